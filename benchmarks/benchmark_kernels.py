"""Benchmark of the FP4 kernels: Triton vs the torch reference (eager and torch.compile) vs a plain copy.

Prints a table and writes JSON (default: $OUT/kernels-h200.json when $OUT is set, else
benchmarks/results/kernels-<gpu>.json). Before timing, it checks on the same data that the Triton kernels and
the torch.compile'd reference are bit-identical to the eager reference (codes, scales, hints, outputs, grads).

Bytes counted (B = bytes per input element, n = number of elements, NVFP4):
  copy                : read n*B + write n*B
  quantize            : read n*B, write n/2 (codes) + n/8 (hints) + n/16 (scales)
  quantize_no_hints   : read n*B, write n/2 + n/16
  fake_quant (hinted) : read n*B + n/16 + n/8, write n*B
  fake_quant_rtn      : read n*B, write n*B (own scales)
  fake_quant_bwd      : read grad n*B + x n*B + n/16, write n*B (ste="clip"; "identity" moves no bytes)

Usage: python3 benchmarks/benchmark_kernels.py [--smoke] [--gib 1.0] [--hidden 2048 7168] [--out PATH]
--smoke runs tiny sizes on CPU (TRITON_INTERPRET=1) to check the script itself.
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

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tracefp4  # noqa: E402
from tracefp4 import reference as ref  # noqa: E402

# (blocks per program, num_warps, split layout, fp-adder rounding); the backward kernel: split layout only
CONFIGS = [(128, 4, False, False), (256, 8, False, False), (512, 8, False, False), (128, 4, False, True),
           (256, 8, False, True), (512, 8, False, True), (256, 4, True, False), (512, 8, True, True)]
SMOKE_CONFIGS = [(64, 2, False, False), (64, 2, True, False), (64, 2, False, True)]


# ---------------------------------------------------------------------------------------------------------
def timer(fn, warmup: int, iters: int, cuda: bool) -> float:
    """Median milliseconds of fn() over iters runs after warmup runs (CUDA events on GPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def mismatches(a, b) -> int:
    """Number of differing elements; NaN equals NaN (payloads differ between casts)."""
    if a is None or b is None:
        return -1 if (a is None) != (b is None) else 0
    if a.shape != b.shape:
        return -2
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        return int(((bits(a) != bits(b)) & ~(na & nb)).sum())  # +0.0 vs -0.0 counts as a mismatch
    return int((a != b).sum())


def make_x(rows: int, hidden: int, dtype, device, seed: int, specials: bool = True) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device=device, dtype=torch.float32)
    x *= torch.exp(torch.randn(rows, 1, generator=g, device=device))  # rows of different magnitudes
    if specials:
        n = max(1, x.numel() // 100000)
        idx = torch.randint(0, x.numel(), (n,), generator=g, device=device)
        pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-30], device=device)
        x.view(-1)[idx] = pool[torch.randint(0, len(pool), (n,), generator=g, device=device)]
    return x.to(dtype)


