"""Experiment (not a test): which task settings does the tiny random-init MoE learn with GRPO within minutes on CPU?

Closed loop without store or FP4: the demo's model (Qwen3-MoE, hidden 256, 8 layers, 16 experts top-2) with the
task's vocabulary, fp32 or bf16 on CPU; each step samples G completions of P prompts with plain torch sampling
(KV cache, temperature 1), scores them with the task's verifiable reward (`tracerl.policy.tasks`), computes group
advantages and the PPO-clip loss against the sampling log-probs (`tracerl.train.loss`) and takes AdamW steps.

Prints one line per step and a summary table (reward of the first 5 steps -> last 5 steps, median over seeds
with min..max, and wall time); saves JSON (machine with its load average, versions, settings, per-step curves)
to benchmarks/results/rl-task-learnability-cpu.json. Wall times depend on what else runs on the machine: the
dev VM's 2 cores are shared, so compare ``step_s_median`` with ``loadavg_1_5_15``.

    python benchmarks/experiment_task_learnability.py --configs copy-a4,target-prompt --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

import tracerl
from tracerl.train import loss as rl
from tracerl.policy import TinyMoESpec, build_model
from tracerl.policy import make_task


@dataclasses.dataclass
class Config:
    task: dict
    steps: int = 60
    prompts: int = 16  # P prompts per step
    group: int = 8  # G samples per prompt
    lr: float = 1e-4  # 1e-3 collapsed the policy's entropy within ~10 steps and stalled `copy` near chance
    weight_decay: float = 0.0
    ppo_epochs: int = 1  # passes over each batch (>1 makes the ratio leave 1 and the clip matter)
    clip_low: float = 0.2
    clip_high: float = 0.28
    adv_scale: str = "std"
    agg: str = "token-mean"
    grad_clip: float = 1.0
    temperature: float = 1.0
    dtype: str = "float32"
    vocab_size: int | None = None  # model vocabulary; None: the task's (alphabet + BOS + SEP)


PRESETS: dict[str, Config] = {
    # emit any of a fixed half of the alphabet: needs no attention (a smoke test for the loop); chance 1/2
    "target-fixed": Config(task={"name": "target-set", "alphabet": 8, "prompt_len": 3, "response_len": 8,
                                 "target": [0, 1, 2, 3]}, steps=30),
    # emit tokens that occur in the prompt (3 distinct of 8): must read the prompt; chance 3/8
    "target-prompt": Config(task={"name": "target-set", "alphabet": 8, "prompt_len": 3, "response_len": 8}),
    # the same task with the model's full 1024-token vocabulary: chance ~3/1024 at init
    "target-prompt-v1024": Config(task={"name": "target-set", "alphabet": 8, "prompt_len": 3, "response_len": 8},
                                  vocab_size=1024),
    # copy 4 symbols of 4: chance 1/4
    "copy-a4": Config(task={"name": "copy", "alphabet": 4, "prompt_len": 4}, steps=100),
    # copy 4 symbols of 8: chance 1/8
    "copy-a8": Config(task={"name": "copy", "alphabet": 8, "prompt_len": 4}, steps=100),
}


def _cache_of(out):
    """The KV cache of a model output (``cache`` in newer transformers, ``past_key_values`` before)."""
    return out["cache"] if "cache" in out else out.past_key_values


def _sample(model, prompts: torch.Tensor, new_tokens: int, temperature: float, gen: torch.Generator,
            cache_kw: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Autoregressive sampling with a KV cache: response ids [N, R] and their log-probs [N, R] (fp32) under the
    sampling distribution (temperature applied), as a rollout engine records them."""
    out = model(input_ids=prompts, use_cache=True)
    cache = _cache_of(out)
    logits = out.logits[:, -1]
    toks, lps = [], []
    for _ in range(new_tokens):
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (N, V)
        nxt = torch.multinomial(logp.exp(), 1, generator=gen)  # (N, 1)
        toks.append(nxt)
        lps.append(logp.gather(-1, nxt))
        out = model(input_ids=nxt, use_cache=True, **{cache_kw: cache})
        cache = _cache_of(out)
        logits = out.logits[:, -1]
    return torch.cat(toks, dim=1), torch.cat(lps, dim=1)


