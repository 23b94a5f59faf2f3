"""The plugin's parts one by one: configuration, refusals, the capture's layouts and integrity checks, the session's
policy-version spans, restarts and conflicts, and the quantizer records' numbers."""

from __future__ import annotations

import json
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import tracefp4
import tracestore as ts
from helpers.sglang import swizzle_128x4
from tracerl.policy import moe_input_site
from tracerl.sglang import checks, quantizer as qz
from tracerl.sglang.capture import CapturedRows, SlotCapture, unswizzle_scales
from tracerl.sglang.config import SGLangConfig, load_config, moe_input_layer
from tracerl.sglang.errors import CaptureError, PluginConfigError, QuantizerRecordError, SGLangPluginError
from tracerl.sglang.session import FinishedRequest, RecordingSession, group_of


# ---- configuration ------------------------------------------------------------------------------------------
def test_unset_means_unconfigured_and_variables_override_the_file(tmp_path):
    assert load_config({}) is None
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"store": "/a", "commit_interval_s": 2, "results": "none"}))
    cfg = load_config({"TRACERL_SGLANG_CONFIG": str(f), "TRACERL_SGLANG_STORE": "/b",
                       "TRACERL_SGLANG_COMMIT_BYTES": "1024", "TRACERL_SGLANG_STORAGE_OPTIONS": '{"anon": true}'})
    assert (cfg.store, cfg.commit_interval_s, cfg.commit_bytes, cfg.results, cfg.storage_options) == (
        "/b", 2, 1024, "none", {"anon": True})
    assert cfg.writer_id(dp_rank=1, tp_rank=0, port=30000).endswith("-30000-dp1-tp0")
    assert "storage_options" not in cfg.to_json()


def test_site_table_from_the_audit_planner(tmp_path):
    t = tmp_path / "sites.json"
    t.write_text(json.dumps({"sites": [{"name": moe_input_site(20), "width": 2048},
                                       {"name": moe_input_site(21), "width": 2048}], "model": {}}))
    cfg = load_config({"TRACERL_SGLANG_STORE": "/s", "TRACERL_SGLANG_SITES": f"@{t}"})
    assert cfg.sites == (moe_input_site(20), moe_input_site(21))
    assert moe_input_layer(moe_input_site(7)) == 7  # one naming with tracerl.policy


@pytest.mark.parametrize("env, words", [
    ({"TRACERL_SGLANG_STORE": "/s", "TRACERL_SGLANG_RESULTS": "maybe"}, "results must be one of"),
    ({"TRACERL_SGLANG_STORE": "/s", "TRACERL_SGLANG_COMMIT_BYTES": "lots"}, "is not a number"),
    ({"TRACERL_SGLANG_STORE": "/s", "TRACERL_SGLANG_SITES": "model.layers.1.self_attn.q_proj.input"},
     "only the MoE layers' first-GEMM input"),
    ({"TRACERL_SGLANG_CONFIG": "/nonexistent.json"}, "cannot read it"),
    ({"TRACERL_SGLANG_STORE": "/s", "TRACERL_SGLANG_SERVER_ID": "a/b"}, "server_id"),
])
def test_bad_configuration_is_refused_with_what_arrived(env, words):
    with pytest.raises(PluginConfigError, match=words):
        load_config(env)


def test_every_unsupported_setting_is_named_with_what_to_change():
    ok = SimpleNamespace(moe_runner_backend="auto", moe_a2a_backend="none", enable_return_routed_experts=True)
    assert checks.refusals(ok, {}, needs_routes=True) == []
    cases = [({"moe_runner_backend": "flashinfer_cutlass"}, {}, "inside the fused CUTLASS kernel"),
             ({"moe_runner_backend": "flashinfer_cutedsl"}, {}, "CuTe DSL"),
             ({"moe_runner_backend": "flashinfer_megamoe"}, {}, "MegaMoE"),
             ({"moe_runner_backend": "marlin"}, {}, "W4A16"),
             ({"enable_torch_compile": True}, {}, "--enable-torch-compile"),
             ({"moe_a2a_backend": "deepep"}, {}, "--moe-a2a-backend deepep"),
             ({"enable_dp_attention": True}, {}, "--enable-dp-attention"),
             ({"speculative_algorithm": "EAGLE"}, {}, "speculative"),
             ({}, {"SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION": "1"}, "per-token"),
             ({}, {"FLASHINFER_NVFP4_4OVER6": "true"}, "Four-over-Six"),
             ({"enable_return_routed_experts": False}, {}, "--enable-return-routed-experts")]
    for args, env, words in cases:
        out = checks.refusals(SimpleNamespace(**{**vars(ok), **args}), env, needs_routes=True)
        assert len(out) == 1 and words in out[0], (args, env, out)
    s = checks.quantizer_settings(ok, {"FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH": "1"}, backend="flashinfer_trtllm",
                                  device_capability=(10, 0), flashinfer_version="0.7.2")
    assert (s["fast_math"], s["fp4_quantize_backend"], s["device_capability"]) == (False, "cute-dsl", "10.0")


