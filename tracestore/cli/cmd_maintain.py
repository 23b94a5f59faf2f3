"""The commands that check and maintain a store: ``verify``, ``gc``, ``compact``, ``export``."""

from __future__ import annotations

import argparse
import json
import sys

from ..cliargs import EXIT_PROBLEMS, UsageError, load_json_arg, positive_float
from .common import human_bytes, json_out, open_store_arg, out, progress

__all__ = ["register"]


def register(add) -> None:
    """Add this module's subcommands through ``add`` (see :func:`tracestore.cli.main.build_parser`)."""
    p = add("verify", "re-read and checksum everything (log entries, metadata, shard indexes, every chunk's "
                      "crc32c); exit 1 on problems",
            examples=["tracestore verify /data/run1 || echo 'problems found'"],
            json="one JSON object: {ok, entries, ..., errors, orphan_segments}")
    p.set_defaults(func=_cmd_verify)

    p = add("gc", "delete uncommitted segments and partial files older than the grace period",
            description="Delete the segments no committed log entry references whose newest object is older than "
                        "the grace period, and old partial files. In a format-version-3 store gc first commits a gc "
                        "entry to the log naming what it deletes, so that no writer commits those segments "
                        "afterwards and none committed them before (FORMAT §6): safe while writers run, whatever "
                        "the delays. Version-1/2 stores have no gc entries: there segments are deleted only with "
                        "--force (when no writer runs).",
            examples=["tracestore gc /data/run1 --dry-run", "tracestore gc s3://bucket/run1 --grace 7200"],
            json="one JSON object: {dry_run, deleted_segments, deleted_objects, deleted_bytes, young_segments, "
                 "gc_entries, committed_meanwhile, kept_segments}")
    p.add_argument("--dry-run", action="store_true", help="only report what would be deleted (commits nothing)")
    p.add_argument("--grace", type=positive_float, default=None, metavar="SECONDS",
                   help="grace period in seconds, > 0 (default: the store's gc_grace_s, 3600); shorter than the "
                        "store's needs --force")
    p.add_argument("--force", action="store_true",
                   help="allow a grace period shorter than the store's gc_grace_s (writers slower than it write "
                        "segments again); in a version-1/2 store, delete segments at all (only when no writer runs)")
    p.set_defaults(func=_cmd_gc)

    p = add("compact", "write a checkpoint of the whole log so that readers open the store with one GET",
            examples=["tracestore compact s3://bucket/run1 --endpoint-url http://host:9000"],
            json="{checkpoint_log_end: N or null}")
    p.set_defaults(func=_cmd_compact)

    p = add("export", "write every committed record, or every committed result, to one Parquet file (for SQL)",
            description="Write one table of a snapshot to one local Parquet file. --table records (default): one "
                        "row per committed record, in log order (seq, writer_id, segment, traj_id, token_start, "
                        "token_stop, row_offset, policy_version, ...); query it instead of index/*.parquet, where "
                        "each checkpoint holds the whole log up to its log_end (reading them all counts records "
                        "more than once). --table results: one row per trajectory whose result is committed "
                        "(traj_id, reward, group_id, advantage, prompt_len, response_len, policy_version, "
                        "finish_reason, extra as JSON text, seq). Both files hold the snapshot in their metadata; "
                        "export both from one --snapshot to join them.",
            examples=["tracestore export s3://bucket/run1 records.parquet",
                      "tracestore export s3://bucket/run1 results.parquet --table results",
                      "duckdb -c \"SELECT policy_version, avg(reward), count(*) FROM 'results.parquet' GROUP BY 1\"",
                      "duckdb -c \"SELECT traj_id, sum(token_stop - token_start) FROM 'records.parquet' GROUP BY 1\""],
            json="one JSON object: {path, table, rows, log_end, snapshot} (records: also records)")
    p.add_argument("out", metavar="OUT.parquet", help="the Parquet file to write (a local path)")
    p.add_argument("--table", choices=("records", "results"), default="records", metavar="TABLE",
                   help="what to write: records (one row per committed token range; the default) or results (one "
                        "row per committed trajectory result)")
    p.add_argument("--snapshot", metavar="JSON", help="export this snapshot (JSON or @file; default: the log head)")
    p.set_defaults(func=_cmd_export)


def _cmd_verify(args: argparse.Namespace) -> int:
    from ..maintenance import verify

    store = open_store_arg(args)
    with progress(args, "verify") as update:
        report = verify(store, progress=update)
    d = report.to_dict()
    if args.json:
        json_out(d)
    else:
        out(f"{'OK' if report.ok else 'FAILED'}: {report.entries:,} log entries, {report.records:,} records, "
             f"{report.segments:,} segments, {report.objects:,} objects, {report.chunks:,} chunks, "
             f"{human_bytes(report.bytes)} checked")
        if report.orphan_segments:
            out(f"{len(report.orphan_segments)} orphaned segments (uncommitted data; `tracestore gc` removes them)")
        if report.partial_objects:
            out(f"{len(report.partial_objects)} partial files (unfinished writes; `tracestore gc` removes them)")
        for e in report.errors:
            out(f"error: {e}")
    if not report.ok:
        sys.stderr.write(f"tracestore verify: {len(report.errors)} problem(s) in {store.url}; first: "
                         f"{report.errors[0]}\n")
        return EXIT_PROBLEMS
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    from ..maintenance import collect_garbage

    store = open_store_arg(args)
    with progress(args, "gc") as update:
        report = collect_garbage(store, grace_s=args.grace, dry_run=args.dry_run, progress=update, force=args.force)
    if args.json:
        json_out(report.to_dict())
        return 0
    verb = "would delete" if report.dry_run else "deleted"
    out(f"{verb} {len(report.deleted_segments)} segments / {report.deleted_objects} objects "
         f"({human_bytes(report.deleted_bytes)}); {len(report.young_segments)} uncommitted segments younger than "
         f"the grace period kept" + (f"; gc entries {report.gc_entries}" if report.gc_entries else ""))
    if report.kept_segments:
        out(f"{len(report.kept_segments)} old uncommitted segments kept: a format-version-{store.format_version} "
            f"store has no gc entries (--force deletes them, only when no writer runs)")
    for s in report.deleted_segments[:20]:
        out(f"  {s}")
    if len(report.deleted_segments) > 20:
        out(f"  ... ({len(report.deleted_segments) - 20} more)")
    return 0


def _cmd_compact(args: argparse.Namespace) -> int:
    from ..maintenance import compact

    store = open_store_arg(args)
    with progress(args, "compact"):  # uncounted: a heartbeat line every 30 s without a terminal
        log_end = compact(store)
    if args.json:
        json_out({"checkpoint_log_end": log_end})
    elif log_end is None:
        out("nothing to do: the log is empty or a checkpoint at its head exists")
    else:
        out(f"wrote a checkpoint of log entries [0, {log_end})")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from ..maintenance import export_table

    store = open_store_arg(args)
    snapshot = load_json_arg(args.snapshot, "--snapshot") if args.snapshot else None
    try:
        with progress(args, "export"):  # uncounted: a heartbeat line every 30 s without a terminal
            done = export_table(store, args.out, None if snapshot is None else json.dumps(snapshot), args.table)
    except OSError as e:
        raise UsageError(f"cannot write {args.out}: {e.strerror or e}") from e
    if args.json:
        json_out(done)
    else:
        out(f"wrote {done['rows']:,} {args.table} of log entries [0, {done['log_end']}) to {done['path']}")
    return 0
