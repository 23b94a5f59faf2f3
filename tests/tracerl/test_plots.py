"""The plots a person looks at (`tracerl loop`'s loop.png, the audit's HTML report) are readable whatever range the
values take: a mismatch that spans less than a decade gets a labelled linear axis, an interrupted run says so in
its title, and a by-position panel with one bucket spans the responses instead of a lone point."""

from __future__ import annotations

import pytest

from tracerl.loop.processes import figure

plt = pytest.importorskip("matplotlib.pyplot")


def _result(dlogp, agreement, stopped_early=False):
    rows = [{"step": i + 1, "reward": 0.5, "mismatch_mean_abs_dlogp": d, "mismatch_code_agreement": a}
            for i, (d, a) in enumerate(zip(dlogp, agreement))]
    return {"steps": rows, "config": {"mode": "fp4_hints"}, "stopped_early": stopped_early}


def _labelled_ticks(ax) -> list[str]:
    ax.figure.canvas.draw()
    return [t.get_text() for t in ax.get_yticklabels() if t.get_text()]


def test_mismatch_within_a_decade_gets_a_linear_labelled_axis():
    fig = figure(_result([1.77e-2, 1.86e-2, 1.81e-2], [0.9989, 0.9990, 0.9988]))
    try:
        for ax in fig.axes[1:]:
            assert ax.get_yscale() == "linear"
            assert len(_labelled_ticks(ax)) >= 3  # a symlog axis over 1.7e-2..1.9e-2 had none
            lo, hi = ax.get_ylim()
            assert lo <= 1.2e-3 and hi >= 1.2e-3 if ax is fig.axes[2] else lo <= 1.77e-2 <= 1.86e-2 <= hi
    finally:
        plt.close(fig)


def test_mismatch_over_decades_stays_logarithmic():
    fig = figure(_result([1e-1, 1e-3, 1e-5], [0.5, 0.99, 1.0]))
    try:
        assert fig.axes[1].get_yscale() == "symlog" and fig.axes[2].get_yscale() == "symlog"
    finally:
        plt.close(fig)


def test_an_interrupted_run_says_so_in_its_title():
    fig = figure(_result([1e-2, 2e-2], [0.99, 0.98], stopped_early=True))
    try:
        assert "stopped early" in fig._suptitle.get_text() and "after step 2" in fig._suptitle.get_text()
    finally:
        plt.close(fig)


def test_one_position_bucket_spans_the_responses():
    from tracerl.audit.html import _by_position

    fig, ax = plt.subplots()
    try:
        _by_position(ax, [{"lo": 0, "hi": 48, "v": 0.1}], lambda r: r["v"], color="C0", label="x")
        assert ax.get_xlim() == (0.0, 48.0)  # not one point on a 30.5-33.5 axis
    finally:
        plt.close(fig)


def test_progress_without_a_terminal_logs_count_rate_and_eta():
    """A long phase in a CI log printed its start and its end only, minutes apart; now a line at least every 30 s."""
    from rich.console import Console

    from tracerl.cli.progress import StepBars

    console = Console(file=__import__("io").StringIO(), force_terminal=False, log_path=False, width=200)
    now = [0.0]
    bars = StepBars(console, clock=lambda: now[0])
    for done in range(0, 11):
        now[0] = 10.0 * done  # 10 s a step
        bars("replay decode", done, 10)
    lines = [ln for ln in console.file.getvalue().splitlines() if "replay decode" in ln]
    assert "started, 10 steps" in lines[0] and "10/10 in 100.0s" in lines[-1]
    middle = lines[1:-1]
    assert len(middle) == 3  # at 30, 60 and 90 s
    assert "3/10 (30%), 0.10 steps/s, 30s elapsed, eta 70s" in middle[0]
