"""``tracerl audit STORE``: what a store says about its rollout quantization.

An audit rebuilds the rollout's model from the store's model metadata (``builder``, ``spec``, ``seed``, ``fp4``,
``site_plan``, ``global_scales``, and ``rollout``: decode path, temperature, batches, as `tracerl demo` records
them), loads the policy version each trajectory was generated with when it is published beside the store
(`tracerl.artifacts.weights`; ``--model`` gives a checkpoint instead), and then:

1. **Integrity**: `tracestore.verify` of the store; trajectories whose data cannot be read are left out and
   named, and the failure (with the object) is reported instead of a crash.
2. **Replay** (`replay_batch`): the rollout's decode path (FP4, the stored tokens forced, the recorded batches) run
   again, capturing the E2M1 codes and block scales at *every* FP4 activation site into device buffers; it
   must reproduce the store (hint bits, scales, routed experts, log-probs), and the report says how exactly it
   did. These codes are the reference of code agreement (a store keeps only each code's LSB) and the exact
   values of the attribution and the what-if coverage passes.
3. **Floor**: the same decode path in bf16 with the tokens forced; on a GPU it runs side by side with the
   replay (a second thread, its own CUDA stream; ``concurrent_decode``), which gives the same bits as one after
   the other.
4. **Passes**: the trainer's recompute (`tracerl.train.recompute.QATTrainer`, THD micro-batches read from the store)
   in each configuration, a `PassSpec`: the FP4 sites are driven by `FP4Runtime.substitute` (own rounding,
   the store's scales, the store's hints, hints from the replay, or the replay's exact values), so one
   runtime serves every pass. Metrics are taken on the device per micro-batch (`tracerl.audit.metrics`).
5. **Attribution**, **coverage planner** and, with ``margin_planner``, the **joint planner** over sites x encoding
   x margin: `tracerl.audit.plan` (definitions there). The joint planner needs margin marks at every planner unit's
   site, so the replay marks those too, and prices each site at each margin point once: from the margin pass's
   tally at the margin sites, from the replay's marks of the same response rows elsewhere.

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
| ``margin:<point>`` | RNE elsewhere, the margin sites as margin exceptions at the point (``--margins``) | own |
| ``margin_replay_routes:<point>`` | as margin:<point> | the rollout's |
| ``hint:<unit>@<point>`` | RNE everywhere, the unit's sites margin exceptions at the point (joint planner) | own |
| ``joint:<n>`` | RNE everywhere, n units each in its option: bits (replay) or margin at its point | own (and rollout's) |

JSON (``run_audit``'s result, ``tracerl audit --json``; stable keys, ``audit_format`` 1):

- ``store``: url, trajectories (in the store), audited_trajectories, response_tokens, hinted_sites, fp4_sites,
  hint_bytes_per_token (with each site's scale encoding), site_bytes (per hinted site: scale_encoding, bytes_per_token;
  FORMAT §2.4), policy_versions, model (the spec).
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
- ``margin`` (null without ``margins``): sites (hinted | all), site_names, bits_bytes_per_token, rne_excess,
  rne_excess_with_routing_replay, entropy_floor, points (per margin point: name, margin, scale_margin,
  scale_payload, bytes_per_token, vs_bits, marked_value_fraction, marked_block_fraction, marked_mismatch,
  unmarked_mismatch, code_agreement, scale_agreement, mean_abs_dlogp, excess, excess_vs_rne, with_routing_replay,
  site_bytes), planner (below), frontier (every measured coverage, ``{encoding: bits | margin | mixed, name, sites,
  bytes_per_token, excess, excess_vs_rne}``, cheapest first, each lowering the excess of all cheaper ones), target
  (null, or target_excess, meets, point (a frontier-style entry), site_table: `plan.site_table` of that point, its
  margin sites declared with their store keys; null when it has no sites).
- ``margin.planner`` (null without ``margin_planner``; `tracerl.audit.plan`'s joint planner): options (per unit:
  ``[{option: bits | margin:<point>, bytes_per_token, mean_abs_dlogp (alone), gain}]``), moves (`plan.hull_moves`:
  unit, option, from, bytes_per_token, gain, delta_bytes, delta_gain, gain_per_kb, in the order tried), curve
  (``[{k, move: {unit, option, from}, assignment: {unit: option}, units, sites: [{site, encoding}],
  bytes_per_token (the sum of the units' option prices), mean_abs_dlogp, excess, excess_vs_rne,
  with_routing_replay}]`` from k = 0, round-to-nearest; with_routing_replay is null but on the budget point:
  mean_abs_dlogp, excess, rne_excess (``fp4_rne_replay_routes``'), excess_vs_rne), rejected (moves set aside: the
  same keys, measured on top of the moves kept before them), rne_excess, budget (bytes_per_token: 7,680, best),
  site_prices (per margin point, per priced site: bytes_per_token, row_bytes_per_token, coding, priced_tokens,
  tokens). A margin site's bytes per token (points, options, site_prices) are what a store spends: its rows in the
  cheapest coding plus each row's end (4 B, ``margin_ends.<site>``, FORMAT §2.5).
- ``timing``: seconds, verify_s, setup_s, replay_s, floor_s, decode_s (wall time of both decodes: their sum, or
  less when they ran side by side), concurrent_decode (bool), passes_s, curve_s (the planner's and the joint
  planner's curve passes), passes, micro_batches.
- ``config``, ``machine``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any

import numpy as np

import tracefp4
import tracestore as ts
from tracerl.artifacts import weights as tw
from tracerl.audit import metrics as am
from tracerl.audit import plan as ap
from tracerl.audit.passes import (
    CODE_BINS,
    SCALE_BINS,
    AuditMicroBatch,
    EntropyTally,
    MarginTally,
    PassSpec,
    PassState,
    attribution_passes,
    detail_of,
    hint_pass,
    joint_pass,
    margin_alone_pass,
    margin_passes,
    mode_passes,
    mode_summary,
    run_pass,
)
from tracerl.audit.replay import ReplayBatch, replay_batch
from tracerl.audit.setup import check_metadata, load_setup, read_trajectories, replay_chunks, use_weights
from tracerl.config import AuditConfig, margin_name
from tracerl.hints import pack_micro_batches, read_packed
from tracerl.runlog import StepFn, json_ready, machine_info

log = logging.getLogger(__name__)

AUDIT_FORMAT = 1
AUDITED_MODE = "fp4_hints"
MODE_NAMES = ("floor", "bf16", "fp4_rne_own_scales", "fp4_rne_rollout_scales", "fp4_hints",
              "fp4_hints_replay_routes", "fp4_rne_replay_routes")
TOP_KEYS = ("audit_format", "store", "integrity", "replay", "modes", "audited_mode", "detail", "histogram",
            "attribution", "planner", "margin", "timing", "config", "machine")
#: the planner's reference budget: the paper's default coverage (20 MoE inputs of width 2048)
REFERENCE_BUDGET = 7680
#: about how many response tokens a margin point's bytes are priced over (every k-th token; all of a smaller audit)
MARGIN_PRICED_TOKENS = 4096



# ---- the model ----------------------------------------------------------------------------------------------


# ---- trajectories -------------------------------------------------------------------------------------------


# ---- replay and floor ---------------------------------------------------------------------------------------


# ---- one micro-batch ----------------------------------------------------------------------------------------


# ---- the audit ----------------------------------------------------------------------------------------------
def _integrity(store: ts.Store, step: StepFn) -> dict[str, Any]:
    phase = "integrity check (tracestore verify)"
    step(phase, 0, 1)
    rep = ts.verify(store, progress=lambda k, n, _name: step(phase, k, max(n, 1)))
    step(phase, 1, 1)
    d = rep.to_dict()
    return {"ok": not d["errors"], "checked": True, **{k: d[k] for k in ("errors", "entries", "records", "segments",
                                                                           "chunks", "bytes")}}


class _Audit:
    """One audit run (`run_audit`): state shared by its phases."""

    def __init__(self, cfg: AuditConfig, step: StepFn):
        self.cfg, self.step = cfg, step
        self.timing: dict[str, Any] = {"verify_s": 0.0, "setup_s": 0.0, "replay_s": 0.0, "floor_s": 0.0,
                                       "decode_s": 0.0, "concurrent_decode": False, "passes_s": 0.0, "curve_s": 0.0}
        self.curve_passes = 0  # passes measured after the main loop (the planners' curves)

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
        self.trajs, skipped = read_trajectories(self.reader, cfg, bool(self.integrity["errors"]),
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
        self.chunks = replay_chunks(self.trajs, self.s.rollout.get("batches"))
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
        by = s.plan.by_name
        self.margin_sites = (list(s.plan.hinted) if cfg.margin_sites == "hinted" else
                             [n for n in s.observable if by[n].kind != "kv"]) if cfg.margins else []
        margin_specs = margin_passes(cfg.margins, self.margin_sites)
        specs += margin_specs
        # the joint planner: each unit alone at each margin point; marks (and prices) at every unit's sites
        self.mark_sites = list(self.margin_sites)
        if cfg.margin_planner:
            specs += [margin_alone_pass(u, j, p) for u in self.units for j, p in enumerate(cfg.margins)]
            encoded = set(self.margin_sites)
            self.mark_sites += [x for u in self.units for x in u.sites if x not in encoded]
        # sites whose bytes no margin pass's tally prices: priced from the replay's marks alone
        self.price_sites = self.mark_sites[len(self.margin_sites):]
        self.mbs = [(c, pack_micro_batches({t.traj_id: t.num_tokens for t in c if t.data_ok}, cfg.micro_batch_tokens))
                    for c in self.chunks]
        n_mb = sum(len(m) for _, m in self.mbs)
        hinted = set(s.plan.hinted)
        n_resp = sum(len(t.response) for t in self.trajs if t.data_ok)
        every = -(-n_resp // MARGIN_PRICED_TOKENS)
        self.pricers = [MarginTally(tuple(p), every) for p in cfg.margins] if self.price_sites else []
        tallied = {sp.name for sp in margin_specs if not sp.replay_routes}
        counted = {sp.name: hinted for sp in specs} | {sp.name: set(self.margin_sites) for sp in margin_specs}
        self.states = {sp.name: PassState(sp, am.TokenLog(), am.CodeTally(s.observable, counted[sp.name], s.device)
                                           if sp.observe else None, {},
                                           margin=MarginTally(sp.margin[1], every) if sp.name in tallied else None)
                       for sp in specs}
        self.states["bf16"].floor_log = am.TokenLog()
        if cfg.margins:
            self.states["fp4_rne_own_scales"].entropy = EntropyTally(self.margin_sites)
        totals = {"replay decode (FP4, tokens forced)": sum(max(len(t.response) for t in c) for c in self.chunks),
                  "floor decode (bf16, tokens forced)": sum(max(len(t.response) for t in c) for c in self.chunks),
                  "recompute passes (micro-batches x passes)": n_mb * len(specs)}
        done = dict.fromkeys(totals, 0)
        self.replays: list[tuple[ReplayBatch, list]] = []
        self.weights: dict[int, str] = {}
        self.repro = np.zeros(4, np.int64)
        self.n_mb = n_mb
        phase = "recompute passes (micro-batches x passes)"
        for chunk, mbs in self.mbs:
            version = chunk[0].version
            self.weights[version] = use_weights(s, self.store.url, version, self.published, cfg.storage_options)
            rep, secs = replay_batch(s, chunk, self.weights[version], self.step, done, totals, cfg.concurrent_decode,
                                     cfg.margins, self.mark_sites)
            for key in ("replay_s", "floor_s", "decode_s"):
                self.timing[key] += secs[key]
            self.timing["concurrent_decode"] |= secs["concurrent"]
            light = []
            for mbatch in mbs:
                packed = read_packed(self.reader, mbatch, list(s.plan.hinted), read_kwargs={"fmt": "numpy"})
                mb = AuditMicroBatch(s, rep, packed)
                self.repro += mb.reproduction()
                for spec in specs:
                    run_pass(s, mb, self.states[spec.name])
                    done[phase] += 1
                    self.step(phase, done[phase], totals[phase])
                for j, pricer in enumerate(self.pricers):  # the same response rows a margin pass's tally prices
                    for site in self.price_sites:
                        vm, bm = mb.replay_marks(site, j)
                        pricer.add_marks(site, vm.index_select(0, mb.resp_dev), bm.index_select(0, mb.resp_dev))
                light.append(dataclasses.replace(packed, hints={}, scales={}))
            self.replays.append((rep, light))
        self.timing["passes_s"] = sum(st.seconds for st in self.states.values())

    def curve(self) -> list[dict]:
        """The planner's ranking and its measured curve: the units are tried in ranking order, each on top of the
        units kept so far (one pass per unit); a unit whose pass does not lower the mean |dlogp| is set aside
        (``self.rejected``), and when any was, one last pass hints every unit (the full-coverage point)."""
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

        def measure(units: list[ap.SiteGroup]) -> float:
            nonlocal done
            m = self._recompute(hint_pass(f"curve:{len(units)}", units), phase, done, total)
            done += self.n_mb
            return m

        first = mean_abs[f"hint:{order[0].name}"] if order else None
        points, self.rejected = ap.greedy_curve(order, rne, floor, first, measure)
        self.step(phase, max(done, 1), max(done, 1))
        self.timing["curve_s"] = time.perf_counter() - t0
        return points

    def _recompute(self, spec: PassSpec, phase: str, done: int, total: int) -> float:
        """Mean |dlogp| of one more pass ``spec`` over every audited micro-batch (the kept replays), reporting
        progress ``done + i`` of ``total`` in ``phase``; counts it in ``curve_passes``."""
        s = self.s
        st = PassState(spec, am.TokenLog(), None, {})
        for rep, light in self.replays:
            use_weights(s, self.store.url, rep.trajs[0].version, self.published, self.cfg.storage_options)
            for packed in light:
                run_pass(s, AuditMicroBatch(s, rep, packed), st)
                done += 1
                self.step(phase, done, total)
        self.curve_passes += 1
        return am.dlogp_summary(st.log.column("dlogp"))["mean_abs_dlogp"]

    def result(self) -> dict[str, Any]:
        s, cfg = self.s, self.cfg
        states = self.states
        bf16 = states["bf16"]
        floor_d = bf16.floor_log.column("dlogp")
        floor_abs = np.abs(floor_d)
        self.floor_mean = float(np.nanmean(floor_abs)) if floor_abs.size else math.nan
        hinted = set(s.plan.hinted)
        modes = {"floor": mode_summary(bf16.floor_log, None, hinted)}
        for name in MODE_NAMES[1:]:
            modes[name] = mode_summary(states[name].log, states[name].tally, hinted)
            modes[name]["excess_over_floor"] = modes[name]["mean_abs_dlogp"] - self.floor_mean
        modes["floor"]["excess_over_floor"] = None
        detail = {name: detail_of(s, states[name], floor_abs, self.trajs, cfg.position_bucket)
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
        margin = self._margin(modes, planner) if cfg.margins else None
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
        enc = {h: self.store.sites[h].scale_encoding for h in s.plan.hinted}
        result = {
            "audit_format": AUDIT_FORMAT,
            "store": {"url": self.store.url, "trajectories": len(self.reader.traj_ids()),
                      "audited_trajectories": sum(t.data_ok for t in self.trajs), "response_tokens": n_resp,
                      "hinted_sites": list(s.plan.hinted), "fp4_sites": [x.name for x in s.plan.sites],
                      "hint_bytes_per_token": sum(ap.site_bytes_per_token(by[h].width, enc[h]) for h in s.plan.hinted),
                      # per hinted site: its scale encoding (FORMAT §2.4) and stored bytes per token
                      "site_bytes": {h: {"scale_encoding": enc[h], "bytes_per_token":
                                         ap.site_bytes_per_token(by[h].width, enc[h])} for h in s.plan.hinted},
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
            "margin": margin,
            "config": {**dataclasses.asdict(cfg), "device": str(s.device), "storage_options": None,
                       "margins": [margin_name(p) for p in cfg.margins],
                       "kernels_backend": tracefp4.resolve_backend(cfg.backend, s.device)},
            "machine": machine_info(),
        }
        return result

    def _planner(self, modes: dict) -> dict[str, Any]:
        s, cfg = self.s, self.cfg
        curve = self.curve()
        rne_excess = modes["fp4_rne_own_scales"]["excess_over_floor"]
        store_bytes = sum(ap.site_bytes_per_token(s.plan.by_name[h].width, self.store.sites[h].scale_encoding)
                          for h in s.plan.hinted)
        rr_excess = modes["fp4_hints_replay_routes"]["excess_over_floor"]
        rr_rne = modes["fp4_rne_replay_routes"]["excess_over_floor"]
        best = ap.best_under_budget(curve, REFERENCE_BUDGET)
        # the same budget with scale hints: more sites fit (272 instead of 384 B/token at width 2,048)
        best_lsb = ap.best_under_budget(curve, REFERENCE_BUDGET, "lsb")
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
                "budget": {"bytes_per_token": REFERENCE_BUDGET, "best": best,
                           "best_by_encoding": {"bytes": best, "lsb": best_lsb}},
                "target": target}


    def _point_prices(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per margin point name: per site that any margin pass encodes or the joint planner prices, what
        `MarginTally.site_bytes` gives (the margin passes' sites, with their counts) or `MarginTally.prices` (the
        other sites, priced from the replay's marks alone); each site priced once."""
        by = self.s.plan.by_name
        widths = {x: by[x].width for x in self.mark_sites}
        out = {}
        for j, point in enumerate(self.cfg.margins):
            name = margin_name(point)
            out[name] = self.states[f"margin:{name}"].margin.site_bytes(widths)
            if self.pricers:
                out[name].update(self.pricers[j].prices(widths))
        return out

    def _margin(self, modes: dict, planner: dict | None) -> dict[str, Any]:
        """The margin points (`margin_passes`): stored bytes per token (the coding `compact.choose_coding` picks
        per site, priced over about `MARGIN_PRICED_TOKENS` response tokens), marks, code agreement and mismatches
        (every response token), excess with own routes and with routing replay; the entropy floor of the sites;
        the joint planner over sites x encoding x margin (`_joint`, with ``margin_planner``); and every measured
        coverage (the planner's bits points, these, the joint planner's) as one frontier."""
        s, cfg = self.s, self.cfg
        by = s.plan.by_name
        sites = self.margin_sites
        rne, rr_rne = (modes[k]["excess_over_floor"] for k in ("fp4_rne_own_scales", "fp4_rne_replay_routes"))
        today = sum(ap.site_bytes_per_token(by[x].width) for x in sites)
        prices = self._point_prices()
        points = []
        for point in cfg.margins:
            name = margin_name(point)
            st, rr = self.states[f"margin:{name}"], self.states[f"margin_replay_routes:{name}"]
            own, routed = (mode_summary(x.log, x.tally, set(sites)) for x in (st, rr))
            sb = {x: prices[name][x] for x in sites}
            tot = {k: sum(v[k] for v in sb.values()) for k in ("values", "marked_values", "blocks", "marked_blocks",
                                                                "marked_mismatch", "unmarked_mismatch")}
            nbytes = sum(v["bytes_per_token"] or 0.0 for v in sb.values())
            excess, rr_excess = own["mean_abs_dlogp"] - self.floor_mean, routed["mean_abs_dlogp"] - self.floor_mean
            m, ms, payload = point
            points.append({
                "name": name, "margin": m if math.isfinite(m) else "inf",
                "scale_margin": ms if math.isfinite(ms) else "inf", "scale_payload": payload,
                "bytes_per_token": nbytes, "vs_bits": nbytes / today if today else None,
                "marked_value_fraction": tot["marked_values"] / tot["values"] if tot["values"] else None,
                "marked_block_fraction": tot["marked_blocks"] / tot["blocks"] if tot["blocks"] else None,
                "marked_mismatch": tot["marked_mismatch"], "unmarked_mismatch": tot["unmarked_mismatch"],
                "code_agreement": own["code_agreement"], "scale_agreement": own["scale_agreement"],
                "mean_abs_dlogp": own["mean_abs_dlogp"], "excess": excess, "excess_vs_rne": ap.excess_ratio(excess, rne),
                "with_routing_replay": {"code_agreement": routed["code_agreement"],
                                        "mean_abs_dlogp": routed["mean_abs_dlogp"], "excess": rr_excess,
                                        "excess_vs_rne": ap.excess_ratio(rr_excess, rr_rne)},
                "site_bytes": sb})
        joint = self._joint(modes, prices) if cfg.margin_planner else None
        measured = [{"encoding": "margin", "name": p["name"], "sites": len(sites), "bytes_per_token":
                     p["bytes_per_token"], "excess": p["excess"], "excess_vs_rne": p["excess_vs_rne"]} for p in points]
        sources: dict[tuple[str, str], Any] = {("margin", p["name"]): p for p in points}
        for encoding, curve in (("bits", planner["curve"] if planner is not None else []),
                                ("mixed", joint["curve"] if joint is not None else [])):
            for c in curve:
                measured.append({"encoding": encoding, "name": f"k={c['k']}", "sites": len(c["sites"]),
                                 "bytes_per_token": c["bytes_per_token"], "excess": c["excess"],
                                 "excess_vs_rne": c["excess_vs_rne"]})
                sources[(encoding, f"k={c['k']}")] = c
        measured.sort(key=lambda p: (p["bytes_per_token"], p["excess"]))
        frontier, best = [], math.inf
        for p in measured:  # cheapest first: a point is on the frontier when it lowers the excess of every cheaper one
            if p["excess"] < best:
                frontier.append(p)
                best = p["excess"]
        target = None
        if cfg.target_excess is not None:
            point = ap.plan_for_target(measured, cfg.target_excess)
            table = (self._site_table(point, sources[(point["encoding"], point["name"])], prices)
                     if point is not None and point["sites"] else None)
            target = {"target_excess": cfg.target_excess, "meets": point is not None, "point": point,
                      "site_table": table}
        floor = self.states["fp4_rne_own_scales"].entropy.site_floor()
        return {"sites": cfg.margin_sites, "site_names": sites, "bits_bytes_per_token": today, "rne_excess": rne,
                "rne_excess_with_routing_replay": rr_rne,
                "entropy_floor": {"bytes_per_token": sum(v["bytes_per_token"] for v in floor.values()),
                                  "code_bins_per_step": CODE_BINS, "scale_bins_per_step": SCALE_BINS, "sites": floor},
                "points": points, "planner": joint, "frontier": frontier, "target": target}

    def _site_table(self, summary: dict, point: dict, prices: dict) -> dict[str, Any]:
        """The site table (`ap.site_table`) of a measured coverage of any encoding: ``summary`` its frontier entry
        (``encoding`` bits, margin or mixed), ``point`` the planner's curve point, the margin point or the joint
        curve point it names; margin sites carry the store keys of their point and the coding they were priced in."""
        s = self.s
        points = {margin_name(p): p for p in self.cfg.margins}
        if summary["encoding"] == "bits":
            sites = [{"site": x, "encoding": ap.BITS_OPTION} for x in point["sites"]]
        elif summary["encoding"] == "margin":
            sites = [{"site": x, "encoding": ap.margin_option(point["name"])} for x in self.margin_sites]
        else:
            sites = point["sites"]
        return ap.joint_site_table(sites, prices, points, s.plan, self.store.model, moe_layers=self.store.moe_layers,
                                   top_k=self.store.top_k, num_experts=self.store.num_experts)

    def _joint(self, modes: dict, prices: dict) -> dict[str, Any]:
        """The joint planner over sites x encoding x margin (`ap.hull_moves`, `ap.joint_curve`): per planner unit
        the options bits (its ``hint:<unit>`` pass) and margin exceptions at each point (``hint:<unit>@<point>``,
        priced at the sum of its sites' bytes at that point), their hull moves, the measured curve (one pass per
        move tried, but those of one unit), and the best point at <= `REFERENCE_BUDGET` B/token measured once more
        with routing replay. The walk re-ranks the moves by their measured gain in context (`ap.joint_curve`'s lazy
        walk): on the H200 model the plain order kept moe-down L0-9 in bits on top of moe-in L0-9, whose hints fix
        most of it, before moe-in L10-19."""
        cfg = self.cfg
        floor = self.floor_mean

        def mean(name: str) -> float:
            return am.dlogp_summary(self.states[name].log.column("dlogp"))["mean_abs_dlogp"]

        rne = mean("fp4_rne_own_scales")
        options, unit_prices, alone = {}, {}, {}
        for u in self.units:
            opts = [(ap.BITS_OPTION, u.bytes_per_token, mean(f"hint:{u.name}"))]
            for point in cfg.margins:
                name = margin_name(point)
                site_b = [prices[name][x]["bytes_per_token"] for x in u.sites]
                if any(b is None for b in site_b):  # no response rows priced: an option without a price
                    log.warning("joint planner: %s at %s has no priced rows; option left out", u.name, name)
                    continue
                opts.append((ap.margin_option(name), sum(site_b), mean(f"hint:{u.name}@{name}")))
            options[u.name] = [{"option": o, "bytes_per_token": b, "mean_abs_dlogp": m, "gain": rne - m}
                               for o, b, m in opts]
            unit_prices[u.name] = {o: b for o, b, _ in opts}
            alone[u.name] = {o: m for o, _, m in opts}
        moves = ap.hull_moves(options)
        phase = "joint planner (moves tried on top of the kept ones, the budget point with routing replay)"
        # at most: the lazy walk's measurements (`ap.joint_curve`'s bound) and the budget point's routing replay
        total = max(self.n_mb * (3 * len(moves) + 1), 1)
        self.step(phase, 0, total)
        done = 0
        t0 = time.perf_counter()
        by = {u.name: u for u in self.units}

        def measure(assignment: dict[str, str], replay_routes: bool = False) -> float:
            nonlocal done
            spec = joint_pass(f"joint:{len(assignment)}", assignment, by, cfg.margins, replay_routes=replay_routes)
            m = self._recompute(spec, phase, done, total)
            done += self.n_mb
            return m

        curve, rejected = ap.joint_curve(moves, self.units, unit_prices, rne, floor, measure, alone)
        best = ap.best_under_budget(curve, REFERENCE_BUDGET)
        rr_rne = modes["fp4_rne_replay_routes"]
        if best is not None:
            m = (measure(best["assignment"], replay_routes=True) if best["assignment"] else
                 rr_rne["mean_abs_dlogp"])  # nothing encoded: RNE with the rollout's routes, measured already
            best["with_routing_replay"] = {
                "mean_abs_dlogp": m, "excess": m - floor, "rne_excess": rr_rne["excess_over_floor"],
                "excess_vs_rne": ap.excess_ratio(m - floor, rr_rne["excess_over_floor"])}
        self.step(phase, max(done, 1), max(done, 1))
        self.timing["curve_s"] += time.perf_counter() - t0
        keep = ("bytes_per_token", "coding", "priced_tokens", "tokens")
        return {"options": options, "moves": moves, "curve": curve, "rejected": rejected,
                "rne_excess": modes["fp4_rne_own_scales"]["excess_over_floor"],
                "budget": {"bytes_per_token": REFERENCE_BUDGET, "best": best},
                "site_prices": {name: {x: {k: v[k] for k in keep} for x, v in per.items()}
                                for name, per in prices.items()}}


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
                        "passes": len(audit.states) + audit.curve_passes,
                        "micro_batches": audit.n_mb}
    return json_ready({k: result[k] for k in TOP_KEYS})


def _integrity_only(audit: _Audit, t_start: float) -> dict[str, Any]:
    """The result when no trajectory could be audited: integrity, and nothing measured."""
    s = audit.s
    return {"audit_format": AUDIT_FORMAT,
            "store": {"url": audit.store.url, "trajectories": len(audit.reader.traj_ids()),
                      "audited_trajectories": 0, "response_tokens": 0, "hinted_sites": list(s.plan.hinted),
                      "fp4_sites": [x.name for x in s.plan.sites], "hint_bytes_per_token": None,
                      "site_bytes": None,
                      "policy_versions": [], "model": dataclasses.asdict(s.spec)},
            "integrity": audit.integrity, "replay": None, "modes": {}, "audited_mode": AUDITED_MODE, "detail": {},
            "histogram": None, "attribution": None, "planner": None, "margin": None,
            "timing": {"seconds": time.perf_counter() - t_start, **audit.timing, "passes": 0, "micro_batches": 0},
            "config": {**dataclasses.asdict(audit.cfg), "device": str(s.device), "storage_options": None,
                       "margins": [margin_name(p) for p in audit.cfg.margins]},
            "machine": machine_info()}
