"""Benchmark of the margin-exception path against today's hint path, per step, through a real local store.

Rollout side, per decode step of B tokens at S sites of width W (NVFP4; the quantization itself is common to
both paths and not counted):
  plain   : Writer.write of the hints [B, W/8] and scale bytes [B, W/16] of every site (the row copy into the
            writer's buffer; the commits of the run are timed apart, per step)
  margin  : tracefp4.margin_marks on x (device), compact.exceptions_from_marks + compact.pack_rows (host numpy,
            what the recorder does on the CPU), Writer.write(rows=) of the packed rows
  margin_pack_torch: the device packer beside the numpy one, on the same marks: compact_device.pack_sites_on_device
            (what the recorder does when the marks are on CUDA: the staged host rows of every site over from pinned
            memory, pack_marks_torch on the device over the sites that share a coding stacked, data + offsets back
            in one copy); its bytes are checked equal to numpy's
Trainer side, per micro-batch of T tokens:
  plain   : Reader.read of the hints and scales of every site (fmt numpy)
  margin  : Reader.read of the rows, compact.unpack_rows (host numpy, the feed's reading thread on the CPU) and
            compact.reconstruct of the trainer's activation x' = x (1 + rel * noise) (device)
  margin_unpack_torch: the device decoder beside the numpy one, on the same rows: compact_device.unpack_sites_torch
            (what the feed does on CUDA: the raw rows over, decoded on the device); checked equal to numpy's
  margin_unpack_triton + margin_fill: the Triton decoder (compact_triton.unpack_sites_dense: one kernel for the
            sites of one coding, their rows stacked, straight into the planes the fill-in reads; checked equal to
            numpy's laid out) and the trainer's per-forward fill-in on them (compact.fill, what MarginSites runs:
            one margin_fill per site, no sync); on CUDA, or on the CPU under TRITON_INTERPRET=1 (else not timed: null)
The torch figures are also timed on the CPU (the torch code runs there too). The JSON's "packers" says which
implementation each phase timed.
Each figure is the median over --runs runs of the mean over the steps of one run (min..max given); the stored
bytes per token of both stores are counted with tracestore.info.

Share of a step (the issue's targets: capture <= 1% of a decode step, trainer decode <= 1% of a trainer step): each
path's cost per token and site, scaled to a reference step of --ref-decode-batch tokens / --ref-trainer-tokens
tokens at --ref-sites sites, as a percentage of that step's measured time. The defaults are the repo's own H200
measurements of the 40-layer loop model (hidden 2048, 20 hinted MoE-input sites, the issue's default site plan):
a decode step of 32 requests at 1,559 generated tokens/s (20.5 ms; loop-cuda-1gpu-dec02.json) and a trainer step
of 4,256 tokens in 0.649 s (the fp4_hints step at the default mean, trainer-h200-global-scales.json). Costs
measured on another device than the reference steps (the CPU run) are printed with that caveat; the figures to
read are the H200 run's.

Usage: python3 benchmarks/benchmark_compact_path.py [--smoke] [--batch 64] [--sites 20] [--width 2048]
       [--steps 16] [--mb-tokens 2048] [--margin 0.03] [--scale-margin inf] [--payload lsb] [--noise 0.02]
       [--runs 3] [--device cuda] [--ref-decode-ms 20.52] [--ref-decode-batch 32] [--ref-trainer-s 1.414]
       [--ref-trainer-tokens 4256] [--ref-sites 20] [--out PATH]
Sizes left out default per device: CUDA B 64, S 20, 16 steps, T 2048; CPU B 16, S 4, 8 steps, T 128 (a shared
2-core VM).
Prints a table and writes JSON to --out (default: $OUT/compact-path-<device>.json when $OUT is set, else
benchmarks/results/compact-path-<device>.json; with --smoke only with --out). --smoke: tiny sizes on the CPU
(B 8, S 2, W 256, 4 steps, T 32, 2 runs) to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import tracefp4  # noqa: E402
import tracestore as ts  # noqa: E402
from tracerl.hints import compact as C  # noqa: E402
from tracerl.hints import compact_device as CD  # noqa: E402
from tracerl.hints.packing import concat_margin_rows  # noqa: E402


def _data(steps: int, b: int, s: int, w: int, noise: float, device: torch.device, seed: int = 0):
    """Per step and site: rollout activation x [B, W] (fp32, spread magnitudes), its g, quantization, and the
    trainer's x'."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        sites = []
        for _ in range(s):
            x = torch.randn(b, w, generator=gen) * torch.exp(2 * torch.randn(b, 1, generator=gen))
            xt = x * (1 + noise * torch.randn(b, w, generator=gen))
            x, xt = x.to(device), xt.to(device)
            g = tracefp4.compute_global_scale(x)
            q = tracefp4.quantize(x, "nvfp4", global_scale=g)
            sites.append((x, xt, g, q.hints, q.scales))
        out.append(sites)
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _summary(xs: list[float]) -> dict:
    return {"median_ms": 1e3 * statistics.median(xs), "min_ms": 1e3 * min(xs), "max_ms": 1e3 * max(xs)}


