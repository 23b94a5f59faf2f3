"""Hint-guided QAT trainer: every mode runs forward + backward with straight-through gradients."""

import numpy as np
import pytest
import torch

from tracerl import fidelity
from tracerl.errors import ConfigError, HintMismatchError
from tracerl.policy import TinyMoESpec, build_model
from tracerl.hints import PackedHints, Segment
from tracerl.policy import MODES, install_fp4
from tracerl.policy import moe_down_site, moe_input_site, parse_layers, plan_sites
from tracerl.train import QATTrainer

TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4, top_k=2,
            moe_intermediate_size=32, vocab_size=128)


def _packed(lens, vocab, seed=0):
    g = np.random.default_rng(seed)
    return PackedHints(
        segments=tuple(Segment(f"t{i}", 0, n) for i, n in enumerate(lens)),
        cu_seqlens=np.concatenate([[0], np.cumsum(lens)]),
        token_ids=g.integers(1, vocab, sum(lens)),
        positions=np.concatenate([np.arange(n) for n in lens]),
        logprobs=np.concatenate([np.r_[np.full(3, np.nan), np.zeros(n - 3)] for n in lens]).astype(np.float32),
        hints={}, scales={}, experts={}, features=None,
    )


@pytest.fixture(scope="module")
def setup():
    spec = TinyMoESpec(**TINY)
    model = build_model(spec, seed=0)
    plan = plan_sites(model, hint_layers="all", hint_sites="all-fp4")
    rt = install_fp4(model, plan)
    packed = _packed([9, 5], spec.vocab_size)
    tr = QATTrainer(model, rt)
    # calibrate from the batch itself, then take "rollout" hints and scales from an own-scales forward
    from tracerl.rollout import RolloutEngine

    RolloutEngine(model, rt).calibrate([packed.token_ids[:9].tolist(), packed.token_ids[9:].tolist()])
    got = {}
    rt.capture = lambda site, q: got.__setitem__(site, (q.hints, q.scales))
    tr.recompute(packed, "fp4_rne_own_scales")
    rt.capture = None
    # captured rows are the padded [2, 9] forward rows; keep the 14 THD tokens'
    packed.hints = {s: h.numpy()[_thd_rows([9, 5])] for s, (h, _) in got.items()}
    packed.scales = {s: sc.numpy()[_thd_rows([9, 5])] for s, (_, sc) in got.items()}
    return spec, model, rt, tr, packed


def _thd_rows(lens):
    lmax = max(lens)
    return np.concatenate([b * lmax + np.arange(n) for b, n in enumerate(lens)])


@pytest.mark.parametrize("mode", MODES)
def test_forward_backward_every_mode(setup, mode):
    spec, model, rt, tr, packed = setup
    out = tr.recompute(packed, mode, backward=True)
    assert np.isfinite(out.loss) and out.grad_norm > 0
    ex = model.model.layers[0].mlp.experts
    assert ex.gate_up_proj.grad is not None and torch.isfinite(ex.gate_up_proj.grad).all()
    assert ex.gate_up_proj.grad.abs().sum() > 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None
    assert np.isnan(out.logprobs[[0, 9]]).all() and np.isfinite(out.logprobs[1:9]).all()
    assert set(out.routes) == {0, 1} and out.routes[0].shape == (14, spec.top_k)
    if mode != "bf16":
        assert out.codes[moe_input_site(1)].shape == (14, spec.hidden_size)


def test_hints_mode_reproduces_own_codes_on_same_activations(setup):
    """With the hints of its own RNE quantization, the trainer picks exactly the RNE codes."""
    spec, model, rt, tr, packed = setup
    own = tr.recompute(packed, "fp4_rne_own_scales")
    hinted = tr.recompute(packed, "fp4_hints")
    for s in (moe_input_site(0), moe_down_site(1)):
        # effective codes cannot tell -0 from +0 (both dequantize to 0): compare with code_matches
        assert fidelity.code_matches(hinted.codes[s], own.codes[s]).all()
    np.testing.assert_array_equal(hinted.logprobs, own.logprobs)


def test_straight_through_gradient_is_identity_at_the_site(setup):
    """STE: d(loss)/d(x) at an FP4 site equals d(loss)/d(fake_quant(x))."""
    spec, model, rt, tr, packed = setup
    x = torch.randn(4, spec.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    rt.set_mode("fp4_rne_own_scales")
    y = rt.quant(moe_input_site(0), x)
    w = torch.randn_like(y)
    (y * w).sum().backward()
    torch.testing.assert_close(x.grad, w)


def test_hint_modes_check_what_they_get(setup):
    spec, model, rt, tr, packed = setup
    bad = PackedHints(**{**packed.__dict__, "scales": {}})
    with pytest.raises(ConfigError, match="needs site"):
        tr.recompute(bad, "fp4_hints")
    rt.set_mode("fp4_hints")
    rt.provide({moe_input_site(0): (torch.zeros(3, 4, dtype=torch.uint8), torch.zeros(3, 8, dtype=torch.uint8))})
    with pytest.raises(HintMismatchError, match="needs scales"):
        rt.quant(moe_input_site(0), torch.zeros(2, spec.hidden_size, dtype=torch.bfloat16))
    rt.provide({})
    rt.set_mode("fp4_rne_own_scales")
    with pytest.raises(ConfigError, match="unknown QAT mode"):
        tr.recompute(packed, "fp8")


def test_packed_layout_matches_padded(setup):
    spec, model, rt, tr, packed = setup
    a = tr.recompute(packed, "bf16")
    b = QATTrainer(model, rt, layout="packed").recompute(packed, "bf16")
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-2, equal_nan=True)


