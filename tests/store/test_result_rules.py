"""What a result may be (FORMAT §3.2): the structural rules a writer checks at ``write_result`` and again when it
commits, what readers and ``verify`` do with entries that break them (another implementation may write such
entries), and hostile values (typed errors, bounded work, nothing buffered)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

import tracestore as ts
from helpers.store import check_batch, rows
from tracestore.format.entries import MAX_EXTRA_BYTES, MAX_EXTRA_DEPTH, RESULTS, LogEntry, Result, encode_entry
from tracestore.format.keys import log_key

SITES = [ts.Site("s0", 64)]


def _store(location, **kw):
    return ts.create_store(location.url, SITES, storage_options=location.options, **kw)


def _open(location):
    return ts.open_store(location.url, storage_options=location.options)


def _refused(w, location, before, match, **kw):
    """``w.write_result("t", ...)`` raises a one-line ResultError matching ``match``; nothing is buffered and the
    store is unchanged."""
    buffered = w.buffered_bytes
    with pytest.raises(ts.ResultError, match=match) as e:
        w.write_result("t", **{"reward": 1.0, **kw})
    assert "\n" not in str(e.value)
    assert w.buffered_bytes == buffered
    w.flush()
    assert location.snapshot() == before
    return e.value


# ------------------------------------------------------------------ the writer refuses, before buffering anything
def test_result_before_any_tokens_is_refused(location):
    store = _store(location)
    with store.writer("w", commit_interval_s=0) as w:
        _refused(w, location, location.snapshot(), "no tokens")
        w.write("t", 0, **rows(store, "t", 0, 4))  # buffered, not committed yet: enough
        w.write_result("t", reward=1.0, prompt_len=3)
    r = _open(location).reader()
    assert r.result("t").reward == 1.0 and r.info("t").num_tokens == 4


@pytest.mark.parametrize("ranges", [[(0, 4), (8, 12)], [(4, 8)], [(0, 4), (6, 8)]])
def test_result_over_a_token_gap_is_refused(location, ranges):
    store = _store(location)
    with store.writer("w", commit_interval_s=0) as w:
        for k, (a, b) in enumerate(ranges):
            w.write("t", a, **rows(store, "t", a, b))
            if k == 0:
                w.flush()  # one range committed, the other buffered: the union counts
        w.flush()
        _refused(w, location, location.snapshot(), "gap")


@pytest.mark.parametrize("prompt_len", [4, 5, 2**62])
def test_prompt_len_must_leave_a_response_token(location, prompt_len):
    store = _store(location)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
        w.flush()
        _refused(w, location, location.snapshot(), "prompt_len", prompt_len=prompt_len)
        w.write_result("t", reward=1.0, prompt_len=3)
    assert _open(location).reader().result("t").prompt_len == 3


def test_only_the_owner_commits_a_result(location):
    store = _store(location)
    with store.writer("a", commit_interval_s=0) as a:
        a.write("t", 0, **rows(store, "t", 0, 4))
    with store.writer("b", commit_interval_s=0) as b:  # opened after a's commit: it has read it
        _refused(b, location, location.snapshot(), "owns")
    with store.writer("a", commit_interval_s=0) as a2:  # the same id again (a restarted writer): the owner
        a2.write_result("t", reward=1.0)
    assert ts.verify(_open(location)).ok


def test_tokens_after_a_result_are_refused(location):
    store = _store(location)
    with store.writer("a", commit_interval_s=0) as a:
        a.write("t", 0, **rows(store, "t", 0, 4))
        a.write_result("t", reward=1.0)
        with pytest.raises(ts.TrajectoryCompleteError, match="after its result .buffered"):
            a.write("t", 4, **rows(store, "t", 4, 8))
    before = location.snapshot()
    for skip in (False, True):
        with store.writer("b", commit_interval_s=0, skip_committed=skip) as b:
            with pytest.raises(ts.TrajectoryCompleteError, match="after its result .committed"):
                b.write("t", 4, **rows(store, "t", 4, 8))
            if skip:  # every position committed already: skipped, no error
                b.write("t", 0, **rows(store, "t", 0, 4))
    assert location.snapshot() == before


def test_application_rules_are_not_the_stores(location):
    """group_id "" and any group size in extra are the trainer's business (it sets such trajectories aside), not
    structural: the store keeps accepting them."""
    store = _store(location)
    with store.writer("w", commit_interval_s=0) as w:
        for t, gid, size in (("a", "", 4), ("b", "g", 3), ("c", "g", 99)):
            w.write(t, 0, **rows(store, t, 0, 4))
            w.write_result(t, reward=1.0, group_id=gid, prompt_len=3, extra={"group_size": size})
    got = {r.traj_id: (r.group_id, r.extra["group_size"]) for r in _open(location).reader().results()}
    assert got == {"a": ("", 4), "b": ("g", 3), "c": ("g", 99)} and ts.verify(_open(location)).ok


# ------------------------------------------------------------------ the commit checks again (races between writers)
def test_tokens_racing_a_result_are_dropped_at_commit(location):
    """b buffers tokens of t before a commits t's result: b's commit reads a's result and drops them."""
    store = _store(location)
    a = store.writer("a", commit_interval_s=0)
    b = store.writer("b", commit_interval_s=0)
    a.write("t", 0, **rows(store, "t", 0, 4))
    b.write("t", 4, **rows(store, "t", 4, 8))
    b.write("u", 0, **rows(store, "u", 0, 4))
    a.write_result("t", reward=1.0)
    a.close()
    with pytest.raises(ts.TrajectoryCompleteError) as e:
        b.close()
    assert e.value.conflicts == [("t", 4, 8)]
    fresh = _open(location)
    assert ts.verify(fresh).ok
    reader = fresh.reader()
    assert reader.info("t").ranges == ((0, 4),) and reader.info("u").num_tokens == 4


