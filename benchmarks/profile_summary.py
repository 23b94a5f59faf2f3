"""Condense torch.profiler Chrome traces (``benchmark_trainer.py --profile``) into where the device time goes.

For each trace: the traced span, the device's busy time (the union of its kernel and memcpy/memset intervals),
kernel launches, and the device time per kernel family (GEMM, attention, FP4 kernels, optimizer, copies, ...) and
per kernel name. Given two traces (e.g. ``fp4_hints`` and ``bf16`` of the same step), it prints them side by side
with the difference: what one mode adds on the device. On the host, per thread that ran torch operations: its span
and the time inside top-level operations; for the thread that started first (the training loop's), the time
*between* its operations (Python, and waits for the GIL) and where the longest of it lies, grouped by the pair of
operations around it: a host-bound step shows up there (the fourteenth session found 34 ms a step after one op per
MoE layer that way: a background thread holding the GIL), and every blocking wait of the host (a sync, or a copy
back to it, of 0.5 ms or more) with the torch operations it sits in: where the host stops launching. Host time per
Python function is in the ``-python.txt`` that the same run writes.

    python benchmarks/profile_summary.py OUT-profile-trace.json.gz OUT-profile-bf16-trace.json.gz [--json PATH]
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

# (family, pattern on the kernel name), first match wins
FAMILIES = [
    ("fp4 (tracefp4 Triton)", r"^_(fake_quant|quantize|dequant|fq_|lsb)|fake_quant|_quantize_kernel"),
    ("grouped GEMM", r"grouped|Grouped|_grouped_mm|cutlass.*group"),
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp|efficient_attention"),
    ("GEMM", r"gemm|Gemm|sm90_xmma|cutlass|cublas|ampere_|sm80_|nvjet"),
    ("optimizer", r"fused_adam|FusedAdam|adam|Adam|multi_tensor_apply"),
    ("reduction", r"reduce_kernel|Reduce|norm_kernel|amax"),
    ("index / sort / scatter", r"index|gather|scatter|sort|Sort|radix|searchsorted|cub::"),
    ("copy / cast", r"copy|Copy|cast|Memcpy|Memset|memcpy|memset|to_copy"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|Elementwise"),
]


def _family(name: str) -> str:
    for fam, pat in FAMILIES:
        if re.search(pat, name):
            return fam
    return "other"


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -float("inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def summarize(path: str, top: int = 25) -> dict:
    """The summary of one trace (times in ms)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    dev = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    launches = sum(1 for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime"
                   and re.search(r"LaunchKernel|cuLaunch", e.get("name", "")))
    host = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "python_function", "user_annotation")]
    spans = [(e["ts"], e["ts"] + e.get("dur", 0)) for e in dev + host]
    span = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e3 if spans else 0.0
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    by_fam: dict[str, float] = collections.defaultdict(float)
    for e in dev:
        name = e.get("name", "?")
        by_name[name][0] += 1
        by_name[name][1] += e.get("dur", 0) / 1e3
        by_fam[_family(name) if e["cat"] == "kernel" else "copy / cast"] += e.get("dur", 0) / 1e3
    busy = _union([(e["ts"], e["ts"] + e.get("dur", 0)) for e in dev]) / 1e3
    names = sorted(by_name.items(), key=lambda kv: -kv[1][1])
    return {"host": host_summary(events), "host_waits": host_waits(events),
            "trace": path, "span_ms": round(span, 2), "device_busy_ms": round(busy, 2),
            "device_busy_share": round(busy / span, 4) if span else None, "kernels": sum(v[0] for v in by_name.values()),
            "launches": launches, "families_ms": {k: round(v, 2) for k, v in sorted(by_fam.items(), key=lambda kv: -kv[1])},
            "top_kernels": [{"name": n[:120], "count": c, "ms": round(t, 3)} for n, (c, t) in names[:top]]}


def _top_level(evs: list[dict]) -> list[dict]:
    """The events of one thread that no earlier event of it contains (sorted by start)."""
    out, end = [], -float("inf")
    for e in sorted(evs, key=lambda e: (e["ts"], -e.get("dur", 0))):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e.get("dur", 0)
    return out


def host_summary(events: list[dict], top: int = 8) -> dict:
    """Per thread with torch operations: span and time inside top-level host events (ms); for the first thread
    (the training loop's), the time between them and the ``top`` largest (previous op, next op) groups of it."""
    host = [e for e in events if e.get("ph") == "X" and "tid" in e
            and e.get("cat") in ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")]
    by_tid: dict = collections.defaultdict(list)
    for e in host:
        by_tid[e["tid"]].append(e)
    threads = []
    for tid, evs in by_tid.items():
        if not any(e.get("cat") == "cpu_op" for e in evs):
            continue
        tl = _top_level(evs)
        start, stop = tl[0]["ts"], max(e["ts"] + e.get("dur", 0) for e in tl)
        threads.append({"tid": tid, "start_ms": start, "span_ms": round((stop - start) / 1e3, 2),
                        "in_ops_ms": round(sum(e.get("dur", 0) for e in tl) / 1e3, 2), "_tl": tl})
    if not threads:
        return {"threads": [], "main": None}
    threads.sort(key=lambda t: t["start_ms"])
    t0 = threads[0]["start_ms"]
    main = threads[0]
    gaps: dict = collections.defaultdict(lambda: [0, 0.0])
    tl = main["_tl"]
    for a, b in zip(tl, tl[1:]):
        g = b["ts"] - (a["ts"] + a.get("dur", 0))
        if g > 0:
            key = (a.get("name", "?")[:48], b.get("name", "?")[:48])
            gaps[key][0] += 1
            gaps[key][1] += g / 1e3
    between = sum(v[1] for v in gaps.values())
    out_threads = [{"tid": t["tid"], "from_ms": round((t["start_ms"] - t0) / 1e3, 2), "span_ms": t["span_ms"],
                    "in_ops_ms": t["in_ops_ms"]} for t in threads]
    return {"threads": out_threads,
            "main": {"tid": main["tid"], "between_ops_ms": round(between, 2),
                     "largest_gaps": [{"after": a, "before": b, "count": c, "ms": round(ms, 3)}
                                      for (a, b), (c, ms) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]]}}


