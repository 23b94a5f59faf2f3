"""gc never deletes committed data, whatever the timing (FORMAT §6): one test per step at which a writer or gc can
be held up, on a local directory and on S3 (moto through the fault proxy), then randomized runs with slow commits
and slow gc runs.

Each actor has its own store object; :class:`helpers.gates.Gate` holds one of its requests (before it is sent, or
after it was applied) while the other actor runs, so every interleaving here is reached on purpose, not by luck.
gc runs with ``now`` far ahead, so that every segment no entry references is old enough to delete: only the
protocol keeps committed data alive, not the clock.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

import tracestore as ts
from helpers.gates import Gate, start
from helpers.store import check_batch, rows

SITES = [ts.Site("s0", 64)]
FAST = ts.RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=10)
LATER = 3600.0  # gc's clock runs this far ahead: every unreferenced segment is past any grace


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def where(request, tmp_path):
    """(url, storage options) of a fresh store location: a local directory, or S3 (moto). The gates hold requests
    in the client, so these tests need no proxy; the randomized runs go through the fault proxy (``proxied``)."""
    if request.param == "local":
        return str(tmp_path / "store"), None
    name, _client, options = request.getfixturevalue("s3_bucket")
    return f"s3://{name}/st", options


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def proxied(request, tmp_path):
    """As ``where``, with S3 through the fault-injecting proxy (tests/helpers/faults.py)."""
    if request.param == "local":
        return str(tmp_path / "store"), None
    proxy = request.getfixturevalue("proxy")
    name, _client, _options = request.getfixturevalue("s3_bucket")
    return f"s3://{name}/st", proxy.storage_options()


def _open(where):
    url, options = where
    return ts.open_store(url, storage_options=options, retry=FAST)


def _create(where, **kw):
    url, options = where
    kw.setdefault("gc_grace_s", 2.0)
    return ts.create_store(url, SITES, storage_options=options, retry=FAST, **kw)


def _gc(where, **kw):
    return ts.collect_garbage(_open(where), now=time.time() + LATER, **kw)


def _gc_held_at(place, method: str, *args, **kwargs):
    """(gate, future): a gc run at the store's grace, from its own store object of ``place`` (the ``where``
    fixture), stopped at ``Gate(method, ...)``."""
    gs = _open(place)
    gate = Gate(gs, method, *args, **kwargs)
    gc = start(ts.collect_garbage, gs, now=time.time() + LATER)
    assert gate.reached.wait(30)
    return gate, gc


def _check(where, trajs: dict[str, int]) -> None:
    """Everything committed is there and reads back right, verify is clean, and no entry names a missing object."""
    store = _open(where)
    report = ts.verify(store)
    assert report.ok, report.errors
    reader = store.reader()
    assert sorted(reader.traj_ids()) == sorted(trajs)
    for t, n in trajs.items():
        check_batch(store, reader.read(t, 0, n, fmt="numpy"), t, 0, n)


def test_late_log_put_lands_after_gc(where):
    """The issue's report: a writer's conditional PUT of its log entry is held up on its way (3 s there, with a 2 s
    grace); gc runs meanwhile at the store's grace. Before the fix gc deleted the segment and the PUT then committed
    an entry naming nothing (verify failed, readers raised IntegrityError)."""
    store = _create(where)
    w = store.writer("w", commit_interval_s=0)
    w.write("t", 0, **rows(store, "t", 0, 24))
    gate = Gate(store, "put_if_absent", r"^log/")
    flush = start(w.flush)
    assert gate.reached.wait(30)
    _gc(where)
    gate.open()
    flush.result()
    w.close()
    _check(where, {"t": 24})
    assert w.stats["rewritten"] == 1  # the writer read gc's entry (it took the position) and wrote the rows again
    entries = _open(where).read_entries(0, 2)
    assert [e.kind for e in entries] == ["gc", "segment"] and entries[1].segment.path not in entries[0].segments


def _written_then_held(store, trajs=("t",), tokens=24):
    """A writer whose segment is written and whose conditional PUT of its log entry is held at a gate."""
    w = store.writer("w", commit_interval_s=0)
    for t in trajs:
        w.write(t, 0, **rows(store, t, 0, tokens))
    gate = Gate(store, "put_if_absent", r"^log/")
    flush = start(w.flush)
    assert gate.reached.wait(30)
    return w, gate, flush


def test_writer_data_write_half_done_when_gc_runs(where):
    """gc lists a segment of which half the objects exist (the writer is slow writing it), and deletes them; the
    writer then writes the rest and commits: it reads gc's entry first and writes the whole segment again."""
    store = _create(where)
    w = store.writer("w", commit_interval_s=0)
    w.write("t", 0, **rows(store, "t", 0, 24))
    gate = Gate(store, "put_many", r"^data/", where="split")
    flush = start(w.flush)
    assert gate.reached.wait(30)
    rep = _gc(where)
    assert len(rep.deleted_segments) == 1 and rep.gc_entries == [0]
    gate.open()
    flush.result()
    w.close()
    assert w.stats["rewritten"] == 1
    _check(where, {"t": 24})
    later = _gc(where)  # the half written after the first run: named by its gc entry, deleted without a new one
    assert later.deleted_segments == rep.deleted_segments and later.gc_entries == []
    assert not ts.verify(_open(where)).orphan_segments


