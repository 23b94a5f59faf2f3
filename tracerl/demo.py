"""The end-to-end TRACE fidelity demo: FP4 rollout -> hints in a store -> trainer recompute in every mode.

Steps (`run_demo`):

0. Check the configuration, the model size, the device and the store location; nothing is built before that.
1. Build a tiny random-init MoE model (bf16) and plan its FP4 sites: the routed experts' GEMMs (inputs and
   weights) as in real NVFP4 checkpoints; attention, router and shared expert in bf16. Calibrate a static
   global scale per site from one bf16 prefill of the prompts.
2. FP4 rollout: batched prefill + decode with a KV cache, seeded sampling; the recorder writes hint bits and
   block scales of the hinted sites, sampled tokens, log-probs and routed experts to a tracestore store whose
   model metadata carries the model spec, the site plan and the global scales.
3. Floor run: the same engine's decode path in bf16 with the sampled tokens forced.
4. Trainer: from a fresh handle on the store, pack the trajectories into THD micro-batches, read hints and
   scales, and recompute in each mode (forward; with ``backward=True`` also the straight-through backward).
5. Metrics per mode (`tracerl.fidelity`) over the response tokens: code/scale agreement at hinted sites
   against the rollout's codes, router flip rate per (token, layer), |dlogp| statistics, k3.

The ``floor`` row compares the bf16 decode path with the bf16 trainer: the gap of two numerical paths with no
FP4 at all. FP4-attributable excess of a mode = its mean |dlogp| minus the floor's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

import tracefp4
import tracestore as ts
from tracefp4.constants import HINTS_PER_BYTE
from tracerl import fidelity
from tracerl.config import SCALE_ENCODINGS, DemoConfig
from tracerl.errors import ConfigError
from tracerl.hints import pack_micro_batches, read_packed, use_store_scale_encodings
from tracerl.hints.scalehints import scale_bytes_per_token
from tracerl.policy import (
    BLOCK,
    MODES,
    FP4Runtime,
    SitePlan,
    SiteSpec,
    TinyMoESpec,
    build_model,
    install_fp4,
    model_metadata,
    moe_blocks,
    moe_layer_name,
    plan_sites,
)
from tracerl.rollout import RolloutEngine, RolloutRecorder, RolloutResult
from tracerl.runlog import StepFn, json_ready, machine_info
from tracerl.train import QATTrainer
from tracerl.util import check_device, swapped

REPORT_MODES = ("floor", *MODES)
METRIC_KEYS = ("code_agreement", "scale_agreement", "router_flip_rate", "mean_abs_dlogp", "p99_abs_dlogp",
               "max_abs_dlogp", "k3")


def _prompts(cfg: DemoConfig, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    lo, hi = cfg.prompt_tokens
    lens = torch.randint(lo, hi + 1, (cfg.trajectories,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def _check(cfg: DemoConfig) -> TinyMoESpec:
    """Everything about ``cfg`` that can be checked before a model or a store is built; the model spec."""
    cfg.check()
    check_device(cfg.device)
    return cfg.model_spec()


@contextlib.contextmanager
def _store_url(store: str | None) -> Iterator[str]:
    """``store``, or a store in a temporary directory that is removed afterwards."""
    if store is not None:
        yield store
        return
    with tempfile.TemporaryDirectory(prefix="tracerl-demo-") as tmp:
        yield f"{tmp}/store"


@dataclasses.dataclass
class _Setup:
    """The demo's model with FP4 installed, its calibrated rollout engine and prompts."""

    spec: TinyMoESpec
    plan: SitePlan
    runtime: FP4Runtime
    engine: RolloutEngine
    prompts: list[list[int]]
    global_scales: dict[str, float]
    moe_layers: list[str]

    @property
    def hinted(self) -> list[SiteSpec]:
        return self.plan.hinted_specs()

    @property
    def site_names(self) -> list[str]:
        return list(self.plan.hinted)

    @property
    def site_widths(self) -> dict[str, int]:
        # a store declares at least one site: a hint-free run records a placeholder
        return {s.name: s.width for s in self.hinted} or {"none": BLOCK}


