"""What a run writes down and reports: per-step metrics as JSON lines (`MetricsLog`), values made JSON-ready
(`json_ready`), the machine it ran on (`machine_info`), and the progress callback of long phases (`StepFn`). The trainer, the rollout worker, the loop, the
audit, the demo and the benchmarks all record through these."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["MetricsLog", "json_ready", "machine_info", "StepFn"]

#: a long phase's progress callback, ``on_step(phase, done, total)`` (first called with ``done == 0``)
StepFn = Callable[[str, int, int], None]


class MetricsLog:
    """Per-step metrics as JSON lines (one object per step, ``step`` increasing), appended and flushed per step.

    `truncate_after(step)` drops lines of later steps (and a torn last line), atomically (temp file + rename):
    a trainer that restarts from checkpoint ``step`` rewrites what the killed run logged after it."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else Path(path)

    def records(self) -> list[dict]:
        if self.path is None or not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line torn by a kill: the end of what was logged
        return out

    def truncate_after(self, step: int) -> None:
        if self.path is None or not self.path.exists():
            return
        keep = [r for r in self.records() if r.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def append(self, record: Mapping) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def json_ready(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN: a statistic of nothing) replaced by None and numpy scalars made
    Python numbers, recursively through mappings, lists and tuples (tuples become lists)."""
    if hasattr(obj, "item") and type(obj).__module__ == "numpy" and getattr(obj, "ndim", None) == 0:
        obj = obj.item()  # a numpy scalar (np.float32(...), np.int64(...))
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def machine_info() -> dict[str, Any]:
    """The machine and the versions a measurement ran with (the ``machine`` entry of results and benchmarks)."""
    import torch

    try:
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = None
    cuda = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers,
            # the CPU's model and the kernels torch picks for it: CPU bf16 / fp32 GEMMs round differently across
            # them, so a CPU run's figures (the demo's table) differ between machines with the same code and versions
            "cpu_model": _cpu_model(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cuda_device": cuda[0] if cuda else None, "cuda": cuda,
            "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}


def _cpu_model() -> str | None:
    """The CPU's model name (Linux: /proc/cpuinfo's first ``model name``; else `platform.processor`), None if unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        pass
    return platform.processor() or None
