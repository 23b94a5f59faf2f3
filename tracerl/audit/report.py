"""Rendering of a `tracerl.audit.run_audit` result: rich tables for the terminal (`render_terminal`).

Everything here reads the result dict only (what ``--json`` prints), so a saved result renders the same way.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tracerl.audit import plan as ap

#: by-position rows and trajectories shown on the terminal (all of them are in --json / --html)
MAX_POSITION_ROWS = 16
MAX_TRAJECTORY_ROWS = 8


def fmt(v: Any, kind: str = "sci") -> str:
    """A cell: ``pct`` (percent, 3 decimals), ``sci`` (3 significant digits, scientific), ``int``, ``round`` (a
    number rounded to an integer: bytes per token priced over rows), ``dec1`` (one decimal), ``x`` (ratio)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "pct":
        return f"{100 * v:.3f}%"
    if kind == "int":
        return f"{int(v):,}"
    if kind == "round":
        return f"{v:,.0f}"
    if kind == "dec1":
        return f"{v:,.1f}"
    if kind == "x":
        return f"{v:.2f}x"
    return f"{v:.3e}"


def _table(title: str, columns: Sequence[tuple[str, str | None]], rows: Sequence[Sequence[Any]], caption: str = ""):
    from rich.table import Table

    t = Table(title=title, caption=caption or None, title_justify="left", caption_justify="left")
    for name, _ in columns:
        t.add_column(name, justify="left" if _ is None else "right")
    for r in rows:
        t.add_row(*[str(v) if kind is None else fmt(v, kind) for v, (_, kind) in zip(r, columns)])
    return t


def summary_lines(result: Mapping[str, Any]) -> list[str]:
    """The header: store, integrity, replay."""
    st, integ, rep = result["store"], result["integrity"], result.get("replay")
    model = st["model"]
    lines = [f"store {st['url']}: {st['audited_trajectories']} of {st['trajectories']} trajectories audited, "
             f"{st['response_tokens']:,} response tokens, {len(st['hinted_sites'])} of {len(st['fp4_sites'])} FP4 "
             f"sites hinted ({st['hint_bytes_per_token'] or 0:,} B/token); model {model['family']} hidden "
             f"{model['hidden_size']}, {model['num_layers']} layers; policy versions {st['policy_versions']}"]
    if not integ["checked"]:
        lines.append("integrity: not checked (--no-verify)")
    elif integ["ok"] and not integ["skipped_trajectories"]:
        lines.append(f"integrity: OK (tracestore verify: {integ['entries']} log entries, {integ['segments']} segments, "
                     f"{integ['chunks']} chunks, every crc32c checked)")
    else:
        lines.append(f"integrity: FAILED, {len(integ['errors'])} problem(s) found by tracestore verify")
        lines += [f"  {e}" for e in integ["errors"][:10]]
        lines += [f"  skipped {s['traj_id']}: {s['reason']}" for s in integ["skipped_trajectories"][:10]]
    if rep:
        verdict = "reproduced bit for bit" if rep["reproduced"] else "NOT reproduced exactly"
        lines.append(f"replay of the rollout ({rep['decode_path']} decode; recorded {rep['recorded_decode_path']}): "
                     f"{verdict}: hints {fmt(rep['hints_equal'], 'pct')}, scales {fmt(rep['scales_equal'], 'pct')}, "
                     f"routes {fmt(rep['routes_equal'], 'pct')}, log-probs {fmt(rep['logprobs_equal'], 'pct')} "
                     f"equal (max |diff| {fmt(rep['max_abs_logprob_diff'])}); weights {rep['weights']}")
    return lines


