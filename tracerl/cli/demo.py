"""``tracerl demo``: a thin layer over `tracerl.demo.run_demo` (options -> `DemoConfig`, progress, table)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from tracerl.cli.args import add_model_size_arguments, add_storage_arguments, int_at_least, storage_options
from tracerl.cli.progress import StepBars
from tracerl.config import DECODE_PATHS, FP4_PLACEMENTS, HINT_SITE_KINDS, MODEL_FAMILIES, SCALE_ENCODINGS, DemoConfig

HELP = "FP4 rollout -> hints in a store -> trainer recompute in every mode -> fidelity table"
DESCRIPTION = (
    "Runs a tiny random-init MoE model (on CPU unless --device says otherwise): an NVFP4 rollout (routed experts' "
    "GEMMs in FP4, attention and router in bf16) that records hints, a bf16 floor run of the same decode path, "
    "and the trainer's recompute in the modes bf16, fp4_rne_own_scales, fp4_rne_rollout_scales and fp4_hints; "
    "prints code/scale agreement at hinted sites, router flip rate and |dlogp| statistics per mode."
)
EXAMPLES = [
    "tracerl demo",
    "tracerl demo --store ./demo-store --trajectories 8 --tokens 512   # keep the store (then: tracerl audit)",
    "tracerl demo --hint-layers all --replay-routes --json",
    "tracerl demo --device cuda --hidden 2048 --layers 40 --experts 32",
]
_DEFAULTS = DemoConfig()
#: model-size options -> `tracerl.policy.models.TinyMoESpec` fields
SPEC_OPTIONS = {"hidden": "hidden_size", "layers": "num_layers", "experts": "num_experts", "vocab": "vocab_size"}


def add_arguments(d: argparse.ArgumentParser) -> None:
    pos, nonneg = int_at_least(1), int_at_least(0)
    d.add_argument("--store", metavar="PATH",
                   help="store URL to create and keep; must not exist yet, or be an empty directory "
                        "(default: a temporary directory, removed afterwards)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    d.add_argument("--trajectories", type=pos, default=_DEFAULTS.trajectories, metavar="N",
                   help=f"number of trajectories (default {_DEFAULTS.trajectories})")
    d.add_argument("--tokens", type=pos, default=_DEFAULTS.tokens, metavar="N",
                   help=f"tokens per trajectory, prompt ({_DEFAULTS.prompt_tokens[0]} to {_DEFAULTS.prompt_tokens[1]}) "
                        f"included; at least {_DEFAULTS.min_tokens} (default {_DEFAULTS.tokens})")
    d.add_argument("--hint-layers", default=_DEFAULTS.hint_layers, metavar="LAYERS",
                   help="layers whose sites get hints: latter-half (default), all, none, or e.g. 0,3,5")
    d.add_argument("--hint-sites", default=_DEFAULTS.hint_sites, choices=HINT_SITE_KINDS,
                   help=f"which FP4 sites of a hinted layer get hints (default {_DEFAULTS.hint_sites})")
    d.add_argument("--fp4", default=_DEFAULTS.fp4, choices=FP4_PLACEMENTS,
                   help="FP4 placement: the routed experts' GEMMs (default), also the attention projections, or none "
                        "(every mode bf16: a control)")
    d.add_argument("--kv-fp4", action="store_true", help="also store the KV cache in NVFP4 (never hinted)")
    d.add_argument("--model", default=_DEFAULTS.model, choices=MODEL_FAMILIES,
                   help=f"model family (default {_DEFAULTS.model})")
    d.add_argument("--seed", type=nonneg, default=_DEFAULTS.seed, metavar="N",
                   help=f"seed of the weights, prompts and sampling (default {_DEFAULTS.seed})")
    d.add_argument("--backward", action="store_true",
                   help="trainer forward + backward (straight-through) in every mode (default: forward only)")
    add_model_size_arguments(d)
    d.add_argument("--device", metavar="DEVICE", default=_DEFAULTS.device,
                   help="torch device of the model, rollout and trainer (default cpu; e.g. cuda, cuda:1)")
    d.add_argument("--decode", default=_DEFAULTS.decode, choices=DECODE_PATHS,
                   help="rollout decode path: static KV cache (CPU default; 'graph' replays it as a CUDA graph, "
                        "the CUDA default) or the model's own Hugging Face forward ('hf'; Qwen3.5-MoE always)")
    d.add_argument("--replay-routes", action="store_true",
                   help="routing replay: the trainer's MoE layers use the rollout's routed experts from the store "
                        "(router flips then count how often the trainer's router would have chosen otherwise)")
    d.add_argument("--scale-encoding", default=_DEFAULTS.scale_encoding, choices=SCALE_ENCODINGS,
                   help="the store's hinted sites: bytes (E4M3 scale bytes, default) or lsb (scale hints: one bit per "
                        "block; the trainer rebuilds the bytes from its own activations; FORMAT §2.4)")
    d.add_argument("--threads", type=nonneg, default=0, metavar="N",
                   help="torch CPU threads (default 0: torch's choice)")
    add_storage_arguments(d)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The `DemoConfig` of parsed ``demo`` options, checked (`DemoConfig.check`, which also checks ``--store``:
    raises `ConfigError`, or tracestore's `UsageError` for bad storage options); loads no torch."""
    cfg = DemoConfig(
        model=args.model, trajectories=args.trajectories, tokens=args.tokens, hint_layers=args.hint_layers,
        hint_sites=args.hint_sites, fp4=args.fp4, kv_fp4=args.kv_fp4, seed=args.seed, store=args.store,
        backward=args.backward, decode=args.decode, device=args.device, replay_routes=args.replay_routes,
        scale_encoding=args.scale_encoding,
        spec={field: getattr(args, opt) for opt, field in SPEC_OPTIONS.items() if getattr(args, opt) is not None},
        storage_options=storage_options(args, args.store) if args.store else None,
    )
    cfg.check()
    return cfg


def _fmt(v, kind: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if kind == "pct":
        return f"{100 * v:.3f}%"
    return f"{v:.3e}"


def render_table(result: dict) -> "object":
    """The fidelity table (a rich `Table`) of a `run_demo` result."""
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


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # before torch is imported: bad options answer at once
    import torch
    from rich.console import Console

    from tracerl.demo import run_demo

    if args.threads:
        torch.set_num_threads(args.threads)
    bars = StepBars(Console(stderr=True, log_path=False))
    try:
        result = run_demo(cfg, on_step=bars)
    finally:
        bars.close()
    if args.json:
        print(json.dumps(result, default=float))
        return 0
    out = Console() if sys.stdout.isatty() else Console(width=160, soft_wrap=True)
    out.print(render_table(result))
    r = result["rollout"]
    out.print(
        f"excess = mean |dlogp| - floor's. Rollout: prefill {r['prefill_s']:.1f}s, {r['decode_steps']} decode "
        f"steps in {r['decode_s']:.1f}s ({r['decode_path']} decode), {r['hint_bytes_per_token']} hint+scale "
        f"bytes/token. Total {result['seconds']:.1f}s."
    )
    if args.store:
        out.print(f"store kept at {args.store}")
    return 0
