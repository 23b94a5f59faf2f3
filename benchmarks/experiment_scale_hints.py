"""Experiment (issue 23, stage 2, step 1): the store's scale encoding ``lsb`` (scale hints, FORMAT §2.4) end to end
on the CPU demo store, side by side with today's ``bytes``.

Steps (one process, CPU, the tiny random-init demo model; nothing is downloaded):

1. Record the demo store twice with the demo's defaults (`tracerl.demo.record_store`: 16 x 256 tokens, the MoE
   input of layers 4-7 hinted, 4 sites of width 256): once with scale bytes (192 B/token), once with scale hints
   (the recorder packs the LSBs on the capture path: 4 x (32 + 2) = 136 B/token). Check: the two rollouts are the
   same (token ids, hints), and every stored scale-hint row is the LSB packing of the bytes store's row.
2. `tracerl audit` (`run_audit`, attribution and planner off) on both stores: per mode code agreement, scale
   agreement (against the replayed rollout's bytes) and excess over the bf16 floor; the store's bytes per token.
3. The trainer's codes on the two stores, micro-batch by micro-batch with the same weights (`QATTrainer.recompute`
   in ``fp4_hints`` with ``observe``): the share of hinted values whose code under scale hints equals the code
   under scale bytes (stage 1 measured 99.9958% code agreement for scale hints against 99.9961% for bytes), and the
   same with identical activations (the rollout's own x, captured by the replay): equal bit for bit.
4. Timing, medians of 5 runs: `reconstruct_scales` at [4096, 2048] next to the hint-guided ``fake_quantize`` it
   precedes (CPU; the GPU cost is the runbook's to measure).

Checks (``checks`` in the JSON; exit 1 if one fails). Writes benchmarks/results/scale-hints-cpu-demo.json and
prints a table; ``--smoke``: 4 trajectories x 64 tokens into a temporary directory unless ``--out``.

    python benchmarks/experiment_scale_hints.py            # ~2-4 min on the 2-core VM
    python benchmarks/experiment_scale_hints.py --smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tracefp4
import tracestore as ts
from tracerl.audit.run import run_audit
from tracerl.audit.setup import load_setup
from tracerl.config import AuditConfig, DemoConfig
from tracerl.demo import record_store
from tracerl.hints import pack_micro_batches, read_packed
from tracerl.hints.scalehints import pack_scale_lsb, reconstruct_scales, use_store_scale_encodings
from tracerl.runlog import json_ready, machine_info

MODES = ("fp4_rne_own_scales", "fp4_rne_rollout_scales", "fp4_hints", "fp4_hints_replay_routes")
STAGE1 = {"code_agreement_lsb": 0.999957529703776, "code_agreement_bytes": 0.9999613444010417,
          "source": "benchmarks/results/subbit-cpu-demo.json, passes m=inf,ms=inf,{byte,lsb} without routing replay"}


def _check_stores(a: ts.Store, b: ts.Store) -> dict:
    """The bytes store ``a`` and the scale-hint store ``b`` hold the same rollout; b's rows are a's LSBs packed."""
    ra, rb = a.reader(), b.reader()
    same_rollout = scale_rows_are_lsbs = True
    rows = 0
    for t in ra.traj_ids():
        x, y = ra.read(t), rb.read(t)
        same_rollout &= bool(np.array_equal(x.token_ids, y.token_ids)
                             and all(np.array_equal(x.hints[s], y.hints[s]) for s in a.sites))
        scale_rows_are_lsbs &= all(np.array_equal(pack_scale_lsb(torch.from_numpy(x.scales[s])).numpy(), y.scales[s])
                                   for s in a.sites)
        rows += len(x.token_ids)
    return {"same_rollout": same_rollout, "scale_rows_are_lsbs": scale_rows_are_lsbs, "rows": rows}


def _audit(url: str) -> dict:
    t0 = time.perf_counter()
    res = run_audit(AuditConfig(store=url, device="cpu", attribution=False, planner=False))
    modes = {m: {k: res["modes"][m].get(k) for k in ("code_agreement", "scale_agreement", "mean_abs_dlogp",
                                                     "excess_over_floor")} for m in MODES if m in res["modes"]}
    return {"bytes_per_token": res["store"]["hint_bytes_per_token"], "site_bytes": res["store"]["site_bytes"],
            "replay_reproduced": res["replay"]["reproduced"], "modes": modes, "seconds": time.perf_counter() - t0}


def _trainer_codes(bytes_url: str, lsb_url: str) -> dict:
    """fp4_hints codes of the trainer on both stores (same model, same weights, micro-batch by micro-batch)."""
    stores = {"bytes": ts.open_store(bytes_url), "lsb": ts.open_store(lsb_url)}
    s = load_setup(stores["bytes"], AuditConfig(store=bytes_url, device="cpu"))
    sites = list(s.plan.hinted)
    readers = {k: st.reader() for k, st in stores.items()}
    mbs = pack_micro_batches({i.traj_id: i.num_tokens for i in readers["bytes"].trajectories()}, 8192)
    equal = total = 0
    for mb in mbs:
        codes = {}
        for k in ("bytes", "lsb"):
            use_store_scale_encodings(s.train, stores[k])
            packed = read_packed(readers[k], mb, sites, read_kwargs={"fmt": "numpy"})
            r = s.trainer.recompute(packed, "fp4_hints", observe=True)
            resp = ~np.isnan(packed.logprobs)
            codes[k] = np.concatenate([r.codes[site][resp] for site in sites], axis=1)
        eq = (codes["bytes"] & 7) == (codes["lsb"] & 7)  # +0 == -0
        eq &= (codes["bytes"] == codes["lsb"]) | ((codes["bytes"] & 7) == 0)
        equal += int(eq.sum())
        total += eq.size
    use_store_scale_encodings(s.train, stores["bytes"])
    return {"values": total, "equal": equal, "share_equal": equal / total if total else None}


def _identical_activations(seed: int = 0) -> dict:
    """Identical activations -> identical codes, bit for bit: the rollout's own x at T=4096, W=2048 (random,
    heavy-tailed), quantized; scale hints reconstructed from that x give the rollout's bytes and today's codes."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(4096, 2048, generator=gen) * torch.randn(4096, 1, generator=gen).exp()).to(torch.bfloat16)
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g)
    rec = reconstruct_scales(x, g, pack_scale_lsb(q.scales))
    y_bytes = tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints)
    y_lsb = tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=rec, hints=q.hints)
    return {"scales_equal": bool(torch.equal(rec, q.scales)), "outputs_bitwise_equal":
            bool(torch.equal(y_bytes.view(torch.int16), y_lsb.view(torch.int16)))}


