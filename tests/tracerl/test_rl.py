"""GRPO math (`tracerl.train.loss`): hand-computed values and properties (clip-region gradients, zero-sum advantages)."""

from __future__ import annotations

import math

import pytest
import torch

from tracerl.errors import ConfigError
from tracerl.train import entropy_from_logits, group_advantages, policy_loss, token_logprobs


def test_group_advantages_hand_computed():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])
    a = group_advantages(r, 4, eps=0.0)
    # group 1: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3); group 2: all equal -> 0
    s = 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(a, torch.tensor([s, -s, -s, s, 0.0, 0.0, 0.0, 0.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(group_advantages(r, 4, scale="none"),
                               torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]), rtol=0, atol=0)
    # equal rewards whose mean rounds away from them (3 * 0.1 / 3 != 0.1 in fp32) still give exactly 0
    assert torch.equal(group_advantages(torch.full((3,), 0.1), 3, eps=0.0), torch.zeros(3))
    # G = 2: std of {a, b} is |a - b| / sqrt(2), so the advantages are +-1/sqrt(2) whatever the gap
    a2 = group_advantages(torch.tensor([3.0, 7.0]), 2, eps=0.0)
    torch.testing.assert_close(a2, torch.tensor([-1.0, 1.0]) / math.sqrt(2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("g", [2, 3, 5, 16])
@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_advantages_sum_to_zero_and_unit_std(g, scale):
    gen = torch.Generator().manual_seed(g)
    r = torch.randn(7 * g, generator=gen) * 3 + 1
    a = group_advantages(r, g, scale=scale, eps=0.0).reshape(7, g)
    torch.testing.assert_close(a.sum(dim=1), torch.zeros(7), rtol=0, atol=1e-5)
    if scale == "std":
        torch.testing.assert_close(a.std(dim=1), torch.ones(7), rtol=0, atol=1e-5)
    # the ranking within a group is the rewards' ranking
    assert torch.equal(a.argsort(dim=1), r.reshape(7, g).argsort(dim=1))


def test_group_advantages_errors():
    with pytest.raises(ConfigError, match="divide"):
        group_advantages(torch.zeros(7), 2)
    with pytest.raises(ConfigError, match=">= 2"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ConfigError, match="1-D"):
        group_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ConfigError, match="NaN"):
        group_advantages(torch.tensor([0.0, float("nan")]), 2)
    with pytest.raises(ConfigError, match="supported"):
        group_advantages(torch.zeros(4), 2, scale="rank")


def _lp(ratios, requires_grad=True):
    return torch.tensor([[math.log(r) for r in ratios]], requires_grad=requires_grad)


def test_policy_loss_positive_advantage_hand_computed():
    logp = _lp([1.5, 0.5, 1.1])
    old = torch.zeros(1, 3)
    loss, st = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3, dtype=torch.bool))
    # min(r, clip(r, 0.8, 1.2)) = 1.2, 0.5, 1.1 -> loss = -(2.8 / 3)
    assert loss.item() == pytest.approx(-2.8 / 3, abs=1e-6)
    loss.backward()
    # d(-r A)/dlogp = -r A / 3 where unclipped; the clipped token (r = 1.5 > 1.2 with A > 0) gets 0 exactly
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5 / 3, -1.1 / 3]]), rtol=0, atol=1e-6)
    assert logp.grad[0, 0].item() == 0.0
    assert st["clip_frac"] == pytest.approx(1 / 3) and st["clip_frac_high"] == pytest.approx(1 / 3)
    assert st["clip_frac_low"] == 0.0
    assert st["ratio_mean"] == pytest.approx(3.1 / 3, abs=1e-6)
    assert st["ratio_min"] == pytest.approx(0.5) and st["ratio_max"] == pytest.approx(1.5)
    k1 = -sum(math.log(r) for r in (1.5, 0.5, 1.1)) / 3
    k3 = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1)) / 3
    assert st["approx_kl_k1"] == pytest.approx(k1, abs=1e-6)
    assert st["approx_kl_k3"] == pytest.approx(k3, abs=1e-6)
    assert st["tokens"] == 3.0 and st["loss"] == pytest.approx(loss.item())


