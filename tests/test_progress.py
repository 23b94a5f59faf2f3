"""Progress without a terminal (a CI log, a ``nohup`` run, a pipe): a long phase of ``tracestore`` or ``tracerl`` prints
a plain line at least every 30 s (``$TRACESTORE_PROGRESS_EVERY_S``) with its count, rate and ETA, also while no step
completes (a heartbeat thread); a short phase prints nothing new. Both commands share `tracestore.cliargs.ProgressLog`.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import pytest

from tracestore.cliargs import ENV_PROGRESS_EVERY_S, ProgressLog, progress_every_s

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _log(**kw) -> tuple[ProgressLog, list[str], _Clock]:
    lines: list[str] = []
    clock = _Clock()
    return ProgressLog(lines.append, heartbeat=False, clock=clock, **kw), lines, clock


def test_a_line_when_due_with_count_rate_and_eta():
    log, lines, clock = _log(every_s=30, unit="steps")
    for done in range(11):
        clock.now = 10.0 * done  # 10 s a step
        log.update("replay", done, 10)
    assert lines == ["replay: 3/10 (30%), 0.10 steps/s, 30s elapsed, eta 70s",
                     "replay: 6/10 (60%), 0.10 steps/s, 60s elapsed, eta 40s",
                     "replay: 9/10 (90%), 0.10 steps/s, 90s elapsed, eta 10s",
                     "replay: 10/10 in 100.0s"]


def test_a_short_phase_prints_nothing_unless_announced():
    log, lines, clock = _log(every_s=30)
    log.update("verify", 0, 5)
    clock.now = 29.0
    log.update("verify", 5, 5)
    assert lines == []
    log, lines, clock = _log(every_s=30, announce=True, unit="steps")
    log.update("decode", 0, 5)
    clock.now = 2.0
    log.update("decode", 5, 5)
    assert lines == ["decode: started, 5 steps", "decode: 5/5 in 2.0s"]


def test_the_end_of_a_phase_reported_again_is_not_a_new_phase():
    """A caller that reports a phase's last count once more after it ended (the audit's verify and curve phases did)
    prints the end once; the same phase with other counts later is a new phase."""
    log, lines, clock = _log(every_s=30, announce=True, unit="steps")
    log.update("verify", 0, 1)
    clock.now = 1.0
    log.update("verify", 1, 1)
    log.update("verify", 1, 1)
    assert lines == ["verify: started, 1 steps", "verify: 1/1 in 1.0s"]
    log.update("verify", 0, 2)
    clock.now = 3.0
    log.update("verify", 2, 2)
    assert lines[2:] == ["verify: started, 2 steps", "verify: 2/2 in 2.0s"]
    log.update("curve", 0, 40)  # a total that is an upper bound, settled at the end by the real count
    clock.now = 5.0
    log.update("curve", 12, 40)
    log.update("curve", 36, 36)
    assert lines[4:] == ["curve: started, 40 steps", "curve: 36/36 in 2.0s"]


def test_unknown_total_what_and_rate_since_the_phase_started():
    log, lines, clock = _log(every_s=10, unit="steps")
    log.update("train", 40, None)  # a trainer resumed at step 40: the rate counts this run's steps
    clock.now = 10.0
    log.update("train", 42, None, "step 42")
    assert lines == ["train: 42 steps, 0.20 steps/s, 10s elapsed (step 42)"]


def test_a_caller_line_resets_the_interval_and_a_new_round_restarts_the_phase():
    log, lines, clock = _log(every_s=30)
    log.update("train", 0, 4)
    clock.now = 25.0
    log.update("train", 1, 4, printed=True)  # the caller just printed its own line
    clock.now = 50.0
    log.update("train", 2, 4)
    assert lines == []
    log, lines, clock = _log(every_s=30, finish_at_total=False)  # tracestore bench: rounds, one phase
    log.start("bench")
    log.update("bench", 0, 4, "local write")
    clock.now = 10.0
    log.update("bench", 4, 4, "local write")  # a round done, the phase goes on
    assert lines == []
    clock.now = 55.0
    log.update("bench", 0, 3, "local read")  # a count below the last one: a new round, timed from now
    clock.now = 85.0
    log.update("bench", 1, 3, "local read")
    clock.now = 90.0
    log.update("bench", 3, 3, "local read")
    log.finish("bench")
    assert lines == ["bench: 0/3 (0%), 0.00 items/s, 0s elapsed, eta unknown (local read)",  # 55 s since the start
                     "bench: 1/3 (33%), 0.03 items/s, 30s elapsed, eta 60s (local read)",
                     "bench: 3/3 in 90.0s"]


def test_the_heartbeat_writes_while_no_count_arrives():
    import threading

    lines: list[str] = []
    two = threading.Event()

    def write(line: str) -> None:
        lines.append(line)
        if len(lines) >= 2:
            two.set()

    with ProgressLog(write, every_s=0.05) as log:
        log.start("gc")
        assert two.wait(timeout=60), lines  # two lines although nothing was counted
    n = len(lines)
    assert all(re.fullmatch(r"gc: \d+s elapsed, no items counted yet", ln) for ln in lines), lines
    log.update("gc", 1, 2)  # closed: nothing more
    assert len(lines) == n


@pytest.mark.parametrize("text, value", [("", 30.0), ("0.5", 0.5), ("0", 0.0), ("-1", 30.0), ("x", 30.0),
                                         ("nan", 30.0)])
def test_the_interval_comes_from_the_environment(text, value, monkeypatch):
    monkeypatch.setenv(ENV_PROGRESS_EVERY_S, text)
    assert progress_every_s() == value


# ------------------------------------------------------------------------------------ real processes, stderr a pipe
def _env(every_s: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    for k in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", ENV_PROGRESS_EVERY_S):
        env.pop(k, None)
    if every_s is not None:
        env[ENV_PROGRESS_EVERY_S] = every_s
    return env


# a phase whose second step takes 1.5 s, run by each command's progress helper on stderr
_SLOW_PHASE = {
    "tracestore": """
        import argparse, time
        from tracestore.cli.common import progress
        with progress(argparse.Namespace(command="verify", quiet=False), "verify") as update:
            update(0, 4, "entry-0")
            update(1, 4, "entry-1")
            time.sleep(1.5)
            update(4, 4, "done")
    """,
    "tracerl": """
        import time
        from rich.console import Console
        from tracerl.cli.progress import StepBars
        bars = StepBars(Console(stderr=True, log_path=False))
        bars("replay decode", 0, 4)
        bars("replay decode", 1, 4)
        time.sleep(1.5)
        bars("replay decode", 4, 4)
        bars.close()
    """,
}


@pytest.mark.parametrize("command", sorted(_SLOW_PHASE))
def test_a_slow_step_prints_lines_through_a_pipe(command):
    p = subprocess.run([sys.executable, "-c", textwrap.dedent(_SLOW_PHASE[command])], capture_output=True, text=True,
                       env=_env("0.2"), timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stderr.strip().splitlines()
    beats = [ln for ln in lines if re.search(r"1/4 \(25%\), \d+\.\d\d \w+/s, \d+s elapsed, eta \d+s", ln)]
    assert len(beats) >= 3, p.stderr  # 1.5 s without a step, a line due every 0.2 s
    assert "4/4 in " in lines[-1], p.stderr
    if command == "tracestore":
        assert all(re.match(r"\[\d\d:\d\d:\d\d\] tracestore verify: ", ln) for ln in lines), p.stderr


@pytest.fixture(scope="module")
def store_with_entries(tmp_path_factory):
    import numpy as np

    import tracestore as ts

    url = str(tmp_path_factory.mktemp("progress") / "store")
    store = ts.create_store(url, [ts.Site("s0", 64)])
    with store.writer() as w:
        for k in range(3):
            w.write(f"t{k}", 0, hints={"s0": np.zeros((4, 8), np.uint8)}, scales={"s0": np.zeros((4, 4), np.uint8)},
                    token_ids=np.zeros(4, np.int64), logprobs=np.zeros(4, np.float32))
            w.flush()
    store.close()
    return url


def _tracestore(*argv: str, every_s: str | None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tracestore.cli", *argv], capture_output=True, text=True,
                          env=_env(every_s), timeout=120, cwd=REPO)


def test_tracestore_verify_through_a_pipe_prints_its_progress(store_with_entries):
    p = _tracestore("verify", store_with_entries, every_s="0")
    assert p.returncode == 0, p.stderr
    assert re.search(r"tracestore verify: \d+/\d+ \(\d+%\), [\d.]+ items/s, \d+s elapsed, eta \S+", p.stderr), p.stderr
    assert re.search(r"tracestore verify: (\d+)/\1 in [\d.]+s", p.stderr), p.stderr
    assert p.stdout.startswith("OK: ")  # stdout keeps the report alone


def test_a_quick_or_quiet_command_prints_no_progress(store_with_entries):
    quick = _tracestore("verify", store_with_entries, every_s=None)  # 30 s: verify is done long before
    quiet = _tracestore("verify", store_with_entries, "--quiet", every_s="0")
    assert quick.returncode == quiet.returncode == 0
    assert quick.stderr == "" and quiet.stderr == "", (quick.stderr, quiet.stderr)
