"""Helpers for the closed-loop tests: a tiny loop store, rollout batches into it, trainer configs, CLI runs."""

from __future__ import annotations

import os
import subprocess
import sys

from tracerl.config import RolloutConfig, TrainConfig
from tracerl.policy import TinyMoESpec
from tracerl.policy import make_task

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: the task of every loop test: emit symbols of the prompt (3 of 8), 8 response tokens
TASK = {"name": "target-set", "alphabet": 8, "prompt_len": 3, "response_len": 8}
#: hidden 64, 2 layers, 8 experts top-2, vocabulary = the task's 10 ids
SPEC = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8, top_k=2,
            moe_intermediate_size=32)
G = 4  # group size of the tests


def create(url: str, storage_options=None, hint_layers: str = "all", scale_encoding: str = "bytes"):
    """A loop store for the tiny model and task (every layer's MoE input hinted)."""
    from tracerl.loop import create_loop_store

    task = make_task(**TASK)
    return create_loop_store(url, TinyMoESpec(**SPEC, vocab_size=task.vocab_size), task, hint_layers=hint_layers,
                             calibration_prompts=16, storage_options=storage_options, scale_encoding=scale_encoding)


def train_cfg(**kw) -> TrainConfig:
    base = dict(groups_per_step=2, group_size=G, micro_batch_tokens=64, lr=1e-3)
    return TrainConfig(**{**base, **kw})


def rollout_cfg(**kw) -> RolloutConfig:
    return RolloutConfig(**{**dict(groups_per_batch=2, group_size=G), **kw})


def env() -> dict:
    """The environment of a child ``tracerl`` process: this checkout first on the path, one torch thread."""
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), e.get("PYTHONPATH", "")])
    e["OMP_NUM_THREADS"] = "1"
    return e


def tracerl(*args: str, **kw) -> subprocess.Popen:
    """``tracerl ARGS`` as a child process (stdout and stderr piped)."""
    return subprocess.Popen([sys.executable, "-m", "tracerl.cli", *args], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def worker(store, **kw):
    """A `RolloutWorker` on ``store`` (a fresh handle) with `rollout_cfg` settings; use it in a ``with`` block (it
    runs a weight-prefetch thread until closed)."""
    import tracestore as ts
    from tracerl.rollout import RolloutWorker

    return RolloutWorker(ts.open_store(store.url), rollout_cfg(**kw))


def train_one_version_ahead(trainer, follower, store, checkpoints, log, steps: int, *, after_step=None,
                            **rollout_kw) -> None:
    """The rollout one version ahead of the trainer, in this process: two batches by version 0, then ``steps`` times
    one training step (`run_training`, weights published to the store) and one batch by the policy it published, so
    that every step after the first trains the previous version's groups. ``after_step()`` is called after each
    training step; ``rollout_kw``: more `rollout_cfg` settings (``max_ahead`` is 2)."""
    from tracerl.rollout import RolloutWorker, run_rollout
    from tracerl.runlog import MetricsLog
    from tracerl.train import run_training

    with RolloutWorker(store, rollout_cfg(max_ahead=2, **rollout_kw)) as worker:
        run_rollout(worker, metrics=MetricsLog(None), max_batches=2)  # v0, v0
        for _ in range(steps):
            run_training(trainer, follower, checkpoints=str(checkpoints), weights_url=store.url, metrics=log,
                         max_steps=trainer.step_num + 1)
            if after_step is not None:
                after_step()
            run_rollout(worker, metrics=MetricsLog(None), max_batches=1)
