"""Progress display of the ``tracerl`` subcommands: rich bars on a terminal, log lines elsewhere."""

from __future__ import annotations

import time

#: without a terminal, a long phase logs its progress at least this often (a CI log or a nohup run never looks hung)
LOG_EVERY_S = 30.0


class StepBars:
    """An ``on_step(phase, done, total)`` callback (`run_demo`'s, the audit's) on ``console``: on a terminal, rich
    progress bars (one per phase, steps done / total, elapsed time, ETA) that start with the first step, so an error
    before it prints nothing; elsewhere (a log file) one line as each phase starts, one at least every
    ``log_every_s`` seconds with the count, rate and ETA, and one as it ends."""

    def __init__(self, console, *, log_every_s: float = LOG_EVERY_S, clock=time.monotonic):
        self.console = console
        self.log_every_s = log_every_s
        self.clock = clock
        self.progress = None
        self.tasks: dict[str, int] = {}
        self.started: dict[str, float] = {}
        self.logged: dict[str, float] = {}

    def __call__(self, phase: str, done: int, total: int) -> None:
        if not self.console.is_terminal:
            self._log(phase, done, total)
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

    def _log(self, phase: str, done: int, total: int) -> None:
        now = self.clock()
        if phase not in self.started:
            self.started[phase] = self.logged[phase] = now
            self.console.log(f"{phase}: started, {total} steps")
        elapsed = now - self.started[phase]
        if done == total:
            self.console.log(f"{phase}: {done}/{total} in {elapsed:.1f}s")
        elif now - self.logged[phase] >= self.log_every_s:
            self.logged[phase] = now
            rate = done / elapsed if elapsed > 0 else 0.0
            eta = f"{(total - done) / rate:.0f}s" if rate > 0 else "unknown"
            self.console.log(f"{phase}: {done}/{total} ({100 * done / max(total, 1):.0f}%), {rate:.2f} steps/s, "
                             f"{elapsed:.0f}s elapsed, eta {eta}")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
