"""The writer: validates per-token hints and traces, buffers them, writes whole segments, commits through the log.

Life of a write::

    write(traj, start, hints=..., ...)   validate everything (dtype, shape, sites, ids, overlap) -> buffer a copy
    ... buffer reaches commit_bytes, or commit_interval_s passed, or flush()/close()
    flush:  1. segment = one Zarr v3 group data/<writer_id>/<seq>-<random>/ ; every array written whole, once
            2. commit  = put-if-absent of log/<N> (N = first free log position), after re-checking the records
                         against every entry < N; on a lost race read entry N and try N+1

A record becomes visible exactly when its log entry exists. A writer killed before step 2 leaves an unreferenced
segment (invisible; ``collect_garbage`` removes it); one killed after step 2 has committed.

Flushes run on a background thread while the caller keeps writing into a second buffer (generation does not
stall on storage); each buffer holds ``min(commit_bytes, max_buffer_bytes / 2)`` bytes of rows, so buffered
rows never exceed ``max_buffer_bytes``. Commits of one writer happen in order.
"""

from __future__ import annotations

import bisect
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import crc32c as _crc32c
import numpy as np

from ._closing import Closing
from ._aligned import PAGE, aligned_empty
from .format.keys import check_id, log_key
from .format.entries import RESULTS, LogEntry, Record, Result, SegmentRef, check_result, decode_entry, encode_entry, merge_ranges
from .format.segment import array_metadata, choose_chunk_rows, group_metadata, layout
from .errors import (
    BackendError,
    CommitError,
    DTypeError,
    ObjectNotFoundError,
    OverlapError,
    ResultExistsError,
    SchemaVersionError,
    ShapeError,
    TraceStoreError,
    TransientStorageError,
    UnknownSiteError,
)

__all__ = ["Writer"]

log = logging.getLogger(__name__)

_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)
_F32_MAX = float(np.finfo(np.float32).max)


def _default_writer_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:60] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _is_torch(x) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "detach")


def _shape(x) -> tuple[int, ...]:
    return tuple(int(d) for d in x.shape)


def _kind(x) -> str:
    """'u' (unsigned int), 'i' (signed int), 'f' (float), 'b' (bool) or other numpy kind of an array/tensor."""
    if _is_torch(x):
        import torch

        if x.dtype == torch.bool:
            return "b"
        if x.dtype.is_floating_point:
            return "f"
        if x.dtype.is_complex:
            return "c"
        return "u" if x.dtype == torch.uint8 else "i"
    return np.asarray(x).dtype.kind


def _dtype_name(x) -> str:
    return str(x.dtype)


def _as_array(x, what: str):
    if _is_torch(x) or isinstance(x, np.ndarray):
        return x
    if isinstance(x, (list, tuple)):
        return np.asarray(x)
    raise DTypeError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def _is_u8(x) -> bool:
    """Whether ``x`` (numpy array or torch tensor) is uint8, without formatting the dtype (str() is slow)."""
    dt = x.dtype
    return dt == np.uint8 if isinstance(dt, np.dtype) else str(dt) == "torch.uint8"


def _fits(x, lo: int, hi: int) -> bool:
    """Whether the integer dtype of ``x`` alone guarantees ``lo <= x <= hi`` (then no min/max pass is needed:
    uint8 experts of <= 256 experts, int32 token ids)."""
    if _is_torch(x):
        import torch

        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            return False
        info = torch.iinfo(x.dtype)
    else:
        if x.dtype.kind not in "iu":
            return False
        info = np.iinfo(x.dtype)
    return info.min >= lo and info.max <= hi


def _check_float32_range(x, what: str) -> None:
    """Finite values beyond float32's range would silently become +-inf when stored as float32: refuse them
    (NaN and +-inf pass through unchanged)."""
    if _is_torch(x):
        import torch

        if x.dtype != torch.float64:
            return
        finite = x[torch.isfinite(x)]
        big = float(finite.abs().max().item()) if finite.numel() else 0.0
    else:
        if np.asarray(x).dtype.itemsize <= 4:
            return
        a = np.asarray(x, dtype=np.float64)
        finite = a[np.isfinite(a)]
        big = float(np.abs(finite).max()) if finite.size else 0.0
    if big > _F32_MAX:
        raise DTypeError(f"{what} holds {big!r}, beyond float32's range (max {_F32_MAX:.4g}); values are stored as "
                         f"float32")


def _minmax(x) -> tuple[float, float]:
    if _is_torch(x):
        return float(x.min().item()), float(x.max().item())
    return float(np.min(x)), float(np.max(x))


def _host(x, s: int, e: int):
    """Rows ``[s, e)`` of ``x`` as a host numpy array (a view for numpy and CPU tensors; CUDA rows are copied)."""
    if _is_torch(x):
        import torch

        t = x[s:e].detach()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()
        return t.cpu().numpy()
    return x[s:e]


#: where staging arrays start relative to a page boundary (see _staging_array)
_STAGING_OFFSET = PAGE - 64


