"""Experiment (issue 23, stage 1): hints below one bit per value on the CPU demo store. How many bytes per token
does margin-exception coding (`tracerl.hints.compact`) need for which code agreement and excess, next to today's
1 bit per value + 1/16 byte, and how far is it from the entropy floor?

Steps (one process, CPU, the tiny random-init demo model; nothing is downloaded):

1. Record a demo store (`tracerl.demo.record_store`, the demo's defaults: 16 x 256 tokens, MoE input of layers
   4-7 hinted, 4 sites of width 256, i.e. 4 x 48 = 192 B/token today).
2. Rebuild it as `tracerl audit` does (`tracerl.audit.setup`) and replay the rollout's decode (`replay_batch`),
   with an `FP4Runtime.substitute` hook that keeps the rollout's pre-quantization activation x_r at the hinted
   sites (checked: quantizing them gives the replayed codes bit for bit, and those the stored hints and scales).
3. The audit's own passes (`mode_passes`: bf16 against the floor decode, RNE, RNE with rollout scales, hints,
   with and without routing replay) for reference figures, then the trainer's recompute with the margin-exception
   rule at every hinted site (a substitute hook: encode from x_r and the stored hints/scales, reconstruct from the
   trainer's own activation, today's hint-guided fake quantization on the result) for a few margins, with and
   without routing replay: mean |dlogp|, excess over the floor, code/scale agreement, bytes per token.
4. Offline grid (the trainer's activations x_t at the hinted sites, taken in the margin = inf pass, i.e. with
   today's hints upstream): for margins m x m_s x scale payload (byte | lsb), bytes per token (positions coded
   per site with the cheapest of all/bitmap/block-bitmap/gamma/rice<k>, rows byte-aligned, plus a uint32 row
   offset per 64 rows per site) and code agreement, per site and overall. The excess passes of step 3 use the
   grid's best points under 1/8, 1/5, 1/3 and 1/2 of today's bytes.
5. Entropy floor per site: the empirical conditional entropy of the rollout's code given the trainer's value
   (rollout scales) binned by ladder interval and signed distance to the boundary, and of the scale byte given the
   trainer's own scale position binned the same way; plug-in and Miller-Madow estimates (`entropy`).
6. Exploratory, not margin exceptions and not in the library: block syndromes (r parity bits of each block's 16
   hint bits + a scale hint per block; the trainer flips the cheapest set of its 8 least reliable values that
   matches), offline and as real passes, to see how much of the gap to the floor side information closes.

Checks (the JSON's ``checks``; exit 1 if one fails): the captured activations quantize to the replayed codes, the
replay equals the store, the rule at m = 0 / m_s = inf / m = inf gives the audit's RNE / RNE with rollout scales /
hints passes token for token, the offline evaluator equals the real margin-inf pass, and pack/unpack round-trips.

Prints tables; writes JSON (benchmarks/results/subbit-cpu-demo.json) and a plot (subbit-cpu-demo.png);
``--hint-layers all`` hints every MoE input (8 sites; -all-layers.json/png): the same rollout, so its passes
answer "more sites for the same bytes" against the default's. ``--smoke``: 4 trajectories x 64 tokens, a small
grid, output to a temporary directory unless ``--out``.

    python benchmarks/experiment_subbit.py            # ~2-3 min on the 2-core VM when idle
    python benchmarks/experiment_subbit.py --hint-layers all   # every MoE input hinted (8 sites)
    python benchmarks/experiment_subbit.py --smoke    # ~1 min
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import tracefp4
import tracestore as ts
from benchmark_audit import GPU_SPEC, SMOKE_SPEC  # noqa: E402  (this directory is on sys.path: run as a script)
from tracefp4 import reference as ref
from tracerl.audit import metrics as am
from tracerl.audit.passes import AuditMicroBatch, PassState, mode_passes, run_pass
from tracerl.audit.replay import replay_batch
from tracerl.audit.setup import load_setup, read_trajectories, replay_chunks, use_weights
from tracerl.config import AuditConfig, DemoConfig
from tracerl.demo import record_store
from tracerl.hints import compact as C
from tracerl.hints import pack_micro_batches, read_packed
from tracerl.runlog import json_ready, machine_info

INF = math.inf
RESULTS = Path(__file__).resolve().parent / "results"
#: the H200 model (hidden 2048, 40 layers, 32 experts, top 4) and the tiny one of benchmark_audit
H200_SPEC, TINY_SPEC = GPU_SPEC, SMOKE_SPEC
#: per --config: the recording (DemoConfig keywords), device, (trajectories, tokens) for (full, --smoke), the
#: grid's row sample (None: every row) and the result's name (None: a temporary directory)
CONFIGS = {
    "demo": dict(demo={}, device="cpu", trajectories=(16, 4), tokens=(256, 64), grid_rows=None,
                 name="subbit-cpu-demo", label="the CPU demo store"),
    # decode="static": the replay keeps the rollout's activations through a Python hook, which a CUDA graph's
    # replay would not call; recording the same path makes the replay the rollout bit for bit
    "h200": dict(demo=dict(prompt_tokens=(64, 64), device="cuda", decode="static", micro_batch_tokens=8192,
                           flush_tokens=1024, spec=H200_SPEC), device="cuda", trajectories=(8, 2),
                 tokens=(1024, 256), grid_rows=1024, name="subbit-h200", label="the H200 model (GPU)"),
    "tiny": dict(demo=dict(spec=TINY_SPEC), device="cpu", trajectories=(2, 2), tokens=(48, 48), grid_rows=24,
                 name=None, label="a tiny model (CPU)"),
}
INDEX_BYTES_PER_ROW = 4 / 64  # a uint32 byte offset per 64 rows per site (the rows are variable-length)
BUDGET_FRACTIONS = (1 / 8, 1 / 5, 1 / 3, 1 / 2)
T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# ---- 2. the rollout's activations during the replay -----------------------------------------------------------
class RolloutCapture:
    """`FP4Runtime.substitute` hook for the replay decode of one batch: keeps each hinted site's activation by
    (batch row, position) and returns None (the replay quantizes as always). The first call per site is the
    prefill (left-padded [B * P_max] rows), call j >= 1 is decode step j - 1 (row b at position P_b + j - 1)."""

    def __init__(self, chunk, widths: dict[str, int]):
        self.plens = [t.prompt_len for t in chunk]
        self.pmax = max(self.plens)
        self.length = self.pmax + max(len(t.response) for t in chunk)
        self.widths = widths
        self.x: dict[str, torch.Tensor] = {}  # fp32 [B, L, W] per site, on the activations' device
        self.calls = dict.fromkeys(widths, 0)

    def __call__(self, site: str, x: torch.Tensor):
        if site not in self.widths:
            return None
        j = self.calls[site]
        self.calls[site] += 1
        if site not in self.x:
            self.x[site] = torch.zeros(len(self.plens), self.length, self.widths[site], device=x.device)
        buf = self.x[site]
        xf = x.detach().float()
        if j == 0:
            for b, n in enumerate(self.plens):
                buf[b, :n] = xf[b * self.pmax + self.pmax - n: (b + 1) * self.pmax]
        else:  # one indexed copy per step (row b at position P_b + j - 1)
            if not hasattr(self, "_rows"):
                self._rows = torch.arange(len(self.plens), device=x.device)
                self._cols = torch.as_tensor(self.plens, device=x.device) - 1
            buf[self._rows, self._cols + j] = xf
        return None


# ---- 3. the trainer's passes with the margin-exception rule ---------------------------------------------------
@dataclasses.dataclass
class SiteRollout:
    """The rollout at one hinted site over a micro-batch's THD rows."""

    x: torch.Tensor  # fp32 [T, W]
    scales: torch.Tensor  # uint8 [T, W/16] (stored)
    hints: torch.Tensor  # uint8 [T, W/8] (stored)
    codes: torch.Tensor  # uint8 [T, W] (replayed, unpacked)


