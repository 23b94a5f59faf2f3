"""Fidelity metric math on hand-computed cases."""

import math

import numpy as np
import pytest

from tracerl import fidelity


def test_dlogp_stats_hand_computed():
    train = np.array([-1.0, -2.0, -3.0, np.nan])
    roll = np.array([-1.5, -2.0, -2.0, -1.0])
    st = fidelity.dlogp_stats(train, roll)  # deltas 0.5, 0, -1 (NaN row skipped)
    assert st["tokens"] == 3
    assert st["mean_abs_dlogp"] == pytest.approx(0.5)
    assert st["max_abs_dlogp"] == pytest.approx(1.0)
    # numpy's linear percentile of |d| = [0, 0.5, 1] at 99%: 0.5 + 0.98 * 0.5
    assert st["p99_abs_dlogp"] == pytest.approx(0.99)
    k3 = np.mean([math.exp(0.5) - 1 - 0.5, 0.0, math.exp(-1) - 1 + 1])
    assert st["k3"] == pytest.approx(k3)
    assert st["extreme_frac"] == pytest.approx(1 / 3)  # |d| = 1 > ln 2; 0.5 < ln 2


def test_dlogp_stats_empty_and_shape_error():
    st = fidelity.dlogp_stats(np.array([np.nan]), np.array([0.0]))
    assert st["tokens"] == 0 and math.isnan(st["mean_abs_dlogp"])
    with pytest.raises(ValueError, match="shape"):
        fidelity.dlogp_stats(np.zeros(2), np.zeros(3))


def test_k3_nonnegative_and_quadratic_for_small_delta():
    d = np.linspace(-1e-3, 1e-3, 11)
    st = fidelity.dlogp_stats(d, np.zeros_like(d))
    assert st["k3"] >= 0
    assert st["k3"] == pytest.approx(np.mean(d**2) / 2, rel=1e-3)


def test_code_agreement_counts_signed_zeros_equal():
    a = np.array([[0, 8, 3, 11, 7]], dtype=np.uint8)
    b = np.array([[8, 0, 3, 3, 6]], dtype=np.uint8)
    # +0/-0 match twice, 3 == 3, 11 (-1.5) != 3 (+1.5), 7 != 6
    assert fidelity.code_agreement(a, b) == pytest.approx(3 / 5)
    # mismatches: (11 vs 3) is -1.5 vs +1.5 (3 steps on the signed ladder), (7 vs 6) is one step
    assert fidelity.one_step_share(a, b) == pytest.approx(1 / 2)


def test_one_step_share_across_zero():
    # +0.5 (code 1) vs -0.5 (code 9): signed ladder indices +1 and -1, two steps apart; 0 vs 9: one step.
    assert fidelity.one_step_share(np.array([1], np.uint8), np.array([9], np.uint8)) == 0.0
    assert fidelity.one_step_share(np.array([0], np.uint8), np.array([9], np.uint8)) == 1.0
    assert math.isnan(fidelity.one_step_share(np.array([2], np.uint8), np.array([2], np.uint8)))


def test_scale_agreement():
    assert fidelity.scale_agreement(np.array([[1, 2], [3, 4]]), np.array([[1, 2], [3, 5]])) == 0.75


def test_router_flips_ignore_order():
    a = np.array([[1, 2], [3, 4], [5, 6]])
    b = np.array([[2, 1], [3, 5], [5, 6]])
    assert fidelity.router_flips(a, b).tolist() == [False, True, False]
    rate = fidelity.router_flip_rate([(a, b), (a, a)])  # 1 flip over 6 (token, layer) pairs
    assert rate == pytest.approx(1 / 6)


def test_by_position_buckets():
    vals = np.array([1.0, 2.0, 3.0, np.nan, 5.0])
    pos = np.array([0, 1, 10, 11, 20])
    out = fidelity.by_position(vals, pos, [0, 10, 20, 30])
    assert out == {"0-10": 1.5, "10-20": 3.0, "20-30": 5.0}


def test_summarize_sites():
    assert fidelity.summarize_sites({"a": (9, 10), "b": (1, 10)}) == 0.5


def test_count_code_matches_against_unpacked_reference():
    """Packed-byte comparison (numpy and torch inputs) = value-by-value comparison of unpacked codes, with +0 == -0
    and the one-step count on the signed ladder."""
    import torch

    from tracerl.fidelity import code_match_counts, code_matches, count_code_matches

    rng = np.random.default_rng(0)
    ref = rng.integers(0, 16, (37, 64), dtype=np.uint8)
    codes = ref.copy()
    flip = rng.random(ref.shape) < 0.2
    codes[flip] = rng.integers(0, 16, int(flip.sum()), dtype=np.uint8)
    codes[0, :4], ref[0, :4] = [0, 8, 1, 9], [8, 0, 2, 1]  # +0/-0 match; 1 vs 2 one step; -0.5 vs +0.5 two
    packed = (ref[:, 0::2] | (ref[:, 1::2] << 4)).astype(np.uint8)
    match = code_matches(codes, ref)
    signed = lambda x: np.where(x & 8, -(x.astype(int) & 7), x & 7)  # noqa: E731
    one = int((~match & (np.abs(signed(codes) - signed(ref)) == 1)).sum())
    want = (int(match.sum()), codes.size, int((~match).sum()), one)
    assert count_code_matches(codes, packed) == want
    assert count_code_matches(torch.from_numpy(codes), torch.from_numpy(packed)) == want
    dev = code_match_counts(torch.from_numpy(codes), packed)  # the trainer's sync-free form: a tensor [4]
    assert dev.dtype == torch.int64 and tuple(dev.tolist()) == want
    assert code_match_counts(codes[:0], packed[:0]).tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError):
        count_code_matches(codes, packed[:, :-1])
