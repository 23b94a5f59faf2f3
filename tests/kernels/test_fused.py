"""Tests of `tracefp4.quantize_fake` (the rollout's fused capture), the Triton `dequantize`, and input edge cases
of every Triton kernel (fp16 NaN signs, degenerate global scales, zero and NaN scale bytes, every code and
scale byte). Triton runs under TRITON_INTERPRET=1 on CPU and compiled on a GPU; every comparison is bit for
bit against `tracefp4.reference`.
"""

from __future__ import annotations

import pytest
import torch

from helpers.fp4 import (  # first: selects Triton's interpreter without CUDA
    BACKENDS, BLOCK, DEVICE, DTYPES, FMTS, HAS_TRITON, assert_bits_equal, needs_triton,
)
import tracefp4
from tracefp4.errors import FormatError, ShapeError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy 1/0 in masked interpreter lanes


def assert_q_equal(q, w) -> None:
    assert q.fmt == w.fmt
    assert_bits_equal(q.codes, w.codes)
    assert_bits_equal(q.scales, w.scales)
    assert (q.hints is None) == (w.hints is None)
    if q.hints is not None:
        assert_bits_equal(q.hints, w.hints)
    assert (q.global_scale is None) == (w.global_scale is None)
    if q.global_scale is not None:
        assert_bits_equal(q.global_scale, w.global_scale)


def _random_x(shape, dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(2 * torch.randn(*shape[:-1], 1, generator=g))
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 40),), generator=g)
    pool = torch.tensor([0.0, -0.0, float("nan"), -float("nan"), float("inf"), float("-inf"), 0.25, 5.0, 6.0,
                         1e-30, -1e-40])
    flat[idx] = pool[torch.randint(0, len(pool), idx.shape, generator=g)]
    return x.to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------------------------------------
# quantize_fake == (fake_quantize, quantize)
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fake_equals_fake_quantize_and_quantize(dtype, fmt, backend):
    x = _random_x((3, 5, 4 * BLOCK[fmt]), dtype, seed=BLOCK[fmt] + len(str(dtype)))
    for g in ([None, 0.37, torch.tensor(2.5, device=DEVICE)] if fmt == "nvfp4" else [None]):
        y, q = tracefp4.quantize_fake(x, fmt, global_scale=g, backend=backend)
        want_q = tracefp4.quantize(x, fmt, global_scale=g, backend="reference")
        assert_q_equal(q, want_q)
        gs = want_q.global_scale if fmt == "nvfp4" else None
        assert_bits_equal(y, tracefp4.fake_quantize(x, fmt, global_scale=gs, backend="reference"))
        assert y.shape == x.shape and q.codes.shape == (3, 5, 2 * BLOCK[fmt])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["floor", "rceil"])
def test_quantize_fake_mxfp4_rules_and_no_hints(rule, backend):
    x = _random_x((9, 64), torch.bfloat16, seed=5)
    y, q = tracefp4.quantize_fake(x, "mxfp4", backend=backend, scale_rule=rule, emit_hints=False)
    assert q.hints is None
    assert_q_equal(q, tracefp4.quantize(x, "mxfp4", backend="reference", scale_rule=rule, emit_hints=False))
    assert_bits_equal(y, tracefp4.fake_quantize(x, "mxfp4", backend="reference", scale_rule=rule))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ste", ["identity", "clip"])
def test_quantize_fake_backward_is_fake_quantize_backward(ste, backend):
    x = (_random_x((4, 64), torch.float32, seed=8).nan_to_num(0.0, 0.0, 0.0) * 1.3)
    grads = []
    for fn in ("fused", "fake"):
        xx = x.clone().requires_grad_(True)
        if fn == "fused":
            y, _ = tracefp4.quantize_fake(xx, "nvfp4", global_scale=0.5, backend=backend, ste=ste)
        else:
            y = tracefp4.fake_quantize(xx, "nvfp4", global_scale=0.5, backend=backend, ste=ste)
        y.backward(torch.arange(y.numel(), dtype=y.dtype, device=y.device).reshape(y.shape))
        grads.append(xx.grad)
    assert_bits_equal(grads[0], grads[1])
    if ste == "clip":
        assert bool((grads[0] == 0).any())


