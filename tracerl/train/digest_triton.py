"""`determinism.param_digest`'s per-tensor sum as one Triton pass over the tensor's bits.

The torch form (`determinism._bit_sum`) widens the bits to int64, multiplies them by a table of position weights
and sums: about 44 bytes of memory traffic per 4-byte value and four launches per tensor. On an H100 at 20 layers of
the H200 model that was ~34 ms of device time per training step (16% of the step's device time), exposed at the
step's end, where the metrics' digest waits for it. Here each program reads its values once (4 bytes each for fp32),
computes the weights ``w(p) = (p * 2654435761 mod (2^61 - 1)) * 2 + 1`` in registers (the modulus of a Mersenne
number by shifts and one conditional subtraction, exact for ``p * 2654435761 < 2^63``) and writes one wrapping int64
partial sum; the partials are summed by torch. Integer addition wraps the same way in any order, so the result
equals the torch form's bit for bit (tests under the interpreter and compiled).

Positions up to `MAX_POSITION` only (``p * 2654435761`` must not wrap, where the torch form's wrapped product and its
floor-style remainder would differ from this arithmetic): `bit_sum` raises for larger tensors and the caller falls
back to the torch form.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tracerl.errors import ShapeMismatchError

__all__ = ["MAX_POSITION", "bit_sum"]

#: the largest position (exclusive) the kernel computes weights for: ``p * 2654435761`` stays below 2^63
MAX_POSITION = 1 << 31
#: values per program: BLOCK lanes x ITERS steps
_BLOCK = 1024
_ITERS = 8
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit(do_not_specialize=["n", "first"])
def _bit_sum_kernel(x_ptr, out_ptr, n, first, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int64)
    base = pid * (BLOCK * ITERS)
    for it in tl.static_range(ITERS):
        offs = base + it * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
        m = offs < n
        bits = tl.load(x_ptr + offs, mask=m, other=0).to(tl.int64)  # sign-extends int16/int32, zero-extends uint8
        prod = (offs + first) * 2654435761  # < 2^63: positions below MAX_POSITION (the multiplier as in the torch form)
        r = (prod & 0x1FFFFFFFFFFFFFFF) + (prod >> 61)  # prod mod (2^61 - 1), up to one subtraction away
        # (the subtraction never applies below MAX_POSITION: checked for every position; kept for the formula)
        r = tl.where(r >= 0x1FFFFFFFFFFFFFFF, r - 0x1FFFFFFFFFFFFFFF, r)
        acc += tl.where(m, bits * (r * 2 + 1), 0)  # wrapping int64, as the torch form
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def bit_sum(flat: torch.Tensor, first: int) -> torch.Tensor:
    """sum over i of bits(flat[i]) * w(first + i) in wrapping int64: `determinism._bit_sum`, bit for bit.

    flat: a 1-D tensor of any dtype of 1, 2, 4 or 8 bytes per element (its bits are read as uint8 / int16 / int32 /
    int64), on a device Triton runs on (or any device under ``TRITON_INTERPRET=1``); first: the global position of
    its first element (>= 0). Returns a 0-dim int64 tensor on ``flat``'s device; launches, no host sync.

    Raises ShapeMismatchError (a ValueError) when ``first + flat.numel()`` exceeds `MAX_POSITION` (use the torch
    form) or the shape, element size or ``first`` is not as above."""
    if flat.dim() != 1 or flat.element_size() not in _BITS or first < 0:
        raise ShapeMismatchError(f"bit_sum needs a 1-D tensor of 1, 2, 4 or 8-byte elements and first >= 0, got "
                                 f"shape {tuple(flat.shape)}, {flat.dtype}, first={first}")
    n = flat.numel()
    if first + n > MAX_POSITION:
        raise ShapeMismatchError(f"bit_sum computes weights for positions below {MAX_POSITION}, got up to "
                                 f"{first + n}")
    if n == 0:
        return torch.zeros((), dtype=torch.int64, device=flat.device)
    x = flat.contiguous().view(_BITS[flat.element_size()])
    grid = -(-n // (_BLOCK * _ITERS))
    partial = torch.empty(grid, dtype=torch.int64, device=flat.device)
    _bit_sum_kernel[(grid,)](x, partial, n, first, BLOCK=_BLOCK, ITERS=_ITERS)
    return partial.sum()
