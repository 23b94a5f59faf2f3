"""Margin exceptions in tracefp4 (`margin_marks`, `margin_fill`, NUMERICS §12): the fp32 / int32 formulation decides
every mark exactly as the float64 definition of `tracerl.hints.compact` does (a float64 oracle here, checked against
compact's own functions), on the edges that matter: every ladder value and boundary, the boundaries moved by each
margin and their fp32 neighbours, zeros, subnormals, huge values, Inf and NaN, every E4M3 value and midpoint, t
clamped at 2^-9 and 448, a stride through all of fp32; the Triton kernels (TRITON_INTERPRET=1 on CPU) equal the
torch reference bit for bit on bf16 / fp16 / fp32 with special values; bad input raises typed errors."""

from __future__ import annotations

import math

import pytest
import torch

from helpers.fp4 import DEVICE, needs_triton  # first: selects Triton's interpreter
import tracefp4
from tracefp4 import margin as M
from tracefp4 import reference as ref
from tracefp4.errors import BackendError, DTypeError, FormatError, ShapeError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy 1/0 in masked interpreter lanes

INF = math.inf
MARGINS = [0.0, 1e-7, 0.03, 0.1, 0.25, 0.5, 0.5000001, 0.6, 100.0, 1e39, INF]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
LADDER = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
MIDS = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


# ---- the float64 oracle (tracerl.hints.compact's definitions, written out) ---------------------------------
def oracle_value_distance(v: torch.Tensor) -> torch.Tensor:
    a = v.double().abs()
    u = torch.where(a <= 2, 2 * a, torch.where(a <= 4, a + 2, a / 2 + 4))
    u = torch.where(torch.signbit(v), -u, u)
    au = u.abs()
    return torch.where(au > 7, au - 6.5, 0.5 - (au - torch.round(au)).abs())


def oracle_scale_distance(t: torch.Tensor) -> torch.Tensor:
    td = t.double()
    mant, exp = torch.frexp(td)
    w = torch.where(td >= 2.0**-6, 8.0 * (exp.double() + 5.0 + 2.0 * mant), td * 512.0)
    return 0.5 - (w - torch.round(w)).abs()


