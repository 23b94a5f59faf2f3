"""The plugin's capture and session, driven through its real hooks in SGLang's layouts (`helpers.sglang_sim`),
against our reference engine: the store SGLang's path writes holds the same hints, scales, experts, tokens,
log-probs and policy versions as the reference recorder's, keeps nothing of an aborted request, records the
multipliers and settings per policy version, and passes ``tracestore verify``, ``tracerl audit`` and trains with
``tracerl train``."""

from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tracestore as ts
from helpers import loop
from helpers.sglang_sim import VARIANTS, Driver, Request
from tracerl.policy import build_policy, moe_input_site, site_widths
from tracerl.rollout import MemorySink, RolloutEngine, RolloutRecorder
from tracerl.sglang import global_scales, hooks, read_records
from tracerl.sglang.config import SGLangConfig

GROUPS, G = 2, loop.G
ABORTED = "sg-b0-p009-s00"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang")
    url = str(tmp / "store")
    store = loop.create(url)
    policy = build_policy(store.model)
    task = policy.task
    prompts = task.prompts(GROUPS, seed=11)
    rids = [f"sg-b0-p{g:03d}-s{s:02d}" for g in range(GROUPS) for s in range(G)] + [ABORTED]
    rep = [prompts[g] for g in range(GROUPS) for _ in range(G)] + [prompts[0]]
    widths = site_widths(policy.plan)
    sink = MemorySink(widths)
    recorder = RolloutRecorder(sink, widths, moe_layers=policy.moe_layers, top_k=policy.spec.top_k)
    engine = RolloutEngine(policy.model, policy.runtime, recorder=recorder, keep_codes=True, feed_last=False,
                           decode="static")
    roll = engine.generate(rep, task.response_len, seed=5, request_ids=rids, policy_version=0)
    reqs = []
    for i, rid in enumerate(rids):
        piece = sink.read(rid)
        p = len(rep[i])
        fed = p + task.response_len - 1
        s = rid.rsplit("-s", 1)[1]
        r = Request(rid=rid, origin_input_ids=list(rep[i]), response=roll.sequences[i][p:].tolist(),
                    logprobs=roll.logprobs[i].tolist(),
                    codes={site: roll.codes[site][i] for site in widths},
                    scales={site: piece.scales[site][:fed] for site in widths},
                    experts={layer: roll.experts[layer][i] for layer in roll.experts})
        if rid == ABORTED:
            r.arrive, r.abort_after = 1, 3
        elif s in ("02", "03"):  # later samples of a group: the prompt is in the prefix cache
            r.arrive, r.donor = 3, rid.rsplit("-s", 1)[0] + "-s00"
        reqs.append(r)
    state = hooks.State(SGLangConfig(store=url, commit_interval_s=0.0, server_id="sgtest"))
    saved, hooks.STATE = hooks.STATE, state
    try:
        args = SimpleNamespace(quantization="modelopt_fp4", moe_runner_backend="flashinfer_trtllm", port=30000,
                               enable_return_routed_experts=True)
        hooks.start_session(state, args, {}, rank=(0, 0))
        driver = Driver(state, reqs, state.session.layer_sites, policy.spec.hidden_size,
                        store.model["global_scales"], num_layers=policy.spec.num_layers, top_k=policy.spec.top_k)
        driver.run()
        state.session.close()
    finally:
        hooks.STATE = saved
    return SimpleNamespace(url=url, tmp=tmp, sink=sink, reqs={r.rid: r for r in reqs}, driver=driver,
                           stats=state.session.stats, widths=widths, meta=store.model, top_k=policy.spec.top_k)


def test_schedule_covered_every_layout(run):
    d = run.driver
    assert all(d.variant_counts[v] > 0 for v in VARIANTS), d.variant_counts
    assert d.padded_rows > 0 and d.prefill_splits > 0
    assert run.stats == {"committed": GROUPS * G, "aborted": 1, "dropped": 0,
                         "tokens": sum(len(r.origin_input_ids) + len(r.response) for r in run.reqs.values()
                                       if r.rid != ABORTED)}


