"""The whole closed loop from one call: a loop store, a trainer process and rollout processes, a live display.

`run_loop` creates the store (`tracerl.loop.create_loop_store`; a local directory by default, ``s3://`` works),
starts ``tracerl train`` and ``rollouts`` x ``tracerl rollout`` as child processes against it (each in its own
session, so a terminal's Ctrl-C reaches only this process, which forwards exactly one SIGINT: the trainer stops
after its current step with a checkpoint, the rollouts after their current batch, everything they generated
committed), follows their JSON-lines metrics (`MetricsTail`), and ends when the trainer has ``steps`` updates.

Run directory::

    <run_dir>/store/            the store (unless --store names another URL)
    <run_dir>/checkpoints/      the trainer's checkpoints (its checkpoint location is <run_dir>)
    <run_dir>/train.jsonl       one line per training step (tracerl.train)
    <run_dir>/rollout-<i>.jsonl one line per generation batch of rollout process i
    <run_dir>/*.log             the processes' stderr
    <run_dir>/loop.json         `summarize`'s result; <run_dir>/loop.png: reward and mismatch over steps

Reported per step: reward, policy version, rollout tokens/s (generated tokens per second of generation, per
batch), trainer tokens/s (tokens per second of the step's compute), commit-to-train lag (a trajectory's result
commit -> its micro-batch read onto the trainer; per step the median, over the run median and p99 of every
trajectory's lag), and the rollout/trainer mismatch on the step's on-policy trajectories: code agreement at
hinted sites, mean |dlogp| and k3 (`tracerl.train`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tracerl.config import LOOP_PARENT_ENV, LoopConfig
from tracerl.errors import LoopProcessError
from tracerl.runlog import json_ready, machine_info

log = logging.getLogger(__name__)

__all__ = ["MetricsTail", "LoopProcesses", "run_loop", "summarize", "plot", "live_view", "render_summary",
           "LoopProcessError"]


class MetricsTail:
    """Incremental reader of a JSON-lines file that another process appends to: `read_new` returns the complete
    lines added since the last call (a line still being written waits for its newline)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.records: list[dict] = []
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[dict]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            if os.fstat(f.fileno()).st_size < self._offset:  # rewritten (a trainer truncated it on restart)
                self._offset, self._partial, self.records = 0, b"", []
            f.seek(self._offset)
            data = f.read()
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        new = [json.loads(line) for line in lines if line.strip()]
        self.records.extend(new)
        return new


def _tracerl(*args: str) -> list[str]:
    return [sys.executable, "-m", "tracerl.cli", *args]


