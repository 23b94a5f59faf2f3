"""``tracerl audit --html FILE``: a self-contained HTML page of a `tracerl.audit.run_audit` result.

One file, no external references: CSS inline, plots as PNG data URIs (matplotlib, Agg backend). The page holds the
integrity result of `tracestore verify` for the store, the replay's verdict, the fidelity table per mode, four
plots (code agreement by layer, the |dlogp| histogram against the floor, mismatch by token position, excess vs
hint bytes per token, with the margin points and the joint planner's curve when measured), the attribution, the
planner's curve, the margin points, the entropy floor per site beside each encoding's bytes and the joint planner's
curve (with ``--margins`` / ``--margin-planner``), and the per-site and per-trajectory tables.
Like `tracerl.audit.report`, it reads the result dict only.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from tracerl.audit import plan as ap
from tracerl.audit.report import FLOOR_CAPTION, fmt, joint_caption
from tracerl.errors import ConfigError

PLOT_MODES = ("fp4_rne_own_scales", "fp4_rne_rollout_scales", "fp4_hints", "fp4_hints_replay_routes")
COLORS = {"floor": "#555555", "bf16": "#8c564b", "fp4_rne_own_scales": "#d62728", "fp4_rne_rollout_scales": "#ff7f0e",
          "fp4_hints": "#1f77b4", "fp4_hints_replay_routes": "#2ca02c"}
CSS = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: right; }
th { background: #f3f3f3; } td.l, th.l { text-align: left; }
.ok { color: #1a7f37; font-weight: bold; } .bad { color: #c62828; font-weight: bold; }
.plots img { width: 560px; margin: 4px; border: 1px solid #eee; vertical-align: top; }
.plots img.wide { width: 1128px; }
pre { background: #f7f7f7; padding: 8px; white-space: pre-wrap; font-size: 12px; }
p.note { font-size: 13px; color: #444; }
"""


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ConfigError(f"--html needs matplotlib ({e}); pip install matplotlib") from None
    return plt


def _png(fig) -> str:
    fig.tight_layout()  # side-by-side panels: a y label clear of its neighbour's ticks
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    fig.clf()
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _num(v: Any) -> float:
    return math.nan if v is None else float(v)