def _setup(cfg: DemoConfig, spec: TinyMoESpec) -> _Setup:
    model = build_model(spec, seed=cfg.seed, device=cfg.device)
    plan = plan_sites(model, fp4=cfg.fp4, hint_layers=cfg.hint_layers, hint_sites=cfg.hint_sites,
                      kv_fp4=cfg.kv_fp4)
    runtime = install_fp4(model, plan, backend=cfg.backend)
    prompts = _prompts(cfg, spec.vocab_size)
    engine = RolloutEngine(model, runtime, keep_codes=True, decode=cfg.decode)
    engine.decode_path(torch.device(cfg.device))  # an unusable --decode fails here, before a store exists
    global_scales = engine.calibrate(prompts)
    return _Setup(spec, plan, runtime, engine, prompts, global_scales, [n for _, n, _ in moe_blocks(model)])


def _create_store(url: str, cfg: DemoConfig, s: _Setup, rids: list[str], scale_encoding: str = "bytes") -> ts.Store:
    # What an audit (tracerl.audit) needs to rebuild the model, the FP4 sites and the rollout's decode: the
    # rollout's batches (request ids in batch order), decode path, device type and sampling temperature.
    rollout = {"engine": "tracerl.engine.RolloutEngine", "decode": s.engine.decode_path(torch.device(cfg.device)),
               "device": torch.device(cfg.device).type, "temperature": 1.0, "batches": [list(rids)]}
    meta = {**model_metadata(s.spec, cfg.seed), "fp4": cfg.fp4, "site_plan": s.plan.to_json(),
            "global_scales": s.global_scales, "rollout": rollout}
    return ts.create_store(url, [ts.Site(n, w, scale_encoding=scale_encoding) for n, w in s.site_widths.items()],
                           model=meta,
                           moe_layers=s.moe_layers, top_k=s.spec.top_k, num_experts=s.spec.num_experts,
                           storage_options=cfg.storage_options)


def _record(cfg: DemoConfig, s: _Setup, store: ts.Store, rids: list[str], on_step: StepFn) -> RolloutResult:
    """The FP4 rollout, recorded into ``store``."""
    max_new = cfg.tokens - cfg.prompt_tokens[1]
    phase = f"FP4 rollout ({len(rids)} x {max_new} tokens)"
    on_step(phase, 0, max_new)
    with store.writer() as writer:
        recorder = RolloutRecorder(writer, s.site_widths, moe_layers=s.moe_layers, top_k=s.spec.top_k,
                                   flush_tokens=cfg.flush_tokens)
        with swapped(s.engine, recorder=recorder):
            return s.engine.generate(s.prompts, max_new, seed=cfg.seed, request_ids=rids,
                                     on_step=lambda done, total: on_step(phase, done, total))


def record_store(cfg: DemoConfig, on_step: StepFn | None = None, *, scale_encoding: str | None = None) -> dict[str, Any]:
    """The demo's recording half only: build and calibrate the model, create the store at ``cfg.store`` and
    record the FP4 rollout into it (no floor run, no trainer; `tracerl.audit` recomputes the rest). Returns
    ``{"store", "trajectories", "response_tokens", "decode_s", "seconds"}``. ``scale_encoding``: the hinted sites'
    (FORMAT §2.4): ``bytes`` (today's layout) or ``lsb`` (scale hints; the recorder packs the LSBs); None takes
    ``cfg.scale_encoding``.

    Raises `ConfigError` as `run_demo` does, when ``cfg.store`` is None, or for an unknown scale encoding."""
    scale_encoding = cfg.scale_encoding if scale_encoding is None else scale_encoding
    if scale_encoding not in SCALE_ENCODINGS:
        raise ConfigError(f"scale_encoding={scale_encoding!r}: must be one of {', '.join(SCALE_ENCODINGS)}")
    if cfg.store is None:
        raise ConfigError("record_store needs cfg.store (the URL of the store to create)")
    t0 = time.perf_counter()
    spec = _check(cfg)
    torch.manual_seed(cfg.seed)
    s = _setup(cfg, spec)
    rids = [f"traj-{i:04d}" for i in range(cfg.trajectories)]
    roll = _record(cfg, s, _create_store(cfg.store, cfg, s, rids, scale_encoding), rids, on_step or (lambda *a: None))
    return {"store": cfg.store, "trajectories": len(rids), "response_tokens": int(sum(map(len, roll.logprobs))),
            "decode_s": roll.decode_s, "seconds": time.perf_counter() - t0}