def run(args) -> dict:
    device = torch.device(args.device)
    names = [f"layers.{i}.moe_in" for i in range(args.sites)]
    data = _data(args.steps, args.batch, args.sites, args.width, args.noise, device)
    # one coding per site, the cheapest on the first step (as a store would fix it when it is created)
    x0, _, g0, h0, s0 = data[0][0]
    coding, _ = C.choose_coding(C.encode_margin_exceptions(x0, g0, s0, h0, args.margin, args.scale_margin,
                                                           scale_payload=args.payload))
    times: dict[str, list[float]] = {k: [] for k in ("plain_write", "plain_commit", "margin_marks", "margin_pack",
                                                     "margin_pack_torch", "margin_write", "margin_commit",
                                                     "plain_read", "margin_read", "margin_unpack",
                                                     "margin_unpack_torch", "margin_reconstruct",
                                                     "margin_unpack_triton", "margin_fill", "margin_concat")}
    triton_on = device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if triton_on:
        from tracerl.hints import compact_triton as CT
    info = {}
    for r in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            plain = ts.create_store(f"{tmp}/plain", [ts.Site(n, args.width) for n in names])
            margin = ts.create_store(f"{tmp}/margin", [C.store_site(n, args.width, coding, args.margin,
                                                                    args.scale_margin, args.payload) for n in names])
            ids = np.arange(args.batch)
            lps = np.zeros(args.batch, np.float32)
            # ---- rollout side: one trajectory per request, one row per step
            t_w = t_m = t_p = t_pt = t_mw = 0.0
            with plain.writer("p", commit_interval_s=0) as wp, margin.writer("m", commit_interval_s=0) as wm:
                for k, sites in enumerate(data):
                    t0 = time.perf_counter()
                    for b in range(args.batch):
                        wp.write(f"r{b}", k,
                                 hints={n: sites[i][3][b:b + 1].cpu().numpy() for i, n in enumerate(names)},
                                 scales={n: sites[i][4][b:b + 1].cpu().numpy() for i, n in enumerate(names)},
                                 token_ids=ids[b:b + 1], logprobs=lps[b:b + 1])
                    t_w += time.perf_counter() - t0
                    t0 = time.perf_counter()
                    marks = [tracefp4.margin_marks(x, g, sc, h, args.margin, args.scale_margin)
                             for x, _, g, h, sc in sites]
                    _sync(device)
                    t1 = time.perf_counter()
                    packed = []
                    for (vm, bm), (_, _, _, h, sc) in zip(marks, sites):
                        enc = C.exceptions_from_marks(vm.cpu(), bm.cpu(), h.cpu(), sc.cpu(), args.margin,
                                                      args.scale_margin, args.payload)
                        packed.append(C.store_rows(C.pack_rows(enc, coding)))
                    t2 = time.perf_counter()
                    for b in range(args.batch):
                        rows = {n: (d[o[b]:o[b + 1]], o[b:b + 2] - o[b]) for n, (d, o) in zip(names, packed)}
                        wm.write(f"r{b}", k, rows=rows, token_ids=ids[b:b + 1], logprobs=lps[b:b + 1])
                    t3 = time.perf_counter()
                    # the device packer on the same rows, from the host copies the recorder's arena holds
                    staged = [tuple(t.cpu().numpy() for t in (vm, bm, h, sc)) for (vm, bm), (_, _, _, h, sc)
                              in zip(marks, sites)]
                    t4 = time.perf_counter()
                    # every site of the step in one call, as the recorder packs a write's margin sites
                    got_t = CD.pack_sites_on_device(device, {n: (*st, coding, args.payload)
                                                             for n, st in zip(names, staged)})
                    packed_t = [got_t[n] for n in names]
                    t5 = time.perf_counter()
                    for (d, o), (dt, ot) in zip(packed, packed_t):
                        if not (np.array_equal(d, dt) and np.array_equal(o, ot)):
                            raise AssertionError("pack_sites_on_device's rows differ from pack_rows'")
                    t_m, t_p, t_mw, t_pt = t_m + (t1 - t0), t_p + (t2 - t1), t_mw + (t3 - t2), t_pt + (t5 - t4)
                t0 = time.perf_counter()
                wp.flush()
                t1 = time.perf_counter()
                wm.flush()
                t2 = time.perf_counter()
            n = len(data)
            for key, v in (("plain_write", t_w), ("margin_marks", t_m), ("margin_pack", t_p),
                           ("margin_pack_torch", t_pt), ("margin_write", t_mw),
                           ("plain_commit", t1 - t0), ("margin_commit", t2 - t1)):
                times[key].append(v / n)
            # ---- trainer side: micro-batches of --mb-tokens tokens, request after request
            tok = min(args.mb_tokens, n)
            per_mb = max(1, args.mb_tokens // tok)
            rp, rm = plain.reader(), margin.reader()
            t_pr = t_mr = t_u = t_ut = t_rc = t_tr = t_fi = t_cc = 0.0
            mbs = 0
            for start in range(0, args.batch, per_mb):
                reqs = range(start, min(args.batch, start + per_mb))
                t0 = time.perf_counter()
                for b in reqs:
                    rp.read(f"r{b}", 0, tok, trace=False)
                t1 = time.perf_counter()
                got = [rm.read(f"r{b}", 0, tok, trace=False) for b in reqs]
                t2 = time.perf_counter()
                # as the feed does: the micro-batch's rows of a site concatenated, decoded once
                rows = {n: C.packed_from_store(margin.sites[n], concat_margin_rows([bt.rows[n] for bt in got]))
                        for n in names}
                t_cat = time.perf_counter() - t2  # the rows' concatenation: counted in every decoder's figure
                t_cc += t_cat  # and reported alone (the feed does it in its reading thread or process)
                t20 = time.perf_counter()
                encs = {n: C.unpack_rows(p) for n, p in rows.items()}
                t3 = time.perf_counter()
                _sync(device)
                t30 = time.perf_counter()
                encs_t = CD.unpack_sites_torch(rows, device)  # the device decoder, as the feed runs it on CUDA
                _sync(device)
                t31 = time.perf_counter()
                if any(encs_t[n] != encs[n] for n in names):
                    raise AssertionError("unpack_sites_torch's exceptions differ from unpack_rows'")
                t_ut += t_cat + (t31 - t30)
                if triton_on:  # the Triton decoder into dense planes, then the forward's fill-in on them
                    t40 = time.perf_counter()
                    dense = CT.unpack_sites_dense(rows, device)
                    _sync(device)
                    t41 = time.perf_counter()
                    if any(dense[n] != C.densify(encs[n]).to(device) for n in names):
                        raise AssertionError("unpack_sites_dense's planes differ from unpack_rows' laid out")
                    xs = [torch.cat([torch.stack([data[k][i][1][b] for k in range(tok)]) for b in reqs])
                          for i in range(len(names))]
                    _sync(device)
                    t42 = time.perf_counter()
                    for i, n in enumerate(names):
                        C.fill(dense[n], xs[i], data[0][i][2])
                    _sync(device)
                    t43 = time.perf_counter()
                    t_tr += t_cat + (t41 - t40)
                    t_fi += t43 - t42
                t4_0 = time.perf_counter()
                for i, n in enumerate(names):
                    xt = torch.cat([torch.stack([data[k][i][1][b] for k in range(tok)]) for b in reqs])
                    e = encs[n]
                    e = C.MarginExceptions(e.value_mask.to(device), e.hint_bits.to(device), e.scale_mask.to(device),
                                           e.scale_bytes.to(device), e.margin, e.scale_margin, e.scale_payload)
                    C.reconstruct(e, xt, data[0][i][2])
                _sync(device)
                t4 = time.perf_counter()
                t_pr, t_mr, t_u, t_rc = t_pr + (t1 - t0), t_mr + (t2 - t1), t_u + t_cat + (t3 - t20), t_rc + (t4 - t4_0)
                mbs += 1
            for key, v in (("plain_read", t_pr), ("margin_read", t_mr), ("margin_unpack", t_u),
                           ("margin_unpack_torch", t_ut), ("margin_reconstruct", t_rc), ("margin_concat", t_cc),
                           *((("margin_unpack_triton", t_tr), ("margin_fill", t_fi)) if triton_on else ())):
                times[key].append(v / mbs)
            if r == 0:
                for name, st in (("plain", plain), ("margin", margin)):
                    d = ts.info(st)
                    info[name] = {"bytes_per_token": d["bytes_per_token"], "bytes": d["bytes"],
                                  "tokens": d["tokens"]}
    stats = {k: _summary(v) for k, v in times.items() if v}
    # the trainer's decode proper: unpack + reconstruct (the read is the store's), with either decoder; with the
    # Triton decoder, unpack + the fill-in the forward runs
    for key, unpack, rest in (("margin_decode", "margin_unpack", "margin_reconstruct"),
                              ("margin_decode_torch", "margin_unpack_torch", "margin_reconstruct"),
                              ("margin_decode_triton", "margin_unpack_triton", "margin_fill")):
        if times[unpack]:
            stats[key] = _summary([u + c for u, c in zip(times[unpack], times[rest])])
    rollout_plain = stats["plain_write"]["median_ms"] + stats["plain_commit"]["median_ms"]
    rollout_margin = sum(stats[k]["median_ms"] for k in ("margin_marks", "margin_pack", "margin_write",
                                                         "margin_commit"))
    trainer_plain = stats["plain_read"]["median_ms"]
    trainer_margin = sum(stats[k]["median_ms"] for k in ("margin_read", "margin_unpack", "margin_reconstruct"))
    rollout_margin_torch = sum(stats[k]["median_ms"] for k in ("margin_marks", "margin_pack_torch", "margin_write",
                                                               "margin_commit"))
    trainer_margin_torch = sum(stats[k]["median_ms"] for k in ("margin_read", "margin_unpack_torch",
                                                               "margin_reconstruct"))
    trainer_margin_triton = (sum(stats[k]["median_ms"] for k in ("margin_read", "margin_unpack_triton", "margin_fill"))
                             if triton_on else None)
    mb_tok = min(args.mb_tokens, len(data)) * max(1, args.mb_tokens // min(args.mb_tokens, len(data)))
    mb_tok = min(mb_tok, args.batch * min(args.mb_tokens, len(data)))

    def pct(ms: float, tokens: int, ref_tokens: int, ref_ms: float) -> float:
        """``ms`` for ``tokens`` tokens at args.sites sites, as a share (%) of a reference step of ``ref_tokens``
        tokens at args.ref_sites sites taking ``ref_ms``."""
        return 100.0 * ms / (tokens * args.sites) * (ref_tokens * args.ref_sites) / ref_ms

    dec = lambda ms: pct(ms, args.batch, args.ref_decode_batch, args.ref_decode_ms)  # noqa: E731
    trn = lambda ms: pct(ms, mb_tok, args.ref_trainer_tokens, 1e3 * args.ref_trainer_s)  # noqa: E731
    share = {
        "reference": {"decode_step_ms": args.ref_decode_ms, "decode_batch": args.ref_decode_batch,
                      "trainer_step_s": args.ref_trainer_s, "trainer_tokens": args.ref_trainer_tokens,
                      "sites": args.ref_sites, "measured_on": "NVIDIA H200 (the repo's loop model, 20 hinted sites)",
                      "costs_measured_on": str(device)},
        "decode_step_pct": {"plain": dec(rollout_plain), "margin": dec(rollout_margin),
                            "margin_torch": dec(rollout_margin_torch),
                            "margin_capture": dec(stats["margin_marks"]["median_ms"] + stats["margin_pack"]["median_ms"]),
                            "margin_capture_torch": dec(stats["margin_marks"]["median_ms"]
                                                        + stats["margin_pack_torch"]["median_ms"]),
                            **{k: dec(stats[k]["median_ms"]) for k in ("plain_write", "plain_commit", "margin_marks",
                                                                        "margin_pack", "margin_pack_torch",
                                                                        "margin_write", "margin_commit")}},
        "trainer_step_pct": {"plain": trn(trainer_plain), "margin": trn(trainer_margin),
                             "margin_torch": trn(trainer_margin_torch),
                             "margin_decode": trn(stats["margin_decode"]["median_ms"]),
                             "margin_decode_torch": trn(stats["margin_decode_torch"]["median_ms"]),
                             **{k: trn(stats[k]["median_ms"]) for k in ("plain_read", "margin_read", "margin_unpack",
                                                                         "margin_unpack_torch", "margin_reconstruct",
                                                                         "margin_unpack_triton", "margin_fill",
                                                                         "margin_decode_triton") if k in stats},
                             **({"margin_triton": trn(trainer_margin_triton)} if triton_on else {})},
    }
    return {
        "benchmark": "compact_path", "smoke": args.smoke, "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "config": {k: (str(v) if isinstance(v, float) and math.isinf(v) else v)
                                              for k, v in vars(args).items() if k != "out"},
        "coding": coding.to_json(), "mb_tokens_used": mb_tok,
        "per_decode_step": {"plain_ms": rollout_plain, "margin_ms": rollout_margin,
                            "margin_torch_ms": rollout_margin_torch},
        "per_micro_batch": {"plain_ms": trainer_plain, "margin_ms": trainer_margin,
                            "margin_torch_ms": trainer_margin_torch, "margin_triton_ms": trainer_margin_triton},
        "packers": {
            "margin_pack": "numpy: compact.exceptions_from_marks + compact.pack_rows on the host (marks copied over)",
            "margin_pack_torch": f"torch: compact_device.pack_sites_on_device on {device} (host rows of every "
                                 "site over, the sites of one coding in one pack, bytes back in one copy)",
            "margin_unpack": "numpy: compact.unpack_rows on the host",
            "margin_unpack_torch": f"torch: compact_device.unpack_sites_torch on {device} (raw rows over)",
            "margin_reconstruct": f"torch: compact.reconstruct on {device}",
            "margin_unpack_triton": (f"triton: compact_triton.unpack_sites_dense on {device} (raw rows over, one "
                                     "kernel per coding, one sync)" if triton_on else "not timed (no CUDA, no "
                                     "TRITON_INTERPRET=1)"),
            "margin_fill": f"compact.fill on the dense planes on {device} (the trainer's MarginSites)",
            "margin_concat": "host: the micro-batch's rows of each site concatenated (concat_margin_rows; included in "
                             "each margin_unpack* figure; the feed does it in its reading thread or process)",
            "margin_ms": "numpy packer / decoder", "margin_torch_ms": "torch packer / decoder",
        },
        "packed_equal": True,  # every torch pack and decode was checked equal to numpy's (else the run fails)
        "share_of_step": share,
        "phases": stats, "stores": info,
    }


def _table(res: dict) -> str:
    ph = res["phases"]
    lines = [f"compact path on {res['device']} ({res['device_name']}), coding {res['coding']}, "
             f"config {json.dumps(res['config'])}",
             f"{'phase':<34}{'median ms':>12}{'min..max ms':>22}"]
    for k, v in ph.items():
        lines.append(f"{k:<34}{v['median_ms']:>12.3f}{v['min_ms']:>11.3f}..{v['max_ms']:<9.3f}")
    for side, key in (("rollout, per decode step", "per_decode_step"), ("trainer, per micro-batch", "per_micro_batch")):
        p, m, mt = res[key]["plain_ms"], res[key]["margin_ms"], res[key]["margin_torch_ms"]
        tr = res[key].get("margin_triton_ms")
        lines.append(f"{side:<34} plain {p:9.3f} ms   margin {m:9.3f} ms (numpy, {m / p if p else float('nan'):.2f}x)"
                     f"   {mt:9.3f} ms (torch, {mt / p if p else float('nan'):.2f}x)"
                     + (f"   {tr:9.3f} ms (triton, {tr / p if p else float('nan'):.2f}x)" if tr is not None else ""))
    sh = res["share_of_step"]
    ref = sh["reference"]
    note = "" if ref["costs_measured_on"].startswith("cuda") else (
        f" [costs measured on {ref['costs_measured_on']}, reference steps on the H200: indicative only]")
    lines.append(f"share of a reference decode step ({ref['decode_step_ms']:.2f} ms, B {ref['decode_batch']}, "
                 f"{ref['sites']} sites) / trainer step ({ref['trainer_step_s']:.3f} s, {ref['trainer_tokens']} tokens)"
                 + note)
    for side, key in (("decode step", "decode_step_pct"), ("trainer step", "trainer_step_pct")):
        lines.append(f"  {side:<14}" + "  ".join(f"{k} {v:.3f}%" for k, v in sh[key].items()))
    for name, d in res["stores"].items():
        lines.append(f"store {name:<8} {d['bytes_per_token']:.1f} stored B/token over {d['tokens']} tokens "
                     f"(payload {d['bytes']['payload']}, margin {d['bytes']['margin']} B)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true",
                   help='tiny sizes, 1 run: checks the code paths (CPU, seconds)')
    p.add_argument("--batch", type=int, default=None,
                   help='requests per decode step (default: per device, see the docstring)')
    p.add_argument("--sites", type=int, default=None,
                   help='hinted sites (default: per device)')
    p.add_argument("--width", type=int, default=2048,
                   help='values per site (default 2048)')
    p.add_argument("--steps", type=int, default=None,
                   help='decode steps recorded per run (default: per device)')
    p.add_argument("--mb-tokens", type=int, default=None,
                   help='tokens per trainer micro-batch (default: per device)')
    p.add_argument("--margin", type=float, default=0.03,
                   help='value margin in ladder steps (default 0.03)')
    p.add_argument("--scale-margin", type=float, default=math.inf,
                   help='block margin in E4M3 steps (default inf: every block marked)')
    p.add_argument("--payload", choices=C.SCALE_PAYLOADS, default="lsb",
                   help='per marked block: its scale byte or its LSB (default lsb)')
    p.add_argument("--noise", type=float, default=0.02,
                   help="relative noise between the rollout's and the trainer's activation (default 0.02)")
    p.add_argument("--runs", type=int, default=3,
                   help='repetitions; medians and min..max are reported (default 3)')
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help='cuda or cpu (default: cuda when available)')
    p.add_argument("--ref-decode-ms", type=float, default=1e3 * 32 / 1559.371743621784,
                   help="reference decode step in ms for the share-of-step estimate (default: the one-GPU loop's, B=32)")
    p.add_argument("--ref-decode-batch", type=int, default=32,
                   help='requests of that reference decode step (default 32)')
    p.add_argument("--ref-trainer-s", type=float, default=0.649,
                   help="reference trainer step in s (default: the fp4_hints step at the trainer's default mean, "
                        "trainer-h200-global-scales.json; 1.414 in decode-cost-h200.json before the speed round)")
    p.add_argument("--ref-trainer-tokens", type=int, default=4256,
                   help='tokens of that reference trainer step (default 4256)')
    p.add_argument("--ref-sites", type=int, default=20,
                   help='hinted sites of the reference steps (default 20)')
    p.add_argument("--out", default=None,
                   help='JSON path (default: benchmarks/results/compact-path-<device>.json; $OUT on the GPU)')
    args = p.parse_args(argv)
    sizes = (64, 20, 16, 2048) if torch.device(args.device).type == "cuda" else (16, 4, 8, 128)
    for name, v in zip(("batch", "sites", "steps", "mb_tokens"), sizes):
        if getattr(args, name) is None:
            setattr(args, name, v)
    if args.smoke:
        args.batch, args.sites, args.width, args.steps, args.mb_tokens, args.runs = 8, 2, 256, 4, 32, 2
        args.device = "cpu"
    res = run(args)
    print(_table(res))
    out = args.out
    if out is None and not args.smoke:
        dev = "cpu" if res["device"] == "cpu" else res["device_name"].split()[-1].lower()
        out = (f"{os.environ['OUT']}/compact-path-{dev}.json" if os.environ.get("OUT") else
               str(Path(__file__).parent / "results" / f"compact-path-{dev}.json"))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(res, indent=1))
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