def test_policy_loss_negative_advantage_hand_computed():
    logp = _lp([1.5, 0.5, 1.1])
    loss, st = policy_loss(logp, torch.zeros(1, 3), torch.tensor([-1.0]), torch.ones(1, 3), clip_low=0.2)
    # min(-r, -clip(r)) = -max(r, clip(r)): -1.5, -0.8 (clipped: r = 0.5 < 0.8 with A < 0), -1.1
    assert loss.item() == pytest.approx(3.4 / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[1.5 / 3, 0.0, 1.1 / 3]]), rtol=0, atol=1e-6)
    assert st["clip_frac_low"] == pytest.approx(1 / 3) and st["clip_frac_high"] == 0.0


def test_clip_higher_asymmetric():
    logp = _lp([1.25, 1.25])
    adv = torch.tensor([[1.0, -1.0]])
    loss, st = policy_loss(logp, torch.zeros(1, 2), adv, torch.ones(1, 2), clip_low=0.2, clip_high=0.28)
    loss.backward()
    # r = 1.25 is inside [0.8, 1.28]: both tokens keep their gradient -r*A/2
    torch.testing.assert_close(logp.grad, torch.tensor([[-0.625, 0.625]]), rtol=0, atol=1e-6)
    assert st["clip_frac"] == 0.0


def test_clip_region_gradient_property():
    """Random ratios and advantages: the gradient is exactly 0 where the clip is active and -r*A/n elsewhere."""
    gen = torch.Generator().manual_seed(0)
    b, t = 6, 50
    logp = (torch.randn(b, t, generator=gen) * 0.4).requires_grad_()
    old = torch.randn(b, t, generator=gen) * 0.1
    adv = torch.randn(b, t, generator=gen)
    mask = torch.rand(b, t, generator=gen) < 0.8
    loss, st = policy_loss(logp, old, adv, mask, clip_low=0.1, clip_high=0.3)
    loss.backward()
    r = torch.exp(logp.detach() - old)
    active = mask & (((adv > 0) & (r > 1.3)) | ((adv < 0) & (r < 0.9)))
    assert active.any() and (mask & ~active).any()
    assert torch.all(logp.grad[active] == 0)
    assert torch.all(logp.grad[~mask] == 0)
    want = -(r * adv) / mask.sum()
    torch.testing.assert_close(logp.grad[mask & ~active], want[mask & ~active], rtol=1e-5, atol=1e-7)
    assert st["clip_frac"] == pytest.approx(active.sum().item() / mask.sum().item())


def test_dual_clip_hand_computed():
    logp = _lp([5.0, 2.0, 5.0])
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, st = policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=3.0)
    # A < 0: max(min(-r, -clip(r)), -3): r = 5 -> -3 (dual-clipped), r = 2 -> -2; A > 0, r = 5 -> 1.2 (clipped)
    assert loss.item() == pytest.approx(-(-3 - 2 + 1.2) / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 2.0 / 3, 0.0]]), rtol=0, atol=1e-6)
    assert st["clip_frac_dual"] == pytest.approx(1 / 3) and st["clip_frac"] == pytest.approx(2 / 3)
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), clip_ratio_c=1.0)


def test_extreme_log_ratio_stays_finite():
    logp = torch.tensor([[200.0, -200.0]], requires_grad=True)  # log r far outside fp32's exp range
    loss, st = policy_loss(logp, torch.zeros(1, 2), torch.tensor([[-1.0, 1.0]]), torch.ones(1, 2))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert st["ratio_max"] == pytest.approx(math.exp(20.0), rel=1e-5)


def test_aggregation_token_vs_sequence():
    # sequence 0 has 1 token with per-token loss -2 (r = 1, A = 2); sequence 1 has 3 tokens with loss -1 each
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([2.0, 1.0])
    mask = torch.tensor([[1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    tok, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, agg="token-mean")
    seq, _ = policy_loss(logp, torch.zeros(2, 3), adv, mask, agg="seq-mean-token-mean")
    assert tok.item() == pytest.approx(-(2 + 3) / 4)
    assert seq.item() == pytest.approx(-(2 + 1) / 2)


def test_tis_weights_hand_computed():
    logp = torch.zeros(1, 3, requires_grad=True)  # r = 1 everywhere, so the surrogate is -A per token
    old = torch.zeros(1, 3)
    rollout = torch.tensor([[math.log(0.5), 0.0, math.log(4.0)]])  # w = exp(old - rollout) = 2, 1, 0.25
    loss, st = policy_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 3), logp_rollout=rollout, tis_cap=1.5)
    # truncated weights 1.5, 1, 0.25
    assert loss.item() == pytest.approx(-(1.5 + 1 + 0.25) / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, -torch.tensor([[1.5, 1.0, 0.25]]) / 3, rtol=0, atol=1e-6)
    assert st["tis_weight_mean"] == pytest.approx(2.75 / 3, abs=1e-6)
    assert st["tis_trunc_frac"] == pytest.approx(1 / 3)
    d = [math.log(2.0), 0.0, math.log(0.25)]
    assert st["mismatch_k3"] == pytest.approx(sum(math.exp(x) - 1 - x for x in d) / 3, abs=1e-6)
    assert st["mismatch_abs"] == pytest.approx(sum(abs(x) for x in d) / 3, abs=1e-6)
    # without a cap the rollout log-probs only feed the statistics
    loss2, st2 = policy_loss(torch.zeros(1, 3), old, torch.tensor([1.0]), torch.ones(1, 3), logp_rollout=rollout)
    assert loss2.item() == pytest.approx(-1.0) and "tis_weight_mean" not in st2 and "mismatch_k3" in st2


