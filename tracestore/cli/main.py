"""``tracestore`` command line: a thin layer over the library (`tracestore.maintenance`, `tracestore.reader`,
`tracestore.cli.bench`); this module builds the parser and runs a command, the commands live in ``cmd_create``,
``cmd_read`` (info, ls, show, tail), ``cmd_maintain`` (verify, gc, compact, export) and ``cmd_bench``.

Subcommands: ``create``, ``info``, ``ls``, ``show``, ``tail``, ``verify``, ``gc``, ``compact``, ``export``, ``bench``;
``tracestore <command> --help`` describes each. ``--json`` output is meant for programs (``tail --json`` prints JSON
lines). Exit codes: 0 success, 1 ``verify`` found problems, 2 a tracestore error (one line on stderr; ``--debug``,
before or after the command, shows the traceback) or a usage error, 130 interrupted.

Storage options (S3 endpoints, credentials) come from ``--storage-options JSON`` (or ``@file.json``), else the
environment variable ``TRACESTORE_STORAGE_OPTIONS`` (JSON, applied to non-local URLs only); ``--endpoint-url``
is a shorthand for ``{"client_kwargs": {"endpoint_url": ...}}``. s3fs also reads the usual ``AWS_*`` variables
(:mod:`tracestore.cliargs`, shared with ``tracerl``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence

from ..cliargs import (
    EXIT_ERROR,
    EXIT_INTERRUPTED,
    HelpFormatter,
    UsageError,
    accept_negative_numbers,
    add_debug_argument,
    add_storage_arguments,
    check_local_store,
    storage_options,
)
from ..cliargs import examples as _examples
from ..errors import TraceStoreError
from . import cmd_bench, cmd_create, cmd_maintain, cmd_read
from .common import URL_HELP

# UsageError and storage_options are imported from here by programs written before tracestore.cliargs
__all__ = ["main", "build_parser", "UsageError", "storage_options"]

log = logging.getLogger("tracestore.cli")

#: the commands whose URL need not hold a store yet; every other command with a store URL (``opens_store``) opens
#: an existing store, so a local path without one is answered before the command imports numpy, pyarrow and zarr
NEW_STORE_COMMANDS = frozenset({"create"})


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    g = p.add_argument_group("common options")
    add_storage_arguments(g)
    g.add_argument("-v", "--verbose", action="store_true", help="info logging on stderr")
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    return p


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    common = _common()
    parser = argparse.ArgumentParser(
        prog="tracestore", formatter_class=HelpFormatter,
        description="Inspect, verify, maintain and benchmark tracestore stores (FP4 rollout hints, TRACE). "
                    "A store is a URL: a local directory, s3://bucket/prefix, ...",
        epilog=_examples(["tracestore info /data/run1", "tracestore verify s3://bucket/run1 --endpoint-url "
                         "http://host:9000", "tracestore tail /data/run1 --from-start --timeout 5"],
                        note="exit codes: 0 ok, 1 verify found problems, 2 error (one line on stderr; --debug,\n"
                             "before or after the command, shows the traceback), 130 interrupted"))
    parser.add_argument("--version", action="version", version=f"tracestore {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True, help="run `tracestore COMMAND --help`")
    parser.subcommands = sub.choices

    def add(name: str, help_: str, *, examples: list[str], description: str | None = None, url: bool = True,
            json: str | None = None) -> argparse.ArgumentParser:
        """A subcommand parser with the common options, the ``examples`` as its epilog, the store ``URL`` as its
        first argument (unless ``url`` is false) and ``--json`` (help ``json``) when given."""
        p = sub.add_parser(name, help=help_, description=description or help_, parents=[common],
                           epilog=_examples(examples), formatter_class=HelpFormatter)
        if url:
            p.add_argument("url", metavar="URL", help=URL_HELP)
            p.set_defaults(opens_store=name not in NEW_STORE_COMMANDS)
        if json is not None:
            p.add_argument("--json", action="store_true", help=json)
        return p

    for commands in (cmd_create, cmd_read, cmd_maintain, cmd_bench):
        commands.register(add)
    add_debug_argument(parser)
    accept_negative_numbers(parser)
    return parser


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI; returns the exit code (the console script passes it to ``sys.exit``)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # report it with the subcommand's usage, not the top-level one
        parser.subcommands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else logging.WARNING
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        if getattr(args, "opens_store", False):
            check_local_store(args.url, storage_options(args, args.url))
        return int(args.func(args) or 0)
    except (TraceStoreError, UsageError) as e:
        if args.debug:
            raise
        kind = "" if isinstance(e, UsageError) else f"{type(e).__name__}: "
        sys.stderr.write(f"tracestore {args.command}: error: {kind}{_one_line(e)}\n")
        return EXIT_ERROR
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `tracestore ls | head`
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
