"""``tracerl loop``: a thin layer over `tracerl.loop.run_loop` (options -> `LoopConfig`, live display, table)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from tracerl.cli.args import (
    add_model_size_arguments,
    add_storage_arguments,
    float_above,
    int_at_least,
    stop_on_signals,
    storage_options,
)
from tracerl.config import (
    FP4_PLACEMENTS,
    QAT_MODES,
    SCALE_ENCODINGS,
    LoopConfig,
    TinyMoESpec,
    check_store_exists,
    parse_layers,
)
from tracerl.errors import ConfigError
from tracestore.cliargs import EXIT_INTERRUPTED, check_local_store
from tracestore.errors import StoreNotFoundError

HELP = "the closed RL loop: rollout and trainer processes on one store, live progress, table, JSON and plot"
DESCRIPTION = (
    "Creates a loop store (a tiny random-init MoE model, a task with a verifiable reward computed from token ids), "
    "starts one trainer process (tracerl train) and --rollouts rollout processes (tracerl rollout) against it, and "
    "shows live: reward, policy version, rollout and trainer tokens/s, commit-to-train lag and the rollout/trainer "
    "mismatch per step (code agreement at hinted sites, mean |dlogp|, k3). Ends when the policy has --steps "
    "updates; prints a table (or --json) and writes loop.json and loop.png to the run directory. Ctrl-C stops "
    "both sides cleanly: the trainer after its step (checkpointed), the rollouts after their batch (committed)."
)
EXAMPLES = [
    "tracerl loop --dir ./run --steps 20",
    "tracerl loop --dir ./run --steps 20 --mode fp4_rne_own_scales --json > rne.json",
    "tracerl loop --dir ./run --rollout-device cuda:0 --trainer-device cuda:1 --hidden 2048 --layers 40",
]
_D = LoopConfig(run_dir="")
_TASK = _D.task


def add_arguments(p: argparse.ArgumentParser) -> None:
    pos, nonneg = int_at_least(1), int_at_least(0)
    p.add_argument("--dir", metavar="DIR",
                   help="run directory: store, checkpoints, metrics, logs, loop.json, loop.png "
                        "(default ./tracerl-loop-<date>-<time>)")
    p.add_argument("--store", metavar="URL", help="store URL to create (default DIR/store; s3://bucket/prefix works)")
    p.add_argument("--steps", type=pos, default=_D.steps, metavar="N", help=f"policy updates (default {_D.steps})")
    p.add_argument("--rollouts", type=pos, default=_D.rollouts, metavar="N",
                   help=f"rollout processes (default {_D.rollouts})")
    p.add_argument("--task", default=_TASK["name"], choices=("target-set", "copy"),
                   help="target-set: emit symbols that occur in the prompt (default); copy: repeat the prompt")
    p.add_argument("--alphabet", type=int_at_least(2), default=_TASK["alphabet"], metavar="N",
                   help=f"task symbols (default {_TASK['alphabet']})")
    p.add_argument("--prompt-len", type=pos, default=_TASK["prompt_len"], metavar="N",
                   help=f"prompt symbols (default {_TASK['prompt_len']})")
    p.add_argument("--response-len", type=pos, default=_TASK["response_len"], metavar="N",
                   help=f"response tokens (default {_TASK['response_len']}; copy: at most --prompt-len)")
    add_model_size_arguments(p, vocab=False)
    p.add_argument("--hint-layers", default=_D.hint_layers, metavar="LAYERS",
                   help="layers whose MoE input gets hints: latter-half (default), all, none, or e.g. 0,3")
    p.add_argument("--scale-encoding", default=_D.scale_encoding, choices=SCALE_ENCODINGS,
                   help="how the store keeps block scales: bytes (default; E4M3 bytes) or lsb (scale hints: one bit "
                        "per block, the trainer rebuilds the byte from its own amax; a format-4 store)")
    p.add_argument("--fp4", default=_D.fp4, choices=FP4_PLACEMENTS, help="FP4 placement (default experts)")
    p.add_argument("--mode", default=_D.mode, choices=QAT_MODES, help=f"trainer QAT mode (default {_D.mode})")
    p.add_argument("--groups-per-step", type=pos, default=_D.groups_per_step, metavar="P",
                   help=f"prompts per step (default {_D.groups_per_step})")
    p.add_argument("--group-size", type=int_at_least(2), default=_D.group_size, metavar="G",
                   help=f"samples per prompt (default {_D.group_size})")
    p.add_argument("--lr", metavar="LR", type=float_above(0), default=_D.lr,
                   help=f"AdamW learning rate (default {_D.lr:g})")
    p.add_argument("--max-staleness", type=nonneg, default=_D.max_staleness, metavar="V",
                   help=f"trainer drops groups more than V versions old (default {_D.max_staleness})")
    p.add_argument("--max-ahead", type=pos, default=_D.max_ahead, metavar="N",
                   help="rollout batches ahead of the trainer, which takes one batch per step (default 1: on-policy; "
                        "2: rollout overlaps training, one version behind)")
    p.add_argument("--tis-cap", metavar="CAP", type=float_above(0),
                   help="truncated importance sampling cap (default: off)")
    p.add_argument("--micro-batch-tokens", type=pos, default=_D.micro_batch_tokens, metavar="N",
                   help=f"trainer micro-batch tokens (default {_D.micro_batch_tokens})")
    p.add_argument("--no-record-codes", action="store_true",
                   help="the rollout does not store its FP4 codes (then no code agreement is reported; the codes "
                        "are 4x the hint bytes, and comparing them took ~7%% of an fp4_hints step that compares on an "
                        "H100, README 'Measured')")
    p.add_argument("--seed", type=nonneg, default=_D.seed, metavar="N",
                   help=f"seed of weights, prompts, sampling (default {_D.seed})")
    p.add_argument("--rollout-device", metavar="DEVICE", default=_D.rollout_device,
                   help="rollout torch device (default cpu)")
    p.add_argument("--trainer-device", metavar="DEVICE", default=_D.trainer_device,
                   help="trainer torch device (default cpu)")
    p.add_argument("--threads", type=nonneg, default=_D.threads, metavar="N",
                   help=f"torch CPU threads per process (default {_D.threads}; 0: torch's choice)")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object instead of the table")
    add_storage_arguments(p)


def config_from_args(args: argparse.Namespace) -> LoopConfig:
    run_dir = args.dir or time.strftime("tracerl-loop-%Y%m%d-%H%M%S")
    spec = {k: v for k, v in (("hidden_size", args.hidden), ("num_layers", args.layers),
                              ("num_experts", args.experts)) if v is not None}
    cfg = LoopConfig(
        run_dir=run_dir, store=args.store, steps=args.steps, rollouts=args.rollouts,
        task={"name": args.task, "alphabet": args.alphabet, "prompt_len": args.prompt_len,
              "response_len": args.response_len}, spec=spec, hint_layers=args.hint_layers, fp4=args.fp4,
        scale_encoding=args.scale_encoding,
        mode=args.mode, groups_per_step=args.groups_per_step, group_size=args.group_size, lr=args.lr,
        max_staleness=args.max_staleness, max_ahead=args.max_ahead, tis_cap=args.tis_cap,
        micro_batch_tokens=args.micro_batch_tokens, record_codes=not args.no_record_codes, seed=args.seed,
        rollout_device=args.rollout_device, trainer_device=args.trainer_device, threads=args.threads)
    cfg.check()
    return cfg


def check_before_loading(cfg: LoopConfig) -> None:
    """What `run_loop` would refuse after loading torch and building the model, refused before (raises
    `ConfigError`): a bad task, a model size or hinted layers the model cannot have, a run directory that is a
    file, a store that exists already (the loop creates its store)."""
    from tracerl.policy.tasks import make_task  # numpy only

    task = make_task(**cfg.task)
    spec = TinyMoESpec(**{"vocab_size": task.vocab_size, **cfg.spec})
    parse_layers(cfg.hint_layers, spec.num_layers)
    if os.path.exists(cfg.run_dir) and not os.path.isdir(cfg.run_dir):
        raise ConfigError(f"--dir {cfg.run_dir}: exists and is not a directory")
    url = cfg.store or os.path.join(cfg.run_dir, "store")
    try:
        check_local_store(url, cfg.storage_options)  # without numpy, pyarrow, zarr
        check_store_exists(url, cfg.storage_options)
    except StoreNotFoundError:
        return
    raise ConfigError(f"store {url}: a tracestore store exists there already; tracerl loop creates a new one (give "
                      f"{'--store' if cfg.store else '--dir'} a path without one)")


def run(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.storage_options = storage_options(args, cfg.store or cfg.run_dir)
    check_before_loading(cfg)  # bad options answer before torch is imported
    from rich.console import Console
    from rich.live import Live

    from tracerl.cli.progress import progress_log
    from tracerl.cli.train import step_line
    from tracerl.loop import live_view, render_summary, run_loop
    from tracerl.runlog import json_ready

    err = Console(stderr=True, log_path=False)
    started = time.time()
    logged = [0]

    def on_update(procs) -> None:
        if live is not None:
            live.update(live_view(procs, started))
            return
        records = procs.train_log.records
        for m in records[logged[0]:]:
            err.log(step_line(m, cfg.steps))
        # without a terminal, a line at least every 30 s also while a step takes longer (count, rate, ETA)
        beat.update("loop", len(records), cfg.steps, printed=len(records) > logged[0])
        logged[0] = len(records)

    live = Live(console=err, refresh_per_second=4, transient=False) if err.is_terminal else None
    beat = progress_log(err, heartbeat=False) if live is None else None  # on_update comes every 0.25 s
    err.log(f"tracerl loop in {cfg.run_dir}: {cfg.rollouts} rollout process(es) + 1 trainer, {cfg.steps} steps, "
            f"mode {cfg.mode}")
    with stop_on_signals() as stop:
        if live is not None:
            with live:
                result = run_loop(cfg, on_update=on_update, stop=stop)
        else:
            with contextlib.closing(beat):
                result = run_loop(cfg, on_update=on_update, stop=stop)
    if args.json:
        print(json.dumps(json_ready(result)))
    else:
        out = Console() if sys.stdout.isatty() else Console(width=160, soft_wrap=True)
        out.print(render_summary(result))
        out.print(f"run directory {cfg.run_dir}: loop.json{', loop.png' if result.get('plot') else ''}, "
                  f"checkpoints/, train.jsonl, rollout-*.jsonl"
                  + (" (stopped early by Ctrl-C)" if result.get("stopped_early") else ""))
    return EXIT_INTERRUPTED if result.get("stopped_early") else 0
