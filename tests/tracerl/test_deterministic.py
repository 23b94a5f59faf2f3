"""The deterministic grouped-MoE path (`tracerl.policy.experts`, what `FP4MoEBlock._routed` runs) against the plain
grouped path it replaced (advanced-index gathers whose backward accumulates, kept here as the reference): the
same forward bit for bit, the same weight gradients bit for bit, the input gradient up to one rounding, and
bitwise-equal gradients across runs and thread counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tracerl.policy.experts import _GatherSlots, _PermuteRows, routed_experts, slot_order
from tracerl.policy import TinyMoESpec, build_model, moe_blocks
from tracerl.policy import install_fp4
from tracerl.policy import plan_sites


def _routes(n: int, k: int, e: int, seed: int, skip_expert: int | None = None) -> torch.Tensor:
    """[n, k] distinct expert ids per row, ascending (as FP4MoEBlock sorts them)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(n, e, generator=g)
    if skip_expert is not None:
        scores[:, skip_expert] = -1.0  # an expert no token picks: an empty group
    return scores.topk(k, dim=-1).indices.sort(dim=-1).values


def _block(mode: str, dtype: torch.dtype, top_k: int = 2):
    spec = TinyMoESpec(num_layers=1, vocab_size=32, top_k=top_k, hidden_size=64, moe_intermediate_size=32,
                       num_experts=8)
    model = build_model(spec, seed=0).to(dtype)
    rt = install_fp4(model, plan_sites(model, hint_layers=[]))
    block = moe_blocks(model)[0][2]
    if mode != "bf16":
        rt.set_global_scales({s.name: 4.0 / (448 * 6) for s in rt.plan.sites})
    rt.set_mode(mode)
    return block, rt


def _run(fn, block, rt, x, idx, w):
    """Forward + backward of sum(out * probe); returns (out, dx, dweights, dw_gate_up, dw_down)."""
    ex = block.experts
    for p in (ex.gate_up_proj, ex.down_proj):
        p.grad = None
    x = x.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    out = fn(x, idx, w)
    probe = torch.linspace(-1, 1, out.numel(), dtype=torch.float32).reshape(out.shape).to(out.dtype)
    (out.float() * probe.float()).sum().backward()
    return out.detach(), x.grad, w.grad, ex.gate_up_proj.grad.clone(), ex.down_proj.grad.clone()


def _proposed(block, rt):
    ex = block.experts

    def fn(x, idx, w):
        w1 = rt.weight(f"{block.module_name}.experts.gate_up_proj", ex.gate_up_proj)
        w2 = rt.weight(f"{block.module_name}.experts.down_proj", ex.down_proj)
        return routed_experts(rt.quant(block.input_site, x), idx, w, w1, w2, ex.act_fn,
                              down_quant=lambda h: rt.quant(block.down_site, h))
    return fn


def _grouped_reference(block, rt, x_q, idx, weights):
    """The grouped path FP4MoEBlock._routed ran before: per-expert GEMMs on ``x_q[tok]`` gathers (an index
    backward), slot permutations by advanced indexing, a sum over each token's k slots in slot order."""
    ex = block.experts
    n, k = idx.shape
    w_gate_up = rt.weight(f"{block.module_name}.experts.gate_up_proj", ex.gate_up_proj)
    w_down = rt.weight(f"{block.module_name}.experts.down_proj", ex.down_proj)
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=ex.num_experts).tolist()
    tok = order // k
    pieces, off = [], 0
    for e, c in enumerate(counts):
        if c:
            gate, up = F.linear(x_q[tok[off : off + c]], w_gate_up[e]).chunk(2, dim=-1)
            pieces.append(ex.act_fn(gate) * up)
            off += c
    h_sorted = torch.cat(pieces)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    inter = h_sorted.shape[-1]
    h_q = rt.quant(block.down_site, h_sorted[inv].reshape(n, k * inter)).reshape(n * k, inter)[order]
    outs, off = [], 0
    for e, c in enumerate(counts):
        if c:
            outs.append(F.linear(h_q[off : off + c], w_down[e]))
            off += c
    y_sorted = torch.cat(outs) * weights.reshape(-1)[order].unsqueeze(-1).to(h_q.dtype)
    return y_sorted[inv].reshape(n, k, -1).sum(dim=1).to(x_q.dtype)


def _current(block, rt):
    return lambda x, idx, w: _grouped_reference(block, rt, rt.quant(block.input_site, x), idx, w)


