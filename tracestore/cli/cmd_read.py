"""The commands that read a store: ``info`` (summary and bytes), ``ls`` (trajectories), ``show`` (one trajectory's
records and rows), ``tail`` (follow the log)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from ..cliargs import UsageError, nonneg_float, nonneg_int, positive_float, positive_int
from .common import human_bytes, json_out, open_store_arg, out

__all__ = ["register"]


def register(add) -> None:
    """Add this module's subcommands through ``add`` (see :func:`tracestore.cli.main.build_parser`)."""
    p = add("info", "summary: sites, layout, log, trajectories, stored bytes by category and per token",
            examples=["tracestore info /data/run1", "tracestore info s3://bucket/run1 --json | jq .bytes"],
            json="print the summary as one JSON object")
    p.set_defaults(func=_cmd_info)

    p = add("ls", "list trajectories: committed tokens, records, policy versions, writers",
            examples=["tracestore ls /data/run1 --prefix prompt-7 --limit 20"],
            json="one JSON object: {snapshot, trajectories: [...]}")
    p.add_argument("--prefix", metavar="P", help="only trajectory ids starting with P (default: all)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="at most N trajectories (default: all)")
    p.add_argument("--snapshot", metavar="JSON", help="pin a snapshot (JSON or @file; default: the log head)")
    p.set_defaults(func=_cmd_ls)

    p = add("show", "one trajectory: records (token ranges, segments); with --tokens/--site the first rows of "
                    "hints, scales and the trace",
            examples=["tracestore show /data/run1 traj-0", "tracestore show /data/run1 traj-0 --tokens 0:8 --rows 0"],
            json="one JSON object: {records, rows: {...}}")
    p.add_argument("traj_id", metavar="TRAJ", help="trajectory id")
    p.add_argument("--tokens", metavar="A:B",
                   help="read tokens [A, B) (A: = to the end of the contiguous run; --site without it reads 0:)")
    p.add_argument("--site", action="append", metavar="NAME", help="site(s) to show (repeatable; default all)")
    p.add_argument("--rows", type=nonneg_int, default=4, metavar="N",
                   help="rows to print (0 = all of --tokens; default 4)")
    p.add_argument("--full", action="store_true", help="print whole hint/scale rows (default: first 24 bytes)")
    p.add_argument("--snapshot", metavar="JSON", help="pin a snapshot (JSON or @file; default: the log head)")
    p.set_defaults(func=_cmd_show)

    p = add("tail", "follow the commit log and print records as they commit; prints the resume cursor at the end",
            description="Follow the commit log from --cursor (default: the current head, i.e. only new commits; "
                        "--from-start: from the first entry) and print every record as it commits. Ends after "
                        "--timeout seconds without a new record, after --max-records, or on Ctrl-C, and then prints "
                        "the cursor to resume from.",
            examples=["tracestore tail s3://bucket/run1 --json --timeout 60 > new.jsonl",
                      'tracestore tail s3://bucket/run1 --json --cursor "$(tail -1 new.jsonl | jq -r .cursor)"'],
            json="JSON lines: one per record (with the cursor after it), then {cursor, records}")
    p.add_argument("--cursor", metavar="C",
                   help="resume position v1:<store_id>:<seq>:<index> (printed by a previous tail; default: the head)")
    p.add_argument("--from-start", action="store_true", help="start at log entry 0")
    p.add_argument("--timeout", type=nonneg_float, default=None, metavar="S",
                   help="stop after S seconds without a new record (default: never)")
    p.add_argument("--max-records", type=positive_int, default=None, metavar="N",
                   help="stop after N records (default: no limit)")
    p.add_argument("--poll", type=positive_float, default=0.05, metavar="S",
                   help="poll interval in seconds (default 0.05)")
    p.set_defaults(func=_cmd_tail)


def _cmd_info(args: argparse.Namespace) -> int:
    from ..maintenance import info

    store = open_store_arg(args)
    d = info(store)
    if args.json:
        json_out(d)
        return 0
    sites = d["sites"]
    kinds: dict[tuple, list] = {}
    for s in sites:
        enc = s["scale_encoding"] if s.get("hint_encoding", "bits") == "bits" else (
            f"margin rows ({s['value_coding']}/{s['block_coding']}, margin {s['margin']}/{s['scale_margin']}, "
            f"scale payload {s['scale_payload']})")
        kinds.setdefault((s["width"], s["fp4_format"], s["block_size"], enc), []).append(s["name"])
    out(f"store        {d['url']}")
    out(f"format       tracestore v{d['format_version']}, store id {d['store_id']}")
    for (w, f, b, enc), names in kinds.items():
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} sites)" if len(names) > 3 else "")
        scales = (f"scales: bytes, {w // b} B/token" if enc == "bytes" else
                  f"scales: lsb (scale hints), {-(-w // (8 * b))} B/token" if enc == "lsb" else enc)
        out(f"sites        {shown}: width {w} {f} (block {b}), {scales}")
    out(f"per token    {d['payload_bytes_per_token']:,} payload bytes (hints + scales), "
         f"{d['trace_bytes_per_token']:,} trace bytes")
    if d["moe_layers"]:
        out(f"moe          {len(d['moe_layers'])} layers, top-{d['top_k']} of {d['num_experts']} experts")
    if d["model"]:
        out(f"model        {json.dumps(d['model'])[:200]}")
    lay = d["layout"]
    out(f"layout       chunk_rows {lay['chunk_rows']}, shard_bytes {human_bytes(lay['shard_bytes'])}, "
         f"feature_chunk {lay['feature_chunk']}")
    out(f"log          {d['log_entries']:,} entries, {d['records']:,} records, {d['segments']:,} segments, "
         f"{len(d['writers'])} writers")
    out(f"content      {d['trajectories']:,} trajectories, {d['tokens']:,} tokens")
    b = d["bytes"]
    out("bytes        " + ", ".join(f"{k} {human_bytes(v)}" for k, v in b.items() if v or k == "total"))
    if d["tokens"]:
        out(f"efficiency   {d['bytes_per_token']:,.1f} stored bytes/token; overhead on payload "
             f"{100 * d['overhead']:.3f}% (index, crc, metadata, log)")
    return 0


