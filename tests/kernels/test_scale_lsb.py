"""`tracefp4.fake_quantize_lsb` (scale hints: each NVFP4 block's E4M3 byte from the activation's own amax and a
stored LSB, NUMERICS §11): the Triton kernel (under TRITON_INTERPRET=1 on CPU) equals the torch reference bit for
bit, special values included; the bytes it picks are the reference rule's, and its output is `fake_quantize` with
those bytes; the LSBs of the rollout's own bytes give back exactly those bytes; the floor byte of the E4M3 grid;
gradients; argument errors."""

from __future__ import annotations

import pytest
import torch

from helpers.fp4 import BACKENDS, DEVICE, DTYPES, assert_bits_equal  # first: selects Triton's interpreter
import tracefp4
from tracefp4 import reference as ref
from tracefp4.errors import DTypeError, FormatError, ShapeError

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy 1/0 in masked interpreter lanes


def _x(rows: int, width: int, dtype, seed: int) -> torch.Tensor:
    """Rows whose magnitudes differ by orders, with NaN, +-Inf, signed zeros, tiny values, a zero block, a block
    at the top of the scale range and exact ladder values sprinkled in."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.exp(2 * torch.randn(rows, 1, generator=g))
    flat = x.view(-1)
    idx = torch.randint(0, flat.numel(), (max(1, flat.numel() // 40),), generator=g)
    pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 6.0, 5.0, 0.25, 1e-30])
    flat[idx] = pool[torch.randint(0, len(pool), idx.shape, generator=g)]
    x[0, :16] = 0.0
    if rows > 1:
        x[1, :16] = 3e4  # a block far above the others: its t clamps at 448 (byte 125 / 126)
    return x.to(dtype).to(DEVICE)


def _random_lsb(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, -(-width // 128)), generator=g, dtype=torch.uint8).to(DEVICE)


def _bits_of(lsb: torch.Tensor, blocks: int) -> torch.Tensor:
    return tracefp4.unpack_hints(lsb)[:, :blocks].reshape(-1)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 64), (5, 48), (3, 2048), (700, 32)])
def test_equals_fake_quantize_with_the_bytes_it_picks(shape, dtype, backend):
    # 48 and 64 values: 3 / 4 blocks, rows of scale hints with unused bits; (700, 32): a persistent loop of tiles
    rows, width = shape
    x = _x(rows, width, dtype, seed=rows + width)
    g = tracefp4.compute_global_scale(x)
    lsb = _random_lsb(rows, width, seed=width)
    hints = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference").hints
    want_s = ref.nvfp4_lsb_scales_ref(x.float().reshape(-1, 16), g, _bits_of(lsb, width // 16)).reshape(rows, -1)
    for h in (hints, None):
        y, s = tracefp4.fake_quantize_lsb(x, g, lsb, hints=h, backend=backend)
        assert s.dtype == torch.uint8 and s.shape == (rows, width // 16)
        assert torch.equal(s, want_s)
        assert int(s.min()) >= 1 and int(s.max()) <= 126
        assert_bits_equal(y, tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=want_s, hints=h,
                                                    backend="reference"))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_rollouts_own_lsbs_give_its_bytes_back(dtype, backend):
    x = _x(64, 256, dtype, seed=5)
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    lsb = tracefp4.pack_hints(q.scales & 1)  # 16 blocks per row: two bytes of LSBs
    y, s = tracefp4.fake_quantize_lsb(x, g, lsb, hints=q.hints, backend=backend)
    assert torch.equal(s, q.scales)
    assert_bits_equal(y, tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints,
                                                backend="reference"))


def test_floor_byte_of_the_e4m3_grid():
    vals = ref.e4m3_decode(torch.arange(1, 127, dtype=torch.uint8))  # 2^-9 .. 448
    assert torch.equal(ref.e4m3_floor_byte(vals), torch.arange(1, 127, dtype=torch.int32))
    below = torch.nextafter(vals[1:], torch.zeros_like(vals[1:]))  # just under each value from the second on
    assert torch.equal(ref.e4m3_floor_byte(below), torch.arange(1, 126, dtype=torch.int32))
    mid = (vals[:-1] + vals[1:]) / 2
    assert torch.equal(ref.e4m3_floor_byte(mid), torch.arange(1, 126, dtype=torch.int32))
    # with the clamp at 125, t = 448 picks 125 or 126 by its LSB
    t = torch.tensor([[448.0 * 6] + [0.0] * 15])
    for bit, byte in ((1, 125), (0, 126)):
        assert int(ref.nvfp4_lsb_scales_ref(t, torch.tensor(1.0), torch.tensor([bit]))) == byte


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_are_straight_through(backend):
    x = _x(8, 64, torch.float32, seed=2).nan_to_num(0.0, 0.0, 0.0).requires_grad_(True)
    g = tracefp4.compute_global_scale(x.detach())
    lsb = _random_lsb(8, 64, seed=3)
    up = torch.randn(8, 64, device=DEVICE)
    y, s = tracefp4.fake_quantize_lsb(x, g, lsb, backend=backend)
    (y * up).sum().backward()
    assert torch.equal(x.grad, up)
    x2 = x.detach().clone().requires_grad_(True)
    x3 = x.detach().clone().requires_grad_(True)
    (tracefp4.fake_quantize_lsb(x2, g, lsb, backend=backend, ste="clip")[0] * up).sum().backward()
    (tracefp4.fake_quantize(x3, "nvfp4", global_scale=g, scales=s, backend=backend, ste="clip") * up).sum().backward()
    assert torch.equal(x2.grad, x3.grad)


def test_argument_errors():
    x = torch.randn(4, 64)
    lsb = torch.zeros(4, 1, dtype=torch.uint8)
    with pytest.raises(ShapeError, match=r"scale_lsb must have shape \(4, 1\)"):
        tracefp4.fake_quantize_lsb(x, 1.0, torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(DTypeError):
        tracefp4.fake_quantize_lsb(x, 1.0, torch.zeros(4, 1, dtype=torch.int32))
    with pytest.raises(FormatError, match="global_scale"):
        tracefp4.fake_quantize_lsb(x, None, lsb)
    with pytest.raises(FormatError, match="global_scale"):
        tracefp4.fake_quantize_lsb(x, float("nan"), lsb)
    with pytest.raises(ShapeError):
        tracefp4.fake_quantize_lsb(torch.randn(4, 40), 1.0, lsb)
    with pytest.raises(ShapeError, match="hints"):
        tracefp4.fake_quantize_lsb(x, 1.0, lsb, hints=torch.zeros(4, 7, dtype=torch.uint8))
    with pytest.raises(FormatError, match="ste"):
        tracefp4.fake_quantize_lsb(x, 1.0, lsb, ste="nope")