def oracle_t(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    t_, w = x.shape
    a = x.float().abs().reshape(t_, w // 16, 16)
    amax = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=-1)
    return torch.clamp(ref.div_rn(ref.div_rn(amax, 6.0), g), min=2.0**-9, max=448.0)


def oracle_v(x: torch.Tensor, scales: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    r = ref.div_rn(ref.div_rn(torch.ones_like(g), g), ref.e4m3_decode(scales))
    return x.float() * r.repeat_interleave(16, dim=1)


def oracle_marks(x, g, scales, hints, m, ms):
    """(value_mask bool [T, W], scale_mask bool [T, W/16]) as encode_margin_exceptions computed them in float64."""
    t_r = oracle_t(x, g)
    smask = (oracle_scale_distance(t_r) < ms) | (ref.e4m3_encode(t_r) != scales)
    if math.isinf(ms):
        smask = torch.ones_like(smask)
    v = oracle_v(x, scales, g)
    own = (ref.e2m1_rne_magnitude(v) & 1).to(torch.uint8)
    vmask = (oracle_value_distance(v) < m) | (own != tracefp4.unpack_hints(hints))
    if math.isinf(m):
        vmask = torch.ones_like(vmask)
    return vmask, smask


def oracle_fill(x, g, vmask, smask, bits, stored, payload):
    """(scales, hint bits) of compact.reconstruct's float64 rule from dense stored values (bits [T, W], stored
    [T, W/16]: bytes, or LSBs with payload "lsb")."""
    t_t = oracle_t(x, g)
    scales = ref.e4m3_encode(t_t)
    if payload == "lsb":
        td = t_t.double()
        mant, exp = torch.frexp(td)
        w = torch.where(td >= 2.0**-6, 8.0 * (exp.double() + 5.0 + 2.0 * mant), td * 512.0)
        low = torch.floor(w).clamp(max=125).to(torch.int32)
        stored = torch.where((low & 1) == (stored.to(torch.int32) & 1), low, low + 1).to(torch.uint8)
    scales = torch.where(smask, stored, scales)
    rtn = (ref.e2m1_rne_magnitude(oracle_v(x, scales, g)) & 1).to(torch.uint8)
    return scales, torch.where(vmask, bits, rtn)


def test_the_oracle_is_compacts_definition():
    from tracerl.hints import compact as C

    a = _edge_values(0.1)
    v = torch.cat([a, -a])
    d = C.boundary_distance(C.ladder_position(v))
    assert torch.equal(torch.isnan(d), torch.isnan(oracle_value_distance(v)))
    assert torch.equal(d.nan_to_num(-1.0), oracle_value_distance(v).nan_to_num(-1.0))
    t = _edge_scales(0.1)
    assert torch.equal(C.scale_boundary_distance(C.scale_position(t)), oracle_scale_distance(t))
    x, g, s, h = _data(4, 64, torch.float32, seed=3)
    assert torch.equal(C.block_scale_t(x.float(), g), oracle_t(x, g))


# ---- edge data --------------------------------------------------------------------------------------------
def _f32(vals) -> torch.Tensor:
    return torch.tensor(vals, dtype=torch.float64).float()


def _bits_to_f32(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int64).clamp(0, 0x7FFFFFFF).to(torch.int32).view(torch.float32)


def _around(a: torch.Tensor, ulps: int = 3) -> torch.Tensor:
    """a and its fp32 neighbours up to ``ulps`` bit patterns away (non-negative a)."""
    b = a.view(torch.int32).to(torch.int64)
    return torch.cat([_bits_to_f32(b + k) for k in range(-ulps, ulps + 1)])


def _edge_values(m: float) -> torch.Tensor:
    """Non-negative fp32 |v|: every ladder value and boundary, the boundaries moved by the margin in ladder units
    (in a: m / 2 below 2, m between 2 and 4, 2 m above 4), the interval ends the formulation uses, each with its
    fp32 neighbours; zeros, subnormals, tiny and huge values, Inf, NaN."""
    steps = [0.5] * 4 + [1.0] * 2 + [2.0]
    mm = 0.0 if math.isinf(m) else m
    moved = [c + s * k * mm for c, s in zip(MIDS, steps) for k in (-1, 1)]
    moved += [6.0 + 2 * mm, 2 * mm, 0.5 - mm / 2] if mm < 1e30 else []
    base = _f32(LADDER + MIDS + [x for x in moved if x < 3e38])
    ends = torch.tensor([v for lo_hi in M.value_intervals(m) for v in lo_hi if lo_hi != M.EMPTY],
                        dtype=torch.int64)
    special = torch.tensor([0, 1, 2, 0x7FFFFF, 0x800000, 0x23800000, 0x23800001, 0x7F7FFFFF, 0x7F800000,
                            0x7FC00000, 0x7F800001, 0x7FFFFFFF], dtype=torch.int64)
    return torch.cat([_around(base), _around(_bits_to_f32(ends)), _around(_bits_to_f32(special)),
                      _f32([1e-30, 1e-38, 1e-45, 3e-8, 7.0, 13.0, 1e10, 3e38])])


def _edge_scales(ms: float) -> torch.Tensor:
    """fp32 t in [2^-9, 448]: every E4M3 value and midpoint, moved by the margin in E4M3 steps, neighbours."""
    vals = ref.e4m3_decode(torch.arange(1, 127, dtype=torch.uint8)).double()
    step = vals[1:] - vals[:-1]
    mid = (vals[1:] + vals[:-1]) / 2
    mm = 0.0 if math.isinf(ms) else min(ms, 0.75)
    pts = torch.cat([vals, mid, mid - mm * step, mid + mm * step, vals[:-1] + mm * step]).float()
    return _around(pts).clamp(2.0**-9, 448.0)


def _stride(lo: int, hi: int, step: int) -> torch.Tensor:
    return _bits_to_f32(torch.arange(lo, hi, step, dtype=torch.int64))


# ---- the exact formulation, on its own ------------------------------------------------------------------------
@pytest.mark.parametrize("m", MARGINS)
def test_value_intervals_decide_the_float64_distance_exactly(m):
    a = torch.cat([_edge_values(m), _stride(0, 0x7F800000 + 1, 4099), _stride(0x3E000000, 0x40E00000, 37)])
    want = oracle_value_distance(a) < m if not math.isinf(m) else torch.ones(a.shape, dtype=torch.bool)
    got = M._in_intervals(M._abs_bits(a), M.value_intervals(m))
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [(float(a[i]), hex(int(a[i].view(torch.int32)))) for i in bad[:5]]
    # the test data has both answers near every boundary unless the margin is 0 or covers everything
    if 0 < m <= 0.5:
        assert 0 < int(want.sum()) < want.numel()


def test_value_intervals_shapes():
    assert M.value_intervals(0.0) == (M.EMPTY,) * 7
    assert M.value_intervals(INF) == (M.ALL,) + (M.EMPTY,) * 6
    assert len([r for r in M.value_intervals(0.1) if r != M.EMPTY]) == 7  # one around each boundary
    one = M.value_intervals(0.6)  # above 1/2: all of [0, 6] and beyond it up to u = 7.1, one range
    assert one[0][0] == 0 and one[1:] == (M.EMPTY,) * 6
    assert float(_bits_to_f32(torch.tensor([one[0][1]]))) == pytest.approx(6.2, abs=1e-6)
    # rounding in float64: 0.5 - 2a is 0.5 for tiny a, so such values are not within 1/2 of the boundary 0.25
    assert M.value_intervals(0.5)[0][0] == 0x23800001


@pytest.mark.parametrize("ms", MARGINS)
def test_scale_threshold_decides_the_float64_distance_exactly(ms):
    t = torch.cat([_edge_scales(ms), _stride(0x3B000000, 0x43E00001, 257)])
    t = t[(t >= 2.0**-9) & (t <= 448.0)]
    want = oracle_scale_distance(t) < ms
    _, f23 = M.scale_fields(t)
    got = (f23 - M.HALF23).abs() < M.scale_margin_threshold(ms)
    bad = (got != want).nonzero().flatten()
    assert bad.numel() == 0, [float(t[i]) for i in bad[:5]]
    if 0 < ms <= 0.5:
        assert 0 < int(want.sum()) < want.numel()


def test_scale_fields_give_the_floor_and_the_rounded_e4m3_byte():
    t = torch.cat([_edge_scales(0.3), _stride(0x3B000000, 0x43E00001, 1009)])
    t = t[(t >= 2.0**-9) & (t <= 448.0)]
    fb, f23 = M.scale_fields(t)
    assert torch.equal(fb, ref.e4m3_floor_byte(t))
    assert torch.equal(M._own_byte(fb, f23).to(torch.uint8), ref.e4m3_encode(t))
    assert torch.equal(M._own_byte(fb, f23).to(torch.uint8), t.to(torch.float8_e4m3fn).view(torch.uint8))
    ends = _f32([2.0**-9, 448.0])
    assert M.scale_fields(ends)[0].tolist() == [1, 126] and M.scale_fields(ends)[1].tolist() == [0, 0]


def test_rtn_lsb_of_bits_is_the_reference_code_lsb():
    a = torch.cat([_edge_values(0.1), -_edge_values(0.03)])
    assert torch.equal(M.rtn_lsb_of_bits(M._abs_bits(a)), ref.e2m1_rne_magnitude(a) & 1)


# ---- the reference against the oracle, end to end ---------------------------------------------------------------
def _data(rows: int, width: int, dtype, seed: int, given: str = "own"):
    """(x, g, scales, hints): rows of spread magnitudes with special values; blocks with g = 1 and amax 6 (scale
    1.0, so v = x) holding edge values; the rollout's own scales and hints, or ("engine") some given scale bytes
    replaced (0, NaN 0x7F / 0xFF, negative 0xB8, neighbours) and some hint bits flipped."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=gen) * torch.exp(2 * torch.randn(rows, 1, generator=gen))
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 30),), generator=gen)
    pool = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), -float("inf"), 1e-30, 1e-40, 3e38])
    flat[idx] = pool[torch.randint(0, len(pool), idx.shape, generator=gen)]
    edges = _edge_values(0.1)
    edges = edges[torch.isfinite(edges) & (edges <= 6.0)]
    edges = edges[torch.randperm(edges.numel(), generator=gen)]
    blocks = x.view(-1, 16)[: max(1, rows * width // 64)]  # a quarter of the blocks: v = x with g = 1
    n = blocks.shape[0] * 15
    blocks[:, 1:] = edges.repeat(n // edges.numel() + 1)[:n].reshape(-1, 15) * torch.where(
        torch.rand(blocks.shape[0], 15, generator=gen) < 0.5, -1.0, 1.0)
    blocks[:, 0] = 6.0
    x = x.to(dtype)
    g = torch.tensor(1.0)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    scales, hints = q.scales.clone(), q.hints.clone()
    if given == "engine":
        s = scales.view(-1)
        pick = torch.randint(0, s.numel(), (max(1, s.numel() // 5),), generator=gen)
        s[pick] = torch.tensor([0, 0x7F, 0xFF, 0xB8, 0x37, 0x39, 1, 126], dtype=torch.uint8)[
            torch.randint(0, 8, pick.shape, generator=gen)]
        h = hints.view(-1)
        flip = torch.randint(0, h.numel(), (max(1, h.numel() // 7),), generator=gen)
        h[flip] ^= (1 << torch.randint(0, 8, flip.shape, generator=gen)).to(torch.uint8)
    return x, g, scales, hints


def _unpack_blocks(bm: torch.Tensor, nb: int) -> torch.Tensor:
    return tracefp4.unpack_hints(bm)[:, :nb].bool()


@pytest.mark.parametrize("given", ["own", "engine"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_marks_reference_equals_the_float64_oracle(dtype, given):
    x, g, s, h = _data(24, 128, dtype, seed=7, given=given)
    for m in MARGINS:
        for ms in (0.0, 0.1, 0.5, INF):
            vm, bm = tracefp4.margin_marks(x, g, s, h, m, ms, backend="reference")
            want_v, want_s = oracle_marks(x, g, s, h, m, ms)
            assert torch.equal(tracefp4.unpack_hints(vm).bool(), want_v), (m, ms)
            assert torch.equal(_unpack_blocks(bm, 8), want_s), (m, ms)
            assert bm.shape == (24, 1) and int((bm >> 8).sum()) == 0


@pytest.mark.parametrize("payload", ["byte", "lsb"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_reference_equals_the_float64_oracle(dtype, payload):
    x, g, s, h = _data(24, 128, dtype, seed=8, given="engine")
    xt = (x.float() * (1 + 0.02 * torch.randn(x.shape, generator=torch.Generator().manual_seed(9)))).to(dtype)
    gen = torch.Generator().manual_seed(10)
    vmask = torch.rand(x.shape, generator=gen) < 0.3
    smask = torch.rand(24, 8, generator=gen) < 0.5
    bits = tracefp4.unpack_hints(h)
    stored = s if payload == "byte" else s & 1
    want_s, want_bits = oracle_fill(xt, g, vmask, smask, bits, stored, payload)
    st = s if payload == "byte" else tracefp4.pack_hints(s & 1)  # 8 blocks per row: one byte of LSBs
    scales, hints = tracefp4.margin_fill(xt, g, tracefp4.pack_hints(vmask), tracefp4.pack_hints(smask),
                                         h, st, payload, backend="torch")
    assert torch.equal(scales, want_s)
    assert torch.equal(tracefp4.unpack_hints(hints), want_bits)


def test_fill_with_nothing_marked_is_the_own_quantization_and_with_everything_the_stored():
    x, g, s, h = _data(8, 256, torch.bfloat16, seed=11)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    zero_v, zero_b = torch.zeros_like(h), torch.zeros(8, 2, dtype=torch.uint8)
    rnd = torch.randint(0, 256, h.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    scales, hints = tracefp4.margin_fill(x, g, zero_v, zero_b, rnd, rnd[:, :16], "byte", backend="reference")
    assert torch.equal(scales, q.scales) and torch.equal(hints, q.hints)
    scales, hints = tracefp4.margin_fill(x, g, zero_v + 255, zero_b + 255, rnd, rnd[:, :16], "byte",
                                         backend="reference")
    assert torch.equal(scales, rnd[:, :16]) and torch.equal(hints, rnd)


# ---- Triton (interpreter on CPU) == reference, bit for bit ------------------------------------------------------
SHAPES = [(3, 48), (4, 272), (2, 1040)]  # 3 blocks; 17 blocks (3 bytes of block bits); 65 blocks: 2 programs a row


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_marks_triton_equals_reference(dtype):
    for shape in SHAPES:
        x, g, s, h = _data(*shape, dtype, seed=shape[1], given="engine" if shape[0] != 4 else "own")
        x, g, s, h = x.to(DEVICE), g.to(DEVICE), s.to(DEVICE), h.to(DEVICE)
        for m, ms in ((0.0, 0.0), (0.03, 0.1), (0.5, 0.5), (1e-7, 0.03), (0.6, INF), (INF, 0.25)):
            want = tracefp4.margin_marks(x, g, s, h, m, ms, backend="reference")
            got = tracefp4.margin_marks(x, g, s, h, m, ms, backend="triton")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (shape, m, ms)


@needs_triton
@pytest.mark.parametrize("payload", ["byte", "lsb"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fill_triton_equals_reference(dtype, payload):
    gen = torch.Generator().manual_seed(5)
    for rows, width in SHAPES:
        x, g, s, h = _data(rows, width, dtype, seed=width + 1, given="engine")
        nb, nbb = width // 16, -(-width // 128)
        vm = torch.randint(0, 256, h.shape, dtype=torch.uint8, generator=gen)
        bm = torch.randint(0, 256, (rows, nbb), dtype=torch.uint8, generator=gen)
        sh = torch.randint(0, 256, h.shape, dtype=torch.uint8, generator=gen)
        ss = s if payload == "byte" else torch.randint(0, 256, (rows, nbb), dtype=torch.uint8, generator=gen)
        args = [t.to(DEVICE) for t in (x, g, vm, bm, sh, ss)]
        want = tracefp4.margin_fill(*args, payload, backend="reference")
        got = tracefp4.margin_fill(*args, payload, backend="triton")
        assert got[0].shape == (rows, nb) and got[1].shape == (rows, width // 8)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (rows, width)


@needs_triton
def test_every_special_bit_pattern_on_both_backends():
    """NaNs of both signs and several payloads, +-Inf, +-0, the extreme subnormals and the largest finite value of
    each dtype, in blocks of ordinary values and blocks made only of them, with given bytes 0 / NaN / negative."""
    pats = {torch.float32: [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000,
                            1, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF],
            torch.float16: [0x7E00, 0xFE00, 0x7C01, 0xFFFF, 0x7C00, 0xFC00, 0, 0x8000, 1, 0x83FF, 0x7BFF, 0xFBFF],
            torch.bfloat16: [0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0, 0x8000, 1, 0x807F, 0x7F7F, 0xFF7F]}
    for dtype, p in pats.items():
        idt = torch.int32 if dtype == torch.float32 else torch.int16
        sp = torch.tensor(p, dtype=torch.int64).to(torch.int32).to(idt).view(dtype)
        rows = []
        for v in sp:
            row = torch.linspace(-3.0, 5.0, 16).to(dtype)
            row[3] = v
            rows.append(row)
        rows.append(sp.repeat(2)[:16])
        x = torch.stack(rows).repeat(1, 2).to(DEVICE)  # [13, 32]
        g = torch.tensor(0.37, device=DEVICE)
        q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
        s = q.scales.clone()
        s[::3, 0] = torch.tensor([0, 0x7F, 0xB8, 0xFF, 0x38], dtype=torch.uint8, device=DEVICE)[: s[::3].shape[0]]
        for m, ms in ((0.1, 0.1), (INF, INF), (0.0, 0.0)):
            want = tracefp4.margin_marks(x, g, s, q.hints, m, ms, backend="reference")
            got = tracefp4.margin_marks(x, g, s, q.hints, m, ms, backend="triton")
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            ov, os_ = oracle_marks(x.cpu(), g.cpu(), s.cpu(), q.hints.cpu(), m, ms)
            assert torch.equal(tracefp4.unpack_hints(want[0]).bool().cpu(), ov)
            assert torch.equal(_unpack_blocks(want[1], 2).cpu(), os_)
            for payload, st in (("byte", s), ("lsb", want[1])):
                f_want = tracefp4.margin_fill(x, g, *want, q.hints, st, payload, backend="reference")
                f_got = tracefp4.margin_fill(x, g, *want, q.hints, st, payload, backend="triton")
                assert torch.equal(f_got[0], f_want[0]) and torch.equal(f_got[1], f_want[1])


@needs_triton
def test_compact_encodes_and_reconstructs_the_same_on_both_backends():
    from tracerl.hints import compact as C

    x, g, s, h = _data(6, 256, torch.bfloat16, seed=12, given="engine")
    xt = (x.float() * 1.01).to(x.dtype)
    for payload in ("byte", "lsb"):
        enc = C.encode_margin_exceptions(x, g, s, h, 0.1, 0.2, scale_payload=payload, backend="reference")
        assert C.encode_margin_exceptions(x, g, s, h, 0.1, 0.2, scale_payload=payload, backend="triton") == enc
        a, b = C.reconstruct(enc, xt, g, backend="reference"), C.reconstruct(enc, xt, g, backend="triton")
        assert torch.equal(a.scales_e4m3, b.scales_e4m3) and torch.equal(a.hints_packed, b.hints_packed)


# ---- errors ---------------------------------------------------------------------------------------------------
def test_bad_input_raises_typed_errors_that_say_what_arrived():
    x, g, s, h = _data(2, 32, torch.float32, seed=1)
    with pytest.raises(DTypeError, match="int32"):
        tracefp4.margin_marks(x.to(torch.int32), g, s, h, 0.1, 0.1)
    with pytest.raises(DTypeError, match="float64"):
        tracefp4.margin_marks(x.double(), g, s, h, 0.1, 0.1)
    with pytest.raises(DTypeError, match="list"):
        tracefp4.margin_marks(x.tolist(), g, s, h, 0.1, 0.1)
    for bad in (x.reshape(-1), x[:, :24], x[:, :0]):
        with pytest.raises(ShapeError, match=r"multiple of 16; got shape"):
            tracefp4.margin_marks(bad, g, s, h, 0.1, 0.1)
    with pytest.raises(DTypeError, match="scales must be uint8.*float32"):
        tracefp4.margin_marks(x, g, s.float(), h, 0.1, 0.1)
    with pytest.raises(ShapeError, match=r"scales must have shape \[2, 2\]; got \[2, 1\]"):
        tracefp4.margin_marks(x, g, s[:, :1], h, 0.1, 0.1)
    with pytest.raises(ShapeError, match=r"hints must have shape \[2, 4\]"):
        tracefp4.margin_marks(x, g, s, h[:1], 0.1, 0.1)
    for bad in (-0.1, float("nan"), True, "0.1", None):
        with pytest.raises(FormatError, match=r"margin must be a number >= 0"):
            tracefp4.margin_marks(x, g, s, h, bad, 0.1)
        with pytest.raises(FormatError, match=r"scale_margin must be a number >= 0"):
            tracefp4.margin_marks(x, g, s, h, 0.1, bad)
    with pytest.raises(ShapeError, match="global_scale must have one element"):
        tracefp4.margin_marks(x, torch.ones(2), s, h, 0.1, 0.1)
    with pytest.raises(DTypeError, match="global_scale must be a floating tensor"):
        tracefp4.margin_marks(x, torch.ones(1, dtype=torch.int32), s, h, 0.1, 0.1)
    with pytest.raises(FormatError, match="global_scale"):
        tracefp4.margin_marks(x, None, s, h, 0.1, 0.1)
    with pytest.raises(FormatError, match="positive finite"):
        tracefp4.margin_marks(x, -1.0, s, h, 0.1, 0.1)
    with pytest.raises(BackendError, match="backend must be one of"):
        tracefp4.margin_marks(x, g, s, h, 0.1, 0.1, backend="cuda")
    vm, bm = tracefp4.margin_marks(x, g, s, h, 0.1, 0.1, backend="torch")
    with pytest.raises(FormatError, match="scale_payload must be one of"):
        tracefp4.margin_fill(x, g, vm, bm, h, s, "nibble")
    with pytest.raises(ShapeError, match=r"stored_scales must have shape \[2, 1\]; got \[2, 2\]"):
        tracefp4.margin_fill(x, g, vm, bm, h, s, "lsb")  # lsb takes packed bits: ceil(2 / 8) = 1 byte a row
    with pytest.raises(ShapeError, match=r"block_marks must have shape \[2, 1\]"):
        tracefp4.margin_fill(x, g, vm, s, h, s, "byte")
    with pytest.raises(ShapeError, match=r"value_marks must have shape \[2, 4\]"):
        tracefp4.margin_fill(x, g, vm[:, :2], bm, h, s, "byte")
    with pytest.raises(DTypeError, match="stored_hints must be uint8.*bool"):
        tracefp4.margin_fill(x, g, vm, bm, h.bool(), s, "byte")
    assert issubclass(DTypeError, TypeError) and issubclass(ShapeError, ValueError)


def test_one_byte_dtypes_are_read_as_raw_bits():
    x, g, s, h = _data(2, 32, torch.float32, seed=2)
    want = tracefp4.margin_marks(x, g, s, h, 0.1, 0.1, backend="reference")
    got = tracefp4.margin_marks(x, g, s.view(torch.float8_e4m3fn), h.view(torch.int8), 0.1, 0.1, backend="reference")
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_marks_into_given_tensors(backend):
    """``out=``: the marks are written into the caller's tensors (e.g. views of a capture buffer), the same bits."""
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE) * 4
    q = tracefp4.quantize(x, global_scale=0.02, backend="reference")
    want = tracefp4.margin_marks(x, 0.02, q.scales, q.hints, 0.1, 0.2, backend="reference")
    buf = torch.full((2, 64), 7, dtype=torch.uint8, device=DEVICE)
    out = (buf[0, :30].view(5, 6), buf[1, :5].view(5, 1))
    got = tracefp4.margin_marks(x, 0.02, q.scales, q.hints, 0.1, 0.2, backend=backend, out=out)
    assert got[0] is out[0] and got[1] is out[1]
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    assert bool((buf[0, 30:] == 7).all()) and bool((buf[1, 5:] == 7).all())  # nothing written past them
    with pytest.raises(ShapeError, match=r"out value marks must be a contiguous uint8 tensor of shape \[5, 6\]"):
        tracefp4.margin_marks(x, 0.02, q.scales, q.hints, 0.1, 0.2, out=(out[0][:4], out[1]))
    with pytest.raises(ShapeError, match="not contiguous"):
        tracefp4.margin_marks(x, 0.02, q.scales, q.hints, 0.1, 0.2,
                              out=(torch.zeros(6, 5, dtype=torch.uint8, device=DEVICE).t(), out[1]))
    with pytest.raises(DTypeError, match="out block marks must be a uint8"):
        tracefp4.margin_marks(x, 0.02, q.scales, q.hints, 0.1, 0.2, out=(out[0], out[1].bool()))
    with pytest.raises(ShapeError, match="a pair of tensors"):
        tracefp4.margin_marks(x, 0.02, q.scales, q.hints, 0.1, 0.2, out=out[0])


# ---- marks fused into the rollout's capture (quantize_fake(marks=)) -------------------------------------------
def _fused(x, g, m, ms, backend, config=None):
    """quantize_fake with marks into fresh buffers, and (y, q) of the same call without marks."""
    t_, w = x.shape
    out = (torch.full((t_, w // 8), 0xA5, dtype=torch.uint8, device=x.device),
           torch.full((t_, -(-w // 128)), 0xA5, dtype=torch.uint8, device=x.device))
    y, q = tracefp4.quantize_fake(x, global_scale=g, backend=backend, marks=(m, ms), marks_out=out)
    return y, q, out


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_marks_fused_into_quantize_fake_equal_margin_marks(dtype, monkeypatch):
    """Rows of 128 / 256 values: the Triton capture kernel writes the marks in its own pass (no `margin_marks`
    launch: patched to fail), bit for bit `margin_marks` of its own scales and hints, with NaN, Inf, zeros, edge
    values, every margin kind; its y, codes, scales and hints are those of the call without marks."""
    for rows, w in ((7, 128), (3, 256), (40, 128)):
        x, _, _, _ = _data(rows, w, dtype, seed=w + rows)
        x = x.to(DEVICE)
        for g in (torch.tensor(1.0, device=DEVICE), torch.tensor(0.37, device=DEVICE)):
            y0, q0 = tracefp4.quantize_fake(x, global_scale=g, backend="triton")
            for m, ms in ((0.0, 0.0), (0.03, 0.1), (0.5, 0.5), (0.6, INF), (INF, 0.25)):
                with monkeypatch.context() as mp:
                    mp.setattr(M, "margin_marks", lambda *a, **k: pytest.fail("marks not fused"))
                    y, q, out = _fused(x, g, m, ms, "triton")
                want = tracefp4.margin_marks(x, g, q.scales, q.hints, m, ms, backend="reference")
                assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1]), (rows, w, m, ms)
                for a, b in ((q.codes, q0.codes), (q.scales, q0.scales), (q.hints, q0.hints)):
                    assert torch.equal(a, b)
                assert torch.equal(y.view(-1).view(torch.uint8), y0.view(-1).view(torch.uint8))


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_marks_with_quantize_fake_where_they_do_not_fuse(backend):
    """Rows not a multiple of 128 values (block marks not whole bytes per row) and the reference backend: the marks
    still come, by a `margin_marks` launch after the capture; a 3-d x counts its rows."""
    x = (torch.randn(2, 3, 48, generator=torch.Generator().manual_seed(5)) * 3).to(DEVICE)
    g = torch.tensor(0.5, device=DEVICE)
    y, q, out = _fused(x.reshape(6, 48), g, 0.1, 0.2, backend)
    want = tracefp4.margin_marks(x.reshape(6, 48), g, q.scales, q.hints, 0.1, 0.2, backend="reference")
    assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
    out3 = (torch.zeros(6, 6, dtype=torch.uint8, device=DEVICE), torch.zeros(6, 1, dtype=torch.uint8, device=DEVICE))
    tracefp4.quantize_fake(x, global_scale=g, backend=backend, marks=(0.1, 0.2), marks_out=out3)
    assert torch.equal(out3[0], want[0]) and torch.equal(out3[1], want[1])


def test_quantize_fake_marks_bad_input():
    x = torch.randn(4, 128, device=DEVICE)
    ok = (torch.zeros(4, 16, dtype=torch.uint8, device=DEVICE), torch.zeros(4, 1, dtype=torch.uint8, device=DEVICE))
    with pytest.raises(ShapeError, match="marks need marks_out"):
        tracefp4.quantize_fake(x, global_scale=1.0, marks=(0.1, 0.1))
    with pytest.raises(FormatError, match="margin must be a number >= 0"):
        tracefp4.quantize_fake(x, global_scale=1.0, marks=(-0.1, 0.1), marks_out=ok)
    with pytest.raises(FormatError, match="NVFP4 sites with hints"):
        tracefp4.quantize_fake(x, "mxfp4", marks=(0.1, 0.1), marks_out=ok)
    with pytest.raises(FormatError, match="NVFP4 sites with hints"):
        tracefp4.quantize_fake(x, global_scale=1.0, emit_hints=False, marks=(0.1, 0.1), marks_out=ok)
    with pytest.raises(FormatError, match=r"marks must be \(margin, scale_margin\)"):
        tracefp4.quantize_fake(x, global_scale=1.0, marks=0.1, marks_out=ok)
    with pytest.raises(ShapeError, match=r"out value marks must be a contiguous uint8 tensor of shape \[4, 16\]"):
        tracefp4.quantize_fake(x, global_scale=1.0, marks=(0.1, 0.1), marks_out=(ok[0][:3], ok[1]))
