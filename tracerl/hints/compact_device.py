"""Margin-exception rows packed and unpacked on the tensors' device (torch; issue 23): the same bytes as the numpy
`compact.pack_rows` / `compact.unpack_rows`, with no Python loop over rows or codewords and a fixed, small number
of host syncs per call, so a GPU encodes on the capture path and decodes in the trainer's feed.

The byte layout is `compact`'s (its module docstring): per token a row, MSB first, zero-padded to a byte::

    [value positions] [one hint bit per marked value] [block positions] [8 bits (or 1: scale hints) per marked block]

**Packing** (`pack_rows_torch`, `pack_marks_torch`). Every row's bit count is worked out densely from the masks
([T, n] elementwise ops, a ``cummax`` for each marked position's gap to the one before), so the row offsets are a
``cumsum``; one ``.tolist()`` of a handful of scalars then brings the total byte count, the mark counts and the
input checks to the host (the only sync: the output's size). Then every field is written into a zeroed bit array
of that size by index writes of its one bits — a field of width L at bit offset p is L scattered bits, a
Golomb-Rice unary run of q ones (any q: the numpy packer's 62-bit pieces are only its field limit) is a +1/-1 pair
whose ``cumsum`` covers the run — and the bits are folded into bytes. The marked positions are listed by a
``cumsum`` compaction of known size (the marks' count), not ``nonzero``, which would sync for its size.

**Unpacking** (`unpack_rows_torch`). The fixed-width fields (bitmaps, block-bitmap groups, hint bits, scale
payloads) are gathered directly. A gamma / Rice codeword starting at bit p ends at ``jump[p]``, computed for every
bit in one pass (a reversed ``cummin`` gives the next 1 or 0 at or after every bit: gamma ends at ``2 o - p + 1``,
Rice at ``o + 1 + k``); row r's m-th codeword starts at ``jump^m(first_r)``, found by binary lifting: the tables
``jump^(2^j)`` are built by squaring (``J = J[J]``, one gather over the stream per level) and each codeword applies
the levels of the set bits of m (powers of one map commute, so one table is live at a time). The value codewords
are walked as a compact list sized by their count (one sync, only for a gamma or Rice value coding); the block
codewords (W/16 per row at most) in a dense [T, W/16] grid of slots, so the blocks need no sync of their own. The
final sync brings the mark counts (the output sizes) and every check. Syncs per call: one, two when the value coding
is gamma or Rice.

**Errors.** Every check of the numpy decoder is made, in its order, on the same values (positions are clamped
into the stream for the gathers, so damaged bytes never index out of range); the checks are reduced on the device
and read with the sync, and the first failing one raises `HintCodingError` with the numpy decoder's message. So the
torch decoder raises exactly when `unpack_rows` does. Two deliberate differences, both before any data is read:
an unknown coding (or a block-bitmap over a row length not a multiple of 16) raises `ConfigError` even for damaged
bytes, and `pack_rows_torch` of inconsistent exceptions (a hint-bit or scale-byte count that is not the marks'
count) raises `HintCodingError` (`compact.reconstruct`'s error) where numpy fails with an IndexError or writes
garbage.

**Several sites** (`unpack_sites_torch`, `pack_sites_on_device`). On CUDA a call costs its ~60 small ops and its
syncs whatever its size, so per-site calls are paid in launches and syncs, not bytes. Rows are independent and
byte-aligned, so the sites that share width, coding and scale payload go through ONE call over their rows stacked
(data back to back, offsets shifted), and the results are cut back per site: the masks by rows, the kept bits and
bytes by each site's mark counts, which the decode reads with its last sync (syncs per group: those of one call).
Calls are capped per device type (`_BATCH_CAPS`): on CUDA by the temporaries' memory; on the CPU, where a call costs
memory traffic rather than launches, at a few sites (stacking more only leaves the cache). A damaged row makes the
group's call raise; then every site is decoded (packed) again on its own, in order, so the error is the first
failing site's own, naming the row within its site.

On CUDA, `unpack_sites_torch` / `pack_marks_on_device` run on a side stream of the device, so their syncs wait for
their own kernels, not for the work already queued on the caller's stream (a trainer's backward, a decode step).

Bit positions are int64 throughout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

import tracefp4
from tracerl.config import MARGIN_DECODES
from tracerl.errors import ConfigError, HintCodingError
from tracerl.hints.compact import (
    BLOCK,
    GROUP,
    DenseExceptions,
    MarginExceptions,
    PackedRows,
    SiteCoding,
    _check_coding,
    offsets_cover,
    unpack_rows,
)
from tracerl.util import to_device, to_host

__all__ = ["pack_rows_torch", "pack_marks_torch", "pack_marks_on_device", "pack_sites_on_device", "SiteMarks",
           "decode_on_side_stream", "unpack_sites",
           "unpack_rows_torch", "unpack_sites_torch"]

log = logging.getLogger(__name__)

_I64 = torch.int64
#: the most bits one `_Stream.read` returns (an 8-byte window at any bit offset)
_READ_MAX = 56
#: the numpy packer writes a Rice unary run in pieces of <= 62 ones and refuses a codeword of more than 63 pieces
_RICE_MAX_Q = 63 * 62


# ---------------------------------------------------------------------------------------------------------
# small tools
# ---------------------------------------------------------------------------------------------------------
def _floor_log2(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) (int64) of integers >= 1 (exact below 2^53: frexp, not log2); -1 for 0."""
    _, e = torch.frexp(x.to(torch.float64))
    return e.to(_I64) - 1


def _compact(mask: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) int64 [size] of the set entries of ``mask`` bool [T, n], row-major, when it has exactly
    ``size`` of them: ``nonzero`` without its size sync (a rank ``cumsum`` and one index write; the unset entries
    all go to one spare slot)."""
    t_, n = mask.shape
    dev = mask.device
    if size == 0 or n == 0:
        return torch.zeros(0, dtype=_I64, device=dev), torch.zeros(0, dtype=_I64, device=dev)
    flat = mask.reshape(-1)
    rank = torch.cumsum(flat, 0, dtype=_I64) - 1
    out = torch.zeros(size + 1, dtype=_I64, device=dev)
    out.index_put_((torch.where(flat, rank, size),), torch.arange(flat.numel(), dtype=_I64, device=dev))
    at = out[:size]
    return at // n, at % n


def _first_of_row(count: torch.Tensor) -> torch.Tensor:
    """int64 [T]: the index of each row's first entry in a row-major list with ``count`` [T] entries per row."""
    return torch.cumsum(count, 0) - count


def _last_dim_cummax_exclusive(last: torch.Tensor) -> torch.Tensor:
    """[T, n] -> [T, n]: the running max of ``last`` before each column (-1 before the first)."""
    if last.shape[1] == 0:
        return last.clone()
    cm = torch.cummax(last, dim=1).values
    return torch.cat([torch.full_like(cm[:, :1], -1), cm[:, :-1]], dim=1)


