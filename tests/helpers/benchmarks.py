"""A program of benchmarks/ imported as a module (they are scripts, not a package), for tests of its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py, freshly imported (its module-level code runs)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
