"""Metrics of `tracerl audit`, computed on the device one micro-batch at a time.

`CodeTally` compares, at every observed FP4 site, the trainer's E2M1 codes and block scales with the rollout's
(codes from the audit's replay of the rollout decode; scales as stored at hinted sites, as replayed elsewhere)
over the micro-batch's response rows. It keeps per-site counters on the device (one transfer at the end of a
pass) and hands per-token counters of the hinted sites to the host once per micro-batch ([R, 5] int64): the
[T, W] codes never leave the device.

`TokenLog` collects, per pass, one row per response token (trajectory, response position, policy version,
dlogp, router flips, code counters) on the host, and `breakdown` turns it into the report's slices: per
trajectory, per policy version and by response position. Definitions follow `tracerl.fidelity` (code agreement:
+0 and -0 count equal; one-step: adjacent on the signed ladder; router flip: the set of top-k experts differs
for a (token, layer) pair).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

import tracefp4
from tracerl import fidelity

#: per-token / per-site counter columns
VALUES, MISMATCH, ONE_STEP, BLOCKS, SCALE_EQ = range(5)
N_COUNTERS = 5


def _signed(codes_u8: torch.Tensor) -> torch.Tensor:
    """E2M1 codes -> signed ladder index (-7 .. 7; +0 and -0 both 0), int16."""
    mag = (codes_u8 & 7).to(torch.int16)
    return torch.where((codes_u8 & 8) != 0, -mag, mag)


def codes_match(codes_t: torch.Tensor, codes_r: torch.Tensor) -> torch.Tensor:
    """bool, the shape of the unpacked uint8 codes ``codes_t`` and ``codes_r``: equal codes, +0 and -0 counted
    equal (the audit's code agreement)."""
    return (codes_t == codes_r) | (((codes_t & 7) == 0) & ((codes_r & 7) == 0))


def code_counters(codes_t: torch.Tensor, codes_r: torch.Tensor, scales_t: torch.Tensor,
                  scales_r: torch.Tensor) -> torch.Tensor:
    """Per-row counters int64 [R, 5] (values, mismatching codes, one-step mismatches, blocks, equal scales) of
    trainer codes ``codes_t`` uint8 [R, W] against rollout codes ``codes_r`` uint8 [R, W] (both unpacked) and
    scale bytes [R, W/16]; on their device."""
    mism = ~codes_match(codes_t, codes_r)
    one = mism & ((_signed(codes_t) - _signed(codes_r)).abs() == 1)
    r, w = codes_t.shape
    nb = scales_t.shape[1]
    return torch.stack([
        torch.full((r,), w, dtype=torch.int64, device=codes_t.device),
        mism.sum(1, dtype=torch.int64),
        one.sum(1, dtype=torch.int64),
        torch.full((r,), nb, dtype=torch.int64, device=codes_t.device),
        (scales_t == scales_r).sum(1, dtype=torch.int64),
    ], dim=1)


class CodeTally:
    """Code and scale agreement of one pass at the observed sites; see the module docstring.

    ``sites``: every observable site in a fixed order; ``hinted``: those whose counters go into the per-token
    counters (the store's hinted sites: "code agreement at hinted sites")."""

    def __init__(self, sites: Sequence[str], hinted: set[str], device: torch.device):
        self.index = {s: i for i, s in enumerate(sites)}
        self.sites = list(sites)
        self.hinted = hinted
        self.per_site = torch.zeros(len(sites), N_COUNTERS, dtype=torch.int64, device=device)
        self.seen = torch.zeros(len(sites), dtype=torch.bool)
        self._rows: torch.Tensor | None = None
        self._resp: torch.Tensor | None = None

    def begin(self, response_rows: torch.Tensor) -> None:
        """Start a micro-batch: ``response_rows`` long [R] (THD rows of its response tokens, on the device)."""
        self._resp = response_rows
        self._rows = torch.zeros(len(response_rows), N_COUNTERS, dtype=torch.int64, device=response_rows.device)

    def add(self, site: str, codes_t: torch.Tensor, codes_r_packed: torch.Tensor, scales_t: torch.Tensor,
            scales_r: torch.Tensor) -> None:
        """One site of the micro-batch, THD rows [T, ...]: trainer codes uint8 [T, W] (unpacked), rollout codes
        packed uint8 [T, W/2], trainer scales and reference scales uint8 [T, W/16]."""
        resp = self._resp
        c = code_counters(codes_t.index_select(0, resp), tracefp4.unpack_codes(codes_r_packed.index_select(0, resp)),
                          scales_t.index_select(0, resp), scales_r.index_select(0, resp))
        i = self.index[site]
        self.per_site[i] += c.sum(0)
        self.seen[i] = True
        if site in self.hinted:
            self._rows += c

    def end(self) -> np.ndarray:
        """The micro-batch's per-token counters of the hinted sites, int64 [R, 5] on the host."""
        rows = self._rows.cpu().numpy()
        self._rows = self._resp = None
        return rows

    def site_counts(self) -> dict[str, np.ndarray]:
        """Per observed site, its counters int64 [5] summed over the pass (one device-to-host transfer)."""
        host = self.per_site.cpu().numpy()
        return {s: host[i] for s, i in self.index.items() if self.seen[i]}


def agreement(c: np.ndarray) -> dict[str, float | None]:
    """Counters [..., 5] summed -> code agreement, one-step and multi-step shares of mismatches, scale agreement
    (None where there is nothing to divide)."""
    c = np.asarray(c, dtype=np.int64).reshape(-1, N_COUNTERS).sum(0)

    def ratio(a, b):
        return float(a / b) if b else None

    mism = c[MISMATCH]
    return {
        "code_agreement": ratio(c[VALUES] - mism, c[VALUES]),
        "one_step_share": ratio(c[ONE_STEP], mism),
        "multi_step_share": ratio(mism - c[ONE_STEP], mism),
        "scale_agreement": ratio(c[SCALE_EQ], c[BLOCKS]),
        "values": int(c[VALUES]),
        "mismatches": int(mism),
    }


def route_flips(trainer: Mapping[int, np.ndarray], reference: Mapping[str | int, np.ndarray],
                layer_names: Mapping[int, str] | None = None) -> tuple[np.ndarray, dict[int, int]]:
    """Router flips of the rows of one micro-batch: per token the number of MoE layers whose top-k *set* differs
    (int64 [R]), and per layer the number of flipped tokens. ``trainer``: layer -> uint8 [R, top_k];
    ``reference``: the same layers (keyed by layer index, or by module name through ``layer_names``)."""
    per_token = None
    per_layer = {}
    for layer, ids in trainer.items():
        ref = reference[layer_names[layer] if layer_names is not None else layer]
        f = fidelity.router_flips(ids, ref)
        per_layer[layer] = int(f.sum())
        per_token = f.astype(np.int64) if per_token is None else per_token + f
    return (np.zeros(0, np.int64) if per_token is None else per_token), per_layer


class TokenLog:
    """Per-token rows of one pass, appended one micro-batch at a time (host arrays, a few numbers per token)."""

    COLUMNS = ("traj", "position", "version", "dlogp", "flips", "layers")

    def __init__(self):
        self.parts: dict[str, list[np.ndarray]] = {c: [] for c in self.COLUMNS}
        self.codes: list[np.ndarray] = []

    def add(self, *, traj: np.ndarray, position: np.ndarray, version: np.ndarray, dlogp: np.ndarray,
            flips: np.ndarray, layers: int, codes: np.ndarray | None = None) -> None:
        n = len(dlogp)
        for name, v in (("traj", traj), ("position", position), ("version", version), ("dlogp", dlogp),
                        ("flips", flips), ("layers", np.full(n, layers, np.int64))):
            self.parts[name].append(np.asarray(v))
        self.codes.append(np.zeros((n, N_COUNTERS), np.int64) if codes is None else codes)

    def column(self, name: str) -> np.ndarray:
        parts = self.parts[name]
        return np.concatenate(parts) if parts else np.zeros(0)

    def code_rows(self) -> np.ndarray:
        return np.concatenate(self.codes) if self.codes else np.zeros((0, N_COUNTERS), np.int64)


def dlogp_summary(d: np.ndarray) -> dict[str, float]:
    """`tracerl.fidelity.dlogp_stats` of per-token deltas ``d`` (NaN entries skipped)."""
    d = np.asarray(d, dtype=np.float64)
    return fidelity.dlogp_stats(d, np.zeros_like(d))


def _slice_rows(log: TokenLog, floor_abs: np.ndarray, sel: np.ndarray, with_codes: bool) -> dict[str, Any]:
    d = log.column("dlogp")[sel]
    flips = log.column("flips")[sel]
    layers = log.column("layers")[sel]
    mean_abs = float(np.nanmean(np.abs(d))) if d.size else math.nan
    floor_mean = float(np.nanmean(floor_abs[sel])) if d.size else math.nan
    row = {"tokens": int(sel.sum()) if sel.dtype == bool else int(len(d)), "mean_abs_dlogp": mean_abs,
           "floor_mean_abs_dlogp": floor_mean, "excess": mean_abs - floor_mean,
           "router_flip_rate": float(flips.sum() / layers.sum()) if layers.sum() else None}
    if with_codes:
        a = agreement(log.code_rows()[sel])
        row.update({k: a[k] for k in ("code_agreement", "one_step_share", "multi_step_share", "scale_agreement")})
    return row


def breakdown(log: TokenLog, floor_abs: np.ndarray, traj_ids: Sequence[str], bucket: int,
              with_codes: bool) -> dict[str, list[dict[str, Any]]]:
    """The per-trajectory, per-policy-version and by-response-position slices of one pass's `TokenLog`.

    ``floor_abs``: the floor's |dlogp| of the same tokens (same order); ``bucket``: response positions per
    slice. Every row has tokens, mean |dlogp|, the floor's mean |dlogp| on those tokens, their difference
    (excess) and the router flip rate; with ``with_codes`` also code agreement at hinted sites, one-step and
    multi-step shares of mismatches and scale agreement."""
    traj = log.column("traj").astype(np.int64)
    pos = log.column("position").astype(np.int64)
    ver = log.column("version").astype(np.int64)
    out: dict[str, list[dict[str, Any]]] = {"per_trajectory": [], "per_policy_version": [], "by_position": []}
    for t in np.unique(traj):
        sel = traj == t
        out["per_trajectory"].append({"traj_id": traj_ids[t], "policy_version": int(ver[sel][0]),
                                      **_slice_rows(log, floor_abs, sel, with_codes)})
    for v in np.unique(ver):
        out["per_policy_version"].append({"policy_version": int(v), **_slice_rows(log, floor_abs, ver == v,
                                                                                    with_codes)})
    if pos.size:
        for lo in range(0, int(pos.max()) + 1, bucket):
            sel = (pos >= lo) & (pos < lo + bucket)
            if sel.any():
                out["by_position"].append({"lo": lo, "hi": lo + bucket,
                                           **_slice_rows(log, floor_abs, sel, with_codes)})
    return out


def histogram(values: Mapping[str, np.ndarray], bins: int = 40) -> dict[str, Any]:
    """Shared log-spaced bins over |dlogp| of several passes: ``{"edges": [...], "zero": {name: n}, "counts":
    {name: [...]}}`` (exact zeros counted apart; edges from the smallest to the largest non-zero |dlogp|)."""
    absd = {k: np.abs(np.asarray(v, dtype=np.float64)) for k, v in values.items()}
    absd = {k: v[np.isfinite(v)] for k, v in absd.items()}
    nz = np.concatenate([v[v > 0] for v in absd.values()]) if absd else np.zeros(0)
    if nz.size == 0:
        return {"edges": [], "zero": {k: int(v.size) for k, v in absd.items()}, "counts": {}}
    lo, hi = float(nz.min()), float(nz.max())
    edges = np.geomspace(lo, hi * (1 + 1e-9), bins + 1) if hi > lo else np.array([lo, lo * 2])
    return {"edges": edges.tolist(), "zero": {k: int((v == 0).sum()) for k, v in absd.items()},
            "counts": {k: np.histogram(v[v > 0], bins=edges)[0].tolist() for k, v in absd.items()}}
