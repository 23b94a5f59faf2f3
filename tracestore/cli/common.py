"""What the ``tracestore`` commands share: the store an argument names, text and JSON output, progress bars."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Iterator

from ..cliargs import UsageError, storage_options

__all__ = ["URL_HELP", "open_store_arg", "out", "json_out", "human_bytes", "progress"]

URL_HELP = "store URL: a local directory, s3://bucket/prefix, or another fsspec URL"


def open_store_arg(args: argparse.Namespace):
    """The store ``args.url`` names, opened with the storage options the arguments give. Raises UsageError."""
    from ..store import open_store

    opts = storage_options(args, args.url)
    try:
        return open_store(args.url, storage_options=opts)
    except TypeError as e:  # unknown storage option for this backend (e.g. an S3 option on a local path)
        raise UsageError(f"storage options {sorted(opts or {})} do not apply to {args.url}: {e}") from e


def out(text: str = "") -> None:
    sys.stdout.write(text + "\n")


def json_out(obj) -> None:
    sys.stdout.write(json.dumps(obj, default=_json_default) + "\n")


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")  # what json.dumps expects of its default hook


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n} B"


@contextlib.contextmanager
def progress(args: argparse.Namespace, description: str) -> Iterator:
    """Progress of a long phase on stderr, nothing with ``--quiet``; yields a callback ``(done, total, what)``. On a
    terminal a rich progress bar; elsewhere (a CI log, ``nohup``, a pipe) plain lines
    (`tracestore.cliargs.ProgressLog`): one at least every 30 s until the block ends (``$TRACESTORE_PROGRESS_EVERY_S``), with the last count, rate and
    ETA, also while no count arrives, and one as it ends; a block shorter than that prints nothing."""
    if getattr(args, "quiet", False):
        yield lambda done, total, what="": None
        return
    if not sys.stderr.isatty():
        from ..cliargs import ProgressLog

        # one phase for the whole command: counted in rounds (bench), with uncounted work around them
        with ProgressLog(_stderr_line, unit="items", finish_at_total=False) as log:
            log.start(description)
            yield lambda done, total, what="": log.update(description, done, total, str(what)[-60:])
            log.finish(description)
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  TextColumn("{task.fields[what]}"), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=None, what="")

        def update(done: int, total: int, what: str = "") -> None:
            bar.update(task, completed=done, total=total, what=str(what)[-60:])

        yield update


def _stderr_line(line: str) -> None:
    """One progress line on stderr, after the time of day, as ``[12:04:31] tracestore verify: 10/20 ...``."""
    sys.stderr.write(f"[{time.strftime('%H:%M:%S')}] tracestore {line}\n")
    sys.stderr.flush()
