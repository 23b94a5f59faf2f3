"""Margin exceptions: a compact hint encoding that stores hints and block scales only where the trainer could
round differently from the rollout (issue 23, stage 1: the reference, torch and numpy; no store format yet).

Today a store keeps, per token and NVFP4 site of width W, every value's hint bit (W/8 bytes) and every block's
E4M3 scale byte (W/16 bytes). Most of it the trainer works out itself: it rounds a value the way the rollout did
unless the two sit on opposite sides of a rounding boundary, and only the rollout can tell which values sit close
to one. Margin exceptions keep just those.

**Ladder position.** For a scaled value v (``v = x * r``, ``r = (1/g)/s`` as in NUMERICS.md §3), its position on
the E2M1 ladder in units of the local ladder step is the piecewise-linear map with ``u(E[k]) = k``::

    u(a) = 2a          for a in [0, 2]        (step 0.5)        a = |v|
    u(a) = a + 2       for a in [2, 4]        (step 1)
    u(a) = a / 2 + 4   for a >= 4             (step 2; saturated values keep going past u = 7)
    u    = sign(v) * u(|v|)                   (float64: exact for every fp32 v)

The round-to-nearest boundaries (the midpoints 0.25, 0.75, ..., 5) sit at ``|u| = k + 1/2``, k = 0..6, and
round-to-nearest-even of v is the nearest integer of |u| (ties to even, at most 7). The distance to a boundary is
``d(u) = min_k | |u| - (k + 1/2) |`` (float64). The block scale has the same picture one level up: ``t =
clamp((amax_b / 6) / g, 2^-9, 448)`` has E4M3 position ``w(t)`` (the byte of t where t is an E4M3 value, linear
between: ``w = 512 t`` below 2^-6, ``w = 8 (e + 7 + m)`` for ``t = 2^e (1 + m)``), its rounding boundaries are
at ``w = b + 1/2`` and its distance is ``d_s(w) = min_b |w - (b + 1/2)|``, b = 1..125.

**Encoding (rollout side, `encode_margin_exceptions`)**, margins ``m`` (values) and ``m_s`` (scales) >= 0:

- block k is *marked* when ``d_s(w_r) < m_s`` (or ``m_s`` is inf, or the given scale byte is not the one x
  implies); the store keeps the marked blocks' scale bytes (``scale_payload="byte"``) or only their LSB
  (``"lsb"``, a *scale hint*: the trainer takes the one of the two E4M3 neighbours around its own t whose LSB it
  is, exactly as hint-guided rounding does for values);
- value i is *marked* when ``d(u_r) < m`` (or ``m`` is inf, or the given hint bit is not the LSB of the value's
  round-to-nearest code), with ``u_r`` computed with the rollout's scale; the store keeps the marked values'
  hint bits.

**Decoding (trainer side, `reconstruct`)**: a marked block takes the stored scale byte (with scale hints: the
byte ``b`` or ``b + 1``, ``b = min(floor(w_t), 125)``, whose LSB is the stored bit), an unmarked block the scale
its own amax gives (NUMERICS §3). Then with those scales, a marked value takes the stored hint bit and an
unmarked value the LSB of its own round-to-nearest code; hint-guided rounding (NUMERICS §6) with these hint bits
gives exactly round-to-nearest at every unmarked value (RTN always returns one of the two ladder values around
|v|), so the trainer's forward is today's ``tracefp4.fake_quantize(x', scales=, hints=)`` on the reconstructed
scales and hints (`fake_quantize_compact`): a fill-in step, then today's kernel.

The float64 distances here are the definition; the masks and the fill-in run as ``tracefp4.margin_marks`` and
``tracefp4.margin_fill`` (a pure-torch reference and Triton kernels, fp32 / int32 arithmetic that decides every
mark exactly as the float64 distances do: NUMERICS §12), on a ``backend`` chosen as in tracefp4.

**Exactness.** With ``u_t`` the trainer's position computed with the reconstructed scale of its block, and
``Δ = |u_t - u_r|`` (float64, both signed): whenever ``Δ < min(m, 1/2)`` the reconstructed code equals the
rollout's code up to the sign of zero (+0 and -0 count equal, as in the audit). Why: an unmarked value has
``d(u_r) >= m`` and reaching or crossing a boundary c needs ``|u_t - u_r| >= |u_r - c| >= d(u_r)`` (and float64
rounding is monotone), so ``u_t`` rounds as ``u_r`` does; a marked value's code is one of the two ladder values
around ``u_t`` whenever ``Δ < 1/2``, and the hint bit picks it. Likewise every unmarked block whose trainer
position satisfies ``|w_t - w_r| < m_s`` gets the rollout's scale byte, and so does every marked block (with
scale hints: when ``|w_t - w_r| < 1/2``). Outside the margin a code may differ only where the trainer's value
moved by at least the margin (or its block's scale differs); `margin_stats` counts both.
``m = 0, m_s = 0`` stores nothing and is round-to-nearest with own scales; ``m = m_s = inf`` stores everything and
is today's hint-guided rounding, bit for bit.

**Position coding** (`pack_rows`, `unpack_rows`: numpy, vectorized over rows): each token's row at a site is a bit
string, MSB first, padded with zeros to a whole byte::

    [value positions] [one hint bit per marked value] [block positions] [8 bits (or 1: scale hints) per marked block]

with each position set coded as ``all`` (no bits: every position is marked; today's layout is margin inf with
``all`` / ``all`` and whole scale bytes), ``bitmap`` (n bits, bit i = position i marked), ``block-bitmap`` (n/16
bits, one per group of 16 positions holding a mark, then 16 mask bits per such group), ``gamma`` (Elias gamma of
count + 1, then of each gap ``p_i - p_(i-1)``, ``p_(-1) = -1``) or ``rice<k>`` (gamma of count + 1, then
Golomb-Rice with parameter 2^k of each ``p_i - p_(i-1) - 1``: q = x >> k ones, a zero, the k low bits).
`choose_coding` picks the cheapest per site; `row_bits` counts a coding's bits without writing them.

NVFP4 only (block 16, E4M3 scales). Shapes: ``x`` [T, W] (bf16/fp16/fp32, W a multiple of 16), scales uint8
[T, W/16], hints uint8 [T, W/8] (NUMERICS §2 layouts), global scale a positive finite float or a 1-element
floating tensor.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from typing import ClassVar

import numpy as np
import torch

import tracefp4
from tracefp4 import reference as ref
from tracefp4.constants import E2M1_MAX, E4M3_MAX, E4M3_MIN_NORMAL, E4M3_MIN_SCALE, HINTS_PER_BYTE, NVFP4_BLOCK_SIZE
from tracerl.errors import ConfigError, HintCodingError

__all__ = [
    "MarginExceptions",
    "DenseExceptions",
    "Reconstruction",
    "SiteCoding",
    "PackedRows",
    "POSITION_CODINGS",
    "SCALE_PAYLOADS",
    "ladder_position",
    "boundary_distance",
    "scale_position",
    "scale_boundary_distance",
    "block_scale_t",
    "scale_hint_bytes",
    "encode_margin_exceptions",
    "exceptions_from_marks",
    "densify",
    "fill",
    "reconstruct",
    "fake_quantize_compact",
    "margin_stats",
    "row_bits",
    "candidate_bits",
    "choose_coding",
    "pack_rows",
    "unpack_rows",
    "packed_row_bytes",
    "today_bytes_per_token",
    "store_site",
    "store_rows",
    "packed_from_store",
]

BLOCK = NVFP4_BLOCK_SIZE
#: what the store keeps of a marked block: its E4M3 byte, or only the byte's LSB (a scale hint)
SCALE_PAYLOADS = ("byte", "lsb")
#: the position codings of a set of marked positions (``rice<k>``: Golomb-Rice with parameter 2^k, k in 0..30)
POSITION_CODINGS = ("all", "bitmap", "block-bitmap", "gamma", "rice<k>")
#: positions per group of the ``block-bitmap`` coding
GROUP = 16
#: bytes a store spends per row beside the row itself: its end in ``margin_ends.<site>`` (uint32, FORMAT §2.5)
ROW_END_BYTES = 4
_RICE = re.compile(r"rice([0-9]|[12][0-9]|30)")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# ---------------------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------------------
def _check_margin(value: float, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ConfigError(f"{name} must be a number >= 0 (inf: mark everything); got {value!r}")
    return float(value)


def _check_x(x: torch.Tensor, name: str) -> tuple[int, int]:
    if not isinstance(x, torch.Tensor):
        raise tracefp4.DTypeError(f"{name} must be a torch.Tensor; got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise tracefp4.DTypeError(f"{name} must be one of {_FLOAT_DTYPES}; got {x.dtype}")
    if x.dim() != 2 or x.shape[1] % BLOCK != 0 or x.shape[1] == 0:
        raise tracefp4.ShapeError(f"{name} must be [T, W] with W a positive multiple of {BLOCK}; got "
                                  f"{tuple(x.shape)}")
    return int(x.shape[0]), int(x.shape[1])


def _check_u8(t: torch.Tensor, name: str, shape: tuple[int, int]) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise tracefp4.DTypeError(f"{name} must be a uint8 tensor; got {got}")
    if tuple(t.shape) != shape:
        raise tracefp4.ShapeError(f"{name} must have shape {list(shape)}; got {list(t.shape)}")
    return t


def _global_scale(g, device: torch.device) -> torch.Tensor:
    if isinstance(g, torch.Tensor):
        if not g.dtype.is_floating_point:
            raise tracefp4.DTypeError(f"global_scale must be a floating tensor; got {g.dtype}")
        if g.numel() != 1:
            raise tracefp4.ShapeError(f"global_scale must have one element; got shape {list(g.shape)}")
        return g.to(device=device, dtype=torch.float32).reshape(())
    if isinstance(g, bool) or not isinstance(g, (int, float)) or not (math.isfinite(g) and g > 0):
        raise ConfigError(f"global_scale must be a positive finite number or a 1-element tensor; got {g!r}")
    return torch.tensor(float(g), dtype=torch.float32, device=device)


# ---------------------------------------------------------------------------------------------------------
# positions relative to the rounding boundaries
# ---------------------------------------------------------------------------------------------------------
def ladder_position(v: torch.Tensor) -> torch.Tensor:
    """Signed E2M1 ladder position u (float64, same shape) of scaled values ``v`` (fp32): ``u(E[k]) = k``,
    linear between ladder values, step 2 past 4 (module docstring). Exact: every fp32 a gives 2a, a + 2 and
    a/2 + 4 exactly in float64. NaN stays NaN, +-Inf gives +-Inf."""
    a = v.double().abs()
    u = torch.where(a <= 2, 2 * a, torch.where(a <= 4, a + 2, a / 2 + 4))
    return torch.where(torch.signbit(v), -u, u)


def boundary_distance(u: torch.Tensor) -> torch.Tensor:
    """Distance (float64) of ladder positions ``u`` to the nearest round-to-nearest boundary ``|u| = k + 1/2``
    (k = 0..6): ``fl(| |u| - c |)`` for the nearest boundary c. NaN for NaN, +Inf for +-Inf."""
    a = u.abs()
    inner = 0.5 - (a - torch.round(a)).abs()  # |u| <= 7: the nearest boundary is round(|u|) +- 1/2
    return torch.where(a > 7, a - 6.5, inner)


def scale_position(t: torch.Tensor) -> torch.Tensor:
    """E4M3 position w (float64) of positive fp32 ``t`` in [2^-9, 448]: the byte of t where t is an E4M3 value,
    linear in t between two neighbouring E4M3 values (module docstring); exact in float64."""
    td = t.double()
    mant, exp = torch.frexp(td)  # td = mant * 2^exp, mant in [0.5, 1)
    normal = 8.0 * (exp.double() + 5.0 + 2.0 * mant)
    return torch.where(td >= E4M3_MIN_NORMAL, normal, td * 512.0)


def scale_boundary_distance(w: torch.Tensor) -> torch.Tensor:
    """Distance (float64) of E4M3 positions ``w`` in [1, 126] to the nearest rounding boundary ``b + 1/2``
    (b = 1..125)."""
    return 0.5 - (w - torch.round(w)).abs()


def block_scale_t(x_f32: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``clamp((amax_b / 6) / g, 2^-9, 448)`` per block: fp32 [T, W/16] of x_f32 [T, W] (NUMERICS §3; non-finite
    values count as 0 in amax). ``e4m3_encode`` of it is the block's own scale byte."""
    t_, w = x_f32.shape
    a = x_f32.abs().reshape(t_, w // BLOCK, BLOCK)
    amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=-1)
    return torch.clamp(ref.div_rn(ref.div_rn(amax, E2M1_MAX), g), min=E4M3_MIN_SCALE, max=E4M3_MAX)