def modes_table(result: Mapping[str, Any]):
    cols = [("mode", None), ("code agr.", "pct"), ("1-step", "pct"), ("scale agr.", "pct"), ("router flips", "pct"),
            ("mean |dlogp|", "sci"), ("excess", "sci"), ("p99 |dlogp|", "sci"), ("max |dlogp|", "sci"), ("k3", "sci")]
    rows = [[m, v["code_agreement"], v["one_step_share"], v["scale_agreement"], v["router_flip_rate"],
             v["mean_abs_dlogp"], v.get("excess_over_floor"), v["p99_abs_dlogp"], v["max_abs_dlogp"], v["k3"]]
            for m, v in result["modes"].items()]
    return _table("fidelity by trainer mode (code and scale agreement at hinted sites; excess = mean |dlogp| - "
                  "floor's)", cols, rows, "1-step: share of code mismatches one codebook step apart")


def layer_table(result: Mapping[str, Any], mode: str):
    cols = [("layer", None), ("hinted code agr.", "pct"), ("code agr. (all FP4)", "pct"), ("1-step", "pct"),
            ("scale agr.", "pct"), ("router flips", "pct")]
    rows = [[r["layer"], r["hinted_code_agreement"], r["code_agreement"], r["one_step_share"], r["scale_agreement"],
             r["router_flip_rate"]] for r in result["detail"][mode]["per_layer"]]
    return _table(f"{mode} by layer", cols, rows)


def _slice_cols(first: str) -> list[tuple[str, str | None]]:
    return [(first, None), ("tokens", "int"), ("code agr.", "pct"), ("1-step", "pct"), ("router flips", "pct"),
            ("mean |dlogp|", "sci"), ("floor", "sci"), ("excess", "sci")]


def _slice_row(label: str, r: Mapping[str, Any]) -> list[Any]:
    return [label, r["tokens"], r.get("code_agreement"), r.get("one_step_share"), r["router_flip_rate"],
            r["mean_abs_dlogp"], r["floor_mean_abs_dlogp"], r["excess"]]


def slice_tables(result: Mapping[str, Any], mode: str) -> Iterator[Any]:
    d = result["detail"][mode]
    pos = d["by_position"]
    rows = [_slice_row(f"{r['lo']}-{r['hi']}", r) for r in pos[:MAX_POSITION_ROWS]]
    more = f"{len(pos) - MAX_POSITION_ROWS} more rows in --json / --html" if len(pos) > MAX_POSITION_ROWS else ""
    yield _table(f"{mode} by response position", _slice_cols("positions"), rows, more)
    worst = sorted(d["per_trajectory"], key=lambda r: -(r["excess"] or 0))[:MAX_TRAJECTORY_ROWS]
    yield _table(f"{mode}: trajectories with the largest excess ({len(d['per_trajectory'])} in --json)",
                 _slice_cols("trajectory"), [_slice_row(f"{r['traj_id']} (v{r['policy_version']})", r) for r in worst])
    if len(d["per_policy_version"]) > 1:
        yield _table(f"{mode} by policy version", _slice_cols("version"),
                     [_slice_row(str(r["policy_version"]), r) for r in d["per_policy_version"]])


def attribution_table(result: Mapping[str, Any]):
    a = result["attribution"]
    ab, sq = a["mean_abs"], a["mean_sq"]
    total = ab["total"]
    cols = [("source (made exact in this order)", None), ("part of mean |dlogp|", "sci"), ("share", "pct"),
            ("part of mean dlogp^2", "sci")]
    rows = [["floor (bf16 trainer vs bf16 decode)", ab["floor"], ab["floor"] / total if total else None, sq["floor"]]]
    rows += [[name, part, part / total if total else None, sq["parts"][name]] for name, part in ab["parts"].items()]
    rows.append(["total (fp4_hints, no routing replay)", total, 1.0 if total else None, sq["total"]])
    caption = (f"dominant: {a['dominant']}. residual (every FP4 site exact, routes replayed) {fmt(ab['residual'])} "
               f"vs floor {fmt(ab['floor'])}: total - floor - parts = {fmt(ab['interaction'])} "
               f"({fmt(abs(ab['interaction']) / total if total else None, 'pct')} of total; the parts add up within "
               f"{fmt(a['tolerance'], 'pct')}: {'yes' if a['adds_up'] else 'NO'})")
    return _table("attribution of the rollout/trainer gap by source", cols, rows, caption)


