"""``tracerl audit STORE``: what a store says about its rollout quantization.

An audit rebuilds the rollout's model from the store's model metadata (``builder``, ``spec``, ``seed``, ``fp4``,
``site_plan``, ``global_scales``, and ``rollout``: decode path, temperature, batches, as `tracerl demo` records
them), loads the policy version each trajectory was generated with when it is published beside the store
(`tracerl.weights`; ``--model`` gives a checkpoint instead), and then:

1. **Integrity**: `tracestore.verify` of the store; trajectories whose data cannot be read are left out and
   named, and the failure (with the object) is reported instead of a crash.
2. **Replay** (`_replay`): the rollout's decode path (FP4, the stored tokens forced, the recorded batches) run
   again, capturing the E2M1 codes and block scales at *every* FP4 activation site into device buffers; it
   must reproduce the store (hint bits, scales, routed experts, log-probs), and the report says how exactly it
   did. These codes are the reference of code agreement (a store keeps only each code's LSB) and the exact
   values of the attribution and the what-if coverage passes.
3. **Floor**: the same decode path in bf16 with the tokens forced; on a GPU it runs side by side with the
   replay (a second thread, its own CUDA stream; ``concurrent_decode``), which gives the same bits as one after
   the other.
4. **Passes**: the trainer's recompute (`tracerl.trainer.QATTrainer`, THD micro-batches read from the store)
   in each configuration, a `PassSpec`: the FP4 sites are driven by `FP4Runtime.substitute` (own rounding,
   the store's scales, the store's hints, hints from the replay, or the replay's exact values), so one
   runtime serves every pass. Metrics are taken on the device per micro-batch (`tracerl.audit_metrics`).
5. **Attribution** and **coverage planner**: `tracerl.audit_plan` (definitions there).

Passes (names as in the JSON ``modes``, ``detail`` and ``attribution``):

| pass | FP4 sites | routes |
| --- | --- | --- |
| ``bf16`` (against the rollout; ``floor``: against the floor decode) | bf16 | own |
| ``fp4_rne_own_scales`` | RNE, own scales everywhere | own |
| ``fp4_rne_rollout_scales`` | store's scales at hinted sites | own |
| ``fp4_hints`` (the audited configuration) | store's hints + scales at hinted sites | own |
| ``fp4_hints_replay_routes`` | as fp4_hints | the rollout's (routing replay) |
| ``fp4_rne_replay_routes`` | RNE, own scales everywhere | the rollout's (the reference of routing replay) |
| ``exact:<group>`` | as fp4_hints, this and every earlier group exact (`audit_plan.attribution_order`) | the rollout's |
| ``hint:<unit>`` | RNE everywhere, the unit's sites hinted (replay) | own |
| ``curve:<k>`` | RNE everywhere, k units hinted: the kept ones and the next in the ranking (or all) | own |

JSON (``run_audit``'s result, ``tracerl audit --json``; stable keys, ``audit_format`` 1):

- ``store``: url, trajectories (in the store), audited_trajectories, response_tokens, hinted_sites, fp4_sites,
  hint_bytes_per_token, policy_versions, model (the spec).
- ``integrity``: ok, checked, errors (tracestore verify's messages: object named), entries, records, segments,
  chunks, bytes, skipped_trajectories (``[{traj_id, reason}]``).
- ``replay``: decode_path, recorded_decode_path, reproduced (bool: every compared byte and log-prob equal),
  hints_equal, scales_equal, routes_equal, logprobs_equal (fractions), max_abs_logprob_diff, weights
  (``{version: "initial" | "published" | "checkpoint"}``).
- ``modes``: ``{floor, bf16, fp4_rne_own_scales, fp4_rne_rollout_scales, fp4_hints, fp4_hints_replay_routes,
  fp4_rne_replay_routes}``
  each with code_agreement, scale_agreement, one_step_share, multi_step_share (hinted sites; null without
  codes), router_flip_rate, mean_abs_dlogp, p99_abs_dlogp, max_abs_dlogp, k3, extreme_frac, tokens,
  excess_over_floor (null for floor).
- ``audited_mode``: ``"fp4_hints"``.
- ``detail``: ``{mode: {per_site, per_layer, per_trajectory, per_policy_version, by_position}}`` for the FP4
  modes (per_site / per_layer cover every FP4 site, hinted or not) and bf16 (no code columns).
- ``histogram``: |dlogp| on shared log bins: edges, zero, counts ``{floor, fp4_rne_own_scales, fp4_hints, ...}``.
- ``attribution`` (null with ``attribution=False``): order (sources, as made exact), groups, mean_abs, mean_sq
  (each: total, floor, parts, sum_of_parts, residual, interaction), dominant, adds_up, tolerance,
  exact_code_agreement (code agreement of the last pass at every FP4 site: 1.0 when "exact" is exact).
- ``planner`` (null with ``planner=False``): units, ranking, curve (``[{k, units, sites, bytes_per_token,
  mean_abs_dlogp, excess, excess_vs_rne}]``: k units hinted, the kept ones in order; the last point hints every
  unit), rejected (the units set aside: the same keys plus ``unit``, measured on top of the units kept before
  them), rne_excess, store_coverage (bytes_per_token, excess, excess_vs_rne, and with_routing_replay: excess,
  rne_excess, excess_vs_rne, both passes replaying the rollout's routes), budget (bytes_per_token, best), target
  (null, or target_excess, meets, point, site_table).
- ``timing``: seconds, verify_s, setup_s, replay_s, floor_s, decode_s (wall time of both decodes: their sum, or
  less when they ran side by side), concurrent_decode (bool), passes_s, curve_s, passes, micro_batches.
- ``config``, ``machine``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import math
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

import tracefp4
import tracestore as ts
from tracerl.artifacts import weights as tw
from tracerl.audit import metrics as am
from tracerl.audit import plan as ap
from tracerl.config import CONCURRENT_DECODE, DECODE_PATHS
from tracerl.errors import ConfigError
from tracerl.policy import (
    FP4Linear,
    FP4MoEBlock,
    FP4Runtime,
    SitePlan,
    TinyMoESpec,
    build_model,
    effective_codes,
    install_fp4,
    moe_blocks,
)
from tracerl.rollout import RolloutEngine
from tracerl.runlog import json_ready, machine_info
from tracerl.train import PackedHints, QATTrainer, pack_micro_batches, read_packed
from tracerl.util import check_device, swapped, to_device

log = logging.getLogger(__name__)

AUDIT_FORMAT = 1
AUDITED_MODE = "fp4_hints"
MODE_NAMES = ("floor", "bf16", "fp4_rne_own_scales", "fp4_rne_rollout_scales", "fp4_hints",
              "fp4_hints_replay_routes", "fp4_rne_replay_routes")
DETAIL_KEYS = ("per_site", "per_layer", "per_trajectory", "per_policy_version", "by_position")
TOP_KEYS = ("audit_format", "store", "integrity", "replay", "modes", "audited_mode", "detail", "histogram",
            "attribution", "planner", "timing", "config", "machine")
#: the planner's reference budget: the paper's default coverage (20 MoE inputs of width 2048)
REFERENCE_BUDGET = 7680
REQUIRED_METADATA = ("builder", "spec", "seed", "site_plan", "global_scales")

#: ``on_step(phase, done, total)``, as `tracerl.demo.run_demo`'s
StepFn = Callable[[str, int, int], None]


@dataclasses.dataclass
class AuditConfig:
    """What `run_audit` audits and how (the ``tracerl audit`` options)."""

    store: str
    device: str = "auto"  # auto: the device type the rollout ran on when this machine has it, else cpu
    model: str | None = None  # a safetensors checkpoint instead of the store's weights
    max_trajectories: int | None = None  # audit the first N trajectories (by id)
    micro_batch_tokens: int = 8192
    bands: int = 4
    position_bucket: int = 64
    attribution: bool = True
    planner: bool = True
    target_excess: float | None = None
    backend: str = "auto"
    storage_options: dict | None = None
    verify: bool = True
    concurrent_decode: str = "auto"  # replay and floor decodes side by side: CONCURRENT_DECODE (auto: CUDA graphs)

    def check(self) -> None:
        """Raise `ConfigError` for values that cannot run (what arrived, what is allowed)."""
        for name, lo in (("micro_batch_tokens", 1), ("bands", 1), ("position_bucket", 1)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{name}={v!r}: must be an integer >= {lo}")
        if self.max_trajectories is not None and (not isinstance(self.max_trajectories, int)
                                                  or self.max_trajectories < 1):
            raise ConfigError(f"max_trajectories={self.max_trajectories!r}: must be an integer >= 1")
        if self.target_excess is not None and not (isinstance(self.target_excess, (int, float))
                                                   and math.isfinite(self.target_excess)):
            raise ConfigError(f"target_excess={self.target_excess!r}: must be a finite number")
        if self.concurrent_decode not in CONCURRENT_DECODE:
            raise ConfigError(f"concurrent_decode={self.concurrent_decode!r}: must be one of "
                              f"{', '.join(CONCURRENT_DECODE)}")
        if self.target_excess is not None and not self.planner:
            raise ConfigError("target_excess needs the planner (planner=False given)")


@dataclasses.dataclass(frozen=True)
class PassSpec:
    """One trainer recompute of every audited token: which FP4 sites do what (``actions``: site ->
    ``scales`` | ``hints`` (the store's) | ``replay_hints`` | ``exact`` (the replay's); absent: own RNE), routing
    replay, and whether code metrics are taken (``observe``). ``fp4=False``: the bf16 trainer."""

    name: str
    fp4: bool = True
    actions: Mapping[str, str] = dataclasses.field(default_factory=dict)
    replay_routes: bool = False
    observe: bool = False


def mode_passes(plan: SitePlan) -> list[PassSpec]:
    stored = {s: "hints" for s in plan.hinted}
    return [PassSpec("bf16", fp4=False),
            PassSpec("fp4_rne_own_scales", observe=True),
            PassSpec("fp4_rne_rollout_scales", actions={s: "scales" for s in plan.hinted}, observe=True),
            PassSpec("fp4_hints", actions=stored, observe=True),
            PassSpec("fp4_hints_replay_routes", actions=stored, replay_routes=True, observe=True),
            PassSpec("fp4_rne_replay_routes", replay_routes=True, observe=True)]


def attribution_passes(plan: SitePlan, groups: Sequence[ap.SiteGroup]) -> list[PassSpec]:
    """``exact:<group>``: routes replayed and every group up to this one (in `ap.attribution_order`) exact, the
    store's hints at the other hinted sites; the last one is the residual (every FP4 site exact)."""
    stored = {s: "hints" for s in plan.hinted}
    out, exact = [], {}
    order = ap.attribution_order(groups)
    for i, g in enumerate(order):
        exact.update({s: "exact" for s in g.sites})
        # the last pass (every FP4 site exact) also counts codes: a check that exact means the rollout's codes
        out.append(PassSpec(f"exact:{g.name}", actions={**stored, **exact}, replay_routes=True,
                            observe=i == len(order) - 1))
    return out