def scale_hint_bytes(t_f32: torch.Tensor, lsb: torch.Tensor) -> torch.Tensor:
    """The E4M3 scale bytes (uint8, t's shape) that scale hints select: of the two E4M3 bytes ``b = min(floor(w),
    125)`` and ``b + 1`` around the trainer's own position ``w = scale_position(t)``, the one whose LSB is ``lsb``
    (0/1 integers, t's shape) — hint-guided rounding one level up. It is the rollout's byte whenever
    ``|w_t - w_r| < 1/2`` (the two bytes around w_t are then the rollout's byte and a neighbour of the other LSB).
    ``t_f32``: fp32 in [2^-9, 448] (`block_scale_t`), so w is in [1, 126] and the result in [1, 126]."""
    low = torch.floor(scale_position(t_f32)).clamp(max=125).to(torch.int32)
    return torch.where((low & 1) == (lsb.to(torch.int32) & 1), low, low + 1).to(torch.uint8)


def _scaled(x_f32: torch.Tensor, scales_u8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """v = x * ((1/g)/s) per value, fp32 [T, W], as `tracefp4.reference` computes it."""
    r = ref.div_rn(ref.div_rn(torch.ones_like(g), g), ref.e4m3_decode(scales_u8))  # [T, W/16]
    return x_f32 * r.repeat_interleave(BLOCK, dim=1)


def scaled_values(x_f32: torch.Tensor, scales_u8: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The scaled values v = x * ((1/g)/s) fp32 [T, W] of x_f32 [T, W] under E4M3 scale bytes uint8 [T, W/16] and
    the fp32 global scale ``g`` (0-d), exactly as the quantizer computes them (`ladder_position` takes them)."""
    return _scaled(x_f32, scales_u8, g)


def _unpack_bits(hints_packed: torch.Tensor) -> torch.Tensor:
    return tracefp4.unpack_hints(hints_packed).to(torch.uint8)


# ---------------------------------------------------------------------------------------------------------
# encode / reconstruct
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MarginExceptions:
    """What the rollout keeps at one site for T tokens (in memory; `pack_rows` gives the bytes).

    value_mask:  bool [T, W]      marked values
    hint_bits:   uint8 [N]        the rollout's hint bit (code LSB) of each marked value, row-major order (N =
                                  value_mask.sum())
    scale_mask:  bool [T, W/16]   marked blocks
    scale_bytes: uint8 [M]        the rollout's E4M3 scale byte of each marked block, row-major (M = scale_mask.sum());
                                  with ``scale_payload == "lsb"`` only its LSB (0 or 1)
    margin, scale_margin: the margins it was encoded with (ladder steps; E4M3 steps)
    scale_payload: "byte" | "lsb" (`SCALE_PAYLOADS`)
    """

    value_mask: torch.Tensor
    hint_bits: torch.Tensor
    scale_mask: torch.Tensor
    scale_bytes: torch.Tensor
    margin: float
    scale_margin: float
    scale_payload: str = "byte"
    #: the tensor fields
    TENSORS: ClassVar[tuple[str, ...]] = ("value_mask", "hint_bits", "scale_mask", "scale_bytes")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.value_mask.shape)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MarginExceptions):
            return NotImplemented
        return (self.margin == other.margin and self.scale_margin == other.scale_margin
                and self.scale_payload == other.scale_payload
                and all(torch.equal(getattr(self, f).cpu(), getattr(other, f).cpu()) for f in self.TENSORS))

    __hash__ = None  # tensors inside: compared by value, not hashable


def encode_margin_exceptions(x_hp: torch.Tensor, global_scale, scales_e4m3: torch.Tensor,
                             hints_packed: torch.Tensor, margin: float, scale_margin: float, *,
                             scale_payload: str = "byte", backend: str = "auto") -> MarginExceptions:
    """The rollout's margin exceptions at one site (module docstring).

    ``x_hp`` [T, W] (bf16/fp16/fp32): the rollout's pre-quantization activation; ``global_scale``: its fp32 g;
    ``scales_e4m3`` uint8 [T, W/16] and ``hints_packed`` uint8 [T, W/8]: what the rollout's quantizer emitted
    (today's store rows). ``margin`` (ladder steps) and ``scale_margin`` (E4M3 steps): numbers >= 0, inf marks
    everything. A block whose given scale byte differs from the one x implies, and a value whose given hint bit
    differs from its round-to-nearest LSB (an engine's own arithmetic), are always marked (with scale hints such a
    block is reproduced only when its byte neighbours the trainer's t). ``scale_payload``: ``"byte"`` keeps a
    marked block's scale byte, ``"lsb"`` its LSB.

    The masks are ``tracefp4.margin_marks`` (fp32 / int32 arithmetic that decides the float64 distances of the
    module docstring exactly, NUMERICS §12), on ``backend`` ("auto": Triton for CUDA tensors, "reference",
    "triton"); only the gather of the kept bits and bytes happens here.

    Raises tracefp4's `DTypeError` / `ShapeError` for tensors of the wrong dtype or shape, `ConfigError` for a
    negative or NaN margin, an unknown scale payload or a bad global scale."""
    if scale_payload not in SCALE_PAYLOADS:
        raise ConfigError(f"scale_payload must be one of {SCALE_PAYLOADS}; got {scale_payload!r}")
    m = _check_margin(margin, "margin")
    ms = _check_margin(scale_margin, "scale_margin")
    t_, w = _check_x(x_hp, "x_hp")
    _check_u8(scales_e4m3, "scales_e4m3", (t_, w // BLOCK))
    _check_u8(hints_packed, "hints_packed", (t_, w // HINTS_PER_BYTE))
    g = _global_scale(global_scale, x_hp.device)
    value_marks, block_marks = tracefp4.margin_marks(x_hp, g, scales_e4m3, hints_packed, m, ms, backend=backend)
    return exceptions_from_marks(value_marks, block_marks, hints_packed.to(x_hp.device), scales_e4m3.to(x_hp.device),
                                 m, ms, scale_payload)


def exceptions_from_marks(value_marks: torch.Tensor, block_marks: torch.Tensor, hints_packed: torch.Tensor,
                          scales_e4m3: torch.Tensor, margin: float, scale_margin: float,
                          scale_payload: str = "byte") -> MarginExceptions:
    """The `MarginExceptions` of packed marks (what ``tracefp4.margin_marks`` returns: value marks uint8 [T, W/8],
    block marks uint8 [T, ceil(W/128)], `pack_hints` order) and the rollout's hints uint8 [T, W/8] and E4M3 scale
    bytes uint8 [T, W/16]: the gather of the kept bits and bytes (a device sync on CUDA: the rollout's recorder runs
    it on the host, when it writes). All tensors on one device."""
    w = hints_packed.shape[1] * HINTS_PER_BYTE
    value_mask = _unpack_bits(value_marks).bool()  # [T, W]
    scale_mask = _unpack_bits(block_marks)[:, : w // BLOCK].bool()  # [T, W/16]
    bits = _unpack_bits(hints_packed)
    stored = scales_e4m3[scale_mask]
    return MarginExceptions(value_mask, bits[value_mask], scale_mask, stored & 1 if scale_payload == "lsb" else stored,
                            margin, scale_margin, scale_payload)


@dataclasses.dataclass(frozen=True)
class Reconstruction:
    """What the trainer works out at one site from its own activation and the margin exceptions.

    scales_e4m3:  uint8 [T, W/16]  stored bytes at marked blocks, its own block scales elsewhere
    hints_packed: uint8 [T, W/8]   stored bits at marked values, LSB of its own round-to-nearest code (with the
                                   reconstructed scales) elsewhere: today's hint layout
    codes_u8:     uint8 [T, W]     the E2M1 codes (unpacked, sign in bit 3) that hint-guided rounding with these
                                   scales and hints gives, i.e. what the forward uses (unspecified where x is NaN)
    """

    scales_e4m3: torch.Tensor
    hints_packed: torch.Tensor
    codes_u8: torch.Tensor


def _pack_blocks(bits: torch.Tensor) -> torch.Tensor:
    """0/1 [T, n] -> packed [T, ceil(n / 8)] (`pack_hints` order, zero padding bits)."""
    pad = (-bits.shape[1]) % HINTS_PER_BYTE
    if pad:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], pad)], dim=1)
    return tracefp4.pack_hints(bits.to(torch.uint8))


def _dense(mask: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """uint8 of mask's shape: ``values`` (row-major) at the marked positions, 0 elsewhere."""
    out = torch.zeros(mask.shape, dtype=torch.uint8, device=mask.device)
    out[mask] = values.to(mask.device, torch.uint8)
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class DenseExceptions:
    """A site's margin exceptions laid out as ``tracefp4.margin_fill`` reads them: fixed-size bit planes, no
    compact lists, so the trainer's forward fills in scales and hints with one kernel and no host sync
    (`densify` of a `MarginExceptions`, or `compact_triton.unpack_rows_dense` straight from the stored rows).

    value_marks:   uint8 [T, W/8]           packed (`tracefp4.pack_hints` order), bit i: value i marked
    hints:         uint8 [T, W/8]           packed, the rollout's hint bit at marked values, 0 elsewhere
    block_marks:   uint8 [T, ceil(W/128)]   packed, bit k: block k marked
    stored_scales: ``scale_payload == "byte"``: uint8 [T, W/16], the rollout's E4M3 byte at marked blocks, 0
                   elsewhere; ``"lsb"``: uint8 [T, ceil(W/128)], packed, its LSB at marked blocks, 0 elsewhere
    width, margin, scale_margin, scale_payload: as in `MarginExceptions`
    """

    value_marks: torch.Tensor
    hints: torch.Tensor
    block_marks: torch.Tensor
    stored_scales: torch.Tensor
    width: int
    margin: float
    scale_margin: float
    scale_payload: str = "byte"
    #: the tensor fields (the planes)
    TENSORS: ClassVar[tuple[str, ...]] = ("value_marks", "hints", "block_marks", "stored_scales")

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.value_marks.shape[0]), int(self.width))

    @property
    def value_mask(self) -> torch.Tensor:
        """bool [T, W]: the marked values (as `MarginExceptions.value_mask`), unpacked from ``value_marks``."""
        return _unpack_bits(self.value_marks).bool()

    def to(self, device: str | torch.device, non_blocking: bool = False) -> DenseExceptions:
        """The same planes on ``device``."""
        return dataclasses.replace(self, **{f: getattr(self, f).to(device, non_blocking=non_blocking)
                                            for f in self.TENSORS})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DenseExceptions):
            return NotImplemented
        return ((self.width, self.margin, self.scale_margin, self.scale_payload)
                == (other.width, other.margin, other.scale_margin, other.scale_payload)
                and all(torch.equal(getattr(self, f).cpu(), getattr(other, f).cpu()) for f in self.TENSORS))

    __hash__ = None


