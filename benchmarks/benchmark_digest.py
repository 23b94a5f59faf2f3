"""The weights' digest each training step reports (`tracerl.train.param_digest`): the torch form (bits widened to
int64, times a table of position weights, summed: four launches and ~44 bytes of traffic per fp32 value) against
the Triton pass (`tracerl.train.digest_triton`: 4 bytes per value), on the fp32 master weights of the H200 model's
trainer (``--layers``, default 40; the parameters' shapes from the model built on the meta device, random values).

Each figure: R runs (default 5), each the mean of N back-to-back digests after warm-up (CUDA events, host sync
included: the digest ends with one); median over runs and min..max. Checks that both give the same digest first
(exits 1 otherwise).

    python3 benchmarks/benchmark_digest.py [--layers 40] [--runs 5] [--iters 5] [--out PATH]
    python3 benchmarks/benchmark_digest.py --smoke     # tiny, on the CPU (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_fsdp import GPU_SPEC, SMOKE_SPEC
from benchmark_matrices import _save, _time  # noqa: E402  (the same timing and results file as it)

from tracerl.config import TinyMoESpec
from tracerl.policy.models import build_model
from tracerl.train import determinism


def _shapes(spec: dict) -> list[tuple[int, ...]]:
    with torch.device("meta"):
        model = build_model(TinyMoESpec(**spec))
    return [tuple(p.shape) for p in model.parameters()]


def _digest(tensors: list[torch.Tensor], triton: bool) -> str:
    """param_digest with one or the other per-tensor sum (the rest, the stack and the host hash, is the same)."""
    real = determinism._bit_sum
    determinism._bit_sum = ((lambda f, first: __import__("tracerl.train.digest_triton", fromlist=["bit_sum"])
                             .bit_sum(f, first)) if triton else determinism._bit_sum_torch)
    try:
        return determinism.param_digest(tensors)
    finally:
        determinism._bit_sum = real


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default the H200 model's 40)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (median, min..max; default 5)")
    p.add_argument("--iters", type=int, default=5, help="back-to-back digests per run (default 5)")
    p.add_argument("--out", default=None,
                   help="JSON output (default $OUT/digest-<gpu>.json or benchmarks/results/)")
    a = p.parse_args()
    cuda = torch.cuda.is_available() and not a.smoke
    if not cuda and not a.smoke:
        p.error("needs a CUDA device (or --smoke for the CPU)")
    spec = dict(SMOKE_SPEC if a.smoke else GPU_SPEC)
    if a.layers is not None:
        if a.layers < 1:
            p.error(f"--layers {a.layers}: need >= 1")
        spec["num_layers"] = a.layers
    dev = "cuda" if cuda else "cpu"
    g = torch.Generator(device=dev).manual_seed(0)
    tensors = [torch.randn(s, generator=g, device=dev, dtype=torch.float32) for s in _shapes(spec)]
    numel = sum(t.numel() for t in tensors)
    same = _digest(tensors, True) == _digest(tensors, False)
    if not same:
        print("the Triton digest differs from the torch form", file=sys.stderr)
        sys.exit(1)
    res = {}
    for name, tri in (("torch", False), ("triton", True)):
        res[name] = _time(lambda tri=tri: _digest(tensors, tri), a.iters, a.runs, cuda)
    gb = numel * 4 / 1e9
    print(f"{len(tensors)} fp32 tensors, {numel / 1e9:.3f} G values ({gb:.1f} GB), same digest: {same}")
    print(f"{'form':8s} {'ms (min..max)':>24s} {'GB/s of fp32 read':>18s}")
    for name, r in res.items():
        print(f"{name:8s} {r['ms']:10.2f} ({r['min']:.2f}..{r['max']:.2f}) {gb / (r['ms'] / 1e3):18.0f}")
    print(f"torch / triton: {res['torch']['ms'] / res['triton']['ms']:.1f}x")
    _save("digest", {"spec": spec, "tensors": len(tensors), "values": numel, "same": same, "args": vars(a),
                     "results": res}, a.out, a.smoke, cuda)

if __name__ == "__main__":
    main()
