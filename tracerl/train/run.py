"""The trainer's main loop: follow the store and train, checkpoint, log and publish, step after step; start fresh
or resume from the newest checkpoint.

Order of a step's side effects: optimizer step -> checkpoint commit -> metrics line -> weight publication. On
restart from checkpoint k (`start_or_resume`), a metrics line after k is dropped and a missing one re-appended
from the checkpoint, and a version already published by the killed run is kept.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping

import torch

import tracestore as ts
from tracerl.artifacts import checkpoints as ckpt
from tracerl.config import TrainConfig
from tracerl.errors import CheckpointNotFoundError, ConfigError
from tracerl.runlog import MetricsLog
from tracerl.train.dist import any_rank, barrier
from tracerl.train.follower import Follower
from tracerl.train.grpo import GRPOTrainer

log = logging.getLogger(__name__)

__all__ = ["run_training", "start_or_resume"]

#: run_training's read_next -> where the next step is read ("": not read ahead)
_READ_NEXT = {False: "", "off": "", True: "process", "process": "process", "thread": "thread"}


def run_training(trainer: GRPOTrainer, follower: Follower, *, checkpoints: str, weights_url: str | None,
                 metrics: MetricsLog, max_steps: int | None = None, stop: threading.Event | None = None,
                 wait_timeout_s: float | None = None, storage_options: Mapping | None = None,
                 on_step: Callable[[dict], None] | None = None, read_next: bool | str = "auto") -> int:
    """Follow the store and train until ``max_steps`` steps (counted from 0, so a resumed run stops at the same
    step), ``stop`` is set, or no group became ready for ``wait_timeout_s``; returns the steps taken now.

    Per step: take groups -> `GRPOTrainer.step` -> checkpoint (every ``checkpoint_every`` steps) -> metrics line
    -> publish the new version to ``weights_url`` (when given; in the background, overlapping the next step,
    and waited for before this returns). With ``read_next``, when the next step's groups are ready before a step
    starts (`Follower.peek`), their data is read from the store in the background while the step computes:
    ``"process"`` (or True) in a reader process (`GRPOTrainer.read_next_in`), ``"thread"`` in a thread of this
    process; False (or ``"off"``) reads each step's data when it starts; ``"auto"`` (the default) is
    ``"process"`` for a trainer on a GPU and ``"off"`` on the CPU (where a reader takes cores the step computes
    on). Which groups each step trains on, and the bits it computes, are the same either way. On one H200 (the
    H200 model, 3 runs per mode side by side, trainer-h200-read-shm.json) a reader process took the read (0.13 s)
    off the step: fp4_hints 0.736 -> 0.670 s per step at the default mean, bf16 0.586 -> 0.445 s; a thread competes
    for the GIL with the host-bound step and slowed the fp4_hints compute from 0.36 to 0.54-0.58 s
    (trainer-h200-read-next*.json). Raises ConfigError for another ``read_next``."""
    if read_next == "auto":
        read_next = "process" if trainer.device.type == "cuda" else "off"
    where = _READ_NEXT.get(read_next) if isinstance(read_next, (bool, str)) else None
    if where is None:
        raise ConfigError(f"read_next: got {read_next!r}; allowed: 'auto', False/'off', True/'process', 'thread'")
    if where:
        trainer.read_next_in(where)
    done = 0
    try:
        done = _train_steps(trainer, follower, checkpoints, weights_url, metrics, max_steps, stop, wait_timeout_s,
                            storage_options, on_step, bool(where))
    finally:
        trainer.wait_published()  # the last version is committed before this returns
    return done


def _train_steps(trainer, follower, checkpoints, weights_url, metrics, max_steps, stop, wait_timeout_s,
                 storage_options, on_step, read_next) -> int:
    cfg = trainer.cfg
    done = 0
    while max_steps is None or trainer.step_num < max_steps:
        if any_rank(stop is not None and stop.is_set()):
            break
        ready_since = time.time()
        taken = follower.take(cfg.groups_per_step, version=trainer.version, max_staleness=cfg.max_staleness,
                              stop=stop, timeout_s=wait_timeout_s)
        if any_rank(taken is None):
            break
        # the next step's groups, when they are ready already: their data is read while this step computes
        # (also past max_steps: a caller that goes on with a later run_training call takes them over)
        following = (follower.peek(cfg.groups_per_step, version=trainer.version + 1, max_staleness=cfg.max_staleness)
                     if read_next else None)
        m = trainer.step(taken, ready_since=ready_since, next_groups=following)  # (also the trainer's last_metrics)
        m["follower"] = {"cursor": follower.cursor, "ready_groups": follower.ready, **dict(follower.counts)}
        if cfg.checkpoint_every and trainer.step_num % cfg.checkpoint_every == 0:
            trainer.save(checkpoints, follower, storage_options=storage_options)
        if trainer.rank == 0:
            metrics.append(m)
        if weights_url is not None:
            trainer.publish(weights_url, storage_options=storage_options, wait=False)
        done += 1
        if on_step is not None:
            on_step(m)
    return done


def start_or_resume(store: ts.Store, cfg: TrainConfig, *, checkpoints: str, weights_url: str | None,
                    metrics: MetricsLog, device: str | torch.device = "cpu", cursor: str | None = None,
                    storage_options: Mapping | None = None, backend: str = "auto") -> tuple[GRPOTrainer, Follower]:
    """A trainer and its follower: restored from the newest checkpoint at ``checkpoints`` (its config wins over
    ``cfg``), or fresh (seeded init, following from ``cursor``), with checkpoint 0 committed and version 0
    published. The metrics log is brought in line with the checkpoint (later lines dropped, the checkpoint's own
    step re-appended when missing), and the checkpoint's version published if the killed run had not.

    Raises CheckpointCorruptError for a newest checkpoint that fails its checks (nothing is changed: no older
    checkpoint is silently taken instead)."""
    latest = ckpt.latest_step(checkpoints, storage_options=storage_options)
    barrier()  # every rank has decided before rank 0 writes checkpoint 0 of a fresh run
    if latest is None:
        trainer = GRPOTrainer(store, cfg, device=device, backend=backend)
        trainer.metrics_path = None if metrics.path is None else str(metrics.path.resolve())
        follower = Follower(store, cfg.group_size, cursor=cursor, max_open_groups=cfg.max_open_groups)
        if cfg.checkpoint_every:
            trainer.save(checkpoints, follower, storage_options=storage_options)
        elif any(r.get("step", 0) > 0 for r in metrics.records()):
            raise CheckpointNotFoundError(
                f"no checkpoint at {checkpoints} but the metrics log {metrics.path} has trained steps: a run started "
                "with checkpoint_every=0 cannot resume; start a new run (new metrics log and weights) or checkpoint")
        if trainer.rank == 0:
            metrics.truncate_after(0)
    else:
        c = ckpt.load(checkpoints, latest, storage_options=storage_options)
        saved = TrainConfig.from_json(c.state["config"])
        if saved != cfg:
            diff = {k: (v, getattr(cfg, k)) for k, v in dataclasses.asdict(saved).items() if getattr(cfg, k) != v}
            log.warning("resuming with the checkpoint's config; the given one differs in %s", diff)
        trainer = GRPOTrainer(store, saved, device=device, backend=backend)
        trainer.metrics_path = None if metrics.path is None else str(metrics.path.resolve())
        follower = trainer.restore(c)
        if trainer.rank == 0:
            metrics.truncate_after(trainer.step_num)
            logged = {r.get("step") for r in metrics.records()}
            if trainer.last_metrics is not None and trainer.step_num not in logged:
                metrics.append(trainer.last_metrics)
        log.info("resumed from checkpoint %d (policy version %d)", c.step, trainer.version)
    if weights_url is not None:
        trainer.publish(weights_url, storage_options=storage_options)
    return trainer, follower
