"""`tracerl audit` at a realistic size: the attribution table, the planner's curve and the audit's own time.

    python benchmarks/benchmark_audit.py                     # GPU (H200): hidden 2048, 40 layers, 8 x 4096 tokens
    python benchmarks/benchmark_audit.py --config cpu-demo   # CPU: the `tracerl demo` store (16 x 256, hidden 256)
    python benchmarks/benchmark_audit.py --smoke             # CPU: a tiny model, same code paths

For each coverage (``default``: the MoE input of the latter half of the layers, the paper's default; ``all-sites``:
every FP4 site of every layer, 80 on the H200 model) the benchmark records a store with the demo's FP4 rollout
(`tracerl.demo.record_store`, the configuration of benchmarks/benchmark_tracerl_h200.py's fidelity section), then
audits it ``--reps`` times with the defaults a user gets (`tracerl.audit.run_audit`: verify, replay, floor, every
pass, attribution, planner). The numbers of an audit are deterministic; its time is reported as the median of the
runs with min..max. The JSON (``--out``) holds per coverage the store's recording, every run's time and phase
breakdown, and the last run's result (modes, attribution, planner, replay, integrity); ``--html-dir`` keeps each
coverage's HTML report and its plots as PNG files. Each coverage is saved as soon as it finishes.
``--scale-encodings bytes,lsb`` records each coverage once per store scale encoding (FORMAT §2.4; the same seed, so
the same rollout) and audits each: today's layout and scale hints side by side (keys ``<coverage>`` and
``<coverage>/lsb``). ``--margins 0.05:0.05,0.1:0.1:lsb`` (``tracerl audit --margins``) also measures margin-exception
encodings at those points (issue 23): per point the stored bytes per token, code agreement and excess, with own
routes and with routing replay (the JSON's ``margin`` per coverage); with ``--margin-planner`` also the joint
planner over sites x encoding x margin (``margin.planner``: its curve, and its best point at <= 7,680 B/token with
and without routing replay against the goal, ``goal_met_by_joint_planner``).
"""

from __future__ import annotations

import argparse
import base64
import gc
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import tracefp4  # noqa: E402
from tracerl.audit import AuditConfig, run_audit  # noqa: E402
from tracerl.audit.plan import curve_rows, joint_rows  # noqa: E402
from tracerl.config import MARGIN_SITES, DemoConfig, parse_margins  # noqa: E402
from tracerl.demo import record_store  # noqa: E402
from tracestore.cliargs import ProgressLog  # noqa: E402

GPU_SPEC = dict(hidden_size=2048, num_layers=40, num_heads=16, num_kv_heads=4, head_dim=128, num_experts=32,
                top_k=4, moe_intermediate_size=512, vocab_size=32768, max_position_embeddings=16384)
SMOKE_SPEC = dict(hidden_size=64, num_layers=4, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=8, top_k=2,
                  moe_intermediate_size=32, vocab_size=256)
COVERAGES = {"default": dict(hint_layers="latter-half", hint_sites="moe-input"),
             "all-sites": dict(hint_layers="all", hint_sites="all-fp4"),
             # the planner's first units (moe-in L0-9, L10-19, ...) cut at 28 layers: 28 x 272 = 7,616 B/token with
             # scale hints (--scale-encodings lsb), the most sites of width 2,048 under the 7,680 B/token goal
             "moe-in-L0-27": dict(hint_layers=",".join(map(str, range(28))), hint_sites="moe-input")}
#: the planner's goal: at <= 7,680 B/token, an excess at most 1/3 of round-to-nearest's
GOAL_BYTES, GOAL_RATIO = 7680, 1 / 3


def demo_config(name: str, coverage: str, store: str, seed: int) -> DemoConfig:
    cov = COVERAGES[coverage]
    if name == "h200":
        return DemoConfig(trajectories=8, tokens=4096, prompt_tokens=(64, 64), seed=seed, store=store, device="cuda",
                          micro_batch_tokens=8192, flush_tokens=1024, spec=dict(GPU_SPEC), **cov)
    if name == "cpu-demo":
        return DemoConfig(seed=seed, store=store, **cov)  # tracerl demo's defaults
    return DemoConfig(trajectories=2, tokens=48, seed=seed, store=store, spec=dict(SMOKE_SPEC), **cov)


