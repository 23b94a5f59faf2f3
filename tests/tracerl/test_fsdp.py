"""The FSDP2 trainer under ``torchrun`` with 2 gloo ranks on CPU, against one unsharded process on the same store:
the same loss, gradient norm and code agreement (to a stated tolerance), parameters, gradients and AdamW state
really sharded, checkpoints resumed bitwise at 2 ranks and resharded into one process, and a rank killed mid-step
that costs no trajectory twice or never."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tracestore as ts
from helpers import loop
from tracerl.artifacts import checkpoints as ckpt
from tracerl.artifacts import weights
from tracerl.policy import build_policy
from tracerl.rollout import RolloutWorker, run_rollout
from tracerl.runlog import MetricsLog
from tracerl.train import run_training, start_or_resume

pytestmark = pytest.mark.slow
STEPS = 3
#: one process and two ranks add the same fp32 gradients in another order (each rank's micro-batches, then the
#: reduce-scatter): the loss of a step agrees to fp32 rounding, the norm of the summed gradient to a few ulps more
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4


def _train_args(store_url: str, ck: Path, log: MetricsLog, steps: int) -> list[str]:
    return ["train", store_url, "--checkpoints", str(ck), "--metrics", str(log.path), "--steps", str(steps),
            "--groups-per-step", "2", "--group-size", str(loop.G), "--micro-batch-tokens", "64", "--lr", "1e-3",
            "--max-staleness", "10", "--no-publish", "--threads", "1", "--wait-timeout", "60"]


def _torchrun(*args: str, nproc: int = 2) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                             str(nproc), "-m", "tracerl.cli", *args], env=loop.env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _run(*args: str, nproc: int = 2) -> None:
    p = _torchrun(*args, nproc=nproc)
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One store with STEPS batches (all by version 0: every later step also measures stale groups, with the kept
    weights swapped into the shards), trained for STEPS steps by one process and by two ranks."""
    d = tmp_path_factory.mktemp("fsdp")
    store = loop.create(str(d / "store"))
    one = MetricsLog(d / "one.jsonl")
    trainer, follower = start_or_resume(store, loop.train_cfg(max_staleness=10), checkpoints=str(d / "ck1"),
                                        weights_url=store.url, metrics=one)
    with RolloutWorker(store, loop.rollout_cfg(max_ahead=STEPS, record_codes=True)) as worker:
        run_rollout(worker, metrics=MetricsLog(None), max_batches=STEPS)
    run_training(trainer, follower, checkpoints=str(d / "ck1"), weights_url=None, metrics=one, max_steps=STEPS)
    two = MetricsLog(d / "two.jsonl")
    _run(*_train_args(store.url, d / "ck2", two, STEPS))
    return d, store, one.records(), two.records()


def test_two_ranks_match_one_process(runs):
    _, _, one, two = runs
    assert len(one) == len(two) == STEPS
    for a, b in zip(one, two):
        assert (a["sharded"], b["sharded"], b["world_size"]) == (False, True, 2)
        assert a["traj_ids"] == b["traj_ids"]
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=LOSS_RTOL)
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=NORM_RTOL)
        for key in ("code_agreement", "mean_abs_dlogp"):
            np.testing.assert_allclose(b["mismatch"][key], a["mismatch"][key], rtol=LOSS_RTOL)
        assert b["mismatch"]["code_values"] == a["mismatch"]["code_values"] > 0


def test_parameters_gradients_and_optimizer_state_are_sharded(runs):
    _, _, one, two = runs
    plain = one[-1]["rank_state_bytes"][0]
    fp32_params = plain["params"] * 4 // 6  # one process holds the bf16 model and the fp32 masters
    ranks = two[-1]["rank_state_bytes"]
    assert len(ranks) == 2
    for r in ranks:  # half of each, give or take the padding of odd first dimensions
        for key, whole in (("params", fp32_params), ("grads", plain["grads"]), ("optim", plain["optim"])):
            assert 0.4 * whole < r[key] < 0.6 * whole, (key, r[key], whole)
    assert sum(r["params"] for r in ranks) >= fp32_params


