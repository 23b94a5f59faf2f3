"""The argparse number types of the ``tracestore`` commands; they live in :mod:`tracestore.cliargs` (shared with
``tracerl``) and are re-exported here for programs that import them from this module."""

from ..cliargs import nonneg_float, nonneg_int, positive_float, positive_int

__all__ = ["positive_int", "nonneg_int", "positive_float", "nonneg_float"]
