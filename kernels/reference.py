"""Pure-torch bit-exact reference of the FP4 numerics (NVFP4 and MXFP4). Runs on CPU and GPU, needs no Triton.

This module *is* the definition: the Triton kernels (`triton_kernels.py`) and any engine adapter must produce
bit-identical codes, scales, hints and outputs. The formulas (see NUMERICS.md for the full text):

NVFP4, per block of 16 along the last dim, all math in fp32 on the upcast input::

    g      = global scale (fp32); dynamic: max(amax_finite(|x|) / 2688, 2^-118), or 1.0 when amax == 0
    amax_b = max over the block of |x| for finite x (NaN and +-Inf are ignored)
    s      = e4m3_rne(clamp((amax_b / 6) / g, 2^-9, 448))           # E4M3FN, round to nearest even
    r      = (1 / g) / s                                            # two correctly rounded fp32 divisions
    v      = x * r                                                  # one fp32 multiply
    code   = rne_ladder(|v|) | signbit(x) << 3                      # ties to the even code, saturate at 6

MXFP4, per block of 32: ``e = clamp(floor(log2 amax_b) - 2, -127, 127)`` ("floor", OCP) or
``e = clamp(ceil(log2((amax_b / 6))), -127, 127)`` ("rceil"); scale byte ``e + 127``; ``v = x * 2^-e`` (exact).

Correctly rounded fp32 division is computed as ``fp32(fp64(a) / fp64(b))``: for +,-,*,/ rounding a 53-bit
result to 24 bits is innocuous (p' >= 2p + 2), so it equals IEEE fp32 division, and it stays exact under
`torch.compile`, whose generated Triton code uses an approximate fp32 division (div.full.f32).

NaN/Inf: block and tensor amax ignore non-finite values; +-Inf gets the saturated code +-6 (0x7 / 0xF);
NaN gets magnitude 7 with its own sign bit (0x7 or 0xF), so its hint bit is 1. Fake quantization propagates
NaN (output NaN where x is NaN). The code's sign bit is always the sign bit of x: -0.0 -> code 0x8, which
dequantizes to -0.0.

Hint-guided rounding (fake quantization with the rollout's scales and hints), per value::

    v   = x' * r  (r from the rollout's s and g, never recomputed);  a = min(|v|, 6)
    k   = #{m in (0.5, 1, 1.5, 2, 3, 4) : m <= a}
    idx = k if (k & 1) == hint else k + 1
    out = (+-E2M1[idx] * s) * g                                     # fp32, then cast to x.dtype

Scale byte 0 gives output +-0; a NaN scale byte (E4M3 0x7F/0xFF, E8M0 0xFF) gives NaN.

Tensors here are 2-D block views ``[NB, B]`` (NB blocks of B values) unless stated; `tracefp4.api` does the
argument checks and the reshaping.
"""

from __future__ import annotations

import torch

from .constants import (
    E2M1_HINT_LADDER,
    E2M1_MAX,
    E2M1_MIDPOINTS,
    E4M3_MAX,
    E4M3_MIN_NORMAL,
    E4M3_MIN_SCALE,
    E8M0_BIAS,
    E8M0_MAX_EXP,
    E8M0_MIN_EXP,
    E8M0_NAN,
    MXFP4_EMAX_ELEM,
    NVFP4_GLOBAL_DENOM,
    NVFP4_GLOBAL_SCALE_FALLBACK,
    NVFP4_GLOBAL_SCALE_MIN,
)
from .packing import pack_codes, pack_hints

__all__ = [
    "div_rn",
    "e4m3_encode",
    "e4m3_decode",
    "e8m0_decode",
    "pow2_f32",
    "global_scale_ref",
    "e2m1_rne_magnitude",
    "e2m1_hint_magnitude",
    "e2m1_value",
    "input_signbit",
    "quantize_blocks_ref",
    "nvfp4_lsb_scales_ref",
    "e4m3_floor_byte",
    "dequantize_blocks_ref",
    "fake_quantize_blocks_ref",
    "fake_quantize_bwd_blocks_ref",
]


# ---------------------------------------------------------------------------------------------------------
# scalar helpers (elementwise)
# ---------------------------------------------------------------------------------------------------------
def div_rn(a: torch.Tensor, b: torch.Tensor | float) -> torch.Tensor:
    """Correctly rounded fp32 ``a / b`` (via fp64, innocuous double rounding; see module docstring)."""
    b64 = b.double() if isinstance(b, torch.Tensor) else float(b)
    return (a.double() / b64).float()


