"""The store benchmark's configuration and its command-line flags, shared by ``tracestore bench`` and
``benchmarks/benchmark_store.py`` (light: the parser is built without loading the benchmark)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from ..cliargs import nonneg_int, positive_int

__all__ = ["BenchConfig", "add_arguments", "config_from_args", "DEFAULT_SITES", "DEFAULT_WIDTH", "DEFAULT_MOE_LAYERS",
           "DEFAULT_TOP_K", "DEFAULT_NUM_EXPERTS", "Progress"]

#: Qwen3.5-35B-A3B default table: 20 hinted sites of 2048 NVFP4 values, 40 MoE layers routing top-8 of 256
DEFAULT_SITES = 20
DEFAULT_WIDTH = 2048
DEFAULT_MOE_LAYERS = 40
DEFAULT_TOP_K = 8
DEFAULT_NUM_EXPERTS = 256

#: a benchmark's progress callback: (phase, done, total)
Progress = Callable[[str, int, int], None]


@dataclass
class BenchConfig:
    """Benchmark size and options (:mod:`tracestore.cli.bench` says what each phase measures)."""

    trajectories: int = 16
    tokens: int = 2048  # per trajectory
    sites: int = DEFAULT_SITES
    width: int = DEFAULT_WIDTH
    fp4_format: str = "nvfp4"
    moe_layers: int = DEFAULT_MOE_LAYERS
    top_k: int = DEFAULT_TOP_K
    num_experts: int = DEFAULT_NUM_EXPERTS
    write_tokens: int = 2048  # tokens per Writer.write call (tracerl's recorder writes pieces of flush_tokens=2048)
    commit_bytes: int = 64 << 20
    chunk_rows: int | None = None  # None: the store default
    shard_bytes: int | None = None
    repeats: int = 3
    url: str | None = None  # local bench directory; None: a temporary directory (removed afterwards)
    s3: bool = True
    s3_endpoint: str | None = None  # None: start a moto server
    s3_bucket: str = "tracestore-bench"
    s3_storage_options: dict | None = None
    s3_trajectories: int | None = None  # None: max(1, trajectories // 4)
    tail_commits: int = 20
    durable: bool = True  # also measure fsync'd writes and cold (page cache evicted) reads, local
    seed: int = 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's command-line flags (shared by ``tracestore bench`` and ``benchmarks/benchmark_store.py``)."""
    d = BenchConfig()

    def number(option: str, metavar: str, kind, default, help_: str) -> None:
        p.add_argument(option, type=kind, default=default, metavar=metavar, help=help_)

    number("--trajectories", "N", positive_int, d.trajectories, f"trajectories (default {d.trajectories})")
    number("--tokens", "N", positive_int, d.tokens, f"tokens per trajectory (default {d.tokens})")
    number("--sites", "N", positive_int, d.sites, f"hinted sites (default {d.sites})")
    number("--width", "W", positive_int, d.width, f"values per site (default {d.width})")
    p.add_argument("--fp4-format", choices=("nvfp4", "mxfp4"), default=d.fp4_format,
                   help=f"FP4 format of the sites (default {d.fp4_format})")
    number("--moe-layers", "L", nonneg_int, d.moe_layers,
           f"MoE layers in the trace (default {d.moe_layers}; 0 = no routed experts)")
    number("--top-k", "K", positive_int, d.top_k, f"routed experts per token and MoE layer (default {d.top_k})")
    number("--num-experts", "E", positive_int, d.num_experts, f"experts per MoE layer (default {d.num_experts})")
    number("--write-tokens", "N", positive_int, d.write_tokens,
           f"tokens per Writer.write call (default {d.write_tokens})")
    number("--commit-bytes", "BYTES", positive_int, d.commit_bytes, "writer commit size (default 64 MiB)")
    number("--chunk-rows", "N", positive_int, None, "store layout (default: the store default)")
    number("--shard-bytes", "BYTES", positive_int, None, "store layout (default: the store default)")
    number("--repeats", "N", positive_int, d.repeats, f"repeats, median reported (default {d.repeats})")
    p.add_argument("--url", metavar="DIR", help="local benchmark directory (default: a temporary directory)")
    p.add_argument("--s3", action=argparse.BooleanOptionalAction, default=True,
                   help="also benchmark S3 (default: yes, against a moto server on 127.0.0.1)")
    p.add_argument("--s3-endpoint", metavar="URL", help="S3 endpoint URL (default: start a moto server)")
    p.add_argument("--s3-bucket", metavar="NAME", default=d.s3_bucket,
                   help=f"bucket for --s3-endpoint (default {d.s3_bucket})")
    number("--s3-trajectories", "N", positive_int, None,
           "trajectories on S3 (default: --trajectories // 4, at least 1)")
    p.add_argument("--durable", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure fsync'd writes and cold reads locally (default: yes)")
    number("--tail-commits", "N", positive_int, d.tail_commits,
           f"commits timed for the tail latency (default {d.tail_commits})")
    p.add_argument("--out", metavar="FILE", help="save the JSON result here")


def config_from_args(args: argparse.Namespace, s3_storage_options: dict | None = None) -> BenchConfig:
    return BenchConfig(
        trajectories=args.trajectories, tokens=args.tokens, sites=args.sites, width=args.width,
        fp4_format=args.fp4_format, moe_layers=args.moe_layers, top_k=args.top_k, num_experts=args.num_experts,
        write_tokens=args.write_tokens, commit_bytes=args.commit_bytes, chunk_rows=args.chunk_rows,
        shard_bytes=args.shard_bytes, repeats=args.repeats, url=args.url, s3=args.s3,
        s3_endpoint=args.s3_endpoint or getattr(args, "endpoint_url", None), s3_bucket=args.s3_bucket,
        s3_storage_options=s3_storage_options, s3_trajectories=args.s3_trajectories, durable=args.durable,
        tail_commits=args.tail_commits)