def test_log_put_applied_answer_late(where):
    """The conditional PUT was applied, its answer is slow: gc reads the entry and deletes nothing."""
    store = _create(where)
    w = store.writer("w", commit_interval_s=0)
    w.write("t", 0, **rows(store, "t", 0, 24))
    gate = Gate(store, "put_if_absent", r"^log/", where="after")
    flush = start(w.flush)
    assert gate.reached.wait(30)
    rep = _gc(where)
    assert rep.deleted_segments == [] and rep.gc_entries == []
    gate.open()
    flush.result()
    w.close()
    _check(where, {"t": 24})


def test_gc_paused_after_listing(where):
    """gc lists the store (the segment is there, not committed yet) and stops; the writer commits; gc goes on,
    reads the log, which now references the segment: nothing deleted."""
    store = _create(where)
    w, wgate, flush = _written_then_held(store)
    ggate, gc = _gc_held_at(where, "list", where="after")
    wgate.open()
    flush.result()
    ggate.open()
    rep = gc.result()
    assert rep.deleted_segments == [] and rep.gc_entries == []
    w.close()
    _check(where, {"t": 24})


def test_gc_paused_while_reading_the_log(where):
    """gc reads the log up to its head and stops before it decides; the writer commits at that head; gc decides
    on what it read (the segment looks unreferenced), but its gc entry loses the position to the commit, so gc
    reads it and leaves the segment out."""
    store = _create(where)
    with store.writer("first", commit_interval_s=0) as w0:
        w0.write("a", 0, **rows(store, "a", 0, 8))
    w, wgate, flush = _written_then_held(store)
    ggate, gc = _gc_held_at(where, "get_many", r"^log/", where="after")
    wgate.open()
    flush.result()
    ggate.open()
    rep = gc.result()
    assert rep.deleted_segments == [] and rep.gc_entries == [] and len(rep.committed_meanwhile) == 1
    w.close()
    _check(where, {"a": 8, "t": 24})


def test_gc_entry_put_delayed(where):
    """gc's own conditional PUT of its gc entry is slow: the writer's commit takes the position first; gc's PUT
    is refused, gc reads the commit and leaves the segment out."""
    store = _create(where)
    w, wgate, flush = _written_then_held(store)
    ggate, gc = _gc_held_at(where, "put_if_absent", r"^log/")
    wgate.open()
    flush.result()
    ggate.open()
    rep = gc.result()
    assert rep.deleted_segments == [] and rep.gc_entries == [] and len(rep.committed_meanwhile) == 1
    assert _open(where).head() == 1  # no gc entry was committed
    w.close()
    _check(where, {"t": 24})


