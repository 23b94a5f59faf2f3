"""Static-shape decode (`tracerl.rollout.decode.StaticDecoder`, the path that runs as a CUDA graph on a GPU).

On the CPU the decoder runs eagerly; these tests check that it computes what the Hugging Face decode path
computes (exactly enough in fp32 to agree on every sampled token, FP4 code, routed expert and recorded hint),
that its capture rings hand the recorder the same rows in the same places for any ring size, that one step
reads no device value on the host (run on meta tensors, which have no values: what a CUDA graph needs), and
that bad configurations fail with `ConfigError`. The graph replay itself runs only on CUDA
(`benchmarks/benchmark_tracerl_h200.py` compares graph and eager decode there).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers.capture import HostTraffic
from tracerl.rollout import StaticDecoder, supports_static_decode
from tracerl.rollout import RolloutEngine
from tracerl.errors import ConfigError
from tracerl.policy import TinyMoESpec, build_model
from tracerl.policy import install_fp4
from tracerl.rollout import MemorySink, RolloutRecorder
from tracerl.policy import plan_sites

TINY = dict(hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, num_experts=8, top_k=2,
            moe_intermediate_size=32, vocab_size=128)
PROMPTS = [[5, 9, 17, 33, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [11, 12, 13, 14, 15, 16, 17]]


def _setup(dtype=torch.float32, kv_fp4=False):
    spec = TinyMoESpec(**TINY)
    model = build_model(spec, seed=0).to(dtype)
    plan = plan_sites(model, hint_layers="all", kv_fp4=kv_fp4)
    return spec, model, plan, install_fp4(model, plan)


def _run(model, rt, plan, spec, decode, steps, ring=32, mode="fp4_rne_own_scales", forced=None):
    eng = RolloutEngine(model, rt, keep_codes=True, decode=decode, ring=ring)
    eng.calibrate(PROMPTS)
    widths = {s.name: s.width for s in plan.hinted_specs()}
    sink = MemorySink(widths)
    eng.recorder = RolloutRecorder(sink, widths, moe_layers=[f"model.layers.{i}.mlp" for i in range(spec.num_layers)],
                                   top_k=spec.top_k, flush_tokens=8, drain_every=3)
    res = eng.generate(PROMPTS, steps, seed=7, mode=mode, forced_tokens=forced)
    eng.recorder.close()
    return res, sink


@pytest.mark.parametrize("mode", ["bf16", "fp4_rne_own_scales"])
def test_static_decode_matches_hf_decode_in_fp32(mode):
    """fp32 weights: both paths sample the same tokens with log-probs within fp32 rounding, and (FP4) give the
    same codes at every hinted site and the same routed experts."""
    spec, model, plan, rt = _setup()
    hf, _ = _run(model, rt, plan, spec, "hf", 12, mode=mode)
    st, _ = _run(model, rt, plan, spec, "static", 12, mode=mode)
    assert (hf.decode_path, st.decode_path) == ("hf", "static")
    for a, b in zip(hf.sequences, st.sequences):
        np.testing.assert_array_equal(a, b)
    d = np.abs(np.concatenate(hf.logprobs) - np.concatenate(st.logprobs)).max()
    assert d < 1e-4, d
    for layer in hf.experts:
        for a, b in zip(hf.experts[layer], st.experts[layer]):
            np.testing.assert_array_equal(a, b)
    if mode != "bf16":
        assert hf.codes and set(hf.codes) == set(st.codes)
        agree = np.mean([(a == b).mean() for s in hf.codes for a, b in zip(hf.codes[s], st.codes[s])])
        assert agree >= 0.999, agree


@pytest.mark.parametrize("ring", [1, 4, 5, 32])
def test_ring_hands_every_step_to_the_recorder(ring):
    """Whatever the ring size (dividing the steps or not), the store gets the same tokens, hints, scales and
    routes from the static path as from the hf path, at the same positions."""
    spec, model, plan, rt = _setup()
    _, want = _run(model, rt, plan, spec, "hf", 10)
    res, got = _run(model, rt, plan, spec, "static", 10, ring=ring)
    assert sorted(got.trajectories()) == sorted(res.request_ids)
    for rid, seq in zip(res.request_ids, res.sequences):
        assert got.num_tokens(rid) == want.num_tokens(rid) == len(seq)
        a, b = want.read(rid), got.read(rid)
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        for s in a.hints:
            assert (a.hints[s] == b.hints[s]).mean() >= 0.999 and (a.scales[s] == b.scales[s]).mean() >= 0.999
        for la in a.experts:
            np.testing.assert_array_equal(a.experts[la], b.experts[la])


def test_fp4_kv_cache_sites_in_static_decode():
    spec, model, plan, rt = _setup(kv_fp4=True)
    hf, _ = _run(model, rt, plan, spec, "hf", 6)
    st, _ = _run(model, rt, plan, spec, "static", 6)
    assert np.abs(np.concatenate(hf.logprobs) - np.concatenate(st.logprobs)).max() < 1e-4
    plain = _setup()
    ref, _ = _run(plain[1], plain[3], plain[2], plain[0], "static", 6,
                  forced=torch.as_tensor(np.stack([s[len(p):] for s, p in zip(st.sequences, PROMPTS)])))
    assert np.abs(np.concatenate(ref.logprobs) - np.concatenate(st.logprobs)).max() > 0  # FP4 K/V did act


def test_bad_configurations_raise_config_error():
    spec, model, plan, rt = _setup()
    with pytest.raises(ConfigError, match="unknown decode path"):
        RolloutEngine(model, rt, decode="fast")
    with pytest.raises(ConfigError, match="CUDA"):
        RolloutEngine(model, rt, decode="graph").generate(PROMPTS, 2)
    with pytest.raises(ConfigError, match="CUDA"):
        StaticDecoder(model, rt, batch=2, max_len=8, use_graph=True)
    with pytest.raises(ConfigError, match=">= 1"):
        StaticDecoder(model, rt, batch=2, max_len=8, ring=0)
    dec = StaticDecoder(model, rt, batch=2, max_len=8)
    with pytest.raises(ConfigError, match="before prepare"):
        dec.step(torch.zeros(2, dtype=torch.long))
    with pytest.raises(ConfigError, match="ring holds"):
        dec.take(33)
    qwen35 = build_model(TinyMoESpec(family="qwen3.5-moe", **{**TINY, "num_layers": 4}), seed=0)
    rt35 = install_fp4(qwen35, plan_sites(qwen35))
    assert not supports_static_decode(qwen35) and supports_static_decode(model)
    with pytest.raises(ConfigError, match="full-attention"):
        RolloutEngine(qwen35, rt35, decode="static").generate(PROMPTS, 2)
    assert RolloutEngine(qwen35, rt35).decode_path(torch.device("cpu")) == "hf"
    assert RolloutEngine(model, rt).decode_path(torch.device("cpu")) == "static"
    assert RolloutEngine(model, rt).decode_path(torch.device("cuda")) == "graph"


def test_static_step_reads_no_device_value_on_meta():
    """One decode step with capture and routes on meta tensors: no host read, no host-to-device copy, so the
    step can be captured as a CUDA graph and replayed without a host sync."""
    spec, model, plan, rt = _setup(dtype=torch.bfloat16)
    RolloutEngine(model, rt).calibrate(PROMPTS)  # static global scales on the host
    model.to("meta")
    rt.set_mode("fp4_rne_own_scales")
    dec = StaticDecoder(model, rt, batch=4, max_len=16, ring=4, capture=True, keep_codes=True, routes=True)
    dec.prepare()
    tok = torch.zeros(4, dtype=torch.long, device="meta")
    dec.step(tok)  # first step: the runtime copies each site's global scale to the device, once
    with HostTraffic(meta=True) as ht:
        for _ in range(3):
            logits = dec.step(tok)
    assert logits.shape == (4, spec.vocab_size) and logits.device.type == "meta"
    # kernels/packing.py's pack_hints is the reference backend's (Triton packs hints in its kernel).
    calls = {k: v for k, v in ht.calls.items() if not (k[1] == "kernels/packing.py" and k[2] == "pack_hints")}
    assert not calls, calls
    sites = {k for k in dec.rings if k[0] == "site"}
    assert sites == {("site", s) for s in plan.hinted}
    assert {k for k in dec.rings if k[0] == "route"} == {("route", str(i)) for i in range(spec.num_layers)}
    assert dec.rings[("route", "0")][0].shape == (4, 4, spec.top_k)


def test_captures_are_staged_with_one_ring_copy_per_step():
    """A capturing step writes the hinted sites' hint bits and scales straight into the decoder's stage (the
    fused quantize kernel's output buffers: no copy per site), the routes too (the router's sort writes its ids
    into their int64 view), the codes with one copy each, and the whole stage into its ring slot with one
    ``index_copy_``; what `take` returns is each step's values, every part uint8."""
    spec, model, plan, rt = _setup(dtype=torch.bfloat16)
    RolloutEngine(model, rt).calibrate(PROMPTS)
    dec = StaticDecoder(model, rt, batch=2, max_len=16, ring=4, capture=True, keep_codes=False, routes=True)
    dec.prepare()
    seen = []
    real = dec._ring_write
    dec._ring_write = lambda key, parts: seen.append((key, tuple(p is None for p in parts))) or real(key, parts)
    toks = [torch.tensor([3, 5]), torch.tensor([7, 11]), torch.tensor([13, 17])]
    dec.step(toks[0])  # first step: lays out the stage
    seen.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        dec.step(toks[1])
    dec.step(toks[2])
    plain = StaticDecoder(model, rt, batch=2, max_len=16, ring=4)
    plain.prepare()
    plain.step(toks[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as plain_prof:
        plain.step(toks[1])
    count = [sum(e.name == "aten::index_copy_" for e in p.events() if e.cpu_parent is None) for p in (prof, plain_prof)]
    assert count[0] == count[1] + 1  # the ring (the others are the KV cache's writes)
    sites = {k: none for k, none in seen if k[0] == "site"}
    assert set(sites) == {("site", s) for s in plan.hinted} and all(v == (True, True) for v in sites.values())
    routes = {k: none for k, none in seen if k[0] == "route"}
    assert set(routes) == {("route", str(i)) for i in range(spec.num_layers)}
    assert all(v == (True,) for v in routes.values())  # sorted into the stage: no copy
    taken = dec.take(3)
    # the same values as a fresh quantization of the same steps: run them again without staging
    ref = StaticDecoder(model, rt, batch=2, max_len=16, ring=4, capture=True, keep_codes=False, routes=True)
    ref.prepare()
    fresh = {}
    for i, t in enumerate(toks):
        with rt.using(capture=lambda site, q, i=i: fresh.setdefault(("site", site), {}).__setitem__(i, (q.hints, q.scales)),
                      on_route=lambda layer, idx, i=i: fresh.setdefault(("route", str(layer)), {}).__setitem__(i, (idx,))):
            ref.tok.copy_(t)
            ref._forward()
    for key, parts in taken.items():
        for j, part in enumerate(parts):
            want = torch.cat([fresh[key][i][j].to(torch.uint8) for i in range(3)])
            assert part.dtype == torch.uint8 and torch.equal(part, want), key


def test_a_capture_part_first_seen_later_keeps_the_ring():
    """An eager decoder whose captures change after the stage is laid out (here: routes switched on after two
    steps) adds the new part after the others and keeps what the ring holds: the earlier steps' hint bits come
    back from `take` unchanged."""
    spec, model, plan, rt = _setup(dtype=torch.bfloat16)
    RolloutEngine(model, rt).calibrate(PROMPTS)
    dec = StaticDecoder(model, rt, batch=2, max_len=16, ring=4, capture=True)
    dec.prepare()
    toks = [torch.tensor([3, 5]), torch.tensor([7, 11]), torch.tensor([13, 17])]
    dec.step(toks[0])
    dec.step(toks[1])
    before = {k: [p.clone() for p in parts] for k, parts in dec.take(2).items()}
    dec.routes = True
    dec.step(toks[2])
    after = dec.take(3)
    assert ("route", "0") in after
    for key, parts in before.items():
        for b, a in zip(parts, after[key]):
            assert torch.equal(a[: b.shape[0]], b), key
