"""``tracerl audit STORE``: a thin layer over `tracerl.audit.run_audit` (options -> `AuditConfig`, progress,
tables, JSON, HTML, the planner's site table).

Exit codes: 0 audited; 1 the audit found a problem (integrity failure or skipped trajectories, or a
``--target-excess`` that no measured coverage reaches); 2 bad arguments or an error (one line on stderr)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from tracerl.cli.args import add_storage_arguments, finite_float, int_at_least, storage_options
from tracerl.config import CONCURRENT_DECODE, MARGIN_SITES, AuditConfig, check_store_exists, parse_margins
from tracerl.errors import ConfigError
from tracestore.cliargs import check_local_store

HELP = "recompute a store's trajectories: agreement, where the gap comes from, which sites to hint"
DESCRIPTION = (
    "Rebuilds the rollout's model from the store's metadata, checks the store (tracestore verify), replays the "
    "rollout's decode path (FP4, stored tokens forced) and the bf16 floor, recomputes the tokens with the "
    "trainer's numerical path in each mode and reports per site, layer, trajectory, policy version and token "
    "position: code agreement at hinted sites, one-step vs multi-step mismatches, scale agreement, router flips "
    "and |dlogp| against the floor; then attributes the gap by source (floor, routing, FP4 site groups) and "
    "measures the excess against hint bytes per token for a ranked coverage (the planner)."
)


EXAMPLES = [
    "tracerl audit ./demo-store",
    "tracerl audit ./demo-store --html report.html --json > audit.json",
    "tracerl audit s3://bucket/run1 --endpoint-url http://127.0.0.1:9000 --no-planner",
    "tracerl audit ./demo-store --target-excess 1e-3 --plan-out sites.json   # then tracestore create --site-table",
    "tracerl audit ./demo-store --margins 0.05:0.05,0.1:0.1:lsb --margin-sites all   # sub-bit hint encodings",
    "tracerl audit ./demo-store --margins 0.05:0.05,inf:inf --margin-planner --target-excess 1e-3   # mixed coverage",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    pos, nonneg = int_at_least(1), int_at_least(0)
    p.add_argument("store", metavar="STORE", help="store URL (local directory or s3://bucket/prefix)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (keys documented in tracerl.audit and the README) instead of tables")
    p.add_argument("--html", metavar="FILE",
                   help="also write a self-contained HTML report (PNG plots embedded; needs matplotlib)")
    p.add_argument("--target-excess", type=finite_float, metavar="X",
                   help="print the planner's cheapest measured coverage with excess <= X as a site table (JSON on "
                        "stdout, for `tracestore create --site-table`; the report goes to stderr); exit 1 when no "
                        "measured coverage reaches X")
    p.add_argument("--plan-out", metavar="FILE", help="write the --target-excess site table to FILE instead")
    p.add_argument("--device", metavar="DEVICE", default="auto",
                   help="torch device: auto (default: the rollout's device type when available, else cpu), cpu, "
                        "cuda, cuda:1")
    p.add_argument("--model", metavar="CHECKPOINT",
                   help="a safetensors checkpoint of the store's model to audit with, instead of the published "
                        "policy versions (default: the version each trajectory was generated with, when published "
                        "beside the store, else the initial weights from the store's spec and seed)")
    p.add_argument("--max-trajectories", type=pos, metavar="N",
                   help="audit only the first N trajectories by id (replay is then bit-exact only for whole "
                        "recorded batches)")
    p.add_argument("--micro-batch-tokens", type=pos, default=8192, metavar="N",
                   help="tokens per trainer micro-batch (default 8192, as tracerl demo)")
    p.add_argument("--bands", type=pos, default=4, metavar="N",
                   help="layer bands of the attribution groups and planner units (default 4)")
    p.add_argument("--position-bucket", type=pos, default=64, metavar="N",
                   help="response positions per by-position slice (default 64)")
    p.add_argument("--no-attribution", action="store_true", help="skip the attribution passes")
    p.add_argument("--no-planner", action="store_true", help="skip the coverage planner passes")
    p.add_argument("--no-verify", action="store_true",
                   help="skip tracestore verify (a corrupt chunk then fails the audit where it is read)")
    add_storage_arguments(p)
    p.add_argument("--concurrent-decode", choices=CONCURRENT_DECODE, default="auto",
                   help="run the replay decode (FP4) and the floor decode (bf16) side by side, the floor in a "
                        "second thread on its own CUDA stream (default auto: with CUDA-graph decodes on a GPU; the "
                        "results are the same bits either way)")
    p.add_argument("--margins", metavar="M:MS[:lsb],...",
                   help="also measure margin-exception encodings (hint encoding margin, FORMAT §2.5) at these "
                        "points: value margin M (ladder steps) and scale margin MS (E4M3 steps), numbers >= 0 or "
                        "inf, ':lsb' for scale hints instead of whole scale bytes; per point the stored bytes per "
                        "token, code agreement and excess with own routes and with routing replay (two passes "
                        "each; the marks come from the replay's own activations on its recorded decode path), and per "
                        "site the entropy floor (what any encoding needs) beside each point's bytes. A "
                        "scale margin >= 0.5 marks every block; only inf marks every value")
    p.add_argument("--margin-sites", choices=MARGIN_SITES, default="hinted",
                   help="the sites the margin points encode: the store's hinted sites (default) or every FP4 "
                        "activation site")
    p.add_argument("--margin-planner", action="store_true",
                   help="also plan coverage over sites x encoding x margin (needs --margins and the planner): each "
                        "planner unit is not hinted, in bits, or margin exceptions at one of the --margins points, "
                        "chosen greedily by measured gain per byte (one pass per unit and point, one per move "
                        "tried); prints the joint curve and the best point at <= 7,680 B/token with and without "
                        "routing replay. With --target-excess the site table is the cheapest measured coverage of "
                        "any encoding (margin sites declared with their margin keys)")
    p.add_argument("--threads", type=nonneg, default=0, metavar="N",
                   help="torch CPU threads (default 0: torch's choice)")


def config_from_args(args: argparse.Namespace) -> AuditConfig:
    """The checked `AuditConfig` of parsed options, for a store that exists (raises `ConfigError`, tracestore's
    `UsageError` for bad storage options and `StoreNotFoundError` for a URL without a store); loads no torch."""

    if args.html:
        import importlib.util
        import os

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--html needs matplotlib (pip install matplotlib)")
        folder = os.path.dirname(os.path.abspath(args.html))
        if not os.path.isdir(folder):
            raise ConfigError(f"--html {args.html}: folder {folder} does not exist")
    if args.margin_sites != "hinted" and not args.margins:
        raise ConfigError("--margin-sites needs --margins")
    if args.margin_planner and not args.margins:
        raise ConfigError("--margin-planner needs --margins (its options are bits and each margin point)")
    if args.margin_planner and args.no_planner:
        raise ConfigError("--margin-planner needs the planner (drop --no-planner)")
    if args.plan_out and args.target_excess is None:
        raise ConfigError("--plan-out needs --target-excess")
    if args.target_excess is not None and args.no_planner:
        raise ConfigError("--target-excess needs the planner (drop --no-planner)")
    opts = storage_options(args, args.store)
    cfg = AuditConfig(store=args.store, device=args.device, model=args.model, max_trajectories=args.max_trajectories,
                      micro_batch_tokens=args.micro_batch_tokens, bands=args.bands,
                      position_bucket=args.position_bucket, attribution=not args.no_attribution,
                      planner=not args.no_planner, target_excess=args.target_excess, storage_options=opts,
                      verify=not args.no_verify, concurrent_decode=args.concurrent_decode,
                      margins=parse_margins(args.margins) if args.margins else (), margin_sites=args.margin_sites,
                      margin_planner=args.margin_planner)
    cfg.check()
    check_local_store(cfg.store, opts)  # without numpy, pyarrow, zarr
    check_store_exists(cfg.store, opts)
    return cfg


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    import torch
    from rich.console import Console

    from tracerl.audit import render_terminal, run_audit
    from tracerl.cli.progress import StepBars

    torch.set_num_threads(args.threads or torch.get_num_threads())
    with contextlib.closing(StepBars(Console(stderr=True, log_path=False))) as bars:
        result = run_audit(cfg, on_step=bars)
    if args.html:
        from tracerl.audit import write_html

        write_html(result, args.html)
    # with the joint planner, the cheapest measured coverage of any encoding (bits, margin, mixed)
    source = result.get("margin") if cfg.margin_planner else result.get("planner")
    target = (source or {}).get("target")
    table = target["site_table"] if target else None
    if args.plan_out and table is not None:
        with open(args.plan_out, "w", encoding="utf-8") as f:
            json.dump(table, f, indent=1)
    table_on_stdout = target is not None and not args.json and not args.plan_out
    if args.json:
        print(json.dumps(result, default=float))
    else:
        out = (Console(stderr=True) if table_on_stdout else
               Console() if sys.stdout.isatty() else Console(width=160, soft_wrap=True))
        for item in render_terminal(result):
            out.print(item)
        if args.html:
            out.print(f"HTML report: {args.html}")
    if table_on_stdout and table is not None:
        print(json.dumps(table, indent=1))
    integ = result["integrity"]
    problems = integ["ok"] is False or bool(integ["skipped_trajectories"])
    if problems:
        print(f"tracerl audit: integrity problems in {cfg.store}: {len(integ['errors'])} verify error(s), "
              f"{len(integ['skipped_trajectories'])} trajectory(ies) left out", file=sys.stderr)
    if target is not None and not target["meets"]:
        measured = result["margin"]["frontier"] if cfg.margin_planner else result["planner"]["curve"]
        print(f"tracerl audit: no measured coverage reaches excess {cfg.target_excess:g} (best: "
              f"{min(c['excess'] for c in measured):.3e})", file=sys.stderr)
        return 1
    if target is not None and table is None:
        print(f"tracerl audit: excess {cfg.target_excess:g} needs no hints (round-to-nearest reaches it)",
              file=sys.stderr)
    return 1 if problems else 0
