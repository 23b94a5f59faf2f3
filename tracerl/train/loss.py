"""GRPO-style policy-gradient math as pure torch functions (no model, no store, no device assumptions).

Notation: B sequences (trajectories) of up to T scored tokens each, right-padded; ``mask`` [B, T] marks the
response tokens that the loss sees. Per token three log-probabilities of the sampled token can exist:

* ``logp`` — the policy being trained, with gradient (this step's forward);
* ``logp_old`` — the policy that the PPO ratio is taken against (no gradient);
* ``logp_rollout`` — what the rollout engine recorded while sampling (FP4 decode; stored in the trace store).

Two ways to use them (`policy_loss`):

1. PPO ratio against the rollout: pass the rollout's log-probs as ``logp_old``; ratio = exp(logp - logp_rollout).
2. Truncated importance sampling (TIS): ``logp_old`` is the trainer's own recompute of the sampling policy
   (training numerics), and each token's surrogate is weighted by w = min(exp(logp_old - logp_rollout), C),
   which corrects for the rollout/trainer mismatch with a bounded weight (Yao et al., "Your efficient RL framework
   secretly brings you off-policy RL training", 2025).

Group-relative advantages (Shao et al., DeepSeekMath, 2024): each prompt is sampled G times; a sample's
advantage is its reward minus the group's mean, optionally divided by the group's standard deviation.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from tracerl.errors import ConfigError

AGGREGATIONS = ("token-mean", "seq-mean-token-mean")
ADV_SCALES = ("std", "none")


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "std", eps: float = 1e-6) -> torch.Tensor:
    """Group-normalized advantages.

    Args:
        rewards: float [B] with B = P * group_size, the G samples of each prompt adjacent
            (samples ``[p*G, (p+1)*G)`` belong to prompt p).
        group_size: G >= 2 (a group of one has no baseline).
        scale: ``"std"``: A = (r - mean_g) / (std_g + eps) with the unbiased (Bessel) standard deviation, as
            DeepSeekMath/TRL; ``"none"``: A = r - mean_g (Dr. GRPO: no per-group rescaling, so a group whose
            rewards barely differ does not get its noise amplified).
        eps: added to the std; a group whose rewards are all equal gets A = 0 either way.

    Returns:
        float32 [B]; the advantages of each group sum to 0 (up to rounding).

    Raises:
        ConfigError: rewards not 1-D, B not a multiple of G, G < 2, non-finite rewards, unknown ``scale``.
    """
    if scale not in ADV_SCALES:
        raise ConfigError(f"advantage scale {scale!r}; supported: {', '.join(ADV_SCALES)}")
    if rewards.dim() != 1:
        raise ConfigError(f"rewards must be 1-D [B], got shape {tuple(rewards.shape)}")
    if group_size < 2 or rewards.numel() % group_size:
        raise ConfigError(f"group_size={group_size} must be >= 2 and divide the {rewards.numel()} rewards")
    r = rewards.detach().float().reshape(-1, group_size)  # (P, G)
    if not bool(torch.isfinite(r).all()):
        raise ConfigError("rewards contain NaN or Inf")
    adv = r - r.mean(dim=1, keepdim=True)
    if scale == "std":
        adv = adv / (r.std(dim=1, keepdim=True) + eps)
    # A group of equal rewards carries no signal; its mean can round away from the common value, and dividing
    # that rounding error by a ~0 std would turn it into a large advantage.
    flat = r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(adv), adv).reshape(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log p(tokens) under ``logits``: float32 [B, T] from logits [B, T, V] (any float dtype) and ids [B, T].

    ``logits[:, t]`` must already be the distribution of ``tokens[:, t]`` (shift before calling). Computed in
    fp32 as logit - logsumexp, which needs no [B, T, V] log-softmax buffer for the gather."""
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of each position's distribution: float32 [B, T] from logits [B, T, V]; H = lse - sum(p * logit)."""
    logits = logits.float()
    p = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (p * logits).sum(dim=-1)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor, agg: str) -> torch.Tensor:
    """Mean of x [B, T] over mask [B, T] (float 0/1): over all tokens, or per sequence then over sequences that
    have at least one token."""
    if agg == "token-mean":
        return (x * mask).sum() / mask.sum().clamp(min=1.0)
    per_seq = (x * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)  # (B,)
    has = (mask.sum(dim=1) > 0).float()
    return (per_seq * has).sum() / has.sum().clamp(min=1.0)


