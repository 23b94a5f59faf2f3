"""Store benchmark: bytes per token, write/read throughput against plain files and plain S3 objects, tail latency.

``run_bench(BenchConfig(...))`` returns one JSON-able dict; ``tracestore bench`` and
``benchmarks/benchmark_store.py`` call it. What is measured (every timing is the median of ``repeats`` runs):

* **bytes per token** (``info`` of the benchmark store): ``payload`` (hint + scale shards), ``trace`` (token ids,
  log-probs, routed experts), ``index_log`` (zarr metadata, log entries, log checkpoints, manifest), reported
  separately, with two overhead definitions: ``overhead_payload`` = (payload + index_log) / logical payload - 1
  (framing cost of the hints: crc32c per inner chunk, shard index, metadata, log) and ``overhead_total`` = all
  stored bytes / logical (payload + trace) - 1.
* **write ratio** = plain time / store time for the same logical bytes: the store writes ``trajectories`` x
  ``tokens`` rows through a :class:`~tracestore.Writer` (``write_tokens`` tokens per ``write`` call, commits
  of ``commit_bytes``; timed from the first write to ``close``); the plain baseline then writes, from one
  preallocated buffer, exactly the objects the store produced (same count, same sizes, same directories),
  one plain ``open().write()`` per file (local) or one s3fs ``pipe`` per segment's objects (S3, as
  concurrent as the store's ``put_many``); the side that writes first alternates between repeats. So the ratio isolates tracestore's own work: validation, the copy
  into the write buffer, crc32c, shard index, log commit.
* **read ratio** = plain time / store time: the store reads every trajectory in full with
  :meth:`Reader.read` (numpy, trace included, crc32c checked; index built from the log inside the timing),
  dropping each batch before the next read as a trainer consuming micro-batches does (so the reader recycles
  the previous batch's output memory; a batch that is kept is never overwritten); the plain baseline reads
  every file it wrote into a fresh numpy array (``np.fromfile`` / s3fs ``cat`` per segment group). Both read
  data written just before (local: from the page cache, both alike). The store shares a large local read
  among ``LocalBackend.read_threads`` threads; the plain baseline reads on one thread, so
  ``read_ratio_vs_threaded_plain`` also compares with plain reads on that many threads (the store's own
  overhead when both use the cores).
  ``read_amplification`` = bytes the store fetched / logical bytes (whole inner chunks at trajectory ends).
* **tail latency**: a :class:`~tracestore.Stream` tailing in a thread (default poll interval) while a writer
  commits small records at random intervals; latency = time seen - the entry's ``created_unix`` (set just
  before the log put), median and p95.

S3 runs against ``s3_endpoint``, or a moto server this module starts in a subprocess on 127.0.0.1 (free port).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import tempfile
import time
import uuid
from dataclasses import asdict

from .bench_config import (
    DEFAULT_SITES,
    DEFAULT_WIDTH,
    BenchConfig,
    Progress,
    add_arguments,
    config_from_args,
)
from ..errors import OptionError
from .moto import MotoServer

# the measurements are in bench_phases, the configuration and flags in bench_config, the moto server in moto; what
# programs import from here stays here
__all__ = ["BenchConfig", "run_bench", "summary_rows", "to_json", "machine_info", "machine_name", "MotoServer",
           "add_arguments", "config_from_args", "DEFAULT_SITES", "DEFAULT_WIDTH"]


def _versions() -> dict:
    from importlib import metadata

    out = {"python": platform.python_version()}
    for dist in ("tracestore", "numpy", "pyarrow", "zarr", "crc32c", "fsspec", "s3fs", "aiobotocore", "moto"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def machine_info() -> dict:
    return {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine(),
            "processor": platform.processor() or None, "hostname": socket.gethostname()}


def machine_name() -> str:
    """A short name for result files: ``<arch>-<n>cpu``."""
    return f"{platform.machine() or 'unknown'}-{os.cpu_count()}cpu"


#: how the two sides are timed, recorded with every result
METHOD = {
    "read": "the store reads each trajectory with Reader.read (numpy, trace included, every chunk's crc32c "
            "checked) and drops the batch before the next read, as a trainer consuming micro-batches does: the "
            "reader recycles the previous batch's output memory (a batch still referenced is never "
            "overwritten); the plain side reads each file into a fresh numpy array (np.fromfile / s3fs cat)",
    "order": "reads alternate which side goes first; so do writes (the plain side writes the objects, names "
             "and sizes, of the store's latest write)",
}


def run_bench(cfg: BenchConfig | None = None, progress: Progress | None = None) -> dict:
    """Run the benchmark; returns one JSON-able dict (see the module docstring). Never deletes ``cfg.url``
    itself, only what it created below it."""
    from . import bench_phases  # numpy and the store: loaded when a benchmark runs, not with the parser

    cfg = cfg or BenchConfig()
    if cfg.trajectories <= 0 or cfg.tokens <= 0 or cfg.repeats <= 0 or cfg.write_tokens <= 0:
        raise OptionError(f"trajectories, tokens, repeats and write_tokens must be > 0, got {cfg}")
    tmp = None
    base = cfg.url
    if base is None:
        tmp = base = tempfile.mkdtemp(prefix="tracestore-bench-")
    run_dir = os.path.join(os.path.abspath(base), f"run-{uuid.uuid4().hex[:8]}")
    os.makedirs(run_dir)
    t_start = time.perf_counter()
    result: dict = {"config": {k: v for k, v in asdict(cfg).items() if k != "s3_storage_options"}, "method": METHOD}
    try:
        loc = bench_phases.run_local(run_dir, cfg, progress)
        sizes, local, durable, tail = loc["sizes"], loc["local"], loc["durable"], loc["tail"]
        result.update({k: sizes[k] for k in ("payload_bytes_per_token", "trace_bytes_per_token", "bytes_per_token",
                                             "bytes_per_token_without_trace", "overhead_payload", "overhead_total")})
        result.update({"write_ratio_local": local["write_ratio"], "read_ratio_local": local["read_ratio"],
                       "read_ratio_local_vs_threaded_plain": local.get("read_ratio_vs_threaded_plain")})
        if durable is not None:
            result["write_ratio_local_fsync"] = durable["write_ratio"]
            result["read_ratio_local_cold"] = durable["read_ratio"]
        result["tail_latency_s"] = tail["median"]
        result["tail_latency_p95_s"] = tail["p95"]
        s3 = bench_phases.run_s3(cfg, progress) if cfg.s3 else None
        if s3 is not None:
            result["write_ratio_s3"] = s3["write_ratio"]
            result["read_ratio_s3"] = s3["read_ratio"]
        result.update(sizes=sizes, local=local, local_durable=durable, tail=tail, s3=s3,
                      goals=_goals(sizes, local, durable, tail, s3), machine=machine_info(), versions=_versions(),
                      wall_s=time.perf_counter() - t_start, unix_time=time.time())
        return result
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _goals(sizes: dict, local: dict, durable: dict | None, tail: dict, s3: dict | None) -> dict:
    """Each goal of the store (README) and whether this run met it (None: not measured)."""
    return {
        "overhead_payload <= 0.01": sizes["overhead_payload"] <= 0.01,
        "write_ratio_local >= 0.8": local["write_ratio"] >= 0.8,
        "read_ratio_local >= 0.8": local["read_ratio"] >= 0.8,
        "write_ratio_s3 >= 0.8": None if s3 is None else s3["write_ratio"] >= 0.8,
        "read_ratio_s3 >= 0.8": None if s3 is None else s3["read_ratio"] >= 0.8,
        "write_ratio_local_fsync >= 0.8": None if durable is None else durable["write_ratio"] >= 0.8,
        "read_ratio_local_cold >= 0.8": None if durable is None else durable["read_ratio"] >= 0.8,
        "tail_latency_s < 1": tail["median"] is not None and tail["median"] < 1.0,
    }


def summary_rows(result: dict) -> list[tuple[str, str, str]]:
    """(metric, value, goal) rows for a human table."""
    def f(v, fmt="{:.3f}"):
        return "-" if v is None else fmt.format(v)

    s3 = result.get("s3") or {}
    loc = result["local"]
    rows = [
        ("payload bytes/token (logical)", f(result["payload_bytes_per_token"], "{:,}"), ""),
        ("trace bytes/token (logical)", f(result["trace_bytes_per_token"], "{:,}"), ""),
        ("stored bytes/token (all)", f(result["bytes_per_token"], "{:,.1f}"), ""),
        ("stored bytes/token (no trace)", f(result["bytes_per_token_without_trace"], "{:,.1f}"), ""),
        ("overhead on payload", f(100 * result["overhead_payload"], "{:.3f}%"), "<= 1%"),
        ("overhead on payload+trace", f(100 * result["overhead_total"], "{:.3f}%"), ""),
        ("local write MB/s store / plain", f"{loc['write_MBps_store']:.0f} / {loc['write_MBps_plain']:.0f}", ""),
        ("write_ratio_local", f(result["write_ratio_local"]), ">= 0.8"),
        ("local read MB/s store / plain", f"{loc['read_MBps_store']:.0f} / {loc['read_MBps_plain']:.0f}", ""),
        ("read_ratio_local", f(result["read_ratio_local"]), ">= 0.8"),
    ]
    if "read_ratio_vs_threaded_plain" in loc:
        rows.append((f"  vs plain reads on {loc['read_threads_store']} threads (as the store reads)",
                     f(loc["read_ratio_vs_threaded_plain"]), ""))
    rows += [
        ("read amplification (local)", f(loc["read_amplification"]), ""),
    ]
    dur = result.get("local_durable")
    if dur:
        rows += [
            ("local fsync write MB/s store / plain", f"{dur['write_MBps_store']:.0f} / {dur['write_MBps_plain']:.0f}",
             ""),
            ("write_ratio_local_fsync", f(dur["write_ratio"]), ">= 0.8"),
            ("local cold read MB/s store / plain", f"{dur['read_MBps_store']:.0f} / {dur['read_MBps_plain']:.0f}", ""),
            ("read_ratio_local_cold", f(dur["read_ratio"]), ">= 0.8"),
        ]
    if s3:
        rows += [
            ("s3 write MB/s store / plain", f"{s3['write_MBps_store']:.0f} / {s3['write_MBps_plain']:.0f}", ""),
            ("write_ratio_s3", f(result.get("write_ratio_s3")), ">= 0.8"),
            ("s3 read MB/s store / plain", f"{s3['read_MBps_store']:.0f} / {s3['read_MBps_plain']:.0f}", ""),
            ("read_ratio_s3", f(result.get("read_ratio_s3")), ">= 0.8"),
            ("s3 tail latency median / p95 s", f"{f(s3.get('tail_latency_s'))} / {f(s3.get('tail_latency_p95_s'))}", ""),
        ]
    rows.append(("tail latency median / p95 s (local)",
                 f"{f(result['tail_latency_s'])} / {f(result['tail_latency_p95_s'])}", "< 1 s"))
    return rows


def to_json(result: dict) -> str:
    return json.dumps(result, indent=1, sort_keys=False)
