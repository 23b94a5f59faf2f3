"""``tracerl`` command line: a thin layer over `tracerl.demo`."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence


def _fmt(v, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "pct":
        return f"{100 * v:.3f}%"
    return f"{v:.3e}"


def render_table(result: dict) -> "object":
    from rich.table import Table

    cfg = result["config"]
    table = Table(
        title=(
            f"TRACE fidelity: {cfg['model']} (hidden {cfg['spec']['hidden_size']}, {cfg['spec']['num_layers']} "
            f"layers), {result['rollout']['trajectories']} trajectories, {result['rollout']['response_tokens']} "
            f"response tokens, {len(cfg['hinted_sites'])} hinted sites"
        )
    )
    cols = [
        ("mode", None), ("code agr.", "pct"), ("scale agr.", "pct"), ("router flips", "pct"),
        ("mean |dlogp|", "sci"), ("excess", "sci"), ("p99 |dlogp|", "sci"), ("max |dlogp|", "sci"), ("k3", "sci"),
    ]
    for name, _ in cols:
        table.add_column(name, justify="left" if name == "mode" else "right")
    for mode, m in result["modes"].items():
        vals = [m["code_agreement"], m["scale_agreement"], m["router_flip_rate"], m["mean_abs_dlogp"],
                m.get("excess_over_floor"), m["p99_abs_dlogp"], m["max_abs_dlogp"], m["k3"]]
        table.add_row(mode, *[_fmt(v, k) for v, (_, k) in zip(vals, cols[1:])])
    return table


def _cmd_demo(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console

    from tracerl.demo import DemoConfig, run_demo

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = DemoConfig(
        model=args.model,
        trajectories=args.trajectories,
        tokens=args.tokens,
        hint_layers=args.hint_layers,
        hint_sites=args.hint_sites,
        fp4=args.fp4,
        kv_fp4=args.kv_fp4,
        seed=args.seed,
        store=args.store,
        backward=args.backward,
        decode=args.decode,
        device=args.device,
        replay_routes=args.replay_routes,
        spec={k: v for k, v in (("hidden_size", args.hidden), ("num_layers", args.layers),
                                ("num_experts", args.experts), ("vocab_size", args.vocab)) if v is not None},
    )
    err = Console(stderr=True)
    if args.json:
        result = run_demo(cfg)
        print(json.dumps(result, default=float))
        return 0
    with err.status("starting") as status:
        result = run_demo(cfg, progress=lambda msg: (status.update(msg), err.log(msg)))
    out = Console() if sys.stdout.isatty() else Console(width=160, soft_wrap=True)
    out.print(render_table(result))
    r = result["rollout"]
    out.print(
        f"excess = mean |dlogp| - floor's. Rollout: prefill {r['prefill_s']:.1f}s, {r['decode_steps']} decode "
        f"steps in {r['decode_s']:.1f}s ({r['decode_path']} decode), {r['hint_bytes_per_token']} hint+scale "
        f"bytes/token. "
        f"Total {result['seconds']:.1f}s."
    )
    if args.store:
        out.print(f"store kept at {args.store}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tracerl", description="TRACE rollout capture and hint-guided QAT tools.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="FP4 rollout -> hints in a store -> trainer recompute in every mode -> fidelity table",
        description=(
            "Runs a tiny random-init MoE model (on CPU unless --device says otherwise): an NVFP4 rollout (routed experts' GEMMs in FP4, attention "
            "and router in bf16) that records hints, a bf16 floor run of the same decode path, and the trainer's "
            "recompute in the modes bf16, fp4_rne_own_scales, fp4_rne_rollout_scales and fp4_hints; prints code/"
            "scale agreement at hinted sites, router flip rate and |dlogp| statistics per mode."
        ),
    )
    d.add_argument("--store", metavar="PATH", help="store URL to create and keep (default: a temporary directory)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    d.add_argument("--trajectories", type=int, default=16, help="number of trajectories (default 16)")
    d.add_argument("--tokens", type=int, default=256, help="tokens per trajectory, prompt included (default 256)")
    d.add_argument("--hint-layers", default="latter-half",
                   help="layers whose sites get hints: latter-half (default), all, none, or e.g. 0,3,5")
    d.add_argument("--hint-sites", default="moe-input", choices=("moe-input", "all-fp4"),
                   help="which FP4 sites of a hinted layer get hints (default moe-input)")
    d.add_argument("--fp4", default="experts", choices=("experts", "experts+attention"),
                   help="FP4 placement: routed experts' GEMMs (default), or also the attention projections")
    d.add_argument("--kv-fp4", action="store_true", help="also store the KV cache in NVFP4 (never hinted)")
    d.add_argument("--model", default="qwen3-moe", choices=("qwen3-moe", "qwen3.5-moe"), help="model family")
    d.add_argument("--seed", type=int, default=0, help="seed of the weights, prompts and sampling")
    d.add_argument("--backward", action="store_true",
                   help="trainer forward + backward (straight-through) in every mode (default: forward only)")
    d.add_argument("--hidden", type=int, help="model hidden size (default 256)")
    d.add_argument("--layers", type=int, help="decoder layers (default 8)")
    d.add_argument("--experts", type=int, help="routed experts per MoE layer (default 16, top-2)")
    d.add_argument("--vocab", type=int, help="vocabulary size (default 1024)")
    d.add_argument("--device", default="cpu",
                   help="torch device of the model, rollout and trainer (default cpu; e.g. cuda, cuda:1)")
    d.add_argument("--decode", default="auto", choices=("auto", "hf", "static", "graph"),
                   help="rollout decode path: static KV cache (CPU default; 'graph' replays it as a CUDA graph, "
                        "the CUDA default) or the model's own Hugging Face forward ('hf'; Qwen3.5-MoE always)")
    d.add_argument("--replay-routes", action="store_true",
                   help="routing replay: the trainer's MoE layers use the rollout's routed experts from the store "
                        "(router flips then count how often the trainer's router would have chosen otherwise)")
    d.add_argument("--threads", type=int, default=0, help="torch CPU threads (default: torch's choice)")
    d.set_defaults(func=_cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    import tracestore

    from tracerl.errors import TracerlError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (TracerlError, tracestore.TraceStoreError) as e:
        print(f"tracerl {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
