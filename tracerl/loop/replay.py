"""Replay training from the archive: a checkpoint, a pinned snapshot of the store, and the live run's log.

`replay` loads checkpoint k (model, optimizer, RNG, follower state with its store cursor), pins the store at its
current log head (a `tracestore.Snapshot`: nothing committed later is read), and re-runs the training steps
k+1, k+2, ... in memory (nothing is written: no checkpoint, no metrics, no weights), taking the same groups in
the same order as the live run did (batching depends only on the log order). After each step it compares the
loss, the gradient norm before clipping and the `param_digest` of the fp32 master weights with what the live run
logged for that step; a bitwise replay matches all three exactly at every step.

Bitwise equality needs deterministic kernels end to end in both runs (the trainer's default,
`tracerl.train.set_deterministic`: torch's deterministic algorithms, on CUDA the math attention and a fixed cuBLAS
workspace; the grouped MoE path sums each token's expert slots in a fixed order) and the same device type and
number of CPU threads (recorded in the checkpoint; the replay uses the recorded thread count).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import tracestore as ts
from tracerl.artifacts import checkpoints as ckpt
from tracerl.config import TrainConfig
from tracerl.errors import CheckpointNotFoundError, ConfigError
from tracerl.train import GRPOTrainer, any_rank, gather_objects

log = logging.getLogger(__name__)

__all__ = ["replay", "COMPARED"]

#: what a replayed step must reproduce exactly, as the live run logged it
COMPARED = ("loss", "grad_norm", "digest")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def replay(store: ts.Store, checkpoints: str, live: Sequence[Mapping[str, Any]], *, step: int | None = None,
           max_steps: int | None = None, device: str | torch.device = "cpu",
           storage_options: Mapping | None = None,
           on_step: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Re-run training from checkpoint ``step`` (None: the earliest kept) and compare with ``live`` (the live run's
    metrics records, one per step).

    Steps replayed: every logged step after the checkpoint, up to ``max_steps`` of them, as long as the pinned
    snapshot holds their groups.

    Returns ``{"bitwise_equal": bool, "steps": n, "first_divergence": None | {"step", "field", "live",
    "replay"}, "from_step": k, "snapshot_log_end": ..., "rows": [{"step", "loss", "grad_norm", "digest",
    "equal"}]}``; ``bitwise_equal`` is true only when at least one step was replayed and every compared value of
    every step matched.

    Under torch.distributed (``torchrun``) every rank calls it and the trainer is sharded as the live one was: a
    replay is bitwise at the live run's world size (another world size adds its gradients in another order).

    Raises CheckpointNotFoundError / CheckpointCorruptError for the checkpoint, ConfigError when it belongs to
    another store or ``live`` has no step after it.
    """
    if step is None:
        steps = ckpt.list_steps(checkpoints, storage_options=storage_options)
        if not steps:
            raise CheckpointNotFoundError(f"{checkpoints}: holds no checkpoint")
        step = steps[0]
    c = ckpt.load(checkpoints, step, storage_options=storage_options)
    by_step = {int(m["step"]): m for m in live if int(m["step"]) > c.step}
    if not by_step:
        raise ConfigError(f"the live log has no step after checkpoint {c.step} to compare with")
    runtime = c.state.get("runtime") or {}
    if runtime.get("threads"):
        torch.set_num_threads(int(runtime["threads"]))
    if runtime.get("device") and runtime["device"] != torch.device(device).type:
        log.warning("the live run trained on %s, the replay runs on %s: expect differences", runtime["device"],
                    torch.device(device).type)
    snapshot = gather_objects(store.snapshot())[0]  # pinned: what the archive holds now (rank 0's, on every rank)
    cfg = TrainConfig.from_json(c.state["config"])
    trainer = GRPOTrainer(store, cfg, device=device)
    follower = trainer.restore(c, log_end=snapshot.log_end)
    rows: list[dict] = []
    first = None
    last = max(by_step) if max_steps is None else min(max(by_step), c.step + max_steps)
    while trainer.step_num < last:
        taken = follower.take(cfg.groups_per_step, version=trainer.version, max_staleness=cfg.max_staleness,
                              timeout_s=0)
        if any_rank(taken is None):
            log.warning("the pinned snapshot (log end %d) has no groups for step %d", snapshot.log_end,
                        trainer.step_num + 1)
            break
        m = trainer.step(taken)
        ref = by_step.get(m["step"])
        if ref is None:
            break
        diffs = [k for k in COMPARED if not _same(m.get(k), ref.get(k))]
        if diffs and first is None:
            first = {"step": m["step"], "field": diffs[0], "live": ref.get(diffs[0]), "replay": m.get(diffs[0])}
        row = {"step": m["step"], **{k: m.get(k) for k in COMPARED}, "equal": not diffs,
               "traj_ids_equal": m["traj_ids"] == ref.get("traj_ids")}
        rows.append(row)
        if on_step is not None:
            on_step(row)
    return {"bitwise_equal": bool(rows) and first is None, "steps": len(rows), "first_divergence": first,
            "from_step": c.step, "snapshot_log_end": snapshot.log_end, "rows": rows}
