"""A writer's rows until they are committed (FORMAT §4: "a writer buffers rows in two buffers").

* :class:`Stage` — one buffer: a preallocated ``[capacity, *row_shape]`` array per stored column, filled row by row,
  a growing byte buffer per margin site (its variable-length rows back to back; the row ends are a column), the
  records (token ranges) its rows hold, the crc32c of every whole chunk computed as rows arrive, and the
  trajectory results to commit after its rows;
* :class:`RowBuffer` — the stage being filled and a spare (the other buffer is with the flusher), the token ranges
  buffered (``pending``) and the trajectories whose result is buffered;
* :class:`TokenRanges` — sorted, non-overlapping token ranges per trajectory (buffered ones here; committed ones in
  :class:`~tracestore.commit.Committer`).

Nothing here does I/O; :mod:`tracestore.commit` writes and commits a stage.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from ._aligned import PAGE, aligned_empty
from ._rows import host_rows
from .format.entries import Record, Result, merge_ranges
from .format.keys import MAX_MARGIN_SEGMENT_BYTES

__all__ = ["Stage", "SegmentWrite", "RowBuffer", "TokenRanges"]


#: where staging arrays start relative to a page boundary (see _staging_array)
_STAGING_OFFSET = PAGE - 64


def _staging_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An empty array that starts :data:`_STAGING_OFFSET` bytes past a page boundary (:mod:`._aligned`).

    Inner chunk ``k`` of a shard sits at file offset ``k * (chunk bytes + 4)``; with chunk sizes a multiple of the
    page size its source starts at the array's page offset, so an array starting 64 bytes before a page boundary
    keeps every chunk of shards up to ~1000 chunks out of the slow band (numpy's 16-byte offset hit chunks 5-11)."""
    dtype = np.dtype(dtype)
    return aligned_empty(math.prod(shape) * dtype.itemsize, _STAGING_OFFSET).view(dtype).reshape(shape)


@dataclass
class SegmentWrite:
    """A segment written for a stage: kept across failed commit tries so a retry commits it again (no orphan per
    try), unless a gc entry names it meanwhile (then it is written again under a new name)."""

    path: str
    nbytes: int
    rows: int
    chunk_rows: int


