"""Benchmark of the margin-exception kernels (`tracefp4.margin_marks`, `tracefp4.margin_fill`, NUMERICS §12) on a GPU.

For every input dtype (bf16, fp16, fp32) and hidden size it
  1. checks that the Triton kernels equal the torch reference bit for bit on the GPU: random rows of spread
     magnitudes with NaN / +-Inf / +-0 / subnormals sprinkled in, blocks that put exact ladder values and
     boundaries at v (g = 1, block amax 6), every special bit pattern of the dtype, given scale bytes that are not
     the block's own (0, NaN, negative, neighbours) and flipped hint bits; marks at every (margin, scale margin) of
     --margins, fills with payload "byte" and "lsb" from those marks;
  2. times margin_marks, margin_fill (both payloads) and a device-to-device copy of x (the yardstick, as in
     benchmark_kernels.py): R runs (--runs), each the mean of --iters back-to-back calls (CUDA events) after 3
     warm-up calls; the figure is the median over runs, the spread min..max; the torch reference once per op
     (--ref-runs runs of 1 call) for the speed-up.

Bytes counted (n values, E bytes per input value):
  copy             : read nE, write nE
  margin_marks     : read nE + n/16 (scales) + n/8 (hints), write n/8 + n/128 (bitmaps)
  margin_fill_byte : read nE + n/8 + n/128 + n/8 + n/16, write n/16 + n/8
  margin_fill_lsb  : read nE + n/8 + n/128 + n/8 + n/128, write n/16 + n/8

Usage: python3 benchmarks/benchmark_margin.py [--smoke] [--hidden 2048 7168] [--dtypes bf16 fp16 fp32]
       [--margins 0.03 0.1 inf] [--time-margin 0.1] [--gib 0.5] [--check-rows 512] [--runs 5] [--iters 10]
       [--ref-runs 3] [--out PATH] [--json]
Writes JSON to --out (default: $OUT/margin-h200.json when $OUT is set, else benchmarks/results/margin-<gpu>.json)
and prints a table. --smoke runs tiny sizes on CPU under TRITON_INTERPRET=1 to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tracefp4  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
OPS = ["copy", "margin_marks", "margin_fill_byte", "margin_fill_lsb"]
#: special bit patterns per dtype: NaNs of both signs and several payloads, +-Inf, +-0, extreme subnormals, max
SPECIALS = {
    torch.float32: [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7F800000, 0xFF800000, 0, 0x80000000, 1,
                    0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF],
    torch.float16: [0x7E00, 0xFE00, 0x7C01, 0xFFFF, 0x7C00, 0xFC00, 0, 0x8000, 1, 0x83FF, 0x7BFF, 0xFBFF],
    torch.bfloat16: [0x7FC0, 0xFFC0, 0x7F81, 0xFFFF, 0x7F80, 0xFF80, 0, 0x8000, 1, 0x807F, 0x7F7F, 0xFF7F],
}
LADDER_AND_BOUNDARIES = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0]


# ---------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------
def make_x(rows: int, hidden: int, dtype, device, seed: int) -> torch.Tensor:
    """Gaussian rows of different magnitudes with 1/1000 of the values 0, -0, NaN, +-Inf, 1e-30, 1e-40; an
    eighth of the blocks hold ladder values, boundaries and their moves by the margins (g = 1 makes v = x there)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen, device=device) * torch.exp(
        2 * torch.randn(rows, 1, generator=gen, device=device))
    n = max(1, x.numel() // 1000)
    idx = torch.randint(0, x.numel(), (n,), generator=gen, device=device)
    pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-30, 1e-40], device=device)
    x.view(-1)[idx] = pool[torch.randint(0, len(pool), (n,), generator=gen, device=device)]
    base = torch.tensor(LADDER_AND_BOUNDARIES, dtype=torch.float64, device=device)
    moves = torch.tensor([0.0, 0.015, -0.015, 0.05, -0.05, 1e-7, -1e-7], dtype=torch.float64, device=device)
    edges = (base[:, None] + moves[None, :]).reshape(-1).clamp(0, 6).float()
    edges = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1)]).abs()
    blocks = x.view(-1, 16)[:: 8]
    pick = torch.randint(0, edges.numel(), (blocks.shape[0], 15), generator=gen, device=device)
    sign = torch.where(torch.rand(blocks.shape[0], 15, generator=gen, device=device) < 0.5, -1.0, 1.0)
    blocks[:, 1:] = edges[pick] * sign
    blocks[:, 0] = 6.0
    return x.to(dtype)


