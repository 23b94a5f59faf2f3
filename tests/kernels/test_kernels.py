"""Tests of the FP4 numerics (`tracefp4`, folder kernels/): exactness of the reference against hand-built expectations, and of
the Triton kernels (under TRITON_INTERPRET=1 on CPU) against the reference, bit for bit.

Expected values here are built by hand (block maxima chosen so that the block scale is exactly 1) and do
not go through the API under test.
"""

from __future__ import annotations

import pytest
import torch

from helpers.fp4 import (  # first: selects Triton's interpreter without CUDA
    BACKENDS, BLOCK, DEVICE, DTYPES, FMTS, HAS_TRITON, assert_bits_equal, bits,
)
import tracefp4
from tracefp4 import reference as ref
from tracefp4.constants import E2M1_MAGNITUDES, E2M1_MIDPOINTS
from tracefp4.errors import BackendError, DTypeError, FormatError, FP4Error, ShapeError

E4M3_ONE = 0x38  # E4M3FN bits of 1.0 (exponent 7, mantissa 0)
E8M0_ONE = 127  # E8M0 bits of 1.0

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy 1/0 in masked interpreter lanes


def anchored_block(values, fmt: str, dtype=torch.float32) -> torch.Tensor:
    """One block [1, B]: 6.0 first (so the scale is exactly 1 with g = 1), then `values`, zero padded."""
    b = BLOCK[fmt]
    row = [6.0, *values]
    assert len(row) <= b
    return torch.tensor(row + [0.0] * (b - len(row)), dtype=dtype, device=DEVICE).reshape(1, b)


def g_for(fmt: str):
    return 1.0 if fmt == "nvfp4" else None


def one_scale(fmt: str, nblocks: int = 1) -> torch.Tensor:
    return torch.full((1, nblocks), E4M3_ONE if fmt == "nvfp4" else E8M0_ONE, dtype=torch.uint8, device=DEVICE)


def codes_of(q) -> torch.Tensor:
    return tracefp4.unpack_codes(q.codes)


