"""FP4Runtime state: calibration uses tracefp4's global-scale formula; per-call state is set and restored in
one place (`FP4Runtime.using`), also when the call fails."""

import pytest
import torch

import tracefp4
from tracerl.rollout import RolloutEngine
from tracerl.errors import ConfigError
from tracerl.policy import TinyMoESpec, build_model, moe_layer_name
from tracerl.policy import install_fp4
from tracerl.policy import moe_down_site, moe_input_site, plan_sites

TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4, top_k=2,
            moe_intermediate_size=32, vocab_size=128)


@pytest.fixture()
def tiny():
    model = build_model(TinyMoESpec(**TINY), seed=0)
    rt = install_fp4(model, plan_sites(model, hint_layers="all"))
    return model, rt


def test_calibration_is_tracefp4_global_scale(tiny):
    """One global-scale formula: the calibrated scale of a site is `tracefp4.compute_global_scale` of all the
    activations it saw (finite values only; 1.0 for a site that saw only zeros). The runtime's own formula,
    clamp(amax, 1e-12) / 2688 over every value, gave inf for an activation with an inf and 3.7e-16 for zeros."""
    _, rt = tiny
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    x2 = 3 * torch.randn(7, 64, generator=g).to(torch.bfloat16)
    x2[1, 5], x2[2, 0] = float("inf"), float("nan")
    odd = torch.tensor(1.0009765625 * 2688 * 0.37)  # an amax whose scale is not a round number
    x1[0, 0] = odd
    site, zero_site = moe_input_site(0), moe_down_site(1)
    with rt.calibrating():
        rt.quant(site, x1)
        rt.quant(site, x2)
        rt.quant(zero_site, torch.zeros(3, 64, dtype=torch.bfloat16))
        for other in rt.plan.sites:
            if other.name not in (site, zero_site):
                rt.quant(other.name, torch.ones(2, other.width, dtype=torch.bfloat16))
    want = tracefp4.compute_global_scale(torch.cat([x1, x2]))
    assert rt.global_scales[site].dtype == torch.float32
    assert torch.equal(rt.global_scales[site], want) and torch.isfinite(want)
    assert rt.global_scales[zero_site].item() == 1.0
    assert rt.mode == "fp4_rne_own_scales" and rt._calib is None  # restored


def test_using_sets_and_restores(tiny):
    _, rt = tiny
    calls = []
    before = {k: getattr(rt, k) for k in rt.CALL_STATE}
    with rt.using(mode="fp4_hints", capture=calls.append, gather_max_slots=7):
        assert rt.mode == "fp4_hints" and rt.capture == calls.append and rt.gather_max_slots == 7
        with rt.using(mode="bf16"):
            assert rt.mode == "bf16" and rt.capture == calls.append
        assert rt.mode == "fp4_hints"
    assert {k: getattr(rt, k) for k in rt.CALL_STATE} == before
    with pytest.raises(RuntimeError, match="boom"), rt.using(mode="bf16", on_route=print):
        raise RuntimeError("boom")
    assert {k: getattr(rt, k) for k in rt.CALL_STATE} == before
    with pytest.raises(ConfigError, match="unknown QAT mode"), rt.using(mode="fp8", capture=print):
        pass
    with pytest.raises(ConfigError, match="unknown state"), rt.using(plan=None):
        pass
    assert {k: getattr(rt, k) for k in rt.CALL_STATE} == before


def test_generate_restores_model_and_runtime_on_failure(tiny):
    """A failing `generate` leaves the model's attention setting and the runtime as they were (a bad mode left
    the attention implementation switched; an error inside left the runtime's callbacks unset, not restored)."""
    model, rt = tiny
    eng = RolloutEngine(model, rt)
    eng.calibrate([[1, 2, 3]])
    model.config._attn_implementation = "eager"
    with pytest.raises(ConfigError, match="unknown QAT mode"):
        eng.generate([[1, 2, 3]], 2, mode="fp8")
    assert model.config._attn_implementation == "eager" and rt.mode == "fp4_rne_own_scales"
    outer = []
    with rt.using(on_route=lambda layer, idx: outer.append(layer)):
        with pytest.raises(RuntimeError):
            eng.generate([[1, 2, 3]], 2, temperature=float("nan"))  # multinomial rejects NaN probabilities
        assert model.config._attn_implementation == "eager" and eng._rows is None
        assert rt.on_route is not None and rt.capture is None  # the caller's callback, not None
    res = eng.generate([[1, 2, 3]], 2, on_step=lambda done, total: outer.append((done, total)))
    assert outer == [(1, 2), (2, 2)] and len(res.logprobs[0]) == 2
    assert sorted(res.experts) == [0, 1] and moe_input_site(0).startswith(moe_layer_name(0) + ".")


