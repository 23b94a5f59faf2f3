"""``tracerl`` command line.

Each subcommand is a module of this package named in `COMMANDS`, with ``HELP`` (one line), ``DESCRIPTION``,
``EXAMPLES`` (command lines shown under its ``--help``), ``add_arguments(parser)`` and ``run(args) -> int``;
argument types they share are in `tracerl.cli.args`. Building the parser imports those modules only: torch,
transformers and tracestore's data modules are imported inside ``run``, after the arguments (and a store URL's
existence, where a command needs one) were checked, so ``tracerl --help``, ``--version`` and argument errors
answer at once. ``--debug`` goes before or after the subcommand. Exit codes: 0 ok, 1 the command found a problem
(``audit``, ``replay``), 2 bad arguments or a tracerl / tracestore error (one line on stderr; ``--debug`` shows the
traceback), 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from tracerl.cli.demo import render_table
from tracerl.errors import TracerlError
from tracestore.cliargs import EXIT_ERROR, EXIT_INTERRUPTED, accept_negative_numbers, add_debug_argument

#: subcommand -> module under tracerl.cli
COMMANDS = {"demo": "tracerl.cli.demo", "train": "tracerl.cli.train", "rollout": "tracerl.cli.rollout",
            "loop": "tracerl.cli.loop", "replay": "tracerl.cli.replay", "audit": "tracerl.cli.audit",
            "set-aside": "tracerl.cli.set_aside"}

__all__ = ["COMMANDS", "build_parser", "main", "render_table"]


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: an argument it does not know is reported with its own usage (argparse would hand
    it back to the top-level parser, whose usage does not show the subcommand's options)."""

    def parse_known_args(self, args=None, namespace=None):
        namespace, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return namespace, extra


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tracestore")  # the distribution that installs tracerl
    except PackageNotFoundError:
        return "unknown (not installed)"


class _VersionAction(argparse.Action):
    """``--version``: prints ``tracerl <version>`` and exits; the distribution's metadata is read only then (it
    took 17 ms of every command's start)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        parser._print_message(f"tracerl {_version()}\n", sys.stdout)
        parser.exit()


def _examples(lines: Sequence[str]) -> str:
    return "examples:\n" + "\n".join(f"  {line}" for line in lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tracerl", description="TRACE rollout capture and hint-guided QAT tools.",
                                epilog=_examples(["tracerl demo", "tracerl audit ./store --html report.html",
                                                  "tracerl COMMAND --help"]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_VersionAction, help="print the version and exit")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_CommandParser,
                           help="what to run; tracerl COMMAND --help lists its options")
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.DESCRIPTION,
                             epilog=_examples(module.EXAMPLES), formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(cmd)
        cmd.set_defaults(func=module.run)
    add_debug_argument(p)
    accept_negative_numbers(p)
    return p


def _is_store_error(e: BaseException) -> bool:
    # tracestore is imported by the commands that use it; an error of its type implies it is loaded
    ts = sys.modules.get("tracestore")
    return ts is not None and isinstance(e, ts.TraceStoreError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.debug:
        logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"tracerl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if args.debug or not (isinstance(e, TracerlError) or _is_store_error(e)):
            raise
        print(f"tracerl {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return EXIT_ERROR