@dataclasses.dataclass(frozen=True)
class Point:
    margin: float
    scale_margin: float
    payload: str = "byte"

    @property
    def name(self) -> str:
        def f(v):
            return "inf" if math.isinf(v) else f"{v:g}"
        return f"m={f(self.margin)},ms={f(self.scale_margin)},{self.payload}"

    def to_json(self):
        return {"margin": self.margin, "scale_margin": self.scale_margin, "scale_payload": self.payload}


def _recompute_with(s, amb, hook, replay_routes: bool) -> tuple[np.ndarray, float]:
    """(trainer - rollout log-probs of ``amb``'s response tokens (float64), seconds) of one round-to-nearest
    recompute with ``hook`` substituting each hinted site's output."""
    t0 = time.perf_counter()
    with s.train.using(substitute=hook):
        out = s.trainer.recompute(amb.packed, "fp4_rne_own_scales", observe=False, replay_routes=replay_routes)
    sel = amb.response
    return out.logprobs[sel].astype(np.float64) - np.asarray(amb.packed.logprobs)[sel], time.perf_counter() - t0


def compact_pass(s, mbs, point: Point, replay_routes: bool, collect: dict | None = None,
                 count_bytes: bool = True) -> dict:
    """One trainer recompute of every micro-batch with margin exceptions at every hinted site; ``collect`` gets
    the trainer's activations of the response rows per site. ``count_bytes=False``: no position coding here (the
    bytes depend on the rollout only; `main` takes them from the grid's row sample at the same point)."""
    hinted = list(s.plan.hinted)
    counts = {site: {} for site in hinted}
    nbytes = {site: 0.0 for site in hinted}
    codings = {}
    dl, secs = [], 0.0
    for amb, roll in mbs:
        resp = amb.resp_dev

        def hook(site, x, amb=amb, roll=roll, resp=resp):
            if site not in roll:
                return None
            g = s.train.global_scale_on(site, x.device)
            r = roll[site]
            x_thd = x.index_select(0, amb.rows)
            enc = C.encode_margin_exceptions(r.x, g, r.scales, r.hints, point.margin, point.scale_margin,
                                             scale_payload=point.payload)
            rec = C.reconstruct(enc, x_thd, g)
            y = tracefp4.fake_quantize(x, "nvfp4", global_scale=g)  # rows outside the batch's tokens: own RTN
            y_thd = tracefp4.fake_quantize(x_thd, "nvfp4", global_scale=g, scales=rec.scales_e4m3,
                                           hints=rec.hints_packed)
            y = y.index_copy(0, amb.rows, y_thd)
            # response rows only, as the audit counts
            sub = _rows(enc, resp)
            rec_r = C.Reconstruction(rec.scales_e4m3[resp], rec.hints_packed[resp], rec.codes_u8[resp])
            st = C.margin_stats(sub, rec_r, r.codes[resp], r.x[resp], x_thd[resp].float(), g, r.scales[resp])
            for k, v in st.items():
                counts[site][k] = counts[site].get(k, 0) + v
            if count_bytes:
                coding, _ = C.choose_coding(sub)
                codings[site] = coding.to_json()
                nbytes[site] += float(C.packed_row_bytes(sub, coding).sum())
            if collect is not None:
                collect.setdefault(site, []).append(x_thd[resp].detach().float().clone())
            return y

        dlogp, took = _recompute_with(s, amb, hook, replay_routes)
        dl.append(dlogp)
        secs += took
    d = np.concatenate(dl)
    rows = sum(int(a.response.sum()) for a, _ in mbs)
    per_site = {site: {**_agreement(c), "bytes_per_token": nbytes[site] / rows + INDEX_BYTES_PER_ROW,
                       "coding": codings.get(site)} for site, c in counts.items()}
    total = {k: sum(c[k] for c in counts.values()) for k in next(iter(counts.values()))}
    return {"point": point.to_json(), "name": point.name, "replay_routes": replay_routes,
            "mean_abs_dlogp": float(np.mean(np.abs(d))), "tokens": int(d.size), "seconds": secs, "_dlogp": d,
            "bytes_per_token": sum(p["bytes_per_token"] for p in per_site.values()), **_agreement(total),
            "per_site": per_site}


