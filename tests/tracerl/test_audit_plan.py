"""The arithmetic of `tracerl.audit.plan` on hand-made inputs: layer bands, groups, the attribution's parts, the
planner's ranking and choice of a point, site tables."""

import numpy as np
import pytest

from tracerl.audit.plan import attribute, attribution_groups, attribution_order, SiteGroup, best_under_budget, curve_rows, greedy_curve, hint_sites_from_table, layer_bands, plan_for_target, planner_units, rank_units, site_bytes_per_token
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