def test_call_state_is_per_thread(tiny):
    """Two threads run the same model in two modes at once (the audit's side-by-side replay and floor decodes):
    a `using` block, `provide` or an assignment in one thread is not seen by the other; a thread starts from the
    defaults, which `set_mode` changes for threads that start later."""
    import threading

    _, rt = tiny
    entered, release, seen = threading.Event(), threading.Event(), {}

    def other():
        seen["start"] = rt.mode
        with rt.using(mode="bf16", forced_routes={0: torch.zeros(1, 2, dtype=torch.long)}):
            rt.provide({"x": (torch.zeros(1), None)})
            entered.set()
            release.wait(10)
            seen["inside"] = (rt.mode, set(rt.forced_routes), set(rt.provided))
        seen["after"] = rt.mode

    t = threading.Thread(target=other)
    with rt.using(mode="fp4_hints"):
        t.start()
        assert entered.wait(10)
        # the other thread is inside its bf16 block with routes and hints of its own: none of it shows here
        assert rt.mode == "fp4_hints" and rt.forced_routes == {} and rt.provided == {}
        release.set()
        t.join(10)
    assert seen == {"start": "fp4_rne_own_scales", "inside": ("bf16", {0}, {"x"}), "after": "fp4_rne_own_scales"}
    assert rt.mode == "fp4_rne_own_scales"
    rt.set_mode("bf16")
    later = {}
    t2 = threading.Thread(target=lambda: later.setdefault("mode", rt.mode))
    t2.start()
    t2.join(10)
    assert later == {"mode": "bf16"} and rt.mode == "bf16"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_effective_codes_are_the_codes_of_a_fake_quantized_tensor(dtype):
    """effective_codes(fake_quantize(x), scales, g) == quantize(x)'s codes (ties included: values at every
    midpoint; ±0 count as one code), and a scale byte 0 gives code 0."""
    from tracerl.policy import effective_codes

    torch.manual_seed(3)
    x = (torch.randn(64, 64) * 4).to(dtype)
    x[0, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -5.0, 6.0, 7.0, 0.0, 4.0, -3.0, 1.0, 0.5])
    g = torch.tensor(1.0)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    y = tracefp4.fake_quantize(x, "nvfp4", global_scale=g, backend="reference")
    got = effective_codes(y, q.scales, g)
    want = tracefp4.unpack_codes(q.codes).reshape(got.shape)
    zero = (want & 7) == 0
    assert torch.equal(got[~zero], want[~zero]) and bool((got[zero] == 0).all())
    assert bool((effective_codes(y, torch.zeros_like(q.scales), g) == 0).all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_effective_codes_equal_the_nearest_ladder_value_of_the_magnitude(dtype):
    """The signed-bucket form equals the definition written per value (|y| / (s g) to the nearest E2M1 magnitude,
    a tie to the lower one; the sign where the code is not 0; 0 for non-finite ratios and for a zero, negative or
    NaN scale byte) on fake-quantized values, arbitrary values, exact ladder values and midpoints, specials."""
    from tracefp4.constants import E2M1_MIDPOINTS
    from tracerl.policy import effective_codes

    def definition(y, scales, g):
        s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1) * g.float()
        mag = torch.where(s > 0, y.float().abs() / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(s))
        idx = torch.bucketize(mag, torch.tensor(E2M1_MIDPOINTS)).to(torch.uint8)
        idx = torch.where(torch.isfinite(mag), idx, torch.zeros_like(idx))
        return idx | (((y < 0) & (idx > 0)).to(torch.uint8) << 3)

    gen = torch.Generator().manual_seed(5)
    for trial in range(6):
        x = (torch.randn(32, 128, generator=gen) * torch.exp(3 * torch.randn(32, 1, generator=gen))).to(dtype)
        idx = torch.randint(0, x.numel(), (100,), generator=gen)
        x.view(-1)[idx] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf")] * 20).to(dtype)
        g = tracefp4.compute_global_scale(x)
        q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
        scales = q.scales.clone()
        if trial % 2:  # zero, NaN and negative scale bytes
            pick = torch.randint(0, scales.numel(), (40,), generator=gen)
            scales.view(-1)[pick] = torch.tensor([0, 0x7F, 0x80, 0xFF, 0x85] * 8, dtype=torch.uint8)
        s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=-1) * g
        ladder = torch.tensor([0, .25, .5, .75, 1, 1.25, 1.5, 1.75, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 1e30])
        on_ladder = ladder[torch.randint(0, len(ladder), x.shape, generator=gen)] * s
        on_ladder = torch.where(torch.rand(x.shape, generator=gen) < 0.5, -on_ladder, on_ladder).to(dtype)
        y = tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints, backend="reference")
        for t in (y, x, on_ladder):
            assert torch.equal(effective_codes(t, scales, g), definition(t, scales, g))