#: host calls that block until the device (or a copy) is done when they are long
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def host_waits(events: list[dict], min_ms: float = 0.5) -> list[dict]:
    """The host's blocking waits of at least ``min_ms``: each sync or copy call (`_WAITS`) that long, when it began
    (ms from the trace's first host event), how long, on which thread, and the torch operations it sits in (outermost
    first: which ``.cpu()`` / ``.item()`` / ``.tolist()`` made the host wait). A step's waits show where the host
    stops launching while the device catches up (a read-back queued behind a large copy shows up as one long one)."""
    host = [e for e in events if e.get("ph") == "X" and "tid" in e and "ts" in e]
    if not host:
        return []
    t0 = min(e["ts"] for e in host)
    ops = collections.defaultdict(list)
    for e in host:
        if e.get("cat") == "cpu_op":
            ops[e["tid"]].append(e)
    out = []
    for w in host:
        if w.get("name") not in _WAITS or w.get("dur", 0) < min_ms * 1e3:
            continue
        end = w["ts"] + w["dur"]
        inside = sorted((o for o in ops[w["tid"]] if o["ts"] <= w["ts"] and o["ts"] + o.get("dur", 0) >= end),
                        key=lambda o: (o["ts"], -o.get("dur", 0)))
        out.append({"at_ms": round((w["ts"] - t0) / 1e3, 2), "ms": round(w["dur"] / 1e3, 3), "call": w["name"],
                    "tid": w["tid"], "in": [o["name"] for o in inside]})
    return sorted(out, key=lambda x: x["at_ms"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("traces", nargs="+", help="one or two Chrome traces (.json or .json.gz)")
    ap.add_argument("--top", type=int, default=25, help="kernel names to list (default 25)")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the summaries as JSON")
    args = ap.parse_args(argv)
    if len(args.traces) > 2:
        ap.error(f"give one or two traces, got {len(args.traces)}")
    for t in args.traces:
        if not Path(t).is_file():
            print(f"profile_summary: no such trace: {t}", file=sys.stderr)
            return 2
    sums = [summarize(t, args.top) for t in args.traces]
    for s in sums:
        print(f"{s['trace']}: span {s['span_ms']:.1f} ms, device busy {s['device_busy_ms']:.1f} ms "
              f"({100 * (s['device_busy_share'] or 0):.0f}%), {s['kernels']} kernels, {s['launches']} launches")
    fams = list(dict.fromkeys(k for s in sums for k in s["families_ms"]))
    head = "family".ljust(26) + "".join(f"{'ms (' + str(i + 1) + ')':>12}" for i in range(len(sums)))
    print(head + (f"{'(1) - (2)':>12}" if len(sums) == 2 else ""))
    for k in fams:
        vals = [s["families_ms"].get(k, 0.0) for s in sums]
        print(k.ljust(26) + "".join(f"{v:12.2f}" for v in vals) + (f"{vals[0] - vals[1]:12.2f}" if len(vals) == 2 else ""))
    for i, s in enumerate(sums):
        h = s["host"]
        if not h["main"]:
            continue
        print(f"host ({i + 1}): " + "; ".join(f"thread {t['tid']} from {t['from_ms']:.1f} ms: span {t['span_ms']:.1f} "
                                             f"ms, in ops {t['in_ops_ms']:.1f} ms" for t in h["threads"]))
        m = h["main"]
        print(f"  thread {m['tid']} between its ops {m['between_ops_ms']:.1f} ms (Python, GIL waits, or waiting on "
              "another thread such as autograd's backward); largest:")
        for g in m["largest_gaps"]:
            print(f"    {g['ms']:8.2f} ms {g['count']:5d}x  after {g['after']} / before {g['before']}")
        if s["host_waits"]:
            print(f"  host waits of 0.5 ms or more ({len(s['host_waits'])}, "
                  f"{sum(w['ms'] for w in s['host_waits']):.1f} ms):")
            for w in s["host_waits"]:
                print(f"    at {w['at_ms']:8.1f} ms {w['ms']:8.2f} ms  {w['call']} in "
                      f"{' > '.join(w['in'][:4]) or '(no torch op)'}")
    for i, s in enumerate(sums):
        print(f"top kernels ({i + 1}):")
        for k in s["top_kernels"]:
            print(f"  {k['ms']:9.3f} ms {k['count']:6d}x  {k['name']}")
    if args.json:
        Path(args.json).write_text(json.dumps(sums, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