def plot_layers(plt, result: Mapping[str, Any]) -> str:
    """Code agreement (every FP4 site of the layer) and router flip rate by layer, per FP4 mode."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for mode in PLOT_MODES:
        rows = result["detail"][mode]["per_layer"]
        layers = [r["layer"] for r in rows]
        ax1.plot(layers, [100 * _num(r["code_agreement"]) for r in rows], "o-", color=COLORS[mode], label=mode)
        ax2.plot(layers, [100 * _num(r["router_flip_rate"]) for r in rows], "o-", color=COLORS[mode], label=mode)
    hinted = sorted({s["layer"] for s in result["detail"]["fp4_hints"]["per_site"] if s["hinted"]})
    for la in hinted:
        ax1.axvspan(la - 0.5, la + 0.5, color="#1f77b4", alpha=0.07, lw=0)
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    ax1.set(xlabel="layer (shaded: hinted sites)", ylabel="code agreement, all FP4 sites (%)",
            title="FP4 code agreement by layer")
    ax2.set(xlabel="layer", ylabel="router flips (% of tokens)", title="router flips by layer")
    ax1.legend(fontsize=7)
    return _png(fig)


def plot_histogram(plt, result: Mapping[str, Any]) -> str:
    """|dlogp| per mode on shared log bins, against the floor's."""
    h = result["histogram"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    edges = h["edges"]
    for name in ("floor", "fp4_rne_own_scales", "fp4_hints", "fp4_hints_replay_routes"):
        counts = h["counts"].get(name)
        if counts and edges:
            ax.stairs(counts, edges, color=COLORS[name], lw=2.2 if name == "floor" else 1.4,
                      label=f"{name} ({h['zero'][name]} exact zeros)")
    ax.set_xscale("log")
    ax.set(xlabel="|logp_train - logp_rollout| (floor: bf16 trainer vs bf16 decode)", ylabel="tokens",
           title="|dlogp| against the floor")
    ax.legend(fontsize=7)
    return _png(fig)


def _by_position(ax, rows: list[Mapping[str, Any]], value, **style) -> None:
    """Values of response-position buckets ``[lo, hi)`` as steps over each bucket's whole range, marked at its
    middle (a lone bucket is a segment across the responses, not one point on an axis of its own)."""
    if not rows:
        return
    edges = [r["lo"] for r in rows] + [rows[-1]["hi"]]
    values = [value(r) for r in rows]
    line = ax.stairs(values, edges, lw=1.6, baseline=None, color=style.get("color"), ls=style.pop("ls", "-"))
    ax.plot([(r["lo"] + r["hi"]) / 2 for r in rows], values, style.pop("marker", "o"), color=line.get_edgecolor(),
            label=style.get("label"))
    ax.set_xlim(edges[0], edges[-1])
    ax.margins(y=0.1)  # a bucket's level clear of the frame


def plot_positions(plt, result: Mapping[str, Any]) -> str:
    """Code mismatch rate at hinted sites and mean |dlogp| (with the floor) by response position."""
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for mode in ("fp4_rne_own_scales", "fp4_hints"):
        rows = result["detail"][mode]["by_position"]
        _by_position(ax1, rows, lambda r: 100 * (1 - _num(r["code_agreement"])), color=COLORS[mode], label=mode)
        _by_position(ax2, rows, lambda r: _num(r["mean_abs_dlogp"]), color=COLORS[mode], label=mode)
    _by_position(ax2, result["detail"]["fp4_hints"]["by_position"], lambda r: _num(r["floor_mean_abs_dlogp"]),
                 color=COLORS["floor"], label="floor", ls="--", marker="s")
    ax1.set(xlabel="response position", ylabel="code mismatch at hinted sites (%)", title="mismatch by position")
    ax2.set(xlabel="response position", ylabel="mean |dlogp|", title="|dlogp| by position")
    ax2.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    return _png(fig)


def plot_curve(plt, result: Mapping[str, Any]) -> str:
    """The planner's measured excess against hint + scale bytes per token."""
    p = result["planner"]
    fig, ax = plt.subplots(figsize=(7, 3.8))
    curve = p["curve"]
    ax.plot([c["bytes_per_token"] for c in curve], [c["excess"] for c in curve], "o-", color="#1f77b4",
            label="kept units (measured)")
    rejected = p.get("rejected") or []
    if rejected:
        ax.plot([r["bytes_per_token"] for r in rejected], [r["excess"] for r in rejected], "x", color="#d62728",
                ms=8, label="unit set aside (measured)")
    sc = p["store_coverage"]
    ax.plot([sc["bytes_per_token"]], [sc["excess"]], "*", ms=14, color="#2ca02c", label="the store's coverage")
    mg = result.get("margin")
    if mg is not None and mg["points"]:
        pts = sorted(mg["points"], key=lambda q: q["bytes_per_token"])
        ax.plot([q["bytes_per_token"] for q in pts], [q["excess"] for q in pts], "D--", ms=5, color="#9467bd",
                label=f"margin exceptions ({mg['sites']} sites, measured)")
        for q in pts:
            ax.annotate(q["name"], (q["bytes_per_token"], q["excess"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
    jp = (mg or {}).get("planner")
    if jp is not None:
        ax.plot([c["bytes_per_token"] for c in jp["curve"]], [c["excess"] for c in jp["curve"]], "s-", ms=5,
                color="#ff7f0e", label="joint planner: bits / margin per unit (measured)")
        if jp["rejected"]:
            ax.plot([r["bytes_per_token"] for r in jp["rejected"]], [r["excess"] for r in jp["rejected"]], "+",
                    color="#ff7f0e", ms=9, label="joint move set aside (measured)")
    ax.axhline(p["rne_excess"], color=COLORS["fp4_rne_own_scales"], ls=":", label="round-to-nearest")
    ax.axhline(0, color="#999999", lw=0.8)
    budget = p["budget"]["bytes_per_token"]
    if budget <= max(c["bytes_per_token"] for c in curve):
        ax.axvline(budget, color="#999999", ls="--", label=f"{budget:,} B/token")
    ax.set(xlabel="hint + scale bytes per token", ylabel="excess over the floor (mean |dlogp|)",
           title="excess vs bytes per token")
    ax.legend(fontsize=7)
    return _png(fig)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], left: int = 1) -> str:
    head = "".join(f"<th class='{'l' if i < left else ''}'>{html.escape(h)}</th>" for i, h in enumerate(header))
    body = "".join("<tr>" + "".join(f"<td class='{'l' if i < left else ''}'>{html.escape(str(c))}</td>"
                                    for i, c in enumerate(r)) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _integrity(result: Mapping[str, Any]) -> str:
    integ = result["integrity"]
    if not integ["checked"]:
        return "<p class='bad'>not checked (--no-verify)</p>"
    ok = integ["ok"] and not integ["skipped_trajectories"]
    head = (f"<p class='{'ok' if ok else 'bad'}'>tracestore verify: {'OK' if ok else 'FAILED'}</p>"
            f"<p class='note'>{integ['entries']} log entries, {integ['records']} records, {integ['segments']} "
            f"segments, {integ['chunks']} chunks ({integ['bytes']:,} bytes) re-read, every crc32c checked.</p>")
    errs = "".join(html.escape(e) + "\n" for e in integ["errors"])
    skipped = "".join(f"{html.escape(s['traj_id'])}: {html.escape(s['reason'])}\n"
                      for s in integ["skipped_trajectories"])
    return (head + (f"<p>problems found</p><pre>{errs}</pre>" if errs else "") +
            (f"<p>trajectories left out of the audit</p><pre>{skipped}</pre>" if skipped else ""))


def _sections(result: Mapping[str, Any], plt) -> list[str]:
    out = []
    rep = result["replay"]
    out.append("<h2>Replay of the rollout</h2>" + (
        f"<p class='{'ok' if rep['reproduced'] else 'bad'}'>"
        f"{'reproduced bit for bit' if rep['reproduced'] else 'not reproduced exactly'}</p>" + _table(
            ["decode path", "recorded", "hints equal", "scales equal", "routes equal", "log-probs equal",
             "max |diff|", "weights"],
            [[rep["decode_path"], rep["recorded_decode_path"], fmt(rep["hints_equal"], "pct"),
              fmt(rep["scales_equal"], "pct"), fmt(rep["routes_equal"], "pct"), fmt(rep["logprobs_equal"], "pct"),
              fmt(rep["max_abs_logprob_diff"]), rep["weights"]]])))
    out.append("<h2>Fidelity by trainer mode</h2><p class='note'>code and scale agreement at hinted sites; "
               "1-step: share of mismatches one codebook step apart; excess = mean |dlogp| minus the floor's</p>" +
               _table(["mode", "code agr.", "1-step", "scale agr.", "router flips", "mean |dlogp|", "excess",
                       "p99 |dlogp|", "max |dlogp|", "k3", "tokens"],
                      [[m, fmt(v["code_agreement"], "pct"), fmt(v["one_step_share"], "pct"),
                        fmt(v["scale_agreement"], "pct"), fmt(v["router_flip_rate"], "pct"), fmt(v["mean_abs_dlogp"]),
                        fmt(v["excess_over_floor"]), fmt(v["p99_abs_dlogp"]), fmt(v["max_abs_dlogp"]), fmt(v["k3"]),
                        v["tokens"]] for m, v in result["modes"].items()]))
    # (name, png, two panels side by side: shown at full width)
    plots = [("agreement by layer", plot_layers(plt, result), True),
             ("mismatch by token position", plot_positions(plt, result), True),
             ("|dlogp| histogram", plot_histogram(plt, result), False)]
    if result["planner"] is not None:
        plots.append(("excess vs bytes per token", plot_curve(plt, result), False))
    out.append("<h2>Plots</h2><div class='plots'>" + "".join(
        f"<img class='{'wide' if wide else ''}' alt='{html.escape(name)}' src='data:image/png;base64,{png}'>"
        for name, png, wide in plots) + "</div>")
    a = result["attribution"]
    if a is not None:
        ab, sq = a["mean_abs"], a["mean_sq"]
        t = ab["total"]
        rows = [["floor (bf16 trainer vs bf16 decode)", fmt(ab["floor"]), fmt(ab["floor"] / t if t else None, "pct"),
                 fmt(sq["floor"])]]
        rows += [[k, fmt(v), fmt(v / t if t else None, "pct"), fmt(sq["parts"][k])] for k, v in ab["parts"].items()]
        rows.append(["total (fp4_hints, no routing replay)", fmt(t), "100.000%", fmt(sq["total"])])
        out.append("<h2>Attribution of the gap by source</h2><p class='note'>sources made exact one more at a time, "
                   "in this order; part = what making it exact removed</p>" +
                   _table(["source", "part of mean |dlogp|", "share", "part of mean dlogp^2"], rows) +
                   f"<p>dominant source: <b>{html.escape(str(a['dominant']))}</b>. Residual (every FP4 site exact, "
                   f"routes replayed) {fmt(ab['residual'])} vs floor {fmt(ab['floor'])}: interaction "
                   f"{fmt(ab['interaction'])}; the parts add up within {fmt(a['tolerance'], 'pct')} of the total: "
                   f"{'yes' if a['adds_up'] else 'no'}. Exact passes carry the rollout's codes: "
                   f"{fmt(a['exact_code_agreement'], 'pct')}.</p>")
    p = result["planner"]
    if p is not None:
        rows = [[k, label, f"{b:,}", fmt(m), fmt(e), fmt(r, "x")] for k, label, b, m, e, r in ap.curve_rows(p)]
        best = p["budget"]["best"]
        note = (f"best measured at <= {p['budget']['bytes_per_token']:,} B/token: k={best['k']}, "
                f"{best['bytes_per_token']:,} B/token, excess {fmt(best['excess'])} "
                f"({fmt(best['excess_vs_rne'], 'x')} round-to-nearest's). " if best else "")
        lsb = p["budget"].get("best_by_encoding", {}).get("lsb")
        if lsb is not None and (best is None or lsb["k"] != best["k"]):
            note += (f"With scale hints (one LSB per block instead of the E4M3 byte): k={lsb['k']}, "
                     f"{ap.point_bytes(lsb, 'lsb'):,} B/token, excess {fmt(lsb['excess'])} "
                     f"({fmt(lsb['excess_vs_rne'], 'x')} round-to-nearest's, measured with the scale bytes). ")
        sc = p["store_coverage"]
        rr = sc["with_routing_replay"]
        note += (f"The store's coverage ({sc['bytes_per_token']:,} B/token) leaves {fmt(sc['excess_vs_rne'], 'x')} "
                 f"round-to-nearest's excess, and with routing replay {fmt(rr['excess_vs_rne'], 'x')} of "
                 "round-to-nearest's with routing replay. ")
        note += ("Units are tried in order of gain per byte, each on top of the units kept before it, and kept "
                 "only when the measured mean |dlogp| falls; units set aside are listed with their measured point. "
                 "Excess is mean |dlogp| minus the bf16 floor's; it can go below zero: FP4 values that follow the "
                 "rollout's snap the trainer's activations to the rollout's and absorb path noise that the bf16 "
                 "floor carries to the logits.")
        out.append("<h2>Coverage planner</h2>" + _table(["k", "unit added", "B/token", "mean |dlogp|", "excess",
                                                         "vs RNE"], rows) + f"<p class='note'>{note}</p>")
    mg = result.get("margin")
    if mg is not None:
        rows = [[q["name"], f"{q['bytes_per_token']:,.1f}", fmt(q["vs_bits"], "x"),
                 fmt(q["marked_value_fraction"], "pct"), fmt(q["marked_block_fraction"], "pct"),
                 fmt(q["code_agreement"], "pct"), f"{q['unmarked_mismatch']:,}", fmt(q["excess"]),
                 fmt(q["excess_vs_rne"], "x"), fmt(q["with_routing_replay"]["excess_vs_rne"], "x")]
                for q in mg["points"]]
        front = "; ".join(f"{html.escape(q['encoding'])} {html.escape(q['name'])}: {q['bytes_per_token']:,.0f} "
                          f"B/token, excess {fmt(q['excess'])}" for q in mg["frontier"])
        out.append("<h2>Margin exceptions</h2>" + _table(
            ["point", "B/token", "vs bits", "marked values", "marked blocks", "code agr.", "unmarked mism.",
             "excess", "vs RNE", "routes replayed: vs RNE"], rows) +
            f"<p class='note'>{len(mg['site_names'])} site(s) ({html.escape(mg['sites'])}) encoded as margin "
            f"exceptions of the replay (m: value margin in ladder steps, ms: scale margin in E4M3 steps); the bits "
            f"encoding of the same sites stores {mg['bits_bytes_per_token']:,} B/token. Frontier of every measured "
            f"coverage (bits: the planner's points): {front}.</p>")
        header, rows = ap.floor_rows(mg)
        out.append("<h2>Entropy floor per site</h2>" + _table(
            header, [[r[0], *(fmt(v, "dec1") for v in r[1:])] for r in rows]) +
            f"<p class='note'>{html.escape(FLOOR_CAPTION)}.</p>")
        jp = mg.get("planner")
        if jp is not None:
            rows = [[k, label, f"{b:,.1f}", fmt(m), fmt(e), fmt(r, "x")] for k, label, b, m, e, r in ap.joint_rows(jp)]
            out.append("<h2>Joint planner: sites x encoding x margin</h2>" + _table(
                ["k", "move (unit: option)", "B/token", "mean |dlogp|", "excess", "vs RNE"], rows, left=2) +
                f"<p class='note'>Per planner unit the options bits and margin exceptions at each point, each "
                f"measured alone; the moves are the steps along each unit's upper concave hull of (bytes, gain), "
                f"best gain per byte first, each kept only when the measured mean |dlogp| falls (moves set aside "
                f"last). {html.escape(joint_caption(jp))}</p>")
    mode = result["audited_mode"]
    d = result["detail"][mode]
    out.append(f"<h2>Per site ({html.escape(mode)})</h2>" + _table(
        ["site", "layer", "kind", "hinted", "code agr.", "1-step", "multi-step", "scale agr.", "values"],
        [[s["site"], s["layer"], s["kind"], "yes" if s["hinted"] else "", fmt(s["code_agreement"], "pct"),
          fmt(s["one_step_share"], "pct"), fmt(s["multi_step_share"], "pct"), fmt(s["scale_agreement"], "pct"),
          f"{s['values']:,}"] for s in d["per_site"]], left=3))
    for key, label in (("per_trajectory", "trajectory"), ("per_policy_version", "policy version")):
        out.append(f"<h2>Per {label} ({html.escape(mode)})</h2>" + _table(
            [label, "tokens", "code agr.", "1-step", "router flips", "mean |dlogp|", "floor", "excess"],
            [[r.get("traj_id", r["policy_version"]), r["tokens"], fmt(r["code_agreement"], "pct"),
              fmt(r["one_step_share"], "pct"), fmt(r["router_flip_rate"], "pct"), fmt(r["mean_abs_dlogp"]),
              fmt(r["floor_mean_abs_dlogp"]), fmt(r["excess"])] for r in d[key]]))
    return out


def render_html(result: Mapping[str, Any]) -> str:
    """The page as a string (plots rendered now). Raises `ConfigError` when matplotlib is not installed."""
    plt = _pyplot()
    st = result["store"]
    m = st["model"]
    parts = [f"<h1>tracerl audit: {html.escape(st['url'])}</h1>",
             f"<p class='note'>{st['audited_trajectories']} of {st['trajectories']} trajectories audited, "
             f"{st['response_tokens']:,} response tokens; {len(st['hinted_sites'])} of {len(st['fp4_sites'])} FP4 "
             f"sites hinted ({st['hint_bytes_per_token'] or 0:,} B/token); model {html.escape(m['family'])}, hidden "
             f"{m['hidden_size']}, {m['num_layers']} layers, {m['num_experts']} experts (top-{m['top_k']}); policy "
             f"versions {st['policy_versions']}; audit took {result['timing']['seconds']:.1f} s on "
             f"{html.escape(str(result['machine'].get('cuda_device') or result['machine']['platform']))}</p>",
             "<h2>Integrity (tracestore verify)</h2>" + _integrity(result)]
    if result["modes"]:
        parts += _sections(result, plt)
    else:
        parts.append("<p class='bad'>Nothing was measured: no trajectory of the store could be read.</p>")
    plt.close("all")
    return (f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>tracerl audit</title><style>{CSS}</style>"
            f"</head><body>{''.join(parts)}</body></html>")


def write_html(result: Mapping[str, Any], path: str) -> None:
    """Write `render_html` of ``result`` to ``path``. Raises `ConfigError` (no matplotlib, unwritable path)."""
    page = render_html(result)
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write(page)
    except OSError as e:
        raise ConfigError(f"--html {path}: cannot write ({e.strerror})") from None
