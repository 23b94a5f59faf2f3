"""Fidelity metrics of a trainer recompute against its rollout (DESIGN §5).

Per token, delta = logp_train - logp_rollout of the sampled token:

- ``mean_abs_dlogp`` = mean |delta|; ``p99_abs_dlogp`` = 99th percentile of |delta| (linear interpolation);
  ``max_abs_dlogp`` = max |delta|;
- ``k3`` = mean(e^delta - 1 - delta), Schulman's k3 estimator of KL(rollout || train) from rollout samples
  (>= 0 per token, ~ delta^2/2 for small delta);
- ``extreme_frac`` = share of tokens with max(e^delta, e^-delta) > 2, i.e. |delta| > ln 2.

Code agreement: share of values whose E2M1 codes match, +0 and -0 counted equal (both dequantize to 0).
Scale agreement: share of blocks whose E4M3 scale bytes match. Router flip rate: share of (token, layer)
pairs whose *set* of top-k experts differs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from tracerl.errors import ShapeMismatchError

if TYPE_CHECKING:  # torch is imported where a function needs it (this module is numpy-only otherwise)
    import torch

EXTREME_RATIO = 2.0


def dlogp_stats(logp_train: np.ndarray, logp_rollout: np.ndarray) -> dict[str, float]:
    """Statistics of delta = logp_train - logp_rollout over tokens where both are finite."""
    a = np.asarray(logp_train, dtype=np.float64)
    b = np.asarray(logp_rollout, dtype=np.float64)
    if a.shape != b.shape:
        raise ShapeMismatchError(f"log-prob arrays differ in shape: {a.shape} vs {b.shape}")
    ok = np.isfinite(a) & np.isfinite(b)
    d = a[ok] - b[ok]
    if d.size == 0:
        return {"mean_abs_dlogp": math.nan, "p99_abs_dlogp": math.nan, "max_abs_dlogp": math.nan,
                "k3": math.nan, "extreme_frac": math.nan, "tokens": 0}
    ad = np.abs(d)
    return {
        "mean_abs_dlogp": float(ad.mean()),
        "p99_abs_dlogp": float(np.percentile(ad, 99)),
        "max_abs_dlogp": float(ad.max()),
        "k3": float(np.mean(np.expm1(d) - d)),
        "extreme_frac": float(np.mean(ad > math.log(EXTREME_RATIO))),
        "tokens": int(d.size),
    }


def code_matches(codes_a: np.ndarray, codes_b: np.ndarray) -> np.ndarray:
    """Elementwise E2M1 code equality (uint8 codes 0..15), with +0 (code 0) == -0 (code 8)."""
    a = np.asarray(codes_a, dtype=np.uint8)
    b = np.asarray(codes_b, dtype=np.uint8)
    if a.shape != b.shape:
        raise ShapeMismatchError(f"code arrays differ in shape: {a.shape} vs {b.shape}")
    return (a == b) | (((a & 7) == 0) & ((b & 7) == 0))


def code_agreement(codes_a: np.ndarray, codes_b: np.ndarray) -> float:
    m = code_matches(codes_a, codes_b)
    return float(m.mean()) if m.size else math.nan


def one_step_share(codes_a: np.ndarray, codes_b: np.ndarray) -> float:
    """Among mismatching values, the share that are one ladder step apart on the signed ladder."""
    a = np.asarray(codes_a, dtype=np.int16)
    b = np.asarray(codes_b, dtype=np.int16)
    sa = np.where(a & 8, -(a & 7), a & 7)
    sb = np.where(b & 8, -(b & 7), b & 7)
    mism = ~code_matches(a.astype(np.uint8), b.astype(np.uint8))
    if not mism.any():
        return math.nan
    return float(np.mean(np.abs(sa[mism] - sb[mism]) == 1))


def _compare_codes(codes, packed_ref):
    """(codes int16 [R, W/2, 2], reference codes int16 [R, W/2, 2], mismatch bool [R, W/2, 2], +0 == -0) of
    `code_match_counts`'s arguments, checked as it says."""
    import torch

    c = torch.as_tensor(codes)
    ref = torch.as_tensor(packed_ref).to(c.device)
    if c.dtype != torch.uint8 or ref.dtype != torch.uint8 or c.dim() != 2 or ref.dim() != 2 \
            or c.shape[0] != ref.shape[0] or c.shape[1] != 2 * ref.shape[1]:
        raise ShapeMismatchError(f"codes {tuple(c.shape)} {c.dtype} and packed codes {tuple(ref.shape)} {ref.dtype}: need "
                         "uint8 [R, W] and [R, W/2]")
    a = torch.stack([c[:, 0::2], c[:, 1::2]], dim=-1).to(torch.int16)  # [R, W/2, 2]
    r = ref.to(torch.int16)
    b = torch.stack([r & 0x0F, r >> 4], dim=-1)
    return a, b, ~((a == b) | (((a & 7) == 0) & ((b & 7) == 0)))


