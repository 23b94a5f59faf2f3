"""Weight sync of the closed loop: publishing a policy version (`tracerl.artifacts.weights.publish`) and loading it
(`tracerl.artifacts.weights.load_state_dict`) through a local directory, the share of each that the blob checksum takes,
and how long each keeps other Python threads from running (both run on background threads in the loop: the
trainer publishes while it trains the next step, the rollout prefetches while it generates).

On the two-H200 loop (benchmarks/results/loop-cuda.json) the rollout waited 20-28 s per policy version of 9 GB;
format 1 of the sidecar checksummed the blob with sha256 at both ends. Format 2 uses crc32c. This program times,
on the same bf16 state dict: publish and load end to end with the default format, and the checksum alone with
each algorithm (the difference is what format 2 saves per version at each end). Medians of --reps runs with
min..max.

    python benchmarks/benchmark_weights.py                # 2 GiB of bf16 tensors, 3 runs
    python benchmarks/benchmark_weights.py --smoke        # 64 MiB, checks the code paths
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tracerl.artifacts import weights as W  # noqa: E402
from tracerl.artifacts.objects import checksum  # noqa: E402


def _in_thread(fn) -> tuple[float, float]:
    """Run ``fn`` on a background thread (as the trainer publishes and the rollout prefetches) while this thread
    ticks every millisecond: (seconds, the longest this thread was kept from running)."""
    done, result = threading.Event(), []

    def run():
        try:
            result.append(fn())
        finally:
            done.set()

    th = threading.Thread(target=run)
    t0 = last = time.perf_counter()
    th.start()
    gap = 0.0
    while not done.is_set():
        time.sleep(0.001)
        now = time.perf_counter()
        gap, last = max(gap, now - last), now
    th.join()
    if not result:
        raise RuntimeError("the timed call failed")
    return time.perf_counter() - t0, gap


def _stats(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gib", type=float, default=2.0, help="size of the state dict in GiB (default 2)")
    p.add_argument("--reps", type=int, default=3, help="runs (median reported; default 3)")
    p.add_argument("--smoke", action="store_true", help="64 MiB, 1 run")
    p.add_argument("--workdir", metavar="DIR",
                   help="the directory below which the versions are written in a temporary folder (created if it does "
                        "not exist; default: the system's temporary directory)")
    p.add_argument("--out", help="JSON path (default benchmarks/results/weights-<machine>.json; smoke: a temp file)")
    args = p.parse_args(argv)
    gib, reps = (1 / 16, 1) if args.smoke else (args.gib, args.reps)
    if reps < 1 or gib <= 0:
        p.error("--reps must be >= 1 and --gib > 0")
    n_tensors = 64
    per = int(gib * (1 << 30)) // 2 // n_tensors
    sd = {f"layer{i}.w": torch.randn(per, dtype=torch.bfloat16) for i in range(n_tensors)}
    nbytes = sum(t.numel() * t.element_size() for t in sd.values())
    rows: dict[str, list[float]] = {k: [] for k in ("publish_s", "load_s", "sha256_s", "crc32c_s", "publish_stall_s",
                                                    "load_stall_s", "library_save_stall_s", "library_load_stall_s")}
    from safetensors.torch import load as lib_load
    from safetensors.torch import save as lib_save
    if args.workdir:
        os.makedirs(args.workdir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for rep in range(reps):
            url = os.path.join(tmp, f"run{rep}")
            secs, gap = _in_thread(lambda: W.publish(url, 0, sd))
            rows["publish_s"].append(secs)
            rows["publish_stall_s"].append(gap)
            secs, gap = _in_thread(lambda: W.load_state_dict(url, 0))
            rows["load_s"].append(secs)
            rows["load_stall_s"].append(gap)
            tensors, side = W.load_state_dict(url, 0)
            assert all(torch.equal(tensors[k], v) for k, v in sd.items())
            blob = Path(url, side["key"]).read_bytes()
            del tensors
            rows["library_save_stall_s"].append(_in_thread(lambda: lib_save(sd))[1])
            rows["library_load_stall_s"].append(_in_thread(lambda: lib_load(blob))[1])
            shutil.rmtree(url)  # the next run starts with as much free memory as this one
            for algo in ("sha256", "crc32c"):
                t0 = time.perf_counter()
                checksum(blob, algo)
                rows[f"{algo}_s"].append(time.perf_counter() - t0)
            del blob
    res = {k: _stats(v) for k, v in rows.items()}
    gb = nbytes / 1e9
    out = {"benchmark": "weights", "bytes": nbytes, "tensors": n_tensors, "reps": reps, "format_version": W.FORMAT_VERSION,
           "results": res,
           "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
                       "python": platform.python_version(), "torch": torch.__version__,
                       "loadavg_1min": os.getloadavg()[0]}}
    print(f"{gb:.2f} GB of bf16 tensors, {reps} run(s), local directory {tempfile.gettempdir() if not args.workdir else args.workdir}")
    print(f"{'':22s} {'median s':>9s} {'min..max':>15s} {'GB/s':>7s}")
    for k, label in (("publish_s", "publish (format 2)"), ("load_s", "load (format 2)"), ("sha256_s", "sha256 (format 1)"),
                     ("crc32c_s", "crc32c (format 2)")):
        r = res[k]
        print(f"{label:22s} {r['median']:9.3f} {r['min']:7.3f}..{r['max']:.3f} {gb / r['median']:7.2f}")
    print(f"longest pause of another Python thread: publish {1e3 * res['publish_stall_s']['median']:.0f} ms, load "
          f"{1e3 * res['load_stall_s']['median']:.0f} ms (safetensors' own save {1e3 * res['library_save_stall_s']['median']:.0f}"
          f" ms, load {1e3 * res['library_load_stall_s']['median']:.0f} ms: they hold the GIL for the whole copy)")
    saved = res["sha256_s"]["median"] - res["crc32c_s"]["median"]
    print(f"format 2 saves {saved:.2f} s per version at each end ({saved / gb:.2f} s/GB): publish and load each "
          f"checksum the blob once")
    out["saved_s_per_end"] = saved
    path = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "weights-smoke.json" if args.smoke else
                                            Path(__file__).resolve().parent / "results" /
                                            f"weights-{platform.machine()}-{os.cpu_count()}cpu.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