def save_html(result: dict, path: str) -> list[str]:
    """The HTML report at ``path`` and its plots beside it as PNG files; returns the PNG paths."""
    from tracerl.audit import write_html

    write_html(result, path)
    with open(path, encoding="utf-8") as f:
        page = f.read()
    pngs = []
    stem = path.removesuffix(".html")
    for alt, data in re.findall(r"<img [^>]*alt='([^']*)' src='data:image/png;base64,([^']*)'", page):
        name = f"{stem}-{re.sub(r'[^a-z0-9]+', '-', alt.lower()).strip('-')}.png"
        with open(name, "wb") as f:
            f.write(base64.b64decode(data))
        pngs.append(name)
    return pngs


def summary(result: dict) -> dict:
    """What the benchmark keeps of a result beside the timing (the whole result is large at 80 sites)."""
    keep = ("store", "integrity", "replay", "modes", "attribution", "planner", "margin", "timing", "config", "machine")
    out = {k: result[k] for k in keep}
    out["per_site_fp4_hints"] = result["detail"]["fp4_hints"]["per_site"]
    out["per_layer_fp4_hints"] = result["detail"]["fp4_hints"]["per_layer"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=("h200", "cpu-demo", "smoke"), default="h200",
                   help="h200 (GPU, default), cpu-demo (the tracerl demo store on the CPU) or smoke (tiny, CPU)")
    p.add_argument("--smoke", action="store_true", help="same as --config smoke")
    p.add_argument("--coverage", default="default,all-sites", help=f"comma-separated: {', '.join(COVERAGES)} (moe-in-L0-27 needs the "
                        "H200 model's 40 layers)")
    p.add_argument("--scale-encodings", default="bytes", metavar="LIST",
                   help="comma-separated store scale encodings to record and audit each coverage with: bytes "
                        "(default), lsb (scale hints), or both")
    p.add_argument("--reps", type=int, default=3, help="audits per store (median time reported; default 3)")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's choice)")
    p.add_argument("--bands", type=int, default=AuditConfig.bands, metavar="N",
                   help=f"layer bands of the attribution groups and planner units (default {AuditConfig.bands}: "
                        "10-layer units on the H200 model; 10 gives 4-layer units, twice the planner passes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the recorded rollout (default 0)")
    p.add_argument("--workdir", default=None, help="where the stores go (default: a temporary directory)")
    p.add_argument("--out", default=None, help="JSON path (default: benchmarks/results/audit-<config>.json; "
                                               "smoke: audit-smoke.json in a temporary directory)")
    p.add_argument("--html-dir", default=None, help="keep each coverage's HTML report and PNG plots here")
    p.add_argument("--margins", default=None, metavar="M:MS[:lsb],...",
                   help="margin-exception points to measure too (tracerl audit --margins; default: none)")
    p.add_argument("--margin-sites", choices=MARGIN_SITES, default="hinted",
                   help="the sites the margin points encode (default: the store's hinted sites)")
    p.add_argument("--margin-planner", action="store_true",
                   help="also run the joint planner over sites x encoding x margin (tracerl audit --margin-planner; "
                        "needs --margins)")
    args = p.parse_args(argv)
    margins = parse_margins(args.margins) if args.margins else ()
    name = "smoke" if args.smoke else args.config
    coverages = args.coverage.split(",")
    bad = [c for c in coverages if c not in COVERAGES]
    if bad or args.reps < 1:
        p.error(f"coverage {bad} unknown (choose from {', '.join(COVERAGES)}) or reps {args.reps} < 1")
    if args.bands < 1:
        p.error(f"--bands {args.bands}: must be >= 1")
    if args.margin_planner and not margins:
        p.error("--margin-planner needs --margins")
    encodings = args.scale_encodings.split(",")
    if not encodings or any(e not in ("bytes", "lsb") for e in encodings):
        p.error(f"--scale-encodings {args.scale_encodings!r}: a comma-separated list of bytes, lsb")
    if args.threads:
        torch.set_num_threads(args.threads)
    if name == "h200" and not torch.cuda.is_available():
        p.error("--config h200 needs a CUDA device; use --config cpu-demo or --smoke on the CPU")
    results = (tempfile.gettempdir() if name == "smoke"
               else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    out_path = args.out or os.path.join(results, f"audit-{name}.json")
    device = torch.device("cuda" if name == "h200" else "cpu")
    out = {"benchmark": "audit", "config": name, "reps": args.reps, "bands": args.bands,
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "kernels_backend": tracefp4.resolve_backend("auto", device)},
           "goal": {"bytes_per_token": GOAL_BYTES, "excess_vs_rne": GOAL_RATIO}, "coverages": {}}
    t0 = time.perf_counter()

    def say(msg: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f}s] {msg}", flush=True)

    def save() -> None:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as f:
            json.dump(out, f, indent=1, default=float)

    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for cov_base, enc in [(c, e) for c in coverages for e in encodings]:
            cov = cov_base if enc == "bytes" else f"{cov_base}/{enc}"
            store = os.path.join(tmp, f"store-{cov_base}-{enc}")
            say(f"{cov}: recording the FP4 rollout into {store}")
            rec = {**record_store(demo_config(name, cov_base, store, args.seed), scale_encoding=enc),
                   "scale_encoding": enc}
            say(f"{cov}: recorded {rec['trajectories']} trajectories, {rec['response_tokens']} response tokens in "
                f"{rec['seconds']:.1f}s (decode {rec['decode_s']:.1f}s)")
            runs, result = [], None
            for rep in range(args.reps):
                load_before = os.getloadavg()[0]
                # a line per phase and at least every 30 s with its count, rate and ETA: a device call's log or a
                # nohup run shows where an audit of several minutes is
                progress = ProgressLog(lambda line: print(line, file=sys.stderr, flush=True), unit="steps",
                                       announce=True)
                try:
                    result = run_audit(AuditConfig(store=store, bands=args.bands, margins=margins,
                                                   margin_sites=args.margin_sites,
                                                   margin_planner=args.margin_planner), on_step=progress.update)
                finally:
                    progress.close()
                # the 1-minute load average around the run: other jobs on a shared machine stretch the time
                runs.append({**result["timing"], "loadavg_1min": [load_before, os.getloadavg()[0]]})
                t = runs[-1]
                # saved after every audit: a run cut short (a device call's time limit) keeps what it measured
                out["coverages"][cov] = {"record": rec, "audit_seconds": [r["seconds"] for r in runs], "runs": runs,
                                         "complete": False, "result": summary(result)}
                save()
                side = " side by side" if t["concurrent_decode"] else ""
                say(f"{cov}: audit {rep + 1}/{args.reps} in {t['seconds']:.1f}s (decodes{side} {t['decode_s']:.1f}s: "
                    f"replay {t['replay_s']:.1f}s, floor {t['floor_s']:.1f}s; {t['passes']} passes "
                    f"{t['passes_s'] + t['curve_s']:.1f}s)")
                if rep + 1 < args.reps:  # the model and its device buffers go before the next audit builds its own
                    result = None
                    gc.collect()
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            secs = [r["seconds"] for r in runs]
            entry = {"record": rec, "audit_seconds": secs, "median_s": statistics.median(secs), "min_s": min(secs),
                     "max_s": max(secs), "runs": runs, "complete": True, "result": summary(result)}
            best = result["planner"]["budget"]["best"]
            entry["goal_met"] = bool(best is not None and best["excess_vs_rne"] is not None
                                     and best["excess_vs_rne"] <= GOAL_RATIO)
            # the store's own coverage, measured directly (not a planner point), when it fits the budget
            sc = result["planner"]["store_coverage"]
            entry["goal_met_by_store_coverage"] = bool(
                sc["bytes_per_token"] <= GOAL_BYTES and sc["excess_vs_rne"] is not None
                and sc["excess_vs_rne"] <= GOAL_RATIO and sc["with_routing_replay"]["excess_vs_rne"] is not None
                and sc["with_routing_replay"]["excess_vs_rne"] <= GOAL_RATIO)
            jp = (result.get("margin") or {}).get("planner")
            if jp is not None:  # the joint planner's best at the budget, without and with routing replay
                jb = jp["budget"]["best"]
                jrr = (jb or {}).get("with_routing_replay") or {}
                entry["goal_met_by_joint_planner"] = bool(
                    jb is not None and jb["excess_vs_rne"] is not None and jb["excess_vs_rne"] <= GOAL_RATIO
                    and jrr.get("excess_vs_rne") is not None and jrr["excess_vs_rne"] <= GOAL_RATIO)
            lsb = result["planner"]["budget"]["best_by_encoding"]["lsb"]
            entry["goal_met_with_scale_hints"] = bool(lsb is not None and lsb["excess_vs_rne"] is not None
                                                      and lsb["excess_vs_rne"] <= GOAL_RATIO)
            if args.html_dir:
                os.makedirs(args.html_dir, exist_ok=True)
                entry["html"] = os.path.join(args.html_dir, f"audit-{name}-{cov.replace('/', '-')}.html")
                entry["pngs"] = save_html(result, entry["html"])
            out["coverages"][cov] = entry
            save()
            print_coverage(cov, entry)
    out["seconds"] = time.perf_counter() - t0
    save()
    say(f"saved {out_path}")
    return 0


