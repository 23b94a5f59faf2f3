"""Streaming: tail the commit log from a resumable cursor and yield every committed record exactly once."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from .errors import IntegrityError, InvalidIdError, ObjectNotFoundError, SnapshotError
from .format.cursor import encode_cursor, parse_cursor
from .format.keys import INT64_MAX, INT64_MIN, check_id, is_int, log_key
from .format.log import LogEntry, Result, SegmentRef
from .reader import TraceBatch, read_record

__all__ = ["Stream", "CommittedRecord", "CommittedResult", "records_of"]

log = logging.getLogger(__name__)

#: a tailing stream that keeps finding no next entry lists the log this often to tell a hole from the end
HOLE_CHECK_INTERVAL_S = 1.0


@dataclass(frozen=True)
class CommittedRecord:
    """A committed token range ``[token_start, token_stop)`` of ``traj_id``: record ``index`` of log entry ``seq``."""

    traj_id: str
    token_start: int
    token_stop: int
    policy_version: int
    writer_id: str
    seq: int
    index: int
    row_offset: int
    segment: SegmentRef = field(repr=False)
    created_unix: float = 0.0

    #: what a stream item is: "record" (tokens) or "result" (a trajectory became complete)
    kind = "record"

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start

    def to_json(self) -> list:
        """The record as a JSON list (what trainer checkpoints store; :meth:`from_json` reads it back):
        ``[traj_id, token_start, token_stop, policy_version, writer_id, seq, index, row_offset,
        [segment.path, segment.writer_id, segment.rows, segment.chunk_rows, segment.shard_bytes], created_unix]``."""
        s = self.segment
        return [self.traj_id, self.token_start, self.token_stop, self.policy_version, self.writer_id, self.seq,
                self.index, self.row_offset, [s.path, s.writer_id, s.rows, s.chunk_rows, s.shard_bytes],
                self.created_unix]

    @classmethod
    def from_json(cls, v: object) -> CommittedRecord:
        """The record of a :meth:`to_json` list, every field checked (ids as FORMAT §2.1, token positions and row
        numbers as a log entry's, the segment path ``data/<writer_id>/<segment_id>``).

        Raises:
            IntegrityError: ``v`` is not such a list (says which field arrived as what, and what is allowed).
        """
        def bad(what: str) -> IntegrityError:
            return IntegrityError(f"not a committed record: {what}; expected [traj_id, token_start, token_stop, "
                                  f"policy_version, writer_id, seq, index, row_offset, [segment path, writer_id, "
                                  f"rows, chunk_rows, shard_bytes], created_unix], got {v!r:.200}")

        if not isinstance(v, (list, tuple)) or len(v) != 10:
            raise bad("a list of 10 values is needed")
        traj, start, stop, pv, wid, seq, index, row, seg, created = v
        if not isinstance(seg, (list, tuple)) or len(seg) != 5:
            raise bad("the segment must be a list of 5 values")
        path, seg_wid, rows, chunk_rows, shard_bytes = seg
        ints = {"token_start": (start, 0), "seq": (seq, 0), "index": (index, 0), "row_offset": (row, 0),
                "token_stop": (stop, start + 1 if is_int(start) else 1), "segment rows": (rows, 1),
                "chunk_rows": (chunk_rows, 1), "shard_bytes": (shard_bytes, 1), "policy_version": (pv, INT64_MIN)}
        for name, (value, lo) in ints.items():
            if not is_int(value) or not lo <= value <= INT64_MAX:
                raise bad(f"{name} must be an int in [{lo}, 2**63 - 1], got {value!r:.40}")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            raise bad(f"created_unix must be a finite number, got {created!r:.40}")
        try:
            check_id(traj)
            check_id(wid, "writer id")
            parts = path.split("/") if isinstance(path, str) else []
            if len(parts) != 3 or parts[0] != "data" or parts[1] != wid or seg_wid != wid:
                raise bad(f"the segment path must be data/<writer_id>/<segment_id> of writer {wid!r}, got "
                          f"{path!r:.80} (writer {seg_wid!r:.40})")
            check_id(parts[2], "segment id")
        except InvalidIdError as e:
            raise bad(str(e)) from e
        return cls(traj, int(start), int(stop), int(pv), wid, int(seq), int(index), int(row),
                   SegmentRef(path, wid, int(rows), int(chunk_rows), int(shard_bytes)), float(created))


@dataclass(frozen=True)
class CommittedResult:
    """A committed trajectory result (format version 2): item ``index`` of results entry ``seq``. From here on the
    trajectory is complete; every token its writer buffered before the result was committed earlier in the log."""

    traj_id: str
    result: Result
    writer_id: str
    seq: int
    index: int
    created_unix: float = 0.0

    kind = "result"

    @property
    def reward(self) -> float:
        return self.result.reward


def records_of(entry: LogEntry) -> list[CommittedRecord | CommittedResult]:
    """What a stream yields of a log entry, in order: its records (CommittedRecord), or its results
    (CommittedResult)."""
    if entry.results:
        return [CommittedResult(r.traj_id, r, entry.writer_id, entry.seq, i, entry.created_unix)
                for i, r in enumerate(entry.results)]
    return [CommittedRecord(r.traj_id, r.token_start, r.token_stop, r.policy_version, entry.writer_id, entry.seq, i,
                            r.row_offset, entry.segment, entry.created_unix)
            for i, r in enumerate(entry.records())]


class Stream:
    """Tails the commit log: yields every committed item exactly once, in log order — a :class:`CommittedRecord`
    per committed token range and (format version 2) a :class:`CommittedResult` per committed trajectory result
    (check ``item.kind``: ``"record"`` / ``"result"``).

    ``cursor`` is a small string (``"v1:<store_id>:<seq>:<index>"``) naming the next record to yield; pass
    :attr:`cursor` to :meth:`Store.stream` to resume exactly after the last record consumed. Iteration waits for
    new entries by polling ``log/<seq>`` (a GET, no listing); it ends (StopIteration) once ``timeout_s`` passes
    without a new record (``None``: never). Iterating again continues from the cursor.

    Raises (constructor): SnapshotError (malformed cursor, another store's, or past the log head: an entry
    beyond the head, or an index beyond its entry's records), SchemaVersionError (unknown cursor version).
    """

    def __init__(self, store, cursor: str | None = None, *, poll_interval_s: float = 0.05,
                 timeout_s: float | None = None):
        self.store = store
        self.poll_interval_s = float(poll_interval_s)
        self.timeout_s = timeout_s
        self._records: list[CommittedRecord] | None = None
        self._caught_up = False
        self._prefetched: dict[int, LogEntry] = {}
        self._hole_checked = -float("inf")
        self._seq, self._index = (0, 0) if cursor is None else self._parse(cursor)

    def _parse(self, cursor: str) -> tuple[int, int]:
        seq, index = parse_cursor(cursor, self.store.store_id, self.store.url)
        self._check_position(cursor, seq, index)
        return seq, index

    def _check_position(self, cursor: str, seq: int, index: int) -> None:
        """Reject a cursor past the log head (FORMAT §7): it names record ``index`` of entry ``seq``, so it must
        satisfy ``seq < head`` and ``index <= `` the entry's record count, or be ``(head, 0)``."""
        store = self.store
        head = store.head()
        if seq > head or (seq == head and index > 0):
            raise SnapshotError(
                f"cursor {cursor!r:.80} is past the log head of {store.url}: it names record {index} of log entry "
                f"{seq}, but the log has {head} entries (allowed: seq < {head} with index up to the entry's "
                f"record count, or seq {head} with index 0)")
        if index > 0:
            entry = store.read_entry(seq)
            n = len(entry) + len(entry.results)
            if index > n:
                raise SnapshotError(
                    f"cursor {cursor!r:.80} is past the end of log entry {seq} in {store.url}: it names record "
                    f"{index}, the entry holds {n} records (allowed: index 0..{n})")
            self._prefetched[seq] = entry  # the first entry the stream reads: no second GET

    @property
    def cursor(self) -> str:
        """Position of the next record (serializable; resume with ``store.stream(cursor)``)."""
        return encode_cursor(self.store.store_id, self._seq, self._index)

    def __iter__(self) -> Iterator[CommittedRecord]:
        return self

    def _load(self) -> bool:
        """Load entry ``self._seq`` if committed; False if not (yet)."""
        store = self.store
        entry = self._prefetched.pop(self._seq, None)
        if entry is None and not self._caught_up:
            # catching up on a long log: fetch entries in batches (and from a checkpoint), not one GET each
            head = store.head()
            if head - self._seq > 1:
                batch = store.read_entries(self._seq, min(head, self._seq + 4096))
                self._prefetched = {e.seq: e for e in batch}
                entry = self._prefetched.pop(self._seq)
            else:
                self._caught_up = True
        if entry is None:
            known = store.known_head  # taken before the GET: an entry committed after it may be noted meanwhile
            try:
                entry = store.read_entry(self._seq)
            except ObjectNotFoundError:
                if self._seq < known:
                    raise IntegrityError(
                        f"log entry {store.url}/{log_key(self._seq)} is missing below the log head "
                        f"({known} entries): a hole in the log (FORMAT §7)") from None
                now = time.monotonic()
                if now - self._hole_checked >= HOLE_CHECK_INTERVAL_S:
                    # a missing entry with later ones after it is a hole, not the end: head() lists past it
                    self._hole_checked = now
                    store.head()
                self._caught_up = True
                return False
        self._records = records_of(entry)  # (self._index <= len(self._records): checked with the cursor)
        self.store.log.note_head(self._seq + 1)
        return True

    def _take(self) -> CommittedRecord | None:
        while True:
            if self._records is None and not self._load():
                return None
            assert self._records is not None
            if self._index < len(self._records):
                rec = self._records[self._index]
                self._index += 1
                if self._index == len(self._records):
                    self._seq, self._index, self._records = self._seq + 1, 0, None
                return rec
            self._seq, self._index, self._records = self._seq + 1, 0, None

    def __next__(self) -> CommittedRecord | CommittedResult:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            rec = self._take()
            if rec is not None:
                return rec
            if deadline is not None and time.monotonic() >= deadline:
                raise StopIteration
            time.sleep(self.poll_interval_s)

    def poll(self, max_records: int | None = None) -> list[CommittedRecord | CommittedResult]:
        """The items committed now (without waiting), at most ``max_records``."""
        out: list[CommittedRecord | CommittedResult] = []
        while max_records is None or len(out) < max_records:
            rec = self._take()
            if rec is None:
                break
            out.append(rec)
        return out

    def read(self, record: CommittedRecord, **kwargs) -> TraceBatch:
        """Read a record's tokens (keyword arguments as :meth:`Reader.read`, without start/stop).

        Raises TypeError for a CommittedResult (it has no tokens; read the trajectory with a Reader)."""
        if not isinstance(record, CommittedRecord):
            raise TypeError(f"stream.read takes a CommittedRecord, got {type(record).__name__} (a result has no tokens)")
        return read_record(self.store, record, **kwargs)
