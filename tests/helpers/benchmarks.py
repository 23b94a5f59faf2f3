"""A program of benchmarks/ imported as a module (they are scripts, not a package), for tests of its functions."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load(name: str) -> ModuleType:
    """benchmarks/<name>.py, freshly imported (its module-level code runs). What that code changes in ``os.environ``
    is undone afterwards: a program sets, e.g., ``PYTHONPATH`` to the repository for the processes it starts when run
    as a script, and left in the test process that would put the repository's ``kernels/`` folder ahead of PyPI's
    ``kernels`` in every later test's subprocess (tests/test_import_names.py failed after a benchmark was loaded)."""
    env = dict(os.environ)
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        for k in set(os.environ) - set(env):
            del os.environ[k]
        for k, v in env.items():
            if os.environ.get(k) != v:
                os.environ[k] = v
    return mod
