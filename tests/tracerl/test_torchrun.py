"""The trainer under ``torchrun`` with 2 gloo ranks on CPU: each rank reads only its data-parallel slice of every
step (disjoint, together the whole batch), gradients are reduce-scattered by FSDP2, and the result matches one rank's."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from helpers import loop
from tracerl.rollout import RolloutWorker, run_rollout
from tracerl.runlog import MetricsLog
from tracerl.train import run_training, start_or_resume

pytestmark = pytest.mark.slow
STEPS = 3


def test_two_gloo_ranks_read_disjoint_slices_and_agree_with_one_rank(tmp_path):
    store = loop.create(str(tmp_path / "store"))
    one = MetricsLog(tmp_path / "one.jsonl")
    trainer, follower = start_or_resume(store, loop.train_cfg(max_staleness=10), checkpoints=str(tmp_path / "ck1"),
                                        weights_url=store.url, metrics=one)
    with RolloutWorker(store, loop.rollout_cfg(max_ahead=STEPS)) as worker:
        run_rollout(worker, metrics=MetricsLog(None), max_batches=STEPS)  # all by version 0, before any training
    run_training(trainer, follower, checkpoints=str(tmp_path / "ck1"), weights_url=None, metrics=one,
                 max_steps=STEPS)
    two = MetricsLog(tmp_path / "two.jsonl")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "tracerl.cli", "train", store.url, "--checkpoints", str(tmp_path / "ck2"), "--metrics", str(two.path),
           "--steps", str(STEPS), "--groups-per-step", "2", "--group-size", str(loop.G), "--micro-batch-tokens", "64",
           "--lr", "1e-3", "--max-staleness", "10", "--no-publish", "--threads", "1", "--wait-timeout", "60"]
    p = subprocess.run(cmd, env=loop.env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for a, b in zip(one.records(), two.records(), strict=True):
        assert b["world_size"] == 2 and a["traj_ids"] == b["traj_ids"]
        r0, r1 = b["rank_traj_ids"]
        assert r0 and r1 and not set(r0) & set(r1) and sorted(r0 + r1) == sorted(b["traj_ids"])
        # the same loss and gradient up to the order of the fp32 sums (the ranks' partial sums, then FSDP2's
        # reduce-scatter)
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-3)
        np.testing.assert_allclose(b["reward_mean"], a["reward_mean"], rtol=0)
