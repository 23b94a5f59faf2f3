"""The policy both ends of a closed RL loop build from one description in the store's model metadata: the same
model, FP4 runtime, site plan and task in the rollout worker and in the trainer.

The description (written by `tracerl.loop.create_loop_store` into the manifest's ``model`` entry)::

    {"builder": "tracerl.models.build_model", "seed": 0, "spec": {...TinyMoESpec...}, "fp4": "experts",
     "site_plan": {...SitePlan.to_json()...}, "global_scales": {site: g}, "task": {...Task.config()...}}

The trainer (`tracerl.train`) and the rollout worker (`tracerl.rollout`) call `build_policy` on that entry: the
same architecture, site plan and global scales, so the rollout's recorded scales and hints line up with the
trainer's sites. The weights themselves travel as published policy versions (`tracerl.artifacts.weights`);
version 0 is the seeded random init, published by the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from tracerl.errors import ConfigError
from tracerl.policy.models import TinyMoESpec, build_model, moe_blocks
from tracerl.policy.runtime import FP4Runtime, install_fp4
from tracerl.policy.sites import BLOCK, SitePlan
from tracerl.policy.tasks import Task, make_task

__all__ = ["NO_SITE", "Policy", "build_policy", "site_widths"]

#: the placeholder site of a store whose plan hints nothing (a store declares at least one site)
NO_SITE = "none"


def site_widths(plan: SitePlan) -> dict[str, int]:
    """{hinted site: width}: the sites a loop store declares (a plan without hints records one placeholder)."""
    return {s.name: s.width for s in plan.hinted_specs()} or {NO_SITE: BLOCK}


@dataclasses.dataclass
class Policy:
    """A model built from a loop store's metadata: the bf16 model with its FP4 runtime, the plan and the task."""

    model: torch.nn.Module
    runtime: FP4Runtime
    plan: SitePlan
    spec: TinyMoESpec
    task: Task
    meta: dict[str, Any]

    @property
    def hinted_sites(self) -> list[str]:
        return list(self.plan.hinted)

    @property
    def moe_layers(self) -> list[str]:
        return [name for _, name, _ in moe_blocks(self.model)]


def build_policy(meta: Mapping[str, Any], device: str | torch.device = "cpu", *, backend: str = "auto") -> Policy:
    """The policy that a loop store's ``model`` metadata describes, on ``device`` (seeded random-init weights:
    load a published version into ``policy.model`` for anything else).

    Raises:
        ConfigError: metadata that `create_loop_store` did not write (missing keys, an unknown task or spec)."""
    missing = [k for k in ("spec", "seed", "site_plan", "global_scales", "task") if k not in meta]
    if missing:
        raise ConfigError(f"store model metadata lacks {missing}: not a loop store (tracerl.loop.create_loop_store)")
    try:
        spec = TinyMoESpec(**meta["spec"])
    except TypeError as e:
        raise ConfigError(f"store model metadata: bad spec {meta['spec']!r:.200}: {e}") from None
    model = build_model(spec, seed=int(meta["seed"]), device=device)
    plan = SitePlan.from_json(meta["site_plan"])
    runtime = install_fp4(model, plan, backend=backend)
    runtime.set_global_scales(meta["global_scales"])
    return Policy(model, runtime, plan, spec, make_task(**meta["task"]), dict(meta))
