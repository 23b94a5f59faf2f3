"""The arithmetic of `tracerl.audit.plan` on hand-made inputs: layer bands, groups, the attribution's parts, the
planner's ranking and choice of a point, site tables, and the joint planner's hulls, move order and walk."""

import numpy as np
import pytest

from tracerl.audit.plan import (
    SiteGroup,
    attribute,
    attribution_groups,
    attribution_order,
    best_under_budget,
    curve_rows,
    greedy_curve,
    hint_sites_from_table,
    hull_moves,
    joint_curve,
    joint_rows,
    joint_site_table,
    layer_bands,
    option_hull,
    plan_for_target,
    planner_units,
    rank_units,
    site_bytes_per_token,
)
from tracerl.errors import ConfigError
from tracerl.policy import SitePlan, SiteSpec


def _plan(layers=8, hinted=(4, 5, 6, 7)):
    sites = []
    for i in range(layers):
        sites.append(SiteSpec(f"model.layers.{i}.mlp.experts.input", 256, i, "moe_input", f"l{i}"))
        sites.append(SiteSpec(f"model.layers.{i}.mlp.experts.down_proj.input", 256, i, "moe_down", f"l{i}"))
    sites.append(SiteSpec("model.layers.0.self_attn.k_cache", 64, 0, "kv", "a0"))
    return SitePlan(tuple(sites), tuple(f"model.layers.{i}.mlp.experts.input" for i in hinted))


def test_layer_bands():
    assert layer_bands(8, 4) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert layer_bands(40, 4) == [(0, 9), (10, 19), (20, 29), (30, 39)]
    assert layer_bands(5, 2) == [(0, 1), (2, 4)]
    assert layer_bands(3, 8) == [(0, 0), (1, 1), (2, 2)]  # never an empty band
    bands = layer_bands(37, 5)
    assert bands[0][0] == 0 and bands[-1][1] == 36 and all(b[0] == a[1] + 1 for a, b in zip(bands, bands[1:]))
    with pytest.raises(ConfigError):
        layer_bands(8, 0)


def test_groups_cover_every_hintable_site_once():
    plan = _plan()
    for groups in (attribution_groups(plan, 8, 4), planner_units(plan, 8, 3)):
        names = [s for g in groups for s in g.sites]
        assert sorted(names) == sorted(s.name for s in plan.sites if s.kind != "kv")
        assert all(g.bytes_per_token == len(g.sites) * site_bytes_per_token(256) for g in groups)
    att = attribution_groups(plan, 8, 4)
    assert {g.name for g in att if g.hinted} == {"moe-in hinted L4-5", "moe-in hinted L6-7"}
    order = [g.name for g in attribution_order(att)]
    assert order[:2] == ["moe-in unhinted L0-1", "moe-down unhinted L0-1"] and order[-1] == "moe-down unhinted L6-7"
    assert site_bytes_per_token(2048) == 384  # 256 hint bytes + 128 E4M3 scales: the paper's 7,680 B for 20 sites


def test_attribute_parts_and_interaction():
    """Parts are the successive decrements; floor + parts + interaction == total; interaction == residual - floor."""
    rng = np.random.default_rng(0)
    total = rng.normal(0, 4.0, 1000)
    step1 = total * 0.75
    step2 = total * 0.5
    floor = total * 0.4
    a = attribute(total, floor, [("routing", step1), ("g", step2)])
    t = np.abs(total).mean()
    ab = a["mean_abs"]
    assert ab["parts"]["routing"] == pytest.approx(0.25 * t) and ab["parts"]["g"] == pytest.approx(0.25 * t)
    assert ab["residual"] == pytest.approx(0.5 * t) and ab["interaction"] == pytest.approx(0.1 * t)
    assert ab["floor"] + sum(ab["parts"].values()) + ab["interaction"] == pytest.approx(t)
    assert a["mean_sq"]["parts"]["routing"] == pytest.approx((1 - 0.75**2) * np.square(total).mean())
    assert a["dominant"] == "floor" and a["adds_up"] is True
    far = attribute(total, total * 0.01, [("x", total * 0.9)])  # residual 0.9 vs floor 0.01: does not add up
    assert far["adds_up"] is False and far["dominant"] == "x"
    nan_safe = attribute(np.array([np.nan, 1.0]), np.array([0.5, np.nan]), [])
    assert nan_safe["mean_abs"]["total"] == 1.0 and nan_safe["mean_abs"]["residual"] is None


