"""Triton kernels of the FP4 numerics, bit-identical to `kernels.reference` (imported lazily by `kernels.api`).

Three kernels over a flat view of the input as NB blocks of B values (B = 16 NVFP4, 32 MXFP4; rows are whole
numbers of blocks, so block k is simply elements [kB, (k+1)B)); every program owns BN whole blocks:

- `_quantize_kernel`:   x [NB, B] -> codes [NB, B/2], scale bytes [NB], hint bytes [NB, B/8]
- `_fake_quant_kernel`: x [NB, B] (+ scale bytes, hint bytes) -> out [NB, B] in x.dtype (RTN or hint-guided)
- `_fake_quant_bwd_kernel`: clipped straight-through gradient (grad where not |x * r| > 6)

Layout: a block is loaded as G = B/8 separate tiles [BN, 8] of identical shape, so one thread holds whole
blocks (each 8-value row is one 16-byte load for 16-bit inputs): the block amax, the 32-bit word of 8 packed
codes and the hint byte are in-thread reductions (no shuffles), and a block's codes/hints/scale leave in one
8-/2-/1-byte store (NVFP4).

These kernels are bound by instructions per element, not bytes, so the per-element math uses integer tricks
that give the same results as the reference's comparisons (tested bit for bit):
- RNE onto the E2M1 ladder: for 1 <= a <= 6, round the fp32 bits of a to one mantissa bit
  (rb = b + 0x1FFFFF + ((b >> 22) & 1)); the code is (rb >> 22) - 252. Below 1 the ladder is uniform (0, 0.5,
  1): code = bits(2a + 2^23) - bits(2^23) (round to nearest even by the fp32 adder; 2a is exact). |v| is
  clamped to 6 first (6 < |v|, Inf and NaN all give code 7).
- Hint-guided k = #{ladder <= a}: the same with truncation instead of rounding.
- E2M1 value of index i >= 2 is the float with bits (i + 252) << 22.

Exactness rules that keep them bit-identical to the reference:
- every division is `tl.math.div_rn` (correctly rounded; Triton's `/` on fp32 is the approximate div.full.f32);
- the E4M3 rounding is the same integer/exact-float procedure as `reference.e4m3_encode`;
- the only multiply feeding an add has an exact product (2a, t * 512), so FMA contraction cannot change a bit;
- the sign is applied last by flipping the sign bit (Triton's unary minus is 0 - x, which loses -0.0).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["quantize_blocks_triton", "fake_quantize_blocks_triton", "fake_quantize_bwd_blocks_triton", "CONFIG"]

#: default launch configuration per kernel: (blocks per program BN, num_warps); tuned on an H200 by
#: benchmarks/benchmark_kernels.py (see benchmarks/results/kernels-h200.json)
CONFIG: dict[str, tuple[int, int]] = {"quantize": (256, 4), "fake_quant": (256, 4), "fake_quant_bwd": (256, 4)}


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
    """-val where neg, by flipping the sign bit."""
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
def _scale_byte_from_amax(amax, g_ptr, IS_NV: tl.constexpr, RCEIL: tl.constexpr):
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
def _tile_offsets(blk, G: tl.constexpr):
    """(group index [BN, G], element offsets [BN, G, 8]) of the BN blocks `blk` (G groups of 8 values each)."""
    gidx = blk[:, None] * G + tl.arange(0, G)[None, :]
    return gidx, gidx[:, :, None] * 8 + tl.arange(0, 8)[None, None, :]


@triton.jit
def _amax_tile(x_in):
    """max |x| over the finite values of each block of a [BN, G, 8] tile (in the input dtype: exact)."""
    ax = tl.abs(x_in)
    return tl.max(tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=2), axis=1)


@triton.jit
def _abs_bits_clamped(v):
    """fp32 bits of min(|v|, 6) as int32; NaN -> 6."""
    return tl.minimum(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x40C00000)


@triton.jit
def _rne_code(x, r3):
    """Codes (int32, sign included) of fp32 x with factors r3 broadcast to x: RNE on the ladder, ties to the
    even code, saturating at 6; NaN -> magnitude 7; the sign bit is x's (NaN included)."""
    v = x * r3
    b = _abs_bits_clamped(v)
    rb = b + 0x1FFFFF + ((b >> 22) & 1)  # RNE of a in [1, 6] to one mantissa bit
    c_norm = (rb >> 22) - 252
    a = b.to(tl.float32, bitcast=True)
    c_sub = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # rne(2a) for a < 1
    mag = tl.where(b < 0x3F800000, c_sub, c_norm)
    return mag | ((x.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _pack_groups(code):
    """(32-bit word of 8 codes, value i in nibble i; hint byte = bit 0 of each code) per group of a
    [BN, G, 8] code tile -> two [BN, G] int32 tensors."""
    lane = tl.arange(0, 8)
    word = tl.sum(code << (lane[None, None, :] * 4), axis=2)  # disjoint nibbles: sum == or
    t = word & 0x11111111  # gather bits 0, 4, ..., 28 into bits 0..7
    t = (t | (t >> 3)) & 0x03030303
    t = (t | (t >> 6)) & 0x000F000F
    t = (t | (t >> 12)) & 0xFF
    return word, t


@triton.jit
def _hint_magnitude(v, hint):
    """Hint-guided magnitude index (int32): k = #{ladder <= min(|v|, 6)}; k + ((k ^ hint) & 1)."""
    b = _abs_bits_clamped(v)
    k_norm = tl.minimum((b >> 22) - 252, 6)  # a in [1, 6]: floor onto the ladder
    k_sub = (b >= 0x3F000000).to(tl.int32)  # a < 1: 0.5 <= a
    k = tl.where(b < 0x3F800000, k_sub, k_norm)
    return k + ((k ^ hint) & 1)


@triton.jit
def _e2m1_bits(mag):
    """fp32 bits of E2M1[mag] for magnitude index 0..7: (mag + 252) << 22 for mag >= 2; 0.5; 0."""
    return tl.where(mag >= 2, (mag + 252) << 22, tl.where(mag == 1, 0x3F000000, 0))


@triton.jit
def _to_bf16_rne(val):
    """fp32 -> bf16 with round-to-nearest-even on the integer bits, NaN -> 0x7FC0 (as torch's CPU cast).
    Used under the interpreter, whose fp32 -> bf16 cast truncates; on GPU the hardware cast (RNE) is used."""
    bits = val.to(tl.int32, bitcast=True)
    rb = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rb = tl.where(val != val, 0x7FC0, rb)
    return rb.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _blocks(NB, BN: tl.constexpr, BIG: tl.constexpr):
    pid = tl.program_id(0)
    if BIG:
        blk = pid.to(tl.int64) * BN + tl.arange(0, BN)
    else:
        blk = pid * BN + tl.arange(0, BN)
    return blk, blk < NB


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, hints_ptr, g_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, RCEIL: tl.constexpr, EMIT_HINTS: tl.constexpr,
    BIG: tl.constexpr,
):
    # codes_ptr: int32 view of the codes (one word per group of 8 values); hints_ptr: uint8, one byte per group
    blk, bmask = _blocks(NB, BN, BIG)
    gidx = blk[:, None] * G + tl.arange(0, G)[None, :]  # [BN, G] group index
    offs = blk[:, None] * (8 * G) + tl.arange(0, 8 * G)[None, :]  # [BN, B]: 16-byte pieces to adjacent threads
    x_in = tl.load(x_ptr + offs, mask=bmask[:, None], other=0.0)
    ax = tl.abs(x_in)
    amax = tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=1)  # finite values only, exact in x's dtype
    sbyte = _scale_byte_from_amax(amax.to(tl.float32), g_ptr, IS_NV, RCEIL)  # [BN]
    _, r, _ = _scale_factor(sbyte, g_ptr, IS_NV)
    code = tl.reshape(_rne_code(x_in.to(tl.float32), r[:, None]), (BN, G, 8))
    word, hbyte = _pack_groups(code)  # [BN, G] each
    # One code word and one hint byte per thread, adjacent threads holding adjacent groups: that is already
    # coalesced, so store flat with contiguity 1; a vectorized store would go through shared memory.
    flat = tl.max_contiguous(tl.reshape(gidx, (BN * G,)), 1)
    fmask = tl.reshape(gidx < NB * G, (BN * G,))
    tl.store(codes_ptr + flat, tl.reshape(word, (BN * G,)), mask=fmask)
    # the scale byte is written by the thread that holds the block's first group
    first = tl.reshape((gidx % G == 0) & (gidx < NB * G), (BN * G,))
    sflat = tl.reshape(sbyte[:, None] + tl.zeros_like(gidx), (BN * G,))
    tl.store(scales_ptr + flat // G, sflat.to(tl.uint8), mask=first)
    if EMIT_HINTS:
        tl.store(hints_ptr + flat, tl.reshape(hbyte, (BN * G,)).to(tl.uint8), mask=fmask)


@triton.jit
def _per_group(ptr, blk, G: tl.constexpr, BN: tl.constexpr, NB, PER_BLOCK: tl.constexpr):
    """Load one byte per group [BN, G] (PER_BLOCK: the block's byte, repeated for each of its groups) as int32.
    Loaded flat with contiguity 1 so that the value lands in the thread that holds the group (no shuffle)."""
    gidx = blk[:, None] * G + tl.arange(0, G)[None, :]
    flat = tl.max_contiguous(tl.reshape(gidx, (BN * G,)), 1)
    fmask = tl.reshape(gidx < NB * G, (BN * G,))
    if PER_BLOCK:
        v = tl.load(ptr + flat // G, mask=fmask, other=0)
    else:
        v = tl.load(ptr + flat, mask=fmask, other=0)
    return tl.reshape(v, (BN, G)).to(tl.int32)


@triton.jit
def _fake_quant_kernel(
    x_ptr, out_ptr, scales_ptr, hints_ptr, g_ptr, scales_out_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, RCEIL: tl.constexpr,
    HAS_SCALES: tl.constexpr, HAS_HINTS: tl.constexpr, STORE_SCALES: tl.constexpr, MANUAL_BF16: tl.constexpr,
    BIG: tl.constexpr,
):
    # x is loaded as [BN, B] (16-byte pieces to adjacent threads: coalesced) and viewed as [BN, G, 8]; per-block
    # values (scale, factor) are computed per group [BN, G] by the thread that holds the group.
    blk, bmask = _blocks(NB, BN, BIG)
    offs = blk[:, None] * (8 * G) + tl.arange(0, 8 * G)[None, :]  # [BN, B]
    x_in = tl.load(x_ptr + offs, mask=bmask[:, None], other=0.0)
    x3_in = tl.reshape(x_in, (BN, G, 8))
    x = x3_in.to(tl.float32)
    if HAS_SCALES:
        sbyte = _per_group(scales_ptr, blk, G, BN, NB, True)  # [BN, G]
    else:
        ax = tl.abs(x3_in)
        amax = tl.max(tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=2), axis=1)  # [BN]
        sb = _scale_byte_from_amax(amax.to(tl.float32), g_ptr, IS_NV, RCEIL)
        if STORE_SCALES:
            tl.store(scales_out_ptr + blk, sb.to(tl.uint8), mask=bmask)
        sbyte = sb[:, None] + tl.zeros((BN, G), dtype=tl.int32)
    s, r, g = _scale_factor(sbyte, g_ptr, IS_NV)  # [BN, G]
    if HAS_HINTS:
        hint = _per_group(hints_ptr, blk, G, BN, NB, False)[:, :, None] >> tl.arange(0, 8)[None, None, :]
        mag = _hint_magnitude(x * r[:, :, None], hint)  # only bit 0 of hint is used
    else:
        mag = _rne_code(x, r[:, :, None]) & 7
    out = (_e2m1_bits(mag).to(tl.float32, bitcast=True) * s[:, :, None]) * g
    out = (out.to(tl.int32, bitcast=True) ^ (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    out = tl.where(x != x, x, out)  # NaN propagates
    if MANUAL_BF16:
        out_lp = _to_bf16_rne(out)
    else:
        out_lp = out.to(x_in.dtype)
    tl.store(out_ptr + offs, tl.reshape(out_lp, (BN, 8 * G)), mask=bmask[:, None])


@triton.jit
def _fake_quant_bwd_kernel(
    grad_ptr, x_ptr, scales_ptr, g_ptr, out_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, BIG: tl.constexpr,
):
    blk, bmask = _blocks(NB, BN, BIG)
    offs = blk[:, None] * (8 * G) + tl.arange(0, 8 * G)[None, :]  # [BN, B]
    m2 = bmask[:, None]
    grad = tl.reshape(tl.load(grad_ptr + offs, mask=m2, other=0.0), (BN, G, 8))
    x = tl.reshape(tl.load(x_ptr + offs, mask=m2, other=0.0), (BN, G, 8)).to(tl.float32)
    _, r, _ = _scale_factor(_per_group(scales_ptr, blk, G, BN, NB, True), g_ptr, IS_NV)  # [BN, G]
    v = x * r[:, :, None]
    out = tl.where(tl.abs(v) > 6.0, tl.zeros_like(grad), grad)
    tl.store(out_ptr + offs, tl.reshape(out, (BN, 8 * G)), mask=m2)


def _g_arg(g: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if g is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return g.to(device=device, dtype=torch.float32).contiguous()


def _cfg(name: str, config: tuple[int, int] | None) -> tuple[int, int]:
    return config if config is not None else CONFIG[name]


def _big(t: torch.Tensor) -> bool:
    return t.numel() >= 2**31 - 2**20


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    hints = torch.empty((nb, b // 8), dtype=torch.uint8, device=dev) if emit_hints else None
    if nb:
        bn, warps = _cfg("quantize", config)
        _quantize_kernel[(triton.cdiv(nb, bn),)](
            xb, codes.view(torch.int32), scales, hints if emit_hints else scales, _g_arg(g, dev), nb,
            G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", RCEIL=scale_rule == "rceil", EMIT_HINTS=emit_hints,
            BIG=_big(xb), num_warps=warps,
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
        dummy = torch.empty((1,), dtype=torch.uint8, device=dev)
        hints_arg = hints_packed.contiguous() if hints_packed is not None else dummy
        _fake_quant_kernel[(triton.cdiv(nb, bn),)](
            xb, out,
            scales_u8.contiguous() if has_scales else dummy,
            hints_arg,
            _g_arg(g, dev),
            scales_out if store_scales else dummy,
            nb, G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", RCEIL=scale_rule == "rceil",
            HAS_SCALES=has_scales, HAS_HINTS=hints_packed is not None, STORE_SCALES=store_scales,
            MANUAL_BF16=xb.dtype == torch.bfloat16 and _interpreting(), BIG=_big(xb), num_warps=warps,
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
            G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", BIG=_big(xb), num_warps=warps,
        )
    return out
