"""Progress display of the ``tracerl`` subcommands: rich bars on a terminal, log lines elsewhere."""

from __future__ import annotations


class StepBars:
    """An ``on_step(phase, done, total)`` callback (`run_demo`'s, the trainer's, the rollout's) on ``console``: on
    a terminal, rich progress bars (one per phase, steps done / total, elapsed time, ETA) that start with the first
    step, so an error before it prints nothing; elsewhere (a log file) one line as each phase starts and one as it
    ends."""

    def __init__(self, console):
        self.console = console
        self.progress = None
        self.tasks: dict[str, int] = {}
        self.started: dict[str, float] = {}

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
        import time

        if phase not in self.started:
            self.started[phase] = time.perf_counter()
            self.console.log(f"{phase}: started, {total} steps")
        if done == total:
            self.console.log(f"{phase}: {done}/{total} in {time.perf_counter() - self.started[phase]:.1f}s")

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