def test_rank_and_choose():
    plan = _plan()
    units = planner_units(plan, 8, 4)
    alone = {u.name: 1.0 - 0.1 * i for i, u in enumerate(units)}  # later units gain more
    alone[units[0].name] = 1.2  # hinting the first unit alone makes it worse
    ranked = rank_units(units, 1.0, alone)
    assert ranked[0]["unit"] == units[-1].name and ranked[-1]["unit"] == units[0].name
    assert [r["gain"] > 0 for r in ranked] == sorted([r["gain"] > 0 for r in ranked], reverse=True)
    curve = [{"k": 0, "bytes_per_token": 0, "excess": 3.0}, {"k": 1, "bytes_per_token": 96, "excess": 1.0},
             {"k": 2, "bytes_per_token": 192, "excess": 0.5}, {"k": 3, "bytes_per_token": 288, "excess": 0.6}]
    assert plan_for_target(curve, 1.0)["k"] == 1 and plan_for_target(curve, 0.55)["k"] == 2
    assert plan_for_target(curve, 5)["k"] == 0 and plan_for_target(curve, 0.1) is None
    assert best_under_budget(curve, 300)["k"] == 2 and best_under_budget(curve, 100)["k"] == 1
    # priced with scale hints, a point over the budget in bytes fits under it
    priced = [dict(c, bytes_per_token_by_encoding={"bytes": c["bytes_per_token"], "lsb": c["bytes_per_token"] * 2 // 3})
              for c in curve]
    assert best_under_budget(priced, 150)["k"] == 1 and best_under_budget(priced, 150, "lsb")["k"] == 2
    assert best_under_budget(priced, 10, "lsb")["k"] == 0
    with pytest.raises(ConfigError, match="'margin'"):
        best_under_budget(priced, 150, "margin")


def test_hint_sites_from_table():
    assert hint_sites_from_table({"sites": [{"name": "a", "width": 64}]}) == ["a"]
    assert hint_sites_from_table([{"name": "b"}]) == ["b"]
    for bad in ({}, {"sites": []}, [{"width": 3}], "x"):
        with pytest.raises(ConfigError):
            hint_sites_from_table(bad)


def test_greedy_curve_sets_aside_a_unit_that_adds_nothing_after_the_kept_ones():
    """Units overlap: B is good alone but adds nothing after A (as a layer's MoE down-projection input after its
    MoE input). The curve keeps A, sets B aside (measured on top of A), keeps C, and ends with every unit; each
    measured set is asked for once, in ranking order."""
    u = {n: SiteGroup(n, "moe_input", None, (0, 0), (f"s{n}",), 100) for n in "ABC"}
    value = {("A",): 6.0, ("A", "B"): 6.5, ("A", "C"): 4.0, ("A", "B", "C"): 4.2}
    asked = []

    def measure(units):
        key = tuple(x.name for x in units)
        asked.append(key)
        return value[key]

    curve, rejected = greedy_curve([u["A"], u["B"], u["C"]], rne=10.0, floor=1.0, first=6.0, measure=measure)
    assert asked == [("A", "B"), ("A", "C"), ("A", "B", "C")]
    assert [(c["k"], c["units"], c["bytes_per_token"], c["mean_abs_dlogp"]) for c in curve] == [
        (0, [], 0, 10.0), (1, ["A"], 100, 6.0), (2, ["A", "C"], 200, 4.0), (3, ["A", "B", "C"], 300, 4.2)]
    assert curve[1]["excess"] == 5.0 and curve[1]["excess_vs_rne"] == pytest.approx(5 / 9)
    assert [(r["unit"], r["k"], r["units"], r["mean_abs_dlogp"]) for r in rejected] == [("B", 2, ["A", "B"], 6.5)]
    labels = [r[1] for r in curve_rows({"curve": curve, "rejected": rejected})]
    assert labels == ["(none: round-to-nearest)", "A", "C", "(every unit)", "set aside: B"]
    # nothing set aside: no extra pass, the last kept point is the full coverage
    asked.clear()
    value[("A", "B")] = 5.0
    value[("A", "B", "C")] = 3.0
    curve, rejected = greedy_curve([u["A"], u["B"], u["C"]], rne=10.0, floor=1.0, first=None, measure=measure)
    assert asked == [("A",), ("A", "B"), ("A", "B", "C")] and rejected == []
    assert [c["units"] for c in curve][-1] == ["A", "B", "C"]
    assert [r[1] for r in curve_rows({"curve": curve, "rejected": []})][-1] == "C"


def _opts(*items):
    return [{"option": o, "bytes_per_token": b, "gain": g} for o, b, g in items]


def test_option_hull_keeps_the_upper_concave_hull_from_the_origin():
    """Options that gain nothing, cost more for no more gain, or lie strictly under the segment between their
    neighbours are not on the hull; of equal options the first given stays (bits before margin at inf); a vertex on
    a straight segment stays (a finer step at the same gain per byte)."""
    opts = _opts(("bits", 384, 6.0), ("m=0", 20, 0.0), ("m=0.02", 100, -1.0), ("m=0.05", 160, 4.0),
                 ("m=0.1", 250, 4.5), ("m=inf", 384, 6.0), ("m=0.2", 300, 3.0), ("nan", 50, float("nan")))
    hull = option_hull(opts)
    # m=0.1 (250, 4.5) lies under the segment (160, 4) - (384, 6) (4.80 there): dropped; m=0.2 gains less than
    # m=0.1 for more bytes: dropped; m=inf ties with bits: the first given (bits) stays
    assert [h["option"] for h in hull] == ["m=0.05", "bits"]
    assert hull[0] is not opts[3] and hull[0] == opts[3]  # copies
    slopes = [g / b for b, g in [(160, 4.0), (384 - 160, 2.0)]]
    assert slopes == sorted(slopes, reverse=True)
    # collinear vertices stay; a move that gains nothing is no vertex
    line = option_hull(_opts(("a", 10, 1.0), ("b", 20, 2.0), ("c", 30, 3.0), ("d", 40, 3.0)))
    assert [h["option"] for h in line] == ["a", "b", "c"]
    # equal bytes: the larger gain; order of the input does not matter otherwise
    assert [h["option"] for h in option_hull(_opts(("x", 10, 1.0), ("y", 10, 2.0)))] == ["y"]
    assert [h["option"] for h in option_hull(_opts(("m=inf", 10, 2.0), ("bits", 10, 2.0)))] == ["m=inf"]
    assert option_hull(_opts(("a", 10, 0.0), ("b", 5, -1.0))) == []
    with pytest.raises(ConfigError, match="bytes_per_token"):
        option_hull(_opts(("a", -1, 1.0)))
    with pytest.raises(ConfigError, match="bytes_per_token"):
        option_hull(_opts(("a", float("inf"), 1.0)))


def test_option_hull_is_concave_and_covers_every_option():
    """On random options: gains rise strictly along the hull, gains per byte never rise, and every option lies on
    or under the hull's piecewise-linear curve from (0, 0), flat past its last vertex."""
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(1, 9))
        b = rng.integers(1, 40, n).astype(float) * (1 if trial % 2 else 7.5)
        g = rng.normal(1.0, 1.0, n)
        opts = _opts(*[(f"o{i}", b[i], g[i]) for i in range(n)])
        hull = option_hull(opts)
        xs = [0.0] + [h["bytes_per_token"] for h in hull]
        ys = [0.0] + [h["gain"] for h in hull]
        assert all(y1 > y0 for y0, y1 in zip(ys, ys[1:]))
        slopes = [(y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:])]
        assert all(s1 <= s0 * (1 + 1e-12) for s0, s1 in zip(slopes, slopes[1:]))
        for o in opts:
            on = float(np.interp(o["bytes_per_token"], xs, ys))  # np.interp is flat past the last vertex
            assert o["gain"] <= on + 1e-9 * max(1.0, abs(on)), (trial, o, hull)