def hint_pass(name: str, units: Sequence[ap.SiteGroup]) -> PassSpec:
    return PassSpec(name, actions={s: "replay_hints" for u in units for s in u.sites})


# ---- the model ----------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Setup:
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
def _bound(model: torch.nn.Module, runtime: FP4Runtime) -> Iterator[None]:
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


def _resolve_device(name: str, recorded: str | None) -> torch.device:
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
    declare, or for a device this machine does not have."""
    meta = store.model
    missing = [k for k in REQUIRED_METADATA if k not in meta]
    if missing:
        raise ConfigError(f"store {store.url}: its model metadata lacks {missing} (has {sorted(meta)}); the audit "
                          "rebuilds the model from what `tracerl demo --store` records (tracerl.demo._create_store)")
    if meta["builder"] != "tracerl.models.build_model":
        raise ConfigError(f"store {store.url}: model builder {meta['builder']!r}; the audit rebuilds "
                          "tracerl.models.build_model models")
    rollout = {"decode": "auto", "device": "cpu", "temperature": 1.0, "batches": None, **(meta.get("rollout") or {})}
    spec = TinyMoESpec(**meta["spec"])
    plan = SitePlan.from_json(meta["site_plan"])
    foreign = sorted(set(plan.hinted) - set(store.sites))
    if foreign:
        raise ConfigError(f"store {store.url}: the site plan hints {foreign[:4]}, which the store does not declare")
    return spec, plan, rollout, _resolve_device(device, rollout.get("device"))


def load_setup(store: ts.Store, cfg: AuditConfig) -> _Setup:
    """Rebuild the rollout's model, site plan and global scales from ``store.model`` (`check_metadata`).

    Raises `ConfigError` as `check_metadata` does, and for a ``cfg.model`` checkpoint that does not fit."""
    spec, plan, rollout, device = check_metadata(store, cfg.device)
    meta = store.model
    model = build_model(spec, seed=int(meta["seed"]), device=device)
    train = install_fp4(model, plan, backend=cfg.backend)
    train.set_global_scales(meta["global_scales"])
    replay_plan = dataclasses.replace(plan, hinted=tuple(s.name for s in plan.sites if s.kind != "kv"))
    replay = FP4Runtime(replay_plan, meta["global_scales"], backend=cfg.backend)
    setup = _Setup(model, spec, plan, train, replay, QATTrainer(model, train), device,
                   {i: n for i, n, _ in moe_blocks(model)}, rollout)
    if cfg.model is not None:
        _load_checkpoint(model, cfg.model)
        setup.loaded = "checkpoint"
    return setup


def _load_checkpoint(model: torch.nn.Module, path: str) -> None:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        model.load_state_dict(load_file(path), strict=True)
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"--model {path}: cannot read a safetensors checkpoint ({e})") from None
    except RuntimeError as e:  # torch names the missing and unexpected keys and the shape mismatches
        raise ConfigError(f"--model {path} does not fit the store's model: {' '.join(str(e).split())[:400]}") from None


def _use_weights(s: _Setup, url: str, version: int, published: set[int], storage_options: dict | None) -> str:
    """Load the weights of policy ``version`` into the model: published beside the store (`tracerl.weights`),
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


