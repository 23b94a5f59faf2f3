"""Margin exceptions in the FP4 numerics (NVFP4): which values and blocks of an activation sit near a rounding
boundary (`margin_marks`, the rollout side), and the trainer's fill-in of block scales and hint bits from the
stored ones (`margin_fill`). NUMERICS.md section 12; the encoding itself (what a store keeps, the position coding)
is `tracerl.hints.compact`, whose float64 definitions these functions decide exactly, in fp32 / int32.

Definitions (per row of x [T, W], NVFP4 blocks of 16; float64 where written so)::

    v      = x * r,  r = div_rn(div_rn(1, g), s)     s = e4m3_decode(scale byte)     # fp32, NUMERICS §3
    u(a)   = 2a (a <= 2),  a + 2 (a <= 4),  a / 2 + 4 (else)       a = |v|           # float64
    d(u)   = |u| - 6.5  if |u| > 7,  else  0.5 - ||u| - round(|u|)|                   # float64, round half-even
    t      = clamp(div_rn(div_rn(amax_b, 6), g), 2^-9, 448)                           # fp32, finite amax_b
    w(t)   = 512 t (t < 2^-6),  8 (e + 7 + f) for t = 2^e (1 + f)                     # float64, exact
    d_s(w) = 0.5 - |w - round(w)|                                                     # float64

- value i is marked when ``d(u(|v_i|)) < margin`` (``margin`` inf: always) or its given hint bit is not the LSB of
  its round-to-nearest code (with the *given* scale of its block);
- block k is marked when ``d_s(w(t_k)) < scale_margin`` (inf: always) or its given scale byte is not
  ``e4m3_rne(t_k)``.

**The exact fp32 / int32 formulation** (the proof of equality with the float64 definitions; the tests check it
on every ladder value, boundary, their fp32 neighbours moved by each margin, every E4M3 value and midpoint, ...).

*Scales.* For t in [2^-9, 448] with fp32 fields E (biased exponent) and M (mantissa), let
``sh = min(E - 118, 3)``. Then ``F23 = (M << sh) & 0x7FFFFF`` is ``2^23 frac(w(t))`` exactly: below 2^-6 (E in
118..120) ``w = 512 t = (2^23 + M) 2^(sh - 23)``, whose fraction is the low 23 bits of ``M << sh``; from 2^-6 up
``w = 8 (E - 120) + M / 2^20`` (integer part plus ``(M & 0xFFFFF) / 2^20 = ((M << 3) & 0x7FFFFF) / 2^23``). Every
float64 step of d_s is exact (w is a multiple of 2^-23 below 2^7; ``w - round(w)`` and ``0.5 - |...|`` then are
too), so ``d_s = |F23 - 2^22| / 2^23`` exactly, and for the integer ``n = |F23 - 2^22|`` and any real ``X >= 0``,
``n < X  <=>  n < ceil(X)``. Hence **block marked  <=>  |F23 - 2^22| < K** with the integer
``K = min(ceil(scale_margin * 2^23), 2^23)`` (``scale_margin * 2^23`` is exact in float64; inf and anything
above 1/2 give 2^23, which marks every block, as d_s <= 1/2 does). The same fields give the block's own byte:
``floor(w) = fb = ((E - 120) << 3) | (M >> 20)`` from 2^-6 up, ``(2^23 + M) >> (23 - sh)`` below, and
``e4m3_rne(t) = fb + (F23 > 2^22 or (F23 == 2^22 and fb odd))`` (round to nearest even on the E4M3 grid, whose
byte order is its value order); scale hints take ``min(fb, 125)`` or the next byte (NUMERICS §11).

*Values.* ``d(u(a))`` is a function of the fp32 number a = |v| that the float64 arithmetic makes *monotone on each
of the 14 pieces* between a ladder value ``E_k`` and a boundary ``c_k`` (``0.25, 0.75, ..., 5``): on
``[E_k, c_k]`` ``round(u) = k`` (at ``u = k + 1/2`` both candidates give ``|u - round(u)| = 1/2``), so
``d = fl(0.5 - (u - k))`` with ``u - k`` exact, non-increasing in a; on ``[c_k, E_(k+1)]`` ``d = fl(0.5 - (k + 1 -
u))``, non-decreasing; on ``[5, inf]`` ``d = fl(fl(a / 2 + 4) - 6.5)``, non-decreasing (u is a monotone function of
a in float64, and rounding is monotone). So ``{a : d(u(a)) < margin}`` is a union of at most 7 intervals of fp32
numbers, one around each boundary: ``[L_k, R_k]``, ``L_k`` the smallest fp32 in ``[E_k, c_k]`` with
``d < margin`` and ``R_k`` the largest in ``[c_k, E_(k+1)]`` (``E_7 = inf``); none when margin is 0 (d >= 0).
Non-negative fp32 numbers order as their bit patterns, so the intervals are int32 ranges of the bits of |v|
(``bits(v) & 0x7FFFFFFF``; a NaN's is above every finite bound and inf's, and is in no interval, as ``NaN < m``
is false). `value_intervals` finds ``L_k`` / ``R_k`` by bisection over bit patterns, evaluating the float64
definition itself (`ladder_distance_f64`) at each probe — exact because the predicate is monotone on the piece —
once per margin (cached; ~1 ms). Hence **value marked  <=>  bits(|v|) in one of the 7 int32 ranges**, margin inf
being the one range ``[0, 2^31 - 1]`` (NaN included, as "mark everything" is). The round-to-nearest LSB is integer
too: the magnitude code is ``#{bits(|v|) > bits(0.25), >= bits(0.75), > bits(1.25), >= bits(1.75), > bits(2.5),
>= bits(3.5), > bits(5)}`` (NUMERICS §3's comparisons on bits; NaN's bits pass all seven: code 7, as the reference
codes a NaN).

Layouts (packed bitmaps as `pack_hints`: position i at bit ``i % 8`` of byte ``i // 8``, LSB first, unused high
bits of a row's last byte 0)::

    x              bf16 / fp16 / fp32 [T, W]          W a positive multiple of 16, nb = W / 16
    global_scale   fp32, one element (or a positive finite float)
    scales         uint8 [T, nb]                      E4M3 bytes
    hints          uint8 [T, W / 8]                   hint bits
    value_marks    uint8 [T, W / 8]                   bit i: value i marked
    block_marks    uint8 [T, ceil(nb / 8)]            bit k: block k marked
"""