def densify(enc: MarginExceptions | DenseExceptions) -> DenseExceptions:
    """``enc`` as `DenseExceptions` on its own device (a `DenseExceptions` is returned as it is).

    Raises `HintCodingError` when ``enc`` is inconsistent (counts of stored bits/bytes not those of its masks):
    that check reads two counts, a host sync on a GPU; `compact_triton.unpack_rows_dense` makes none."""
    if isinstance(enc, DenseExceptions):
        return enc
    n, nb = int(enc.value_mask.sum()), int(enc.scale_mask.sum())
    if enc.hint_bits.numel() != n or enc.scale_bytes.numel() != nb:
        raise HintCodingError(f"margin exceptions mark {n} values and {nb} blocks but hold {enc.hint_bits.numel()} "
                              f"hint bits and {enc.scale_bytes.numel()} scale bytes")
    vmask, smask = enc.value_mask, enc.scale_mask
    stored_scales = _dense(smask, enc.scale_bytes)  # [T, W/16]
    if enc.scale_payload == "lsb":
        stored_scales = _pack_blocks(stored_scales & 1)  # [T, ceil(W/128)]
    return DenseExceptions(tracefp4.pack_hints(vmask.to(torch.uint8)),
                           tracefp4.pack_hints(_dense(vmask, enc.hint_bits)), _pack_blocks(smask), stored_scales,
                           int(vmask.shape[1]), enc.margin, enc.scale_margin, enc.scale_payload)