def test_gc_paused_before_deleting(where):
    """gc commits its gc entry and stops before deleting (for as long as it likes); a writer whose segment it
    names tries to commit meanwhile: its PUT loses the position to the gc entry, it reads the entry, writes the
    rows again under a new name and commits that; gc then deletes only what it named."""
    store = _create(where)
    w, wgate, flush = _written_then_held(store)
    ggate, gc = _gc_held_at(where, "delete_many", r"^data/")
    wgate.open()
    flush.result()
    assert w.stats["rewritten"] == 1
    ggate.open()
    rep = gc.result()
    assert rep.gc_entries == [0] and len(rep.deleted_segments) == 1
    w.close()
    _check(where, {"t": 24})
    entries = _open(where).read_entries(0, 2)
    assert entries[1].segment.path not in entries[0].segments


def test_a_gc_that_stopped_after_its_entry(where):
    """A gc run that committed its gc entry and died before deleting: the next run deletes what the entry names,
    whatever its age, without a new gc entry; nothing committed is touched."""
    store = _create(where)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 8))
    orphan = store.writer("crashed", commit_interval_s=0)
    orphan.write("x", 0, **rows(store, "x", 0, 8))
    stage = orphan._buffer.take()
    orphan._committer.write_segment(stage)  # written, never committed (the writer died)
    gs = _open(where)

    def dies(keys):
        raise KeyboardInterrupt("gc killed before deleting")

    gs.backend.delete_many = dies
    with pytest.raises(KeyboardInterrupt):
        ts.collect_garbage(gs, now=time.time() + LATER)
    rep = ts.collect_garbage(_open(where))  # at the real time: the segment is young, but named
    assert rep.deleted_segments == [stage.segment.path] and rep.gc_entries == []
    _check(where, {"t": 8})


def test_writer_log_read_slow(where):
    """The writer looks for the log head (log/0 absent), and its answer is slow; gc announces at 0 meanwhile and
    deletes the segment. The writer built its entry for position 0, which is taken: its PUT is refused, it reads the
    gc entry and writes the rows again. Before: gc deleted the segment and the writer committed it at 0."""
    store = _create(where)
    w = store.writer("w", commit_interval_s=0)
    w.write("t", 0, **rows(store, "t", 0, 24))
    gate = Gate(store, "exists", r"^log/", where="after")
    flush = start(w.flush)
    assert gate.reached.wait(30)
    rep = _gc(where)
    assert rep.gc_entries == [0] and len(rep.deleted_segments) == 1
    gate.open()
    flush.result()
    w.close()
    assert w.stats["rewritten"] == 1
    _check(where, {"t": 24})


def test_gc_entry_put_applied_but_answered_with_an_error(proxy, s3_bucket):
    """gc's conditional PUT of its gc entry is applied, the answer is a 500: gc reads the position back, finds its
    own entry and deletes what it named (no second gc entry, no lost deletion)."""
    name, _client, _options = s3_bucket
    where = (f"s3://{name}/st", proxy.storage_options())
    store = _create(where)
    orphan = store.writer("crashed", commit_interval_s=0)
    orphan.write("x", 0, **rows(store, "x", 0, 8))
    orphan._committer.write_segment(orphan._buffer.take())  # written, never committed
    proxy.add("apply_error", "PUT", r"/log/000000000000\.arrow$", code="InternalError")
    rep = _gc(where)
    assert proxy.stats["apply_error"] == 1
    assert rep.gc_entries == [0] and len(rep.deleted_segments) == 1 and _open(where).head() == 1
    assert _open(where).read_entry(0).segments == tuple(rep.deleted_segments)


def test_log_partial_and_its_directory_removed_before_the_link(tmp_path):
    """Local backend: the writer's temporary file of its log entry is written and then the writer stalls; gc
    deletes the (old) partial file and prunes the empty log/ directory. The writer writes both again and commits.
    Before: os.link failed with FileNotFoundError and the commit failed. (A version-2 store: there gc keeps the
    unreferenced segment without force, so no gc entry recreates log/.)"""
    where = (str(tmp_path / "store"), None)
    store = _create(where, format_version=2)
    w = store.writer("w", commit_interval_s=0)
    w.write("t", 0, **rows(store, "t", 0, 24))
    gate = Gate(store, "_write_partial", r"/log/", where="after")
    flush = start(w.flush)
    assert gate.reached.wait(30)
    rep = _gc(where)
    assert rep.deleted_objects == 1 and len(rep.kept_segments) == 1 and not (tmp_path / "store" / "log").exists()
    gate.open()
    flush.result()
    w.close()
    _check(where, {"t": 24})