def planner_table(result: Mapping[str, Any]):
    p = result["planner"]
    cols = [("k", None), ("unit added", None), ("B/token", "int"), ("mean |dlogp|", "sci"), ("excess", "sci"),
            ("vs RNE", "x")]
    rows = [list(r) for r in ap.curve_rows(p)]
    sc, best = p["store_coverage"], p["budget"]["best"]
    rr = sc["with_routing_replay"]
    caption = (f"store's coverage: {sc['bytes_per_token']:,} B/token, excess {fmt(sc['excess'])} "
               f"({fmt(sc['excess_vs_rne'], 'x')} RNE's; with routing replay {fmt(rr['excess'])}, "
               f"{fmt(rr['excess_vs_rne'], 'x')} of RNE's with routing replay). ")
    if best is not None:
        caption += (f"Best measured at <= {p['budget']['bytes_per_token']:,} B/token: k={best['k']}, "
                    f"{best['bytes_per_token']:,} B/token, excess {fmt(best['excess'])} "
                    f"({fmt(best['excess_vs_rne'], 'x')} RNE's). ")
    lsb = p["budget"].get("best_by_encoding", {}).get("lsb")
    if lsb is not None and (best is None or lsb["k"] != best["k"]):
        caption += (f"With scale hints (lsb): k={lsb['k']}, {ap.point_bytes(lsb, 'lsb'):,} B/token, excess "
                    f"{fmt(lsb['excess'])} ({fmt(lsb['excess_vs_rne'], 'x')} RNE's, measured with scale bytes). ")
    t = p.get("target")
    if t is not None:
        caption += (f"Target excess {t['target_excess']:g}: " +
                    (f"k={t['point']['k']}, {t['point']['bytes_per_token']:,} B/token" if t["meets"] else
                     "not reached by any measured point"))
    return _table("coverage planner: units in order of gain per byte, each kept if it lowers the measured excess",
                  cols, rows, caption)


def margin_table(result: Mapping[str, Any]):
    mg = result["margin"]
    cols = [("point", None), ("B/token", "int"), ("vs bits", "x"), ("marked values", "pct"), ("marked blocks", "pct"),
            ("code agr.", "pct"), ("unmarked mism.", "int"), ("excess", "sci"), ("vs RNE", "x"),
            ("routes replayed: vs RNE", "x")]
    rows = [[p["name"], p["bytes_per_token"], p["vs_bits"], p["marked_value_fraction"], p["marked_block_fraction"],
             p["code_agreement"], p["unmarked_mismatch"], p["excess"], p["excess_vs_rne"],
             p["with_routing_replay"]["excess_vs_rne"]] for p in mg["points"]]
    front = ", ".join(f"{p['encoding']} {p['name']} ({p['bytes_per_token']:,.0f} B/token, excess {fmt(p['excess'])})"
                      for p in mg["frontier"])
    caption = (f"{len(mg['site_names'])} site(s) ({mg['sites']}); bits encoding of the same sites: "
               f"{mg['bits_bytes_per_token']:,} B/token; entropy floor (what any encoding needs, given the trainer's "
               f"own values): {mg['entropy_floor']['bytes_per_token']:,.1f} B/token. Frontier of every measured "
               f"coverage: {front}.")
    t = mg.get("target")
    if t is not None:
        caption += (f" Cheapest with excess <= {t['target_excess']:g}: " +
                    (f"{t['point']['encoding']} {t['point']['name']}, {t['point']['bytes_per_token']:,.0f} B/token"
                     if t["meets"] else "none measured"))
    return _table("margin exceptions: stored bytes, agreement and excess per margin point (m: value margin in "
                  "ladder steps, ms: scale margin in E4M3 steps)", cols, rows, caption)