def test_kl_penalty_and_entropy_bonus():
    logp = torch.tensor([[0.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-0.5, -1.0]])
    ent = torch.tensor([[2.0, 1.0]], requires_grad=True)
    loss, st = policy_loss(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 2), logp_ref=ref, kl_coef=0.1,
                           entropy=ent, entropy_coef=0.01)
    d = torch.tensor([-0.5, 0.0])  # ref - logp
    k3 = (torch.exp(d) - 1 - d).mean().item()
    assert st["kl_ref_k3"] == pytest.approx(k3, abs=1e-6)
    assert st["entropy"] == pytest.approx(1.5)
    assert loss.item() == pytest.approx(0.1 * k3 - 0.01 * 1.5, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp); the advantage is 0 so only the penalty moves logp
    torch.testing.assert_close(logp.grad, 0.1 * (1 - torch.exp(d))[None] / 2, rtol=0, atol=1e-6)
    torch.testing.assert_close(ent.grad, torch.full((1, 2), -0.01 / 2), rtol=0, atol=1e-7)


def test_padding_nan_does_not_leak():
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.2, float("nan")]])
    rollout = torch.tensor([[-1.1, float("-inf")]])
    mask = torch.tensor([[True, False]])
    loss, st = policy_loss(logp, old, torch.tensor([1.0]), mask, logp_rollout=rollout, tis_cap=2.0)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0
    assert all(math.isfinite(v) for v in st.values())


def test_empty_mask():
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, st = policy_loss(logp, torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3))
    loss.backward()
    assert loss.item() == 0.0 and torch.all(logp.grad == 0)
    assert st["tokens"] == 0.0 and math.isnan(st["ratio_mean"]) and math.isnan(st["clip_frac"])


def test_policy_loss_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ConfigError, match="logp_old"):
        policy_loss(z, torch.zeros(2, 4), torch.zeros(2), z)
    with pytest.raises(ConfigError, match="advantages"):
        policy_loss(z, z, torch.zeros(3), z)
    with pytest.raises(ConfigError, match="aggregation"):
        policy_loss(z, z, torch.zeros(2), z, agg="sum")
    with pytest.raises(ConfigError, match="tis_cap"):
        policy_loss(z, z, torch.zeros(2), z, tis_cap=2.0)
    with pytest.raises(ConfigError, match="tis_cap"):
        policy_loss(z, z, torch.zeros(2), z, tis_cap=0.0, logp_rollout=z)
    with pytest.raises(ConfigError, match="clip"):
        policy_loss(z, z, torch.zeros(2), z, clip_low=-0.1)
    with pytest.raises(ConfigError, match="logp_ref"):
        policy_loss(z, z, torch.zeros(2), z, kl_coef=0.1)
    with pytest.raises(ConfigError, match=r"\[B, T\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3))


def test_token_logprobs_and_entropy_match_definitions():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 11, generator=gen, dtype=torch.float64).to(torch.bfloat16)
    tokens = torch.randint(0, 11, (3, 5), generator=gen)
    ls = torch.log_softmax(logits.float(), dim=-1)
    torch.testing.assert_close(token_logprobs(logits, tokens), ls.gather(-1, tokens[..., None]).squeeze(-1),
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy_from_logits(logits), -(ls.exp() * ls).sum(-1), rtol=0, atol=1e-5)
    # a uniform distribution over V has entropy log V
    assert entropy_from_logits(torch.zeros(1, 1, 11)).item() == pytest.approx(math.log(11), abs=1e-6)