def _rollouts(cfg: DemoConfig, s: _Setup, store: ts.Store, rids: list[str], on_step: StepFn):
    """The FP4 rollout, recorded into ``store``, then the floor run (bf16, the sampled tokens forced)."""
    max_new = cfg.tokens - cfg.prompt_tokens[1]
    roll = _record(cfg, s, store, rids, on_step)
    phase = "floor run (bf16, tokens forced)"
    on_step(phase, 0, max_new)
    forced = torch.as_tensor(np.stack([q[len(p):] for q, p in zip(roll.sequences, s.prompts)]))
    floor = s.engine.generate(s.prompts, max_new, seed=cfg.seed, request_ids=rids, forced_tokens=forced, mode="bf16",
                              on_step=lambda done, total: on_step(phase, done, total))
    return roll, floor


def _recompute(cfg: DemoConfig, s: _Setup, packed: list, roll: RolloutResult, floor: RolloutResult,
               rids: list[str], on_step: StepFn) -> tuple[dict[str, list], dict[str, _CodeTally]]:
    """The trainer's recompute of every micro-batch in every mode (code agreement counted as it goes); under
    routing replay also the ``floor`` row: bf16 with the floor run's routes (the stored ones are the FP4
    rollout's)."""
    trainer = QATTrainer(s.engine.model, s.runtime)
    recomputes: dict[str, list] = {}
    tallies: dict[str, _CodeTally] = {}
    total = len(packed) * (len(MODES) + cfg.replay_routes)
    phase = "trainer recompute"
    on_step(phase, 0, total)
    for mode in MODES:
        if mode != "bf16":
            tallies[mode] = _CodeTally(roll, rids, s.site_names)
        recomputes[mode] = []
        for p in packed:
            r = trainer.recompute(p, mode, backward=cfg.backward, replay_routes=cfg.replay_routes)
            if mode in tallies:
                tallies[mode].add(p, r)
            r.codes = {}  # counted; [T, W] per hinted site is too much to keep for every micro-batch
            recomputes[mode].append(r)
            on_step(phase, sum(map(len, recomputes.values())), total)
    if cfg.replay_routes:
        index = {r: i for i, r in enumerate(rids)}
        recomputes["floor"] = []
        for p in packed:
            routes = {moe_layer_name(la): np.concatenate([per[index[g.traj_id]][g.start : g.stop] for g in p.segments])
                      for la, per in floor.experts.items()}
            recomputes["floor"].append(trainer.recompute(dataclasses.replace(p, experts=routes), "bf16",
                                                         backward=cfg.backward, replay_routes=True))
            on_step(phase, sum(map(len, recomputes.values())), total)
    return recomputes, tallies


