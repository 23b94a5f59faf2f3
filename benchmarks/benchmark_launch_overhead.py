"""Host time per call of the trainer's FP4 operations, layer by layer down to a bare Triton launch.

The trainer's step is host-bound (the H100 at 20 layers: GPU busy 52-80%), so the host microseconds each FP4 call
costs are what the fp4_hints step pays over a bf16 one. This times, on inputs so small that the device finishes
each launch long before the host issues the next, the host time per call (wall time of N back-to-back calls,
then one sync, divided by N) of:

  torch_add          ``x.add(1)``: one torch operation, the floor every launch pays
  triton_copy        a one-line Triton copy kernel launched with ``kernel[grid](...)``: Triton's own launch path
  launcher_hints     ``triton_kernels.fake_quantize_blocks_triton``: our launcher (argument checks, grid, views)
  api_hints          ``tracefp4.fake_quantize(x, global_scale=g, scales=s, hints=h)`` under no_grad
  api_hints_grad     the same with ``x.requires_grad`` (the autograd node a training forward builds)
  api_rtn            ``tracefp4.fake_quantize(x, global_scale=g)`` (own scales, as the unhinted sites)
  matrices           ``tracefp4.fake_quantize_matrices`` of a small expert stack (the weight path: 3 launches)

Each figure: the median of R runs (default 5) of N calls (default 2,000) after a warm-up, with min..max. The
differences between rows say where a call's host time goes; a row times the sum of everything above it in the
call chain.

    python3 benchmarks/benchmark_launch_overhead.py [--runs 5] [--iters 2000] [--out PATH]
    python3 benchmarks/benchmark_launch_overhead.py --smoke     # the CPU under Triton's interpreter (checks the code)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tracefp4  # noqa: E402
from tracefp4 import triton_kernels as tk  # noqa: E402


@triton.jit
def _copy_kernel(src, dst, n, BN: tl.constexpr):
    offs = tl.program_id(0) * BN + tl.arange(0, BN)
    tl.store(dst + offs, tl.load(src + offs, mask=offs < n), mask=offs < n)


def _host_us(fn, iters: int, runs: int, cuda: bool) -> dict:
    """Host microseconds per call: ``iters`` back-to-back calls timed on the host clock, a sync after each run."""
    for _ in range(max(10, iters // 10)):
        fn()
    if cuda:
        torch.cuda.synchronize()
    per = []
    for _ in range(runs):
        t = time.perf_counter()
        for _ in range(iters):
            fn()
        per.append((time.perf_counter() - t) * 1e6 / iters)
        if cuda:
            torch.cuda.synchronize()
    return {"us": statistics.median(per), "min": min(per), "max": max(per), "runs": per}


def cases(device: torch.device, rows: int, width: int, stack: tuple[int, int, int]) -> dict:
    """name -> a zero-argument callable issuing one call of that layer, on tiny inputs on ``device``."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, width, generator=gen).to(device=device, dtype=torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g)
    scales, hints = q.scales, q.hints
    xb = x.reshape(-1, 16)
    sb, hb = scales.reshape(-1), hints.reshape(-1, 2)
    flat, dst = x.reshape(-1), torch.empty_like(x).reshape(-1)
    w = torch.randn(*stack, generator=gen).to(device=device, dtype=torch.bfloat16)
    be = "triton"

    def api_hints_grad():
        return tracefp4.fake_quantize(xg, "nvfp4", global_scale=g, scales=scales, hints=hints, backend=be)

    def no_grad(fn):
        def run():
            with torch.no_grad():
                return fn()
        return run

    return {
        "torch_add": lambda: x.add(1),
        "triton_copy": lambda: _copy_kernel[(triton.cdiv(flat.numel(), 1024),)](flat, dst, flat.numel(), BN=1024),
        "launcher_hints": lambda: tk.fake_quantize_blocks_triton(xb, "nvfp4", g, sb, hb),
        "api_hints": no_grad(lambda: tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=scales, hints=hints,
                                                            backend=be)),
        "api_hints_grad": api_hints_grad,
        "api_rtn": no_grad(lambda: tracefp4.fake_quantize(x, "nvfp4", global_scale=g, backend=be)),
        "matrices": lambda: tracefp4.fake_quantize_matrices(w, backend=be),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5, help="runs per case; the median is reported (default 5)")
    ap.add_argument("--iters", type=int, default=2000, help="back-to-back calls per run (default 2000)")
    ap.add_argument("--rows", type=int, default=16, help="activation rows (default 16: tiny, host-bound)")
    ap.add_argument("--width", type=int, default=2048, help="activation width (default 2048, the H200 model's)")
    ap.add_argument("--out", default=None, help="JSON path (default $OUT or benchmarks/results/launch-overhead-<gpu>.json)")
    ap.add_argument("--smoke", action="store_true", help="the CPU under Triton's interpreter, few calls (checks the code)")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        ap.error("needs a CUDA GPU (or --smoke)")
    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.runs, args.iters, args.rows, args.width = 2, 3, 2, 32
    stack = (4, 64, args.width) if not args.smoke else (2, 4, 32)
    rows = {}
    for name, fn in cases(device, args.rows, args.width, stack).items():
        rows[name] = _host_us(fn, args.iters, args.runs, cuda)
        r = rows[name]
        print(f"{name:16s} {r['us']:9.1f} us/call  ({r['min']:.1f}..{r['max']:.1f})", flush=True)
    gpu = torch.cuda.get_device_name(0) if cuda else None
    info = {"machine": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": triton.__version__, "gpu": gpu, "smoke": args.smoke, "runs": args.runs, "iters": args.iters,
            "rows": args.rows, "width": args.width, "stack": list(stack), "cases": rows}
    tag = "cpu" if gpu is None else gpu.split()[1].lower() if len(gpu.split()) > 1 else "gpu"
    path = args.out or ("/tmp/launch-overhead-smoke.json" if args.smoke else
                        os.path.join(os.environ.get("OUT") or "benchmarks/results", f"launch-overhead-{tag}.json"))
    with open(path, "w") as fh:
        json.dump(info, fh, indent=1)
    print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