def test_hull_moves_merge_units_by_gain_per_byte_keeping_each_units_order():
    """Moves of all units, best gain per byte first; a unit's upgrade comes after its first step whatever the
    other units offer; ties between units: the unit given first."""
    options = {"A": _opts(("m=0.05", 10, 5.0), ("bits", 30, 7.0)),   # slopes 0.5, then 0.1
               "B": _opts(("bits", 10, 3.0)),                        # 0.3
               "C": _opts(("bits", 20, 2.0), ("m=0.1", 10, 1.0)),    # (10, 1) then (20, 2): collinear, 0.1 each
               "D": _opts(("bits", 10, 1.0))}                        # 0.1, ties with A's upgrade and C's moves
    moves = hull_moves(options)
    assert [(m["unit"], m["option"], m["from"]) for m in moves] == [
        ("A", "m=0.05", None), ("B", "bits", None), ("A", "bits", "m=0.05"), ("C", "m=0.1", None),
        ("C", "bits", "m=0.1"), ("D", "bits", None)]
    up = moves[2]
    assert (up["delta_bytes"], up["delta_gain"], up["bytes_per_token"], up["gain"]) == (20, 2.0, 30, 7.0)
    assert up["gain_per_kb"] == pytest.approx(2.0 / 20 * 1024)
    # a unit's own moves keep their order even when rounding would put a later one ahead
    tricky = {"U": _opts(("a", 3, 0.3), ("b", 6, 0.6), ("c", 9, 0.9))}
    assert [m["option"] for m in hull_moves(tricky)] == ["a", "b", "c"]
    assert hull_moves({"Z": _opts(("bits", 10, -1.0))}) == []