def pow2_f32(n: torch.Tensor) -> torch.Tensor:
    """Exact fp32 ``2^n`` for int32 ``n`` in [-127, 127], built from bits (2^-127 is the subnormal 0x00400000)."""
    n = n.to(torch.int32)
    bits = torch.where(n >= -126, (n + 127) << 23, torch.full_like(n, 1 << 22))
    return bits.view(torch.float32)


def e4m3_encode(t: torch.Tensor) -> torch.Tensor:
    """E4M3FN byte (uint8) of fp32 ``t`` in [2^-9, 448], rounded to nearest, ties to even.

    Normal range (t >= 2^-6): drop 20 of the 23 fp32 mantissa bits with RNE on the integer bits.
    Subnormal range (step 2^-9): m = rne(t * 2^9) computed with exact float steps; byte = m (m = 8 is 2^-6,
    whose normal encoding 1 << 3 is also 8)."""
    t = t.float()
    bits = t.view(torch.int32)
    lsb = (bits >> 20) & 1
    rb = (bits + 0x7FFFF + lsb) & ~0xFFFFF  # RNE to 3 mantissa bits
    exp_field = ((rb >> 23) & 0xFF) - 127 + 7
    normal_byte = (exp_field << 3) | ((rb >> 20) & 7)
    q = t * 512.0  # exact: power-of-two scaling of a value >= 2^-9
    q_floor = q.to(torch.int32)  # q >= 0, truncation == floor
    frac = q - q_floor.float()  # exact
    round_up = (frac > 0.5) | ((frac == 0.5) & ((q_floor & 1) == 1))
    sub_byte = q_floor + round_up.to(torch.int32)
    byte = torch.where(t >= E4M3_MIN_NORMAL, normal_byte, sub_byte)
    return byte.to(torch.uint8)


def e4m3_decode(byte_u8: torch.Tensor) -> torch.Tensor:
    """fp32 value of E4M3FN bytes (sign bit 0x80; 0x7F/0xFF are NaN; no infinities)."""
    b = byte_u8.to(torch.int32)
    mag = b & 0x7F
    e = mag >> 3
    m = mag & 7
    normal = ((e + 120) << 23 | (m << 20)).view(torch.float32)
    sub = m.float() * E4M3_MIN_SCALE
    val = torch.where(e == 0, sub, normal)
    val = torch.where(mag == 0x7F, torch.full_like(val, float("nan")), val)
    return torch.where((b & 0x80) != 0, -val, val)


def e8m0_decode(byte_u8: torch.Tensor) -> torch.Tensor:
    """fp32 value ``2^(byte - 127)`` of E8M0 bytes; 0xFF is NaN."""
    b = byte_u8.to(torch.int32)
    val = pow2_f32((b - E8M0_BIAS).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP))
    return torch.where(b == E8M0_NAN, torch.full_like(val, float("nan")), val)


def input_signbit(x: torch.Tensor) -> torch.Tensor:
    """The sign bit of every element of x (bf16/fp16/fp32), read from x's own bits. ``torch.signbit`` of an
    upcast x is not enough: a NaN's sign can be lost in the cast (CUDA's fp16 -> fp32 conversion returns a
    positive canonical NaN), and NUMERICS.md section 7 codes a NaN with its own sign bit."""
    if x.element_size() == 4:
        return x.view(torch.int32) < 0
    if x.element_size() == 2:
        return x.view(torch.int16) < 0
    return torch.signbit(x)


def _finite_abs(x_f32: torch.Tensor) -> torch.Tensor:
    a = x_f32.abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a))


