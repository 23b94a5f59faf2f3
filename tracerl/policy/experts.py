"""The grouped MoE expert path of `tracerl.policy.runtime.FP4MoEBlock._routed`, with a backward that is deterministic by
construction (no accumulation whose order depends on thread scheduling).

What the plain grouped path (``qat.py`` before; the reference in ``tests/tracerl/test_deterministic.py``) does in
autograd terms, per MoE layer with N tokens, top-k, E experts:

* ``x_q[tok[off:off + c]]`` per expert: advanced indexing, whose backward is ``index_put_(accumulate=True)``
  into a fresh zero [N, H] tensor per expert; autograd then adds the E dense [N, H] gradients. Whatever the
  scatter kernel does (sort-based, or atomics in some torch versions), the result is exact only because each
  call's indices happen to be unique; and the backward costs E dense [N, H] buffers and E dense adds: O(E * N * H)
  memory traffic for O(k * N * H) useful values.
* ``h_q[off:off + c]`` and ``w_gate_up[e]`` / ``w_down[e]`` per expert: slice/select backward, again one zero
  tensor of the full size per expert (for the weights O(E^2 * I * H), all zeros but one slice).
* ``h_sorted[inv]``, ``[order]`` permutations: index backward with a sort of N*k indices each.

This path (`routed_experts`): one gather of all k*N slot rows in expert order with a custom backward that
permutes the slot gradients back to (token, slot) order and sums each token's k slots in a fixed order
(ascending expert id, fp32 accumulation), the expert GEMMs as two grouped GEMMs over all experts
(``torch._grouped_mm`` with group offsets computed on the device; where it is not available, `torch.split` /
`torch.unbind` per-expert pieces, whose backward is one ``cat`` / ``stack``), and permutations as index_select
pairs (the backward of a permutation is the inverse permutation: a gather, nothing accumulates). Every gradient is then a gather, a GEMM or a
fixed-order sum, so two runs are bitwise equal by construction, whatever the torch version's scatter kernels,
and the dense per-expert buffers are gone.

Measured on one H200 (torch 2.11, bf16, fwd + bwd of the routed experts alone, median of 10): N=8192 tokens,
H=256, I=128, E=16, k=2: 12.2 ms plain, 7.5 ms this path; H=2048, I=768, E=128, k=8 (a Qwen3-30B-A3B-sized
layer): 200.7 ms plain, 35.4 ms this path. Both paths gave bitwise-equal gradients over 4 runs there: with
torch 2.11 the current path is already reproducible, and the whole-model nondeterminism seen on that GPU came
from the attention backward (cuDNN / memory-efficient SDPA), not from the MoE gather.
``tests/tracerl/test_deterministic.py`` checks it against the plain grouped path: the same forward and weight
gradients bit for bit, the input gradient up to one rounding (an fp32 sum of the k slots instead of autograd's
adds in the input's dtype).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

Act = Callable[[torch.Tensor], torch.Tensor]
Quant = Callable[[torch.Tensor], torch.Tensor]


class _PermuteRows(torch.autograd.Function):
    """y = x[perm] for a permutation ``perm`` of x's rows; dx = dy[inv] with inv = perm^-1 (a gather)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inv,) = ctx.saved_tensors
        return grad.index_select(0, inv), None, None


