"""`tracefp4.effective_codes`: the E2M1 codes a fake-quantized NVFP4 tensor carries. The Triton kernel
(TRITON_INTERPRET=1 on CPU, compiled on a GPU) equals the torch reference bit for bit on bf16 / fp16 / fp32, on
fake-quantized values, exact ladder values and midpoints times the scale (the ties), their fp32 neighbours, zeros
of both signs, NaN, Inf, and zero / negative / NaN scale bytes; the reference gives back `quantize`'s codes of a
fake-quantized tensor; bad input raises typed errors."""

from __future__ import annotations

import pytest
import torch

from helpers.fp4 import DEVICE, DTYPES, needs_triton  # first: selects Triton's interpreter
import tracefp4
from tracefp4.errors import BackendError, DTypeError, FormatError, ShapeError

LADDER = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 1e30]


def _case(dtype: torch.dtype, seed: int, bad_scales: bool):
    """(y, scales, g): fake-quantized rows, arbitrary rows, ladder values and midpoints times each block's scale
    (and their fp32 neighbours), specials; scale bytes of x, some replaced by 0, 0x7F, 0x80, 0xFF, 0x85."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(24, 128, generator=gen) * torch.exp(3 * torch.randn(24, 1, generator=gen))).to(dtype)
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    scales = q.scales.clone()
    y = tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=scales, backend="reference").detach()
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1) * g
    lad = torch.tensor(LADDER)[torch.randint(0, len(LADDER), (8, 128), generator=gen)]
    sign = torch.where(torch.rand(8, 128, generator=gen) < 0.5, -1.0, 1.0)
    exact = (lad * sign * s[:8]).to(dtype)
    step = torch.nextafter(lad * sign * s[8:16], torch.full((8, 128), float("inf"))).to(dtype)
    y = torch.cat([y[:8], exact, step])
    flat = y.view(-1)
    pick = torch.randint(0, flat.numel(), (60,), generator=gen)
    flat[pick] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-30] * 10).to(dtype)
    if bad_scales:
        pick = torch.randint(0, scales.numel(), (30,), generator=gen)
        scales.view(-1)[pick] = torch.tensor([0, 0x7F, 0x80, 0xFF, 0x85] * 6, dtype=torch.uint8)
    return y, scales, g


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad_scales", [False, True])
def test_triton_equals_reference(dtype, bad_scales):
    for seed in range(3):
        y, scales, g = _case(dtype, seed, bad_scales)
        want = tracefp4.effective_codes(y, scales, g, backend="reference")
        got = tracefp4.effective_codes(y.to(DEVICE), scales.to(DEVICE), g.to(DEVICE), backend="triton")
        assert got.dtype == torch.uint8 and got.shape == y.shape
        diff = (got.cpu() != want).nonzero()
        assert diff.numel() == 0, (f"{len(diff)} codes differ, first at {diff[0].tolist()}: y "
                                   f"{y[tuple(diff[0])].item()!r} triton {got.cpu()[tuple(diff[0])]} "
                                   f"reference {want[tuple(diff[0])]}")
        assert bool(((want & 7) != 0).any()) and bool((want >= 8).any())  # both signs, nonzero codes met


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_codes_of_a_fake_quantized_tensor_are_quantizes(dtype):
    """effective_codes(fake_quantize(x), q.scales, g) == quantize(x).codes (±0 both code 0), with the leading
    dimensions kept."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(2, 16, 64, generator=gen) * 3).to(dtype)
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    y = tracefp4.fake_quantize(x, "nvfp4", global_scale=g, backend="reference")
    got = tracefp4.effective_codes(y, q.scales, g)
    want = tracefp4.unpack_codes(q.codes).reshape(got.shape)
    want = torch.where((want & 7) == 0, 0, want)
    assert got.shape == x.shape and torch.equal(got, want)


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_bad_input_is_a_typed_error(backend):
    y = torch.zeros(4, 32, dtype=torch.bfloat16, device=DEVICE)
    s = torch.zeros(4, 2, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ShapeError, match="scales must have shape"):
        tracefp4.effective_codes(y, s[:, :1], 1.0, backend=backend)
    with pytest.raises(ShapeError, match="multiple of the nvfp4 block size 16"):
        tracefp4.effective_codes(y[:, :24], s, 1.0, backend=backend)
    with pytest.raises(DTypeError, match="y must be one of"):
        tracefp4.effective_codes(y.to(torch.int32), s, 1.0, backend=backend)
    with pytest.raises(DTypeError, match="scales must be uint8"):
        tracefp4.effective_codes(y, s.float(), 1.0, backend=backend)
    with pytest.raises(FormatError, match="global_scale"):
        tracefp4.effective_codes(y, s, None, backend=backend)
    with pytest.raises(FormatError, match="positive finite"):
        tracefp4.effective_codes(y, s, -1.0, backend=backend)
    with pytest.raises(BackendError, match="backend must be one of"):
        tracefp4.effective_codes(y, s, 1.0, backend="fast")
    assert tracefp4.effective_codes(y[:0], s[:0], 1.0, backend=backend).shape == (0, 32)