def _units(*names, bits=100):
    return [SiteGroup(n, "moe_input", None, (0, 0), (f"{n}.s0", f"{n}.s1"), bits) for n in names]


def test_joint_curve_keeps_moves_that_lower_the_measured_excess():
    """The plain walk (``lazy=False``) applies each move on top of the kept assignment: kept when the measured mean |dlogp| falls, set
    aside otherwise (measured on top of the moves kept before it); a configuration of one unit is its alone pass
    (not measured again); bytes are the sum of the units' option prices."""
    units = _units("A", "B")
    prices = {"A": {"bits": 100, "margin:m=0.05": 40.5}, "B": {"bits": 100, "margin:m=0.05": 30.25}}
    alone = {"A": {"bits": 6.0, "margin:m=0.05": 7.0}, "B": {"bits": 8.0, "margin:m=0.05": 9.0}}
    rne = 10.0
    options = {u: _opts(*[(o, prices[u][o], rne - alone[u][o]) for o in prices[u]]) for u in prices}
    moves = hull_moves(options)
    assert [(m["unit"], m["option"]) for m in moves] == [("A", "margin:m=0.05"), ("B", "margin:m=0.05"),
                                                         ("A", "bits"), ("B", "bits")]
    value = {(("A", "margin:m=0.05"), ("B", "margin:m=0.05")): 5.0,
             (("A", "bits"), ("B", "margin:m=0.05")): 5.5,  # the upgrade of A does not help after B
             (("A", "margin:m=0.05"), ("B", "bits")): 4.0}
    asked = []

    def measure(assignment):
        asked.append(tuple(assignment.items()))
        return value[tuple(assignment.items())]

    curve, rejected = joint_curve(moves, units, prices, rne, 1.0, measure, alone, lazy=False)
    assert asked == list(value)  # the first move is A's alone pass
    assert [(c["k"], c["assignment"], c["mean_abs_dlogp"]) for c in curve] == [
        (0, {}, 10.0), (1, {"A": "margin:m=0.05"}, 7.0), (2, {"A": "margin:m=0.05", "B": "margin:m=0.05"}, 5.0),
        (3, {"A": "margin:m=0.05", "B": "bits"}, 4.0)]
    assert [c["bytes_per_token"] for c in curve] == [0, 40.5, 70.75, 140.5]
    assert curve[3]["move"] == {"unit": "B", "option": "bits", "from": "margin:m=0.05"}
    assert curve[3]["sites"] == [{"site": "A.s0", "encoding": "margin:m=0.05"},
                                 {"site": "A.s1", "encoding": "margin:m=0.05"},
                                 {"site": "B.s0", "encoding": "bits"}, {"site": "B.s1", "encoding": "bits"}]
    assert curve[1]["excess"] == 6.0 and curve[1]["excess_vs_rne"] == pytest.approx(6 / 9)
    assert [(r["k"], r["assignment"], r["mean_abs_dlogp"], r["bytes_per_token"]) for r in rejected] == [
        (3, {"A": "bits", "B": "margin:m=0.05"}, 5.5, 130.25)]
    assert all(c["with_routing_replay"] is None for c in curve + rejected)
    labels = [r[1] for r in joint_rows({"curve": curve, "rejected": rejected})]
    assert labels == ["(none: round-to-nearest)", "A: m=0.05", "B: m=0.05", "B: m=0.05 -> bits",
                      "set aside: A: m=0.05 -> bits"]
    # a move whose earlier step was set aside applies on top of what was kept (from: not hinted)
    value2 = {(("A", "margin:m=0.05"), ("B", "margin:m=0.05")): 7.5, (("A", "bits"),): 6.0,
              (("A", "bits"), ("B", "margin:m=0.05")): 9.0, (("A", "bits"), ("B", "bits")): 5.0}
    asked.clear()
    value.clear()
    value.update(value2)
    curve, rejected = joint_curve(moves, units, prices, rne, 1.0, measure, alone, lazy=False)
    assert [c["assignment"] for c in curve] == [{}, {"A": "margin:m=0.05"}, {"A": "bits"},
                                                {"A": "bits", "B": "bits"}]
    assert [r["move"] for r in rejected] == [{"unit": "B", "option": "margin:m=0.05", "from": None}]
    assert curve[3]["move"] == {"unit": "B", "option": "bits", "from": None}
    assert asked == [(("A", "margin:m=0.05"), ("B", "margin:m=0.05")), (("A", "bits"), ("B", "bits"))]
    with pytest.raises(ConfigError, match="no such unit"):
        joint_curve([{"unit": "X", "option": "bits"}], units, prices, rne, 1.0, measure)


