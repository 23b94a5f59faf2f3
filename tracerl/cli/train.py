"""``tracerl train``: a thin layer over `tracerl.train` (options -> `TrainConfig`, resume, follow, progress)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os

from tracerl.cli.args import (
    add_process_arguments,
    end_distributed,
    existing_store_options,
    float_above,
    init_distributed,
    int_at_least,
    start_process,
    stop_on_signals,
    stop_with_parent,
)
from tracerl.cli.progress import progress_log
from tracerl.config import MARGIN_DECODES, QAT_MODES, TrainConfig

HELP = "GRPO trainer that follows a live loop store, checkpoints, and publishes policy versions"
DESCRIPTION = (
    "Follows STORE (a loop store: tracerl loop creates one) from its beginning or from the newest checkpoint in "
    "--checkpoints, takes complete GRPO groups as their results commit, and trains the policy in the chosen QAT "
    "mode: PPO-clip against the rollout's stored log-probs (or TIS), AdamW on fp32 masters of the bf16 model. "
    "After every step: a checkpoint (model, optimizer, RNG, store cursor; atomic), a metrics line in --metrics, "
    "and the new policy version published beside the store for the rollout side. A killed trainer restarted with "
    "the same options resumes exactly where its checkpoint left off. Under torchrun the weights, gradients "
    "and AdamW state are sharded with FSDP2 over the ranks (gloo on CPU, NCCL on CUDA), each rank reads only its "
    "micro-batches, and checkpoints are distributed checkpoints that resume at any world size. Ctrl-C stops after the current step."
)
EXAMPLES = [
    "tracerl train ./run/store --checkpoints ./run --metrics ./run/train.jsonl --steps 20",
    "torchrun --nproc-per-node 2 -m tracerl.cli train ./run/store --checkpoints ./run --steps 20",
    "tracerl train s3://bucket/run1 --checkpoints s3://bucket/run1 --endpoint-url http://127.0.0.1:9000",
]
_D = TrainConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    pos, nonneg = int_at_least(1), int_at_least(0)
    add_process_arguments(p, "step")
    p.add_argument("--checkpoints", required=True, metavar="URL",
                   help="where checkpoints go (local directory or s3://...); the newest one there is resumed")
    p.add_argument("--steps", type=pos, metavar="N",
                   help="stop once the policy has N updates (counted over restarts; default: follow until Ctrl-C)")
    p.add_argument("--wait-timeout", type=float_above(0), metavar="S",
                   help="stop when no training step's groups were ready for S seconds (default: wait forever)")
    p.add_argument("--mode", default=_D.mode, choices=QAT_MODES,
                   help=f"QAT mode of the trainer's forward (default {_D.mode})")
    p.add_argument("--groups-per-step", type=pos, default=_D.groups_per_step, metavar="P",
                   help=f"GRPO groups (prompts) per optimizer step (default {_D.groups_per_step})")
    p.add_argument("--group-size", type=int_at_least(2), default=_D.group_size, metavar="G",
                   help=f"trajectories per group; the rollout must use the same (default {_D.group_size})")
    p.add_argument("--micro-batch-tokens", type=pos, default=_D.micro_batch_tokens, metavar="N",
                   help=f"tokens per packed micro-batch, at least the longest trajectory (default {_D.micro_batch_tokens})")
    p.add_argument("--lr", metavar="LR", type=float_above(0), default=_D.lr,
                   help=f"AdamW learning rate (default {_D.lr:g})")
    p.add_argument("--weight-decay", metavar="WD", type=float, default=_D.weight_decay,
                   help=f"AdamW weight decay (default {_D.weight_decay:g})")
    p.add_argument("--grad-clip", metavar="NORM", type=float_above(0), default=_D.grad_clip,
                   help=f"clip the global gradient norm to this (default {_D.grad_clip:g})")
    p.add_argument("--clip-low", metavar="EPS", type=float, default=_D.clip_low,
                   help=f"PPO clip epsilon below 1 (default {_D.clip_low:g})")
    p.add_argument("--clip-high", metavar="EPS", type=float, default=_D.clip_high,
                   help=f"PPO clip epsilon above 1 (default {_D.clip_high:g}, DAPO's clip-higher)")
    p.add_argument("--clip-ratio-c", metavar="C", type=float_above(1),
                   help="dual-clip bound for negative advantages (default off)")
    p.add_argument("--tis-cap", metavar="CAP", type=float_above(0),
                   help="truncated importance sampling: weight tokens by min(exp(logp_trainer - logp_rollout), CAP) "
                        "and take the PPO ratio against the trainer's own log-probs (default: ratio against the "
                        "rollout's log-probs, no TIS)")
    p.add_argument("--adv-scale", default=_D.adv_scale, choices=("std", "none"),
                   help="group advantages divided by the group's reward std (std, default) or not (none, Dr. GRPO)")
    p.add_argument("--temperature", metavar="T", type=float_above(0), default=_D.temperature,
                   help="sampling temperature the rollout used (divides the logits; default 1)")
    p.add_argument("--max-staleness", type=nonneg, default=_D.max_staleness, metavar="V",
                   help=f"drop groups generated more than V policy versions ago (default {_D.max_staleness})")
    p.add_argument("--replay-routes", action="store_true",
                   help="the trainer's MoE layers use the rollout's routed experts")
    p.add_argument("--no-code-agreement", action="store_true",
                   help="do not observe codes at hinted sites (code agreement needs the rollout's --record-codes; "
                        "on a store with codes, comparing them took ~7%% of an fp4_hints step that compares on an H100)")
    p.add_argument("--no-measure-stale", action="store_true",
                   help="measure the mismatch on on-policy groups only (default: also on stale groups, with their "
                        "version's kept weights, one extra forward without gradient)")
    p.add_argument("--measure-stale-every", type=pos, default=_D.measure_stale_every, metavar="N",
                   help="keep every N-th policy version's weights, so that the stale groups of one version in N are "
                        f"measured (default {_D.measure_stale_every}; 1: every stale group, at one extra forward "
                        "per step)")
    p.add_argument("--checkpoint-every", type=nonneg, default=_D.checkpoint_every, metavar="N",
                   help="commit a checkpoint every N steps (default 1; a kill loses at most the steps since); 0: never, "
                        "not even step 0 (for throughput runs whose checkpoint does not fit; such a run cannot resume)")
    p.add_argument("--keep-checkpoints", type=pos, metavar="N", help="keep the N newest checkpoints and the first")
    p.add_argument("--keep-versions", type=pos, metavar="N", help="keep the N newest policy versions and version 0")
    p.add_argument("--weights", metavar="URL", help="where policy versions are published (default: STORE)")
    p.add_argument("--no-publish", action="store_true", help="do not publish policy versions")
    p.add_argument("--cursor", metavar="CURSOR",
                   help="a fresh trainer follows the store from this stream cursor (default: the beginning)")
    p.add_argument("--read-ahead-mb", type=nonneg, default=_D.read_ahead_bytes >> 20, metavar="MB",
                   help="read a step's micro-batches ahead of their forward/backward up to this many MB held "
                        f"(default {_D.read_ahead_bytes >> 20}; 0: one micro-batch at a time)")
    p.add_argument("--read-next", choices=("auto", "off", "thread", "process"), default="auto",
                   help="read the next step's micro-batches while a step computes: in a reader process, in a thread, "
                        "or not (default auto: a reader process on a GPU, off on the CPU)")
    p.add_argument("--margin-decode", choices=MARGIN_DECODES, default=_D.margin_decode,
                   help="where a store's margin-exception rows are decoded: auto (the Triton decoder on a GPU, numpy "
                        "on the CPU), device (the torch codec), host (numpy), triton (one Triton kernel per coding; a "
                        f"GPU) (default {_D.margin_decode})")
    p.add_argument("--time-phases", action="store_true",
                   help="time each step's phases (forward, backward, mismatch, optimizer, ...) into the metrics' "
                        "phases_s, waiting for the device at each phase boundary")
    p.add_argument("--seed", type=nonneg, default=_D.seed, metavar="N", help="seed of torch's RNG (default 0)")
    p.add_argument("--no-deterministic", action="store_true",
                   help="allow nondeterministic kernels (replay is then not bitwise)")


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The checked `TrainConfig` of parsed options (raises `ConfigError`)."""
    cfg = TrainConfig(
        mode=args.mode, groups_per_step=args.groups_per_step, group_size=args.group_size,
        micro_batch_tokens=args.micro_batch_tokens, lr=args.lr, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, clip_low=args.clip_low, clip_high=args.clip_high, clip_ratio_c=args.clip_ratio_c,
        adv_scale=args.adv_scale, tis_cap=args.tis_cap, temperature=args.temperature, replay_routes=args.replay_routes,
        max_staleness=args.max_staleness, code_agreement=not args.no_code_agreement,
        measure_stale=not args.no_measure_stale, measure_stale_every=args.measure_stale_every,
        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
        keep_versions=args.keep_versions, read_ahead_bytes=args.read_ahead_mb << 20, time_phases=args.time_phases,
        seed=args.seed, deterministic=not args.no_deterministic, margin_decode=args.margin_decode)
    cfg.check()
    return cfg