# ---- trajectories -------------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Traj:
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


def _read_trajectories(reader: ts.Reader, cfg: AuditConfig, check_data: bool,
                       sites: Sequence[str]) -> tuple[list[_Traj], list[dict]]:
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
        t = _Traj(info.traj_id, len(out), info.num_tokens, tok[:p].tolist(), tok[p:], lp[p:],
                  {k: np.asarray(v) for k, v in b.experts.items()}, int(np.asarray(b.policy_version)[p]))
        if check_data:
            try:
                reader.read(info.traj_id, 0, info.num_tokens, sites=list(sites), fmt="numpy")
            except ts.IntegrityError as e:
                t.data_ok = False
                skipped.append({"traj_id": info.traj_id, "reason": f"IntegrityError: {e}"})
        out.append(t)
    return out, skipped


def _chunks(trajs: list[_Traj], batches: Sequence[Sequence[str]] | None) -> list[list[_Traj]]:
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


# ---- replay and floor ---------------------------------------------------------------------------------------
class _ReplayEngine(RolloutEngine):
    """A `RolloutEngine` whose captured codes and scales go into dense device buffers ``{site: (codes uint8
    [B, L, W/2], scales uint8 [B, L, W/16])}`` indexed by (batch row, position): nothing goes to the host."""

    def __init__(self, model, runtime, buffers: dict[str, tuple[torch.Tensor, torch.Tensor]], rids: Sequence[str],
                 **kwargs):
        super().__init__(model, runtime, keep_codes=True, **kwargs)
        self._buffers = buffers
        self._row_of = {r: i for i, r in enumerate(rids)}
        self._last: tuple | None = None

    def _deliver_site(self, rids, pos, site, hints, scales, codes) -> None:
        buf = self._buffers.get(site)
        if buf is None:
            return
        last = self._last
        # The engine hands every site of one forward (or ring) the same rids/pos objects: index them once. The
        # references are held, so an identity match is never a recycled id.
        if last is None or last[0] is not rids or last[1] is not pos:
            b = torch.as_tensor(np.fromiter((self._row_of[r] for r in rids), np.int64, len(rids)))
            p = torch.as_tensor(np.asarray(pos, dtype=np.int64))
            last = self._last = (rids, pos, to_device(b, codes.device), to_device(p, codes.device))
        buf[0][last[2], last[3]] = codes
        buf[1][last[2], last[3]] = scales


@dataclasses.dataclass
class _Replay:
    """One replay batch: its trajectories, the replayed codes/scales (device), the replay's and the floor's
    log-probs and routes (host)."""

    trajs: list[_Traj]
    codes: dict[str, torch.Tensor]  # site -> uint8 [B, L, W/2]
    scales: dict[str, torch.Tensor]  # site -> uint8 [B, L, W/16]
    logprobs: list[np.ndarray]  # per trajectory float32 [G_b] (replay)
    experts: dict[int, list[np.ndarray]]  # layer -> per trajectory uint8 [P_b + fed, top_k] (replay)
    floor_logprobs: np.ndarray  # float32 [B, G] by response position (NaN past a trajectory's end)
    floor_experts: dict[int, np.ndarray]  # layer -> uint8 [B, L, top_k] by position
    decode_path: str
    weights: str


def _dense(per_request: Sequence[np.ndarray], length: int, fill) -> np.ndarray:
    """Per-request arrays [n_b, ...] -> one array [B, length, ...] (``fill`` past each request's end)."""
    out = np.full((len(per_request), length, *per_request[0].shape[1:]), fill, dtype=per_request[0].dtype)
    for b, a in enumerate(per_request):
        out[b, : len(a)] = a[:length]
    return out


def _decode_path(s: _Setup, engine: RolloutEngine) -> str:
    """The recorded decode path when this machine can run it, else the engine's default."""
    recorded = s.rollout.get("decode") if s.rollout.get("decode") in DECODE_PATHS else "auto"
    with contextlib.suppress(ConfigError):
        engine.decode = recorded
        return engine.decode_path(s.device)
    engine.decode = "auto"
    return engine.decode_path(s.device)


class _LineUp:
    """Lines up ``n`` decodes that run side by side: their set-ups (graph capture, prefill) run one at a time,
    and every decode loop starts only when all are set up. A CUDA graph capture forbids device-wide syncs in
    every thread (the prefill's, the end of a decode), so no capture may overlap another decode's work.

    Use: ``with gate.setup(): engine.generate(..., on_ready=gate.ready)`` in each thread. A thread that fails
    before it is ready releases the set-up and breaks the line-up, so the others raise instead of waiting."""

    def __init__(self, n: int):
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(n)
        self._local = threading.local()

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        self._lock.acquire()
        self._local.holding = True
        try:
            yield
        except BaseException:
            self._barrier.abort()
            raise
        finally:
            if self._local.holding:
                self._local.holding = False
                self._lock.release()

    def ready(self) -> None:
        self._local.holding = False
        self._lock.release()
        self._barrier.wait()