def _check_shape(name: str, t: torch.Tensor | None, shape: torch.Size) -> None:
    if t is not None and t.shape != shape:
        raise ConfigError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)} like logp")


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    clip_ratio_c: float | None = None,
    agg: str = "token-mean",
    logp_rollout: torch.Tensor | None = None,
    tis_cap: float | None = None,
    logp_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate loss (to minimize) with optional TIS, KL-to-reference penalty and entropy bonus, in named
    parts: `ppo_clip_surrogate`, `rollout_mismatch` (TIS weights), `kl_to_reference`, the entropy bonus, and the
    statistics.

    Per token, with r = exp(logp - logp_old) and advantage A:
        loss_t = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * k3_ref - entropy_coef * H
    where w = min(exp(logp_old - logp_rollout), tis_cap) with TIS and 1 without, k3_ref = exp(d) - 1 - d with
    d = logp_ref - logp (an unbiased, non-negative estimate of KL(policy || ref), DeepSeekMath eq. 4). The
    gradient of the surrogate is zero where the clipped branch is taken: r > 1 + clip_high with A > 0, or
    r < 1 - clip_low with A < 0. Setting clip_high > clip_low is DAPO's "clip-higher". With ``clip_ratio_c``
    (dual-clip PPO, Ye et al. 2020) a token with A < 0 contributes at most -clip_ratio_c * A: a very large ratio
    on a bad token (a stale or mismatched rollout) cannot dominate the batch; its gradient is zero there too.
    log r is clamped to [-20, 20] before the exp so that a wild token gives a large finite ratio, not inf/NaN.

    Args:
        logp: float [B, T], with gradient: log-prob of each sampled token under the trained policy.
        logp_old: float [B, T], no gradient: the ratio's denominator (the rollout's log-probs, or with TIS the
            trainer's recompute of the sampling policy). Masked-out positions may hold anything (NaN too).
        advantages: float [B] (one per sequence, broadcast over its tokens) or [B, T].
        mask: bool or 0/1 float [B, T]: tokens that count.
        clip_low, clip_high: epsilons of the clip range [1 - clip_low, 1 + clip_high]; >= 0.
        clip_ratio_c: dual-clip bound (> 1) for tokens with negative advantage; None: off.
        agg: ``"token-mean"`` (every token of the batch weighs the same; DAPO) or ``"seq-mean-token-mean"``
            (mean per sequence, then over sequences; the original GRPO, where long responses weigh less per token).
        logp_rollout: float [B, T]: the rollout engine's log-probs; needed by ``tis_cap``; with it, the stats
            also report the rollout/trainer mismatch (``mismatch_k3``, ``mismatch_abs``).
        tis_cap: C > 0 of truncated importance sampling; None: no TIS.
        logp_ref: float [B, T], no gradient: a reference policy's log-probs for the KL penalty (with ``kl_coef``).
        entropy: float [B, T] per-token entropy (with gradient for a bonus); reported as ``entropy``.

    Returns:
        (loss, stats): a scalar tensor (differentiable through ``logp``, and ``entropy`` if a bonus is used) and
        a dict of floats over the masked tokens: ``loss``, ``pg_loss``, ``ratio_mean``, ``ratio_min``,
        ``ratio_max``, ``clip_frac`` (tokens whose gradient the clip zeroes), ``clip_frac_low``,
        ``clip_frac_high``, ``clip_frac_dual`` (tokens the dual clip bounds), ``approx_kl_k1`` (mean
        logp_old - logp), ``approx_kl_k3`` (mean of r - 1 - log r, an estimate of KL(old || policy)), ``tokens``;
        with TIS ``tis_weight_mean``, ``tis_trunc_frac``; with ``logp_rollout`` ``mismatch_k3`` (mean of
        exp(d) - 1 - d, d = logp_old - logp_rollout) and ``mismatch_abs`` (mean |d|); with ``logp_ref``
        ``kl_ref_k3``; with ``entropy`` ``entropy``. Statistics of an empty mask are NaN (the loss is then 0).
        All floats come to the host in one transfer.

    Raises:
        ConfigError: shape mismatches, negative clip epsilons, ``clip_ratio_c`` <= 1, unknown ``agg``,
            ``tis_cap`` <= 0 or without ``logp_rollout``, a coefficient without its tensor.
    """
    _check_loss_inputs(logp, logp_old, advantages, mask, clip_low=clip_low, clip_high=clip_high,
                       clip_ratio_c=clip_ratio_c, agg=agg, logp_rollout=logp_rollout, tis_cap=tis_cap,
                       logp_ref=logp_ref, kl_coef=kl_coef, entropy=entropy, entropy_coef=entropy_coef)
    m = mask.to(torch.bool)
    mf = m.float()
    zero = torch.zeros((), dtype=torch.float32, device=logp.device)
    # Masked-out positions are replaced before any exp so that padding (NaN, -inf) cannot reach the loss or its
    # gradient: 0 * NaN is NaN, and torch.where's gradient is zero on the branch not taken.
    lp = torch.where(m, logp.float(), zero)
    lp_old = torch.where(m, logp_old.detach().float(), zero)
    adv = advantages.detach().float()
    adv = torch.where(m, adv[:, None] if adv.dim() == 1 else adv, zero)  # (B, T)

    ppo = ppo_clip_surrogate(lp, lp_old, adv, m, clip_low=clip_low, clip_high=clip_high, clip_ratio_c=clip_ratio_c)
    per_token = -ppo.surrogate
    stats_t: dict[str, torch.Tensor] = {}
    if logp_rollout is not None:
        weight, rollout_stats = rollout_mismatch(lp_old, torch.where(m, logp_rollout.detach().float(), zero), mf,
                                                 tis_cap)
        stats_t.update(rollout_stats)
        if weight is not None:
            per_token = per_token * weight
    pg_loss = _masked_mean(per_token, mf, agg)
    loss = pg_loss
    if logp_ref is not None:
        kl_ref = kl_to_reference(lp, torch.where(m, logp_ref.detach().float(), zero), mf, agg)
        stats_t["kl_ref_k3"] = kl_ref.detach()
        if kl_coef:
            loss = loss + kl_coef * kl_ref
    if entropy is not None:
        ent = _masked_mean(torch.where(m, entropy.float(), zero), mf, agg)
        stats_t["entropy"] = ent.detach()
        if entropy_coef:
            loss = loss - entropy_coef * ent
    return loss, _loss_stats(loss, pg_loss, ppo, m, mf, stats_t)


def _check_loss_inputs(logp, logp_old, advantages, mask, *, clip_low, clip_high, clip_ratio_c, agg, logp_rollout,
                       tis_cap, logp_ref, kl_coef, entropy, entropy_coef) -> None:
    """Raise `ConfigError` for what `policy_loss` cannot compute (see its Raises)."""
    shape = logp.shape
    if logp.dim() != 2:
        raise ConfigError(f"logp must be [B, T], got shape {tuple(shape)}")
    for name, t in (("logp_old", logp_old), ("mask", mask), ("logp_rollout", logp_rollout),
                    ("logp_ref", logp_ref), ("entropy", entropy)):
        _check_shape(name, t, shape)
    if advantages.shape not in (shape, shape[:1]):
        raise ConfigError(f"advantages have shape {tuple(advantages.shape)}; expected [B] = {tuple(shape[:1])} "
                          f"or [B, T] = {tuple(shape)}")
    if agg not in AGGREGATIONS:
        raise ConfigError(f"aggregation {agg!r}; supported: {', '.join(AGGREGATIONS)}")
    if clip_low < 0 or clip_high < 0 or not (math.isfinite(clip_low) and math.isfinite(clip_high)):
        raise ConfigError(f"clip epsilons must be finite and >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ConfigError(f"clip_ratio_c={clip_ratio_c} must be > 1 (or None)")
    if tis_cap is not None and (logp_rollout is None or not tis_cap > 0):
        raise ConfigError(f"tis_cap={tis_cap} needs a positive cap and logp_rollout")
    if kl_coef and logp_ref is None:
        raise ConfigError(f"kl_coef={kl_coef} needs logp_ref")
    if entropy_coef and entropy is None:
        raise ConfigError(f"entropy_coef={entropy_coef} needs entropy")


@dataclasses.dataclass(frozen=True)
class PPOClip:
    """What `ppo_clip_surrogate` computes per token [B, T]: the objective to maximize, log r (clamped) and r, and
    the masks of the tokens whose gradient a clip zeroes."""

    surrogate: torch.Tensor
    log_ratio: torch.Tensor
    ratio: torch.Tensor
    clip_high: torch.Tensor  # A > 0, r > 1 + clip_high
    clip_low: torch.Tensor  # A < 0, r < 1 - clip_low
    clip_dual: torch.Tensor  # A < 0, r > clip_ratio_c (dual clip)


def ppo_clip_surrogate(lp: torch.Tensor, lp_old: torch.Tensor, adv: torch.Tensor, m: torch.Tensor, *,
                       clip_low: float, clip_high: float, clip_ratio_c: float | None) -> PPOClip:
    """The PPO-clip objective per token (masked-out positions already zeroed; ``m`` the bool mask [B, T]):

        r = exp(clamp(lp - lp_old, -20, 20)),  surrogate = min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A)

    and with ``clip_ratio_c`` (dual-clip PPO) for A < 0: surrogate = max(surrogate, clip_ratio_c * A)."""
    log_ratio = (lp - lp_old).clamp(-20.0, 20.0)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    surr = torch.minimum(ratio * adv, clipped * adv)  # the PPO objective per token (to maximize)
    clip_hi = m & (adv > 0) & (ratio > 1.0 + clip_high)
    clip_lo = m & (adv < 0) & (ratio < 1.0 - clip_low)
    clip_dual = torch.zeros_like(m)
    if clip_ratio_c is not None:
        # for A < 0 the PPO term is -max(r, clip(r)) * |A|, unbounded in r; dual clip: at least c * A
        clip_dual = m & (adv < 0) & (ratio > clip_ratio_c)
        surr = torch.where(adv < 0, torch.maximum(surr, clip_ratio_c * adv), surr)
    return PPOClip(surr, log_ratio, ratio, clip_hi, clip_lo, clip_dual)


def rollout_mismatch(lp_old: torch.Tensor, lp_rollout: torch.Tensor, mf: torch.Tensor,
                     tis_cap: float | None) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The rollout/trainer mismatch d = lp_old - lp_rollout [B, T] over the mask ``mf``: its k3 (mean of
    e^d - 1 - d) and mean |d|, and with ``tis_cap`` the truncated importance weights w = min(e^d, C) (returned;
    None without) with their mean and the share of tokens truncated."""
    d_roll = lp_old - lp_rollout
    stats = {"mismatch_k3": _masked_mean(torch.expm1(d_roll) - d_roll, mf, "token-mean"),
             "mismatch_abs": _masked_mean(d_roll.abs(), mf, "token-mean")}
    if tis_cap is None:
        return None, stats
    w_raw = torch.exp(d_roll)
    w = w_raw.clamp(max=tis_cap)
    stats["tis_weight_mean"] = _masked_mean(w, mf, "token-mean")
    stats["tis_trunc_frac"] = _masked_mean((w_raw > tis_cap).float(), mf, "token-mean")
    return w, stats