# ---- capture ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rows, cols", [(1, 4), (3, 7), (130, 9), (257, 128)])
def test_unswizzle_inverts_the_128x4_layout(rows, cols):
    sf = np.random.default_rng(rows * cols).integers(0, 256, (rows, cols), dtype=np.uint8)
    sw = swizzle_128x4(sf)
    np.testing.assert_array_equal(unswizzle_scales(torch.from_numpy(sw), rows, cols).numpy(), sf)
    np.testing.assert_array_equal(unswizzle_scales(torch.from_numpy(sw).view(-1, -(-cols // 4) * 4), rows,
                                                   cols).numpy(), sf)
    with pytest.raises(CaptureError, match="swizzled"):
        unswizzle_scales(torch.from_numpy(sw[:-1]), rows, cols)


def _quantized(t: int, w: int, seed: int):
    x = torch.randn(t, w, generator=torch.Generator().manual_seed(seed))
    g = tracefp4.compute_global_scale(x)
    return tracefp4.quantize(x, "nvfp4", global_scale=g), torch.tensor(1.0) / g


def test_capture_stores_hints_scales_multiplier_per_kv_slot_and_drops_graph_padding():
    w = 32
    cap = SlotCapture({3: "s3"}, w, max_rows=16, num_slots=20)
    q, m = _quantized(8, w, 0)  # 8 rows: 5 real, 3 CUDA-graph padding
    cap.begin_forward()
    cap.capture(3, q.codes, q.scales.view(torch.float8_e4m3fn), m)
    cap.capture(4, q.codes, q.scales, m)  # a layer that is not hinted: ignored
    step = cap.take(torch.tensor([7, 2, 9, 11, 4]))
    cap.begin_forward()  # the next forward overwrites the stage before the first one's rows reach the host
    cap.capture(3, torch.zeros_like(q.codes), torch.zeros_like(q.scales), m)
    step.map_device_tensors(lambda x: x.clone())
    step.finalize()
    rows = cap.rows(np.array([7, 2, 9, 11, 4]))
    np.testing.assert_array_equal(rows.hints["s3"], q.hints[:5].numpy())
    np.testing.assert_array_equal(rows.scales["s3"], q.scales[:5].numpy())
    assert (rows.multiplier["s3"] == m.numpy()).all() and rows.valid.all()
    assert not cap.rows(np.array([0, 1])).valid.any()  # slots never written


def test_a_layer_whose_hook_did_not_run_is_caught_by_its_tag():
    w = 16
    cap = SlotCapture({0: "a", 1: "b"}, w, max_rows=4, num_slots=8)
    q, m = _quantized(2, w, 1)
    cap.begin_forward()
    cap.capture(0, q.codes, q.scales, m)
    cap.capture(1, q.codes, q.scales, m)
    cap.take(torch.tensor([1, 2])).finalize()
    cap.begin_forward()
    cap.capture(0, q.codes, q.scales, m)  # layer 1 ran some other path: its rows are the previous forward's
    cap.take(torch.tensor([3, 4])).finalize()
    assert cap.rows(np.array([1, 2])).valid.all() and not cap.rows(np.array([3, 4])).valid.any()
    assert cap.invalid_rows == 2


def test_capture_refuses_what_it_cannot_hold():
    cap = SlotCapture({0: "a"}, 32, max_rows=2, num_slots=4)
    q, m = _quantized(3, 32, 2)
    with pytest.raises(CaptureError, match="exceeds the capture's 2 rows"):
        cap.capture(0, q.codes, q.scales, m)
    with pytest.raises(CaptureError, match="expected uint8"):
        cap.capture(0, q.codes[:2, :8], q.scales[:2], m)
    with pytest.raises(CaptureError, match="KV slots outside"):
        cap.store_rows(torch.tensor([9]), torch.zeros(1, cap.row_bytes, dtype=torch.uint8), 0)


# ---- quantizer records ------------------------------------------------------------------------------------------
def _f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def test_global_scale_for_gives_a_g_whose_reciprocal_is_the_multiplier():
    rng = np.random.default_rng(0)
    gs = (10 ** rng.uniform(-4, 0, 2000)).astype(np.float32)
    not_round_trip = 0
    for g in gs:
        m = np.float32(1) / g  # what SGLang passes: fp32(1 / g), correctly rounded
        found = qz.global_scale_for(float(m))
        assert np.float32(1) / np.float32(found) == m
        assert qz.global_scale_for(float(m), preferred=float(g)) == float(g)
        not_round_trip += np.float32(1) / m != g
    assert 0.08 < not_round_trip / len(gs) < 0.25  # why fl(1/m) is not simply stored as g
    with pytest.raises(QuantizerRecordError, match="positive finite"):
        qz.global_scale_for(0.0)
    # a multiplier no fp32 reciprocal makes (SGLang's never is one): refused, not rounded to something close
    lacking = 0
    for b in range(0x3FC00000, 0x3FC00400):
        try:
            qz.global_scale_for(_f32(b))
        except QuantizerRecordError as e:
            assert "no fp32 g" in str(e)
            lacking += 1
    assert lacking > 0


def test_records_commit_once_and_a_second_rule_for_one_version_is_refused(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), [ts.Site(moe_input_site(0), 16)])
    area = store.area(qz.AREA)
    sites = {moe_input_site(0): {"layer": 0, "multiplier": 4.0}}
    rec = qz.make_record(3, "w-a", sites, {"fast_math": True})
    assert qz.put_record(area, rec) and not qz.put_record(area, qz.make_record(3, "w-a", sites, {"fast_math": True}))
    with pytest.raises(QuantizerRecordError, match="two rules"):
        qz.put_record(area, qz.make_record(3, "w-a", {moe_input_site(0): {"layer": 0, "multiplier": 2.0}}, {}))
    assert qz.global_scales(store, 3) == {moe_input_site(0): 0.25}
    qz.put_record(area, qz.make_record(3, "w-b", {moe_input_site(0): {"layer": 0, "multiplier": 2.0}}, {}))
    with pytest.raises(QuantizerRecordError, match="writers recorded multipliers"):
        qz.global_scales(str(tmp_path / "s"), 3)
    with pytest.raises(QuantizerRecordError, match="no quantizer record of policy version 4"):
        qz.global_scales(store, 4)


# ---- session ------------------------------------------------------------------------------------------------------
W = 16


def _store(tmp_path, name="s"):
    return ts.create_store(str(tmp_path / name), [ts.Site(moe_input_site(0), W)], moe_layers=["model.layers.0.mlp"],
                           top_k=2, num_experts=4)


def _request(rid="r-s00", prompt=(1, 2, 3), out=(4, 5, 6, 7), spans=(("default", 0, 4),), mult=0.5, reason="stop"):
    n = len(prompt) + len(out) - 1
    rng = np.random.default_rng(len(rid))
    rows = CapturedRows({moe_input_site(0): rng.integers(0, 256, (n, W // 8), dtype=np.uint8)},
                        {moe_input_site(0): rng.integers(1, 126, (n, W // 16), dtype=np.uint8)},
                        {moe_input_site(0): np.full(n, mult, np.float32)}, np.ones(n, bool))
    experts = rng.integers(0, 4, (n, 1, 2))
    return FinishedRequest(rid, list(prompt), list(out), [-0.5] * len(out), reason, list(spans), rows, experts)


def test_weight_version_spans_become_records_of_their_policy_version(tmp_path):
    store = _store(tmp_path)
    s = RecordingSession(SGLangConfig(store=store.url, default_version=2), store, "w0", quantizer={})
    fr = _request(spans=[("default", 0, 1), ("7", 1, 3), ("8", 3, 4)])
    assert s.finish(fr)
    s.close()
    r = ts.open_store(store.url).reader()
    got = r.read("r-s00")
    np.testing.assert_array_equal(got.policy_version, [2, 2, 2, 2, 7, 7, 8])  # prompt with the first span
    assert [qz.global_scales(store.url, v) for v in (2, 7)] == [{moe_input_site(0): 2.0}] * 2
    assert qz.global_scales(store.url, 8) == {}  # its only token is the never-forwarded last one: no codes
    with pytest.raises(SGLangPluginError, match="not a policy version"):
        s.policy_version("v1-rc")
    assert group_of("r-s00", None) == "r" and group_of("x", {"tracerl_group_id": "g"}) == "g"


def test_restart_rerunning_requests_duplicates_nothing_and_bad_requests_are_dropped_loudly(tmp_path, caplog):
    store = _store(tmp_path)
    cfg = SGLangConfig(store=store.url, results="none")
    first = RecordingSession(cfg, store, "w0", quantizer={})
    assert first.finish(_request())
    first.close()
    second = RecordingSession(cfg, ts.open_store(store.url), "w0", quantizer={})  # the restarted server re-runs it
    assert second.finish(_request())
    bad = _request(rid="r-s01")
    bad.rows.valid[2] = False
    assert not second.finish(bad)
    assert not second.finish(_request(rid="r-s02", mult=0.25, spans=[("default", 0, 4)]))  # version 0: 2nd rule
    assert not second.finish(_request(rid="r-s03", reason="abort"))
    second.close()
    assert second.stats["dropped"] == 2 and second.stats["aborted"] == 1
    assert "positions [2] were not captured" in caplog.text and "two rules" in caplog.text
    reader = ts.open_store(store.url).reader()
    assert reader.trajectories_table().num_rows == 1 and len(reader.read("r-s00")) == 7
    items = list(ts.open_store(store.url).stream(cursor=None, timeout_s=0))
    assert [(i.traj_id, i.token_start, i.token_stop) for i in items] == [("r-s00", 0, 7)]  # once
