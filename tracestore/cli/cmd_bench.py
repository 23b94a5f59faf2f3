"""``tracestore bench``: the store benchmark (:mod:`tracestore.cli.bench`) from the command line."""

from __future__ import annotations

import argparse

from ..cliargs import load_json_arg
from .bench_config import add_arguments
from .common import json_out, out, progress

__all__ = ["register"]


def register(add) -> None:
    """Add this module's subcommands through ``add`` (see :func:`tracestore.cli.main.build_parser`)."""
    p = add("bench", "benchmark: bytes/token, write/read throughput vs plain files and plain S3, tail latency",
            description="Benchmark the store against plain files (local) and plain s3fs (moto server started on "
                        "127.0.0.1 unless --s3-endpoint): bytes per token by category, write/read ratios (page "
                        "cache; fsync'd / cold), tail latency. Defaults: the Qwen3.5-35B-A3B table (20 sites x 2048 "
                        "NVFP4 values, 40 MoE layers, top-8 of 256 experts). --storage-options apply to "
                        "--s3-endpoint.",
            examples=["tracestore bench --trajectories 4 --tokens 512 --no-s3 --no-durable",
                      "tracestore bench --out bench.json --json"],
            url=False, json="print one JSON object")
    add_arguments(p)
    p.set_defaults(func=_cmd_bench)


def _cmd_bench(args: argparse.Namespace) -> int:
    from .bench import config_from_args, run_bench, summary_rows, to_json

    s3_options = load_json_arg(args.storage_options, "--storage-options") if args.storage_options else None
    cfg = config_from_args(args, s3_options)
    with progress(args, "bench") as update:
        result = run_bench(cfg, progress=lambda phase, done, total: update(done, total, phase))
    text = to_json(result)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    if args.json:
        json_out(result)
    else:
        rows = summary_rows(result)
        w0 = max(len(r[0]) for r in rows)
        w1 = max(len(r[1]) for r in rows)
        for name, value, goal in rows:
            out(f"{name:<{w0}}  {value:>{w1}}  {goal}".rstrip())
    return 0
