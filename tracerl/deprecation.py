"""The module paths of tracerl 0.1's flat layout, kept working for one release with a `DeprecationWarning`.

tracerl 0.1 was one folder of modules (``tracerl.qat``, ``tracerl.engine``, ``tracerl.trainer``, ...); they now
live in sub-packages along the closed loop (``tracerl.policy``, ``tracerl.rollout``, ``tracerl.train``,
``tracerl.artifacts``, ``tracerl.audit``, ``tracerl.loop``). ``import tracerl.qat`` still works: an import hook
(`install`, called by ``import tracerl``) hands out the module that took its place under the old name and warns
once per name; `forward` does the same for a name that left a module whose path stayed (``tracerl.train
.MetricsLog`` is now ``tracerl.runlog.MetricsLog``). Both go away in the next release.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["MOVED_MODULES", "install", "forward"]

#: old module path -> the module that holds its public names now
MOVED_MODULES: dict[str, str] = {
    "tracerl.qat": "tracerl.policy.runtime",
    "tracerl.sites": "tracerl.policy.sites",
    "tracerl.models": "tracerl.policy.models",
    "tracerl.tasks": "tracerl.policy.tasks",
    "tracerl.state": "tracerl.util",
    "tracerl.engine": "tracerl.rollout.engine",
    "tracerl.decode": "tracerl.rollout.decode",
    "tracerl.recorder": "tracerl.rollout.recorder",
    "tracerl.trainer": "tracerl.train.recompute",
    "tracerl.packing": "tracerl.hints.packing",
    "tracerl.rl": "tracerl.train.loss",
    "tracerl.weights": "tracerl.artifacts.weights",
    "tracerl.checkpoint": "tracerl.artifacts.checkpoints",
    "tracerl.audit_metrics": "tracerl.audit.metrics",
    "tracerl.audit_plan": "tracerl.audit.plan",
    "tracerl.audit_report": "tracerl.audit.report",
    "tracerl.audit_html": "tracerl.audit.html",
    "tracerl.replay": "tracerl.loop.replay",
}


def _warn(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and goes away in the next release; use {new}", DeprecationWarning,
                  stacklevel=3)


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds an old module path and loads it as the module that replaced it (the same module object)."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = MOVED_MODULES[spec.name]
        _warn(spec.name, new)
        return importlib.import_module(new)

    def exec_module(self, module) -> None:
        pass  # the module that took the old name's place is already executed


def install() -> None:
    """Make the old module paths importable (idempotent)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())


def forward(package: str, moved: Mapping[str, str]) -> Callable[[str], Any]:
    """A module ``__getattr__`` for ``package`` that hands out each name in ``moved`` (name -> its module now) with
    a `DeprecationWarning`, and raises AttributeError for any other missing name."""

    def __getattr__(name: str) -> Any:
        target = moved.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        _warn(f"{package}.{name}", f"{target}.{name}")
        value = getattr(importlib.import_module(target), name)
        setattr(sys.modules[package], name, value)  # warned once: later look-ups find it
        return value

    return __getattr__