def concurrent_decode(cfg_value: str, device: torch.device, path: str) -> bool:
    """Whether the replay and floor decodes run side by side (``auto``: CUDA-graph decodes on a GPU, where a
    decode step of a small batch leaves most of the device idle; on the CPU both would share the same cores)."""
    if cfg_value == "auto":
        return device.type == "cuda" and path == "graph"
    return cfg_value == "on"


def _replay(s: _Setup, chunk: list[_Traj], weights: str, step: StepFn, done: dict[str, int],
            totals: dict[str, int], concurrency: str = "auto") -> tuple[_Replay, dict[str, Any]]:
    """The replay decode (FP4) and the floor decode (bf16) of one recorded batch, the stored tokens forced.

    With `concurrent_decode` the floor runs in a second thread (its own CUDA stream on a GPU) while the replay
    runs in this one: each decode is the same computation as alone (the same captured graph per step, the same
    kernels), so the results are the same bits either way (tests/tracerl/test_audit.py); the runtime's per-call
    state is per thread (`FP4Runtime`), so the two modes do not see each other."""
    rids = [t.traj_id for t in chunk]
    prompts = [t.prompt for t in chunk]
    max_new = max(len(t.response) for t in chunk)
    forced = torch.zeros(len(chunk), max_new, dtype=torch.long)
    for b, t in enumerate(chunk):
        forced[b, : len(t.response)] = torch.as_tensor(t.response)
    length = max(map(len, prompts)) + max_new
    by = s.plan.by_name
    buffers = {n: (torch.zeros(len(chunk), length, by[n].width // 2, dtype=torch.uint8, device=s.device),
                   torch.zeros(len(chunk), length, by[n].width // ap.NVFP4_BLOCK_SIZE, dtype=torch.uint8,
                               device=s.device)) for n in s.observable}
    temperature = float(s.rollout.get("temperature") or 1.0)
    phases = (("replay decode (FP4, tokens forced)", "fp4_rne_own_scales"),
              ("floor decode (bf16, tokens forced)", "bf16"))
    # The engines leave the model's attention implementation alone (two threads swapping it would race).
    with _bound(s.model, s.replay), swapped(s.model.config, _attn_implementation="sdpa"):
        engines = {"fp4_rne_own_scales": _ReplayEngine(s.model, s.replay, buffers, rids, attn_implementation=None),
                   "bf16": _ReplayEngine(s.model, s.replay, {}, rids, attn_implementation=None)}
        path = _decode_path(s, engines["fp4_rne_own_scales"])
        engines["bf16"].decode = engines["fp4_rne_own_scales"].decode
        side_by_side = concurrent_decode(concurrency, s.device, path)

        gate = _LineUp(2 if side_by_side else 1)

        def run(phase: str, mode: str) -> tuple[Any, float]:
            base = done[phase]
            stream = (torch.cuda.stream(torch.cuda.Stream(s.device)) if side_by_side and s.device.type == "cuda"
                      else contextlib.nullcontext())
            t0 = time.perf_counter()
            with stream, gate.setup():
                out = engines[mode].generate(prompts, max_new, request_ids=rids, forced_tokens=forced, mode=mode,
                                             temperature=temperature, on_ready=gate.ready,
                                             on_step=lambda d, _t, p=phase, b0=base: step(p, b0 + d, totals[p]))
            done[phase] = base + max_new
            return out, time.perf_counter() - t0

        t0 = time.perf_counter()
        if side_by_side:
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="audit-floor") as pool:
                floor_job = pool.submit(run, *phases[1])
                try:
                    roll, replay_s = run(*phases[0])
                except BaseException:
                    concurrent.futures.wait([floor_job])  # the floor is not left running
                    if isinstance(floor_job.exception(), Exception):  # the floor failed first: its error, not the
                        raise floor_job.exception() from None  # replay's broken line-up
                    raise
                floor, floor_s = floor_job.result()  # the floor's own error, if it failed
        else:
            roll, replay_s = run(*phases[0])
            floor, floor_s = run(*phases[1])
        decode_s = time.perf_counter() - t0
    rep = _Replay(chunk, {k: v[0] for k, v in buffers.items()}, {k: v[1] for k, v in buffers.items()},
                  [lp[: len(t.response)] for lp, t in zip(roll.logprobs, chunk)], roll.experts,
                  _dense([lp[: len(t.response)] for lp, t in zip(floor.logprobs, chunk)], max_new, np.nan),
                  {la: _dense(per, length, 0) for la, per in floor.experts.items()}, path, weights)
    return rep, {"replay_s": replay_s, "floor_s": floor_s, "decode_s": decode_s, "concurrent": side_by_side}


