"""Readers: random access over a snapshot of the log, and a streaming tail with a resumable cursor.

Random access builds an in-memory index (trajectory -> records) from the log entries below the snapshot, then
reads only the inner chunks a request touches (rows of the requested token range, and — for feature slices —
only the column chunks that hold the requested values), with one batched range request per contiguous run of
chunks. Every chunk's crc32c is checked before its bytes are used.
"""

from __future__ import annotations

import functools
import logging
import math
import re
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from traceschemas import record_schema, token_schema, trajectory_schema

from ._format import check_id, log_key
from ._log import LogEntry, SegmentRef, merge_ranges
from ._segment import ReadTargets, layout
from .errors import (
    HintNotFoundError,
    IntegrityError,
    ObjectNotFoundError,
    SchemaVersionError,
    ShapeError,
    SnapshotError,
    UnknownSiteError,
)
from .store import Snapshot

_DIGITS = re.compile(r"[0-9]{1,19}")

#: a tailing stream that keeps finding no next entry lists the log this often to tell a hole from the end
HOLE_CHECK_INTERVAL_S = 1.0

__all__ = ["Reader", "TraceBatch", "TrajectoryInfo", "Stream", "CommittedRecord"]

log = logging.getLogger(__name__)

FORMATS = ("numpy", "torch", "arrow")


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

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start


def records_of(entry: LogEntry) -> list[CommittedRecord]:
    return [CommittedRecord(t, s, e, pv, entry.writer_id, entry.seq, i, ro, entry.segment, entry.created_unix)
            for i, (t, s, e, ro, pv) in enumerate(entry.records())]


@dataclass(frozen=True)
class TrajectoryInfo:
    """What the snapshot holds of one trajectory.

    ``num_tokens``: committed tokens contiguous from position 0 (what a trainer can read from the start);
    ``ranges``: all committed token ranges, merged; ``committed_tokens``: their total.
    """

    traj_id: str
    num_tokens: int
    committed_tokens: int
    ranges: tuple[tuple[int, int], ...]
    num_records: int
    policy_versions: tuple[int, ...]
    writers: tuple[str, ...]
    first_seq: int
    last_seq: int


@dataclass
class TraceBatch:
    """Tokens ``[start, stop)`` of one trajectory.

    Shapes (``T = stop - start``; ``lo, hi`` the feature slice, the full width by default):
        hints[site]: uint8 ``[T, (hi-lo)/8]``; scales[site]: uint8 ``[T, (hi-lo)/block_size]``;
        token_ids: int32 ``[T]``; logprobs: float32 ``[T]``; experts[layer]: uint8 (uint16 if > 256 experts)
        ``[T, top_k]`` (views into one ``[T, L, top_k]`` array); policy_version: int64 ``[T]``;
        positions: int64 ``[T]``. numpy arrays, torch tensors or pyarrow arrays depending on ``fmt``.
    """

    traj_id: str
    start: int
    stop: int
    positions: object
    hints: dict
    scales: dict
    token_ids: object
    logprobs: object
    experts: dict
    policy_version: object
    features: tuple[int, int] | None = None

    def __len__(self) -> int:
        return self.stop - self.start

    def to_arrow(self) -> pa.Table:
        """The logical records, one row per (position, site), in ``traceschemas.record_schema()``."""
        sites = list(self.hints)
        T = len(self)
        rows_traj = pa.array([self.traj_id] * (T * len(sites)), pa.string())
        pos = np.repeat(_np(self.positions), len(sites)).astype(np.int64)
        site_idx = np.tile(np.arange(len(sites), dtype=np.int32), T)
        site_col = pa.DictionaryArray.from_arrays(pa.array(site_idx, pa.int32()), pa.array(sites, pa.string()))

        def interleave(d: dict) -> pa.Array:
            # row (t, k) holds site k's bytes of token t: the rows of [T, sum of widths] laid end to end
            mats = [_np(d[s]) for s in sites]
            widths = np.array([m.shape[1] for m in mats], np.int64)
            row_bytes = int(widths.sum())
            if T * row_bytes > np.iinfo(np.int32).max:
                raise OverflowError(f"{T * row_bytes} bytes do not fit one Arrow binary column")
            values = np.concatenate(mats, axis=1) if mats else np.zeros((T, 0), np.uint8)
            ends = (np.arange(T, dtype=np.int64)[:, None] * row_bytes + np.cumsum(widths)[None, :]).ravel()
            offsets = np.concatenate([np.zeros(1, np.int64), ends]).astype(np.int32)
            return pa.Array.from_buffers(pa.binary(), T * len(sites),
                                         [None, pa.py_buffer(offsets), pa.py_buffer(np.ascontiguousarray(values))])

        return pa.Table.from_arrays([rows_traj, pa.array(pos), site_col, interleave(self.hints),
                                     interleave(self.scales)], schema=record_schema())

    def to_arrow_tokens(self) -> pa.Table:
        """The per-token trace, one row per position, in ``traceschemas.token_schema()``."""
        T = len(self)
        if self.experts:
            ex = np.stack([_np(v) for v in self.experts.values()], axis=1).reshape(T, -1).astype(np.uint16)
            experts = pa.ListArray.from_arrays(pa.array(np.arange(0, ex.size + 1, max(1, ex.shape[1]),
                                                                  dtype=np.int32)), pa.array(ex.ravel()))
        else:
            experts = pa.nulls(T, pa.list_(pa.uint16()))
        return pa.Table.from_arrays(
            [pa.array([self.traj_id] * T, pa.string()), pa.array(_np(self.positions).astype(np.int64)),
             pa.array(_np(self.token_ids)), pa.array(_np(self.logprobs)),
             pa.array(_np(self.policy_version).astype(np.int64)), experts],
            schema=token_schema())


