"""Small helpers every room of tracerl uses: scoped attribute changes, and moving tensors between the host and a
device without host syncs.

A host sync (the CPU waiting for the GPU) in a decode step or a trainer forward costs more than the kernels around
it, and a CUDA graph capture forbids it outright, so tensors cross to a device from pinned memory without
blocking (`to_device`) and come back in one transfer per device (`to_host`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tracerl.errors import ConfigError

__all__ = ["swapped", "to_device", "to_host", "sync", "check_device"]


@contextlib.contextmanager
def swapped(obj: Any, **values: Any) -> Iterator[Any]:
    """Set attributes of ``obj`` to ``values`` inside the block and put the previous values back on exit, also
    when the block raises. Nested blocks restore in reverse order, so each sees what the enclosing one set.

    Raises AttributeError (before anything is changed) for an attribute ``obj`` does not have."""
    missing = [k for k in values if not hasattr(obj, k)]
    if missing:
        raise AttributeError(f"{type(obj).__name__} has no attribute(s) {missing}")
    prev = {k: getattr(obj, k) for k in values}
    try:
        for k, v in values.items():
            setattr(obj, k, v)
        yield obj
    finally:
        for k, v in prev.items():
            setattr(obj, k, v)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host tensor -> ``device`` without a host sync (``t.to(cuda)`` from pageable memory blocks the host)."""
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


_NP_DTYPES = {torch.uint8: np.uint8, torch.int8: np.int8, torch.int16: np.int16, torch.int32: np.int32,
              torch.int64: np.int64, torch.float16: np.float16, torch.float32: np.float32,
              torch.float64: np.float64, torch.bool: np.bool_}


def to_host(tensors: Sequence[torch.Tensor]) -> list[np.ndarray]:
    """numpy copies of ``tensors`` (numpy dtypes only) with one device-to-host transfer per device.

    Each device's tensors are concatenated as raw bytes on the device, copied once and split on the host, so
    the values are bit for bit the tensors' (a ``.cpu()`` per tensor would be a blocking copy, a host sync,
    each). Host tensors take the same path, so a CPU run reads values exactly as often as a CUDA run."""
    out: list[np.ndarray | None] = [None] * len(tensors)
    by_dev: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dev.setdefault(t.device, []).append(i)
    for idx in by_dev.values():
        idx.sort(key=lambda i: -tensors[i].element_size())  # keeps every part's byte offset aligned
        flat = [tensors[i].contiguous().reshape(-1).view(torch.uint8) for i in idx]
        host = torch.cat(flat).cpu().numpy()
        off = 0
        for i, f in zip(idx, flat):
            t = tensors[i]
            n = f.shape[0]
            out[i] = host[off : off + n].view(_NP_DTYPES[t.dtype]).reshape(tuple(t.shape))
            off += n
    return out


def sync(device: torch.device) -> None:
    """Wait for ``device`` (timings of CUDA work); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_device(name: str) -> torch.device:
    """``name`` as a torch device this machine can run tracerl on (cpu, or cuda when torch sees a GPU).

    Raises `ConfigError` naming what arrived and what is allowed."""
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {name!r} is not a torch device ({e}); e.g. cpu, cuda, cuda:1") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r}: this torch ({torch.__version__}) sees no CUDA device")
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device {name!r}: tracerl runs on cpu or cuda")
    return dev