# ---------------------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------------------
def test_pack_codes_layout_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    packed = tracefp4.pack_codes(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(tracefp4.unpack_codes(packed), codes)


def test_pack_hints_layout_little_endian():
    b = torch.zeros(1, 16, dtype=torch.uint8)
    b[0, 0] = 1
    b[0, 7] = 1
    b[0, 9] = 1
    packed = tracefp4.pack_hints(b)
    assert packed.tolist() == [[0x81, 0x02]]
    assert torch.equal(tracefp4.unpack_hints(packed), b)


@pytest.mark.parametrize("shape", [(8,), (3, 16), (2, 5, 64)])
def test_pack_roundtrip_random(shape):
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    assert torch.equal(tracefp4.unpack_codes(tracefp4.pack_codes(codes)), codes)
    hb = torch.randint(0, 2, shape, generator=g, dtype=torch.uint8)
    assert torch.equal(tracefp4.unpack_hints(tracefp4.pack_hints(hb)), hb)
    assert torch.equal(tracefp4.hints_from_codes(tracefp4.pack_codes(codes)), tracefp4.pack_hints(codes & 1))


def test_pack_errors():
    with pytest.raises(ShapeError, match="multiple of 8"):
        tracefp4.pack_hints(torch.zeros(12, dtype=torch.uint8))
    with pytest.raises(ShapeError, match="multiple of 2"):
        tracefp4.pack_codes(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(DTypeError):
        tracefp4.pack_codes(torch.zeros(4))
    for unpack in (tracefp4.unpack_codes, tracefp4.unpack_hints):
        with pytest.raises(ShapeError, match="at least one dimension"):
            unpack(torch.tensor(1, dtype=torch.uint8))


# ---------------------------------------------------------------------------------------------------------
# scale encodings
# ---------------------------------------------------------------------------------------------------------
def _all_e4m3_positive():
    b = torch.arange(1, 0x7F, dtype=torch.uint8)  # 0x01 (2^-9) .. 0x7E (448)
    return b.view(torch.float8_e4m3fn).float()


def test_e4m3_decode_matches_torch_for_all_256_bytes():
    allb = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    assert_bits_equal(ref.e4m3_decode(allb), allb.view(torch.float8_e4m3fn).float())


def test_e4m3_encode_every_value_every_tie_and_neighbours():
    vals = _all_e4m3_positive()
    mids = (vals[:-1].double() + vals[1:].double()) / 2  # exact in fp32 (5 significant bits)
    mids = mids.float()
    t = torch.cat([vals, mids, torch.nextafter(mids, torch.zeros_like(mids)), torch.nextafter(mids, mids + 1)])
    t = t.clamp(2.0**-9, 448.0)
    expected = t.to(torch.float8_e4m3fn).view(torch.uint8)  # torch's cast: round to nearest even
    assert torch.equal(ref.e4m3_encode(t), expected)
    # the ties go to the even mantissa
    tie_bytes = ref.e4m3_encode(mids)
    assert bool(((tie_bytes & 1) == 0).all())


def test_e8m0_decode():
    allb = torch.arange(255, dtype=torch.int32).to(torch.uint8)
    want = torch.exp2(torch.arange(255, dtype=torch.float64) - 127).float()
    assert_bits_equal(ref.e8m0_decode(allb), want)
    assert torch.isnan(ref.e8m0_decode(torch.tensor([255], dtype=torch.uint8))).all()


# ---------------------------------------------------------------------------------------------------------
# codes: every code, every tie, +-0, saturation (hand-built expectations, scale exactly 1)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
def test_every_one_of_the_16_codes(fmt, backend):
    mags = list(E2M1_MAGNITUDES)
    vals = mags[1:] + [-m for m in mags]  # codes 1..7 then 8..15 (-0.0 is code 8)
    x = anchored_block(vals, fmt)
    q = tracefp4.quantize(x, fmt, global_scale=g_for(fmt), backend=backend)
    expected = [7] + list(range(1, 8)) + list(range(8, 16))
    assert codes_of(q)[0, : len(expected)].tolist() == expected
    assert q.scales.flatten().tolist()[0] == (E4M3_ONE if fmt == "nvfp4" else E8M0_ONE)
    deq = tracefp4.dequantize(q, dtype=torch.float32)
    assert_bits_equal(deq, x)  # every code dequantizes to its exact value, -0.0 included
    assert torch.equal(q.hints, tracefp4.pack_hints(codes_of(q) & 1))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("tie_index", range(7))
def test_each_tie_rounds_to_the_even_code(tie_index, fmt, backend):
    mid = E2M1_MIDPOINTS[tie_index]
    lower = tie_index  # the tie sits between magnitude codes tie_index and tie_index + 1
    even = lower if lower % 2 == 0 else lower + 1
    below = torch.nextafter(torch.tensor(mid), torch.tensor(0.0)).item()
    above = torch.nextafter(torch.tensor(mid), torch.tensor(10.0)).item()
    x = anchored_block([mid, -mid, below, above], fmt)
    q = tracefp4.quantize(x, fmt, global_scale=g_for(fmt), backend=backend)
    assert codes_of(q)[0, 1:5].tolist() == [even, even | 8, lower, lower + 1]
    # fake quantization rounds the same way
    y = tracefp4.fake_quantize(x, fmt, global_scale=g_for(fmt), backend=backend)
    assert y[0, 1].item() == E2M1_MAGNITUDES[even] and y[0, 2].item() == -E2M1_MAGNITUDES[even]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_signed_zero_round_trips(fmt, dtype, backend):
    x = anchored_block([0.0, -0.0, -0.1, 0.1], fmt, dtype)
    q = tracefp4.quantize(x, fmt, global_scale=g_for(fmt), backend=backend)
    assert codes_of(q)[0, 1:5].tolist() == [0, 8, 8, 0]  # tiny values keep their sign as +-0
    y = tracefp4.fake_quantize(x, fmt, global_scale=g_for(fmt), backend=backend)
    assert torch.signbit(y[0, 1:5]).tolist() == [False, True, True, False]
    assert (y[0, 1:5] == 0).all()
    deq = tracefp4.dequantize(q, dtype=dtype)
    assert_bits_equal(deq, y)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
def test_all_zero_block(fmt, backend):
    x = torch.zeros(3, 2 * BLOCK[fmt], device=DEVICE)
    x[1] = -0.0
    q = tracefp4.quantize(x, fmt, backend=backend)
    if fmt == "nvfp4":
        assert q.global_scale.item() == 1.0  # amax == 0 fallback
        assert (q.scales == 0x01).all()  # clamp((0/6)/g, 2^-9, 448) = 2^-9
    else:
        assert (q.scales == 0).all()  # amax 0 -> e clamped to -127
    c = codes_of(q)
    assert (c[0] == 0).all() and (c[1] == 8).all() and (c[2] == 0).all()
    assert_bits_equal(tracefp4.fake_quantize(x, fmt, backend=backend), x)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
def test_saturation_at_6_and_beyond_with_given_scales(fmt, backend):
    x = torch.tensor([[5.0, 5.5, 6.0, 7.0, 100.0, 3e38, -7.0, -1e30] * (BLOCK[fmt] // 8)], device=DEVICE)
    y = tracefp4.fake_quantize(x, fmt, global_scale=g_for(fmt), scales=one_scale(fmt), backend=backend)
    want = torch.tensor([[4.0, 6.0, 6.0, 6.0, 6.0, 6.0, -6.0, -6.0] * (BLOCK[fmt] // 8)], device=DEVICE)
    assert_bits_equal(y, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nvfp4_saturates_when_the_block_scale_rounds_down(backend):
    # (amax/6)/g = 1.0625 is an E4M3 tie between 1.0 and 1.125 -> 1.0 (even), so v(amax) = 6.375 -> code 7
    x = anchored_block([], "nvfp4")
    x[0, 0] = 6.375
    x[0, 1] = -6.375
    q = tracefp4.quantize(x, "nvfp4", global_scale=1.0, backend=backend)
    assert q.scales.item() == E4M3_ONE
    assert codes_of(q)[0, :2].tolist() == [7, 15]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nvfp4_block_scale_saturates_at_448(backend):
    x = anchored_block([], "nvfp4")
    x[0, 0] = 6000.0  # (6000/6)/1 = 1000 -> clamped to 448 (0x7E)
    x[0, 1] = 448.0 * 3.0  # v = 3 exactly
    q = tracefp4.quantize(x, "nvfp4", global_scale=1.0, backend=backend)
    assert q.scales.item() == 0x7E
    assert codes_of(q)[0, :2].tolist() == [7, 5]  # 6000/448 = 13.4 saturates; 1344/448 = 3
    assert tracefp4.dequantize(q, dtype=torch.float32)[0, 0].item() == 6.0 * 448.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_nvfp4_block_scale_underflows_to_2_pow_minus_9(backend):
    x = torch.zeros(1, 32, device=DEVICE)
    x[0, 0] = 1.0  # sets g = 1/2688 ...
    x[0, 16] = 1e-7  # ... and this block's (amax/6)/g = 4.5e-4 < 2^-9 -> clamped to 2^-9 (byte 0x01)
    x[0, 17] = 3e-7
    q = tracefp4.quantize(x, "nvfp4", backend=backend)
    assert q.scales.tolist() == [[0x7E, 0x01]]
    # r = (1/g) / 2^-9 = 2688 * 512: v(1e-7) = 0.138 -> code 0, v(3e-7) = 0.413 -> code 1 (0.5)
    assert codes_of(q)[0, 16:18].tolist() == [0, 1]


def test_e4m3_subnormal_scale_ties():
    # t = 1.5 * 2^-9 and 2.5 * 2^-9 are ties on the subnormal grid: -> 2 and 2 (even)
    t = torch.tensor([1.5, 2.5, 3.5, 7.5]) * 2.0**-9
    assert ref.e4m3_encode(t).tolist() == [2, 2, 4, 8]
    assert torch.equal(ref.e4m3_encode(t), t.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_mxfp4_scale_rules(rule, backend):
    x = torch.zeros(4, 32, device=DEVICE)
    x[0, 0] = 6.0  # floor: 2^(2-2)=1        rceil: 2^ceil(log2 1) = 1
    x[1, 0] = 6.5  # floor: 2^0              rceil: 2^ceil(log2 1.083) = 2
    x[2, 0] = 1.0  # floor: 2^(0-2)          rceil: 2^ceil(log2 1/6) = 2^-2
    x[3, 0] = 1e-40  # subnormal amax -> clamped to 2^-127 (byte 0) both ways
    q = tracefp4.quantize(x, "mxfp4", backend=backend, scale_rule=rule)
    want = [127, 127, 125, 0] if rule == "floor" else [127, 128, 125, 0]
    assert q.scales.flatten().tolist() == want


# ---------------------------------------------------------------------------------------------------------
# NaN / Inf (documented in NUMERICS.md)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
def test_nan_and_inf(fmt, backend):
    x = anchored_block([float("nan"), float("inf"), float("-inf"), 1.0, -2.0, -float("nan")], fmt)
    q = tracefp4.quantize(x, fmt, global_scale=g_for(fmt), backend=backend)
    # amax ignores NaN/Inf (scale stays exactly 1); Inf saturates to +-6; NaN -> magnitude 7 with its sign bit
    assert q.scales.flatten()[0].item() == (E4M3_ONE if fmt == "nvfp4" else E8M0_ONE)
    assert codes_of(q)[0, :7].tolist() == [7, 7, 7, 15, 2, 12, 15]
    y = tracefp4.fake_quantize(x, fmt, global_scale=g_for(fmt), backend=backend)
    assert torch.isnan(y[0, 1]) and y[0, 2].item() == 6.0 and y[0, 3].item() == -6.0
    assert y[0, 4].item() == 1.0 and y[0, 5].item() == -2.0
    yh = tracefp4.fake_quantize(x, fmt, global_scale=g_for(fmt), scales=q.scales, hints=q.hints, backend=backend)
    assert torch.isnan(yh[0, 1]) and torch.isnan(yh[0, 6]) and torch.equal(yh[0, 2:6], y[0, 2:6])


def test_global_scale_ignores_non_finite_and_falls_back():
    # amax over the finite values is 5376 -> g = 5376 / 2688 = 2.0 exactly; an amax that propagated NaN would
    # fall back to 1.0, one that kept Inf would give Inf
    x = torch.tensor([[float("nan"), float("inf"), 5376.0] + [0.0] * 13])
    assert tracefp4.compute_global_scale(x).item() == 2.0
    assert tracefp4.compute_global_scale(torch.full((1, 16), float("nan"))).item() == 1.0
    assert tracefp4.compute_global_scale(torch.zeros(2, 16)).item() == 1.0
    assert tracefp4.compute_global_scale(torch.full((1, 16), 1e-38)).item() == 2.0**-118


def test_nan_scale_byte_gives_nan_and_zero_scale_gives_zero():
    x = torch.ones(1, 32)
    s = torch.tensor([[0x7F, 0x00]], dtype=torch.uint8)
    y = tracefp4.fake_quantize(x, "nvfp4", global_scale=1.0, scales=s, backend="reference")
    assert torch.isnan(y[0, :16]).all() and (y[0, 16:] == 0).all()


# ---------------------------------------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------------------------------------
def test_last_dim_not_a_multiple_of_the_block_size():
    with pytest.raises(ShapeError, match=r"block size 16.*\(3, 24\)"):
        tracefp4.quantize(torch.zeros(3, 24))
    with pytest.raises(ShapeError, match=r"block size 32"):
        tracefp4.fake_quantize(torch.zeros(48), "mxfp4")
    with pytest.raises(ShapeError):
        tracefp4.quantize(torch.tensor(1.0))


def test_wrong_dtypes_and_arguments():
    with pytest.raises(DTypeError, match="int32"):
        tracefp4.quantize(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(DTypeError, match="float64"):
        tracefp4.fake_quantize(torch.zeros(16, dtype=torch.float64))
    with pytest.raises(DTypeError, match="int32"):
        tracefp4.compute_global_scale(torch.zeros(16, dtype=torch.int32))
    with pytest.raises(FormatError, match="fp8"):
        tracefp4.quantize(torch.zeros(16), "fp8")
    with pytest.raises(FormatError):
        tracefp4.quantize(torch.zeros(32), "mxfp4", global_scale=2.0)
    with pytest.raises(FormatError):
        tracefp4.quantize(torch.zeros(16), global_scale=float("nan"))
    with pytest.raises(FormatError):
        tracefp4.fake_quantize(torch.zeros(16), hints=torch.zeros(2, dtype=torch.uint8))
    with pytest.raises(FormatError):
        tracefp4.fake_quantize(torch.zeros(16), scales=torch.zeros(1, dtype=torch.uint8))  # no global scale
    with pytest.raises(FP4Error):
        tracefp4.fake_quantize(torch.zeros(16), ste="nope")
    with pytest.raises(DTypeError, match="int32"):
        tracefp4.quantize(torch.zeros(16), global_scale=torch.tensor(1, dtype=torch.int32))
    with pytest.raises(ShapeError, match=r"\(2,\)"):
        tracefp4.quantize(torch.zeros(16), global_scale=torch.ones(2))
    assert issubclass(ShapeError, ValueError)


def test_scales_and_hints_with_wrong_shapes():
    x = torch.zeros(2, 32)
    with pytest.raises(ShapeError, match=r"\(2, 2\)"):
        tracefp4.fake_quantize(x, global_scale=1.0, scales=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ShapeError, match=r"\(2, 4\)"):
        tracefp4.fake_quantize(
            x, global_scale=1.0, scales=torch.zeros(2, 2, dtype=torch.uint8), hints=torch.zeros(2, 2, dtype=torch.uint8)
        )
    with pytest.raises(DTypeError):
        tracefp4.fake_quantize(x, global_scale=1.0, scales=torch.zeros(2, 2))


def test_backend_choice(monkeypatch):
    assert tracefp4.resolve_backend("auto", torch.device("cpu")) == "reference"
    with pytest.raises(BackendError, match="nope"):
        tracefp4.resolve_backend("nope", torch.device("cpu"))
    if HAS_TRITON:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(BackendError, match="TRITON_INTERPRET"):
            tracefp4.resolve_backend("triton", torch.device("cpu"))


# ---------------------------------------------------------------------------------------------------------
# Triton == reference on random data (odd shapes, all dtypes), and properties of hint-guided rounding
# ---------------------------------------------------------------------------------------------------------
def _random_x(rows: int, d: int, dtype, seed: int, specials: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # heavy-tailed magnitudes so blocks span many scales; some exact ladder values and ties
    x = torch.randn(rows, d, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    if specials:
        flat = x.view(-1)
        idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 50),), generator=g)
        pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 0.25, 5.0, 6.0, 1e-30])
        flat[idx] = pool[torch.randint(0, len(pool), idx.shape, generator=g)]
    return x.to(dtype).to(DEVICE)


def _noisy(x: torch.Tensor, rel: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    e = (torch.rand(x.shape, generator=g) * 2 - 1) * rel
    return (x.float().cpu() * (1 + e)).to(x.dtype).to(x.device)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 64), (37, 96), (199, 32)])
def test_triton_matches_reference(rows, d, dtype, fmt):
    x = _random_x(rows, d, dtype, seed=rows * 1000 + d)
    for g in ([None, 0.37] if fmt == "nvfp4" else [None]):
        qr = tracefp4.quantize(x, fmt, global_scale=g, backend="reference")
        qt = tracefp4.quantize(x, fmt, global_scale=g, backend="triton")
        assert_bits_equal(qt.codes, qr.codes)
        assert_bits_equal(qt.scales, qr.scales)
        assert_bits_equal(qt.hints, qr.hints)
        if fmt == "nvfp4":
            assert_bits_equal(qt.global_scale, qr.global_scale)
        else:
            assert qt.global_scale is None and qr.global_scale is None
        xn = _noisy(x, 0.02, seed=rows)
        gs = qr.global_scale
        for kw in (dict(), dict(scales=qr.scales), dict(scales=qr.scales, hints=qr.hints)):
            if kw and fmt == "nvfp4":
                kw["global_scale"] = gs
            elif fmt == "nvfp4":
                kw["global_scale"] = g
            yr = tracefp4.fake_quantize(xn, fmt, backend="reference", **kw)
            yt = tracefp4.fake_quantize(xn, fmt, backend="triton", **kw)
            assert_bits_equal(yt, yr)
    q_no = tracefp4.quantize(x, fmt, global_scale=g, backend="triton", emit_hints=False)
    assert q_no.hints is None
    assert_bits_equal(q_no.codes, qr.codes)
    assert_bits_equal(q_no.scales, qr.scales)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_mxfp4_rceil_and_empty(fmt):
    x = _random_x(5, 64, torch.bfloat16, seed=3)
    qr = tracefp4.quantize(x, fmt, backend="reference", scale_rule="rceil")
    qt = tracefp4.quantize(x, fmt, backend="triton", scale_rule="rceil")
    assert_bits_equal(qt.codes, qr.codes)
    assert_bits_equal(qt.scales, qr.scales)
    empty = torch.zeros(0, 64, dtype=torch.bfloat16, device=DEVICE)
    for be in ("reference", "triton"):
        q = tracefp4.quantize(empty, fmt, backend=be)
        assert q.codes.shape == (0, 32) and q.hints.shape == (0, 8)
        assert tracefp4.fake_quantize(empty, fmt, backend=be).shape == (0, 64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("rel", [1e-3, 1e-2, 5e-2])
def test_hint_guided_code_equals_rollout_code_when_it_brackets(rel, fmt, backend):
    x = _random_x(64, 64, torch.float32, seed=7, specials=False)
    q = tracefp4.quantize(x, fmt, backend="reference")
    xn = _noisy(x, rel, seed=11)
    g = q.global_scale if fmt == "nvfp4" else None
    yh = tracefp4.fake_quantize(xn, fmt, global_scale=g, scales=q.scales, hints=q.hints, backend=backend)
    rollout = tracefp4.dequantize(q, dtype=torch.float32)
    # bracket test computed independently: the rollout magnitude is one of the two ladder values around |v|
    b = BLOCK[fmt]
    s = ref.e4m3_decode(q.scales) * g if fmt == "nvfp4" else ref.e8m0_decode(q.scales)
    v = xn.reshape(-1, b).double() / s.reshape(-1, 1).double()
    a = v.abs().clamp(max=6.0)
    ladder = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float64, device=a.device)
    k = (a.unsqueeze(-1) >= ladder[1:7]).sum(-1)
    c = tracefp4.unpack_codes(q.codes).reshape(-1, b).long()
    same_sign = torch.signbit(xn.reshape(-1, b)) == ((c & 8) != 0)
    brackets = (((c & 7) == k) | ((c & 7) == k + 1)) & same_sign
    # the fp64 bracket test can disagree with the fp32 kernel only within an ulp of a ladder value
    near = ((a.unsqueeze(-1) - ladder).abs() < 1e-6 * (1 + a.unsqueeze(-1))).any(-1)
    sel = (brackets & ~near).reshape(xn.shape)
    assert sel.float().mean() > 0.9
    assert_bits_equal(yh[sel], rollout[sel])
    agreement = (bits(yh) == bits(rollout)).float().mean().item()
    if rel <= 1e-2:
        assert agreement >= 0.9999, agreement


def test_hint_agreement_at_1_percent_noise_large():
    # 2^18 values, bf16: the mismatch rate must be <= 1e-4; the expected count of mismatches is 0 here because
    # a 1% move cannot skip a ladder step (adjacent magnitudes differ by >= 33%)
    x = _random_x(512, 512, torch.bfloat16, seed=5, specials=False)
    q = tracefp4.quantize(x, "nvfp4", backend="reference")
    xn = _noisy(x, 1e-2, seed=6)
    yh = tracefp4.fake_quantize(xn, "nvfp4", global_scale=q.global_scale, scales=q.scales, hints=q.hints,
                               backend="reference")
    ynn = tracefp4.fake_quantize(xn, "nvfp4", global_scale=q.global_scale, scales=q.scales, backend="reference")
    rollout = tracefp4.dequantize(q, dtype=torch.bfloat16)
    agree_hint = (bits(yh) == bits(rollout)).float().mean().item()
    agree_rtn = (bits(ynn) == bits(rollout)).float().mean().item()
    assert agree_hint >= 0.9999
    assert agree_rtn < agree_hint  # round-to-nearest with the rollout's scales flips codes near midpoints


# ---------------------------------------------------------------------------------------------------------
# autograd
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("ste", ["identity", "clip"])
def test_backward_is_straight_through(ste, fmt, backend):
    x = _random_x(3, 64, torch.float32, seed=9, specials=False)
    q = tracefp4.quantize(x, fmt, backend="reference")
    g = q.global_scale if fmt == "nvfp4" else None
    xn = (x * 1.3).requires_grad_(True)  # push some values past 6 so that "clip" has work
    grad_out = torch.randn_like(xn)
    for kw in (dict(scales=q.scales, hints=q.hints), dict(scales=q.scales)):
        xn.grad = None
        y = tracefp4.fake_quantize(xn, fmt, global_scale=g, backend=backend, ste=ste, **kw)
        y.backward(grad_out)
        if ste == "identity":
            assert_bits_equal(xn.grad, grad_out)
        else:
            s = ref.e4m3_decode(q.scales) * g if fmt == "nvfp4" else ref.e8m0_decode(q.scales)
            v = xn.detach().reshape(-1, BLOCK[fmt]).double() / s.reshape(-1, 1).double()
            keep = (v.abs() <= 6.0 * (1 - 1e-6)).reshape(xn.shape)
            drop = (v.abs() > 6.0 * (1 + 1e-6)).reshape(xn.shape)
            assert bool(drop.any())
            assert torch.equal(xn.grad[keep], grad_out[keep]) and bool((xn.grad[drop] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ste", ["identity", "clip"])
def test_no_gradient_calls_skip_the_graph_and_give_the_same_bits(ste, backend):
    # without an input that needs a gradient (or under no_grad) fake_quantize runs its forward directly, without
    # autograd's Function machinery (tracefp4.api._NoGraphCtx): the same bits as the recorded call, no graph node
    import tracefp4.api as api

    x = _random_x(5, 64, torch.bfloat16, seed=31)
    q = tracefp4.quantize(x, "nvfp4", backend="reference")
    for kw in ({}, {"global_scale": q.global_scale, "scales": q.scales},
               {"global_scale": q.global_scale, "scales": q.scales, "hints": q.hints}):
        xg = x.clone().requires_grad_(True)
        recorded = tracefp4.fake_quantize(xg, "nvfp4", backend=backend, ste=ste, **kw)
        assert recorded.grad_fn is not None and api._needs_graph(xg)
        plain = tracefp4.fake_quantize(x, "nvfp4", backend=backend, ste=ste, **kw)
        with torch.no_grad():
            under_no_grad = tracefp4.fake_quantize(xg, "nvfp4", backend=backend, ste=ste, **kw)
        assert not api._needs_graph(x) and plain.grad_fn is None and under_no_grad.grad_fn is None
        assert not under_no_grad.requires_grad
        assert_bits_equal(plain, recorded.detach())
        assert_bits_equal(under_no_grad, recorded.detach())
    # scale hints: any LSB bits make a valid input (one bit per block of each row, 4 blocks -> 1 byte)
    lsb = torch.randint(0, 256, (5, 1), generator=torch.Generator().manual_seed(3), dtype=torch.uint8).to(x.device)
    y1, s1 = tracefp4.fake_quantize_lsb(x.clone().requires_grad_(True), q.global_scale, lsb, q.hints,
                                        backend=backend, ste=ste)
    y2, s2 = tracefp4.fake_quantize_lsb(x, q.global_scale, lsb, q.hints, backend=backend, ste=ste)
    assert y1.grad_fn is not None and y2.grad_fn is None
    assert_bits_equal(y2, y1.detach())
    assert_bits_equal(s2, s1)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_triton_fake_quant_launch_plan_follows_the_default_config(monkeypatch):
    # the launcher caches its launch plans by what they depend on, including the resolved default config: a changed
    # default (a user tuning CONFIG_CASES) takes effect at the next launch, and a bad one is refused, not cached
    from tracefp4 import triton_kernels as tk
    from tracefp4.errors import LaunchConfigError

    x, g = _ties_x("nvfp4")
    xb = _noisy(x, 0.02, seed=5).to(torch.bfloat16).reshape(-1, 16)
    q = ref.quantize_blocks_ref(xb, "nvfp4", g)
    want = ref.fake_quantize_blocks_ref(xb, "nvfp4", g, q[1], tracefp4.unpack_hints(q[2]))
    assert_bits_equal(tk.fake_quantize_blocks_triton(xb, "nvfp4", g, q[1], q[2])[0], want)
    key = ("fake_quant", "bf16", "nvfp4")
    for cfg in [(4, 1, 3), ("rows", 8, 1, 0)]:
        monkeypatch.setitem(tk.CONFIG_CASES, key, cfg)
        assert_bits_equal(tk.fake_quantize_blocks_triton(xb, "nvfp4", g, q[1], q[2])[0], want)
        assert any(plan[1] == cfg[-3] and k[10] == cfg for k, plan in tk._FQ_PLANS.items())
        # an explicit config as a list (JSON has no tuples), as the other launchers take it: same plan, same bits
        assert_bits_equal(tk.fake_quantize_blocks_triton(xb, "nvfp4", g, q[1], q[2], config=list(cfg))[0], want)
    monkeypatch.setitem(tk.CONFIG_CASES, key, ("rows", 3, 1, 0))  # 3 rows per program: not whole blocks
    n = len(tk._FQ_PLANS)
    with pytest.raises(LaunchConfigError, match="rows per program"):
        tk.fake_quantize_blocks_triton(xb, "nvfp4", g, q[1], q[2])
    assert len(tk._FQ_PLANS) == n


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_backward_matches_reference(dtype):
    x = _random_x(37, 32, dtype, seed=4)
    grad_out = torch.randn(x.shape).to(dtype).to(x.device)
    grads = []
    for be in ("reference", "triton"):
        xx = x.clone().requires_grad_(True)
        tracefp4.fake_quantize(xx, "nvfp4", backend=be, ste="clip").backward(grad_out)  # own scales
        grads.append(xx.grad)
    assert_bits_equal(grads[1], grads[0])


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_equals_round_to_nearest_fake_quantize(fmt):
    x = _random_x(7, 64, torch.bfloat16, seed=12)
    q = tracefp4.quantize(x, fmt, backend="reference")
    y = tracefp4.fake_quantize(x, fmt, global_scale=q.global_scale, backend="reference")
    d = tracefp4.dequantize(q.codes, q.scales, fmt=fmt, global_scale=q.global_scale, dtype=torch.bfloat16)
    finite = torch.isfinite(x)
    assert_bits_equal(d[finite], y[finite])


def _ties_x(fmt: str):
    """(x [13, 4B] bf16 whose first block holds every tie at scale 1, and g = 1 for NVFP4 / None for MXFP4)."""
    b = BLOCK[fmt]
    x = _random_x(13, 4 * b, torch.bfloat16, seed=21)
    specials = [6.0, *E2M1_MIDPOINTS, *[-m for m in E2M1_MIDPOINTS], 7.0, 1e30, float("inf"), float("nan")]
    x[0, :b] = torch.tensor((specials + [0.0] * b)[:b])  # the first block: every tie at scale 1 (g = 1 below)
    return x, (torch.tensor(1.0) if fmt == "nvfp4" else None)


_LAUNCH_CFGS = [(8, 1, 0), (8, 1, 1), (4, 1, 3), (8, 1, 32, 64)]


def _launch_variant_cases() -> list:
    """(cfg, dtype, fmt) cases: the full product where the kernels run compiled (a CUDA device: milliseconds each);
    under Triton's interpreter (2-30 s each, the suite's slowest test) a pairwise cover of it: every config with every
    dtype, and each of those pairs' config and dtype with both formats (12 of 24 cases)."""
    if torch.cuda.is_available():
        cases = [(c, d, f) for c in _LAUNCH_CFGS for d in DTYPES for f in FMTS]
    else:
        cases = [(c, d, FMTS[(i + j) % len(FMTS)]) for i, c in enumerate(_LAUNCH_CFGS) for j, d in enumerate(DTYPES)]
    return [pytest.param(c, d, f, id=f"{'-'.join(map(str, c))}-{str(d).split('.')[-1]}-{f}") for c, d, f in cases]


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("cfg,dtype,fmt", _launch_variant_cases())
def test_triton_launch_variants_match_reference(cfg, dtype, fmt):
    # one program per tile and the persistent loop (several tiles per program, next tile loaded ahead, a
    # ragged last tile), every dtype and both formats, on data with every tie at scale 1
    from tracefp4 import triton_kernels as tk

    b = BLOCK[fmt]
    x, g = _ties_x(fmt)
    xb = x.to(dtype).reshape(-1, b)
    want = ref.quantize_blocks_ref(xb, fmt, g)
    got = tk.quantize_blocks_triton(xb, fmt, g, config=cfg)
    for a, w in zip(got, want):
        assert_bits_equal(a, w)
    got_nh = tk.quantize_blocks_triton(xb, fmt, g, emit_hints=False, config=cfg)
    assert got_nh[2] is None
    assert_bits_equal(got_nh[0], want[0])
    xn = _noisy(x, 0.02, seed=22).to(dtype).reshape(-1, b)
    for scales, hints in ((want[1], want[2]), (want[1], None), (None, None)):
        yr = ref.fake_quantize_blocks_ref(xn, fmt, g, scales, None if hints is None else tracefp4.unpack_hints(hints))
        yt, _ = tk.fake_quantize_blocks_triton(xn, fmt, g, scales, hints, config=cfg)
        assert_bits_equal(yt, yr)
    y, codes, scales, hints = tk.quantize_fake_blocks_triton(xb, fmt, g, config=cfg)
    assert_bits_equal(y, ref.fake_quantize_blocks_ref(xb, fmt, g))
    for a, w in zip((codes, scales, hints), want):
        assert_bits_equal(a, w)
    d = tk.dequantize_blocks_triton(want[0], want[1], fmt, g, dtype, config=cfg)
    assert_bits_equal(d, ref.dequantize_blocks_ref(tracefp4.unpack_codes(want[0]), want[1], fmt, g, dtype))


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cfg", [("rows", 16, 1, 0), ("rows", 8, 1, 3), ("rows", 32, 1, 32)])
def test_triton_row_layout_matches_reference(cfg, dtype, fmt):
    # the row layout (one thread per 16 input bytes; a block's amax across its rows' threads): one program per
    # tile and the persistent loop with a ragged last tile; quantize takes it for bf16 / fp16 only
    from tracefp4 import triton_kernels as tk
    from tracefp4.errors import LaunchConfigError

    b = BLOCK[fmt]
    x, g = _ties_x(fmt)
    xb = x.to(dtype).reshape(-1, b)
    want = ref.quantize_blocks_ref(xb, fmt, g)
    if dtype == torch.float32:
        with pytest.raises(LaunchConfigError, match="bf16 / fp16"):
            tk.quantize_blocks_triton(xb, fmt, g, config=cfg)
    else:
        for emit in (True, False):
            got = tk.quantize_blocks_triton(xb, fmt, g, emit_hints=emit, config=cfg)
            for a, w in zip(got, want if emit else want[:2]):
                assert_bits_equal(a, w)
        y, codes, scales, hints = tk.quantize_fake_blocks_triton(xb, fmt, g, config=cfg)
        assert_bits_equal(y, ref.fake_quantize_blocks_ref(xb, fmt, g))
        for a, w in zip((codes, scales, hints), want):
            assert_bits_equal(a, w)
    xn = _noisy(x, 0.02, seed=22).to(dtype).reshape(-1, b)
    for scales, hints in ((want[1], want[2]), (want[1], None), (None, None)):
        yr = ref.fake_quantize_blocks_ref(xn, fmt, g, scales, None if hints is None else tracefp4.unpack_hints(hints))
        yt, st = tk.fake_quantize_blocks_triton(xn, fmt, g, scales, hints, return_scales=True, config=cfg)
        assert_bits_equal(yt, yr)
        if scales is None:
            assert_bits_equal(st, ref.quantize_blocks_ref(xn, fmt, g)[1])
    d = tk.dequantize_blocks_triton(want[0], want[1], fmt, g, dtype, config=cfg)
    assert_bits_equal(d, ref.dequantize_blocks_ref(tracefp4.unpack_codes(want[0]), want[1], fmt, g, dtype))


_BF, _FP, _F32 = torch.bfloat16, torch.float16, torch.float32
# each variant on the code paths it changes (a hint word per 8 / 16 / 32 values: the row layout, NVFP4, MXFP4; the
# three input dtypes' piece layouts), not the full product: each case costs seconds under the interpreter
_VARIANT_CASES = [
    *[("nibbles", (8, 1, 0), False, d, f) for d in (_BF, _FP, _F32) for f in ("nvfp4", "mxfp4")],
    *[("nibbles", (4, 1, 3), True, d, "nvfp4") for d in (_BF, _F32)],  # an odd trip count (3): a last tile
    ("gather", (8, 1, 3), True, _BF, "mxfp4"),  # unrolled persistent loop, an even trip count (2)
    ("nibbles_x4", (4, 1, 3), True, _BF, "nvfp4"),
    ("nibbles_x4", (8, 1, 2), False, _FP, "nvfp4"),
    *[("nibbles", ("pairs", 4, 1, 0), False, d, "nvfp4") for d in (_BF, _F32)],
    ("gather", ("pairs", 4, 1, 3), True, _FP, "nvfp4"),
    ("nibbles", ("pairs", 8, 1, 32), False, _BF, "mxfp4"),  # refused: the pair layout is NVFP4's
    *[("nibbles", ("rows", 16, 1, 3), False, d, "nvfp4") for d in (_BF, _FP, _F32)],  # one hint byte per row
]


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("hint_pack,cfg,unroll,dtype,fmt", _VARIANT_CASES)
def test_triton_quantize_variants_match_reference(hint_pack, cfg, unroll, dtype, fmt):
    # quantize's variants (tracefp4.triton_kernels.HINT_PACKS, the pair layout, the unrolled persistent loop) on
    # data with every tie at scale 1: 52 blocks, 50 (no whole groups of 4: "nibbles_x4" falls back) and 51 (odd:
    # the pair layout falls back); the pair layout is NVFP4's, the row layout bf16 / fp16's
    from tracefp4 import triton_kernels as tk
    from tracefp4.errors import LaunchConfigError

    b = BLOCK[fmt]
    x, g = _ties_x(fmt)
    xb = x.to(dtype).reshape(-1, b)
    kw = dict(config=cfg, hint_pack=hint_pack, unroll=unroll)
    if (cfg[0] == "pairs" and fmt != "nvfp4") or (cfg[0] == "rows" and dtype == torch.float32):
        with pytest.raises(LaunchConfigError):
            tk.quantize_blocks_triton(xb, fmt, g, **kw)
        return
    for n in ((52, 50, 51) if hint_pack == "nibbles_x4" else (52, 51)):
        want = ref.quantize_blocks_ref(xb[:n], fmt, g)
        for a, w in zip(tk.quantize_blocks_triton(xb[:n], fmt, g, **kw), want):
            assert_bits_equal(a, w)
    got_nh = tk.quantize_blocks_triton(xb, fmt, g, emit_hints=False, **kw)
    want = ref.quantize_blocks_ref(xb, fmt, g)
    assert got_nh[2] is None
    assert_bits_equal(got_nh[0], want[0])
    assert_bits_equal(got_nh[1], want[1])
    y, codes, scales, hints = tk.quantize_fake_blocks_triton(xb, fmt, g, **kw)
    assert_bits_equal(y, ref.fake_quantize_blocks_ref(xb, fmt, g))
    for a, w in zip((codes, scales, hints), want):
        assert_bits_equal(a, w)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_triton_quantize_variant_arguments_are_checked():
    from tracefp4 import triton_kernels as tk
    from tracefp4.errors import LaunchConfigError

    x, g = _ties_x("nvfp4")
    xb = x.reshape(-1, 16)
    with pytest.raises(LaunchConfigError, match="hint_pack"):
        tk.quantize_blocks_triton(xb, "nvfp4", g, hint_pack="fast")
    with pytest.raises(LaunchConfigError, match="pairs per program"):
        tk.quantize_blocks_triton(xb, "nvfp4", g, config=("pairs", 8, 1))
    with pytest.raises(LaunchConfigError, match="NVFP4 quantize"):  # the pair layout is quantize's only
        tk.fake_quantize_blocks_triton(xb, "nvfp4", g, None, None, config=("pairs", 8, 1, 0))
    # the default hint packing is one of the packings, and the defaults give the reference's bits
    assert tk.HINT_PACK in tk.HINT_PACKS
    for a, w in zip(tk.quantize_blocks_triton(xb, "nvfp4", g), ref.quantize_blocks_ref(xb, "nvfp4", g)):
        assert_bits_equal(a, w)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
def test_triton_row_layout_refuses_bad_configs_and_takes_a_global_scale_per_matrix():
    from tracefp4 import triton_kernels as tk
    from tracefp4.errors import LaunchConfigError

    x, g = _ties_x("nvfp4")
    xb = x.reshape(-1, 16)
    with pytest.raises(LaunchConfigError, match="rows per program, num_warps"):
        tk.fake_quantize_blocks_triton(xb, "nvfp4", g, None, None, config=("rows", 16, 1))
    with pytest.raises(LaunchConfigError, match="divisible"):
        tk.quantize_blocks_triton(xb, "nvfp4", g, config=("rows", 1, 1, 0))  # 2 rows per bf16 block
    stack = torch.tensor([1.0, 0.25])  # one global scale per matrix (6 blocks each): as in the block layout
    for scales in (None, ref.quantize_blocks_ref(xb[:12], "nvfp4", torch.tensor(1.0))[1]):
        want, _ = tk.fake_quantize_blocks_triton(xb[:12], "nvfp4", stack, scales, None, config=(8, 1, 0))
        got, _ = tk.fake_quantize_blocks_triton(xb[:12], "nvfp4", stack, scales, None, config=("rows", 16, 1, 0))
        assert_bits_equal(got, want)


@pytest.mark.skipif(not HAS_TRITON, reason="no triton")
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_backward_kernel_ragged_matches_reference(fmt):
    # the backward kernel's config is (BN, num_warps); anything else is refused
    from tracefp4 import triton_kernels as tk

    b = BLOCK[fmt]
    x, g = _ties_x(fmt)
    xb = x.reshape(-1, b)
    scales = ref.quantize_blocks_ref(xb, fmt, g)[1]
    xn = _noisy(x, 0.02, seed=22).reshape(-1, b)
    grad = torch.randn(xn.shape).to(torch.bfloat16).to(xn.device)
    want = ref.fake_quantize_bwd_blocks_ref(grad, xn, fmt, g, scales)
    assert_bits_equal(tk.fake_quantize_bwd_blocks_triton(grad, xn, fmt, g, scales, config=(32, 1)), want)
    with pytest.raises(ValueError, match="blocks per program, num_warps"):
        tk.fake_quantize_bwd_blocks_triton(grad, xn, fmt, g, scales, config=(32, 1, 0))
    with pytest.raises(ValueError, match="programs per SM"):
        tk.quantize_blocks_triton(xb, fmt, g, config=(32, 1))
