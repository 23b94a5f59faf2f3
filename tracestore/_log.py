"""Commit-log entries: encoding, decoding and checking (mirror images of each other).

An entry is an Arrow IPC file (``schemas.log_entry_schema()``) with two schema-metadata keys:

* ``tracestore.entry`` — compact JSON: ``format_version``, ``seq``, ``writer_id``, ``writer_seq``, ``segment``
  (key prefix of the segment group), ``rows``, ``chunk_rows``, ``shard_bytes``, ``created_unix``,
  ``segment_nbytes``;
* ``tracestore.crc32c`` — 8 lowercase hex digits: crc32c of the ``tracestore.entry`` bytes followed by the
  canonical column bytes (per column in schema order: strings as u32-LE length + UTF-8, int64 as LE bytes).

Readers check, in this order: the Arrow file decodes (truncation is caught by the IPC footer), the format
version is supported (:class:`SchemaVersionError`), the crc matches, the columns and the ``seq`` match the key
(:class:`IntegrityError` for everything else).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from schemas import log_entry_schema

from ._format import (
    ENTRY_CRC_KEY,
    ENTRY_META_KEY,
    FORMAT_VERSION,
    SUPPORTED_FORMAT_VERSIONS,
    check_id,
    log_key,
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
    extra: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.traj_ids)


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
        if isinstance(e, IntegrityError):
            raise
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


def entry_key(seq: int) -> str:
    return log_key(seq)