from __future__ import annotations

import functools
import math

import torch

from . import reference as ref
from .constants import E2M1_MAX, E4M3_MAX, E4M3_MIN_SCALE, HINTS_PER_BYTE, NVFP4_BLOCK_SIZE
from .errors import BackendError, DTypeError, FormatError, ShapeError
from .packing import pack_hints, unpack_hints

__all__ = [
    "MARGIN_SCALE_PAYLOADS",
    "margin_marks",
    "margin_fill",
    "margin_marks_ref",
    "margin_fill_ref",
    "value_intervals",
    "scale_margin_threshold",
    "ladder_distance_f64",
    "scale_fields",
    "rtn_lsb_of_bits",
]

BLOCK = NVFP4_BLOCK_SIZE
#: what the trainer is given of a marked block: its E4M3 byte, or only the byte's LSB (a scale hint)
MARGIN_SCALE_PAYLOADS: tuple[str, ...] = ("byte", "lsb")
#: the backends of these functions; "torch" is another name of "reference" (the pure-torch definition)
MARGIN_BACKENDS: tuple[str, ...] = ("auto", "reference", "torch", "triton")
#: int32 ranges (lo, hi) per call: at most one per rounding boundary
N_INTERVALS: int = 7
#: an empty range (no int32 b has lo <= b <= hi)
EMPTY: tuple[int, int] = (0x7FFFFFFF, 0)
ALL: tuple[int, int] = (0, 0x7FFFFFFF)
#: 2^23 frac(w) of a block exactly on an E4M3 rounding boundary
HALF23: int = 1 << 22
#: fp32 bits of the E2M1 ladder values and round-to-nearest boundaries (midpoints)
_LADDER_BITS = (0x00000000, 0x3F000000, 0x3F800000, 0x3FC00000, 0x40000000, 0x40400000, 0x40800000, 0x40C00000)
_MID_BITS = (0x3E800000, 0x3F400000, 0x3FA00000, 0x3FE00000, 0x40200000, 0x40600000, 0x40A00000)
_INF_BITS = 0x7F800000
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# the float64 definition and the thresholds that decide it exactly
# ---------------------------------------------------------------------------------------------------------
def ladder_distance_f64(a_f32: torch.Tensor) -> torch.Tensor:
    """``d(u(|v|))`` in float64 for fp32 ``a_f32`` (the definition, as `tracerl.hints.compact` computes it with
    ``boundary_distance(ladder_position(v))``): used on the host to find `value_intervals`. NaN for NaN."""
    a = a_f32.double().abs()
    u = torch.where(a <= 2, 2 * a, torch.where(a <= 4, a + 2, a / 2 + 4))
    inner = 0.5 - (u - torch.round(u)).abs()
    return torch.where(u > 7, u - 6.5, inner)


