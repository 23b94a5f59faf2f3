"""Attribution of the rollout/trainer log-prob gap by source, and the hint-coverage planner (`tracerl audit`).

Sources and groups
------------------
An audit recomputes the stored tokens several times, turning the sources of rollout/trainer mismatch *exact*
one at a time (`tracerl.audit` runs the passes; this module names them and does the arithmetic):

- **routing**: routing replay, i.e. every MoE layer uses the rollout's recorded experts;
- **an FP4 site group**: every FP4 activation site of the group outputs exactly the rollout's quantized values
  (the rollout's codes and block scales, from the audit's replay of the rollout decode, dequantized with the
  site's global scale), instead of the trainer's own rounding. Groups split the FP4 sites by kind (attention
  projection input, MoE input, MoE down-projection input), by whether the store hints them, and by layer band
  (`layer_bands`: ``bands`` contiguous bands of layers).

KV-cache sites (never hinted) stay as they are in every pass; their share stays in the residual.

Attribution arithmetic (`attribute`)
-----------------------------------
For a pass P, ``d_P`` = logp_train(P) - logp_rollout per response token, and M(P) = mean |d_P| (also reported:
mean d_P^2, ~2 KL(rollout || train) for small gaps). ``total`` is the audited configuration (`fp4_hints` at
the store's hinted sites, own round-to-nearest elsewhere, no routing replay). The sources are made exact
*cumulatively*, in the order the forward meets their effect (`attribution_order`): routing first (so its part
is exactly what routing replay removes, ``M(fp4_hints) - M(fp4_hints_replay_routes)``), then the FP4 groups
from the first layer band to the last. Pass k has sources 1..k exact, and

    part_k = M(pass k-1) - M(pass k)          (pass 0 = total)

Upstream groups are credited with the downstream mismatches they cause (a rounding difference in layer 3 moves
every later activation); a one-at-a-time removal would count such an effect once per source on its path, and
the floor plus those marginal parts came to 2.1x the total (mean d^2) on the demo store. The
parts add up to ``total - residual`` by construction, where ``residual`` = M(every FP4 site exact, routes
replayed): the gap of the two numerical paths with FP4 and routing out of the picture. That is the FP4 model's
own floor; the **floor** part of the report is the measured one (the same tokens through the bf16 trainer
against the bf16 decode path), so

    total = floor + sum(parts) + (residual - floor)

and the parts are said to *add up* when ``|residual - floor| <= ADDITIVITY_TOLERANCE * total`` (mean |dlogp|).
The two floors differ for a physical reason: exact FP4 values at every MoE input snap the residual stream back
to the rollout's at each layer, absorbing some of the path noise that the bf16 model carries to the logits
(on the demo store the residual is 0.67x the floor). The dominant source is the largest of the floor and the
parts.

Coverage planner (`rank_units`, `greedy_curve`, `plan_for_target`)
--------------------------------------------------------------------
Units are (kind, layer band) groups of FP4 sites regardless of what the store hints; a unit's cost is its hint
and scale bytes per token (W/8 + W/16 per site of width W). The planner starts from round-to-nearest with own
scales everywhere (``fp4_rne_own_scales``, nothing hinted) and measures, per unit, the mean |dlogp| with only
that unit hinted (hints and scales from the replayed rollout: exactly what a rollout that recorded them would
have stored). Units are ranked by gain per byte. The curve is built greedily and measured at every step: each
unit in ranking order is tried on top of the units kept so far and kept only if the mean |dlogp| falls (units
overlap: hints at a layer's MoE input fix most of its down-projection input, so a unit good alone can add
nothing after another); units set aside are reported with their measured point, and a last pass hints every
unit. Each point is a measured excess, not an estimate (one recompute pass per unit, plus one). ``--target-excess
X`` picks the cheapest measured point with excess <= X and prints its sites as a site table (`site_table`) that
``tracestore create --site-table`` accepts and that the rollout side turns into a site plan with
`hint_sites_from_table` (``plan_sites(model, hint_sites=hint_sites_from_table(table))``).

Joint planner over sites x encoding x margin (`option_hull`, `hull_moves`, `joint_curve`; ``--margin-planner``)
---------------------------------------------------------------------------------------------------------------
The same units, but each may be stored in one of several encodings: not hinted, ``bits`` (today's layout, the
unit's ``bytes_per_token``) or ``margin:<point>`` (margin exceptions at one of the audit's margin points, priced
at the bytes `tracerl.hints.compact.pack_rows` writes for the replay's marks in the cheapest coding per site).
Each option's value is measured alone: mean |dlogp| with only that unit encoded that way and every other FP4 site
round to nearest with own scales (gain = RNE's mean |dlogp| minus it). Per unit, the options that gain something
and lie on the upper concave hull of (bytes, gain) from (0, 0) give the unit's *moves* (``none -> e1 -> e2 ...``,
each with its gain per byte); an option under the hull (more bytes for less gain per byte than a mix of its
neighbours) is never a move. The moves of every unit are merged by gain per byte, best first, a unit's own moves
staying in hull order (its later moves are upgrades: they gain less per byte). The curve is then walked: each move
sets its unit to its option on top of the kept assignment, the configuration is measured (one recompute pass; a
configuration of one unit is that option's alone pass) and the move is kept when the mean |dlogp| falls, else set
aside. By default the walk is *lazy*: a measured move is kept only if its gain per byte in context still beats
every other move's key (its alone gain per byte until it is measured), else it waits with its measured key. Units
overlap (hints at a layer's MoE input fix most of its down-projection input, so the second gains little on top
of the first): on the H200 model the plain order kept such a move before a better one and reached 0.63x RNE's
excess at 7,680 B/token where bits alone reach 0.39x. With one option per unit the plain walk (``lazy=False``) is
`greedy_curve` without its last every-unit point (units that gain nothing alone are not tried: they have no
move). Every point is measured.
`joint_site_table` turns a point into a site table whose margin sites carry the store keys of their point and the
coding they were priced in (FORMAT §2.5), for ``tracestore create --site-table``.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

import tracestore as ts
from tracefp4.constants import HINTS_PER_BYTE
from tracerl.config import SCALE_ENCODINGS
from tracerl.errors import ConfigError
from tracerl.hints.scalehints import scale_bytes_per_token
from tracerl.policy import SitePlan

#: ``|total - floor - sum(parts)| <= ADDITIVITY_TOLERANCE * total`` in mean |dlogp| (see the module docstring)
ADDITIVITY_TOLERANCE = 0.5
#: site kinds of the attribution groups and planner units, and their short names in group names
KIND_LABELS = {"linear": "attn", "moe_input": "moe-in", "moe_down": "moe-down"}
METRICS = ("mean_abs", "mean_sq")




def site_bytes_per_token(width: int, scale_encoding: str = "bytes") -> int:
    """Stored bytes per token of one hinted NVFP4 site of ``width`` values: W/8 hint bytes plus the block scales,
    W/16 E4M3 bytes (``scale_encoding="bytes"``) or ceil(W/128) bytes of scale hints (``"lsb"``). Raises
    `ConfigError` for an unknown encoding."""
    return width // HINTS_PER_BYTE + scale_bytes_per_token(width, scale_encoding)


def layer_bands(num_layers: int, bands: int) -> list[tuple[int, int]]:
    """``bands`` contiguous, nearly equal bands [lo, hi] (inclusive) covering layers 0 .. num_layers-1 (fewer when
    there are fewer layers than bands). Raises `ConfigError` for bands < 1 or num_layers < 1."""
    if bands < 1 or num_layers < 1:
        raise ConfigError(f"layer bands: need bands >= 1 and num_layers >= 1, got {bands} and {num_layers}")
    n = min(bands, num_layers)
    edges = np.linspace(0, num_layers, n + 1).round().astype(int)
    return [(int(a), int(b) - 1) for a, b in zip(edges[:-1], edges[1:])]


@dataclasses.dataclass(frozen=True)
class SiteGroup:
    """A named set of FP4 activation sites: an attribution group or a planner unit."""

    name: str
    kind: str
    hinted: bool | None  # whether the store hints these sites (None: a planner unit, either)
    layers: tuple[int, int]  # inclusive layer band
    sites: tuple[str, ...]
    bytes_per_token: int  # stored with scale bytes (today's layout)
    #: stored with scale hints instead (scale encoding lsb, FORMAT §2.4); 0: not given
    lsb_bytes_per_token: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "hinted": self.hinted, "layers": list(self.layers),
                "sites": list(self.sites), "bytes_per_token": self.bytes_per_token,
                "lsb_bytes_per_token": self.lsb_bytes_per_token}


def _groups(plan: SitePlan, bands: int, split_hinted: bool, num_layers: int) -> list[SiteGroup]:
    hinted = set(plan.hinted)
    out = []
    for kind, label in KIND_LABELS.items():
        for lo, hi in layer_bands(num_layers, bands):
            sel = [s for s in plan.sites if s.kind == kind and lo <= s.layer <= hi]
            splits = ((True, "hinted"), (False, "unhinted")) if split_hinted else ((None, ""),)
            for flag, word in splits:
                part = [s for s in sel if flag is None or (s.name in hinted) == flag]
                if not part:
                    continue
                band = f"L{lo}" if lo == hi else f"L{lo}-{hi}"
                name = f"{label} {word} {band}".replace("  ", " ")
                out.append(SiteGroup(name, kind, flag, (lo, hi), tuple(s.name for s in part),
                                     sum(site_bytes_per_token(s.width) for s in part),
                                     sum(site_bytes_per_token(s.width, "lsb") for s in part)))
    return out


def attribution_groups(plan: SitePlan, num_layers: int, bands: int) -> list[SiteGroup]:
    """Attribution groups: the non-KV FP4 sites of ``plan`` by kind, hinted or not (in the store), layer band."""
    return _groups(plan, bands, True, num_layers)


def planner_units(plan: SitePlan, num_layers: int, bands: int) -> list[SiteGroup]:
    """Planner units: the non-KV FP4 sites of ``plan`` by kind and layer band (hinted or not)."""
    return _groups(plan, bands, False, num_layers)


def metric(d: np.ndarray, which: str) -> float:
    """``mean_abs`` (mean |d|) or ``mean_sq`` (mean d^2) over the finite entries of ``d``."""
    d = np.asarray(d, dtype=np.float64)
    d = d[np.isfinite(d)]
    if d.size == 0:
        return math.nan
    return float(np.abs(d).mean()) if which == "mean_abs" else float(np.square(d).mean())


def attribution_order(groups: Sequence[SiteGroup]) -> list[SiteGroup]:
    """Groups in the order the forward meets them: by layer band, then attention, MoE input, MoE down."""
    kinds = list(KIND_LABELS)
    return sorted(groups, key=lambda g: (g.layers[0], kinds.index(g.kind), not g.hinted))


def attribute(total: np.ndarray, floor: np.ndarray, steps: Sequence[tuple[str, np.ndarray]]) -> dict[str, Any]:
    """Parts of the gap ``total`` (per-token dlogp of the audited pass) by source (module docstring).

    ``steps``: (source, per-token dlogp with that source and every earlier one exact), in order, the same tokens
    as ``total``; the last step is the residual. ``floor``: the floor's per-token dlogp. Returns ``{metric:
    {"total", "floor", "parts": {source: part}, "sum_of_parts", "residual", "interaction"}, "dominant",
    "adds_up", "tolerance"}`` with interaction = total - floor - sum(parts) = residual - floor."""
    out: dict[str, Any] = {}
    for which in METRICS:
        t = metric(total, which)
        f = metric(floor, which)
        parts, prev = {}, t
        for name, d in steps:
            cur = metric(d, which)
            parts[name] = prev - cur
            prev = cur
        s = f + sum(parts.values())
        out[which] = {"total": t, "floor": f, "parts": parts, "sum_of_parts": s,
                      "residual": prev if steps else None, "interaction": t - s}
    ab = out["mean_abs"]
    candidates = {"floor": ab["floor"], **ab["parts"]}
    out["dominant"] = max(candidates, key=lambda k: candidates[k])
    out["tolerance"] = ADDITIVITY_TOLERANCE
    out["adds_up"] = bool(abs(ab["interaction"]) <= ADDITIVITY_TOLERANCE * ab["total"])
    return out


def rank_units(units: Sequence[SiteGroup], baseline: float, hinted_alone: Mapping[str, float]) -> list[dict]:
    """Units ordered by gain per byte, best first: gain = ``baseline`` (mean |dlogp| with nothing hinted) minus
    ``hinted_alone[unit]`` (mean |dlogp| with only that unit hinted). Units that gain nothing go last, cheapest
    first. Returns ``[{"unit", "gain", "bytes_per_token", "gain_per_kb"}]``."""
    rows = []
    for u in units:
        gain = baseline - hinted_alone[u.name]
        rows.append({"unit": u.name, "gain": gain, "bytes_per_token": u.bytes_per_token,
                     "gain_per_kb": gain / u.bytes_per_token * 1024})
    return sorted(rows, key=lambda r: (r["gain"] <= 0, -r["gain_per_kb"] if r["gain"] > 0 else r["bytes_per_token"]))


def excess_ratio(excess: float | None, rne_excess: float | None) -> float | None:
    """An excess over the floor relative to round-to-nearest's (None unless RNE's excess is positive)."""
    return excess / rne_excess if excess is not None and rne_excess is not None and rne_excess > 0 else None


def curve_point(k: int, units: Sequence[SiteGroup], mean_abs: float, floor: float, rne_excess: float) -> dict:
    """One measured point of the coverage curve: ``units`` (k of them) hinted (measured with the rollout's scale
    bytes; ``bytes_per_token_by_encoding`` also prices the same sites stored with scale hints, whose excess the
    audit of a store of that encoding measures at the store's coverage)."""
    sites = [s for u in units for s in u.sites]
    excess = mean_abs - floor
    return {"k": k, "units": [u.name for u in units], "sites": sites,
            "bytes_per_token": sum(u.bytes_per_token for u in units), "mean_abs_dlogp": mean_abs,
            "bytes_per_token_by_encoding": {"bytes": sum(u.bytes_per_token for u in units),
                                            "lsb": sum(u.lsb_bytes_per_token for u in units)},
            "excess": excess, "excess_vs_rne": excess_ratio(excess, rne_excess)}


def greedy_curve(order: Sequence[SiteGroup], rne: float, floor: float, first: float | None,
                 measure: Callable[[list[SiteGroup]], float]) -> tuple[list[dict], list[dict]]:
    """The measured coverage curve: ``order`` (units, best ranked first) tried one at a time on top of the units
    kept so far; a unit is kept when the mean |dlogp| ``measure(units)`` gives falls below the last kept point's,
    else set aside. ``rne``: mean |dlogp| with nothing hinted; ``first``: the first unit's, already measured
    (its hint pass; None: measured here); ``floor``: the floor's. When a unit was set aside, a last point hints
    every unit. Returns (curve points, units set aside: `curve_point` keys plus ``unit``)."""
    points = [curve_point(0, [], rne, floor, rne - floor)]
    rejected: list[dict] = []
    kept: list[SiteGroup] = []
    for i, u in enumerate(order):
        m = first if i == 0 and first is not None else measure(kept + [u])
        if m < points[-1]["mean_abs_dlogp"]:
            kept.append(u)
            points.append(curve_point(len(kept), kept, m, floor, rne - floor))
        else:
            rejected.append({**curve_point(len(kept) + 1, kept + [u], m, floor, rne - floor), "unit": u.name})
    if rejected:
        points.append(curve_point(len(order), list(order), measure(list(order)), floor, rne - floor))
    return points, rejected


def curve_rows(planner: Mapping[str, Any]) -> list[tuple[int, str, int, float, float, float | None]]:
    """The planner's measured points as table rows (k, what the point adds, bytes per token, mean |dlogp|, excess,
    excess / RNE's): the curve (kept units; "(every unit)" for the full-coverage point after units were set aside),
    then each unit set aside, measured on top of the units kept before it."""
    rejected = planner.get("rejected") or []
    rows = []
    for i, c in enumerate(planner["curve"]):
        label = ("(none: round-to-nearest)" if not c["units"] else
                 "(every unit)" if rejected and i == len(planner["curve"]) - 1 else c["units"][-1])
        rows.append((c["k"], label, c["bytes_per_token"], c["mean_abs_dlogp"], c["excess"], c["excess_vs_rne"]))
    for r in rejected:
        rows.append((r["k"], f"set aside: {r['unit']}", r["bytes_per_token"], r["mean_abs_dlogp"], r["excess"],
                     r["excess_vs_rne"]))
    return rows


#: the joint planner's option of a unit in today's layout (hint bits and scale bytes)
BITS_OPTION = "bits"
#: `option_hull`: a vertex counts as under the segment between its neighbours only by more than this (relative)
HULL_RTOL = 1e-12


def margin_option(point_name: str) -> str:
    """The joint planner's option name of margin exceptions at margin point ``point_name`` (`margin_name`)."""
    return f"margin:{point_name}"


def option_hull(options: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The upper concave hull of one unit's options in (bytes, gain), from (0, 0) (the unit not hinted).

    ``options``: ``[{"option", "bytes_per_token", "gain"}, ...]`` (gain: RNE's mean |dlogp| minus the option's
    alone). Returns the hull's vertices past the origin, cheapest first (copies of the options): gains rise
    strictly and gains per byte never rise. Left out: options that gain nothing (gain <= 0 or NaN); an option with
    no more gain than a cheaper (or equally priced) one; an option strictly under the segment between its
    neighbours. Of options with the same bytes and gain the first given is kept (so ``bits`` before an equal
    ``margin`` point at m = inf); a vertex *on* the segment between its neighbours is kept (a finer step at the
    same gain per byte). Raises `ConfigError` for bytes that are negative or not finite."""
    for o in options:
        b = o["bytes_per_token"]
        if not (isinstance(b, (int, float)) and math.isfinite(b) and b >= 0):
            raise ConfigError(f"option {o.get('option')!r}: bytes_per_token must be a finite number >= 0, got {b!r}")
    gaining = [(i, o) for i, o in enumerate(options) if o["gain"] > 0]  # NaN > 0 is False
    gaining.sort(key=lambda io: (io[1]["bytes_per_token"], -io[1]["gain"], io[0]))
    hull: list[tuple[float, float, Mapping | None]] = [(0.0, 0.0, None)]
    for _, o in gaining:
        b, g = float(o["bytes_per_token"]), float(o["gain"])
        if g <= hull[-1][1]:  # the last vertex has the most gain so far, for no more bytes
            continue
        while len(hull) >= 2:
            (b0, g0, _), (b1, g1, _) = hull[-2], hull[-1]
            # the last vertex strictly under the segment from the one before it to this option: not on the hull
            # (under by more than rounding: a vertex on the segment, as computed in floats, stays)
            up, across = (b1 - b0) * (g - g0), (g1 - g0) * (b - b0)
            if up - across > HULL_RTOL * (abs(up) + abs(across)):
                hull.pop()
            else:
                break
        hull.append((b, g, o))
    return [dict(o) for _, _, o in hull[1:]]


def hull_moves(options: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[dict[str, Any]]:
    """Every unit's hull moves (`option_hull`), merged best gain per byte first.

    ``options``: ``{unit: [{"option", "bytes_per_token", "gain"}, ...]}``; its order breaks ties between units.
    A move sets its unit from the previous hull vertex (``from``: None for not hinted) to ``option``: ``{"unit",
    "option", "from", "bytes_per_token", "gain"`` (the option's), ``"delta_bytes", "delta_gain", "gain_per_kb"}``.
    A unit's moves stay in hull order whatever the rounding of their gains per byte (the lists are merged, not
    sorted); a move that costs no bytes comes first. Raises `ConfigError` as `option_hull`."""
    seqs = []
    for unit, opts in options.items():
        prev_b, prev_g, prev_o, seq = 0.0, 0.0, None, []
        for v in option_hull(opts):
            db, dg = v["bytes_per_token"] - prev_b, v["gain"] - prev_g
            seq.append({"unit": unit, "option": v["option"], "from": prev_o, "bytes_per_token": v["bytes_per_token"],
                        "gain": v["gain"], "delta_bytes": db, "delta_gain": dg,
                        "gain_per_kb": dg / db * 1024 if db > 0 else math.inf})
            prev_b, prev_g, prev_o = v["bytes_per_token"], v["gain"], v["option"]
        seqs.append(seq)
    heads, out = [0] * len(seqs), []
    while True:
        live = [i for i, seq in enumerate(seqs) if heads[i] < len(seq)]
        if not live:
            return out
        best = max(live, key=lambda i: (seqs[i][heads[i]]["gain_per_kb"], -i))  # ties: the unit given first
        out.append(seqs[best][heads[best]])
        heads[best] += 1


def joint_point(k: int, assignment: Mapping[str, str], units: Mapping[str, SiteGroup],
                prices: Mapping[str, Mapping[str, float]], mean_abs: float, floor: float, rne_excess: float,
                move: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One measured point of the joint curve: ``assignment`` ({unit: option}, in the order the units were first
    encoded), its sites with their option (``[{"site", "encoding"}]``), bytes per token (the sum of the units'
    option ``prices``: {unit: {option: bytes}}), mean |dlogp|, excess and its ratio to RNE's, the ``move`` that
    led here (``{"unit", "option", "from"}``; None at k = 0) and ``with_routing_replay`` (None: not measured)."""
    return {"k": k, "move": dict(move) if move is not None else None, "assignment": dict(assignment),
            "units": list(assignment),
            "sites": [{"site": s, "encoding": o} for u, o in assignment.items() for s in units[u].sites],
            "bytes_per_token": sum(prices[u][o] for u, o in assignment.items()), "mean_abs_dlogp": mean_abs,
            "excess": mean_abs - floor, "excess_vs_rne": excess_ratio(mean_abs - floor, rne_excess),
            "with_routing_replay": None}


def joint_curve(moves: Sequence[Mapping[str, Any]], units: Sequence[SiteGroup],
                prices: Mapping[str, Mapping[str, float]], rne: float, floor: float,
                measure: Callable[[dict[str, str]], float],
                alone: Mapping[str, Mapping[str, float]] | None = None, *, lazy: bool = True,
                max_passes: int | None = None) -> tuple[list[dict], list[dict]]:
    """The measured joint curve (module docstring): ``moves`` (`hull_moves`) applied one at a time on top of the
    kept assignment; a move is kept when ``measure(assignment)`` (mean |dlogp| of ``{unit: option}``) falls below
    the last kept point's, else set aside. ``alone``: {unit: {option: mean |dlogp|}} of the options' alone passes,
    used (not measured again) for an assignment of one unit. ``rne``: mean |dlogp| with nothing hinted; ``floor``:
    the floor's; ``prices``: {unit: {option: bytes per token}}.

    ``lazy`` (default): the moves are re-ranked by what they gain *in context* (lazy greedy). A unit's next hull
    move waits in a queue keyed by its gain per byte, first the one its alone pass gives; the best is measured on
    top of the kept assignment and kept only if its measured gain per byte still beats every other key, else it goes
    back with that measured key (a measurement is reused while nothing new was kept). Units that overlap (hints at
    a layer's MoE input fix most of its down-projection input) gain far less on top of each other than alone: the
    plain order (``lazy=False``: the moves as given, each measured once) kept such a move before a better one.
    ``max_passes``: the most measurements (default 3 per move); past it every move is measured once more at most
    and kept if it lowers the mean. A unit's moves stay in hull order; a unit's next move is queued when its
    current one is kept or set aside.

    Returns (curve points from k = 0, moves set aside: `joint_point` keys, measured on top of the moves kept
    before them). Raises `ConfigError` for a move whose unit is not in ``units`` or whose option has no price."""
    by = {u.name: u for u in units}
    for mv in moves:
        if mv["unit"] not in by or mv["option"] not in prices.get(mv["unit"], {}):
            raise ConfigError(f"move {mv['unit']!r} -> {mv['option']!r}: no such unit or no price for that option")
    points = [joint_point(0, {}, by, prices, rne, floor, rne - floor)]
    rejected: list[dict] = []
    kept: dict[str, str] = {}

    def value(cand: dict[str, str], unit: str, option: str) -> tuple[float, bool]:
        """(mean |dlogp| of ``cand``, whether it took a pass: an assignment of one unit reuses its alone pass)."""
        if alone is not None and len(cand) == 1 and option in alone.get(unit, {}):
            return alone[unit][option], False
        return measure(dict(cand)), True

    if not lazy:
        for mv in moves:
            unit, option = mv["unit"], mv["option"]
            cand = {**kept, unit: option}
            m, _ = value(cand, unit, option)
            point = joint_point(len(points), cand, by, prices, m, floor, rne - floor,
                                {"unit": unit, "option": option, "from": kept.get(unit)})
            if m < points[-1]["mean_abs_dlogp"]:
                kept = cand
                points.append(point)
            else:
                rejected.append(point)
        return points, rejected

    budget = 3 * len(moves) if max_passes is None else max_passes
    queued: dict[str, list[tuple[int, Mapping]]] = {}
    for i, mv in enumerate(moves):
        queued.setdefault(mv["unit"], []).append((i, mv))
    heap: list[tuple[float, int, int, float | None]] = []  # (-key, move index, kept count it was measured at, m)

    def queue_next(unit: str) -> None:
        if queued.get(unit):
            i, mv = queued[unit].pop(0)
            heapq.heappush(heap, (-mv["gain_per_kb"], i, -1, None))

    for unit in queued:
        queue_next(unit)
    passes = 0
    while heap:
        neg_key, i, at, m = heapq.heappop(heap)
        unit, option = moves[i]["unit"], moves[i]["option"]
        cand = {**kept, unit: option}
        cur = points[-1]["mean_abs_dlogp"]
        step = {"unit": unit, "option": option, "from": kept.get(unit)}
        if at != len(points) or m is None:  # not measured since the last kept move
            m, fresh = value(cand, unit, option)
            passes += fresh
            if not m < cur:
                rejected.append(joint_point(len(points), cand, by, prices, m, floor, rne - floor, step))
                queue_next(unit)
                continue
            delta = sum(prices[u][o] for u, o in cand.items()) - sum(prices[u][o] for u, o in kept.items())
            key = (cur - m) / delta * 1024 if delta > 0 else math.inf
            if heap and key < -heap[0][0] and passes < budget:  # another move may gain more per byte here
                heapq.heappush(heap, (-key, i, len(points), m))
                continue
        kept = cand
        points.append(joint_point(len(points), cand, by, prices, m, floor, rne - floor, step))
        queue_next(unit)
    return points, rejected


def joint_label(point: Mapping[str, Any]) -> str:
    """What a joint curve point changed: ``"moe-in L0-9: bits"``, ``"moe-in L0-9: m=0.1 ms=0.1 -> bits"``."""
    mv = point.get("move")
    if mv is None:
        return "(none: round-to-nearest)"
    def name(o: str | None) -> str:
        return "none" if o is None else o.removeprefix("margin:")

    return f"{mv['unit']}: {name(mv['option'])}" if mv["from"] is None else \
        f"{mv['unit']}: {name(mv['from'])} -> {name(mv['option'])}"


def joint_rows(planner: Mapping[str, Any]) -> list[tuple[int, str, float, float, float, float | None]]:
    """The joint planner's measured points as table rows (k, the move, bytes per token, mean |dlogp|, excess,
    excess / RNE's): the curve, then each move set aside (measured on top of the moves kept before it)."""
    rows = [(c["k"], joint_label(c), c["bytes_per_token"], c["mean_abs_dlogp"], c["excess"], c["excess_vs_rne"])
            for c in planner["curve"]]
    rows += [(r["k"], "set aside: " + joint_label(r), r["bytes_per_token"], r["mean_abs_dlogp"], r["excess"],
              r["excess_vs_rne"]) for r in planner.get("rejected") or []]
    return rows


def floor_rows(margin: Mapping[str, Any]) -> tuple[list[str], list[list[Any]]]:
    """Per margin site, what any encoding needs next to what each one stores (the audit's ``margin`` result):
    header and rows of (site, its entropy floor in B/token: the rollout's codes and scales given the trainer's own
    round-to-nearest, bits of the codes and of the scales per token, the bits encoding's B/token, then each margin
    point's B/token at that site, None where a point did not price it). Sites in the result's order; a last row
    sums each column (None where a site lacks its value)."""
    floor = margin["entropy_floor"]["sites"]
    points = margin["points"]
    header = ["site", "floor B/token", "code bits/token", "scale bits/token", "bits B/token",
              *(f"{p['name']} B/token" for p in points)]
    rows = []
    for site in margin["site_names"]:
        f = floor.get(site, {})
        priced = [(p.get("site_bytes") or {}).get(site) for p in points]
        width = next((q["width"] for q in priced if q), None)
        row = [f.get("bytes_per_token"), f.get("code_bits_per_token"), f.get("scale_bits_per_token"),
               site_bytes_per_token(width) if width else None, *(q["bytes_per_token"] if q else None for q in priced)]
        rows.append([site, *row])
    rows.append(["all", *(None if any(v is None for v in col) else sum(col) for col in zip(*(r[1:] for r in rows)))])
    return header, rows


def plan_for_target(curve: Sequence[Mapping], target_excess: float) -> Mapping | None:
    """The cheapest measured curve point (fewest bytes per token, then lowest excess) whose excess is at most
    ``target_excess``; None when no measured point reaches it."""
    ok = [p for p in curve if p["excess"] <= target_excess]
    return min(ok, key=lambda p: (p["bytes_per_token"], p["excess"])) if ok else None


def point_bytes(point: Mapping, encoding: str = "bytes") -> int:
    """A curve point's bytes per token with its sites stored in scale ``encoding`` (`SCALE_ENCODINGS`; a point
    without a per-encoding price is priced as ``bytes``). Raises `ConfigError` for an unknown encoding."""
    if encoding not in SCALE_ENCODINGS:
        raise ConfigError(f"scale encoding {encoding!r}: must be one of {', '.join(SCALE_ENCODINGS)}")
    return point.get("bytes_per_token_by_encoding", {}).get(encoding, point["bytes_per_token"])


def best_under_budget(curve: Sequence[Mapping], bytes_per_token: int, encoding: str = "bytes") -> Mapping | None:
    """The measured point with the lowest excess among those of at most ``bytes_per_token`` when its sites are
    stored in scale ``encoding`` (``lsb``: scale hints, 1/8 of the scale bytes; the excess is the one measured
    with the rollout's scale bytes, which scale hints reproduce where the trainer's block scale is within half an
    E4M3 step of the rollout's). Raises `ConfigError` for an unknown encoding."""
    ok = [p for p in curve if point_bytes(p, encoding) <= bytes_per_token]
    return min(ok, key=lambda p: (p["excess"], point_bytes(p, encoding))) if ok else None


def site_table(sites: Sequence[str], plan: SitePlan, store_model: Mapping[str, Any], *, moe_layers: Sequence[str],
               top_k: int, num_experts: int, encodings: Mapping[str, Mapping[str, Any]] | None = None
               ) -> dict[str, Any]:
    """A site table for ``sites`` (hinted FP4 site names of ``plan``): ``{"sites": [{"name", "width", ...}],
    "model", "moe_layers", "top_k", "num_experts"}``, the object ``tracestore create --site-table FILE`` reads.
    ``model`` is the audited store's model metadata with the site plan's hinted set replaced (and no ``rollout``
    entry: a new rollout records its own). ``encodings``: per site the store keys of its hint encoding when it is
    not today's bits (a margin site: ``hint_encoding="margin"``, ``margin``, ``scale_margin`` (numbers or
    ``"inf"``), ``value_coding``, ``block_coding``, ``scale_payload``; FORMAT §2.5), checked as
    `tracestore.Site.from_dict` checks them. Raises `ConfigError` for an empty list, a name that is not a non-KV
    FP4 site, an encoding for a site not in ``sites`` or one the store would refuse."""
    by = plan.by_name
    bad = [s for s in sites if s not in by or by[s].kind == "kv"]
    if bad or not sites:
        raise ConfigError(f"site table: {'no sites' if not sites else f'not hintable FP4 sites: {bad[:4]}'}")
    encodings = dict(encodings or {})
    stray = sorted(set(encodings) - set(sites))
    if stray:
        raise ConfigError(f"site table: encodings given for sites not in the table: {stray[:4]}")
    order = [s.name for s in plan.sites if s.name in set(sites)]
    rows = [{"name": n, "width": by[n].width, **encodings.get(n, {})} for n in order]
    for r in rows:  # the store's own check of a site's keys, before a user hands the table to tracestore create
        try:
            ts.Site.from_dict(r)
        except (ts.TraceStoreError, ValueError, TypeError) as e:
            raise ConfigError(f"site table: site {r['name']!r} as declared ({r}) is refused by the store: "
                              f"{e}") from None
    new_plan = dataclasses.replace(plan, hinted=tuple(order))
    model = {k: v for k, v in store_model.items() if k != "rollout"}
    model["site_plan"] = new_plan.to_json()
    return {"sites": rows, "model": model, "moe_layers": list(moe_layers), "top_k": top_k,
            "num_experts": num_experts}


def margin_site_keys(point: Sequence[Any], coding: Mapping[str, str]) -> dict[str, Any]:
    """The store keys of a margin site (`site_table`'s ``encodings``) at margin point ``point`` ((m, m_s,
    payload); a margin may be ``math.inf`` or the JSON's ``"inf"``) in position ``coding`` (``{"values",
    "blocks"}``, `compact.SiteCoding.to_json`); a margin of inf is ``"inf"`` (JSON has no infinity)."""
    m, ms, payload = point

    def margin(v: Any) -> Any:
        return "inf" if v == "inf" or (isinstance(v, float) and math.isinf(v)) else v

    return {"hint_encoding": "margin", "margin": margin(m), "scale_margin": margin(ms),
            "value_coding": coding["values"], "block_coding": coding["blocks"], "scale_payload": payload}


def joint_site_table(sites: Sequence[Mapping[str, str]], site_prices: Mapping[str, Mapping[str, Mapping[str, Any]]],
                     points: Mapping[str, Sequence[Any]], plan: SitePlan, store_model: Mapping[str, Any], *,
                     moe_layers: Sequence[str], top_k: int, num_experts: int) -> dict[str, Any]:
    """The `site_table` of a joint planner point: ``sites`` its ``[{"site", "encoding"}]`` (encoding ``bits`` or
    ``margin:<point name>``), each margin site declared at its point (``points``: {point name: (m, m_s,
    payload)}) in the coding it was priced in (``site_prices``: {point name: {site: {"coding", ...}}}, the JSON's
    ``margin.planner.site_prices``). Raises `ConfigError` for an encoding that names no given point or a site
    without a price there, and as `site_table`."""
    names, enc = [e["site"] for e in sites], {}
    for e in sites:
        if e["encoding"] == BITS_OPTION:
            continue
        name = e["encoding"].removeprefix("margin:")
        if name not in points or e["site"] not in site_prices.get(name, {}):
            raise ConfigError(f"site table: site {e['site']!r} with encoding {e['encoding']!r}: no such margin point "
                              f"(points: {list(points)}) or no price of the site there")
        enc[e["site"]] = margin_site_keys(points[name], site_prices[name][e["site"]]["coding"])
    return site_table(names, plan, store_model, moe_layers=moe_layers, top_k=top_k, num_experts=num_experts,
                      encodings=enc)


def hint_sites_from_table(table: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[str]:
    """The hinted site names of a site table (an object with ``sites``, or the list itself), for
    ``tracerl.policy.sites.plan_sites(model, hint_sites=...)``: the rollout side's plan from a planner table.
    Raises `ConfigError` when there is no list of named sites."""
    sites = table.get("sites") if isinstance(table, Mapping) else table
    if not isinstance(sites, list) or not sites or not all(isinstance(s, Mapping) and "name" in s for s in sites):
        raise ConfigError("site table: expected a non-empty list of sites with 'name' (or an object with 'sites')")
    return [str(s["name"]) for s in sites]