def test_a_result_whose_tokens_another_writer_committed_first_is_dropped(location):
    store = _store(location)
    a = store.writer("a", commit_interval_s=0)
    b = store.writer("b", commit_interval_s=0)
    a.write("t", 0, **rows(store, "t", 0, 4))
    a.write_result("t", reward=1.0)  # a's view: t's tokens are a's
    b.write("t", 0, **rows(store, "t", 0, 4))
    b.close()  # b commits t's tokens first: b owns t
    with pytest.raises(ts.ResultError, match="owns") as e:
        a.close()
    assert ("t", 0, 4) in e.value.conflicts and ("t", 0, 0) in e.value.conflicts  # and its tokens lost the race
    fresh = _open(location)
    assert fresh.reader().result("t") is None and ts.verify(fresh).ok
    with store.writer("b", commit_interval_s=0) as b2:
        b2.write_result("t", reward=2.0)
    assert _open(location).reader().result("t").reward == 2.0


def test_skip_committed_drops_racing_results_silently(location):
    store = _store(location)
    a = store.writer("a", commit_interval_s=0, skip_committed=True)
    b = store.writer("b", commit_interval_s=0, skip_committed=True)
    a.write("t", 0, **rows(store, "t", 0, 4))
    a.write_result("t", reward=1.0)
    b.write("t", 0, **rows(store, "t", 0, 4))
    b.write_result("t", reward=2.0)
    b.close()
    a.close()  # its tokens and its result were another writer's first: skipped
    reader = _open(location).reader()
    assert reader.result("t").reward == 2.0 and reader.info("t").writers == ("b",)


# ------------------------------------------------------------------ entries another implementation wrote
def _rogue(store, seq: int, *results: Result) -> None:
    empty = np.zeros(0, np.int64)
    entry = LogEntry(seq=seq, writer_id="rogue", writer_seq=0, segment=None, created_unix=0.0, segment_nbytes=0,
                     traj_ids=[], token_start=empty, token_stop=empty, row_offset=empty, policy_version=empty,
                     kind=RESULTS, results=results, batch=f"{seq:08d}-000000000000")
    assert store.backend.put_if_absent(log_key(seq), encode_entry(entry))