def test_parse_layers_and_plan():
    assert parse_layers("latter-half", 8) == [4, 5, 6, 7]
    assert parse_layers("0,3,5", 8) == [0, 3, 5]
    assert parse_layers("none", 8) == []
    with pytest.raises(ConfigError, match="out of range"):
        parse_layers("9", 8)
    with pytest.raises(ConfigError, match="expected latter-half"):
        parse_layers("first", 8)
    model = build_model(TinyMoESpec(**TINY), seed=0)
    plan = plan_sites(model, fp4="experts+attention", hint_layers="1")
    assert plan.hinted == (moe_input_site(1),)
    assert "model.layers.0.self_attn.q_proj.input" in plan.by_name
    assert plan_sites(model, hint_sites=["*down_proj*"]).hinted == (moe_down_site(0), moe_down_site(1))


def _with_experts(packed, experts):
    import dataclasses

    return dataclasses.replace(packed, experts=experts)


def test_routing_replay_uses_the_given_experts(setup):
    """Replaying the trainer's own routes changes nothing; replaying other experts changes the log-probs while
    the reported routes stay the router's own choice; the gate still gets gradients."""
    spec, model, rt, tr, packed = setup
    base = tr.recompute(packed, "fp4_rne_own_scales")
    own = {f"model.layers.{la}.mlp": r for la, r in base.routes.items()}
    same = tr.recompute(_with_experts(packed, own), "fp4_rne_own_scales", replay_routes=True)
    np.testing.assert_allclose(same.logprobs, base.logprobs, atol=1e-6, equal_nan=True)
    # a different but valid expert set per token: shift every id by one (mod E), keep ascending order
    other = {k: np.sort((v.astype(np.int64) + 1) % spec.num_experts, axis=-1).astype(np.uint8) for k, v in own.items()}
    moved = tr.recompute(_with_experts(packed, other), "fp4_rne_own_scales", replay_routes=True, backward=True)
    ok = ~np.isnan(base.logprobs)
    assert np.abs(moved.logprobs[ok] - base.logprobs[ok]).max() > 1e-3
    for la in base.routes:  # routes report what the router chose, not what was replayed
        np.testing.assert_array_equal(moved.routes[la], base.routes[la])
    gate = model.model.layers[0].mlp.gate.weight
    assert gate.grad is not None and float(gate.grad.abs().sum()) > 0
    assert rt.forced_routes == {}  # reset after the call


def test_routing_replay_checks_its_input(setup):
    spec, model, rt, tr, packed = setup
    with pytest.raises(ConfigError, match="routed experts of model.layers.0.mlp"):
        tr.recompute(_with_experts(packed, {}), "bf16", replay_routes=True)
    bad = {f"model.layers.{i}.mlp": np.zeros((len(packed.token_ids), spec.top_k + 1), np.uint8)
           for i in range(spec.num_layers)}
    with pytest.raises(HintMismatchError, match="replayed routes"):
        tr.recompute(_with_experts(packed, bad), "bf16", replay_routes=True)
    assert rt.forced_routes == {}


def test_capturing_quant_equals_fake_quantize_with_nan_and_inf(setup):
    """At a hinted site the CPU capture path reuses quantize's codes; its output must still be fake_quantize's,
    NaN included (a NaN is coded as magnitude 6 but comes out as NaN)."""
    import tracefp4

    spec, model, rt, tr, packed = setup
    site = rt.plan.hinted[0]
    w = rt.plan.by_name[site].width
    x = torch.randn(5, w, dtype=torch.bfloat16)
    x[0, 3], x[1, 7], x[2, 0] = float("nan"), float("inf"), -float("inf")
    g = rt.global_scale_on(site, x.device)
    want = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g)
    rt.set_mode("fp4_rne_own_scales")
    got_q = []
    rt.capture = lambda s, q: got_q.append(s)
    try:
        y = rt.quant(site, x)
    finally:
        rt.capture = None
    assert got_q == [site]
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    ok = ~torch.isnan(want)
    assert torch.equal(y[ok].view(torch.int16), want[ok].view(torch.int16))