class Stage:
    """The write buffer: one preallocated ``[capacity, *row_shape]`` array per segment array, filled row by
    row, and the records (token ranges) whose rows it holds. A flush encodes straight from these arrays."""

    def __init__(self, columns: Mapping, capacity: int, crc_rows: int = 0, margin: Mapping | None = None,
                 budget: int = 0):
        self.capacity = capacity
        self.arrays = {n: _staging_array((capacity, *shape), dtype) for n, (dtype, shape) in columns.items()}
        #: margin site -> its row ends column (FORMAT §2.3); the rows' bytes go to ``margin_data[site]``
        self.margin_ends: dict[str, str] = dict(margin or {})
        self.margin_data: dict[str, np.ndarray] = {m: np.empty(0, np.uint8) for m in self.margin_ends}
        self.margin_len: dict[str, int] = dict.fromkeys(self.margin_ends, 0)
        #: row bytes (fixed columns + margin rows) at which the stage is full; 0: rows alone decide
        self.budget = budget
        self.row_nbytes = sum(int(a[0].nbytes) for a in self.arrays.values()) if capacity else 0
        self.rows = 0
        self.records: list[Record] = []
        self.segment: SegmentWrite | None = None  # written, not yet committed
        self.rows_committed = False  # the rows are committed; only the results are left
        self.results: list[Result] = []  # trajectory results, committed after the rows
        self.results_batch = ""  # the results entry's batch id (kept across retries)
        # crc32c of every whole chunk of ``crc_rows`` rows of each column, computed right after its rows were
        # copied in (while they are in cache; the flusher then has no checksum pass over memory), and the
        # running crc of each column's incomplete chunk. Used when the segment's chunk_rows is ``crc_rows``.
        self.crc_rows = crc_rows
        self._bytes = {n: memoryview(a.reshape(-1).view(np.uint8)) for n, a in self.arrays.items()}
        self._row_nbytes = {n: a[0].nbytes for n, a in self.arrays.items()}
        self.crcs: dict[str, list[int]] = {n: [] for n in self.arrays}
        self._crc_run: dict[str, int] = dict.fromkeys(self.arrays, 0)

    def chunk_crcs(self, name: str, r: int, n: int) -> tuple[list[int], int]:
        """Checksums of column ``name`` after rows ``[r, r + n)`` (the next rows) were copied in, without changing
        state: (crcs of the chunks they complete, running crc of the chunk they leave incomplete)."""
        cr, rb, mv = self.crc_rows, self._row_nbytes[name], self._bytes[name]
        done: list[int] = []
        if not cr:
            return done, 0
        run = self._crc_run[name]
        pos, end = r, r + n
        while pos < end:
            stop = min(end, (pos // cr + 1) * cr)
            run = _crc32c.crc32c(mv[pos * rb : stop * rb], run if pos % cr else 0)
            if stop % cr == 0:
                done.append(run)
                run = 0
            pos = stop
        return done, run

    @property
    def margin_nbytes(self) -> int:
        """Bytes of margin rows buffered (all margin sites)."""
        return sum(self.margin_len.values())

    @property
    def nbytes(self) -> int:
        """Row bytes buffered: fixed columns and margin rows."""
        return self.rows * self.row_nbytes + self.margin_nbytes

    def fit(self, margin: Mapping, s: int, n: int) -> int:
        """How many of the next ``n`` rows (``[s, s + n)`` of a write whose margin rows are ``margin``: site ->
        (data, offsets [T + 1])) fit: the stage's bytes stay within its budget and each margin site's rows within
        the uint32 row ends (FORMAT §2.3). An empty stage takes at least one row."""
        cum = np.zeros(n + 1, np.int64)
        k = n
        for site, (_data, off) in margin.items():
            part = off[s:s + n + 1] - off[s]
            cum += part
            k = min(k, int(np.searchsorted(part, MAX_MARGIN_SEGMENT_BYTES - self.margin_len[site], side="right")) - 1)
        if self.budget:
            total = self.margin_nbytes + cum + (self.rows + np.arange(n + 1, dtype=np.int64)) * self.row_nbytes
            k = min(k, int(np.searchsorted(total, self.budget, side="right")) - 1)
        return max(k, 1 if self.rows == 0 else 0)

    def add_margin(self, margin: Mapping, r: int, s: int, n: int) -> None:
        """Copy the margin rows ``[s, s + n)`` of a write to the end of each site's bytes and their ends (relative
        to the segment's bytes of the site, uint32) to rows ``[r, r + n)`` of its ends column."""
        for site, (data, off) in margin.items():
            a, b = int(off[s]), int(off[s + n])
            have, buf = self.margin_len[site], self.margin_data[site]
            if have + (b - a) > buf.size:
                grown = np.empty(max(2 * buf.size, have + (b - a), 1 << 16), np.uint8)
                grown[:have] = buf[:have]
                self.margin_data[site] = buf = grown
            buf[have:have + (b - a)] = data[a:b]
            self.arrays[self.margin_ends[site]][r:r + n] = off[s + 1:s + n + 1] - a + have

    def commit_margin(self, margin: Mapping, s: int, n: int) -> None:
        """Count the rows copied by :meth:`add_margin` as the stage's."""
        for site, (_data, off) in margin.items():
            self.margin_len[site] += int(off[s + n] - off[s])

    def add_crcs(self, name: str, done: list[int], run: int) -> None:
        self.crcs[name].extend(done)
        self._crc_run[name] = run

    def add_record(self, traj_id: str, start: int, stop: int, row: int, policy_version: int) -> None:
        assert stop > start, (traj_id, start, stop)  # an empty record would make a log entry invalid
        last = self.records[-1] if self.records else None
        if last and last.traj_id == traj_id and last.token_stop == start and last.policy_version == policy_version \
                and last.row_offset + (last.token_stop - last.token_start) == row:
            self.records[-1] = last._replace(token_stop=stop)  # adjacent rows of one trajectory: one record
        else:
            self.records.append(Record(traj_id, start, stop, row, policy_version))

    def reset(self) -> None:
        self.rows = 0
        self.records = []
        self.segment = None
        self.rows_committed = False
        self.results = []
        self.results_batch = ""
        self.crcs = {n: [] for n in self.arrays}
        self._crc_run = dict.fromkeys(self.arrays, 0)
        self.margin_len = dict.fromkeys(self.margin_ends, 0)


class RowBuffer:
    """The rows of one writer that are not handed to the commit yet (see the module docstring). Not thread-safe:
    the writer holds its lock around every call, and its state lock around :attr:`pending` and
    :attr:`pending_results`, which the flusher thread also changes."""

    def __init__(self, columns: Mapping, capacity: int, crc_rows: int, margin: Mapping | None = None,
                 budget: int = 0):
        self.columns = columns  # name -> (dtype, row shape) of every stored column (Store.row_columns)
        self.capacity = capacity  # rows per stage
        self.margin = dict(margin or {})  # margin site -> its row ends column
        self.budget = budget  # row bytes per stage (with margin sites: rows vary, the bytes decide)
        # checksums of whole chunks as rows arrive (0: at flush; with column chunks a site's inner chunk is not a
        # run of its rows)
        self.crc_rows = crc_rows
        self.stage: Stage | None = None  # the one being filled, created on first use
        self.spare: Stage | None = None
        self.oldest: float | None = None  # monotonic time of the oldest row or result in the filling stage
        self.pending = TokenRanges()  # token ranges buffered (in any stage) and not yet committed
        self.pending_results: set[str] = set()  # trajectories whose result is buffered

    @property
    def rows(self) -> int:
        """Rows in the filling stage."""
        return 0 if self.stage is None else self.stage.rows

    @property
    def nbytes(self) -> int:
        """Row bytes in the filling stage (fixed columns and margin rows)."""
        return 0 if self.stage is None else self.stage.nbytes

    @property
    def has_data(self) -> bool:
        """Whether the filling stage holds rows or results."""
        return self.stage is not None and bool(self.stage.rows or self.stage.results)

    def current(self) -> Stage:
        """The filling stage (created on first use)."""
        if self.stage is None:
            self.stage = Stage(self.columns, self.capacity, self.crc_rows, self.margin,
                               self.budget if self.margin else 0)
        return self.stage

    def take(self) -> Stage:
        """Hand the filling stage on; the spare (or a new stage, at first use) is filled from here on."""
        stage, self.stage, self.spare = self.stage, self.spare, None
        self.oldest = None
        return stage

    def recycle(self, stage: Stage) -> None:
        """A stage whose rows and results are committed: empty, and the spare if there is none."""
        stage.reset()
        if self.spare is None:
            self.spare = stage

    def add_result(self, result: Result) -> None:
        self.current().results.append(result)
        if self.oldest is None:
            self.oldest = time.monotonic()

    def append(self, traj_id: str, token_start: int, s: int, T: int, columns: dict, policy_version: int,
               done: list, handoff: Callable[[], None], margin: Mapping | None = None) -> None:
        """Copy rows ``[s, T)`` of the checked ``columns`` and ``margin`` rows (tokens ``token_start + s ..``) into
        the filling stage, calling ``handoff()`` whenever it is full; ``done[0]`` says how far the copy got (when
        ``handoff`` raises, the rows before it are buffered, the others are not)."""
        while s < T:
            stage = self.current()
            if stage.rows >= stage.capacity:
                # still full: handing it on failed before (the previous commit failed); try again, now that
                # nothing of these rows is in it (raises, with these rows unbuffered, if it fails again)
                handoff()
                continue
            room = min(T - s, stage.capacity - stage.rows)
            n = stage.fit(margin, s, room) if margin else room
            if n == 0:  # the stage's bytes are full (margin rows)
                handoff()
                continue
            r = stage.rows
            crcs = []
            if margin:
                stage.add_margin(margin, r, s, n)
                crcs.extend((name, *stage.chunk_crcs(name, r, n)) for name in stage.margin_ends.values())
            for name, (src, _dtype) in columns.items():
                dst = stage.arrays[name][r:r + n]
                if name == "experts":
                    for k, a in enumerate(src):
                        dst[:, k, :] = host_rows(a, s, s + n)  # [n, top_k] -> layer k of [n, L, top_k]
                else:
                    dst[...] = host_rows(src, s, s + n)
                crcs.append((name, *stage.chunk_crcs(name, r, n)))  # while the rows are in cache
            for name, done_crcs, run in crcs:  # every column copied: the rows are the stage's now
                stage.add_crcs(name, done_crcs, run)
            if margin:
                stage.commit_margin(margin, s, n)
            stage.rows += n
            stage.add_record(traj_id, token_start + s, token_start + s + n, r, policy_version)
            if self.oldest is None:
                self.oldest = time.monotonic()
            s += n
            done[0] = s
            if stage.rows >= stage.capacity or n < room:
                handoff()


class TokenRanges:
    """Sorted, non-overlapping token ranges per trajectory with overlap queries."""

    def __init__(self) -> None:
        self._starts: dict[str, list[int]] = {}
        self._stops: dict[str, list[int]] = {}

    def overlaps(self, traj: str, s: int, e: int) -> tuple[int, int] | None:
        starts = self._starts.get(traj)
        if not starts:
            return None
        stops = self._stops[traj]
        i = bisect.bisect_right(starts, s) - 1
        if i >= 0 and stops[i] > s:
            return starts[i], stops[i]
        if i + 1 < len(starts) and starts[i + 1] < e:
            return starts[i + 1], stops[i + 1]
        return None

    def covered(self, traj: str, s: int, e: int) -> bool:
        starts = self._starts.get(traj)
        if not starts:
            return False
        stops = self._stops[traj]
        i = bisect.bisect_right(starts, s) - 1
        while i >= 0 and i < len(starts) and starts[i] <= s:
            if stops[i] >= e:
                return True
            if stops[i] <= s:
                return False
            s = stops[i]
            i += 1
        return False

    def add(self, traj: str, s: int, e: int) -> None:
        starts = self._starts.setdefault(traj, [])
        stops = self._stops.setdefault(traj, [])
        i = bisect.bisect_left(starts, s)
        starts.insert(i, s)
        stops.insert(i, e)

    def uncovered(self, traj: str, s: int, e: int) -> list[tuple[int, int]]:
        """The parts of ``[s, e)`` that no range of ``traj`` covers, in order."""
        starts = self._starts.get(traj)
        if not starts:
            return [(s, e)]
        stops = self._stops[traj]
        i = max(0, bisect.bisect_right(starts, s) - 1)
        out, pos = [], s
        while i < len(starts) and starts[i] < e:
            if stops[i] > pos:
                if starts[i] > pos:
                    out.append((pos, starts[i]))
                pos = max(pos, stops[i])
            i += 1
        if pos < e:
            out.append((pos, e))
        return out

    def subtract(self, traj: str, s: int, e: int) -> None:
        """Remove ``[s, e)`` from the ranges of ``traj`` (splitting ranges that straddle it)."""
        starts, stops = self._starts.get(traj), self._stops.get(traj)
        if not starts:
            return
        keep = []
        for a, b in zip(starts, stops):
            if b <= s or a >= e:
                keep.append((a, b))
                continue
            if a < s:
                keep.append((a, s))
            if b > e:
                keep.append((e, b))
        if keep:
            self._starts[traj] = [a for a, _ in keep]
            self._stops[traj] = [b for _, b in keep]
        else:
            del self._starts[traj], self._stops[traj]

    def get(self, traj: str) -> list[tuple[int, int]]:
        return merge_ranges(zip(self._starts.get(traj, []), self._stops.get(traj, [])))
