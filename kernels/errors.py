"""Typed exceptions of the FP4 numerics. Messages say what arrived and what is allowed.

All derive from `FP4Error`, itself a `ValueError`, so callers that catch `ValueError` keep working.
"""

from __future__ import annotations


class FP4Error(ValueError):
    """Base class of every error raised by `kernels`."""


class ShapeError(FP4Error):
    """A tensor's shape does not fit the format (block size, codes/scales/hints layout)."""


class DTypeError(FP4Error, TypeError):
    """A tensor's dtype is not one the operation accepts."""


class FormatError(FP4Error):
    """Unknown format name, scale rule or STE mode, or an argument that the format does not take."""


class LaunchConfigError(FP4Error):
    """A kernel launch configuration (blocks per program, warps, programs per SM) of the wrong shape."""


class BackendError(FP4Error):
    """The requested backend cannot run here (e.g. Triton not importable, or Triton on CPU without
    TRITON_INTERPRET=1)."""
