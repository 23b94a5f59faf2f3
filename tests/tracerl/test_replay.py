"""Replay (`tracerl replay`): a short live run re-run from its first checkpoint and the pinned store is bitwise
equal (loss, grad norm, weight digest at every step), in another process; a log that disagrees is reported at
its first divergent step with exit 1; a missing or corrupt checkpoint is a one-line error (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import loop
from tracerl.rollout import RolloutWorker, run_rollout
from tracerl.runlog import MetricsLog
from tracerl.train import run_training, start_or_resume

STEPS = 4


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    d = tmp_path_factory.mktemp("live")
    store = loop.create(str(d / "store"))
    log = MetricsLog(d / "train.jsonl")
    cfg = loop.train_cfg(max_staleness=1)
    trainer, follower = start_or_resume(store, cfg, checkpoints=str(d / "ckpt"), weights_url=store.url, metrics=log)
    with RolloutWorker(store, loop.rollout_cfg(record_codes=True)) as worker:
        for _ in range(STEPS):  # the loop in lockstep: generate with the newest version, train one step on it
            run_rollout(worker, metrics=MetricsLog(None), max_batches=1)
            run_training(trainer, follower, checkpoints=str(d / "ckpt"), weights_url=store.url, metrics=log,
                         max_steps=trainer.step_num + 1)
    return d


def _replay(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracerl.cli", "replay", *args, "--json"], env=loop.env(),
                          capture_output=True, text=True, timeout=300)


def test_replay_is_bitwise_equal(live):
    p = _replay(str(live / "store"), "--from", str(live / "ckpt"))
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert (r["bitwise_equal"], r["steps"], r["first_divergence"], r["from_step"]) == (True, STEPS, None, 0)
    assert all(row["traj_ids_equal"] for row in r["rows"])
    # from a later checkpoint: the remaining steps
    p = _replay(str(live / "store"), "--from", str(live / "ckpt"), "--step", "2")
    assert p.returncode == 0 and json.loads(p.stdout)["steps"] == STEPS - 2


def test_replay_reports_the_first_divergence(live, tmp_path):
    steps = MetricsLog(live / "train.jsonl").records()
    steps[2]["grad_norm"] = steps[2]["grad_norm"] * (1 + 2**-20)  # what a nondeterministic kernel would do
    steps[3]["digest"] = "0" * 32
    bad = tmp_path / "bad.jsonl"
    bad.write_text("".join(json.dumps(m) + "\n" for m in steps))
    p = _replay(str(live / "store"), "--from", str(live / "ckpt"), "--log", str(bad))
    assert p.returncode == 1, p.stderr[-3000:]
    r = json.loads(p.stdout)
    assert r["bitwise_equal"] is False and r["steps"] == STEPS
    assert r["first_divergence"]["step"] == 3 and r["first_divergence"]["field"] == "grad_norm"
    assert [row["equal"] for row in r["rows"]] == [True, True, False, False]


def test_replay_of_a_missing_or_corrupt_checkpoint_is_a_typed_error(live, tmp_path):
    p = _replay(str(live / "store"), "--from", str(tmp_path / "nothing"))
    assert p.returncode == 2 and "CheckpointNotFoundError" in p.stderr and p.stderr.count("\n") == 1
