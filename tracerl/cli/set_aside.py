"""``tracerl set-aside``: what a trainer set aside (never trained on), from a checkpoint's follower state."""

from __future__ import annotations

import argparse
import json

from tracerl.cli.args import add_storage_arguments, int_at_least, storage_options

HELP = "list the trajectories a trainer set aside (bad results, broken token records) from its checkpoint"
DESCRIPTION = (
    "A trainer never stops on a trajectory or group GRPO cannot use (a result without a group id or with another "
    "group size, tokens that do not cover [0, n) past the prompt, a second result, an overfull or never-completed "
    "group): it sets it aside, logs one line, counts it in the step metrics (follower.set_aside) and keeps the "
    "last 1,000 in every checkpoint's follower state. This lists them from checkpoint --step (default: the "
    "latest) of CHECKPOINTS: the totals by reason (all of them) and the entries kept, with the log entry (seq) "
    'that set each aside. With --json: {"step": n, "set_aside": total, "by_reason": {...}, "entries": [...]}.'
)
EXAMPLES = [
    "tracerl set-aside ./run",
    "tracerl set-aside s3://bucket/run --step 120 --reason group_size --json",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tracerl.config import SET_ASIDE_REASONS

    p.add_argument("checkpoints", metavar="CHECKPOINTS",
                   help="the trainer's checkpoint location (its tracerl train --checkpoints)")
    p.add_argument("--step", type=int_at_least(0), metavar="N", help="checkpoint step (default: the latest)")
    p.add_argument("--reason", choices=sorted(SET_ASIDE_REASONS), metavar="REASON",
                   help=f"only entries of this reason: {', '.join(sorted(SET_ASIDE_REASONS))} (default: all)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_storage_arguments(p)


def run(args: argparse.Namespace) -> int:
    opts = storage_options(args, args.checkpoints)
    from tracerl.artifacts import checkpoints as ckpt
    from tracerl.config import SET_ASIDE_REASONS

    c = ckpt.load(args.checkpoints, args.step, storage_options=opts)  # the manifest (tensors are not read)
    follower = c.state.get("follower", {})
    counts = follower.get("counts", {})
    by_reason = {r: counts[f"set_aside.{r}"] for r in SET_ASIDE_REASONS if counts.get(f"set_aside.{r}")}
    entries = [e for e in follower.get("set_aside", []) if args.reason in (None, e.get("reason"))]
    total = counts.get("set_aside", 0)
    if args.json:
        print(json.dumps({"step": c.step, "set_aside": total, "by_reason": by_reason, "entries": entries}))
        return 0
    from rich.console import Console
    from rich.table import Table

    out = Console()
    out.print(f"checkpoint {c.step} of {args.checkpoints}: {total} trajector{'y' if total == 1 else 'ies'} set aside"
              + (f" ({', '.join(f'{r}: {n}' for r, n in by_reason.items())})" if by_reason else ""))
    if entries:
        t = Table(title=f"{len(entries)} kept entr{'y' if len(entries) == 1 else 'ies'}"
                        + (f" of reason {args.reason}" if args.reason else ""))
        for col, just in (("log entry", "right"), ("trajectory", "left"), ("group", "left"), ("reason", "left"),
                          ("detail", "left")):
            t.add_column(col, justify=just)
        for e in entries:
            t.add_row(str(e.get("seq")), e.get("traj_id", ""), e.get("group_id", ""), e.get("reason", ""),
                      e.get("detail", "") or SET_ASIDE_REASONS.get(e.get("reason"), ""))
        out.print(t)
    return 0