def _as_f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _first_true(lo: torch.Tensor, hi: torch.Tensor, pred) -> torch.Tensor:
    """Per element, the smallest b in [lo, hi] with pred(b), for pred monotone (False..True) and pred(hi) True."""
    while bool((lo < hi).any()):
        mid = (lo + hi) // 2
        p = pred(mid)
        active = lo < hi
        hi = torch.where(active & p, mid, hi)
        lo = torch.where(active & ~p, mid + 1, lo)
    return lo


def _last_true(lo: torch.Tensor, hi: torch.Tensor, pred) -> torch.Tensor:
    """Per element, the largest b in [lo, hi] with pred(b), for pred monotone (True..False) and pred(lo) True."""
    while bool((lo < hi).any()):
        mid = (lo + hi + 1) // 2
        p = pred(mid)
        active = lo < hi
        lo = torch.where(active & p, mid, lo)
        hi = torch.where(active & ~p, mid - 1, hi)
    return lo


@functools.lru_cache(maxsize=256)
def value_intervals(margin: float) -> tuple[tuple[int, int], ...]:
    """The `N_INTERVALS` int32 ranges ``(lo, hi)`` of ``bits(|v|)`` (fp32 bits, sign cleared) whose values are
    marked at ``margin`` (>= 0 or inf): ``d(u(|v|)) < margin`` exactly as the float64 definition decides it (module
    docstring: one range around each boundary, found by bisection on the monotone pieces), merged where they touch,
    sorted, padded with `EMPTY`. Margin inf: `ALL` (NaN included)."""
    if math.isinf(margin):
        return (ALL,) + (EMPTY,) * (N_INTERVALS - 1)
    if margin <= 0:
        return (EMPTY,) * N_INTERVALS  # d >= 0 everywhere: nothing is below a margin of 0

    def marked(b: torch.Tensor) -> torch.Tensor:
        return ladder_distance_f64(_as_f32(b)) < margin

    mids = torch.tensor(_MID_BITS, dtype=torch.int64)
    below = torch.tensor(_LADDER_BITS[:7], dtype=torch.int64)
    above = torch.tensor(_LADDER_BITS[1:7] + (_INF_BITS,), dtype=torch.int64)
    assert bool(marked(mids).all())  # d(c_k) = 0 < margin
    lo = _first_true(below, mids.clone(), marked)
    hi = _last_true(mids.clone(), above, marked)
    merged: list[list[int]] = []
    for a, b in zip(lo.tolist(), hi.tolist()):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return tuple(tuple(r) for r in merged) + (EMPTY,) * (N_INTERVALS - len(merged))


def scale_margin_threshold(scale_margin: float) -> int:
    """K with ``block marked <=> |F23 - 2^22| < K`` (module docstring): ``min(ceil(scale_margin * 2^23), 2^23)``."""
    x = math.ldexp(scale_margin, 23)  # exact (a power-of-two scaling) unless it overflows to inf
    return 1 << 23 if math.isinf(x) else min(math.ceil(x), 1 << 23)