# ---- one micro-batch ----------------------------------------------------------------------------------------
class _MicroBatch:
    """A packed micro-batch on the device: forward rows of the trainer's layout, the replay's codes/scales and
    the store's hints/scales gathered to THD rows (each once, on first use), and its response tokens."""

    def __init__(self, s: _Setup, rep: _Replay, packed: PackedHints):
        self.s, self.rep, self.packed = s, rep, packed
        dev = s.device
        inputs, self.rows = s.trainer._layout(packed, dev)
        self.nrows = int(inputs["input_ids"].numel())
        local = {t.traj_id: b for b, t in enumerate(rep.trajs)}
        self.b_host = np.concatenate([np.full(len(g), local[g.traj_id]) for g in packed.segments]).astype(np.int64)
        self.pos_host = np.asarray(packed.positions, dtype=np.int64)
        self.b_dev = to_device(torch.as_tensor(self.b_host), dev)
        self.pos_dev = to_device(torch.as_tensor(self.pos_host), dev)
        self.response = ~np.isnan(np.asarray(packed.logprobs))
        self.resp_dev = to_device(torch.as_tensor(np.flatnonzero(self.response)), dev)
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def _get(self, key: tuple[str, str], make: Callable[[], torch.Tensor]) -> torch.Tensor:
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = make()
        return t

    def replay_codes(self, site: str) -> torch.Tensor:  # packed uint8 [T, W/2]
        return self._get((site, "rc"), lambda: self.rep.codes[site][self.b_dev, self.pos_dev])

    def replay_scales(self, site: str) -> torch.Tensor:  # uint8 [T, W/16]
        return self._get((site, "rs"), lambda: self.rep.scales[site][self.b_dev, self.pos_dev])

    def stored(self, site: str, what: str) -> torch.Tensor:  # what: "hints" [T, W/8] | "scales" [T, W/16]
        return self._get((site, what), lambda: to_device(torch.as_tensor(
            np.ascontiguousarray(getattr(self.packed, what)[site])), self.s.device))

    def reference_scales(self, site: str) -> torch.Tensor:
        """The rollout's scales: as stored at the store's hinted sites, as replayed elsewhere."""
        return self.stored(site, "scales") if site in self.packed.scales else self.replay_scales(site)

    def forward_rows(self, key: tuple[str, str], thd: Callable[[], torch.Tensor]) -> torch.Tensor:
        """THD rows [T, C] -> the trainer's forward rows [nrows, C] (rows it does not cover: 0, scale 0 -> 0)."""
        return self._get((key[0], "fwd-" + key[1]),
                         lambda: QATTrainer._scatter(thd(), self.rows, self.nrows, self.s.device))

    def reproduction(self) -> np.ndarray:
        """[equal hint bytes, hint bytes, equal scale bytes, scale bytes] of the replay against the store at
        the store's hinted sites, over every row of the micro-batch."""
        out = np.zeros(4, np.int64)
        for site in self.packed.hints:
            h = tracefp4.hints_from_codes(self.replay_codes(site)) == self.stored(site, "hints")
            sc = self.replay_scales(site) == self.stored(site, "scales")
            out += np.array([int(h.sum()), h.numel(), int(sc.sum()), sc.numel()])
        return out


def _substitute(mb: _MicroBatch, spec: PassSpec, tally: am.CodeTally | None):
    """The `FP4Runtime.substitute` hook of one pass over one micro-batch (the pass's site actions; with a
    ``tally``, code metrics at every observable site). The runtime's mode is ``fp4_rne_own_scales``, so a site
    the hook leaves alone (None) is rounded to nearest with its own scales, as it would be here too."""
    rt = mb.s.train
    observable = set(mb.s.observable)

    def sub(site: str, x: torch.Tensor) -> torch.Tensor | None:
        act = spec.actions.get(site)
        if site not in observable or (act is None and tally is None):
            return None
        g = rt.global_scale_on(site, x.device)
        if act == "exact":  # the rollout's quantized values, as its forward used them
            scales = mb.forward_rows((site, "rs"), lambda: mb.replay_scales(site))
            y = tracefp4.dequantize(mb.forward_rows((site, "rc"), lambda: mb.replay_codes(site)), scales,
                                    fmt="nvfp4", global_scale=g, dtype=x.dtype, backend=rt.backend)
            if tally is not None:  # a self-check: the codes y carries are the rollout's
                used = scales.index_select(0, mb.rows)
                tally.add(site, effective_codes(y.index_select(0, mb.rows), used, g), mb.replay_codes(site), used,
                          mb.replay_scales(site))
            return y
        if act is not None:
            if act == "replay_hints":
                scales = mb.forward_rows((site, "rs"), lambda: mb.replay_scales(site))
                hints = mb.forward_rows((site, "rh"), lambda: tracefp4.hints_from_codes(mb.replay_codes(site)))
            else:
                scales = mb.forward_rows((site, "scales"), lambda: mb.stored(site, "scales"))
                hints = (mb.forward_rows((site, "hints"), lambda: mb.stored(site, "hints")) if act == "hints"
                         else None)
            y = tracefp4.fake_quantize(x, fmt="nvfp4", global_scale=g, scales=scales, hints=hints,
                                       backend=rt.backend)
            if tally is not None:
                used = scales.index_select(0, mb.rows)
                tally.add(site, effective_codes(y.detach().index_select(0, mb.rows), used, g), mb.replay_codes(site),
                          used, mb.reference_scales(site))
            return y
        y, q = tracefp4.quantize_fake(x, "nvfp4", global_scale=g, backend=rt.backend)
        tally.add(site, tracefp4.unpack_codes(q.codes.index_select(0, mb.rows)), mb.replay_codes(site),
                  q.scales.index_select(0, mb.rows), mb.reference_scales(site))
        return y

    return sub


@dataclasses.dataclass
class _PassState:
    """What one pass accumulates over the micro-batches."""

    spec: PassSpec
    log: am.TokenLog
    tally: am.CodeTally | None
    layer_flips: dict[int, int]
    layer_tokens: int = 0
    seconds: float = 0.0
    floor_log: am.TokenLog | None = None  # the bf16 pass: also against the floor decode


def _run_pass(s: _Setup, mb: _MicroBatch, st: _PassState) -> None:
    """Recompute ``mb`` in ``st.spec`` and append its response tokens' rows to ``st``."""
    spec = st.spec
    t0 = time.perf_counter()
    if st.tally is not None:
        st.tally.begin(mb.resp_dev)
    if spec.fp4:
        with s.train.using(substitute=_substitute(mb, spec, st.tally)):
            r = s.trainer.recompute(mb.packed, "fp4_rne_own_scales", observe=False, replay_routes=spec.replay_routes)
    else:
        r = s.trainer.recompute(mb.packed, "bf16", observe=False, replay_routes=spec.replay_routes)
    codes = st.tally.end() if st.tally is not None else None
    st.seconds += time.perf_counter() - t0
    resp = mb.response
    b, pos = mb.b_host[resp], mb.pos_host[resp]
    trajs = mb.rep.trajs
    prompt = np.array([t.prompt_len for t in trajs])[b]
    index = np.array([t.index for t in trajs])[b]
    version = np.array([t.version for t in trajs])[b]
    routes = {la: ids[resp] for la, ids in r.routes.items()}
    stored_routes = {name: ids[resp] for name, ids in mb.packed.experts.items()}
    flips, per_layer = am.route_flips(routes, stored_routes, s.moe_names)
    for la, n in per_layer.items():
        st.layer_flips[la] = st.layer_flips.get(la, 0) + n
    st.layer_tokens += int(resp.sum())
    lp = r.logprobs[resp].astype(np.float64)
    st.log.add(traj=index, position=pos - prompt, version=version, dlogp=lp - np.asarray(mb.packed.logprobs)[resp],
               flips=flips, layers=len(routes), codes=codes)
    if st.floor_log is not None:
        floor_lp = mb.rep.floor_logprobs[b, pos - prompt].astype(np.float64)
        ff, _ = am.route_flips(routes, {la: mb.rep.floor_experts[la][b, pos] for la in routes})
        st.floor_log.add(traj=index, position=pos - prompt, version=version, dlogp=lp - floor_lp, flips=ff,
                         layers=len(routes))


