"""Store maintenance: ``info`` (summary and byte accounting), ``verify`` (re-read and check everything) and
``collect_garbage`` (remove data no committed log entry references). The CLI calls these.
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
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
from ._buffer import TokenRanges
from .commit import claim, result_problem
from .format.entries import (
    GC,
    MAX_GC_SEGMENTS,
    LogEntry,
    decode_checkpoint,
    encode_entry,
    records_table,
    same_entry,
)
from .format.segment import array_metadata, crc32c, layout, margin_layout
from .errors import (
    GcFenceError,
    GcRefusedError,
    IntegrityError,
    ObjectNotFoundError,
    OptionError,
    SchemaVersionError,
    TraceStoreError,
)
from .writer import _default_writer_id

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

    ``bytes``: ``payload`` (hint + scale shards), ``margin`` (the shards of margin sites' rows and row ends, FORMAT
    §2.5), ``trace`` (token ids, log-probs, experts shards),
    ``zarr_metadata`` (zarr.json objects), ``log`` (log entries), ``checkpoints`` (``index/``), ``manifest``, ``orphan`` (data of no committed
    entry), ``partial`` (unfinished temporary files), ``total``. ``payload_logical_bytes`` = committed tokens x
    hint+scale bytes per token of the bits sites; ``overhead`` = everything stored except orphans, trace and margin,
    over that; ``margin_bytes_per_token`` = the ``margin`` bytes over the committed tokens (None without margin
    sites or tokens).
    """
    objects = _store_objects(store)
    entries = _all_entries(store, objects=objects)
    referenced = {e.segment.path for e in entries if e.segment is not None}
    cats = dict.fromkeys(("payload", "margin", "trace", "zarr_metadata", "log", "checkpoints", "manifest", "orphan",
                          "partial", "other"), 0)
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
            cats["payload" if array.startswith(("hints.", "scales.")) else
                 "margin" if array.startswith(("margin.", "margin_ends.")) else "trace"] += o.size
        else:
            cats["other"] += o.size
    cats["total"] = sum(o.size for o in objects)
    tokens = sum(int((e.token_stop - e.token_start).sum()) for e in entries)
    trajs = {t for e in entries for t in e.traj_ids}
    logical = tokens * sum(s.bytes_per_token for s in store.sites.values() if not s.is_margin)
    stored_useful = cats["total"] - cats["orphan"] - cats["partial"] - cats["other"]
    return {
        "url": store.url,
        "format_version": store.format_version,
        "store_id": store.store_id,
        "sites": [s.to_dict() for s in store.sites.values()],  # every key spelled out (scale_encoding too)
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
        "overhead": ((stored_useful - cats["trace"] - cats["margin"]) / logical - 1.0) if logical else None,
        "margin_bytes_per_token": (cats["margin"] / tokens) if tokens and store.margin_arrays else None,
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


def _normal_zarr(meta: object, itemsize: int) -> object:
    """An array's ``zarr.json`` in a normal form, so that two encodings of the same metadata compare equal (FORMAT
    §2.3): whatever the key order and whitespace, with the optional members at their defaults left out
    (``attributes: {}``, ``storage_transformers: []``, ``dimension_names: null``, a codec's empty
    ``configuration``, the ``v2`` key encoding's default separator ``.``) and the ``bytes`` codec of a one-byte
    data type with or without ``endian`` (byte order means nothing there)."""
    if not isinstance(meta, dict):
        return meta
    out = dict(meta)
    for key, default in (("attributes", {}), ("storage_transformers", []), ("dimension_names", None)):
        if key in out and out[key] == default:
            del out[key]
    cke = out.get("chunk_key_encoding")
    if isinstance(cke, dict) and cke.get("name") == "v2" and cke.get("configuration", {}) in ({}, {"separator": "."}):
        out["chunk_key_encoding"] = {"name": "v2"}

    def codecs(items: object, inner: bool) -> object:
        if not isinstance(items, list):
            return items
        normal = []
        for c in items:
            if isinstance(c, dict):
                c = dict(c)
                if c.get("configuration") == {}:
                    del c["configuration"]
                if c.get("name") == "bytes" and inner and itemsize == 1:
                    c.pop("configuration", None)
                if c.get("name") == "sharding_indexed" and isinstance(c.get("configuration"), dict):
                    conf = dict(c["configuration"])
                    conf["codecs"] = codecs(conf.get("codecs"), True)
                    conf["index_codecs"] = codecs(conf.get("index_codecs"), False)
                    c["configuration"] = conf
            normal.append(c)
        return normal

    out["codecs"] = codecs(out.get("codecs"), True)
    return out


def same_array_metadata(stored: bytes, expected: bytes, itemsize: int) -> bool:
    """Whether a stored array ``zarr.json`` means what ``expected`` (this code's encoding) means (FORMAT §2.3: the
    same JSON value up to :func:`_normal_zarr`); False for bytes that are not JSON."""
    if stored == expected:
        return True
    try:
        got = json.loads(stored)
    except (ValueError, RecursionError):
        return False
    return _normal_zarr(got, itemsize) == _normal_zarr(json.loads(expected), itemsize)


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
    ends_of: dict[str, np.ndarray | None] = {}  # margin row ends that passed every check (None: they did not)
    for name, spec in store.array_specs.items():
        if spec.ends:  # a margin site's rows: the array's length is the segment's last row end (FORMAT §2.3)
            ends = ends_of.get(spec.ends)
            if ends is None:
                report.errors.append(f"{where}: {name} not checked: its row ends {spec.ends} failed their checks")
                continue
            lay = margin_layout(spec, int(ends[-1]), seg.chunk_rows, seg.shard_bytes)
        else:
            lay = layout(spec, seg.rows, seg.chunk_rows, seg.shard_bytes)
        payloads = _verify_array(store, entry, lay, where, trajs, report, keep=name.startswith("margin_ends."))
        if name.startswith("margin_ends."):
            ends_of[name] = _check_ends(store, seg, name, payloads, report, where)


def _check_ends(store, seg, name: str, payloads: list | None, report: VerifyReport, where: str) -> np.ndarray | None:
    """The row ends of margin array ``name`` (uint32 ``[rows]``) from its checked chunk ``payloads``, or None (and
    an error) when a chunk failed or the ends are not non-decreasing rows of at most the site's ``max_row_bytes``."""
    if payloads is None:
        return None
    ends = np.frombuffer(b"".join(payloads), "<u4")[:seg.rows].astype(np.int64)
    site = store.sites[name.split(".", 1)[1]]
    lengths = np.diff(ends, prepend=0)
    if len(ends) != seg.rows or (lengths < 0).any() or int(lengths.max(initial=0)) > site.max_row_bytes:
        bad = int(np.flatnonzero((lengths < 0) | (lengths > site.max_row_bytes))[0]) if len(ends) == seg.rows else 0
        report.errors.append(f"damaged row ends: object {store.url}/{seg.path}/{name} row {bad}: ends must be "
                             f"non-decreasing with rows of at most max_row_bytes {site.max_row_bytes} ({where})")
        return None
    return ends


def _verify_array(store, entry: LogEntry, lay, where: str, trajs: list, report: VerifyReport,
                  keep: bool = False) -> list | None:
    """Check one array of a segment: its zarr.json and every shard (size, index, each chunk's crc32c). Returns
    (``keep``) the chunks' payloads in order when every shard passed, else None."""
    seg, name, spec = entry.segment, lay.spec.name, lay.spec
    payloads: list | None = [] if keep else None
    prefix = f"{seg.path}/{name}"
    try:
        if not same_array_metadata(store.backend.get(f"{prefix}/zarr.json"), array_metadata(lay),
                                   spec.dtype.itemsize):
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
            payloads = None
            continue
        report.objects += 1
        report.bytes += len(data)
        size, index = lay.expected_index(s)
        if len(data) != size:
            report.errors.append(f"object {store.url}/{key}: {len(data)} bytes, expected {size} ({where})")
            payloads = None
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
                payloads = None
                i = s * lay.chunks_per_shard + k // lay.n_inner
                rows = (i * lay.chunk_rows, (i + 1) * lay.chunk_rows)
                what = "bytes" if spec.ends else "rows"
                hit = [f"{t}[{a}:{b})" for t, a, b, ro, _pv in entry.records()
                       if spec.ends or (ro < rows[1] and ro + (b - a) > rows[0])]
                report.errors.append(f"crc32c mismatch: object {store.url}/{key} chunk ({i}, {k % lay.n_inner}) "
                                     f"({what} {rows[0]}..{rows[1]}, trajectories {hit[:5]}, {where})")
            elif payloads is not None:
                payloads.append(arr[k, : lay.chunk_nbytes].tobytes())
    return payloads


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
    if store.format_version >= 3:
        report.errors.extend(result_rule_violations(entries))
    report.errors.extend(gc_rule_violations(entries))
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


def result_rule_violations(entries: list[LogEntry]) -> list[str]:
    """What breaks the structural rules of results (FORMAT §3.2, format version 3) in ``entries`` (the log from 0,
    in order): a result whose trajectory's tokens below it are not one range ``[0, n)`` with ``prompt_len < n``, or
    whose first tokens another writer committed; tokens committed after a trajectory's result. A reader hands such
    entries out as they are (another implementation may have written them); ``verify`` reports them."""
    ranges = TokenRanges()
    owner: dict[str, str] = {}
    completed: dict[str, int] = {}
    out: list[str] = []
    for e in entries:
        for r in e.records():
            if r.traj_id in completed:
                out.append(f"trajectory {r.traj_id!r}: tokens [{r.token_start}, {r.token_stop}) committed in log "
                           f"entry {e.seq}, after its result (log entry {completed[r.traj_id]})")
            ranges.add(r.traj_id, r.token_start, r.token_stop)
            owner.setdefault(r.traj_id, e.writer_id)
        for res in e.results:
            if res.traj_id in completed:
                continue  # a second result: reported as such
            completed[res.traj_id] = e.seq
            why = result_problem(res, e.writer_id, ranges.get(res.traj_id), owner.get(res.traj_id))
            if why is not None:
                out.append(f"trajectory {res.traj_id!r}: its result in log entry {e.seq} (writer {e.writer_id!r}) "
                           f"breaks FORMAT §3.2: {why}")
    return out


def gc_rule_violations(entries: list[LogEntry]) -> list[str]:
    """Segments that a gc entry names and an entry references (FORMAT §6: never, in either order)."""
    announced: dict[str, int] = {}
    for e in entries:
        for p in e.segments:
            announced.setdefault(p, e.seq)
    return [f"segment {e.segment.path} is referenced by log entry {e.seq} and named for deletion by gc entry "
            f"{announced[e.segment.path]}" for e in entries
            if e.segment is not None and e.segment.path in announced]


@dataclass
class GcReport:
    """Outcome of :func:`collect_garbage`."""

    dry_run: bool
    deleted_segments: list[str] = field(default_factory=list)
    deleted_objects: int = 0
    deleted_bytes: int = 0
    young_segments: list[str] = field(default_factory=list)
    #: log positions of the gc entries this run committed (format version 3: they name what it deleted)
    gc_entries: list[int] = field(default_factory=list)
    #: old unreferenced segments that an entry committed while this run announced its gc entry (kept)
    committed_meanwhile: list[str] = field(default_factory=list)
    #: old unreferenced segments kept because the store's format version has no gc entries (use ``force``)
    kept_segments: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"dry_run": self.dry_run, "deleted_segments": list(self.deleted_segments),
                "deleted_objects": self.deleted_objects, "deleted_bytes": self.deleted_bytes,
                "young_segments": list(self.young_segments), "gc_entries": list(self.gc_entries),
                "committed_meanwhile": list(self.committed_meanwhile), "kept_segments": list(self.kept_segments)}


