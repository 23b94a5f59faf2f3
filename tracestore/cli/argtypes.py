"""argparse value types that check numbers at parse time: a bad value is a one-line usage error (exit 2) naming
the option, what arrived and what is allowed, before any work starts."""

from __future__ import annotations

import argparse
import math


def _number(text: str, kind: type, lo: float, lo_open: bool) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    if value < lo or (lo_open and value == lo):
        raise argparse.ArgumentTypeError(f"must be {'>' if lo_open else '>='} {lo:g}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer > 0."""
    return int(_number(text, int, 0, True))


def nonneg_int(text: str) -> int:
    """An integer >= 0."""
    return int(_number(text, int, 0, False))


def positive_float(text: str) -> float:
    """A finite number > 0."""
    return float(_number(text, float, 0.0, True))


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    return float(_number(text, float, 0.0, False))