def _reader(args: argparse.Namespace, store):
    snap = None
    if getattr(args, "snapshot", None):
        snap = args.snapshot[1:] if args.snapshot.startswith("@") else args.snapshot
        if args.snapshot.startswith("@"):
            try:
                with open(snap, encoding="utf-8") as f:
                    snap = f.read()
            except OSError as e:
                raise UsageError(f"--snapshot: cannot read {snap!r}: {e.strerror}") from e
    return store.reader(snap)


def _traj_dict(i) -> dict:
    return {"traj_id": i.traj_id, "num_tokens": i.num_tokens, "committed_tokens": i.committed_tokens,
            "ranges": [list(r) for r in i.ranges], "num_records": i.num_records,
            "policy_versions": list(i.policy_versions), "writers": list(i.writers), "first_seq": i.first_seq,
            "last_seq": i.last_seq, "complete": i.complete,
            "result": i.result.to_json() if i.result is not None else None}


def _span(values: Sequence[int]) -> str:
    if not values:
        return "-"
    return str(values[0]) if len(values) == 1 else f"{min(values)}..{max(values)} ({len(values)})"


def _cmd_ls(args: argparse.Namespace) -> int:
    store = open_store_arg(args)
    reader = _reader(args, store)
    infos = reader.trajectories()
    if args.prefix:
        infos = [i for i in infos if i.traj_id.startswith(args.prefix)]
    if args.limit is not None:
        infos = infos[: args.limit]
    if args.json:
        json_out({"snapshot": json.loads(reader.snapshot.to_json()), "trajectories": [_traj_dict(i) for i in infos]})
        return 0
    header = ("trajectory", "tokens", "committed", "records", "reward", "policy", "writers", "ranges")
    rows = [(i.traj_id, f"{i.num_tokens:,}", f"{i.committed_tokens:,}", str(i.num_records),
             f"{i.result.reward:g}" if i.result is not None else "-", _span(i.policy_versions),
             ",".join(i.writers) if len(i.writers) <= 2 else f"{i.writers[0]},... ({len(i.writers)})",
             " ".join(f"[{a},{b})" for a, b in i.ranges[:3]) + (" ..." if len(i.ranges) > 3 else ""))
            for i in infos]
    widths = [max(len(h), *(len(r[k]) for r in rows)) if rows else len(h) for k, h in enumerate(header)]
    right = {1, 2, 3, 4}
    for r in [header, *rows]:
        out("  ".join(c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip())
    out(f"{len(infos)} trajectories, {sum(i.committed_tokens for i in infos):,} tokens "
         f"(snapshot log_end {reader.snapshot.log_end})")
    return 0


def _parse_tokens(text: str) -> tuple[int, int | None]:
    try:
        a, _, b = text.partition(":")
        start = int(a) if a else 0
        stop = int(b) if b else None
    except ValueError as e:
        raise UsageError(f"--tokens must be A:B (or A: / :B), got {text!r}") from e
    if start < 0 or (stop is not None and stop <= start):
        raise UsageError(f"--tokens A:B needs 0 <= A < B, got {text!r}")
    return start, stop


def _hex(row, limit: int | None) -> str:
    b = bytes(row)
    if limit is not None and len(b) > limit:
        return b[:limit].hex() + f"... ({len(b)} B)"
    return b.hex()


def _record_dict(r, cursor: str | None = None) -> dict:
    if r.kind == "result":
        d = {"kind": "result", "seq": r.seq, "index": r.index, "traj_id": r.traj_id, "writer_id": r.writer_id,
             "created_unix": r.created_unix, "result": r.result.to_json()}
    else:
        d = {"kind": "record", "seq": r.seq, "index": r.index, "traj_id": r.traj_id, "token_start": r.token_start,
             "token_stop": r.token_stop, "num_tokens": r.num_tokens, "policy_version": r.policy_version,
             "writer_id": r.writer_id, "segment": r.segment.path, "row_offset": r.row_offset,
             "created_unix": r.created_unix}
    if cursor is not None:
        d["cursor"] = cursor
    return d


def _cmd_show(args: argparse.Namespace) -> int:
    from ..format.keys import check_id
    from ..records import records_of

    store = open_store_arg(args)
    reader = _reader(args, store)
    check_id(args.traj_id)
    ti = reader.info(args.traj_id)
    records = [r for e in reader.entries if args.traj_id in e.traj_ids for r in records_of(e)
               if r.traj_id == args.traj_id]
    records.sort(key=lambda r: r.token_start)
    shown: dict = {"snapshot": json.loads(reader.snapshot.to_json()), "trajectory": _traj_dict(ti),
                 "records": [_record_dict(r) for r in records]}
    if args.tokens or args.site:
        start, stop = _parse_tokens(args.tokens or "0:")
        batch = reader.read(args.traj_id, start, stop, sites=args.site or None)
        n = len(batch) if args.rows == 0 else min(args.rows, len(batch))
        limit = None if (args.full or args.json) else 24
        tok: dict = {"start": batch.start, "stop": batch.stop, "rows_shown": n, "sites": {}}
        for name in batch.hints:
            tok["sites"][name] = {"hints": [_hex(x, limit) for x in batch.hints[name][:n]],
                                  "scales": [_hex(x, limit) for x in batch.scales[name][:n]]}
        for name, mrows in batch.rows.items():  # margin sites (FORMAT §2.5): one variable-length row per token
            tok["sites"][name] = {"margin_rows": [_hex(mrows.row(t), limit)
                                                  for t in range(n)]}
        tok["token_ids"] = batch.token_ids[:n].tolist()
        tok["logprobs"] = batch.logprobs[:n].tolist()
        tok["policy_version"] = batch.policy_version[:n].tolist()
        tok["experts"] = {k: v[:n].tolist() for k, v in batch.experts.items()}
        shown["tokens"] = tok
    if args.json:
        json_out(shown)
        return 0
    out(f"trajectory {ti.traj_id}: {ti.committed_tokens:,} committed tokens "
         f"({ti.num_tokens:,} contiguous from 0), {ti.num_records} records, policy versions "
         f"{_span(ti.policy_versions)}, writers {', '.join(ti.writers)}")
    out("ranges     " + " ".join(f"[{a}, {b})" for a, b in ti.ranges))
    out(f"{'tokens':>17}  {'seq':>6}  {'idx':>4}  {'rows':>13}  {'policy':>6}  writer / segment")
    for r in records:
        out(f"{f'[{r.token_start}, {r.token_stop})':>17}  {r.seq:>6}  {r.index:>4}  "
             f"{f'{r.row_offset}+{r.num_tokens}':>13}  {r.policy_version:>6}  {r.segment.path}")
    if "tokens" in shown:
        tok = shown["tokens"]
        n = tok["rows_shown"]
        out(f"tokens [{tok['start']}, {tok['stop']}), first {n} rows:")
        for k in range(n):
            pos = tok["start"] + k
            ex = ""
            if tok["experts"]:
                first = next(iter(tok["experts"]))
                ex = f"  experts[{first}] {tok['experts'][first][k]}"
                if len(tok["experts"]) > 1:
                    ex += f" (+{len(tok['experts']) - 1} layers)"
            out(f"  {pos:>8}  token {tok['token_ids'][k]:>7}  logprob {tok['logprobs'][k]:+.4f}  "
                 f"policy {tok['policy_version'][k]}{ex}")
        for name, d in tok["sites"].items():
            out(f"  site {name}")
            for k in range(n):
                out(f"  {tok['start'] + k:>8}  hints {d['hints'][k]}")
                out(f"  {'':>8}  scales {d['scales'][k]}")
    return 0


def _cmd_tail(args: argparse.Namespace) -> int:
    store = open_store_arg(args)
    if args.cursor and args.from_start:
        raise UsageError("give --cursor or --from-start, not both")
    cursor = args.cursor
    if cursor is None and not args.from_start:
        cursor = store.snapshot().to_cursor()  # follow new commits only
    stream = store.stream(cursor, poll_interval_s=args.poll, timeout_s=args.timeout)
    n = 0
    try:
        if args.max_records == 0:
            return 0
        for rec in stream:
            n += 1
            if args.json:
                json_out(_record_dict(rec, stream.cursor))
            elif rec.kind == "result":
                age = time.time() - rec.created_unix
                out(f"{rec.seq:>6}/{rec.index:<3} {rec.traj_id} complete: reward {rec.result.reward:g}  "
                     f"policy {rec.result.policy_version}  {rec.result.finish_reason or '-'}  writer {rec.writer_id}  "
                     f"(committed {age:.2f} s ago)")
            else:
                age = time.time() - rec.created_unix
                out(f"{rec.seq:>6}/{rec.index:<3} {rec.traj_id} [{rec.token_start}, {rec.token_stop}) "
                     f"{rec.num_tokens} tokens  policy {rec.policy_version}  writer {rec.writer_id}  "
                     f"(committed {age:.2f} s ago)")
            sys.stdout.flush()
            if args.max_records is not None and n >= args.max_records:
                break
    except KeyboardInterrupt:
        pass
    finally:
        if args.json:
            json_out({"cursor": stream.cursor, "records": n})
        else:
            out(f"cursor {stream.cursor}")
        sys.stdout.flush()
    return 0