def make_ties(rows: int, hidden: int, dtype, device, seed: int) -> torch.Tensor:
    """Blocks of 16 whose scale is a power of two with g = 1: every value is a ladder value or an exact tie."""
    g = torch.Generator(device=device).manual_seed(seed)
    vals = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0],
                        device=device)
    x = vals[torch.randint(0, len(vals), (rows, hidden), generator=g, device=device)]
    x *= torch.where(torch.rand(rows, hidden, generator=g, device=device) < 0.5, -1.0, 1.0)
    x.view(-1, 16)[:, 0] = 6.0
    x *= torch.exp2(torch.randint(-6, 6, (rows, hidden // 16), generator=g, device=device).float()).repeat_interleave(16, 1)
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------------------
def run_size(hidden, rows, dtype, device, cuda, configs, do_compile, log):
    from tracefp4 import triton_kernels as tk

    res: dict = {"hidden": hidden, "rows": rows, "dtype": str(dtype).replace("torch.", "")}
    x = make_x(rows, hidden, dtype, device, seed=hidden)
    n = x.numel()
    eb = x.element_size()
    res["activation_bytes"] = n * eb
    xb = x.view(-1, 16)
    g = torch.tensor(0.01, dtype=torch.float32, device=device)  # a static per-site global scale
    w_fast, w_slow, it_fast, it_slow = (5, 1, 50, 3) if cuda else (1, 0, 2, 1)

    # ---- reference outputs (eager) and the rollout side of the hinted path
    codes_r, scales_r, hints_r = ref.quantize_blocks_ref(xb, "nvfp4", g)
    xn = (x.float() * (1 + 0.01 * (2 * torch.rand(x.shape, device=device) - 1))).to(dtype)  # trainer activations
    xnb = xn.view(-1, 16)
    hint_bits = tracefp4.unpack_hints(hints_r)  # [NB, 16]
    fq_r = ref.fake_quantize_blocks_ref(xnb, "nvfp4", g, scales_r, hint_bits)
    rtn_r = ref.fake_quantize_blocks_ref(xnb, "nvfp4", g)
    grad = torch.randn(x.shape, device=device, dtype=dtype).view(-1, 16)
    bwd_r = ref.fake_quantize_bwd_blocks_ref(grad, xnb, "nvfp4", g, scales_r)

    # ---- exactness: Triton vs eager
    codes_t, scales_t, hints_t = tk.quantize_blocks_triton(xb, "nvfp4", g)
    fq_t, _ = tk.fake_quantize_blocks_triton(xnb, "nvfp4", g, scales_r, hints_r)
    rtn_t, _ = tk.fake_quantize_blocks_triton(xnb, "nvfp4", g, None, None)
    bwd_t = tk.fake_quantize_bwd_blocks_triton(grad, xnb, "nvfp4", g, scales_r)
    exact_t = {
        "codes": mismatches(codes_t, codes_r), "scales": mismatches(scales_t, scales_r),
        "hints": mismatches(hints_t, hints_r), "fake_quant_hinted": mismatches(fq_t, fq_r),
        "fake_quant_rtn": mismatches(rtn_t, rtn_r), "fake_quant_bwd": mismatches(bwd_t, bwd_r),
    }
    # dynamic global scale and exact ties, on a smaller slice
    xs = make_ties(min(rows, 4096), hidden, dtype, device, seed=1)
    for name, xx, gg in (("ties_g1", xs, torch.tensor(1.0, device=device)),
                         ("dynamic_g", x[: min(rows, 4096)], ref.global_scale_ref(x[: min(rows, 4096)]))):
        cr = ref.quantize_blocks_ref(xx.view(-1, 16), "nvfp4", gg)
        ct = tk.quantize_blocks_triton(xx.view(-1, 16), "nvfp4", gg)
        exact_t[f"{name}_codes_scales_hints"] = sum(mismatches(a, b) for a, b in zip(ct, cr))
        fr = ref.fake_quantize_blocks_ref(xx.view(-1, 16), "nvfp4", gg, cr[1], tracefp4.unpack_hints(cr[2]))
        ft, _ = tk.fake_quantize_blocks_triton(xx.view(-1, 16), "nvfp4", gg, cr[1], cr[2])
        exact_t[f"{name}_fake_quant_hinted"] = mismatches(ft, fr)
    for fmt_, rule in (("mxfp4", "floor"), ("mxfp4", "rceil")):
        xm = x[: min(rows, 4096)].reshape(-1, 32)
        cr = ref.quantize_blocks_ref(xm, fmt_, None, rule)
        ct = tk.quantize_blocks_triton(xm, fmt_, None, rule)
        exact_t[f"{fmt_}_{rule}_codes_scales_hints"] = sum(mismatches(a, b) for a, b in zip(ct, cr))
        fr = ref.fake_quantize_blocks_ref(xm, fmt_, None, cr[1], tracefp4.unpack_hints(cr[2]))
        ft, _ = tk.fake_quantize_blocks_triton(xm, fmt_, None, cr[1], cr[2])
        exact_t[f"{fmt_}_{rule}_fake_quant_hinted"] = mismatches(ft, fr)
    res["exact_triton_vs_eager_mismatches"] = exact_t
    log(f"  exactness triton vs eager (mismatch counts): {exact_t}")

    # ---- timings
    nbytes = {
        "copy": 2 * n * eb,
        "quantize": n * eb + n // 2 + n // 8 + n // 16,
        "quantize_no_hints": n * eb + n // 2 + n // 16,
        "fake_quant": 2 * n * eb + n // 16 + n // 8,
        "fake_quant_rtn": 2 * n * eb,
        "fake_quant_bwd": 3 * n * eb + n // 16,
    }
    res["bytes"] = nbytes
    ms: dict = {}
    y = torch.empty_like(x)
    ms["copy"] = timer(lambda: y.copy_(x), w_fast, it_fast, cuda)
    del y

    sweep: dict = {}
    ops = {
        "quantize": lambda c: tk.quantize_blocks_triton(xb, "nvfp4", g, config=c),
        "quantize_no_hints": lambda c: tk.quantize_blocks_triton(xb, "nvfp4", g, emit_hints=False, config=c),
        "fake_quant": lambda c: tk.fake_quantize_blocks_triton(xnb, "nvfp4", g, scales_r, hints_r, config=c),
        "fake_quant_rtn": lambda c: tk.fake_quantize_blocks_triton(xnb, "nvfp4", g, None, None, config=c),
        "fake_quant_bwd": lambda c: tk.fake_quantize_bwd_blocks_triton(grad, xnb, "nvfp4", g, scales_r, config=c),
    }
    for op, fn in ops.items():
        sweep[op] = {}
        for c in configs:
            if op == "fake_quant_bwd" and (not c[2] or c[3]):
                continue
            name = f"BN{c[0]}_w{c[1]}_{'split' if c[2] else 'block'}{'_fprne' if c[3] else ''}"
            try:
                t = timer(lambda: fn(c), w_fast, it_fast, cuda)
            except Exception as e:  # a config that does not compile or launch is recorded, not fatal
                res.setdefault("config_errors", {})[f"{op}_{name}"] = repr(e)[:300]
                continue
            sweep[op][name] = nbytes[op] / t / 1e6
        best = max(sweep[op], key=sweep[op].get)
        ms[op] = nbytes[op] / sweep[op][best] / 1e6
        res.setdefault("best_config", {})[op] = best
    res["triton_config_sweep_gbps"] = {op: {k: round(v, 1) for k, v in d.items()} for op, d in sweep.items()}

    # the same operations through the torch reference, eager and torch.compile
    ref_ops = {
        "quantize": lambda f: f["q"](xb, "nvfp4", g),
        "quantize_no_hints": lambda f: f["q"](xb, "nvfp4", g, "floor", False),
        "fake_quant": lambda f: f["fq"](xnb, "nvfp4", g, scales_r, hint_bits),
        "fake_quant_rtn": lambda f: f["fq"](xnb, "nvfp4", g),
        "fake_quant_bwd": lambda f: f["bwd"](grad, xnb, "nvfp4", g, scales_r),
    }
    eager = {"q": ref.quantize_blocks_ref, "fq": ref.fake_quantize_blocks_ref, "bwd": ref.fake_quantize_bwd_blocks_ref}
    ms_eager = {op: timer(lambda: f(eager), w_slow, it_slow, cuda) for op, f in ref_ops.items()}
    ms_comp: dict = {}
    if do_compile:
        # fake_quant_rtn is left out here: one graph less to compile (it is the same function as fake_quant)
        comp_ops = {op: f for op, f in ref_ops.items() if op != "fake_quant_rtn"}
        try:
            t0 = time.perf_counter()
            comp = {k: torch.compile(v, dynamic=True) for k, v in eager.items()}  # one graph for all sizes
            outs = {op: f(comp) for op, f in comp_ops.items()}  # compiles
            res["torch_compile_first_call_s"] = round(time.perf_counter() - t0, 1)
            exact_c = {
                "codes": mismatches(outs["quantize"][0], codes_r), "scales": mismatches(outs["quantize"][1], scales_r),
                "hints": mismatches(outs["quantize"][2], hints_r),
                "fake_quant_hinted": mismatches(outs["fake_quant"], fq_r),
                "fake_quant_bwd": mismatches(outs["fake_quant_bwd"], bwd_r),
            }
            del outs
            res["exact_compile_vs_eager_mismatches"] = exact_c
            log(f"  exactness torch.compile vs eager (mismatch counts): {exact_c}")
            ms_comp = {op: timer(lambda: f(comp), 2, 10 if cuda else 1, cuda) for op, f in comp_ops.items()}
        except Exception as e:  # recorded in the JSON; the Triton and eager figures still stand
            res["torch_compile_error"] = repr(e)[:500]
            log(f"  torch.compile failed: {e!r}"[:500])

    gbps = lambda d: {op: round(nbytes[op] / t / 1e6, 3) for op, t in d.items()}  # noqa: E731
    res["ms"] = {k: round(v, 4) for k, v in ms.items()}
    res["gbps"] = gbps(ms)
    res["torch_eager_gbps"] = gbps(ms_eager)
    res["torch_compile_gbps"] = gbps(ms_comp)
    res["fraction_of_copy"] = {op: round(v / res["gbps"]["copy"], 3) for op, v in res["gbps"].items()}
    res["hint_overhead_pct"] = round(100 * (ms["quantize"] / ms["quantize_no_hints"] - 1), 2)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--gib", type=float, default=1.0, help="activation size per hidden size, GiB (bf16)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168])
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--compile-smoke", action="store_true", help="also torch.compile the reference in --smoke")
    ap.add_argument("--out", type=str, default=None)
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16
    configs = SMOKE_CONFIGS if args.smoke else CONFIGS
    log = lambda s: print(s, flush=True)  # noqa: E731
    import triton

    meta = {
        "gpu": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "smoke": args.smoke, "fmt": "nvfp4", "dtype": "bfloat16",
        "timing": "median of CUDA-event timings (Triton/copy: 5 warm-up + 50 runs; eager: 1 + 3; compile: 2 + 10)",
    }
    log(f"{meta}")
    if args.out:
        path = Path(args.out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kernels-h200.json"
    else:
        name = "smoke" if args.smoke else meta["gpu"].lower().replace(" ", "-")
        path = Path(__file__).resolve().parent / "results" / f"kernels-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    results = []
    for h in args.hidden:
        rows = 4 if args.smoke else max(1, int(args.gib * 2**30) // (h * 2))
        log(f"hidden {h}: x [{rows}, {h}] {dtype}")
        do_compile = (not args.no_compile) and (cuda or args.compile_smoke)
        results.append(run_size(h, rows, dtype, device, cuda, configs, do_compile, log))
        path.write_text(json.dumps({**meta, "partial": True, "results": results}, indent=1))  # survives a timeout
        if cuda:
            torch.cuda.empty_cache()

    ops = ["copy", "quantize", "quantize_no_hints", "fake_quant", "fake_quant_rtn", "fake_quant_bwd"]
    summary = {}
    for op in ops:
        summary[f"{op}_gbps"] = min(r["gbps"][op] for r in results)
    for op in ops[1:]:
        summary[f"torch_eager_{op}_gbps"] = min(r["torch_eager_gbps"].get(op, 0) for r in results)
        if all(op in r["torch_compile_gbps"] for r in results):
            summary[f"torch_compile_{op}_gbps"] = min(r["torch_compile_gbps"][op] for r in results)
        summary[f"{op}_fraction_of_copy"] = min(r["fraction_of_copy"][op] for r in results)
    summary["hint_overhead_pct"] = max(r["hint_overhead_pct"] for r in results)
    summary["triton_bit_exact_vs_eager"] = all(
        all(v == 0 for v in r["exact_triton_vs_eager_mismatches"].values()) for r in results)
    if all("exact_compile_vs_eager_mismatches" in r for r in results):
        summary["torch_compile_bit_exact_vs_eager"] = all(
            all(v == 0 for v in r["exact_compile_vs_eager_mismatches"].values()) for r in results)
    out = {**summary, "note": "top-level figures are the minimum (worst) over the sizes", **meta,
           "sizes": [{"hidden": r["hidden"], "rows": r["rows"], "bytes": r["activation_bytes"]} for r in results],
           "results": results}

    log("")
    log(f"{'op':20s} " + " ".join(f"{'h' + str(r['hidden']) + ' GB/s':>12s} {'%copy':>6s} {'eager':>8s} {'compile':>8s}"
                                   for r in results))
    for op in ops:
        row = f"{op:20s} "
        for r in results:
            row += (f"{r['gbps'][op]:12.1f} {100 * r['fraction_of_copy'][op]:6.1f} "
                    f"{r['torch_eager_gbps'].get(op, float('nan')):8.1f} {r['torch_compile_gbps'].get(op, float('nan')):8.1f} ")
        log(row)
    log(f"hint overhead (quantize vs quantize_no_hints): {summary['hint_overhead_pct']} %")
    log(f"triton bit-exact vs eager: {summary['triton_bit_exact_vs_eager']}; "
        f"torch.compile bit-exact vs eager: {summary.get('torch_compile_bit_exact_vs_eager')}")

    path.write_text(json.dumps(out, indent=1))
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