def _staging_array(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An empty array that starts :data:`_STAGING_OFFSET` bytes past a page boundary (:mod:`._aligned`).

    Inner chunk ``k`` of a shard sits at file offset ``k * (chunk bytes + 4)``; with chunk sizes a multiple of the
    page size its source starts at the array's page offset, so an array starting 64 bytes before a page boundary
    keeps every chunk of shards up to ~1000 chunks out of the slow band (numpy's 16-byte offset hit chunks 5-11)."""
    dtype = np.dtype(dtype)
    return aligned_empty(math.prod(shape) * dtype.itemsize, _STAGING_OFFSET).view(dtype).reshape(shape)


class _Again(Exception):
    """Raised by a commit's entry builder to start the claim over (after writing its segment again)."""


@dataclass
class _SegmentWrite:
    """A segment written for a stage: kept across failed commit tries so a retry commits it again (no orphan per
    try) as long as it is younger than half the gc grace period (``started``: monotonic time of its first write)."""

    path: str
    nbytes: int
    rows: int
    chunk_rows: int
    started: float


class _Staging:
    """The write buffer: one preallocated ``[capacity, *row_shape]`` array per segment array, filled row by
    row, and the records (token ranges) whose rows it holds. A flush encodes straight from these arrays."""

    def __init__(self, columns: Mapping, capacity: int, crc_rows: int = 0):
        self.capacity = capacity
        self.arrays = {n: _staging_array((capacity, *shape), dtype) for n, (dtype, shape) in columns.items()}
        self.rows = 0
        self.records: list[Record] = []
        self.segment: _SegmentWrite | None = None  # written, not yet committed
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


def _check_position(token_start: object, policy_version: object) -> tuple[int, int]:
    """``token_start`` in ``[0, 2**63 - 1]`` and ``policy_version`` in int64, as Python ints."""
    if isinstance(token_start, bool) or not isinstance(token_start, (int, np.integer)) or not (
            0 <= token_start <= _INT64.max):
        raise ShapeError(f"token_start must be an int in [0, 2**63 - 1], got {token_start!r:.40}")
    if isinstance(policy_version, bool) or not isinstance(policy_version, (int, np.integer)):
        raise DTypeError(f"policy_version must be an int, got {type(policy_version).__name__} {policy_version!r:.40}")
    if not _INT64.min <= policy_version <= _INT64.max:
        raise ShapeError(f"policy_version must fit int64 [-2**63, 2**63 - 1], got {policy_version!r:.40}")
    return int(token_start), int(policy_version)


def _check_trace(token_ids, logprobs, token_start: int, traj_id: str) -> tuple[dict, int]:
    """``token_ids`` (integers in int32, ``[T]``) and ``logprobs`` (floats within float32, ``[T]``) as stage
    columns, and ``T``."""
    token_ids = _as_array(token_ids, "token_ids")
    if len(_shape(token_ids)) != 1:
        raise ShapeError(f"token_ids must be 1-D [T], got shape {_shape(token_ids)}")
    T = _shape(token_ids)[0]
    if T == 0:
        raise ShapeError(f"empty write: token_ids has 0 tokens (traj {traj_id!r}, token_start {token_start})")
    if token_start > _INT64.max - T:
        raise ShapeError(f"tokens [{token_start}, {token_start} + {T}) end past the largest token position "
                         f"2**63 - 1 (int64)")
    if _kind(token_ids) not in "iu":
        raise DTypeError(f"token_ids must be integers, got {_dtype_name(token_ids)}")
    _check_int_range(token_ids, _INT32.min, _INT32.max, "token_ids", DTypeError)
    logprobs = _as_array(logprobs, "logprobs")
    if _shape(logprobs) != (T,):
        raise ShapeError(f"logprobs must have shape ({T},) like token_ids, got {_shape(logprobs)}")
    if _kind(logprobs) != "f":
        raise DTypeError(f"logprobs must be floating point, got {_dtype_name(logprobs)}")
    _check_float32_range(logprobs, "logprobs")
    return {"token_ids": (token_ids, np.dtype("<i4")), "logprobs": (logprobs, np.dtype("<f4"))}, T


def _check_int_range(x, lo: int, hi: int, what: str, error: type) -> None:
    if not _fits(x, lo, hi):
        a, b = _minmax(x)
        if a < lo or b > hi:
            raise error(f"{what} values must be in [{lo}, {hi}], got min {a}, max {b}")


def _check_names(given: object, declared, what: str, kind: str) -> Mapping:
    """``given`` must be a mapping with exactly the ``declared`` keys (sites or MoE layers)."""
    if not isinstance(given, Mapping):
        raise DTypeError(f"{what} must be a mapping {{{kind}: array}}, got {type(given).__name__}")
    unknown = [k for k in given if k not in declared]
    if unknown:
        raise UnknownSiteError(f"{what}: unknown {kind}(s) {unknown!r}; the store declares {list(declared)}")
    missing = [k for k in declared if k not in given]
    if missing:
        raise ShapeError(f"{what}: missing {kind}(s) {missing}; every declared {kind} is required per write")
    return given


def _check_sites(store, hints, scales, T: int) -> dict:
    """``hints`` / ``scales``: uint8 ``[T, hint_bytes]`` / ``[T, scale_bytes]`` for every declared site."""
    columns = {}
    for what, given, per_site in (("hints", hints, "hint_bytes"), ("scales", scales, "scale_bytes")):
        given = _check_names(given, store.sites, what, "site")
        for name, site in store.sites.items():
            arr = _as_array(given[name], f"{what}[{name!r}]")
            want = (T, getattr(site, per_site))
            if not _is_u8(arr):
                raise DTypeError(f"{what}[{name!r}] must be uint8, got {_dtype_name(arr)}")
            if _shape(arr) != want:
                raise ShapeError(f"{what}[{name!r}] must have shape {want} (T={T}, width {site.width}, "
                                 f"block {site.block_size}), got {_shape(arr)}")
            columns[f"{what}.{name}"] = (arr, np.dtype(np.uint8))
    return columns


def _check_experts(store, experts, T: int) -> tuple[list, np.dtype]:
    """``experts``: integers ``[T, top_k]`` in ``[0, num_experts)`` for every declared MoE layer."""
    if not store.moe_layers:
        raise UnknownSiteError(f"experts given for {list(experts)!r} but the store declares no MoE layers")
    if not isinstance(experts, Mapping):
        raise ShapeError(f"experts {{layer: [T, {store.top_k}]}} are required: the store declares MoE "
                         f"layers {list(store.moe_layers)}; got {type(experts).__name__}")
    experts = _check_names(experts, store.moe_layers, "experts", "MoE layer")
    layer_arrays = []
    for name in store.moe_layers:
        arr = _as_array(experts[name], f"experts[{name!r}]")
        if _shape(arr) != (T, store.top_k):
            raise ShapeError(f"experts[{name!r}] must have shape ({T}, {store.top_k}), got {_shape(arr)}")
        if _kind(arr) not in "iu":
            raise DTypeError(f"experts[{name!r}] must be integers, got {_dtype_name(arr)}")
        _check_int_range(arr, 0, store.num_experts - 1, f"experts[{name!r}]", ShapeError)
        layer_arrays.append(arr)
    return layer_arrays, store.row_columns["experts"][0]


class _Ranges:
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


class Writer(Closing):
    """Buffers per-token rows of one or many trajectories and commits them in whole segments.

    Use as a context manager or call :meth:`close`. Thread-safe. Full buffers are written and committed by a
    background flusher thread while ``write`` continues in a second buffer (it waits only if both are full);
    a timer commits buffered rows older than ``commit_interval_s`` (0 disables it; then rows are committed on
    size, on :meth:`flush` and on :meth:`close`). A commit that fails in the background is raised by the next
    ``write``/``flush``/``close`` and its rows are kept and retried at the next flush.

    Args:
        store: the open store.
        writer_id: names this writer's segments ``data/<writer_id>/...``; default ``<host>-<pid>-<random>``.
            Restarting with the same id is safe (segment names carry a random part; already committed token
            ranges are rejected with OverlapError, or skipped with ``skip_committed=True``).
        commit_bytes: commit a segment once this many row bytes are buffered (64 MiB: ~8,700 tokens of the
            default 20 x 2048 site table).
        commit_interval_s: commit buffered rows at the latest this long after the oldest was written.
        max_buffer_bytes: hard bound of buffered row bytes (a long trajectory spans several segments).
        skip_committed: ``write`` silently skips token positions already committed for the trajectory and
            buffers only the rest, and positions that another writer commits first while they are buffered are
            dropped without an error (idempotent re-runs and writers racing on one trajectory). Without it any
            overlap with a committed range raises OverlapError, and a lost race is reported by the next
            ``flush``/``close`` (OverlapError with ``.conflicts``). Overlaps with this writer's own buffered rows
            always raise.
        commit_timeout_s: deadline of one commit (claiming a log position) while the storage fails; then
            CommitError, the rows stay buffered and the next flush retries. Transient failures within it are
            retried with backoff; a commit whose answer was lost is recognised by reading the entry back.

    Every commit claims the first free log position with put-if-absent; a segment older than half the store's
    gc grace period is written again under a new name before it is committed (gc deletes unreferenced segments
    older than the grace period), and after a commit slower than that the segment is checked and rewritten in
    place if a gc removed it meanwhile.

    Raises:
        BackendError: the store's backend cannot create-if-absent (read-only fsspec filesystems).
    """

    def __init__(self, store, writer_id: str | None = None, *, commit_bytes: int = 64 << 20,
                 commit_interval_s: float = 5.0, max_buffer_bytes: int = 256 << 20, skip_committed: bool = False,
                 commit_timeout_s: float = 120.0):
        if not store.backend.supports_put_if_absent:
            raise BackendError(f"{store.url}: backend {store.backend!r} cannot commit (no atomic create-if-absent)")
        self.store = store
        self.writer_id = check_id(writer_id if writer_id is not None else _default_writer_id(), "writer id")
        if commit_bytes <= 0 or max_buffer_bytes <= 0 or commit_interval_s < 0:
            raise ValueError(f"commit_bytes={commit_bytes}, max_buffer_bytes={max_buffer_bytes} must be > 0 and "
                             f"commit_interval_s={commit_interval_s} >= 0")
        if not (isinstance(commit_timeout_s, (int, float)) and math.isfinite(commit_timeout_s) and commit_timeout_s > 0):
            raise ValueError(f"commit_timeout_s must be a finite number of seconds > 0, got {commit_timeout_s!r}")
        self.commit_timeout_s = float(commit_timeout_s)
        self.commit_bytes = int(commit_bytes)
        self.max_buffer_bytes = int(max_buffer_bytes)
        self.commit_interval_s = float(commit_interval_s)
        self.skip_committed = bool(skip_committed)
        # two buffers: one filling, one being written by the flusher thread
        self._flush_bytes = min(self.commit_bytes, self.max_buffer_bytes // 2)
        self._token_nbytes = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                                 for dt, shape in store.row_columns.values())
        self._lock = threading.RLock()
        self._stage: _Staging | None = None
        self._capacity = max(1, self._flush_bytes // self._token_nbytes)
        if self._capacity >= store.chunk_rows:
            # full segments hold whole inner chunks (no padding, chunk boundaries at multiples of chunk_rows)
            self._capacity -= self._capacity % store.chunk_rows
        self._oldest: float | None = None
        self._committed = _Ranges()
        self._own = _Ranges()  # ranges committed by this writer's own segments
        self._attempted: set[str] = set()  # commits this writer tried (entry ids: a log entry naming one is ours)
        self._landed: set[str] = set()  # those of them that a log entry names
        self._has_result: set[str] = set()  # trajectories whose result is committed
        self._pending_results: set[str] = set()  # ... or buffered by this writer
        self._lost_results: list[str] = []  # results dropped at commit (another writer committed one first)
        self._last_error: BaseException | None = None
        self._pending = _Ranges()
        self._synced = 0
        self._segments = 0
        self._error: BaseException | None = None
        self._state = threading.Lock()  # guards _committed, _pending, _synced, _lost, stats
        self._sync_lock = threading.Lock()  # one log sync / commit at a time
        self._flusher: ThreadPoolExecutor | None = None
        self._inflight = None  # (future, stage) being written and committed by the flusher thread
        self._spare: _Staging | None = None
        self._failed: _Staging | None = None  # a stage whose commit failed; retried at the next flush
        self._lost: list[tuple[str, int, int]] = []  # ranges dropped at commit (another writer was first)
        self._closed = False
        #: counters: segments / records / rows committed, bytes written (data + log)
        self.stats = {"segments": 0, "records": 0, "rows": 0, "data_bytes": 0, "log_bytes": 0, "lost_races": 0,
                      "results": 0}
        self._sync()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.commit_interval_s > 0:
            self._ticker = threading.Thread(target=self._tick, name=f"tracestore-writer-{self.writer_id}", daemon=True)
            self._ticker.start()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and self.buffered_bytes:
            warnings.warn(f"tracestore writer {self.writer_id!r} was not closed: {self.buffered_bytes} buffered "
                          f"bytes were never committed", ResourceWarning, stacklevel=2)

    # ------------------------------------------------------------------ context
    def __repr__(self) -> str:
        return f"Writer({self.store.url!r}, writer_id={self.writer_id!r}, buffered={self.buffered_bytes})"

    def committed(self, traj_id: str) -> list[tuple[int, int]]:
        """Committed token ranges ``[(start, stop), ...]`` of ``traj_id`` (merged), after reading new log entries."""
        check_id(traj_id)
        self._sync()
        with self._state:
            return self._committed.get(traj_id)

    # ------------------------------------------------------------------ write
    def write(self, traj_id: str, token_start: int, *, hints: Mapping, scales: Mapping, token_ids, logprobs,
              experts: Mapping | None = None, policy_version: int = 0) -> None:
        """Buffer tokens ``[token_start, token_start + T)`` of ``traj_id``.

        Args:
            hints: ``{site: uint8 [T, width/8]}`` for every declared site (bit i = LSB of code i, LSB first).
            scales: ``{site: uint8 [T, width/block_size]}`` for every declared site.
            token_ids: integer ``[T]`` (stored int32).
            logprobs: floating ``[T]`` (stored float32).
            experts: ``{moe_layer: integer [T, top_k]}`` for every declared MoE layer (required iff the store
                declares MoE layers), values in ``[0, num_experts)``.
            policy_version: int64 policy version that generated these tokens.
            Arrays may be numpy arrays or torch tensors (CPU or CUDA; copied to host memory).

        Everything is validated before anything is buffered; on error the writer and the store are unchanged.

        Raises:
            InvalidIdError, ShapeError, DTypeError, UnknownSiteError, OverlapError (range overlaps one committed
            or buffered for ``traj_id``), TraceStoreError (writer closed / a background commit failed),
            BackendError (a commit triggered by this write failed; buffered rows stay buffered and are retried).
            A storage error raised part-way through a long write (a full buffer could not be handed on because
            the previous commit failed) carries ``buffered_to``: the tokens of this write before that position
            are buffered and will be committed; write the rest again starting there. Errors raised before
            anything was buffered have ``buffered_to == token_start``.
        """
        traj_id = check_id(traj_id)
        token_start, policy_version = _check_position(token_start, policy_version)
        columns, T = _check_trace(token_ids, logprobs, token_start, traj_id)
        columns.update(_check_sites(self.store, hints, scales, T))
        if self.store.moe_layers or experts:
            columns["experts"] = _check_experts(self.store, experts, T)
        with self._lock:
            self._check_open()
            parts = self._reserve(traj_id, token_start, token_start + T)
            if parts:
                self._buffer_parts(traj_id, token_start, T, parts, columns, policy_version)

    def write_result(self, traj_id: str, *, reward: float, group_id: str = "", advantage: float | None = None,
                     prompt_len: int = 0, response_len: int = 0, policy_version: int = 0, finish_reason: str = "",
                     extra: Mapping | None = None) -> None:
        """Buffer the result of ``traj_id``; it commits (as a results log entry, FORMAT §3.2) after every token of
        the trajectory this writer buffered before it, so a trajectory is *complete* exactly when its result is
        committed. Fields as :class:`~tracestore.format.entries.Result` (``reward`` finite, ``group_id`` an id or "",
        ``advantage`` finite or None, lengths >= 0, ``policy_version`` int64, ``finish_reason`` a short word,
        ``extra`` a JSON object of at most 16 KiB). Needs a format-version-2 store.

        Raises:
            SchemaVersionError: the store is format version 1 (it cannot hold results).
            ResultExistsError: the trajectory already has a result, committed (as far as this writer has read the
                log) or buffered by this writer; with ``skip_committed`` a committed one is skipped silently.
            InvalidIdError / ValueError / TypeError: a bad field (nothing is buffered).
            TraceStoreError / BackendError: as :meth:`write`.
        """
        if self.store.format_version < 2:
            raise SchemaVersionError(f"{self.store.url} is a format-version-1 store, which cannot hold trajectory "
                                     f"results (version 2 can); create a new store to record results")
        result = check_result(Result(traj_id, reward, group_id, advantage, prompt_len, response_len,
                                     policy_version, finish_reason, {} if extra is None else extra))
        with self._lock:
            self._check_open()
            with self._state:
                if traj_id in self._has_result and self.skip_committed:
                    log.info("%s: %s already has a committed result; skipped", self.writer_id, traj_id)
                    return
                if traj_id in self._has_result or traj_id in self._pending_results:
                    where = "committed" if traj_id in self._has_result else "buffered by this writer"
                    raise ResultExistsError(f"trajectory {traj_id!r} already has a result {where} in "
                                            f"{self.store.url}", [(traj_id, 0, 0)])
                self._pending_results.add(traj_id)
            self._current_stage().results.append(result)
            if self._oldest is None:
                self._oldest = time.monotonic()

    def _reserve(self, traj_id: str, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of ``[start, stop)`` to buffer (all of it, or with ``skip_committed`` the positions not yet
        committed), marked pending. Raises OverlapError (and marks nothing) on an overlap with committed or
        buffered positions."""
        with self._state:
            parts = [(start, stop)]
            hit = self._committed.overlaps(traj_id, start, stop)
            if hit is not None and self.skip_committed:
                parts = self._committed.uncovered(traj_id, start, stop)
                log.info("%s: %s [%d, %d): skipping committed positions, writing %s", self.writer_id, traj_id,
                         start, stop, parts)
                hit = None
            where = "committed"
            if hit is None:
                where = "buffered by this writer"
                hit = next((h for a, b in parts if (h := self._pending.overlaps(traj_id, a, b)) is not None), None)
            if hit is not None:
                raise OverlapError(
                    f"trajectory {traj_id!r}: tokens [{start}, {stop}) overlap [{hit[0]}, {hit[1]}) "
                    f"already {where} in {self.store.url}", [(traj_id, start, stop)])
            for a, b in parts:
                self._pending.add(traj_id, a, b)
        return parts

    def _buffer_parts(self, traj_id: str, token_start: int, T: int, parts: list[tuple[int, int]], columns: dict,
                      policy_version: int) -> None:
        """Copy the reserved ``parts`` of a validated write into the stage (caller holds ``_lock``)."""
        done = [0]
        try:
            for a, b in parts:
                done[0] = a - token_start
                self._buffer(traj_id, token_start, a - token_start, b - token_start, columns, policy_version, done)
            done[0] = T
            if self._due():
                self._handoff()
        except TraceStoreError as e:
            # a full buffer could not be handed on (the previous commit failed): say how far this write got
            e.buffered_to = token_start + done[0]
            raise
        finally:
            # after a failure part-way, what never reached the buffer is not pending
            with self._state:
                for a, b in parts:
                    if token_start + done[0] < b:
                        self._pending.subtract(traj_id, max(a, token_start + done[0]), b)

    def _current_stage(self) -> _Staging:
        """The filling buffer (created on first use)."""
        if self._stage is None:
            # (with column chunks a site's inner chunk is not a run of its rows: checksums at flush)
            crc_rows = 0 if self.store.feature_chunk else self.store.chunk_rows
            self._stage = _Staging(self.store.row_columns, self._capacity, crc_rows)
        return self._stage

    def _buffer(self, traj_id: str, token_start: int, s: int, T: int, columns: dict, policy_version: int,
                done: list) -> None:
        """Copy rows ``[s, T)`` of the validated ``columns`` (tokens ``token_start + s ..``) into the stage."""
        while s < T:
            stage = self._current_stage()
            if stage.rows >= stage.capacity:
                # still full: handing it on failed before (the previous commit failed); try again, now that
                # nothing of these rows is in it (raises, with these rows unbuffered, if it fails again)
                self._handoff()
                continue
            n = min(T - s, stage.capacity - stage.rows)
            r = stage.rows
            crcs = []
            for name, (src, _dtype) in columns.items():
                dst = stage.arrays[name][r:r + n]
                if name == "experts":
                    for k, a in enumerate(src):
                        dst[:, k, :] = _host(a, s, s + n)  # [n, top_k] -> layer k of [n, L, top_k]
                else:
                    dst[...] = _host(src, s, s + n)
                crcs.append((name, *stage.chunk_crcs(name, r, n)))  # while the rows are in cache
            for name, done_crcs, run in crcs:  # every column copied: the rows are the stage's now
                stage.add_crcs(name, done_crcs, run)
            stage.rows += n
            stage.add_record(traj_id, token_start + s, token_start + s + n, r, policy_version)
            if self._oldest is None:
                self._oldest = time.monotonic()
            s += n
            done[0] = s
            if stage.rows >= stage.capacity:
                self._handoff()

    def _check_open(self) -> None:
        if self._closed:
            raise TraceStoreError(f"writer {self.writer_id!r} of {self.store.url} is closed")
        if self._error is not None:  # a commit of the flusher thread failed: raise it here, once
            err, self._error = self._error, None
            raise err

    def _due(self) -> bool:
        return (self._oldest is not None and self.commit_interval_s > 0
                and time.monotonic() - self._oldest >= self.commit_interval_s)

    def _tick(self) -> None:
        period = max(0.01, min(self.commit_interval_s / 4, 1.0))
        while not self._stop.wait(period):
            with self._lock:
                if self._closed or not self._due() or self._error is not None:
                    continue
                try:
                    self._handoff()
                except Exception as e:  # surfaced by the next write/flush/close
                    log.warning("%s: background commit failed: %s", self.writer_id, e)
                    self._error = e

    # ------------------------------------------------------------------ flush / commit
    def flush(self) -> None:
        """Write and commit everything buffered.

        Raises:
            OverlapError: since the last flush()/close(), commits (this one or automatic ones) dropped token ranges
                that another writer had committed first; ``.conflicts`` lists them, everything else was committed.
            BackendError: storage failure (rows stay buffered; a later flush retries).
        """
        with self._lock:
            self._check_open()
            self._handoff(wait=True)
            self._check_open()
            self._raise_lost()

    def _raise_lost(self) -> None:
        with self._state:
            lost, self._lost = self._lost, []
            lost_results, self._lost_results = self._lost_results, []
        if lost_results:
            raise ResultExistsError(
                f"{len(lost_results)} result(s) were not committed: another writer committed a result for "
                f"{', '.join(repr(t) for t in lost_results[:5])} first; everything else was committed",
                [(t, 0, 0) for t in lost_results])
        if lost:
            raise OverlapError(
                f"{len(lost)} token range(s) lost a commit race: another writer committed them first "
                f"({', '.join(f'{t}[{a}:{b})' for t, a, b in lost[:5])}); they were dropped, everything else "
                f"was committed", lost)

    def close(self) -> None:
        """Commit what is buffered and stop the background threads. Idempotent once it succeeded.

        Raises as :meth:`flush`. After a storage error nothing buffered is lost: the writer stays open (without
        its commit timer) and ``close()`` (or ``flush()``) can be called again. After an OverlapError the writer
        is closed (everything else was committed)."""
        if self._closed:
            return
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        with self._lock:
            try:
                self._check_open()
                self._handoff(wait=True)
                self._check_open()
            except BaseException:
                self._shutdown_flusher()
                raise
            self._closed = True
            self._shutdown_flusher()
            self._raise_lost()

    def _shutdown_flusher(self) -> None:
        self._wait_inflight()
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)
            self._flusher = None

    def _sync(self) -> None:
        with self._sync_lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        """Read the log entries this writer has not seen (caller holds ``_sync_lock``). An entry naming a segment
        this writer wrote is its own commit, even if the answer to its conditional PUT was lost."""
        head = self.store.head()
        if head <= self._synced:
            return
        entries = self.store.read_entries(self._synced, head)
        with self._state:
            for entry in entries:
                own = entry.writer_id == self.writer_id and entry.entry_id in self._attempted
                self._has_result.update(r.traj_id for r in entry.results)
                if own and entry.entry_id not in self._landed:
                    self._landed.add(entry.entry_id)
                    log.info("%s: %s was committed as log entry %d by an earlier try", self.writer_id,
                             entry.entry_id, entry.seq)
                for r in entry.records():
                    self._committed.add(r.traj_id, r.token_start, r.token_stop)
                    if own:
                        self._own.add(r.traj_id, r.token_start, r.token_stop)
            self._synced = head

    @property
    def buffered_bytes(self) -> int:
        """Row bytes buffered and not yet committed (the filling buffer and the one being written)."""
        rows = 0 if self._stage is None else self._stage.rows
        inflight = self._inflight
        if inflight is not None:
            rows += inflight[1].rows
        return rows * self._token_nbytes

    def _handoff(self, wait: bool = False) -> None:
        """Give the filling buffer to the flusher thread (after the previous one is done) and continue in a
        spare buffer, so that writes overlap with encoding and I/O; ``wait``: also wait until it is committed.
        Caller holds ``_lock``."""
        if self._failed is not None:  # retry a failed commit first, synchronously (raises if it fails again)
            failed, self._failed = self._failed, None
            try:
                self._flush_stage(failed)
            except BaseException:
                self._failed = failed
                raise
        stage = self._stage
        if stage is not None and (stage.rows or stage.results):
            self._wait_inflight()
            if self._failed is not None:  # the previous commit just failed: surface it, keep this buffer
                self._check_open()
            self._stage, self._spare = self._spare, None
            self._oldest = None
            if self._flusher is None:
                self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tracestore-{self.writer_id}")
            self._inflight = (self._flusher.submit(self._flush_stage, stage), stage)
        if wait:
            self._wait_inflight()

    def _wait_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        future, stage = inflight
        try:
            future.result()
        except Exception as e:  # keep the rows for a retry; raise at the next call
            log.warning("%s: commit failed (rows kept for a retry): %s", self.writer_id, e)
            self._failed = stage
            self._error = e

    def _flush_stage(self, stage: _Staging) -> None:
        """Commit ``stage`` (flusher thread, or the caller for a retry): its rows as a segment (written unless a
        failed earlier try already wrote it and it is still young), then its results as a results entry, so that
        a trajectory's result never commits before its tokens. Raises on failure; the stage keeps what is not
        committed yet."""
        if stage.rows and not stage.rows_committed:
            if stage.segment is None:
                self._write_segment(stage)
            conflicts = self._commit(stage, list(stage.records))
            stage.rows_committed = True
            with self._state:
                for r in stage.records:
                    self._pending.subtract(r.traj_id, r.token_start, r.token_stop)
                if conflicts:
                    if self.skip_committed:  # another writer committed these positions first: nothing to report
                        log.info("%s: %d token range(s) were committed by another writer first; skipped: %s",
                                 self.writer_id, len(conflicts), conflicts[:5])
                    else:  # reported by the next flush()/close() (OverlapError with the list)
                        log.warning("%s: %d token range(s) lost a commit race and were dropped: %s",
                                    self.writer_id, len(conflicts), conflicts[:5])
                        self._lost.extend(conflicts)
        if stage.results:
            if not stage.results_batch:
                stage.results_batch = f"{self._segments:08d}-{uuid.uuid4().hex[:12]}"
                self._segments += 1
            dropped = self._commit_results(stage)
            with self._state:
                self._pending_results.difference_update(r.traj_id for r in stage.results)
                if dropped and not self.skip_committed:
                    self._lost_results.extend(dropped)
        stage.reset()
        if self._spare is None:
            self._spare = stage

    def _write_segment(self, stage: _Staging, path: str | None = None) -> _SegmentWrite:
        """Encode and write every array of ``stage`` as a segment, then the group ``zarr.json``; ``path``: rewrite
        that existing segment (repair) instead of a new one. Records the write in ``stage.segment``."""
        store = self.store
        rows = stage.rows
        chunk_rows = choose_chunk_rows(rows, store.chunk_rows)
        started = time.monotonic()
        if path is None:
            segment_id = f"{self._segments:08d}-{uuid.uuid4().hex[:12]}"
            self._segments += 1
            path = f"data/{self.writer_id}/{segment_id}"
        segment_id = path.rsplit("/", 1)[1]

        # every object of the segment in one put_many: object stores send them concurrently (one round trip
        # per segment instead of one per array); nothing is visible before the log entry references them
        items: dict[str, object] = {}
        for name, spec in store.array_specs.items():
            lay = layout(spec, rows, chunk_rows, store.shard_bytes)
            if spec.grouped:
                kind = name.split(".", 1)[0]
                columns = [f"{kind}.{m}" for m in spec.members]
            else:
                columns = [name]
            sources = [stage.arrays[c][:rows] for c in columns]
            crcs = [stage.crcs[c] for c in columns] if stage.crc_rows == chunk_rows and lay.n_col == 1 else None
            items[f"{path}/{name}/zarr.json"] = array_metadata(lay)
            items.update({f"{path}/{k}": v for k, v in lay.encode_parts(sources, crcs).items()})
        items[f"{path}/zarr.json"] = group_metadata(
            {"tracestore": {"format_version": store.format_version, "writer_id": self.writer_id,
                            "segment_id": segment_id, "rows": rows, "store_id": store.store_id}})
        self._attempted.add(path)  # from here on a log entry naming it is this writer's
        # a repair replaces what is left of the segment (atomic puts); a new segment's objects are fresh
        store.backend.put_many(items, atomic=stage.segment is not None and stage.segment.path == path)
        nbytes = sum(len(v) if isinstance(v, (bytes, bytearray)) else sum(len(x) for x in v) for v in items.values())
        stage.segment = _SegmentWrite(path, nbytes, rows, chunk_rows, started)
        return stage.segment

    def _split(self, records: list[Record]) -> tuple[list[Record], list[tuple[str, int, int]]]:
        """Split ``records`` against the committed ranges (caller holds ``_state``): the parts still to commit,
        and the parts another writer committed first (conflicts). Parts that an earlier try of this writer
        committed (an ambiguous commit that did land) are neither."""
        keep: list[Record] = []
        conflicts: list[tuple[str, int, int]] = []
        for r in records:
            t = r.traj_id
            if self._committed.overlaps(t, r.token_start, r.token_stop) is None:
                keep.append(r)
                continue
            pos = r.token_start
            for a, b in self._committed.uncovered(t, r.token_start, r.token_stop):
                if a > pos:
                    conflicts.extend((t, x, y) for x, y in self._own.uncovered(t, pos, a))
                keep.append(Record(t, a, b, r.row_offset + (a - r.token_start), r.policy_version))
                pos = b
            if pos < r.token_stop:
                conflicts.extend((t, x, y) for x, y in self._own.uncovered(t, pos, r.token_stop))
        return keep, conflicts

    def _claim(self, seq: int, data: bytes, entry_id: str) -> str:
        """Try to create log entry ``seq``: ``"ours"`` (it holds our commit ``entry_id``), ``"taken"`` (another
        entry is there) or ``"unknown"`` (the storage failed; the entry may still appear). After a failed or refused
        conditional PUT the entry is read back: a PUT that was applied although the client saw an error (or whose
        retry got 412) is our commit, not a lost race."""
        backend = self.store.backend
        key = log_key(seq)
        try:
            if backend.put_if_absent(key, data):
                return "ours"
        except TransientStorageError as e:
            self._last_error = e
        try:
            existing = decode_entry(backend.get(key), seq, f"{self.store.url}/{key}")
        except ObjectNotFoundError:
            return "unknown"  # not applied (or still in flight): try the same position again
        except TransientStorageError as e:
            self._last_error = e
            return "unknown"
        return "ours" if existing.writer_id == self.writer_id and existing.entry_id == entry_id else "taken"

    def _commit_loop(self, what: str, build, on_ours) -> list:
        """Claim the next free log position for one commit (see the module docstring); returns what ``build``
        dropped (positions or results another writer committed first).

        ``build(seq)`` runs after the log was read up to ``seq`` (caller state current) and returns ``(entry,
        dropped)``: the entry to claim, or None when nothing is left (or an earlier try did land); raising
        :class:`_Again` starts over. ``on_ours(entry, data)`` books a successful claim.

        Raises:
            CommitError: no position could be claimed before ``commit_timeout_s`` (storage failing); the caller
                keeps its rows/results, and a later flush retries (recognising an entry that did land meanwhile).
            BackendError / IntegrityError: reading the log failed.
        """
        store = self.store
        deadline = time.monotonic() + self.commit_timeout_s
        failures = 0
        self._last_error = None
        with self._sync_lock:
            while True:
                self._sync_locked()
                try:
                    entry, dropped = build(self._synced)
                except _Again:
                    continue
                if entry is None:
                    return dropped
                data = encode_entry(entry)
                outcome = self._claim(entry.seq, data, entry.entry_id)
                if outcome == "ours":
                    with self._state:
                        self._landed.add(entry.entry_id)
                        self._synced = entry.seq + 1
                        self.stats["log_bytes"] += len(data)
                    store.log.note_head(entry.seq + 1)
                    log.debug("%s: committed %s as log entry %d", self.writer_id, entry.entry_id, entry.seq)
                    on_ours(entry, data)
                    return dropped
                if outcome == "taken":
                    with self._state:
                        self.stats["lost_races"] += 1
                    continue
                failures += 1
                pause = store.backend.retry.delay(failures)
                if time.monotonic() + pause > deadline:
                    raise CommitError(
                        f"writer {self.writer_id!r} could not commit {what} to {store.url} within "
                        f"{self.commit_timeout_s:.0f} s ({failures} failed tries at log entry {entry.seq}); it stays "
                        f"buffered and the next flush retries; last error: {self._last_error}")
                time.sleep(pause)

    def _commit(self, stage: _Staging, records: list[Record]) -> list[tuple[str, int, int]]:
        """Commit ``stage.segment`` with ``records`` (less what another writer committed first); returns the
        dropped ranges. Never commits a segment older than half the gc grace period (writes it again)."""
        store = self.store

        def build(seq: int):
            nonlocal records
            seg = stage.segment
            if seg.path in self._landed:  # an earlier try whose answer was lost did commit
                return None, []
            with self._state:
                records, conflicts = self._split(records)
            if not records:
                log.info("%s: nothing left to commit in %s", self.writer_id, seg.path)
                return None, conflicts
            if time.monotonic() - seg.started > store.gc_grace_s / 2:
                # gc may delete an unreferenced segment once it is gc_grace_s old: never commit an old one
                log.warning("%s: segment %s is older than half the gc grace period (%.0f s); writing it again",
                            self.writer_id, seg.path, store.gc_grace_s)
                self._write_segment(stage)
                raise _Again
            return LogEntry(
                seq=seq, writer_id=self.writer_id, writer_seq=int(seg.path.rsplit("/", 1)[1].split("-")[0]),
                segment=SegmentRef(seg.path, self.writer_id, seg.rows, seg.chunk_rows, store.shard_bytes),
                created_unix=time.time(), segment_nbytes=seg.nbytes,
                traj_ids=[r.traj_id for r in records],
                token_start=np.array([r.token_start for r in records], np.int64),
                token_stop=np.array([r.token_stop for r in records], np.int64),
                row_offset=np.array([r.row_offset for r in records], np.int64),
                policy_version=np.array([r.policy_version for r in records], np.int64),
                format_version=store.format_version,
            ), conflicts

        def on_ours(entry: LogEntry, data: bytes) -> None:
            seg = stage.segment
            with self._state:
                for r in entry.records():
                    self._committed.add(r.traj_id, r.token_start, r.token_stop)
                    self._own.add(r.traj_id, r.token_start, r.token_stop)
                self.stats["segments"] += 1
                self.stats["rows"] += seg.rows
                self.stats["data_bytes"] += seg.nbytes
                self.stats["records"] += len(entry)
            if time.monotonic() - seg.started > store.gc_grace_s / 2:
                self._repair(stage, seg)

        return self._commit_loop(f"segment {stage.segment.path}", build, on_ours)

    def _commit_results(self, stage: _Staging) -> list[str]:
        """Commit the stage's results as one results entry (after its segment); returns the trajectories whose
        result another writer committed first (dropped)."""
        batch = stage.results_batch
        entry_id = f"results/{self.writer_id}/{batch}"
        results = list(stage.results)

        def build(seq: int):
            nonlocal results
            if entry_id in self._landed:
                return None, []
            with self._state:
                dropped = [r.traj_id for r in results if r.traj_id in self._has_result]
                results = [r for r in results if r.traj_id not in self._has_result]
            if not results:
                return None, dropped
            empty = np.zeros(0, np.int64)
            return LogEntry(seq=seq, writer_id=self.writer_id, writer_seq=int(batch.split("-")[0]), segment=None,
                            created_unix=time.time(), segment_nbytes=0, traj_ids=[], token_start=empty,
                            token_stop=empty, row_offset=empty, policy_version=empty, kind=RESULTS,
                            results=tuple(results), batch=batch, format_version=self.store.format_version), dropped

        def on_ours(entry: LogEntry, data: bytes) -> None:
            with self._state:
                self._has_result.update(r.traj_id for r in entry.results)
                self.stats["results"] += len(entry.results)

        self._attempted.add(entry_id)
        return self._commit_loop(f"{len(results)} results", build, on_ours)

    def _repair(self, stage: _Staging, seg: _SegmentWrite) -> None:
        """After a commit that took longer than half the gc grace period, a gc that ran meanwhile may have deleted
        the (then unreferenced) segment: check it, and write it again at the same path if it is gone."""
        if self.store.backend.exists(f"{seg.path}/zarr.json"):
            return
        log.warning("%s: committed segment %s was deleted while its commit was in flight (gc); writing it again",
                    self.writer_id, seg.path)
        self._write_segment(stage, path=seg.path)
