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
from typing import NoReturn

from tracerl.config import LOOP_PARENT_ENV, check_store_exists
from tracestore.cliargs import (
    add_storage_arguments,
    check_local_store,
    finite_float,
    float_above,
    float_at_least,
    int_at_least,
    storage_options,
)

__all__ = ["add_storage_arguments", "finite_float", "float_above", "float_at_least", "int_at_least",
           "storage_options", "existing_store_options", "add_process_arguments", "add_model_size_arguments",
           "start_process", "init_distributed",
           "end_distributed", "exit_process",
           "stop_on_signals", "stop_with_parent"]

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


def add_model_size_arguments(p: argparse.ArgumentParser, *, vocab: bool = True) -> None:
    """``--hidden``, ``--layers``, ``--experts`` (and ``--vocab``): overrides of `tracerl.config.TinyMoESpec`'s
    defaults, each None when not given."""
    pos = int_at_least(1)
    p.add_argument("--hidden", type=pos, metavar="N", help="model hidden size, a multiple of 16 (default 256)")
    p.add_argument("--layers", type=pos, metavar="N", help="decoder layers (default 8)")
    p.add_argument("--experts", type=pos, metavar="N",
                   help="routed experts per MoE layer, at most 256 (default 16, top-2)")
    if vocab:
        p.add_argument("--vocab", type=pos, metavar="N", help="vocabulary size (default 1024)")


def existing_store_options(args: argparse.Namespace, url: str) -> dict | None:
    """The storage options of ``url`` (`storage_options`), once a store is known to exist there: before a command
    imports torch or builds a model. A local path without a store is answered without numpy, pyarrow or zarr
    (`tracestore.cliargs.check_local_store`); any other URL is opened and closed with tracestore (s3fs for S3).

    Raises:
        UsageError: bad storage options. StoreNotFoundError: no store at ``url``. BackendError: the storage failed.
    """
    opts = storage_options(args, url)
    check_local_store(url, opts)
    check_store_exists(url, opts)
    return opts


def start_process(args: argparse.Namespace):
    """What a loop process (``tracerl train``, ``tracerl rollout``) does first, after its arguments were checked: the
    store's storage options (raises tracestore's `UsageError`) once the store is known to exist
    (`existing_store_options`: tracestore's `StoreNotFoundError`), then torch's CPU threads, warnings-level
    logging, and a rich console on stderr for its progress lines. Returns (storage options, console)."""
    opts = existing_store_options(args, args.store)
    import torch
    from rich.console import Console

    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    return opts, Console(stderr=True, log_path=False)


def init_distributed(device: str) -> str:
    """Under torchrun (any ``--nproc-per-node``, 1 included: the FSDP2 path at world size 1) or another launcher
    with ``WORLD_SIZE`` > 1: join the process group (NCCL for CUDA, gloo otherwise) and return this rank's device
    (``cuda:LOCAL_RANK`` for a CUDA device); else (a plain process) ``device`` unchanged."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and "TORCHELASTIC_RUN_ID" not in os.environ:
        return device
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    global _JOINED
    _JOINED = True
    return device


#: whether this process joined a process group (`init_distributed`): `exit_process` then skips finalization
_JOINED = False


def exit_process(rc: int) -> NoReturn:
    """End the ``python -m tracerl.cli`` process with exit status ``rc``. A process that joined a process group
    (a torchrun rank) leaves with ``os._exit`` once its output and logs are flushed: with gloo, a rank's process
    sometimes aborted *after* its work was done and the group destroyed ("terminate called without an active
    exception", SIGABRT, once in CI, not reproduced in 32 runs here), the known PyTorch teardown race of c10d's C++
    threads and interpreter finalization (pytorch/pytorch#179291); skipping finalization removes the window. Every
    command has committed, published and joined its threads before it returns, so nothing is lost."""
    if _JOINED:
        sys.stdout.flush()
        sys.stderr.flush()
        logging.shutdown()
        os._exit(rc)
    sys.exit(rc)


def end_distributed() -> None:
    """Leave the process group `init_distributed` joined (nothing without one)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        # every rank past its last collective before any tears the group down (a rank leaving while another still
        # communicated is the suspect of a rare abort at exit, "terminate called without an active exception")
        dist.barrier()
        dist.destroy_process_group()


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
