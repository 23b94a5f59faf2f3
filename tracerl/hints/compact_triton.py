"""Margin-exception rows decoded by one Triton kernel straight into the planes the trainer's fill-in reads
(`compact.DenseExceptions`; issue 23): the same result as the numpy `compact.unpack_rows` followed by
`compact.densify`, with no jump tables, no compact lists and one host sync per call (the error flags).

**Layout.** One lane per row (``ROWS`` rows per program): each lane walks its own row's bits (`compact`'s layout,
MSB first) sequentially, the way a scalar decoder would, and all rows of a micro-batch are decoded at once. A row is
``[value positions] [hint bits] [block positions] [scale payload]``; each position set is walked twice, once to
write the marks and find where its payload starts, once more to place the payload bits at the marked positions
(re-decoding a position set costs less than keeping its positions). Bits are read as a big-endian 8-byte window at
the bit's byte, shifted to the bit (at least 57 valid bits); a codeword's leading zeros (Elias gamma) or ones
(Rice's unary part, which may run past one window) are counted with a branch-free count of leading zeros. Marks
and one-bit payloads are collected into a byte per lane and stored when the lane's next position leaves that byte
(positions only increase within a row), so the output planes are written once per byte, zero-initialised.

**Errors.** The kernel flags every row whose bits do not decode the way `compact.unpack_rows` accepts them (a
field past the row's end, a count or position past the row, a present block-bitmap group without marks, bits
after the last field) and stops walking it; when any row is flagged, the whole site is decoded again by
`compact.unpack_rows`, which raises its own `HintCodingError` for the first bad row (or, for a flag that is only
a conservative guess, returns the rows, which are then laid out from its result). So this decoder raises exactly
when and as the numpy one does. Offsets are checked on the host before anything runs.

Bit positions are int64. Codings: every `compact.POSITION_CODINGS` entry (all, bitmap, block-bitmap, gamma,
rice<k>), both scale payloads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from tracerl.hints.compact import (
    BLOCK,
    GROUP,
    DenseExceptions,
    PackedRows,
    _check_coding,
    densify,
    offsets_cover,
    unpack_rows,
)
from tracerl.hints.compact_device import decode_on_side_stream

__all__ = ["unpack_rows_dense", "unpack_sites_dense"]

#: rows (lanes) per program
ROWS = 32
_ALL, _BITMAP, _BLOCK_BITMAP, _GAMMA, _RICE = range(5)
#: output modes of a walk: the marks (bit 1 at each position), a 1-bit payload per position (packed), an 8-bit
#: payload per position (one byte per position)
_MARKS, _BIT, _BYTE = range(3)


# ---------------------------------------------------------------------------------------------------------
# bits
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _window(data_ptr, pos, NBITS):
    """uint64: the stream's bits from ``pos`` (int64, clamped into [0, NBITS]) at the top; >= 57 valid bits
    (the data carries 8 zero bytes past its end)."""
    p = tl.minimum(tl.maximum(pos, 0), NBITS)
    byte = p >> 3
    w = tl.zeros(p.shape, dtype=tl.uint64)
    for j in tl.static_range(8):
        w = (w << 8) | tl.load(data_ptr + byte + j).to(tl.uint64)
    return w << (p & 7).to(tl.uint64)


@triton.jit
def _read(data_ptr, pos, nbits, NBITS):
    """int64: the ``nbits`` (0..56, per lane) bits at ``pos``, MSB first."""
    w = _window(data_ptr, pos, NBITS)
    return ((w >> 1) >> (63 - nbits).to(tl.uint64)).to(tl.int64)  # two shifts: nbits == 0 gives 0


@triton.jit
def _clz(x):
    """int64: leading zeros of uint64 ``x`` (64 for 0), by halving."""
    n = tl.zeros(x.shape, dtype=tl.int64)
    for k in tl.static_range(6):  # shifts 32, 16, 8, 4, 2, 1: the top half of what is left is zero?
        c = (x >> (64 - (32 >> k))) == 0
        n = tl.where(c, n + (32 >> k), n)
        x = tl.where(c, x << (32 >> k), x)
    return tl.where(x == 0, 64, n)


@triton.jit
def _gamma(data_ptr, cur, NBITS):
    """An Elias-gamma codeword at ``cur``: (value int64, the bit after it int64, bad: no codeword of <= 56 zeros)."""
    z = _clz(_window(data_ptr, cur, NBITS))
    bad = z > 55
    z = tl.minimum(z, 55)
    return _read(data_ptr, cur + z, z + 1, NBITS), cur + 2 * z + 1, bad


# ---------------------------------------------------------------------------------------------------------
# one walk over a position set
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _emit(out_ptr, rowbase, p, on, bit, acc, at, MODE: tl.constexpr):
    """Position ``p`` (int64, lanes ``on``) with payload ``bit``: MARKS / BIT collect it into the lane's byte
    ``acc`` at byte ``at`` (stored when the byte changes), BYTE stores it at byte p."""
    if MODE == 2:
        tl.store(out_ptr + rowbase + p, bit.to(tl.uint8), mask=on)
    else:
        byte = p >> 3
        flush = on & (byte != at) & (at >= 0)
        tl.store(out_ptr + rowbase + tl.maximum(at, 0), acc.to(tl.uint8), mask=flush)
        acc = tl.where(on & (byte != at), 0, acc)
        at = tl.where(on, byte, at)
        acc = tl.where(on, acc | (bit << (p & 7)), acc)
    return acc, at


@triton.jit
def _payload(data_ptr, pay, i, NBITS, MODE: tl.constexpr):
    """The payload of the i-th position (int64 i), fields from ``pay``: 1 (MARKS), 1 bit (BIT) or 8 bits (BYTE)."""
    if MODE == 0:
        return tl.full(i.shape, 1, tl.int64)
    elif MODE == 1:
        return _read(data_ptr, pay + i, tl.full(i.shape, 1, tl.int64), NBITS)
    else:
        return _read(data_ptr, pay + 8 * i, tl.full(i.shape, 8, tl.int64), NBITS)


@triton.jit
def _walk(data_ptr, NBITS, cur, end, ok, n, out_ptr, rowbase, pay,
          CODING: tl.constexpr, K: tl.constexpr, MODE: tl.constexpr):
    """Walk each lane's position set of ``n`` positions starting at bit ``cur`` (lanes ``ok``), writing per MODE.
    Returns (the bit after the set int64, positions int64, ok: lanes still decodable)."""
    cnt = tl.zeros(cur.shape, dtype=tl.int64)
    acc = tl.zeros(cur.shape, dtype=tl.int64)
    at = tl.full(cur.shape, -1, tl.int64)
    if CODING == 0:  # all: positions 0..n-1, no bits
        i = 0
        while i < n:
            p = tl.full(cur.shape, i, tl.int64)
            acc, at = _emit(out_ptr, rowbase, p, ok, _payload(data_ptr, pay, p, NBITS, MODE), acc, at, MODE)
            i += 1
        cnt = tl.where(ok, n, 0)
        stop = cur
    elif CODING == 1:  # bitmap: n bits, bit i = position i
        ok = ok & (cur + n <= end)
        q = tl.zeros(cur.shape, dtype=tl.int64)  # the next bit of the bitmap to look at
        live = ok & (q < n)
        while tl.max(live.to(tl.int32), axis=0) > 0:
            z = _clz(_window(data_ptr, cur + q, NBITS))
            hit = live & (z < 57) & (q + z < n)
            p = q + z
            acc, at = _emit(out_ptr, rowbase, p, hit, _payload(data_ptr, pay, cnt, NBITS, MODE), acc, at, MODE)
            cnt = tl.where(hit, cnt + 1, cnt)
            q = tl.where(hit, p + 1, tl.where(live, q + 57, q))
            live = live & (q < n)
        stop = cur + n
    elif CODING == 2:  # block-bitmap: n/16 presence bits, then 16 bits per present group
        ng = n // 16
        ok = ok & (cur + ng <= end)
        gq = tl.zeros(cur.shape, dtype=tl.int64)  # the next presence bit to look at
        rem = tl.zeros(cur.shape, dtype=tl.int64)  # the current group's marks not yet emitted (MSB = its first)
        grp = tl.zeros(cur.shape, dtype=tl.int64)
        dptr = cur + ng
        live = ok & (gq < ng)
        while tl.max(live.to(tl.int32), axis=0) > 0:
            need = live & (rem == 0)
            z = _clz(_window(data_ptr, cur + gq, NBITS))
            found = need & (z < 57) & (gq + z < ng)
            grp = tl.where(found, gq + z, grp)
            bits = _read(data_ptr, dptr, tl.full(cur.shape, 16, tl.int64), NBITS)
            ok = ok & ~(found & ((dptr + 16 > end) | (bits == 0)))
            rem = tl.where(found, bits, rem)
            dptr = tl.where(found, dptr + 16, dptr)
            gq = tl.where(found, grp + 1, tl.where(need, gq + 57, gq))
            give = live & ~need & ok
            b = _clz(rem.to(tl.uint64) << 48)
            p = grp * 16 + b
            acc, at = _emit(out_ptr, rowbase, p, give, _payload(data_ptr, pay, cnt, NBITS, MODE), acc, at, MODE)
            cnt = tl.where(give, cnt + 1, cnt)
            rem = tl.where(give, rem & ~(32768 >> b), rem)
            live = ok & ((gq < ng) | (rem != 0))
        stop = dptr
    else:  # gamma(count + 1), then count gap codewords (gamma, or Rice 2^K of gap - 1)
        c1, cur, bad = _gamma(data_ptr, cur, NBITS)
        count = c1 - 1
        ok = ok & ~bad & (cur <= end) & (count <= n)
        prev = tl.full(cur.shape, -1, tl.int64)
        live = ok & (cnt < count)
        while tl.max(live.to(tl.int32), axis=0) > 0:
            if CODING == 3:
                gap, nxt, bad = _gamma(data_ptr, cur, NBITS)
            else:
                q = tl.zeros(cur.shape, dtype=tl.int64)  # the unary run of ones, across windows
                run = live
                while tl.max(run.to(tl.int32), axis=0) > 0:
                    c = _clz(~_window(data_ptr, cur + q, NBITS))
                    valid = 64 - ((tl.minimum(tl.maximum(cur + q, 0), NBITS)) & 7)
                    q = tl.where(run, q + tl.minimum(c, valid), q)
                    run = run & (c >= valid) & (q <= n) & (cur + q < end)
                bad = q > n
                q = tl.minimum(q, n + 1)
                low = _read(data_ptr, cur + q + 1, tl.full(cur.shape, K, tl.int64), NBITS)
                gap = ((q << K) | low) + 1
                nxt = cur + q + 1 + K
            p = prev + gap
            ok = ok & ~(live & (bad | (nxt > end) | (p >= n)))
            give = live & ok
            acc, at = _emit(out_ptr, rowbase, p, give, _payload(data_ptr, pay, cnt, NBITS, MODE), acc, at, MODE)
            cnt = tl.where(give, cnt + 1, cnt)
            prev = tl.where(give, p, prev)
            cur = tl.where(give, nxt, cur)
            live = ok & (cnt < count)
        stop = cur
    if MODE != 2:
        tl.store(out_ptr + rowbase + tl.maximum(at, 0), acc.to(tl.uint8), mask=ok & (at >= 0))
    return stop, cnt, ok


# T and NBITS change with every micro-batch: specialized (Triton's default for ints: == 1, % 16), a new value's
# divisibility compiled the kernel again mid-training (a 5.5 s step on the H100 when a micro-batch's total bytes
# turned odd, trainer-h100-l20-margin.json)
@triton.jit(do_not_specialize=["T", "NBITS"])
def _unpack_dense_kernel(data_ptr, off_ptr, T, NBITS, vm_ptr, hint_ptr, bm_ptr, ss_ptr, bad_ptr, W, NB, NBB,
                         VC: tl.constexpr, VK: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
                         LSB: tl.constexpr, ROWS_: tl.constexpr):
    r = tl.program_id(0) * ROWS_ + tl.arange(0, ROWS_)
    on = r < T
    start = tl.load(off_ptr + r, mask=on, other=0) * 8
    end = tl.load(off_ptr + r + 1, mask=on, other=0) * 8
    rv = r.to(tl.int64) * (W // 8)
    # values: the marks, then (the hint bits start where the positions end) the hint bits
    vstop, vcnt, ok = _walk(data_ptr, NBITS, start, end, on, W, vm_ptr, rv, start, VC, VK, 0)
    ok = ok & (vstop + vcnt <= end)
    _, _, ok = _walk(data_ptr, NBITS, start, end, ok, W, hint_ptr, rv, vstop, VC, VK, 1)
    cur = vstop + vcnt
    # blocks: the marks, then the scale payload (1 bit each, packed; or a byte each)
    rb = r.to(tl.int64) * NBB
    bstop, bcnt, ok = _walk(data_ptr, NBITS, cur, end, ok, NB, bm_ptr, rb, cur, BC, BK, 0)
    if LSB:
        ok = ok & (bstop + bcnt <= end)
        _, _, ok = _walk(data_ptr, NBITS, cur, end, ok, NB, ss_ptr, rb, bstop, BC, BK, 1)
        cur = bstop + bcnt
    else:
        ok = ok & (bstop + 8 * bcnt <= end)
        _, _, ok = _walk(data_ptr, NBITS, cur, end, ok, NB, ss_ptr, r.to(tl.int64) * NB, bstop, BC, BK, 2)
        cur = bstop + 8 * bcnt
    rest = end - cur
    tail = _read(data_ptr, cur, tl.minimum(tl.maximum(rest, 0), 7), NBITS)
    ok = ok & (rest >= 0) & (rest < 8) & (tail == 0)
    tl.store(bad_ptr + r, (~ok).to(tl.int32), mask=on)


# ---------------------------------------------------------------------------------------------------------
# entry points
# ---------------------------------------------------------------------------------------------------------
def _code(coding: str, n: int) -> tuple[int, int]:
    k = _check_coding(coding, n)  # ConfigError for an unknown coding, as the other decoders
    if k is not None:
        return _RICE, k
    return {"all": _ALL, "bitmap": _BITMAP, "block-bitmap": _BLOCK_BITMAP, "gamma": _GAMMA}[coding], 0


def _key(p: PackedRows) -> tuple:
    """What a launch specializes on: sites with the same key are decoded by one launch."""
    return (*_code(p.coding.values, p.width), *_code(p.coding.blocks, p.width // BLOCK), p.width,
            p.scale_payload == "lsb")


def _launch(group: Sequence[PackedRows], device: torch.device
            ) -> tuple[list[DenseExceptions], torch.Tensor, list[torch.Tensor]]:
    """Start decoding the sites of ``group`` (host arrays, `_on_host`; one `_key`) on ``device`` in one launch:
    their rows stacked, one lane each, so that every site's rows run at once. Returns (each site's planes, being
    written: row slices of the group's planes; whether each site has a flagged row, bool [S] on the device; the
    device allocations all of it lives in). Every site's offsets must cover its data (`offsets_cover`).

    The rows and offsets go over in one copy (one host buffer, pinned on CUDA: offsets int64 [T + 1], then the
    bytes, then 8 zero bytes for the kernel's 8-byte windows); the flags and the four planes are one zeroed
    allocation. Every array the kernel gets starts 16-byte aligned and its row and bit counts are not specialized,
    so a new micro-batch size never compiles the kernel again."""
    vc, vk, bc, bk, w, lsb = _key(group[0])
    counts = [p.offsets.size - 1 for p in group]
    t_ = sum(counts)
    nbytes = sum(p.data.size for p in group)
    head = -(-8 * (t_ + 1) // 16) * 16  # the bytes start 16-aligned whatever t_ is (pointer alignment is specialized)
    host = torch.empty(head + nbytes + 8, dtype=torch.uint8, pin_memory=device.type == "cuda")
    hv = host.numpy()
    offsets = hv[:8 * (t_ + 1)].view(np.int64)
    hv[head + nbytes:] = 0
    base = row = 0
    for p, t in zip(group, counts):
        hv[head + base: head + base + p.data.size] = p.data
        offsets[row: row + t] = p.offsets[:-1] + base
        base, row = base + p.data.size, row + t
    offsets[t_] = nbytes
    buf = host.to(device, non_blocking=True)
    off, d = buf[:8 * (t_ + 1)].view(torch.int64), buf[head:]
    nb = w // BLOCK
    nbb = -(-nb // 8)
    cols = (w // 8, w // 8, nbb, nbb if lsb else nb)
    sizes = [4 * t_, *(t_ * c for c in cols)]
    parts = [-(-n // 16) * 16 for n in sizes]  # every part 16-aligned, whatever t_ and the width are
    planes_flat = torch.zeros(sum(parts), dtype=torch.uint8, device=device)
    bad, *planes = (a[:n] for a, n in zip(torch.split(planes_flat, parts), sizes))
    bad = bad.view(torch.int32)
    planes = [a.view(t_, c) for a, c in zip(planes, cols)]
    if t_:
        _unpack_dense_kernel[(-(-t_ // ROWS),)](
            d, off, t_, nbytes * 8, *planes, bad, w, nb, nbb, VC=vc, VK=vk, BC=bc, BK=bk, LSB=lsb, ROWS_=ROWS,
            num_warps=1)
    per_site = [torch.split(a, counts) for a in planes]
    out = [DenseExceptions(*(rows[i] for rows in per_site), w, p.margin, p.scale_margin, p.scale_payload)
           for i, p in enumerate(group)]
    if len(set(counts)) == 1:  # the usual case: every site has the micro-batch's rows
        flagged = bad.view(len(group), counts[0]).any(dim=1)
    else:
        flagged = torch.stack([s.any() for s in torch.split(bad, counts)])
    return out, flagged, [buf, planes_flat]


def _on_host(p: PackedRows) -> PackedRows:
    """``p`` with its data uint8 [n] and offsets int64 [T + 1] as the numpy decoder reads them: flat host arrays
    (device tensors come over first)."""
    data, offsets = (np.asarray(a.cpu() if isinstance(a, torch.Tensor) else a, dtype=dt).reshape(-1)
                     for a, dt in ((p.data, np.uint8), (p.offsets, np.int64)))
    return dataclasses.replace(p, data=data, offsets=offsets)


def unpack_sites_dense(rows: Mapping[str, PackedRows], device: str | torch.device) -> dict[str, DenseExceptions]:
    """Each site's rows decoded on ``device`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``) into
    `compact.DenseExceptions`: one kernel launch for all sites of one coding and width (their rows stacked: every
    site's rows run at once; each site's planes are row slices of the group's) and one host sync for all of them
    (the error flags). On CUDA the rows go over from pinned memory in one copy and the kernels run on the side
    stream `compact_device` decodes on, so the sync waits for them alone, not for the caller's queued work; the
    caller's stream then waits for that stream and the planes are marked as used by it, so they are safe to use
    there at once.

    Equal to ``compact.densify(compact.unpack_rows(p))`` for every site. Raises `HintCodingError` exactly as
    `compact.unpack_rows` does (the first site in order whose rows do not decode), `ConfigError` for an unknown
    coding (before anything is decoded)."""
    device = torch.device(device)
    for p in rows.values():  # every coding checked before any launch
        _code(p.coding.values, p.width)
        _code(p.coding.blocks, p.width // BLOCK)
    if not rows:
        return {}
    rows = {s: _on_host(p) for s, p in rows.items()}
    keep: list[torch.Tensor] = []
    return decode_on_side_stream(device, lambda: _decode(rows, device, keep), record=lambda: keep)


def _decode(rows: Mapping[str, PackedRows], device: torch.device, keep: list[torch.Tensor]
            ) -> dict[str, DenseExceptions]:
    """Each site's planes (`unpack_sites_dense`); the device allocations they live in are appended to ``keep``."""
    groups: dict[tuple, list[str]] = {}
    for site, p in rows.items():
        if not offsets_cover(p.data, p.offsets):
            unpack_rows(p)  # raises the numpy decoder's own error (the first such site in order)
        groups.setdefault(_key(p), []).append(site)
    dense, flags = {}, []
    for sites in groups.values():
        out, flagged, allocs = _launch([rows[s] for s in sites], device)
        dense.update(zip(sites, out))
        flags.append(flagged)
        keep += allocs
    flagged = dict(zip((s for sites in groups.values() for s in sites), torch.cat(flags).tolist()))  # the one sync
    out = {}
    for site in rows:  # the caller's order: its first failing site raises
        # a flagged site is decoded again by numpy: its error, or (a conservative flag) its rows
        if flagged[site]:
            out[site] = densify(unpack_rows(rows[site])).to(device)
            keep += [getattr(out[site], f) for f in DenseExceptions.TENSORS]
        else:
            out[site] = dense[site]
    return out


def unpack_rows_dense(p: PackedRows, device: str | torch.device) -> DenseExceptions:
    """One site's rows as `unpack_sites_dense` decodes them (data uint8 [n], offsets int64 [T + 1] of ``p``):
    `compact.DenseExceptions` on ``device``; raises as `compact.unpack_rows`."""
    return unpack_sites_dense({"site": p}, device)["site"]


assert GROUP == 16 and BLOCK == 16  # the kernel's group and block sizes
