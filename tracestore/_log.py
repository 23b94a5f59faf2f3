"""Commit-log entries: encoding, decoding and checking (mirror images of each other).

An entry is an Arrow IPC file (``traceschemas.log_entry_schema()``) with two schema-metadata keys:

* ``tracestore.entry`` — compact JSON: ``format_version``, ``seq``, ``writer_id``, ``writer_seq``, ``segment``
  (key prefix of the segment group), ``rows``, ``chunk_rows``, ``shard_bytes``, ``created_unix``,
  ``segment_nbytes``;
* ``tracestore.crc32c`` — 8 lowercase hex digits: crc32c of the ``tracestore.entry`` bytes followed by the
  canonical column bytes (per column in schema order: strings as u32-LE length + UTF-8, int64 as LE bytes).

Readers check, in this order: the Arrow file decodes (truncation is caught by the IPC footer), both metadata keys
are present and the entry metadata is JSON, the format version is supported (:class:`SchemaVersionError`), the
columns match ``log_entry_schema()``, the crc matches, the ``seq`` matches the key and the segment path and
records are well formed (:class:`IntegrityError` for everything but the version).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from traceschemas import log_entry_schema

from ._format import (
    ENTRY_CRC_KEY,
    ENTRY_META_KEY,
    FORMAT_VERSION,
    SUPPORTED_FORMAT_VERSIONS,
    check_id,
)
from ._segment import crc32c
from .errors import IntegrityError, InvalidIdError, SchemaVersionError

_SCHEMA = log_entry_schema()


@dataclass(frozen=True)
class SegmentRef:
    """Where a segment lives and how its arrays are laid out (all a reader needs to read it)."""

    path: str  # key prefix of the segment group, "data/<writer_id>/<segment_id>"
    writer_id: str
    rows: int
    chunk_rows: int
    shard_bytes: int


@dataclass(frozen=True)
class LogEntry:
    """One commit: a segment and the records (trajectory token ranges) it holds."""

    seq: int
    writer_id: str
    writer_seq: int
    segment: SegmentRef
    created_unix: float
    segment_nbytes: int
    traj_ids: list[str]
    token_start: np.ndarray  # [n] int64
    token_stop: np.ndarray  # [n] int64
    row_offset: np.ndarray  # [n] int64
    policy_version: np.ndarray  # [n] int64

    def __len__(self) -> int:
        return len(self.traj_ids)

    def records(self) -> Iterator[tuple[str, int, int, int, int]]:
        """Per record, in order: ``(traj_id, token_start, token_stop, row_offset, policy_version)`` (Python ints)."""
        return zip(self.traj_ids, self.token_start.tolist(), self.token_stop.tolist(), self.row_offset.tolist(),
                   self.policy_version.tolist())


def merge_ranges(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, non-overlapping ``[start, stop)`` ranges with touching ones joined: ``[0, 5), [5, 9)`` -> ``[0, 9)``."""
    out: list[tuple[int, int]] = []
    for s, e in ranges:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def _canonical(traj_ids: list[str], ints: list[np.ndarray]) -> bytes:
    parts = []
    for t in traj_ids:
        b = t.encode()
        parts.append(struct.pack("<I", len(b)))
        parts.append(b)
    for col in ints:
        parts.append(np.ascontiguousarray(col, dtype="<i8").tobytes())
    return b"".join(parts)


def encode_entry(entry: LogEntry) -> bytes:
    meta = {
        "format_version": FORMAT_VERSION,
        "seq": entry.seq,
        "writer_id": entry.writer_id,
        "writer_seq": entry.writer_seq,
        "segment": entry.segment.path,
        "rows": entry.segment.rows,
        "chunk_rows": entry.segment.chunk_rows,
        "shard_bytes": entry.segment.shard_bytes,
        "created_unix": entry.created_unix,
        "segment_nbytes": entry.segment_nbytes,
    }
    meta_bytes = json.dumps(meta, separators=(",", ":"), sort_keys=True).encode()
    ints = [entry.token_start, entry.token_stop, entry.row_offset, entry.policy_version]
    crc = crc32c(meta_bytes + _canonical(entry.traj_ids, ints))
    schema = _SCHEMA.with_metadata({ENTRY_META_KEY: meta_bytes, ENTRY_CRC_KEY: f"{crc:08x}".encode()})
    table = pa.table(
        [pa.array(entry.traj_ids, pa.string())] + [pa.array(np.asarray(c, np.int64), pa.int64()) for c in ints],
        schema=schema,
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, schema) as w:
        w.write_table(table)
    return sink.getvalue().to_pybytes()


