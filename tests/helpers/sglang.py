"""Helpers for the SGLang plugin's tests: SGLang's plugin loader in a fresh interpreter without running
``sglang/__init__.py`` (whose imports need SGLang's CUDA stack), and SGLang's scale layouts built independently of
the code under test."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from helpers.loop import REPO

#: the start of a child script: ``sglang`` as a bare namespace package, so ``sglang.srt.*`` imports without
#: ``sglang/__init__.py`` (``sglang/srt`` has no ``__init__.py`` in 0.5.23)
NAMESPACE = """
import importlib.util, sys, types
_spec = importlib.util.find_spec("sglang")
_pkg = types.ModuleType("sglang"); _pkg.__path__ = list(_spec.submodule_search_locations)
sys.modules["sglang"] = _pkg
"""


def sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


def run_child(code: str, env_extra: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """``code`` after `NAMESPACE` in a fresh interpreter, with this checkout on the path and no TRACERL_SGLANG_*
    variable but ``env_extra``'s; stdout and stderr captured."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRACERL_SGLANG_", "SGLANG_PLUGINS"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, os.path.join(REPO, "tests"), env.get("PYTHONPATH", "")])
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", NAMESPACE + code], env=env, capture_output=True, text=True,
                          timeout=timeout)


def json_tail(proc: subprocess.CompletedProcess) -> dict:
    """The last stdout line of a child as JSON."""
    return json.loads(proc.stdout.strip().splitlines()[-1])


def swizzle_128x4(sf: np.ndarray) -> np.ndarray:
    """Linear scale bytes [M, K] -> FlashInfer's 128x4-interleaved layout (``nvfp4_block_scale_interleave``),
    padded to [round_up(M, 128), round_up(K, 4)] with zeros, returned flat. Built element by element from the
    layout's index formula (tile (r // 128, c // 4), inside it row r % 32, then (r % 128) // 32, then c % 4), not
    by the reshapes the code under test uses."""
    m, k = sf.shape
    mp, kp = -(-m // 128) * 128, -(-k // 4) * 4
    out = np.zeros(mp * kp, dtype=np.uint8)
    for r in range(m):
        for c in range(k):
            tile = (r // 128) * (kp // 4) + c // 4
            out[tile * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4] = sf[r, c]
    return out
