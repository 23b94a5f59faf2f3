"""What the ``tracerl`` subcommands share: argument types (`tracestore.cliargs`, the same as the ``tracestore``
command's: bad values are rejected by the parser, exit 2 with the subcommand's usage, before any command code runs),
storage options, the options of the loop's processes, and stopping on signals."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator

from tracerl.config import LOOP_PARENT_ENV
from tracestore.cliargs import (
    add_storage_arguments,
    finite_float,
    float_above,
    float_at_least,
    int_at_least,
    storage_options,
)

__all__ = ["add_storage_arguments", "finite_float", "float_above", "float_at_least", "int_at_least",
           "storage_options", "add_process_arguments", "stop_on_signals", "stop_with_parent"]

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def add_process_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """``STORE``, ``--metrics``, ``--device``, ``--threads``, ``--json``: what the loop's processes share (``what``:
    one metrics line per what)."""
    p.add_argument("store", metavar="STORE", help="loop store URL (local directory or s3://bucket/prefix)")
    p.add_argument("--metrics", metavar="PATH", help=f"JSON-lines file of per-{what} metrics (default: none)")
    p.add_argument("--device", default="cpu", metavar="DEVICE", help="torch device: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--threads", type=int_at_least(0), default=0, metavar="N",
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help=f"print one JSON line per {what} on stdout")
    add_storage_arguments(p)


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