def test_joint_curve_with_one_option_per_unit_is_the_greedy_curve():
    """Units with only the bits option: the plain joint walk asks for the same sets and gives the same points and units
    set aside as `greedy_curve` on the same numbers (without greedy_curve's last every-unit point)."""
    units = _units("A", "B", "C", "D")
    units[3] = SiteGroup("D", "moe_down", None, (0, 0), ("D.s0",), 50)
    rne = 10.0
    alone = {"A": 7.0, "B": 8.0, "C": 9.5, "D": 9.0}
    together = {("A",): 7.0, ("A", "B"): 7.5, ("A", "D"): 6.0, ("A", "D", "C"): 5.0}
    greedy_asked, joint_asked = [], []

    def g_measure(us):
        greedy_asked.append(tuple(u.name for u in us))
        return together.get(tuple(u.name for u in us), 4.9)

    def j_measure(assignment):
        joint_asked.append(tuple(assignment))
        return together[tuple(assignment)]

    order = {u.name: u for u in units}
    ranking = rank_units(units, rne, alone)
    g_curve, g_rej = greedy_curve([order[r["unit"]] for r in ranking], rne, 1.0, alone[ranking[0]["unit"]],
                                  g_measure)
    moves = hull_moves({u.name: _opts(("bits", u.bytes_per_token, rne - alone[u.name])) for u in units})
    assert [m["unit"] for m in moves] == [r["unit"] for r in ranking]
    j_curve, j_rej = joint_curve(moves, units, {u.name: {"bits": u.bytes_per_token} for u in units}, rne, 1.0,
                                 j_measure, {u: {"bits": v} for u, v in alone.items()}, lazy=False)
    assert g_rej and g_curve[-1]["units"] == [r["unit"] for r in ranking]  # greedy's extra every-unit point
    assert joint_asked == greedy_asked[:-1]
    for g, j in zip(g_curve[:-1], j_curve, strict=True):
        assert (g["k"], g["units"], g["sites"], g["bytes_per_token"], g["mean_abs_dlogp"], g["excess"],
                g["excess_vs_rne"]) == (j["k"], j["units"], [e["site"] for e in j["sites"]], j["bytes_per_token"],
                                        j["mean_abs_dlogp"], j["excess"], j["excess_vs_rne"])
    assert [(r["unit"], r["units"], r["mean_abs_dlogp"]) for r in g_rej] == [
        (r["move"]["unit"], r["units"], r["mean_abs_dlogp"]) for r in j_rej]


def _overlap_case():
    """Three units of the H200 model's shape (audit-h200-joint-on-h100.json): A's margin option is the best first move;
    B gains much alone but little on top of A (A's MoE input fixes most of B's down-projection input); C is
    independent of both. Mean |dlogp| of an assignment: RNE's minus each unit's gain, B's cut to 0.5 next to A."""
    units = _units("A", "B", "C")
    prices = {"A": {"margin:m=0.1": 2500, "bits": 3840}, "B": {"bits": 3840}, "C": {"bits": 3840}}
    gain = {("A", "margin:m=0.1"): 5.0, ("A", "bits"): 6.0, ("B", "bits"): 5.5, ("C", "bits"): 5.0}
    rne = 16.0

    def mean(assignment):
        g = sum(gain[(u, o)] for u, o in assignment.items())
        if "A" in assignment and "B" in assignment:
            g -= gain[("B", "bits")] - 0.5
        return rne - g

    options = {u: _opts(*[(o, b, gain[(u, o)]) for o, b in prices[u].items()]) for u in prices}
    alone = {u: {o: rne - gain[(u, o)] for o in prices[u]} for u in prices}
    return units, prices, hull_moves(options), alone, rne, mean


