"""The closed RL loop from one call: its store (`create_loop_store`), the rollout and trainer processes with a
live view and a summary (`run_loop`), and bitwise replay of training from the archive (`replay`)."""

from tracerl import deprecation

from tracerl.loop.processes import LoopProcesses, MetricsTail, live_view, plot, render_summary, run_loop, summarize
from tracerl.loop.replay import COMPARED, replay
from tracerl.loop.store import create_loop_store

__all__ = ["LoopProcesses", "MetricsTail", "live_view", "plot", "render_summary", "run_loop", "summarize",
           "COMPARED", "replay", "create_loop_store"]

# names that left this package's modules in tracerl 0.2 (`tracerl.deprecation`)
__getattr__ = deprecation.forward(__name__, {
    "LoopProcessError": "tracerl.errors",
})