def _run_info(cfg: DemoConfig, s: _Setup, roll: RolloutResult, recomputes: dict[str, list]) -> dict[str, Any]:
    """The result's ``config``, ``rollout``, ``trainer_seconds`` and ``machine`` entries."""
    return {
        "config": {**dataclasses.asdict(cfg), "spec": dataclasses.asdict(s.spec), "hinted_sites": s.site_names,
                   "fp4_sites": [x.name for x in s.plan.sites],
                   "kernels_backend": tracefp4.resolve_backend(cfg.backend, torch.device(cfg.device))},
        "rollout": {
            "trajectories": len(roll.request_ids),
            "tokens": int(sum(len(q) for q in roll.sequences)),
            "response_tokens": int(sum(len(lp) for lp in roll.logprobs)),
            "prefill_s": roll.prefill_s,
            "decode_s": roll.decode_s,
            "decode_steps": roll.decode_steps,
            "decode_path": roll.decode_path,
            "decode_prepare_s": roll.prepare_s,
            "hint_bytes_per_token": sum(x.width // HINTS_PER_BYTE + scale_bytes_per_token(x.width, cfg.scale_encoding)
                                        for x in s.hinted),
            "scale_encoding": cfg.scale_encoding,
            "store_url": cfg.store,
        },
        "trainer_seconds": {m: sum(r.seconds for r in rs) for m, rs in recomputes.items()},
        "machine": machine_info(),
    }


def run_demo(cfg: DemoConfig, progress: Callable[[str], None] | None = None, *,
             on_step: StepFn | None = None) -> dict[str, Any]:
    """Run the demo; returns ``{"modes": {mode: metrics}, "config": ..., "rollout": ..., ...}``.

    ``progress(message)`` is called as each phase starts; ``on_step(phase, done, total)`` as the long phases
    (the FP4 rollout and the floor run: decode steps; the trainer recompute: micro-batches x modes) advance,
    first with ``done == 0``.

    Raises `ConfigError` for a configuration that cannot run (`DemoConfig.check`, the model spec, the device,
    the decode path, a ``store`` that exists or cannot be created) before any store is created."""
    t_start = time.perf_counter()
    said: set[str] = set()

    def step(phase: str, done: int, total: int) -> None:
        if progress is not None and phase not in said:
            said.add(phase)
            progress(phase)
        if on_step is not None:
            on_step(phase, done, total)

    spec = _check(cfg)
    torch.manual_seed(cfg.seed)
    step("build and calibrate the model", 0, 1)
    s = _setup(cfg, spec)
    step("build and calibrate the model", 1, 1)
    rids = [f"traj-{i:04d}" for i in range(cfg.trajectories)]
    with _store_url(cfg.store) as url:
        roll, floor = _rollouts(cfg, s, _create_store(url, cfg, s, rids, cfg.scale_encoding), rids, step)
        # the trainer reads the store back through a fresh handle, as THD micro-batches
        stored = ts.open_store(url)
        use_store_scale_encodings(s.runtime, stored)  # lsb sites: the trainer rebuilds the bytes itself
        reader = stored.reader()
        mbs = pack_micro_batches({i.traj_id: i.num_tokens for i in reader.trajectories()}, cfg.micro_batch_tokens)
        packed = [read_packed(reader, mb, s.site_names, read_kwargs={"fmt": "numpy"}) for mb in mbs]
        recomputes, tallies = _recompute(cfg, s, packed, roll, floor, rids, step)
        result = _metrics(cfg, packed, recomputes, tallies, roll, floor, rids, s.hinted, spec)
    result.update(_run_info(cfg, s, roll, recomputes))
    result["seconds"] = time.perf_counter() - t_start
    return result


class _CodeTally:
    """Code / scale agreement of one trainer mode at the hinted sites, counted one micro-batch at a time
    against the rollout's codes (which `RolloutEngine` kept with ``keep_codes``), over response tokens."""

    def __init__(self, roll: RolloutResult, rids: list[str], sites: list[str]):
        # scale agreement against the rollout's own bytes (kept with its codes): the store may keep only LSBs
        self.roll, self.sites = roll, sites
        self.index = {r: i for i, r in enumerate(rids)}
        self.counts = {s: [0, 0] for s in sites}  # matching codes, codes
        self.mismatch = self.one_step = 0
        self.scale_eq = self.scale_n = 0

    def add(self, p, r) -> None:
        response = ~np.isnan(p.logprobs)
        for s in self.sites:
            per_req = self.roll.codes[s]
            rcp = np.concatenate([per_req[self.index[g.traj_id]][g.start : g.stop] for g in p.segments])[response]
            match, total, n_bad, one = fidelity.count_code_matches(r.codes[s][response], rcp)
            c = self.counts[s]
            c[0] += match
            c[1] += total
            self.mismatch += n_bad
            self.one_step += one
            per_scl = self.roll.scales[s]
            rsp = np.concatenate([per_scl[self.index[g.traj_id]][g.start : g.stop] for g in p.segments])[response]
            eq = r.scales[s][response] == rsp
            self.scale_eq += int(eq.sum())
            self.scale_n += eq.size

    def summary(self) -> dict:
        per_site = {k: (a, b) for k, (a, b) in self.counts.items()}
        return {
            "code_agreement": fidelity.summarize_sites(per_site),
            "scale_agreement": self.scale_eq / self.scale_n if self.scale_n else math.nan,
            "per_site_code_agreement": {k: a / b for k, (a, b) in per_site.items() if b},
            "mismatch_one_step_share": self.one_step / self.mismatch if self.mismatch else math.nan,
        }


