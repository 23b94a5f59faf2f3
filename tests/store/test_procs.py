"""Many writer processes on one store, and writers killed with SIGKILL (local directory and moto S3)."""

from __future__ import annotations

import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import time

import pytest

import tracestore as ts
from helpers.store import check_batch

HERE = pathlib.Path(__file__).resolve().parent
SITES = [ts.Site("s0", 64), ts.Site("s1", 128)]


pytestmark = pytest.mark.slow


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def proc_location(request, tmp_path):
    from helpers.store import RawLocal, RawS3

    if request.param == "local":
        return RawLocal(str(tmp_path / "store"))
    name, client, options = request.getfixturevalue("s3_bucket")
    return RawS3(name, "procs", client, options)


def _spawn(loc, writer_id: str, trajs, **kw) -> subprocess.Popen:
    spec = {"url": loc.url, "options": loc.options, "writer_id": writer_id, "trajs": trajs, **kw}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")]))
    return subprocess.Popen([sys.executable, "-c", "import helpers.store as h, sys; sys.exit(h.child_main())",
                             json.dumps(spec)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)


def _wait_ready(p: subprocess.Popen) -> None:
    line = p.stdout.readline()
    assert line.strip() == "ready", (line, p.stderr.read() if p.poll() is not None else "")


def _check_exactly_once(store, expected: dict[str, int]) -> None:
    recs = list(store.stream(timeout_s=0))
    assert len({(r.seq, r.index) for r in recs}) == len(recs)
    by_traj: dict[str, list[tuple[int, int]]] = {}
    for r in recs:
        by_traj.setdefault(r.traj_id, []).append((r.token_start, r.token_stop))
    assert set(by_traj) == set(expected)
    for traj, n in expected.items():
        spans = sorted(by_traj[traj])
        pos = 0
        for a, b in spans:  # contiguous, no overlap, no gap: every token exactly once
            assert a == pos, (traj, spans)
            pos = b
        assert pos == n, (traj, spans)
    r = store.reader()
    for traj, n in expected.items():
        check_batch(store, r.read(traj, 0, n), traj, 0, n)


def test_many_writer_processes(proc_location):
    loc = proc_location
    store = ts.create_store(loc.url, SITES, storage_options=loc.options)
    s3 = loc.options is not None  # moto serves ~100 requests/s: fewer commits there
    n_proc = 3 if s3 else 4
    expected = {}
    procs = []
    for k in range(n_proc):
        trajs = [[f"p{k}-t{j}", 30 + 11 * j] for j in range(3)]
        expected.update({t: n for t, n in trajs})
        procs.append(_spawn(loc, f"w{k}", trajs, commit_bytes=2000 if s3 else 800, step=5))
    # two more processes compete for the same shared trajectories
    shared = [["shared-0", 40], ["shared-1", 23]]
    expected.update({t: n for t, n in shared})
    procs += [_spawn(loc, f"c{k}", shared, commit_bytes=1000 if s3 else 500, step=4) for k in range(2)]
    tail = store.stream(poll_interval_s=0.02, timeout_s=0)
    seen = []
    while any(p.poll() is None for p in procs):
        seen.extend(tail.poll())
        time.sleep(0.05)
    for p in procs:
        out, err = p.communicate()
        assert p.returncode == 0, err[-3000:]
    seen.extend(tail.poll())
    assert len(seen) == len({(r.seq, r.index) for r in seen}) == len(list(store.stream(timeout_s=0)))
    _check_exactly_once(store, expected)
    assert ts.verify(store).ok


@pytest.mark.timeout(300)
def test_sigkill_at_arbitrary_points(proc_location):
    loc = proc_location
    store = ts.create_store(loc.url, SITES, storage_options=loc.options)
    s3 = loc.options is not None  # moto serves ~100 requests/s: fewer, larger commits there
    trajs = [[f"k-t{j}", 60 + 13 * j] for j in range(4 if not s3 else 3)]
    expected = {t: n for t, n in trajs}
    rng = random.Random(1234)
    rounds = 6 if not s3 else 3
    commit_bytes = 700 if not s3 else 1800
    # The victim sleeps delay_s after each of its writes (55 local, 38 on S3), so it runs for at least 0.11 s /
    # 0.76 s after "ready" however fast the machine: each kill lands at a random point before that.
    delay_s, kill_by = (0.002, 0.1) if not s3 else (0.02, 0.7)
    kills = 0
    for _ in range(rounds):
        p = _spawn(loc, "victim", trajs, commit_bytes=commit_bytes, step=6, delay_s=delay_s)
        _wait_ready(p)
        time.sleep(rng.uniform(0.0, kill_by))
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            kills += 1
        p.communicate()
        # after every kill: no partial record visible, nothing duplicated
        rep = ts.verify(store)
        assert rep.ok, rep.errors
        recs = list(store.stream(timeout_s=0))
        per = {}
        for r in recs:
            per.setdefault(r.traj_id, []).append((r.token_start, r.token_stop))
        for spans in per.values():
            spans.sort()
            assert all(b0 <= a1 for (_, b0), (a1, _) in zip(spans, spans[1:]))
    assert kills == rounds  # the victim cannot have finished before its kill
    # restart with the same writer id until done: resumes without duplicates
    p = _spawn(loc, "victim", trajs, commit_bytes=commit_bytes, step=6)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    _check_exactly_once(store, expected)
    # orphans of the killed runs are collectable; committed data survives gc
    gc = ts.collect_garbage(store, now=time.time() + 1e6)
    rep = ts.verify(store)
    assert rep.ok and not rep.orphan_segments and not rep.partial_objects, (gc, rep)
    _check_exactly_once(store, expected)

