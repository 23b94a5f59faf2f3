"""The commit log of one store: its head, the decoded-entry cache and the checkpoints.

Entries are immutable and dense (``log/0 .. log/head-1``), so decoded entries are cached for the life of the
object and the head only grows. Writers, readers and streams of one :class:`~tracestore.store.Store` share its
:class:`CommitLog`; they tell it about entries they created or read with :meth:`CommitLog.note_head`.
"""

from __future__ import annotations

import logging
import threading

from .errors import IntegrityError, TraceStoreError
from .format.keys import FORMAT_VERSION, CHECKPOINT_MIN_ENTRIES, INDEX_PREFIX, LOG_PREFIX, checkpoint_key, log_key, parse_checkpoint_key, parse_log_key
from .format.entries import LogEntry, decode_checkpoint, decode_entry, encode_checkpoint
from .storage import Backend

__all__ = ["CommitLog"]

log = logging.getLogger(__name__)


class CommitLog:
    """The log of the store at ``url`` on ``backend`` (see the module docstring). Thread-safe."""

    def __init__(self, backend: Backend, url: str, format_version: int = FORMAT_VERSION):
        self.backend = backend
        self.url = url
        self.format_version = format_version  # of the store: its checkpoints are written in it
        self._head = 0  # entries < _head are known to exist
        self._entries: list[LogEntry] = []  # decoded entries 0..n-1
        self._cache_lock = threading.Lock()

    def _exists_entry(self, seq: int) -> bool:
        return self.backend.exists(log_key(seq))

    def head(self) -> int:
        """Number of committed log entries: ``log/0 .. log/head-1`` exist and no entry exists after them.

        Found by galloping + binary search over ``exists`` from the last known head (O(log n) requests), then
        confirmed with one listing of the log after the candidate (S3: one ``ListObjectsV2`` with ``StartAfter``):
        an entry after a missing one means a hole, never the end of the log (FORMAT §7).

        Raises:
            IntegrityError: a log entry is missing while later ones exist (a hole).
            BackendError: the storage could not answer (after retries); never read as "absent".
        """
        lo = self._head  # invariant: entries < lo exist
        while True:
            h = self._probe_head(lo)
            later = self._entries_after(h)
            if not later:
                self.note_head(h)
                return h
            # an entry after h: h was committed since it was probed (a race), or h is a hole
            if self._exists_entry(h):
                lo = h + 1
                continue
            raise IntegrityError(
                f"log entry {self.url}/{log_key(h)} is missing but later entries exist "
                f"({', '.join(log_key(n) for n in later[:3])}): a hole in the log, which hides every entry after it "
                f"(FORMAT §7); restore the entry from a backup or a checkpoint (index/) before reading or writing")

    def _probe_head(self, lo: int) -> int:
        """First absent position >= ``lo`` found by galloping + bisection (entries < ``lo`` are known to exist)."""
        if not self._exists_entry(lo):
            return lo
        step = 1
        while self._exists_entry(lo + step):
            lo += step
            step *= 2
        hi = lo + step  # lo exists, hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._exists_entry(mid):
                lo = mid
            else:
                hi = mid
        return hi

    def _entries_after(self, seq: int) -> list[int]:
        """Positions of log entries after ``log_key(seq)`` (one listing; empty when the backend cannot list)."""
        if not self.backend.supports_listing:
            return []
        keys = self.backend.list_after(LOG_PREFIX, log_key(seq), limit=16)
        return [n for k in keys if (n := parse_log_key(k)) is not None and n > seq]

    @property
    def known_head(self) -> int:
        """The largest log head seen so far (no request): entries below it exist."""
        return self._head

    def note_head(self, n: int) -> None:
        """Record that entries ``< n`` exist (a writer that just committed ``n - 1``, a reader that read it)."""
        self._head = max(self._head, n)

    def read_entry(self, seq: int, *, cached: bool = True) -> LogEntry:
        """Decode log entry ``seq`` (``cached=False``: re-read and re-check the stored bytes).

        Raises ObjectNotFoundError if absent, IntegrityError / SchemaVersionError."""
        with self._cache_lock:
            if cached and seq < len(self._entries):
                return self._entries[seq]
        key = log_key(seq)
        data = self.backend.get(key)
        return decode_entry(data, seq, f"{self.url}/{key}")

    def read_entries(self, lo: int, hi: int) -> list[LogEntry]:
        """Entries ``[lo, hi)``, fetched concurrently (and cached: entries are immutable).

        Raises IntegrityError if one is missing, or as :func:`decode_entry`."""
        with self._cache_lock:
            have = len(self._entries)
        if have < hi and hi - have >= CHECKPOINT_MIN_ENTRIES and lo <= have:
            self._load_checkpoint(hi)
        with self._cache_lock:
            cached = self._entries[lo:min(hi, len(self._entries))]
        out: list[LogEntry] = list(cached)
        batch = 256
        for b0 in range(lo + len(cached), hi, batch):
            seqs = list(range(b0, min(hi, b0 + batch)))
            keys = [log_key(s) for s in seqs]
            datas = self.backend.get_many(keys)
            for seq, key, data in zip(seqs, keys, datas):
                if data is None:
                    raise IntegrityError(f"log entry {self.url}/{key} is missing below the log head")
                out.append(decode_entry(data, seq, f"{self.url}/{key}"))
        with self._cache_lock:
            if lo <= len(self._entries) < hi:  # extend the dense cached prefix
                self._entries.extend(out[len(self._entries) - lo:])
        self.note_head(hi)
        return out

    def checkpoints(self) -> list[int]:
        """``log_end`` of every checkpoint object (``index/<log_end>.parquet``), ascending (one listing)."""
        if not self.backend.supports_listing:
            return []
        return sorted(n for o in self.backend.list(INDEX_PREFIX) if (n := parse_checkpoint_key(o.key)) is not None)

    def _load_checkpoint(self, hi: int) -> None:
        """Fill the entry cache from the newest usable checkpoint with ``log_end <= hi`` (if it saves reads).
        A checkpoint that fails its checks is skipped with a warning: the log entries are the source of truth."""
        try:
            ends = [n for n in self.checkpoints() if n <= hi]
        except TraceStoreError as e:
            log.warning("%s: cannot list checkpoints: %s", self.url, e)
            return
        with self._cache_lock:
            have = len(self._entries)
        for n in reversed(ends):
            if n - have < CHECKPOINT_MIN_ENTRIES:
                return
            key = checkpoint_key(n)
            try:
                entries = decode_checkpoint(self.backend.get(key), n, f"{self.url}/{key}")
            except TraceStoreError as e:  # IntegrityError, SchemaVersionError, BackendError
                log.warning("ignoring checkpoint %s/%s: %s", self.url, key, e)
                continue
            with self._cache_lock:
                if len(self._entries) < n:
                    self._entries = entries
            self.note_head(n)
            return

    def compact(self) -> int | None:
        """Write a checkpoint of the whole log (``index/<head>.parquet``) so that new readers and writers load
        one object instead of one per entry. Returns its ``log_end``, or None when the log is empty or a
        checkpoint at the head exists. Safe to run concurrently with writers (the checkpoint is immutable and
        covers a prefix of the log)."""
        head = self.head()
        if head == 0:
            return None
        key = checkpoint_key(head)
        if self.backend.exists(key):
            return None
        data = encode_checkpoint(self.read_entries(0, head), self.format_version)
        return head if self.backend.put_if_absent(key, data) else None