#: how long gc keeps trying to commit one gc entry while the storage fails (then GcFenceError, nothing deleted)
GC_ENTRY_TIMEOUT_S = 120.0


def _announce(store, paths: list[str], seq: int, timeout_s: float | None = None) -> tuple[set[str], list[int]]:
    """Commit gc entries (FORMAT §6) naming ``paths`` (unreferenced by every entry below ``seq``, which gc has
    read), at the first free positions from ``seq``: each claim reads the entries it lost the position to and
    leaves out the segments they reference. Returns (the segments the committed gc entries name, their
    positions). From then on no conforming writer commits any of them, and no entry below names them: deleting
    them is safe however long the deletion takes.

    Raises:
        GcFenceError: a gc entry could not be committed within ``timeout_s`` (storage failing); the segments of
            the entries committed before it are returned by no one, and a later run deletes them.
        BackendError / IntegrityError: reading the log failed.
    """
    timeout_s = GC_ENTRY_TIMEOUT_S if timeout_s is None else timeout_s
    gc_id = f"gc-{_default_writer_id()}"[:200]
    remaining = sorted(paths)
    fenced: set[str] = set()
    positions: list[int] = []
    k = 0
    while remaining:
        batch = f"{k:08d}-{uuid.uuid4().hex[:12]}"
        deadline = time.monotonic() + timeout_s
        failures = 0
        while remaining:
            chunk = tuple(remaining[:MAX_GC_SEGMENTS])
            empty = np.zeros(0, np.int64)
            entry = LogEntry(seq=seq, writer_id=gc_id, writer_seq=k, segment=None, created_unix=time.time(),
                             segment_nbytes=0, traj_ids=[], token_start=empty, token_stop=empty, row_offset=empty,
                             policy_version=empty, kind=GC, batch=batch, segments=chunk,
                             format_version=store.format_version)
            outcome, error = claim(store, seq, encode_entry(entry), gc_id, entry.entry_id)
            if outcome == "ours":
                store.log.note_head(seq + 1)
                fenced.update(chunk)
                positions.append(seq)
                remaining = remaining[len(chunk):]
                seq += 1
                break
            if outcome == "taken":  # read what won the position(s): a segment it commits is not garbage
                later = store.read_entries(seq, max(store.head(), seq + 1))
                committed = {e.segment.path for e in later if e.segment is not None}
                remaining = [p for p in remaining if p not in committed]
                seq += len(later)
                continue
            failures += 1
            pause = store.backend.retry.delay(failures)
            if time.monotonic() + pause > deadline:
                raise GcFenceError(f"gc could not commit its gc entry to {store.url} within {timeout_s:.0f} s "
                                   f"({failures} failed tries at log entry {seq}); nothing of it was deleted; last "
                                   f"error: {error}")
            time.sleep(pause)
        k += 1
    return fenced, positions