@pytest.mark.parametrize("lens", [[9, 5], [6, 6]], ids=["padded", "no-padding"])
def test_own_sdpa_mask_is_hugging_faces_mask_and_changes_no_bit(setup, monkeypatch, lens):
    """The trainer gives SDPA its mask itself (tracerl.train.attention: no device check of the padding): it is
    Hugging Face's mask element for element (None without padding), Hugging Face's mask code is never consulted,
    and every log-prob, code and gradient is the same bit for bit as when Hugging Face makes the mask."""
    import transformers.masking_utils as mu

    from tracerl.train import attention
    from tracerl.train import recompute as rc

    spec, model, rt, tr, packed = setup
    if lens != [9, 5]:
        packed = _packed(lens, spec.vocab_size)
        packed.hints = {s: np.zeros((sum(lens), h.shape[1]), np.uint8) for s, h in setup[4].hints.items()}
        packed.scales = {s: np.full((sum(lens), h.shape[1]), 0x38, np.uint8) for s, h in setup[4].scales.items()}
    inputs, _ = tr._layout(packed, torch.device("cpu"))
    emb = model.model.embed_tokens(inputs["input_ids"])
    theirs = mu.create_causal_mask(config=model.config, inputs_embeds=emb, attention_mask=inputs["attention_mask"],
                                   cache=None, position_ids=inputs["position_ids"])
    if lens == [9, 5]:
        assert torch.equal(theirs, attention.sdpa_padding_mask(inputs["attention_mask"]))
    else:
        assert theirs is None  # SDPA's causal path, which own_sdpa_mask(None) takes too

    def run():
        model.zero_grad(set_to_none=True)
        out = tr.recompute(packed, "fp4_hints", backward=True)
        return out, [p.grad.clone() for p in model.parameters() if p.grad is not None]

    with monkeypatch.context() as m:
        def consulted(*a, **k):
            raise AssertionError("Hugging Face's mask check ran")
        m.setattr(mu, "_ignore_causal_mask_sdpa", consulted)
        m.setattr(mu, "find_packed_sequence_indices", consulted)
        ours, g_ours = run()
    assert model.config._attn_implementation == "sdpa"  # put back after the forward
    with monkeypatch.context() as m:
        m.setattr(rc.QATTrainer, "_own_sdpa_mask", lambda self: False)
        hf, g_hf = run()
    np.testing.assert_array_equal(ours.logprobs, hf.logprobs)
    assert ours.codes.keys() == hf.codes.keys() and all(np.array_equal(ours.codes[k], hf.codes[k]) for k in ours.codes)
    assert len(g_ours) == len(g_hf) and all(torch.equal(a, b) for a, b in zip(g_ours, g_hf))


def test_own_sdpa_mask_only_where_it_is_hugging_faces(setup, monkeypatch):
    """Eager attention and a sliding window leave the mask to Hugging Face; outside the trainer's forward the
    registered implementation refuses to run, and an error inside puts the model's attention back."""
    from tracerl.train import attention

    spec, model, rt, tr, packed = setup
    assert tr._own_sdpa_mask()
    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    assert not tr._own_sdpa_mask()
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    monkeypatch.setattr(model.config, "sliding_window", 4)
    assert not tr._own_sdpa_mask()
    monkeypatch.undo()
    with pytest.raises(ConfigError, match="only inside"):
        attention._attention(model.model.layers[0].self_attn, *(torch.zeros(1, 2, 3, 32),) * 3, None)
    with pytest.raises(ValueError, match="boom"):
        with attention.own_sdpa_mask(model, None):
            assert model.config._attn_implementation == attention.NAME
            raise ValueError("boom")
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("padded", [False, True])
def test_stacked_scatter_equals_scatter_per_array(padded):
    """The hinted sites' scales and hints go to the device stacked (one host buffer, copy and index copy per dtype
    and width); each result equals `_scatter` of its own array and is contiguous, whatever mix of widths, dtypes,
    torch tensors and single arrays arrives."""
    g = np.random.default_rng(0)
    t = 7
    arrays = [g.integers(0, 256, (t, 8), dtype=np.uint8) for _ in range(3)]
    arrays += [g.integers(0, 256, (t, 4), dtype=np.uint8) for _ in range(2)]
    arrays += [g.integers(0, 9, (t, 4)).astype(np.int64),  # one of its kind: takes _scatter
               torch.arange(t * 8, dtype=torch.uint8).reshape(t, 8),  # a tensor: takes _scatter
               np.asfortranarray(g.integers(0, 256, (t, 8), dtype=np.uint8))]  # not C-contiguous
    nrows = 12 if padded else t
    rows = torch.tensor([0, 1, 2, 5, 6, 7, 9] if padded else list(range(t)))
    cpu = torch.device("cpu")
    got = QATTrainer._scatter_stacked(arrays, rows, nrows, cpu)
    for a, y in zip(arrays, got):
        want = QATTrainer._scatter(a, rows, nrows, cpu)
        assert y.is_contiguous() and y.dtype == want.dtype and torch.equal(y, want)
    if padded:  # rows the batch does not cover are 0 (scale 0 -> 0)
        assert all(int(y[[3, 4, 8, 10, 11]].abs().sum()) == 0 for y in got)
