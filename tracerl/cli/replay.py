"""``tracerl replay``: a thin layer over `tracerl.loop.replay.replay` (checkpoint + pinned store -> comparison)."""

from __future__ import annotations

import argparse
import json
import os

from tracerl.cli.args import (
    add_storage_arguments,
    end_distributed,
    existing_store_options,
    init_distributed,
    int_at_least,
)

HELP = "re-run training from a checkpoint and the archived store; compare loss, grad norm, weights bit for bit"
DESCRIPTION = (
    "Loads a trainer checkpoint (model, optimizer, RNG, store cursor) from --from, pins STORE at its current log "
    "head, and re-runs the training steps after the checkpoint in memory (nothing is written), comparing each "
    "step's loss, gradient norm and weight digest with the live run's metrics log. Prints a table, or with --json "
    '{"bitwise_equal": true|false, "steps": n, "first_divergence": null|{...}, ...}. Exit 0 when every replayed '
    "step is bitwise equal, 1 when one differs (or none could be replayed), 2 on errors. A run trained under "
    "torchrun is replayed under torchrun with as many ranks (its sharded checkpoints load at any world size, but "
    "another world size adds the gradients in another order)."
)


EXAMPLES = [
    "tracerl replay ./run/store --from ./run",
    "torchrun --nproc-per-node 2 -m tracerl.cli replay ./run/store --from ./run --json",
    "tracerl replay ./run/store --from ./run --step 0 --steps 5 --json",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("store", metavar="STORE", help="the store the live run trained on (local directory or s3://...)")
    p.add_argument("--from", dest="checkpoints", required=True, metavar="CHECKPOINTS",
                   help="the live run's checkpoint location (its tracerl train --checkpoints)")
    p.add_argument("--step", type=int_at_least(0), metavar="N",
                   help="checkpoint to start from (default: the earliest kept, usually 0)")
    p.add_argument("--log", metavar="PATH",
                   help="the live run's metrics log (default: the path the checkpoint recorded)")
    p.add_argument("--steps", type=int_at_least(1), metavar="N", help="replay at most N steps (default: all logged)")
    p.add_argument("--device", metavar="DEVICE", default="cpu",
                   help="torch device (default cpu; use the live run's device type)")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    add_storage_arguments(p)


def _check_checkpoints(args: argparse.Namespace, opts: dict | None) -> str:
    """The live run's metrics log, once the checkpoint to start from is known to exist (before torch is imported):
    raises `CheckpointNotFoundError` (no checkpoint in --from, or not --step), `ConfigError` (no log to compare
    with)."""
    from tracerl.artifacts import checkpoints as ckpt
    from tracerl.errors import CheckpointNotFoundError, ConfigError

    steps = ckpt.list_steps(args.checkpoints, storage_options=opts)  # a listing: no checkpoint is read
    if not steps:
        raise CheckpointNotFoundError(f"{args.checkpoints}: holds no checkpoint")
    step = steps[0] if args.step is None else args.step
    if step not in steps:
        raise CheckpointNotFoundError(f"{args.checkpoints}: no checkpoint {step} (it holds {len(steps)}: "
                                      f"{', '.join(map(str, steps[:8]))}{', ...' if len(steps) > 8 else ''})")
    if args.log is not None:
        return args.log
    c = ckpt.load(args.checkpoints, step, storage_options=opts)
    log_path = c.state.get("metrics_path")
    if not log_path:
        raise ConfigError(f"checkpoint {c.step} records no metrics log; pass --log PATH")
    return log_path


def run(args: argparse.Namespace) -> int:
    opts = existing_store_options(args, args.store)  # a missing store answers before torch loads
    from tracerl.runlog import MetricsLog

    live = MetricsLog(_check_checkpoints(args, opts)).records()  # the store's options, as replay() uses them
    if args.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts (deterministic GEMMs)
    from rich.console import Console
    from rich.table import Table

    import tracestore as ts
    from tracerl.cli.progress import progress_log
    from tracerl.loop import replay

    err = Console(stderr=True, log_path=False)
    rank = int(os.environ.get("RANK", "0"))
    # without a terminal, a line at least every 30 s also while a step (or loading the checkpoint) takes longer
    beat = progress_log(err) if rank == 0 and not err.is_terminal else None
    replayed = [0]

    def on_step(row: dict) -> None:
        err.log(f"step {row['step']}: {'equal' if row['equal'] else 'DIFFERS'} (loss {row['loss']}, "
                f"|g| {row['grad_norm']}, digest {row['digest']})")
        replayed[0] += 1
        if beat is not None:
            beat.update("replay", replayed[0], args.steps, printed=True)

    device = init_distributed(args.device)  # under torchrun: the live run's world size, sharded as it was
    try:
        if beat is not None:
            beat.start("replay", args.steps)
        result = replay(ts.open_store(args.store, storage_options=opts), args.checkpoints, live, step=args.step,
                        max_steps=args.steps, device=device, storage_options=opts, on_step=on_step)
    finally:
        if beat is not None:
            beat.close()
        end_distributed()
    if rank != 0:
        return 0 if result["bitwise_equal"] else 1
    if args.json:
        print(json.dumps(result))
    else:
        t = Table(title=f"replay from checkpoint {result['from_step']} of {args.checkpoints} "
                        f"(store log end {result['snapshot_log_end']})")
        for col in ("step", "loss", "grad norm", "weight digest", "bitwise equal"):
            t.add_column(col, justify="right")
        for r in result["rows"]:
            t.add_row(str(r["step"]), repr(r["loss"]), repr(r["grad_norm"]), r["digest"], "yes" if r["equal"] else "NO")
        out = Console()
        out.print(t)
        d = result["first_divergence"]
        out.print(f"{result['steps']} step(s) replayed: " + ("bitwise equal" if result["bitwise_equal"] else
                  ("first divergence at step {step}, {field}: live {live!r}, replay {replay!r}".format(**d)
                   if d else "nothing to compare")))
    return 0 if result["bitwise_equal"] else 1
