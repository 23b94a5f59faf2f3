"""Command-line pieces shared by the ``tracestore`` and ``tracerl`` commands, so that both take the same options in
the same places and fail alike: usage errors, storage options, ``--debug``, argparse number types, exit codes.

Imports nothing heavy (no numpy, pyarrow, zarr or torch): a command checks its arguments before it loads any of
them. Usage::

    parser = argparse.ArgumentParser(prog="tool")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("check")
    p.add_argument("url")
    p.add_argument("--limit", type=int_at_least(1), metavar="N")
    add_storage_arguments(p)
    add_debug_argument(parser)       # after the subcommands: `tool --debug check` and `tool check --debug`
    accept_negative_numbers(parser)  # `--x -1e-05` is a value, not an unknown option
    args = parser.parse_args()
    options = storage_options(args, args.url)  # raises UsageError
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Callable, Iterator

from .errors import UsageError

__all__ = ["UsageError", "EXIT_PROBLEMS", "EXIT_ERROR", "EXIT_INTERRUPTED", "ENV_STORAGE_OPTIONS",
           "add_storage_arguments", "storage_options", "load_json_arg", "add_debug_argument", "HelpFormatter",
           "examples",
           "accept_negative_numbers", "int_at_least", "float_above", "float_at_least", "finite_float",
           "positive_int", "nonneg_int", "positive_float", "nonneg_float"]

#: exit codes: the command ran and found problems (``tracestore verify``, an audit that found one)
EXIT_PROBLEMS = 1
#: bad arguments or an error (one line on stderr)
EXIT_ERROR = 2
#: interrupted (SIGINT), as shells report 128 + 2
EXIT_INTERRUPTED = 130

#: JSON storage options for non-local URLs when ``--storage-options`` is not given
ENV_STORAGE_OPTIONS = "TRACESTORE_STORAGE_OPTIONS"


# ---------------------------------------------------------------------------------------------- storage options
def load_json_arg(text: str, what: str):
    """``text`` as JSON, or the JSON in file ``text[1:]`` when it starts with ``@``; ``what`` names the option in
    errors. Raises UsageError."""
    try:
        if text.startswith("@"):
            with open(text[1:], encoding="utf-8") as f:
                return json.load(f)
        return json.loads(text)
    except OSError as e:
        raise UsageError(f"{what}: cannot read {text[1:]!r}: {e.strerror}") from e
    except ValueError as e:
        raise UsageError(f"{what}: not valid JSON ({e}): {text!r:.120}") from e


def add_storage_arguments(parser) -> None:
    """``--storage-options JSON|@file.json`` and ``--endpoint-url URL`` on ``parser`` (or an argument group)."""
    parser.add_argument("--storage-options", metavar="JSON",
                        help=f"fsspec storage options as JSON or @file.json (S3: key, secret, "
                             f"client_kwargs.endpoint_url); default ${ENV_STORAGE_OPTIONS} for non-local URLs")
    parser.add_argument("--endpoint-url", metavar="URL", help="S3 endpoint (shorthand for client_kwargs.endpoint_url)")


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def storage_options(args: argparse.Namespace, url: str) -> dict | None:
    """Storage options of ``url`` from ``--storage-options``, else ``$TRACESTORE_STORAGE_OPTIONS`` (non-local URLs
    only), with ``--endpoint-url`` set as ``client_kwargs.endpoint_url``; None when there are none.

    Raises:
        UsageError: a ``memory://`` URL (such a store lives inside one process and is gone when the command ends),
            options that are not valid JSON or not a JSON object, an unreadable ``@file``.
    """
    if url.startswith("memory://"):
        raise UsageError(f"{url}: a memory:// store lives only inside one Python process and is gone when this "
                         f"command ends; use a local directory or s3://bucket/prefix")
    opts = None
    if getattr(args, "storage_options", None):
        opts = load_json_arg(args.storage_options, "--storage-options")
    elif os.environ.get(ENV_STORAGE_OPTIONS) and not _is_local(url):
        opts = load_json_arg(os.environ[ENV_STORAGE_OPTIONS], ENV_STORAGE_OPTIONS)
    if opts is not None and not isinstance(opts, dict):
        raise UsageError(f"storage options must be a JSON object, got {type(opts).__name__}")
    if getattr(args, "endpoint_url", None):
        opts = dict(opts or {})
        opts.setdefault("client_kwargs", {})["endpoint_url"] = args.endpoint_url
    return opts


# ---------------------------------------------------------------------------------------------- parsers
def _parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """``parser``'s subcommand parsers, nested ones included, each once (aliases share a parser)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):  # argparse has no public way to reach them
            for sub in dict.fromkeys(action.choices.values()):
                yield sub
                yield from _parsers(sub)


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help layout, except that a text with line breaks (an epilog of :func:`examples`) is printed as
    written; one-paragraph descriptions are filled to the terminal's width as usual."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if "\n" in text:
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def examples(lines: list[str], note: str = "") -> str:
    """An epilog for :class:`HelpFormatter`: ``examples:``, one command line each, then ``note`` if given."""
    text = "examples:\n" + "\n".join(f"  {line}" for line in lines)
    return f"{text}\n\n{note}" if note else text


DEBUG_HELP = "show tracebacks and debug logging (before or after the command)"


def add_debug_argument(parser: argparse.ArgumentParser) -> None:
    """``--debug`` on ``parser`` and on every subcommand it has (call it once the subcommands are added), so that
    ``prog --debug cmd`` and ``prog cmd --debug`` both set ``args.debug``: the subcommands' copies default to
    ``SUPPRESS`` and so leave the main parser's value alone unless they are given."""
    parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
    for sub in _parsers(parser):
        sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


#: what argparse should take for a negative number: its own pattern (``^-\d+$|^-\d*\.\d+$``, Python 3.11 to 3.13.0)
#: misses exponents, so ``--x -1e-05`` is read as an unknown option and ``--x`` lacks its value
NEGATIVE_NUMBER = re.compile(r"^-(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?$")


def accept_negative_numbers(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` and its subcommands read ``-1e-05`` (and ``-2``, ``-.5``) after an option as that option's
    value. Like argparse's own rule it applies only to parsers with no option that looks like a negative number."""
    for p in (parser, *_parsers(parser)):
        p._negative_number_matcher = NEGATIVE_NUMBER  # the (private) pattern argparse consults


# ---------------------------------------------------------------------------------------------- number types
def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}") from None


def int_at_least(lo: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``lo``."""

    def parse(text: str) -> int:
        value = _number(text, int)
        if value < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"  # argparse names the type in some messages
    return parse


def _float_bounded(lo: float, strict: bool) -> Callable[[str], float]:
    relation = ">" if strict else ">="

    def parse(text: str) -> float:
        value = _number(text, float)
        if not (math.isfinite(value) and (value > lo if strict else value >= lo)):
            raise argparse.ArgumentTypeError(f"must be a finite number {relation} {lo:g}, got {text}")
        return value

    parse.__name__ = f"number {relation} {lo:g}"
    return parse


def float_above(lo: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite float > ``lo``."""
    return _float_bounded(lo, strict=True)


def float_at_least(lo: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite float >= ``lo``."""
    return _float_bounded(lo, strict=False)


def finite_float(text: str) -> float:
    """An argparse ``type``: any finite float (negative ones too: see :func:`accept_negative_numbers`)."""
    value = _number(text, float)
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


#: an integer > 0
positive_int = int_at_least(1)
#: an integer >= 0
nonneg_int = int_at_least(0)
#: a finite number > 0
positive_float = float_above(0.0)
#: a finite number >= 0
nonneg_float = float_at_least(0.0)
