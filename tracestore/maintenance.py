"""Store maintenance: ``info`` (summary and byte accounting), ``verify`` (re-read and check everything) and
``collect_garbage`` (remove data no committed log entry references). The CLI calls these.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .format.keys import (
    DATA_PREFIX,
    INDEX_PREFIX,
    LOG_PREFIX,
    MANIFEST_KEY,
    checkpoint_key,
    is_store_key,
    log_key,
    parse_checkpoint_key,
    parse_log_key,
)
from .storage import PARTIAL_SUFFIX
from .format.entries import LogEntry, decode_checkpoint, records_table, same_entry
from .format.segment import array_metadata, crc32c, layout
from .errors import (
    GcRefusedError,
    IntegrityError,
    ObjectNotFoundError,
    OptionError,
    SchemaVersionError,
    TraceStoreError,
)

__all__ = ["info", "verify", "collect_garbage", "compact", "export_table", "export_records", "export_results",
           "VerifyReport", "GcReport"]

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]  # (done, total, what)


def _segment_of(key: str) -> str | None:
    """``data/<writer>/<segment>/...`` -> ``data/<writer>/<segment>``; None for keys outside that shape."""
    parts = key.split("/")
    if len(parts) < 4 or parts[0] + "/" != DATA_PREFIX:
        return None
    return "/".join(parts[:3])


def _store_objects(store) -> list:
    """One listing of the store's own objects (FORMAT §2): what an application keeps in other areas of the URL is
    left out, so that no maintenance reads, changes or deletes it."""
    return [o for o in store.backend.list("") if is_store_key(o.key)]


def _listed_log(objects) -> list[int]:
    """Positions of the log entries in a listing, ascending."""
    return sorted(n for o in objects if (n := parse_log_key(o.key)) is not None)


def _holes(listed: list[int]) -> list[int]:
    """Positions missing below the last listed entry (entries are dense: each is a hole, FORMAT §7)."""
    have = set(listed)
    return [n for n in range(listed[-1] + 1) if n not in have] if listed else []


def _all_entries(store, errors: list[str] | None = None, objects=None) -> list[LogEntry]:
    """Every committed entry. With ``errors`` (verify): problems are appended there, unreadable or missing entries
    skipped; without: the first problem raises. ``objects`` (a listing made before) also reveals holes that
    existence probes could step over."""
    listed = _listed_log(objects) if objects is not None else []
    holes = _holes(listed)
    if holes and errors is None:
        raise IntegrityError(
            f"{store.url}: log entries {[log_key(n) for n in holes[:5]]} are missing below the log head "
            f"({listed[-1] + 1} entries): holes in the log (FORMAT §7)")
    try:
        head = store.head()
    except IntegrityError as e:
        if errors is None:
            raise
        errors.append(str(e))
        head = 0
    head = max(head, listed[-1] + 1 if listed else 0)
    if errors is None:
        return store.read_entries(0, head)
    out = []
    for seq in range(head):
        if seq in holes:
            errors.append(f"log entry {store.url}/{log_key(seq)} is missing below the log head ({head} entries): "
                          f"a hole in the log (FORMAT §7)")
            continue
        try:
            out.append(store.read_entry(seq, cached=False))
        except ObjectNotFoundError:
            errors.append(f"log entry {store.url}/{log_key(seq)} is missing below the log head ({head} entries)")
        except (IntegrityError, SchemaVersionError) as e:
            errors.append(f"log entry {seq}: {e}")
    return out


def info(store) -> dict:
    """A JSON-able summary: declaration, log and trajectory counts, and stored bytes by category.

    ``bytes``: ``payload`` (hint + scale shards), ``trace`` (token ids, log-probs, experts shards),
    ``zarr_metadata`` (zarr.json objects), ``log`` (log entries), ``checkpoints`` (``index/``), ``manifest``, ``orphan`` (data of no committed
    entry), ``partial`` (unfinished temporary files), ``total``. ``payload_logical_bytes`` = committed tokens x
    hint+scale bytes per token; ``overhead`` = everything stored except orphans and trace, over that.
    """
    objects = _store_objects(store)
    entries = _all_entries(store, objects=objects)
    referenced = {e.segment.path for e in entries if e.segment is not None}
    cats = dict.fromkeys(("payload", "trace", "zarr_metadata", "log", "checkpoints", "manifest", "orphan", "partial",
                          "other"), 0)
    for o in objects:
        name = o.key.rsplit("/", 1)[-1]
        seg = _segment_of(o.key)
        if name.endswith(PARTIAL_SUFFIX):
            cats["partial"] += o.size
        elif o.key == MANIFEST_KEY:
            cats["manifest"] += o.size
        elif o.key.startswith(LOG_PREFIX):
            cats["log" if parse_log_key(o.key) is not None else "other"] += o.size
        elif o.key.startswith(INDEX_PREFIX):
            cats["checkpoints" if parse_checkpoint_key(o.key) is not None else "other"] += o.size
        elif seg is not None and seg not in referenced:
            cats["orphan"] += o.size
        elif seg is not None and name == "zarr.json":
            cats["zarr_metadata"] += o.size
        elif seg is not None:
            array = o.key.split("/")[3]
            cats["payload" if array.startswith(("hints.", "scales.")) else "trace"] += o.size
        else:
            cats["other"] += o.size
    cats["total"] = sum(o.size for o in objects)
    tokens = sum(int((e.token_stop - e.token_start).sum()) for e in entries)
    trajs = {t for e in entries for t in e.traj_ids}
    logical = tokens * store.payload_bytes_per_token
    stored_useful = cats["total"] - cats["orphan"] - cats["partial"] - cats["other"]
    return {
        "url": store.url,
        "format_version": store.format_version,
        "store_id": store.store_id,
        "sites": [s.to_dict() for s in store.sites.values()],
        "model": store.model,
        "moe_layers": list(store.moe_layers),
        "top_k": store.top_k,
        "num_experts": store.num_experts,
        "layout": {"chunk_rows": store.chunk_rows, "shard_bytes": store.shard_bytes,
                   "feature_chunk": store.feature_chunk},
        "log_entries": len(entries),
        "records": sum(len(e) for e in entries),
        "results": sum(len(e.results) for e in entries),
        "segments": len(referenced),
        "trajectories": len(trajs),
        "tokens": tokens,
        "writers": sorted({e.writer_id for e in entries}),
        "objects": len(objects),
        "bytes": cats,
        "payload_bytes_per_token": store.payload_bytes_per_token,
        "trace_bytes_per_token": store.trace_bytes_per_token,
        "payload_logical_bytes": logical,
        "bytes_per_token": (stored_useful / tokens) if tokens else None,
        "overhead": ((stored_useful - cats["trace"]) / logical - 1.0) if logical else None,
    }


@dataclass
class VerifyReport:
    """Outcome of :func:`verify`; ``ok`` iff ``errors`` is empty."""

    entries: int = 0  # log entries read
    records: int = 0  # token ranges they commit
    segments: int = 0  # segments checked
    objects: int = 0  # zarr.json and shard objects read
    chunks: int = 0  # inner chunks whose crc32c was checked
    bytes: int = 0  # shard bytes read
    results: int = 0  # trajectories with a committed result
    errors: list[str] = field(default_factory=list)  # every problem, the object named
    orphan_segments: list[str] = field(default_factory=list)  # segments no entry references (gc collects them)
    partial_objects: list[str] = field(default_factory=list)  # temporary files of unfinished writes

    @property
    def ok(self) -> bool:
        return not self.errors

    def to_dict(self) -> dict:
        return {"ok": self.ok, "entries": self.entries, "records": self.records, "results": self.results,
                "segments": self.segments,
                "objects": self.objects, "chunks": self.chunks, "bytes": self.bytes, "errors": list(self.errors),
                "orphan_segments": list(self.orphan_segments), "partial_objects": list(self.partial_objects)}


def _verify_segment(store, entry: LogEntry, report: VerifyReport) -> None:
    seg = entry.segment
    where = f"segment {store.url}/{seg.path} (log entry {entry.seq})"
    try:
        group = json.loads(store.backend.get(f"{seg.path}/zarr.json"))
        attrs = group["attributes"]["tracestore"]
        want = {"rows": seg.rows, "writer_id": entry.writer_id, "segment_id": seg.path.rsplit("/", 1)[1],
                "store_id": store.store_id}
        bad = {k: attrs.get(k) for k, v in want.items() if attrs.get(k) != v}
        if group.get("zarr_format") != 3 or group.get("node_type") != "group" or bad:
            report.errors.append(f"{where}: group zarr.json does not match the log entry ({bad or 'not a group'})")
    except (ObjectNotFoundError, ValueError, KeyError, TypeError) as e:
        report.errors.append(f"{where}: bad group zarr.json: {e}")
    trajs = sorted(set(entry.traj_ids))
    for name, spec in store.array_specs.items():
        lay = layout(spec, seg.rows, seg.chunk_rows, seg.shard_bytes)
        prefix = f"{seg.path}/{name}"
        try:
            if store.backend.get(f"{prefix}/zarr.json") != array_metadata(lay):
                report.errors.append(f"{where}: {name}/zarr.json differs from the layout the log entry implies")
        except ObjectNotFoundError:
            report.errors.append(f"{where}: {name}/zarr.json is missing")
        report.objects += 1
        for s in range(lay.n_shards):
            key = f"{seg.path}/{lay.shard_key(s)}"
            try:
                data = store.backend.get(key)
            except ObjectNotFoundError:
                report.errors.append(f"object {store.url}/{key} is missing ({where}, trajectories {trajs[:5]})")
                continue
            report.objects += 1
            report.bytes += len(data)
            size, index = lay.expected_index(s)
            if len(data) != size:
                report.errors.append(f"object {store.url}/{key}: {len(data)} bytes, expected {size} ({where})")
                continue
            if data[size - len(index):] != index:
                report.errors.append(f"object {store.url}/{key}: shard index differs from the expected one ({where})")
            n_chunks = (size - len(index)) // lay.stored_chunk_nbytes
            arr = np.frombuffer(data, np.uint8, count=n_chunks * lay.stored_chunk_nbytes).reshape(
                n_chunks, lay.stored_chunk_nbytes)
            stored = arr[:, lay.chunk_nbytes:].copy().view("<u4").reshape(-1)
            for k in range(n_chunks):
                report.chunks += 1
                if crc32c(arr[k, : lay.chunk_nbytes]) != int(stored[k]):
                    i = s * lay.chunks_per_shard + k // lay.n_inner
                    rows = (i * lay.chunk_rows, (i + 1) * lay.chunk_rows)
                    hit = [f"{t}[{a}:{b})" for t, a, b, ro, _pv in entry.records()
                           if ro < rows[1] and ro + (b - a) > rows[0]]
                    report.errors.append(f"crc32c mismatch: object {store.url}/{key} chunk ({i}, {k % lay.n_inner}) "
                                         f"(rows {rows[0]}..{rows[1]}, trajectories {hit[:5]}, {where})")


def verify(store, *, progress: Progress | None = None) -> VerifyReport:
    """Re-read every committed object and check it: log entries (crc, version, density), no overlapping token
    ranges, zarr metadata, shard sizes and indexes, every chunk's crc32c. Lists orphaned segments and partial
    files (not errors). Never raises for bad data: problems go into ``report.errors``."""
    report = VerifyReport()
    try:  # one listing, before the log is read (as gc): every checkpoint in it covers entries read below
        objects = _store_objects(store)
    except TraceStoreError as e:
        report.errors.append(f"listing failed: {e}")
        objects = []
    entries = _all_entries(store, report.errors, objects)
    report.entries = len(entries)
    report.records = sum(len(e) for e in entries)
    ranges: dict[str, list[tuple[int, int, int]]] = {}
    for e in entries:
        for t, a, b, _ro, _pv in e.records():
            ranges.setdefault(t, []).append((a, b, e.seq))
    for t, rs in ranges.items():
        rs.sort()
        for (a0, b0, q0), (a1, b1, q1) in zip(rs, rs[1:]):
            if a1 < b0:
                report.errors.append(f"trajectory {t!r}: [{a0}, {b0}) (entry {q0}) overlaps [{a1}, {b1}) (entry {q1})")
    by_seq = {e.seq: e for e in entries}
    for n in sorted(n for o in objects if (n := parse_checkpoint_key(o.key)) is not None):
        key = checkpoint_key(n)
        try:
            ck = decode_checkpoint(store.backend.get(key), n, f"{store.url}/{key}")
        except (IntegrityError, SchemaVersionError, ObjectNotFoundError) as e:
            report.errors.append(f"checkpoint {key}: {e}")
            continue
        bad = [c.seq for c in ck if c.seq not in by_seq or not same_entry(c, by_seq[c.seq])]
        if bad:
            report.errors.append(f"checkpoint {key} disagrees with log entries {bad[:5]}")
    with_result: dict[str, int] = {}
    for e in entries:
        for r in e.results:
            if r.traj_id in with_result:
                report.errors.append(f"trajectory {r.traj_id!r} has two results (log entries "
                                     f"{with_result[r.traj_id]} and {e.seq})")
            with_result.setdefault(r.traj_id, e.seq)
    report.results = len(with_result)
    seen: set[str] = set()
    for k, e in enumerate(entries):
        if progress is not None:
            progress(k, len(entries), e.entry_id)
        if e.segment is None:
            continue
        if e.segment.path in seen:
            report.errors.append(f"segment {e.segment.path} is referenced by more than one log entry")
            continue
        seen.add(e.segment.path)
        report.segments += 1
        _verify_segment(store, e, report)
    if progress is not None:
        progress(len(entries), len(entries), "done")
    orphans = set()
    for o in objects:
        if o.key.endswith(PARTIAL_SUFFIX):
            report.partial_objects.append(o.key)
            continue
        seg = _segment_of(o.key)
        if seg is not None and seg not in seen:
            orphans.add(seg)
    report.orphan_segments = sorted(orphans)
    return report


@dataclass
class GcReport:
    """Outcome of :func:`collect_garbage`."""

    dry_run: bool
    deleted_segments: list[str] = field(default_factory=list)
    deleted_objects: int = 0
    deleted_bytes: int = 0
    young_segments: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "deleted_segments": list(self.deleted_segments),
                "deleted_objects": self.deleted_objects, "deleted_bytes": self.deleted_bytes,
                "young_segments": list(self.young_segments)}


#: resolution of object modification times (S3 LastModified has whole seconds)
MTIME_RESOLUTION_S = 1.0


def commit_windows(objects, entries: list[LogEntry]) -> dict[int, float]:
    """Per log entry, how long its segment was (at least) unreferenced before the entry existed: the larger of
    (log object mtime - the segment's newest object mtime), both by the storage's clock from one listing, and
    (log object mtime - the entry's ``created_unix``), the time its conditional PUT was in flight (writer's clock
    against the storage's: clock skew adds to it). gc's grace must exceed these."""
    seg_mtime: dict[str, float] = {}
    log_mtime: dict[int, float] = {}
    for o in objects:
        seg = _segment_of(o.key)
        if seg is not None:
            seg_mtime[seg] = max(seg_mtime.get(seg, 0.0), o.mtime)
        elif (n := parse_log_key(o.key)) is not None:
            log_mtime[n] = o.mtime
    out = {}
    for e in entries:
        if e.seq not in log_mtime or e.segment is None:
            continue
        landed = log_mtime[e.seq]
        window = landed - e.created_unix
        if e.segment.path in seg_mtime:
            window = max(window, landed - seg_mtime[e.segment.path])
        # object stores report whole seconds: a fast commit can span a second boundary, so take one second off
        out[e.seq] = max(0.0, window - MTIME_RESOLUTION_S)
    return out


def collect_garbage(store, *, grace_s: float | None = None, dry_run: bool = False,
                    progress: Progress | None = None, now: float | None = None, force: bool = False) -> GcReport:
    """Delete data that no committed log entry references and that is older than ``grace_s``.

    Deletes (a) every object of a segment ``data/<writer>/<segment>/`` that no log entry names, once the
    segment's newest object is older than the grace period, and (b) ``*.partial`` temporary files older than it.
    Log entries, checkpoints and the manifest are never deleted. Data is listed *before* the log is read, so a
    segment that commits meanwhile is seen as referenced; writers never commit a segment older than half the
    store's ``gc_grace_s`` (they write it again), and check after a slower commit that its segment survived
    (FORMAT §6). Safe to run while writers and readers work.

    Nothing is deleted unless the whole log was read: a listing or an entry that cannot be read, or a hole in
    the log, raises before any deletion.

    Args:
        grace_s: seconds; default the store's ``gc_grace_s``. Must be finite and > 0, at least the store's
            ``gc_grace_s`` (writers rely on it) unless ``force``, and more than twice the longest commit seen in
            the store (from its segment's last write to its log entry, by the storage's clock).
        force: allow a grace shorter than the store's ``gc_grace_s`` (only when no writer is running).
        now: the current time (unix seconds; tests).

    Raises:
        GcRefusedError: an unsafe grace period (nothing deleted).
        IntegrityError / SchemaVersionError: a log entry is missing (a hole) or cannot be decoded (nothing is
            deleted then: the entry might reference data). BackendError: the storage failed (nothing deleted
            unless the failure came during deletion).
    """
    grace = store.gc_grace_s if grace_s is None else grace_s
    if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not math.isfinite(grace) or grace <= 0:
        raise GcRefusedError(f"gc grace period must be a finite number of seconds > 0, got {grace!r}")
    grace = float(grace)
    if grace < store.gc_grace_s and not force:
        raise GcRefusedError(
            f"gc grace {grace:g} s is shorter than the store's gc_grace_s {store.gc_grace_s:g} s, which writers rely "
            f"on (they commit segments younger than half of it); use force (--force) only when no writer runs")
    now = time.time() if now is None else now
    report = GcReport(dry_run=dry_run)
    objects = _store_objects(store)
    entries = _all_entries(store, objects=objects)  # after listing (see docstring); raises on any problem
    windows = commit_windows(objects, entries)
    if windows:
        seq, slowest = max(windows.items(), key=lambda kv: kv[1])
        if grace <= 2 * slowest:
            raise GcRefusedError(
                f"gc grace {grace:g} s is not more than twice the longest commit seen in {store.url} "
                f"(log entry {seq}: about {slowest:.1f} s from its segment's write to its log entry); use a grace "
                f"> {2 * slowest:.0f} s")
    referenced = {e.segment.path for e in entries if e.segment is not None}
    segments: dict[str, list] = {}
    doomed: list = []
    for o in objects:
        if o.key.endswith(PARTIAL_SUFFIX):
            if now - o.mtime > grace:
                doomed.append(o)
            continue
        seg = _segment_of(o.key)
        if seg is not None and seg not in referenced:
            segments.setdefault(seg, []).append(o)
    for seg, objs in sorted(segments.items()):
        if now - max(o.mtime for o in objs) > grace:
            report.deleted_segments.append(seg)
            doomed.extend(objs)
        else:
            report.young_segments.append(seg)
    report.deleted_objects = len(doomed)
    report.deleted_bytes = sum(o.size for o in doomed)
    if not dry_run:
        batch = 256
        for k in range(0, len(doomed), batch):
            if progress is not None:
                progress(k, len(doomed), "deleting")
            store.backend.delete_many([o.key for o in doomed[k:k + batch]])
        if progress is not None:
            progress(len(doomed), len(doomed), "done")
        log.info("gc %s: deleted %d segments, %d objects, %d bytes", store.url, len(report.deleted_segments),
                 report.deleted_objects, report.deleted_bytes)
    return report


#: what ``tracestore export --table`` writes: one row per committed record, or per committed result
EXPORT_TABLES = ("records", "results")


def export_table(store, path: str, snapshot=None, table: str = "records") -> dict:
    """Write one table of ``snapshot`` (default: the log head) to one Parquet file at ``path`` (a local path), for
    SQL engines and ``pyarrow.dataset``; the snapshot is in the file's metadata (``tracestore.snapshot``).

    * ``records`` — one row per committed record, in log order, with the columns of a version-1 checkpoint
      (FORMAT §3.1: ``seq``, ``writer_id``, ``writer_seq``, ``segment``, ``rows``, ``chunk_rows``, ``shard_bytes``,
      ``created_unix``, ``segment_nbytes``, ``traj_id``, ``token_start``, ``token_stop``, ``row_offset``,
      ``policy_version``). Query this, not ``index/*.parquet``: each checkpoint holds the whole log up to its
      ``log_end``, so reading them all counts records more than once.
    * ``results`` — one row per trajectory whose result is committed (its first result), in log order, in
      ``traceschemas.result_schema()``: ``traj_id``, ``reward``, ``group_id``, ``advantage`` (null: left to the
      trainer), ``prompt_len``, ``response_len``, ``policy_version``, ``finish_reason``, ``extra`` (JSON text),
      ``seq`` (the results entry).

    Returns ``{"path", "table", "rows", "log_end", "snapshot"}`` (and ``"records"`` = rows for ``records``, as
    before). Raises OptionError for another ``table``; as :meth:`Store.read_entries`; OSError if ``path`` cannot be
    written (written to ``path + ".partial"`` first, then renamed).
    """
    import os

    import pyarrow.parquet as pq

    if table not in EXPORT_TABLES:
        raise OptionError(f"export table {table!r:.40}: allowed are {', '.join(EXPORT_TABLES)}")
    snap = store.check_snapshot(snapshot)
    if table == "records":
        data = records_table(store.read_entries(0, snap.log_end))
    else:
        data = store.reader(snap).results_table()
    data = data.replace_schema_metadata({b"tracestore.snapshot": snap.to_json().encode()})
    tmp = f"{path}.partial"
    pq.write_table(data, tmp, compression="zstd")
    os.replace(tmp, path)
    out = {"path": path, "table": table, "rows": data.num_rows, "log_end": snap.log_end, "snapshot": snap.to_json()}
    if table == "records":
        out["records"] = data.num_rows
    return out


def export_records(store, path: str, snapshot=None) -> dict:
    """:func:`export_table` of the ``records`` table."""
    return export_table(store, path, snapshot, "records")


def export_results(store, path: str, snapshot=None) -> dict:
    """:func:`export_table` of the ``results`` table."""
    return export_table(store, path, snapshot, "results")


def compact(store) -> int | None:
    """Write a checkpoint of the whole log (see :meth:`Store.compact`); returns its ``log_end`` or None."""
    return store.compact()
