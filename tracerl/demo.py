"""The end-to-end TRACE fidelity demo: FP4 rollout -> hints in a store -> trainer recompute in every mode.

Steps (`run_demo`):

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

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tracefp4
import tracestore as ts
from tracerl import fidelity
from tracerl.engine import RolloutEngine, RolloutResult
from tracerl.errors import ConfigError
from tracerl.models import TinyMoESpec, build_model, model_metadata
from tracerl.packing import pack_micro_batches, read_packed
from tracerl.qat import MODES, install_fp4
from tracerl.recorder import RolloutRecorder
from tracerl.sites import plan_sites
from tracerl.trainer import QATTrainer

REPORT_MODES = ("floor", *MODES)
METRIC_KEYS = ("code_agreement", "scale_agreement", "router_flip_rate", "mean_abs_dlogp", "p99_abs_dlogp",
               "max_abs_dlogp", "k3")


@dataclasses.dataclass
class DemoConfig:
    model: str = "qwen3-moe"
    trajectories: int = 16
    tokens: int = 256  # per trajectory, prompt + response
    prompt_tokens: tuple[int, int] = (8, 16)  # prompt lengths drawn uniformly from [lo, hi]
    hint_layers: str = "latter-half"
    hint_sites: str = "moe-input"
    fp4: str = "experts"
    kv_fp4: bool = False
    seed: int = 0
    store: str | None = None
    backward: bool = False
    micro_batch_tokens: int = 8192
    flush_tokens: int = 128
    device: str = "cpu"
    backend: str = "auto"
    decode: str = "auto"  # RolloutEngine decode path: auto | hf | static | graph
    replay_routes: bool = False  # trainer uses the rollout's routed experts (the floor: the floor run's)
    spec: dict[str, Any] = dataclasses.field(default_factory=dict)  # TinyMoESpec overrides


def _prompts(cfg: DemoConfig, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(cfg.seed + 1)
    lo, hi = cfg.prompt_tokens
    lens = torch.randint(lo, hi + 1, (cfg.trajectories,), generator=g).tolist()
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]


def _nan_to_none(d: dict) -> dict:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}


def _check_device(name: str) -> None:
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {name!r} is not a torch device ({e}); e.g. cpu, cuda, cuda:1") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: this torch ({torch.__version__}) sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r}: the demo runs on cpu or cuda")


def run_demo(cfg: DemoConfig, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the demo; returns ``{"modes": {mode: metrics}, "config": ..., "rollout": ..., ...}``.

    Raises `ConfigError` for an unusable device, decode path or token budget (before any store is created)."""
    say = progress or (lambda msg: None)
    t_start = time.perf_counter()
    _check_device(cfg.device)
    max_new = cfg.tokens - cfg.prompt_tokens[1]
    if max_new < 2:
        raise ConfigError(f"tokens={cfg.tokens} leaves no room for a response after prompts of up to "
                          f"{cfg.prompt_tokens[1]} tokens; use tokens >= {cfg.prompt_tokens[1] + 2}")
    torch.manual_seed(cfg.seed)
    spec = TinyMoESpec(family=cfg.model, **cfg.spec)
    model = build_model(spec, seed=cfg.seed, device=cfg.device)
    plan = plan_sites(model, fp4=cfg.fp4, hint_layers=cfg.hint_layers, hint_sites=cfg.hint_sites,
                      kv_fp4=cfg.kv_fp4)
    runtime = install_fp4(model, plan, backend=cfg.backend)
    prompts = _prompts(cfg, spec.vocab_size)
    engine = RolloutEngine(model, runtime, keep_codes=True, decode=cfg.decode)
    engine.decode_path(torch.device(cfg.device))  # an unusable --decode fails here, before a store exists
    global_scales = engine.calibrate(prompts)
    hinted = plan.hinted_specs()
    moe_layers = [f"model.layers.{i}.mlp" for i in range(spec.num_layers)]

    tmp = None
    url = cfg.store
    if url is None:
        tmp = tempfile.TemporaryDirectory(prefix="tracerl-demo-")
        url = f"{tmp.name}/store"
    try:
        meta = {
            **model_metadata(spec, cfg.seed),
            "fp4": cfg.fp4,
            "site_plan": plan.to_json(),
            "global_scales": global_scales,
        }
        store = ts.create_store(
            url,
            [ts.Site(s.name, s.width) for s in hinted] or [ts.Site("none", 16)],
            model=meta,
            moe_layers=moe_layers,
            top_k=spec.top_k,
            num_experts=spec.num_experts,
        )
        # ---- FP4 rollout, recorded -------------------------------------------------------------------
        say(f"FP4 rollout: {cfg.trajectories} trajectories x {cfg.tokens} tokens, {len(hinted)} hinted sites")
        rids = [f"traj-{i:04d}" for i in range(cfg.trajectories)]
        with store.writer() as writer:
            recorder = RolloutRecorder(
                writer,
                {s.name: s.width for s in hinted} if hinted else {"none": 16},
                moe_layers=moe_layers,
                top_k=spec.top_k,
                flush_tokens=cfg.flush_tokens,
            )
            engine.recorder = recorder
            roll = engine.generate(prompts, max_new, seed=cfg.seed, request_ids=rids)
            engine.recorder = None
        # ---- floor: the rollout's decode path in bf16, tokens forced ----------------------------------
        say("floor run: bf16 decode path with the sampled tokens forced")
        forced = torch.as_tensor(np.stack([s[len(p):] for s, p in zip(roll.sequences, prompts)]))
        floor = engine.generate(prompts, max_new, seed=cfg.seed, request_ids=rids, forced_tokens=forced,
                                mode="bf16")
        # ---- trainer: read the store back as THD micro-batches -----------------------------------------
        reader = ts.open_store(url).reader()
        infos = reader.trajectories()
        mbs = pack_micro_batches({i.traj_id: i.num_tokens for i in infos}, cfg.micro_batch_tokens)
        site_names = [s.name for s in hinted]
        packed = [read_packed(reader, mb, site_names, read_kwargs={"fmt": "numpy"}) for mb in mbs]
        trainer = QATTrainer(model, runtime)
        recomputes: dict[str, list] = {}
        tallies: dict[str, _CodeTally] = {}
        for mode in MODES:
            say(f"trainer recompute: {mode}")
            if mode != "bf16":
                tallies[mode] = _CodeTally(roll, rids, site_names)
            recomputes[mode] = []
            for p in packed:
                r = trainer.recompute(p, mode, backward=cfg.backward, replay_routes=cfg.replay_routes)
                if mode in tallies:
                    tallies[mode].add(p, r)
                r.codes = {}  # counted; [T, W] per hinted site is too much to keep for every micro-batch
                recomputes[mode].append(r)
        if cfg.replay_routes:
            # The floor compares the bf16 decode path with the bf16 trainer; under routing replay the trainer
            # replays the floor run's routes (the stored ones are the FP4 rollout's).
            say("trainer recompute: bf16 with the floor run's routes")
            index = {r: i for i, r in enumerate(rids)}
            recomputes["floor"] = [
                trainer.recompute(dataclasses.replace(p, experts={
                    f"model.layers.{la}.mlp": np.concatenate(
                        [per[index[g.traj_id]][g.start : g.stop] for g in p.segments])
                    for la, per in floor.experts.items()}), "bf16", backward=cfg.backward, replay_routes=True)
                for p in packed]
        result = _metrics(cfg, packed, recomputes, tallies, roll, floor, rids, hinted, spec)
        hint_bytes = sum(s.width // 8 + s.width // 16 for s in hinted)
        result.update({
            "config": {**dataclasses.asdict(cfg), "spec": dataclasses.asdict(spec),
                       "hinted_sites": site_names, "fp4_sites": [s.name for s in plan.sites],
                       "kernels_backend": tracefp4.resolve_backend(cfg.backend, torch.device(cfg.device))},
            "rollout": {
                "trajectories": len(rids),
                "tokens": int(sum(len(s) for s in roll.sequences)),
                "response_tokens": int(sum(len(lp) for lp in roll.logprobs)),
                "prefill_s": roll.prefill_s,
                "decode_s": roll.decode_s,
                "decode_steps": roll.decode_steps,
                "decode_path": roll.decode_path,
                "decode_prepare_s": roll.prepare_s,
                "hint_bytes_per_token": hint_bytes,
                "store_url": url if cfg.store else None,
            },
            "trainer_seconds": {m: sum(r.seconds for r in rs) for m, rs in recomputes.items()},
            "seconds": time.perf_counter() - t_start,
        })
        return result
    finally:
        if tmp is not None:
            tmp.cleanup()


class _CodeTally:
    """Code / scale agreement of one trainer mode at the hinted sites, counted one micro-batch at a time
    against the rollout's codes (which `RolloutEngine` kept with ``keep_codes``), over response tokens."""

    def __init__(self, roll: RolloutResult, rids: list[str], sites: list[str]):
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
            tc = r.codes[s][response]  # [R, W] unpacked
            # Compare packed bytes first (value 2j in the low nibble of byte j, as tracefp4 packs them); only
            # differing bytes are unpacked (at full coverage and 32K tokens this is most of the metric's time).
            rows, cols = np.nonzero((tc[:, 0::2] | (tc[:, 1::2] << 4)) != rcp)
            a = np.stack([tc[rows, 2 * cols], tc[rows, 2 * cols + 1]], axis=-1)
            b = tracefp4.unpack_codes(torch.from_numpy(rcp[rows, cols][:, None])).numpy()
            bad = ~fidelity.code_matches(a, b)  # +0 / -0 differ as bytes but match as codes
            n_bad = int(bad.sum())
            c = self.counts[s]
            c[0] += tc.size - n_bad
            c[1] += tc.size
            if n_bad:
                self.mismatch += n_bad
                self.one_step += round(fidelity.one_step_share(a[bad], b[bad]) * n_bad)
            eq = r.scales[s][response] == p.scales[s][response]
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
        modes[mode] = _nan_to_none(entry)
    floor_mean = modes["floor"]["mean_abs_dlogp"]
    for m in MODES:
        modes[m]["excess_over_floor"] = modes[m]["mean_abs_dlogp"] - floor_mean
    return {"modes": modes}
