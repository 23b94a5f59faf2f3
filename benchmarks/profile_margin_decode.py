"""Where the Triton margin-row decoder's time goes (issue 23): `compact_triton.unpack_sites_dense` on synthetic
rows (random bf16 activations quantized and marked at value margin --margin, Rice/all coding, LSB scale payload),
split into its host part (`_on_host`), the launch (stacking, copies, planes, kernel) and the whole call, each the
median of --runs calls (min given); then a torch-profiler table of three calls (kernel vs copies vs host ops).

    python benchmarks/profile_margin_decode.py --out $OUT/margin-decode-profile.json   # GPU
    python benchmarks/profile_margin_decode.py --smoke                                    # CPU, TRITON_INTERPRET=1

The benchmark of the whole path (store read, concatenation, decode, fill-in) is `benchmark_compact_path.py`.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

import tracefp4  # noqa: E402
from tracerl.hints import compact as C  # noqa: E402
from tracerl.hints import compact_triton as CT  # noqa: E402


def _rows(sites: int, t: int, w: int, margin: float, device: torch.device) -> dict[str, C.PackedRows]:
    g = torch.tensor(1.0, device=device)
    out = {}
    for s in range(sites):
        gen = torch.Generator(device).manual_seed(s)
        x = torch.randn(t, w, device=device, generator=gen).to(torch.bfloat16)
        q = tracefp4.quantize(x, global_scale=g)
        enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, margin, float("inf"), scale_payload="lsb")
        out[f"site{s}"] = C.pack_rows(enc, C.SiteCoding("rice4", "all"))
    return out


def _timed(fn, device: torch.device, runs: int) -> dict[str, float]:
    ts = []
    for _ in range(runs):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ts.append(1e3 * (time.perf_counter() - t))
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "runs": runs}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1024, help="rows (tokens) per site (default 1024)")
    p.add_argument("--sites", type=int, default=20, help="sites decoded in one call (default 20)")
    p.add_argument("--width", type=int, default=2048, help="values per row (default 2048)")
    p.add_argument("--margin", type=float, default=0.03, help="value margin of the marks (default 0.03)")
    p.add_argument("--runs", type=int, default=10, help="calls timed per figure (default 10)")
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU under TRITON_INTERPRET=1")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "margin-decode-profile.json"),
                   help="JSON path (default $OUT/margin-decode-profile.json)")
    args = p.parse_args(argv)
    if args.smoke:
        device, args.rows, args.sites, args.width, args.runs = torch.device("cpu"), 4, 2, 64, 3
    elif not torch.cuda.is_available():
        p.error("needs a CUDA device (or --smoke)")
    else:
        device = torch.device("cuda")
    rows = _rows(args.sites, args.rows, args.width, args.margin, device)
    for _ in range(2):  # compile, warm the pinned-memory cache
        CT.unpack_sites_dense(rows, device)
    host = {s: CT._on_host(r) for s, r in rows.items()}
    group = list(host.values())
    figures = {
        "unpack_sites_dense": _timed(lambda: CT.unpack_sites_dense(rows, device), device, args.runs),
        "on_host": _timed(lambda: {s: CT._on_host(r) for s, r in rows.items()}, device, args.runs),
        "launch_all_sites": _timed(lambda: CT._launch(group, device), device, args.runs),
        "launch_one_site": _timed(lambda: CT._launch(group[:1], device), device, args.runs),
    }
    table = None
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                CT.unpack_sites_dense(rows, device)
            torch.cuda.synchronize(device)
        table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12)
    res = {
        "benchmark": "margin-decode-profile",
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__, "config": vars(args),
        "bytes_per_row": float(np.mean([r.data.size / args.rows for r in rows.values()])),
        "figures": figures, "profile_table": table,
    }
    print(f"margin decode, {args.sites} sites x {args.rows} rows x {args.width} on {res['device']} "
          f"({res['bytes_per_row']:.1f} B/row), median of {args.runs}")
    for k, v in figures.items():
        print(f"  {k:22s} {v['median_ms']:9.3f} ms  (min {v['min_ms']:.3f})")
    if table:
        print(table)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
