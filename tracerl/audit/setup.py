"""What an audit rebuilds and reads: the rollout's model with two runtimes over the same modules (`Setup`), the
weights each policy version was generated with, and the stored trajectories in their recorded replay batches."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

import tracestore as ts
from tracerl.artifacts import weights as tw
from tracerl.config import AuditConfig
from tracerl.errors import ConfigError
from tracerl.hints.scalehints import use_store_scale_encodings
from tracerl.policy import (
    BUILDER,
    FP4Linear,
    FP4MoEBlock,
    FP4Runtime,
    SitePlan,
    TinyMoESpec,
    build_model,
    install_fp4,
    moe_blocks,
)
from tracerl.train import QATTrainer
from tracerl.util import check_device

#: what an audit needs in a store's model metadata
REQUIRED_METADATA = ("builder", "spec", "seed", "site_plan", "global_scales")


@dataclasses.dataclass
class Setup:
    """The rebuilt model with two runtimes over the same modules: ``train`` (the store's plan: the trainer's
    passes) and ``replay`` (every non-KV FP4 site hinted, so the replayed decode captures every site's codes)."""

    model: torch.nn.Module
    spec: TinyMoESpec
    plan: SitePlan
    train: FP4Runtime
    replay: FP4Runtime
    trainer: QATTrainer
    device: torch.device
    moe_names: dict[int, str]  # MoE layer index -> module name (the store's ``moe_layers``)
    rollout: dict[str, Any]  # the store's ``rollout`` metadata (defaults when absent)
    initial: dict[str, torch.Tensor] | None = None  # host copy of the spec/seed weights (to come back to)
    loaded: int | str | None = None  # which weights the model holds now

    @property
    def observable(self) -> list[str]:
        return [s.name for s in self.plan.sites if s.kind != "kv"]


@contextlib.contextmanager
def bound_runtime(model: torch.nn.Module, runtime: FP4Runtime) -> Iterator[None]:
    """Point every FP4 module of ``model`` at ``runtime`` for the block."""
    mods = [m for m in model.modules() if isinstance(m, (FP4MoEBlock, FP4Linear))]
    prev = [m.runtime for m in mods]
    prev_model = model.fp4_runtime
    try:
        for m in mods:
            m.runtime = runtime
        model.fp4_runtime = runtime
        yield
    finally:
        for m, r in zip(mods, prev):
            m.runtime = r
        model.fp4_runtime = prev_model


def resolve_device(name: str, recorded: str | None) -> torch.device:
    """``auto``: the device type the rollout ran on when this machine has it, else the CPU. Raises `ConfigError`
    for a device this machine cannot use (`tracerl.util.check_device`)."""
    if name == "auto":
        name = "cuda" if recorded == "cuda" and torch.cuda.is_available() else "cpu"
    check_device(name)
    return torch.device(name)


def check_metadata(store: ts.Store, device: str = "auto") -> tuple[TinyMoESpec, SitePlan, dict, torch.device]:
    """What a rebuild needs from ``store.model``, checked before anything is built: (spec, site plan, the
    ``rollout`` metadata with defaults, the audit's device).

    Raises `ConfigError` when the metadata lacks a key, names another builder, hints sites the store does not
    declare or keeps as margin-exception rows, or for a device this machine does not have."""
    meta = store.model
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise ConfigError(f"store {store.url}: its model metadata lacks {missing} (has {sorted(meta)}); the audit "
                          "rebuilds the model from what `tracerl demo --store` records (tracerl.demo._create_store)")
    if meta["builder"] != BUILDER:
        raise ConfigError(f"store {store.url}: model builder {meta['builder']!r}; the audit rebuilds "
                          "tracerl.models.build_model models")
    rollout = {"decode": "auto", "device": "cpu", "temperature": 1.0, "batches": None, **(meta.get("rollout") or {})}
    spec = TinyMoESpec(**meta["spec"])
    plan = SitePlan.from_json(meta["site_plan"])
    foreign = sorted(set(plan.hinted) - set(store.sites))
    if foreign:
        raise ConfigError(f"store {store.url}: the site plan hints {foreign[:4]}, which the store does not declare")
    margin = sorted(h for h in plan.hinted if getattr(store.sites[h], "hint_encoding", "bits") == "margin")
    if margin:  # the passes compare against and substitute stored hint bits and scale bytes, row for row
        raise ConfigError(f"store {store.url}: hinted sites {margin[:4]} keep margin-exception rows (hint encoding "
                          "margin, format 5); the audit needs stored hints and scales at every hinted site (train on "
                          "such a store with tracerl's trainer or tracerl.hints.patch_model)")
    return spec, plan, rollout, resolve_device(device, rollout.get("device"))


def load_setup(store: ts.Store, cfg: AuditConfig) -> Setup:
    """Rebuild the rollout's model, site plan and global scales from ``store.model`` (`check_metadata`).

    Raises `ConfigError` as `check_metadata` does, and for a ``cfg.model`` checkpoint that does not fit."""
    spec, plan, rollout, device = check_metadata(store, cfg.device)
    meta = store.model
    model = build_model(spec, seed=int(meta["seed"]), device=device)
    train = install_fp4(model, plan, backend=cfg.backend)
    train.set_global_scales(meta["global_scales"])
    use_store_scale_encodings(train, store)  # scale hints at the store's lsb sites (FORMAT §2.4)
    replay_plan = dataclasses.replace(plan, hinted=tuple(s.name for s in plan.sites if s.kind != "kv"))
    replay = FP4Runtime(replay_plan, meta["global_scales"], backend=cfg.backend)
    setup = Setup(model, spec, plan, train, replay, QATTrainer(model, train), device,
                   {i: n for i, n, _ in moe_blocks(model)}, rollout)
    if cfg.model is not None:
        load_checkpoint(model, cfg.model)
        setup.loaded = "checkpoint"
    return setup


def load_checkpoint(model: torch.nn.Module, path: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        model.load_state_dict(load_file(path), strict=True)
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"--model {path}: cannot read a safetensors checkpoint ({e})") from None
    except RuntimeError as e:  # torch names the missing and unexpected keys and the shape mismatches
        raise ConfigError(f"--model {path} does not fit the store's model: {' '.join(str(e).split())[:400]}") from None


def use_weights(s: Setup, url: str, version: int, published: set[int], storage_options: dict | None) -> str:
    """Load the weights of policy ``version`` into the model: published beside the store (`tracerl.artifacts.weights`),
    else the spec/seed initial weights (policy version 0 of a fresh run); a ``--model`` checkpoint is kept for
    every version. Returns the source: ``checkpoint``, ``published`` or ``initial``."""
    if s.loaded == "checkpoint":
        return "checkpoint"
    want = version if version in published else "initial"
    if s.loaded != want and not (s.loaded is None and want == "initial"):
        if s.initial is None:  # first switch away from the initial weights: keep them to come back to
            s.initial = {k: v.detach().cpu().clone() for k, v in s.model.state_dict().items()}
        if want == "initial":
            s.model.load_state_dict(s.initial, strict=True)
        else:
            tw.load(url, version, s.model, storage_options=storage_options)
    s.loaded = want
    return "initial" if want == "initial" else "published"


@dataclasses.dataclass
class StoredTrajectory:
    traj_id: str
    index: int  # position in the audit's trajectory list
    num_tokens: int
    prompt: list[int]
    response: np.ndarray  # int64 [G]
    logprobs: np.ndarray  # float32 [G], as stored
    experts: dict[str, np.ndarray]  # MoE layer name -> uint8 [N, top_k], as stored
    version: int
    data_ok: bool = True  # every stored byte of it readable (else: replayed for its batch, not measured)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def read_trajectories(reader: ts.Reader, cfg: AuditConfig, check_data: bool,
                       sites: Sequence[str]) -> tuple[list[StoredTrajectory], list[dict]]:
    """Every audited trajectory's tokens, stored log-probs and routes (trace reads). With ``check_data`` (the
    integrity check found problems) each trajectory is also read whole, and one that fails is kept for the
    replay (its batch) but not measured. Unreadable traces and trajectories without response tokens are
    skipped; returns (trajectories, skipped ``[{traj_id, reason}]``)."""
    infos = reader.trajectories()
    if cfg.max_trajectories is not None:
        infos = infos[: cfg.max_trajectories]
    out, skipped = [], []
    for info in infos:
        try:
            b = reader.read(info.traj_id, 0, info.num_tokens, sites=[], fmt="numpy")
        except (ts.IntegrityError, ts.HintNotFoundError) as e:
            skipped.append({"traj_id": info.traj_id, "reason": f"{type(e).__name__}: {e}"})
            continue
        lp = np.asarray(b.logprobs, dtype=np.float32)
        resp = np.flatnonzero(~np.isnan(lp))
        if resp.size == 0:
            skipped.append({"traj_id": info.traj_id, "reason": "no response tokens (every log-prob is NaN)"})
            continue
        p = int(resp[0])
        tok = np.asarray(b.token_ids, dtype=np.int64)
        t = StoredTrajectory(info.traj_id, len(out), info.num_tokens, tok[:p].tolist(), tok[p:], lp[p:],
                  {k: np.asarray(v) for k, v in b.experts.items()}, int(np.asarray(b.policy_version)[p]))
        if check_data:
            try:
                reader.read(info.traj_id, 0, info.num_tokens, sites=list(sites), fmt="numpy")
            except ts.IntegrityError as e:
                t.data_ok = False
                skipped.append({"traj_id": info.traj_id, "reason": f"IntegrityError: {e}"})
        out.append(t)
    return out, skipped


def replay_chunks(trajs: list[StoredTrajectory], batches: Sequence[Sequence[str]] | None) -> list[list[StoredTrajectory]]:
    """Replay batches: the recorded rollout batches (restricted to the audited trajectories and split by
    policy version), then the rest by policy version. The replay reproduces the rollout bit for bit only with
    the rollout's batches."""
    by_id = {t.traj_id: t for t in trajs}
    out, used = [], set()
    for batch in batches or []:
        members = [by_id[r] for r in batch if r in by_id and r not in used]
        for v in sorted({t.version for t in members}):
            out.append([t for t in members if t.version == v])
        used.update(t.traj_id for t in members)
    rest = [t for t in trajs if t.traj_id not in used]
    for v in sorted({t.version for t in rest}):
        out.append([t for t in rest if t.version == v])
    return [c for c in out if c]
