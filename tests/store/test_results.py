"""Trajectory results (format version 2): written by the rollout side, committed through the log after the
trajectory's tokens, read back by readers and streams; version-1 stores stay readable and refuse results."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pytest

import tracestore as ts
from helpers.store import check_batch, rows
from tracestore.cli import main as cli
from tracestore.format.keys import log_key
from tracestore.format.entries import RESULTS, LogEntry, Result, encode_entry

SITES = [ts.Site("s0", 64)]


def _store(location, **kw):
    return ts.create_store(location.url, SITES, storage_options=location.options, **kw)


def _entry_meta(location, seq: int) -> dict:
    data = location.read(log_key(seq))
    return json.loads(pa.ipc.open_file(pa.BufferReader(data)).schema.metadata[b"tracestore.entry"])


def test_result_commits_after_the_tokens_and_reads_back(location):
    store = _store(location)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t0", 0, **rows(store, "t0", 0, 12))
        w.write_result("t0", reward=1.5, group_id="g-0", prompt_len=4, response_len=8, policy_version=3,
                       finish_reason="stop", extra={"answer": [1, 2]})
        w.write("t1", 0, **rows(store, "t1", 0, 5))  # buffered with t0's result: not complete
    assert _entry_meta(location, 0).get("kind") == "segment" and _entry_meta(location, 1)["kind"] == "results"
    reader = ts.open_store(location.url, storage_options=location.options).reader()
    r = reader.result("t0")
    assert r == Result("t0", 1.5, "g-0", None, 4, 8, 3, "stop", {"answer": [1, 2]})
    assert reader.info("t0").complete and not reader.info("t1").complete and reader.result("t1") is None
    assert reader.complete_traj_ids() == ["t0"]
    table = reader.results_table()
    assert table.num_rows == 1 and table.column("reward").to_pylist() == [1.5] and table.column("seq").to_pylist() == [1]
    assert table.column("advantage").to_pylist() == [None] and json.loads(table.column("extra")[0].as_py()) == {"answer": [1, 2]}
    check_batch(store, reader.read("t0", 0, 12, fmt="numpy"), "t0", 0, 12)
    items = list(store.stream(timeout_s=0))
    kinds = [(i.kind, i.traj_id) for i in items]
    assert kinds.index(("result", "t0")) > kinds.index(("record", "t0"))
    result_item = next(i for i in items if i.kind == "result")
    assert result_item.reward == 1.5 and result_item.seq == 1
    with pytest.raises(TypeError):
        store.stream(timeout_s=0).read(result_item)


def test_stream_resumes_between_records_and_results(location):
    store = _store(location)
    with store.writer("w", commit_interval_s=0) as w:
        for i in range(3):
            w.write(f"t{i}", 0, **rows(store, f"t{i}", 0, 4))
            w.write_result(f"t{i}", reward=float(i))
            w.flush()
    everything = [(i.kind, i.seq, i.index) for i in store.stream(timeout_s=0)]
    stream = store.stream(timeout_s=0)
    first = [next(stream) for _ in range(3)]
    resumed = list(store.stream(stream.cursor, timeout_s=0))
    assert [(i.kind, i.seq, i.index) for i in first + resumed] == everything and len(everything) == 6


def test_one_result_per_trajectory(location):
    store = _store(location)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
        w.write_result("t", reward=1.0)
        with pytest.raises(ts.ResultExistsError, match="buffered"):
            w.write_result("t", reward=2.0)
    with store.writer("w", commit_interval_s=0) as w:
        with pytest.raises(ts.ResultExistsError, match="committed"):
            w.write_result("t", reward=3.0)
    with store.writer("w", commit_interval_s=0, skip_committed=True) as w:
        w.write_result("t", reward=4.0)  # skipped silently
    assert [r.reward for r in store.reader().results()] == [1.0]


@pytest.mark.parametrize("skip", [False, True])
def test_racing_writers_commit_one_result(location, skip):
    """Two writer objects of one writer id (a restarted process and the one it replaces) both buffer the result of
    a trajectory that id owns: the first commit wins, the second is dropped (ResultExistsError, or silently)."""
    store = _store(location)
    with store.writer("a", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
    a = store.writer("a", commit_interval_s=0, skip_committed=skip)
    b = store.writer("a", commit_interval_s=0, skip_committed=skip)
    a.write_result("t", reward=1.0)
    b.write_result("t", reward=2.0)  # b has not seen a's result: both buffer one
    a.close()
    if skip:
        b.close()
    else:
        with pytest.raises(ts.ResultExistsError) as e:
            b.close()
        assert e.value.conflicts == [("t", 0, 0)]
    assert [r.reward for r in store.reader().results()] == [1.0]
    assert ts.verify(store).ok


@pytest.mark.parametrize("kw,match", [
    (dict(reward=math.nan), "reward"), (dict(reward=math.inf), "reward"), (dict(reward="1"), "reward"),
    (dict(reward=1.0, advantage=math.nan), "advantage"), (dict(reward=1.0, group_id="a/b"), "group id"),
    (dict(reward=1.0, prompt_len=-1), "prompt_len"), (dict(reward=1.0, response_len=1.5), "response_len"),
    (dict(reward=1.0, policy_version=2**63), "policy_version"), (dict(reward=1.0, finish_reason="no way"), "finish"),
    (dict(reward=1.0, extra={"x": float("nan")}), "NaN|JSON|Out of range"), (dict(reward=1.0, extra={"x": "y" * 20000}), "extra"),
    (dict(reward=1.0, extra=[1]), "extra"),
])
def test_bad_results_are_refused_and_buffer_nothing(tmp_path, kw, match):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    with store.writer("w", commit_interval_s=0) as w:
        with pytest.raises((ValueError, TypeError), match=match):
            w.write_result("t", **kw)
        assert w.buffered_bytes == 0
    assert store.reader().results() == [] and store.head() == 0


def test_version_1_store_reads_and_writes_version_1(tmp_path, monkeypatch):
    url = str(tmp_path / "v1")
    store = ts.create_store(url, SITES, format_version=1)
    with store.writer("w", commit_interval_s=0) as w:
        for i in range(3):
            w.write(f"t{i}", 0, **rows(store, f"t{i}", 0, 6))
            w.flush()
        with pytest.raises(ts.SchemaVersionError, match="version-1"):
            w.write_result("t0", reward=1.0)
    manifest = json.loads((tmp_path / "v1" / "tracestore.json").read_text())
    meta = json.loads(pa.ipc.open_file(pa.BufferReader((tmp_path / "v1" / log_key(0)).read_bytes())).schema.metadata[
        b"tracestore.entry"])
    assert manifest["format_version"] == 1 and meta["format_version"] == 1 and "kind" not in meta
    monkeypatch.setattr("tracestore.commit_log.CHECKPOINT_MIN_ENTRIES", 2)
    assert store.compact() == 3
    fresh = ts.open_store(url)
    assert fresh.format_version == 1 and fresh.reader().traj_ids() == ["t0", "t1", "t2"]
    check_batch(fresh, fresh.reader().read("t1", 0, 6, fmt="numpy"), "t1", 0, 6)
    assert ts.verify(fresh).ok


def test_version_2_checkpoint_holds_results(tmp_path, monkeypatch):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    with store.writer("w", commit_interval_s=0) as w:
        for i in range(3):
            w.write(f"t{i}", 0, **rows(store, f"t{i}", 0, 4))
            w.write_result(f"t{i}", reward=float(i), advantage=-1.0 + i)
            w.flush()
    monkeypatch.setattr("tracestore.commit_log.CHECKPOINT_MIN_ENTRIES", 2)
    assert store.compact() == 6
    fresh = ts.open_store(str(tmp_path / "s"))
    calls = []
    orig = fresh.backend.get_many
    monkeypatch.setattr(fresh.backend, "get_many", lambda keys: calls.append(keys) or orig(keys))
    reader = fresh.reader()
    assert calls == []  # everything came from the checkpoint
    assert [(r.traj_id, r.reward, r.advantage) for r in reader.results()] == [("t0", 0.0, -1.0), ("t1", 1.0, 0.0),
                                                                            ("t2", 2.0, 1.0)]
    assert ts.verify(fresh).ok


def test_verify_reports_two_results_for_one_trajectory(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
        w.write_result("t", reward=1.0)
    empty = np.zeros(0, np.int64)
    rogue = LogEntry(seq=2, writer_id="rogue", writer_seq=0, segment=None, created_unix=0.0, segment_nbytes=0,
                     traj_ids=[], token_start=empty, token_stop=empty, row_offset=empty, policy_version=empty,
                     kind=RESULTS, results=(Result("t", 9.0),), batch="00000000-000000000000")
    assert store.backend.put_if_absent(log_key(2), encode_entry(rogue))
    fresh = ts.open_store(str(tmp_path / "s"))
    report = ts.verify(fresh)
    assert not report.ok and any("two results" in e for e in report.errors)
    assert fresh.reader().result("t").reward == 1.0  # the first committed result counts
    assert [i.reward for i in fresh.stream(timeout_s=0) if i.kind == "result"] == [1.0, 9.0]  # a stream: both


@pytest.mark.s3
def test_ambiguous_results_commit_is_ours(moto_endpoint, s3_bucket, monkeypatch):
    from helpers.faults import FaultProxy, no_s3fs_retries

    no_s3fs_retries(monkeypatch)
    name, _client, _opts = s3_bucket
    with FaultProxy(moto_endpoint) as proxy:
        opts = proxy.storage_options()
        store = ts.create_store(f"s3://{name}/r", SITES, storage_options=opts,
                                retry=ts.RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05))
        with store.writer("w", commit_interval_s=0) as w:
            w.write("t", 0, **rows(store, "t", 0, 4))
            w.flush()
            proxy.add("apply_error", "PUT", r"/log/000000000001\.arrow$", code="InternalError")
            w.write_result("t", reward=1.0)
        assert proxy.stats["apply_error"] == 1 and w.stats["lost_races"] == 0
        assert store.head() == 2 and [r.reward for r in store.reader().results()] == [1.0]


def test_cli_shows_results(tmp_path, capsys):
    url = str(tmp_path / "s")
    store = ts.create_store(url, SITES)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
        w.write_result("t", reward=0.75, finish_reason="stop")
    assert cli(["ls", url, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["trajectories"][0]["complete"] and d["trajectories"][0]["result"]["reward"] == 0.75
    assert cli(["tail", url, "--from-start", "--timeout", "0", "--json"]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [x.get("kind") for x in lines[:-1]] == ["record", "result"] and lines[-1]["records"] == 2
    assert cli(["info", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["results"] == 1
