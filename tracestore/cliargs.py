"""Command-line pieces shared by the ``tracestore`` and ``tracerl`` commands, so that both take the same options in
the same places and fail alike: usage errors, storage options, a local store's existence, ``--debug``, argparse
number types, exit codes, and the plain progress lines of long phases when stderr is not a terminal (`ProgressLog`).

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
import threading
import time
from collections.abc import Callable, Iterator

from .errors import StoreNotFoundError, UsageError

__all__ = ["UsageError", "EXIT_PROBLEMS", "EXIT_ERROR", "EXIT_INTERRUPTED", "ENV_STORAGE_OPTIONS",
           "add_storage_arguments", "storage_options", "check_local_store", "load_json_arg", "add_debug_argument",
           "HelpFormatter",
           "examples",
           "accept_negative_numbers", "int_at_least", "float_above", "float_at_least", "finite_float",
           "positive_int", "nonneg_int", "positive_float", "nonneg_float",
           "ENV_PROGRESS_EVERY_S", "DEFAULT_EVERY_S", "progress_every_s", "ProgressLog"]

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


#: a store's manifest, the object whose absence means "no store here" (`tracestore.format.keys.MANIFEST_KEY`; that
#: module loads numpy and pyarrow, so the name is repeated here and a test checks that the two agree)
MANIFEST_NAME = "tracestore.json"


def check_local_store(url: str, storage_options: dict | None = None) -> None:
    """Raise `StoreNotFoundError`, with `tracestore.open_store`'s message, when ``url`` is a local path that holds
    no store (nothing there, or a directory without a manifest), without loading numpy, pyarrow or zarr: a command
    says so at once. Anything else passes (a store, a remote URL, storage options, a path `open_store` refuses for
    another reason: a file on the way, no permission): opening the store decides then."""
    if storage_options or not _is_local(url):
        return  # s3fs and friends are needed to know; storage options on a local path are open_store's error
    root = os.path.abspath(os.path.expanduser(url.removeprefix("file://")))
    try:
        os.stat(os.path.join(root, MANIFEST_NAME))
    except FileNotFoundError:  # ENOENT only: ENOTDIR, EACCES, ... are open_store's to describe
        raise StoreNotFoundError(f"no tracestore store at {url} ({MANIFEST_NAME} not found)") from None
    except (OSError, ValueError):
        return


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


# ---------------------------------------------------------------------------------------------- progress lines
# Without a terminal (a CI log, a ``nohup`` run, a pipe) both commands print plain progress lines instead of rich
# bars: a long phase prints a line at least every ``every_s`` seconds (default 30; ``$TRACESTORE_PROGRESS_EVERY_S``
# overrides it) with its count, rate and ETA. A heartbeat thread writes the line when it is due, so that a phase
# whose steps are slow, or one that has not counted its first step yet, prints too::
#
#     with ProgressLog(lambda line: print(line, file=sys.stderr, flush=True)) as log:
#         log.start("verify")                # optional: time it (and the heartbeat) before the first count
#         for k, item in enumerate(items):
#             log.update("verify", k, len(items))
#             ...
#         log.update("verify", len(items), len(items))
#
# A line reads ``verify: 120/5,000 (2%), 4.00 items/s, 30s elapsed, eta 1220s``. A phase that finishes before its
# first line is due prints nothing (unless ``announce``: a line as it starts and one as it ends, always); one that
# printed a line prints one more as it ends.

#: seconds between two progress lines of a running phase without a terminal (a float); default `DEFAULT_EVERY_S`
ENV_PROGRESS_EVERY_S = "TRACESTORE_PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 30.0
#: the heartbeat thread never wakes more often than this, whatever the interval
_MIN_WAIT_S = 0.01


def progress_every_s(default: float = DEFAULT_EVERY_S) -> float:
    """``$TRACESTORE_PROGRESS_EVERY_S`` when it is set to a number >= 0, else ``default``."""
    text = os.environ.get(ENV_PROGRESS_EVERY_S, "").strip()
    try:
        value = float(text)
    except ValueError:
        return default
    return value if value >= 0 else default  # nan compares False: the default


class _Phase:
    __slots__ = ("began", "started", "logged", "first", "done", "total", "what", "lines")

    def __init__(self, now: float, total: int | None, done: int = 0):
        self.began = self.started = self.logged = now  # began: the first round's start (the end line's time)
        self.first = self.done = done  # the rate counts what was done since this round started
        self.total = total
        self.what = ""
        self.lines = 0


class ProgressLog:
    """Plain progress lines through ``write`` (one call per line, without a newline): see "progress lines" above.

    Args:
        write: takes one line (``print`` to stderr, a rich console's ``log``); called from the heartbeat thread too.
        every_s: seconds between two lines of a running phase (default `progress_every_s`: 30 s).
        unit: what the counts count (``steps``, ``items``, ``batches``), as in ``4.00 items/s``.
        announce: also a line when a phase starts and one when it ends, however short it is.
        finish_at_total: a phase ends when its count reaches its total (False: at `finish` or `close` only, for a
            phase that runs in rounds, each counted up to its own total, with uncounted work between them).
        heartbeat: write due lines from a background thread (False: only from `update`; for a simulated clock).
        clock: seconds, monotonic.
    """

    def __init__(self, write: Callable[[str], None], *, every_s: float | None = None, unit: str = "items",
                 announce: bool = False, finish_at_total: bool = True, heartbeat: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.write = write
        self.every_s = progress_every_s() if every_s is None else float(every_s)
        self.unit = unit
        self.announce = announce
        self.finish_at_total = finish_at_total
        self.clock = clock
        self._heartbeat = heartbeat
        self._phases: dict[str, _Phase] = {}  # running phases, in start order
        self._ended: dict[str, tuple[int, int | None]] = {}  # phase -> (done, total) it ended at
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------------------------------ the caller's side
    def start(self, phase: str, total: int | None = None) -> None:
        """Start timing ``phase`` now (`update` starts a phase it does not know, too)."""
        with self._lock:
            if not self._closed:
                self._start(phase, total, self.clock())

    def update(self, phase: str, done: int, total: int | None = None, what: str = "", *,
               printed: bool = False) -> None:
        """``done`` of ``total`` (None: unknown) steps of ``phase`` are done; ``what`` (optional) names the current
        item. A count below the last one or a total other than the one known starts a new round of the phase (its
        rate and ETA start again), except a final count given as its own total (``done == total``: a phase whose
        total was an upper bound ends there). ``printed``: the caller has just written its own line about this phase
        (the next one is due ``every_s`` from now)."""
        with self._lock:
            if self._closed:
                return
            now = self.clock()
            p = self._phases.get(phase)
            if p is None and total is not None and done >= total and self._ended.get(phase) == (done, total):
                return  # the end of a phase that just ended at these counts, reported again: not a new round
            if p is None:
                p = self._start(phase, total, now, done)
            elif done < p.done or (p.total is not None and total != p.total
                                   and not (total is not None and done == total)):
                # a new round (a total that only settles at the final count, done == total, ends this one)
                p.started, p.first, p.total = now, done, total
                if self.announce:
                    self._line(self._started(phase, total))
            p.done, p.total, p.what = done, total, str(what)
            if self.finish_at_total and total is not None and done >= total:
                self._finish(phase, now)
            elif printed:
                p.logged = now
            elif now - p.logged >= self.every_s:
                self._report(phase, p, now)

    def finish(self, phase: str) -> None:
        """End ``phase`` (a line if it printed one, or with ``announce``); nothing if it is not running."""
        with self._lock:
            if phase in self._phases and not self._closed:
                self._finish(phase, self.clock())

    def close(self) -> None:
        """Stop the heartbeat; phases still running print nothing more."""
        with self._lock:
            self._closed = True
            self._phases.clear()
            self._wake.set()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)

    def __enter__(self) -> ProgressLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ lines
    def _text(self, phase: str, p: _Phase, now: float) -> str:
        elapsed = now - p.started
        unit = f" {self.unit}" if self.unit else ""
        if p.total is None and p.done == p.first:
            text = f"{phase}: {now - p.began:.0f}s elapsed, no{unit or ' steps'} counted yet"
        else:
            rate = (p.done - p.first) / elapsed if elapsed > 0 else 0.0
            if p.total is None:
                text = f"{phase}: {p.done:,}{unit}, {rate:.2f}{unit}/s, {elapsed:.0f}s elapsed"
            else:
                eta = f"{(p.total - p.done) / rate:.0f}s" if rate > 0 else "unknown"
                text = (f"{phase}: {p.done:,}/{p.total:,} ({100 * p.done / max(p.total, 1):.0f}%), "
                        f"{rate:.2f}{unit}/s, {elapsed:.0f}s elapsed, eta {eta}")
        return f"{text} ({p.what})" if p.what else text

    def _started(self, phase: str, total: int | None) -> str:
        return f"{phase}: started" + ("" if total is None else f", {total:,} {self.unit}".rstrip())

    def _start(self, phase: str, total: int | None, now: float, done: int = 0) -> _Phase:
        self._ended.pop(phase, None)
        p = self._phases[phase] = _Phase(now, total, done)
        if self.announce:
            self._line(self._started(phase, total))
        if self._heartbeat and self._thread is None:
            self._thread = threading.Thread(target=self._beat, name="progress-heartbeat", daemon=True)
            self._thread.start()
        self._wake.set()  # the heartbeat recomputes when the next line is due
        return p

    def _finish(self, phase: str, now: float) -> None:
        p = self._phases.pop(phase)
        self._ended[phase] = (p.done, p.total)
        if self.announce or p.lines:
            count = f"{p.done:,}" if p.total is None else f"{p.done:,}/{p.total:,}"
            self._line(f"{phase}: {count} in {now - p.began:.1f}s")

    def _report(self, phase: str, p: _Phase, now: float) -> None:
        p.logged = now
        p.lines += 1
        self._line(self._text(phase, p, now))

    def _line(self, text: str) -> None:
        self.write(text)

    # ------------------------------------------------------------------------------------------ heartbeat
    def _beat(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                now = self.clock()
                wait = None
                for phase, p in list(self._phases.items()):
                    due = p.logged + self.every_s
                    if now >= due:
                        self._report(phase, p, now)
                        due = now + self.every_s
                    wait = due - now if wait is None else min(wait, due - now)
                self._wake.clear()
            self._wake.wait(None if wait is None else max(wait, _MIN_WAIT_S))