def decode_entry(data: bytes, seq: int, where: str) -> LogEntry:
    """Decode and check the entry stored at ``log_key(seq)``; ``where`` names it in errors (URL + key).

    Raises:
        IntegrityError: truncated/corrupt file, crc mismatch, bad columns, ``seq`` not matching the key.
        SchemaVersionError: the entry declares an unsupported format version.
    """
    try:
        reader = pa.ipc.open_file(pa.BufferReader(data))
        table = reader.read_all()
    except (pa.ArrowInvalid, pa.ArrowException, OSError) as e:
        raise IntegrityError(f"log entry {where} is truncated or not an Arrow IPC file ({len(data)} bytes): {e}") from e
    meta_raw = (table.schema.metadata or {}).get(ENTRY_META_KEY)
    crc_raw = (table.schema.metadata or {}).get(ENTRY_CRC_KEY)
    if meta_raw is None or crc_raw is None:
        raise IntegrityError(f"log entry {where} lacks the tracestore.entry / tracestore.crc32c metadata")
    try:
        meta = json.loads(meta_raw)
    except ValueError as e:
        raise IntegrityError(f"log entry {where}: metadata is not JSON: {e}") from e
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if version not in SUPPORTED_FORMAT_VERSIONS:
        raise SchemaVersionError(
            f"log entry {where} has format_version {version!r}; this tracestore writes version {FORMAT_VERSION} "
            f"and reads versions {list(SUPPORTED_FORMAT_VERSIONS)}"
        )
    if table.schema.remove_metadata() != _SCHEMA:
        raise IntegrityError(f"log entry {where}: columns {table.schema.names} do not match log_entry_schema v1")
    traj_ids = table.column("traj_id").to_pylist()
    ints = [table.column(n).to_numpy() for n in ("token_start", "token_stop", "row_offset", "policy_version")]
    crc = crc32c(meta_raw + _canonical(traj_ids, ints))
    if f"{crc:08x}".encode() != crc_raw:
        raise IntegrityError(f"log entry {where}: crc32c mismatch (stored {crc_raw.decode(errors='replace')}, computed {crc:08x})")
    try:
        if meta["seq"] != seq:
            raise IntegrityError(f"log entry {where} declares seq {meta['seq']}, expected {seq}")
        writer_id = check_id(meta["writer_id"], "writer id")
        segment = SegmentRef(
            path=str(meta["segment"]),
            writer_id=writer_id,
            rows=int(meta["rows"]),
            chunk_rows=int(meta["chunk_rows"]),
            shard_bytes=int(meta["shard_bytes"]),
        )
        entry = LogEntry(
            seq=seq,
            writer_id=writer_id,
            writer_seq=int(meta["writer_seq"]),
            segment=segment,
            created_unix=float(meta["created_unix"]),
            segment_nbytes=int(meta.get("segment_nbytes", 0)),
            traj_ids=traj_ids,
            token_start=ints[0].astype(np.int64),
            token_stop=ints[1].astype(np.int64),
            row_offset=ints[2].astype(np.int64),
            policy_version=ints[3].astype(np.int64),
        )
    except (KeyError, TypeError, ValueError, InvalidIdError) as e:
        raise IntegrityError(f"log entry {where}: bad metadata: {e}") from e
    _check_entry(entry, where)
    return entry


def _check_entry(entry: LogEntry, where: str) -> None:
    seg = entry.segment
    parts = seg.path.split("/")
    if len(parts) != 3 or parts[0] != "data" or parts[1] != entry.writer_id or ".." in parts:
        raise IntegrityError(f"log entry {where}: segment path {seg.path!r} is not data/<writer_id>/<segment_id>")
    try:
        check_id(parts[2], "segment id")
    except InvalidIdError as e:
        raise IntegrityError(f"log entry {where}: {e}") from e
    if seg.rows <= 0 or seg.chunk_rows <= 0 or seg.shard_bytes <= 0 or len(entry) == 0:
        raise IntegrityError(f"log entry {where}: empty or malformed segment layout")
    n = entry.token_stop - entry.token_start
    if (entry.token_start < 0).any() or (n <= 0).any() or (entry.row_offset < 0).any() or (
        entry.row_offset + n > seg.rows
    ).any():
        raise IntegrityError(f"log entry {where}: a record's token range or rows are out of bounds")
    for t in entry.traj_ids:
        try:
            check_id(t)
        except InvalidIdError as e:
            raise IntegrityError(f"log entry {where}: {e}") from e


# ---------------------------------------------------------------------- checkpoints
_CKPT_META_KEY = b"tracestore.checkpoint"
_RECORD_INT_FIELDS = ("token_start", "token_stop", "row_offset", "policy_version")


def _checkpoint_schema() -> pa.Schema:
    fields = [pa.field("seq", pa.int64(), nullable=False), pa.field("writer_id", pa.string(), nullable=False),
              pa.field("writer_seq", pa.int64(), nullable=False), pa.field("segment", pa.string(), nullable=False),
              pa.field("rows", pa.int64(), nullable=False), pa.field("chunk_rows", pa.int64(), nullable=False),
              pa.field("shard_bytes", pa.int64(), nullable=False),
              pa.field("created_unix", pa.float64(), nullable=False),
              pa.field("segment_nbytes", pa.int64(), nullable=False)]
    return pa.schema(fields + list(_SCHEMA))


def _checkpoint_canonical(cols: dict) -> bytes:
    parts = []
    for name in _checkpoint_schema().names:
        values = cols[name]
        if isinstance(values, list):  # strings
            parts.append(_canonical(values, []))
        else:
            parts.append(np.ascontiguousarray(values, dtype="<f8" if name == "created_unix" else "<i8").tobytes())
    return b"".join(parts)