class LoopProcesses:
    """The trainer and rollout child processes of one loop (see the module docstring)."""

    def __init__(self, cfg: LoopConfig, store_url: str):
        self.cfg = cfg
        self.store_url = store_url
        self.run_dir = Path(cfg.run_dir)
        self.train_log = MetricsTail(self.run_dir / "train.jsonl")
        self.rollout_logs = [MetricsTail(self.run_dir / f"rollout-{i}.jsonl") for i in range(cfg.rollouts)]
        self.trainer: subprocess.Popen | None = None
        self.rollouts: list[subprocess.Popen] = []

    def commands(self) -> tuple[list[str], list[list[str]]]:
        """(trainer argv, [rollout argv]) of this loop."""
        c = self.cfg
        common = ["--threads", str(c.threads)]
        if c.storage_options:
            common += ["--storage-options", json.dumps(c.storage_options)]
        train = _tracerl("train", self.store_url, "--checkpoints", str(self.run_dir), "--metrics",
                         str(self.train_log.path), "--steps", str(c.steps), "--mode", c.mode, "--groups-per-step",
                         str(c.groups_per_step), "--group-size", str(c.group_size), "--lr", repr(c.lr),
                         "--max-staleness", str(c.max_staleness), "--micro-batch-tokens", str(c.micro_batch_tokens),
                         "--seed", str(c.seed), "--device", c.trainer_device, *common, *c.extra_train_args)
        if c.tis_cap is not None:
            train += ["--tis-cap", repr(c.tis_cap)]
        per_batch = -(-c.groups_per_step // c.rollouts)
        rollouts = []
        for i, tail in enumerate(self.rollout_logs):
            argv = _tracerl("rollout", self.store_url, "--metrics", str(tail.path), "--groups-per-batch",
                            str(per_batch), "--group-size", str(c.group_size), "--seed", str(c.seed + 1000 * i),
                            "--max-ahead", str(c.max_ahead), "--device", c.rollout_device, "--worker-id",
                            f"rollout{i}-{os.getpid()}-{int(time.time())}", *common, *c.extra_rollout_args)
            if c.record_codes:
                argv.append("--record-codes")
            rollouts.append(argv)
        return train, rollouts

    def start(self) -> None:
        train, rollouts = self.commands()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.trainer = self._spawn(train, "trainer", self.trainer_env())
        self.rollouts = [self._spawn(argv, f"rollout-{i}") for i, argv in enumerate(rollouts)]

    def trainer_env(self) -> dict[str, str]:
        """Environment the trainer gets beyond this process's: where it shares one CUDA device with a rollout and
        the user set no ``PYTORCH_CUDA_ALLOC_CONF``, torch's expandable segments, so that the memory the trainer's
        caching allocator holds stays close to what it uses (on one H200 it held ~10 GiB more than its peak
        allocation with fixed segments, memory the rollout beside it could not have). Allocation only: every
        kernel and every bit is the same. The rollout keeps the default allocator (its decode runs CUDA graphs)."""
        c = self.cfg
        shared = c.trainer_device.startswith("cuda") and _same_device(c.trainer_device, c.rollout_device)
        if shared and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
            return {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        return {}

    def _spawn(self, argv: list[str], name: str, extra_env: dict[str, str] | None = None) -> subprocess.Popen:
        with open(self.run_dir / f"{name}.log", "wb") as err:
            # own session: a terminal's Ctrl-C goes to the loop only, which forwards one SIGINT (two would abort)
            # the child stops (SIGINT) when this process dies, whatever kills it (tracerl.cli.args.stop_with_parent)
            env = {**os.environ, **(extra_env or {}), LOOP_PARENT_ENV: str(os.getpid())}
            return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True, env=env)

    def poll(self) -> None:
        """Read new metrics; raise `LoopProcessError` if a child failed."""
        self.train_log.read_new()
        for t in self.rollout_logs:
            t.read_new()
        for name, p in self._children():
            if p.poll() not in (None, 0):
                raise LoopProcessError(f"{name} exited with {p.returncode}: {self._tail(name)}")

    def _children(self) -> list[tuple[str, subprocess.Popen]]:
        out = [("trainer", self.trainer)] if self.trainer is not None else []
        return out + [(f"rollout-{i}", p) for i, p in enumerate(self.rollouts)]

    def _tail(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return text[-2000:].strip() or "(no output)"

    @property
    def trainer_done(self) -> bool:
        return self.trainer is not None and self.trainer.poll() == 0

    def stop(self, timeout_s: float = 120.0) -> None:
        """One SIGINT to every running child (each stops at its next boundary with everything committed); after
        ``timeout_s`` a child still running is killed."""
        for _, p in self._children():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout_s
        for name, p in self._children():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s; killed", name, timeout_s)
                p.kill()
                p.wait()


def run_loop(cfg: LoopConfig, *, on_update: Callable[[LoopProcesses], None] | None = None,
             stop: Any = None, poll_s: float = 0.25) -> dict:
    """Create the store, run the processes until the trainer has ``cfg.steps`` updates (or ``stop`` is set),
    stop them cleanly, and return `summarize`'s result (also written to ``<run_dir>/loop.json``, with the plot
    ``<run_dir>/loop.png`` when matplotlib is installed).

    Raises ConfigError (bad config; the store exists), LoopProcessError (a child failed; the others are stopped)."""
    cfg.check()
    from tracerl.loop.store import create_loop_store
    from tracerl.policy import TinyMoESpec, make_task

    run_dir = Path(cfg.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    url = cfg.store or str(run_dir / "store")
    task = make_task(**cfg.task)
    spec = TinyMoESpec(**{"vocab_size": task.vocab_size, **cfg.spec})
    t0 = time.time()
    create_loop_store(url, spec, task, seed=cfg.seed, fp4=cfg.fp4, hint_layers=cfg.hint_layers,
                      storage_options=cfg.storage_options, device=cfg.rollout_device,
                      scale_encoding=cfg.scale_encoding)
    procs = LoopProcesses(cfg, url)
    procs.start()
    stopped = False
    try:
        while not procs.trainer_done:
            procs.poll()
            if on_update is not None:
                on_update(procs)
            if stop is not None and stop.is_set():
                stopped = True
                break
            time.sleep(poll_s)
    finally:
        procs.stop()
    procs.poll()  # the last metrics, and an error if a child did not stop cleanly
    if on_update is not None:
        on_update(procs)
    result = summarize(cfg, procs.train_log.records, [r for t in procs.rollout_logs for r in t.records])
    result.update(store=url, wall_s=time.time() - t0, stopped_early=stopped)
    (run_dir / "loop.json").write_text(json.dumps(result, indent=1))
    try:
        plot(result, run_dir / "loop.png")
        result["plot"] = str(run_dir / "loop.png")
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
    return result


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else format(v, spec)


def live_view(procs: LoopProcesses, started: float):
    """The live display of a running loop (a rich renderable): progress over the steps and the newest step's
    and batch's numbers beside the first step's."""
    from rich.console import Group
    from rich.table import Table

    cfg = procs.cfg
    steps = procs.train_log.records
    batches = [r for t in procs.rollout_logs for r in t.records]
    done = steps[-1]["step"] if steps else 0
    elapsed = time.time() - started
    eta = (elapsed / done * (cfg.steps - done)) if done else math.nan
    bar_w = 30
    fill = int(bar_w * done / cfg.steps)
    head = (f"[bold]tracerl loop[/] {cfg.mode}  step {done}/{cfg.steps} [{'#' * fill}{'.' * (bar_w - fill)}]  "
            f"elapsed {elapsed:.0f}s  eta {_fmt(eta, '.0f')}s  rollout batches {len(batches)}")
    t = Table(box=None, pad_edge=False)
    for col in ("", "reward", "policy v", "rollout tok/s", "trainer tok/s", "lag s", "code agr.", "mean |dlogp|",
                "k3", "stale"):
        t.add_column(col, justify="right")

    def row(name, m, b):
        mm = (m or {}).get("mismatch") or {}
        t.add_row(name, _fmt((m or b or {}).get("reward_mean"), ".3f"),
                  str((m or {}).get("version", (b or {}).get("version", "-"))),
                  _fmt((b or {}).get("generated_tokens_per_s"), ".0f"), _fmt((m or {}).get("tokens_per_s"), ".0f"),
                  _fmt((m or {}).get("lag_s_median"), ".2f"), _fmt(mm.get("code_agreement"), ".5f"),
                  _fmt(mm.get("mean_abs_dlogp"), ".2e"), _fmt(mm.get("k3"), ".2e"),
                  str((m or {}).get("stale_groups", "-")))

    row("first", steps[0] if steps else None, batches[0] if batches else None)
    row("latest", steps[-1] if steps else None, batches[-1] if batches else None)
    return Group(head, t)


def render_summary(result: dict):
    """The end-of-run table (rich): one row per step, then the summary line."""
    from rich.console import Group
    from rich.table import Table

    t = Table(title=f"tracerl loop: mode {(result.get('config') or {}).get('mode')}, {len(result['steps'])} steps")
    for col in ("step", "reward", "versions trained", "trainer tok/s", "lag s (median)", "code agr.",
                "mean |dlogp|", "k3", "stale groups"):
        t.add_column(col, justify="right")
    for r in result["steps"]:
        t.add_row(str(r["step"]), _fmt(r["reward"], ".3f"), ",".join(map(str, r["policy_versions"])),
                  _fmt(r["trainer_tokens_per_s"], ".0f"), _fmt(r["lag_s_median"], ".2f"),
                  _fmt(r["mismatch_code_agreement"], ".5f"), _fmt(r["mismatch_mean_abs_dlogp"], ".2e"),
                  _fmt(r["mismatch_k3"], ".2e"), str(r["stale_groups"]))
    s = result["summary"]
    line = (f"reward {_fmt(s['reward_start'], '.3f')} -> {_fmt(s['reward_end'], '.3f')} (first / last 3 steps); "
            f"commit-to-train lag median {_fmt(s['lag_s_median'], '.2f')} s, p99 {_fmt(s['lag_s_p99'], '.2f')} s "
            f"({s['lag_trajectories']} trajectories; from the trainer being free: median "
            f"{_fmt(s.get('ready_lag_s_median'), '.2f')} s, p99 {_fmt(s.get('ready_lag_s_p99'), '.2f')} s); rollout {_fmt(s['rollout_tokens_per_s_median'], '.0f')} tok/s, "
            f"trainer {_fmt(s['trainer_tokens_per_s_median'], '.0f')} tok/s (medians); mismatch median: code "
            f"agreement {_fmt(s['code_agreement_median'], '.5f')}, mean |dlogp| "
            f"{_fmt(s['mismatch_mean_abs_dlogp_median'], '.2e')}, k3 {_fmt(s['mismatch_k3_median'], '.2e')}")
    return Group(t, line)


def _median(xs) -> float:
    xs = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.median(xs)) if xs else math.nan


def summarize(cfg: LoopConfig | None, steps: list[dict], batches: list[dict]) -> dict:
    """The loop's result: per-step rows, per-batch rows and the summary (reward at start and end: mean of the
    first and last 3 steps; lag median and p99 over every trained trajectory; throughput medians; mismatch
    medians over the steps that had on-policy tokens)."""
    lags = [x for m in steps for x in m.get("lag_s", [])]
    ready_lags = [x for m in steps for x in (m.get("ready_lag_s") or [])]
    k = min(3, len(steps))
    rows = [{"step": m["step"], "version": m["version"], "reward": m["reward_mean"],
             "policy_versions": m["policy_versions"], "trainer_tokens_per_s": m["tokens_per_s"],
             "lag_s_median": m["lag_s_median"], "stale_groups": m["stale_groups"], "loss": m.get("loss"),
             "grad_norm": m["grad_norm"], "digest": m["digest"],
             **{key: m.get(key) for key in ("step_s", "read_s", "compute_s", "reduce_s", "phases_s")},
             **{f"mismatch_{key}": m["mismatch"].get(key) for key in
                ("mean_abs_dlogp", "k3", "code_agreement", "tokens", "p99_abs_dlogp", "max_abs_dlogp")}}
            for m in steps]
    summary = {
        "steps": len(steps),
        "reward_start": float(np.mean([r["reward"] for r in rows[:k]])) if rows else math.nan,
        "reward_end": float(np.mean([r["reward"] for r in rows[-k:]])) if rows else math.nan,
        "lag_s_median": float(np.median(lags)) if lags else math.nan,
        "lag_s_p99": float(np.percentile(lags, 99)) if lags else math.nan,
        "lag_trajectories": len(lags),
        # from max(commit, the trainer starting to wait): without queueing behind the previous step
        "ready_lag_s_median": float(np.median(ready_lags)) if ready_lags else math.nan,
        "ready_lag_s_p99": float(np.percentile(ready_lags, 99)) if ready_lags else math.nan,
        "rollout_tokens_per_s_median": _median(b["generated_tokens_per_s"] for b in batches),
        "trainer_tokens_per_s_median": _median(r["trainer_tokens_per_s"] for r in rows),
        "mismatch_mean_abs_dlogp_median": _median(r["mismatch_mean_abs_dlogp"] for r in rows),
        "mismatch_k3_median": _median(r["mismatch_k3"] for r in rows),
        "code_agreement_median": _median(r["mismatch_code_agreement"] for r in rows),
        "stale_groups": sum(r["stale_groups"] for r in rows),
        "rollout_batches": len(batches),
        "step_s_median": _median(r["step_s"] for r in rows),
        # with the trainer's time_phases: the median seconds of each phase of a step
        "phases_s_median": {k: _median((r["phases_s"] or {}).get(k) for r in rows)
                            for k in sorted({k for r in rows for k in (r["phases_s"] or {})})} or None,
    }
    return json_ready({"config": None if cfg is None else dataclasses.asdict(cfg), "summary": summary, "steps": rows,
                      "rollout": batches, "machine": machine_info()})


def _mismatch_axis(ax, values: list[float]) -> None:
    """A y scale that shows ``values`` (>= 0; NaN: not measured): logarithmic when they span a decade or more
    (with a linear stretch around 0, where an exact match lies), else linear with scientific tick labels (a log
    axis over less than a decade has no labelled tick)."""
    finite = [v for v in values if v == v]
    positive = [v for v in finite if v > 0]
    if positive and max(positive) >= 10 * min(positive):
        ax.set_yscale("symlog", linthresh=min(positive) / 2)
        return
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    if finite:
        lo, hi = min(finite), max(finite)
        pad = (hi - lo) * 0.1 or abs(hi) * 0.1 or 1e-9
        ax.set_ylim(max(0.0, lo - pad) if lo >= 0 else lo - pad, hi + pad)


def figure(result: dict, *, label: str | None = None):
    """The matplotlib figure of `plot` (reward, mean |dlogp| and 1 - code agreement over steps).

    Raises ImportError without matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["steps"]
    x = [r["step"] for r in rows]

    def series(key):
        return [np.nan if r[key] is None else r[key] for r in rows]

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(x, series("reward"), marker=".")
    axes[0].set(title="reward (mean per step)", xlabel="step")
    dlogp = series("mismatch_mean_abs_dlogp")
    axes[1].plot(x, dlogp, marker=".")
    axes[1].set(title="mean |logp_trainer - logp_rollout|", xlabel="step")
    disagreement = [1 - v for v in series("mismatch_code_agreement")]
    axes[2].plot(x, disagreement, marker=".")
    axes[2].set(title="1 - code agreement (hinted sites)", xlabel="step")
    _mismatch_axis(axes[1], dlogp)
    _mismatch_axis(axes[2], disagreement)
    cfg = result.get("config") or {}
    title = label or f"tracerl loop: mode {cfg.get('mode')}, {len(rows)} steps"
    if result.get("stopped_early"):
        title += f" (stopped early by Ctrl-C after step {x[-1] if x else 0})"
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def plot(result: dict, path: str | os.PathLike, *, label: str | None = None) -> None:
    """Reward and mismatch (mean |dlogp|, 1 - code agreement) over steps as a PNG at ``path`` (`figure`).

    Raises ImportError without matplotlib."""
    import matplotlib.pyplot as plt

    fig = figure(result, label=label)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _same_device(a: str, b: str) -> bool:
    """Whether two torch device strings name one device (``cuda`` is ``cuda:0``)."""
    def norm(d: str) -> str:
        return "cuda:0" if d == "cuda" else d
    return norm(a) == norm(b)
