"""The trainer's code-agreement count per hinted site (`tracefp4.effective_codes`): the codes a fake-quantized
activation carries, by the torch reference (`reference.nvfp4_codes_ref`: a cast, a division, a bucketize with int64
buckets, a table look-up and a where) against the Triton pass (`triton_margin.nvfp4_codes_triton`), the way the
trainer calls it (the public function, argument checks included).

Shape: one micro-batch of the H200 model's trainer at one hinted site, [8192, 2048] bf16 (``--rows``,
``--width``), fake-quantized with the rollout's scales and hints as the trainer's forward makes it. Each figure: R
runs (default 5), each the mean of N back-to-back calls after warm-up (CUDA events); the median over runs and
min..max, and per step the figure times the H200 model's 20 hinted sites. Checks that both give the same bits
first (exits 1 otherwise).

    python3 benchmarks/benchmark_effective_codes.py [--runs 5] [--iters 50] [--out PATH]
    python3 benchmarks/benchmark_effective_codes.py --smoke     # tiny, on the CPU (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

import tracefp4  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from benchmark_matrices import _save, _time  # noqa: E402  (the same timing and results file as it)

SITES = 20  # hinted sites of the H200 model (the latter half of 40 MoE inputs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--rows", type=int, default=8192, help="rows (tokens) of the activation (default 8192)")
    p.add_argument("--width", type=int, default=2048, help="its width (default 2048, a multiple of 16)")
    p.add_argument("--runs", type=int, default=5, help="timed runs per figure (median, min..max; default 5)")
    p.add_argument("--iters", type=int, default=50, help="back-to-back calls per run (default 50)")
    p.add_argument("--out", default=None,
                   help="JSON output (default $OUT/effective-codes-<gpu>.json or benchmarks/results/)")
    a = p.parse_args()
    if a.width <= 0 or a.width % 16 or a.rows <= 0:
        p.error(f"--rows {a.rows} --width {a.width}: need rows >= 1 and a width that is a positive multiple of 16")
    cuda = torch.cuda.is_available() and not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    rows, width = (16, 256) if a.smoke else (a.rows, a.width)
    runs, iters = (2, 1) if a.smoke else (a.runs, a.iters)
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(rows, width, generator=gen) * 2).to(torch.bfloat16).to(dev)
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g)
    xn = (x.float() * (1 + 0.01 * torch.randn(x.shape, generator=gen).to(dev))).to(torch.bfloat16)
    y = tracefp4.fake_quantize(xn, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints).detach()
    want = tracefp4.effective_codes(y, q.scales, g, backend="reference")
    got = tracefp4.effective_codes(y, q.scales, g, backend="triton")
    same = bool(torch.equal(got, want))
    row = {"rows": rows, "width": width, "bits_equal": same,
           "reference": _time(lambda: tracefp4.effective_codes(y, q.scales, g, backend="reference"), iters, runs, cuda),
           "triton": _time(lambda: tracefp4.effective_codes(y, q.scales, g, backend="triton"), iters, runs, cuda),
           "copy": _time(lambda: y.clone(), iters, runs, cuda)}
    ref_ms, tri_ms = row["reference"]["ms"], row["triton"]["ms"]
    print(f"effective_codes on [{rows}, {width}] bf16 ({'GPU ' + torch.cuda.get_device_name(0) if cuda else 'CPU'}),"
          f" median of {runs} runs x {iters} calls, min..max")
    for k in ("reference", "triton", "copy"):
        r = row[k]
        print(f"  {k:10} {r['ms']:9.4f} ms  ({r['min']:.4f}..{r['max']:.4f})")
    print(f"  triton / reference {tri_ms / ref_ms:.3f}; per step at {SITES} sites: {SITES * ref_ms:.2f} -> "
          f"{SITES * tri_ms:.2f} ms; bits equal: {same}")
    _save("effective-codes", {"runs": runs, "iters": iters, "dtype": "bf16", "sites_per_step": SITES, **row}, a.out,
          a.smoke, cuda)
    if not same:
        sys.exit("the Triton codes differ from the reference's")


if __name__ == "__main__":
    main()
