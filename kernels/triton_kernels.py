"""Triton kernels of the FP4 numerics, bit-identical to `tracefp4.reference` (imported lazily by `tracefp4.api`).

Three kernels over a flat view of the input as NB blocks of B values (B = 16 NVFP4, 32 MXFP4; rows are whole
numbers of blocks, so block k is simply elements [kB, (k+1)B)); every program owns BN whole blocks:

- `_quantize_kernel`:   x [NB, B] -> codes [NB, B/2], scale bytes [NB], hint bytes [NB, B/8]
- `_fake_quant_kernel`: x [NB, B] (+ scale bytes, hint bytes) -> out [NB, B] in x.dtype (RTN or hint-guided)
- `_fake_quant_bwd_kernel`: clipped straight-through gradient (grad where not |x * r| > 6)

Two tile layouts for the forward kernels (constexpr SPLIT; the default per kernel is in CONFIG; the backward
kernel has the split layout only):
- one thread per block (SPLIT=False): a block is loaded as G = B/8 tiles [BN, 8] of identical shape, so the
  block amax, the 32-bit word of 8 packed codes and the hint byte are in-thread reductions and a block's
  codes/hints/scale leave in one 8-/2-/1-byte store (NVFP4). Each warp load instruction uses half of every
  32-byte sector (the other half comes from L1 on the next load); the per-block work (3 correctly rounded
  divisions, E4M3 rounding) is amortized over 16 values. Best for quantize and hint-guided fake quant.
- split (SPLIT=True): a [BN, B] tile, 16-byte pieces to adjacent threads (fully coalesced), a block shared by
  G threads (one shuffle for the amax), per-block work repeated in each of them, flat per-group stores with
  contiguity 1 (a vectorized store would go through shared memory). Best for the light kernels (backward,
  round-to-nearest fake quant).

These kernels are bound by the integer (ALU) pipe, not by bytes (on an H200 the ALU pipe does 64 lanes/clock per
SM against 128 for FP32 multiply-adds), so the per-element math uses tricks that move work to the FMA pipe and
give the same results as the reference's comparisons (tested bit for bit):
- RNE onto the E2M1 ladder: for 1 <= a <= 6, round the fp32 bits of a to one mantissa bit
  (rb = b + 0x1FFFFF + ((b >> 22) & 1)); the code is (rb >> 22) - 252; or (FP_RNE) with the fp32 adder,
  (a + 2^(e+22)) - 2^(e+22). Below 1 the ladder is uniform (0, 0.5, 1): code = bits(2a + 2^23) - bits(2^23)
  (round to nearest even by the fp32 adder; 2a is exact). 6 < |v|, Inf and NaN all give code 7.
- Hint-guided rounding: with b the bits of min(|v|, 6) (just below 6), k + 252 = b >> 22 for a >= 1, so the
  value bits are (b & 0xFFC00000) + ((((b >> 22) ^ hint) & 1) << 22).
- E2M1 value of index i >= 2 is the float with bits (i + 252) << 22; the hint byte is gathered from the code
  word by three carry-free multiplications; the sign by a high multiply (x_bits >> 28).
- On GPU the block amax uses a + (a - a) (NaN for +-Inf/NaN) and the NaN-ignoring hardware max; the
  interpreter (whose max propagates NaN) uses a select instead. Both ignore non-finite values.

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

#: default launch configuration per kernel, the best of the sweep on an H200 at hidden 2048 and 7168
#: (benchmarks/results/kernels-h200.json). Forward kernels: (blocks per program BN, num_warps, split layout,
#: fp-adder rounding); "split": a block's values spread over adjacent threads (coalesced 16-byte pieces) instead
#: of one thread per block. The backward kernel (split layout only, no rounding): (BN, num_warps).
CONFIG: dict[str, tuple] = {
    "quantize": (128, 4, False, True),
    "fake_quant": (128, 4, False, False),  # hint-guided
    "fake_quant_rtn": (256, 4, True, False),  # round to nearest (no hints)
    "fake_quant_bwd": (256, 4),
}


@triton.jit
def _nv_scale(amax, g):
    """(E4M3 byte as int32, its fp32 value s) of e4m3_rne(clamp((amax / 6) / g, 2^-9, 448)).

    Normal range (t >= 2^-6): RNE of the fp32 bits to 3 mantissa bits; the rounded bits are s, and the byte is
    (bits >> 20) - (120 << 3). Subnormal range: t + 2^14 rounds t to the 2^-9 grid (ulp(2^14) = 2^-9) with the
    adder's round-to-nearest-even; the bit difference to 2^14 is the byte m and (t + 2^14) - 2^14 is s (exact).
    Same values as reference.e4m3_encode/e4m3_decode (tested)."""
    t = tl.math.div_rn(tl.math.div_rn(amax, 6.0), g)
    t = tl.minimum(tl.maximum(t, 0.001953125), 448.0)
    bits = t.to(tl.int32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576  # -1048576 == ~0xFFFFF
    ts = t + 16384.0
    normal = t >= 0.015625
    sbyte = tl.where(normal, (rb >> 20) - 960, ts.to(tl.int32, bitcast=True) - 0x46800000)
    s = tl.where(normal, rb.to(tl.float32, bitcast=True), ts - 16384.0)
    return sbyte, s


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
def _own_scale(amax, g_ptr, IS_NV: tl.constexpr, RCEIL: tl.constexpr):
    """(scale byte int32, s, r, g) from the block amax (fp32): v = x * r."""
    if IS_NV:
        g = tl.load(g_ptr)
        sbyte, s = _nv_scale(amax, g)
        r = tl.math.div_rn(tl.math.div_rn(1.0, g), s)
    else:
        g = 1.0
        e = _mx_exponent(amax, RCEIL)
        sbyte = e + 127
        s = _pow2(e)
        r = _pow2(-e)
    return sbyte, s, r, g


@triton.jit
def _scale_factor(sbyte, g_ptr, IS_NV: tl.constexpr):
    """(s, r, g) from given scale bytes (int32): s decoded scale, r with v = x * r, g global scale (1 for MX)."""
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
def _rne_code(x, r3, FP_RNE: tl.constexpr):
    """Codes (int32, sign included) of fp32 x with factors r3 broadcast to x: RNE on the ladder, ties to the
    even code, saturating at 6; NaN -> magnitude 7; the sign bit is x's (NaN included).

    FP_RNE: round a = |v| in [1, 8) with the fp32 adder instead of integer ops (these kernels are bound by the
    integer pipe): C = 2^(e + 22) for a in [2^e, 2^(e+1)) has ulp 2^(e-1), so (a + C) - C is a rounded to one
    mantissa bit, ties to even (Inf/NaN/huge a give NaN or >= 8, clamped to code 7)."""
    a = tl.abs(x) * r3  # |v| = |x| * r
    if FP_RNE:
        c_exp = (a.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True) * 4194304.0
        rounded = (a + c_exp) - c_exp
        # unsigned shift: any NaN (either sign) gives >= 511 - 252, clamped to 7
        c_norm = tl.minimum((rounded.to(tl.uint32, bitcast=True) >> 22).to(tl.int32) - 252, 7)
    else:
        b = tl.minimum(a.to(tl.int32, bitcast=True), 0x40C00000)  # clamped to 6; NaN -> 6
        rb = b + 0x1FFFFF + ((b >> 22) & 1)  # RNE of a in [1, 6] to one mantissa bit
        c_norm = (rb >> 22) - 252
    c_sub = (a * 2.0 + 8388608.0).to(tl.int32, bitcast=True) - 0x4B000000  # rne(2a) for a < 1
    mag = tl.where(a < 1.0, c_sub, c_norm)
    # sign bit of x to bit 3: x_bits >> 28 as a high multiply (runs on the FMA pipe, the integer pipe is the limit)
    return mag | (tl.umulhi(x.to(tl.uint32, bitcast=True), 16).to(tl.int32) & 8)


@triton.jit
def _gather_hint_bits(word):
    """Bits 0, 4, ..., 28 of a 32-bit word of 8 codes -> bits 0..7 (the hint byte). Multiplications by
    (1 + 2^3), (1 + 2^6), (1 + 2^12) bring the bits together without carries (every partial product lands on a
    distinct bit) and run on the FMA pipe: 3 multiplies and 4 logic ops instead of 7 logic ops."""
    t = (word & 0x11111111) * 9 & 0x18181818  # (i, i+1) pairs at bits 8k+3, 8k+4
    t = (t * 65) & 0x1E001E00  # nibbles i0..i3 at bits 9..12, i4..i7 at 25..28
    return ((t * 4097) >> 21) & 0xFF  # i0..i7 at bits 21..28


@triton.jit
def _pack_groups(code):
    """(32-bit word of 8 codes, value i in nibble i; hint byte = bit 0 of each code) per group of a
    [BN, G, 8] code tile -> two [BN, G] int32 tensors."""
    lane = tl.arange(0, 8)
    word = tl.sum(code << (lane[None, None, :] * 4), axis=2)  # disjoint nibbles: sum == or
    return word, _gather_hint_bits(word)


@triton.jit
def _hint_value_bits(v, hint):
    """fp32 bits of E2M1[idx] for hint-guided rounding of v (hint: only bit 0 is used).

    With a = min(|v|, 6) and b its bits clamped below 6 (so a = 6 counts like [4, 6)): for a >= 1,
    k + 252 = b >> 22, so idx + 252 = (b >> 22) + ((k ^ hint) & 1) and the value bits are (idx + 252) << 22.
    For a < 1: k = (a >= 0.5); idx = hint ? 1 : 2k, i.e. 0.5 if the hint is 1, else 0 or 1."""
    b = tl.minimum(v.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0x40BFFFFF)  # |v|, NaN -> just below 6
    hb = hint & 1
    hi = (b & -4194304) + ((((b >> 22) ^ hb) & 1) << 22)  # -4194304 == 0xFFC00000
    lo = tl.where(hb == 1, 0x3F000000, tl.where(b >= 0x3F000000, 0x3F800000, 0))
    return tl.where(b >= 0x3F800000, hi, lo)


@triton.jit
def _e2m1_bits(mag):
    """fp32 bits of E2M1[mag] for magnitude index 0..7: (mag + 252) << 22 for mag >= 2; 0.5; 0."""
    return tl.where(mag >= 2, (mag + 252) << 22, tl.where(mag == 1, 0x3F000000, 0))


@triton.jit
def _to_bf16_rne(val):
    """fp32 -> bf16 with round-to-nearest-even on the integer bits, NaN -> 0x7FC0 (a NaN; NaN payloads are
    unspecified, see NUMERICS.md section 7). Used under the interpreter, whose fp32 -> bf16 cast truncates; on
    GPU the hardware cast (RNE) is used."""
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
def _offsets8(blk, j: tl.constexpr, G: tl.constexpr):
    """Element offsets [BN, 8] of the j-th group of 8 values of each block (one thread per block layout)."""
    return (blk * G + j)[:, None] * 8 + tl.arange(0, 8)[None, :]


@triton.jit
def _amax8(x_in, NAN_IGNORING_MAX: tl.constexpr):
    """max |x| over the finite values of each row of [BN, 8], as fp32.

    NAN_IGNORING_MAX (GPU): a + (a - a) is a for finite a and NaN for +-Inf/NaN, and the hardware max ignores
    NaN: two adds on the FMA pipe instead of a compare and a select on the integer pipe. The interpreter's max
    propagates NaN, so there the non-finite values are replaced by 0 with a select."""
    a = tl.abs(x_in.to(tl.float32))
    if NAN_IGNORING_MAX:
        return tl.maximum(tl.max(a + (a - a), axis=1), 0.0)
    else:
        return tl.max(tl.where(a < float("inf"), a, 0.0), axis=1)


@triton.jit
def _word8(code):
    """(32-bit word of the 8 codes of each row of [BN, 8], hint byte) as int32 [BN]."""
    word = tl.sum(code << (tl.arange(0, 8)[None, :] * 4), axis=1)  # disjoint nibbles: sum == or
    return word, _gather_hint_bits(word)


@triton.jit
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, hints_ptr, g_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, RCEIL: tl.constexpr, EMIT_HINTS: tl.constexpr,
    BIG: tl.constexpr, SPLIT: tl.constexpr, FP_RNE: tl.constexpr, NAN_IGNORING_MAX: tl.constexpr,
):
    blk, bmask = _blocks(NB, BN, BIG)
    if SPLIT:
        # [BN, B] tile: 16-byte pieces to adjacent threads (coalesced), a block shared by G threads.
        # codes_ptr: int32 view (one word per group); hints_ptr: uint8 (one byte per group)
        gidx = blk[:, None] * G + tl.arange(0, G)[None, :]  # [BN, G] group index
        offs = blk[:, None] * (8 * G) + tl.arange(0, 8 * G)[None, :]  # [BN, B]
        x_in = tl.load(x_ptr + offs, mask=bmask[:, None], other=0.0)
        ax = tl.abs(x_in)
        amax = tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=1)  # finite values only, exact in x's dtype
        sbyte, _, r, _ = _own_scale(amax.to(tl.float32), g_ptr, IS_NV, RCEIL)  # [BN]
        code = tl.reshape(_rne_code(x_in.to(tl.float32), r[:, None], FP_RNE), (BN, G, 8))
        word, hbyte = _pack_groups(code)  # [BN, G] each
        # One code word and one hint byte per thread, adjacent threads holding adjacent groups: already
        # coalesced, so store flat with contiguity 1; a vectorized store would go through shared memory.
        flat = tl.max_contiguous(tl.reshape(gidx, (BN * G,)), 1)
        fmask = tl.reshape(gidx < NB * G, (BN * G,))
        tl.store(codes_ptr + flat, tl.reshape(word, (BN * G,)), mask=fmask)
        first = tl.reshape((gidx % G == 0) & (gidx < NB * G), (BN * G,))  # the thread with the first group
        sflat = tl.reshape(sbyte[:, None] + tl.zeros_like(gidx), (BN * G,))
        tl.store(scales_ptr + flat // G, sflat.to(tl.uint8), mask=first)
        if EMIT_HINTS:
            tl.store(hints_ptr + flat, tl.reshape(hbyte, (BN * G,)).to(tl.uint8), mask=fmask)
    else:
        # One thread per block: G tiles [BN, 8] of identical layout. codes_ptr: int64 view (G/2 words per
        # block); hints_ptr: int16 (G = 2) or int32 (G = 4) view, one element per block.
        m2 = bmask[:, None]
        x0_in = tl.load(x_ptr + _offsets8(blk, 0, G), mask=m2, other=0.0)
        x1_in = tl.load(x_ptr + _offsets8(blk, 1, G), mask=m2, other=0.0)
        amax = tl.maximum(_amax8(x0_in, NAN_IGNORING_MAX), _amax8(x1_in, NAN_IGNORING_MAX))
        if G == 4:
            x2_in = tl.load(x_ptr + _offsets8(blk, 2, G), mask=m2, other=0.0)
            x3_in = tl.load(x_ptr + _offsets8(blk, 3, G), mask=m2, other=0.0)
            amax = tl.maximum(amax, tl.maximum(_amax8(x2_in, NAN_IGNORING_MAX), _amax8(x3_in, NAN_IGNORING_MAX)))
        sbyte, _, r, _ = _own_scale(amax.to(tl.float32), g_ptr, IS_NV, RCEIL)  # [BN]
        w0, h0 = _word8(_rne_code(x0_in.to(tl.float32), r[:, None], FP_RNE))
        w1, h1 = _word8(_rne_code(x1_in.to(tl.float32), r[:, None], FP_RNE))
        words01 = w0.to(tl.uint32, bitcast=True).to(tl.int64) | (w1.to(tl.int64) << 32)
        tl.store(scales_ptr + blk, sbyte.to(tl.uint8), mask=bmask)
        if G == 2:
            tl.store(codes_ptr + blk, words01, mask=bmask)
            if EMIT_HINTS:
                tl.store(hints_ptr + blk, (h0 | (h1 << 8)).to(tl.int16), mask=bmask)
        else:
            w2, h2 = _word8(_rne_code(x2_in.to(tl.float32), r[:, None], FP_RNE))
            w3, h3 = _word8(_rne_code(x3_in.to(tl.float32), r[:, None], FP_RNE))
            words23 = w2.to(tl.uint32, bitcast=True).to(tl.int64) | (w3.to(tl.int64) << 32)
            tl.store(codes_ptr + 2 * blk, words01, mask=bmask)
            tl.store(codes_ptr + 2 * blk + 1, words23, mask=bmask)
            if EMIT_HINTS:
                tl.store(hints_ptr + blk, h0 | (h1 << 8) | (h2 << 16) | (h3 << 24), mask=bmask)


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
def _fq_values(x_in, s, r, g, hint, HAS_HINTS: tl.constexpr, MANUAL_BF16: tl.constexpr, FP_RNE: tl.constexpr):
    """Fake-quantized values of a tile x_in (any shape) with s, r broadcast to it; hint: hint bits (bit 0)."""
    x = x_in.to(tl.float32)
    if HAS_HINTS:
        vbits = _hint_value_bits(tl.abs(x) * r, hint)
    else:
        vbits = _e2m1_bits(_rne_code(x, r, FP_RNE) & 7)
    out = (vbits.to(tl.float32, bitcast=True) * s) * g
    out = (out.to(tl.int32, bitcast=True) ^ (x.to(tl.int32, bitcast=True) & -2147483648)).to(tl.float32, bitcast=True)
    out = tl.where(x != x, x, out)  # NaN propagates
    if MANUAL_BF16:
        return _to_bf16_rne(out)
    else:
        return out.to(x_in.dtype)


@triton.jit
def _fake_quant_kernel(
    x_ptr, out_ptr, scales_ptr, hints_ptr, g_ptr, scales_out_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, RCEIL: tl.constexpr,
    HAS_SCALES: tl.constexpr, HAS_HINTS: tl.constexpr, STORE_SCALES: tl.constexpr, MANUAL_BF16: tl.constexpr,
    BIG: tl.constexpr, SPLIT: tl.constexpr, FP_RNE: tl.constexpr, NAN_IGNORING_MAX: tl.constexpr,
):
    blk, bmask = _blocks(NB, BN, BIG)
    lane = tl.arange(0, 8)
    if SPLIT:
        # x loaded as [BN, B] (coalesced) and viewed as [BN, G, 8]; per-block values are computed per group
        # [BN, G] by the thread that holds the group. hints_ptr: uint8, one byte per group.
        offs = blk[:, None] * (8 * G) + tl.arange(0, 8 * G)[None, :]  # [BN, B]
        x_in = tl.load(x_ptr + offs, mask=bmask[:, None], other=0.0)
        x3_in = tl.reshape(x_in, (BN, G, 8))
        if HAS_SCALES:
            s, r, g = _scale_factor(_per_group(scales_ptr, blk, G, BN, NB, True), g_ptr, IS_NV)  # [BN, G]
        else:
            ax = tl.abs(x3_in)
            amax = tl.max(tl.max(tl.where(ax < float("inf"), ax, 0.0), axis=2), axis=1)  # [BN]
            sb, s1, r1, g = _own_scale(amax.to(tl.float32), g_ptr, IS_NV, RCEIL)
            if STORE_SCALES:
                tl.store(scales_out_ptr + blk, sb.to(tl.uint8), mask=bmask)
            zeros = tl.zeros((BN, G), dtype=tl.float32)
            s = s1[:, None] + zeros
            r = r1[:, None] + zeros
        if HAS_HINTS:
            hint = _per_group(hints_ptr, blk, G, BN, NB, False)[:, :, None] >> lane[None, None, :]
        else:
            hint = 0
        out = _fq_values(x3_in, s[:, :, None], r[:, :, None], g, hint, HAS_HINTS, MANUAL_BF16, FP_RNE)
        tl.store(out_ptr + offs, tl.reshape(out, (BN, 8 * G)), mask=bmask[:, None])
    else:
        # One thread per block: G tiles [BN, 8]. hints_ptr: int16 (G = 2) / int32 (G = 4) view, one per block.
        m2 = bmask[:, None]
        o0 = _offsets8(blk, 0, G)
        o1 = _offsets8(blk, 1, G)
        x0_in = tl.load(x_ptr + o0, mask=m2, other=0.0)
        x1_in = tl.load(x_ptr + o1, mask=m2, other=0.0)
        if G == 4:
            o2 = _offsets8(blk, 2, G)
            o3 = _offsets8(blk, 3, G)
            x2_in = tl.load(x_ptr + o2, mask=m2, other=0.0)
            x3_in = tl.load(x_ptr + o3, mask=m2, other=0.0)
        if HAS_SCALES:
            s, r, g = _scale_factor(tl.load(scales_ptr + blk, mask=bmask, other=0).to(tl.int32), g_ptr, IS_NV)
        else:
            amax = tl.maximum(_amax8(x0_in, NAN_IGNORING_MAX), _amax8(x1_in, NAN_IGNORING_MAX))
            if G == 4:
                amax = tl.maximum(amax, tl.maximum(_amax8(x2_in, NAN_IGNORING_MAX), _amax8(x3_in, NAN_IGNORING_MAX)))
            sb, s, r, g = _own_scale(amax.to(tl.float32), g_ptr, IS_NV, RCEIL)
            if STORE_SCALES:
                tl.store(scales_out_ptr + blk, sb.to(tl.uint8), mask=bmask)
        if HAS_HINTS:
            hb = tl.load(hints_ptr + blk, mask=bmask, other=0).to(tl.int32)  # [BN]: G hint bytes
        else:
            hb = tl.zeros_like(blk).to(tl.int32)
        s2 = s[:, None]
        r2 = r[:, None]
        tl.store(out_ptr + o0, _fq_values(x0_in, s2, r2, g, hb[:, None] >> lane[None, :], HAS_HINTS, MANUAL_BF16, FP_RNE), mask=m2)
        tl.store(out_ptr + o1, _fq_values(x1_in, s2, r2, g, hb[:, None] >> (lane[None, :] + 8), HAS_HINTS, MANUAL_BF16, FP_RNE), mask=m2)
        if G == 4:
            tl.store(out_ptr + o2, _fq_values(x2_in, s2, r2, g, hb[:, None] >> (lane[None, :] + 16), HAS_HINTS, MANUAL_BF16, FP_RNE), mask=m2)
            tl.store(out_ptr + o3, _fq_values(x3_in, s2, r2, g, hb[:, None] >> (lane[None, :] + 24), HAS_HINTS, MANUAL_BF16, FP_RNE), mask=m2)


@triton.jit
def _fake_quant_bwd_kernel(
    grad_ptr, x_ptr, scales_ptr, g_ptr, out_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, BIG: tl.constexpr,
):
    # coalesced [BN, B] tiles viewed as [BN, G, 8]; the per-block factor is computed per group
    blk, bmask = _blocks(NB, BN, BIG)
    offs = blk[:, None] * (8 * G) + tl.arange(0, 8 * G)[None, :]  # [BN, B]
    m2 = bmask[:, None]
    grad = tl.reshape(tl.load(grad_ptr + offs, mask=m2, other=0.0), (BN, G, 8))
    x = tl.reshape(tl.load(x_ptr + offs, mask=m2, other=0.0), (BN, G, 8)).to(tl.float32)
    _, r, _ = _scale_factor(_per_group(scales_ptr, blk, G, BN, NB, True), g_ptr, IS_NV)  # [BN, G]
    v = x * r[:, :, None]
    out = tl.where(tl.abs(v) > 6.0, tl.zeros_like(grad), grad)
    tl.store(out_ptr + offs, tl.reshape(out, (BN, 8 * G)), mask=m2)


def _g_arg(g: torch.Tensor | None, fmt: str, device: torch.device, unused: torch.Tensor) -> torch.Tensor:
    """The g_ptr argument: g as fp32 on `device`; for MXFP4 without g (the kernels never load g_ptr then) the
    tensor `unused`, already on the device, so that a launch allocates and fills nothing for it."""
    if g is None:
        if fmt == "nvfp4":
            raise ValueError("nvfp4 needs the global scale g (fp32 0-d tensor); got None")
        return unused
    # tracefp4.api passes g on x's device already; a host g goes along without blocking (no host sync).
    return g.to(device=device, dtype=torch.float32, non_blocking=g.device.type == "cpu").contiguous()


def _bwd_cfg(config: tuple | None) -> tuple[int, int]:
    """(BN, num_warps) of the backward kernel. config: (BN, num_warps), or None for CONFIG; a forward-style
    4-tuple (as benchmarks/benchmark_kernels.py sweeps) is taken only if its layout fields are what the backward
    kernel does (split layout, no fp-adder rounding)."""
    if config is None:
        return CONFIG["fake_quant_bwd"]
    if len(config) == 4:
        bn, warps, split, fp_rne = config
        if not split or fp_rne:
            raise ValueError(f"the backward kernel has the split layout only and no fp-adder rounding; got {config}")
        return bn, warps
    bn, warps = config
    return bn, warps


def _big(t: torch.Tensor) -> bool:
    return t.numel() >= 2**31 - 2**20


def _per_block_view(t: torch.Tensor, nbytes_per_block: int) -> torch.Tensor:
    """View a contiguous uint8 tensor of `nbytes_per_block` (2 or 4) bytes per block as one int per block."""
    return t.view({2: torch.int16, 4: torch.int32}[nbytes_per_block])


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def quantize_blocks_triton(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scale_rule: str = "floor", emit_hints: bool = True,
    config: tuple | None = None,
):
    """Triton twin of `reference.quantize_blocks_ref`: xb [NB, B] -> (codes [NB, B/2], scales [NB],
    hints [NB, B/8] or None). config: (blocks per program, num_warps, split layout, fp-adder rounding), or None
    for CONFIG["quantize"]."""
    xb = xb.contiguous()
    nb, b = xb.shape
    dev = xb.device
    codes = torch.empty((nb, b // 2), dtype=torch.uint8, device=dev)
    scales = torch.empty((nb,), dtype=torch.uint8, device=dev)
    hints = torch.empty((nb, b // 8), dtype=torch.uint8, device=dev) if emit_hints else None
    if nb:
        bn, warps, split, fp_rne = config or CONFIG["quantize"]
        if split:
            codes_arg, hints_arg = codes.view(torch.int32), hints if emit_hints else scales
        else:
            codes_arg = codes.view(torch.int64)
            hints_arg = _per_block_view(hints, b // 8) if emit_hints else scales
        _quantize_kernel[(triton.cdiv(nb, bn),)](
            xb, codes_arg, scales, hints_arg, _g_arg(g, fmt, dev, scales), nb,
            G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", RCEIL=scale_rule == "rceil", EMIT_HINTS=emit_hints,
            BIG=_big(xb), SPLIT=split, FP_RNE=fp_rne, NAN_IGNORING_MAX=not _interpreting(), num_warps=warps,
        )
    return codes, scales, hints


def fake_quantize_blocks_triton(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scales_u8: torch.Tensor | None,
    hints_packed: torch.Tensor | None, scale_rule: str = "floor", return_scales: bool = False,
    config: tuple | None = None,
):
    """Triton twin of `reference.fake_quantize_blocks_ref` with packed hints [NB, B/8].
    Returns (out [NB, B], scale bytes [NB] used, or None when own scales were not asked for). config: as for
    `quantize_blocks_triton`, or None for CONFIG["fake_quant"] (hints given) / CONFIG["fake_quant_rtn"]."""
    xb = xb.contiguous()
    nb, b = xb.shape
    dev = xb.device
    out = torch.empty_like(xb)
    has_scales = scales_u8 is not None
    store_scales = (not has_scales) and return_scales
    scales_out = torch.empty((nb,), dtype=torch.uint8, device=dev) if store_scales else None
    if nb:
        bn, warps, split, fp_rne = config or CONFIG["fake_quant" if hints_packed is not None else "fake_quant_rtn"]
        dummy = torch.empty((1,), dtype=torch.int32, device=dev)
        hints_arg = dummy
        if hints_packed is not None:
            hints_arg = hints_packed.contiguous().reshape(nb, b // 8)
            if not split:
                hints_arg = _per_block_view(hints_arg, b // 8)
        _fake_quant_kernel[(triton.cdiv(nb, bn),)](
            xb, out,
            scales_u8.contiguous() if has_scales else dummy,
            hints_arg,
            _g_arg(g, fmt, dev, dummy),
            scales_out if store_scales else dummy,
            nb, G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", RCEIL=scale_rule == "rceil",
            HAS_SCALES=has_scales, HAS_HINTS=hints_packed is not None, STORE_SCALES=store_scales,
            MANUAL_BF16=xb.dtype == torch.bfloat16 and _interpreting(), BIG=_big(xb), SPLIT=split,
            FP_RNE=fp_rne, NAN_IGNORING_MAX=not _interpreting(), num_warps=warps,
        )
    return out, (scales_u8 if has_scales else scales_out)


def fake_quantize_bwd_blocks_triton(
    grad_b: torch.Tensor, xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scales_u8: torch.Tensor,
    config: tuple | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.fake_quantize_bwd_blocks_ref` (clipped straight-through gradient).
    config: (blocks per program, num_warps), or None for CONFIG["fake_quant_bwd"] (see `_bwd_cfg`)."""
    grad_b = grad_b.contiguous()
    xb = xb.contiguous()
    nb, b = xb.shape
    out = torch.empty_like(grad_b)
    if nb:
        bn, warps = _bwd_cfg(config)
        scales_u8 = scales_u8.contiguous()
        _fake_quant_bwd_kernel[(triton.cdiv(nb, bn),)](
            grad_b, xb, scales_u8, _g_arg(g, fmt, xb.device, scales_u8), out, nb,
            G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", BIG=_big(xb), num_warps=warps,
        )
    return out