def test_readers_hand_out_rule_breaking_entries_and_verify_reports_them(location):
    store = _store(location)
    with store.writer("rogue", commit_interval_s=0) as w:
        w.write("gap", 0, **rows(store, "gap", 0, 4))
        w.write("gap", 8, **rows(store, "gap", 8, 12))
        w.write("short", 0, **rows(store, "short", 0, 4))
    with store.writer("w", commit_interval_s=0) as w:
        w.write("theirs", 0, **rows(store, "theirs", 0, 4))
    _rogue(store, store.head(), Result("none", 1.0), Result("gap", 1.0), Result("short", 1.0, prompt_len=4),
           Result("theirs", 1.0))
    with store.writer("rogue", commit_interval_s=0) as w:  # tokens after the result: as a rogue writer would
        w._committer.has_result.discard("short")
        w.write("short", 4, **rows(store, "short", 4, 8))
    fresh = _open(location)
    reader = fresh.reader()  # no IntegrityError: the entries are well formed
    assert [r.traj_id for r in reader.results()] == ["none", "gap", "short", "theirs"]
    check_batch(fresh, reader.read("short", 0, 8, fmt="numpy"), "short", 0, 8)
    assert [i.traj_id for i in fresh.stream(timeout_s=0) if i.kind == "result"] == ["none", "gap", "short", "theirs"]
    errors = ts.verify(fresh).errors
    for needle in ("'none': its result", "'gap': its result", "'short': its result", "'theirs': its result",
                   "'short': tokens [4, 8)"):
        assert any(needle in e for e in errors), (needle, errors)
    assert len(errors) == 5, errors


def test_version_2_stores_are_not_held_to_the_version_3_rules(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES, format_version=2)
    _rogue(store, 0, Result("none", 1.0))  # a version-2 writer could commit this
    assert ts.verify(ts.open_store(str(tmp_path / "s"))).ok


# ------------------------------------------------------------------ hostile values
def _nested(depth: int, leaf=0, kind=dict):
    x = leaf
    for _ in range(depth):
        x = {"a": x} if kind is dict else [x]
    return x


@pytest.mark.parametrize("kw,match", [
    (dict(reward=10**400), "reward"), (dict(reward=-(10**400)), "reward"), (dict(advantage=10**400), "advantage"),
    (dict(prompt_len=10**5000), "prompt_len"), (dict(policy_version=-(10**5000)), "policy_version"),
    (dict(extra=_nested(100_000)), "nested"), (dict(extra={"x": _nested(100_000, kind=list)}), "nested"),
    (dict(extra=_nested(MAX_EXTRA_DEPTH + 1)), "nested"), (dict(extra={"x": list(range(2_000_000))}), "bytes"),
    (dict(extra={str(i): i for i in range(200_000)}), "bytes"), (dict(extra={"x": "y" * 10**8}), "bytes"),
    (dict(extra={"x": 10**5000}), "JSON"), (dict(extra={1: 2}), "key"), (dict(extra={"x": {None: 1}}), "key"),
    (dict(extra={"x": float("inf")}), "JSON"), (dict(extra={"x": np.float32(1.0)}), "JSON"),
    (dict(extra={"x": "\u00e9" * 2731}), "bytes"),  # 2,731 x 6 bytes (\u00e9) + 8 > 16 KiB
])
def test_hostile_values_are_typed_bounded_and_buffer_nothing(tmp_path, kw, match):
    """Before: reward=10**400 raised OverflowError, a deeply nested extra RecursionError, and a huge extra was
    encoded whole before its size was checked."""
    store = ts.create_store(str(tmp_path / "s"), SITES)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
        t0 = time.perf_counter()
        with pytest.raises(ts.ResultError, match=match) as e:
            w.write_result("t", **{"reward": 1.0, **kw})
        assert time.perf_counter() - t0 < 1.0
        assert "\n" not in str(e.value) and len(str(e.value)) < 400
        assert w._buffer.pending_results == set()
    assert store.reader().results() == []


def test_extra_bounds_are_inclusive(tmp_path):
    """extra of exactly 16 KiB (canonical encoding: compact, sorted keys, non-ASCII escaped) and exactly 32 levels
    is accepted, and reads back equal."""
    store = ts.create_store(str(tmp_path / "s"), SITES)
    fill = MAX_EXTRA_BYTES - len('{"x":""}')
    extras = [{"x": "y" * fill}, {"x": "\u00e9" * (fill // 6) + "y" * (fill % 6)}, _nested(MAX_EXTRA_DEPTH)]
    with store.writer("w", commit_interval_s=0) as w:
        for i, extra in enumerate(extras):
            w.write(f"t{i}", 0, **rows(store, f"t{i}", 0, 4))
            w.write_result(f"t{i}", reward=1.0, extra=extra)
    got = [store.reader().result(f"t{i}").extra for i in range(len(extras))]
    assert got == extras
    assert len(json.dumps(extras[1], separators=(",", ":"), sort_keys=True)) == MAX_EXTRA_BYTES
