"""`tracefp4.fake_quantize_matrices`: a stack of matrices, each fake-quantized with its own dynamic NVFP4 global
scale in one launch, equals `fake_quantize` of every matrix alone, bit for bit (reference and Triton, under
TRITON_INTERPRET=1 on CPU), special values included; and its argument errors."""

from __future__ import annotations

import pytest
import torch

from helpers.fp4 import BACKENDS, DEVICE, DTYPES, assert_bits_equal, needs_triton  # first: selects Triton's interpreter
import tracefp4
from tracefp4 import reference as ref
from tracefp4.errors import DTypeError, ShapeError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy 1/0 in masked interpreter lanes


def _stack(shape, dtype, seed: int) -> torch.Tensor:
    """Matrices whose magnitudes differ by orders between matrices (so their global scales differ), with NaN,
    +-Inf, signed zeros and exact ladder values sprinkled in; one matrix all zeros, one only non-finite + zeros."""
    g = torch.Generator().manual_seed(seed)
    m = int(torch.tensor(shape[:-2]).prod()) if len(shape) > 2 else 1
    r, c = shape[-2:]
    x = torch.randn(m, r, c, generator=g) * torch.exp(3 * torch.randn(m, 1, 1, generator=g))
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 40),), generator=g)
    pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 6.0, 5.0, 0.25, 1e-30])
    flat[idx] = pool[torch.randint(0, len(pool), idx.shape, generator=g)]
    if m >= 3:
        x[1] = 0.0
        x[2] = 0.0
        x[2, 0, :4] = torch.tensor([float("nan"), float("inf"), float("-inf"), -0.0])
    return x.reshape(shape).to(dtype).to(DEVICE)


def _one_by_one(w: torch.Tensor, backend: str) -> torch.Tensor:
    flat = w.reshape(-1, *w.shape[-2:])
    return torch.stack([tracefp4.fake_quantize(m, "nvfp4", backend=backend) for m in flat]).reshape(w.shape)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 7, 48), (2, 3, 4, 32), (1, 9, 16), (6, 1, 16)])
def test_equals_each_matrix_alone(shape, dtype, backend):
    # (5, 7, 48): 21 blocks per matrix, so a tile of blocks straddles matrices; (6, 1, 16): one block each
    w = _stack(shape, dtype, seed=sum(shape))
    got = tracefp4.fake_quantize_matrices(w, backend=backend)
    assert got.shape == w.shape and got.dtype == w.dtype
    assert_bits_equal(got, _one_by_one(w, backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_many_matrices_of_one_block_each_in_a_persistent_launch(backend):
    # more blocks than one program's tile x programs: the persistent loop crosses many matrix boundaries
    w = _stack((300, 2, 32), torch.bfloat16, seed=3)
    assert_bits_equal(tracefp4.fake_quantize_matrices(w, backend=backend), _one_by_one(w, backend))


def test_global_scales_are_each_matrix_own():
    w = _stack((4, 8, 32), torch.float32, seed=11).cpu()
    want = torch.stack([ref.global_scale_ref(m) for m in w])
    assert torch.equal(ref.global_scales_ref(w), want)
    assert len(set(want.tolist())) >= 2  # the matrices' scales do differ (the test would not see a shared g)


def test_argument_errors():
    with pytest.raises(ShapeError, match=r"stack of matrices \[\.\.\., R, C\]; got shape \(32,\)"):
        tracefp4.fake_quantize_matrices(torch.zeros(32))
    with pytest.raises(ShapeError, match="multiple of the nvfp4 block size 16"):
        tracefp4.fake_quantize_matrices(torch.zeros(2, 3, 24))
    with pytest.raises(DTypeError, match="w must be one of"):
        tracefp4.fake_quantize_matrices(torch.zeros(2, 3, 16, dtype=torch.int32))
    with pytest.raises(DTypeError, match="w must be a torch.Tensor"):
        tracefp4.fake_quantize_matrices([[0.0] * 16])
    empty = torch.zeros(0, 4, 16)
    assert tracefp4.fake_quantize_matrices(empty).shape == (0, 4, 16)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 7, 48), (3, 130, 256), (1, 1, 16)])
def test_triton_global_scales_equal_the_reference(shape, dtype):
    # (3, 130, 256): 33,280 values per matrix, three chunks of 16,384 (the last partial): the per-chunk maxima
    # and their reduction; matrix 1 all zeros (the fallback 1.0), matrix 2 only non-finite values and zeros
    from tracefp4 import triton_kernels as tk

    w = _stack(shape, dtype, seed=7 + sum(shape))
    assert_bits_equal(tk.global_scales_triton(w), ref.global_scales_ref(w))


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_global_scales_of_tiny_and_huge_magnitudes(dtype):
    # a matrix whose amax is the dtype's smallest subnormal (the clamp to 2^-118), one whose amax is its largest
    # finite value, one whose amax sits past a NaN and an Inf, and negative values only
    from tracefp4 import triton_kernels as tk

    info = torch.finfo(dtype)
    w = torch.zeros(4, 2, 16, dtype=dtype)
    w[0, 1, 3] = info.smallest_normal / 4 if dtype != torch.float32 else 1e-45
    w[1, 0, 0] = -info.max
    w[2, 0, :3] = torch.tensor([float("nan"), float("-inf"), -3.5], dtype=dtype)
    w[3] = -torch.arange(32, dtype=dtype).reshape(2, 16)
    w = w.to(DEVICE)
    got = tk.global_scales_triton(w)
    assert_bits_equal(got, ref.global_scales_ref(w))
    assert got[2].item() == pytest.approx(3.5 / 2688)