def test_lazy_joint_curve_re_ranks_overlapping_units_by_their_gain_in_context():
    """The lazy walk measures B on top of A, finds it gains 0.5 for 3,840 B where C still promises 5 (its alone
    key), puts B back with its measured key and keeps C first: at 7,680 B/token A and C in bits (5.0) instead of
    the plain walk's A's margin + B (10.5)."""
    units, prices, moves, alone, rne, mean = _overlap_case()
    assert [(m["unit"], m["option"]) for m in moves][:3] == [("A", "margin:m=0.1"), ("B", "bits"), ("C", "bits")]
    asked = []

    def measure(assignment):
        asked.append(dict(assignment))
        return mean(assignment)

    plain, _ = joint_curve(moves, units, prices, rne, 0.0, measure, alone, lazy=False)
    assert [c["assignment"] for c in plain[:3]] == [{}, {"A": "margin:m=0.1"}, {"A": "margin:m=0.1", "B": "bits"}]
    asked.clear()
    lazy, rejected = joint_curve(moves, units, prices, rne, 0.0, measure, alone)
    assert [c["assignment"] for c in lazy] == [
        {}, {"A": "margin:m=0.1"}, {"A": "margin:m=0.1", "C": "bits"},
        {"A": "bits", "C": "bits"}, {"A": "bits", "C": "bits", "B": "bits"}]
    assert [c["mean_abs_dlogp"] for c in lazy] == [16.0, 11.0, 6.0, 5.0, 4.5]
    assert [c["move"]["from"] for c in lazy[1:]] == [None, None, "margin:m=0.1", None]
    assert rejected == []
    assert all(mean(c["assignment"]) == c["mean_abs_dlogp"] for c in lazy)  # every point is a measured one
    assert asked[:2] == [{"A": "margin:m=0.1", "B": "bits"}, {"A": "margin:m=0.1", "C": "bits"}]
    best = lambda curve: min((c for c in curve if c["bytes_per_token"] <= 7680), key=lambda c: c["excess"])  # noqa: E731
    assert best(lazy)["mean_abs_dlogp"] == 5.0 and best(plain)["mean_abs_dlogp"] == 10.5  # A + C in bits: 7,680 B


def test_lazy_joint_curve_without_overlap_is_the_plain_walk_and_bounded():
    """Units whose gains add up: the lazy walk keeps the moves in the plain walk's order and measures each once;
    ``max_passes`` bounds the re-measurements (past it a move that lowers the mean is kept where it stands)."""
    units = _units("A", "B", "C")
    prices = {"A": {"bits": 100}, "B": {"bits": 100}, "C": {"bits": 50}}
    gain = {"A": 3.0, "B": 2.0, "C": 0.5}
    rne = 10.0
    moves = hull_moves({u: _opts(("bits", prices[u]["bits"], gain[u])) for u in prices})
    alone = {u: {"bits": rne - gain[u]} for u in prices}
    asked: list[dict] = []

    def measure(assignment):
        asked.append(dict(assignment))
        return rne - sum(gain[u] for u in assignment)

    lazy, _ = joint_curve(moves, units, prices, rne, 0.0, measure, alone)
    n_lazy = len(asked)
    asked.clear()
    plain, _ = joint_curve(moves, units, prices, rne, 0.0, measure, alone, lazy=False)
    assert [c["assignment"] for c in lazy] == [c["assignment"] for c in plain]
    assert n_lazy == len(asked) == 2  # the first move is its alone pass
    _, _, moves2, alone2, rne2, mean2 = _overlap_case()
    units2, prices2 = _overlap_case()[:2]
    asked.clear()
    bounded, _ = joint_curve(moves2, units2, prices2, rne2, 0.0, lambda a: asked.append(a) or mean2(a), alone2,
                             max_passes=1)
    # one measurement allowed to be put back: B is measured on top of A (the one pass) and then kept as the plain
    # walk would keep it
    assert [c["assignment"] for c in bounded[:3]] == [{}, {"A": "margin:m=0.1"}, {"A": "margin:m=0.1", "B": "bits"}]


