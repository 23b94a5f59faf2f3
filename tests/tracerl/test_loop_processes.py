"""The closed loop across processes through a real store (local directory, and S3 through moto's server):
``tracerl rollout`` and ``tracerl train`` as separate processes; the trainer is SIGKILLed mid-run and restarted
with the same command, and every complete trajectory is trained exactly once, in commit order."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

import tracestore as ts
from helpers import loop
from tracerl.artifacts import checkpoints as ckpt
from tracerl.artifacts import weights
from tracerl.runlog import MetricsLog

pytestmark = pytest.mark.slow

STEPS = 8
SMALL = ["--group-size", str(loop.G), "--threads", "1"]


def _location(kind, tmp_path, request):
    if kind == "local":
        return str(tmp_path / "store"), str(tmp_path / "ckpt"), None
    name, _client, options = request.getfixturevalue("s3_bucket")
    return f"s3://{name}/store", f"s3://{name}/ckpt", options


def _wait_lines(log: MetricsLog, n: int, procs, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(log.records()) < n:
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"child failed: {p.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, f"no {n} metrics lines after {timeout}s"
        time.sleep(0.05)


@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_trainer_sigkill_and_restart_trains_every_trajectory_once(kind, tmp_path, request):
    url, ck, opts = _location(kind, tmp_path, request)
    loop.create(url, storage_options=opts)
    common = ["--storage-options", json.dumps(opts)] if opts else []
    metrics = MetricsLog(tmp_path / "train.jsonl")
    train_cmd = ["train", url, "--checkpoints", ck, "--metrics", str(metrics.path), "--steps", str(STEPS),
                 "--groups-per-step", "2", "--micro-batch-tokens", "64", "--max-staleness", "100",
                 "--wait-timeout", "120", *SMALL, *common]
    rollout = loop.tracerl("rollout", url, "--batches", str(STEPS), "--groups-per-batch", "2", "--max-ahead", "3",
                           "--weights-timeout", "120", *SMALL, *common)
    trainer = loop.tracerl(*train_cmd)
    kills = 0
    for after in (2, 5):  # kill it twice, at different points of its run
        _wait_lines(metrics, after, [rollout, trainer])
        time.sleep(0.05 * after)  # somewhere inside a later step (or between: both must work)
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        kills += 1
        trainer = loop.tracerl(*train_cmd)
    out, err = trainer.communicate(timeout=300)
    assert trainer.returncode == 0, err[-3000:]
    out, err = rollout.communicate(timeout=300)
    assert rollout.returncode == 0, err[-3000:]

    steps = metrics.records()
    assert [m["step"] for m in steps] == list(range(1, STEPS + 1))  # each step logged once, none lost
    trained = [t for m in steps for t in m["traj_ids"]]
    store = ts.open_store(url, storage_options=opts)
    assert trained == store.reader().complete_traj_ids()  # every trajectory once, in commit order
    assert not any(m["stale_traj_ids"] for m in steps)
    assert ckpt.latest_step(ck, storage_options=opts) == STEPS
    assert weights.list_versions(url, storage_options=opts) == list(range(STEPS + 1))
    assert kills == 2
