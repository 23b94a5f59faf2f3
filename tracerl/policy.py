"""The policy of a closed RL loop: one description in the store's model metadata that every process builds the
same model, FP4 runtime and task from.

`create_loop_store` builds the random-init model once, plans its FP4 sites, calibrates the static per-site
global scales on the task's prompts, and creates the store with all of it in the manifest's ``model`` entry::

    {"builder": "tracerl.models.build_model", "seed": 0, "spec": {...TinyMoESpec...}, "fp4": "experts",
     "site_plan": {...SitePlan.to_json()...}, "global_scales": {site: g}, "task": {...Task.config()...}}

The trainer (`tracerl.train`) and the rollout worker (`tracerl.rollout`) call `build_policy` on that entry: the
same architecture, site plan and global scales, so the rollout's recorded scales and hints line up with the
trainer's sites. The weights themselves travel as published policy versions (`tracerl.weights`); version 0 is
the seeded random init, published by the trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

import tracestore as ts
from tracerl.engine import RolloutEngine
from tracerl.errors import ConfigError
from tracerl.models import TinyMoESpec, build_model, model_metadata, moe_blocks
from tracerl.qat import FP4Runtime, install_fp4
from tracerl.sites import BLOCK, SitePlan, plan_sites
from tracerl.tasks import Task, make_task

#: the placeholder site of a store whose plan hints nothing (a store declares at least one site)
NO_SITE = "none"


def site_widths(plan: SitePlan) -> dict[str, int]:
    """{hinted site: width}: the sites a loop store declares (a plan without hints records one placeholder)."""
    return {s.name: s.width for s in plan.hinted_specs()} or {NO_SITE: BLOCK}


def create_loop_store(url: str, spec: TinyMoESpec, task: Task, *, seed: int = 0, fp4: str = "experts",
                      hint_layers: str = "latter-half", hint_sites: str = "moe-input", calibration_prompts: int = 64,
                      storage_options: Mapping | None = None, backend: str = "auto",
                      device: str | torch.device = "cpu") -> ts.Store:
    """Create the store of a loop at ``url``; returns it open.

    The model vocabulary must hold the task's ids (``spec.vocab_size >= task.vocab_size``). Global scales come
    from one bf16 prefill of ``calibration_prompts`` task prompts (seeded by ``seed``) on ``device`` (a large
    model initializes and calibrates in seconds on a GPU; its memory is released before returning).

    Raises:
        ConfigError: a vocabulary too small for the task, a bad site plan.
        tracestore.StoreExistsError: a store exists at ``url``. tracestore.BackendError: storage failure.
    """
    if spec.vocab_size < task.vocab_size:
        raise ConfigError(f"model vocabulary {spec.vocab_size} < the task's {task.vocab_size} ids")
    model = build_model(spec, seed=seed, device=device)
    plan = plan_sites(model, fp4=fp4, hint_layers=hint_layers, hint_sites=hint_sites)
    runtime = install_fp4(model, plan, backend=backend)
    scales = RolloutEngine(model, runtime).calibrate(task.prompts(calibration_prompts, seed=seed + 7919))
    meta = {**model_metadata(spec, seed), "fp4": fp4, "site_plan": plan.to_json(), "global_scales": scales,
            "task": task.config()}
    layers = [name for _, name, _ in moe_blocks(model)]
    del model, runtime
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the rollout and trainer processes need this GPU's memory
    return ts.create_store(url, [ts.Site(n, w) for n, w in site_widths(plan).items()], model=meta,
                           moe_layers=layers, top_k=spec.top_k, num_experts=spec.num_experts,
                           storage_options=storage_options)


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
        raise ConfigError(f"store model metadata lacks {missing}: not a loop store (tracerl.policy.create_loop_store)")
    try:
        spec = TinyMoESpec(**meta["spec"])
    except TypeError as e:
        raise ConfigError(f"store model metadata: bad spec {meta['spec']!r:.200}: {e}") from None
    model = build_model(spec, seed=int(meta["seed"]), device=device)
    plan = SitePlan.from_json(meta["site_plan"])
    runtime = install_fp4(model, plan, backend=backend)
    runtime.set_global_scales(meta["global_scales"])
    return Policy(model, runtime, plan, spec, make_task(**meta["task"]), dict(meta))
