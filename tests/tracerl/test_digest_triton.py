"""`param_digest`'s Triton sum (`tracerl.train.digest_triton`, under TRITON_INTERPRET=1 on CPU, compiled on a GPU)
equals the torch form bit for bit: every element size, special values, sizes around the program's span, offsets of
sharded tensors up to the last position it accepts; and on CUDA `param_digest` takes it."""

from __future__ import annotations

import helpers.fp4  # noqa: F401  (selects Triton's interpreter without CUDA, before Triton loads)
import pytest
import torch
from helpers.fp4 import DEVICE, HAS_TRITON

from tracerl.train import determinism

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="no triton")


def _both(flat: torch.Tensor, first: int) -> tuple[int, int]:
    from tracerl.train.digest_triton import bit_sum

    got = bit_sum(flat.to(DEVICE), first)
    assert got.dtype == torch.int64 and got.dim() == 0 and got.device.type == torch.device(DEVICE).type
    return int(got), int(determinism._bit_sum_torch(flat, first))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int8,
                                   torch.int32, torch.int64, torch.float64])
def test_every_element_size_equals_the_torch_form(dtype):
    g = torch.Generator().manual_seed(3)
    if dtype.is_floating_point:
        t = torch.randn(5000, generator=g, dtype=torch.float64).mul(1e3).to(dtype)
        t[:6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40], dtype=torch.float64
                             ).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (5000,), generator=g, dtype=torch.int64).to(dtype)
        t[:2] = torch.tensor([info.min, info.max]).to(dtype)  # negative bits are sign-extended, uint8 zero-extended
    got, want = _both(t, 0)
    assert got == want


@pytest.mark.parametrize("n", [1, 1023, 1024, 8191, 8192, 8193, 20000])
def test_sizes_around_a_programs_span(n):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got, want = _both(t, 0)
    assert got == want


@pytest.mark.parametrize("first", [1, 12345, (1 << 27) - 7, (1 << 27) + 5, (1 << 31) - 3000])
def test_offsets_of_a_shard_up_to_the_last_position(first):
    """Positions past the torch form's weight table (computed there) and up to `MAX_POSITION`, whose products
    with the multiplier come within a factor 1.6 of int64's end."""
    t = torch.randn(3000, generator=torch.Generator().manual_seed(first % 1000))
    got, want = _both(t, first)
    assert got == want


def test_a_changed_bit_changes_the_sum_and_the_order_does_not_matter():
    t = torch.randn(10000, generator=torch.Generator().manual_seed(1))
    from tracerl.train.digest_triton import bit_sum

    base = int(bit_sum(t.to(DEVICE), 0))
    u = t.clone()
    u.view(torch.int32)[9999] ^= 1 << 30
    assert int(bit_sum(u.to(DEVICE), 0)) != base
    # a strided view is read in its logical order (made contiguous), as the torch form reads it
    m = torch.randn(100, 100, generator=torch.Generator().manual_seed(2))
    got, want = _both(m.t().reshape(-1), 0)
    assert got == want


def test_bad_input_is_refused():
    from tracerl.train.digest_triton import MAX_POSITION, bit_sum

    with pytest.raises(ValueError, match="positions below"):
        bit_sum(torch.zeros(4), MAX_POSITION - 3)
    with pytest.raises(ValueError, match="1-D"):
        bit_sum(torch.zeros(2, 2), 0)
    with pytest.raises(ValueError, match="first >= 0"):
        bit_sum(torch.zeros(2), -1)
    assert int(bit_sum(torch.zeros(0), 5)) == 0


@pytest.mark.skipif(DEVICE != "cuda", reason="param_digest takes the kernel on CUDA only")
def test_param_digest_on_cuda_is_the_cpu_digest(monkeypatch):
    from tracerl.train import digest_triton

    ts = [torch.randn(300, 70), torch.randn(33).to(torch.bfloat16), torch.randn(0), torch.randn(5, dtype=torch.float64)]
    calls = []
    real = digest_triton.bit_sum
    monkeypatch.setattr(digest_triton, "bit_sum", lambda *a: calls.append(1) or real(*a))
    assert determinism.param_digest([t.cuda() for t in ts]) == determinism.param_digest(ts)
    assert len(calls) == len(ts)