def global_scale_ref(x: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 global scale (fp32, 0-d): ``max(amax / 2688, 2^-118)`` over the finite values of x;
    1.0 when there is no finite non-zero value."""
    if x.numel() == 0:
        return torch.full((), NVFP4_GLOBAL_SCALE_FALLBACK, dtype=torch.float32, device=x.device)
    amax = _finite_abs(x.float()).amax()
    g = div_rn(amax, NVFP4_GLOBAL_DENOM).clamp(min=NVFP4_GLOBAL_SCALE_MIN)
    return torch.where(amax > 0, g, torch.full_like(g, NVFP4_GLOBAL_SCALE_FALLBACK))


def global_scales_ref(w: torch.Tensor) -> torch.Tensor:
    """Dynamic NVFP4 global scale of each matrix of a stack w [M, R, C] (fp32 [M]): `global_scale_ref` of w[i]
    for every i, bit for bit (the max of finite |values| is exact in any order)."""
    if w.shape[1] * w.shape[2] == 0:
        return torch.full((w.shape[0],), NVFP4_GLOBAL_SCALE_FALLBACK, dtype=torch.float32, device=w.device)
    amax = _finite_abs(w.float()).amax(dim=(1, 2))
    g = div_rn(amax, NVFP4_GLOBAL_DENOM).clamp(min=NVFP4_GLOBAL_SCALE_MIN)
    return torch.where(amax > 0, g, torch.full_like(g, NVFP4_GLOBAL_SCALE_FALLBACK))


def e2m1_rne_magnitude(v: torch.Tensor) -> torch.Tensor:
    """Magnitude code 0..7 (int32) of fp32 ``v``: nearest ladder value, ties to the even code, saturating at
    6 (Inf -> 7); NaN -> 7."""
    a = v.abs()
    mag = torch.zeros(a.shape, dtype=torch.int32, device=a.device)
    for i, mid in enumerate(E2M1_MIDPOINTS):
        # tie between codes i and i+1 goes to the even one: down (strict >) if i is even, up (>=) if odd
        mag += (a > mid if i % 2 == 0 else a >= mid).to(torch.int32)
    return torch.where(torch.isnan(a), torch.full_like(mag, 7), mag)


def e2m1_hint_magnitude(v: torch.Tensor, hint_bits: torch.Tensor) -> torch.Tensor:
    """Hint-guided magnitude code (int32): a = min(|v|, 6); k = #{ladder m <= a}; k if (k&1)==hint else k+1.
    NaN v counts as k = 0 (the output is NaN anyway)."""
    a = torch.clamp(v.abs(), max=E2M1_MAX)
    k = torch.zeros(a.shape, dtype=torch.int32, device=a.device)
    for m in E2M1_HINT_LADDER:
        k += (a >= m).to(torch.int32)
    return torch.where((k & 1) == hint_bits.to(torch.int32), k, k + 1)


def e2m1_value(mag: torch.Tensor) -> torch.Tensor:
    """fp32 magnitude E2M1[mag] for magnitude codes 0..7.

    Built from bits rather than looked up in ``torch.tensor(E2M1_MAGNITUDES, device=...)``, which on CUDA is
    a blocking host -> device copy (a host sync) per call: E2M1[i] for i >= 2 is the float with bits
    (i + 252) << 22 (1, 1.5, 2, 3, 4, 6), E2M1[1] = 0.5 (0x3F000000), E2M1[0] = 0
    (tests/test_capture_sync.py checks it against ``kernels.E2M1_MAGNITUDES``)."""
    m = mag.to(torch.int32)
    bits = torch.where(m >= 2, (m + 252) << 22, torch.where(m == 1, 0x3F000000, 0).to(torch.int32))
    return bits.view(torch.float32)


# ---------------------------------------------------------------------------------------------------------
# block scales
# ---------------------------------------------------------------------------------------------------------
def _nvfp4_block_t(xb_f32: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """clamp((amax_b / 6) / g, 2^-9, 448) [NB] of fp32 blocks [NB, 16]: the value a block's scale byte encodes."""
    amax = _finite_abs(xb_f32).amax(dim=-1)  # [NB]
    return torch.clamp(div_rn(div_rn(amax, E2M1_MAX), g), min=E4M3_MIN_SCALE, max=E4M3_MAX)


def nvfp4_scales_ref(xb_f32: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E4M3 block-scale bytes [NB] of fp32 blocks [NB, 16]: e4m3_rne(clamp((amax_b / 6) / g, 2^-9, 448))."""
    return e4m3_encode(_nvfp4_block_t(xb_f32, g))


def e4m3_floor_byte(t: torch.Tensor) -> torch.Tensor:
    """The E4M3 byte (int32) of the largest E4M3 value <= t, for fp32 t in [2^-9, 448]: ``floor(w(t))`` of the
    byte position w (the byte where t is an E4M3 value, linear between neighbours). Exact integer arithmetic on
    t's bits: ``((exponent - 120) << 3) | top 3 mantissa bits`` from 2^-6 up, ``floor(512 t)`` below."""
    bits = t.view(torch.int32)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    sub = (t * 512.0).to(torch.int32)  # exact: t * 2^9 in [1, 8), truncated
    return torch.where(t >= E4M3_MIN_NORMAL, normal, sub)


def nvfp4_lsb_scales_ref(xb_f32: torch.Tensor, g: torch.Tensor, lsb: torch.Tensor) -> torch.Tensor:
    """Scale hints: E4M3 block-scale bytes [NB] (uint8) of fp32 blocks [NB, 16] from each block's own
    ``t = clamp((amax_b / 6) / g, 2^-9, 448)`` and a stored bit ``lsb`` [NB] (0/1 integers, the LSB of the
    rollout's byte): of the two bytes ``b = min(floor(w(t)), 125)`` and ``b + 1`` around t, the one whose LSB is
    ``lsb`` (NUMERICS §11). Bytes are in [1, 126]."""
    b = torch.clamp(e4m3_floor_byte(_nvfp4_block_t(xb_f32, g)), max=125)
    return torch.where((b & 1) == (lsb.to(torch.int32) & 1), b, b + 1).to(torch.uint8)


def mxfp4_exponents_ref(xb_f32: torch.Tensor, scale_rule: str = "floor") -> torch.Tensor:
    """Block exponents e (int32) [NB] of fp32 blocks [NB, 32]; the E8M0 byte is e + 127."""
    amax = _finite_abs(xb_f32).amax(dim=-1)  # [NB]
    if scale_rule == "floor":
        # floor(log2 amax) = exponent field - 127 for normal amax; subnormal/0 amax clamps to -127 below
        e = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - MXFP4_EMAX_ELEM
    else:  # "rceil": smallest e with amax / 2^e <= 6
        t = div_rn(amax, E2M1_MAX)
        bits = t.view(torch.int32)
        exp_field = (bits >> 23) & 0xFF
        mant = bits & 0x7FFFFF
        e_norm = exp_field - 127 + (mant != 0).to(torch.int32)
        e_sub = -127 + (mant > 0x400000).to(torch.int32)  # t < 2^-126: ceil(log2 t) > -127 iff t > 2^-127
        e = torch.where(exp_field == 0, e_sub, e_norm)
    return e.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def _scale_and_factor(fmt: str, scales_u8: torch.Tensor, g: torch.Tensor | None):
    """(s, r, g) fp32 per block from the scale bytes: s the decoded scale, r the factor with v = x * r."""
    if fmt == "nvfp4":
        s = e4m3_decode(scales_u8)
        inv_g = div_rn(torch.ones_like(g), g)
        r = div_rn(inv_g, s)
        return s, r, g
    e = scales_u8.to(torch.int32) - E8M0_BIAS
    s = e8m0_decode(scales_u8)
    r = pow2_f32((-e).clamp(E8M0_MIN_EXP, E8M0_MAX_EXP))  # 2^-e exactly
    r = torch.where(scales_u8.to(torch.int32) == E8M0_NAN, torch.full_like(r, float("nan")), r)
    return s, r, torch.ones((), dtype=torch.float32, device=scales_u8.device)


# ---------------------------------------------------------------------------------------------------------
# operations on block views
# ---------------------------------------------------------------------------------------------------------
def scales_ref(xb_f32: torch.Tensor, fmt: str, g: torch.Tensor | None, scale_rule: str = "floor") -> torch.Tensor:
    """Scale bytes [NB] (uint8) of fp32 blocks [NB, B]."""
    if fmt == "nvfp4":
        return nvfp4_scales_ref(xb_f32, g)
    return (mxfp4_exponents_ref(xb_f32, scale_rule) + E8M0_BIAS).to(torch.uint8)


def quantize_blocks_ref(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scale_rule: str = "floor", emit_hints: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Quantize blocks ``xb`` [NB, B] (any float dtype) -> (codes_packed [NB, B/2], scales_u8 [NB],
    hints_packed [NB, B/8] or None)."""
    x_f32 = xb.float()
    scales_u8 = scales_ref(x_f32, fmt, g, scale_rule)
    _, r, _ = _scale_and_factor(fmt, scales_u8, g)
    v = x_f32 * r[:, None]  # [NB, B]
    mag = e2m1_rne_magnitude(v)
    sign = input_signbit(xb)  # the sign bit of x, NaN included
    codes = (mag | (sign.to(torch.int32) << 3)).to(torch.uint8)  # [NB, B]
    hints = pack_hints(codes & 1) if emit_hints else None
    return pack_codes(codes), scales_u8, hints


def _assemble(mag: torch.Tensor, negative: torch.Tensor, s: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """(E2M1[mag] * s) * g in fp32 with the sign applied last by flipping the sign bit (so -0 stays -0; a
    unary minus compiled by torch.compile into Triton is 0 - x, which turns -0.0 into +0.0)."""
    out = (e2m1_value(mag) * s[:, None]) * g
    return (out.view(torch.int32) ^ (negative.to(torch.int32) << 31)).view(torch.float32)


def dequantize_blocks_ref(
    codes_u8: torch.Tensor, scales_u8: torch.Tensor, fmt: str, g: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Dequantize unpacked codes [NB, B] with scale bytes [NB] -> [NB, B] in ``dtype``."""
    s, _, g = _scale_and_factor(fmt, scales_u8, g)
    c = codes_u8.to(torch.int32)
    return _assemble(c & 7, (c & 8) != 0, s, g).to(dtype)


def fake_quantize_blocks_ref(
    xb: torch.Tensor,
    fmt: str,
    g: torch.Tensor | None,
    scales_u8: torch.Tensor | None = None,
    hint_bits: torch.Tensor | None = None,
    scale_rule: str = "floor",
) -> torch.Tensor:
    """Fake-quantize blocks [NB, B]: round to nearest with own (``scales_u8=None``) or given scales, or
    hint-guided with given scales and unpacked ``hint_bits`` [NB, B]. Output in xb.dtype."""
    x_f32 = xb.float()
    if scales_u8 is None:
        scales_u8 = scales_ref(x_f32, fmt, g, scale_rule)
    s, r, g = _scale_and_factor(fmt, scales_u8, g)
    v = x_f32 * r[:, None]
    mag = e2m1_rne_magnitude(v) if hint_bits is None else e2m1_hint_magnitude(v, hint_bits)
    out = _assemble(mag, torch.signbit(x_f32), s, g)
    out = torch.where(torch.isnan(x_f32), x_f32, out)  # NaN propagates
    return out.to(xb.dtype)


_CODE_BUCKETS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _code_buckets(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(14 fp32 boundaries: the E2M1 midpoints' negatives, each one fp32 step further from 0, then the midpoints;
    the code (uint8) of each of the 15 buckets: 8|7 .. 8|1, 0, 1 .. 7), on ``device``, built once per device."""
    hit = _CODE_BUCKETS.get(device)
    if hit is None:
        mids = torch.tensor(E2M1_MIDPOINTS, dtype=torch.float32)
        neg = torch.nextafter(-mids, torch.full_like(mids, -float("inf"))).flip(0)
        table = torch.tensor([8 | m for m in range(7, 0, -1)] + list(range(8)), dtype=torch.uint8)
        hit = _CODE_BUCKETS[device] = (torch.cat([neg, mids]).to(device), table.to(device))
    return hit


def nvfp4_codes_ref(y: torch.Tensor, scales_u8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (uint8 [N, W]) that a fake-quantized NVFP4 ``y`` [N, W] carries, given its scale bytes uint8
    [N, W/16] and fp32 global scale ``g`` (0-d): the code whose ladder value is nearest |y| / (s * g), ties to
    the lower magnitude, with y's sign (code 0 for ±0: both dequantize to 0).

    y = sign * E[code] * s * g (rounded to y's dtype), so |y| / (s*g) lands within 2^-8 relative of a ladder
    value and adjacent ladder values are >= 4/3 apart: the nearest ladder value is the code. One bucketize over
    the signed ratio against the midpoints and their negatives (a tie to the lower magnitude on both sides: the
    negative midpoints are moved one fp32 step outwards), then a table from bucket to code. The same codes as the
    distances' argmin for every magnitude below 2^24, and 0 for NaN and Inf ratios, a zero or NaN scale and a
    negative scale byte; above 2^24 the saturated code 7 (a fake-quantized value is at most 6 s g: only foreign
    inputs get there)."""
    n, w = y.shape
    s = e4m3_decode(scales_u8) * g.float()  # [N, W/16]
    s = torch.where(s > 0, s, float("nan"))  # a zero, negative or NaN scale byte: code 0 (NaN below)
    ratio = (y.float().reshape(n, w // 16, 16) / s.unsqueeze(-1)).reshape(n, w)  # x/NaN: NaN; -0 stays -0
    bounds, table = _code_buckets(y.device)
    codes = table[torch.bucketize(ratio, bounds)]
    return torch.where(torch.isfinite(ratio), codes, 0)


def fake_quantize_bwd_blocks_ref(
    grad_b: torch.Tensor, xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scales_u8: torch.Tensor
) -> torch.Tensor:
    """Clipped straight-through gradient: grad where not |x * r| > 6, else 0 (NaN v keeps its gradient)."""
    _, r, _ = _scale_and_factor(fmt, scales_u8, g)
    v = xb.float() * r[:, None]
    return torch.where(v.abs() > E2M1_MAX, torch.zeros_like(grad_b), grad_b)