def test_a_checkpoint_of_two_ranks_resumes_bitwise_at_two(runs, tmp_path):
    d, store, _, two = runs
    ck, log = tmp_path / "ck", MetricsLog(tmp_path / "resumed.jsonl")
    _run(*_train_args(store.url, ck, log, 1))  # a run stopped after step 1 ...
    _run(*_train_args(store.url, ck, log, STEPS))  # ... and resumed from its checkpoint
    got = log.records()
    assert [m["step"] for m in got] == list(range(1, STEPS + 1))
    for a, b in zip(two, got):
        assert (a["loss"], a["grad_norm"], a["digest"], a["traj_ids"]) == (b["loss"], b["grad_norm"], b["digest"],
                                                                           b["traj_ids"])


def test_a_checkpoint_of_two_ranks_reshards_into_one_process(runs, tmp_path):
    d, store, one, two = runs
    ck = tmp_path / "ck"
    shutil.copytree(d / "ck2", ck)
    ckpt.prune(str(ck), 1, keep=(0, STEPS - 1))
    (ck / ckpt.manifest_key(STEPS)).unlink()  # as if the two-rank run had stopped after step STEPS - 1
    assert ckpt.latest_step(str(ck)) == STEPS - 1
    log = MetricsLog(tmp_path / "one.jsonl")
    trainer, follower = start_or_resume(ts.open_store(store.url), loop.train_cfg(max_staleness=10),
                                        checkpoints=str(ck), weights_url=None, metrics=log)
    assert (trainer.step_num, trainer.trainable.sharded) == (STEPS - 1, False)
    assert trainer.digest() == two[STEPS - 2]["digest"]  # the same weights, gathered from two ranks' shards
    run_training(trainer, follower, checkpoints=str(ck), weights_url=None, metrics=log, max_steps=STEPS)
    last = log.records()[-1]
    assert last["step"] == STEPS and last["traj_ids"] == two[-1]["traj_ids"]
    np.testing.assert_allclose(last["loss"], two[-1]["loss"], rtol=LOSS_RTOL)
    np.testing.assert_allclose(last["grad_norm"], two[-1]["grad_norm"], rtol=NORM_RTOL)


def _workers_of(agent: subprocess.Popen) -> list[int]:
    """Pids of torchrun's worker processes (its children)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == agent.pid:
                pids.append(int(proc.name))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_rank_killed_mid_step_costs_no_trajectory_twice_or_never(tmp_path):
    steps = 4
    store = loop.create(str(tmp_path / "store"))
    weights.publish(store.url, 0, build_policy(store.model).model.state_dict())  # what the rollout generates with
    with RolloutWorker(store, loop.rollout_cfg(max_ahead=steps)) as worker:
        run_rollout(worker, metrics=MetricsLog(None), max_batches=steps)
    ck, log = tmp_path / "ck", MetricsLog(tmp_path / "train.jsonl")
    p = _torchrun(*_train_args(store.url, ck, log, steps))
    deadline = time.monotonic() + 240
    while len(log.records()) < 2:  # step 2 is done: step 3 is running
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1][-3000:]
        time.sleep(0.05)
    workers = _workers_of(p)
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGKILL)
    p.communicate(timeout=120)
    assert p.returncode != 0  # torchrun saw its worker die and stopped the other
    killed_at = len(log.records())
    assert killed_at < steps  # the kill interrupted training
    _run(*_train_args(store.url, ck, log, steps))
    trained = [t for m in log.records() for t in m["traj_ids"]]
    assert [m["step"] for m in log.records()] == list(range(1, steps + 1)), killed_at
    assert sorted(trained) == sorted(set(trained)) == sorted(ts.open_store(store.url).reader().complete_traj_ids())


def test_replay_of_two_ranks_at_two_ranks_is_bitwise(runs):
    d, store, _, two = runs
    p = _torchrun("replay", store.url, "--from", str(d / "ck2"), "--json")
    out, err = p.communicate(timeout=300)
    assert p.returncode == 0, err[-3000:]
    r = json.loads(out.strip().splitlines()[-1])
    assert (r["bitwise_equal"], r["steps"], r["from_step"]) == (True, STEPS, 0)