def test_gc_that_cannot_commit_its_entry_deletes_nothing(tmp_path, monkeypatch):
    """Every conditional PUT of gc's entry fails (throttled) until gc's deadline: GcFenceError, one line, nothing
    deleted; the next run, with a working storage, announces and deletes."""
    monkeypatch.setattr("tracestore.maintenance.GC_ENTRY_TIMEOUT_S", 0.3)
    where = (str(tmp_path / "store"), None)
    store = _create(where)
    orphan = store.writer("crashed", commit_interval_s=0)
    orphan.write("x", 0, **rows(store, "x", 0, 8))
    stage = orphan._buffer.take()
    orphan._committer.write_segment(stage)
    gs = _open(where)

    def throttled(key, data):
        raise ts.ThrottledError(f"PUT {key}: SlowDown (injected)")

    gs.backend.put_if_absent = throttled
    with pytest.raises(ts.GcFenceError, match="nothing of it was deleted") as e:
        ts.collect_garbage(gs, now=time.time() + LATER)
    assert "\n" not in str(e.value) and (tmp_path / "store" / stage.segment.path / "zarr.json").exists()
    assert _gc(where).deleted_segments == [stage.segment.path]


def test_verify_reports_a_committed_segment_named_by_a_gc_entry(tmp_path):
    """What a conforming writer and gc never produce (FORMAT §6.1), written by hand: verify reports it."""
    from tracestore.format.entries import GC, LogEntry, encode_entry
    from tracestore.format.keys import log_key

    where = (str(tmp_path / "store"), None)
    store = _create(where)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 8))
    path = store.read_entry(0).segment.path
    empty = np.zeros(0, np.int64)
    rogue = LogEntry(seq=1, writer_id="gc-rogue", writer_seq=0, segment=None, created_unix=0.0, segment_nbytes=0,
                     traj_ids=[], token_start=empty, token_stop=empty, row_offset=empty, policy_version=empty,
                     kind=GC, batch="00000000-000000000000", segments=(path,))
    assert store.backend.put_if_absent(log_key(1), encode_entry(rogue))
    errors = ts.verify(_open(where)).errors
    assert any(path in e and "gc entry 1" in e for e in errors), errors


@pytest.mark.parametrize("change,match", [
    (dict(segments=()), "1..10000 distinct"), (dict(segments=("data/w/a", "data/w/a")), "distinct"),
    (dict(segments=("log/000000000000.arrow",)), "not data/"), (dict(segments=("data/../x/y",)), "not data/"),
    (dict(format_version=2), "kind 'gc'"),
])
def test_malformed_gc_entries_are_integrity_errors(tmp_path, change, match):
    from tracestore.format.entries import GC, LogEntry, decode_entry, encode_entry

    empty = np.zeros(0, np.int64)
    fields = dict(seq=0, writer_id="gc-x", writer_seq=0, segment=None, created_unix=0.0, segment_nbytes=0,
                  traj_ids=[], token_start=empty, token_stop=empty, row_offset=empty, policy_version=empty, kind=GC,
                  batch="00000000-000000000000", segments=("data/w/00000000-0123456789ab",), format_version=3)
    data = encode_entry(LogEntry(**{**fields, **change}))
    with pytest.raises(ts.IntegrityError, match=match):
        decode_entry(data, 0, "log/000000000000.arrow")


def _gc_loop(where, done: list) -> int:
    """gc at the store's own grace, every 0.2 s, until ``done``; returns the runs."""
    gs = _open(where)
    runs = 0
    while not done:
        ts.collect_garbage(gs)
        runs += 1
        time.sleep(0.2)
    return runs


def _follow(where, done: list) -> list[str]:
    """Tail the log from the start, reading and checking every record's bytes, until ``done`` and caught up."""
    fs = _open(where)
    stream = fs.stream(timeout_s=0.3)
    seen = []
    while True:
        finished = bool(done)
        for rec in stream:
            if rec.kind == "record":
                check_batch(fs, stream.read(rec, fmt="numpy"), rec.traj_id, rec.token_start, rec.token_stop)
                seen.append(rec.traj_id)
        if finished:
            return seen