def _np(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if isinstance(x, pa.FixedSizeBinaryArray):
        n = x.type.byte_width
        return np.frombuffer(x.buffers()[1], np.uint8)[x.offset * n:(x.offset + len(x)) * n].reshape(len(x), n)
    if isinstance(x, pa.FixedSizeListArray):
        return x.flatten().to_numpy(zero_copy_only=False).reshape(len(x), x.type.list_size)
    if isinstance(x, pa.Array):
        return x.to_numpy(zero_copy_only=False)
    return x.numpy()  # torch


_ARENA_MIN_BYTES = 4 << 20  # numpy's huge-page threshold
_PAGE = 4096
_ARENA_ALIGN = _PAGE  # outputs start at page boundaries (see _page_aligned)


_POOL_ARENAS = 4  # per thread
_POOL_MAX_BYTES = 512 << 20  # per thread, in all; larger arenas are not kept
_pool = threading.local()


def _pooled_arena(nbytes: int) -> np.ndarray:
    """An output arena of at least ``nbytes``: a recycled one that nothing references any more, else a new one.

    A fresh arena is faulted in page by page while the read fills it (with the checksum pass this made reading
    into fresh outputs ~1.5x slower than into warm memory). Arenas of finished reads are kept per thread (at most
    :data:`_POOL_ARENAS` holding at most :data:`_POOL_MAX_BYTES`) and handed out again only once no output of
    the read that used them is alive: every output is a numpy view whose ``base`` is the arena (also behind
    torch/arrow conversions), so the arena's reference count says whether anything still uses it. A caller who
    keeps a batch keeps its memory; one who drops it (a trainer consuming micro-batches) reuses warm memory.
    """
    arenas = getattr(_pool, "arenas", None)
    if arenas is None:
        arenas = _pool.arenas = []
    need = nbytes + _PAGE
    for k in range(len(arenas) - 1, -1, -1):
        a = arenas[k]
        # references: the pool list, ``a`` and getrefcount's argument -> nothing else holds it
        if need <= a.size <= 2 * need and sys.getrefcount(a) == 3:
            del arenas[k]
            arenas.append(a)  # most recently used last
            return _page_aligned(a, nbytes)
        del a
    a = np.empty(need, np.uint8)
    if need <= _POOL_MAX_BYTES:
        arenas.append(a)
        while len(arenas) > _POOL_ARENAS or sum(x.size for x in arenas) > _POOL_MAX_BYTES:
            del arenas[0]  # the least recently used (still valid for whoever holds its outputs)
    return _page_aligned(a, nbytes)


def _page_aligned(raw: np.ndarray, nbytes: int) -> np.ndarray:
    """``nbytes`` of ``raw`` starting at a page boundary (a view: its ``base`` is ``raw``).

    Outputs start at page boundaries because the kernel's copy into user memory (``preadv`` from the page cache)
    ran ~3x slower on the benchmark machine (AMD EPYC) when the destination address was 1-31 bytes past the
    source's page offset, which is where numpy's 16-byte-aligned allocations put every page-aligned chunk."""
    off = -raw.ctypes.data % _PAGE
    return raw[off : off + nbytes]


class _Alloc:
    """Output buffers: numpy, or torch (optionally in pinned host memory) with numpy views to fill."""

    def __init__(self, fmt: str, pin_memory: bool):
        self.torch = fmt == "torch"
        self.pin = False
        if self.torch:
            import torch

            self._torch = torch
            if pin_memory:
                if torch.cuda.is_available():
                    self.pin = True
                else:
                    warnings.warn("pin_memory=True but CUDA is not available; returning pageable tensors",
                                  RuntimeWarning, stacklevel=4)
        elif pin_memory:
            raise ValueError("pin_memory=True needs fmt='torch'")

        self._arena: np.ndarray | None = None
        self._used = 0

    def reserve(self, nbytes: int) -> None:
        """Carve the numpy outputs of one read out of a single allocation of ``nbytes`` (plus alignment).

        numpy asks the kernel for transparent huge pages on allocations of 4 MiB and more; many separate
        per-site outputs below that size are faulted in 4 KiB pages, which made filling them several times
        slower than the read itself. Each output stays a separate C-contiguous array (a view of the arena).
        Torch outputs are allocated one by one (a view would make ``torch.save`` write the whole arena)."""
        if not self.torch and nbytes >= _ARENA_MIN_BYTES:
            self._arena = _pooled_arena(nbytes)
            self._used = 0

    def empty(self, shape: tuple[int, ...], dtype: np.dtype):
        if not self.torch:
            dtype = np.dtype(dtype)
            n = math.prod(shape) * dtype.itemsize  # math.prod: np.prod costs ~10 us per call
            if self._arena is not None and self._used + n <= len(self._arena):
                view = self._arena[self._used:self._used + n].view(dtype).reshape(shape)
                self._used += -(-n // _ARENA_ALIGN) * _ARENA_ALIGN
                return view, None
            return np.empty(shape, dtype), None
        t = self._torch.empty(shape, dtype=_torch_dtypes()[np.dtype(dtype).name], pin_memory=self.pin)
        return t.numpy(), t


@functools.lru_cache(maxsize=1)
def _torch_dtypes() -> dict:
    import torch  # imported on first use: importing tracestore stays fast

    return {"uint8": torch.uint8, "int32": torch.int32, "float32": torch.float32, "int64": torch.int64,
            "uint16": torch.uint16 if hasattr(torch, "uint16") else torch.int32}




@dataclass(frozen=True)
class _Piece:
    """Rows of one record that a read needs: tokens ``[start, stop)`` at segment rows ``row0..``."""

    seq: int
    segment: SegmentRef
    start: int
    stop: int
    row0: int
    policy_version: int


def _check_features(store, sites: Sequence[str], features) -> tuple[int, int] | None:
    if features is None:
        return None
    try:
        lo, hi = (int(features[0]), int(features[1]))
    except (TypeError, ValueError, IndexError) as e:
        raise ShapeError(f"features must be a (lo, hi) pair of ints, got {features!r}") from e
    for name in sites:
        site = store.sites[name]
        align = int(np.lcm(8, site.block_size))
        if not (0 <= lo < hi <= site.width) or lo % align or hi % align:
            raise ShapeError(
                f"features [{lo}, {hi}) invalid for site {name!r} (width {site.width}, block {site.block_size}): "
                f"need 0 <= lo < hi <= {site.width}, both multiples of {align} (block size and 8 hint bits per byte)")
    return lo, hi


def read_pieces(store, traj_id: str, start: int, stop: int, pieces: Sequence[_Piece], *, sites=None, features=None,
                fmt: str = "numpy", pin_memory: bool = False, trace: bool = True) -> TraceBatch:
    """Read ``pieces`` (covering ``[start, stop)`` contiguously, in order) into a TraceBatch."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    if sites is None:
        sites = list(store.sites)
    else:
        if isinstance(sites, str):
            sites = [sites]
        sites = list(dict.fromkeys(sites))
        unknown = [s for s in sites if s not in store.sites]
        if unknown:
            raise UnknownSiteError(f"unknown site(s) {unknown!r}; the store declares {list(store.sites)}")
    feats = _check_features(store, sites, features)
    trace_arrays = (("token_ids", "logprobs") + (("experts",) if store.moe_layers else ())) if trace else ()
    T = stop - start
    alloc = _Alloc(fmt, pin_memory)
    nbytes = 8  # per token: policy version
    for name in sites:
        site = store.sites[name]
        lo, hi = feats if feats else (0, site.width)
        nbytes += (hi - lo) // 8 + (hi - lo) // site.block_size
    nbytes += sum(store.array_specs[n].row_nbytes for n in trace_arrays)
    alloc.reserve(T * nbytes + _ARENA_ALIGN * (2 * len(sites) + 4))
    outs: dict[str, tuple[np.ndarray, object, int, int]] = {}  # array -> (numpy view, torch, b0, b1)
    for name in sites:
        site = store.sites[name]
        lo, hi = feats if feats else (0, site.width)
        for kind, per in (("hints", 8), ("scales", site.block_size)):
            b0, b1 = lo // per, hi // per
            arr, t = alloc.empty((T, b1 - b0), np.uint8)
            outs[f"{kind}.{name}"] = (arr, t, b0, b1)
    for name in trace_arrays:
        spec = store.array_specs[name]
        arr, t = alloc.empty((T, *spec.row_shape), spec.dtype)
        outs[name] = (arr, t, 0, 0)
    # which stored arrays to read, and where each of their sites / columns goes
    wanted: dict[str, list[tuple[int, str]]] = {}  # array name -> [(index along axis 1, output column)]
    for name in sites:
        h, sc, k = store.site_arrays[name]
        wanted.setdefault(h, []).append((k, f"hints.{name}"))
        wanted.setdefault(sc, []).append((k, f"scales.{name}"))
    for name in trace_arrays:
        wanted[name] = [(0, name)]
    pv, pv_t = alloc.empty((T,), np.int64)
    targets = ReadTargets()
    for p in pieces:
        r0 = p.row0
        r1 = r0 + (p.stop - p.start)
        dest = p.start - start
        pv[dest:dest + (p.stop - p.start)] = p.policy_version

        def describe(ij, p=p, key=None):
            return (f"object {store.url}/{key} chunk {tuple(ij)} (trajectory {traj_id!r} tokens "
                    f"[{p.start}, {p.stop}), log entry {p.seq}, segment {p.segment.path})")

        for name, members in wanted.items():
            spec = store.array_specs[name]
            lay = layout(spec, p.segment.rows, p.segment.chunk_rows, p.segment.shard_bytes)
            views = {k: (outs[col][0][dest:dest + (r1 - r0)], outs[col][2], outs[col][3]) for k, col in members}
            flats = lay.flat_ranges((k, outs[col][2], outs[col][3]) for k, col in members) if spec.grouped else None
            for rng, chunks in lay.plan(p.segment.path, r0, r1, flats):
                targets.add(rng, lay, chunks, views, r0, r1, functools.partial(describe, key=rng.key))
    try:
        targets.read(store.backend)
    except ObjectNotFoundError as e:
        raise IntegrityError(f"committed data of trajectory {traj_id!r} tokens [{start}, {stop}) is missing in "
                             f"{store.url}: {e}") from e

    pos = np.arange(start, stop, dtype=np.int64)

    def conv(name: str):
        arr, t, _b0, _b1 = outs[name]
        if fmt == "torch":
            return t
        if fmt == "arrow":
            if arr.ndim == 2:
                return pa.FixedSizeBinaryArray.from_buffers(pa.binary(arr.shape[1]), len(arr),
                                                            [None, pa.py_buffer(np.ascontiguousarray(arr))])
            return pa.array(arr)
        return arr

    hints = {n: conv(f"hints.{n}") for n in sites}
    scales = {n: conv(f"scales.{n}") for n in sites}
    experts: dict = {}
    token_ids = logprobs = None
    if trace:
        token_ids, logprobs = conv("token_ids"), conv("logprobs")
        if store.moe_layers:
            arr, t, _, _ = outs["experts"]
            for k, layer in enumerate(store.moe_layers):
                if fmt == "torch":
                    experts[layer] = t[:, k, :]
                elif fmt == "arrow":
                    experts[layer] = pa.FixedSizeListArray.from_arrays(pa.array(arr[:, k, :].ravel()), store.top_k)
                else:
                    experts[layer] = arr[:, k, :]
    if fmt == "torch":
        import torch

        positions, policy = torch.from_numpy(pos), pv_t
    elif fmt == "arrow":
        positions, policy = pa.array(pos), pa.array(pv)
    else:
        positions, policy = pos, pv
    return TraceBatch(traj_id, start, stop, positions, hints, scales, token_ids, logprobs, experts, policy, feats)


class Reader:
    """Random access to the records committed in a snapshot (default: the log head when created).

    Raises (constructor): SnapshotError (foreign/future snapshot), IntegrityError / SchemaVersionError (a log
    entry fails its checks).
    """

    def __init__(self, store, snapshot: Snapshot | str | None = None):
        self.store = store
        self.snapshot = store.check_snapshot(snapshot)
        self._entries = store.read_entries(0, self.snapshot.log_end)
        index: dict[str, list[tuple]] = {}
        for entry in self._entries:
            for t, s, e, ro, pv in entry.records():
                index.setdefault(t, []).append((s, e, entry.seq, ro, pv))
        self._index: dict[str, tuple[np.ndarray, ...]] = {}
        for t, recs in index.items():
            recs.sort()
            a = np.array(recs, dtype=np.int64).reshape(-1, 5)
            self._index[t] = (a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy(), a[:, 4].copy())

    def __repr__(self) -> str:
        return f"Reader({self.store.url!r}, log_end={self.snapshot.log_end}, trajectories={len(self._index)})"

    def refresh(self) -> Reader:
        """A reader at the current log head (entries already read are not read again)."""
        return Reader(self.store, None)

    @property
    def entries(self) -> list[LogEntry]:
        return list(self._entries)

    def __contains__(self, traj_id: str) -> bool:
        return traj_id in self._index

    def traj_ids(self) -> list[str]:
        return sorted(self._index)

    def _records(self, traj_id: str) -> tuple[np.ndarray, ...]:
        """``(starts, stops, seqs, row_offsets, policy_versions)`` of ``traj_id``'s records, sorted by start.

        Raises HintNotFoundError: the snapshot holds no record of ``traj_id``."""
        recs = self._index.get(traj_id)
        if recs is None:
            raise HintNotFoundError(f"trajectory {traj_id!r} has no committed records in {self.store.url} "
                                    f"(snapshot log_end {self.snapshot.log_end})")
        return recs

    def info(self, traj_id: str) -> TrajectoryInfo:
        check_id(traj_id)
        starts, stops, seqs, _ro, pvs = self._records(traj_id)
        ranges = merge_ranges(zip(starts.tolist(), stops.tolist()))
        num = ranges[0][1] if ranges and ranges[0][0] == 0 else 0
        writers = sorted({self._entries[q].writer_id for q in set(seqs.tolist())})
        return TrajectoryInfo(traj_id, num, int((stops - starts).sum()), tuple(ranges), len(starts),
                              tuple(sorted(set(pvs.tolist()))), tuple(writers), int(seqs.min()), int(seqs.max()))

    def trajectories(self) -> list[TrajectoryInfo]:
        """One :class:`TrajectoryInfo` per trajectory, sorted by id."""
        return [self.info(t) for t in sorted(self._index)]

    def trajectories_table(self) -> pa.Table:
        """:meth:`trajectories` as Arrow, in ``traceschemas.trajectory_schema()``."""
        infos = self.trajectories()
        cols = {
            "traj_id": [i.traj_id for i in infos], "num_tokens": [i.num_tokens for i in infos],
            "committed_tokens": [i.committed_tokens for i in infos], "num_records": [i.num_records for i in infos],
            "min_policy_version": [min(i.policy_versions) for i in infos],
            "max_policy_version": [max(i.policy_versions) for i in infos],
            "first_seq": [i.first_seq for i in infos], "last_seq": [i.last_seq for i in infos],
        }
        return pa.table(cols, schema=trajectory_schema())

    def _pieces(self, traj_id: str, start: int, stop: int | None) -> tuple[int, list[_Piece]]:
        check_id(traj_id)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ShapeError(f"start must be an int >= 0, got {start!r}")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, (int, np.integer)) or stop <= start):
            raise ShapeError(f"stop must be an int > start ({start}), got {stop!r}")
        starts, stops, seqs, ros, pvs = self._records(traj_id)
        i = int(np.searchsorted(starts, start, side="right")) - 1
        pieces: list[_Piece] = []
        pos = start
        while True:
            if i < 0 or i >= len(starts) or not (starts[i] <= pos < stops[i]):
                if stop is None and pieces:
                    break
                have = ", ".join(f"[{a}, {b})" for a, b in self.info(traj_id).ranges[:8])
                raise HintNotFoundError(
                    f"trajectory {traj_id!r}: token {pos} is not committed in {self.store.url} (snapshot log_end "
                    f"{self.snapshot.log_end}); committed ranges: {have}")
            end = int(stops[i]) if stop is None else min(int(stops[i]), int(stop))
            seq = int(seqs[i])
            pieces.append(_Piece(seq, self._entries[seq].segment, pos, end, int(ros[i]) + pos - int(starts[i]),
                                 int(pvs[i])))
            pos = end
            if stop is not None and pos >= stop:
                break
            i += 1
        return pos, pieces

    def read(self, traj_id: str, start: int = 0, stop: int | None = None, *, sites: Sequence[str] | None = None,
             features: tuple[int, int] | None = None, fmt: str = "numpy", pin_memory: bool = False,
             trace: bool = True) -> TraceBatch:
        """Tokens ``[start, stop)`` of ``traj_id`` (``stop=None``: up to the end of the contiguous committed run).

        Args:
            sites: subset of site names (default all). features: ``(lo, hi)`` value indices, multiples of the
                site's block size and of 8, applied to every requested site. fmt: "numpy" | "torch" | "arrow".
            pin_memory: torch outputs in pinned host memory (falls back with a warning without CUDA).
            trace: also read token ids, log-probs and experts (False: hints/scales/policy_version only).

        Raises:
            HintNotFoundError: a requested position is not committed in the snapshot. UnknownSiteError,
            ShapeError (bad range / feature slice), InvalidIdError, IntegrityError (crc mismatch, missing data:
            the message names the object and the trajectory).
        """
        stop_, pieces = self._pieces(traj_id, start, stop)
        return read_pieces(self.store, traj_id, int(start), stop_, pieces, sites=sites, features=features, fmt=fmt,
                           pin_memory=pin_memory, trace=trace)


class Stream:
    """Tails the commit log: yields every committed record exactly once, in log order.

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
        if not isinstance(cursor, str):
            raise SnapshotError(f"cursor must be a str, got {type(cursor).__name__}")
        parts = cursor.split(":")
        if len(parts) != 4:
            raise SnapshotError(f"malformed cursor {cursor!r:.80} (expected v1:<store_id>:<seq>:<index>)")
        if parts[0] != "v1":
            raise SchemaVersionError(f"cursor version {parts[0]!r}; supported: ['v1']")
        if parts[1] != self.store.store_id:
            raise SnapshotError(f"cursor belongs to store {parts[1]}, not {self.store.store_id} ({self.store.url})")
        # plain ASCII digits only (int() would also take " 1", "0_1", "+1" and other scripts' digits)
        if not all(_DIGITS.fullmatch(x) for x in parts[2:]):
            raise SnapshotError(f"malformed cursor {cursor!r:.80}: <seq> and <index> must be decimal digits 0-9")
        seq, index = int(parts[2]), int(parts[3])
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
            if index > len(entry):
                raise SnapshotError(
                    f"cursor {cursor!r:.80} is past the end of log entry {seq} in {store.url}: it names record "
                    f"{index}, the entry holds {len(entry)} records (allowed: index 0..{len(entry)})")
            self._prefetched[seq] = entry  # the first entry the stream reads: no second GET

    @property
    def cursor(self) -> str:
        """Position of the next record (serializable; resume with ``store.stream(cursor)``)."""
        return f"v1:{self.store.store_id}:{self._seq}:{self._index}"

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
        self.store._note_head(self._seq + 1)
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

    def __next__(self) -> CommittedRecord:
        deadline = None if self.timeout_s is None else time.monotonic() + self.timeout_s
        while True:
            rec = self._take()
            if rec is not None:
                return rec
            if deadline is not None and time.monotonic() >= deadline:
                raise StopIteration
            time.sleep(self.poll_interval_s)

    def poll(self, max_records: int | None = None) -> list[CommittedRecord]:
        """The records committed now (without waiting), at most ``max_records``."""
        out: list[CommittedRecord] = []
        while max_records is None or len(out) < max_records:
            rec = self._take()
            if rec is None:
                break
            out.append(rec)
        return out

    def read(self, record: CommittedRecord, **kwargs) -> TraceBatch:
        """Read a record's tokens (keyword arguments as :meth:`Reader.read`, without start/stop)."""
        return read_record(self.store, record, **kwargs)


def read_record(store, record: CommittedRecord, *, start: int | None = None, stop: int | None = None,
                **kwargs) -> TraceBatch:
    """Read tokens ``[start, stop)`` (default: all) of one committed record, without building an index."""
    s = record.token_start if start is None else start
    e = record.token_stop if stop is None else stop
    if not (record.token_start <= s < e <= record.token_stop):
        raise ShapeError(f"[{s}, {e}) is not inside record [{record.token_start}, {record.token_stop})")
    piece = _Piece(record.seq, record.segment, s, e, record.row_offset + s - record.token_start,
                   record.policy_version)
    return read_pieces(store, record.traj_id, s, e, [piece], **kwargs)
