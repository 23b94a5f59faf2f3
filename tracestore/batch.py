"""What a read hands out and how one is done: :class:`TraceBatch` (tokens ``[start, stop)`` of one trajectory) and
:func:`read_pieces`, which fills one from committed records — outputs carved from one page-aligned arena, range
reads planned straight into them (only the inner chunks of the requested rows and, for feature slices, columns;
one batched request per contiguous run), every chunk's crc32c checked before its bytes are used, then converted to
numpy, torch or Arrow. :class:`~tracestore.reader.Reader` (random access) and :class:`~tracestore.stream.Stream`
(one committed record) both read through it.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from traceschemas import record_schema, token_schema

from ._aligned import PAGE, aligned_view
from .errors import ArrowOverflowError, IntegrityError, ObjectNotFoundError, OptionError, ShapeError, UnknownSiteError
from .format.entries import SegmentRef
from .format.segment import ReadTargets, layout, margin_layout
from .records import CommittedRecord

__all__ = ["TraceBatch", "MarginRows", "Piece", "read_pieces", "read_record", "FORMATS"]

FORMATS = ("numpy", "torch", "arrow")


class MarginRows(NamedTuple):
    """The margin-exception rows of one site for T tokens (FORMAT §2.5): ``data`` uint8 ``[n]``, the rows back to
    back, and ``offsets`` int64 ``[T + 1]`` (``offsets[0] == 0``, ``offsets[T] == n``): row t (token ``start + t``) is
    ``data[offsets[t]:offsets[t + 1]]``. numpy arrays or torch tensors; what ``Writer.write(rows=)`` takes."""

    data: object
    offsets: object

    def row(self, t: int) -> bytes:
        """Row ``t`` as bytes."""
        off = _np(self.offsets)
        return _np(self.data)[int(off[t]):int(off[t + 1])].tobytes()


@dataclass
class TraceBatch:
    """Tokens ``[start, stop)`` of one trajectory.

    Shapes (``T = stop - start``; ``lo, hi`` the feature slice, the full width by default):
        hints[site]: uint8 ``[T, (hi-lo)/8]``; scales[site]: uint8 ``[T, (hi-lo)/block_size]`` (scale encoding
        lsb: ``[T, ceil(hi/(8*block_size)) - lo/(8*block_size)]``, 8 blocks' scale LSBs per byte, FORMAT §2.4);
        token_ids: int32 ``[T]``; logprobs: float32 ``[T]``; experts[layer]: uint8 (uint16 if > 256 experts)
        ``[T, top_k]`` (views into one ``[T, L, top_k]`` array); policy_version: int64 ``[T]``;
        positions: int64 ``[T]``. numpy arrays, torch tensors or pyarrow arrays depending on ``fmt``.
        rows[site]: the margin-exception rows of each requested site of hint encoding ``margin`` (such a site has
        no ``hints``/``scales`` entry): a :class:`MarginRows` (numpy / torch: ``data`` uint8 ``[n]``, ``offsets``
        int64 ``[T + 1]``), with ``fmt="arrow"`` a ``pyarrow.LargeBinaryArray`` of T rows.
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
    rows: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return self.stop - self.start

    def to_arrow(self) -> pa.Table:
        """The logical records, one row per (position, site), in ``traceschemas.record_schema()``.

        Raises ShapeError: the batch holds margin rows, which that schema has no column for (read ``rows`` with
        ``fmt="arrow"``, or pass ``sites=`` of bits sites)."""
        if self.rows:
            raise ShapeError(f"to_arrow: sites {list(self.rows)} store margin-exception rows (hint_encoding margin), "
                             f"which record_schema() has no column for; take batch.rows (fmt='arrow': one "
                             f"LargeBinaryArray per site) or read sites of hint_encoding bits only")
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
                raise ArrowOverflowError(f"{T} tokens x {row_bytes} bytes = {T * row_bytes} bytes do not fit one Arrow "
                                         f"binary column (at most {np.iinfo(np.int32).max}); convert fewer tokens")
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
_ARENA_ALIGN = PAGE  # outputs start at page boundaries (see tracestore._aligned)


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
    need = nbytes + PAGE
    for k in range(len(arenas) - 1, -1, -1):
        a = arenas[k]
        # references: the pool list, ``a`` and getrefcount's argument -> nothing else holds it
        if need <= a.size <= 2 * need and sys.getrefcount(a) == 3:
            del arenas[k]
            arenas.append(a)  # most recently used last
            return aligned_view(a, nbytes)
        del a
    a = np.empty(need, np.uint8)
    if need <= _POOL_MAX_BYTES:
        arenas.append(a)
        while len(arenas) > _POOL_ARENAS or sum(x.size for x in arenas) > _POOL_MAX_BYTES:
            del arenas[0]  # the least recently used (still valid for whoever holds its outputs)
    return aligned_view(a, nbytes)


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
            raise OptionError(f"pin_memory=True needs fmt='torch', got fmt={fmt!r}")

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
class Piece:
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
        if site.is_margin:
            if (lo, hi) != (0, site.width):
                raise ShapeError(f"features [{lo}, {hi}) invalid for site {name!r}: it stores margin-exception rows "
                                 f"(hint_encoding margin), which are read whole (features (0, {site.width}) or None); "
                                 f"read it apart from the feature slice, or declare one site per slice")
            continue
        # a slice starts at a hint byte and a scale byte (scale encoding lsb: a byte holds 8 blocks' bits) and
        # ends at one or at the row's end
        align = int(np.lcm(8, site.scale_values_per_byte))
        if not (0 <= lo < hi <= site.width) or lo % align or (hi % align and hi != site.width):
            what = ("block size and 8 hint bits per byte" if site.scale_encoding == "bytes" else
                    f"8 scale bits per byte of blocks of {site.block_size}: scale encoding {site.scale_encoding}")
            raise ShapeError(
                f"features [{lo}, {hi}) invalid for site {name!r} (width {site.width}, block {site.block_size}): "
                f"need 0 <= lo < hi <= {site.width}, both multiples of {align} ({what}; hi may be the width)")
    return lo, hi


def _check_sites(store, sites) -> list[str]:
    """The sites to read, in order, without duplicates (default: every declared site)."""
    if sites is None:
        return list(store.sites)
    if isinstance(sites, str):
        sites = [sites]
    sites = list(dict.fromkeys(sites))
    unknown = [s for s in sites if s not in store.sites]
    if unknown:
        raise UnknownSiteError(f"unknown site(s) {unknown!r}; the store declares {list(store.sites)}")
    return sites


def _allocate(store, sites: list[str], feats, trace_arrays: tuple[str, ...], T: int, alloc: _Alloc) -> dict:
    """The outputs of one read, carved from one arena: ``{column: (numpy view, torch tensor | None, b0, b1)}``
    (``hints.<site>`` / ``scales.<site>`` ``[T, b1 - b0]`` bytes, trace arrays ``[T, *row_shape]``, and
    ``policy_version`` ``[T]`` int64)."""
    nbytes = 8  # per token: policy version
    for name in sites:
        site = store.sites[name]
        lo, hi = feats if feats else (0, site.width)
        nbytes += (hi - lo) // 8 + -(-hi // site.scale_values_per_byte) - lo // site.scale_values_per_byte
    nbytes += sum(store.array_specs[n].row_nbytes for n in trace_arrays)
    alloc.reserve(T * nbytes + _ARENA_ALIGN * (2 * len(sites) + 4))
    outs: dict[str, tuple[np.ndarray, object, int, int]] = {}
    for name in sites:
        site = store.sites[name]
        lo, hi = feats if feats else (0, site.width)
        for kind, per in (("hints", 8), ("scales", site.scale_values_per_byte)):
            b0, b1 = lo // per, -(-hi // per)
            outs[f"{kind}.{name}"] = (*alloc.empty((T, b1 - b0), np.uint8), b0, b1)
    for name in trace_arrays:
        spec = store.array_specs[name]
        outs[name] = (*alloc.empty((T, *spec.row_shape), spec.dtype), 0, 0)
    outs["policy_version"] = (*alloc.empty((T,), np.int64), 0, 0)
    return outs


def _plan(store, traj_id: str, start: int, pieces: Sequence[Piece], sites: list[str],
          trace_arrays: tuple[str, ...], outs: dict) -> ReadTargets:
    """Range reads of every stored array a read needs, each targeting its rows and columns of ``outs``."""
    wanted: dict[str, list[tuple[int, str]]] = {}  # array name -> [(index along axis 1, output column)]
    for name in sites:
        h, sc, k = store.site_arrays[name]
        wanted.setdefault(h, []).append((k, f"hints.{name}"))
        wanted.setdefault(sc, []).append((k, f"scales.{name}"))
    for name in trace_arrays:
        wanted[name] = [(0, name)]
    pv = outs["policy_version"][0]
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
    return targets


def _assemble(store, traj_id: str, start: int, stop: int, sites: list[str], trace: bool, outs: dict, fmt: str,
              feats) -> TraceBatch:
    """The TraceBatch of filled ``outs``, converted to ``fmt`` (numpy views, torch tensors or Arrow arrays)."""

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
    pos = np.arange(start, stop, dtype=np.int64)
    if fmt == "torch":
        import torch

        positions = torch.from_numpy(pos)
    elif fmt == "arrow":
        positions = pa.array(pos)
    else:
        positions = pos
    return TraceBatch(traj_id, start, stop, positions, hints, scales, token_ids, logprobs, experts,
                      conv("policy_version"), feats)


def read_pieces(store, traj_id: str, start: int, stop: int, pieces: Sequence[Piece], *, sites=None, features=None,
                fmt: str = "numpy", pin_memory: bool = False, trace: bool = True) -> TraceBatch:
    """Read ``pieces`` (covering ``[start, stop)`` contiguously, in order) into a TraceBatch: allocate the
    outputs, plan range reads straight into them, read and check every chunk's crc32c, convert to ``fmt``."""
    if fmt not in FORMATS:
        raise OptionError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    sites = _check_sites(store, sites)
    feats = _check_features(store, sites, features)
    margin = [n for n in sites if n in store.margin_arrays]
    bits = [n for n in sites if n not in store.margin_arrays]
    if feats is not None and not bits:
        feats = None
    trace_arrays = (("token_ids", "logprobs") + (("experts",) if store.moe_layers else ())) if trace else ()
    alloc = _Alloc(fmt, pin_memory)
    outs = _allocate(store, bits, feats, trace_arrays, stop - start, alloc)
    targets = _plan(store, traj_id, start, pieces, bits, trace_arrays, outs)
    ends = _plan_margin_ends(store, traj_id, pieces, margin, targets)
    _read(store, targets, traj_id, start, stop)
    batch = _assemble(store, traj_id, start, stop, bits, trace, outs, fmt, feats)
    if margin:
        batch.rows = _read_margin(store, traj_id, start, stop, margin, ends, fmt, alloc)
    return batch


def _read(store, targets: ReadTargets, traj_id: str, start: int, stop: int) -> None:
    try:
        targets.read(store.backend)
    except ObjectNotFoundError as e:
        raise IntegrityError(f"committed data of trajectory {traj_id!r} tokens [{start}, {stop}) is missing in "
                             f"{store.url}: {e}") from e


def _plan_margin_ends(store, traj_id: str, pieces: Sequence[Piece], margin: list[str], targets: ReadTargets
                      ) -> dict[str, list]:
    """Plan reads of the row ends each piece needs of each margin site into ``targets``: rows ``[r0 - 1, r1)`` (row
    ``r0 - 1``'s end is row ``r0``'s start; none before row 0). Returns ``{site: [(piece, ends uint32, r0 > 0)]}``."""
    out: dict[str, list] = {}
    for name in margin:
        spec = store.array_specs[store.margin_arrays[name][0]]
        out[name] = []
        for p in pieces:
            r0 = p.row0
            r1 = r0 + (p.stop - p.start)
            ra = max(r0 - 1, 0)
            ends = np.empty(r1 - ra, np.dtype("<u4"))
            lay = layout(spec, p.segment.rows, p.segment.chunk_rows, p.segment.shard_bytes)

            def describe(ij, p=p, key=None):
                return (f"object {store.url}/{key} chunk {tuple(ij)} (trajectory {traj_id!r} tokens "
                        f"[{p.start}, {p.stop}), log entry {p.seq}, segment {p.segment.path})")

            for rng, chunks in lay.plan(p.segment.path, ra, r1):
                targets.add(rng, lay, chunks, {0: (ends, 0, 0)}, ra, r1, functools.partial(describe, key=rng.key))
            out[name].append((p, ends, r0 > 0))
    return out


def _read_margin(store, traj_id: str, start: int, stop: int, margin: list[str], ends: dict, fmt: str,
                 alloc: _Alloc) -> dict:
    """Each margin site's rows of tokens ``[start, stop)``: check the row ends read (non-decreasing, rows of at
    most ``max_row_bytes``; IntegrityError naming the object otherwise), then read the byte ranges they give
    straight into one output per site (every chunk's crc32c checked) -> ``{site: rows}`` in ``fmt``."""
    T = stop - start
    targets = ReadTargets()
    outs: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name in margin:
        site = store.sites[name]
        ends_name, data_name = store.margin_arrays[name]
        spec = store.array_specs[data_name]
        offsets = np.zeros(T + 1, np.int64)
        ranges = []
        pos = 0
        for p, e, skip in ends[name]:
            e = e.astype(np.int64)
            a, vals = (int(e[0]), e[1:]) if skip else (0, e)
            lengths = np.diff(vals, prepend=a)
            if (lengths < 0).any() or int(lengths.max(initial=0)) > site.max_row_bytes:
                raise IntegrityError(
                    f"damaged row ends: object {store.url}/{p.segment.path}/{ends_name} rows [{p.row0}, "
                    f"{p.row0 + len(vals)}) are not non-decreasing ends of rows of at most max_row_bytes "
                    f"{site.max_row_bytes} (got lengths {lengths.min()}..{lengths.max()}; trajectory {traj_id!r} "
                    f"tokens [{p.start}, {p.stop}), log entry {p.seq})")
            dest = p.start - start
            offsets[dest + 1:dest + 1 + len(vals)] = pos + vals - a
            b = int(vals[-1])
            ranges.append((p, a, b, pos))
            pos += b - a
        data = np.empty(pos, np.uint8)
        for p, a, b, at in ranges:
            if b == a:
                continue
            lay = margin_layout(spec, b, p.segment.chunk_rows, p.segment.shard_bytes)

            def describe(ij, p=p, key=None):
                return (f"object {store.url}/{key} chunk {tuple(ij)} (margin rows of trajectory {traj_id!r} tokens "
                        f"[{p.start}, {p.stop}), log entry {p.seq}, segment {p.segment.path})")

            for rng, chunks in lay.plan(p.segment.path, a, b):
                targets.add(rng, lay, chunks, {0: (data[at:at + (b - a)], 0, 0)}, a, b,
                            functools.partial(describe, key=rng.key))
        outs[name] = (data, offsets)
    _read(store, targets, traj_id, start, stop)
    out: dict = {}
    for name, (data, offsets) in outs.items():
        if fmt == "arrow":
            out[name] = pa.LargeBinaryArray.from_buffers(pa.large_binary(), T,
                                                         [None, pa.py_buffer(offsets), pa.py_buffer(data)])
        elif fmt == "torch":
            import torch

            d, o = torch.from_numpy(data), torch.from_numpy(offsets)
            out[name] = MarginRows(d.pin_memory(), o.pin_memory()) if alloc.pin else MarginRows(d, o)
        else:
            out[name] = MarginRows(data, offsets)
    return out


def read_record(store, record: CommittedRecord, *, start: int | None = None, stop: int | None = None,
                **kwargs) -> TraceBatch:
    """Read tokens ``[start, stop)`` (default: all) of one committed record, without building an index."""
    s = record.token_start if start is None else start
    e = record.token_stop if stop is None else stop
    if not (record.token_start <= s < e <= record.token_stop):
        raise ShapeError(f"[{s}, {e}) is not inside record [{record.token_start}, {record.token_stop})")
    piece = Piece(record.seq, record.segment, s, e, record.row_offset + s - record.token_start,
                   record.policy_version)
    return read_pieces(store, record.traj_id, s, e, [piece], **kwargs)