class _GatherSlots(torch.autograd.Function):
    """Rows of x [N, H] for every (token, slot) in expert-sorted order: y[i] = x[order[i] // k], [N*k, H].

    Backward: the slot gradients back in (token, slot) order, dy[inv] viewed [N, k, H], summed over the k slots
    in slot order (ascending expert id) with an fp32 (fp64 for fp64) accumulator, cast to x's dtype once."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inv)
        ctx.k = k
        ctx.n = x.shape[0]
        return x.index_select(0, torch.div(order, k, rounding_mode="floor"))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (inv,) = ctx.saved_tensors
        g = grad.index_select(0, inv).view(ctx.n, ctx.k, -1)  # (N, k, H), slot order
        acc_dtype = torch.promote_types(grad.dtype, torch.float32)  # fp32 for bf16/fp16/fp32, fp64 stays
        acc = g[:, 0].to(acc_dtype)
        for j in range(1, ctx.k):  # a fixed order of k - 1 adds, the same on every device
            acc = acc + g[:, j].to(acc_dtype)
        return acc.to(grad.dtype), None, None, None


def slot_order(idx: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """(order, inv, counts) for routed expert ids ``idx`` [N, k] (int64, distinct per row).

    order [N*k]: flat slot ids (token * k + j) sorted by expert, stable (ties by slot id); inv [N*k]: its
    inverse permutation; counts: slots per expert, a host list of E ints (one device -> host read)."""
    flat = idx.reshape(-1)
    order, inv = _sort_slots(flat)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, inv, counts


def _sort_slots(flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, inv) of flat slot expert ids: the stable sort by expert and its inverse permutation (no host read)."""
    order = torch.argsort(flat, stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return order, inv


@functools.cache
def _hopper_or_newer(device_index: int) -> bool:
    """Compute capability >= 9.0 (looked up once per device: `grouped_gemm_supported` runs per MoE call)."""
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


def grouped_gemm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether `routed_experts` runs its expert GEMMs as two ``torch._grouped_mm`` calls for these operands.

    ``torch._grouped_mm`` (one GEMM over all experts, the groups given by device offsets) is used on the CPU for
    bf16 / fp16 / fp32 (torch's fallback there computes each group with the same matmul as a per-expert
    ``F.linear``: the same bits, tests/tracerl/test_deterministic.py) and on CUDA for bf16 on Hopper or newer
    (CUTLASS grouped GEMM, no split-K: deterministic). Elsewhere (float64, older GPUs, a torch without it) the
    per-expert loop runs. ``TRACERL_GROUPED_MM=0`` forces the loop (to compare the two)."""
    if os.environ.get("TRACERL_GROUPED_MM", "1") == "0" or not hasattr(torch, "_grouped_mm"):
        return False
    if x.dtype != w.dtype or x.device != w.device:
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and _hopper_or_newer(
            x.device.index if x.device.index is not None else torch.cuda.current_device())
    return False


_SYNC_FREE: dict[str, bool] = {}


def grouped_gemm_sync_free(device: torch.device) -> bool:
    """Whether ``torch._grouped_mm`` runs on ``device`` without a host sync (so a CUDA graph can capture it: the
    decode step). Probed once per device with torch's sync debug mode; the CPU is always free.

    The probe sets that mode process-wide for one tiny call, so no other thread may sync the device meanwhile: it
    runs at the first decode-sized MoE call on the device, i.e. in a decoder's warm-up, which the audit's
    side-by-side decodes take one at a time (`tracerl.audit._LineUp`) and which is the only device work of a
    rollout process then (its weight prefetch reads into host memory)."""
    if device.type != "cuda":
        return device.type == "cpu"
    key = str(device)
    if key not in _SYNC_FREE:
        a = torch.zeros(32, 64, dtype=torch.bfloat16, device=device)
        b = torch.zeros(2, 64, 32, dtype=torch.bfloat16, device=device)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device)
        torch.cuda.synchronize(device)
        prev = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("error")
            torch._grouped_mm(a, b, offs=offs)
            _SYNC_FREE[key] = True
        except RuntimeError:
            _SYNC_FREE[key] = False
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    return _SYNC_FREE[key]


def routed_experts(x_q: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, w_gate_up: torch.Tensor,
                   w_down: torch.Tensor, act_fn: Act, down_quant: Quant | None = None) -> torch.Tensor:
    """The routed experts of one MoE layer, grouped by expert, with a deterministic backward.

    Args:
        x_q: [N, H] (already quantized at the MoE-input site).
        idx: int64 [N, k] expert ids, ascending per row (as `FP4MoEBlock` sorts them).
        weights: [N, k] router weights of those experts.
        w_gate_up: [E, 2I, H]; w_down: [E, H, I] (possibly fake-quantized, straight-through).
        act_fn: the experts' activation (SiLU for Qwen3-MoE); down_quant: the down-input site, applied to
            h [N, k*I] in (token, slot) order (None: identity).

    Returns:
        [N, H] in x_q's dtype: sum over each token's k slots (ascending expert id) of weight * expert output.

    The expert GEMMs are two grouped GEMMs (`grouped_gemm_supported`: no host sync, two launches per layer) or,
    elsewhere, a Python loop over the experts (2 GEMMs and ~10 more operations per expert, and one host read of
    the expert counts).
    """
    n, k = idx.shape
    num_experts = w_gate_up.shape[0]
    grouped = grouped_gemm_supported(x_q, w_gate_up)
    if grouped:
        flat = idx.reshape(-1)
        order, inv = _sort_slots(flat)
        # Group ends on the device without a host read (graph-capturable): slots with an expert id below e + 1.
        ends = torch.arange(1, num_experts + 1, device=flat.device, dtype=flat.dtype)
        offs = torch.searchsorted(flat.index_select(0, order), ends).to(torch.int32)
    else:
        order, inv, counts = slot_order(idx, num_experts)
    x_sorted = _GatherSlots.apply(x_q, order, inv, k)  # (N*k, H), expert order
    if grouped:
        gate, up = torch._grouped_mm(x_sorted, w_gate_up.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        h_sorted = act_fn(gate) * up  # (N*k, I), expert order
    else:
        w1 = w_gate_up.unbind(0)
        pieces = []
        for e, xe in enumerate(x_sorted.split(counts)):
            if counts[e]:
                gate, up = F.linear(xe, w1[e]).chunk(2, dim=-1)
                pieces.append(act_fn(gate) * up)
        h_sorted = torch.cat(pieces)  # (N*k, I), expert order
    inter = h_sorted.shape[-1]
    h = _PermuteRows.apply(h_sorted, inv, order).reshape(n, k * inter)  # (N, k*I), slot order
    if down_quant is not None:
        h = down_quant(h)
    h_q = _PermuteRows.apply(h.reshape(n * k, inter), order, inv)  # (N*k, I), expert order
    if grouped:
        y_experts = torch._grouped_mm(h_q, w_down.transpose(-2, -1), offs=offs)  # (N*k, H)
    else:
        w2 = w_down.unbind(0)
        y_experts = torch.cat([F.linear(he, w2[e]) for e, he in enumerate(h_q.split(counts)) if counts[e]])
    w_sorted = _PermuteRows.apply(weights.reshape(-1, 1), order, inv).to(h_q.dtype)  # (N*k, 1)
    y_sorted = y_experts * w_sorted
    y = _PermuteRows.apply(y_sorted, inv, order).reshape(n, k, -1)  # (N, k, H), slot order
    return y.sum(dim=1).to(x_q.dtype)
