"""RolloutRecorder: per-step capture -> per-request pieces, bounded buffering, completeness rules."""

import numpy as np
import pytest
import torch

from tracerl.errors import RecorderError
from tracerl.rollout import NO_EXPERT, MemorySink, RolloutRecorder

W = 32  # site width: 4 hint bytes, 2 scale bytes per token


def _payload(rid_index, pos):
    """Deterministic per-(request, position) payload so reads can be checked exactly."""
    base = (rid_index * 1000 + np.asarray(pos)) % 251
    hints = torch.as_tensor(np.stack([base + j for j in range(W // 8)], -1).astype(np.uint8))
    scales = torch.as_tensor(np.stack([base * 2 % 251 + j for j in range(W // 16)], -1).astype(np.uint8))
    return hints, scales


def _run(sink, n_req=3, prompt=5, gen=40, flush_tokens=8, drain_every=3, feed_last=True):
    rec = RolloutRecorder(sink, {"s": W}, moe_layers=["L0"], top_k=2, flush_tokens=flush_tokens,
                          drain_every=drain_every)
    rids = [f"r{i}" for i in range(n_req)]
    for r in rids:
        rec.begin(r, policy_version=7)
    # prefill: all prompt positions of every request in one step
    rows = [(i, p) for i in range(n_req) for p in range(prompt)]
    ridx = [rids[i] for i, _ in rows]
    pos = [p for _, p in rows]
    rec.record_tokens(ridx, pos, torch.tensor([100 + p for p in pos]), torch.full((len(pos),), float("nan")))
    h, s = _payload(np.array([i for i, _ in rows]), pos)
    rec.record_sites(ridx, pos, "s", h, s)
    rec.record_experts(ridx, pos, "L0", torch.tensor([[p % 4, 4 + p % 4] for p in pos]))
    rec.step()
    for step in range(gen):
        p = prompt + step
        rec.record_tokens(rids, [p] * n_req, torch.full((n_req,), 100 + p), torch.full((n_req,), -0.5))
        if step < gen - 1 or feed_last:
            h, s = _payload(np.arange(n_req), [p] * n_req)
            rec.record_sites(rids, [p] * n_req, "s", h, s)
            rec.record_experts(rids, [p] * n_req, "L0", torch.tensor([[p % 4, 4 + p % 4]] * n_req))
        rec.step()
    for r in rids:
        rec.end(r)
    return rec


def test_pieces_reassemble_exactly():
    sink = MemorySink({"s": W})
    rec = _run(sink)
    assert rec.tokens_written == 3 * 45
    for i in range(3):
        got = sink.read(f"r{i}")
        n = len(got.token_ids)
        assert n == 45
        h, s = _payload(np.full(n, i), np.arange(n))
        np.testing.assert_array_equal(got.hints["s"], h.numpy())
        np.testing.assert_array_equal(got.scales["s"], s.numpy())
        np.testing.assert_array_equal(got.token_ids, 100 + np.arange(n))
        assert np.isnan(got.logprobs[:5]).all() and (got.logprobs[5:] == -0.5).all()
        np.testing.assert_array_equal(got.experts["L0"][:, 0], np.arange(n) % 4)
        assert (got.policy_version == 7).all()
        # flushed in pieces of >= flush_tokens complete rows, not at the end only
        assert len(sink._pieces[f"r{i}"]) > 2


def test_buffer_stays_bounded():
    sink = MemorySink({"s": W})
    rec = _run(sink, gen=200, flush_tokens=8)
    assert rec._cap == 16  # never had to grow: complete rows are flushed as they accumulate


def test_unfed_last_token_written_with_sentinels():
    sink = MemorySink({"s": W})
    _run(sink, gen=10, feed_last=False)
    got = sink.read("r1")
    assert len(got.token_ids) == 15
    assert (got.scales["s"][-1] == 0).all() and (got.hints["s"][-1] == 0).all()
    assert (got.experts["L0"][-1] == NO_EXPERT).all()
    assert (got.scales["s"][-2] != 0).any()


def test_errors_name_what_is_wrong():
    rec = RolloutRecorder(MemorySink({"s": W}), {"s": W})
    with pytest.raises(RecorderError, match="not begun"):
        rec.record_tokens(["x"], [0], torch.tensor([1]), torch.tensor([0.0]))
    rec.begin("x")
    with pytest.raises(RecorderError, match="already begun"):
        rec.begin("x")
    with pytest.raises(RecorderError, match="not recorded"):
        rec.record_sites(["x"], [0], "other", torch.zeros(1, 4, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.uint8))
    with pytest.raises(RecorderError, match="must all match"):
        rec.record_tokens(["x", "x"], [0], torch.tensor([1, 2]), torch.tensor([0.0, 0.0]))
