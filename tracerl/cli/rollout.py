"""``tracerl rollout``: a thin layer over `tracerl.rollout` (options -> `RolloutConfig`, batches, progress)."""

from __future__ import annotations

import argparse
import contextlib
import json

from tracerl.cli.args import (
    add_process_arguments,
    float_above,
    int_at_least,
    start_process,
    stop_on_signals,
    stop_with_parent,
)
from tracerl.cli.progress import progress_log
from tracerl.config import DECODE_PATHS, RolloutConfig

HELP = "rollout worker: generate GRPO groups with the newest policy version into a loop store"
DESCRIPTION = (
    "Loads the newest policy version published beside STORE (waiting for version 0 if needed), samples groups of "
    "responses to the store's task prompts with the FP4 rollout engine, records hints, scales, routed experts, "
    "tokens, log-probs and the policy version into STORE, and commits each trajectory's reward as its result. "
    "Between batches it loads the newest version, and waits while it would be more than --max-ahead batches ahead "
    "of the trainer (one batch per training step). Ctrl-C stops after the current batch (everything generated is committed)."
)
EXAMPLES = [
    "tracerl rollout ./run/store --metrics ./run/rollout-0.jsonl --record-codes",
    "tracerl rollout ./run/store --batches 10 --groups-per-batch 4 --group-size 8 --device cuda",
]
_D = RolloutConfig()


def add_arguments(p: argparse.ArgumentParser) -> None:
    pos, nonneg = int_at_least(1), int_at_least(0)
    add_process_arguments(p, "batch")
    p.add_argument("--batches", type=pos, metavar="N", help="stop after N batches (default: until Ctrl-C)")
    p.add_argument("--groups-per-batch", type=pos, default=_D.groups_per_batch, metavar="P",
                   help=f"prompts per batch (default {_D.groups_per_batch})")
    p.add_argument("--group-size", type=int_at_least(2), default=_D.group_size, metavar="G",
                   help=f"responses sampled per prompt (default {_D.group_size})")
    p.add_argument("--temperature", metavar="T", type=float_above(0), default=_D.temperature,
                   help="sampling temperature (default 1)")
    p.add_argument("--seed", type=nonneg, default=_D.seed, metavar="N", help="seed of prompts and sampling (default 0)")
    p.add_argument("--max-ahead", type=pos, default=_D.max_ahead, metavar="N",
                   help="batches the worker may run ahead of the trainer, which takes one batch per step (default 1: "
                        "on-policy; 2 lets rollout and training overlap, one version behind)")
    p.add_argument("--record-codes", action="store_true",
                   help="also store the rollout's FP4 codes at the hinted sites (audit/codes/ beside the store), so "
                        "the trainer can report code agreement (4x the hint bytes)")
    p.add_argument("--weights", metavar="URL", help="where policy versions are published (default: STORE)")
    p.add_argument("--weights-timeout", type=float_above(0), metavar="S",
                   help="stop when no policy version to generate with came for S seconds (default: wait forever)")
    p.add_argument("--worker-id", metavar="ID",
                   help="prefix of writer and trajectory ids (default rollout-<pid>-<random>)")
    p.add_argument("--decode", default=_D.decode, choices=DECODE_PATHS, help="decode path (default auto)")


def run(args: argparse.Namespace) -> int:
    cfg = RolloutConfig(groups_per_batch=args.groups_per_batch, group_size=args.group_size,
                        temperature=args.temperature, seed=args.seed, max_ahead=args.max_ahead,
                        record_codes=args.record_codes, decode=args.decode)
    cfg.check()
    opts, console = start_process(args)
    import tracestore as ts
    from tracerl.rollout import RolloutWorker, run_rollout
    from tracerl.runlog import MetricsLog

    worker = RolloutWorker(ts.open_store(args.store, storage_options=opts), cfg, device=args.device,
                           worker_id=args.worker_id, weights_url=args.weights, storage_options=opts)

    # without a terminal, a line at least every 30 s also while a batch (or the wait for weights) takes longer
    beat = None if console.is_terminal else progress_log(console, unit="batches")

    def on_batch(m: dict) -> None:
        if args.json:
            print(json.dumps(m), flush=True)
        console.log(f"batch {m['batch'] + 1}{'' if args.batches is None else f'/{args.batches}'} v{m['version']} "
                    f"reward {m['reward_mean']:.3f} {m['generated_tokens_per_s']:.0f} tok/s (waited "
                    f"{m['weights_wait_s']:.2f}s for weights)")
        if beat is not None:
            beat.update("rollout", m["batch"] + 1, args.batches, printed=True)

    console.log(f"rollout worker {worker.worker_id}: {cfg.groups_per_batch} x {cfg.group_size} per batch, task "
                f"{worker.task.name}, into {args.store}")
    if beat is not None:
        beat.update("rollout", 0, args.batches, printed=True)
    try:
        with contextlib.closing(beat) if beat is not None else contextlib.nullcontext(), stop_on_signals() as stop:
            stop_with_parent(stop)
            n = run_rollout(worker, metrics=MetricsLog(args.metrics), max_batches=args.batches, stop=stop,
                            weights_timeout_s=args.weights_timeout, on_batch=on_batch)
    finally:
        worker.close()
    console.log(f"rollout worker {worker.worker_id}: {n} batch(es) committed; last policy version {worker.version}")
    return 0