def _dense_gaps(mask: torch.Tensor) -> torch.Tensor:
    """int64 [T, n]: at each marked position its gap ``p_i - p_(i-1)`` (``p_(-1) = -1``), 0 elsewhere."""
    col = torch.arange(mask.shape[1], dtype=_I64, device=mask.device).expand(mask.shape)
    prev = _last_dim_cummax_exclusive(torch.where(mask, col, torch.full_like(col, -1)))
    return torch.where(mask, col - prev, torch.zeros_like(col))


def _list_gaps(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """int64 [K]: the gaps of a row-major list of positions (as `compact._gaps`)."""
    prev = torch.cat([cols.new_full((1,), -1), cols[:-1]])
    first = torch.ones_like(rows, dtype=torch.bool)
    first[1:] = rows[1:] != rows[:-1]
    return cols - torch.where(first, torch.full_like(prev, -1), prev)


class _Bits:
    """A zeroed bit array of ``nbits`` bits plus one spare bit (index ``nbits``) that takes every write that is
    not to be made, so writes need no boolean masks."""

    def __init__(self, nbits: int, device: torch.device):
        self.n = nbits
        self.bits = torch.zeros(nbits + 1, dtype=torch.uint8, device=device)

    def set_ones(self, dest: torch.Tensor, on: torch.Tensor) -> None:
        """Set bit ``dest`` wherever ``on`` (same shapes)."""
        if dest.numel():
            self.bits[torch.where(on, dest, torch.full_like(dest, self.n)).reshape(-1)] = 1

    def fields(self, at: torch.Tensor, value: torch.Tensor, width: torch.Tensor | int, max_width: int) -> None:
        """Fields (int64 [K]) ``value`` of ``width`` (<= ``max_width`` <= 62) bits at bit offsets ``at``, MSB first
        (only the low ``width`` bits of a value are written)."""
        if at.numel() == 0 or max_width == 0:
            return
        width = torch.as_tensor(width, dtype=_I64, device=at.device).expand(at.shape)
        j = torch.arange(max_width, dtype=_I64, device=at.device)
        shift = (width[:, None] - 1 - j).clamp(min=0)
        on = (((value[:, None] >> shift) & 1) == 1) & (j < width[:, None])
        self.set_ones(at[:, None] + j, on)

    def runs(self, at: torch.Tensor, length: torch.Tensor) -> None:
        """Runs of ``length`` (int64 [K], >= 0, non-overlapping) ones starting at bit ``at``: +1 at the start, -1
        after the end, and the ``cumsum`` is 1 inside a run."""
        if at.numel() == 0:
            return
        diff = torch.zeros(self.n + 2, dtype=torch.int32, device=at.device)
        has = length > 0
        sink = torch.full_like(at, self.n + 1)
        ones = torch.ones_like(at, dtype=torch.int32)
        diff.index_put_((torch.where(has, at, sink),), ones, accumulate=True)
        diff.index_put_((torch.where(has, at + length, sink),), -ones, accumulate=True)
        inside = torch.cumsum(diff[: self.n], 0, dtype=torch.int32) > 0
        self.bits[: self.n] |= inside.to(torch.uint8)

    def to_bytes(self) -> torch.Tensor:
        """uint8 [nbits / 8]: the bits, MSB first (nbits a multiple of 8)."""
        b = self.bits[: self.n].reshape(-1, 8).to(torch.int32)
        shifts = torch.arange(7, -1, -1, dtype=torch.int32, device=b.device)
        return (b << shifts).sum(dim=1).to(torch.uint8)


def _section_sync(values: Sequence[torch.Tensor]) -> list[int]:
    """One device-to-host read of integer scalars or vectors, flattened in order (the sync of a call)."""
    if not values:
        return []
    return torch.cat([v.reshape(-1).to(_I64) for v in values]).tolist()


#: device type -> the most (row bytes, rows x width) one decode over stacked sites takes, and the most rows x width
#: one pack takes. A call's temporaries grow with them (a decode: an int64 per bit of the stream for the gamma / Rice
#: jump tables, 4 MiB of gamma rows peaked at 1.4 GiB on the CPU; a pack: int64 [T, W] gaps and indices, 56 B per
#: row cell at the peak). On CUDA a call costs its ~60 launches and its syncs, whatever its size, so sites are
#: stacked up to some 0.7 to 0.9 GiB of temporaries beside the trainer's or the engine's own. On the CPU a call costs
#: memory traffic, which slows down once the temporaries leave the cache: 20 sites of W 2048 (gamma / bitmap, 10%
#: marked) decode 3 to 6x faster in one call than one by one at 4 to 16 rows a site, as fast at 64 rows (260 KB of
#: rows in all), 2x slower at 256 rows, so calls stay small there. Other device types take the CPU's caps.
_BATCH_CAPS: dict[str, tuple[int, int, int]] = {"cuda": (2 << 20, 1 << 26, 1 << 24),
                                                "cpu": (64 << 10, 1 << 19, 1 << 19)}


def _batch_caps(device: torch.device, what: str) -> tuple[int, int]:
    """(row bytes, rows x width) of one call over stacked sites on ``device``; ``what``: "decode" or "pack" (which
    is not capped by bytes: its input is dense)."""
    max_bytes, decode_cells, pack_cells = _BATCH_CAPS.get(device.type, _BATCH_CAPS["cpu"])
    return (max_bytes, decode_cells) if what == "decode" else (1 << 62, pack_cells)


def _chunks(items: list[tuple[str, int, int]], max_bytes: int, max_cells: int) -> list[list[str]]:
    """Consecutive runs of ``items`` (name, bytes, cells) within the caps (an item over them goes alone)."""
    out: list[list[str]] = []
    nbytes = cells = 0
    for name, b, c in items:
        if not out or nbytes + b > max_bytes or cells + c > max_cells:
            out.append([])
            nbytes = cells = 0
        out[-1].append(name)
        nbytes, cells = nbytes + b, cells + c
    return out


# ---------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------
class _Section:
    """One position set of a pack: its coding, per-row position bits (int64 [T]) and the input checks made with
    the sync ((bad 0-d bool, detail 0-d int64, message(detail))), and then its field writes."""

    def __init__(self, mask: torch.Tensor, coding: str, k: int | None):
        self.mask, self.coding, self.k = mask, coding, k
        t_, n = mask.shape
        dev = mask.device
        self.count = mask.sum(dim=1, dtype=_I64)  # [T]
        self.checks: list[tuple[torch.Tensor, torch.Tensor, Callable[[int], str]]] = []
        zero = torch.zeros((), dtype=_I64, device=dev)
        if coding == "all":
            missing = (~mask).sum(dtype=_I64)
            self.checks.append((missing > 0, missing, lambda d: f"coding 'all' needs every position marked; {d} of "
                                                                f"{t_ * n} are not"))
            self.bits = torch.zeros(t_, dtype=_I64, device=dev)
        elif coding == "bitmap":
            self.bits = torch.full((t_,), n, dtype=_I64, device=dev)
        elif coding == "block-bitmap":
            groups = mask.reshape(t_, n // GROUP, GROUP).any(dim=2).sum(dim=1, dtype=_I64)
            self.bits = n // GROUP + GROUP * groups
        else:
            gaps = _dense_gaps(mask)  # [T, n], 0 where unmarked
            if k is None:
                per = torch.where(mask, 2 * _floor_log2(gaps) + 1, torch.zeros_like(gaps))
            else:
                q = (gaps - 1) >> k
                per = torch.where(mask, q + 1 + k, torch.zeros_like(gaps))
                long_q = (mask & (q >= _RICE_MAX_Q)).any()
                gmax = gaps.amax() if gaps.numel() else zero
                self.checks.append((long_q, gmax, lambda d: f"coding {coding!r}: a gap of {d} needs more than 63 "
                                                            "unary pieces; use a larger k"))
            self.bits = 2 * _floor_log2(self.count + 1) + 1 + per.sum(dim=1)

    def write(self, out: _Bits, start: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> None:
        """Write the position bits of every row at bit ``start`` [T]; ``rows``, ``cols``: the marked positions."""
        mask, coding, k = self.mask, self.coding, self.k
        t_, n = mask.shape
        dev = mask.device
        if coding == "all" or t_ == 0:
            return
        if coding == "bitmap":
            out.set_ones(start[:, None] + torch.arange(n, dtype=_I64, device=dev), mask)
            return
        if coding == "block-bitmap":
            ng = n // GROUP
            g = mask.reshape(t_, ng, GROUP)
            present = g.any(dim=2)  # [T, n/16]
            out.set_ones(start[:, None] + torch.arange(ng, dtype=_I64, device=dev), present)
            within = torch.cumsum(present, dim=1, dtype=_I64) - present.to(_I64)  # rank among the present groups
            at = (start[:, None, None] + ng + GROUP * within[:, :, None]
                  + torch.arange(GROUP, dtype=_I64, device=dev))
            out.set_ones(at, g)
            return
        # gamma(count + 1): floor(log2) zeros, then the value in floor(log2) + 1 bits
        x = self.count + 1
        width = _floor_log2(x) + 1
        out.fields(start + width - 1, x, width, int(n + 1).bit_length())
        gaps = _list_gaps(rows, cols)  # [K]
        if k is None:
            gw = _floor_log2(gaps) + 1
            length = 2 * gw - 1
        else:
            q = (gaps - 1) >> k
            length = q + 1 + k
        excl = torch.cumsum(length, 0) - length  # bits of the row's codewords before each one (+ earlier rows')
        first = _first_of_row(self.count)
        at = start[rows] + (2 * width[rows] - 1) + excl - excl[first[rows]]
        if k is None:
            out.fields(at + gw - 1, gaps, gw, int(n).bit_length())
        else:
            out.runs(at, q)  # q ones, then the zero the array already has
            if k:
                out.fields(at + q + 1, (gaps - 1) & ((1 << k) - 1), k, k)


def _pack(value_mask: torch.Tensor, scale_mask: torch.Tensor, coding: SiteCoding, scale_payload: str,
          hint_bits: torch.Tensor | None, scale_bytes: torch.Tensor | None,
          hints_dense: torch.Tensor | None = None, scales_dense: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows' bytes: with ``hint_bits`` [N] / ``scale_bytes`` [M] (a `MarginExceptions`' kept bits and bytes,
    checked against the masks' counts), or with ``hints_dense`` [T, W] / ``scales_dense`` [T, W/16] (every
    position's hint bit and scale byte; the marked ones are kept)."""
    if value_mask.dim() != 2 or scale_mask.dim() != 2 or value_mask.shape[0] != scale_mask.shape[0]:
        raise tracefp4.ShapeError(f"value_mask [T, W] and scale_mask [T, W/16] must share T; got "
                                  f"{list(value_mask.shape)} and {list(scale_mask.shape)}")
    dev = value_mask.device
    value_mask = value_mask.to(torch.bool)
    scale_mask = scale_mask.to(device=dev, dtype=torch.bool)
    t_, w = value_mask.shape
    kv = _check_coding(coding.values, w)
    kb = _check_coding(coding.blocks, scale_mask.shape[1])
    per = 1 if scale_payload == "lsb" else 8
    vsec, bsec = _Section(value_mask, coding.values, kv), _Section(scale_mask, coding.blocks, kb)
    row_bits = vsec.bits + vsec.count + bsec.bits + per * bsec.count
    offsets = torch.cat([torch.zeros(1, dtype=_I64, device=dev), torch.cumsum((row_bits + 7) // 8, 0)])
    checks = vsec.checks + bsec.checks
    got = _section_sync([offsets[-1], vsec.count.sum(), bsec.count.sum()]
                        + [c for bad, detail, _ in checks for c in (bad, detail)])  # the one sync
    nbytes, nv, nb = got[:3]
    for (_, _, message), bad, detail in zip(checks, got[3::2], got[4::2]):
        if bad:
            raise ConfigError(message(detail))
    if hint_bits is not None and (hint_bits.numel() != nv or scale_bytes.numel() != nb):
        raise HintCodingError(f"margin exceptions mark {nv} values and {nb} blocks but hold {hint_bits.numel()} "
                              f"hint bits and {scale_bytes.numel()} scale bytes")
    out = _Bits(8 * nbytes, dev)
    start = offsets[:-1] * 8
    hr, hc = _compact(value_mask, nv)
    sr, sc = _compact(scale_mask, nb)
    vsec.write(out, start, hr, hc)
    s2 = start + vsec.bits  # hint bits
    hints = (hint_bits.to(dev) if hint_bits is not None else hints_dense[hr, hc]).to(_I64)
    hrank = torch.arange(nv, dtype=_I64, device=dev) - _first_of_row(vsec.count)[hr]
    out.set_ones(s2[hr] + hrank, (hints & 1) == 1)
    s3 = s2 + vsec.count  # block positions
    bsec.write(out, s3, sr, sc)
    s4 = s3 + bsec.bits  # scale payload
    scales = (scale_bytes.to(dev) if scale_bytes is not None else scales_dense[sr, sc]).to(_I64)
    srank = torch.arange(nb, dtype=_I64, device=dev) - _first_of_row(bsec.count)[sr]
    out.fields(s4[sr] + per * srank, scales, per, per)
    return out.to_bytes(), offsets


def pack_rows_torch(enc: MarginExceptions, coding: SiteCoding) -> tuple[torch.Tensor, torch.Tensor]:
    """``enc`` as rows, on ``enc.value_mask``'s device: (data uint8 [nbytes], offsets int64 [T + 1]), byte for byte
    `compact.pack_rows(enc, coding)`'s ``data`` / ``offsets``.

    One host sync (the total byte count, read together with the mark counts and the input checks); no
    ``nonzero``, no loop over rows. Raises `ConfigError` where `compact.pack_rows` does (an unknown coding, a
    block-bitmap over a row length not a multiple of 16, ``all`` with a position unmarked, a Rice gap of more than
    63 x 62 unary ones), `HintCodingError` when ``enc`` holds another number of hint bits or scale bytes than its
    masks mark, tracefp4's `ShapeError` for masks of different row counts."""
    return _pack(enc.value_mask, enc.scale_mask, coding, enc.scale_payload, enc.hint_bits, enc.scale_bytes)


def pack_marks_torch(value_marks: torch.Tensor, block_marks: torch.Tensor, hints_packed: torch.Tensor,
                     scales_e4m3: torch.Tensor, coding: SiteCoding, scale_payload: str = "byte"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_rows_torch` of `compact.exceptions_from_marks` of the same tensors, without building the exceptions
    (whose boolean gathers sync twice more): value marks uint8 [T, W/8], block marks uint8 [T, ceil(W/128)]
    (``tracefp4.margin_marks``' layout), the rollout's hints uint8 [T, W/8] and E4M3 scale bytes uint8 [T, W/16],
    all on one device. Returns (data uint8 [nbytes], offsets int64 [T + 1]) there; one host sync. Raises as
    `pack_rows_torch` does."""
    w = hints_packed.shape[1] * 8
    dev = hints_packed.device
    value_mask = tracefp4.unpack_hints(value_marks.to(dev)).bool()  # [T, W]
    scale_mask = tracefp4.unpack_hints(block_marks.to(dev))[:, : w // BLOCK].bool()  # [T, W/16]
    return _pack(value_mask, scale_mask, coding, scale_payload, None, None,
                 hints_dense=tracefp4.unpack_hints(hints_packed), scales_dense=scales_e4m3.to(dev))


_SIDE: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device):
    """A stream of ``device`` for the work whose syncs must not wait for the caller's queue (CUDA), else None."""
    if device.type != "cuda":
        return None
    dev = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
    if dev not in _SIDE:
        _SIDE[dev] = torch.cuda.Stream(dev)
    return _SIDE[dev]


def decode_on_side_stream(device: torch.device, decode: Callable[[], dict],
                          record: Callable[[], Sequence[torch.Tensor]] | None = None) -> dict:
    """``decode()`` (site -> `MarginExceptions` or `DenseExceptions` on ``device``) run on the device's side stream
    when it is CUDA, so its syncs wait for its own kernels, not for the caller's queued work; then the caller's
    stream waits for the side stream and each result's tensors (``TENSORS``) are marked as used by it
    (``record_stream``): safe to use there at once. ``record``: instead, the tensors to mark (called after
    ``decode()``; e.g. the allocations that the results are views of, one call each instead of one per view). Off
    CUDA, ``decode()`` as it is."""
    stream = _side_stream(device)
    if stream is None:
        return decode()
    caller = torch.cuda.current_stream(device)
    with torch.cuda.stream(stream):
        out = decode()
    caller.wait_stream(stream)
    used = record() if record is not None else [getattr(item, f) for item in out.values() for f in item.TENSORS]
    for t in used:
        t.record_stream(caller)
    return out


def pack_marks_on_device(device: torch.device, value_marks: np.ndarray, block_marks: np.ndarray,
                         hints_packed: np.ndarray, scales_e4m3: np.ndarray, coding: SiteCoding,
                         scale_payload: str = "byte") -> tuple[np.ndarray, np.ndarray]:
    """`pack_marks_torch` of host arrays (numpy uint8, the recorder's staged rows) on ``device``: (data uint8
    [nbytes], offsets int64 [T + 1]) numpy, `compact.store_rows` of `compact.pack_rows` of the same rows.

    The arrays go over from pinned memory, the rows come back in one device-to-host copy (data and offsets
    together); on CUDA it all runs on a side stream of the device, so its sync and that copy wait for the pack's
    own kernels only. Raises as `pack_rows_torch` does."""
    device = torch.device(device)
    stream = _side_stream(device)
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        args = [to_device(torch.from_numpy(np.ascontiguousarray(a)), device)
                for a in (value_marks, block_marks, hints_packed, scales_e4m3)]
        data, offsets = pack_marks_torch(*args, coding, scale_payload)
        data_h, offsets_h = to_host([data, offsets])
    return data_h, offsets_h


#: a site's rows for `pack_sites_on_device`: (value marks, block marks, hints, scale bytes, coding, scale payload),
#: `pack_marks_on_device`'s arguments
SiteMarks = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, SiteCoding, str]


def _stack_key(marks: SiteMarks) -> tuple | None:
    """What sites must share to be packed in one call over their rows stacked (coding, scale payload, the arrays'
    dtypes and row shapes), or None for a site packed on its own: arrays that are not 2-D host arrays of one row
    count and of one width W (W/8 value marks and hints, W/16 scale bytes, ceil(W/128) block marks), whose rows
    could not be told apart once stacked."""
    arrays, coding, payload = marks[:4], marks[4], marks[5]
    if not all(isinstance(a, np.ndarray) and a.ndim == 2 for a in arrays):
        return None
    vm, bm, h, sc = arrays
    n = h.shape[1]
    if len({a.shape[0] for a in arrays}) != 1 or vm.shape[1] != n or 2 * sc.shape[1] != n or bm.shape[1] != -(-n // 16):
        return None
    return coding.values, coding.blocks, payload, tuple((a.dtype.str, a.shape[1]) for a in arrays)


def pack_sites_on_device(device: torch.device, sites: Mapping[str, SiteMarks]
                         ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """`pack_marks_on_device` of several sites: site -> (value_marks uint8 [T, W/8], block_marks uint8
    [T, ceil(W/128)], hints_packed uint8 [T, W/8], scales_e4m3 uint8 [T, W/16], coding, scale_payload) host arrays
    -> (data uint8 [nbytes], offsets int64 [T + 1]) numpy, in ``sites``' order, byte for byte each site's own
    `pack_marks_on_device`.

    Sites that share width, coding and scale payload are packed in ONE call over their rows stacked (a row's bytes
    depend on its own marks only, and rows are byte-aligned), so the syncs and copies are those of one pack per
    such group, not per site; each site's bytes and offsets are cut back out of the group's (its own arrays). A
    group is cut into several calls past the device's cap on rows x width (`_BATCH_CAPS`).

    Raises as `pack_marks_on_device` does, with the message of the first failing site's own pack: when a group's
    pack fails, every site is packed again one by one, in ``sites``' order."""
    device = torch.device(device)
    groups: dict[tuple, list[tuple[str, int, int]]] = {}
    plan: list[list[str]] = []
    for name, marks in sites.items():
        key = _stack_key(marks)
        if key is None:
            plan.append([name])
        else:
            h = marks[2]
            groups.setdefault(key, []).append((name, 0, h.shape[0] * h.shape[1] * 8))
    plan = [c for items in groups.values() for c in _chunks(items, *_batch_caps(device, "pack"))] + plan
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    try:
        for names in plan:
            if len(names) == 1:
                out[names[0]] = pack_marks_on_device(device, *sites[names[0]])
                continue
            coding, payload = sites[names[0]][4:]
            data, offsets = pack_marks_on_device(device, *(np.concatenate([sites[s][i] for s in names])
                                                           for i in range(4)), coding, payload)
            r = 0
            for s in names:
                t = sites[s][2].shape[0]
                off = offsets[r: r + t + 1]
                out[s] = data[off[0]: off[-1]].copy(), off - off[0]
                r += t
    except (ConfigError, HintCodingError):
        # a stacked pack's message counts the whole stack: packed site by site, in order, the first failing site
        # raises its own pack's message
        log.debug("margin rows of %d sites did not pack together; packing them one by one", len(sites))
        return {s: pack_marks_on_device(device, *m) for s, m in sites.items()}
    return {s: out[s] for s in sites}


# ---------------------------------------------------------------------------------------------------------
# unpacking
# ---------------------------------------------------------------------------------------------------------
class _Checks:
    """The decoder's checks, in the numpy decoder's order: each a per-entry ``bad`` vector and a message of the first
    offending entry; reduced on the device (any, first index) and read with a sync."""

    def __init__(self, device: torch.device):
        self.device = device
        self.items: list[tuple[torch.Tensor, Callable[[int], str]]] = []
        self.done = 0

    def add(self, bad: torch.Tensor, message: Callable[[int], str]) -> None:
        self.items.append((bad.reshape(-1), message))

    def reductions(self) -> list[torch.Tensor]:
        out = []
        for bad, _ in self.items[self.done:]:
            if bad.numel() == 0:
                z = torch.zeros((), dtype=_I64, device=self.device)
                out += [z, z]
            else:
                out += [bad.any(), torch.argmax(bad.to(torch.uint8))]
        return out

    def raise_first(self, got: list[int]) -> None:
        """Raise `HintCodingError` for the first failing check of those not read before (``got``: `reductions`
        read back)."""
        pending = self.items[self.done:]
        self.done = len(self.items)
        for (_, message), bad, first in zip(pending, got[0::2], got[1::2]):
            if bad:
                raise HintCodingError(message(int(first)))


class _Stream:
    """The rows' bits as one stream (as `compact._Stream`, on the device).

    bits: uint8 [N + 1] (N = 8 * nbytes; a 0 past the end); start, end: int64 [T], each row's first bit and the bit
    after its last (clamped into [0, N], the offsets are checked apart). N + 1 stands for "past every row"."""

    def __init__(self, data: torch.Tensor, offsets: torch.Tensor):
        dev = data.device
        self.device = dev
        self.n = int(data.numel()) * 8
        self.data = torch.cat([data, torch.zeros(8, dtype=torch.uint8, device=dev)])
        shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=dev)
        self.bits = torch.cat([((data[:, None] >> shifts) & 1).reshape(-1), torch.zeros(1, dtype=torch.uint8,
                                                                                          device=dev)])
        self.start = (offsets[:-1] * 8).clamp(0, self.n)
        self.end = (offsets[1:] * 8).clamp(0, self.n)
        self._next: dict[int, torch.Tensor] = {}

    def clip(self, pos: torch.Tensor) -> torch.Tensor:
        return pos.clamp(0, self.n + 1)

    def next_all(self, value: int) -> torch.Tensor:
        """int64 [N + 2]: for every position 0..N+1 the first position at or after it whose bit is ``value``
        (N + 1 if none): a reversed running minimum."""
        hit = self._next.get(value)
        if hit is None:
            idx = torch.arange(self.n, dtype=_I64, device=self.device)
            at = torch.where(self.bits[: self.n] == value, idx, torch.full_like(idx, self.n + 1))
            at = torch.cat([at, torch.full((2,), self.n + 1, dtype=_I64, device=self.device)])
            hit = self._next[value] = torch.flip(torch.cummin(torch.flip(at, (0,)), 0).values, (0,))
        return hit

    def next_at(self, value: int, pos: torch.Tensor) -> torch.Tensor:
        return self.next_all(value)[self.clip(pos)]

    def bit(self, pos: torch.Tensor) -> torch.Tensor:
        return self.bits[pos.clamp(0, self.n)]

    def read(self, pos: torch.Tensor, nbits: torch.Tensor | int) -> torch.Tensor:
        """int64 of the ``nbits`` (0..56, clamped there) bits at bit offsets ``pos``, MSB first: an 8-byte
        big-endian window (int64; the arithmetic shift's sign bits are masked off, as the field ends at least one
        bit below the window's top)."""
        pos = self.clip(pos)
        nb = torch.as_tensor(nbits, dtype=_I64, device=self.device).expand(pos.shape).clamp(0, _READ_MAX)
        idx = pos >> 3
        w = torch.zeros(pos.shape, dtype=_I64, device=self.device)
        for j in range(8):
            w = (w << 8) | self.data[idx + j].to(_I64)
        shift = 64 - (pos & 7) - nb.clamp(min=1)
        out = (w >> shift) & ((torch.ones_like(nb) << nb) - 1)
        return torch.where(nb > 0, out, torch.zeros_like(out))


def _fits(checks: _Checks, st: _Stream, rows: torch.Tensor | None, stop: torch.Tensor, what: str,
          valid: torch.Tensor | None = None) -> None:
    """Fields (of rows ``rows``; None: every row) that end at bits ``stop`` must end inside their row."""
    end = st.end if rows is None else st.end[rows]
    start = st.start if rows is None else st.start[rows]
    bad = stop > end
    if valid is not None:
        bad = bad & valid
    row_of = (lambda i: i) if rows is None else (lambda i: int(rows[i]))
    checks.add(bad, lambda i: f"row {row_of(i)}: truncated ({what} ends at bit {int(stop[i] - start[i])} of "
                              f"{int(end[i] - start[i])})")


def _walk(jump: torch.Tensor, first: torch.Tensor, rank: torch.Tensor, levels: int) -> torch.Tensor:
    """``jump^rank[i](first[i])`` (int64 [K]) by binary lifting: level j's table is ``jump^(2^j)`` (squared from
    the one before), applied where bit j of the rank is set."""
    pos = first
    table = jump
    for j in range(levels):
        pos = torch.where(((rank >> j) & 1) == 1, table[pos], pos)
        if j + 1 < levels:
            table = table[table]
    return pos


def _positions(st: _Stream, checks: _Checks, cur: torch.Tensor, coding: str, n: int, k: int | None,
               compact_walk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Decode each row's position set at bit ``cur`` [T]: (mask bool [T, n], count int64 [T], cur after it).

    ``compact_walk``: walk the gamma / Rice codewords as a list sized by their count (a sync); else in a dense grid
    of T x n slots (no sync)."""
    t_ = cur.numel()
    dev = st.device
    ar = torch.arange(t_, dtype=_I64, device=dev)
    if coding == "all":
        return torch.ones(t_, n, dtype=torch.bool, device=dev), torch.full((t_,), n, dtype=_I64, device=dev), cur
    if coding == "bitmap":
        _fits(checks, st, None, cur + n, "bitmap")
        mask = st.bit(cur[:, None] + torch.arange(n, dtype=_I64, device=dev)) == 1
        return mask, mask.sum(dim=1, dtype=_I64), cur + n
    if coding == "block-bitmap":
        ng = n // GROUP
        _fits(checks, st, None, cur + ng, "block-bitmap presence bits")
        present = st.bit(cur[:, None] + torch.arange(ng, dtype=_I64, device=dev)) == 1  # [T, n/16]
        npresent = present.sum(dim=1, dtype=_I64)
        _fits(checks, st, None, cur + ng + GROUP * npresent, "block-bitmap groups")
        within = torch.cumsum(present, dim=1, dtype=_I64) - 1  # the group's index among its row's present groups
        at = cur[:, None, None] + ng + GROUP * within[:, :, None] + torch.arange(GROUP, dtype=_I64, device=dev)
        bits = (st.bit(at) == 1) & present[:, :, None]  # [T, n/16, 16]
        empty = present & ~bits.any(dim=2)
        checks.add(empty, lambda i: f"row {i // ng}: group {i % ng} flagged present but has no marked position")
        mask = bits.reshape(t_, n)
        return mask, mask.sum(dim=1, dtype=_I64), cur + ng + GROUP * npresent
    # gamma(count + 1), then count gap codewords (gamma, or Golomb-Rice 2^k of gap - 1)
    z = st.next_at(1, cur) - cur
    _fits(checks, st, None, cur + 2 * z + 1, "Elias-gamma count")
    checks.add(z > 55, lambda i: f"row {i}: a count of more than {n} positions")
    count_raw = st.read(cur + z, z + 1) - 1
    checks.add(count_raw > n, lambda i: f"row {i}: {int(count_raw[i])} positions in a row of {n}")
    count = count_raw.clamp(0, n)
    cur = cur + 2 * z + 1
    sink = st.n + 1
    p = torch.arange(sink + 1, dtype=_I64, device=dev)
    if k is None:  # gamma at p: zeros up to the first one o, then (o - p) + 1 bits from o: it ends at 2 o - p + 1
        jump = torch.clamp(2 * st.next_all(1) - p + 1, max=sink)
    else:  # Rice at p: ones up to the first zero o, then k bits: it ends at o + 1 + k
        jump = torch.clamp(st.next_all(0) + (1 + k), max=sink)
    jump[sink] = sink
    if compact_walk:  # the codeword list's size: sync A, with the checks so far
        got = _section_sync([count.sum(), count.max() if t_ else torch.zeros((), dtype=_I64, device=dev)]
                            + checks.reductions())
        checks.raise_first(got[2:])
        total, most = got[0], got[1]
        idx = torch.arange(total, dtype=_I64, device=dev)
        rows = torch.searchsorted(torch.cumsum(count, 0), idx, right=True)  # the row of each codeword
        rank = idx - _first_of_row(count)[rows]
        valid = None
    else:
        most = n
        rows = torch.arange(t_ * n, dtype=_I64, device=dev) // max(n, 1)
        rank = torch.arange(t_ * n, dtype=_I64, device=dev) % max(n, 1)
        valid = rank < count[rows]
    node = _walk(jump, st.clip(cur)[rows], rank, max(most - 1, 0).bit_length())
    stop = jump[node]
    _fits(checks, st, rows, stop, "gap code", valid)

    def on(bad: torch.Tensor) -> torch.Tensor:
        return bad if valid is None else bad & valid

    if k is None:
        q = (stop - node - 1) // 2  # leading zeros
        checks.add(on(q > 55), lambda i: f"row {int(rows[i])}: a position past the row of {n}")
        gap = st.read(node + q, q + 1)
    else:
        q = stop - node - 1 - k  # unary ones
        checks.add(on(q > n), lambda i: f"row {int(rows[i])}: a position past the row of {n}")
        gap = ((q.clamp(0, n) << k) | st.read(node + q + 1, k)) + 1
    def row_sums(g: torch.Tensor) -> torch.Tensor:  # p_i = the row's gaps up to i, summed, - 1
        if valid is None:
            csum = torch.cumsum(g, 0)
            return csum - torch.cat([torch.zeros(1, dtype=_I64, device=dev), csum])[_first_of_row(count)[rows]] - 1
        return torch.cumsum(torch.where(valid, g, torch.zeros_like(g)).reshape(t_, n), dim=1).reshape(-1) - 1

    # a gap > n puts the position past the row (gaps are >= 1): clamped, the sums stay in range (the message
    # names the unclamped position, as numpy's does)
    pos = row_sums(gap.clamp(1, n + 1))
    checks.add(on(pos >= n), lambda i: f"row {int(rows[i])}: position {int(row_sums(gap)[i])} past the row of {n}")
    flat = torch.zeros(t_ * n + 1, dtype=torch.bool, device=dev)
    ok = (pos < n) if valid is None else (valid & (pos < n))
    flat[torch.where(ok, rows * n + pos.clamp(0, max(n - 1, 0)), torch.full_like(pos, t_ * n))] = True
    mask = flat[: t_ * n].reshape(t_, n)
    if valid is None:
        last = (_first_of_row(count) + count - 1).clamp(0, max(stop.numel() - 1, 0))
        end_cw = stop[last] if stop.numel() else cur
    else:
        end_cw = stop.reshape(t_, n)[ar, (count - 1).clamp(min=0)] if n else cur
    return mask, count, torch.where(count > 0, end_cw, cur)


def _payload_start(checks: _Checks, st: _Stream, cur: torch.Tensor, count: torch.Tensor, per: int,
                   what: str) -> torch.Tensor:
    """Check that ``count`` [T] fields of ``per`` bits fit after ``cur``; returns the bit after them."""
    _fits(checks, st, None, cur + per * count, what)
    return cur + per * count


def _gather_payload(st: _Stream, mask: torch.Tensor, count: torch.Tensor, total: int, at0: torch.Tensor,
                    per: int) -> torch.Tensor:
    """uint8 [total]: the ``per``-bit field of each marked position of ``mask`` (row-major), the fields of row r
    back to back from bit ``at0[r]``."""
    rows, _ = _compact(mask, total)
    rank = torch.arange(total, dtype=_I64, device=st.device) - _first_of_row(count)[rows]
    at = at0[rows] + per * rank
    return (st.bit(at) if per == 1 else st.read(at, per)).to(torch.uint8)


def _as_device_tensor(a, dtype: torch.dtype, device: torch.device | None) -> torch.Tensor:
    t = a if isinstance(a, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(a))
    t = t.to(dtype) if t.dtype != dtype else t
    return t if device is None or t.device == device else to_device(t.contiguous(), device)


def _decode(data: torch.Tensor, offsets: torch.Tensor, width: int, coding: SiteCoding, scale_payload: str,
            bounds: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[int], list[int]]:
    """The body of `unpack_rows_torch` on ``data`` uint8 [nbytes] / ``offsets`` int64 [T + 1] (one device):
    (value_mask bool [T, W], hint_bits uint8 [N], scale_mask bool [T, W/16], scale_bytes uint8 [M]) and the hint
    bits and scale bytes of each row range ``bounds[i]:bounds[i + 1]`` (``bounds`` int64 [S + 1] there, ascending
    from 0 to T; None: one range of every row), read with the last sync. Raises as `unpack_rows_torch` does."""
    dev = data.device
    w = int(width)
    nb = w // BLOCK
    kv = _check_coding(coding.values, w)
    kb = _check_coding(coding.blocks, nb)
    t_ = offsets.numel() - 1
    if t_ < 0:
        raise HintCodingError(f"row offsets []... do not cover {data.numel()} bytes")
    checks = _Checks(dev)
    bad_offsets = ((offsets[0] != 0) | (offsets[-1] != data.numel())
                   | (torch.diff(offsets) < 0).any()).reshape(1)
    checks.add(bad_offsets, lambda _: f"row offsets {offsets[:4].tolist()}... do not cover {data.numel()} bytes")
    st = _Stream(data, offsets)
    per = 1 if scale_payload == "lsb" else 8
    cur = st.start
    vmask, vcount, cur = _positions(st, checks, cur, coding.values, w, kv, compact_walk=True)
    hint_at = cur
    cur = _payload_start(checks, st, cur, vcount, 1, "hint bits")
    smask, scount, cur = _positions(st, checks, cur, coding.blocks, nb, kb, compact_walk=False)
    scale_at = cur
    cur = _payload_start(checks, st, cur, scount, per, "scale payload")
    rest = st.end - cur
    trailing = (rest >= 8) | (st.read(cur, rest.clamp(0, 7)) != 0)
    checks.add(trailing, lambda r: f"row {r}: {int(rest[r])} bits after the last field (padding must be < 8 zero "
                                   "bits)")
    if bounds is None:
        ranges = 1
        sums = [vcount.sum(), scount.sum()]
    else:  # each range's marks: differences of the running counts at its bounds, read with the same sync
        ranges = bounds.numel() - 1
        zero = torch.zeros(1, dtype=_I64, device=dev)
        sums = [torch.diff(torch.cat([zero, torch.cumsum(c, 0)])[bounds]) for c in (vcount, scount)]
    got = _section_sync(sums + checks.reductions())  # the (last) sync
    checks.raise_first(got[2 * ranges:])
    n_hints, n_scales = got[:ranges], got[ranges: 2 * ranges]
    hints = _gather_payload(st, vmask, vcount, sum(n_hints), hint_at, 1)
    scales = _gather_payload(st, smask, scount, sum(n_scales), scale_at, per)
    return vmask, hints, smask, scales, n_hints, n_scales


def unpack_rows_torch(data, offsets, width: int, coding: SiteCoding, margin: float, scale_margin: float,
                      scale_payload: str = "byte", *, device: str | torch.device | None = None) -> MarginExceptions:
    """The inverse of `pack_rows_torch` / `compact.pack_rows`, on the device: equal to `compact.unpack_rows` of
    the same bytes (``PackedRows(data, offsets, width, coding, margin, scale_margin, scale_payload)``).

    ``data`` uint8 [nbytes] and ``offsets`` int64 [T + 1] (tensors or numpy arrays); ``device``: where to decode
    (default: ``data``'s device; host arrays go over from pinned memory without a sync). Returns the
    `MarginExceptions` there: value_mask bool [T, W], hint_bits uint8 [N], scale_mask bool [T, W/16], scale_bytes
    uint8 [M].

    Host syncs: one (the mark counts, which size the outputs, and every check), two when the value coding is gamma
    or Rice (first the number of value codewords). Raises `HintCodingError` exactly where `compact.unpack_rows`
    does (truncated rows, positions past the row, a present block-bitmap group without marks, non-zero padding or
    trailing bits, offsets that do not cover the bytes), with its messages; `ConfigError` for an unknown coding (or
    a block-bitmap over a row length not a multiple of 16), before the bytes are read."""
    dev = torch.device(device) if device is not None else (data.device if isinstance(data, torch.Tensor)
                                                          else torch.device("cpu"))
    data = _as_device_tensor(data, torch.uint8, dev).reshape(-1)
    offsets = _as_device_tensor(offsets, _I64, dev).reshape(-1)
    vmask, hints, smask, scales, _, _ = _decode(data, offsets, width, coding, scale_payload)
    return MarginExceptions(vmask, hints, smask, scales, margin, scale_margin, scale_payload)


def _host_rows(p: PackedRows) -> tuple[np.ndarray, np.ndarray] | None:
    """``p``'s (data uint8 [n], offsets int64 [T + 1]) as host arrays when they can be stacked with other sites'
    rows: host memory of those dtypes (no copy, no sync) and offsets that cover the bytes (checked here, on the
    host, as stacking would hide a site's own offsets). None: decode the site on its own."""
    arrays = []
    for a, dtype in ((p.data, np.uint8), (p.offsets, np.int64)):
        if isinstance(a, torch.Tensor):
            if a.device.type != "cpu":
                return None
            a = a.detach().numpy()
        a = np.asarray(a)
        if a.dtype != dtype:
            return None
        arrays.append(a.reshape(-1))
    data, offsets = arrays
    return (data, offsets) if offsets_cover(data, offsets) else None


def _decode_plan(rows: Mapping[str, PackedRows], device: torch.device
                 ) -> tuple[list[list[str]], dict[str, tuple[np.ndarray, np.ndarray]]] | None:
    """The decode calls of ``rows`` (runs of sites that share width, coding and scale payload, stacked into one
    call; single sites otherwise) and the stackable sites' host rows (`_host_rows`); None when a site's coding is
    unknown (then every site is decoded on its own, so the `ConfigError` comes at that site, after any earlier
    site's `HintCodingError`, as before)."""
    groups: dict[tuple, list[tuple[str, int, int]]] = {}
    alone: list[list[str]] = []
    hosts: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for name, p in rows.items():
        try:
            _check_coding(p.coding.values, int(p.width))
            _check_coding(p.coding.blocks, int(p.width) // BLOCK)
        except ConfigError:
            return None
        host = _host_rows(p)
        if host is None:
            alone.append([name])
            continue
        hosts[name] = data, offsets = host
        key = (int(p.width), p.coding.values, p.coding.blocks, p.scale_payload)
        groups.setdefault(key, []).append((name, int(data.size), (offsets.size - 1) * int(p.width)))
    calls = [c for items in groups.values() for c in _chunks(items, *_batch_caps(device, "decode"))]
    return calls + alone, hosts


def _unpack_stacked(parts: Sequence[PackedRows], host: Sequence[tuple[np.ndarray, np.ndarray]],
                    device: torch.device) -> list[MarginExceptions]:
    """One decode of several sites' rows (one width, coding and scale payload; ``host``: their `_host_rows`)
    stacked: data back to back, offsets shifted by the bytes before; the results split back per site (row slices
    of the masks, the kept bits and bytes by each site's counts, read with the decode's last sync). Rows decode
    independently, so each site's part is its own decode's result."""
    t = [o.size - 1 for _, o in host]
    shift = np.cumsum([0] + [d.size for d, _ in host[:-1]])
    # the stacked offsets and the sites' row bounds go over in one copy
    index = np.concatenate([np.zeros(1, np.int64)] + [o[1:] + k for (_, o), k in zip(host, shift)]
                           + [np.cumsum([0] + t).astype(np.int64)])
    index_d = _as_device_tensor(index, _I64, device)
    data_d = _as_device_tensor(np.concatenate([d for d, _ in host]), torch.uint8, device)
    total = sum(t)
    p0 = parts[0]
    vmask, hints, smask, scales, n_hints, n_scales = _decode(data_d, index_d[: total + 1], p0.width, p0.coding,
                                                             p0.scale_payload, bounds=index_d[total + 1:])
    return [MarginExceptions(vm, h, sm, sc, p.margin, p.scale_margin, p.scale_payload)
            for p, vm, h, sm, sc in zip(parts, vmask.split(t), hints.split(n_hints), smask.split(t),
                                        scales.split(n_scales))]


def _unpack_one(p: PackedRows, device: torch.device) -> MarginExceptions:
    return unpack_rows_torch(p.data, p.offsets, p.width, p.coding, p.margin, p.scale_margin, p.scale_payload,
                             device=device)


def _unpack_sites(rows: Mapping[str, PackedRows], device: torch.device) -> dict[str, MarginExceptions]:
    planned = _decode_plan(rows, device)
    if planned is None:
        return {s: _unpack_one(p, device) for s, p in rows.items()}
    plan, hosts = planned
    out: dict[str, MarginExceptions] = {}
    try:
        for names in plan:
            if len(names) == 1:
                out[names[0]] = _unpack_one(rows[names[0]], device)
            else:
                out.update(zip(names, _unpack_stacked([rows[s] for s in names], [hosts[s] for s in names],
                                                      device)))
    except HintCodingError:
        # A stacked decode's message names a row of the stack: decoded site by site, in order, the first damaged
        # site raises its own decode's message (the error path may be slow).
        log.debug("margin rows of %d sites did not decode together; decoding them one by one", len(rows))
        return {s: _unpack_one(p, device) for s, p in rows.items()}
    log.debug("decoded margin rows of %d sites in %d calls on %s", len(rows), len(plan), device)
    return {s: out[s] for s in rows}


def resolve_margin_decode(decode: str, device: str | torch.device) -> str:
    """The decoder "auto" stands for on ``device``: "triton" on CUDA when Triton is installed (on an H100, 20 sites
    x 1,024 rows: 7.9 ms with the rows' host concatenation, the torch codec 136.5 ms, medians of 3;
    `benchmarks/results/compact-path-triton-concat-h100.json`), the torch codec ("device") on CUDA without it,
    numpy ("host") elsewhere; any other ``decode`` as it is. Raises `ConfigError` for an unknown ``decode``."""
    if decode not in MARGIN_DECODES:
        raise ConfigError(f"decode must be one of {list(MARGIN_DECODES)}; got {decode!r}")
    if decode != "auto":
        return decode
    if torch.device(device).type != "cuda":
        return "host"
    return "triton" if importlib.util.find_spec("triton") is not None else "device"


def unpack_sites(rows: Mapping[str, PackedRows], device: str | torch.device, decode: str = "auto"
                 ) -> dict[str, MarginExceptions | DenseExceptions]:
    """Each site's rows decoded where ``decode`` says (`tracerl.config.MARGIN_DECODES`), the results on ``device``:
    "host" with numpy (`compact.unpack_rows`, the masks and bytes then copied over), "device" with the torch codec
    there (`unpack_sites_torch`), "triton" with one Triton kernel per coding straight into `DenseExceptions`
    (`compact_triton.unpack_sites_dense`; CUDA, or the CPU under TRITON_INTERPRET=1), "auto": `resolve_margin_decode`
    ("triton" on CUDA, else "host"). The results are equal either way (`compact.densify` of the others' is the
    "triton" result).

    Raises `ConfigError` for an unknown ``decode`` or coding, `HintCodingError` for rows that do not decode."""
    device = torch.device(device)
    decode = resolve_margin_decode(decode, device)
    if decode == "triton":
        from tracerl.hints.compact_triton import unpack_sites_dense

        return unpack_sites_dense(rows, device)
    if decode == "device":
        return unpack_sites_torch(rows, device)
    out = {}
    for site, p in rows.items():
        enc = unpack_rows(p)
        out[site] = dataclasses.replace(enc, **{f: getattr(enc, f).to(device, non_blocking=True)
                                                for f in enc.TENSORS})
    return out


def unpack_sites_torch(rows: Mapping[str, PackedRows], device: str | torch.device) -> dict[str, MarginExceptions]:
    """`unpack_rows_torch` of each site's `PackedRows` (host bytes) on ``device``: site -> `MarginExceptions` there,
    equal to each site's own `unpack_rows_torch` (same dtypes and shapes, contiguous), in ``rows``' order.

    Sites that share width, coding and scale payload are decoded in ONE call over their rows stacked (rows decode
    independently), so the syncs are those of one decode per such group (one, two with a gamma / Rice value coding),
    not per site; the masks of a site are row slices of its group's, its kept bits and bytes slices of the group's
    (views). A group is cut into several calls past the device's caps on row bytes and rows x width (`_BATCH_CAPS`:
    large on CUDA, a few sites on the CPU), to bound the decode's temporaries. A site whose rows are device tensors,
    are not uint8 / int64, or whose offsets do not cover its bytes is decoded on its own.

    On CUDA the decodes run on a side stream of the device: their syncs wait for the decodes' own kernels, not for
    the work queued on the caller's stream; that stream then waits for the side stream, and the results are marked
    as used by it (``record_stream``), so they are safe to use there at once.

    Raises as `unpack_rows_torch` does, with the message of the first failing site's own decode (which names the row
    within its site): when a group's decode fails, every site is decoded again one by one, in ``rows``' order;
    `ConfigError` for an unknown coding (or a block-bitmap over a row length not a multiple of 16)."""
    device = torch.device(device)
    out = decode_on_side_stream(device, lambda: _unpack_sites(rows, device))
    log.debug("decoded margin rows of %d sites on %s", len(out), device)
    return out
