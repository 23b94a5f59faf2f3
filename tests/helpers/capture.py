"""`HostTraffic`: a TorchFunctionMode that records torch calls which read device values on the host (and, with
``meta=True``, host -> device copies, run on meta tensors), per calling file/function/line — the CPU stand-in for
torch's CUDA sync debug mode (see ``tests/tracerl/test_capture_sync.py``)."""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))

READS = {
    "item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__array__", "nonzero",
    "argwhere", "unique", "unique_consecutive", "masked_select", "bincount", "histc", "equal", "allclose",
    "is_nonzero",
}
def _caller() -> tuple[str, str, int]:
    """(file relative to the repo, function, line) of the first frame outside torch above the mode."""
    f = sys._getframe(2)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if not fn.startswith(TORCH_DIR):
            rel = os.path.relpath(fn, ROOT) if fn.startswith(ROOT) else fn
            return rel, f.f_code.co_name, f.f_lineno
        f = f.f_back
    return "?", "?", 0


def _has_tensor(data) -> bool:
    if isinstance(data, torch.Tensor):
        return True
    if isinstance(data, (list, tuple)):
        return any(_has_tensor(d) for d in data)
    return False


def _is_bool_index(idx) -> bool:
    if isinstance(idx, torch.Tensor):
        return idx.dtype == torch.bool
    if isinstance(idx, (list, tuple)):
        return any(_is_bool_index(i) for i in idx)
    return False


def _target_device(args, kwargs):
    for a in (kwargs.get("device"), *args):
        if isinstance(a, (torch.device, str)):
            try:
                return torch.device(a)
            except (RuntimeError, TypeError):
                continue
        if isinstance(a, torch.Tensor):
            return a.device
    return None


class HostTraffic(TorchFunctionMode):
    """Counts torch calls that read tensor values on the host (and, with ``meta=True``, host -> meta copies,
    which stand for host -> device copies), per (op, calling file, function, line)."""

    def __init__(self, meta: bool = False):
        super().__init__()
        self.meta = meta
        self.calls: Counter = Counter()

    def _classify(self, name, args, kwargs) -> str | None:
        if name in READS:
            return name
        if name == "repeat_interleave":
            reps = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(reps, torch.Tensor) and kwargs.get("output_size") is None and len(args) < 4:
                return "repeat_interleave(tensor repeats)"
        if name in ("__getitem__", "__setitem__", "index_put_", "index_put", "index") and len(args) > 1:
            if _is_bool_index(args[1]):
                return f"{name}(bool mask)"
        if name == "where" and len(args) == 1 and not kwargs:
            return "where(cond)"
        if name == "one_hot" and (args[1] if len(args) > 1 else kwargs.get("num_classes", -1)) == -1:
            return "one_hot(no num_classes)"
        if name in ("tensor", "as_tensor", "asarray") and args:
            if _has_tensor(args[0]) and not isinstance(args[0], torch.Tensor):
                return "tensor(from tensors)"
            dev = kwargs.get("device")
            src_dev = args[0].device if isinstance(args[0], torch.Tensor) else torch.device("cpu")
            if self.meta and dev is not None and torch.device(dev).type == "meta" and src_dev.type == "cpu":
                return "host->device (torch.tensor)"
        if self.meta and name in ("to", "copy_", "cuda") and args and isinstance(args[0], torch.Tensor):
            src = args[0] if name != "copy_" else args[1]
            dst = _target_device(args[1:], kwargs) if name != "copy_" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type == "cpu" and dst is not None and dst.type == "meta":
                return f"host->device ({name})"
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = self._classify(getattr(func, "__name__", str(func)), args, kwargs)
        if op is not None:
            self.calls[(op, *_caller())] += 1
        return func(*args, **kwargs)


def spy_on_site(rt, site: str) -> list:
    """Make ``rt.quant`` also keep a copy of every activation it quantizes at ``site`` (in call order); returns
    the list the copies go to."""
    seen: list = []
    orig = rt.quant

    def spy(name, x):
        if name == site:
            seen.append(x.detach().clone())
        return orig(name, x)

    rt.quant = spy
    return seen