def test_quantize_fake_errors():
    with pytest.raises(ShapeError):
        tracefp4.quantize_fake(torch.zeros(3, 24))
    with pytest.raises(FormatError, match="ste"):
        tracefp4.quantize_fake(torch.zeros(16), ste="nope")
    with pytest.raises(FormatError):
        tracefp4.quantize_fake(torch.zeros(32), "mxfp4", global_scale=2.0)
    with pytest.raises(FormatError, match="scale_rule"):
        tracefp4.quantize_fake(torch.zeros(32), "mxfp4", scale_rule="ceil")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_fake_writes_into_given_buffers(dtype, fmt, backend):
    """scales_out / hints_out (views into one larger capture buffer, as a CUDA-graph decode stages them): the
    same bits as fresh outputs, written in place (q.scales / q.hints are those buffers), and the bytes around
    them untouched; with autograd on, y still carries the straight-through gradient."""
    block = BLOCK[fmt]
    x = _random_x((4, 3 * block), dtype, seed=7 + block).requires_grad_()
    want_y, want_q = tracefp4.quantize_fake(x.detach(), fmt, backend="reference")
    stage = torch.full((16 + 4 * 3 + 16 + 4 * 3 * block // 8 + 16,), 0xAB, dtype=torch.uint8, device=DEVICE)
    s_view = stage[16:16 + 12].view(4, 3)
    h_off = 16 + 12 + 4  # 16-byte aligned
    h_view = stage[h_off:h_off + 4 * 3 * block // 8].view(4, 3 * block // 8)
    y, q = tracefp4.quantize_fake(x, fmt, backend=backend, scales_out=s_view, hints_out=h_view)
    assert_bits_equal(y, want_y)
    assert_q_equal(q, want_q)
    assert q.scales.data_ptr() == s_view.data_ptr() and q.hints.data_ptr() == h_view.data_ptr()
    assert_bits_equal(s_view, want_q.scales)
    assert_bits_equal(h_view, want_q.hints)
    untouched = torch.ones_like(stage, dtype=torch.bool)
    untouched[16:16 + 12] = False
    untouched[h_off:h_off + h_view.numel()] = False
    assert bool((stage[untouched] == 0xAB).all())
    y.float().sum().backward()
    assert x.grad is not None and x.grad.shape == x.shape


def test_quantize_fake_output_buffer_errors():
    from tracefp4.errors import DTypeError

    x = torch.zeros(2, 32)
    with pytest.raises(ShapeError, match=r"scales_out must have shape \(2, 2\).*got \(2, 3\)"):
        tracefp4.quantize_fake(x, scales_out=torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(DTypeError, match="hints_out must be uint8"):
        tracefp4.quantize_fake(x, hints_out=torch.zeros(2, 4, dtype=torch.int16))
    with pytest.raises(ShapeError, match="hints_out must be a contiguous tensor.*got a non-contiguous one"):
        tracefp4.quantize_fake(x, hints_out=torch.zeros(4, 2, dtype=torch.uint8).t())


# ---------------------------------------------------------------------------------------------------------
# dequantize on Triton
# ---------------------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_dequantize_every_code_and_scale_byte(dtype, fmt):
    # 256 blocks, block k has scale byte k (E4M3 NaN 0x7F/0xFF, zero 0x00/0x80, negative scales; E8M0 NaN 0xFF)
    # and every one of the 16 codes in every block
    b = BLOCK[fmt]
    scales = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).to(DEVICE)
    codes = (torch.arange(16 * 16 * b) % 16).to(torch.uint8).reshape(16, 16 * b)
    codes = tracefp4.pack_codes(codes[:, torch.randperm(16 * b, generator=torch.Generator().manual_seed(1))])
    codes = codes.to(DEVICE)
    for g in ([0.37, 3e-30] if fmt == "nvfp4" else [None]):
        got = tracefp4.dequantize(codes, scales, fmt=fmt, global_scale=g, dtype=dtype, backend="triton")
        want = tracefp4.dequantize(codes, scales, fmt=fmt, global_scale=g, dtype=dtype, backend="reference")
        assert_bits_equal(got, want)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_triton_dequantize_of_quantize_on_random_data(fmt):
    x = _random_x((33, 96 if fmt == "nvfp4" else 64), torch.bfloat16, seed=3)
    q = tracefp4.quantize(x, fmt, backend="reference")
    for dtype in DTYPES:
        assert_bits_equal(tracefp4.dequantize(q, dtype=dtype, backend="triton"),
                          tracefp4.dequantize(q, dtype=dtype, backend="reference"))


# ---------------------------------------------------------------------------------------------------------
# edge cases of the inputs (every kernel, Triton == reference)
# ---------------------------------------------------------------------------------------------------------
def _all_paths(x, fmt, g, backend):
    """(quantize, RTN fake quant, RTN with the rollout's scales, hint-guided, fused) on one backend; the
    rollout's scales/hints are the reference's."""
    q = tracefp4.quantize(x, fmt, global_scale=g, backend=backend)
    qr = tracefp4.quantize(x, fmt, global_scale=g, backend="reference")
    gs = qr.global_scale if fmt == "nvfp4" else None
    y_rtn = tracefp4.fake_quantize(x, fmt, global_scale=gs, backend=backend)
    y_sc = tracefp4.fake_quantize(x, fmt, global_scale=gs, scales=qr.scales, backend=backend)
    y_h = tracefp4.fake_quantize(x, fmt, global_scale=gs, scales=qr.scales, hints=qr.hints, backend=backend)
    y_f, q_f = tracefp4.quantize_fake(x, fmt, global_scale=g, backend=backend)
    return q, y_rtn, y_sc, y_h, y_f, q_f


def _check_all_paths(x, fmt, g):
    got = _all_paths(x, fmt, g, "triton")
    want = _all_paths(x, fmt, g, "reference")
    for a, w in zip(got, want):
        if isinstance(a, tracefp4.QuantizedFP4):
            assert_q_equal(a, w)
        else:
            assert_bits_equal(a, w)
    return want


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_fp16_negative_nan_keeps_its_sign_bit(fmt):
    # fp16 NaNs with the sign bit set (0xfe00, 0xfc01, 0xffff) code as 0xF, positive ones (0x7e00, 0x7c01) as 0x7
    # (NUMERICS.md section 7); a conversion of a NaN to fp32 may drop its sign, the kernels read the input's bits
    raw = [0xFE00, 0xFC01, 0xFFFF, 0x7E00, 0x7C01, 0xFC00, 0x7C00, 0x8000, 0x3C00, 0xBC00]
    row = torch.tensor(raw + [0x4600] * (BLOCK[fmt] - len(raw)), dtype=torch.int32).to(torch.int16)
    x = row.view(torch.float16).reshape(1, -1).repeat(3, 2).to(DEVICE)
    want = _check_all_paths(x, fmt, 1.0 if fmt == "nvfp4" else None)
    codes = tracefp4.unpack_codes(want[0].codes)[0, : len(raw)].tolist()
    assert codes[:5] == [0xF, 0xF, 0xF, 0x7, 0x7] and codes[5:7] == [0xF, 0x7]


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_degenerate_global_scale_and_zero_inputs(dtype):
    # g = 2^-140 (positive, finite; 1/g overflows to Inf): r = Inf for every block, so x * r is NaN at x = +-0
    # (coded as magnitude 7; hint-guided rounding counts it as k = 0) and +-Inf elsewhere
    x = torch.tensor([[0.0, -0.0, 1e-30, -2.0, 3.0, float("nan"), float("inf"), 0.5] * 4], dtype=dtype).to(DEVICE)
    _check_all_paths(x, "nvfp4", 2.0**-140)


@needs_triton
@pytest.mark.parametrize("backend_scale", [0x00, 0x80, 0x7F, 0xFF])
def test_given_zero_and_nan_scale_bytes(backend_scale):
    # a rollout scale byte of +-0 gives r = Inf (x * r NaN at x = 0): the output is +-0 (NaN only where x is NaN);
    # a NaN scale byte gives NaN
    x = torch.tensor([[0.0, -0.0, 1.0, -3.0, float("nan"), float("inf"), 1e-3, -0.0] * 2], dtype=torch.bfloat16)
    x = x.to(DEVICE)
    scales = torch.tensor([[backend_scale]], dtype=torch.uint8, device=DEVICE)
    hints = torch.tensor([[0xA5, 0x3C]], dtype=torch.uint8, device=DEVICE)
    for kw in (dict(scales=scales), dict(scales=scales, hints=hints)):
        got = tracefp4.fake_quantize(x, "nvfp4", global_scale=0.5, backend="triton", **kw)
        want = tracefp4.fake_quantize(x, "nvfp4", global_scale=0.5, backend="reference", **kw)
        assert_bits_equal(got, want)


@needs_triton
@pytest.mark.parametrize("fmt", FMTS)
def test_hint_guided_at_and_beyond_6_and_every_ladder_neighbour(fmt):
    # |v| exactly on every ladder value, just below/above it, at 6 and beyond, with both hint bits
    ladder = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    vals = []
    for m in ladder + [7.0, 8.0, 1e30]:
        t = torch.tensor(m)
        vals += [m, torch.nextafter(t, torch.tensor(0.0)).item(), torch.nextafter(t, torch.tensor(99.0)).item()]
    b = BLOCK[fmt]
    x = torch.tensor(vals + [0.0] * (-len(vals) % b), dtype=torch.float32).reshape(-1, b)
    x = torch.cat([x, -x]).to(DEVICE)
    one = 0x38 if fmt == "nvfp4" else 127  # scale exactly 1
    scales = torch.full((x.shape[0], 1), one, dtype=torch.uint8, device=DEVICE)
    g = 1.0 if fmt == "nvfp4" else None
    for hint_byte in (0x00, 0xFF, 0x5A):
        hints = torch.full((x.shape[0], b // 8), hint_byte, dtype=torch.uint8, device=DEVICE)
        got = tracefp4.fake_quantize(x, fmt, global_scale=g, scales=scales, hints=hints, backend="triton")
        want = tracefp4.fake_quantize(x, fmt, global_scale=g, scales=scales, hints=hints, backend="reference")
        assert_bits_equal(got, want)


@needs_triton
def test_triton_nvfp4_subnormal_block_scales_and_saturation():
    # block scales on the E4M3 subnormal grid (every step m * 2^-9) and at 448, with g = 1
    b = 16
    amax = [6 * m * 2.0**-9 for m in range(1, 9)] + [6 * 1.5 * 2.0**-9, 6 * 2.5 * 2.0**-9, 6 * 448.0, 6 * 480.0,
                                                      6 * 1e-5, 6 * 2.0**-6 * 1.0625, 6 * 2.0**-6 * 1.125]
    x = torch.zeros(len(amax), b)
    x[:, 0] = torch.tensor(amax)
    x[:, 1:] = torch.tensor(amax)[:, None] * torch.linspace(-1, 1, b - 1)[None, :]
    _check_all_paths(x.to(DEVICE), "nvfp4", 1.0)


@pytest.mark.skipif(not torch.cuda.is_available() or not HAS_TRITON, reason="needs a CUDA GPU")
def test_quantize_fake_in_cuda_graph_without_host_sync():
    x = _random_x((64, 2048), torch.bfloat16, seed=11)
    g = torch.tensor(0.01, device="cuda")
    y0, q0 = tracefp4.quantize_fake(x, global_scale=g)  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.graph(graph):
            y, q = tracefp4.quantize_fake(x, global_scale=g)
            d = tracefp4.dequantize(q, dtype=torch.bfloat16)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    x.copy_(_random_x((64, 2048), torch.bfloat16, seed=12))
    graph.replay()
    torch.cuda.synchronize()
    y1, q1 = tracefp4.quantize_fake(x, global_scale=g, backend="reference")
    assert_bits_equal(y, y1)
    assert_q_equal(q, q1)
    assert_bits_equal(d, tracefp4.dequantize(q1, dtype=torch.bfloat16, backend="reference"))