def test_slow_log_put_against_gc_at_the_stores_grace(tmp_path):
    """The issue's run in real time: grace 2 s, the writer's conditional PUT of its log entry held 3 s, gc at the
    store's own grace in a loop, a follower tailing and reading every record. Before: gc deleted the committed
    segment, the follower got IntegrityError, verify failed, the writer's repair failed with LocationError. (Local
    directory: the held PUT is in the client; test_faults.py has the same run on S3 with the delay in the proxy.)"""
    where = (str(tmp_path / "store"), None)
    store = _create(where)
    Gate(store, "put_if_absent", r"^log/", delay_s=3.0)
    done: list = []
    gc, follower = start(_gc_loop, where, done), start(_follow, where, done)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 24))
    done.append(True)
    assert gc.result() > 5
    assert follower.result() == ["t"]
    assert w.stats["rewritten"] == 1  # gc named the segment while the PUT was held: written again, then committed
    _check(where, {"t": 24})


def test_commits_slower_than_the_grace_fail_typed_and_keep_the_rows(tmp_path):
    """Liveness has a bound, safety has none: when every commit takes longer than the grace period, gc names every
    version of the segment first; the writer gives up after commit_timeout_s with CommitError, keeps its rows, and
    commits them once commits are fast again. Nothing committed is ever lost on the way."""
    where = (str(tmp_path / "store"), None)
    store = _create(where, gc_grace_s=1.0)
    gate = Gate(store, "put_if_absent", r"^log/", delay_s=1.5, times=None)
    done: list = []
    gc = start(_gc_loop, where, done)
    w = store.writer("w", commit_interval_s=0, commit_timeout_s=3)
    w.write("t", 0, **rows(store, "t", 0, 24))
    with pytest.raises(ts.CommitError, match="gc_grace_s"):
        w.flush()
    assert w.stats["rewritten"] >= 2
    gate.remove()
    w.close()
    done.append(True)
    gc.result()
    _check(where, {"t": 24})


# ------------------------------------------------------------------ randomized: slow commits against slow gc runs
@pytest.mark.parametrize("size", ["short", pytest.param("long", marks=pytest.mark.long)])
def test_campaign_slow_commits_against_slow_gc(proxied, size):
    """Writers whose requests pause at random against two gc loops whose every step pauses at random, at a grace
    shorter than many pauses, S3 through the fault proxy: gc keeps naming segments of writers that are slow to
    commit, writers keep writing them again; nothing committed is lost, the follower never fails
    (helpers.gates.gc_campaign). short (CI, a few seconds): 2 writers x 2 trajectories x 32 tokens, 30% of
    requests paused up to 0.3 s, grace 0.1 s: about 4 s local, 10 s S3; long (``pytest -m long``): 3 x 12 x 96,
    pauses up to 1 s, grace 0.5 s: about 2.5 min local (2,362 writer requests, 714 paused; 80 gc runs, 22 segments
    deleted, 17 rewritten), 5 min S3 (113 gc runs, 72 deleted, 43 rewritten) on two shared cores."""
    from helpers.gates import gc_campaign

    url, options = proxied
    # The pauses are random and real time: on a loaded machine a short campaign can end before gc deleted a slow
    # writer's segment. Every campaign must lose nothing; up to three (seeds 9, 10, 11 / 17, 18, 19, each on a
    # fresh prefix) get a chance to exercise a deletion and a rewrite.
    for attempt in range(3):
        where = f"{url.rstrip('/')}/a{attempt}"
        if size == "short":
            out = gc_campaign(where, options, writers=2, trajectories=2, tokens=32, seed=9 + attempt, gc_runs=2,
                              grace_s=0.1, writer_pause=(0.3, 0.3), gc_pause=(0.3, 0.2))
        else:
            out = gc_campaign(where, options, writers=3, trajectories=12, tokens=96, seed=17 + attempt, gc_runs=2)
        c = out["counts"]
        print(c)
        assert not out["problems"], out
        if c["gc_runs"] > 3 and c["gc_deleted_segments"] > 0 and c["writer_rewritten"] > 0:
            break
    assert c["gc_runs"] > 3 and c["gc_deleted_segments"] > 0 and c["writer_rewritten"] > 0, c
