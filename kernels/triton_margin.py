"""Triton kernels of the margin exceptions (`tracefp4.margin`), bit-identical to its pure-torch reference
(`margin_marks_ref`, `margin_fill_ref`); imported lazily by `tracefp4.margin`. Beside them, on the same tiles,
the codes a fake-quantized tensor carries (`nvfp4_codes_triton`, twin of `reference.nvfp4_codes_ref`, for
`tracefp4.effective_codes`). The exact fp32 / int32 formulation
and its proof are in `tracefp4.margin`'s docstring (NUMERICS §12); the kernels compute the same integers:

- block scale: ``t = clamp(div_rn(div_rn(amax_b, 6), g), 2^-9, 448)`` (finite values only), its fields
  ``fb = floor(w(t))`` and ``F23 = 2^23 frac(w(t))`` from t's bits, own byte ``fb + round-up``;
- value: ``v = x * r`` with ``r = div_rn(div_rn(1, g), s)`` (one fp32 multiply, no add after it, so no FMA
  contraction can change a bit), then only integer compares on ``bits(v) & 0x7FFFFFFF``.

Layout: a program takes BLK consecutive blocks (16 * BLK values, contiguous in memory) of one row; grid (T,
ceil(nb / BLK)). BLK is a multiple of 8, so a program's blocks fill whole bytes of the block bitmaps (a row's last
byte is only partly used: its blocks past nb are masked, their bits 0). Values are a [BLK, 16] tile; a value's
hint / mark bit is read from its byte (the 8 loads of one byte coalesce) and a block's bits are packed with a
shifted sum over the last axis of a [BLK, 2, 8] (values) or [BLK / 8, 8] (blocks) reshape. bf16 is loaded as its
int16 bits and widened by a shift (exact); fp16 / fp32 by conversion (exact); no sign is needed (marks and LSBs
depend on |v| only). The thresholds are launch arguments (not specialized: a new margin compiles nothing).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import E2M1_MIDPOINTS
from .triton_kernels import (
    _KIND,
    THRESHOLDS,
    _cdiv,
    _e4m3_decode,
    _next_pow2,
    _in_ranges,
    _on_input_device,
    _own_byte,
    _rtn_lsb,
    _t_fields,
)

__all__ = ["margin_marks_triton", "margin_fill_triton", "nvfp4_codes_triton", "MAX_BLOCKS_PER_PROGRAM"]

#: blocks per program on the GPU (fewer for short rows: the next power of two >= nb, at least 8)
MAX_BLOCKS_PER_PROGRAM: int = 64


@triton.jit
def _tile(x_ptr, row, NB, BLK: tl.constexpr, KIND: tl.constexpr):
    """(blk [BLK] block indices in the row, bmask [BLK], j [16] value index in a block, x fp32 [BLK, 16])."""
    blk = tl.program_id(1) * BLK + tl.arange(0, BLK)
    bmask = blk < NB
    j = tl.arange(0, 16)
    offs = row * NB * 16 + blk[:, None] * 16 + j[None, :]
    if KIND == 0:
        raw = tl.load(x_ptr + offs, mask=bmask[:, None], other=0)
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = tl.load(x_ptr + offs, mask=bmask[:, None], other=0).to(tl.float32)
    return blk, bmask, j, x


@triton.jit
def _scale_fields(x, g):
    """(fb, F23) int32 [BLK] of each block's t (tracefp4.margin.scale_fields)."""
    a = tl.abs(x)
    a = tl.where(a < float("inf"), a, 0.0)  # NaN and +-Inf count as 0 in the block amax
    amax = tl.max(a, axis=1)
    return _t_fields(tl.math.div_rn(tl.math.div_rn(amax, 6.0), g))


@triton.jit
def _abs_bits(x, sbyte, inv_g):
    """bits(|x * r|) [BLK, 16], r = div_rn(inv_g, s) of each block's scale byte (int32 [BLK])."""
    r = tl.math.div_rn(inv_g, _e4m3_decode(sbyte))
    v = x * r[:, None]
    return v.to(tl.int32, bitcast=True) & 0x7FFFFFFF


@triton.jit
def _bit_of(ptr, byte_idx, bit, mask):
    return (tl.load(ptr + byte_idx, mask=mask, other=0).to(tl.int32) >> bit) & 1


@triton.jit
def _store_value_bits(ptr, row, NB, blk, bmask, bits, BLK: tl.constexpr):
    """bits int32 0/1 [BLK, 16] -> two bytes per block at row * 2 NB + 2 blk."""
    b3 = tl.reshape(bits, (BLK, 2, 8))
    byte = tl.sum(b3 << tl.arange(0, 8)[None, None, :], axis=2)  # disjoint bits: sum == or
    offs = row * NB * 2 + blk[:, None] * 2 + tl.arange(0, 2)[None, :]
    tl.store(ptr + offs, byte.to(tl.uint8), mask=bmask[:, None])