def _metrics(cfg, packed, recomputes, tallies, roll: RolloutResult, floor: RolloutResult, rids, hinted,
             spec) -> dict:
    index = {r: i for i, r in enumerate(rids)}
    # THD -> (trajectory index, position) of every row, over all micro-batches.
    rows_traj = np.concatenate([np.repeat([index[s.traj_id] for s in p.segments], np.diff(p.cu_seqlens))
                                for p in packed])
    rows_pos = np.concatenate([p.positions for p in packed])
    roll_lp = np.concatenate([p.logprobs for p in packed])
    response = ~np.isnan(roll_lp)
    prompt_len = np.array([len(s) - len(lp) for s, lp in zip(roll.sequences, roll.logprobs)])
    resp_pos = rows_pos - prompt_len[rows_traj]

    def cat(mode, get):
        return np.concatenate([get(r) for r in recomputes[mode]])

    def gather(per_request):
        """Engine per-request arrays [P_b + fed, ...] -> THD rows."""
        dense = np.zeros((len(per_request), max(len(a) for a in per_request), *per_request[0].shape[1:]),
                         dtype=per_request[0].dtype)
        for i, a in enumerate(per_request):
            dense[i, : len(a)] = a
        return dense[rows_traj, rows_pos]

    modes: dict[str, dict] = {}
    # response-position buckets of 64 tokens (the last one open-ended) for the by-position slice
    last = int(resp_pos.max()) + 1
    edges = [e for e in range(0, last, 64)] + [last]
    floor_lp = np.full(len(rows_pos), np.nan, dtype=np.float32)
    floor_lp[response] = np.stack(floor.logprobs)[rows_traj[response], resp_pos[response]]
    for mode in REPORT_MODES:
        src = mode if mode in recomputes else "bf16"  # the floor row: "floor" under routing replay
        train_lp = cat(src, lambda r: r.logprobs)
        ref_lp = floor_lp if mode == "floor" else roll_lp
        st = fidelity.dlogp_stats(train_lp[response], ref_lp[response])
        routes_ref = floor.experts if mode == "floor" else roll.experts
        pairs = [(cat(src, lambda r, la=la: r.routes[la])[response], gather(routes_ref[la])[response])
                 for la in sorted(routes_ref)]
        entry = {
            "code_agreement": None,
            "scale_agreement": None,
            "router_flip_rate": fidelity.router_flip_rate(pairs),
            **{k: st[k] for k in ("mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "k3", "extreme_frac")},
            "tokens": st["tokens"],
        }
        if mode not in ("floor", "bf16") and hinted:
            entry.update(tallies[mode].summary())
        entry["by_position_mean_abs_dlogp"] = fidelity.by_position(
            np.abs(train_lp.astype(np.float64) - ref_lp), resp_pos, edges)
        modes[mode] = json_ready(entry)
    floor_mean = modes["floor"]["mean_abs_dlogp"]
    for m in MODES:
        modes[m]["excess_over_floor"] = modes[m]["mean_abs_dlogp"] - floor_mean
    return {"modes": modes}