def test_block_runs_the_deterministic_path():
    block, rt = _block("fp4_rne_own_scales", torch.bfloat16)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(41, 64, generator=g).to(torch.bfloat16)
    idx = _routes(41, 2, 8, seed=8)
    w = torch.rand(41, 2, generator=g).to(torch.bfloat16)
    block_fn = lambda x_, i_, w_: block._routed(rt.quant(block.input_site, x_), i_, w_)  # noqa: E731
    for a, b in zip(_run(block_fn, block, rt, x, idx, w), _run(_proposed(block, rt), block, rt, x, idx, w)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["bf16", "fp4_rne_own_scales"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("top_k", [2, 3])
def test_matches_current_grouped_path(mode, dtype, top_k):
    block, rt = _block(mode, dtype, top_k)
    n = 97  # odd: uneven groups
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 64, generator=g).to(dtype)
    idx = _routes(n, top_k, 8, seed=2, skip_expert=5)
    w = torch.rand(n, top_k, generator=g).to(dtype)
    ref = _run(_current(block, rt), block, rt, x, idx, w)
    new = _run(_proposed(block, rt), block, rt, x, idx, w)
    assert torch.equal(new[0], ref[0])  # the forward is the same computation, bit for bit
    # weight and router-weight gradients: the same GEMMs and products, only the zero buffers are gone
    for a, b in zip(new[2:], ref[2:]):
        assert torch.equal(a, b)
    # dx: each token's k slot gradients summed in a fixed order with an fp32 accumulator, where autograd adds
    # them in x's dtype in its own order; equal up to one rounding of x's dtype
    tol = {torch.bfloat16: 1e-2, torch.float32: 1e-6}[dtype]
    torch.testing.assert_close(new[1], ref[1], rtol=tol, atol=tol * 1e-2)
    if top_k == 2:  # two addends: one rounding either way (the first autograd add is onto an exact copy)
        assert torch.equal(new[1], ref[1])


def test_float64_gradients_equal_and_gradcheck():
    """In float64 the two paths give the same gradients to 1e-12, and the custom backwards pass gradcheck."""
    block, rt = _block("bf16", torch.float64, top_k=3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(33, 64, generator=g, dtype=torch.float64)
    idx = _routes(33, 3, 8, seed=4)
    w = torch.rand(33, 3, generator=g, dtype=torch.float64)
    ref = _run(_current(block, rt), block, rt, x, idx, w)
    new = _run(_proposed(block, rt), block, rt, x, idx, w)
    for a, b in zip(new, ref):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    order, inv, _ = slot_order(idx, 8)
    xs = torch.randn(33, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _GatherSlots.apply(t, order, inv, 3), (xs,))
    ys = torch.randn(99, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: _PermuteRows.apply(t, order, inv), (ys,))


def test_bitwise_reproducible_across_runs_and_threads():
    block, rt = _block("fp4_rne_own_scales", torch.bfloat16, top_k=2)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(256, 64, generator=g).to(torch.bfloat16)
    idx = _routes(256, 2, 8, seed=6)
    w = torch.rand(256, 2, generator=g).to(torch.bfloat16)
    prev = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            runs.append(_run(_proposed(block, rt), block, rt, x, idx, w))
    finally:
        torch.set_num_threads(prev)
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert torch.equal(a, b)


def test_slot_order():
    idx = torch.tensor([[0, 2], [1, 2], [0, 1]])
    order, inv, counts = slot_order(idx, 4)
    # flat slots: 0:e0 1:e2 2:e1 3:e2 4:e0 5:e1 -> by expert, ties by slot id
    assert order.tolist() == [0, 4, 2, 5, 1, 3] and counts == [2, 2, 2, 0]
    assert torch.equal(order[inv], torch.arange(6)) and torch.equal(inv[order], torch.arange(6))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_grouped_gemm_equals_the_per_expert_loop(monkeypatch, dtype):
    """The two-launch grouped GEMM path (`torch._grouped_mm`, what the CPU and a Hopper GPU run) gives the same
    forward and gradients, bit for bit, as the per-expert loop (``TRACERL_GROUPED_MM=0``), also with an expert no
    token picks; and it really is the grouped path that runs (two grouped GEMMs per call, no loop)."""
    from tracerl.policy import experts as det

    block, rt = _block("fp4_rne_own_scales", dtype, top_k=3)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(77, 64, generator=g).to(dtype)
    idx = _routes(77, 3, 8, seed=12, skip_expert=2)
    w = torch.rand(77, 3, generator=g).to(dtype)
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert det.grouped_gemm_supported(x, block.experts.gate_up_proj)
    grouped = _run(_proposed(block, rt), block, rt, x, idx, w)
    assert len(calls) == 2
    monkeypatch.setenv("TRACERL_GROUPED_MM", "0")
    assert not det.grouped_gemm_supported(x, block.experts.gate_up_proj)
    loop = _run(_proposed(block, rt), block, rt, x, idx, w)
    assert len(calls) == 2
    for a, b in zip(grouped, loop):
        assert torch.equal(a, b)