def code_mismatch_mask(codes, packed_ref) -> torch.Tensor:
    """bool [R, W] on the codes' device: which values of ``codes`` differ from ``packed_ref`` (the arguments of
    `code_match_counts`, +0 and -0 matching). Raises what `code_match_counts` raises."""
    bad = _compare_codes(codes, packed_ref)[2]
    return bad.reshape(bad.shape[0], -1)


def code_match_counts(codes, packed_ref) -> torch.Tensor:
    """Compare effective codes ``codes`` (uint8 [R, W], one code per value) with reference codes packed two per
    byte ``packed_ref`` (uint8 [R, W/2], value 2j in the low nibble of byte j, as tracefp4 packs them).

    numpy arrays or torch tensors (on any device: the trainer counts where its codes are, on the GPU); the
    reference goes to the codes' device. Returns int64 [4] on that device: (matching values, values, mismatching
    values, mismatches one ladder step apart), +0 and -0 matching. Every value is compared (no data-dependent
    shapes), so nothing waits for the device until the caller reads the counts (the trainer sums its sites' and
    reads once). Raises `ShapeMismatchError` for codes that are not uint8 [R, W] with references uint8 [R, W/2]."""
    import torch

    a, b, bad = _compare_codes(codes, packed_ref)
    signed_a = torch.where((a & 8) > 0, -(a & 7), a & 7)  # sign-magnitude -> position on the signed ladder
    signed_b = torch.where((b & 8) > 0, -(b & 7), b & 7)
    n_bad = bad.sum()
    total = torch.full_like(n_bad, bad.numel())
    return torch.stack([total - n_bad, total, n_bad, (bad & ((signed_a - signed_b).abs() == 1)).sum()])


def count_code_matches(codes, packed_ref) -> tuple[int, int, int, int]:
    """`code_match_counts` read to the host: (matching values, values, mismatching values, mismatches one ladder
    step apart) as ints. Raises what `code_match_counts` raises."""
    m, t, bad, one = code_match_counts(codes, packed_ref).tolist()
    return m, t, bad, one


def scale_agreement(scales_a: np.ndarray, scales_b: np.ndarray) -> float:
    a, b = np.asarray(scales_a), np.asarray(scales_b)
    if a.shape != b.shape:
        raise ShapeMismatchError(f"scale arrays differ in shape: {a.shape} vs {b.shape}")
    return float((a == b).mean()) if a.size else math.nan


def router_flips(experts_a: np.ndarray, experts_b: np.ndarray) -> np.ndarray:
    """bool [T]: the set of routed experts differs (order within the top-k ignored)."""
    a = np.sort(np.asarray(experts_a), axis=-1)
    b = np.sort(np.asarray(experts_b), axis=-1)
    if a.shape != b.shape:
        raise ShapeMismatchError(f"expert arrays differ in shape: {a.shape} vs {b.shape}")
    return (a != b).any(axis=-1)


def router_flip_rate(pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """Flip rate over (token, layer) pairs; ``pairs`` holds one (experts_a, experts_b) per layer."""
    flips = [router_flips(a, b) for a, b in pairs]
    total = sum(f.size for f in flips)
    return float(sum(int(f.sum()) for f in flips) / total) if total else math.nan


def by_position(values: np.ndarray, positions: np.ndarray, edges: Sequence[int]) -> dict[str, float]:
    """Mean of ``values`` in position buckets [edges[i], edges[i+1]) (NaN values skipped)."""
    v = np.asarray(values, dtype=np.float64)
    p = np.asarray(positions)
    out = {}
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (p >= lo) & (p < hi) & np.isfinite(v)
        out[f"{lo}-{hi}"] = float(v[sel].mean()) if sel.any() else math.nan
    return out


def summarize_sites(per_site: Mapping[str, tuple[int, int]]) -> float:
    """Overall agreement from per-site (matching, total) counts."""
    m = sum(a for a, _ in per_site.values())
    t = sum(b for _, b in per_site.values())
    return m / t if t else math.nan