def kl_to_reference(lp: torch.Tensor, lp_ref: torch.Tensor, mf: torch.Tensor, agg: str) -> torch.Tensor:
    """The k3 estimate of KL(policy || ref) over the mask: mean of e^d - 1 - d with d = lp_ref - lp (unbiased and
    non-negative; DeepSeekMath eq. 4), aggregated as ``agg``; differentiable through ``lp``."""
    d_ref = lp_ref - lp
    return _masked_mean(torch.expm1(d_ref) - d_ref, mf, agg)


def _loss_stats(loss: torch.Tensor, pg_loss: torch.Tensor, ppo: PPOClip, m: torch.Tensor, mf: torch.Tensor,
                stats_t: dict[str, torch.Tensor]) -> dict[str, float]:
    """`policy_loss`'s statistics over the masked tokens (NaN for an empty mask), brought to the host in one
    transfer."""
    n_tok = mf.sum()
    nan = torch.full((), float("nan"), device=loss.device)

    def tok_mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(n_tok > 0, (x * mf).sum() / n_tok.clamp(min=1.0), nan)

    lr_d = ppo.log_ratio.detach()
    r_d = ppo.ratio.detach()
    big = torch.full_like(r_d, float("inf"))
    stats_t.update(
        loss=loss.detach(),
        pg_loss=pg_loss.detach(),
        ratio_mean=tok_mean(r_d),
        ratio_min=torch.where(n_tok > 0, torch.where(m, r_d, big).amin(), nan),
        ratio_max=torch.where(n_tok > 0, torch.where(m, r_d, -big).amax(), nan),
        clip_frac=tok_mean((ppo.clip_high | ppo.clip_low | ppo.clip_dual).float()),
        clip_frac_low=tok_mean(ppo.clip_low.float()),
        clip_frac_high=tok_mean(ppo.clip_high.float()),
        clip_frac_dual=tok_mean(ppo.clip_dual.float()),
        approx_kl_k1=tok_mean(-lr_d),
        approx_kl_k3=tok_mean(torch.expm1(lr_d) - lr_d),
        tokens=n_tok,
    )
    for k in ("mismatch_k3", "mismatch_abs", "tis_weight_mean", "tis_trunc_frac", "kl_ref_k3", "entropy"):
        if k in stats_t:  # the shared masked mean returns 0 for an empty mask; report NaN like the others
            stats_t[k] = torch.where(n_tok > 0, stats_t[k].float(), nan)
    keys = list(stats_t)
    values = torch.stack([stats_t[k].float() for k in keys]).tolist()  # one device -> host transfer
    return dict(zip(keys, values))
