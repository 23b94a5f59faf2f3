"""The trainer's weight fake quantization (`tracefp4.fake_quantize_matrices`) on the H200 model's expert stacks:
the per-matrix global scales by the torch reference (`reference.global_scales_ref`: a cast, abs, isfinite, where
and amax per stack) against the Triton pass (`triton_kernels.global_scales_triton`), and the whole call with each.

Shapes: the H200 model's MoE layer (32 experts, hidden 2048, expert width 512): gate_up [32, 1024, 2048] and
down [32, 2048, 512], bf16, as the trainer holds them. Each figure: R runs (default 5), each the mean of N
back-to-back calls after warm-up (CUDA events); the median over runs and min..max. Checks that both scale paths
give the same bits first.

    python3 benchmarks/benchmark_matrices.py [--runs 5] [--iters 50] [--out PATH]
    python3 benchmarks/benchmark_matrices.py --smoke     # tiny stacks on the CPU (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import tracefp4  # noqa: E402
from tracefp4 import reference as ref  # noqa: E402
from tracefp4 import triton_kernels as tk  # noqa: E402

SHAPES = {"gate_up": (32, 1024, 2048), "down": (32, 2048, 512)}
SMOKE_SHAPES = {"gate_up": (4, 32, 64), "down": (4, 64, 16)}


def _time(fn, iters: int, runs: int, cuda: bool) -> dict:
    for _ in range(3):
        fn()
    per = []
    for _ in range(runs):
        if cuda:
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            b.synchronize()
            per.append(a.elapsed_time(b) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            per.append((time.perf_counter() - t) * 1e3 / iters)
    return {"ms": statistics.median(per), "min": min(per), "max": max(per), "runs": per}


def _save(stem: str, result: dict, out: str | None, smoke: bool, cuda: bool) -> str:
    """Write ``result`` with the machine's fields (host, versions, GPU) as JSON to ``out``, else to
    $OUT/<stem>-<gpu>.json on a device machine, benchmarks/results/<stem>-<gpu>.json here, /tmp/<stem>-smoke.json for
    --smoke; print and return the path."""
    gpu = "cpu" if not cuda else torch.cuda.get_device_name(0).split()[-1].lower()
    info = {"machine": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "triton": __import__("triton").__version__, "gpu": torch.cuda.get_device_name(0) if cuda else None,
            "smoke": smoke, **result}
    path = out or (f"/tmp/{stem}-smoke.json" if smoke else
                   os.path.join(os.environ.get("OUT") or "benchmarks/results", f"{stem}-{gpu}.json"))
    with open(path, "w") as fh:
        json.dump(info, fh, indent=1)
    print(f"saved {path}")
    return path


def _whole(w: torch.Tensor, triton_scales: bool) -> torch.Tensor:
    """fake_quantize_matrices with one or the other global-scale path (the launch it makes after them is the same)."""
    stack = w.reshape(-1, *w.shape[-2:])
    g = tk.global_scales_triton(stack) if triton_scales else ref.global_scales_ref(stack)
    out, _ = tk.fake_quantize_blocks_triton(stack.reshape(-1, 16), "nvfp4", g, None, None)
    return out.reshape(w.shape)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny stacks on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (median, min..max)")
    p.add_argument("--iters", type=int, default=50, help="back-to-back calls per run")
    p.add_argument("--out", default=None, help="JSON output (default $OUT/matrices-<gpu>.json or benchmarks/results/)")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    shapes = SMOKE_SHAPES if a.smoke else SHAPES
    runs, iters = (3, 2) if a.smoke else (a.runs, a.iters)
    rows = []
    for name, shape in shapes.items():
        w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).mul_(0.02).to(torch.bfloat16).to(dev)
        stack = w.reshape(-1, *shape[-2:])
        same = torch.equal(tk.global_scales_triton(stack).view(torch.int32), ref.global_scales_ref(stack).view(torch.int32))
        same &= torch.equal(tracefp4.fake_quantize_matrices(w).view(torch.int16), _whole(w, False).view(torch.int16))
        row = {"stack": name, "shape": list(shape), "bits_equal": bool(same),
               "scales_reference": _time(lambda: ref.global_scales_ref(stack), iters, runs, cuda),
               "scales_triton": _time(lambda: tk.global_scales_triton(stack), iters, runs, cuda),
               "call_reference_scales": _time(lambda: _whole(w, False), iters, runs, cuda),
               "call_triton_scales": _time(lambda: _whole(w, True), iters, runs, cuda)}
        row["copy"] = _time(lambda: w.clone(), iters, runs, cuda)
        rows.append(row)
    print(f"{'stack':8} {'shape':18} {'scales ref ms':>14} {'scales triton':>14} {'call ref':>10} {'call triton':>12}"
          f" {'copy':>8}  bits equal")
    for r in rows:
        f = {k: f"{r[k]['ms']:.3f}" for k in ("scales_reference", "scales_triton", "call_reference_scales",
                                               "call_triton_scales", "copy")}
        print(f"{r['stack']:8} {str(tuple(r['shape'])):18} {f['scales_reference']:>14} {f['scales_triton']:>14} "
              f"{f['call_reference_scales']:>10} {f['call_triton_scales']:>12} {f['copy']:>8}  {r['bits_equal']}")
    _save("matrices", {"runs": runs, "iters": iters, "dtype": "bf16", "rows": rows}, a.out, a.smoke, cuda)
    if not all(r["bits_equal"] for r in rows):
        sys.exit("the two global-scale paths differ")


if __name__ == "__main__":
    main()
