"""The ``tracestore`` command line (``main``) and the benchmark harness behind ``tracestore bench`` (``bench``)."""

from .main import build_parser, main

__all__ = ["main", "build_parser"]