def syndrome_pass(s, mbs, r: int, replay_routes: bool, search: int = 8) -> dict:
    """One trainer recompute with block syndromes (r bits per block) and scale hints at every hinted site."""
    mism = vmism = smism = n = 0
    dl, secs = [], 0.0
    width = {}
    for amb, roll in mbs:
        resp = amb.resp_dev

        def hook(site, x, amb=amb, roll=roll, resp=resp):
            nonlocal mism, vmism, smism, n
            if site not in roll:
                return None
            g = s.train.global_scale_on(site, x.device)
            ro = roll[site]
            x_thd = x.index_select(0, amb.rows).float()
            enc = C.encode_margin_exceptions(ro.x, g, ro.scales, ro.hints, 0.0, INF, scale_payload="lsb")
            scales = C.reconstruct(enc, x_thd, g).scales_e4m3  # scale hints at every block
            s_r = syndromes(tracefp4.unpack_hints(ro.hints).to(torch.uint8), r)
            codes, bits = syndrome_codes(x_thd, g, scales, s_r, r, search)
            y = tracefp4.fake_quantize(x, "nvfp4", global_scale=g)
            y_thd = tracefp4.fake_quantize(x.index_select(0, amb.rows), "nvfp4", global_scale=g, scales=scales,
                                           hints=tracefp4.pack_hints(bits))
            y = y.index_copy(0, amb.rows, y_thd)
            c_t, c_r = codes[resp], ro.codes[resp]
            m_ = (c_t != c_r) & ~(((c_t & 7) == 0) & ((c_r & 7) == 0))
            wrong = (scales[resp] != ro.scales[resp])
            mism += int(m_.sum())
            vmism += int((m_ | (wrong.repeat_interleave(16, dim=1) & (((c_t & 7) != 0) | ((c_r & 7) != 0)))).sum())
            smism += int(wrong.sum())
            n += c_t.numel()
            width[site] = c_t.shape[1]
            return y

        dlogp, took = _recompute_with(s, amb, hook, replay_routes)
        dl.append(dlogp)
        secs += took
    d = np.concatenate(dl)
    return {"name": f"syndrome r={r}", "syndrome_bits": r, "search": search, "replay_routes": replay_routes,
            "mean_abs_dlogp": float(np.mean(np.abs(d))), "tokens": int(d.size), "seconds": secs,
            "bytes_per_token": float(sum(syndrome_bytes_per_token(w, r) for w in width.values())),
            "code_agreement": 1 - mism / n, "value_agreement": 1 - vmism / n,
            "scale_agreement": 1 - smism / (n // 16), "code_mismatches": mism, "value_mismatches": vmism}


def _bytes_from_grid(pr: dict, grid: dict) -> None:
    """Fill a pass's bytes per token (overall and per site) from the offline grid's point with its margins: the
    bytes depend on the rollout only (the same for both trainers), the grid counts them on its row sample."""
    key = (pr["point"]["margin"], pr["point"]["scale_margin"], pr["point"]["scale_payload"])

    def at(points):
        return next(q for q in points if (q["margin"], q["scale_margin"], q["scale_payload"]) == key)

    pr["bytes_per_token"] = at(grid["overall"])["bytes_per_token"]
    for site, row in pr["per_site"].items():
        q = at(grid["per_site"][site])
        row["bytes_per_token"], row["coding"] = q["bytes_per_token"], q["coding"]
    pr["bytes_source"] = "offline grid's row sample"


def _rows(enc: C.MarginExceptions, idx: torch.Tensor) -> C.MarginExceptions:
    """``enc`` restricted to the rows ``idx`` (its stored bits and bytes with them)."""
    bits = torch.zeros(enc.value_mask.shape, dtype=torch.uint8, device=enc.value_mask.device)
    bits[enc.value_mask] = enc.hint_bits
    sb = torch.zeros(enc.scale_mask.shape, dtype=torch.uint8, device=enc.scale_mask.device)
    sb[enc.scale_mask] = enc.scale_bytes
    vm, sm = enc.value_mask[idx], enc.scale_mask[idx]
    return dataclasses.replace(enc, value_mask=vm, hint_bits=bits[idx][vm], scale_mask=sm, scale_bytes=sb[idx][sm])


def _agreement(c: dict) -> dict:
    n, nb = c["values"], c["blocks"]
    um = n - c["marked_values"]
    return {"code_agreement": 1 - c["code_mismatch"] / n, "value_agreement": 1 - c["value_mismatch"] / n,
            "scale_agreement": 1 - c["scale_mismatch"] / nb, "value_mismatches": c["value_mismatch"],
            "marked_value_share": c["marked_values"] / n, "marked_block_share": c["marked_blocks"] / nb,
            "unmarked_mismatch_share": c["unmarked_mismatch"] / um if um else 0.0,
            "within_margin_mismatch": c["within_margin_mismatch"], "moved_mismatch": c["moved_mismatch"],
            "wrong_scale_values": c["wrong_scale_values"], "code_mismatches": c["code_mismatch"], "values": n}


# ---- 4. offline grid ------------------------------------------------------------------------------------------
def _r(scales, g):
    r = ref.div_rn(ref.div_rn(torch.ones_like(g), g), ref.e4m3_decode(scales))
    return r.repeat_interleave(16, dim=1)


def _block_t(x, g):
    a = x.abs().reshape(x.shape[0], -1, 16)
    a = torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(-1)
    return ref.div_rn(ref.div_rn(a, 6.0), g).clamp(2.0**-9, 448.0)


def _signed(c):
    mag = (c & 7).to(torch.int16)
    return torch.where((c & 8) != 0, -mag, mag)


class SiteData:
    """Response rows of one hinted site over the whole store: rollout and trainer activations, the stored hints and
    scales, the replayed codes; the quantities every grid point shares.

    ``sample``: row indices (int64, sorted) where position bits and the entropy floor are counted (numpy, the slow
    part; bytes per token are a mean over rows and depend on the rollout only), or None for every row; agreement
    is always counted over every row. ``bits_cache``: a dict shared by the SiteData of one site's rollout (the
    value masks, hence the bits, do not depend on the trainer's activations)."""

    def __init__(self, x_r, x_t, g, scales, hints, codes, rice_max, sample=None, bits_cache=None):
        self.g, self.scales, self.codes, self.rice_max = g, scales, codes, rice_max
        self.rows, self.width = x_r.shape
        self.sample = sample
        self.bits_rows = self.rows if sample is None else int(sample.numel())
        v_r = x_r * _r(scales, g)
        self.u_r = C.ladder_position(v_r)
        self.bits = tracefp4.unpack_hints(hints).to(torch.uint8)
        self.d_r = C.boundary_distance(self.u_r)
        self.disagree = (ref.e2m1_rne_magnitude(v_r) & 1).to(torch.uint8) != self.bits  # always marked
        t_r = _block_t(x_r, g)
        self.ds_r = C.scale_boundary_distance(C.scale_position(t_r))
        self.sdisagree = ref.e4m3_encode(t_r) != scales
        self.x_t = x_t
        t_t = _block_t(x_t, g)
        self.own_scales = ref.e4m3_encode(t_t)
        low = torch.floor(C.scale_position(t_t)).clamp(max=125).to(torch.int32)
        self.lsb_scales = torch.where((low & 1) == (scales & 1).to(torch.int32), low, low + 1).to(torch.uint8)
        self.sign = ref.input_signbit(x_t).to(torch.uint8) << 3
        self.w_t, self.w_r = C.scale_position(t_t), C.scale_position(t_r)
        self._vbits: dict[float, tuple[np.ndarray, str, dict]] = {} if bits_cache is None else bits_cache

    def sampled(self, t: torch.Tensor) -> torch.Tensor:
        """``t``'s rows where bits are counted."""
        return t if self.sample is None else t.index_select(0, self.sample)

    def release(self) -> None:
        """Drop the per-value tensors (the bits cache stays): a site's data is large on the H200 model."""
        for k in [k for k, v in vars(self).items() if isinstance(v, torch.Tensor)]:
            delattr(self, k)

    def value_mask(self, m):
        return torch.ones_like(self.d_r, dtype=torch.bool) if math.isinf(m) else (self.d_r < m) | self.disagree

    def scale_mask(self, ms):
        return torch.ones_like(self.ds_r, dtype=torch.bool) if math.isinf(ms) else (self.ds_r < ms) | self.sdisagree

    def value_bits(self, m):
        """(bits per row of positions + hint bits, chosen coding, every coding's total bits) at margin m."""
        if m not in self._vbits:
            mask = self.sampled(self.value_mask(m)).cpu().numpy()
            totals = C.candidate_bits(mask, self.rice_max)
            best = min(totals, key=lambda c: int(totals[c].sum()))
            self._vbits[m] = (totals[best] + mask.sum(1), best, {c: int(v.sum()) for c, v in totals.items()})
        return self._vbits[m]

    def evaluate_syndromes(self, rs, search):
        """Offline points of block syndromes (r bits per block of 16 values) + scale hints at every block."""
        out = []
        codes_r = _signed(self.codes)
        wrong = self.lsb_scales != self.scales
        wrong_v = wrong.repeat_interleave(16, dim=1)
        for r in rs:
            codes, _ = syndrome_codes(self.x_t, self.g, self.lsb_scales, syndromes(self.bits, r), r, search)
            mism = _signed(codes) != codes_r
            vmism = mism | (wrong_v & ((codes_r != 0) | ((codes & 7) != 0)))
            out.append({"syndrome_bits": r, "search": search,
                        "bytes_per_token": float(syndrome_bytes_per_token(self.width, r)),
                        "code_mismatches": int(mism.sum()), "value_mismatches": int(vmism.sum()),
                        "values": int(mism.numel()), "code_agreement": 1 - float(mism.float().mean()),
                        "value_agreement": 1 - float(vmism.float().mean()),
                        "scale_agreement": 1 - float(wrong.float().mean())})
        return out

    def evaluate(self, margins, scale_margins, payloads):
        out = []
        codes_r = _signed(self.codes)
        for ms in scale_margins:
            smask = self.scale_mask(ms)
            sm_np = self.sampled(smask).cpu().numpy()
            stotals = C.candidate_bits(sm_np, self.rice_max)
            sbest = min(stotals, key=lambda c: int(stotals[c].sum()))
            for payload in payloads:
                stored = self.scales if payload == "byte" else self.lsb_scales
                rec_s = torch.where(smask, stored, self.own_scales)
                v_t = self.x_t * _r(rec_s, self.g)
                rtn = ref.e2m1_rne_magnitude(v_t)
                hg = ref.e2m1_hint_magnitude(v_t, self.bits)
                mism_rtn = _signed(rtn.to(torch.uint8) | self.sign) != codes_r
                mism_hg = _signed(hg.to(torch.uint8) | self.sign) != codes_r
                delta = (C.ladder_position(v_t) - self.u_r).abs()
                wrong = rec_s != self.scales
                wrong_v = wrong.repeat_interleave(16, dim=1)
                nz_r = codes_r != 0
                # a value's dequantized value differs when its code does, or its block scale does and a code is not 0
                vmism_rtn = mism_rtn | (wrong_v & (nz_r | (rtn != 0)))
                vmism_hg = mism_hg | (wrong_v & (nz_r | (hg != 0)))
                sbits = stotals[sbest] + (8 if payload == "byte" else 1) * sm_np.sum(1)
                for m in margins:
                    vmask = self.value_mask(m)
                    mism = torch.where(vmask, mism_hg, mism_rtn)
                    vmism = torch.where(vmask, vmism_hg, vmism_rtn)
                    vbits, vbest, _ = self.value_bits(m)
                    nbytes = float(((vbits + sbits + 7) // 8).sum()) / self.bits_rows + INDEX_BYTES_PER_ROW
                    within = delta < min(m, 0.5)
                    n_unmarked = int((~vmask).sum())
                    out.append({"margin": m, "scale_margin": ms, "scale_payload": payload,
                                "bytes_per_token": nbytes, "coding": {"values": vbest, "blocks": sbest},
                                "code_mismatches": int(mism.sum()), "values": int(mism.numel()),
                                "value_mismatches": int(vmism.sum()),
                                "code_agreement": 1 - float(mism.float().mean()),
                                "value_agreement": 1 - float(vmism.float().mean()),
                                "scale_agreement": 1 - float(wrong.float().mean()),
                                "marked_value_share": float(vmask.float().mean()),
                                "marked_block_share": float(smask.float().mean()),
                                "unmarked_mismatch_share": (int((mism & ~vmask).sum()) / n_unmarked
                                                            if n_unmarked else 0.0),
                                "within_margin_mismatch": int((mism & within).sum())})
        return out


def combine(per_site: dict[str, list[dict]], keys=("margin", "scale_margin", "scale_payload"),
            means=("scale_agreement", "marked_value_share"), sums=("within_margin_mismatch",)) -> list[dict]:
    """Grid points summed over sites (the same ``keys``, e.g. margins, at every site): bytes and mismatch counts
    summed, agreements from the sums, ``means`` averaged over sites, ``sums`` summed."""
    sites = list(per_site)
    out = []
    for i, p in enumerate(per_site[sites[0]]):
        rows = [per_site[s][i] for s in sites]
        n = sum(r["values"] for r in rows)
        mism = sum(r["code_mismatches"] for r in rows)
        vmism = sum(r["value_mismatches"] for r in rows)
        out.append({k: p[k] for k in keys} | {
            "bytes_per_token": sum(r["bytes_per_token"] for r in rows), "code_mismatches": mism, "values": n,
            "value_mismatches": vmism, "code_agreement": 1 - mism / n, "value_agreement": 1 - vmism / n}
            | {k: float(np.mean([r[k] for r in rows])) for k in means} | {k: sum(r[k] for r in rows) for k in sums})
    return out


def frontier(points: list[dict]) -> list[dict]:
    """Points no other point beats in both bytes and value mismatches, by bytes."""
    best, out = None, []
    for p in sorted(points, key=lambda p: (p["bytes_per_token"], p["value_mismatches"])):
        if best is None or p["value_mismatches"] < best:
            out.append(p)
            best = p["value_mismatches"]
    return out


def per_site_allocation(per_site: dict[str, list[dict]], lambdas) -> list[dict]:
    """Margins chosen per site: for each lambda every site takes its grid point minimising value mismatches +
    lambda * bytes per token (a Lagrangian split of a byte budget); the curve of totals (offline)."""
    out = []
    for lam in lambdas:
        pick = {s: min(pts, key=lambda p: p["value_mismatches"] + lam * p["bytes_per_token"]) for s, pts in
                per_site.items()}
        n = sum(p["values"] for p in pick.values())
        vmism = sum(p["value_mismatches"] for p in pick.values())
        out.append({"lambda": lam, "bytes_per_token": sum(p["bytes_per_token"] for p in pick.values()),
                    "value_mismatches": vmism, "value_agreement": 1 - vmism / n,
                    "sites": {s: {k: p[k] for k in ("margin", "scale_margin", "scale_payload")}
                              for s, p in pick.items()}})
    return frontier(out)


# ---- exploratory: block syndromes decoded with the trainer's reliabilities (not in the library) --------------
def syndrome_columns(r: int, device=None) -> torch.Tensor:
    """The r-bit parity-check column of each of a block's 16 values (distinct and non-zero as far as r allows)."""
    return torch.tensor([j % (2**r - 1) + 1 for j in range(16)], dtype=torch.int64, device=device)


def syndromes(bits: torch.Tensor, r: int) -> torch.Tensor:
    """r-bit syndrome (int64 [N, W/16]) of each block of hint bits (uint8 [N, W]): XOR of the columns of its ones."""
    b = bits.to(torch.int64).reshape(bits.shape[0], -1, 16)
    out = torch.zeros(b.shape[:2], dtype=torch.int64, device=bits.device)
    for j, c in enumerate(syndrome_columns(r).tolist()):
        out ^= b[..., j] * c
    return out


def syndrome_decode(bits_t: torch.Tensor, rho: torch.Tensor, s_r: torch.Tensor, r: int, search: int = 8):
    """The trainer's hint bits (uint8 [N, W]) from its own round-to-nearest LSBs ``bits_t``, their reliabilities
    ``rho`` (distance to the boundary, float [N, W]) and the rollout's block syndromes ``s_r``: in a block whose
    syndrome differs, flip the cheapest set (sum of rho) among its ``search`` least reliable values whose columns
    XOR to the difference (none such: flip nothing)."""
    n, w = bits_t.shape
    e = (syndromes(bits_t, r) ^ s_r).reshape(-1)  # [NB]
    bad = torch.nonzero(e).squeeze(1)
    out = bits_t.clone().reshape(-1, 16)
    if bad.numel() == 0:
        return out.reshape(n, w)
    rb = rho.reshape(-1, 16)[bad].double()
    order = torch.argsort(rb, dim=1)[:, :search]  # [B', L]
    cols = syndrome_columns(r, rho.device)[order]
    cost_l = torch.gather(rb, 1, order)
    ar = torch.arange(1 << search, device=rho.device)
    subsets = (ar[:, None] >> torch.arange(search, device=rho.device)[None, :]) & 1  # [2^L, L]
    syn = torch.zeros(bad.numel(), 1 << search, dtype=torch.int64, device=rho.device)
    for l in range(search):  # XOR of the chosen columns, one bit-plane of the subsets at a time
        syn ^= cols[:, l: l + 1] * subsets[:, l][None, :]
    cost = cost_l @ subsets.T.double()  # [B', 2^L]: sum of the chosen reliabilities
    cost = torch.where(syn == e[bad][:, None], cost, torch.full_like(cost, math.inf))
    best = cost.argmin(dim=1)
    found = torch.isfinite(cost.min(dim=1).values)
    for l in range(search):
        flip = found & (((best >> l) & 1) == 1)
        rows, pos = bad[flip], order[flip, l]
        out[rows, pos] ^= 1
    return out.reshape(n, w)


def syndrome_codes(x_t, g, scales_rec, s_r, r, search=8):
    """Codes (uint8 [N, W], sign in bit 3) the trainer gets with syndrome-decoded hints and the given scales."""
    v_t = x_t * _r(scales_rec, g)
    rtn = ref.e2m1_rne_magnitude(v_t)
    rho = C.boundary_distance(C.ladder_position(v_t))
    bits = syndrome_decode((rtn & 1).to(torch.uint8), rho, s_r, r, search)
    mag = ref.e2m1_hint_magnitude(v_t, bits)
    return (mag | (ref.input_signbit(x_t).to(torch.int32) << 3)).to(torch.uint8), bits


def syndrome_bytes_per_token(width: int, r: int) -> float:
    """r syndrome bits + 1 scale-hint bit per block: fixed-size rows (no positions, no row index)."""
    return math.ceil(width // 16 * (r + 1) / 8)


# ---- 5. entropy floor -------------------------------------------------------------------------------------
_EDGES = np.concatenate([[0.0], 2.0 ** np.arange(-14, 0), [0.5, 1.0, 2.0, np.inf]])


def _offset_bins(pos: torch.Tensor, lo: int, hi: int) -> np.ndarray:
    """Bin of each position: (nearest boundary k + 1/2, k in [lo, hi]; signed offset on log-spaced edges)."""
    p = np.nan_to_num(np.abs(pos.cpu().numpy()), nan=1e9, posinf=1e9)
    k = np.clip(np.floor(p), lo, hi)
    off = p - (k + 0.5)
    mag = np.searchsorted(_EDGES, np.abs(off), side="right")  # 1 .. len(_EDGES)
    return (((k - lo) * 2 + (off < 0)) * (len(_EDGES) + 1) + mag).astype(np.int64)


def entropy(y: np.ndarray, bins: np.ndarray) -> dict[str, float]:
    """Empirical conditional entropy H(Y | bin) in bits per sample: plug-in (maximum likelihood) and with the
    Miller-Madow correction ((K_b - 1) / (2 n_b ln 2) bits added per bin b with K_b distinct values of Y seen).
    Conditioning on bins of the trainer's value instead of the value itself can only raise the true entropy; the
    plug-in estimate is biased low with few samples per bin (Miller-Madow corrects the first order)."""
    y = y.astype(np.int64).ravel()
    b = bins.astype(np.int64).ravel()
    n = y.size
    pair, pair_n = np.unique(b * 1024 + (y + 512), return_counts=True)  # |y| < 512: codes and scale bytes
    pb = pair // 1024
    ub, bn = np.unique(b, return_counts=True)
    nb = bn[np.searchsorted(ub, pb)]
    plug = float(-(pair_n * np.log2(pair_n / nb)).sum() / n)
    k_b = np.bincount(np.searchsorted(ub, pb), minlength=len(ub))
    mm = plug + float(((k_b - 1) / (2 * np.log(2))).sum() / n)
    return {"plug_in": plug, "miller_madow": mm, "samples": int(n), "bins": int(len(ub))}


def entropy_floor(d: SiteData) -> dict:
    """Per-value entropy of the rollout's code given the trainer's value (with the rollout's scale), per-block
    entropy of the rollout's scale byte given the trainer's own scale position; bytes per token of the floor."""
    x_t, scales, codes, sign, bits, own, w_t = (d.sampled(t) for t in (d.x_t, d.scales, d.codes, d.sign, d.bits,
                                                                        d.own_scales, d.w_t))
    v_t = x_t * _r(scales, d.g)
    u_t = C.ladder_position(v_t)
    rtn = _signed(ref.e2m1_rne_magnitude(v_t).to(torch.uint8) | sign)
    y_code = (_signed(codes) - rtn).cpu().numpy()
    bins_v = _offset_bins(u_t.abs().clamp(max=1e9), 0, 6)
    hv = entropy(y_code, bins_v)
    hh = entropy(bits.cpu().numpy().astype(np.int64), bins_v)
    y_s = scales.to(torch.int64).cpu().numpy() - own.to(torch.int64).cpu().numpy()
    hs = entropy(y_s, _offset_bins(w_t, 1, 125))
    w = d.width
    return {"code_bits_per_value": hv, "hint_bits_per_value": hh, "scale_bits_per_block": hs,
            "bytes_per_token": (w * hv["miller_madow"] + w / 16 * hs["miller_madow"]) / 8,
            "bytes_per_token_plug_in": (w * hv["plug_in"] + w / 16 * hs["plug_in"]) / 8}


# ---- the run ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", choices=tuple(CONFIGS), default="demo",
                   help="demo: the tracerl demo store on the CPU (default); h200: the H200 model (hidden 2048, 40 "
                        "layers, GPU; 8 x 1,024 tokens, decoded without CUDA graphs so the rollout's activations can "
                        "be kept); tiny: a 4-layer model on the CPU with the H200 configuration's row sampling (a "
                        "check of that code path)")
    p.add_argument("--smoke", action="store_true", help="fewer tokens and a small grid, output to a temp dir")
    p.add_argument("--trajectories", type=int, default=None, help="trajectories to record (default per config)")
    p.add_argument("--tokens", type=int, default=None,
                   help="tokens per trajectory, prompt included (default per config)")
    p.add_argument("--grid-rows", type=int, default=None,
                   help="response rows (a seeded random sample) where the offline grid counts position bits and "
                        "the entropy floor; agreement is counted over every row (default: all rows for demo, 1024 "
                        "for h200, 24 for tiny)")
    p.add_argument("--seed", type=int, default=0, help="the recording's seed (and the row sample's)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--hint-layers", default="latter-half",
                   help="the demo's hinted layers (latter-half: today's default; all: every MoE input, the 'more sites "
                        "for the same bytes' question); output name gets -all-layers for 'all'")
    p.add_argument("--out", default=None, help="JSON path (the PNG goes beside it)")
    p.add_argument("--replot", default=None, metavar="JSON", help="only redraw the PNG beside a saved JSON")
    args = p.parse_args(argv)
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), Path(args.replot).with_suffix(".png"))
        return 0
    torch.set_num_threads(args.threads)
    conf = CONFIGS[args.config]
    if conf["device"] == "cuda" and not torch.cuda.is_available():
        p.error(f"--config {args.config} needs a CUDA device; use --config demo or tiny on the CPU")
    traj = args.trajectories or conf["trajectories"][args.smoke]
    tokens = args.tokens or conf["tokens"][args.smoke]
    grid_rows = args.grid_rows if args.grid_rows is not None else conf["grid_rows"]
    if grid_rows is not None and grid_rows < 1:
        p.error(f"--grid-rows {grid_rows}: must be >= 1")
    layers = "" if args.hint_layers == "latter-half" else f"-{args.hint_layers}-layers"
    out_json = Path(args.out) if args.out else (Path(tempfile.mkdtemp()) / "subbit-smoke.json"
                                               if args.smoke or conf["name"] is None
                                               else RESULTS / f"{conf['name']}{layers}.json")
    margins = ([0.0, 0.02, 0.05, 0.1, 0.25, INF] if args.smoke else
               [0.0, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, INF])
    scale_margins = [0.0, 0.1, 0.3, INF] if args.smoke else [0.0, 0.05, 0.1, 0.2, 0.3, 0.5, INF]
    syndrome_rs = [1, 3, 5] if args.smoke else [1, 2, 3, 4, 5, 6, 8]
    payloads = ("byte", "lsb")
    load_before = os.getloadavg()
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    say(f"load before: {uptime}")
    timing = {}

    with tempfile.TemporaryDirectory(prefix="subbit-") as tmp:
        url = f"{tmp}/store"
        t0 = time.perf_counter()
        rec = record_store(DemoConfig(trajectories=traj, tokens=tokens, seed=args.seed, store=url,
                                      hint_layers=args.hint_layers, **conf["demo"]))
        timing["record_s"] = time.perf_counter() - t0
        say(f"recorded {rec['trajectories']} trajectories, {rec['response_tokens']} response tokens")
        store = ts.open_store(url)
        cfg = AuditConfig(store=url, device=conf["device"], verify=False)
        s = load_setup(store, cfg)
        reader = store.reader()
        trajs, _ = read_trajectories(reader, cfg, False, s.plan.hinted)
        hinted = list(s.plan.hinted)
        widths = {h: s.plan.by_name[h].width for h in hinted}
        today = C.today_bytes_per_token(widths.values())

        # ---- replay with the rollout's activations, micro-batches with the rollout per THD row ----
        t0 = time.perf_counter()
        mbs, checks = [], {"replay_codes_from_x": True, "stored_equals_replay": True}
        for chunk in replay_chunks(trajs, s.rollout.get("batches")):
            w = use_weights(s, url, chunk[0].version, set(), None)
            cap = RolloutCapture(chunk, widths)
            with s.replay.using(substitute=cap):
                rep, _ = replay_batch(s, chunk, w, lambda *a: None, {"replay decode (FP4, tokens forced)": 0,
                                                                     "floor decode (bf16, tokens forced)": 0},
                                      {"replay decode (FP4, tokens forced)": 1,
                                       "floor decode (bf16, tokens forced)": 1}, "off")
            for site in hinted:  # the captured activations quantize to the replayed codes
                g = s.replay.global_scale_on(site, s.device)
                for b, t in enumerate(chunk):
                    n = t.num_tokens
                    q = tracefp4.quantize(cap.x[site][b, :n], "nvfp4", global_scale=g, backend="reference")
                    checks["replay_codes_from_x"] &= bool(torch.equal(q.codes, rep.codes[site][b, :n]))
            sizes = {t.traj_id: t.num_tokens for t in chunk}
            for mbatch in pack_micro_batches(sizes, cfg.micro_batch_tokens):
                packed = read_packed(reader, mbatch, hinted, read_kwargs={"fmt": "numpy"})
                amb = AuditMicroBatch(s, rep, packed)
                rp = amb.reproduction()
                checks["stored_equals_replay"] &= bool(rp[0] == rp[1] and rp[2] == rp[3])
                roll = {site: SiteRollout(cap.x[site][amb.b_dev, amb.pos_dev], amb.stored(site, "scales"),
                                          amb.stored(site, "hints"), tracefp4.unpack_codes(amb.replay_codes(site)))
                        for site in hinted}
                mbs.append((amb, roll))
        timing["replay_s"] = time.perf_counter() - t0
        say(f"replayed; checks {checks}")
        if not all(checks.values()):
            raise SystemExit(f"the captured rollout activations do not reproduce the store: {checks}")

        # ---- the audit's own passes ----
        t0 = time.perf_counter()
        audit_modes, audit_d = {}, {}
        floor_mean = None
        for spec in mode_passes(s.plan):
            st = PassState(spec, am.TokenLog(), am.CodeTally(s.observable, set(hinted), s.device) if spec.observe
                           else None, {}, floor_log=am.TokenLog() if spec.name == "bf16" else None)
            for amb, _ in mbs:
                run_pass(s, amb, st)
            d = audit_d[spec.name] = st.log.column("dlogp")
            row = {"mean_abs_dlogp": float(np.nanmean(np.abs(d)))}
            if st.tally is not None:
                counts = st.tally.site_counts()
                row.update({k: v for k, v in am.agreement(np.stack([counts[h] for h in hinted])).items()
                            if k in ("code_agreement", "scale_agreement")})
            if spec.name == "bf16":
                floor_mean = float(np.nanmean(np.abs(st.floor_log.column("dlogp"))))
            audit_modes[spec.name] = row
        for row in audit_modes.values():
            row["excess_over_floor"] = row["mean_abs_dlogp"] - floor_mean
        timing["audit_passes_s"] = time.perf_counter() - t0
        say("audit passes: " + ", ".join(f"{k} {v['excess_over_floor']:.3e}" for k, v in audit_modes.items()))

        # ---- the margin = inf passes (today's hints), keeping the trainer's activations ----
        t0 = time.perf_counter()
        passes, x_train = [], {}
        for rr in (False, True):
            collect: dict = {}
            passes.append(compact_pass(s, mbs, Point(INF, INF), rr, collect, count_bytes=grid_rows is None))
            x_train[rr] = {site: torch.cat(v) for site, v in collect.items()}
        say("margin inf passes done")

        # ---- offline grid ----
        resp = [(amb, roll) for amb, roll in mbs]
        grid, sites_data, floors, syn_site = {}, {}, {}, {}
        t1 = time.perf_counter()
        n_resp = sum(int(a.resp_dev.numel()) for a, _ in resp)
        sample = None
        if grid_rows is not None and grid_rows < n_resp:
            gen = torch.Generator().manual_seed(args.seed)
            sample = torch.randperm(n_resp, generator=gen)[:grid_rows].sort().values.to(s.device)
        caches: dict[str, dict] = {}
        for rr in (False, True):
            per_site = {}
            for site in hinted:
                cat = {k: torch.cat([getattr(r[site], k)[a.resp_dev] for a, r in resp]) for k in
                       ("x", "scales", "hints", "codes")}
                g = s.train.global_scale_on(site, s.device)
                d = SiteData(cat["x"], x_train[rr][site], g, cat["scales"], cat["hints"], cat["codes"], rice_max=8,
                             sample=sample, bits_cache=caches.setdefault(site, {}))
                per_site[site] = d.evaluate(margins, scale_margins, payloads)
                syn_site.setdefault(rr, {})[site] = d.evaluate_syndromes(syndrome_rs, search=8)
                floors.setdefault(rr, {})[site] = entropy_floor(d)
                d.release()
                sites_data[(rr, site)] = d
                del cat
            say(f"grid ({'with' if rr else 'without'} routing replay) done")
            grid[rr] = {"per_site": per_site, "overall": combine(per_site)}
        timing["grid_s"] = time.perf_counter() - t1
        if grid_rows is not None:  # the margin = inf passes above did not count bytes either
            for pr in passes:
                _bytes_from_grid(pr, grid[False])
        say(f"grid: {len(grid[False]['overall'])} points x 2 in {timing['grid_s']:.1f}s")

        # the offline evaluator agrees with the library's margin_stats where the trainer is the same (margin inf)
        for rr in (False, True):
            real = passes[rr]
            off = next(p for p in grid[rr]["overall"] if math.isinf(p["margin"]) and math.isinf(p["scale_margin"])
                       and p["scale_payload"] == "byte")
            checks[f"offline_equals_pass_rr{int(rr)}"] = (off["code_mismatches"] == real["code_mismatches"]
                                                         and off["value_mismatches"] == real["value_mismatches"])

        # ---- picks for real passes: the grid's best under fractions of today's bytes (no routing replay) ----
        front = frontier(grid[False]["overall"])
        picks = []
        for frac in BUDGET_FRACTIONS:
            under = [p for p in front if p["bytes_per_token"] <= frac * today]
            if under:
                best = min(under, key=lambda p: p["value_mismatches"])
                pt = Point(best["margin"], best["scale_margin"], best["scale_payload"])
                if pt not in picks:
                    picks.append(pt)
        fixed = [Point(0.0, 0.0), Point(0.0, INF), Point(INF, INF, "lsb")]
        for rr in (False, True):
            for pt in fixed + picks:
                passes.append(compact_pass(s, mbs, pt, rr, count_bytes=grid_rows is None))
                if grid_rows is not None:
                    _bytes_from_grid(passes[-1], grid[False])
                say(f"pass {pt.name} rr={rr}: {passes[-1]['bytes_per_token']:.1f} B/token, agreement "
                    f"{passes[-1]['code_agreement']:.5f}, excess {passes[-1]['mean_abs_dlogp'] - floor_mean:.3e}")
        syn_passes = []
        for rr in (False, True):
            for r_ in ([1, 3] if args.smoke else [2, 4, 6]):
                syn_passes.append(syndrome_pass(s, mbs, r_, rr))
                sp = syn_passes[-1]
                say(f"pass syndrome r={r_} rr={rr}: {sp['bytes_per_token']:.1f} B/token, value agreement "
                    f"{sp['value_agreement']:.5f}, excess {sp['mean_abs_dlogp'] - floor_mean:.3e}")
        for pr in passes + syn_passes:
            pr["excess_over_floor"] = pr["mean_abs_dlogp"] - floor_mean
            base = audit_modes["fp4_rne_replay_routes" if pr["replay_routes"] else "fp4_rne_own_scales"]
            pr["excess_vs_rne"] = pr["excess_over_floor"] / base["excess_over_floor"]
            pr["excess_vs_rne_no_replay"] = (pr["excess_over_floor"]
                                             / audit_modes["fp4_rne_own_scales"]["excess_over_floor"])
        timing["compact_passes_s"] = sum(pr["seconds"] for pr in passes + syn_passes)
        # the rule at the margins' ends is the audit's RNE / RNE with rollout scales / hints pass, token for token
        by = {(pr["name"], pr["replay_routes"]): pr for pr in passes}
        for pt, rr, mode in ((Point(0.0, 0.0), False, "fp4_rne_own_scales"), (Point(0.0, 0.0), True,
                              "fp4_rne_replay_routes"), (Point(0.0, INF), False, "fp4_rne_rollout_scales"),
                             (Point(INF, INF), False, "fp4_hints"), (Point(INF, INF), True, "fp4_hints_replay_routes")):
            checks[f"{pt.name}{',rr' if rr else ''} == audit {mode}"] = bool(
                np.array_equal(by[(pt.name, rr)]["_dlogp"], audit_d[mode]))
        for pr in passes:
            pr.pop("_dlogp")

        # ---- the byte stream: pack/unpack of every pick at every site (first 256 response rows) ----
        t0 = time.perf_counter()
        rt_ok = True
        amb, roll = mbs[0]
        for pt in picks:
            for site in hinted:
                r = roll[site]
                n = min(256, int(amb.resp_dev.numel()))
                rows = amb.resp_dev[:n]
                enc = C.encode_margin_exceptions(r.x[rows], s.train.global_scale_on(site, s.device), r.scales[rows],
                                                 r.hints[rows], pt.margin, pt.scale_margin, scale_payload=pt.payload)
                coding, _ = C.choose_coding(enc)
                packed = C.pack_rows(enc, coding)
                rt_ok &= C.unpack_rows(packed) == enc and packed.nbytes == int(C.packed_row_bytes(enc, coding).sum())
        checks["pack_unpack_round_trip"] = rt_ok
        timing["round_trip_s"] = time.perf_counter() - t0

    # ---- per-site allocation, coding comparison, summary ----
    lambdas = [0.0] + list(np.geomspace(0.01, 1e5, 60))
    alloc = {rr: per_site_allocation(grid[rr]["per_site"], lambdas) for rr in (False, True)}
    coding_cmp = {}
    for pt in picks:
        for site in hinted:
            d = sites_data[(False, site)]
            _, vbest, vtotals = d.value_bits(pt.margin)
            coding_cmp.setdefault(pt.name, {})[site] = {
                "values": {c: b / 8 / d.rows for c, b in vtotals.items()}, "values_best": vbest}
    floor_total = {rr: {"bytes_per_token": sum(f["bytes_per_token"] for f in floors[rr].values()),
                        "bytes_per_token_plug_in": sum(f["bytes_per_token_plug_in"] for f in floors[rr].values())}
                   for rr in (False, True)}
    timing["seconds"] = time.perf_counter() - T0
    result = {
        "experiment": conf["name"] or f"subbit-{args.config}", "issue": 23, "setup": args.config,
        "store": {"trajectories": traj, "tokens_per_trajectory": tokens, "response_tokens": rec["response_tokens"],
                  "grid_rows": n_resp if sample is None else int(sample.numel()), "rows": n_resp,
                  "hint_layers": args.hint_layers,
                  "hinted_sites": hinted, "widths": widths, "today_bytes_per_token": today},
        "checks": checks,
        "floor_mean_abs_dlogp": floor_mean,
        "audit_modes": audit_modes,
        "passes": passes,
        "entropy_floor": {("replay_routes" if rr else "no_replay"): {"per_site": floors[rr], **floor_total[rr]}
                          for rr in (False, True)},
        "grid": {("replay_routes" if rr else "no_replay"): {"overall": grid[rr]["overall"],
                                                             "frontier": frontier(grid[rr]["overall"]),
                                                             "per_site_allocation": alloc[rr],
                                                             "per_site_frontier": {
                                                                 site: _table(frontier(pts)) for site, pts in
                                                                 grid[rr]["per_site"].items()}}
                 for rr in (False, True)},
        "position_codings_at_picks": coding_cmp,
        "exploratory_syndromes": {
            "what": "not margin exceptions and not in the library: per block of 16 values the rollout stores r "
                    "parity bits of its hint bits (columns j % (2^r - 1) + 1) and every block's scale LSB; the "
                    "trainer flips, among its 8 least reliable values (distance to the boundary), the cheapest set "
                    "that matches the syndrome. Fixed-size rows; no exactness guarantee (it can miscorrect)",
            "passes": syn_passes,
            "offline": {("replay_routes" if rr else "no_replay"): {
                "overall": combine(syn_site[rr], keys=("syndrome_bits", "search"), means=(), sums=()), "per_site": syn_site[rr]} for rr in (False, True)}},
        "definitions": {
            "bytes_per_token": "mean over response tokens of each site's byte-aligned row (positions + hint bits + "
                               "block positions + scale bytes or bits) plus a uint32 offset per 64 rows, summed "
                               "over the hinted sites; today's layout: W/8 + W/16 per site",
            "code_agreement": "trainer's reconstructed code == rollout's (+0 == -0) over response tokens at hinted "
                              "sites",
            "grid": "offline: trainer activations of the margin=inf pass (today's hints upstream), every site with "
                    "the same margins (overall: every grid point; per_site_frontier: each site's own frontier, the "
                    "full per-site grid is not kept); passes: real recomputes with the rule at every hinted site",
            "entropy": "H(rollout's signed code - trainer's RTN code | bin), bins = (nearest boundary, signed "
                       "offset on log-spaced edges 2^-14..1/2, 1, 2) of the trainer's ladder position with the "
                       "rollout's scale; scales: H(rollout byte - own byte | bin of own E4M3 position), pooled over "
                       "binades; plug-in and Miller-Madow, bits per value / block",
        },
        "config": {"margins": margins, "scale_margins": scale_margins, "payloads": payloads, "smoke": args.smoke,
                   "seed": args.seed, "threads": args.threads, "budget_fractions": BUDGET_FRACTIONS,
                   "index_bytes_per_row": INDEX_BYTES_PER_ROW},
        "machine": {**machine_info(), "uptime_before": uptime, "loadavg_before": load_before,
                    "loadavg_after": os.getloadavg()},
        "timing": timing,
    }
    out_json.parent.mkdir(parents=True, exist_ok=True)
    result["definitions"]["inf"] = 'a margin of "inf" marks every value (block)'
    result = json_ready(_inf_as_text(result))
    out_json.write_text(_dumps(result))
    plot(result, out_json.with_suffix(".png"))
    report(result)
    say(f"wrote {out_json} and {out_json.with_suffix('.png')}")
    return 0 if all(checks.values()) else 1


GRID_COLUMNS = ("margin", "scale_margin", "scale_payload", "bytes_per_token", "values_coding", "blocks_coding",
                "value_agreement", "code_agreement", "scale_agreement", "value_mismatches", "code_mismatches",
                "marked_value_share", "marked_block_share", "unmarked_mismatch_share", "within_margin_mismatch")


def _table(points: list[dict]) -> dict:
    """Grid points of one site as a column table (the JSON would be 5x larger as one object per point)."""
    flat = [{**p, "values_coding": p["coding"]["values"], "blocks_coding": p["coding"]["blocks"]} for p in points]
    def short(v):
        return float(f"{v:.8g}") if isinstance(v, float) and math.isfinite(v) else v

    return {"columns": list(GRID_COLUMNS), "rows": [[short(p[c]) for c in GRID_COLUMNS] for p in flat]}


def _dumps(obj) -> str:
    """JSON with one-space indents, lists of scalars on one line each."""
    text = json.dumps(obj, indent=1)
    return re.sub(r"\[\s+([^\[\]{}]*?)\s+\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def _inf_as_text(obj):
    """Infinite margins as "inf" (json_ready would write them as null, which reads as "not measured")."""
    if isinstance(obj, float) and math.isinf(obj):
        return "inf" if obj > 0 else "-inf"
    if isinstance(obj, dict):
        return {k: _inf_as_text(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_inf_as_text(v) for v in obj]
    return obj


def _num(v) -> float:
    return math.inf if v == "inf" else v


def report(r: dict) -> None:
    today = r["store"]["today_bytes_per_token"]
    print(f"\ntoday's layout: {today} B/token at {len(r['store']['hinted_sites'])} sites; floor mean|dlogp| "
          f"{r['floor_mean_abs_dlogp']:.3e}; checks: {r['checks']}")
    print("\naudit modes: " + "; ".join(f"{k}: code agr {v.get('code_agreement') or float('nan'):.5f}, excess "
                                         f"{v['excess_over_floor']:.3e}" for k, v in r["audit_modes"].items()))
    for key, ef in r["entropy_floor"].items():
        print(f"entropy floor ({key}): {ef['bytes_per_token']:.2f} B/token (Miller-Madow; plug-in "
              f"{ef['bytes_per_token_plug_in']:.2f}) = {ef['bytes_per_token'] / today:.3f} x today")
    print("\npass                         | rr | B/token | x today | code agr. | value agr. | scale agr. | marked "
          "| unmarked mism | excess    | x RNE (like for like)")
    rows = r["passes"] + r["exploratory_syndromes"]["passes"]
    for p in rows:
        print(f"{p['name']:28s} | {'y' if p['replay_routes'] else 'n'}  | {p['bytes_per_token']:7.2f} | "
              f"{p['bytes_per_token'] / today:7.3f} | {p['code_agreement']:.6f}  | {p['value_agreement']:.6f}   | "
              f"{p['scale_agreement']:.6f}   | {p.get('marked_value_share', float('nan')):.4f} | "
              f"{p.get('unmarked_mismatch_share', float('nan')):.2e}      | {p['excess_over_floor']:.3e} | "
              f"{p['excess_vs_rne']:.3f}")
    for key, g in r["grid"].items():
        print(f"\noffline frontier ({key}): B/token -> value agreement (code agreement), margins")
        for p in g["frontier"]:
            print(f"  {p['bytes_per_token']:7.2f} ({p['bytes_per_token'] / today:.3f} x) -> {p['value_agreement']:.6f} "
                  f"({p['code_agreement']:.6f})  m={_num(p['margin']):g} ms={_num(p['scale_margin']):g} "
                  f"{p['scale_payload']}")
        print(f"offline syndromes ({key}): " + "; ".join(
            f"r={p['syndrome_bits']} {p['bytes_per_token']:.0f} B -> {p['value_agreement']:.6f}"
            for p in r["exploratory_syndromes"]["offline"][key]["overall"]))


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    today = r["store"]["today_bytes_per_token"]
    n_values = r["passes"][0]["values"]
    lo = 0.5 / n_values  # zero mismatches are drawn here

    def rate(p):
        return max(1 - p["value_agreement"], lo)

    fig, (a, b) = plt.subplots(1, 2, figsize=(14, 5.5))
    colors = {"no_replay": "tab:blue", "replay_routes": "tab:orange"}
    for key, g in r["grid"].items():
        pts = g["overall"]
        a.scatter([p["bytes_per_token"] for p in pts], [rate(p) for p in pts], s=5, color=colors[key], alpha=0.2)
        fr = g["frontier"]
        a.plot([p["bytes_per_token"] for p in fr], [rate(p) for p in fr], "-", color=colors[key],
               label=f"margin exceptions, same margins at every site ({key})")
        al = g["per_site_allocation"]
        a.plot([p["bytes_per_token"] for p in al], [rate(p) for p in al], ":", color=colors[key],
               label=f"margin exceptions, margins per site ({key})")
        syn = r["exploratory_syndromes"]["offline"][key]["overall"]
        a.plot([p["bytes_per_token"] for p in syn], [rate(p) for p in syn], "--^", ms=4, color=colors[key],
               alpha=0.7, label=f"block syndromes r=1..8 + scale hints, exploratory ({key})")
        ef = r["entropy_floor"][key]["bytes_per_token"]
        a.axvline(ef, color=colors[key], ls="-.", lw=1, label=f"entropy floor {ef:.1f} B ({key})")
    for p in r["passes"] + r["exploratory_syndromes"]["passes"]:
        key = "replay_routes" if p["replay_routes"] else "no_replay"
        a.scatter([p["bytes_per_token"]], [rate(p)], marker="x", color=colors[key], s=40, zorder=3)
    a.axvline(today, color="k", lw=1, label=f"today: {today} B/token")
    a.axvline(today / 3, color="gray", lw=1, ls=":", label="1/3 of today")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlim(3, 1.35 * today)
    widths = sorted(set(r["store"]["widths"].values()))
    a.set_xlabel(f"bytes per token ({len(r['store']['hinted_sites'])} hinted sites of width "
                 f"{'/'.join(map(str, widths))})")
    a.set_ylabel("value mismatch rate (code or scale differs)")
    a.legend(fontsize=6, loc="lower left")
    a.set_title("offline grid (lines, dots) and real recompute passes (x)", fontsize=9)
    rne = r["audit_modes"]["fp4_rne_own_scales"]["excess_over_floor"]
    rne_rr = r["audit_modes"]["fp4_rne_replay_routes"]["excess_over_floor"]
    for group, marker in ((r["passes"], "o"), (r["exploratory_syndromes"]["passes"], "^")):
        for key, rr in (("no_replay", False), ("replay_routes", True)):
            pts = sorted((p for p in group if p["replay_routes"] == rr), key=lambda p: p["bytes_per_token"])
            b.plot([p["bytes_per_token"] for p in pts], [p["excess_over_floor"] for p in pts], marker=marker, ls="",
                   color=colors[key], label=f"{'margin exceptions' if marker == 'o' else 'syndromes'} ({key})")
    for p in r["passes"]:
        if not p["replay_routes"]:
            b.annotate(p["name"].replace(",", " "), (p["bytes_per_token"], p["excess_over_floor"]), fontsize=5,
                       xytext=(3, 2), textcoords="offset points")
    b.axhline(rne, color="tab:red", lw=1, label=f"RNE own scales {rne:.2e}")
    b.axhline(rne / 3, color="tab:red", lw=1, ls=":", label="0.33 x RNE (no routing replay)")
    b.axhline(rne_rr / 3, color="tab:purple", lw=1, ls=":", label="0.33 x RNE with routing replay")
    b.axvline(today, color="k", lw=1)
    b.axvline(today / 3, color="gray", lw=1, ls=":")
    b.set_xscale("log")
    b.set_xlim(3, 1.35 * today)
    lowest = min(p["excess_over_floor"] for p in r["passes"] + r["exploratory_syndromes"]["passes"])
    b.set_ylim(bottom=min(0.0, 1.15 * lowest))
    b.axhline(0, color="k", lw=0.5)
    b.set_xlabel("bytes per token")
    b.set_ylabel("excess mean |dlogp| over the floor (< 0: below it)")
    b.legend(fontsize=6, loc="upper right")
    b.set_title("excess of real recompute passes", fontsize=9)
    label = CONFIGS.get(r.get("setup", "demo"), CONFIGS["demo"])["label"]
    fig.suptitle(f"Margin exceptions on {label}, hinted layers: {r['store']['hint_layers']}, "
                 f"{r['store']['response_tokens']} response tokens (issue 23)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
