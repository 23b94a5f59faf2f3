"""Progress display of the ``tracerl`` subcommands: rich bars on a terminal, plain lines elsewhere (a CI log, a
``nohup`` run), written by `tracestore.cliargs.ProgressLog`, the same as the ``tracestore`` command's."""

from __future__ import annotations

import time

from tracestore.cliargs import DEFAULT_EVERY_S, ProgressLog

#: without a terminal, a long phase logs its progress at least this often (a CI log or a nohup run never looks
#: hung); ``$TRACESTORE_PROGRESS_EVERY_S`` overrides it
LOG_EVERY_S = DEFAULT_EVERY_S

__all__ = ["LOG_EVERY_S", "StepBars", "progress_log"]


def progress_log(console, unit: str = "steps", **kwargs) -> ProgressLog:
    """A `ProgressLog` that writes its lines with ``console.log`` (a rich console: time-stamped lines)."""
    return ProgressLog(console.log, unit=unit, **kwargs)


class StepBars:
    """An ``on_step(phase, done, total)`` callback (`run_demo`'s, the audit's) on ``console``: on a terminal, rich
    progress bars (one per phase, steps done / total, elapsed time, ETA) that start with the first step, so an error
    before it prints nothing; elsewhere (a log file) one line as each phase starts, one at least every
    ``log_every_s`` seconds (default 30, ``$TRACESTORE_PROGRESS_EVERY_S``) with the count, rate and ETA, also
    between two steps (a heartbeat thread, with the real clock), and one as it ends. Call `close` at the end."""

    def __init__(self, console, *, log_every_s: float | None = None, clock=time.monotonic):
        self.console = console
        self.progress = None
        self.tasks: dict[str, int] = {}
        self.log = None if console.is_terminal else progress_log(
            console, every_s=log_every_s, announce=True, heartbeat=clock is time.monotonic, clock=clock)

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.log is not None:
            self.log.update(phase, done, total)
            return
        if self.progress is None:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("elapsed"), TimeElapsedColumn(), TextColumn("eta"),
                                     TimeRemainingColumn(), console=self.console)
            self.progress.start()
        task = self.tasks.get(phase)
        if task is None:
            task = self.tasks[phase] = self.progress.add_task(phase, total=total)
        self.progress.update(task, completed=done, total=total)

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
        if self.progress is not None:
            self.progress.stop()