def collect_garbage(store, *, grace_s: float | None = None, dry_run: bool = False,
                    progress: Progress | None = None, now: float | None = None, force: bool = False) -> GcReport:
    """Delete data that no committed log entry references and that is older than ``grace_s``; never data a
    committed entry references, however slow any request of gc or of a writer is (FORMAT §6).

    Lists the store, reads the whole log, then (format version 3) commits a **gc entry** naming the segments it
    will delete — unreferenced by every entry below that gc entry, their newest object older than the grace
    period — and deletes exactly those. A writer that reads the gc entry before it commits such a segment writes
    it again under a new name; a commit that was already on its way cannot land at or below the gc entry's
    position (put-if-absent) and reads it when it retries. Segments an earlier gc entry names are deleted
    whatever their age (an earlier run stopped before deleting them). Also deletes ``*.partial`` temporary files
    older than the grace period. Log entries, checkpoints, the manifest and application areas are never deleted.
    Safe to run while writers, readers and other gc runs work.

    Format versions 1 and 2 have no gc entries: there gc deletes unreferenced segments only with ``force`` (only
    when no writer runs and no commit is on its way), and lists them in ``kept_segments`` otherwise.

    Nothing is deleted unless the whole log was read: a listing or an entry that cannot be read, or a hole in
    the log, raises before any deletion.

    Args:
        grace_s: seconds; default the store's ``gc_grace_s``. Must be finite and > 0, and at least the store's
            ``gc_grace_s`` unless ``force``. The grace period does not make gc safe (its gc entries do); it spares
            writers whose segments are about to commit the work of writing them again.
        force: allow a grace shorter than the store's ``gc_grace_s``; in a version-1/2 store, delete unreferenced
            segments (only when no writer runs).
        now: the current time (unix seconds; tests).

    Raises:
        GcRefusedError: a grace period that is not allowed (nothing deleted).
        GcFenceError: the gc entry could not be committed (storage failing; nothing deleted).
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
            f"gc grace {grace:g} s is shorter than the store's gc_grace_s {store.gc_grace_s:g} s, which writers "
            f"expect (a segment not committed within it is written again); use force (--force) to allow it")
    now = time.time() if now is None else now
    report = GcReport(dry_run=dry_run)
    objects = _store_objects(store)
    entries = _all_entries(store, objects=objects)  # raises on any problem: nothing is deleted then
    referenced = {e.segment.path for e in entries if e.segment is not None}
    announced = {p for e in entries if e.kind == GC for p in e.segments}
    segments: dict[str, list] = {}
    partials: list = []
    for o in objects:
        if o.key.endswith(PARTIAL_SUFFIX):
            if now - o.mtime > grace:
                partials.append(o)
            continue
        seg = _segment_of(o.key)
        if seg is not None and seg not in referenced:
            segments.setdefault(seg, []).append(o)
    doomed: list[str] = []  # named by a gc entry already: no entry can ever reference them
    old: list[str] = []
    for seg, objs in sorted(segments.items()):
        if seg in announced:
            doomed.append(seg)
        elif now - max(o.mtime for o in objs) > grace:
            old.append(seg)
        else:
            report.young_segments.append(seg)
    if old and store.format_version < 3 and not force:
        log.warning("gc %s: %d unreferenced segments older than the grace period kept: a format-version-%d store "
                    "has no gc entries, so deleting them is safe only when no writer runs (force)", store.url,
                    len(old), store.format_version)
        report.kept_segments, old = old, []
    if not dry_run and old and store.format_version >= 3:
        fenced, report.gc_entries = _announce(store, old, len(entries))
        report.committed_meanwhile = [p for p in old if p not in fenced]
        old = [p for p in old if p in fenced]
    report.deleted_segments = sorted(doomed + old)
    doomed_objects = [o for seg in report.deleted_segments for o in segments[seg]] + partials
    report.deleted_objects = len(doomed_objects)
    report.deleted_bytes = sum(o.size for o in doomed_objects)
    if not dry_run:
        batch = 256
        for k in range(0, len(doomed_objects), batch):
            if progress is not None:
                progress(k, len(doomed_objects), "deleting")
            store.backend.delete_many([o.key for o in doomed_objects[k:k + batch]])
        if progress is not None:
            progress(len(doomed_objects), len(doomed_objects), "done")
        log.info("gc %s: deleted %d segments, %d objects, %d bytes (gc entries %s)", store.url,
                 len(report.deleted_segments), report.deleted_objects, report.deleted_bytes, report.gc_entries)
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
