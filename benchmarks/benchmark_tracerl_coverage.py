"""How hint coverage changes fidelity: the demo's flow for several choices of hinted sites and FP4 placements.

    python benchmarks/benchmark_tracerl_coverage.py [--trajectories 8] [--tokens 128] [--out PATH]

Each variant runs `tracerl.demo.run_demo` with the same seed (same weights, prompts, and hence the same
sampled rollout up to the FP4 placement) and reports, per trainer mode, mean |dlogp|, its excess over the
floor, code agreement at hinted sites and router flips. Prints a table and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tracerl.config import DemoConfig
from tracerl.demo import run_demo  # noqa: E402

VARIANTS = {
    "moe-input, latter half (default)": dict(hint_layers="latter-half", hint_sites="moe-input"),
    "moe-input, all layers": dict(hint_layers="all", hint_sites="moe-input"),
    "every expert FP4 site, all layers": dict(hint_layers="all", hint_sites="all-fp4"),
    "no hints": dict(hint_layers="none", hint_sites="moe-input"),
    "FP4 attention too, moe-input hinted in all layers": dict(fp4="experts+attention", hint_layers="all",
                                                              hint_sites="moe-input"),
    "FP4 attention too, every FP4 site hinted": dict(fp4="experts+attention", hint_layers="all",
                                                     hint_sites="all-fp4"),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trajectories", type=int, default=8, help="trajectories recorded (default 8)")
    p.add_argument("--tokens", type=int, default=128, help="tokens per trajectory (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the rollouts (default 0)")
    p.add_argument("--variants", default="", help="comma-separated indices into the variant list (default all)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                 "tracerl-cpu-coverage.json"),
                   help="JSON path (default: benchmarks/results/tracerl-cpu-coverage.json)")
    args = p.parse_args(argv)
    names = list(VARIANTS)
    if args.variants:
        names = [names[int(i)] for i in args.variants.split(",")]
    out = {"benchmark": "tracerl-coverage", "torch_threads": torch.get_num_threads(),
           "trajectories": args.trajectories, "tokens": args.tokens, "seed": args.seed, "variants": {}}
    for name in names:
        t0 = time.perf_counter()
        res = run_demo(DemoConfig(trajectories=args.trajectories, tokens=args.tokens, seed=args.seed,
                                  **VARIANTS[name]))
        out["variants"][name] = {"options": VARIANTS[name], "hinted_sites": len(res["config"]["hinted_sites"]),
                                 "fp4_sites": len(res["config"]["fp4_sites"]), "modes": res["modes"],
                                 "seconds": time.perf_counter() - t0}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
        print(f"done: {name} ({time.perf_counter() - t0:.0f}s)", flush=True)
    print(f"{'variant':52s} {'hinted':>6s} {'mode':22s} {'code':>8s} {'flips':>7s} {'mean|d|':>9s} {'excess':>9s}")
    for name, v in out["variants"].items():
        for mode in ("floor", "fp4_rne_own_scales", "fp4_rne_rollout_scales", "fp4_hints"):
            m = v["modes"][mode]
            code = "-" if m["code_agreement"] is None else f"{100 * m['code_agreement']:.2f}%"
            exc = m.get("excess_over_floor")
            print(f"{name:52s} {v['hinted_sites']:>6d} {mode:22s} {code:>8s} {100 * m['router_flip_rate']:6.2f}% "
                  f"{m['mean_abs_dlogp']:.3e} {'-' if exc is None else f'{exc:.3e}':>9s}")
    print(f"saved {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