# ---------------------------------------------------------------------------------------------------------
# pure-torch reference (CPU and GPU; fp32 / int32 per value)
# ---------------------------------------------------------------------------------------------------------
def _block_t(x_f32: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """t = clamp(div_rn(div_rn(amax_b, 6), g), 2^-9, 448), fp32 [T, nb] of x_f32 [T, W] (finite values only)."""
    t_, w = x_f32.shape
    a = x_f32.abs().reshape(t_, w // BLOCK, BLOCK)
    amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=-1)
    return torch.clamp(ref.div_rn(ref.div_rn(amax, E2M1_MAX), g), min=E4M3_MIN_SCALE, max=E4M3_MAX)


def scale_fields(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fb, F23), int32, of fp32 t in [2^-9, 448]: ``fb = floor(w(t))`` (the E4M3 byte of the largest E4M3 value
    <= t) and ``F23 = 2^23 frac(w(t))``, from t's bits (module docstring)."""
    bits = t.view(torch.int32)
    e = bits >> 23
    m = bits & 0x7FFFFF
    sh = torch.clamp(e - 118, max=3)
    f23 = (m << sh) & 0x7FFFFF
    fb = torch.where(e >= 121, ((e - 120) << 3) | (m >> 20), (m | 0x800000) >> (23 - sh).clamp(min=0))
    return fb, f23


def _own_byte(fb: torch.Tensor, f23: torch.Tensor) -> torch.Tensor:
    """e4m3_rne(t) (int32) from its fields: the floor byte, plus one above the midpoint or at it from an odd byte."""
    up = (f23 > HALF23) | ((f23 == HALF23) & ((fb & 1) == 1))
    return fb + up.to(torch.int32)


def rtn_lsb_of_bits(ab: torch.Tensor) -> torch.Tensor:
    """LSB (int32 0/1) of the round-to-nearest magnitude code of values with fp32 bits ``ab`` (sign cleared; NaN's
    bits give code 7): the parity of how many of NUMERICS §3's seven boundary comparisons pass."""
    n = torch.zeros(ab.shape, dtype=torch.int32, device=ab.device)
    for i, mb in enumerate(_MID_BITS):
        n += (ab > mb if i % 2 == 0 else ab >= mb).to(torch.int32)  # ties to the even code
    return n & 1


def _abs_bits(v: torch.Tensor) -> torch.Tensor:
    return v.view(torch.int32) & 0x7FFFFFFF


def _in_intervals(ab: torch.Tensor, intervals: tuple[tuple[int, int], ...]) -> torch.Tensor:
    out = torch.zeros(ab.shape, dtype=torch.bool, device=ab.device)
    for lo, hi in intervals:
        if (lo, hi) != EMPTY:
            out |= (ab >= lo) & (ab <= hi)
    return out


def _factor(scales_u8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """r = div_rn(div_rn(1, g), s) per block, fp32 [T, nb] (any byte: 0 gives inf, NaN bytes NaN)."""
    return ref.div_rn(ref.div_rn(torch.ones_like(g), g), ref.e4m3_decode(scales_u8))


def _pack_blocks(bits: torch.Tensor) -> torch.Tensor:
    """0/1 [T, nb] -> packed [T, ceil(nb / 8)], zero padding bits."""
    pad = (-bits.shape[1]) % HINTS_PER_BYTE
    if pad:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], pad)], dim=1)
    return pack_hints(bits.to(torch.uint8))


def _unpack_blocks(packed: torch.Tensor, nb: int) -> torch.Tensor:
    return unpack_hints(packed)[:, :nb].to(torch.int32)


