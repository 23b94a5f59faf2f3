"""What tracerl keeps beside a store, as immutable objects committed like the store's own records (data first,
then a commit object created with put-if-absent): policy versions (`tracerl.artifacts.weights`), trainer
checkpoints (`tracerl.artifacts.checkpoints`), the rollout's recorded codes (`tracerl.artifacts.codes`), and the
safetensors codec and commit-object helpers they share (`tensorfile`, `objects`). The formats are specified in
``schemas/ARTIFACTS.md``.

The modules are imported on first use (PEP 562): listing or reading a checkpoint's manifest (``tracerl replay``,
``tracerl set-aside`` checking their arguments) loads no torch.
"""

import importlib
from typing import Any

__all__ = ["checkpoints", "codes", "errors", "objects", "tensorfile", "weights"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'tracerl.artifacts' has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")  # the import binds it here: later look-ups skip this


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
