"""``tracerl loop`` end to end on CPU with the tiny model: the processes, the result files, and Ctrl-C stopping both
sides cleanly (the trainer's newest checkpoint is its last logged step, every recorded trajectory is complete)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

import tracestore as ts
from helpers import loop
from tracerl import checkpoint as ckpt
from tracerl.train import MetricsLog

pytestmark = pytest.mark.slow

TINY = ["--hidden", "64", "--layers", "2", "--experts", "8", "--hint-layers", "all", "--groups-per-step", "2",
        "--group-size", str(loop.G), "--micro-batch-tokens", "64", "--lr", "1e-3"]


def _loop(run_dir, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tracerl.cli", "loop", "--dir", str(run_dir), *TINY, *args],
                            env=loop.env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def test_loop_runs_both_sides_and_reports(tmp_path):
    p = _loop(tmp_path / "run", "--steps", "3", "--json")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    result = json.loads(out)
    assert [r["step"] for r in result["steps"]] == [1, 2, 3]
    s = result["summary"]
    assert s["steps"] == 3 and s["lag_trajectories"] == 3 * 2 * loop.G and s["rollout_batches"] >= 3
    for r in result["steps"]:  # max-ahead 1: every step trains the version the trainer had
        assert r["policy_versions"] == [r["version"] - 1] and r["mismatch_tokens"] > 0
        assert 0.99 <= r["mismatch_code_agreement"] <= 1 and r["mismatch_mean_abs_dlogp"] >= 0
    files = {f.name for f in (tmp_path / "run").iterdir()}
    assert {"store", "checkpoints", "train.jsonl", "rollout-0.jsonl", "loop.json", "loop.png"} <= files
    assert json.loads((tmp_path / "run" / "loop.json").read_text())["summary"] == s


def test_ctrl_c_stops_both_sides_cleanly(tmp_path):
    run = tmp_path / "run"
    p = _loop(run, "--steps", "1000")
    log = MetricsLog(run / "train.jsonl")
    deadline = time.monotonic() + 240
    while len(log.records()) < 2:
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 0, err[-3000:]
    assert "stopped early" in out
    steps = log.records()
    assert ckpt.latest_step(str(run / "checkpoints")) == steps[-1]["step"]  # nothing trained is lost
    reader = ts.open_store(str(run / "store")).reader()
    assert all(i.complete for i in reader.trajectories())  # no rollout batch left half-committed
    trained = [t for m in steps for t in m["traj_ids"]]
    assert trained == reader.complete_traj_ids()[: len(trained)]