def encode_checkpoint(entries: list[LogEntry]) -> bytes:
    """All records of log entries ``0 .. len(entries)-1`` in one Parquet file (``index/<log_end>.parquet``).

    A checkpoint only saves readers the per-entry GETs; the log entries stay the source of truth."""
    import pyarrow.parquet as pq

    cols: dict = {name: [] for name in _checkpoint_schema().names}
    for e in entries:
        n = len(e)
        for name, value in (("seq", e.seq), ("writer_id", e.writer_id), ("writer_seq", e.writer_seq),
                            ("segment", e.segment.path), ("rows", e.segment.rows),
                            ("chunk_rows", e.segment.chunk_rows), ("shard_bytes", e.segment.shard_bytes),
                            ("created_unix", e.created_unix), ("segment_nbytes", e.segment_nbytes)):
            cols[name].extend([value] * n)
        cols["traj_id"].extend(e.traj_ids)
        for name in _RECORD_INT_FIELDS:
            cols[name].extend(getattr(e, name).tolist())
    arrays = {k: (v if k in ("writer_id", "segment", "traj_id") else np.asarray(v, np.float64 if k == "created_unix"
                                                                                   else np.int64))
              for k, v in cols.items()}
    crc = crc32c(_checkpoint_canonical(arrays))
    meta = json.dumps({"format_version": FORMAT_VERSION, "log_end": len(entries), "crc32c": f"{crc:08x}"},
                      separators=(",", ":")).encode()
    schema = _checkpoint_schema().with_metadata({_CKPT_META_KEY: meta})
    table = pa.table([pa.array(arrays[n], schema.field(n).type) for n in schema.names], schema=schema)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


def decode_checkpoint(data: bytes, log_end: int, where: str) -> list[LogEntry]:
    """Entries ``0 .. log_end-1`` from a checkpoint. Raises IntegrityError / SchemaVersionError."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        raise IntegrityError(f"checkpoint {where} is truncated or not Parquet: {e}") from e
    try:
        meta = json.loads((table.schema.metadata or {})[_CKPT_META_KEY])
    except (KeyError, ValueError) as e:
        raise IntegrityError(f"checkpoint {where} lacks valid tracestore.checkpoint metadata") from e
    if meta.get("format_version") not in SUPPORTED_FORMAT_VERSIONS:
        raise SchemaVersionError(f"checkpoint {where} has format_version {meta.get('format_version')!r}; this "
                                 f"tracestore reads versions {list(SUPPORTED_FORMAT_VERSIONS)}")
    if meta.get("log_end") != log_end or table.schema.remove_metadata() != _checkpoint_schema():
        raise IntegrityError(f"checkpoint {where}: log_end or columns do not match its key")
    cols = {n: (table.column(n).to_pylist() if n in ("writer_id", "segment", "traj_id")
                else table.column(n).to_numpy()) for n in table.schema.names}
    if f"{crc32c(_checkpoint_canonical(cols)):08x}" != meta.get("crc32c"):
        raise IntegrityError(f"checkpoint {where}: crc32c mismatch")
    seqs = cols["seq"]
    entries: list[LogEntry] = []
    bounds = np.flatnonzero(np.diff(seqs)) + 1
    starts = [0, *bounds.tolist()]
    stops = [*bounds.tolist(), len(seqs)]
    for a, b in zip(starts, stops):
        seq = int(seqs[a])
        if seq != len(entries):
            raise IntegrityError(f"checkpoint {where}: entries are not dense (found {seq}, expected {len(entries)})")
        writer_id = cols["writer_id"][a]
        entry = LogEntry(
            seq=seq, writer_id=writer_id, writer_seq=int(cols["writer_seq"][a]),
            segment=SegmentRef(cols["segment"][a], writer_id, int(cols["rows"][a]), int(cols["chunk_rows"][a]),
                               int(cols["shard_bytes"][a])),
            created_unix=float(cols["created_unix"][a]), segment_nbytes=int(cols["segment_nbytes"][a]),
            traj_ids=cols["traj_id"][a:b],
            **{n: cols[n][a:b].astype(np.int64) for n in _RECORD_INT_FIELDS},
        )
        _check_entry(entry, f"{where} (entry {seq})")
        entries.append(entry)
    if len(entries) != log_end:
        raise IntegrityError(f"checkpoint {where} holds {len(entries)} entries, expected {log_end}")
    return entries


def same_entry(a: LogEntry, b: LogEntry) -> bool:
    """Field-by-field equality of two decoded entries (for checking checkpoints against the log)."""
    return (a.seq == b.seq and a.writer_id == b.writer_id and a.writer_seq == b.writer_seq and a.segment == b.segment
            and a.created_unix == b.created_unix and a.segment_nbytes == b.segment_nbytes
            and a.traj_ids == b.traj_ids
            and all(np.array_equal(getattr(a, n), getattr(b, n)) for n in _RECORD_INT_FIELDS))
