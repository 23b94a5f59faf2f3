"""Argument types shared by the ``tracerl`` subcommands: bad values are rejected by the parser (exit 2, with
the subcommand's usage), before any command code runs."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator

from tracerl.config import LOOP_PARENT_ENV

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"  # argparse names the type in some messages
    return parse


def float_above(lo: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite float > ``lo``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (value > lo and value < float("inf")):
            raise argparse.ArgumentTypeError(f"must be a finite number > {lo:g}, got {text}")
        return value

    parse.__name__ = f"number > {lo:g}"
    return parse


def add_process_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``STORE``, ``--metrics``, ``--device``, ``--threads``, ``--json``: what the loop's processes share (``what``:
    one metrics line per what)."""
    p.add_argument("store", metavar="STORE", help="loop store URL (local directory or s3://bucket/prefix)")
    p.add_argument("--metrics", metavar="PATH", help=f"JSON-lines file of per-{what} metrics (default: none)")
    p.add_argument("--device", default="cpu", help="torch device (default cpu)")
    p.add_argument("--threads", type=int_at_least(0), default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help=f"print one JSON line per {what} on stdout")
    add_storage_arguments(p)


def add_storage_arguments(p: argparse.ArgumentParser) -> None:
    """``--storage-options`` and ``--endpoint-url`` (S3), as the ``tracestore`` commands take them."""
    p.add_argument("--storage-options", metavar="JSON",
                   help="fsspec storage options as JSON or @file.json (S3: key, secret, client_kwargs.endpoint_url); "
                        "default $TRACESTORE_STORAGE_OPTIONS for non-local URLs")
    p.add_argument("--endpoint-url", metavar="URL", help="S3 endpoint (shorthand for client_kwargs.endpoint_url)")


def storage_options(args: argparse.Namespace, url: str) -> dict | None:
    """The storage options of ``url`` from the parsed options (tracestore's rules); raises `ConfigError`."""
    from tracerl.errors import ConfigError
    from tracestore.cli.main import UsageError
    from tracestore.cli.main import storage_options as ts_options

    try:
        return ts_options(args, url)
    except UsageError as e:
        raise ConfigError(str(e)) from None


@contextlib.contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """An event that SIGINT (Ctrl-C) and SIGTERM set, so a long-running command stops at its next boundary (a
    step, a batch) with everything committed; a second SIGINT interrupts at once (KeyboardInterrupt)."""
    stop = threading.Event()
    previous = {}

    def handler(signum, frame):
        if stop.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        previous[sig] = signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)


def stop_with_parent(stop: threading.Event) -> None:
    """Under `tracerl loop` (``TRACERL_LOOP_PARENT`` names the loop's pid): set ``stop`` when the loop process dies,
    however it dies (SIGKILL, a timeout's SIGTERM to a program that called `tracerl.loop.run_loop`), so no trainer
    or rollout outlives it holding a GPU. On Linux the kernel sends SIGINT at the parent's death (prctl
    PR_SET_PDEATHSIG), which `stop_on_signals` turns into a stop at the next boundary; elsewhere nothing changes.
    Call inside `stop_on_signals`."""
    parent = os.environ.get(LOOP_PARENT_ENV)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGINT), 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): this process may outlive the loop", ctypes.get_errno())
    except (OSError, AttributeError) as e:
        log.warning("prctl is not available (%s): this process may outlive the loop", e)
    if str(os.getppid()) != parent:  # the loop died before prctl took effect
        stop.set()