def run(cfg: Config, seed: int, log=print) -> dict:
    task = make_task(**cfg.task)
    vocab = cfg.vocab_size or task.vocab_size
    dtype = getattr(torch, cfg.dtype)
    model = build_model(TinyMoESpec(vocab_size=vocab), seed=seed).to(dtype)
    model.train()  # no dropout in these configs: train and eval forwards are the same computation
    # transformers renamed the cache argument (past_key_values -> cache); use what this version takes
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    lp_len, r_len = task.prompt_tokens, task.response_len
    curve = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        ts = time.perf_counter()
        prompts = task.prompts(cfg.prompts, seed=seed * 1_000_003 + step)
        rep = [p for p in prompts for _ in range(cfg.group)]  # (P*G) prompts, each group's G samples adjacent
        ids_p = torch.tensor(rep, dtype=torch.long)  # (N, Lp)
        with torch.no_grad():
            resp, lp_roll = _sample(model, ids_p, r_len, cfg.temperature, gen, cache_kw)  # (N, R) each
        rewards = task.rewards(rep, resp.tolist())
        r = torch.tensor([x.reward for x in rewards])
        adv = rl.group_advantages(r, cfg.group, scale=cfg.adv_scale)
        seq = torch.cat([ids_p, resp], dim=1)  # (N, Lp + R)
        mask = torch.ones_like(resp, dtype=torch.bool)
        stats = []
        for _ in range(cfg.ppo_epochs):
            logits = model(input_ids=seq, use_cache=False).logits[:, lp_len - 1: -1]  # (N, R, V): predicts resp
            logp = rl.token_logprobs(logits.float() / cfg.temperature, resp)  # (N, R)
            loss, st = rl.policy_loss(logp, lp_roll, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      agg=cfg.agg, entropy=rl.entropy_from_logits(logits.detach().float()))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
            opt.step()
            stats.append({**st, "grad_norm": gnorm})
        groups = r.reshape(-1, cfg.group)
        row = {
            "step": step,
            "reward_mean": float(r.mean()),
            "reward_max": float(r.max()),
            "solved_frac": float((r == 1).float().mean()),
            "groups_with_signal": float((groups.amax(1) > groups.amin(1)).float().mean()),
            "loss": stats[0]["loss"],
            "clip_frac": stats[-1]["clip_frac"],
            "approx_kl_k3": stats[-1]["approx_kl_k3"],
            "entropy": stats[0]["entropy"],
            "grad_norm": stats[0]["grad_norm"],
            "seconds": time.perf_counter() - ts,
        }
        curve.append(row)
        log(f"  step {step:3d}  reward {row['reward_mean']:.3f}  solved {row['solved_frac']:.2f}  "
            f"H {row['entropy']:.2f}  kl {row['approx_kl_k3']:.1e}  clip {row['clip_frac']:.2f}  "
            f"|g| {row['grad_norm']:.2f}  {row['seconds']:.1f}s")
    wall = time.perf_counter() - t0
    k = min(5, len(curve))
    return {
        "seed": seed,
        "chance": task.chance(),
        "reward_first5": statistics.fmean(c["reward_mean"] for c in curve[:k]),
        "reward_last5": statistics.fmean(c["reward_mean"] for c in curve[-k:]),
        "wall_s": wall,
        "step_s_median": statistics.median(c["seconds"] for c in curve),
        "curve": curve,
    }


def _machine() -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "python": sys.version.split()[0],
            "torch": torch.__version__, "tracerl": getattr(tracerl, "__file__", ""),
            # the dev machine's 2 cores are shared: the load average says how much of them this run had
            "loadavg_1_5_15": list(os.getloadavg())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="target-fixed,target-prompt,copy-a4,target-prompt-v1024",
                    help=f"comma-separated presets among: {', '.join(PRESETS)} (empty: only print the table of "
                         "the runs saved in --out, adding derived fields)")
    ap.add_argument("--seeds", default="0,1,2", help="comma-separated seeds; each config runs once per seed")
    ap.add_argument("--steps", type=int, default=None, help="override every preset's number of steps")
    ap.add_argument("--lr", type=float, default=None, help="override every preset's AdamW learning rate")
    ap.add_argument("--group", type=int, default=None, help="override every preset's G (samples per prompt)")
    ap.add_argument("--prompts", type=int, default=None, help="override every preset's P (prompts per step)")
    ap.add_argument("--ppo-epochs", type=int, default=None, help="override every preset's passes per batch")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default=None, help="override the model dtype")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (the dev machine shares 2 cores)")
    ap.add_argument("--out", default="benchmarks/results/rl-task-learnability-cpu.json",
                    help="JSON output path (runs already there under other config names are kept)")
    ap.add_argument("--quiet", action="store_true", help="no per-step lines")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in PRESETS]
    if unknown:
        print(f"unknown configs {unknown}; choose among {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    seeds = [int(s) for s in args.seeds.split(",") if s]
    overrides = {k: v for k, v in {"steps": args.steps, "lr": args.lr, "group": args.group, "prompts": args.prompts,
                                   "ppo_epochs": args.ppo_epochs, "dtype": args.dtype}.items() if v is not None}
    out_path = Path(args.out)
    doc = json.loads(out_path.read_text()) if out_path.exists() else {"runs": {}}
    log = (lambda *a, **k: None) if args.quiet else print
    for name in names:
        cfg = dataclasses.replace(PRESETS[name], **overrides)
        results = []
        for seed in seeds:
            print(f"{name} seed {seed}: {cfg}", flush=True)
            results.append(run(cfg, seed, log=lambda m: log(m, flush=True)))
        key = name + "".join(f",{k}={v}" for k, v in sorted(overrides.items()))
        doc["runs"][key] = {"config": dataclasses.asdict(cfg), "seeds": seeds, "results": results,
                            "machine": _machine()}
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(doc, indent=1))

    for run_doc in doc["runs"].values():
        # expected reward of a policy uniform over the model's whole vocabulary (what a random init starts near;
        # Task.chance() is uniform over the alphabet only): each of the alphabet's ids is hit with 1/V
        cfg = run_doc["config"]
        task = make_task(**cfg["task"])
        run_doc["chance_vocab"] = task.chance() * task.alphabet / (cfg["vocab_size"] or task.vocab_size)
    if doc["runs"]:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(doc, indent=1))

    def med(xs):
        return f"{statistics.median(xs):.3f} ({min(xs):.3f}..{max(xs):.3f})"

    print(f"\n{'config':<44} {'chance':>6}  {'reward first 5 steps':>22}  {'reward last 5 steps':>22}  {'wall s':>16}")
    for key, run_doc in doc["runs"].items():
        res = run_doc["results"]
        print(f"{key:<44} {run_doc['chance_vocab']:>6.3f}  {med([r['reward_first5'] for r in res]):>22}  "
              f"{med([r['reward_last5'] for r in res]):>22}  "
              f"{statistics.median(r['wall_s'] for r in res):>7.0f} ({min(r['wall_s'] for r in res):.0f}.."
              f"{max(r['wall_s'] for r in res):.0f})")
    print("chance: expected reward of a policy uniform over the model's vocabulary (JSON: chance_vocab; each "
          "result's `chance` is uniform over the task's alphabet)")
    print(f"saved {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
