"""Benchmark of the FP4 kernels (tracefp4's Triton backend) against a device-to-device copy of the same bytes.

For every input dtype (bf16, fp16, fp32), format (NVFP4, MXFP4) and hidden size it
  1. checks on the GPU that every Triton output equals the torch reference bit for bit: random data with NaN /
     Inf / +-0 / subnormals sprinkled in, exact-tie data, a dynamic global scale, and every special bit pattern
     of the dtype (negative NaNs with several payloads included), for quantize (+hints), the fused
     quantize_fake, round-to-nearest / rollout-scale / hint-guided fake quantization, dequantize and backward;
  2. times each kernel in the default configuration (`tracefp4.triton_kernels.CONFIG`, what a user gets) and,
     with --sweep, in every configuration of the sweep: R runs (default 5) in this process, each the mean of
     back-to-back launches after warm-up; the figure is the median over runs, the spread is min..max.

Bytes counted (n values, E bytes per input value, B block size):
  copy             : read nE + write nE
  quantize         : read nE, write n/2 (codes) + n/8 (hints) + n/B (scales)
  quantize_no_hints: read nE, write n/2 + n/B
  quantize_fake    : read nE, write nE (y) + n/2 + n/8 + n/B          (the rollout's capture, one pass)
  capture_unfused  : quantize + fake_quant_rtn, two kernels            (what the rollout ran before)
  fake_quant       : read nE + n/B + n/8, write nE                    (hint-guided, the trainer)
  fake_quant_lsb   : read nE + n/128 + n/8, write nE + n/16           (NVFP4, scale hints: bytes rebuilt in the pass)
  fake_quant_rtn   : read nE, write nE                                (round to nearest, own scales)
  dequantize       : read n/2 + n/B, write nE
  fake_quant_bwd   : read 2nE + n/B, write nE                         (ste="clip"; "identity" moves no bytes)

Usage: python3 benchmarks/benchmark_kernels.py [--smoke] [--sweep] [--gib 1.0] [--hidden 2048 7168]
       [--dtypes bf16 fp16 fp32] [--fmts nvfp4 mxfp4] [--runs 5] [--out PATH] [--json]
       [--quantize-variants all|A,B,... [--skip-exactness] [--profile-variants]]

--quantize-variants times only quantize with and without hints, for each named variant (hint packing, pair layout,
unrolled loop) at each of its configurations, runs interleaved, and prints the hint cost of each variant: its best
time with hints over the fastest time without hints of the whole case (both sides get every configuration). The
variants' bits are checked against the reference on the device first (the timed data, ties, special values).
Writes JSON to --out (default: $OUT/kernels-h200.json when $OUT is set, else benchmarks/results/kernels-<gpu>.json)
and prints a table. --smoke runs tiny sizes on CPU under TRITON_INTERPRET=1 to check the script itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
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
from tracefp4 import reference as ref  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BLOCK = {"nvfp4": 16, "mxfp4": 32}
OPS = ["copy", "quantize", "quantize_no_hints", "quantize_fake", "capture_unfused", "fake_quant", "fake_quant_lsb",
       "fake_quant_rtn", "dequantize", "fake_quant_bwd"]
NVFP4_ONLY = ("fake_quant_lsb",)
#: the configuration sweep of the forward kernels: (blocks per program, num_warps, programs per SM; 0 = one
#: program per tile, 32 = as many as fit[, register cap]); the backward kernel: (blocks per program, num_warps)
SWEEP = [(128, 4, 0), (64, 2, 0), (128, 4, 32), (64, 2, 32), (128, 4, 8), (64, 2, 8), (256, 8, 32), (128, 4, 32, 40)]
SWEEP_BWD = [(256, 4), (128, 4), (512, 8)]
SMOKE_SWEEP = [(8, 1, 0), (8, 1, 2)]
#: the row layout (one thread per 16 input bytes; given-scale and round-to-nearest fake quantization and
#: dequantization only): ("rows", rows per program, num_warps, programs per SM)
SWEEP_ROWS = [("rows", 128, 4, 0), ("rows", 256, 8, 0), ("rows", 512, 4, 0), ("rows", 1024, 8, 0),
              ("rows", 256, 4, 32), ("rows", 512, 8, 32), ("rows", 1024, 8, 8)]
SMOKE_SWEEP_ROWS = [("rows", 16, 1, 0), ("rows", 32, 1, 2)]
ROWS_OPS = ("fake_quant", "fake_quant_lsb", "fake_quant_rtn", "dequantize", "quantize", "quantize_no_hints", "quantize_fake")
ROWS_NO_FP32 = ("quantize", "quantize_no_hints", "quantize_fake")  # a row of 4 fp32 values is half a code word


def takes_rows(op: str, dtype_name: str) -> bool:
    """Whether `op` on `dtype_name` input has the row layout."""
    return op in ROWS_OPS and not (op in ROWS_NO_FP32 and dtype_name == "fp32")
#: the row-layout config the exactness suite checks besides each kernel's default
ROWS_CHECK = ("rows", 512, 8, 32)
#: kernel -> the CONFIG key whose default it runs
CONFIG_KEY = {"quantize": "quantize", "quantize_no_hints": "quantize", "quantize_fake": "quantize_fake",
              "fake_quant": "fake_quant", "fake_quant_lsb": "fake_quant", "fake_quant_rtn": "fake_quant_rtn", "dequantize": "dequantize",
              "fake_quant_bwd": "fake_quant_bwd"}


# ---------------------------------------------------------------------------------------------------------
# data
# ---------------------------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def mismatches(a, b) -> int:
    """Number of differing elements; NaN equals NaN (payloads differ between casts), +0 differs from -0."""
    if a is None or b is None:
        return -1 if (a is None) != (b is None) else 0
    if a.shape != b.shape or a.dtype != b.dtype:
        return -2
    if a.dtype.is_floating_point:
        na, nb = torch.isnan(a), torch.isnan(b)
        return int(((bits(a) != bits(b)) & ~(na & nb)).sum() + (na != nb).sum())
    return int((a != b).sum())


def make_x(rows: int, hidden: int, dtype, device, seed: int) -> torch.Tensor:
    """Gaussian rows of different magnitudes, with about 1e-5 of the values replaced by 0, -0, NaN, +-Inf,
    1e-30 (subnormal in bf16/fp16 ranges after scaling)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, device=device, dtype=torch.float32)
    x *= torch.exp(torch.randn(rows, 1, generator=g, device=device))
    n = max(1, x.numel() // 100000)
    idx = torch.randint(0, x.numel(), (n,), generator=g, device=device)
    pool = torch.tensor([0.0, -0.0, float("nan"), float("inf"), float("-inf"), 1e-30], device=device)
    x.view(-1)[idx] = pool[torch.randint(0, len(pool), (n,), generator=g, device=device)]
    return x.to(dtype)


def make_ties(rows: int, hidden: int, dtype, device, seed: int) -> torch.Tensor:
    """Blocks whose scale is a power of two with g = 1: every value is a ladder value or an exact tie."""
    g = torch.Generator(device=device).manual_seed(seed)
    vals = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0],
                        device=device)
    x = vals[torch.randint(0, len(vals), (rows, hidden), generator=g, device=device)]
    x *= torch.where(torch.rand(rows, hidden, generator=g, device=device) < 0.5, -1.0, 1.0)
    x.view(-1, 16)[:, 0] = 6.0
    x *= torch.exp2(torch.randint(-6, 6, (rows, hidden // 16), generator=g, device=device).float()
                    ).repeat_interleave(16, 1)
    return x.to(dtype)


def make_specials(dtype, block: int, device) -> torch.Tensor:
    """Every special bit pattern of the dtype (NaNs of both signs with the smallest, a middle and the largest
    payload; +-Inf; +-0; the smallest and largest subnormals; the largest finite), each in its own block next
    to ordinary values, and blocks made only of them."""
    if dtype == torch.float32:
        pats = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800000, 0xFF800000,
                0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0xFF7FFFFF]
        t = torch.tensor(pats, dtype=torch.int64).to(torch.int32).view(torch.float32)
    else:
        if dtype == torch.float16:
            pats = [0x7E00, 0xFE00, 0x7C01, 0xFC01, 0x7FFF, 0xFFFF, 0x7C00, 0xFC00, 0x0000, 0x8000, 0x0001,
                    0x83FF, 0x7BFF, 0xFBFF]
        else:
            pats = [0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7F80, 0xFF80, 0x0000, 0x8000, 0x0001,
                    0x807F, 0x7F7F, 0xFF7F]
        t = torch.tensor(pats, dtype=torch.int32).to(torch.int16).view(dtype)
    ordinary = torch.linspace(-3.0, 5.0, block).to(dtype)
    rows = []
    for v in t:  # each special next to ordinary values
        row = ordinary.clone()
        row[3] = v
        rows.append(row)
    rows.append(t.repeat(block)[:block])  # only specials
    rows.append(t.flip(0).repeat(block)[:block])
    return torch.stack(rows).repeat(1, 2).to(device)  # [16, 2B]


# ---------------------------------------------------------------------------------------------------------
# exactness on the GPU
# ---------------------------------------------------------------------------------------------------------
def exactness(x, fmt: str, g, tk) -> dict:
    """Mismatch counts Triton vs reference (0 everywhere = bit-exact) of every kernel on x [rows, D]."""
    b = BLOCK[fmt]
    xb = x.reshape(-1, b)
    out: dict = {}
    rules = ["floor"] if fmt == "nvfp4" else ["floor", "rceil"]
    for rule in rules:
        sfx = "" if rule == "floor" else "_rceil"
        cr, sr, hr = ref.quantize_blocks_ref(xb, fmt, g, rule)
        ct, st, ht = tk.quantize_blocks_triton(xb, fmt, g, rule)
        out[f"quantize{sfx}"] = mismatches(ct, cr) + mismatches(st, sr) + mismatches(ht, hr)
        fr = ref.fake_quantize_blocks_ref(xb, fmt, g, None, None, rule)
        yt, ct2, st2, ht2 = tk.quantize_fake_blocks_triton(xb, fmt, g, rule)
        out[f"quantize_fake{sfx}"] = (mismatches(yt, fr) + mismatches(ct2, cr) + mismatches(st2, sr)
                                      + mismatches(ht2, hr))
        out[f"fake_quant_rtn{sfx}"] = mismatches(tk.fake_quantize_blocks_triton(xb, fmt, g, None, None, rule)[0], fr)
    cr, sr, hr = ref.quantize_blocks_ref(xb, fmt, g)
    xn = (x.float() * (1 + 0.01 * (2 * torch.rand(x.shape, device=x.device) - 1))).to(x.dtype).reshape(-1, b)
    hb = tracefp4.unpack_hints(hr)
    out["fake_quant_hinted"] = mismatches(tk.fake_quantize_blocks_triton(xn, fmt, g, sr, hr)[0],
                                          ref.fake_quantize_blocks_ref(xn, fmt, g, sr, hb))
    out["fake_quant_given_scales"] = mismatches(tk.fake_quantize_blocks_triton(xn, fmt, g, sr, None)[0],
                                                ref.fake_quantize_blocks_ref(xn, fmt, g, sr, None))
    out["dequantize"] = mismatches(tk.dequantize_blocks_triton(cr, sr, fmt, g, x.dtype),
                                   ref.dequantize_blocks_ref(tracefp4.unpack_codes(cr), sr, fmt, g, x.dtype))
    rc = ROWS_CHECK if x.is_cuda else SMOKE_SWEEP_ROWS[1]
    if x.dtype != torch.float32:
        for rule in rules:
            sfx = "" if rule == "floor" else "_rceil"
            cr2, sr2, hr2 = ref.quantize_blocks_ref(xb, fmt, g, rule)
            ct, st, ht = tk.quantize_blocks_triton(xb, fmt, g, rule, config=rc)
            out[f"quantize_rows{sfx}"] = mismatches(ct, cr2) + mismatches(st, sr2) + mismatches(ht, hr2)
            yt, ct2, st2, ht2 = tk.quantize_fake_blocks_triton(xb, fmt, g, rule, config=rc)
            out[f"quantize_fake_rows{sfx}"] = (mismatches(yt, ref.fake_quantize_blocks_ref(xb, fmt, g, None, None, rule))
                                               + mismatches(ct2, cr2) + mismatches(st2, sr2) + mismatches(ht2, hr2))
    out["fake_quant_rtn_rows"] = mismatches(tk.fake_quantize_blocks_triton(xb, fmt, g, None, None, config=rc)[0],
                                            ref.fake_quantize_blocks_ref(xb, fmt, g, None, None))
    out["fake_quant_hinted_rows"] = mismatches(tk.fake_quantize_blocks_triton(xn, fmt, g, sr, hr, config=rc)[0],
                                               ref.fake_quantize_blocks_ref(xn, fmt, g, sr, hb))
    out["fake_quant_given_scales_rows"] = mismatches(
        tk.fake_quantize_blocks_triton(xn, fmt, g, sr, None, config=rc)[0],
        ref.fake_quantize_blocks_ref(xn, fmt, g, sr, None))
    out["dequantize_rows"] = mismatches(tk.dequantize_blocks_triton(cr, sr, fmt, g, x.dtype, config=rc),
                                        ref.dequantize_blocks_ref(tracefp4.unpack_codes(cr), sr, fmt, g, x.dtype))
    if fmt == "nvfp4":  # scale hints (random LSBs: both neighbours of each block's t), both layouts
        nbr = x.shape[-1] // b
        lsb = torch.randint(0, 256, (x.shape[0], -(-nbr // 8)), dtype=torch.uint8, device=x.device)
        sl = ref.nvfp4_lsb_scales_ref(xn.float(), g, tracefp4.unpack_hints(lsb)[:, :nbr].reshape(-1))
        want = ref.fake_quantize_blocks_ref(xn, fmt, g, sl, hb)
        for name, c in (("fake_quant_lsb", None), ("fake_quant_lsb_rows", rc)):
            yl, sl_t = tk.fake_quantize_blocks_triton(xn, fmt, g, None, hr, scale_lsb=lsb, lsb_blocks_per_row=nbr,
                                                      config=c)
            out[name] = mismatches(yl, want) + mismatches(sl_t, sl)
    grad = torch.randn(xn.shape, device=x.device).to(x.dtype)
    out["fake_quant_bwd"] = mismatches(tk.fake_quantize_bwd_blocks_triton(grad, xn, fmt, g, sr),
                                       ref.fake_quantize_bwd_blocks_ref(grad, xn, fmt, g, sr))
    return out


def exactness_suite(rows: int, hidden: int, dtype, fmt: str, device, tk) -> dict:
    """Exactness on random data (static and dynamic g), exact ties (g = 1) and the dtype's special values."""
    x = make_x(rows, hidden, dtype, device, seed=hidden + 7)
    nv = fmt == "nvfp4"
    cases = {
        "random": (x, torch.tensor(0.01, device=device) if nv else None),
        "random_dynamic_g": (x, ref.global_scale_ref(x) if nv else None),
        "ties_g1": (make_ties(min(rows, 256), hidden, dtype, device, seed=1), torch.tensor(1.0, device=device)
                    if nv else None),
        "specials": (make_specials(dtype, BLOCK[fmt], device), torch.tensor(0.37, device=device) if nv else None),
        "specials_g_subnormal": (make_specials(dtype, BLOCK[fmt], device),
                                 torch.tensor(2.0**-140, device=device) if nv else None),
    }
    if not nv:
        del cases["specials_g_subnormal"]
    return {name: exactness(xx, fmt, gg, tk) for name, (xx, gg) in cases.items()}


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


def op_bytes(n: int, e: int, b: int) -> dict:
    q = n * e + n // 2 + n // 8 + n // b
    return {
        "copy": 2 * n * e, "quantize": q, "quantize_no_hints": n * e + n // 2 + n // b,
        "quantize_fake": q + n * e, "capture_unfused": q + 2 * n * e, "fake_quant": 2 * n * e + n // b + n // 8,
        "fake_quant_lsb": 2 * n * e + n // 128 + n // 8 + n // 16,
        "fake_quant_rtn": 2 * n * e, "dequantize": n // 2 + n // b + n * e, "fake_quant_bwd": 3 * n * e + n // b,
    }


def cfg_name(c) -> str:
    if c[0] in ("rows", "pairs"):
        return f"{c[0]}{c[1]}_w{c[2]}_" + (f"persist{c[3]}" if c[3] else "grid")
    if len(c) == 2:
        return f"BN{c[0]}_w{c[1]}"
    name = f"BN{c[0]}_w{c[1]}_" + (f"persist{c[2]}" if c[2] else "grid")
    return name + (f"_maxreg{c[3]}" if len(c) > 3 and c[3] else "")


def make_ops(x, fmt: str, g, tk) -> dict:
    """op -> (fn(config) for a Triton config, config kind "fwd"/"bwd"), on the operands built from x."""
    b = BLOCK[fmt]
    xb = x.reshape(-1, b)
    codes, scales, hints = tk.quantize_blocks_triton(xb, fmt, g)
    xn = (x.float() * (1 + 0.01 * (2 * torch.rand(x.shape, device=x.device) - 1))).to(x.dtype).reshape(-1, b)
    grad = torch.randn(xn.shape, device=x.device).to(x.dtype)

    def unfused(c):
        tk.quantize_blocks_triton(xb, fmt, g, config=c)
        tk.fake_quantize_blocks_triton(xb, fmt, g, None, None, config=c)

    nvfp4 = {}
    if fmt == "nvfp4":  # scale hints: one LSB per block (the rollout's), the bytes rebuilt from xn in the pass
        nbr = x.shape[-1] // b
        lsb = tracefp4.pack_hints((scales.view(-1, nbr) & 1))
        nvfp4["fake_quant_lsb"] = (lambda c: tk.fake_quantize_blocks_triton(
            xn, fmt, g, None, hints, scale_lsb=lsb, lsb_blocks_per_row=nbr, config=c), "fwd")
    return nvfp4 | {
        "quantize": (lambda c: tk.quantize_blocks_triton(xb, fmt, g, config=c), "fwd"),
        "quantize_no_hints": (lambda c: tk.quantize_blocks_triton(xb, fmt, g, emit_hints=False, config=c), "fwd"),
        "quantize_fake": (lambda c: tk.quantize_fake_blocks_triton(xb, fmt, g, config=c), "fwd"),
        "capture_unfused": (unfused, "fwd"),
        "fake_quant": (lambda c: tk.fake_quantize_blocks_triton(xn, fmt, g, scales, hints, config=c), "fwd"),
        "fake_quant_rtn": (lambda c: tk.fake_quantize_blocks_triton(xn, fmt, g, None, None, config=c), "fwd"),
        "dequantize": (lambda c: tk.dequantize_blocks_triton(codes, scales, fmt, g, x.dtype, config=c), "fwd"),
        "fake_quant_bwd": (lambda c: tk.fake_quantize_bwd_blocks_triton(grad, xn, fmt, g, scales, config=c), "bwd"),
    }


def summarize(times: list[float], nbytes: int) -> dict:
    times = [max(t, 1e-6) for t in times]  # CPU smoke runs can time 0
    med = statistics.median(times)
    return {"ms_median": round(med, 5), "ms_min": round(min(times), 5), "ms_max": round(max(times), 5),
            "gbps_median": round(nbytes / med / 1e6, 1), "gbps_min": round(nbytes / max(times) / 1e6, 1),
            "gbps_max": round(nbytes / min(times) / 1e6, 1), "runs_ms": [round(t, 5) for t in times]}


def run_case(hidden, dtype_name, fmt, args, device, cuda, sweep, tk, log) -> dict:
    dtype = DTYPES[dtype_name]
    e = torch.tensor([], dtype=dtype).element_size()
    rows = 4 if args.smoke else max(1, int(args.gib * 2**30) // (hidden * e))
    res: dict = {"hidden": hidden, "rows": rows, "dtype": dtype_name, "fmt": fmt, "input_bytes": rows * hidden * e}
    log(f"[{dtype_name} {fmt} h{hidden}] x [{rows}, {hidden}]")
    res["exact_mismatches"] = exactness_suite(min(rows, 2048), hidden, dtype, fmt, device, tk)
    res["bit_exact"] = all(v == 0 for case in res["exact_mismatches"].values() for v in case.values())
    log(f"  bit-exact vs reference: {res['bit_exact']}"
        + ("" if res["bit_exact"] else f" {res['exact_mismatches']}"))

    x = make_x(rows, hidden, dtype, device, seed=hidden)
    g = torch.tensor(0.01, dtype=torch.float32, device=device) if fmt == "nvfp4" else None
    n = x.numel()
    nbytes = op_bytes(n, e, BLOCK[fmt])
    res["bytes"] = nbytes
    runs, iters, warm = (args.runs, args.iters, 3) if cuda else (2, 1, 0)
    y = torch.empty_like(x)
    copy = summarize(time_runs(lambda: y.copy_(x), runs, iters, warm, cuda), nbytes["copy"])
    del y
    res["default"] = {"copy": copy}
    res["sweep"] = {}
    ops = make_ops(x, fmt, g, tk)
    for op, (fn, kind) in ops.items():
        default_cfg = tk.default_config(CONFIG_KEY[op.replace("capture_unfused", "quantize")], dtype, fmt)
        res["default"][op] = {"config": cfg_name(default_cfg),
                              **summarize(time_runs(lambda: fn(None), runs, iters, warm, cuda), nbytes[op])}
        if sweep and op != "capture_unfused":
            res["sweep"][op] = {}
            for c in (sweep["bwd"] if kind == "bwd" else sweep["fwd"] + (sweep["rows"] if takes_rows(op, dtype_name)
                                                                               else [])):
                res["sweep"][op][cfg_name(c)] = summarize(time_runs(lambda: fn(c), runs, iters, warm, cuda),
                                                          nbytes[op])
    del ops, x
    copy_gbps = copy["gbps_median"]
    res["fraction_of_copy_default"] = {op: round(v["gbps_median"] / copy_gbps, 3) for op, v in res["default"].items()}
    res["best"] = {}
    for op, d in res["sweep"].items():
        best = max(d, key=lambda k: d[k]["gbps_median"])
        res["best"][op] = {"config": best, "gbps_median": d[best]["gbps_median"],
                           "fraction_of_copy": round(d[best]["gbps_median"] / copy_gbps, 3)}
    dq, dn = res["default"]["quantize"]["ms_median"], res["default"]["quantize_no_hints"]["ms_median"]
    res["hint_cost_pct_default"] = round(100 * (dq / dn - 1), 2)
    if "fake_quant_lsb" in res["default"]:  # the trainer's decode of scale hints, fused, over given scale bytes
        res["scale_hint_decode_cost_pct_default"] = round(
            100 * (res["default"]["fake_quant_lsb"]["ms_median"] / res["default"]["fake_quant"]["ms_median"] - 1), 2)
    res["capture_fused_vs_unfused_time"] = round(res["default"]["quantize_fake"]["ms_median"]
                                                 / res["default"]["capture_unfused"]["ms_median"], 3)
    if cuda:
        torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------------------------------------
# quantize variants side by side (--quantize-variants): the hint cost per variant
# ---------------------------------------------------------------------------------------------------------
#: configurations each quantize variant is timed at (its best one is its figure): the block layout, the pair
#: layout ("pairs": two blocks per thread, NVFP4); programs per SM 0 = a plain grid (UNROLL needs a persistent one)
VARIANT_CONFIGS = {
    "bf16": [(128, 4, 16), (128, 4, 32), (128, 4, 12), (64, 2, 16), (64, 2, 32), (256, 8, 16), (128, 4, 0),
             (64, 2, 0)],
    "fp16": [(64, 2, 0), (128, 4, 0), (128, 4, 16), (64, 2, 16), (128, 4, 32)],
    "fp32": [(128, 4, 0), (64, 2, 0), (128, 4, 16), (64, 2, 16)],
}
VARIANT_CONFIGS_PAIRS = {
    "bf16": [("pairs", 128, 4, 8), ("pairs", 128, 4, 16), ("pairs", 128, 4, 32), ("pairs", 64, 2, 16),
             ("pairs", 64, 2, 32), ("pairs", 256, 8, 8)],
    "fp16": [("pairs", 64, 2, 0), ("pairs", 128, 4, 16), ("pairs", 64, 2, 16)],
    "fp32": [("pairs", 64, 2, 0), ("pairs", 128, 4, 0), ("pairs", 64, 2, 16)],
}
SMOKE_VARIANT_CONFIGS = [(8, 1, 0), (8, 1, 3)]
SMOKE_VARIANT_CONFIGS_PAIRS = [("pairs", 8, 1, 0), ("pairs", 4, 1, 3)]
DEFAULT_VARIANTS = ("gather,nibbles,nibbles_x4,gather+unroll,nibbles+unroll,gather+pairs,nibbles+pairs,"
                    "nibbles+pairs+unroll")


def parse_variant(name: str, tk) -> dict:
    """A quantize variant from its name: tokens joined by "+": a hint packing (one of
    `tracefp4.triton_kernels.HINT_PACKS`, default the module's HINT_PACK), "pairs" (the pair layout), "unroll" (two
    tiles per trip of the persistent loop)."""
    v = {"name": name, "hint_pack": tk.HINT_PACK, "pairs": False, "unroll": False}
    for t in name.split("+"):
        if t in tk.HINT_PACKS:
            v["hint_pack"] = t
        elif t in ("pairs", "unroll"):
            v[t] = True
        else:
            raise SystemExit(f"unknown token {t!r} in quantize variant {name!r} (hint packings {tk.HINT_PACKS}, "
                             f"'pairs', 'unroll')")
    return v


def variant_configs(v: dict, dtype_name: str, fmt: str, smoke: bool) -> list:
    """The configurations variant v is timed at (the pair layout: NVFP4 only; unroll: persistent grids only)."""
    if v["pairs"]:
        if fmt != "nvfp4":
            return []
        cfgs = SMOKE_VARIANT_CONFIGS_PAIRS if smoke else VARIANT_CONFIGS_PAIRS[dtype_name]
    else:
        cfgs = SMOKE_VARIANT_CONFIGS if smoke else VARIANT_CONFIGS[dtype_name]
    return [c for c in cfgs if not v["unroll"] or c[-1] > 0]


def variant_fns(v: dict, cfg, xb, fmt: str, g, tk):
    """(quantize with hints, quantize without hints) of variant v at cfg. The kernel without hints does not depend
    on the hint packing: every variant's is launched with the default one (the same binary)."""
    def with_hints():
        return tk.quantize_blocks_triton(xb, fmt, g, config=cfg, hint_pack=v["hint_pack"], unroll=v["unroll"])

    def no_hints():
        return tk.quantize_blocks_triton(xb, fmt, g, emit_hints=False, config=cfg, unroll=v["unroll"])

    return with_hints, no_hints


def time_interleaved(fns: dict, runs: int, iters: int, warmup: int, cuda: bool) -> dict:
    """`time_runs` of several functions with their runs interleaved (run r of each, then run r + 1 of each), so
    that a drift of the clock or the memory's temperature over the minutes of a sweep lands on all of them."""
    out = {k: [] for k in fns}
    for _ in range(runs):
        for k, fn in fns.items():
            out[k] += time_runs(fn, 1, iters, warmup, cuda)
    return out


def variant_exactness(variants, xb, fmt: str, g, tk, want=None) -> dict:
    """Mismatches (codes + scales + hints, and quantize_fake's y) of every variant at every one of its configs
    against the reference on xb."""
    if want is None:
        want = ref.quantize_blocks_ref(xb, fmt, g)
    y_want = ref.fake_quantize_blocks_ref(xb, fmt, g) if xb.shape[0] <= 1 << 16 else None
    out = {}
    for v, cfgs in variants:
        for c in cfgs:
            fh, fn = variant_fns(v, c, xb, fmt, g, tk)
            got, got_nh = fh(), fn()
            m = sum(mismatches(a, w) for a, w in zip(got, want)) + mismatches(got_nh[0], want[0]) \
                + mismatches(got_nh[1], want[1])
            if y_want is not None:
                y, *q = tk.quantize_fake_blocks_triton(xb, fmt, g, config=c, hint_pack=v["hint_pack"],
                                                       unroll=v["unroll"])
                m += mismatches(y, y_want) + sum(mismatches(a, w) for a, w in zip(q, want))
            out[f"{v['name']}/{cfg_name(c)}"] = m
    return out


def reference_chunked(xb, fmt: str, g, chunks: int = 32):
    """`reference.quantize_blocks_ref` of a large xb in row chunks (per block, so the same bits; less memory)."""
    parts = [ref.quantize_blocks_ref(c, fmt, g) for c in xb.chunk(chunks)]
    return tuple(torch.cat([p[i] for p in parts]) for i in range(3))


def run_variants_case(hidden, dtype_name, fmt, args, device, cuda, variant_names, tk, log) -> dict:
    """Time quantize with and without hints for every variant and configuration on 1 GiB (--gib) of input: the
    hint cost per variant at each configuration, at the variant's best configuration against the fastest kernel
    without hints of the whole case (the fair figure: both sides get every configuration), and bit-exactness."""
    dtype = DTYPES[dtype_name]
    e = torch.tensor([], dtype=dtype).element_size()
    rows = 4 if args.smoke else max(1, int(args.gib * 2**30) // (hidden * e))
    b = BLOCK[fmt]
    variants = [(v, variant_configs(v, dtype_name, fmt, args.smoke))
                for v in (parse_variant(n, tk) for n in variant_names)]
    variants = [(v, c) for v, c in variants if c]
    res: dict = {"hidden": hidden, "rows": rows, "dtype": dtype_name, "fmt": fmt, "input_bytes": rows * hidden * e}
    log(f"[variants {dtype_name} {fmt} h{hidden}] x [{rows}, {hidden}]: {', '.join(v['name'] for v, _ in variants)}")
    x = make_x(rows, hidden, dtype, device, seed=hidden)
    g = torch.tensor(0.01, dtype=torch.float32, device=device) if fmt == "nvfp4" else None
    xb = x.reshape(-1, b)
    n = x.numel()
    nbytes = op_bytes(n, e, b)
    res["bytes"] = {k: nbytes[k] for k in ("copy", "quantize", "quantize_no_hints")}
    # exactness: the timed data (persistent loops of many trips, odd and even), ties and the dtype's special values
    if not args.skip_exactness:
        t0 = time.perf_counter()
        few = 2 if args.smoke else 256  # (the interpreter runs a program at a time)
        small = [("ties_g1", make_ties(few, hidden, dtype, device, seed=1).reshape(-1, b),
                  torch.tensor(1.0, device=device) if fmt == "nvfp4" else None),
                 ("specials", make_specials(dtype, b, device).reshape(-1, b),
                  torch.tensor(0.37, device=device) if fmt == "nvfp4" else None),
                 ("random_odd_blocks", make_x(few + 1, hidden, dtype, device, seed=5).reshape(-1, b)[1:], g)]
        exact = {name: variant_exactness(variants, xx, fmt, gg, tk) for name, xx, gg in small}
        exact["timed"] = variant_exactness(variants, xb, fmt, g, tk, want=reference_chunked(xb, fmt, g))
        res["exact_mismatches"] = exact
        res["bit_exact"] = all(m == 0 for d in exact.values() for m in d.values())
        log(f"  bit-exact vs reference (every variant and config): {res['bit_exact']} "
            f"({time.perf_counter() - t0:.1f} s)" + ("" if res["bit_exact"] else f" {exact}"))
    runs, iters, warm = (args.runs, args.iters, 3) if cuda else (2, 1, 0)
    y = torch.empty_like(x)
    res["copy"] = summarize(time_runs(lambda: y.copy_(x), runs, iters, warm, cuda), nbytes["copy"])
    del y
    copy_gbps = res["copy"]["gbps_median"]
    res["variants"] = {}
    for v, cfgs in variants:
        d = {}
        for c in cfgs:
            fh, fn = variant_fns(v, c, xb, fmt, g, tk)
            t = time_interleaved({"quantize": fh, "quantize_no_hints": fn}, runs, iters, warm, cuda)
            q, nh = summarize(t["quantize"], nbytes["quantize"]), summarize(t["quantize_no_hints"],
                                                                           nbytes["quantize_no_hints"])
            d[cfg_name(c)] = {"quantize": q, "quantize_no_hints": nh,
                              "fraction_of_copy": round(q["gbps_median"] / copy_gbps, 4),
                              "fraction_of_copy_no_hints": round(nh["gbps_median"] / copy_gbps, 4),
                              "hint_cost_pct": round(100 * (q["ms_median"] / nh["ms_median"] - 1), 2)}
        res["variants"][v["name"]] = d
    # the fastest kernel without hints of the whole case (every variant's layout, unroll and configuration)
    nh_all = [(k, c, r["quantize_no_hints"]["ms_median"]) for k, d in res["variants"].items() for c, r in d.items()]
    kb, cb, tb = min(nh_all, key=lambda t: t[2])
    res["fastest_no_hints"] = {"variant": kb, "config": cb, "ms_median": tb,
                               "fraction_of_copy": res["variants"][kb][cb]["fraction_of_copy_no_hints"]}
    res["summary"] = {}
    for k, d in res["variants"].items():
        c = min(d, key=lambda c: d[c]["quantize"]["ms_median"])
        r = d[c]
        own = min(x["quantize_no_hints"]["ms_median"] for x in d.values())  # this variant's layout and loop only
        res["summary"][k] = {
            "best_config": c, "ms_median": r["quantize"]["ms_median"], "fraction_of_copy": r["fraction_of_copy"],
            "hint_cost_pct_vs_fastest_no_hints": round(100 * (r["quantize"]["ms_median"] / tb - 1), 2),
            "hint_cost_pct_vs_own_fastest_no_hints": round(100 * (r["quantize"]["ms_median"] / own - 1), 2),
            "hint_cost_pct_same_config": r["hint_cost_pct"],
            "hint_cost_pct_min_max": [  # the spread: slowest / fastest runs against the fastest no-hints medians
                round(100 * (r["quantize"]["ms_min"] / tb - 1), 2), round(100 * (r["quantize"]["ms_max"] / tb - 1), 2)],
        }
    del x, xb
    if cuda:
        torch.cuda.empty_cache()
    return res


def log_variants(results, log, detail: bool = True) -> None:
    """The variants' table: per case the summary per variant (detail: and every configuration's figures)."""
    log("")
    log("quantize variants: hint cost = time with hints / the fastest time without hints of the case (every variant "
        "and config) - 1; the bytes alone are +{:.2f}% (bf16 NVFP4)".format(
            100 * (op_bytes(1 << 20, 2, 16)["quantize"] / op_bytes(1 << 20, 2, 16)["quantize_no_hints"] - 1)))
    for r in results:
        fn = r["fastest_no_hints"]
        log(f"{r['dtype']} {r['fmt']} h{r['hidden']}: copy {r['copy']['gbps_median']} GB/s; fastest without hints "
            f"{fn['variant']} [{fn['config']}] {fn['ms_median']:.4f} ms {100 * fn['fraction_of_copy']:.1f}% of copy; "
            f"bit-exact {r.get('bit_exact')}")
        for k, sm in r["summary"].items():
            log(f"   {k:24s} [{sm['best_config']:22s}] {sm['ms_median']:.4f} ms {100 * sm['fraction_of_copy']:6.1f}%  "
                f"hint cost {sm['hint_cost_pct_vs_fastest_no_hints']:+6.2f}% "
                f"({sm['hint_cost_pct_min_max'][0]:+.2f}..{sm['hint_cost_pct_min_max'][1]:+.2f}), "
                f"vs its own layout {sm['hint_cost_pct_vs_own_fastest_no_hints']:+.2f}%, "
                f"same config {sm['hint_cost_pct_same_config']:+.2f}%")
        for k, d in (r["variants"].items() if detail else ()):
            for c, x in d.items():
                log(f"      {k:24s} {c:22s} hints {x['quantize']['ms_median']:.4f} ms "
                    f"({100 * x['fraction_of_copy']:.1f}%)  no hints {x['quantize_no_hints']['ms_median']:.4f} ms "
                    f"({100 * x['fraction_of_copy_no_hints']:.1f}%)  {x['hint_cost_pct']:+.2f}%")


def profile_variants(variant_names, args, device, tk, log) -> None:
    """One launch of each variant with and without hints at its first configuration (bf16 NVFP4, first hidden size),
    nothing else of tracefp4 launched: for Nsight Compute (-k regex:_quantize_kernel), in the printed order."""
    dtype_name, fmt = args.dtypes[0], args.fmts[0]
    dtype = DTYPES[dtype_name]
    hidden = args.hidden[0]
    rows = max(1, int(args.gib * 2**30) // (hidden * torch.tensor([], dtype=dtype).element_size()))
    xb = make_x(rows, hidden, dtype, device, seed=hidden).reshape(-1, BLOCK[fmt])
    g = torch.tensor(0.01, dtype=torch.float32, device=device) if fmt == "nvfp4" else None
    i = 0
    seen = set()  # kernels without hints already launched (they do not depend on the hint packing)
    for name in variant_names:
        v = parse_variant(name, tk)
        cfgs = variant_configs(v, dtype_name, fmt, args.smoke)
        if not cfgs:
            continue
        c = cfgs[0]
        fh, fn = variant_fns(v, c, xb, fmt, g, tk)
        key = (c, v["unroll"])
        for label, f in (("hints", fh),) + ((("no_hints", fn),) if key not in seen else ()):
            log(f"profile launch {i}: {name} {label} [{cfg_name(c)}] x [{rows}, {hidden}] {dtype_name} {fmt}")
            f()
            if device == "cuda":
                torch.cuda.synchronize()
            i += 1
        seen.add(key)



# ---------------------------------------------------------------------------------------------------------
# compile everything first, in parallel processes (Triton's on-disk cache is shared)
# ---------------------------------------------------------------------------------------------------------
def _compile_worker(job) -> str:
    dtype_name, fmt, fwd_cfg, bwd_cfg, with_exactness = job
    from tracefp4 import triton_kernels as tk

    x = make_x(64, 256, DTYPES[dtype_name], "cuda", seed=1)
    g = torch.tensor(0.01, device="cuda") if fmt == "nvfp4" else None
    for op, (fn, kind) in make_ops(x, fmt, g, tk).items():
        if fwd_cfg is not None and fwd_cfg[0] == "rows" and not takes_rows(op, dtype_name):
            continue
        fn(bwd_cfg if kind == "bwd" else fwd_cfg)
    if with_exactness:
        exactness(x, fmt, g, tk)
    torch.cuda.synchronize()
    return f"{dtype_name}/{fmt}/{fwd_cfg}"


def _compile_variants_worker(job) -> str:
    dtype_name, fmt, name, cfg = job
    from tracefp4 import triton_kernels as tk

    x = make_x(64, 256, DTYPES[dtype_name], "cuda", seed=1)
    g = torch.tensor(0.01, device="cuda") if fmt == "nvfp4" else None
    xb = x.reshape(-1, BLOCK[fmt])
    for f in variant_fns(parse_variant(name, tk), cfg, xb, fmt, g, tk):
        f()
    xo = x.reshape(-1, BLOCK[fmt])[1:]  # an odd count of blocks (the pair layout's fallback)
    for f in variant_fns(parse_variant(name, tk), cfg, xo, fmt, g, tk):
        f()
    tk.quantize_fake_blocks_triton(xb, fmt, g, config=cfg, hint_pack=parse_variant(name, tk)["hint_pack"],
                                   unroll=parse_variant(name, tk)["unroll"])
    torch.cuda.synchronize()
    return f"{dtype_name}/{fmt}/{name}/{cfg}"


def precompile_variants(cases, variant_names, workers: int, log) -> None:
    """`precompile` of the quantize variants (each variant at each of its configurations)."""
    import multiprocessing as mp

    from tracefp4 import triton_kernels as tk

    jobs = []
    for dtype_name, fmt in cases:
        for name in variant_names:
            jobs += [(dtype_name, fmt, name, c) for c in variant_configs(parse_variant(name, tk), dtype_name, fmt,
                                                                          False)]
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(_compile_variants_worker, jobs))
    log(f"precompiled {len(jobs)} variant jobs of {cases} in {time.perf_counter() - t0:.1f} s ({workers} processes)")


def precompile(cases, sweep, workers: int, log) -> None:
    """Run every kernel variant once on small data in `workers` processes, so that the timing process finds
    them compiled (the kernels' sizes are not specialized on, so small data compiles the same binaries)."""
    import multiprocessing as mp

    jobs = []
    for dtype_name, fmt in cases:
        fwd = [None] + (sweep["fwd"] + sweep["rows"] if sweep else [])
        bwd = [None] + (sweep["bwd"] if sweep else [])
        jobs += [(dtype_name, fmt, fwd[i], bwd[min(i, len(bwd) - 1)], i == 0) for i in range(len(fwd))]
    if not jobs:
        return
    t0 = time.perf_counter()
    with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(_compile_worker, jobs))
    log(f"precompiled {len(jobs)} jobs in {time.perf_counter() - t0:.1f} s ({workers} processes)")


# ---------------------------------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU under TRITON_INTERPRET=1")
    ap.add_argument("--sweep", action="store_true", help="also time every configuration of the sweep")
    ap.add_argument("--gib", type=float, default=1.0, help="input size per case, GiB (in the input's dtype)")
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168], help="hidden sizes (row lengths)")
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES), help="input dtypes")
    ap.add_argument("--fmts", nargs="+", default=list(BLOCK), choices=list(BLOCK), help="FP4 formats")
    ap.add_argument("--sweep-cases", nargs="+", default=["bf16/nvfp4"],
                    help="dtype/fmt cases that get the configuration sweep (with --sweep)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per figure (median and min..max reported)")
    ap.add_argument("--iters", type=int, default=10, help="back-to-back launches per run")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="processes that compile the kernels before timing (GPU only)")
    ap.add_argument("--out", type=str, default=None, help="JSON output path")
    ap.add_argument("--json", action="store_true", help="print the JSON summary on stdout (and the table on stderr)")
    ap.add_argument("--quantize-variants", type=str, default=None, metavar="A,B,...",
                    help="time only quantize with and without hints for these variants (names: a hint packing of "
                         "tracefp4.triton_kernels.HINT_PACKS, '+pairs', '+unroll'; 'all' = " + DEFAULT_VARIANTS + ") "
                         "at each of their configurations, side by side, and check their bits on the device")
    ap.add_argument("--skip-exactness", action="store_true", help="with --quantize-variants: no bit checks")
    ap.add_argument("--profile-variants", action="store_true",
                    help="with --quantize-variants: one launch of each variant with and without hints at its first "
                         "configuration (first dtype, format and hidden size), nothing else: run under ncu")
    args = ap.parse_args()

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.json else (lambda s: print(s, flush=True))
    import triton

    from tracefp4 import triton_kernels as tk

    sweep = None
    if args.sweep:
        sweep = {"fwd": SMOKE_SWEEP if args.smoke else SWEEP, "bwd": [(8, 1)] if args.smoke else SWEEP_BWD,
                 "rows": SMOKE_SWEEP_ROWS if args.smoke else SWEEP_ROWS}
    meta = {
        "gpu": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
        "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
        "cuda": torch.version.cuda, "smoke": args.smoke, "default_config": {k: list(v) for k, v in tk.CONFIG.items()},
        "default_config_cases": {"/".join(k): list(v) for k, v in tk.CONFIG_CASES.items()},
        "timing": f"{args.runs} runs per figure in one process; a run = mean of {args.iters} back-to-back launches "
                  "(CUDA events) after 3 warm-up launches; figure = median over runs, spread = min..max",
    }
    log(json.dumps(meta))
    if args.quantize_variants:
        names = [n for n in (DEFAULT_VARIANTS if args.quantize_variants == "all" else args.quantize_variants).split(",")
                 if n]
        for n in names:
            parse_variant(n, tk)  # unknown names fail before anything runs
        if args.profile_variants:
            profile_variants(names, args, device, tk, log)
            return
        if args.out:
            vpath = Path(args.out)
        elif os.environ.get("OUT"):
            vpath = Path(os.environ["OUT"]) / "kernels-quantize-variants.json"
        else:
            vpath = Path(__file__).resolve().parent / "results" / (
                f"kernels-quantize-variants-{'smoke' if args.smoke else 'gpu'}.json")
        vpath.parent.mkdir(parents=True, exist_ok=True)
        cases = [(d, f) for d in args.dtypes for f in args.fmts]
        meta["timing"] = (f"{args.runs} runs per figure, with and without hints interleaved run by run; a run = mean "
                          f"of {args.iters} back-to-back launches (CUDA events) after 3 warm-up launches; figure = "
                          "median over runs, spread = min..max")
        results = []
        for dtype_name, fmt in cases:  # compiled case by case: the first case's figures come first
            if cuda:
                precompile_variants([(dtype_name, fmt)], names, args.workers, log)
            for h in args.hidden:
                results.append(run_variants_case(h, dtype_name, fmt, args, device, cuda, names, tk, log))
                vpath.write_text(json.dumps({**meta, "variants": names, "partial": True, "results": results},
                                            indent=1))
                log_variants(results[-1:], log)  # each case's table as soon as it is measured
        vpath.write_text(json.dumps({**meta, "variants": names, "results": results}, indent=1))
        log_variants(results, log, detail=False)
        log(f"wrote {vpath}")
        return
    if args.out:
        path = Path(args.out)
    elif os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kernels-h200.json"
    else:
        name = "smoke" if args.smoke else meta["gpu"].lower().replace(" ", "-")
        path = Path(__file__).resolve().parent / "results" / f"kernels-{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    cases = [(d, f) for d in args.dtypes for f in args.fmts]
    if cuda:
        sweep_cases = [tuple(c.split("/")) for c in args.sweep_cases]
        precompile([c for c in cases if c not in sweep_cases], None, args.workers, log)
        precompile([c for c in cases if c in sweep_cases], sweep, args.workers, log)
    results = []
    for dtype_name, fmt in cases:
        case_sweep = sweep if f"{dtype_name}/{fmt}" in args.sweep_cases else None
        for h in args.hidden:
            results.append(run_case(h, dtype_name, fmt, args, device, cuda, case_sweep, tk, log))
            path.write_text(json.dumps({**meta, "partial": True, "results": results}, indent=1))  # survives a kill
    summary = {
        "all_bit_exact": all(r["bit_exact"] for r in results),
        "worst_fraction_of_copy_default": {
            op: min(r["fraction_of_copy_default"][op] for r in results if op in r["fraction_of_copy_default"])
            for op in OPS if op != "copy"},
        "worst_hint_cost_pct_default": max(r["hint_cost_pct_default"] for r in results),
    }
    out = {**meta, "summary": summary, "results": results}
    path.write_text(json.dumps(out, indent=1))

    log("")
    log("GB/s median (min..max over runs) and % of the copy of the same bytes; default configuration")
    for r in results:
        log(f"{r['dtype']} {r['fmt']} h{r['hidden']}: copy {r['default']['copy']['gbps_median']} GB/s, "
            f"hint cost {r['hint_cost_pct_default']}%, fused capture {r['capture_fused_vs_unfused_time']}x the "
            f"unfused time, bit-exact {r['bit_exact']}")
        if "scale_hint_decode_cost_pct_default" in r:
            log(f"   (scale hints decoded in the pass: {r['scale_hint_decode_cost_pct_default']:+.2f}% of the time of "
                f"fake_quant with the bytes given)")
        for op in OPS[1:]:
            if op not in r["default"]:
                continue
            d = r["default"][op]
            best = r["best"].get(op)
            extra = f"   best {best['config']} {100 * best['fraction_of_copy']:.1f}%" if best else ""
            log(f"   {op:18s} {d['gbps_median']:8.1f} ({d['gbps_min']:.0f}..{d['gbps_max']:.0f}) "
                f"{100 * r['fraction_of_copy_default'][op]:6.1f}%  [{d['config']}]{extra}")
    log(f"all bit-exact: {summary['all_bit_exact']}; wrote {path}")
    if args.json:
        print(json.dumps(summary))


if __name__ == "__main__":
    main()
