"""Shared by the FP4 kernel tests: the backends, dtypes and formats they sweep, and bit-exact comparisons.

Importing this module first selects Triton's interpreter on a machine without CUDA (before Triton is loaded)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="no triton")
BACKENDS = ["reference", pytest.param("triton", marks=needs_triton)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FMTS = ["nvfp4", "mxfp4"]
BLOCK = {"nvfp4": 16, "mxfp4": 32}


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t`` as signed integers of its element size."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def assert_bits_equal(a: torch.Tensor, b: torch.Tensor) -> None:
    """Exact equality of bit patterns; NaNs match NaNs (payloads differ between casts)."""
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, b.shape, a.dtype, b.dtype)
    if a.dtype.is_floating_point:
        nan_a, nan_b = torch.isnan(a), torch.isnan(b)
        assert torch.equal(nan_a, nan_b), "NaN positions differ"
        diff = (bits(a) != bits(b)) & ~nan_a
    else:
        diff = a != b
    n = int(diff.sum())
    assert n == 0, f"{n} of {a.numel()} differ; first at {diff.nonzero()[:5].tolist()}"
