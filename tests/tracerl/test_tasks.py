"""Tasks with verifiable rewards (`tracerl.policy.tasks`): prompts, rewards by hand, chance levels, and a short GRPO run
on a tiny model whose reward must rise."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tracerl.train import loss as rl
from tracerl.errors import ConfigError
from tracerl.policy import BOS, FIRST, SEP, TASKS, CopyTask, TargetSetTask, make_task


@pytest.mark.parametrize("task", [CopyTask(alphabet=5, prompt_len=4), TargetSetTask(alphabet=8, prompt_len=3),
                                  TargetSetTask(alphabet=6, prompt_len=5, target=[0, 5])])
def test_prompts_are_seeded_and_well_formed(task):
    a = task.prompts(20, seed=7)
    assert a == task.prompts(20, seed=7)
    assert task.prompts(5, seed=7) == a[:5]  # a prefix of the same seed
    assert a != task.prompts(20, seed=8)
    for p in a:
        assert len(p) == task.prompt_tokens and p[0] == BOS and p[-1] == SEP
        assert all(FIRST <= t < task.vocab_size for t in p[1:-1])
    assert task.vocab_size == task.alphabet + 2
    assert task.prompts(0, seed=0) == []


def test_copy_rewards_by_hand():
    t = CopyTask(alphabet=4, prompt_len=4)
    p = [BOS, 2, 5, 3, 3, SEP]
    assert t.reward(p, [2, 5, 3, 3]).reward == 1.0
    r = t.reward(p, [2, 4, 3, 0])
    assert r.reward == 0.5 and r.token_rewards == (1.0, 0.0, 1.0, 0.0)
    assert t.reward(p, [2]).token_rewards == (1.0, 0.0, 0.0, 0.0)  # a short response: missing positions score 0
    assert t.reward(p, [2, 5, 3, 3, 9, 9]).reward == 1.0  # tokens past response_len are ignored
    assert t.reward(p, [1023, 5, 3, 3]).reward == 0.75  # ids outside the task's vocabulary are just wrong
    assert CopyTask(alphabet=4, prompt_len=4, response_len=2).reward(p, [2, 5, 0, 0]).reward == 1.0


def test_target_set_rewards_by_hand():
    t = TargetSetTask(alphabet=8, prompt_len=3, response_len=4)
    p = [BOS, 4, 2, 7, SEP]
    r = t.reward(p, [2, 2, 3, 7])
    assert r.token_rewards == (1.0, 1.0, 0.0, 1.0) and r.reward == 0.75
    fixed = TargetSetTask(alphabet=8, prompt_len=3, response_len=4, target=[0, 1])  # ids 2, 3
    assert fixed.reward(p, [2, 3, 4, 9]).token_rewards == (1.0, 1.0, 0.0, 0.0)
    # prompt-set prompts hold distinct symbols
    assert all(len(set(q[1:-1])) == 3 for q in t.prompts(200, seed=1))


def test_bad_prompts_and_configs():
    t = CopyTask(alphabet=4, prompt_len=3)
    for bad in ([BOS, 2, 3, SEP], [SEP, 2, 3, 4, SEP], [BOS, 2, 3, 4, BOS], [BOS, 2, 3, 6, SEP], [BOS, 2, 1, 3, SEP]):
        with pytest.raises(ConfigError, match="not a prompt"):
            t.reward(bad, [2, 2, 2])
    with pytest.raises(ConfigError, match="repeat"):
        TargetSetTask(alphabet=8, prompt_len=3).reward([BOS, 2, 2, 3, SEP], [2])
    with pytest.raises(ConfigError, match="responses"):
        t.rewards([[BOS, 2, 3, 4, SEP]], [])
    with pytest.raises(ConfigError):
        CopyTask(alphabet=1)
    with pytest.raises(ConfigError, match="response_len"):
        CopyTask(alphabet=4, prompt_len=3, response_len=4)
    with pytest.raises(ConfigError, match="subset"):
        TargetSetTask(alphabet=4, target=[4])
    with pytest.raises(ConfigError, match="distinct"):
        TargetSetTask(alphabet=4, prompt_len=5)
    with pytest.raises(ConfigError, match="unknown task"):
        make_task("sort")
    with pytest.raises(ConfigError, match="copy"):
        make_task("copy", target="prompt")


@pytest.mark.parametrize("task", [CopyTask(alphabet=8, prompt_len=4), TargetSetTask(alphabet=8, prompt_len=3),
                                  TargetSetTask(alphabet=8, prompt_len=3, target=[1, 2, 3, 4, 5])])
def test_chance_level(task):
    """Uniform alphabet responses score chance() on average. n * response_len >= 16,000 Bernoulli tokens: the
    standard error of the mean is <= 0.5 / sqrt(16,000) = 0.004, so 0.02 is a 5-sigma bound."""
    n = 4000
    prompts = task.prompts(n, seed=3)
    rng = np.random.default_rng(4)
    resp = rng.integers(FIRST, FIRST + task.alphabet, size=(n, task.response_len)).tolist()
    mean = np.mean([r.reward for r in task.rewards(prompts, resp)])
    assert abs(mean - task.chance()) < 0.02


@pytest.mark.parametrize("name", sorted(TASKS))
def test_config_round_trip(name):
    task = make_task(name)
    again = make_task(**task.config())
    assert again.config() == task.config() and type(again) is type(task)
    assert again.prompts(3, seed=0) == task.prompts(3, seed=0)


def test_grpo_raises_reward_on_a_tiny_model():
    """The loop's parts together (task prompts and rewards, sampling, group advantages, PPO-clip, AdamW) on a
    2-layer random-init Qwen3-MoE with the task's 10-token vocabulary: the fixed-target task (chance 0.5) must
    climb. Seeded and single-threaded: the same numbers every run (a 2-layer model climbed to ~0.9 in 8 steps
    when this test was written; the bound leaves room)."""
    from tracerl.policy import TinyMoESpec, build_model

    torch.manual_seed(0)
    task = TargetSetTask(alphabet=8, prompt_len=3, response_len=6, target=[0, 1, 2, 3])
    model = build_model(TinyMoESpec(vocab_size=task.vocab_size, num_layers=2), seed=0).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    group, lp = 8, task.prompt_tokens
    means = []
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for step in range(8):
            rep = [p for p in task.prompts(4, seed=step) for _ in range(group)]
            seq = torch.tensor(rep)
            with torch.no_grad():  # sampling without a cache: a full forward per new token (short sequences)
                lps = []
                for _ in range(task.response_len):
                    logp = torch.log_softmax(model(input_ids=seq, use_cache=False).logits[:, -1].float(), -1)
                    nxt = torch.multinomial(logp.exp(), 1, generator=gen)
                    lps.append(logp.gather(-1, nxt))
                    seq = torch.cat([seq, nxt], dim=1)
            resp = seq[:, lp:]
            r = torch.tensor([x.reward for x in task.rewards(rep, resp.tolist())])
            means.append(r.mean().item())
            logits = model(input_ids=seq, use_cache=False).logits[:, lp - 1:-1]
            loss, st = rl.policy_loss(rl.token_logprobs(logits, resp), torch.cat(lps, 1),
                                      rl.group_advantages(r, group), torch.ones_like(resp, dtype=torch.bool))
            # on-policy: the recomputed log-probs equal the sampling ones up to fp rounding, so no clipping
            assert st["clip_frac"] == 0.0 and abs(st["ratio_mean"] - 1) < 1e-4
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(prev)
    assert np.mean(means[-3:]) > means[0] + 0.2, means