def step_line(m: dict, total: int | None) -> str:
    """One line of a step's metrics, for a log."""
    mm = m.get("mismatch") or {}

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    return (f"step {m['step']}{'' if total is None else f'/{total}'} v{m['version']} reward {f(m['reward_mean'], '.3f')} "
            f"loss {f(m.get('loss'), '+.4f')} |g| {f(m['grad_norm'], '.3f')} mismatch |dlogp| "
            f"{f(mm.get('mean_abs_dlogp'), '.2e')} k3 {f(mm.get('k3'), '.2e')} code {f(mm.get('code_agreement'), '.5f')} "
            f"lag {f(m['lag_s_median'], '.2f')}s {f(m['tokens_per_s'], '.0f')} tok/s stale {m['stale_groups']}")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)  # before torch is imported: bad options answer at once
    if args.device.startswith("cuda") and not args.no_deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts (deterministic GEMMs)
    import tracestore as ts

    store = None
    if args.cursor is not None:  # a cursor of another store, malformed or past the log head: said before torch loads
        store = ts.open_store(args.store, storage_options=existing_store_options(args, args.store))
        store.stream(args.cursor)
    opts, console = start_process(args)
    from tracerl.runlog import MetricsLog
    from tracerl.train import run_training, start_or_resume

    device = init_distributed(args.device)
    if store is None:
        store = ts.open_store(args.store, storage_options=opts)
    weights_url = None if args.no_publish else (args.weights or args.store)
    metrics = MetricsLog(args.metrics)
    trainer, follower = start_or_resume(store, cfg, checkpoints=args.checkpoints, weights_url=weights_url,
                                        metrics=metrics, device=device, cursor=args.cursor, storage_options=opts)
    # without a terminal, a line at least every 30 s also while a step (or the wait for its groups) takes longer
    beat = progress_log(console) if trainer.rank == 0 and not console.is_terminal else None
    if trainer.rank == 0:
        console.log(f"trainer at step {trainer.step_num} (policy version {trainer.version}), mode {trainer.cfg.mode}, "
                    f"{trainer.world} rank(s), following {args.store} from {follower.cursor}")
        if beat is not None:
            beat.update("train", trainer.step_num, args.steps, printed=True)

    def on_step(m: dict) -> None:
        if trainer.rank != 0:
            return
        if args.json:
            print(json.dumps(m), flush=True)
        console.log(step_line(m, args.steps))
        if beat is not None:
            beat.update("train", trainer.step_num, args.steps, printed=True)

    with contextlib.closing(beat) if beat is not None else contextlib.nullcontext(), stop_on_signals() as stop:
        stop_with_parent(stop)
        run_training(trainer, follower, checkpoints=args.checkpoints, weights_url=weights_url, metrics=metrics,
                     max_steps=args.steps, stop=stop, wait_timeout_s=args.wait_timeout, storage_options=opts,
                     on_step=on_step, read_next=args.read_next)
        stopped = stop.is_set()
    if trainer.rank == 0:
        every = trainer.cfg.checkpoint_every
        where = (f"checkpoint {trainer.step_num if trainer.step_num % every == 0 else 'earlier'} in {args.checkpoints}"
                 if every else "no checkpoints (--checkpoint-every 0)")
        console.log(f"trainer {'stopped' if stopped else 'done'} at step {trainer.step_num} (policy version "
                    f"{trainer.version}); {where}")
    end_distributed()
    return 0