def test_prequantized_weights_are_what_the_forward_would_compute(monkeypatch):
    """`prequantize_weights` after a change of the weights (an optimizer step, then `weights_changed`) fills the
    cache with what the next forward's `weight` calls would compute: that forward quantizes no weight itself and
    its output and gradients are the same bits as a twin's that quantizes them lazily; bf16 mode and a runtime
    without the weight cache (sharded training) quantize nothing ahead."""
    ids = torch.randint(0, TINY["vocab_size"], (2, 7), generator=torch.Generator().manual_seed(1))

    def twin():
        model = build_model(TinyMoESpec(**TINY), seed=0)
        rt = install_fp4(model, plan_sites(model, hint_layers="all"))
        with rt.calibrating(), torch.no_grad():
            model(input_ids=ids)
        rt.set_mode("fp4_rne_own_scales")
        return model, rt

    def fwd_bwd(model):
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids).logits
        out.float().square().mean().backward()
        return [out.detach()] + [p.grad for p in model.parameters() if p.grad is not None]

    def change_weights(model, rt):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)
        rt.weights_changed()

    (lazy, rt_lazy), (ahead, rt) = twin(), twin()
    assert rt.prequantize_weights() == 0  # nothing met yet
    for model, r in ((lazy, rt_lazy), (ahead, rt)):
        fwd_bwd(model)  # the first forward meets every expert stack
        change_weights(model, r)
    stacks = 2 * TINY["num_layers"]  # gate_up and down per MoE layer
    calls = []
    real = tracefp4.fake_quantize_matrices
    monkeypatch.setattr(tracefp4, "fake_quantize_matrices", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert rt.prequantize_weights() == stacks and len(calls) == stacks
    assert rt.prequantize_weights() == 0  # already current
    calls.clear()
    got = fwd_bwd(ahead)
    assert not calls, "the forward quantized a weight the cache should have held"
    want = fwd_bwd(lazy)
    assert len(calls) == stacks  # the lazy twin quantized its own
    assert len(got) == len(want) and all(torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a, b.view(
        torch.uint8) if b.dtype == torch.bfloat16 else b) for a, b in zip(got, want))
    change_weights(ahead, rt)
    key = next(iter(rt._wsrc))  # a weight whose storage was freed since (FSDP2 reshards after the backward)
    gone = rt._wsrc[key].detach().clone()
    gone.untyped_storage().resize_(0)
    rt._wsrc[key] = gone
    with rt.using(mode="bf16"):
        assert rt.prequantize_weights() == 0
    assert rt.prequantize_weights() == stacks - 1 and key not in rt._wcache
    rt.cache_weights = False
    assert rt.prequantize_weights() == 0