@triton.jit
def _store_block_bits(ptr, row, NBB, bits, BLK: tl.constexpr):
    """bits int32 0/1 [BLK] (0 past the row) -> BLK / 8 bytes at row * NBB + program's first byte."""
    byte = tl.sum(tl.reshape(bits, (BLK // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
    idx = tl.program_id(1) * (BLK // 8) + tl.arange(0, BLK // 8)
    tl.store(ptr + row * NBB + idx, byte.to(tl.uint8), mask=idx < NBB)


@triton.jit(do_not_specialize=["NB", "NBB", *THRESHOLDS])
def _margin_marks_kernel(x_ptr, g_ptr, scales_ptr, hints_ptr, vmarks_ptr, bmarks_ptr, NB, NBB,
                         L0, H0, L1, H1, L2, H2, L3, H3, L4, H4, L5, H5, L6, H6, KS,
                         BLK: tl.constexpr, KIND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk, bmask, j, x = _tile(x_ptr, row, NB, BLK, KIND)
    g = tl.load(g_ptr)
    inv_g = tl.math.div_rn(1.0, g)
    # blocks: |F23 - 2^22| < K, or the given byte is not the block's own
    fb, f23 = _scale_fields(x, g)
    sbyte = tl.load(scales_ptr + row * NB + blk, mask=bmask, other=0).to(tl.int32)
    bmark = (tl.abs(f23 - 4194304) < KS) | (_own_byte(fb, f23) != sbyte)
    _store_block_bits(bmarks_ptr, row, NBB, (bmark & bmask).to(tl.int32), BLK)
    # values, with the given scales: bits(|v|) in one of the 7 ranges, or the given hint is not the RTN LSB
    ab = _abs_bits(x, sbyte, inv_g)
    vmark = _in_ranges(ab, (L0, H0, L1, H1, L2, H2, L3, H3, L4, H4, L5, H5, L6, H6))
    given = _bit_of(hints_ptr, row * NB * 2 + blk[:, None] * 2 + j[None, :] // 8, j[None, :] % 8, bmask[:, None])
    vmark = vmark | (_rtn_lsb(ab) != given)
    _store_value_bits(vmarks_ptr, row, NB, blk, bmask, vmark.to(tl.int32), BLK)


@triton.jit(do_not_specialize=["NB", "NBB"])
def _margin_fill_kernel(x_ptr, g_ptr, vmarks_ptr, bmarks_ptr, shints_ptr, sscales_ptr, scales_out_ptr, hints_out_ptr,
                        NB, NBB, BLK: tl.constexpr, KIND: tl.constexpr, LSB: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk, bmask, j, x = _tile(x_ptr, row, NB, BLK, KIND)
    g = tl.load(g_ptr)
    inv_g = tl.math.div_rn(1.0, g)
    fb, f23 = _scale_fields(x, g)
    if LSB:
        low = tl.minimum(fb, 125)  # of low and low + 1 around t, the byte whose LSB is the stored bit
        lsb = _bit_of(sscales_ptr, row * NBB + blk // 8, blk % 8, bmask)
        stored = tl.where((low & 1) == lsb, low, low + 1)
    else:
        stored = tl.load(sscales_ptr + row * NB + blk, mask=bmask, other=0).to(tl.int32)
    marked = _bit_of(bmarks_ptr, row * NBB + blk // 8, blk % 8, bmask)
    sbyte = tl.where(marked == 1, stored, _own_byte(fb, f23))
    tl.store(scales_out_ptr + row * NB + blk, sbyte.to(tl.uint8), mask=bmask)
    ab = _abs_bits(x, sbyte, inv_g)
    hb = row * NB * 2 + blk[:, None] * 2 + j[None, :] // 8
    vm = _bit_of(vmarks_ptr, hb, j[None, :] % 8, bmask[:, None])
    bits = tl.where(vm == 1, _bit_of(shints_ptr, hb, j[None, :] % 8, bmask[:, None]), _rtn_lsb(ab))
    _store_value_bits(hints_out_ptr, row, NB, blk, bmask, bits, BLK)


def _blocks_per_program(nb: int) -> int:
    return max(8, min(MAX_BLOCKS_PER_PROGRAM, _next_pow2(nb)))


def _x_arg(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16) if x.dtype == torch.bfloat16 else x


@_on_input_device
def margin_marks_triton(x: torch.Tensor, g: torch.Tensor, scales_u8: torch.Tensor, hints_u8: torch.Tensor,
                        intervals: tuple[tuple[int, int], ...], k_scale: int,
                        out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `tracefp4.margin.margin_marks_ref` (same arguments, checked by `tracefp4.margin_marks`); the
    marks go into ``out`` (checked there) when given."""
    t_, w = x.shape
    nb = w // 16
    nbb = -(-nb // 8)
    if out is not None:
        vmarks, bmarks = out
    else:
        vmarks = torch.empty((t_, w // 8), dtype=torch.uint8, device=x.device)
        bmarks = torch.empty((t_, nbb), dtype=torch.uint8, device=x.device)
    if t_:
        blk = _blocks_per_program(nb)
        flat = [v for lo_hi in intervals for v in lo_hi]
        _margin_marks_kernel[(t_, _cdiv(nb, blk))](
            _x_arg(x), g.reshape(1), scales_u8, hints_u8, vmarks, bmarks, nb, nbb, *flat, k_scale,
            BLK=blk, KIND=_KIND[x.dtype], num_warps=4)
    return vmarks, bmarks


@_on_input_device
def margin_fill_triton(x: torch.Tensor, g: torch.Tensor, value_marks: torch.Tensor, block_marks: torch.Tensor,
                       stored_hints: torch.Tensor, stored_scales: torch.Tensor,
                       scale_payload: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `tracefp4.margin.margin_fill_ref` (same arguments, checked by `tracefp4.margin_fill`)."""
    t_, w = x.shape
    nb = w // 16
    nbb = -(-nb // 8)
    scales = torch.empty((t_, nb), dtype=torch.uint8, device=x.device)
    hints = torch.empty((t_, w // 8), dtype=torch.uint8, device=x.device)
    if t_:
        blk = _blocks_per_program(nb)
        _margin_fill_kernel[(t_, _cdiv(nb, blk))](
            _x_arg(x), g.reshape(1), value_marks, block_marks, stored_hints, stored_scales, scales, hints, nb, nbb,
            BLK=blk, KIND=_KIND[x.dtype], LSB=scale_payload == "lsb", num_warps=4)
    return scales, hints


# The E2M1 midpoints (tracefp4.constants.E2M1_MIDPOINTS), spelled out in `_nvfp4_codes_kernel`.
assert E2M1_MIDPOINTS == (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@triton.jit(do_not_specialize=["NB"])
def _nvfp4_codes_kernel(y_ptr, scales_ptr, g_ptr, codes_ptr, NB, BLK: tl.constexpr, KIND: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk, bmask, j, y = _tile(y_ptr, row, NB, BLK, KIND)
    g = tl.load(g_ptr)
    sbyte = tl.load(scales_ptr + row * NB + blk, mask=bmask, other=0).to(tl.int32)
    s = _e4m3_decode(sbyte) * g  # one fp32 multiply, as the reference's
    s = tl.where(s > 0, s, float("nan"))  # a zero, negative or NaN scale: NaN ratios, code 0
    r = tl.math.div_rn(y, s[:, None])
    a = tl.abs(r)
    # the magnitude code: how many midpoints lie strictly below |r| (a tie goes to the lower magnitude, on both
    # signs: the reference's bucketize with its outward-moved negative bounds), NaN: 0
    mag = ((a > 0.25).to(tl.int32) + (a > 0.75).to(tl.int32) + (a > 1.25).to(tl.int32) + (a > 1.75).to(tl.int32)
           + (a > 2.5).to(tl.int32) + (a > 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    code = tl.where(mag == 0, 0, tl.where(r < 0, mag | 8, mag))
    code = tl.where(a < float("inf"), code, 0)  # Inf and NaN ratios: 0
    offs = row * NB * 16 + blk[:, None] * 16 + j[None, :]
    tl.store(codes_ptr + offs, code.to(tl.uint8), mask=bmask[:, None])


@_on_input_device
def nvfp4_codes_triton(y: torch.Tensor, scales_u8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """Triton twin of `reference.nvfp4_codes_ref` (y [N, W] contiguous bf16 / fp16 / fp32, scale bytes uint8
    [N, W/16] contiguous, g fp32 one element, all on one device): codes uint8 [N, W], one launch, no host sync."""
    n, w = y.shape
    nb = w // 16
    codes = torch.empty((n, w), dtype=torch.uint8, device=y.device)
    if n and nb:
        blk = _blocks_per_program(nb)
        _nvfp4_codes_kernel[(n, _cdiv(nb, blk))](_x_arg(y), scales_u8, g.reshape(1), codes, nb, BLK=blk,
                                                         KIND=_KIND[y.dtype], num_warps=4)
    return codes
