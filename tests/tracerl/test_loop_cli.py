"""``tracerl loop`` end to end on CPU with the tiny model: the processes, the result files, and Ctrl-C stopping both
sides cleanly (the trainer's newest checkpoint is its last logged step, every recorded trajectory is complete)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tracestore as ts
from helpers import loop
from tracerl.artifacts import checkpoints as ckpt
from tracerl.runlog import MetricsLog

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
    assert 0 <= s["ready_lag_s_median"] <= s["lag_s_median"]  # queueing behind a busy trainer taken out
    for r in result["steps"]:  # max-ahead 1: every step trains the version the trainer had
        assert r["policy_versions"] == [r["version"] - 1] and r["mismatch_tokens"] > 0
        assert 0.99 <= r["mismatch_code_agreement"] <= 1 and r["mismatch_mean_abs_dlogp"] >= 0
    files = {f.name for f in (tmp_path / "run").iterdir()}
    assert {"store", "checkpoints", "train.jsonl", "rollout-0.jsonl", "loop.json", "loop.png"} <= files
    assert json.loads((tmp_path / "run" / "loop.json").read_text())["summary"] == s


def _wait_for_steps(p, run, n: int, timeout_s: float = 240) -> MetricsLog:
    """The loop's metrics log once it holds ``n`` steps (the loop process ``p`` still running)."""
    log = MetricsLog(run / "train.jsonl")
    deadline = time.monotonic() + timeout_s
    while len(log.records()) < n:
        assert p.poll() is None, p.communicate()[1][-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    return log


def test_ctrl_c_stops_both_sides_cleanly(tmp_path):
    run = tmp_path / "run"
    p = _loop(run, "--steps", "1000")
    log = _wait_for_steps(p, run, 2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=240)
    assert p.returncode == 130, err[-3000:]  # interrupted, as tracerl demo and tracestore report it
    assert "stopped early" in out
    steps = log.records()
    assert ckpt.latest_step(str(run)) == steps[-1]["step"]  # nothing trained is lost
    reader = ts.open_store(str(run / "store")).reader()
    assert all(i.complete for i in reader.trajectories())  # no rollout batch left half-committed
    trained = [t for m in steps for t in m["traj_ids"]]
    assert trained == reader.complete_traj_ids()[: len(trained)]


def _children_of(run_dir) -> list[int]:
    """Pids of the live processes whose command line names ``run_dir`` (the loop's trainer and rollouts)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().split(b"\0")
                state = next(ln for ln in (d / "status").read_text().splitlines() if ln.startswith("State:"))
            except (OSError, StopIteration):
                continue
            if b"tracerl.cli" in cmd and any(str(run_dir).encode() in c for c in cmd) and "zombie" not in state:
                pids.append(int(d.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_stop_when_the_loop_process_is_killed(tmp_path):
    """A loop killed outright (SIGKILL, or a timeout's SIGTERM to a program calling run_loop) leaves no orphan
    trainer or rollout holding a device: both stop at their next boundary with everything committed."""
    run = tmp_path / "run"
    p = _loop(run, "--steps", "1000")
    log = _wait_for_steps(p, run, 1)
    children = _children_of(run / "store")
    assert len(children) == 2, children  # the trainer and one rollout
    p.kill()
    p.communicate(timeout=60)
    deadline = time.monotonic() + 120
    while _children_of(run / "store"):
        assert time.monotonic() < deadline, f"orphans still running: {_children_of(run / 'store')}"
        time.sleep(0.2)
    steps = log.records()
    assert ckpt.latest_step(str(run)) == steps[-1]["step"]  # the trainer stopped cleanly
    reader = ts.open_store(str(run / "store")).reader()
    assert all(i.complete for i in reader.trajectories())


@pytest.mark.parametrize("trainer, rollout, user, expected", [
    ("cuda:0", "cuda:0", None, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ("cuda", "cuda:0", None, {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}),
    ("cuda:1", "cuda:0", None, {}),       # a GPU each: the trainer's allocator is left alone
    ("cpu", "cpu", None, {}),
    ("cuda:0", "cuda:0", "backend:native", {}),  # the user's own setting wins
])
def test_trainer_sharing_a_gpu_gets_expandable_segments(trainer, rollout, user, expected, tmp_path, monkeypatch):
    from tracerl.config import LoopConfig
    from tracerl.loop.processes import LoopProcesses

    if user is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user)
    cfg = LoopConfig(run_dir=str(tmp_path), trainer_device=trainer, rollout_device=rollout)
    assert LoopProcesses(cfg, str(tmp_path / "store")).trainer_env() == expected