def _timing(runs: int = 5) -> dict:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, 2048, generator=gen).to(torch.bfloat16)
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g)
    lsb = pack_scale_lsb(q.scales)

    def med(fn) -> float:
        fn()
        out = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return statistics.median(out)

    rec = med(lambda: reconstruct_scales(x, g, lsb))
    fq = med(lambda: tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints,
                                            backend="reference"))
    return {"shape": [4096, 2048], "runs": runs, "reconstruct_scales_s": rec, "fake_quantize_hints_reference_s": fq,
            "ratio": rec / fq, "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="4 trajectories x 64 tokens (a quick check)")
    ap.add_argument("--out", metavar="DIR", help="where the JSON goes (default benchmarks/results; --smoke: a temp dir)")
    args = ap.parse_args(argv)
    out = Path(args.out) if args.out else (Path(tempfile.mkdtemp()) if args.smoke else
                                            Path(__file__).resolve().parent / "results")
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        urls = {k: f"{tmp}/{k}" for k in ("bytes", "lsb")}
        base = DemoConfig(trajectories=4, tokens=64) if args.smoke else DemoConfig()
        rec = {}
        for k, url in urls.items():
            rec[k] = record_store(DemoConfig(**{**base.__dict__, "store": url}), scale_encoding=k)
            print(f"recorded {k}: {rec[k]['response_tokens']} response tokens in {rec[k]['seconds']:.1f} s",
                  flush=True)
        stores = {k: ts.open_store(u) for k, u in urls.items()}
        same = _check_stores(stores["bytes"], stores["lsb"])
        audits = {k: _audit(u) for k, u in urls.items()}
        for k, a in audits.items():
            print(f"audited {k} in {a['seconds']:.1f} s", flush=True)
        codes = _trainer_codes(urls["bytes"], urls["lsb"])
        info = {k: ts.info(st) for k, st in stores.items()}
    ident = _identical_activations()
    timing = _timing()
    checks = {
        "same rollout recorded both ways": same["same_rollout"],
        "lsb rows are the bytes store's LSBs": same["scale_rows_are_lsbs"],
        "replay reproduces both stores": all(a["replay_reproduced"] for a in audits.values()),
        "identical activations -> identical scales and outputs": ident["scales_equal"] and ident["outputs_bitwise_equal"],
        "lsb code agreement >= stage 1's": (audits["lsb"]["modes"]["fp4_hints"]["code_agreement"]
                                            >= STAGE1["code_agreement_lsb"]) if not args.smoke else True,
    }
    print(f"\n{'':28}{'bytes':>14}{'lsb':>14}")
    print(f"{'payload B/token (audit)':28}{audits['bytes']['bytes_per_token']:>14}{audits['lsb']['bytes_per_token']:>14}")
    print(f"{'payload B/token (stored)':28}"
          + "".join(f"{(i['bytes']['payload'] / i['tokens']):>14.2f}" for i in info.values()))
    for m in MODES:
        for key in ("code_agreement", "scale_agreement", "excess_over_floor"):
            vals = [audits[k]["modes"][m][key] for k in ("bytes", "lsb")]
            print(f"{m[:18] + ' ' + key[:9]:28}" + "".join(f"{v:>14.6g}" if v is not None else f"{'-':>14}"
                                                          for v in vals))
    print(f"trainer codes lsb == bytes: {codes['share_equal']:.6%} of {codes['values']:,} hinted values")
    print(f"reconstruct_scales {timing['reconstruct_scales_s'] * 1e3:.1f} ms vs hint-guided fake_quantize "
          f"{timing['fake_quantize_hints_reference_s'] * 1e3:.1f} ms (reference backend, CPU, median of {timing['runs']})")
    for name, ok in checks.items():
        print(f"check {'ok  ' if ok else 'FAIL'} {name}")
    result = {"experiment": "scale hints as a store encoding (issue 23, stage 2, step 1)", "smoke": args.smoke,
              "config": base.__dict__, "recorded": rec, "stores_compared": same, "audits": audits,
              "stored_payload_bytes_per_token": {k: i["bytes"]["payload"] / i["tokens"] for k, i in info.items()},
              "trainer_codes_lsb_vs_bytes": codes, "stage1": STAGE1, "identical_activations": ident,
              "timing": timing, "checks": checks, "machine": machine_info(),
              "seconds": time.perf_counter() - t_start}
    path = out / ("scale-hints-cpu-demo-smoke.json" if args.smoke else "scale-hints-cpu-demo.json")
    path.write_text(json.dumps(json_ready(result), indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