def print_coverage(cov: str, e: dict) -> None:
    r = e["result"]
    m, a, p = r["modes"], r["attribution"], r["planner"]
    print(f"\n== {cov}: {r['store']['response_tokens']} response tokens, {len(r['store']['hinted_sites'])} hinted sites "
          f"({r['store']['hint_bytes_per_token']} B/token); audit {e['median_s']:.1f}s median of {len(e['audit_seconds'])} "
          f"(min {e['min_s']:.1f}, max {e['max_s']:.1f}); replay reproduced: {r['replay']['reproduced']}")
    print(f"{'mode':26s} {'code agr.':>10s} {'flips':>8s} {'mean|d|':>10s} {'excess':>10s}")
    for name, v in m.items():
        ca = "-" if v["code_agreement"] is None else f"{100 * v['code_agreement']:.3f}%"
        ex = "-" if v["excess_over_floor"] is None else f"{v['excess_over_floor']:.3e}"
        print(f"{name:26s} {ca:>10s} {100 * v['router_flip_rate']:7.3f}% {v['mean_abs_dlogp']:10.3e} {ex:>10s}")
    ab = a["mean_abs"]
    print(f"attribution (mean |dlogp|, sources made exact in order; dominant: {a['dominant']}):")
    print(f"  {'floor':32s} {ab['floor']:.3e}")
    for k, v in ab["parts"].items():
        print(f"  {k:32s} {v:.3e}")
    print(f"  {'total':32s} {ab['total']:.3e}  (residual {ab['residual']:.3e}, interaction {ab['interaction']:.3e}, "
          f"adds up within {a['tolerance']:.0%}: {a['adds_up']})")
    print("planner curve (k, unit added, B/token, excess, x RNE; units set aside last):")
    for k, label, b, _, exc, r in curve_rows(p):
        ratio = "-" if r is None else f"{r:.2f}x"
        print(f"  {k:3d} {label:36s} {b:8d} {exc:10.3e} {ratio:>7s}")
    best = p["budget"]["best"]
    if best is not None:
        print(f"best at <= {p['budget']['bytes_per_token']} B/token: k={best['k']}, {best['bytes_per_token']} B/token, "
              f"{best['excess_vs_rne']:.2f}x RNE's excess (goal <= {GOAL_RATIO:.2f}x: "
              f"{'met' if e['goal_met'] else 'missed'})")
    lsb = p["budget"].get("best_by_encoding", {}).get("lsb")
    if lsb is not None:
        print(f"  with scale hints: k={lsb['k']}, {lsb['bytes_per_token_by_encoding']['lsb']} B/token, "
              f"{lsb['excess_vs_rne']:.2f}x RNE's excess (measured with scale bytes)")
    mg = e["result"].get("margin")
    if mg is not None:
        print(f"margin exceptions at {len(mg['site_names'])} {mg['sites']} site(s) (bits: {mg['bits_bytes_per_token']} "
              f"B/token; entropy floor {mg['entropy_floor']['bytes_per_token']:.1f} B/token): point, B/token, marked "
              f"values, code agr., unmarked mismatches, x RNE (routes replayed)")
        for q in mg["points"]:
            ca = "-" if q["code_agreement"] is None else f"{100 * q['code_agreement']:.3f}%"
            rr = q["with_routing_replay"]["excess_vs_rne"]
            print(f"  {q['name']:20s} {q['bytes_per_token']:9.1f} {100 * q['marked_value_fraction']:7.3f}% {ca:>9s} "
                  f"{q['unmarked_mismatch']:10d} {q['excess_vs_rne'] or float('nan'):6.3f}x "
                  f"({rr or float('nan'):.3f}x)")
        jp = mg.get("planner")
        if jp is not None:
            print("joint planner curve (k, move: unit: option, B/token, excess, x RNE; moves set aside last):")
            for k, label, b, _, exc, r in joint_rows(jp):
                ratio = "-" if r is None else f"{r:.2f}x"
                print(f"  {k:3d} {label:44s} {b:9.1f} {exc:10.3e} {ratio:>7s}")
            jb = jp["budget"]["best"]
            if jb is not None:
                jrr = jb["with_routing_replay"] or {}
                met = e.get("goal_met_by_joint_planner")
                ratio, rr_ratio = (v if v is not None else float("nan")
                                   for v in (jb["excess_vs_rne"], jrr.get("excess_vs_rne")))
                print(f"joint best at <= {jp['budget']['bytes_per_token']} B/token: k={jb['k']}, "
                      f"{jb['bytes_per_token']:.1f} B/token, {ratio:.2f}x RNE's excess; with routing replay "
                      f"{rr_ratio:.2f}x RNE's with routing replay (goal <= {GOAL_RATIO:.2f}x both: "
                      f"{'met' if met else 'missed'})")


if __name__ == "__main__":
    sys.exit(main())
