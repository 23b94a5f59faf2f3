"""Argument types shared by the ``tracerl`` subcommands: bad values are rejected by the parser (exit 2, with
the subcommand's usage), before any command code runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``lo``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"  # argparse names the type in some messages
    return parse
