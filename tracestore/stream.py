"""Streaming: tail the commit log from a resumable cursor and yield every committed record exactly once."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

from .batch import TraceBatch, read_record
from .errors import IntegrityError, ObjectNotFoundError, OptionTypeError, SnapshotError
from .format.cursor import encode_cursor, parse_cursor
from .format.keys import log_key
from .format.entries import LogEntry
from .records import CommittedRecord, CommittedResult, records_of

__all__ = ["Stream"]

log = logging.getLogger(__name__)

#: a tailing stream that keeps finding no next entry lists the log this often to tell a hole from the end
HOLE_CHECK_INTERVAL_S = 1.0


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

        Raises OptionTypeError (a TypeError) for a CommittedResult (it has no tokens; read the trajectory with a
        Reader)."""
        if not isinstance(record, CommittedRecord):
            raise OptionTypeError(f"stream.read takes a CommittedRecord, got {type(record).__name__} (a result has no "
                                  f"tokens)")
        return read_record(self.store, record, **kwargs)