def margin_marks_ref(x: torch.Tensor, g: torch.Tensor, scales_u8: torch.Tensor, hints_u8: torch.Tensor,
                     intervals: tuple[tuple[int, int], ...], k_scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `margin_marks` on checked arguments: x [T, W], g fp32 0-d, ``intervals`` = `value_intervals`
    (margin), ``k_scale`` = `scale_margin_threshold` (scale_margin). Returns (value_marks uint8 [T, W/8],
    block_marks uint8 [T, ceil(W/128)])."""
    x_f32 = x.float()
    t_, w = x_f32.shape
    fb, f23 = scale_fields(_block_t(x_f32, g))
    block = ((f23 - HALF23).abs() < k_scale) | (_own_byte(fb, f23) != scales_u8.to(torch.int32))
    v = x_f32 * _factor(scales_u8, g).repeat_interleave(BLOCK, dim=1)  # [T, W] with the given scales
    ab = _abs_bits(v)
    given = unpack_hints(hints_u8).to(torch.int32)
    value = _in_intervals(ab, intervals) | (rtn_lsb_of_bits(ab) != given)
    return pack_hints(value.to(torch.uint8)), _pack_blocks(block.to(torch.uint8))


def margin_fill_ref(x: torch.Tensor, g: torch.Tensor, value_marks: torch.Tensor, block_marks: torch.Tensor,
                    stored_hints: torch.Tensor, stored_scales: torch.Tensor,
                    scale_payload: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `margin_fill` on checked arguments. Returns (scales uint8 [T, W/16], hints uint8 [T, W/8])."""
    x_f32 = x.float()
    t_, w = x_f32.shape
    nb = w // BLOCK
    fb, f23 = scale_fields(_block_t(x_f32, g))
    if scale_payload == "lsb":
        low = fb.clamp(max=125)  # of the two bytes around t, the one whose LSB is the stored bit (NUMERICS §11)
        stored = torch.where((low & 1) == _unpack_blocks(stored_scales, nb), low, low + 1)
    else:
        stored = stored_scales.to(torch.int32)
    scales = torch.where(_unpack_blocks(block_marks, nb) == 1, stored, _own_byte(fb, f23)).to(torch.uint8)
    v = x_f32 * _factor(scales, g).repeat_interleave(BLOCK, dim=1)
    vm = unpack_hints(value_marks) == 1
    bits = torch.where(vm, unpack_hints(stored_hints).to(torch.int32), rtn_lsb_of_bits(_abs_bits(v)))
    return scales, pack_hints(bits.to(torch.uint8))


# ---------------------------------------------------------------------------------------------------------
# public entry points
# ---------------------------------------------------------------------------------------------------------
def _check_x(x: torch.Tensor) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise DTypeError(f"x must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise DTypeError(f"x must be one of {_FLOAT_DTYPES}; got {x.dtype}")
    if x.dim() != 2 or x.shape[1] == 0 or x.shape[1] % BLOCK:
        raise ShapeError(f"x must be [T, W] with W a positive multiple of {BLOCK}; got shape {tuple(x.shape)}")
    return int(x.shape[0]), int(x.shape[1])


def _check_u8(t: torch.Tensor, name: str, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise DTypeError(f"{name} must be a uint8 torch.Tensor; got {type(t).__name__}")
    if t.dtype != torch.uint8:
        if t.dtype.itemsize != 1 or t.dtype == torch.bool:
            raise DTypeError(f"{name} must be uint8 (or another 1-byte dtype holding raw bits); got {t.dtype}")
        t = t.view(torch.uint8)
    if tuple(t.shape) != shape:
        raise ShapeError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    return t.to(device).contiguous()


def _marks_shapes(t_: int, w: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of the marks of x [t_, w]: value marks [T, W/8], block marks [T, ceil(W/128)]."""
    return (t_, w // HINTS_PER_BYTE), (t_, -(-(w // BLOCK) // HINTS_PER_BYTE))


def _check_out(out, shapes: tuple[tuple[int, int], ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """``out`` checked as output tensors of ``shapes`` (uint8, contiguous, on ``device``)."""
    if not isinstance(out, (tuple, list)) or len(out) != len(shapes):
        raise ShapeError(f"out must be a pair of tensors (value marks, block marks); got {type(out).__name__}")
    for t, shape, name in zip(out, shapes, ("value marks", "block marks")):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise DTypeError(f"out {name} must be a uint8 torch.Tensor; got "
                             f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
            raise ShapeError(f"out {name} must be a contiguous uint8 tensor of shape {list(shape)} on {device}; got "
                             f"shape {list(t.shape)} on {t.device}" + ("" if t.is_contiguous() else ", not contiguous"))
    return tuple(out)


def _check_margin(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise FormatError(f"{name} must be a number >= 0 (inf: mark everything); got {value!r}")
    return float(value)


def _backend(backend: str, device: torch.device) -> str:
    from .api import resolve_backend

    if backend not in MARGIN_BACKENDS:
        raise BackendError(f"backend must be one of {MARGIN_BACKENDS}; got {backend!r}")
    return resolve_backend("reference" if backend == "torch" else backend, device)


def _g(global_scale, device: torch.device) -> torch.Tensor:
    from .api import _global_scale

    if global_scale is None:
        raise FormatError("margin marks and fills need the rollout's global_scale (fp32); got None")
    return _global_scale(global_scale, "nvfp4", device, None)


def margin_marks(x: torch.Tensor, global_scale: torch.Tensor | float, scales: torch.Tensor, hints: torch.Tensor,
                 margin: float, scale_margin: float, backend: str = "auto",
                 out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's margin exceptions at one NVFP4 site, as packed bitmaps (module docstring; exactly the masks
    of `tracerl.hints.compact.encode_margin_exceptions`).

    x: bf16 / fp16 / fp32 [T, W] (W a positive multiple of 16), the rollout's activation; global_scale: its fp32
    g (a one-element floating tensor, used as given, or a positive finite float); scales: uint8 [T, W/16], the
    E4M3 bytes the rollout used; hints: uint8 [T, W/8], its hint bits (`pack_hints` layout); margin (ladder steps)
    and scale_margin (E4M3 steps): numbers >= 0, inf marks everything.

    Returns (value_marks uint8 [T, W/8], block_marks uint8 [T, ceil(W/128)]), on x's device, bit order of
    `pack_hints` (padding bits 0). Value i is marked when its distance to the nearest rounding boundary of the
    E2M1 ladder (in local ladder steps, with its block's *given* scale) is below ``margin``, or its hint bit is
    not its round-to-nearest LSB; block k when the distance of its own ``t`` to the nearest E4M3 rounding
    boundary (in E4M3 steps) is below ``scale_margin``, or its given byte is not ``e4m3_rne(t)``. NaN values are
    marked only by the hint rule (or margin inf), +-Inf likewise; +-0 has distance 1/2.

    backend: "auto" (Triton on CUDA when importable), "reference" (or "torch": the pure-torch definition), or
    "triton" (CUDA, or CPU under TRITON_INTERPRET=1); all give the same bits. out: (value_marks, block_marks)
    tensors to write the marks into (uint8, exactly those shapes, contiguous, on x's device), e.g. views of a
    capture buffer, so a caller needs no copy of its own; they are returned.

    Raises DTypeError (x not bf16/fp16/fp32, scales/hints not 1-byte, out not uint8), ShapeError (x not [T, 16k],
    scales/hints or a global-scale tensor of another shape, out of another shape or device or not contiguous),
    FormatError (a margin negative, NaN or not a number, a bad float global scale), BackendError (an unknown
    backend, or Triton not available here)."""
    t_, w = _check_x(x)
    if out is not None:
        out = _check_out(out, _marks_shapes(t_, w), x.device)
    m = _check_margin(margin, "margin")
    ms = _check_margin(scale_margin, "scale_margin")
    scales = _check_u8(scales, "scales", (t_, w // BLOCK), x.device)
    hints = _check_u8(hints, "hints", (t_, w // HINTS_PER_BYTE), x.device)
    g = _g(global_scale, x.device)
    be = _backend(backend, x.device)
    intervals, k_scale = value_intervals(m), scale_margin_threshold(ms)
    x = x.contiguous()
    if be == "triton":
        from .triton_margin import margin_marks_triton

        return margin_marks_triton(x, g, scales, hints, intervals, k_scale, out=out)
    marks = margin_marks_ref(x, g, scales, hints, intervals, k_scale)
    if out is None:
        return marks
    for o, m_ in zip(out, marks):
        o.copy_(m_)
    return out


def _fused_marks(t_: int, w: int, device: torch.device, margin: float, scale_margin: float,
                 out) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[int, ...]]:
    """`quantize_fake`'s ``marks`` for x [t_, w]: (``out`` checked as `margin_marks`' out, the 15 thresholds
    L0, H0, .., L6, H6, KS of ``margin`` and ``scale_margin``). Raises as `margin_marks` does."""
    if out is None:
        raise ShapeError("marks need marks_out: the (value marks, block marks) tensors to write them into")
    out = _check_out(out, _marks_shapes(t_, w), device)
    m = _check_margin(margin, "margin")
    ms = _check_margin(scale_margin, "scale_margin")
    return out, tuple(v for lo_hi in value_intervals(m) for v in lo_hi) + (scale_margin_threshold(ms),)


def margin_fill(x: torch.Tensor, global_scale: torch.Tensor | float, value_marks: torch.Tensor,
                block_marks: torch.Tensor, stored_hints: torch.Tensor, stored_scales: torch.Tensor,
                scale_payload: str = "byte", backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's scales and hints at one NVFP4 site under margin exceptions (`tracerl.hints.compact.reconstruct`):
    a marked block takes the stored scale (the byte, or with ``scale_payload="lsb"`` the E4M3 neighbour of its
    own t whose LSB is the stored bit, NUMERICS §11), an unmarked block its own ``e4m3_rne(t)``; then, with those
    scales, a marked value takes the stored hint bit and an unmarked one the LSB of its own round-to-nearest code.

    Inputs, all on (or moved to) x's device, in a dense layout where only marked positions are read (the
    variable-length position coding of a store row, `tracerl.hints.compact.pack_rows`, is decoded on the host
    into these tensors):

        x              bf16 / fp16 / fp32 [T, W]   the trainer's activation (W a positive multiple of 16)
        global_scale   the rollout's fp32 g (one-element floating tensor, or a positive finite float)
        value_marks    uint8 [T, W/8]              packed, bit i: value i marked
        block_marks    uint8 [T, ceil(W/128)]      packed, bit k: block k marked
        stored_hints   uint8 [T, W/8]              packed hint bits; read at marked values
        stored_scales  "byte": uint8 [T, W/16]     E4M3 bytes; read at marked blocks
                       "lsb":  uint8 [T, ceil(W/128)]  packed LSBs of the rollout's bytes; read at marked blocks

    Returns (scales uint8 [T, W/16], hints uint8 [T, W/8]): what today's hint-guided
    ``fake_quantize(x, "nvfp4", global_scale=g, scales=, hints=)`` takes. backend as for `margin_marks`.

    Raises DTypeError / ShapeError for tensors of another dtype or shape (saying which and what is expected),
    FormatError for an unknown scale payload or a bad float global scale, BackendError for an unknown or unavailable
    backend."""
    t_, w = _check_x(x)
    if scale_payload not in MARGIN_SCALE_PAYLOADS:
        raise FormatError(f"scale_payload must be one of {MARGIN_SCALE_PAYLOADS}; got {scale_payload!r}")
    nb = w // BLOCK
    nbb = -(-nb // HINTS_PER_BYTE)
    dev = x.device
    value_marks = _check_u8(value_marks, "value_marks", (t_, w // HINTS_PER_BYTE), dev)
    block_marks = _check_u8(block_marks, "block_marks", (t_, nbb), dev)
    stored_hints = _check_u8(stored_hints, "stored_hints", (t_, w // HINTS_PER_BYTE), dev)
    stored_scales = _check_u8(stored_scales, "stored_scales", (t_, nbb if scale_payload == "lsb" else nb), dev)
    g = _g(global_scale, dev)
    be = _backend(backend, dev)
    x = x.contiguous()
    if be == "triton":
        from .triton_margin import margin_fill_triton

        return margin_fill_triton(x, g, value_marks, block_marks, stored_hints, stored_scales, scale_payload)
    return margin_fill_ref(x, g, value_marks, block_marks, stored_hints, stored_scales, scale_payload)
