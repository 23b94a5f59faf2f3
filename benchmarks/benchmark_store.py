"""Benchmark of the tracestore store: bytes per token, write/read throughput against plain files and plain S3
objects (moto server), tail latency. A thin program over ``tracestore.cli.bench.run_bench`` (the same function as
``tracestore bench``); see that module's docstring for exactly what is timed and what the baselines are.

Prints a table and saves JSON (default ``benchmarks/results/store-<arch>-<n>cpu.json``).

Usage: python3 benchmarks/benchmark_store.py [--trajectories 32] [--tokens 2048] [--s3-trajectories 4]
       [--no-s3] [--no-durable] [--chunk-rows 256] [--out PATH] [--smoke]
--smoke runs a tiny size (seconds) to check the program itself.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tracestore.cli.bench import add_arguments, config_from_args, machine_name, run_bench, summary_rows, to_json  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def _git_state() -> dict:
    """The commit measured, and the tracestore files that differed from it (others may be editing)."""
    import subprocess

    root = Path(__file__).resolve().parents[1]

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            return ""

    # porcelain lines are "XY <path>": keep the leading status columns intact
    dirty = [line[3:] for line in git("status", "--porcelain", "--", "tracestore", "schemas").splitlines() if line]
    return {"commit": git("rev-parse", "HEAD").strip() or None, "dirty_files": dirty}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, to check the program")
    parser.add_argument("--tag", default="", help="suffix of the default result file name")
    args = parser.parse_args(argv)
    if args.smoke:
        args.trajectories, args.tokens, args.repeats, args.tail_commits = 2, 256, 1, 3
        args.s3_trajectories = 1
    logging.basicConfig(level=logging.WARNING)
    cfg = config_from_args(args)

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    console = Console()
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True, disable=not sys.stderr.isatty()) as bar:
        task = bar.add_task("bench", total=None)
        result = run_bench(cfg, progress=lambda phase, done, total: bar.update(task, description=phase,
                                                                                completed=done, total=total))
    result["git"] = _git_state()
    loc = result["local"]
    s3 = result.get("s3") or {}
    table = Table(title=(f"tracestore store benchmark: {cfg.sites} sites x {cfg.width} {cfg.fp4_format}, "
                         f"{cfg.moe_layers} MoE layers x top-{cfg.top_k}; local {loc['tokens']:,} tokens "
                         f"({loc['logical_bytes'] / 1e6:,.0f} MB)"
                         + (f", S3 {s3['tokens']:,} tokens ({s3['logical_bytes'] / 1e6:,.0f} MB)" if s3 else "")
                         + f"; {result['machine']['cpu_count']} CPUs"))
    for name, justify in (("metric", "left"), ("value", "right"), ("goal", "left")):
        table.add_column(name, justify=justify)
    for row in summary_rows(result):
        table.add_row(*row)
    console.print(table)
    out = Path(args.out) if args.out else RESULTS / f"store-{machine_name()}{'-' + args.tag if args.tag else ''}.json"
    if not args.smoke or args.out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(to_json(result) + "\n")
        console.print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