def test_store_holds_the_engines_rows(run):
    reader = ts.open_store(run.url).reader()
    assert sorted(reader.trajectories_table().column("traj_id").to_pylist()) == sorted(
        r for r in run.reqs if r != ABORTED)
    for rid, r in run.reqs.items():
        if rid == ABORTED:
            continue
        p, n = len(r.origin_input_ids), len(r.origin_input_ids) + len(r.response)
        got = reader.read(rid, 0, n)
        ref = run.sink.read(rid)
        donor = run.sink.read(r.donor) if r.donor else None
        for site in run.widths:
            want_h, want_s = ref.hints[site][: n - 1].copy(), ref.scales[site][: n - 1].copy()
            if donor is not None:  # cached prompt tokens: what the donor's forward captured
                want_h[: p - 1], want_s[: p - 1] = donor.hints[site][: p - 1], donor.scales[site][: p - 1]
            np.testing.assert_array_equal(got.hints[site][: n - 1], want_h)
            np.testing.assert_array_equal(got.scales[site][: n - 1], want_s)
            assert not got.hints[site][n - 1].any() and not got.scales[site][n - 1].any()  # never forwarded
        for layer, name in enumerate(sorted(ref.experts)):
            np.testing.assert_array_equal(got.experts[name][: n - 1], ref.experts[name][: n - 1])
            np.testing.assert_array_equal(got.experts[name][n - 1], np.arange(run.top_k))
        np.testing.assert_array_equal(got.token_ids, [*r.origin_input_ids, *r.response])
        assert np.isnan(got.logprobs[:p]).all()
        np.testing.assert_array_equal(got.logprobs[p:], np.asarray(r.logprobs, dtype=np.float32))
        assert (got.policy_version == 0).all()
        res = reader.result(rid)
        assert (res.group_id, res.prompt_len, res.response_len, res.policy_version) == (
            rid.rsplit("-s", 1)[0], p, len(r.response), 0)


def test_hints_are_the_lsbs_of_the_codes(run):
    # the hint bits come from SGLang's codes (tracefp4.hints_from_codes): equal to the engine's own hints
    r = run.reqs["sg-b0-p001-s01"]
    site = moe_input_site(1)
    codes = torch.from_numpy(r.codes[site])
    lsb = ((codes & 1) | ((codes >> 4) & 1) << 1)  # bits of values 2i, 2i+1 of each byte
    bits = np.unpackbits(ts.open_store(run.url).reader().read(r.rid).hints[site][:-1], axis=1, bitorder="little")
    np.testing.assert_array_equal(bits[:, 0::2], lsb.numpy() & 1)
    np.testing.assert_array_equal(bits[:, 1::2], lsb.numpy() >> 1)


def test_quantizer_record_gives_the_trainer_the_engines_global_scales(run):
    got = global_scales(run.url, 0)
    assert got == {s: float(np.float32(run.meta["global_scales"][s])) for s in run.widths}
    [rec] = read_records(run.url, 0)
    assert rec["writer_id"] == "sgtest-dp0-tp0" and rec["quantizer"]["moe_runner_backend"] == "flashinfer_trtllm"
    for site, s in rec["sites"].items():
        assert np.float32(1) / np.float32(s["global_scale"]) == np.float32(s["multiplier"])


def test_aborted_request_leaves_nothing(run):
    store = ts.open_store(run.url)
    with pytest.raises(ts.HintNotFoundError):
        store.reader().read(ABORTED)
    assert ABORTED not in store.reader().results_table().column("traj_id").to_pylist()


def _cli(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", *args], env=loop.env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_store_passes_verify_audit_and_trains(run):
    v = _cli("tracestore.cli", "verify", run.url, "--json")
    assert v.returncode == 0, v.stderr[-2000:]
    assert json.loads(v.stdout)["ok"] is True
    a = _cli("tracerl.cli", "audit", run.url, "--json", "--no-planner", "--no-attribution", "--threads", "1")
    assert a.returncode == 0, a.stderr[-3000:]
    audit = json.loads(a.stdout)
    assert audit["integrity"]["ok"] and audit["store"]["audited_trajectories"] == GROUPS * G
    # SGLang never feeds a trajectory's last token, so its row is the "never forwarded" marker (scale bytes 0):
    # the replay (which feeds it) differs there and only there, 1 of the 13 positions of each trajectory
    n = len(next(iter(run.reqs.values())).origin_input_ids) + len(next(iter(run.reqs.values())).response)
    assert audit["replay"]["logprobs_equal"] == 1.0
    assert abs(audit["replay"]["hints_equal"] - (n - 1) / n) < 0.002
    # and the trainer's codes agree at every forwarded response token (7 of 8): the hints repair all of them
    fp4 = audit["modes"]["fp4_hints"]
    assert fp4["code_agreement"] >= 7 / 8 and fp4["mean_abs_dlogp"] <= audit["modes"]["fp4_rne_own_scales"][
        "mean_abs_dlogp"]
    t = _cli("tracerl.cli", "train", run.url, "--checkpoints", str(run.tmp / "ck"), "--steps", "1",
             "--groups-per-step", str(GROUPS), "--group-size", str(G), "--micro-batch-tokens", "64",
             "--wait-timeout", "60", "--threads", "1", "--json")
    assert t.returncode == 0, t.stderr[-3000:]
    step = json.loads(t.stdout.strip().splitlines()[-1])
    assert step["step"] == 1 and sorted(step["traj_ids"]) == sorted(r for r in run.reqs if r != ABORTED)
