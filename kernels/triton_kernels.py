"""Triton kernels of the FP4 numerics, bit-identical to `tracefp4.reference` (imported lazily by `tracefp4.api`).

One module on purpose (about 1,600 lines): the five kernels are thin compositions of the same ~25 ``@triton.jit``
helpers (piece loads, block amax, own and given scales, the three-operation E2M1 rounding, code/hint packing and
stores), and the bit-level argument below is made once for all of them. Split by op, each op's module would hold
a page of kernel and a page of launcher while every reason for its bits stayed in a shared helper module; the
sections below (loads, scales, rounding, stores, kernels, launchers) give the same map in one place.

Kernels over a flat view of the input as NB blocks of B values (B = 16 NVFP4, 32 MXFP4; rows are whole numbers
of blocks, so block k is simply elements [kB, (k+1)B)):

- `_quantize_kernel`:      x -> codes [NB, B/2], scale bytes [NB], hint bytes [NB, B/8]
- `_fake_quant_kernel`:    x (+ scale bytes, hint bytes) -> y in x.dtype (round to nearest or hint-guided)
- `_quantize_fake_kernel`: x -> y (round to nearest, own scales) and codes, scales, hints in one pass
  (`_quantize_kernel` with FAKE; with MARKS also `tracefp4.margin_marks` of its own scales and hints: value marks
  as hint bytes, block marks as bits)
- `_dequantize_kernel`:    codes, scale bytes -> y
- `_fake_quant_bwd_kernel`: clipped straight-through gradient (grad where not |x * r| > 6)

Layout (forward kernels): one thread per block. A block is loaded as P pieces of 16 bytes ([BN, K] tiles of
identical layout, so piece p of a block is in the same thread as its other pieces): bf16 as K = 4 int32 words
(two values each), fp16 as K = 8 halves, fp32 as K = 4 floats. Each piece is split into the even and the odd
element of every pair, so the code byte of a pair is ``code(even) | code(odd) << 4`` with no data movement; the
block amax, the 32-bit word of 8 codes and the hint byte are in-thread reductions, and a block's codes / hints /
scale leave in one 8- (16-) / 2- (4-) / 1-byte store. With PERSIST the grid is a few programs per SM, each
looping over tiles of BN blocks and loading the next tile before it computes the current one, so that every
warp keeps 16 * P bytes per thread in flight while it computes (the kernels are latency- and issue-bound, not
bound by DRAM bytes: see benchmarks/results/kernels-h200-analysis.log).

The row layout (a config ``("rows", rows per program, num_warps, programs per SM)``; quantization of bf16 / fp16,
fake quantization and dequantization): one thread per *piece* (a row of 16 input bytes), so that a warp's loads and
stores are 512 contiguous bytes instead of 32 threads' pieces at a stride of 16 * P bytes. A block of P rows takes
its amax with a max across its P neighbouring threads (`_group_max`: warp shuffles) and reads a given scale byte P
times (L1); a row's codes are one word (bf16 / fp16) or half of one (fp32), its hints one byte or half of one. Where
a thread held 64 or more bytes of a block (MXFP4; NVFP4 fp32) the block layout reached 22-78% of copy bandwidth on
an H200 and the row layout 91-101% (kernels-h200-rows*.json); the defaults per case (CONFIG_CASES) are what measured
fastest. Every per-value operation is the same helper in both layouts, so their bits are the same.

Quantize variants, the same bits, timed side by side by `benchmarks/benchmark_kernels.py --quantize-variants` (the
hint cost: hints are +4.9% of a bf16 NVFP4 quantize's bytes, and the kernel is about as issue- as memory-bound):
the hint packing (HINT_PACKS: 16, 8 or, through warp shuffles and shared memory, ~40 instructions per block of 16
values on sm_90), the pair layout (a config ("pairs", pairs per program, num_warps, programs per SM): two blocks per
thread, so a thread stores 16 code, 4 hint and 2 scale bytes) and UNROLL (two tiles per trip of the persistent loop).

Per-value arithmetic (the reasons are instruction counts: quantize executed 24.3 instructions per value before, 17.7
now, ncu on an H200):
- Round to nearest on the E2M1 ladder with ties to the even code, in three floating-point operations: for
  a = min(|x * r|, 6) let C = 2^22 * 2^max(e, 0) where 2^e <= a < 2^(e+1). Then ulp(C) is the ladder step at a
  (0.5 below 2, 1 in [2, 4), 2 in [4, 6]), so (a + C) - C is a rounded to the ladder by the adder, ties to the
  even multiple = the even code. Scaled by 2^-126 the rounded value rho lands on the fp32 grid where E2M1 is
  "subnormal-aligned": the bits of rho * 2^-126 are exactly code << 22 (0.5 -> 2^-127 -> 0x00400000, 1 ->
  2^-126 -> 0x00800000, ..., 6 -> 0x01C00000), so packing is a shift per value and the value of a code c is
  the float with bits c << 22, times 2^126. C is carried as cn = -C * 2^-126 (one integer add from the exponent
  bits), so t = fma(cn, -2^126, a) = a + C and rho * 2^-126 = fma(t, 2^-126, cn) (both products exact, so FMA
  contraction cannot change a bit).
- Hint-guided rounding on GPU: t = a + C rounded toward zero puts the floor ladder index m (same parity as k) in
  the low bits of t; t + ((~(t ^ hint)) & 1) moves to the neighbour whose code has the hint's parity, and
  t - C is the E2M1 value (exact). The interpreter has no directed rounding and uses an integer floor instead.
- The block amax on GPU: fma(|x|, 0, |x|) is NaN for +-Inf/NaN and |x| otherwise, and the hardware max
  ignores NaN; the interpreter (whose max propagates NaN) uses a select.
- NaN outputs of fake quantization come only from NaN inputs (a NaN product x * r of a finite x, from a zero
  scale, is coded like the reference): y = fma(E * |s|, g, p) with p = min_nan(|x|, +0) (+0, or NaN for NaN x).
  A negative given scale (E4M3 bytes >= 0x80) contributes its sign to the final sign flip instead.
- Signs are applied last by XOR-ing the sign bit of x into the sign bit of (E2M1 * s) * g (bf16: on the packed
  output word, one op per pair); the sign bit is taken from the input bits, never from a converted NaN, whose
  sign the fp16 -> fp32 conversion may drop.

Exactness rules that keep them bit-identical to the reference:
- every division is `tl.math.div_rn` (correctly rounded; Triton's `/` on fp32 is the approximate div.full.f32);
- the E4M3 rounding of the block scale is the same adder trick on 3 mantissa bits (grid 2^-9 below 2^-6), and
  the scale byte is the bits of s * 2^-120 shifted by 20 (E4M3 is subnormal-aligned at that scale);
- the only multiplies feeding an add have exact products, so FMA contraction cannot change a bit;
- Triton's unary minus is 0 - x, which loses -0.0: signs are set by bit operations.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from .constants import NVFP4_GLOBAL_DENOM, NVFP4_GLOBAL_SCALE_FALLBACK, NVFP4_GLOBAL_SCALE_MIN
from .errors import FormatError, LaunchConfigError, ShapeError

__all__ = [
    "default_config",
    "quantize_blocks_triton",
    "fake_quantize_blocks_triton",
    "quantize_fake_blocks_triton",
    "dequantize_blocks_triton",
    "fake_quantize_bwd_blocks_triton",
    "CONFIG",
    "CONFIG_CASES",
    "HINT_PACK",
    "HINT_PACKS",
    "QUANTIZE_UNROLL",
]

#: default launch configuration per kernel (bf16 input; NVFP4 and MXFP4): (blocks per program BN, num_warps,
#: programs per SM). Programs per SM 0: one program per tile (a plain grid); 1..31: a persistent grid of exactly
#: that many programs per SM, each looping over tiles with the next tile's loads in flight; 32: as many as fit on
#: an SM at once (known from the register count after the kernel's first launch). Chosen from the sweeps on an
#: H200 (benchmarks/results/kernels-h200.json); CONFIG_CASES overrides them per input dtype and format.
#: The backward kernel: (BN, num_warps).
CONFIG: dict[str, tuple] = {
    "quantize": (128, 4, 16),
    "fake_quant": (256, 8, 32),  # hint-guided / rollout scales
    "fake_quant_rtn": (128, 4, 0),  # round to nearest with own scales
    "quantize_fake": (128, 4, 32),
    "dequantize": (64, 2, 0),
    "fake_quant_bwd": (256, 4),
}
#: (kernel, input dtype, fmt) -> config, where the H200 sweep found a config clearly (> 3 points of copy
#: bandwidth) better than CONFIG's for that input (a ("rows", ...) config where the row layout was)
CONFIG_CASES: dict[tuple[str, str, str], tuple] = {
    **{("quantize", "fp16", f): (64, 2, 0) for f in ("nvfp4", "mxfp4")},
    **{("quantize", "fp32", f): (128, 4, 0) for f in ("nvfp4", "mxfp4")},
    ("quantize", "bf16", "mxfp4"): (128, 4, 32),
    # a plain grid of 64-block programs: the fastest with and without hints on an H100 (103.6% / 103.4% of copy
    # against 97.1% / 98.8% for CONFIG's persistent (128, 4, 16); hint cost 4.7% against 6.7%;
    # kernels-quantize-variants-h100.json) and the fastest of the H200's sweep (kernels-h200-rows-quantize.json)
    ("quantize", "bf16", "nvfp4"): (64, 2, 0),
    **{("quantize_fake", d, f): (64, 2, 0) for d in ("bf16", "fp16", "fp32") for f in ("nvfp4", "mxfp4")
       if (d, f) not in (("bf16", "nvfp4"), ("bf16", "mxfp4"), ("fp16", "mxfp4"))},
    ("fake_quant", "fp16", "nvfp4"): (128, 4, 0),
    # the row layout (one thread per 16 input bytes), from the H200 sweeps of kernels-h200-rows*.json: every
    # dequantization, every MXFP4 and fp32 fake quantization, MXFP4 bf16 / fp16 quantize_fake
    **{("dequantize", d, f): ("rows", 512, 4, 0) for d in ("bf16", "fp16") for f in ("nvfp4", "mxfp4")},
    **{("dequantize", "fp32", f): ("rows", 1024, 8, 0) for f in ("nvfp4", "mxfp4")},
    ("fake_quant", "bf16", "mxfp4"): ("rows", 1024, 8, 0),
    ("fake_quant", "fp16", "mxfp4"): ("rows", 512, 4, 0),
    ("fake_quant", "fp32", "nvfp4"): ("rows", 512, 4, 0),
    ("fake_quant", "fp32", "mxfp4"): ("rows", 128, 4, 0),
    **{("fake_quant_rtn", d, "mxfp4"): ("rows", 512, 4, 0) for d in ("bf16", "fp16")},
    ("fake_quant_rtn", "fp32", "nvfp4"): ("rows", 1024, 8, 0),
    ("fake_quant_rtn", "fp32", "mxfp4"): ("rows", 128, 4, 0),
    ("quantize_fake", "bf16", "mxfp4"): ("rows", 512, 4, 0),
    ("quantize_fake", "fp16", "mxfp4"): ("rows", 128, 4, 0),
}
#: how quantize gathers a block's hint bits from its code words (the same bits): "gather" three multiplies per word
#: of 8 codes (`_gather_hint_bits`), "nibbles" one multiply per word and one high multiply per two words
#: (`_hint_bytes2`: 8 integer ops per 16 codes instead of 16), "nibbles_x4" as "nibbles" with the 2-byte hints of 4
#: neighbouring threads summed by warp shuffles into one 8-byte store (`_store_hints_x4`; block layout with 2 code
#: words per block, a block count divisible by 4, else "nibbles"). HINT_PACK is the default of every launch.
HINT_PACKS = ("gather", "nibbles", "nibbles_x4")
HINT_PACK = "gather"
#: whether quantize's persistent loop takes two tiles per trip by default (`_quantize_kernel`'s UNROLL)
QUANTIZE_UNROLL = False
_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _on_input_device(fn):
    """Launch on the device of the first argument (a CUDA tensor), not on the current device: Triton launches on
    the current CUDA device, and a tensor of another GPU is then an inaccessible pointer."""

    @functools.wraps(fn)
    def wrapper(x, *args, **kwargs):
        if x.is_cuda and x.device.index != torch.cuda.current_device():
            with torch.cuda.device(x.device):
                return fn(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    return wrapper


def default_config(kernel: str, dtype: torch.dtype, fmt: str) -> tuple:
    """The configuration a launch of `kernel` ("quantize", "fake_quant", "fake_quant_rtn", "quantize_fake",
    "dequantize", "fake_quant_bwd") gets without an explicit config, for inputs of `dtype` in `fmt`."""
    return CONFIG_CASES.get((kernel, _DTYPE_NAME.get(dtype, ""), fmt), CONFIG[kernel])

_KIND = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
#: the margin marks' launch arguments (`tracefp4.margin`): the 7 value ranges of bits(|v|), then the scale threshold
THRESHOLDS = ("L0", "H0", "L1", "H1", "L2", "H2", "L3", "H3", "L4", "H4", "L5", "H5", "L6", "H6", "KS")
_F32_MAX = 3.4028234663852886e38


# ---------------------------------------------------------------------------------------------------------
# loading and unpacking
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _blocks(start, NB, BN: tl.constexpr):
    blk = start + tl.arange(0, BN)
    return blk, blk < NB


@triton.jit
def _piece_offsets(blk, p: tl.constexpr, P: tl.constexpr, K: tl.constexpr):
    """Element offsets [BN, K] of piece p (16 bytes) of each block of P pieces."""
    return (blk * P + p)[:, None] * K + tl.arange(0, K)[None, :]


@triton.jit
def _load_pieces(ptr, blk, bmask, P: tl.constexpr, K: tl.constexpr):
    """The P pieces [BN, K] of BN blocks, as a tuple (loaded together: P 16-byte loads per thread)."""
    m = bmask[:, None]
    if P == 1:
        return (tl.load(ptr + _piece_offsets(blk, 0, P, K), mask=m, other=0),)
    elif P == 2:
        return (tl.load(ptr + _piece_offsets(blk, 0, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 1, P, K), mask=m, other=0))
    elif P == 4:
        return (tl.load(ptr + _piece_offsets(blk, 0, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 1, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 2, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 3, P, K), mask=m, other=0))
    else:
        return (tl.load(ptr + _piece_offsets(blk, 0, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 1, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 2, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 3, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 4, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 5, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 6, P, K), mask=m, other=0),
                tl.load(ptr + _piece_offsets(blk, 7, P, K), mask=m, other=0))


@triton.jit
def _unpack(raw, KIND: tl.constexpr):
    """(xe, xo, se, so) of a piece: fp32 values of the even / odd element of each pair [BN, K/2 pairs] and
    int32 carriers of their sign bits (bit 31). bf16 words: w << 16 and w & 0xFFFF0000 are exact; fp16:
    the sign comes from the half's bits (sign-extended), not from the converted value."""
    if KIND == 0:
        xe_bits = raw << 16
        xo_bits = raw & -65536
        return xe_bits.to(tl.float32, bitcast=True), xo_bits.to(tl.float32, bitcast=True), xe_bits, xo_bits
    elif KIND == 1:
        he, ho = tl.split(tl.reshape(raw, (raw.shape[0], raw.shape[1] // 2, 2)))
        se = he.to(tl.int16, bitcast=True).to(tl.int32)
        so = ho.to(tl.int16, bitcast=True).to(tl.int32)
        return he.to(tl.float32), ho.to(tl.float32), se, so
    else:
        fe, fo = tl.split(tl.reshape(raw, (raw.shape[0], raw.shape[1] // 2, 2)))
        return fe, fo, fe.to(tl.int32, bitcast=True), fo.to(tl.int32, bitcast=True)


@triton.jit
def _finite_amax(xe, xo, GPU: tl.constexpr):
    """max |x| over the finite values of each row of the pair tiles, fp32 [BN] (0 if none)."""
    if GPU:
        # fma(x, 0, x) is x for finite x and NaN for +-Inf/NaN; the hardware max ignores NaN. The abs is taken
        # after the fma so that it stays a free operand modifier (an abs of the unpacked bits would be folded
        # into an extra integer AND)
        m = tl.maximum(tl.abs(tl.fma(xe, 0.0, xe)), tl.abs(tl.fma(xo, 0.0, xo)))
        return tl.max(m, axis=1)
    else:
        ae = tl.abs(xe)
        ao = tl.abs(xo)
        m = tl.maximum(tl.where(ae < float("inf"), ae, 0.0), tl.where(ao < float("inf"), ao, 0.0))
        return tl.max(m, axis=1)


@triton.jit
def _pieces_amax(xs, P: tl.constexpr, KIND: tl.constexpr, GPU: tl.constexpr):
    amax = tl.zeros((xs[0].shape[0],), dtype=tl.float32)
    for p in tl.static_range(P):
        xe, xo, _, _ = _unpack(xs[p], KIND)
        amax = tl.maximum(amax, _finite_amax(xe, xo, GPU))
    return amax


@triton.jit
def _pieces_absmax(xs, P: tl.constexpr, KIND: tl.constexpr):
    """max |x| of each block ignoring NaN but not +-Inf (GPU: one NaN-ignoring max per value)."""
    amax = tl.zeros((xs[0].shape[0],), dtype=tl.float32)
    for p in tl.static_range(P):
        xe, xo, _, _ = _unpack(xs[p], KIND)
        amax = tl.maximum(amax, tl.max(tl.maximum(tl.abs(xe), tl.abs(xo)), axis=1))
    return amax


@triton.jit
def _div6(a):
    """RN(a / 6) for finite a >= 2^-125 (or 0): q = a * RN(1/6), then one exact-residual correction. Checked
    against the correctly rounded quotient for every fp32 a in [2^-125, max] and 0 (a smaller nonzero a can
    differ: its quotient is subnormal)."""
    q = a * 0.16666667
    return tl.fma(tl.fma(q, -6.0, a), 0.16666667, q)


@triton.jit
def _group_max(v, RB: tl.constexpr):
    """[BR] -> [BR]: the max over each group of RB consecutive entries, at every entry of the group (RB = 1: v;
    the row layout's block amax, a reduction across the RB neighbouring threads of a block)."""
    if RB == 1:
        return v
    else:
        m = tl.max(tl.reshape(v, (v.shape[0] // RB, RB)), axis=1)
        return tl.reshape(tl.broadcast_to(m[:, None], (v.shape[0] // RB, RB)), (v.shape[0],))


@triton.jit
def _slow_amax(amax):
    """1 (int32) where a block's NaN-ignoring max |x| needs the exact path: +-Inf, or in (0, 2^-125) (`_div6`)."""
    return ((amax == float("inf")) | ((amax > 0.0) & (amax < 2.350988701644575e-38))).to(tl.int32)


@triton.jit
def _block_amax_q(xs, P: tl.constexpr, KIND: tl.constexpr, IS_NV: tl.constexpr, GPU: tl.constexpr,
                  RB: tl.constexpr = 1):
    """(amax, RN(amax / 6) for NVFP4 (else amax)) of each block of a tile. On GPU, a tile with no +-Inf and no
    block amax in (0, 2^-125) (the common case, decided once per tile: a uniform branch) takes the fast path:
    the plain NaN-ignoring max and `_div6`; otherwise the finite max and a correctly rounded division."""
    if GPU:
        amax = _group_max(_pieces_absmax(xs, P, KIND), RB)
        if tl.max(_slow_amax(amax), axis=0) != 0:
            amax = _group_max(_pieces_amax(xs, P, KIND, GPU), RB)
            q = tl.math.div_rn(amax, 6.0)
        else:
            q = _div6(amax)
    else:
        amax = _group_max(_pieces_amax(xs, P, KIND, GPU), RB)
        q = tl.math.div_rn(amax, 6.0)
    return amax, q


@triton.jit
def _halves(xs, P: tl.constexpr):
    """The pieces of the pair layout's two blocks: (pieces 0 .. P/2 - 1, pieces P/2 .. P - 1) of a tuple of P."""
    if P == 2:
        return (xs[0],), (xs[1],)
    elif P == 4:
        return (xs[0], xs[1]), (xs[2], xs[3])
    else:
        return (xs[0], xs[1], xs[2], xs[3]), (xs[4], xs[5], xs[6], xs[7])


@triton.jit
def _pair_amax_q(xs, P: tl.constexpr, KIND: tl.constexpr, GPU: tl.constexpr):
    """`_block_amax_q` of the two blocks of each thread in the pair layout (P pieces, P/2 per block): (amax, q) of
    the first and of the second block, with one tile-wide branch for both."""
    xa, xb = _halves(xs, P)
    if GPU:
        aa = _pieces_absmax(xa, P // 2, KIND)
        ab = _pieces_absmax(xb, P // 2, KIND)
        if tl.max(_slow_amax(aa) | _slow_amax(ab), axis=0) != 0:
            aa = _pieces_amax(xa, P // 2, KIND, GPU)
            ab = _pieces_amax(xb, P // 2, KIND, GPU)
            qa = tl.math.div_rn(aa, 6.0)
            qb = tl.math.div_rn(ab, 6.0)
        else:
            qa = _div6(aa)
            qb = _div6(ab)
    else:
        aa = _pieces_amax(xa, P // 2, KIND, GPU)
        ab = _pieces_amax(xb, P // 2, KIND, GPU)
        qa = tl.math.div_rn(aa, 6.0)
        qb = tl.math.div_rn(ab, 6.0)
    return aa, qa, ab, qb


# ---------------------------------------------------------------------------------------------------------
# block scales
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _round_mag(a, CB_MIN: tl.constexpr, SHIFT: tl.constexpr):
    """(t, cn): t = a + C rounded to nearest (even), C = 2^SHIFT * 2^max(e, e_min) with 2^e <= a (e_min from
    CB_MIN, the fp32 bits of 2^e_min), cn = -C * 2^-126 (fp32). (t - C) = a rounded to SHIFT - 23 fewer
    mantissa bits than C's, i.e. to the grid ulp(C); a >= 0 finite."""
    e = a.to(tl.uint32, bitcast=True) & 0x7F800000
    # bits of -2^-126 * 2^SHIFT * 2^e: exponent shifted by SHIFT - 126, sign bit set (wraps mod 2^32)
    d = (SHIFT - 126) * 8388608 + 2147483648
    cn = tl.maximum(e + d, CB_MIN + d).to(tl.float32, bitcast=True)  # no wrap: e + d < 2^32
    t = tl.fma(cn, -(2.0**126), a)
    return t, cn


@triton.jit
def _nv_own_scale(q, g, inv_g):
    """(scale byte int32, s, r) of NVFP4 blocks from q = RN(amax / 6): s = e4m3_rne(clamp(q / g, 2^-9, 448)),
    r = (1 / g) / s. E4M3 rounding: 3 mantissa bits above 2^-6, grid 2^-9 below (C = 2^20 * 2^max(e, -6))."""
    t = tl.math.div_rn(q, g)
    t = tl.minimum(t, 448.0)  # NaN-free: amax finite, g positive
    tt, cn = _round_mag(t, 0x3C800000, 20)
    s = tl.maximum(tl.fma(cn, 2.0**126, tt), 0.001953125)  # (t + C) - C, then the clamp up to 2^-9
    sbyte = ((s * 7.52316384526264e-37).to(tl.int32, bitcast=True) >> 20)  # bits of s * 2^-120 >> 20
    return sbyte, s, tl.math.div_rn(inv_g, s)


@triton.jit
def _lsb_scale_byte(q, g, lsb):
    """Scale hints (NVFP4): the E4M3 byte (int32, in [1, 126]) of each block from q = RN(amax / 6) and the stored
    bit ``lsb`` (int32 0/1): t = clamp(q / g, 2^-9, 448); of b = min(floor(w(t)), 125) and b + 1, the one whose LSB
    is ``lsb``. floor(w(t)) on t's bits: ((exponent - 120) << 3) | top 3 mantissa bits from 2^-6 up, floor(512 t)
    below (`reference.e4m3_floor_byte`)."""
    t = tl.maximum(tl.minimum(tl.math.div_rn(q, g), 448.0), 0.001953125)
    bits = t.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - 120) << 3) | ((bits >> 20) & 7)
    sub = (t * 512.0).to(tl.int32)  # exact, truncated: t * 2^9 in [1, 8)
    b = tl.minimum(tl.where(t >= 0.015625, normal, sub), 125)
    return tl.where((b & 1) == lsb, b, b + 1)


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
def _own_scale(xs, g, inv_g, P: tl.constexpr, KIND: tl.constexpr, IS_NV: tl.constexpr, RCEIL: tl.constexpr,
               GPU: tl.constexpr, RB: tl.constexpr = 1):
    """(scale byte int32, s, r) of each block of a tile from its values: v = x * r (row layout, RB > 1: of each
    row, from the amax of its block's RB rows)."""
    amax, q = _block_amax_q(xs, P, KIND, IS_NV, GPU, RB)
    return _scale_of(amax, q, g, inv_g, IS_NV, RCEIL)


@triton.jit
def _scale_of(amax, q, g, inv_g, IS_NV: tl.constexpr, RCEIL: tl.constexpr):
    """(scale byte int32, s, r) of blocks from their amax and q = RN(amax / 6) (NVFP4)."""
    if IS_NV:
        sbyte, s, r = _nv_own_scale(q, g, inv_g)
    else:
        e = _mx_exponent(amax, RCEIL)
        sbyte = e + 127
        s = _pow2(e)
        r = _pow2(-e)
    return sbyte, s, r


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
def _given_scale(sbyte, inv_g, IS_NV: tl.constexpr):
    """(|s|, r, flip) from given scale bytes (int32): |s| the decoded scale's magnitude (NaN for a NaN byte),
    r with v = x * r, flip = 1 << 31 for a negative scale (E4M3 bytes >= 0x80; E8M0 has no sign), else 0."""
    if IS_NV:
        s = _e4m3_decode(sbyte)
        r = tl.math.div_rn(inv_g, s)
        return tl.abs(s), r, (sbyte & 0x80) << 24
    else:
        e = sbyte - 127
        s = tl.where(sbyte == 255, float("nan"), _pow2(tl.minimum(tl.maximum(e, -127), 127)))
        r = tl.where(sbyte == 255, float("nan"), _pow2(tl.minimum(tl.maximum(-e, -127), 127)))
        return s, r, tl.zeros_like(sbyte)


@triton.jit
def _global(g_ptr, IS_NV: tl.constexpr):
    """(g, 1/g) of the launch (NVFP4: loaded once per program; MXFP4: 1)."""
    if IS_NV:
        g = tl.load(g_ptr)
        return g, tl.math.div_rn(1.0, g)
    else:
        return 1.0, 1.0


# ---------------------------------------------------------------------------------------------------------
# per-value rounding
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _clamp6(a, GPU: tl.constexpr):
    """min(a, 6) with NaN -> 6 (code 7, as the reference codes a NaN product)."""
    if GPU:
        return tl.minimum(a, 6.0)  # the hardware min returns the non-NaN operand
    else:
        return tl.where(a < 6.0, a, 6.0)


@triton.jit
def _code_bits(x, r, GPU: tl.constexpr):
    """code << 22 (int32; the fp32 bits of E2M1[code] * 2^-126) of the magnitude code of x * r: round to
    nearest on the ladder, ties to the even code, saturating at 6; NaN -> 7. x fp32, r broadcast to x."""
    t, cn = _round_mag(_clamp6(tl.abs(x * r), GPU), 0x3F800000, 22)  # |x * r| == |x| * r
    return tl.fma(t, 2.0**-126, cn).to(tl.int32, bitcast=True)


@triton.jit
def _rtn_value(x, r, GPU: tl.constexpr):
    """(E2M1 magnitude value rho of x * r (fp32; NaN product -> 6), code << 22) for round to nearest."""
    t, cn = _round_mag(_clamp6(tl.abs(x * r), GPU), 0x3F800000, 22)
    rho = tl.fma(cn, 2.0**126, t)  # t - C, exact
    return rho, (rho * 2.0**-126).to(tl.int32, bitcast=True)


@triton.jit
def _hint_value(x, r, hint, GPU: tl.constexpr):
    """E2M1 magnitude value of hint-guided rounding of x * r (fp32): of the two ladder values bracketing
    a = min(|x * r|, 6) (k = #{ladder m <= a} over 0.5 .. 4), the one whose code has LSB == hint (bit 0 of
    hint); a NaN product counts as k = 0 (as the reference's comparisons do)."""
    v = tl.abs(x * r)
    if GPU:
        # max first (the hardware max returns the non-NaN operand: NaN -> 0), then the clamp just below 6 so
        # that a = 6 counts as k = 6 (floor index 2 of the step-2 range [4, 8))
        a = tl.minimum(tl.maximum(v, 0.0), 5.9999995)
        e = a.to(tl.uint32, bitcast=True) & 0x7F800000
        c = tl.maximum(e, 0x3F800000).to(tl.float32, bitcast=True)  # 2^max(e, 0)
        t = libdevice.add_rz(a, c * 4194304.0)  # C + floor(a / ulp(C)) * ulp(C), C = c * 2^22
        tb = t.to(tl.int32, bitcast=True)
        tb = tb + ((tb ^ hint) & 1)  # up to the neighbour with the hint's parity (k and m have equal parity)
        return tl.fma(c, -4194304.0, tb.to(tl.float32, bitcast=True))  # t - C, exact
    else:
        b = tl.where(v == v, tl.minimum(v.to(tl.int32, bitcast=True), 0x40BFFFFF), 0)  # NaN -> k = 0
        hb = hint & 1
        hi = (b & -4194304) + ((((b >> 22) ^ hb) & 1) << 22)  # -4194304 == 0xFFC00000
        lo = tl.where(hb == 1, 0x3F000000, tl.where(b >= 0x3F000000, 0x3F800000, 0))
        return tl.where(b >= 0x3F800000, hi, lo).to(tl.float32, bitcast=True)


@triton.jit
def _nan_probe(x):
    """+0.0 for non-NaN x (Inf included), NaN for NaN x (one min with a free abs modifier)."""
    return tl.minimum(tl.abs(x), 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _scaled(mag, s, g, x, IS_NV: tl.constexpr):
    """(mag * s) * g for s >= 0 (or NaN), NaN where x is NaN: the NaN probe (+0 otherwise) is the addend of the
    last multiply, which changes no value of a non-negative product."""
    if IS_NV:
        return tl.fma(mag * s, g, _nan_probe(x))
    else:
        return mag * s + _nan_probe(x)


# ---------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _gather_hint_bits(word):
    """Bits 0, 4, ..., 28 of a 32-bit word of 8 codes -> bits 0..7 (the hint byte). Multiplications by
    (1 + 2^3), (1 + 2^6), (1 + 2^12) bring the bits together without carries (every partial product lands on a
    distinct bit) and run on the FMA pipe: 3 multiplies and 4 logic ops instead of 7 logic ops."""
    t = (word & 0x11111111) * 9 & 0x18181818  # (i, i+1) pairs at bits 8k+3, 8k+4
    t = (t * 65) & 0x1E001E00  # nibbles i0..i3 at bits 9..12, i4..i7 at 25..28
    return ((t * 4097) >> 21) & 0xFF  # i0..i7 at bits 21..28


@triton.jit
def _hint_nibbles(word):
    """The hint bits of a word of 8 codes (uint32) as two nibbles: codes 0..3 at bits 12..15, codes 4..7 at 28..31,
    every other bit 0. (word & 0x11111111) * (2^3 + 2^6 + 2^9 + 2^12) puts bit 4i at 4i + 3, 4i + 6, 4i + 9,
    4i + 12: four distinct residues mod 4, so no two partial products share a bit (no carries), and bit 12 + j
    (28 + j) is code j's (4 + j's) bit 0 shifted by 12 - 3j. 2 ops (one on the FMA pipe) and the mask."""
    return ((word.to(tl.uint32, bitcast=True) & 0x11111111) * 4680) & 0xF000F000


@triton.jit
def _hint_bytes2(w0, w1):
    """The two hint bytes of 16 codes (words w0, w1) in bits 0..15 (w0's byte first; bits 16.. are garbage, cut
    by the 16-bit store): w1's nibbles at 12..15, 28..31 and w0's moved to 4..7, 20..23, then one high multiply by
    (1 + 2^12) << 16 moves each low nibble next to its high one (no two partial products share a bit) and the
    16 bits down. 8 ops for 16 codes instead of 16 (`_gather_hint_bits` twice and their merge)."""
    x = _hint_nibbles(w1) | (_hint_nibbles(w0) >> 8)
    return tl.umulhi(x, 0x10010000)


@triton.jit
def _hint_byte1(w0):
    """The hint byte of 8 codes (word w0) in bits 0..7 (bits 8.. are garbage, cut by the 8-bit store)."""
    return tl.umulhi(_hint_nibbles(w0), 0x100100)


@triton.jit
def _store_hints_x4(hints_ptr, start, bmask, h):
    """HPACK 2: the 16-bit hints h [BN] of blocks start .. start + BN - 1 stored as one int64 per 4 consecutive blocks
    (hints_ptr: int64 view; the launcher takes it for a block count divisible by 4 only, so a group is all valid or
    all masked): a sum across each 4 neighbouring threads (warp shuffles), then one 8-byte store per group."""
    h4 = tl.reshape((h & 0xFFFF).to(tl.int64), (h.shape[0] // 4, 4))
    w = tl.sum(h4 << (16 * tl.arange(0, 4)).to(tl.int64)[None, :], axis=1)
    m = tl.max(tl.reshape(bmask.to(tl.int32), (h.shape[0] // 4, 4)), axis=1) != 0
    tl.store(hints_ptr + start // 4 + tl.arange(0, h.shape[0] // 4), w, mask=m)


@triton.jit
def _piece_word(cbe, cbo, se, so, SH0: tl.constexpr, SIGNS: tl.constexpr):
    """Codes of a piece (code << 22 bits of the even/odd elements [BN, J], sign carriers with the sign at bit
    31) packed as nibbles from bit SH0 on: element 2j at nibble 2j, 2j+1 at nibble 2j+1 (int32 [BN]); without
    SIGNS the sign bits are left 0.

    A code at bit 22 moves to bit s by a high multiply by 2^(10 + s) (s <= 20) or a multiply by 2^(s - 22)
    (s >= 24), each one multiply-add on the FMA pipe; a sign moves from bit 31 to bit s + 3 by a shift and a
    masked OR."""
    j = tl.arange(0, cbe.shape[1])[None, :]
    sh_e = 8 * j + SH0
    sh_o = sh_e + 4
    ce = tl.where(sh_e <= 20, tl.umulhi(cbe, 1 << (10 + tl.minimum(sh_e, 20))), cbe << tl.maximum(sh_e - 22, 0))
    co = tl.where(sh_o <= 20, tl.umulhi(cbo, 1 << (10 + tl.minimum(sh_o, 20))), cbo << tl.maximum(sh_o - 22, 0))
    if SIGNS:
        sgn_e = (se.to(tl.uint32, bitcast=True) >> (28 - sh_e)).to(tl.int32, bitcast=True) & (8 << sh_e)
        sgn_o = (so.to(tl.uint32, bitcast=True) >> (28 - sh_o)).to(tl.int32, bitcast=True) & (8 << sh_o)
        return tl.sum((ce + co) | (sgn_e | sgn_o), axis=1)
    else:
        return tl.sum(ce + co, axis=1)


@triton.jit
def _prmt(a, b, SEL: tl.constexpr):
    """PTX prmt.b32 (byte permute; a selector nibble with bit 3 set replicates the byte's sign bit)."""
    return tl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [a, b], dtype=tl.int32,
                                     is_pure=True, pack=1)


@triton.jit
def _bf16_sign_nibbles(word, raw):
    """word | the sign bits of the 8 bf16 values of a piece of 4 words [BN, 4] at bits 3, 7, ..., 31 (value i
    at bit 4i + 3; word j holds values 2j (bit 15) and 2j + 1 (bit 31)): byte-sign replication with prmt puts
    0x00/0xFF per value (4 prmt), two masked ORs keep bits 3 and 7 of each byte: 6 ops per 8 values."""
    w02, w13 = tl.split(tl.reshape(raw, (raw.shape[0], 2, 2)))
    w0, w2 = tl.split(w02)
    w1, w3 = tl.split(w13)
    a = _prmt(w0, w1, 0xFBD9)  # sign bytes of values 0, 2, 1, 3 (selectors: a.b1, b.b1, a.b3, b.b3, replicated)
    b = _prmt(w2, w3, 0xFBD9)  # values 4, 6, 5, 7
    ev = _prmt(a, b, 0x5410)  # values 0, 2, 4, 6
    od = _prmt(a, b, 0x7632)  # values 1, 3, 5, 7
    return word | (ev & 0x08080808) | (od & -2139062144)  # 0x80808080


@triton.jit
def _store_codes(codes_ptr, hints_ptr, blk, bmask, words, G: tl.constexpr, EMIT_HINTS: tl.constexpr,
                 HPACK: tl.constexpr = 0, start=0):
    """Store the G code words of each block (codes_ptr: int64 view, G/2 per block) and its hint bytes
    (hints_ptr: int16 (G = 2) or int32 (G = 4) view, one per block). HPACK: how the hint bits are gathered (0:
    `_gather_hint_bits` per word, 1: `_hint_bytes2` per two words; 2: as 1, stored 4 blocks per thread by
    `_store_hints_x4`, G = 2 only, hints_ptr an int64 view); the same bits."""
    if G == 1:  # the row layout: one word (codes_ptr: int32 view) and one hint byte (uint8) per row
        tl.store(codes_ptr + blk, words[0], mask=bmask)
        if EMIT_HINTS:
            if HPACK == 1:
                tl.store(hints_ptr + blk, _hint_byte1(words[0]).to(tl.uint8), mask=bmask)
            else:
                tl.store(hints_ptr + blk, _gather_hint_bits(words[0]).to(tl.uint8), mask=bmask)
    elif G == 2:
        w01 = words[0].to(tl.uint32, bitcast=True).to(tl.int64) | (words[1].to(tl.int64) << 32)
        tl.store(codes_ptr + blk, w01, mask=bmask)
        if EMIT_HINTS:
            if HPACK == 2:
                _store_hints_x4(hints_ptr, start, bmask, _hint_bytes2(words[0], words[1]).to(tl.int32, bitcast=True))
            else:
                if HPACK == 1:
                    h = _hint_bytes2(words[0], words[1])
                else:
                    h = _gather_hint_bits(words[0]) | (_gather_hint_bits(words[1]) << 8)
                tl.store(hints_ptr + blk, h.to(tl.int16), mask=bmask)
    else:
        w01 = words[0].to(tl.uint32, bitcast=True).to(tl.int64) | (words[1].to(tl.int64) << 32)
        w23 = words[2].to(tl.uint32, bitcast=True).to(tl.int64) | (words[3].to(tl.int64) << 32)
        tl.store(codes_ptr + 2 * blk, w01, mask=bmask)
        tl.store(codes_ptr + 2 * blk + 1, w23, mask=bmask)
        if EMIT_HINTS:
            if HPACK == 1:
                h = ((_hint_bytes2(words[0], words[1]) & 0xFFFF) | (_hint_bytes2(words[2], words[3]) << 16))
                h = h.to(tl.int32, bitcast=True)
            else:
                h = (_gather_hint_bits(words[0]) | (_gather_hint_bits(words[1]) << 8)
                     | (_gather_hint_bits(words[2]) << 16) | (_gather_hint_bits(words[3]) << 24))
            tl.store(hints_ptr + blk, h, mask=bmask)


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
def _bf16_bits(y, GPU: tl.constexpr):
    """bf16 bits (RNE) of fp32 y in the low 16 bits of an int32."""
    if GPU:
        b = y.to(tl.bfloat16)
    else:
        b = _to_bf16_rne(y)
    return b.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _bf16x2(lo, hi, GPU: tl.constexpr):
    """int32 word of two bf16 (RNE): lo in bits 0..15, hi in 16..31 (one cvt.rn.bf16x2.f32 on GPU)."""
    if GPU:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return _bf16_bits(lo, GPU) | (_bf16_bits(hi, GPU) << 16)


@triton.jit
def _out_piece(ye, yo, raw, se, so, flip, KIND: tl.constexpr, GPU: tl.constexpr):
    """The output piece (the store layout of the input piece) from ye, yo = (E2M1 * |s|) * g >= 0 (or NaN) of the
    even/odd elements: the sign bit of x, XOR the sign of the block scale (flip: int32 [BN, 1], 0 or 1 << 31;
    or 0), flips the sign bit of y after the cast (the RNE cast is symmetric)."""
    if KIND == 0:
        # one word per pair: both halves, then the two sign bits at once (raw: the input word)
        flipw = flip | ((flip >> 16) & 32768)
        return _bf16x2(ye, yo, GPU) ^ ((raw ^ flipw) & -2147450880)  # 0x80008000
    elif KIND == 1:
        ve = (ye.to(tl.int32, bitcast=True) ^ ((se ^ flip) & -2147483648)).to(tl.float32, bitcast=True)
        vo = (yo.to(tl.int32, bitcast=True) ^ ((so ^ flip) & -2147483648)).to(tl.float32, bitcast=True)
        out = tl.join(ve.to(tl.float16), vo.to(tl.float16))
        return tl.reshape(out, (raw.shape[0], raw.shape[1]))
    else:
        ve = (ye.to(tl.int32, bitcast=True) ^ ((se ^ flip) & -2147483648)).to(tl.float32, bitcast=True)
        vo = (yo.to(tl.int32, bitcast=True) ^ ((so ^ flip) & -2147483648)).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(ve, vo), (raw.shape[0], raw.shape[1]))


@triton.jit
def _store_piece(out_ptr, blk, bmask, p: tl.constexpr, P: tl.constexpr, K: tl.constexpr, val):
    tl.store(out_ptr + _piece_offsets(blk, p, P, K), val, mask=bmask[:, None])


# ---------------------------------------------------------------------------------------------------------
# margin marks (`tracefp4.margin`, NUMERICS §12): shared with `tracefp4.triton_margin`, and fused into the
# rollout's capture (`quantize_fake` with ``marks``)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _t_fields(t):
    """(fb, F23) int32 of a block's t = RN(RN(amax / 6) / g) before its clamp to [2^-9, 448]
    (tracefp4.margin.scale_fields): fb = floor(w(t)) and F23 = 2^23 frac(w(t)) from t's bits."""
    t = tl.minimum(tl.maximum(t, 0.001953125), 448.0)
    bits = t.to(tl.int32, bitcast=True)
    e = bits >> 23
    m = bits & 0x7FFFFF
    sh = tl.minimum(e - 118, 3)
    f23 = (m << sh) & 0x7FFFFF
    fb = tl.where(e >= 121, ((e - 120) << 3) | (m >> 20), (m | 0x800000) >> (23 - sh))
    return fb, f23


@triton.jit
def _own_byte(fb, f23):
    up = (f23 > 4194304) | ((f23 == 4194304) & ((fb & 1) == 1))  # 4194304 = 2^22: the E4M3 midpoint
    return fb + up.to(tl.int32)


@triton.jit
def _rtn_lsb(ab):
    """LSB of the round-to-nearest magnitude code from bits(|v|): parity of NUMERICS §3's boundary compares on the
    bits of 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5 (ties to the even code; NaN's bits pass all: code 7)."""
    n = ((ab > 0x3E800000).to(tl.int32) + (ab >= 0x3F400000).to(tl.int32) + (ab > 0x3FA00000).to(tl.int32)
         + (ab >= 0x3FE00000).to(tl.int32) + (ab > 0x40200000).to(tl.int32) + (ab >= 0x40600000).to(tl.int32)
         + (ab > 0x40A00000).to(tl.int32))
    return n & 1


@triton.jit
def _in_ranges(ab, thr):
    """bool: bits(|v|) ``ab`` (int32) in one of the 7 ranges of ``thr`` (L0, H0, .., L6, H6, ...)."""
    return (((ab >= thr[0]) & (ab <= thr[1])) | ((ab >= thr[2]) & (ab <= thr[3])) | ((ab >= thr[4]) & (ab <= thr[5]))
            | ((ab >= thr[6]) & (ab <= thr[7])) | ((ab >= thr[8]) & (ab <= thr[9]))
            | ((ab >= thr[10]) & (ab <= thr[11])) | ((ab >= thr[12]) & (ab <= thr[13])))


@triton.jit
def _value_mark(x, r, cb, thr):
    """int32 0/1 [BN, J]: value x (fp32) with its block's r marked (`tracefp4.margin_marks`): bits(|x * r|) in one
    of the 7 ranges of ``thr`` (L0, H0, .., L6, H6), or the code's LSB (cb = code << 22) not the RTN LSB."""
    ab = (x * r).to(tl.int32, bitcast=True) & 0x7FFFFFFF
    return (_in_ranges(ab, thr) | (_rtn_lsb(ab) != ((cb >> 22) & 1))).to(tl.int32)


@triton.jit
def _mark_word(me, mo, SH0: tl.constexpr):
    """int32 [BN]: the marks (0/1 [BN, J]) of a piece's even / odd values at bit 0 of their code nibbles (as
    `_piece_word` lays out codes from bit SH0), so that `_gather_hint_bits` packs them as hint bits."""
    sh_e = 8 * tl.arange(0, me.shape[1])[None, :] + SH0
    return tl.sum((me << sh_e) | (mo << (sh_e + 4)), axis=1)


@triton.jit
def _store_block_marks(bm_ptr, start, q, sbyte, g, KS, BN: tl.constexpr, NBYTES):
    """Block marks of the tile's BN blocks (from `start`, a multiple of 8) into bytes start / 8 ..: |F23 - 2^22| < KS
    of t = RN(q / g) (q = RN(amax / 6)), or the block's byte not its own."""
    fb, f23 = _t_fields(tl.math.div_rn(q, g))
    bits = ((tl.abs(f23 - 4194304) < KS) | (_own_byte(fb, f23) != sbyte)).to(tl.int32)
    byte = tl.sum(tl.reshape(bits, (BN // 8, 8)) << tl.arange(0, 8)[None, :], axis=1)
    idx = start // 8 + tl.arange(0, BN // 8)
    tl.store(bm_ptr + idx, byte.to(tl.uint8), mask=idx < NBYTES)


# ---------------------------------------------------------------------------------------------------------
# tiles
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _quantize_tile(xs, start, blk, bmask, codes_ptr, scales_ptr, hints_ptr, fq_ptr, g, inv_g,
                   P: tl.constexpr, K: tl.constexpr, KIND: tl.constexpr, IS_NV: tl.constexpr,
                   RCEIL: tl.constexpr, EMIT_HINTS: tl.constexpr, FAKE: tl.constexpr, GPU: tl.constexpr,
                   RB: tl.constexpr, HPACK: tl.constexpr, PAIR: tl.constexpr, MARKS: tl.constexpr = False,
                   vm_ptr=None, bm_ptr=None, thr=None, NBYTES=0):
    """Quantize one tile of BN blocks (pieces xs); with FAKE also store the round-to-nearest fake-quantized
    values (fq_ptr, the input's layout). RB > 1: the row layout (P = 1: blk are rows, RB rows per block; bf16 and
    fp16 only, whose row is one code word). PAIR: the pair layout (NVFP4; blk are pairs of consecutive blocks, P
    pieces per pair, the first P/2 of its first block): a thread stores a pair's 16 code bytes, 4 hint bytes and 2
    scale bytes (scales_ptr: int16 view, hints_ptr: int32 view). MARKS (NVFP4, block layout, BN a multiple of 8):
    also `tracefp4.margin_marks` of the tile at thresholds ``thr`` (L0, H0, .., L6, H6, KS): value marks as hint
    bytes at vm_ptr (int16 view, one per block), block marks as bits at bm_ptr (NBYTES bytes in all)."""
    if PAIR:
        aa, qa, ab, qb = _pair_amax_q(xs, P, KIND, GPU)
        sbyte, s, r = _scale_of(aa, qa, g, inv_g, IS_NV, RCEIL)
        sbyte_b, s_b, r_b = _scale_of(ab, qb, g, inv_g, IS_NV, RCEIL)
        tl.store(scales_ptr + blk, (sbyte | (sbyte_b << 8)).to(tl.int16), mask=bmask)
        r2_b = r_b[:, None]
        s2_b = s_b[:, None]
    else:
        amax, q = _block_amax_q(xs, P, KIND, IS_NV, GPU, RB)
        sbyte, s, r = _scale_of(amax, q, g, inv_g, IS_NV, RCEIL)
        if MARKS:
            _store_block_marks(bm_ptr, start, q, sbyte, g, thr[14], xs[0].shape[0], NBYTES)
        if RB == 1:
            tl.store(scales_ptr + blk, sbyte.to(tl.uint8), mask=bmask)
        else:
            tl.store(scales_ptr + blk // RB, sbyte.to(tl.uint8), mask=bmask & (blk % RB == 0))
        r2_b = r[:, None]
        s2_b = s[:, None]
    r2 = r[:, None]
    s2 = s[:, None]
    # KIND 2 (fp32): a piece holds 4 values (half a code word); else 8 (one word)
    w0 = tl.zeros_like(blk).to(tl.int32)
    w1 = tl.zeros_like(blk).to(tl.int32)
    w2 = tl.zeros_like(blk).to(tl.int32)
    w3 = tl.zeros_like(blk).to(tl.int32)
    m0 = tl.zeros_like(blk).to(tl.int32)  # MARKS: the value marks as words of hint bits (as w0, w1)
    m1 = tl.zeros_like(blk).to(tl.int32)
    for p in tl.static_range(P):
        xe, xo, se, so = _unpack(xs[p], KIND)
        if PAIR and p >= P // 2:  # the pair's second block
            rp = r2_b
            sp = s2_b
        else:
            rp = r2
            sp = s2
        if FAKE:
            rhoe, cbe = _rtn_value(xe, rp, GPU)
            rhoo, cbo = _rtn_value(xo, rp, GPU)
            # NaN products (not NaN x) were clamped to 6 above; code bits are <= 7 << 22 here
            ye = _scaled(rhoe, sp, g, xe, IS_NV)
            yo = _scaled(rhoo, sp, g, xo, IS_NV)
            _store_piece(fq_ptr, blk, bmask, p, P, K, _out_piece(ye, yo, xs[p], se, so, 0, KIND, GPU))
        else:
            cbe = _code_bits(xe, rp, GPU)
            cbo = _code_bits(xo, rp, GPU)
        if MARKS:
            mw = _mark_word(_value_mark(xe, rp, cbe, thr), _value_mark(xo, rp, cbo, thr),
                            (p % 2) * 16 if KIND == 2 else 0)
            if (p // 2 if KIND == 2 else p) == 0:
                m0 = m0 | mw
            else:
                m1 = m1 | mw
        if KIND == 0 and GPU:
            wp = _bf16_sign_nibbles(_piece_word(cbe, cbo, se, so, 0, False), xs[p])
        else:
            wp = _piece_word(cbe, cbo, se, so, (p % 2) * 16 if KIND == 2 else 0, True)
        gi = p // 2 if KIND == 2 else p
        if gi == 0:
            w0 = w0 | wp
        elif gi == 1:
            w1 = w1 | wp
        elif gi == 2:
            w2 = w2 | wp
        else:
            w3 = w3 | wp
    if MARKS:  # NVFP4: two words of hint bits per block
        tl.store(vm_ptr + blk, (_gather_hint_bits(m0) | (_gather_hint_bits(m1) << 8)).to(tl.int16), mask=bmask)
    if P == 1:
        _store_codes(codes_ptr, hints_ptr, blk, bmask, (w0,), 1, EMIT_HINTS, HPACK)
    elif P == 2 or (KIND == 2 and P == 4):
        _store_codes(codes_ptr, hints_ptr, blk, bmask, (w0, w1), 2, EMIT_HINTS, HPACK, start)
    else:
        _store_codes(codes_ptr, hints_ptr, blk, bmask, (w0, w1, w2, w3), 4, EMIT_HINTS, HPACK)


@triton.jit
def _fake_quant_pieces(xs, blk, bmask, out_ptr, s2, r2, g, flip, hb, P: tl.constexpr, K: tl.constexpr,
                       KIND: tl.constexpr, IS_NV: tl.constexpr, HAS_HINTS: tl.constexpr, GPU: tl.constexpr):
    for p in tl.static_range(P):
        xe, xo, se, so = _unpack(xs[p], KIND)
        if HAS_HINTS:
            # value 2j of the piece (J pairs) is value 2pJ + 2j of the block: hint bit 2pJ + 2j of hb
            sh = 2 * (p * xe.shape[1] + tl.arange(0, xe.shape[1])[None, :])
            me = _hint_value(xe, r2, hb[:, None] >> sh, GPU)
            mo = _hint_value(xo, r2, hb[:, None] >> (sh + 1), GPU)
        else:
            me, _ = _rtn_value(xe, r2, GPU)
            mo, _ = _rtn_value(xo, r2, GPU)
        ye = _scaled(me, s2, g, xe, IS_NV)
        yo = _scaled(mo, s2, g, xo, IS_NV)
        _store_piece(out_ptr, blk, bmask, p, P, K, _out_piece(ye, yo, xs[p], se, so, flip, KIND, GPU))


@triton.jit
def _fake_quant_tile(xs, blk, bmask, out_ptr, scales_ptr, hints_ptr, scales_out_ptr, g, inv_g, LSB_NBR,
                     P: tl.constexpr, K: tl.constexpr, KIND: tl.constexpr, IS_NV: tl.constexpr,
                     RCEIL: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_HINTS: tl.constexpr,
                     STORE_SCALES: tl.constexpr, GPU: tl.constexpr, G_PER: tl.constexpr, RB: tl.constexpr,
                     SCALE_LSB: tl.constexpr):
    """One tile of fake quantization; g, inv_g: fp32 scalars, or [BN] vectors (one per block, or row) with G_PER.
    RB > 1: the row layout (P = 1: blk are rows, RB rows per block; hints_ptr the uint8 hint bytes). SCALE_LSB
    (NVFP4): scales_ptr holds scale hints, rows of ceil(LSB_NBR / 8) bytes (LSB_NBR blocks per row); each block's
    byte comes from its own amax and its bit (`_lsb_scale_byte`)."""
    if HAS_SCALES:
        sidx = blk if RB == 1 else blk // RB  # the row layout: a block's RB rows read its byte RB times (L1)
        s, r, flip = _given_scale(tl.load(scales_ptr + sidx, mask=bmask, other=0).to(tl.int32), inv_g, IS_NV)
        flip = flip[:, None]
    else:  # the row layout: the block amax over its RB rows (threads)
        if SCALE_LSB:
            bi = blk if RB == 1 else blk // RB
            row = bi // LSB_NBR
            j = bi - row * LSB_NBR
            byte = tl.load(scales_ptr + row * ((LSB_NBR + 7) // 8) + j // 8, mask=bmask, other=0).to(tl.int32)
            _, q = _block_amax_q(xs, P, KIND, IS_NV, GPU, RB)
            sbyte = _lsb_scale_byte(q, g, (byte >> (j % 8)) & 1)
            s = _e4m3_decode(sbyte)
            r = tl.math.div_rn(inv_g, s)
        else:
            sbyte, s, r = _own_scale(xs, g, inv_g, P, KIND, IS_NV, RCEIL, GPU, RB)  # s > 0
        flip = 0
        if STORE_SCALES:
            if RB == 1:
                tl.store(scales_out_ptr + blk, sbyte.to(tl.uint8), mask=bmask)
            else:
                tl.store(scales_out_ptr + blk // RB, sbyte.to(tl.uint8), mask=bmask & (blk % RB == 0))
    if not HAS_HINTS:
        hb = 0
    elif RB == 1:
        hb = tl.load(hints_ptr + blk, mask=bmask, other=0).to(tl.int32)  # [BN]: the block's hint bits
    elif KIND == 2:  # a row of 4 fp32 values: half a hint byte
        hb = tl.load(hints_ptr + blk // 2, mask=bmask, other=0).to(tl.int32) >> ((blk % 2) * 4).to(tl.int32)
    else:
        hb = tl.load(hints_ptr + blk, mask=bmask, other=0).to(tl.int32)  # one hint byte per row
    if G_PER:
        gp = g[:, None]
    else:
        gp = g
    _fake_quant_pieces(xs, blk, bmask, out_ptr, s[:, None], r[:, None], gp, flip, hb, P, K, KIND, IS_NV,
                       HAS_HINTS, GPU)


# ---------------------------------------------------------------------------------------------------------
# kernels (PERSIST: grid = programs per SM x SMs, each looping over tiles with the next tile's loads in flight).
# NB and n_iter are not specialized on, so that one binary serves every size (and small data compiles it).
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def _first_tile(x_ptr, NB, BN: tl.constexpr, P: tl.constexpr, K: tl.constexpr, BIG: tl.constexpr):
    """(start, blocks, mask, pieces) of this program's first tile of BN blocks."""
    if BIG:
        start = tl.program_id(0).to(tl.int64) * BN
    else:
        start = tl.program_id(0) * BN
    blk, bmask = _blocks(start, NB, BN)
    return start, blk, bmask, _load_pieces(x_ptr, blk, bmask, P, K)


@triton.jit
def _next_tile(x_ptr, start, NB, BN: tl.constexpr, P: tl.constexpr, K: tl.constexpr):
    """(start, blocks, mask, pieces) of the tile after `start` in a persistent loop (the grid's stride): its loads
    are issued here, before the current tile is computed."""
    start += tl.num_programs(0) * BN
    blk, bmask = _blocks(start, NB, BN)
    return start, blk, bmask, _load_pieces(x_ptr, blk, bmask, P, K)


@triton.jit(do_not_specialize=["NB", "n_iter", *THRESHOLDS])
def _quantize_kernel(
    x_ptr, codes_ptr, scales_ptr, hints_ptr, fq_ptr, g_ptr, NB, n_iter,
    P: tl.constexpr, K: tl.constexpr, KIND: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr,
    RCEIL: tl.constexpr, EMIT_HINTS: tl.constexpr, FAKE: tl.constexpr, BIG: tl.constexpr,
    PERSIST: tl.constexpr, GPU: tl.constexpr, RB: tl.constexpr, HPACK: tl.constexpr = 0,
    PAIR: tl.constexpr = False, UNROLL: tl.constexpr = False, MARKS: tl.constexpr = False,
    vm_ptr=None, bm_ptr=None, L0=0, H0=0, L1=0, H1=0, L2=0, H2=0, L3=0, H3=0, L4=0, H4=0, L5=0, H5=0, L6=0, H6=0,
    KS=0,
):
    # RB > 1: the row layout (NB rows of one 16-byte piece each, P = 1, RB rows per block); PAIR: the pair layout
    # (NB pairs of consecutive blocks, P pieces per pair). UNROLL (with PERSIST): two tiles per trip, their pieces
    # in two register sets that trade roles, so that no trip copies the next tile's pieces into the current one's
    # registers (the plain loop ends each trip with a move per 4 loaded bytes)
    g, inv_g = _global(g_ptr, IS_NV)
    thr = (L0, H0, L1, H1, L2, H2, L3, H3, L4, H4, L5, H5, L6, H6, KS)  # MARKS' thresholds
    nbytes = NB // 8  # MARKS' block-mark bytes
    start, blk, bmask, xs = _first_tile(x_ptr, NB, BN, P, K, BIG)
    if PERSIST and UNROLL:
        for _ in range(n_iter // 2):
            cur = start  # (the tile's first block, for HPACK 2)
            start, nblk, nmask, nxs = _next_tile(x_ptr, start, NB, BN, P, K)
            _quantize_tile(xs, cur, blk, bmask, codes_ptr, scales_ptr, hints_ptr, fq_ptr, g, inv_g,
                           P, K, KIND, IS_NV, RCEIL, EMIT_HINTS, FAKE, GPU, RB, HPACK, PAIR,
                           MARKS, vm_ptr, bm_ptr, thr, nbytes)
            cur = start
            start, blk, bmask, xs = _next_tile(x_ptr, start, NB, BN, P, K)
            _quantize_tile(nxs, cur, nblk, nmask, codes_ptr, scales_ptr, hints_ptr, fq_ptr, g, inv_g,
                           P, K, KIND, IS_NV, RCEIL, EMIT_HINTS, FAKE, GPU, RB, HPACK, PAIR,
                           MARKS, vm_ptr, bm_ptr, thr, nbytes)
        if n_iter % 2 != 0:  # the last tile (no tile after it to load)
            _quantize_tile(xs, start, blk, bmask, codes_ptr, scales_ptr, hints_ptr, fq_ptr, g, inv_g,
                           P, K, KIND, IS_NV, RCEIL, EMIT_HINTS, FAKE, GPU, RB, HPACK, PAIR,
                           MARKS, vm_ptr, bm_ptr, thr, nbytes)
    else:
        for _ in range(n_iter if PERSIST else 1):
            cur = start
            if PERSIST:
                start, nblk, nmask, nxs = _next_tile(x_ptr, start, NB, BN, P, K)
            _quantize_tile(xs, cur, blk, bmask, codes_ptr, scales_ptr, hints_ptr, fq_ptr, g, inv_g,
                           P, K, KIND, IS_NV, RCEIL, EMIT_HINTS, FAKE, GPU, RB, HPACK, PAIR,
                           MARKS, vm_ptr, bm_ptr, thr, nbytes)
            if PERSIST:
                xs, blk, bmask = nxs, nblk, nmask


@triton.jit(do_not_specialize=["NB", "n_iter"])
def _fake_quant_kernel(
    x_ptr, out_ptr, scales_ptr, hints_ptr, g_ptr, scales_out_ptr, NB, n_iter, G_BLOCKS, LSB_NBR,
    P: tl.constexpr, K: tl.constexpr, KIND: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr,
    RCEIL: tl.constexpr, HAS_SCALES: tl.constexpr, HAS_HINTS: tl.constexpr, STORE_SCALES: tl.constexpr,
    BIG: tl.constexpr, PERSIST: tl.constexpr, GPU: tl.constexpr, G_PER: tl.constexpr, RB: tl.constexpr,
    SCALE_LSB: tl.constexpr = False,
):
    # G_PER: one global scale per G_BLOCKS consecutive blocks (a stack of matrices, each with its own g: block i
    # takes g_ptr[i // G_BLOCKS]); else one g for the launch. RB > 1: the row layout (NB rows, RB per block).
    if not G_PER:
        g, inv_g = _global(g_ptr, IS_NV)
    start, blk, bmask, xs = _first_tile(x_ptr, NB, BN, P, K, BIG)
    for _ in range(n_iter if PERSIST else 1):
        if PERSIST:
            start, nblk, nmask, nxs = _next_tile(x_ptr, start, NB, BN, P, K)
        if G_PER:
            g = tl.load(g_ptr + (blk if RB == 1 else blk // RB) // G_BLOCKS, mask=bmask, other=1.0)  # [BN]
            inv_g = tl.math.div_rn(1.0, g)
        _fake_quant_tile(xs, blk, bmask, out_ptr, scales_ptr, hints_ptr, scales_out_ptr, g, inv_g, LSB_NBR,
                         P, K, KIND, IS_NV, RCEIL, HAS_SCALES, HAS_HINTS, STORE_SCALES, GPU, G_PER, RB, SCALE_LSB)
        if PERSIST:
            xs, blk, bmask = nxs, nblk, nmask


@triton.jit
def _load_codes(codes_ptr, scales_ptr, blk, bmask, G: tl.constexpr, KIND: tl.constexpr, RB: tl.constexpr):
    """(code words [BN, G] int32 (one vector load per block), scale bytes [BN] int32) of a tile; the row layout
    (RB > 1, blk are rows): each row's word [BN] with its first value's code at nibble 0 (an fp32 row of 4 values is
    half a word) and its block's scale byte."""
    if RB == 1:
        words = tl.load(codes_ptr + blk[:, None] * G + tl.arange(0, G)[None, :], mask=bmask[:, None], other=0)
        return words, tl.load(scales_ptr + blk, mask=bmask, other=0).to(tl.int32)
    elif KIND == 2:
        word = tl.load(codes_ptr + blk // 2, mask=bmask, other=0) >> ((blk % 2) * 16).to(tl.int32)
        return word, tl.load(scales_ptr + blk // RB, mask=bmask, other=0).to(tl.int32)
    else:
        word = tl.load(codes_ptr + blk, mask=bmask, other=0)
        return word, tl.load(scales_ptr + blk // RB, mask=bmask, other=0).to(tl.int32)


@triton.jit
def _dequantize_tile(words, sbyte, blk, bmask, out_ptr, g, G: tl.constexpr,
                     P: tl.constexpr, K: tl.constexpr, KIND: tl.constexpr, IS_NV: tl.constexpr,
                     GPU: tl.constexpr, RB: tl.constexpr):
    """words [BN, G] (8 codes each), scale bytes [BN] -> out in the input-piece layout (the row layout, RB > 1:
    one word per row [BN] -> one piece per row)."""
    s, _, flip = _given_scale(sbyte, 1.0, IS_NV)  # r is not needed (the compiler drops its division)
    s2 = s[:, None]
    flip = flip[:, None]
    if RB > 1:
        _store_piece(out_ptr, blk, bmask, 0, 1, K, _dequantize_piece(words[:, None], 0, s2, g, flip, K, KIND, IS_NV,
                                                                        GPU))
    else:
        if G == 2:
            w0, w1 = tl.split(words)
            w2 = w0
            w3 = w1
        else:
            w02, w13 = tl.split(tl.reshape(words, (words.shape[0], 2, 2)))
            w0, w2 = tl.split(w02)
            w1, w3 = tl.split(w13)
        for p in tl.static_range(P):
            gi = p if KIND != 2 else p // 2
            if gi == 0:
                word = w0[:, None]
            elif gi == 1:
                word = w1[:, None]
            elif gi == 2:
                word = w2[:, None]
            else:
                word = w3[:, None]
            # fp32 pieces are half words: piece p starts at nibble (p % 2) * 4
            val = _dequantize_piece(word, (p % 2) * 4 if KIND == 2 else 0, s2, g, flip, K, KIND, IS_NV, GPU)
            _store_piece(out_ptr, blk, bmask, p, P, K, val)


@triton.jit
def _dequantize_piece(word, NIB0: tl.constexpr, s2, g, flip, K: tl.constexpr, KIND: tl.constexpr,
                      IS_NV: tl.constexpr, GPU: tl.constexpr):
    """One output piece (the store layout of an input piece, [BN, K]) from the code word [BN, 1] whose nibbles
    NIB0, NIB0 + 1, ... are its values' codes, |s| [BN, 1], g, flip [BN, 1] (or 0)."""
    if KIND == 0:
        jj = tl.arange(0, K)[None, :]  # pair index within the piece (bf16: K words = K pairs)
    else:
        jj = tl.arange(0, K // 2)[None, :]
    nib = NIB0 + 2 * jj  # nibble of value 2j of the piece
    ce = word >> (4 * nib)
    co = word >> (4 * nib + 4)
    # E2M1[c & 7] = float(bits (c & 7) << 22) * 2^126; then * |s|, * g
    me = ((ce & 7) << 22).to(tl.float32, bitcast=True) * 2.0**126
    mo = ((co & 7) << 22).to(tl.float32, bitcast=True) * 2.0**126
    if IS_NV:
        ye = (me * s2) * g
        yo = (mo * s2) * g
    else:
        ye = me * s2
        yo = mo * s2
    se = (ce & 8) << 28  # the code's sign bit at bit 31
    so = (co & 8) << 28
    if KIND == 0:
        raw = (se >> 16) & 32768 | so  # the sign bits where a bf16 word of x has them
    else:
        raw = tl.zeros((ye.shape[0], K), dtype=tl.int32)  # only its shape is used
    return _out_piece(ye, yo, raw, se, so, flip, KIND, GPU)


@triton.jit(do_not_specialize=["NB", "n_iter"])
def _dequantize_kernel(
    codes_ptr, scales_ptr, g_ptr, out_ptr, NB, n_iter,
    G: tl.constexpr, P: tl.constexpr, K: tl.constexpr, KIND: tl.constexpr, BN: tl.constexpr,
    IS_NV: tl.constexpr, BIG: tl.constexpr, PERSIST: tl.constexpr, GPU: tl.constexpr, RB: tl.constexpr,
):
    # RB > 1: the row layout (NB rows of one 16-byte output piece each, RB rows per block)
    if IS_NV:
        g = tl.load(g_ptr)
    else:
        g = 1.0
    pid = tl.program_id(0)
    if BIG:
        start = pid.to(tl.int64) * BN
    else:
        start = pid * BN
    blk, bmask = _blocks(start, NB, BN)
    words, sbyte = _load_codes(codes_ptr, scales_ptr, blk, bmask, G, KIND, RB)
    if PERSIST:
        step = tl.num_programs(0) * BN
        for _ in range(n_iter):
            start += step
            nblk, nmask = _blocks(start, NB, BN)
            nwords, nsbyte = _load_codes(codes_ptr, scales_ptr, nblk, nmask, G, KIND, RB)
            _dequantize_tile(words, sbyte, blk, bmask, out_ptr, g, G, P, K, KIND, IS_NV, GPU, RB)
            words = nwords
            sbyte = nsbyte
            blk = nblk
            bmask = nmask
    else:
        _dequantize_tile(words, sbyte, blk, bmask, out_ptr, g, G, P, K, KIND, IS_NV, GPU, RB)


@triton.jit
def _per_group(ptr, blk, G: tl.constexpr, BN: tl.constexpr, NB):
    """The block's byte for each of its G groups [BN, G], loaded flat with contiguity 1 so that the value lands
    in the thread that holds the group (no shuffle)."""
    gidx = blk[:, None] * G + tl.arange(0, G)[None, :]
    flat = tl.max_contiguous(tl.reshape(gidx, (BN * G,)), 1)
    fmask = tl.reshape(gidx < NB * G, (BN * G,))
    v = tl.load(ptr + flat // G, mask=fmask, other=0)
    return tl.reshape(v, (BN, G)).to(tl.int32)


@triton.jit(do_not_specialize=["NB"])
def _fake_quant_bwd_kernel(
    grad_ptr, x_ptr, scales_ptr, g_ptr, out_ptr, NB,
    G: tl.constexpr, BN: tl.constexpr, IS_NV: tl.constexpr, BIG: tl.constexpr,
):
    # coalesced [BN, B] tiles viewed as [BN, G, 8]; the per-block factor is computed per group
    pid = tl.program_id(0)
    if BIG:
        blk = pid.to(tl.int64) * BN + tl.arange(0, BN)
    else:
        blk = pid * BN + tl.arange(0, BN)
    bmask = blk < NB
    offs = blk[:, None] * (8 * G) + tl.arange(0, 8 * G)[None, :]  # [BN, B]
    m2 = bmask[:, None]
    grad = tl.reshape(tl.load(grad_ptr + offs, mask=m2, other=0.0), (BN, G, 8))
    x_in = tl.reshape(tl.load(x_ptr + offs, mask=m2, other=0.0), (BN, G, 8))
    if x_in.dtype == tl.bfloat16:
        # exact bf16 -> fp32 by the bits (the interpreter's conversion flushes the smallest subnormals)
        x = (x_in.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = x_in.to(tl.float32)
    _, inv_g = _global(g_ptr, IS_NV)
    _, r, _ = _given_scale(_per_group(scales_ptr, blk, G, BN, NB), inv_g, IS_NV)  # [BN, G]
    v = x * r[:, :, None]
    out = tl.where(tl.abs(v) > 6.0, tl.zeros_like(grad), grad)
    tl.store(out_ptr + offs, tl.reshape(out, (BN, 8 * G)), mask=m2)


@triton.jit
def _matrix_amax_kernel(bits_ptr, part_ptr, N, CHUNKS, INF_BITS: tl.constexpr, BLOCK: tl.constexpr,
                        ITERS: tl.constexpr):
    """Program (m, c): the largest finite |value| of chunk c (BLOCK * ITERS values) of matrix m, as the integer bits
    of the magnitude (non-negative floats order like their bits; +-Inf and NaN, whose magnitude bits are >= the
    Inf pattern, count as 0), into part[m, c] (int32). Bits, not floats: exact in the interpreter too."""
    m = tl.program_id(0)
    c = tl.program_id(1)
    base = m.to(tl.int64) * N
    start = c.to(tl.int64) * (BLOCK * ITERS)
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for i in tl.static_range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        raw = tl.load(bits_ptr + base + offs, mask=offs < N, other=0).to(tl.int32)
        mag = raw & (INF_BITS | (INF_BITS - 1))  # the sign bit cleared (INF_BITS - 1: every bit below the exponent)
        acc = tl.maximum(acc, tl.where(mag < INF_BITS, mag, 0))
    tl.store(part_ptr + m.to(tl.int64) * CHUNKS + c, tl.max(acc, axis=0))


@triton.jit
def _matrix_scales_kernel(part_ptr, g_ptr, CHUNKS, DT: tl.constexpr, CB: tl.constexpr, DENOM: tl.constexpr,
                          G_MIN: tl.constexpr, FALLBACK: tl.constexpr):
    """Program m: matrix m's amax from its chunks' bits (DT 0: bf16, 1: fp16, 2: fp32), then its dynamic NVFP4
    global scale ``max(RN(amax / DENOM), G_MIN)`` (FALLBACK when amax is 0), fp32, into g[m]."""
    m = tl.program_id(0)
    offs = tl.arange(0, CB)
    bits = tl.max(tl.load(part_ptr + m.to(tl.int64) * CHUNKS + offs, mask=offs < CHUNKS, other=0), axis=0)
    if DT == 0:
        amax = (bits << 16).to(tl.float32, bitcast=True)
    elif DT == 1:
        amax = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        amax = bits.to(tl.float32, bitcast=True)
    g = tl.maximum(tl.math.div_rn(amax, DENOM), G_MIN)
    tl.store(g_ptr + m, tl.where(amax > 0.0, g, FALLBACK))


# ---------------------------------------------------------------------------------------------------------
# launchers
# ---------------------------------------------------------------------------------------------------------
def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) of non-negative ints on the host (``triton.cdiv`` is a ConstexprFunction in Triton 3.9, whose call
    costs ~3 us of argument unwrapping: a launch computes two)."""
    return -(-a // b)


def _next_pow2(n: int) -> int:
    """The least power of two >= n (0 for n = 0), as ``triton.next_power_of_2``, without its call overhead."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


#: {device: an int32 [1] tensor on it}: the pointer argument a launch passes where its kernel reads nothing (a
#: constexpr flag turns the load off), allocated once per device instead of once per launch
_UNUSED: dict[torch.device, torch.Tensor] = {}


def _unused_arg(device: torch.device) -> torch.Tensor:
    """A tensor on ``device`` for a pointer argument the kernel never dereferences (never written either)."""
    t = _UNUSED.get(device)
    if t is None:
        t = _UNUSED[device] = torch.empty((1,), dtype=torch.int32, device=device)
    return t


def _loop_count(n_iter: int):
    """A persistent kernel's ``n_iter`` (its ``range`` bound) as a launch argument: the int itself when compiled (the
    kernels and their binaries do not change); under the interpreter a NumPy integer, which it passes to the kernel
    as it is. Triton 3.6's interpreter wraps a Python int argument into a shape-(1,) array and ``range`` takes its
    ``__index__``, ``int(array)``, which NumPy >= 2.4 refuses ("only 0-dimensional arrays can be converted to Python
    scalars"); Triton 3.9 squeezes the array first."""
    if not _interpreting():
        return n_iter
    import numpy as np

    return np.int64(n_iter)


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


#: (kernel, launch key) -> programs of that kernel that fit on one SM at once (from its register count; sm_90:
#: 64K registers, 64 warps, 32 blocks per SM; registers are allocated per warp in units of 256)
_RESIDENT: dict[tuple, int] = {}


def _note_residency(key: tuple, compiled, warps: int) -> None:
    """Record how many programs of a just-launched kernel fit on an SM (nothing under the interpreter)."""
    if key in _RESIDENT or compiled is None or not hasattr(compiled, "n_regs"):
        return
    regs_per_warp = -(-max(int(compiled.n_regs), 1) * 32 // 256) * 256
    _RESIDENT[key] = max(1, min(65536 // (regs_per_warp * warps), 64 // warps, 32))


def _grid(nb: int, bn: int, per_sm: int, device: torch.device, key: tuple) -> tuple[int, int, bool]:
    """(programs, loop iterations per program, persistent) for nb blocks in tiles of bn. Persistent: per_sm
    programs per SM; 32: as many as fit at once (known after the kernel's first launch), so that no program
    waits for another to finish (a few programs left for a second wave would double the time). Host-side
    numbers only (the SM count is cached per device): no device sync, usable in CUDA-graph capture."""
    tiles = _cdiv(nb, bn)
    if per_sm <= 0:
        return tiles, 1, False
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 2
    if per_sm >= 32:
        per_sm = min(per_sm, _RESIDENT.get(key, per_sm))
    progs = max(1, min(tiles, sms * per_sm))
    return progs, _cdiv(tiles, progs), True


def _load_view(xb: torch.Tensor, kind: int) -> torch.Tensor:
    """``xb`` as the kernels load it: bf16 (kind 0) as int32 pairs, fp16 and fp32 as they are."""
    return xb.view(torch.int32) if kind == 0 else xb


def _layout(xb: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(x viewed for the loads, pieces per block P, elements per piece K, kind) of a block view [NB, B]."""
    kind = _KIND[xb.dtype]
    b = xb.shape[1]
    p, k = (b // 8, 4) if kind == 0 else (b // 8, 8) if kind == 1 else (b // 4, 4)
    return _load_view(xb, kind), p, k, kind


def _g_arg(g: torch.Tensor | None, fmt: str, device: torch.device, unused: torch.Tensor) -> torch.Tensor:
    """The g_ptr argument: g as fp32 on `device`; for MXFP4 without g (the kernels never load g_ptr then) the
    tensor `unused`, already on the device, so that a launch allocates and fills nothing for it."""
    if g is None:
        if fmt == "nvfp4":
            raise FormatError("nvfp4 needs the global scale g (fp32 0-d tensor); got None")
        return unused
    if g.dtype == torch.float32 and g.dim() == 0 and g.device == device:
        return g  # what tracefp4.api passes (a 0-d tensor is contiguous): no view, no copy
    # tracefp4.api passes g on x's device already; a host g goes along without blocking (no host sync).
    return g.to(device=device, dtype=torch.float32, non_blocking=g.device.type == "cpu").contiguous()


def _big(t: torch.Tensor) -> bool:
    return t.numel() >= 2**31 - 2**20


def _per_block_view(t: torch.Tensor, nbytes_per_block: int) -> torch.Tensor:
    """View a contiguous uint8 tensor of `nbytes_per_block` (2 or 4) bytes per block as one int per block."""
    return t.view({2: torch.int16, 4: torch.int32}[nbytes_per_block])


def _is_rows(cfg: tuple | None) -> bool:
    """Whether a config asks for the row layout: ("rows", rows per program, num_warps, programs per SM)."""
    return bool(cfg) and cfg[0] == "rows"


def _is_pairs(cfg: tuple | None) -> bool:
    """Whether a config asks for the pair layout: ("pairs", pairs of blocks per program, num_warps, programs per
    SM); NVFP4 quantization (and quantize_fake) only."""
    return bool(cfg) and cfg[0] == "pairs"


def _fwd_cfg(config: tuple | None, key: str, dtype: torch.dtype, fmt: str) -> tuple[int, int, int, dict]:
    """(BN, num_warps, programs per SM, extra launch options) of a forward kernel. config: (BN, num_warps,
    programs per SM) or with a 4th element, a register cap per thread (0: none); ("rows", rows per program,
    num_warps, programs per SM): the row layout (every forward kernel but fp32 quantization, checked by the
    caller); ("pairs", pairs per program, num_warps, programs per SM): the pair layout (NVFP4 quantize and
    quantize_fake); None: `default_config`."""
    cfg = config or default_config(key, dtype, fmt)
    if _is_pairs(cfg):
        if key not in ("quantize", "quantize_fake") or fmt != "nvfp4":
            raise LaunchConfigError(f"the pair layout is for NVFP4 quantize and quantize_fake; got {key} {fmt}")
        if len(cfg) != 4 or not all(isinstance(v, int) and v >= 0 for v in cfg[1:]) or cfg[1] < 1 or cfg[2] < 1:
            raise LaunchConfigError(f"a pair-layout config is ('pairs', pairs per program, num_warps, programs per "
                                    f"SM); got {cfg}")
        return cfg[1], cfg[2], cfg[3], {}
    if _is_rows(cfg):
        if len(cfg) != 4 or not all(isinstance(v, int) and v >= 0 for v in cfg[1:]) or cfg[1] < 1 or cfg[2] < 1:
            raise LaunchConfigError(f"a row-layout config is ('rows', rows per program, num_warps, programs per SM); "
                                    f"got {cfg}")
        return cfg[1], cfg[2], cfg[3], {}
    if len(cfg) not in (3, 4):
        raise LaunchConfigError(f"a forward config is (blocks per program, num_warps, programs per SM[, max registers]); "
                         f"got {cfg}")
    opts = {"maxnreg": cfg[3]} if len(cfg) == 4 and cfg[3] and not _interpreting() else {}
    return cfg[0], cfg[1], cfg[2], opts


def _launch_quantize(xb, fmt, g, scale_rule, emit_hints, fake, config, key, scales_out=None, hints_out=None,
                     hint_pack=None, unroll=None, marks=None):
    """marks: (value marks uint8 [NB, 2], block marks uint8 [NB / 8], the 15 thresholds L0, H0, .., L6, H6, KS of
    `tracefp4.margin`) to fuse `margin_marks` into the launch (NVFP4; the block layout is used, the pair layout's
    bits being the same; a row-layout config or BN not a multiple of 8: LaunchConfigError)."""
    xb = xb.contiguous()
    nb, b = xb.shape
    dev = xb.device
    codes = torch.empty((nb, b // 2), dtype=torch.uint8, device=dev)
    # scales_out [NB] / hints_out [NB, B/8]: caller's contiguous uint8 buffers to write into (checked by the API)
    scales = torch.empty((nb,), dtype=torch.uint8, device=dev) if scales_out is None else scales_out
    hints = None
    if emit_hints:
        hints = torch.empty((nb, b // 8), dtype=torch.uint8, device=dev) if hints_out is None else hints_out
    out = torch.empty_like(xb) if fake else None
    if nb:
        cfg = config or default_config(key, xb.dtype, fmt)
        bn, warps, per_sm, opts = _fwd_cfg(cfg, key, xb.dtype, fmt)
        xv, p, k, kind = _layout(xb)
        rows = _is_rows(cfg)
        # an odd count of blocks (or caller's buffers not aligned for the int16 / int32 views) takes the block
        # layout: the same bits
        pair = (_is_pairs(cfg) and nb % 2 == 0 and scales.storage_offset() % 2 == 0
                and (hints is None or hints.storage_offset() % 4 == 0) and marks is None)
        if marks is not None and (rows or bn % 8 or fmt != "nvfp4" or nb % 8):
            raise LaunchConfigError(f"margin marks fuse into NVFP4 block-layout launches of BN % 8 == 0 over whole "
                                    f"bytes of blocks; got {fmt}, {cfg}, {nb} blocks")
        if rows and (kind == 2 or bn % p):
            raise LaunchConfigError(f"the row layout of {key} takes bf16 / fp16 input and rows per program divisible "
                                    f"by the {p} rows of a block; got {xb.dtype} and {cfg}")
        rb = p if rows else 1
        if (hint_pack or HINT_PACK) not in HINT_PACKS:
            raise LaunchConfigError(f"hint_pack is one of {HINT_PACKS}; got {hint_pack!r}")
        hpack = HINT_PACKS.index(hint_pack or HINT_PACK)
        if hpack == 2 and (rows or pair or b // 8 != 2 or nb % 4 or bn % 4 or hints is None
                           or hints.storage_offset() % 8):
            hpack = 1  # the 8-byte hint stores need 2-byte hints per block and whole groups of 4 blocks
        consts = dict(P=1 if rows else (2 * p if pair else p), K=k, KIND=kind, BN=bn, IS_NV=fmt == "nvfp4",
                      RCEIL=scale_rule == "rceil", EMIT_HINTS=emit_hints, FAKE=fake, BIG=_big(xb),
                      GPU=not _interpreting(), RB=rb, HPACK=hpack, PAIR=pair,
                      UNROLL=QUANTIZE_UNROLL if unroll is None else bool(unroll))
        mk = {}
        if marks is not None:
            vm, bm, thr = marks
            mk = dict(MARKS=True, vm_ptr=vm.view(-1).view(torch.int16), bm_ptr=bm.view(-1),
                      **dict(zip(THRESHOLDS, thr, strict=True)))
        rkey = ("quantize", *consts.values(), marks is not None, warps, *opts.values())
        units = nb // 2 if pair else nb * rb  # the kernel's "blocks": pairs, rows or blocks
        progs, n_iter, persist = _grid(units, bn, per_sm, dev, rkey)
        if rows:
            codes_arg, hints_arg = codes.view(torch.int32), hints.view(-1) if emit_hints else scales
        elif pair:  # per pair: 2 int64 of codes, an int32 of hints, an int16 of scales
            codes_arg, hints_arg = codes.view(torch.int64), hints.view(-1).view(torch.int32) if emit_hints else scales
        elif hpack == 2:
            codes_arg, hints_arg = codes.view(torch.int64), hints.view(-1).view(torch.int64)
        else:
            codes_arg, hints_arg = codes.view(torch.int64), _per_block_view(hints, b // 8) if emit_hints else scales
        fq_arg = (out.view(torch.int32) if kind == 0 else out) if fake else scales
        compiled = _quantize_kernel[(progs,)](
            xv, codes_arg, scales.view(torch.int16) if pair else scales, hints_arg, fq_arg,
            _g_arg(g, fmt, dev, scales), units, _loop_count(n_iter), PERSIST=persist, num_warps=warps, **consts,
            **opts, **mk,
        )
        _note_residency(rkey, compiled, warps)
    return codes, scales, hints, out


@_on_input_device
def quantize_blocks_triton(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scale_rule: str = "floor", emit_hints: bool = True,
    config: tuple | None = None, hint_pack: str | None = None, unroll: bool | None = None,
):
    """Triton twin of `reference.quantize_blocks_ref`: xb [NB, B] -> (codes [NB, B/2], scales [NB],
    hints [NB, B/8] or None). config: (blocks per program, num_warps, programs per SM or 0), or None for
    `default_config("quantize", xb.dtype, fmt)`. hint_pack: one of HINT_PACKS (None: HINT_PACK); unroll: two tiles
    per trip of the persistent loop (None: QUANTIZE_UNROLL). Neither changes a bit."""
    codes, scales, hints, _ = _launch_quantize(xb, fmt, g, scale_rule, emit_hints, False, config, "quantize",
                                               hint_pack=hint_pack, unroll=unroll)
    return codes, scales, hints


@_on_input_device
def quantize_fake_blocks_triton(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scale_rule: str = "floor", emit_hints: bool = True,
    config: tuple | None = None, scales_out: torch.Tensor | None = None, hints_out: torch.Tensor | None = None,
    hint_pack: str | None = None, unroll: bool | None = None, marks: tuple | None = None,
):
    """One pass over xb [NB, B]: (round-to-nearest fake-quantized values [NB, B] in xb.dtype, codes, scales,
    hints or None), equal to `reference.fake_quantize_blocks_ref(xb, fmt, g)` and
    `reference.quantize_blocks_ref(xb, fmt, g)`. config as for `quantize_blocks_triton` (default:
    `default_config("quantize_fake", ...)`). scales_out (uint8 [NB]) / hints_out (uint8 [NB, B/8]), contiguous:
    written in place of fresh scales / hints tensors. hint_pack, unroll: as for `quantize_blocks_triton`. marks:
    (value marks uint8 [NB, 2], block marks uint8 [NB / 8], 15 thresholds): `tracefp4.margin_marks` of the blocks
    written there in the same pass (NVFP4; `_launch_quantize`)."""
    codes, scales, hints, out = _launch_quantize(xb, fmt, g, scale_rule, emit_hints, True, config,
                                                 "quantize_fake", scales_out, hints_out, hint_pack, unroll, marks)
    return out, codes, scales, hints


#: fake_quantize_blocks_triton's launch plans (constexprs, tile, warps, layout), by what they depend on: a trainer's
#: forward launches it at every FP4 site, and building the plan each time was a third of the launcher's host time
_FQ_PLANS: dict[tuple, tuple] = {}


def _fake_quant_plan(xb: torch.Tensor, fmt: str, scale_rule: str, has_scales: bool, has_hints: bool,
                     store_scales: bool, lsb: bool, g_per: bool, key: str, cfg: tuple, interp: bool) -> tuple:
    """(constexprs, BN, num_warps, programs per SM, launch options, row layout, rows per block, input kind, residency
    key) of a `_fake_quant_kernel` launch in config ``cfg`` of `default_config` entry ``key`` on blocks like ``xb``
    [NB, B]. Raises LaunchConfigError for a bad config (nothing is cached then)."""
    bn, warps, per_sm, opts = _fwd_cfg(cfg, key, xb.dtype, fmt)
    _, p, k, kind = _layout(xb)
    rows = _is_rows(cfg)
    if rows and bn % p:
        raise LaunchConfigError(f"the row layout needs rows per program divisible by the {p} rows of a block; "
                                f"got {cfg}")
    rb = p if rows else 1
    consts = dict(P=1 if rows else p, K=k, KIND=kind, BN=bn, IS_NV=fmt == "nvfp4", RCEIL=scale_rule == "rceil",
                  HAS_SCALES=has_scales, HAS_HINTS=has_hints, STORE_SCALES=store_scales,
                  BIG=_big(xb), GPU=not interp, G_PER=g_per, RB=rb, SCALE_LSB=lsb)
    rkey = ("fake_quant", *consts.values(), warps, *opts.values())
    return consts, bn, warps, per_sm, opts, rows, rb, kind, rkey


@_on_input_device
def fake_quantize_blocks_triton(
    xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scales_u8: torch.Tensor | None,
    hints_packed: torch.Tensor | None, scale_rule: str = "floor", return_scales: bool = False,
    config: tuple | None = None, scale_lsb: torch.Tensor | None = None, lsb_blocks_per_row: int = 0,
):
    """Triton twin of `reference.fake_quantize_blocks_ref` with packed hints [NB, B/8].
    Returns (out [NB, B], scale bytes [NB] used, or None when own scales were not asked for). config: as for
    `quantize_blocks_triton`, or None for `default_config` of "fake_quant" (scales given) / "fake_quant_rtn".

    ``scale_lsb`` (NVFP4, with ``scales_u8=None``): scale hints, uint8 [R, ceil(lsb_blocks_per_row / 8)] for the
    NB = R * lsb_blocks_per_row blocks (`reference.nvfp4_lsb_scales_ref` per block); the scale bytes it gives are
    returned (always). Takes the configuration of "fake_quant" (as with given scales).

    NVFP4 ``g``: a 0-d (or one-element) fp32 tensor, or a 1-D fp32 tensor of M > 1 global scales, one per NB / M
    consecutive blocks (M must divide NB: a stack of M matrices of NB / M blocks each)."""
    xb = xb.contiguous()
    nb, b = xb.shape
    dev = xb.device
    g_blocks = 0
    if g is not None and g.dim() == 1 and g.numel() > 1:
        if nb % g.numel():
            raise ShapeError(f"{g.numel()} global scales for {nb} blocks: the count must divide the blocks")
        g_blocks = nb // g.numel()
    out = torch.empty_like(xb)
    has_scales = scales_u8 is not None
    lsb = scale_lsb is not None
    if lsb and (has_scales or fmt != "nvfp4" or lsb_blocks_per_row < 1 or nb % lsb_blocks_per_row
                or scale_lsb.numel() != nb // lsb_blocks_per_row * -(-lsb_blocks_per_row // 8)):
        raise ShapeError(f"scale hints need nvfp4, no scale bytes and {nb} blocks in rows of {lsb_blocks_per_row} "
                         f"(ceil(blocks / 8) bytes each); got {fmt}, scales {'given' if has_scales else 'None'}, "
                         f"{scale_lsb.numel()} hint bytes")
    store_scales = (not has_scales) and (return_scales or lsb)
    scales_out = torch.empty((nb,), dtype=torch.uint8, device=dev) if store_scales else None
    if nb:
        interp = _interpreting()
        key = "fake_quant" if has_scales or lsb else "fake_quant_rtn"
        cfg = config or default_config(key, xb.dtype, fmt)
        if isinstance(cfg, list):  # as every launcher takes it (e.g. from JSON); the plan cache needs a hashable key
            cfg = tuple(cfg)
        pkey = (b, xb.dtype, fmt, scale_rule, has_scales, hints_packed is not None, store_scales, lsb, g_blocks > 0,
                _big(xb), cfg, interp)
        plan = _FQ_PLANS.get(pkey)
        if plan is None:
            plan = _FQ_PLANS[pkey] = _fake_quant_plan(xb, fmt, scale_rule, has_scales, hints_packed is not None,
                                                      store_scales, lsb, g_blocks > 0, key, cfg, interp)
        consts, bn, warps, per_sm, opts, rows, rb, kind, rkey = plan
        xv = _load_view(xb, kind)
        progs, n_iter, persist = _grid(nb * rb, bn, per_sm, dev, rkey)
        dummy = _unused_arg(dev)
        hints_arg = dummy
        if hints_packed is not None:  # the row layout reads a byte per row (or half of one: fp32)
            hints_arg = hints_packed.contiguous().reshape(nb * (b // 8))
            if not rows:
                hints_arg = _per_block_view(hints_arg.view(nb, b // 8), b // 8)
        compiled = _fake_quant_kernel[(progs,)](
            xv, out.view(torch.int32) if kind == 0 else out,
            scales_u8.contiguous() if has_scales else (scale_lsb.contiguous().reshape(-1) if lsb else dummy),
            hints_arg,
            _g_arg(g, fmt, dev, dummy),
            scales_out if store_scales else dummy,
            nb * rb, _loop_count(n_iter), max(g_blocks, 1), max(lsb_blocks_per_row, 1), PERSIST=persist,
            num_warps=warps, **consts, **opts,
        )
        _note_residency(rkey, compiled, warps)
    return out, (scales_u8 if has_scales else scales_out)


@_on_input_device
def dequantize_blocks_triton(
    codes_packed: torch.Tensor, scales_u8: torch.Tensor, fmt: str, g: torch.Tensor | None, dtype: torch.dtype,
    config: tuple | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.dequantize_blocks_ref` on packed codes: codes [NB, B/2] (uint8), scale bytes
    [NB] -> [NB, B] in ``dtype``. config as for `quantize_blocks_triton` (default: `default_config`)."""
    codes_packed = codes_packed.contiguous()
    nb, half = codes_packed.shape
    b = 2 * half
    dev = codes_packed.device
    out = torch.empty((nb, b), dtype=dtype, device=dev)
    if nb:
        cfg = config or default_config("dequantize", dtype, fmt)
        bn, warps, per_sm, opts = _fwd_cfg(cfg, "dequantize", dtype, fmt)
        ov, p, k, kind = _layout(out)
        rb = p if _is_rows(cfg) else 1
        consts = dict(G=b // 8, P=1 if rb > 1 else p, K=k, KIND=kind, BN=bn, IS_NV=fmt == "nvfp4", BIG=_big(out),
                      GPU=not _interpreting(), RB=rb)
        rkey = ("dequantize", *consts.values(), warps, *opts.values())
        progs, n_iter, persist = _grid(nb * rb, bn, per_sm, dev, rkey)
        scales_u8 = scales_u8.contiguous()
        compiled = _dequantize_kernel[(progs,)](
            codes_packed.view(torch.int32), scales_u8, _g_arg(g, fmt, dev, scales_u8), ov, nb * rb,
            _loop_count(n_iter), PERSIST=persist, num_warps=warps, **consts, **opts,
        )
        _note_residency(rkey, compiled, warps)
    return out


def _bwd_cfg(config: tuple | None) -> tuple[int, int]:
    """(BN, num_warps) of the backward kernel; config: (BN, num_warps) or None for CONFIG."""
    cfg = config or CONFIG["fake_quant_bwd"]
    if len(cfg) != 2:
        raise LaunchConfigError(f"the backward config is (blocks per program, num_warps); got {cfg}")
    return cfg


@_on_input_device
def fake_quantize_bwd_blocks_triton(
    grad_b: torch.Tensor, xb: torch.Tensor, fmt: str, g: torch.Tensor | None, scales_u8: torch.Tensor,
    config: tuple | None = None,
) -> torch.Tensor:
    """Triton twin of `reference.fake_quantize_bwd_blocks_ref` (clipped straight-through gradient).
    config: (blocks per program, num_warps), or None for CONFIG["fake_quant_bwd"]."""
    grad_b = grad_b.contiguous()
    xb = xb.contiguous()
    nb, b = xb.shape
    out = torch.empty_like(grad_b)
    if nb:
        bn, warps = _bwd_cfg(config)
        scales_u8 = scales_u8.contiguous()
        _fake_quant_bwd_kernel[(_cdiv(nb, bn),)](
            grad_b, xb, scales_u8, _g_arg(g, fmt, xb.device, scales_u8), out, nb,
            G=b // 8, BN=bn, IS_NV=fmt == "nvfp4", BIG=_big(xb), num_warps=warps,
        )
    return out


#: (values per program iteration, num_warps, the fewest iterations per program) of `global_scales_triton`
_AMAX_BLOCK, _AMAX_WARPS, _AMAX_MIN_ITERS = 2048, 4, 8
_AMAX_BITS = {torch.bfloat16: (torch.int16, 0x7F80, 0), torch.float16: (torch.int16, 0x7C00, 1),
              torch.float32: (torch.int32, 0x7F800000, 2)}


@_on_input_device
def global_scales_triton(stack: torch.Tensor) -> torch.Tensor:
    """Triton twin of `reference.global_scales_ref`: the dynamic NVFP4 global scale of each matrix of ``stack``
    [M, R, C] (bf16/fp16/fp32, R * C > 0), fp32 [M], bit for bit (a max is exact in any order). Two launches for
    the whole stack, one pass over it (the reference takes a cast, abs, isfinite, where and amax: five passes and
    as many launches per stack); no host sync."""
    m = stack.shape[0]
    n = stack[0].numel() if m else 0
    int_dtype, inf_bits, dt = _AMAX_BITS[stack.dtype]
    bits = stack.contiguous().view(int_dtype).reshape(m, n)
    iters = max(_AMAX_MIN_ITERS, _next_pow2(_cdiv(n, _AMAX_BLOCK * 1024)))
    chunks = _cdiv(n, _AMAX_BLOCK * iters)  # <= 1024
    part = torch.empty((m, chunks), dtype=torch.int32, device=stack.device)
    g = torch.empty((m,), dtype=torch.float32, device=stack.device)
    if m:
        _matrix_amax_kernel[(m, chunks)](bits, part, n, chunks, INF_BITS=inf_bits, BLOCK=_AMAX_BLOCK, ITERS=iters,
                                         num_warps=_AMAX_WARPS)
        _matrix_scales_kernel[(m,)](part, g, chunks, DT=dt, CB=max(_next_pow2(chunks), 16),
                                    DENOM=float(NVFP4_GLOBAL_DENOM), G_MIN=float(NVFP4_GLOBAL_SCALE_MIN),
                                    FALLBACK=float(NVFP4_GLOBAL_SCALE_FALLBACK), num_warps=1)
    return g
