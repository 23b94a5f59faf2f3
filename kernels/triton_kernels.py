"""Triton kernels of the FP4 numerics, bit-identical to `kernels.reference` (imported lazily by `kernels.api`).

Three kernels, each over a flat view of the input as NB blocks of B values (B = 16 NVFP4, 32 MXFP4; rows are
whole numbers of blocks, so block k is simply elements [kB, (k+1)B) and every program owns BN whole blocks).
A program's tile is [BN, G, 8] with G = B/8: the last axis of 8 values is one hint byte and one 32-bit word of
packed codes, so packing is an in-thread reduction and the 8 values are one 16-byte load for 16-bit inputs:

- `_quantize_kernel`:   x [NB, B] -> codes [NB, B/2], scale bytes [NB], hint bytes [NB, B/8]
- `_fake_quant_kernel`: x [NB, B] (+ scale bytes, hint bytes) -> out [NB, B] in x.dtype (RTN or hint-guided)
- `_fake_quant_bwd_kernel`: clipped straight-through gradient (grad where not |x * r| > 6)

Exactness rules that keep them bit-identical to the reference:
- every division is `tl.math.div_rn` (correctly rounded; Triton's `/` on fp32 is the approximate div.full.f32);
- the E4M3 rounding is the same integer/exact-float procedure as `reference.e4m3_encode`;
- no multiply feeds an add except where the product is exact (t * 512), so FMA contraction cannot change a bit;
- E2M1 magnitudes are selected with `tl.where` (exact constants), and the sign is applied last.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .constants import HINTS_PER_BYTE

__all__ = ["quantize_blocks_triton", "fake_quantize_blocks_triton", "fake_quantize_bwd_blocks_triton", "CONFIG"]

#: default launch configuration per kernel: (blocks per program BN, num_warps); tuned on an H200 by
#: benchmarks/benchmark_kernels.py (see benchmarks/results/kernels-h200.json)
CONFIG: dict[str, tuple[int, int]] = {"quantize": (128, 4), "fake_quant": (128, 4), "fake_quant_bwd": (128, 4)}


@triton.jit
def _e4m3_scale_byte(amax, g):
    """E4M3 byte (int32) of e4m3_rne(clamp((amax / 6) / g, 2^-9, 448)); see reference.e4m3_encode."""
    t = tl.math.div_rn(tl.math.div_rn(amax, 6.0), g)
    t = tl.minimum(tl.maximum(t, 0.001953125), 448.0)
    bits = t.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    rb = (bits + 0x7FFFF + lsb) & -1048576  # RNE to 3 mantissa bits (-1048576 == ~0xFFFFF)
    normal_byte = ((((rb >> 23) & 0xFF) - 120) << 3) | ((rb >> 20) & 7)
    q = t * 512.0  # exact
    q_floor = q.to(tl.int32)
    frac = q - q_floor.to(tl.float32)  # exact
    up = (frac > 0.5) | ((frac == 0.5) & ((q_floor & 1) == 1))
    sub_byte = q_floor + up.to(tl.int32)
    return tl.where(t >= 0.015625, normal_byte, sub_byte)


@triton.jit
def _flip_sign(val, neg):
    """-val where neg, by flipping the sign bit (Triton's unary minus is 0 - x, which loses -0.0)."""
    bits = val.to(tl.int32, bitcast=True) ^ (neg.to(tl.int32) << 31)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_decode(sbyte):
    """fp32 value of E4M3FN bytes given as int32 (sign bit, NaN 0x7F/0xFF)."""
    mag = sbyte & 0x7F
    e = mag >> 3
    m = mag & 7
    normal = ((e + 120) << 23 | (m << 20)).to(tl.float32, bitcast=True)
    val = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    val = tl.where(mag == 0x7F, float("nan"), val)
    return _flip_sign(val, (sbyte & 0x80) != 0)


@triton.jit
def _pow2(n):
    """Exact fp32 2^n for int32 n in [-127, 127]."""
    bits = tl.where(n >= -126, (n + 127) << 23, 4194304)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mx_exponent(amax, RCEIL: tl.constexpr):
    if RCEIL:
        t = tl.math.div_rn(amax, 6.0)
        bits = t.to(tl.int32, bitcast=True)
        exp_field = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        e_norm = exp_field - 127 + (mant != 0).to(tl.int32)
        e_sub = -127 + (mant > 0x400000).to(tl.int32)
        e = tl.where(exp_field == 0, e_sub, e_norm)
    else:
        e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 129
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _own_scale(x, g_ptr, IS_NV: tl.constexpr, RCEIL: tl.constexpr):
    """Scale byte (int32) per block of fp32 blocks x [BN, G, 8]; amax over finite |x| (NaN/Inf ignored)."""
    ax = tl.abs(x)
    afin = tl.where(ax < float("inf"), ax, 0.0)  # NaN < inf is False
    amax = tl.max(tl.max(afin, axis=2), axis=1)  # [BN]
    if IS_NV:
        sbyte = _e4m3_scale_byte(amax, tl.load(g_ptr))
    else:
        sbyte = _mx_exponent(amax, RCEIL) + 127
    return sbyte


@triton.jit
def _scale_factor(sbyte, g_ptr, IS_NV: tl.constexpr):
    """(s, r, g) from scale bytes (int32 [BN]): s decoded scale, r with v = x * r, g global scale (1 for MX)."""
    if IS_NV:
        g = tl.load(g_ptr)
        s = _e4m3_decode(sbyte)
        r = tl.math.div_rn(tl.math.div_rn(1.0, g), s)
    else:
        g = 1.0
        e = sbyte - 127
        s = tl.where(sbyte == 255, float("nan"), _pow2(tl.minimum(tl.maximum(e, -127), 127)))
        r = tl.where(sbyte == 255, float("nan"), _pow2(tl.minimum(tl.maximum(-e, -127), 127)))
    return s, r, g


@triton.jit
def _rne_magnitude(v):
    """E2M1 magnitude code (int32) of v: nearest, ties to even code, saturate at 6; NaN -> 7."""
    a = tl.abs(v)
    mag = (a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
    mag += (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32)
    return tl.where(a != a, 7, mag)


@triton.jit
def _e2m1_value(mag):
    hi = tl.where(mag >= 6, tl.where(mag == 7, 6.0, 4.0), tl.where(mag == 5, 3.0, 2.0))
    return tl.where(mag >= 4, hi, mag.to(tl.float32) * 0.5)


@triton.jit
def _to_bf16_rne(val):
    """fp32 -> bf16 with round-to-nearest-even on the integer bits, NaN -> 0x7FC0 (as torch's CPU cast).
    Done by hand because the Triton interpreter's fp32 -> bf16 cast truncates."""
    bits = val.to(tl.int32, bitcast=True)
    rb = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rb = tl.where(val != val, 0x7FC0, rb)
    return rb.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, hints_ptr, g_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, RCEIL: tl.constexpr, EMIT_HINTS: tl.constexpr,
):
    # Tile [BN, G, 8]: BN blocks of G groups of 8 values (B = 8G). One group of 8 values gives one hint byte
    # and one 32-bit word of codes (value i of the group in nibble i: little-endian, so element 2i is the low
    # nibble of byte i), so packing is a reduction over the last axis, which stays inside a thread.
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BN + tl.arange(0, BN)  # [BN]
    bmask = blk < NB
    grp = tl.arange(0, G)
    lane = tl.arange(0, 8)
    gidx = blk[:, None] * G + grp[None, :]  # [BN, G] group index
    offs = gidx[:, :, None] * 8 + lane[None, None, :]  # [BN, G, 8]
    x = tl.load(x_ptr + offs, mask=bmask[:, None, None], other=0.0).to(tl.float32)
    sbyte = _own_scale(x, g_ptr, IS_NV, RCEIL)  # [BN]
    _, r, _ = _scale_factor(sbyte, g_ptr, IS_NV)
    v = x * r[:, None, None]
    mag = _rne_magnitude(v)
    neg = (x.to(tl.int32, bitcast=True) < 0) & (x == x)
    code = (mag | (neg.to(tl.int32) << 3)).to(tl.uint32)  # [BN, G, 8]
    word = tl.sum(code << (lane[None, None, :] * 4).to(tl.uint32), axis=2)  # [BN, G]; disjoint bits: sum == or
    gmask = bmask[:, None]
    tl.store(codes_ptr + gidx, word.to(tl.int32, bitcast=True), mask=gmask)
    tl.store(scales_ptr + blk, sbyte.to(tl.uint8), mask=bmask)
    if EMIT_HINTS:
        hbyte = tl.sum((code & 1) << lane[None, None, :].to(tl.uint32), axis=2)  # [BN, G]
        tl.store(hints_ptr + gidx, hbyte.to(tl.uint8), mask=gmask)


@triton.jit
def _fake_quant_kernel(
    x_ptr, out_ptr, scales_ptr, hints_ptr, g_ptr, scales_out_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, RCEIL: tl.constexpr,
    HAS_SCALES: tl.constexpr, HAS_HINTS: tl.constexpr, STORE_SCALES: tl.constexpr, OUT_BF16: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BN + tl.arange(0, BN)  # [BN]
    bmask = blk < NB
    grp = tl.arange(0, G)
    lane = tl.arange(0, 8)
    gidx = blk[:, None] * G + grp[None, :]  # [BN, G]
    offs = gidx[:, :, None] * 8 + lane[None, None, :]  # [BN, G, 8]
    mask3 = bmask[:, None, None]
    x_in = tl.load(x_ptr + offs, mask=mask3, other=0.0)
    x = x_in.to(tl.float32)
    if HAS_SCALES:
        sbyte = tl.load(scales_ptr + blk, mask=bmask, other=0).to(tl.int32)
    else:
        sbyte = _own_scale(x, g_ptr, IS_NV, RCEIL)
        if STORE_SCALES:
            tl.store(scales_out_ptr + blk, sbyte.to(tl.uint8), mask=bmask)
    s, r, g = _scale_factor(sbyte, g_ptr, IS_NV)
    v = x * r[:, None, None]
    if HAS_HINTS:
        hbyte = tl.load(hints_ptr + gidx, mask=bmask[:, None], other=0).to(tl.int32)  # [BN, G]
        hint = (hbyte[:, :, None] >> lane[None, None, :]) & 1  # [BN, G, 8]
        a = tl.minimum(tl.abs(v), 6.0)
        k = (a >= 0.5).to(tl.int32) + (a >= 1.0).to(tl.int32) + (a >= 1.5).to(tl.int32)
        k += (a >= 2.0).to(tl.int32) + (a >= 3.0).to(tl.int32) + (a >= 4.0).to(tl.int32)
        mag = tl.where((k & 1) == hint, k, k + 1)
    else:
        mag = _rne_magnitude(v)
    out = (_e2m1_value(mag) * s[:, None, None]) * g
    out = _flip_sign(out, x.to(tl.int32, bitcast=True) < 0)
    out = tl.where(x != x, x, out)  # NaN propagates
    if OUT_BF16:
        tl.store(out_ptr + offs, _to_bf16_rne(out), mask=mask3)
    else:
        tl.store(out_ptr + offs, out.to(x_in.dtype), mask=mask3)


@triton.jit
def _fake_quant_bwd_kernel(
    grad_ptr, x_ptr, scales_ptr, g_ptr, out_ptr, NB, G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr,
):
    pid = tl.program_id(0)
    blk = pid.to(tl.int64) * BN + tl.arange(0, BN)
    bmask = blk < NB
    grp = tl.arange(0, G)
    lane = tl.arange(0, 8)
    offs = (blk[:, None] * G + grp[None, :])[:, :, None] * 8 + lane[None, None, :]  # [BN, G, 8]
    mask3 = bmask[:, None, None]
    grad = tl.load(grad_ptr + offs, mask=mask3, other=0.0)
    x = tl.load(x_ptr + offs, mask=mask3, other=0.0).to(tl.float32)
    sbyte = tl.load(scales_ptr + blk, mask=bmask, other=0).to(tl.int32)
    _, r, _ = _scale_factor(sbyte, g_ptr, IS_NV)
    v = x * r[:, None, None]
    out = tl.where(tl.abs(v) > 6.0, tl.zeros_like(grad), grad)
    tl.store(out_ptr + offs, out, mask=mask3)


def _g_arg(g: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if g is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return g.to(device=device, dtype=torch.float32).contiguous()


def _cfg(name: str, config: tuple[int, int] | None) -> tuple[int, int]:
    return config if config is not None else CONFIG[name]


def quantize_blocks_triton(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scale_rule: str = "floor", emit_hints: bool = True,
    config: tuple[int, int] | None = None,
):
    """Triton twin of `reference.quantize_blocks_ref`: xb [NB, B] -> (codes [NB, B/2], scales [NB],
    hints [NB, B/8] or None)."""
    xb = xb.contiguous()
    nb, b = xb.shape
    dev = xb.device
    codes = torch.empty((nb, b // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((nb,), dtype=torch.uint8, device=dev)
    hints = torch.empty((nb, b // HINTS_PER_BYTE), dtype=torch.uint8, device=dev) if emit_hints else None
    if nb:
        bn, warps = _cfg("quantize", config)
        _quantize_kernel[(triton.cdiv(nb, bn),)](
            xb, codes.view(torch.int32), scales, hints if emit_hints else codes, _g_arg(g, dev), nb,
            G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", RCEIL=scale_rule == "rceil", EMIT_HINTS=emit_hints,
            num_warps=warps,
        )
    return codes, scales, hints


def fake_quantize_blocks_triton(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scales_u8: torch.Tensor | None,
    hints_packed: torch.Tensor | None, scale_rule: str = "floor", return_scales: bool = False,
    config: tuple[int, int] | None = None,
):
    """Triton twin of `reference.fake_quantize_blocks_ref` with packed hints [NB, B/8].
    Returns (out [NB, B], scale bytes [NB] used, or None when own scales were not asked for)."""
    xb = xb.contiguous()
    nb, b = xb.shape
    dev = xb.device
    out = torch.empty_like(xb)
    has_scales = scales_u8 is not None
    store_scales = (not has_scales) and return_scales
    scales_out = torch.empty((nb,), dtype=torch.uint8, device=dev) if store_scales else None
    if nb:
        bn, warps = _cfg("fake_quant", config)
        dummy = out
        _fake_quant_kernel[(triton.cdiv(nb, bn),)](
            xb, out,
            scales_u8.contiguous() if has_scales else dummy,
            hints_packed.contiguous() if hints_packed is not None else dummy,
            _g_arg(g, dev),
            scales_out if store_scales else dummy,
            nb, G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", RCEIL=scale_rule == "rceil",
            HAS_SCALES=has_scales, HAS_HINTS=hints_packed is not None, STORE_SCALES=store_scales,
            OUT_BF16=xb.dtype == torch.bfloat16, num_warps=warps,
        )
    return out, (scales_u8 if has_scales else scales_out)


def fake_quantize_bwd_blocks_triton(
    grad_b: torch.Tensor, xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scales_u8: torch.Tensor,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.fake_quantize_bwd_blocks_ref` (clipped straight-through gradient)."""
    grad_b = grad_b.contiguous()
    xb = xb.contiguous()
    nb, b = xb.shape
    out = torch.empty_like(grad_b)
    if nb:
        bn, warps = _cfg("fake_quant_bwd", config)
        _fake_quant_bwd_kernel[(triton.cdiv(nb, bn),)](
            grad_b, xb, scales_u8.contiguous(), _g_arg(g, xb.device), out, nb,
            G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", num_warps=warps,
        )
    return out