def test_joint_site_table_declares_margin_sites_with_their_keys(tmp_path):
    """A mixed point's site table: bits sites as today, margin sites with the keys a margin site declares
    (FORMAT §2.5; margin inf as "inf"); `tracestore create --site-table` makes a version-5 store of it."""
    import json

    import tracestore as ts
    from tracestore.cli.main import main as tracestore_main

    plan = _plan()
    a, b, c = (s.name for s in plan.sites[:3])
    prices = {"m=0.05 ms=0.05": {b: {"coding": {"values": "gamma", "blocks": "bitmap"}}},
              "m=inf ms=0.5 lsb": {c: {"coding": {"values": "all", "blocks": "all"}}}}
    points = {"m=0.05 ms=0.05": (0.05, 0.05, "byte"), "m=inf ms=0.5 lsb": (float("inf"), 0.5, "lsb")}
    sites = [{"site": a, "encoding": "bits"}, {"site": b, "encoding": "margin:m=0.05 ms=0.05"},
             {"site": c, "encoding": "margin:m=inf ms=0.5 lsb"}]
    table = joint_site_table(sites, prices, points, plan, {"spec": {}, "rollout": {"x": 1}}, moe_layers=["l0"],
                             top_k=2, num_experts=4)
    rows = {r["name"]: r for r in table["sites"]}
    assert rows[a] == {"name": a, "width": 256}
    assert rows[c] == {"name": c, "width": 256, "hint_encoding": "margin", "margin": "inf", "scale_margin": 0.5,
                       "value_coding": "all", "block_coding": "all", "scale_payload": "lsb"}
    assert table["model"]["site_plan"]["hinted"] == [s.name for s in plan.sites if s.name in (a, b, c)]
    assert "rollout" not in table["model"]
    path = tmp_path / "sites.json"
    path.write_text(json.dumps(table))
    assert tracestore_main(["create", str(tmp_path / "mixed"), "--site-table", str(path)]) == 0
    store = ts.open_store(str(tmp_path / "mixed"))
    assert store.sites[b].hint_encoding == "margin" and store.sites[b].margin == 0.05
    assert store.sites[c].margin == float("inf") and store.sites[a].hint_encoding == "bits"
    with pytest.raises(ConfigError, match="no such margin point"):
        joint_site_table([{"site": a, "encoding": "margin:m=9 ms=9"}], prices, points, plan, {}, moe_layers=[],
                         top_k=1, num_experts=1)
    bad = {"m=0.05 ms=0.05": {b: {"coding": {"values": "zigzag", "blocks": "bitmap"}}}}
    with pytest.raises(ConfigError, match="refused by the store"):
        joint_site_table(sites[1:2], bad, points, plan, {}, moe_layers=[], top_k=1, num_experts=1)


def test_floor_rows_sum_columns_only_where_every_site_has_a_value():
    """`floor_rows`: a row per margin site (floor, code / scale bits, the bits encoding's bytes from the site's width,
    each point's bytes) and a total row; a point that did not price a site shows None there and in its total."""
    from tracerl.audit.plan import floor_rows

    floor = {"a": {"bytes_per_token": 1.5, "code_bits_per_token": 10.0, "scale_bits_per_token": 2.0},
             "b": {"bytes_per_token": 2.5, "code_bits_per_token": 18.0, "scale_bits_per_token": 2.0}}
    points = [{"name": "m=0.1 ms=0.1", "site_bytes": {"a": {"width": 256, "bytes_per_token": 7.0},
                                                     "b": {"width": 256, "bytes_per_token": 9.0}}},
              {"name": "m=inf ms=inf", "site_bytes": {"a": {"width": 256, "bytes_per_token": 52.0}}}]
    header, rows = floor_rows({"site_names": ["a", "b"], "entropy_floor": {"sites": floor}, "points": points})
    assert header == ["site", "floor B/token", "code bits/token", "scale bits/token", "bits B/token",
                      "m=0.1 ms=0.1 B/token", "m=inf ms=inf B/token"]
    assert rows == [["a", 1.5, 10.0, 2.0, 48, 7.0, 52.0], ["b", 2.5, 18.0, 2.0, 48, 9.0, None],
                    ["all", 4.0, 28.0, 4.0, 96, 16.0, None]]
