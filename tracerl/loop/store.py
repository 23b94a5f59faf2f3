"""Create the store of a closed RL loop: the random-init model built once, its FP4 sites planned, the static
per-site global scales calibrated on the task's prompts (one bf16 prefill of the rollout engine), and all of it
written as the store's model metadata, which every loop process builds its policy from
(`tracerl.policy.build_policy`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

import tracestore as ts
from tracerl.errors import ConfigError
from tracerl.policy import (
    Task,
    TinyMoESpec,
    build_model,
    install_fp4,
    model_metadata,
    moe_blocks,
    plan_sites,
    site_widths,
)
from tracerl.rollout import RolloutEngine

__all__ = ["create_loop_store"]


def create_loop_store(url: str, spec: TinyMoESpec, task: Task, *, seed: int = 0, fp4: str = "experts",
                      hint_layers: str = "latter-half", hint_sites: str = "moe-input", calibration_prompts: int = 64,
                      storage_options: Mapping | None = None, backend: str = "auto",
                      device: str | torch.device = "cpu", scale_encoding: str = "bytes",
                      margin: tuple[float, float, str] | None = None, margin_coding: str = "gamma:bitmap") -> ts.Store:
    """Create the store of a loop at ``url``; returns it open.

    ``margin``: (value margin, scale margin, scale payload "byte" | "lsb") keeps every hinted site as
    margin-exception rows (tracestore hint encoding ``margin``, format 5; `tracerl.hints.compact.store_site`) in
    ``margin_coding`` ("<value coding>:<block coding>", e.g. "gamma:bitmap"; "bitmap" blocks when left out) instead
    of hint bits and scale bytes; a rollout worker then records them with margin capture on and the trainer
    reconstructs them.

    The model vocabulary must hold the task's ids (``spec.vocab_size >= task.vocab_size``). Global scales come
    from one bf16 prefill of ``calibration_prompts`` task prompts (seeded by ``seed``) on ``device`` (a large
    model initializes and calibrates in seconds on a GPU; its memory is released before returning).

    Raises:
        ConfigError: a vocabulary too small for the task, a bad site plan.
        tracestore.DeclarationError: a ``margin`` or ``margin_coding`` the sites cannot take (unknown coding,
        block-bitmap over a row that is no multiple of 16 positions, a negative margin).
        tracestore.StoreExistsError: a store exists at ``url``. tracestore.BackendError: storage failure.
    """
    if spec.vocab_size < task.vocab_size:
        raise ConfigError(f"model vocabulary {spec.vocab_size} < the task's {task.vocab_size} ids")
    model = build_model(spec, seed=seed, device=device)
    plan = plan_sites(model, fp4=fp4, hint_layers=hint_layers, hint_sites=hint_sites)
    # the sites declared first: a declaration they cannot take fails before the calibration's prefill
    if margin is not None:
        from tracerl.hints import compact

        values, _, blocks = margin_coding.partition(":")
        coding = compact.SiteCoding(values, blocks or "bitmap")
        sites = [compact.store_site(n, w, coding, margin[0], margin[1], margin[2])
                 for n, w in site_widths(plan).items()]
    else:
        sites = [ts.Site(n, w, scale_encoding=scale_encoding) for n, w in site_widths(plan).items()]
    runtime = install_fp4(model, plan, backend=backend)
    scales = RolloutEngine(model, runtime).calibrate(task.prompts(calibration_prompts, seed=seed + 7919))
    meta = {**model_metadata(spec, seed), "fp4": fp4, "site_plan": plan.to_json(), "global_scales": scales,
            "task": task.config()}
    layers = [name for _, name, _ in moe_blocks(model)]
    del model, runtime
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()  # the rollout and trainer processes need this GPU's memory
    return ts.create_store(url, sites, model=meta,
                           moe_layers=layers, top_k=spec.top_k, num_experts=spec.num_experts,
                           storage_options=storage_options)
