"""``tracestore`` command line: a thin layer over the library (`tracestore.maintenance`, `tracestore.reader`,
`tracestore.bench`).

Subcommands: ``create``, ``info``, ``ls``, ``show``, ``tail``, ``verify``, ``gc``, ``compact``, ``bench``; ``tracestore
<command> --help`` describes each. ``--json`` output is meant for programs (``tail --json`` prints JSON lines).
Exit codes: 0 success, 1 ``verify`` found problems, 2 a tracestore error (one line on stderr; ``--debug`` shows
the traceback) or a usage error, 130 interrupted.

Storage options (S3 endpoints, credentials) come from ``--storage-options JSON`` (or ``@file.json``), else the
environment variable ``TRACESTORE_STORAGE_OPTIONS`` (JSON, applied to non-local URLs only); ``--endpoint-url``
is a shorthand for ``{"client_kwargs": {"endpoint_url": ...}}``. s3fs also reads the usual ``AWS_*`` variables.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence

from ..cliargs import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    EXIT_PROBLEMS,
    UsageError,
    accept_negative_numbers,
    add_debug_argument,
    add_storage_arguments,
    load_json_arg,
    nonneg_float,
    nonneg_int,
    positive_float,
    positive_int,
    storage_options,
)
from ..errors import TraceStoreError

# UsageError and storage_options are imported from here by programs written before tracestore.cliargs
__all__ = ["main", "build_parser", "UsageError", "storage_options"]

log = logging.getLogger("tracestore.cli")

def _open(args: argparse.Namespace):
    from ..store import open_store

    opts = storage_options(args, args.url)
    try:
        return open_store(args.url, storage_options=opts)
    except TypeError as e:  # unknown storage option for this backend (e.g. an S3 option on a local path)
        raise UsageError(f"storage options {sorted(opts or {})} do not apply to {args.url}: {e}") from e


def _out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def _json_out(obj) -> None:
    sys.stdout.write(json.dumps(obj, default=_json_default) + "\n")


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


@contextlib.contextmanager
def _progress(args: argparse.Namespace, description: str) -> Iterator:
    """A rich progress bar on stderr (only when stderr is a terminal and not ``--quiet``); yields a callback
    ``(done, total, what)``."""
    enabled = sys.stderr.isatty() and not getattr(args, "quiet", False)
    if not enabled:
        yield lambda done, total, what="": None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[what]}"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None, what="")

        def update(done: int, total: int, what: str = "") -> None:
            bar.update(task, completed=done, total=total, what=str(what)[-60:])

        yield update


# ---------------------------------------------------------------------------------------------- create
def _sites_from_table(table) -> tuple[list, dict]:
    """A site table: a JSON list of site objects, or an object with ``sites`` and optionally ``model``,
    ``moe_layers``, ``top_k``, ``num_experts``, ``layout`` (a store manifest is accepted as is)."""
    from ..store import Site

    extra: dict = {}
    if isinstance(table, dict):
        sites = table.get("sites")
        for k in ("model", "moe_layers", "top_k", "num_experts"):
            if k in table:
                extra[k] = table[k]
        lay = table.get("layout") or {}
        for k in ("chunk_rows", "shard_bytes", "feature_chunk"):
            if k in lay:
                extra[k] = lay[k]
    else:
        sites = table
    if not isinstance(sites, list) or not sites:
        raise UsageError("site table: expected a non-empty list of sites (or an object with a 'sites' list)")
    try:
        return [Site.from_dict(s) for s in sites], extra
    except (KeyError, TypeError, AttributeError) as e:
        raise UsageError(f"site table: each site needs 'name' and 'width' ({e!r})") from e


def _names(template: str, n: int, option: str) -> list[str]:
    """``template`` formatted with ``i = 0 .. n-1``; one name each (a pattern without ``{i}`` is refused)."""
    try:
        names = [template.format(i=i) for i in range(n)]
    except (KeyError, IndexError, ValueError, AttributeError, TypeError) as e:
        raise UsageError(f"{option} {template!r} is not a name pattern: use {{i}} for the index (e.g. "
                         f"'layers.{{i}}.mlp'); {type(e).__name__}: {e}") from e
    if n > 1 and len(set(names)) != n:
        raise UsageError(f"{option} {template!r} gives the same name twice: it must contain {{i}}")
    return names


def _cmd_create(args: argparse.Namespace) -> int:
    from ..errors import StoreExistsError, StoreNotFoundError
    from ..maintenance import info
    from ..store import Site, create_store, open_store

    if args.site_table:
        sites, extra = _sites_from_table(load_json_arg("@" + args.site_table, "--site-table"))
    elif args.sites:
        sites = [Site(name, args.width, fp4_format=args.fp4_format)
                 for name in _names(args.site_name, args.sites, "--site-name")]
        extra = {}
    else:
        raise UsageError("give --site-table FILE or --sites N [--width W]")
    if args.moe_layers is not None:
        extra["moe_layers"] = _names(args.moe_layer_name, args.moe_layers, "--moe-layer-name")
        extra["top_k"] = args.top_k
        extra["num_experts"] = args.num_experts
    for k in ("chunk_rows", "shard_bytes", "feature_chunk"):
        if getattr(args, k) is not None:
            extra[k] = getattr(args, k)
    if args.model:
        extra["model"] = load_json_arg(args.model, "--model")
    opts = storage_options(args, args.url)
    existed = False
    if args.exist_ok:
        try:
            open_store(args.url, storage_options=opts)
            existed = True
        except StoreNotFoundError:
            pass
    try:
        store = create_store(args.url, sites, storage_options=opts, exist_ok=args.exist_ok, **extra)
    except StoreExistsError as e:
        if not args.exist_ok:
            raise StoreExistsError(f"a tracestore store already exists at {args.url} (pass --exist-ok to open "
                                   f"it when it declares the same sites)") from e
        raise
    except TypeError as e:
        raise UsageError(f"bad store declaration: {e}") from e
    if args.json:
        _json_out({**info(store), "created": not existed})
    else:
        verb = "opened the existing store" if existed else "created"
        _out(f"{verb} {store.url}: {len(store.sites)} sites, {store.payload_bytes_per_token:,} payload bytes/token"
             f", {len(store.moe_layers)} MoE layers (store id {store.store_id})")
    return 0


# ---------------------------------------------------------------------------------------------- info
def _cmd_info(args: argparse.Namespace) -> int:
    from ..maintenance import info

    store = _open(args)
    d = info(store)
    if args.json:
        _json_out(d)
        return 0
    sites = d["sites"]
    kinds: dict[tuple, list] = {}
    for s in sites:
        kinds.setdefault((s["width"], s["fp4_format"], s["block_size"]), []).append(s["name"])
    _out(f"store        {d['url']}")
    _out(f"format       tracestore v{d['format_version']}, store id {d['store_id']}")
    for (w, f, b), names in kinds.items():
        shown = ", ".join(names[:3]) + (f", ... ({len(names)} sites)" if len(names) > 3 else "")
        _out(f"sites        {shown}: width {w} {f} (block {b})")
    _out(f"per token    {d['payload_bytes_per_token']:,} payload bytes (hints + scales), "
         f"{d['trace_bytes_per_token']:,} trace bytes")
    if d["moe_layers"]:
        _out(f"moe          {len(d['moe_layers'])} layers, top-{d['top_k']} of {d['num_experts']} experts")
    if d["model"]:
        _out(f"model        {json.dumps(d['model'])[:200]}")
    lay = d["layout"]
    _out(f"layout       chunk_rows {lay['chunk_rows']}, shard_bytes {_human_bytes(lay['shard_bytes'])}, "
         f"feature_chunk {lay['feature_chunk']}")
    _out(f"log          {d['log_entries']:,} entries, {d['records']:,} records, {d['segments']:,} segments, "
         f"{len(d['writers'])} writers")
    _out(f"content      {d['trajectories']:,} trajectories, {d['tokens']:,} tokens")
    b = d["bytes"]
    _out("bytes        " + ", ".join(f"{k} {_human_bytes(v)}" for k, v in b.items() if v or k == "total"))
    if d["tokens"]:
        _out(f"efficiency   {d['bytes_per_token']:,.1f} stored bytes/token; overhead on payload "
             f"{100 * d['overhead']:.3f}% (index, crc, metadata, log)")
    return 0


# ---------------------------------------------------------------------------------------------- ls / show
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
    store = _open(args)
    reader = _reader(args, store)
    infos = reader.trajectories()
    if args.prefix:
        infos = [i for i in infos if i.traj_id.startswith(args.prefix)]
    if args.limit is not None:
        infos = infos[: args.limit]
    if args.json:
        _json_out({"snapshot": json.loads(reader.snapshot.to_json()), "trajectories": [_traj_dict(i) for i in infos]})
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
        _out("  ".join(c.rjust(w) if k in right else c.ljust(w) for k, (c, w) in enumerate(zip(r, widths))).rstrip())
    _out(f"{len(infos)} trajectories, {sum(i.committed_tokens for i in infos):,} tokens "
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

    store = _open(args)
    reader = _reader(args, store)
    check_id(args.traj_id)
    ti = reader.info(args.traj_id)
    records = [r for e in reader.entries if args.traj_id in e.traj_ids for r in records_of(e)
               if r.traj_id == args.traj_id]
    records.sort(key=lambda r: r.token_start)
    out: dict = {"snapshot": json.loads(reader.snapshot.to_json()), "trajectory": _traj_dict(ti),
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
        tok["token_ids"] = batch.token_ids[:n].tolist()
        tok["logprobs"] = batch.logprobs[:n].tolist()
        tok["policy_version"] = batch.policy_version[:n].tolist()
        tok["experts"] = {k: v[:n].tolist() for k, v in batch.experts.items()}
        out["tokens"] = tok
    if args.json:
        _json_out(out)
        return 0
    _out(f"trajectory {ti.traj_id}: {ti.committed_tokens:,} committed tokens "
         f"({ti.num_tokens:,} contiguous from 0), {ti.num_records} records, policy versions "
         f"{_span(ti.policy_versions)}, writers {', '.join(ti.writers)}")
    _out("ranges     " + " ".join(f"[{a}, {b})" for a, b in ti.ranges))
    _out(f"{'tokens':>17}  {'seq':>6}  {'idx':>4}  {'rows':>13}  {'policy':>6}  writer / segment")
    for r in records:
        _out(f"{f'[{r.token_start}, {r.token_stop})':>17}  {r.seq:>6}  {r.index:>4}  "
             f"{f'{r.row_offset}+{r.num_tokens}':>13}  {r.policy_version:>6}  {r.segment.path}")
    if "tokens" in out:
        tok = out["tokens"]
        n = tok["rows_shown"]
        _out(f"tokens [{tok['start']}, {tok['stop']}), first {n} rows:")
        for k in range(n):
            pos = tok["start"] + k
            ex = ""
            if tok["experts"]:
                first = next(iter(tok["experts"]))
                ex = f"  experts[{first}] {tok['experts'][first][k]}"
                if len(tok["experts"]) > 1:
                    ex += f" (+{len(tok['experts']) - 1} layers)"
            _out(f"  {pos:>8}  token {tok['token_ids'][k]:>7}  logprob {tok['logprobs'][k]:+.4f}  "
                 f"policy {tok['policy_version'][k]}{ex}")
        for name, d in tok["sites"].items():
            _out(f"  site {name}")
            for k in range(n):
                _out(f"  {tok['start'] + k:>8}  hints {d['hints'][k]}")
                _out(f"  {'':>8}  scales {d['scales'][k]}")
    return 0


# ---------------------------------------------------------------------------------------------- tail
def _cmd_tail(args: argparse.Namespace) -> int:
    store = _open(args)
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
                _json_out(_record_dict(rec, stream.cursor))
            elif rec.kind == "result":
                age = time.time() - rec.created_unix
                _out(f"{rec.seq:>6}/{rec.index:<3} {rec.traj_id} complete: reward {rec.result.reward:g}  "
                     f"policy {rec.result.policy_version}  {rec.result.finish_reason or '-'}  writer {rec.writer_id}  "
                     f"(committed {age:.2f} s ago)")
            else:
                age = time.time() - rec.created_unix
                _out(f"{rec.seq:>6}/{rec.index:<3} {rec.traj_id} [{rec.token_start}, {rec.token_stop}) "
                     f"{rec.num_tokens} tokens  policy {rec.policy_version}  writer {rec.writer_id}  "
                     f"(committed {age:.2f} s ago)")
            sys.stdout.flush()
            if args.max_records is not None and n >= args.max_records:
                break
    except KeyboardInterrupt:
        pass
    finally:
        if args.json:
            _json_out({"cursor": stream.cursor, "records": n})
        else:
            _out(f"cursor {stream.cursor}")
        sys.stdout.flush()
    return 0


# ---------------------------------------------------------------------------------------------- verify / gc
def _cmd_verify(args: argparse.Namespace) -> int:
    from ..maintenance import verify

    store = _open(args)
    with _progress(args, "verify") as update:
        report = verify(store, progress=update)
    d = report.to_dict()
    if args.json:
        _json_out(d)
    else:
        _out(f"{'OK' if report.ok else 'FAILED'}: {report.entries:,} log entries, {report.records:,} records, "
             f"{report.segments:,} segments, {report.objects:,} objects, {report.chunks:,} chunks, "
             f"{_human_bytes(report.bytes)} checked")
        if report.orphan_segments:
            _out(f"{len(report.orphan_segments)} orphaned segments (uncommitted data; `tracestore gc` removes them)")
        if report.partial_objects:
            _out(f"{len(report.partial_objects)} partial files (unfinished writes; `tracestore gc` removes them)")
        for e in report.errors:
            _out(f"error: {e}")
    if not report.ok:
        sys.stderr.write(f"tracestore verify: {len(report.errors)} problem(s) in {store.url}; first: "
                         f"{report.errors[0]}\n")
        return EXIT_PROBLEMS
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from ..maintenance import collect_garbage

    store = _open(args)
    with _progress(args, "gc") as update:
        report = collect_garbage(store, grace_s=args.grace, dry_run=args.dry_run, progress=update, force=args.force)
    if args.json:
        _json_out(report.to_dict())
        return 0
    verb = "would delete" if report.dry_run else "deleted"
    _out(f"{verb} {len(report.deleted_segments)} segments / {report.deleted_objects} objects "
         f"({_human_bytes(report.deleted_bytes)}); {len(report.young_segments)} uncommitted segments younger than "
         f"the grace period kept")
    for s in report.deleted_segments[:20]:
        _out(f"  {s}")
    if len(report.deleted_segments) > 20:
        _out(f"  ... ({len(report.deleted_segments) - 20} more)")
    return 0


def _cmd_compact(args: argparse.Namespace) -> int:
    from ..maintenance import compact

    store = _open(args)
    log_end = compact(store)
    if args.json:
        _json_out({"checkpoint_log_end": log_end})
    elif log_end is None:
        _out("nothing to do: the log is empty or a checkpoint at its head exists")
    else:
        _out(f"wrote a checkpoint of log entries [0, {log_end})")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..maintenance import export_records

    store = _open(args)
    snapshot = load_json_arg(args.snapshot, "--snapshot") if args.snapshot else None
    try:
        out = export_records(store, args.out, None if snapshot is None else json.dumps(snapshot))
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from e
    if args.json:
        _json_out(out)
    else:
        _out(f"wrote {out['records']:,} records of log entries [0, {out['log_end']}) to {out['path']}")
    return 0


# ---------------------------------------------------------------------------------------------- bench
def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import config_from_args, run_bench, summary_rows, to_json

    s3_options = load_json_arg(args.storage_options, "--storage-options") if args.storage_options else None
    cfg = config_from_args(args, s3_options)
    with _progress(args, "bench") as update:
        result = run_bench(cfg, progress=lambda phase, done, total: update(done, total, phase))
    text = to_json(result)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        _json_out(result)
    else:
        rows = summary_rows(result)
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        for name, value, goal in rows:
            _out(f"{name:<{w0}}  {value:>{w1}}  {goal}".rstrip())
    return 0


# ---------------------------------------------------------------------------------------------- parser
def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    add_storage_arguments(g)
    g.add_argument("-v", "--verbose", action="store_true", help="info logging on stderr")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    common = _common()
    parser = argparse.ArgumentParser(
        prog="tracestore",
        description="Inspect, verify, maintain and benchmark tracestore stores (FP4 rollout hints, TRACE). "
                    "A store is a URL: a local directory, s3://bucket/prefix, ...",
        epilog="Exit codes: 0 ok, 1 verify found problems, 2 error (one line on stderr; --debug for a traceback).")
    parser.add_argument("--version", action="version", version=f"tracestore {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="run `tracestore COMMAND --help`")
    parser.subcommands = sub.choices

    def add(name: str, help_: str, description: str | None = None) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=description or help_, parents=[common])

    p = add("create", "create a store from a site table (JSON) or --sites N --width W")
    p.add_argument("url", help="store URL")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--site-table", metavar="FILE", help="JSON: a list of sites {name, width, [kind, fp4_format, "
                     "block_size]} or an object with 'sites' (+ model, moe_layers, top_k, num_experts, layout)")
    src.add_argument("--sites", type=positive_int, metavar="N", help="N sites of --width values each")
    p.add_argument("--width", type=positive_int, default=2048, help="values per site with --sites (default 2048)")
    p.add_argument("--fp4-format", choices=("nvfp4", "mxfp4"), default="nvfp4",
                   help="FP4 format of every site with --sites: nvfp4 (blocks of 16, E4M3 scales) or mxfp4 "
                        "(blocks of 32, E8M0 scales); default nvfp4")
    p.add_argument("--site-name", default="layers.{i}.moe_in",
                   help="site name pattern with --sites; {i} is replaced by 0..N-1 (default layers.{i}.moe_in)")
    p.add_argument("--moe-layers", type=positive_int, metavar="L", help="declare L MoE layers (routed-expert trace)")
    p.add_argument("--moe-layer-name", default="layers.{i}.mlp",
                   help="MoE layer name pattern with --moe-layers; {i} is replaced by 0..L-1 (default layers.{i}.mlp)")
    p.add_argument("--top-k", type=positive_int, default=8,
                   help="routed experts per token and MoE layer, with --moe-layers (default 8)")
    p.add_argument("--num-experts", type=positive_int, default=256,
                   help="experts per MoE layer, with --moe-layers (default 256; ids stored as uint8 up to 256)")
    p.add_argument("--chunk-rows", type=positive_int, help="rows per inner chunk (store default 1024)")
    p.add_argument("--shard-bytes", type=positive_int, help="target bytes per shard object (store default 16 MiB)")
    p.add_argument("--feature-chunk", type=nonneg_int, help="values per column chunk (tensor-parallel slicing)")
    p.add_argument("--model", metavar="JSON", help="free-form model metadata (JSON or @file.json)")
    p.add_argument("--exist-ok", action="store_true", help="open an existing store with the same declaration")
    p.add_argument("--json", action="store_true", help="print the new store's info as JSON")
    p.set_defaults(func=_cmd_create)

    p = add("info", "summary: sites, layout, log, trajectories, stored bytes by category and per token")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(func=_cmd_info)

    p = add("ls", "list trajectories: committed tokens, records, policy versions, writers")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("--prefix", help="only trajectory ids starting with this")
    p.add_argument("--limit", type=positive_int, help="at most this many trajectories")
    p.add_argument("--snapshot", metavar="JSON", help="pin a snapshot (JSON or @file) instead of the log head")
    p.add_argument("--json", action="store_true",
                   help="one JSON object: {snapshot, trajectories: [...]}")
    p.set_defaults(func=_cmd_ls)

    p = add("show", "one trajectory: records (token ranges, segments); with --tokens/--site the first rows of "
                    "hints, scales and the trace")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("traj_id", help="trajectory id")
    p.add_argument("--tokens", metavar="A:B", help="read tokens [A, B) (A: = to the end of the contiguous run)")
    p.add_argument("--site", action="append", metavar="NAME", help="site(s) to show (repeatable; default all)")
    p.add_argument("--rows", type=nonneg_int, default=4, help="rows to print (0 = all of --tokens; default 4)")
    p.add_argument("--full", action="store_true", help="print whole hint/scale rows (default: first 24 bytes)")
    p.add_argument("--snapshot", metavar="JSON", help="pin a snapshot (JSON or @file)")
    p.add_argument("--json", action="store_true", help="one JSON object: {records, rows: {...}}")
    p.set_defaults(func=_cmd_show)

    p = add("tail", "follow the commit log and print records as they commit; prints the resume cursor at the end",
            "Follow the commit log from --cursor (default: the current head, i.e. only new commits; --from-start: "
            "from the first entry) and print every record as it commits. Ends after --timeout seconds without a "
            "new record, after --max-records, or on Ctrl-C, and then prints the cursor to resume from.")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("--cursor", help="resume position v1:<store_id>:<seq>:<index> (printed by a previous tail)")
    p.add_argument("--from-start", action="store_true", help="start at log entry 0")
    p.add_argument("--timeout", type=nonneg_float, default=None, help="stop after this many seconds without a new record")
    p.add_argument("--max-records", type=positive_int, default=None, help="stop after this many records")
    p.add_argument("--poll", type=positive_float, default=0.05, help="poll interval in seconds (default 0.05)")
    p.add_argument("--json", action="store_true", help="JSON lines: one per record (with the cursor after it), "
                   "then {cursor, records}")
    p.set_defaults(func=_cmd_tail)

    p = add("verify", "re-read and checksum everything (log entries, metadata, shard indexes, every chunk's "
                      "crc32c); exit 1 on problems")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("--json", action="store_true", help="one JSON object: {ok, entries, ..., errors, orphan_segments}")
    p.set_defaults(func=_cmd_verify)

    p = add("gc", "delete uncommitted segments and partial files older than the grace period")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    p.add_argument("--grace", type=positive_float, default=None, metavar="SECONDS",
                   help="grace period in seconds, > 0 (default: the store's gc_grace_s, 3600); shorter than the "
                        "store's needs --force")
    p.add_argument("--force", action="store_true",
                   help="allow a grace period shorter than the store's gc_grace_s (only when no writer is running)")
    p.add_argument("--json", action="store_true", help="one JSON object: {dry_run, deleted_segments, ...}")
    p.set_defaults(func=_cmd_gc)

    p = add("compact", "write a checkpoint of the whole log so that readers open the store with one GET")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("--json", action="store_true", help="{checkpoint_log_end: N or null}")
    p.set_defaults(func=_cmd_compact)

    p = add("export", "write every committed record to one Parquet file (for SQL engines)",
            "Write every committed record (one row per record, in log order: seq, writer_id, segment, traj_id, "
            "token_start, token_stop, row_offset, policy_version, ...) to one local Parquet file. Query it instead "
            "of index/*.parquet: each checkpoint holds the whole log up to its log_end, so reading them all counts "
            "records more than once.")
    p.add_argument("url", help=URL_HELP)
    p.add_argument("out", help="the Parquet file to write (a local path)")
    p.add_argument("--snapshot", metavar="JSON", help="export this snapshot (JSON or @file) instead of the log head")
    p.add_argument("--json", action="store_true", help="one JSON object: {path, records, log_end, snapshot}")
    p.set_defaults(func=_cmd_export)

    from .bench import add_arguments

    p = add("bench", "benchmark: bytes/token, write/read throughput vs plain files and plain S3, tail latency",
            "Benchmark the store against plain files (local) and plain s3fs (moto server started on 127.0.0.1 "
            "unless --s3-endpoint): bytes per token by category, write/read ratios (page cache; fsync'd / cold), "
            "tail latency. Defaults: the Qwen3.5-35B-A3B table (20 sites x 2048 NVFP4 values, 40 MoE layers, "
            "top-8 of 256 experts). --storage-options apply to --s3-endpoint.")
    add_arguments(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_bench)
    add_debug_argument(parser)
    accept_negative_numbers(parser)
    return parser


URL_HELP = "store URL: a local directory, s3://bucket/prefix, or another fsspec URL"


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script passes it to ``sys.exit``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # report it with the subcommand's usage, not the top-level one
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return int(args.func(args) or 0)
    except (TraceStoreError, UsageError) as e:
        if args.debug:
            raise
        kind = "" if isinstance(e, UsageError) else f"{type(e).__name__}: "
        sys.stderr.write(f"tracestore {args.command}: error: {kind}{_one_line(e)}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `tracestore ls | head`
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