# ---- the audit ----------------------------------------------------------------------------------------------
def _integrity(store: ts.Store, step: StepFn) -> dict[str, Any]:
    phase = "integrity check (tracestore verify)"
    step(phase, 0, 1)
    rep = ts.verify(store, progress=lambda k, n, _name: step(phase, k, max(n, 1)))
    step(phase, 1, 1)
    d = rep.to_dict()
    return {"ok": not d["errors"], "checked": True, **{k: d[k] for k in ("errors", "entries", "records", "segments",
                                                                           "chunks", "bytes")}}


def _mode_summary(log: am.TokenLog, tally: am.CodeTally | None, hinted: set[str]) -> dict[str, Any]:
    d = log.column("dlogp")
    stats = am.dlogp_summary(d)
    layers = log.column("layers").sum()
    out = {"code_agreement": None, "scale_agreement": None, "one_step_share": None, "multi_step_share": None,
           "router_flip_rate": float(log.column("flips").sum() / layers) if layers else None,
           **{k: stats[k] for k in ("mean_abs_dlogp", "p99_abs_dlogp", "max_abs_dlogp", "k3", "extreme_frac",
                                     "tokens")}}
    if tally is not None and hinted:
        counts = tally.site_counts()
        a = am.agreement(np.stack([counts[h] for h in hinted if h in counts]) if counts else np.zeros(5))
        out.update({k: a[k] for k in ("code_agreement", "scale_agreement", "one_step_share", "multi_step_share")})
    return out


def _site_rows(s: _Setup, tally: am.CodeTally) -> tuple[list[dict], dict[int, dict]]:
    counts = tally.site_counts()
    hinted = set(s.plan.hinted)
    sites, layers = [], {}
    for spec in s.plan.sites:
        if spec.name not in counts:
            continue
        c = counts[spec.name]
        sites.append({"site": spec.name, "layer": spec.layer, "kind": spec.kind, "hinted": spec.name in hinted,
                      "width": spec.width, **am.agreement(c)})
        la = layers.setdefault(spec.layer, {"all": np.zeros(5, np.int64), "hinted": np.zeros(5, np.int64)})
        la["all"] += c
        if spec.name in hinted:
            la["hinted"] += c
    return sites, layers


def _detail(s: _Setup, st: _PassState, floor_abs: np.ndarray, trajs: list[_Traj], bucket: int) -> dict[str, Any]:
    out = {k: [] for k in DETAIL_KEYS}
    layer_counts: dict[int, dict] = {}
    if st.tally is not None:
        out["per_site"], layer_counts = _site_rows(s, st.tally)
    for la in sorted(s.moe_names):
        c = layer_counts.get(la)
        hinted = am.agreement(c["hinted"]) if c is not None else None
        every = am.agreement(c["all"]) if c is not None else None
        out["per_layer"].append({
            "layer": la,
            "hinted_code_agreement": hinted["code_agreement"] if hinted else None,
            "code_agreement": every["code_agreement"] if every else None,
            "one_step_share": every["one_step_share"] if every else None,
            "scale_agreement": every["scale_agreement"] if every else None,
            "router_flip_rate": st.layer_flips.get(la, 0) / st.layer_tokens if st.layer_tokens else None,
        })
    out.update(am.breakdown(st.log, floor_abs, [t.traj_id for t in trajs], bucket, st.tally is not None))
    return out