FLOOR_CAPTION = ("floor: the entropy of the rollout's codes and block scales given the trainer's own round-to-nearest "
                 "(what any encoding must store at least); bits: one hint bit per value and a scale byte per block; "
                 "each margin point as priced on the audited rows")


def floor_table(result: Mapping[str, Any]):
    """Per margin site: the entropy floor next to what the bits encoding and each margin point store
    (`tracerl.audit.plan.floor_rows`)."""
    header, rows = ap.floor_rows(result["margin"])
    cols = [(header[0], None), *((h, "dec1") for h in header[1:])]
    return _table("entropy floor per site against the stored bytes", cols, rows, FLOOR_CAPTION)


def joint_caption(jp: Mapping[str, Any]) -> str:
    """The joint planner's best point at <= the reference budget, without and with routing replay."""
    best, budget = jp["budget"]["best"], jp["budget"]["bytes_per_token"]
    if best is None:
        return f"No measured point at <= {budget:,} B/token."
    rr = best.get("with_routing_replay") or {}
    units = ", ".join(f"{u} {o.removeprefix('margin:')}" for u, o in best["assignment"].items()) or "nothing encoded"
    return (f"Best measured at <= {budget:,} B/token: k={best['k']} ({units}), {best['bytes_per_token']:,.0f} "
            f"B/token, excess {fmt(best['excess'])} ({fmt(best['excess_vs_rne'], 'x')} RNE's); with routing replay "
            f"{fmt(rr.get('excess'))} ({fmt(rr.get('excess_vs_rne'), 'x')} of RNE's with routing replay).")


def joint_table(result: Mapping[str, Any]):
    """The joint planner's curve (`tracerl.audit.plan.joint_rows`): each kept move, then the moves set aside."""
    jp = result["margin"]["planner"]
    cols = [("k", None), ("move (unit: option)", None), ("B/token", "round"), ("mean |dlogp|", "sci"),
            ("excess", "sci"), ("vs RNE", "x")]
    rows = [list(r) for r in ap.joint_rows(jp)]
    caption = (f"{len(jp['moves'])} move(s) on the units' hulls of (bytes, gain), best gain per byte first, each kept "
               f"if it lowers the measured excess. " + joint_caption(jp))
    return _table("joint planner: sites x encoding (bits or margin exceptions) x margin", cols, rows, caption)


def render_terminal(result: Mapping[str, Any]) -> list[Any]:
    """The report as a list of rich renderables (strings and tables), in print order."""
    out: list[Any] = list(summary_lines(result))
    if not result["modes"]:
        out.append("nothing was measured: no trajectory could be read")
        return out
    mode = result["audited_mode"]
    out.append(modes_table(result))
    out.append(layer_table(result, mode))
    out.extend(slice_tables(result, mode))
    if result["attribution"] is not None:
        out.append(attribution_table(result))
    if result["planner"] is not None:
        out.append(planner_table(result))
    if result.get("margin") is not None:
        out.append(margin_table(result))
        out.append(floor_table(result))
        if result["margin"].get("planner") is not None:
            out.append(joint_table(result))
    t = result["timing"]
    decodes = (f"replay and floor decodes side by side {t['decode_s']:.1f}s (replay {t['replay_s']:.1f}s, floor "
               f"{t['floor_s']:.1f}s)" if t["concurrent_decode"] else
               f"replay decode {t['replay_s']:.1f}s, floor decode {t['floor_s']:.1f}s")
    out.append(f"audit {t['seconds']:.1f}s: verify {t['verify_s']:.1f}s, setup {t['setup_s']:.1f}s, {decodes}, "
               f"{t['passes']} recompute passes over "
               f"{t['micro_batches']} micro-batch(es) {t['passes_s'] + t['curve_s']:.1f}s")
    return out