def make_specials(dtype, device) -> torch.Tensor:
    """Each special bit pattern next to ordinary values, and blocks made only of them: [13, 32]."""
    idt = torch.int32 if dtype == torch.float32 else torch.int16
    sp = torch.tensor(SPECIALS[dtype], dtype=torch.int64).to(torch.int32).to(idt).view(dtype)
    rows = []
    for v in sp:
        row = torch.linspace(-3.0, 5.0, 16).to(dtype)
        row[3] = v
        rows.append(row)
    rows.append(sp.repeat(2)[:16])
    return torch.stack(rows).repeat(1, 2).to(device)


def engine_inputs(x: torch.Tensor, g: torch.Tensor, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rollout's own scales and hints, with 1/5 of the bytes replaced (0, NaN, negative, neighbours) and 1/7
    of the hint bytes with a bit flipped."""
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    gen = torch.Generator(device=x.device).manual_seed(seed)
    s, h = q.scales.clone(), q.hints.clone()
    sv, hv = s.view(-1), h.view(-1)
    pick = torch.randint(0, sv.numel(), (max(1, sv.numel() // 5),), generator=gen, device=x.device)
    sv[pick] = torch.tensor([0, 0x7F, 0xFF, 0xB8, 0x37, 0x39, 1, 126], dtype=torch.uint8, device=x.device)[
        torch.randint(0, 8, pick.shape, generator=gen, device=x.device)]
    flip = torch.randint(0, hv.numel(), (max(1, hv.numel() // 7),), generator=gen, device=x.device)
    hv[flip] ^= (1 << torch.randint(0, 8, flip.shape, generator=gen, device=x.device)).to(torch.uint8)
    return (q.scales, q.hints), (s, h)


# ---------------------------------------------------------------------------------------------------------
# exactness
# ---------------------------------------------------------------------------------------------------------
def mismatches(a: tuple, b: tuple) -> int:
    return sum(int((p != q).sum()) if p.shape == q.shape else -1 for p, q in zip(a, b))


def exactness(x: torch.Tensor, g: torch.Tensor, pairs: list[tuple[float, float]], seed: int) -> dict:
    """Mismatch counts Triton vs reference (0 everywhere = bit-exact) for marks and fills on x, at every (margin,
    scale margin) of ``pairs``."""
    out: dict = {}
    own, engine = engine_inputs(x, g, seed)
    gen = torch.Generator(device=x.device).manual_seed(seed + 1)
    rnd = torch.randint(0, 256, (x.shape[0], x.shape[1] // 8), dtype=torch.uint8, generator=gen, device=x.device)
    for given_name, (s, h) in (("own", own), ("engine", engine)):
        for m, ms in pairs:
            marks = [tracefp4.margin_marks(x, g, s, h, m, ms, backend=be) for be in ("reference", "triton")]
            key = f"{given_name} m={m} ms={ms}"
            out[f"marks {key}"] = mismatches(*marks)
            vm, bm = marks[0]
            for payload, stored in (("byte", s), ("lsb", bm)):
                fills = [tracefp4.margin_fill(x, g, vm, bm, rnd, stored, payload, backend=be)
                         for be in ("reference", "triton")]
                out[f"fill_{payload} {key}"] = mismatches(*fills)
    return out


def exactness_suite(rows: int, hidden: int, dtype, device, pairs: list[tuple[float, float]]) -> dict:
    x = make_x(rows, hidden, dtype, device, seed=hidden)
    cases = {
        "random_g1": (x, torch.tensor(1.0, device=device)),
        "random_dynamic_g": (x, tracefp4.compute_global_scale(x)),
        "specials": (make_specials(dtype, device), torch.tensor(0.37, device=device)),
    }
    return {name: exactness(xx, gg, pairs, seed=7) for name, (xx, gg) in cases.items()}


# ---------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------
def time_runs(fn, runs: int, iters: int, warmup: int, cuda: bool) -> list[float]:
    """Milliseconds per call of fn, one figure per run: the mean of `iters` back-to-back calls (CUDA events
    around them) after `warmup` calls."""
    out = []
    for _ in range(runs):
        for _ in range(warmup):
            fn()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(iters):
                fn()
            b.record()
            torch.cuda.synchronize()
            out.append(a.elapsed_time(b) / iters)
        else:
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            out.append((time.perf_counter() - t) * 1e3 / iters)
    return out


def op_bytes(n: int, e: int) -> dict:
    return {"copy": 2 * n * e, "margin_marks": n * e + n // 16 + n // 8 + n // 8 + n // 128,
            "margin_fill_byte": n * e + n // 8 + n // 128 + n // 8 + n // 16 + n // 16 + n // 8,
            "margin_fill_lsb": n * e + n // 8 + n // 128 + n // 8 + n // 128 + n // 16 + n // 8}


def summarize(times: list[float], nbytes: int) -> dict:
    times = [max(t, 1e-6) for t in times]  # CPU smoke runs can time 0
    med = statistics.median(times)
    return {"ms_median": round(med, 5), "ms_min": round(min(times), 5), "ms_max": round(max(times), 5),
            "gbps_median": round(nbytes / med / 1e6, 1), "gbps_min": round(nbytes / max(times) / 1e6, 1),
            "gbps_max": round(nbytes / min(times) / 1e6, 1), "runs_ms": [round(t, 5) for t in times]}


def make_ops(x: torch.Tensor, g: torch.Tensor, margin: float, backend: str) -> dict:
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="triton" if backend == "triton" else "reference")
    vm, bm = tracefp4.margin_marks(x, g, q.scales, q.hints, margin, margin, backend=backend)
    xt = (x.float() * (1 + 0.01 * torch.randn(x.shape, device=x.device))).to(x.dtype)
    lsb = bm  # any bits [T, ceil(nb / 8)] serve as stored LSBs
    return {
        "margin_marks": lambda: tracefp4.margin_marks(x, g, q.scales, q.hints, margin, margin, backend=backend),
        "margin_fill_byte": lambda: tracefp4.margin_fill(xt, g, vm, bm, q.hints, q.scales, "byte", backend=backend),
        "margin_fill_lsb": lambda: tracefp4.margin_fill(xt, g, vm, bm, q.hints, lsb, "lsb", backend=backend),
    }


def run_case(hidden: int, dtype_name: str, args, device: str, cuda: bool, log) -> dict:
    dtype = DTYPES[dtype_name]
    e = torch.tensor([], dtype=dtype).element_size()
    rows = 4 if args.smoke else max(1, int(args.gib * 2**30) // (hidden * e))
    check_rows = 4 if args.smoke else args.check_rows
    res: dict = {"hidden": hidden, "rows": rows, "dtype": dtype_name, "input_bytes": rows * hidden * e,
                 "check_rows": check_rows}
    t0 = time.perf_counter()
    # every pair of margins on the GPU; the smoke run (the interpreter is slow) the equal pairs only
    pairs = [(m, m) for m in args.margins] if args.smoke else [(m, ms) for m in args.margins for ms in args.margins]
    ex = exactness_suite(check_rows, hidden, dtype, device, pairs)
    res["mismatches"] = ex
    res["bit_exact"] = all(v == 0 for case in ex.values() for v in case.values())
    res["check_s"] = round(time.perf_counter() - t0, 2)
    bad = {f"{c} {k}": v for c, case in ex.items() for k, v in case.items() if v != 0}
    log(f"{dtype_name} h{hidden}: bit-exact {res['bit_exact']} over {sum(len(c) for c in ex.values())} checks"
        + (f"; mismatches {bad}" if bad else ""))

    x = make_x(rows, hidden, dtype, device, seed=1)
    g = tracefp4.compute_global_scale(x)
    n = x.numel()
    nbytes = op_bytes(n, e)
    ops = {"copy": lambda: x.clone(), **make_ops(x, g, args.time_margin, "triton")}
    res["triton"] = {op: summarize(time_runs(fn, args.runs, args.iters, 3, cuda), nbytes[op]) for op, fn in ops.items()}
    copy_gbps = res["triton"]["copy"]["gbps_median"]
    res["fraction_of_copy"] = {op: round(v["gbps_median"] / copy_gbps, 3) for op, v in res["triton"].items()}
    ref_ops = make_ops(x, g, args.time_margin, "reference")
    res["reference"] = {op: summarize(time_runs(fn, args.ref_runs, 1, 1, cuda), nbytes[op]) for op, fn in ref_ops.items()}
    res["speedup_vs_reference"] = {op: round(res["reference"][op]["ms_median"] / res["triton"][op]["ms_median"], 1)
                                   for op in ref_ops}
    if cuda:
        del x, ops, ref_ops
        torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="check the script: tiny sizes (4 rows of 64 and 272 values) on CPU under TRITON_INTERPRET=1, "
                         "equal margin pairs only, at most 2 runs of 1 call")
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168], help="hidden sizes (row lengths, multiples of 16)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="input dtypes")
    ap.add_argument("--margins", type=float, nargs="+", default=[0.03, 0.1, math.inf],
                    help="margins (value and scale, every pair) of the exactness check; 'inf' marks everything")
    ap.add_argument("--time-margin", type=float, default=0.1, help="margin (value and scale) of the timed calls")
    ap.add_argument("--gib", type=float, default=0.5, help="timed input size per case, GiB (in the input's dtype)")
    ap.add_argument("--check-rows", type=int, default=512, help="rows of the random data of the exactness check")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per Triton figure (median and min..max reported)")
    ap.add_argument("--iters", type=int, default=10, help="back-to-back calls per timed run")
    ap.add_argument("--ref-runs", type=int, default=3, help="timed runs (of one call each) of the torch reference")
    ap.add_argument("--out", type=str, default=None, help="JSON output path")
    ap.add_argument("--json", action="store_true", help="print the JSON summary on stdout (and the table on stderr)")
    args = ap.parse_args()
    if args.runs < 1 or args.iters < 1 or args.ref_runs < 1:
        ap.error(f"--runs, --iters and --ref-runs must be >= 1; got {args.runs}, {args.iters}, {args.ref_runs}")
    if any(h <= 0 or h % 16 for h in args.hidden):
        ap.error(f"--hidden sizes must be positive multiples of 16; got {args.hidden}")

    if args.smoke:
        args.runs, args.iters, args.ref_runs = min(args.runs, 2), 1, min(args.ref_runs, 2)
    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        ap.error("no CUDA device here: run with --smoke (CPU, TRITON_INTERPRET=1) or on a GPU")
    device = "cuda" if cuda else "cpu"
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    import triton

    meta = {
        "gpu": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "smoke": args.smoke, "hidden": args.hidden, "dtypes": args.dtypes,
        "margins_checked": args.margins, "time_margin": args.time_margin, "gib": args.gib,
        "timing": f"Triton: {args.runs} runs per figure in one process, a run = mean of {args.iters} back-to-back "
                  f"calls (CUDA events) after 3 warm-up calls; reference: {args.ref_runs} runs of 1 call after 1; "
                  "figure = median over runs, spread = min..max; the calls include their argument checks",
    }
    log(json.dumps(meta))
    if args.out:
        path = Path(args.out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "margin-h200.json"
    else:
        name = "smoke" if args.smoke else meta["gpu"].lower().replace(" ", "-")
        path = Path(__file__).resolve().parent / "results" / f"margin-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    hidden = [64, 272] if args.smoke else args.hidden
    results = []
    for dtype_name in args.dtypes:
        for h in hidden:
            results.append(run_case(h, dtype_name, args, device, cuda, log))
            path.write_text(json.dumps({**meta, "partial": True, "results": results}, indent=1))  # survives a kill
    summary = {
        "all_bit_exact": all(r["bit_exact"] for r in results),
        "worst_fraction_of_copy": {op: min(r["fraction_of_copy"][op] for r in results) for op in OPS[1:]},
        "min_speedup_vs_reference": {op: min(r["speedup_vs_reference"][op] for r in results) for op in OPS[1:]},
    }
    path.write_text(json.dumps({**meta, "summary": summary, "results": results}, indent=1))

    log("")
    log("GB/s median (min..max over runs), % of the copy of the same bytes, speed-up over the torch reference")
    for r in results:
        log(f"{r['dtype']} h{r['hidden']} ({r['rows']} rows): copy {r['triton']['copy']['gbps_median']} GB/s, "
            f"bit-exact {r['bit_exact']}")
        for op in OPS[1:]:
            d = r["triton"][op]
            log(f"   {op:17s} {d['ms_median']:9.4f} ms ({d['ms_min']:.4f}..{d['ms_max']:.4f})  {d['gbps_median']:8.1f} "
                f"GB/s ({d['gbps_min']:.0f}..{d['gbps_max']:.0f})  {100 * r['fraction_of_copy'][op]:6.1f}%  "
                f"x{r['speedup_vs_reference'][op]} vs reference ({r['reference'][op]['ms_median']:.3f} ms)")
    log(f"all bit-exact: {summary['all_bit_exact']}; wrote {path}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