class _Audit:
    """One audit run (`run_audit`): state shared by its phases."""

    def __init__(self, cfg: AuditConfig, step: StepFn):
        self.cfg, self.step = cfg, step
        self.timing: dict[str, Any] = {"verify_s": 0.0, "setup_s": 0.0, "replay_s": 0.0, "floor_s": 0.0,
                                       "decode_s": 0.0, "concurrent_decode": False, "passes_s": 0.0, "curve_s": 0.0}

    def open(self) -> None:
        cfg = self.cfg
        self.store = ts.open_store(cfg.store, storage_options=cfg.storage_options)
        check_metadata(self.store, cfg.device)  # what cannot work fails before the store is read
        t0 = time.perf_counter()
        self.integrity = (_integrity(self.store, self.step) if cfg.verify else
                          {"ok": None, "checked": False, "errors": [], "entries": None, "records": None,
                           "segments": None, "chunks": None, "bytes": None})
        self.timing["verify_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        self.s = load_setup(self.store, cfg)
        self.reader = self.store.reader()
        self.trajs, skipped = _read_trajectories(self.reader, cfg, bool(self.integrity["errors"]),
                                                 self.s.plan.hinted)
        self.integrity["skipped_trajectories"] = skipped
        if not cfg.verify:
            self.integrity["ok"] = None if not skipped else False
        try:
            self.published = set(tw.list_versions(self.store.url, storage_options=cfg.storage_options))
        except ts.TraceStoreError as e:
            log.warning("cannot list published weights beside %s (%s): auditing with the initial weights",
                        self.store.url, e)
            self.published = set()
        self.chunks = _chunks(self.trajs, self.s.rollout.get("batches"))
        self.timing["setup_s"] = time.perf_counter() - t0

    def passes(self) -> None:
        """Replay, floor and every pass that needs the store's data, one replay batch at a time."""
        s, cfg = self.s, self.cfg
        specs = mode_passes(s.plan)
        self.groups = ap.attribution_groups(s.plan, s.spec.num_layers, cfg.bands) if cfg.attribution else []
        self.units = ap.planner_units(s.plan, s.spec.num_layers, cfg.bands) if cfg.planner else []
        if cfg.attribution:
            specs += attribution_passes(s.plan, self.groups)
        specs += [hint_pass(f"hint:{u.name}", [u]) for u in self.units]
        self.mbs = [(c, pack_micro_batches({t.traj_id: t.num_tokens for t in c if t.data_ok}, cfg.micro_batch_tokens))
                    for c in self.chunks]
        n_mb = sum(len(m) for _, m in self.mbs)
        hinted = set(s.plan.hinted)
        self.states = {sp.name: _PassState(sp, am.TokenLog(), am.CodeTally(s.observable, hinted, s.device)
                                           if sp.observe else None, {}) for sp in specs}
        self.states["bf16"].floor_log = am.TokenLog()
        totals = {"replay decode (FP4, tokens forced)": sum(max(len(t.response) for t in c) for c in self.chunks),
                  "floor decode (bf16, tokens forced)": sum(max(len(t.response) for t in c) for c in self.chunks),
                  "recompute passes (micro-batches x passes)": n_mb * len(specs)}
        done = dict.fromkeys(totals, 0)
        self.replays: list[tuple[_Replay, list]] = []
        self.weights: dict[int, str] = {}
        self.repro = np.zeros(4, np.int64)
        self.n_mb = n_mb
        phase = "recompute passes (micro-batches x passes)"
        for chunk, mbs in self.mbs:
            version = chunk[0].version
            self.weights[version] = _use_weights(s, self.store.url, version, self.published, cfg.storage_options)
            rep, secs = _replay(s, chunk, self.weights[version], self.step, done, totals, cfg.concurrent_decode)
            for key in ("replay_s", "floor_s", "decode_s"):
                self.timing[key] += secs[key]
            self.timing["concurrent_decode"] |= secs["concurrent"]
            light = []
            for mbatch in mbs:
                packed = read_packed(self.reader, mbatch, list(s.plan.hinted), read_kwargs={"fmt": "numpy"})
                mb = _MicroBatch(s, rep, packed)
                self.repro += mb.reproduction()
                for spec in specs:
                    _run_pass(s, mb, self.states[spec.name])
                    done[phase] += 1
                    self.step(phase, done[phase], totals[phase])
                light.append(dataclasses.replace(packed, hints={}, scales={}))
            self.replays.append((rep, light))
        self.timing["passes_s"] = sum(st.seconds for st in self.states.values())

    def curve(self) -> list[dict]:
        """The planner's ranking and its measured curve: the units are tried in ranking order, each on top of the
        units kept so far (one pass per unit); a unit whose pass does not lower the mean |dlogp| is set aside
        (``self.rejected``), and when any was, one last pass hints every unit (the full-coverage point)."""
        s = self.s
        mean_abs = {name: am.dlogp_summary(st.log.column("dlogp"))["mean_abs_dlogp"]
                    for name, st in self.states.items()}
        floor = self.floor_mean
        rne = mean_abs["fp4_rne_own_scales"]
        self.ranking = ap.rank_units(self.units, rne, {u.name: mean_abs[f"hint:{u.name}"] for u in self.units})
        by = {u.name: u for u in self.units}
        order = [by[r["unit"]] for r in self.ranking]
        phase = "coverage curve (units tried on top of the kept ones)"
        total = self.n_mb * len(order)  # at most: the first unit's pass is its hint pass, a full one may follow
        self.step(phase, 0, max(total, 1))
        done = 0
        t0 = time.perf_counter()
        self.curve_passes = 0

        def measure(units: list[ap.SiteGroup]) -> float:
            nonlocal done
            st = _PassState(hint_pass(f"curve:{len(units)}", units), am.TokenLog(), None, {})
            for rep, light in self.replays:
                _use_weights(s, self.store.url, rep.trajs[0].version, self.published, self.cfg.storage_options)
                for packed in light:
                    _run_pass(s, _MicroBatch(s, rep, packed), st)
                    done += 1
                    self.step(phase, done, total)
            self.curve_passes += 1
            return am.dlogp_summary(st.log.column("dlogp"))["mean_abs_dlogp"]

        first = mean_abs[f"hint:{order[0].name}"] if order else None
        points, self.rejected = ap.greedy_curve(order, rne, floor, first, measure)
        self.step(phase, max(done, 1), max(done, 1))
        self.timing["curve_s"] = time.perf_counter() - t0
        return points

    def result(self) -> dict[str, Any]:
        s, cfg = self.s, self.cfg
        states = self.states
        bf16 = states["bf16"]
        floor_d = bf16.floor_log.column("dlogp")
        floor_abs = np.abs(floor_d)
        self.floor_mean = float(np.nanmean(floor_abs)) if floor_abs.size else math.nan
        hinted = set(s.plan.hinted)
        modes = {"floor": _mode_summary(bf16.floor_log, None, hinted)}
        for name in MODE_NAMES[1:]:
            modes[name] = _mode_summary(states[name].log, states[name].tally, hinted)
            modes[name]["excess_over_floor"] = modes[name]["mean_abs_dlogp"] - self.floor_mean
        modes["floor"]["excess_over_floor"] = None
        detail = {name: _detail(s, states[name], floor_abs, self.trajs, cfg.position_bucket)
                  for name in MODE_NAMES[1:]}
        hist = am.histogram({"floor": floor_d, **{n: states[n].log.column("dlogp") for n in MODE_NAMES[1:]}})
        attribution = None
        if cfg.attribution:
            order = ap.attribution_order(self.groups)
            steps = [("routing", states["fp4_hints_replay_routes"].log.column("dlogp")),
                     *[(g.name, states[f"exact:{g.name}"].log.column("dlogp")) for g in order]]
            last = states[f"exact:{order[-1].name}"].tally if order else None
            check = am.agreement(np.stack(list(last.site_counts().values()))) if last is not None else None
            attribution = {"order": [name for name, _ in steps], "groups": [g.to_json() for g in order],
                           **ap.attribute(states[AUDITED_MODE].log.column("dlogp"), floor_d, steps),
                           "exact_code_agreement": check["code_agreement"] if check else None}
        planner = self._planner(modes) if cfg.planner else None
        n_resp = int(sum(len(t.response) for t in self.trajs if t.data_ok))
        rep_lp = [np.array_equal(r.logprobs[b], t.logprobs, equal_nan=True) for r, _ in self.replays
                  for b, t in enumerate(r.trajs)]
        lp_diff = [float(np.nanmax(np.abs(r.logprobs[b].astype(np.float64) - t.logprobs))) if len(t.logprobs)
                   else 0.0 for r, _ in self.replays for b, t in enumerate(r.trajs)]
        route_eq = [0, 0]
        for r, _ in self.replays:
            for la, per in r.experts.items():
                for b, t in enumerate(r.trajs):
                    stored = t.experts.get(s.moe_names[la])
                    if stored is not None:
                        eq = np.all(per[b][: len(stored)] == stored, axis=-1)
                        route_eq[0] += int(eq.sum())
                        route_eq[1] += eq.size
        repro = self.repro
        replay = {
            "decode_path": self.replays[0][0].decode_path if self.replays else None,
            "recorded_decode_path": s.rollout.get("decode"),
            "hints_equal": repro[0] / repro[1] if repro[1] else None,
            "scales_equal": repro[2] / repro[3] if repro[3] else None,
            "routes_equal": route_eq[0] / route_eq[1] if route_eq[1] else None,
            "logprobs_equal": float(np.mean(rep_lp)) if rep_lp else None,
            "max_abs_logprob_diff": max(lp_diff) if lp_diff else None,
            "weights": {str(v): w for v, w in sorted(self.weights.items())},
        }
        replay["reproduced"] = bool(rep_lp) and all(
            replay[k] in (None, 1.0) for k in ("hints_equal", "scales_equal", "routes_equal", "logprobs_equal"))
        by = s.plan.by_name
        result = {
            "audit_format": AUDIT_FORMAT,
            "store": {"url": self.store.url, "trajectories": len(self.reader.traj_ids()),
                      "audited_trajectories": sum(t.data_ok for t in self.trajs), "response_tokens": n_resp,
                      "hinted_sites": list(s.plan.hinted), "fp4_sites": [x.name for x in s.plan.sites],
                      "hint_bytes_per_token": sum(ap.site_bytes_per_token(by[h].width) for h in s.plan.hinted),
                      "policy_versions": sorted({t.version for t in self.trajs}),
                      "model": dataclasses.asdict(s.spec)},
            "integrity": self.integrity,
            "replay": replay,
            "modes": modes,
            "audited_mode": AUDITED_MODE,
            "detail": detail,
            "histogram": hist,
            "attribution": attribution,
            "planner": planner,
            "config": {**dataclasses.asdict(cfg), "device": str(s.device), "storage_options": None,
                       "kernels_backend": tracefp4.resolve_backend(cfg.backend, s.device)},
            "machine": machine_info(),
        }
        return result

    def _planner(self, modes: dict) -> dict[str, Any]:
        s, cfg = self.s, self.cfg
        curve = self.curve()
        rne_excess = modes["fp4_rne_own_scales"]["excess_over_floor"]
        store_bytes = sum(ap.site_bytes_per_token(s.plan.by_name[h].width) for h in s.plan.hinted)
        rr_excess = modes["fp4_hints_replay_routes"]["excess_over_floor"]
        rr_rne = modes["fp4_rne_replay_routes"]["excess_over_floor"]
        best = ap.best_under_budget(curve, REFERENCE_BUDGET)
        target = None
        if cfg.target_excess is not None:
            point = ap.plan_for_target(curve, cfg.target_excess)
            table = (ap.site_table(point["sites"], s.plan, self.store.model, moe_layers=self.store.moe_layers,
                                   top_k=self.store.top_k, num_experts=self.store.num_experts)
                     if point is not None and point["sites"] else None)
            target = {"target_excess": cfg.target_excess, "meets": point is not None, "point": point,
                      "site_table": table}
        return {"units": [u.to_json() for u in self.units], "ranking": self.ranking, "curve": curve,
                "rejected": self.rejected, "rne_excess": rne_excess,
                "store_coverage": {"bytes_per_token": store_bytes, "excess": modes[AUDITED_MODE]["excess_over_floor"],
                                   "excess_vs_rne": ap.excess_ratio(modes[AUDITED_MODE]["excess_over_floor"],
                                                                    rne_excess),
                                   "with_routing_replay": {"excess": rr_excess, "rne_excess": rr_rne,
                                                           "excess_vs_rne": ap.excess_ratio(rr_excess, rr_rne)}},
                "budget": {"bytes_per_token": REFERENCE_BUDGET, "best": best},
                "target": target}


def run_audit(cfg: AuditConfig, on_step: StepFn | None = None) -> dict[str, Any]:
    """Audit the store at ``cfg.store``; returns the JSON-ready result described in the module docstring.

    ``on_step(phase, done, total)`` reports progress of the long phases (first with ``done == 0``).

    Raises `ConfigError` (bad configuration, metadata the audit cannot rebuild from, an unusable checkpoint),
    tracestore's `StoreNotFoundError` / `BackendError`; integrity problems are reported, not raised (a store
    whose every trajectory is unreadable gives a result with ``modes`` empty)."""
    t_start = time.perf_counter()
    cfg.check()
    step = on_step or (lambda *_: None)
    audit = _Audit(cfg, step)
    audit.open()
    if not any(t.data_ok for t in audit.trajs):
        return json_ready(_integrity_only(audit, t_start))
    audit.passes()
    result = audit.result()
    t = audit.timing
    result["timing"] = {"seconds": time.perf_counter() - t_start, **t,
                        "passes": len(audit.states) + getattr(audit, "curve_passes", 0),
                        "micro_batches": audit.n_mb}
    return json_ready({k: result[k] for k in TOP_KEYS})


def _integrity_only(audit: _Audit, t_start: float) -> dict[str, Any]:
    """The result when no trajectory could be audited: integrity, and nothing measured."""
    s = audit.s
    return {"audit_format": AUDIT_FORMAT,
            "store": {"url": audit.store.url, "trajectories": len(audit.reader.traj_ids()),
                      "audited_trajectories": 0, "response_tokens": 0, "hinted_sites": list(s.plan.hinted),
                      "fp4_sites": [x.name for x in s.plan.sites], "hint_bytes_per_token": None,
                      "policy_versions": [], "model": dataclasses.asdict(s.spec)},
            "integrity": audit.integrity, "replay": None, "modes": {}, "audited_mode": AUDITED_MODE, "detail": {},
            "histogram": None, "attribution": None, "planner": None,
            "timing": {"seconds": time.perf_counter() - t_start, **audit.timing, "passes": 0, "micro_batches": 0},
            "config": {**dataclasses.asdict(audit.cfg), "device": str(s.device), "storage_options": None},
            "machine": machine_info()}
