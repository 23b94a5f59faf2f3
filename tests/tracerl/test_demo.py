"""`tracerl demo --json` on a tiny configuration: the output schema and the store it keeps."""

import json

import pytest

import tracestore as ts
from tracerl.cli import main
from tracerl.demo import METRIC_KEYS, REPORT_MODES


def test_demo_json_schema_and_kept_store(tmp_path, capsys):
    url = str(tmp_path / "store")
    rc = main(["demo", "--json", "--trajectories", "2", "--tokens", "24", "--store", url, "--threads", "2",
               "--hidden", "64", "--layers", "4", "--experts", "4", "--vocab", "128", "--backward"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["modes"]) == set(REPORT_MODES)
    for mode, m in out["modes"].items():
        assert set(METRIC_KEYS) <= set(m)
        assert m["mean_abs_dlogp"] >= 0 and m["k3"] >= -1e-9
        assert 0 <= m["router_flip_rate"] <= 1
        if mode in ("floor", "bf16"):
            assert m["code_agreement"] is None and m["scale_agreement"] is None
        else:
            assert 0 < m["code_agreement"] <= 1 and 0 < m["scale_agreement"] <= 1
    assert out["modes"]["fp4_rne_rollout_scales"]["scale_agreement"] == 1.0
    assert out["rollout"]["trajectories"] == 2 and out["rollout"]["response_tokens"] == 2 * 8
    assert len(out["config"]["hinted_sites"]) == 2  # MoE input of the latter 2 of 4 layers
    store = ts.open_store(url)
    assert set(store.model["global_scales"]) == set(out["config"]["fp4_sites"])
    infos = store.reader().trajectories()
    assert len(infos) == 2 and all(16 <= i.num_tokens <= 24 for i in infos)  # prompts of 8..16 + 8


def test_demo_help_and_bad_args(capsys):
    with pytest.raises(SystemExit) as e:
        main(["demo", "--help"])
    assert e.value.code == 0
    assert "--hint-layers" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["demo", "--model", "llama"])


def test_demo_routing_replay_and_decode_paths(capsys, tmp_path):
    """--replay-routes: the trainer replays the stored routes (the floor row the floor run's); --decode hf and the
    default static path both run and report their path."""
    common = ["demo", "--json", "--trajectories", "2", "--tokens", "24", "--threads", "2", "--hidden", "64",
              "--layers", "4", "--experts", "4", "--vocab", "128"]
    assert main([*common, "--replay-routes"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["config"]["replay_routes"] is True and "floor" in rep["trainer_seconds"]
    assert rep["rollout"]["decode_path"] == "static"
    assert rep["modes"]["fp4_hints"]["code_agreement"] >= 0.99
    assert main([*common, "--decode", "hf"]) == 0
    hf = json.loads(capsys.readouterr().out)
    assert hf["rollout"]["decode_path"] == "hf" and "floor" not in hf["trainer_seconds"]
    url = tmp_path / "never"
    assert main([*common, "--decode", "graph", "--store", str(url)]) == 2  # CPU: a clear error, no traceback
    assert "CUDA" in capsys.readouterr().err and not url.exists()  # and no half-made store
    for bad in ("gpu0", "meta"):
        assert main([*common, "--device", bad, "--store", str(url)]) == 2
        assert "device" in capsys.readouterr().err and not url.exists()
    assert main([*common, "--tokens", "16", "--store", str(url)]) == 2  # prompts take up to 16 tokens
    assert "no room for a response" in capsys.readouterr().err and not url.exists()


def test_demo_with_scale_hints_stores_fewer_bytes_and_keeps_the_fidelity(tmp_path, capsys):
    """--scale-encoding lsb: the store keeps one LSB per block (format 4), the trainer rebuilds the rollout's bytes
    from its own activations; its scale agreement (against the bytes the rollout used, kept with its codes) and code
    agreement stay those of the same rollout stored with bytes, at fewer bytes per token."""
    common = ["demo", "--json", "--trajectories", "2", "--tokens", "24", "--threads", "2", "--hidden", "64",
              "--layers", "4", "--experts", "4", "--vocab", "128"]
    out = {}
    for enc in ("bytes", "lsb"):
        url = str(tmp_path / enc)
        assert main([*common, "--store", url, "--scale-encoding", enc]) == 0
        out[enc] = json.loads(capsys.readouterr().out)
        store = ts.open_store(url)
        assert {site.scale_encoding for site in store.sites.values()} == {enc}
        assert store.format_version == (4 if enc == "lsb" else 3)
    b, lsb = out["bytes"], out["lsb"]
    assert lsb["rollout"]["hint_bytes_per_token"] < b["rollout"]["hint_bytes_per_token"]
    assert lsb["rollout"]["scale_encoding"] == "lsb" and lsb["config"]["scale_encoding"] == "lsb"
    for mode in ("fp4_hints", "fp4_rne_rollout_scales"):
        assert lsb["modes"][mode]["scale_agreement"] >= 0.99
        assert abs(lsb["modes"][mode]["code_agreement"] - b["modes"][mode]["code_agreement"]) <= 0.01
    assert b["modes"]["fp4_rne_rollout_scales"]["scale_agreement"] == 1.0  # bytes: the rollout's, as stored
    with pytest.raises(SystemExit):
        main([*common, "--scale-encoding", "bits"])