def fill(enc: MarginExceptions | DenseExceptions, x_hp: torch.Tensor, global_scale, *,
         backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's scales uint8 [T, W/16] and hints uint8 [T, W/8] for its activation ``x_hp`` [T, W]
    (`reconstruct`'s first two fields, without its codes): one ``tracefp4.margin_fill`` on ``backend``; no host sync
    for a `DenseExceptions` on x's device.

    Raises tracefp4's `DTypeError` / `ShapeError` (x of the wrong dtype, or not the shape ``enc`` covers),
    `HintCodingError` as `densify`."""
    t_, w = _check_x(x_hp, "x_hp")
    if enc.shape != (t_, w):
        raise tracefp4.ShapeError(f"x_hp {[t_, w]} does not match the margin exceptions' shape {list(enc.shape)}")
    d = densify(enc).to(x_hp.device)
    return tracefp4.margin_fill(x_hp, _global_scale(global_scale, x_hp.device), d.value_marks, d.block_marks,
                                d.hints, d.stored_scales, d.scale_payload, backend=backend)


def reconstruct(enc: MarginExceptions | DenseExceptions, x_hp: torch.Tensor, global_scale, *,
                backend: str = "auto") -> Reconstruction:
    """The trainer's rule (module docstring) for its activation ``x_hp`` [T, W] at the site ``enc`` was encoded
    for, with the same fp32 ``global_scale``.

    The scales and hints are ``tracefp4.margin_fill`` on ``backend`` ("auto", "reference", "triton"): the stored
    bits and bytes are laid out densely here (zeros where nothing is marked) and the fill-in runs in one pass over
    x; the codes are hint-guided rounding with them.

    Raises tracefp4's `DTypeError` / `ShapeError` (x of the wrong dtype, or not the shape ``enc`` covers),
    `HintCodingError` when ``enc`` is inconsistent (counts of stored bits/bytes not those of its masks)."""
    t_, w = _check_x(x_hp, "x_hp")
    if enc.shape != (t_, w):
        raise tracefp4.ShapeError(f"x_hp {[t_, w]} does not match the margin exceptions' shape {list(enc.shape)}")
    d = densify(enc).to(x_hp.device)
    scales, hints = fill(d, x_hp, global_scale, backend=backend)
    g = _global_scale(global_scale, x_hp.device)
    vmask = _unpack_bits(d.value_marks).bool()
    v = _scaled(x_hp.float(), scales, g)
    rtn = ref.e2m1_rne_magnitude(v)
    mag = torch.where(vmask, ref.e2m1_hint_magnitude(v, _unpack_bits(hints)), rtn)
    codes = (mag | (ref.input_signbit(x_hp).to(torch.int32) << 3)).to(torch.uint8)
    return Reconstruction(scales, hints, codes)


def fake_quantize_compact(enc: MarginExceptions | DenseExceptions, x_hp: torch.Tensor, global_scale, *,
                          backend: str = "auto") -> torch.Tensor:
    """The trainer's fake-quantized activation [T, W] (x_hp's dtype) under margin exceptions: `fill`, then
    today's hint-guided ``tracefp4.fake_quantize`` on the reconstructed scales and hints (both on ``backend``;
    straight-through backward). Raises as `reconstruct` does."""
    scales, hints = fill(enc, x_hp, global_scale, backend=backend)
    g = _global_scale(global_scale, x_hp.device)
    return tracefp4.fake_quantize(x_hp, "nvfp4", global_scale=g, scales=scales, hints=hints, backend=backend)


def margin_stats(enc: MarginExceptions, rec: Reconstruction, codes_rollout: torch.Tensor,
                 x_rollout: torch.Tensor, x_trainer: torch.Tensor, global_scale,
                 scales_rollout: torch.Tensor) -> dict[str, int]:
    """Counts of one site's reconstruction against the rollout (all int):

    values, blocks; marked_values, marked_blocks; code_mismatch (codes differ, +0 == -0); scale_mismatch;
    value_mismatch (the dequantized values differ: the codes differ, or the block scales do and a code is not 0);
    unmarked_mismatch / marked_mismatch (code mismatches among unmarked / marked values); within_margin (values
    with ``Δ < min(m, 1/2)``, Δ measured with the reconstructed scale) and within_margin_mismatch (the exactness
    property says 0); moved_mismatch (mismatches with Δ >= the margin); wrong_scale_values (values in blocks
    whose reconstructed scale differs from the rollout's).

    ``codes_rollout`` uint8 [T, W] (unpacked), ``x_rollout`` / ``x_trainer`` [T, W], ``scales_rollout`` uint8
    [T, W/16]."""
    g = _global_scale(global_scale, x_trainer.device)
    u_r = ladder_position(_scaled(x_rollout.float(), scales_rollout, g))
    u_t = ladder_position(_scaled(x_trainer.float(), rec.scales_e4m3, g))
    delta = (u_t - u_r).abs()
    c_t, c_r = rec.codes_u8, codes_rollout
    mism = (c_t != c_r) & ~(((c_t & 7) == 0) & ((c_r & 7) == 0))
    within = delta < min(enc.margin, 0.5)
    wrong_scale = (rec.scales_e4m3 != scales_rollout).repeat_interleave(BLOCK, dim=1)
    value_mism = mism | (wrong_scale & (((c_t & 7) != 0) | ((c_r & 7) != 0)))
    vm = enc.value_mask
    return {
        "values": int(vm.numel()), "blocks": int(enc.scale_mask.numel()),
        "marked_values": int(vm.sum()), "marked_blocks": int(enc.scale_mask.sum()),
        "code_mismatch": int(mism.sum()), "scale_mismatch": int((rec.scales_e4m3 != scales_rollout).sum()),
        "value_mismatch": int(value_mism.sum()),
        "unmarked_mismatch": int((mism & ~vm).sum()), "marked_mismatch": int((mism & vm).sum()),
        "within_margin": int(within.sum()), "within_margin_mismatch": int((mism & within).sum()),
        "moved_mismatch": int((mism & ~within).sum()), "wrong_scale_values": int(wrong_scale.sum()),
    }


# ---------------------------------------------------------------------------------------------------------
# position coding (numpy): bit counts, pack, unpack
# ---------------------------------------------------------------------------------------------------------
def _check_coding(coding: str, n: int) -> int | None:
    """The Rice parameter k of ``coding`` (None for the others); `ConfigError` for an unknown coding or a
    block-bitmap over a row length that is not a multiple of 16."""
    if coding in ("all", "bitmap", "gamma"):
        return None
    if coding == "block-bitmap":
        if n % GROUP:
            raise ConfigError(f"coding 'block-bitmap' needs rows of a multiple of {GROUP} positions; got {n}")
        return None
    match = _RICE.fullmatch(coding) if isinstance(coding, str) else None
    if match is None:
        raise ConfigError(f"unknown position coding {coding!r}; supported: {', '.join(POSITION_CODINGS)} "
                          "(k in 0..30)")
    return int(match.group(1))


def _floor_log2(x: np.ndarray) -> np.ndarray:
    """floor(log2 x) of positive integers (exact below 2^53: frexp, not log2)."""
    _, e = np.frexp(x.astype(np.float64))
    return e.astype(np.int64) - 1


def _gamma_len(x: np.ndarray) -> np.ndarray:
    return 2 * _floor_log2(x) + 1


def _gaps(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row of each marked position, its gap p_i - p_(i-1) with p_(-1) = -1), row-major order."""
    rows, cols = np.nonzero(mask)
    prev = np.empty_like(cols)
    prev[1:] = cols[:-1]
    first = np.ones(len(cols), dtype=bool)
    first[1:] = rows[1:] != rows[:-1]
    prev[first] = -1
    return rows, (cols - prev).astype(np.int64)


def row_bits(mask: np.ndarray, coding: str) -> np.ndarray:
    """Bits (int64 [T]) that ``coding`` takes for the marked positions of each row of ``mask`` (bool [T, n]),
    positions only (no hint bits or scale bytes, no padding). Raises `ConfigError` for an unknown coding, and for
    ``all`` when a position is not marked."""
    mask = np.asarray(mask, dtype=bool)
    t_, n = mask.shape
    k = _check_coding(coding, n)
    if coding == "all":
        if not mask.all():
            raise ConfigError(f"coding 'all' needs every position marked; {int((~mask).sum())} of {mask.size} are not")
        return np.zeros(t_, dtype=np.int64)
    if coding == "bitmap":
        return np.full(t_, n, dtype=np.int64)
    if coding == "block-bitmap":
        groups = mask.reshape(t_, n // GROUP, GROUP).any(axis=2).sum(axis=1)
        return n // GROUP + GROUP * groups.astype(np.int64)
    return _gap_bits(mask.sum(axis=1).astype(np.int64), *_gaps(mask), k)


def _gap_bits(count: np.ndarray, rows: np.ndarray, gaps: np.ndarray, k: int | None) -> np.ndarray:
    """Bits per row of a gap coding (gamma: ``k`` None; rice<k>) from the rows' counts and `_gaps`."""
    per = _gamma_len(gaps) if k is None else ((gaps - 1) >> k) + 1 + k
    # summed per row exactly (float64 holds integers below 2^53; np.add.at is an order of magnitude slower)
    return _gamma_len(count + 1) + np.bincount(rows, weights=per, minlength=len(count)).astype(np.int64)


@dataclasses.dataclass(frozen=True)
class SiteCoding:
    """The position codings of one site: ``values`` for marked values (row length W), ``blocks`` for marked
    blocks (row length W/16); each one of `POSITION_CODINGS`."""

    values: str
    blocks: str

    def to_json(self) -> dict[str, str]:
        return {"values": self.values, "blocks": self.blocks}


def candidate_bits(mask: np.ndarray, rice_max: int = 8) -> dict[str, np.ndarray]:
    """Position bits per row (int64 [T]) of ``mask`` (bool [T, n]) in every coding that can code it, in
    preference order: ``all`` (only when every position is marked), bitmap, gamma, rice0..rice<rice_max>,
    block-bitmap (when n is a multiple of 16)."""
    mask = np.asarray(mask, dtype=bool)
    names = ["all"] if mask.all() else []
    names += ["bitmap", "gamma", *(f"rice{k}" for k in range(rice_max + 1))]
    names += ["block-bitmap"] if mask.shape[1] % GROUP == 0 else []
    count, (rows, gaps) = mask.sum(axis=1).astype(np.int64), _gaps(mask)  # once for every gap coding
    return {c: _gap_bits(count, rows, gaps, _check_coding(c, mask.shape[1])) if c == "gamma" or c.startswith("rice")
            else row_bits(mask, c) for c in names}


def choose_coding(enc: MarginExceptions, rice_max: int = 8) -> tuple[SiteCoding, dict[str, dict[str, int]]]:
    """The cheapest coding of each position set of ``enc`` (fewest bits over all its rows; ties: the earlier
    of all (only when every position is marked), bitmap, gamma, rice0..rice<rice_max>, block-bitmap), and every
    candidate's total bits ``{"values": {coding: bits}, "blocks": {...}}``."""
    totals = {key: {c: int(b.sum()) for c, b in candidate_bits(mask.cpu().numpy(), rice_max).items()}
              for key, mask in (("values", enc.value_mask), ("blocks", enc.scale_mask))}
    pick = {k: min(v, key=v.get) for k, v in totals.items()}
    return SiteCoding(pick["values"], pick["blocks"]), totals


def packed_row_bytes(enc: MarginExceptions, coding: SiteCoding) -> np.ndarray:
    """Bytes (int64 [T]) of each row `pack_rows` writes: positions + hint bits + positions + scale bytes,
    padded to a byte."""
    vm = enc.value_mask.cpu().numpy()
    sm = enc.scale_mask.cpu().numpy()
    per_block = 1 if enc.scale_payload == "lsb" else 8
    bits = row_bits(vm, coding.values) + vm.sum(1) + row_bits(sm, coding.blocks) + per_block * sm.sum(1)
    return (bits + 7) // 8


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """One site's rows as bytes: ``data`` uint8 [nbytes], row r = ``data[offsets[r]:offsets[r + 1]]``
    (``offsets`` int64 [T + 1]); ``width`` W, the ``coding``, the margins and the scale payload, which the bytes
    do not carry (a store would keep them per site)."""

    data: np.ndarray
    offsets: np.ndarray
    width: int
    coding: SiteCoding
    margin: float
    scale_margin: float
    scale_payload: str = "byte"

    @property
    def nbytes(self) -> int:
        return int(self.data.size)


def _fields_of_positions(mask: np.ndarray, coding: str) -> list[tuple[np.ndarray, ...]]:
    """The position coding's fields as (row, order, value uint64, length) arrays: within a row, fields go out in
    ``order``; every length is in 1..63 (long unary runs are split, bitmaps go bit by bit)."""
    t_, n = mask.shape
    k = _check_coding(coding, n)
    if coding == "all":
        row_bits(mask, coding)  # every position marked, or ConfigError
        return []
    if coding == "bitmap":
        return [_bit_fields(mask)]
    if coding == "block-bitmap":
        g = mask.reshape(t_, n // GROUP, GROUP)
        present = g.any(axis=2)  # [T, n/16]
        # per row: the presence bits (order 0..n/16-1), then the 16 mask bits of each present group in order
        r, grp = np.nonzero(present)
        bits = g[r, grp]  # [P, 16]
        rows = np.repeat(r, GROUP)
        order = n // GROUP + np.repeat(grp, GROUP) * GROUP + np.tile(np.arange(GROUP), len(r))
        return [_bit_fields(present), (rows.astype(np.int64), order.astype(np.int64),
                                       bits.reshape(-1).astype(np.uint64), np.ones(rows.size, np.int64))]
    count = mask.sum(axis=1).astype(np.int64)
    header = (np.arange(t_, dtype=np.int64), np.full(t_, -1, np.int64), (count + 1).astype(np.uint64),
              _gamma_len(count + 1))
    rows, gaps = _gaps(mask)
    idx = np.arange(len(rows), dtype=np.int64)  # codeword index (row-major, so increasing within a row)
    if k is None:
        return [header, (rows, idx, gaps.astype(np.uint64), _gamma_len(gaps))]
    x = gaps - 1
    q = x >> k
    # codeword i: unary q ones and a zero, in pieces of <= 62 ones (orders 64i + j), then the k low bits (64i + 63)
    pieces = q // 62 + 1
    if int(pieces.max(initial=1)) > 63:
        raise ConfigError(f"coding {coding!r}: a gap of {int(gaps.max())} needs more than 63 unary pieces; use a "
                          "larger k")
    prow = np.repeat(rows, pieces)
    first = np.cumsum(pieces) - pieces
    piece_j = np.arange(int(pieces.sum()), dtype=np.int64) - np.repeat(first, pieces)
    plen = np.full(prow.size, 62, dtype=np.int64)
    last = np.cumsum(pieces) - 1
    plen[last] = q % 62 + 1  # the last piece: the remaining ones and the terminating zero
    pval = (np.uint64(1) << plen.astype(np.uint64)) - np.uint64(1)
    pval[last] -= np.uint64(1)  # its final bit is the zero
    out = [header, (prow, np.repeat(idx, pieces) * 64 + piece_j, pval, plen)]
    if k:
        out.append((rows, idx * 64 + 63, (x & ((1 << k) - 1)).astype(np.uint64), np.full(len(rows), k, np.int64)))
    return out


def _bit_fields(bits: np.ndarray) -> tuple[np.ndarray, ...]:
    """Every bit of bool [T, L] as a 1-bit field (row, order = column, value, 1)."""
    rows, cols = np.indices(bits.shape)
    return (rows.reshape(-1).astype(np.int64), cols.reshape(-1).astype(np.int64),
            bits.reshape(-1).astype(np.uint64), np.ones(bits.size, np.int64))


def _write(sections: list[list[tuple[np.ndarray, ...]]], t_: int) -> tuple[np.ndarray, np.ndarray]:
    """Sections of fields (row, order, value, length) -> (bytes uint8, row byte offsets int64 [T + 1]): row by
    row, section by section, fields by order, each MSB first, each row padded with zeros to a byte."""
    parts = [(np.full(len(f[0]), s, np.int64), *f) for s, sec in enumerate(sections) for f in sec]
    sec, r, order, v, ln = (np.concatenate([p[i] for p in parts]) for i in range(5))
    perm = np.lexsort((order, sec, r))
    r, v, ln = r[perm], v[perm], ln[perm]
    row_bytes = (np.bincount(r, weights=ln, minlength=t_).astype(np.int64) + 7) // 8
    offsets = np.concatenate([[0], np.cumsum(row_bytes)]).astype(np.int64)
    before = np.cumsum(ln) - ln  # bits of all fields before each one
    first = np.searchsorted(r, np.arange(t_))  # index of each row's first field
    start = offsets[r] * 8 + before - before[first[r]] if r.size else before
    out = np.zeros(int(offsets[-1]) * 8, dtype=np.uint8)
    if r.size:
        within = np.arange(int(ln.sum())) - np.repeat(before, ln)  # bit index inside its field
        shift = (np.repeat(ln, ln) - 1 - within).astype(np.uint64)
        out[np.repeat(start, ln) + within] = ((np.repeat(v, ln) >> shift) & np.uint64(1)).astype(np.uint8)
    return np.packbits(out), offsets


def pack_rows(enc: MarginExceptions, coding: SiteCoding) -> PackedRows:
    """``enc`` as bytes, one byte-aligned row per token (module docstring). Raises `ConfigError` for an
    unknown coding."""
    vm = enc.value_mask.cpu().numpy()
    sm = enc.scale_mask.cpu().numpy()
    t_, w = vm.shape
    hr, _ = np.nonzero(vm)
    sr, _ = np.nonzero(sm)
    sections = [
        _fields_of_positions(vm, coding.values),
        [(hr.astype(np.int64), np.arange(len(hr), dtype=np.int64), enc.hint_bits.cpu().numpy().astype(np.uint64),
          np.ones(len(hr), np.int64))],
        _fields_of_positions(sm, coding.blocks),
        [(sr.astype(np.int64), np.arange(len(sr), dtype=np.int64), enc.scale_bytes.cpu().numpy().astype(np.uint64),
          np.full(len(sr), 1 if enc.scale_payload == "lsb" else 8, np.int64))],
    ]
    data, offsets = _write(sections, t_)
    return PackedRows(data, offsets, w, coding, enc.margin, enc.scale_margin, enc.scale_payload)


class _Stream:
    """The rows' bits (MSB first, as `pack_rows` writes them) as one stream with the lookups the decoders need.

    bits:  uint8 [N + 1] (N = 8 * nbytes; a 0 past the end)
    start, end: int64 [T], each row's first bit and the bit after its last
    N + 1 stands for "past every row": a lookup that finds nothing gives it, positions are clipped to it, and whatever
    reaches it is truncated."""

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        self.data = np.concatenate([np.asarray(data, np.uint8), np.zeros(8, np.uint8)])
        self.n = int(data.size) * 8
        self.bits = np.concatenate([np.unpackbits(np.asarray(data, np.uint8)), np.zeros(1, np.uint8)])
        self.start = offsets[:-1] * 8
        self.end = offsets[1:] * 8
        self._where: dict[int, np.ndarray] = {}

    def where(self, value: int) -> np.ndarray:
        """int64 [M]: the positions of the bits equal to ``value``, ascending."""
        hit = self._where.get(value)
        if hit is None:
            hit = self._where[value] = np.flatnonzero(self.bits[: self.n] == value)
        return hit

    def next_at(self, value: int, pos: np.ndarray) -> np.ndarray:
        """int64: the first position >= each of ``pos`` holding ``value`` (N + 1 if none)."""
        at = self.where(value)
        i = np.searchsorted(at, pos)
        return np.where(i < at.size, at[np.minimum(i, max(at.size - 1, 0))] if at.size else 0, self.n + 1)

    def next_all(self, value: int) -> np.ndarray:
        """int32 (int64 for streams of 2^30 bits or more) [N + 2]: `next_at` of every position 0..N+1, by one
        np.repeat (the positions in (a_(i-1), a_i] map to a_i)."""
        dt = np.int32 if self.n + 4 < 2**30 else np.int64  # 2 a - p + 1 below stays in range
        ext = np.concatenate([self.where(value).astype(dt), np.array([self.n + 1], dt)])
        return np.repeat(ext, np.diff(ext, prepend=dt(-1)))

    def read(self, pos: np.ndarray, nbits) -> np.ndarray:
        """int64 of the ``nbits`` (0..56, scalar or per field) bits at bit offsets ``pos`` (int64), MSB first: a
        big-endian window of the bytes, as few as the widest field needs."""
        pos = np.asarray(pos, dtype=np.int64)
        nb = np.broadcast_to(np.asarray(nbits, dtype=np.int64), pos.shape)
        width = int(nb.max(initial=0))
        if width == 0:
            return np.zeros(pos.shape, np.int64)
        nbytes = (7 + width + 7) // 8  # bytes that hold any field of <= width bits at any bit offset
        idx = pos >> 3
        w = np.zeros(pos.shape, dtype=np.uint64)
        for j in range(nbytes):
            w = (w << np.uint64(8)) | self.data[idx + j].astype(np.uint64)
        shift = (np.uint64(8 * nbytes) - (pos & 7).astype(np.uint64) - nb.astype(np.uint64))
        out = (w >> shift) & ((np.uint64(1) << nb.astype(np.uint64)) - np.uint64(1))
        return out.astype(np.int64)


def _fail_if(bad: np.ndarray, message) -> None:
    """Raise `HintCodingError` with ``message(first offending index)`` when any of ``bad`` is set."""
    if bad.any():
        raise HintCodingError(message(int(np.flatnonzero(bad)[0])))


def _check_fits(st: _Stream, rows: np.ndarray, stop: np.ndarray, what: str) -> None:
    """Fields of rows ``rows`` that end at bits ``stop`` must end inside their row."""
    bad = stop > st.end[rows]
    _fail_if(bad, lambda i: f"row {int(rows[i])}: truncated ({what} ends at bit {int(stop[i] - st.start[rows[i]])} "
                            f"of {int(st.end[rows[i]] - st.start[rows[i]])})")


def _chain(first: np.ndarray, count: np.ndarray, jump: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The codewords of a self-delimiting code: row r's ``count[r]`` codewords start at ``first[r]``, each the next
    where the one before ends, ``jump[p]`` for a codeword starting at p (int [N + 2], computed for every bit in one
    pass; N + 1 maps to itself). Returns (row, start, stop) int64 of every codeword, row-major, in order within a row.

    All rows walk together, one codeword per step: a gather of R positions per step, as many steps as the most
    codewords in a row."""
    rows = np.flatnonzero(count > 0)
    if rows.size == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)
    steps = int(count[rows].max())
    walk = np.empty((steps + 1, rows.size), dtype=jump.dtype)  # [steps + 1, R]: row r's codeword i starts at [i, r]
    walk[0] = first[rows]
    take = jump.take
    for i in range(steps):
        take(walk[i], out=walk[i + 1])
    keep = (np.arange(steps)[:, None] < count[rows]).T  # [R, steps]
    return (np.repeat(rows, count[rows]), walk[:-1].T[keep].astype(np.int64), walk[1:].T[keep].astype(np.int64))


def _positions(st: _Stream, cur: np.ndarray, coding: str, n: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Decode each row's position set at bit ``cur[r]`` (updated in place to the bit after it): (rows, positions)
    of the marked positions, row-major, ascending within a row; None for ``all`` (every position, no bits)."""
    k = _check_coding(coding, n)
    t_ = cur.size
    if coding == "all":
        return None
    ar = np.arange(t_, dtype=np.int64)
    if coding == "bitmap":
        _check_fits(st, ar, cur + n, "bitmap")
        r, c = np.nonzero(st.bits[cur[:, None] + np.arange(n)])
        cur += n
        return r.astype(np.int64), c.astype(np.int64)
    if coding == "block-bitmap":
        ng = n // GROUP
        _check_fits(st, ar, cur + ng, "block-bitmap presence bits")
        present = st.bits[cur[:, None] + np.arange(ng)].astype(bool)  # [T, n/16]
        npresent = present.sum(axis=1)
        _check_fits(st, ar, cur + ng + GROUP * npresent, "block-bitmap groups")
        r, grp = np.nonzero(present)
        within = (np.cumsum(present, axis=1) - 1)[r, grp]  # the group's index among its row's present groups
        bits = st.bits[(cur[r] + ng + GROUP * within)[:, None] + np.arange(GROUP)].astype(bool)  # [P, 16]
        _fail_if(~bits.any(axis=1), lambda i: f"row {int(r[i])}: group {int(grp[i])} flagged present but has no "
                                              "marked position")
        pr, pj = np.nonzero(bits)
        cur += ng + GROUP * npresent
        return r[pr].astype(np.int64), (grp[pr] * GROUP + pj).astype(np.int64)
    # gamma(count + 1), then count gap codewords (gamma, or Golomb-Rice 2^k of gap - 1)
    z = st.next_at(1, cur) - cur
    _check_fits(st, ar, cur + 2 * z + 1, "Elias-gamma count")
    _fail_if(z > 55, lambda i: f"row {i}: a count of more than {n} positions")
    count = st.read(cur + z, z + 1) - 1
    _fail_if(count > n, lambda i: f"row {i}: {int(count[i])} positions in a row of {n}")
    cur += 2 * z + 1
    sink = st.n + 1
    if k is None:  # gamma at p: zeros up to the first one o, then (o - p) + 1 bits from o: it ends at 2 o - p + 1
        jump = np.minimum(2 * st.next_all(1) - np.arange(sink + 1, dtype=np.int32) + 1, sink)
    else:  # Rice at p: ones up to the first zero o, then k bits: it ends at o + 1 + k
        jump = np.minimum(st.next_all(0) + (1 + k), sink)
    jump[sink] = sink
    rows, node, stop = _chain(cur, count, jump)
    _check_fits(st, rows, stop, "gap code")
    if k is None:
        q = (stop - node - 1) // 2  # leading zeros
        _fail_if(q > 55, lambda i: f"row {int(rows[i])}: a position past the row of {n}")
        gap = st.read(node + q, q + 1)
    else:
        q = stop - node - 1 - k  # unary ones
        _fail_if(q > n, lambda i: f"row {int(rows[i])}: a position past the row of {n}")  # gap >= q 2^k + 1 > n
        gap = ((q << k) | st.read(node + q + 1, k)) + 1
    csum = np.cumsum(gap)
    first = np.searchsorted(rows, ar)  # each row's first codeword
    pos = csum - np.concatenate([[0], csum])[first[rows]] - 1  # p_i = sum of the row's gaps up to i, - 1
    _fail_if(pos >= n, lambda i: f"row {int(rows[i])}: position {int(pos[i])} past the row of {n}")
    has = count > 0
    cur[has] = stop[(first + count - 1)[has]]
    return rows, pos


def _payload(st: _Stream, cur: np.ndarray, marked: tuple[np.ndarray, np.ndarray] | None, n: int, per: int,
             what: str) -> np.ndarray:
    """The ``per``-bit fields (uint8) that follow each row's position set, one per marked position (``marked``:
    `_positions` of rows of ``n`` positions); ``cur`` moves past them."""
    t_ = cur.size
    if marked is None:  # every position: n fields per row
        count = np.full(t_, n, dtype=np.int64)
        at = (cur[:, None] + per * np.arange(n, dtype=np.int64)).reshape(-1)
    else:
        rows = marked[0]
        count = np.bincount(rows, minlength=t_).astype(np.int64)
        first = np.concatenate([[0], np.cumsum(count)])[:-1]
        at = cur[rows] + per * (np.arange(rows.size, dtype=np.int64) - first[rows])
    _check_fits(st, np.arange(t_, dtype=np.int64), cur + per * count, what)
    cur += per * count
    return (st.bits[at] if per == 1 else st.read(at, per)).astype(np.uint8)


def _mask(marked: tuple[np.ndarray, np.ndarray] | None, t_: int, n: int) -> np.ndarray:
    """bool [T, n] of `_positions`' marked positions."""
    if marked is None:
        return np.ones((t_, n), dtype=bool)
    out = np.zeros((t_, n), dtype=bool)
    out[marked] = True
    return out


def offsets_cover(data: np.ndarray, offsets: np.ndarray) -> bool:
    """Whether row ``offsets`` (int64 [T + 1]) cover ``data`` (uint8 [n]): from 0, never decreasing, to n."""
    return bool(offsets.size and offsets[0] == 0 and offsets[-1] == data.size and not (np.diff(offsets) < 0).any())


def unpack_rows(packed: PackedRows) -> MarginExceptions:
    """The inverse of `pack_rows`. Raises `HintCodingError` for bytes that do not decode as the coding says
    (truncated, positions past the row, non-zero padding or trailing bits).

    Vectorized over all rows (numpy): fixed-width fields are gathered directly; for the self-delimiting gamma /
    Rice codewords, where a codeword starting at any bit would end is one pass over the stream, and all rows then
    walk their codewords together (`_chain`)."""
    w = packed.width
    nb = w // BLOCK
    offsets = np.asarray(packed.offsets, dtype=np.int64)
    data = np.asarray(packed.data, dtype=np.uint8)
    t_ = len(offsets) - 1
    if not offsets_cover(data, offsets):
        raise HintCodingError(f"row offsets {offsets[:4].tolist()}... do not cover {data.size} bytes")
    st = _Stream(data, offsets)
    cur = st.start.copy()
    values = _positions(st, cur, packed.coding.values, w)
    hints = _payload(st, cur, values, w, 1, "hint bits")
    blocks = _positions(st, cur, packed.coding.blocks, nb)
    scales = _payload(st, cur, blocks, nb, 1 if packed.scale_payload == "lsb" else 8, "scale payload")
    rest = st.end - cur
    _fail_if((rest >= 8) | (st.read(cur, np.clip(rest, 0, 7)) != 0),
             lambda r: f"row {r}: {int(rest[r])} bits after the last field (padding must be < 8 zero bits)")
    return MarginExceptions(torch.from_numpy(_mask(values, t_, w)), torch.from_numpy(hints),
                            torch.from_numpy(_mask(blocks, t_, nb)),
                            torch.from_numpy(scales), packed.margin, packed.scale_margin, packed.scale_payload)



def today_bytes_per_token(widths: Sequence[int]) -> int:
    """Bytes per token of today's layout at sites of these widths: W/8 hint bytes + W/16 scale bytes each."""
    return sum(w // HINTS_PER_BYTE + w // BLOCK for w in widths)


# ---------------------------------------------------------------------------------------------------------
# the store's margin sites (tracestore format version 5, FORMAT §2.5)
# ---------------------------------------------------------------------------------------------------------
def store_site(name: str, width: int, coding: SiteCoding, margin: float, scale_margin: float,
               scale_payload: str = "byte", *, max_row_bytes: int | None = None, kind: str = "activation"):
    """The `tracestore.Site` of hint encoding ``margin`` that keeps `pack_rows` rows of this coding, margins and
    scale payload (the keys a reader needs to decode them; FORMAT §2.5). Raises tracestore's DeclarationError /
    ShapeError for values the store does not allow (a margin < 0, an unknown coding, W not a multiple of 16)."""
    import tracestore

    return tracestore.Site(name, width, kind=kind, hint_encoding="margin", margin=margin, scale_margin=scale_margin,
                           value_coding=coding.values, block_coding=coding.blocks, scale_payload=scale_payload,
                           max_row_bytes=max_row_bytes)


def store_rows(packed: PackedRows) -> tuple[np.ndarray, np.ndarray]:
    """``packed``'s rows as `tracestore.Writer.write(rows={site: ...})` takes them: (data uint8 [n], offsets int64
    [T + 1])."""
    return np.ascontiguousarray(packed.data, dtype=np.uint8), np.ascontiguousarray(packed.offsets, dtype=np.int64)


def packed_from_store(site, rows) -> PackedRows:
    """The `PackedRows` of rows a tracestore reader returned for a margin ``site`` (`tracestore.Site`): ``rows`` is
    ``TraceBatch.rows[site.name]`` read with ``fmt="numpy"`` or ``"torch"`` (data uint8 [n], offsets int64 [T + 1])
    or ``"arrow"`` (a large_binary array). The coding, margins and scale payload come from the site's keys.

    Raises `ConfigError`: ``site`` is not a margin site."""
    if getattr(site, "hint_encoding", None) != "margin":
        raise ConfigError(f"site {getattr(site, 'name', site)!r} is not a margin site (hint_encoding "
                          f"{getattr(site, 'hint_encoding', None)!r}); its rows are hints and scales")
    if hasattr(rows, "buffers") and hasattr(rows, "type"):  # pyarrow large_binary: [validity, offsets, data]
        _, off_buf, data_buf = rows.buffers()
        offsets = np.frombuffer(off_buf, np.int64)[rows.offset: rows.offset + len(rows) + 1]
        data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
        data, offsets = data[offsets[0]:offsets[-1]], offsets - offsets[0]
    else:
        data, offsets = rows
        data = data.cpu().numpy() if isinstance(data, torch.Tensor) else np.asarray(data)
        offsets = offsets.cpu().numpy() if isinstance(offsets, torch.Tensor) else np.asarray(offsets)
    return PackedRows(np.asarray(data, np.uint8), np.asarray(offsets, np.int64), site.width,
                      SiteCoding(site.value_coding, site.block_coding), site.margin, site.scale_margin,
                      site.scale_payload)
