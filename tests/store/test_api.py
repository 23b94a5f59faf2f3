"""The store's write/read API, run against every backend (local directory, in-memory, moto S3)."""

from __future__ import annotations

import json
import threading
import time
import types

import numpy as np
import pyarrow as pa
import pytest
import torch

import tracestore as ts
from helpers.store import check_batch, rows

SITES = [
    ts.Site("l20.moe_in", 64),  # nvfp4: 8 hint bytes, 4 scale bytes
    ts.Site("l21.moe_in", 64),
    ts.Site("l22.attn_o", 128, fp4_format="mxfp4"),  # 16 hint bytes, 4 scale bytes
]
MOE = dict(moe_layers=["l20", "l21"], top_k=2, num_experts=300)  # > 256 experts -> uint16 storage


def make_store(loc, **kw) -> ts.Store:
    opts = dict(model={"name": "tiny-moe", "hidden": 64}, chunk_rows=16, shard_bytes=2048, **MOE)
    opts.update(kw)
    return ts.create_store(loc.url, opts.pop("sites", SITES), storage_options=loc.options, **opts)


def test_site_validation():
    s = ts.Site("a", 2048)
    assert (s.block_size, s.hint_bytes, s.scale_bytes) == (16, 256, 128)
    assert ts.Site("b", 2048, fp4_format="mxfp4").scale_bytes == 64
    with pytest.raises(ts.ShapeError):
        ts.Site("c", 40)  # not a multiple of 16
    with pytest.raises(ts.ShapeError):
        ts.Site("c", 36, block_size=4)  # not a multiple of 8
    with pytest.raises(ValueError):
        ts.Site("c", 64, fp4_format="fp8")
    with pytest.raises(ts.InvalidIdError):
        ts.Site("../x", 64)


def test_create_open_roundtrip_all_fields(location):
    store = make_store(location)
    assert "tracestore.json" in location.keys()
    with store.writer("w0", commit_bytes=1 << 30, commit_interval_s=0) as w:
        w.write("traj-a", 0, **rows(store, "traj-a", 0, 50))
        w.write("traj-b", 0, **rows(store, "traj-b", 0, 7, policy_version=3))
        w.write("traj-a", 50, **{**rows(store, "traj-a", 50, 83), "policy_version": 1})
    # the raw store holds one log entry and one segment
    keys = location.keys()
    assert [k for k in keys if k.startswith("log/")] == ["log/000000000000.arrow"]
    store2 = ts.open_store(location.url, storage_options=location.options)
    assert list(store2.sites) == [s.name for s in SITES] and store2.sites["l22.attn_o"].block_size == 32
    assert store2.model == {"name": "tiny-moe", "hidden": 64}
    assert (store2.moe_layers, store2.top_k, store2.num_experts) == (("l20", "l21"), 2, 300)
    r = store2.reader()
    infos = {i.traj_id: i for i in r.trajectories()}
    assert infos["traj-a"].num_tokens == 83 and infos["traj-a"].policy_versions == (0, 1)
    assert infos["traj-b"].num_tokens == 7 and infos["traj-b"].writers == ("w0",)
    b = r.read("traj-a")
    check_batch(store2, b, "traj-a", 0, 83)
    assert b.token_ids.dtype == np.int32 and b.logprobs.dtype == np.float32
    assert b.experts["l20"].dtype == np.uint16  # 300 experts
    np.testing.assert_array_equal(b.policy_version, [0] * 50 + [1] * 33)
    check_batch(store2, r.read("traj-b", 2, 7), "traj-b", 2, 7)
    # torch
    bt = r.read("traj-a", 10, 60, fmt="torch")
    assert isinstance(bt.hints["l20.moe_in"], torch.Tensor) and bt.hints["l20.moe_in"].dtype == torch.uint8
    check_batch(store2, ts.TraceBatch(**{**bt.__dict__, **{
        "hints": {k: v.numpy() for k, v in bt.hints.items()}, "scales": {k: v.numpy() for k, v in bt.scales.items()},
        "token_ids": bt.token_ids.numpy(), "logprobs": bt.logprobs.numpy(), "positions": bt.positions.numpy(),
        "experts": {k: v.numpy() for k, v in bt.experts.items()}}}), "traj-a", 10, 60)
    with pytest.warns(RuntimeWarning) if not torch.cuda.is_available() else _nullcontext():
        pinned = r.read("traj-a", 0, 5, fmt="torch", pin_memory=True)
    assert pinned.hints["l20.moe_in"].shape == (5, 8)
    # arrow
    ba = r.read("traj-a", 3, 9, fmt="arrow")
    assert isinstance(ba.hints["l22.attn_o"], pa.FixedSizeBinaryArray)
    want = rows(store2, "traj-a", 3, 9)
    assert ba.hints["l22.attn_o"][0].as_py() == want["hints"]["l22.attn_o"][0].tobytes()
    table = r.read("traj-a", 3, 9).to_arrow()
    assert table.schema.equals(__import__("schemas").record_schema()) and table.num_rows == 6 * 3
    row = table.slice(4, 1).to_pylist()[0]  # position 4, site index 1
    assert row["position"] == 4 and row["site"] == "l21.moe_in"
    assert row["hints"] == want["hints"]["l21.moe_in"][1].tobytes()
    tokens = r.read("traj-a", 3, 9).to_arrow_tokens()
    assert tokens.column("token_id").to_pylist() == want["token_ids"].tolist()
    assert r.trajectories_table().num_rows == 2


def _token_bytes(x) -> list[bytes]:
    """Per token, the bytes of a hints/scales output of any ``fmt``."""
    if isinstance(x, pa.FixedSizeBinaryArray):
        return [v.as_py() for v in x]
    return [row.tobytes() for row in (x.numpy() if isinstance(x, torch.Tensor) else x)]


def test_to_arrow_every_row_matches_the_batch(tmp_path):
    store = make_store(types.SimpleNamespace(url=str(tmp_path / "s"), options=None))
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 37))
    r = store.reader()
    for kw in [{}, {"fmt": "arrow"}, {"fmt": "torch"}, {"sites": ["l22.attn_o", "l20.moe_in"]},
               {"sites": ["l20.moe_in", "l21.moe_in"], "features": (32, 64)}, {"sites": []}]:
        b = r.read("t", 5, 36, **kw)
        table = b.to_arrow()
        hints = {s: _token_bytes(v) for s, v in b.hints.items()}
        scales = {s: _token_bytes(v) for s, v in b.scales.items()}
        # the reference, built row by row: one row per (position, site), token-major, sites in batch order
        want = [{"traj_id": "t", "position": 5 + i, "site": s, "hints": hints[s][i], "scales": scales[s][i]}
                for i in range(31) for s in b.hints]
        assert table.schema.equals(__import__("schemas").record_schema()), kw
        assert table.to_pylist() == want, kw
        table.validate(full=True)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def test_random_access_and_segments(location):
    store = make_store(location)
    rng = np.random.default_rng(1)
    spans = {}
    with store.writer("w1", commit_bytes=5000, commit_interval_s=0) as w:  # a segment every ~100 tokens
        for t in range(4):
            pos = 0
            for n in rng.integers(1, 70, size=5):
                w.write(f"t{t}", pos, **rows(store, f"t{t}", pos, pos + int(n)))
                pos += int(n)
            spans[f"t{t}"] = pos
    assert sum(1 for k in location.keys() if k.startswith("log/")) > 3
    r = store.reader()
    for _ in range(25):
        t = f"t{rng.integers(4)}"
        a = int(rng.integers(0, spans[t]))
        b = int(rng.integers(a + 1, spans[t] + 1))
        check_batch(store, r.read(t, a, b), t, a, b)
    # site subsets, no trace
    b = r.read("t1", 5, 40, sites=["l22.attn_o"], trace=False)
    assert list(b.hints) == ["l22.attn_o"] and b.token_ids is None
    with pytest.raises(ts.HintNotFoundError):
        r.read("t1", 0, spans["t1"] + 1)
    with pytest.raises(ts.HintNotFoundError):
        r.read("nope")
    with pytest.raises(ts.UnknownSiteError):
        r.read("t1", 0, 3, sites=["bogus"])


def test_feature_slices(location):
    store = make_store(location, sites=[ts.Site("a", 128), ts.Site("b", 128, fp4_format="mxfp4")], feature_chunk=32)
    with store.writer(commit_interval_s=0) as w:
        w.write("x", 0, **rows(store, "x", 0, 40))
    r = store.reader()
    for lo, hi in [(0, 32), (32, 64), (32, 128), (0, 128), (64, 96)]:
        check_batch(store, r.read("x", 3, 37, features=(lo, hi)), "x", 3, 37, features=(lo, hi))
    for bad in [(0, 16), (8, 40), (0, 160), (64, 32), (-32, 0)]:
        with pytest.raises(ts.ShapeError):
            r.read("x", 0, 4, features=bad)


def test_long_trajectory_bounded_memory(location):
    store = make_store(location, sites=[ts.Site("a", 256)], moe_layers=(), top_k=0, num_experts=0)
    T = 1500
    data = rows(store, "long", 0, T)
    budget = 300 * (32 + 16 + 8)  # 300 tokens: two buffers of 150
    w = store.writer("w", commit_bytes=1 << 30, max_buffer_bytes=budget, commit_interval_s=0)
    w.write("long", 0, **data)  # one call: split into segments of <= max_buffer_bytes
    assert w.buffered_bytes <= budget
    w.close()
    assert w.stats["segments"] >= T // 150
    r = store.reader()
    assert r.info("long").num_tokens == T
    check_batch(store, r.read("long", 234, 1345), "long", 234, 1345)


def test_snapshot_pinning(location):
    store = make_store(location)
    with store.writer(commit_interval_s=0) as w:
        w.write("a", 0, **rows(store, "a", 0, 10))
    snap = store.snapshot()
    text = snap.to_json()
    with store.writer(commit_interval_s=0) as w:
        w.write("a", 10, **rows(store, "a", 10, 20))
        w.write("b", 0, **rows(store, "b", 0, 5))
    old = store.reader(ts.Snapshot.from_json(text))
    assert [i.traj_id for i in old.trajectories()] == ["a"] and old.info("a").num_tokens == 10
    with pytest.raises(ts.HintNotFoundError):
        old.read("a", 5, 15)
    new = store.reader()
    assert new.info("a").num_tokens == 20 and "b" in new
    with pytest.raises(ts.SnapshotError):
        store.reader(ts.Snapshot("other-store", 1))
    with pytest.raises(ts.SnapshotError):
        store.reader(ts.Snapshot(store.store_id, 99))
    with pytest.raises(ts.SchemaVersionError):
        ts.Snapshot.from_json(json.dumps({"kind": "tracestore.snapshot", "version": 7, "store_id": "x", "log_end": 1}))


def test_stream_cursor_resume_exactly_once(location):
    store = make_store(location)
    with store.writer("w", commit_interval_s=0) as w:
        for i in range(6):
            w.write(f"t{i}", 0, **rows(store, f"t{i}", 0, 5 + i))
            if i % 2:
                w.flush()  # entries with 2 records each
    s = store.stream(timeout_s=0)
    first = [next(s) for _ in range(3)]
    cur = s.cursor
    rest = list(store.stream(cur, timeout_s=0))
    assert [r.traj_id for r in first + rest] == [f"t{i}" for i in range(6)]
    assert len({(r.seq, r.index) for r in first + rest}) == 6
    # reading a streamed record
    rec = rest[-1]
    check_batch(store, s.read(rec), rec.traj_id, rec.token_start, rec.token_stop)
    # nothing new: an exhausted stream's cursor resumes with nothing
    s2 = store.stream(timeout_s=0)
    assert len(list(s2)) == 6 and list(store.stream(s2.cursor, timeout_s=0)) == []
    with pytest.raises(ts.SnapshotError):
        store.stream("v1:someoneelse:0:0")
    with pytest.raises(ts.SchemaVersionError):
        store.stream(f"v9:{store.store_id}:0:0")


def test_committed_record_json_round_trip(tmp_path):
    store = make_store(types.SimpleNamespace(url=str(tmp_path / "s"), options=None))
    with store.writer("w", commit_interval_s=0) as w:
        w.write("a", 0, **rows(store, "a", 0, 5, policy_version=3))
        w.write("b", 2, **rows(store, "b", 2, 9))
    records = list(store.stream(timeout_s=0))
    for rec in records:
        v = rec.to_json()
        s = rec.segment  # the list trainer checkpoints store: it must not change
        assert v == [rec.traj_id, rec.token_start, rec.token_stop, rec.policy_version, rec.writer_id, rec.seq,
                     rec.index, rec.row_offset, [s.path, s.writer_id, s.rows, s.chunk_rows, s.shard_bytes],
                     rec.created_unix]
        back = ts.CommittedRecord.from_json(json.loads(json.dumps(v)))
        assert back == rec and back.to_json() == v
        check_batch(store, ts.read_record(store, back), rec.traj_id, rec.token_start, rec.token_stop)
    v = records[0].to_json()
    for bad in (None, "x", v[:9], v + [0], [7, *v[1:]], [*v[:1], -1, *v[2:]], [*v[:2], v[1], *v[3:]],
                [*v[:3], 2**63, *v[4:]], [*v[:4], "bad/id", *v[5:]], [*v[:5], True, *v[6:]],
                [*v[:8], v[8][:4], v[9]], [*v[:8], ["data/other/00000000-0123456789ab", *v[8][1:]], v[9]],
                [*v[:8], ["../../etc", *v[8][1:]], v[9]], [*v[:8], [*v[8][:2], 0, *v[8][3:]], v[9]],
                [*v[:9], float("nan")], [*v[:9], "1.5"]):
        with pytest.raises(ts.IntegrityError, match="not a committed record"):
            ts.CommittedRecord.from_json(bad)


def test_check_id_is_public():
    assert ts.check_id("traj-0") == "traj-0" and ts.check_id("w:1", what="writer id") == "w:1"
    with pytest.raises(ts.InvalidIdError, match="writer id"):
        ts.check_id("a/b", what="writer id")


def test_stream_cursor_past_the_head_is_rejected(location):
    store = make_store(location)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("a", 0, **rows(store, "a", 0, 4))
        w.write("b", 0, **rows(store, "b", 0, 4))
        w.flush()  # entry 0: two records
        w.write("c", 0, **rows(store, "c", 0, 4))  # entry 1: one record
    assert store.head() == 2
    before = location.snapshot()
    sid = store.store_id
    # FORMAT §7: a cursor past the head is a SnapshotError, raised by stream() itself (not a silent poll)
    for seq, index, allowed in [(99, 0, "the log has 2 entries"), (3, 0, "the log has 2 entries"),
                                (2, 1, "the log has 2 entries"), (0, 3, "holds 2 records (allowed: index 0..2)"),
                                (1, 2, "holds 1 records (allowed: index 0..1)")]:
        cursor = f"v1:{sid}:{seq}:{index}"
        with pytest.raises(ts.SnapshotError) as e:
            store.stream(cursor, timeout_s=0)
        msg = str(e.value)
        assert cursor in msg and f"record {index}" in msg and allowed in msg, msg  # what arrived, what is allowed
        if seq >= 2:
            assert f"log entry {seq}" in msg and "seq < 2" in msg and "seq 2 with index 0" in msg, msg
    # the boundaries are valid: the head itself, and an index at the end of an entry (= the next entry)
    assert list(store.stream(f"v1:{sid}:2:0", timeout_s=0)) == []
    assert [r.traj_id for r in store.stream(f"v1:{sid}:0:2", timeout_s=0)] == ["c"]
    assert [r.traj_id for r in store.stream(f"v1:{sid}:0:1", timeout_s=0)] == ["b", "c"]
    assert [r.traj_id for r in store.stream(f"v1:{sid}:1:1", timeout_s=0)] == []
    assert location.snapshot() == before  # rejecting (and reading) changed nothing


def test_stream_tails_a_live_writer(location):
    store = make_store(location)
    got = []
    stream = store.stream(poll_interval_s=0.01, timeout_s=5.0)

    def consume():
        for rec in stream:
            got.append(rec)
            if len(got) == 5:
                return

    th = threading.Thread(target=consume)
    th.start()
    with store.writer("live", commit_interval_s=0.05) as w:  # time-based commits, no explicit flush
        for i in range(5):
            w.write(f"t{i}", 0, **rows(store, f"t{i}", 0, 3))
            time.sleep(0.1)
    th.join(10)
    assert [r.traj_id for r in got] == [f"t{i}" for i in range(5)]


def test_overlap_and_restart(location):
    store = make_store(location)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("a", 0, **rows(store, "a", 0, 10))
        with pytest.raises(ts.OverlapError):
            w.write("a", 5, **rows(store, "a", 5, 12))  # overlaps the buffer
        w.flush()
        before = location.snapshot()
        with pytest.raises(ts.OverlapError):
            w.write("a", 9, **rows(store, "a", 9, 11))  # overlaps a committed range
        assert w.buffered_bytes == 0 and location.snapshot() == before  # the failed write left no trace
        w.write("a", 10, **rows(store, "a", 10, 12))
    # a restarted writer with the same id: duplicates are refused, or skipped when asked
    with store.writer("w", commit_interval_s=0) as w2:
        assert w2.committed("a") == [(0, 12)]
        with pytest.raises(ts.OverlapError):
            w2.write("a", 0, **rows(store, "a", 0, 10))
    with store.writer("w", commit_interval_s=0, skip_committed=True) as w3:
        w3.write("a", 0, **rows(store, "a", 0, 10))  # skipped: already committed
        w3.write("a", 12, **rows(store, "a", 12, 15))
    r = store.reader()
    assert r.info("a").ranges == ((0, 15),) and r.info("a").committed_tokens == 15
    check_batch(store, r.read("a"), "a", 0, 15)


def test_racing_writers_first_commit_wins(location):
    store = make_store(location)
    a = store.writer("A", commit_interval_s=0)
    b = ts.open_store(location.url, storage_options=location.options).writer("B", commit_interval_s=0)
    a.write("x", 0, **rows(store, "x", 0, 10))
    b.write("x", 5, **rows(store, "x", 5, 15))  # B has not seen A's (uncommitted) rows
    b.write("y", 0, **rows(store, "y", 0, 4))
    a.flush()
    with pytest.raises(ts.OverlapError) as e:
        b.flush()
    assert e.value.conflicts == [("x", 5, 10)]  # B keeps only what A did not commit: [10, 15)
    a.close()
    b.close()
    r = store.reader()
    assert r.info("x").ranges == ((0, 15),) and r.info("y").num_tokens == 4
    assert [w for w in r.info("x").writers] == ["A", "B"]
    check_batch(store, r.read("x"), "x", 0, 15)
    assert ts.verify(store).ok


def test_create_exist_ok_and_not_found(location):
    make_store(location)
    with pytest.raises(ts.StoreExistsError):
        make_store(location)
    assert make_store(location, exist_ok=True).sites.keys() == {s.name for s in SITES}
    with pytest.raises(ts.StoreExistsError):
        make_store(location, exist_ok=True, sites=[ts.Site("other", 64)])
    with pytest.raises(ts.StoreNotFoundError):
        ts.open_store(location.url.rstrip("/") + "-missing", storage_options=location.options)


def test_info_accounting(location):
    store = make_store(location)
    with store.writer(commit_interval_s=0) as w:
        w.write("a", 0, **rows(store, "a", 0, 100))
    d = ts.info(store)
    assert d["tokens"] == 100 and d["trajectories"] == 1 and d["log_entries"] == 1
    assert d["payload_bytes_per_token"] == 8 + 4 + 8 + 4 + 16 + 4
    assert d["bytes"]["total"] == sum(len(location.read(k)) for k in location.keys())
    assert d["bytes"]["payload"] >= 100 * d["payload_bytes_per_token"]
    json.dumps(d)


def test_torch_inputs_and_dtype_conversion(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES, **MOE)
    want = rows(store, "t", 0, 12)
    with store.writer(commit_interval_s=0) as w:
        w.write("t", 0,
                hints={k: torch.from_numpy(v) for k, v in want["hints"].items()},
                scales={k: torch.from_numpy(v) for k, v in want["scales"].items()},
                token_ids=torch.from_numpy(want["token_ids"]),  # int64 -> int32
                logprobs=torch.from_numpy(want["logprobs"]).to(torch.float64),  # float64 -> float32
                experts={k: torch.from_numpy(v).to(torch.int16) for k, v in want["experts"].items()},
                policy_version=np.int64(4))
        w.write("u", 0, **{**rows(store, "u", 0, 3), "logprobs": torch.zeros(3, dtype=torch.bfloat16)})
    r = store.reader()
    check_batch(store, r.read("t"), "t", 0, 12)
    assert r.info("t").policy_versions == (4,)
    np.testing.assert_array_equal(r.read("u").logprobs, np.zeros(3, np.float32))


def test_background_commit_by_time_and_writer_state(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES, **MOE)
    w = store.writer("timed", commit_interval_s=0.1)
    w.write("t", 0, **rows(store, "t", 0, 4))
    assert w.buffered_bytes > 0 and store.head() == 0
    deadline = time.monotonic() + 5
    while store.head() == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.head() == 1  # committed by the writer's timer, without flush()
    w.close()
    w.close()  # idempotent
    with pytest.raises(ts.TraceStoreError):
        w.write("t", 4, **rows(store, "t", 4, 5))
    assert w.stats["segments"] == 1 and w.stats["records"] == 1


def test_failed_commit_keeps_rows_and_retries(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES, **MOE)
    w = store.writer("flaky", commit_interval_s=0)
    real = store.backend.put_many
    calls = {"n": 0}

    def flaky(items, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ts.BackendError("injected: storage unavailable")
        return real(items, **kw)

    store.backend.put_many = flaky
    w.write("t", 0, **rows(store, "t", 0, 6))
    with pytest.raises(ts.BackendError, match="injected"):
        w.flush()
    assert store.head() == 0
    w.write("t", 6, **rows(store, "t", 6, 9))  # the writer keeps working
    w.close()  # retries the failed buffer, then commits the new rows
    r = store.reader()
    assert r.info("t").ranges == ((0, 9),)
    check_batch(store, r.read("t"), "t", 0, 9)
    assert not ts.verify(store).errors


def test_snapshot_cursor_and_refresh(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES, **MOE)
    with store.writer(commit_interval_s=0) as w:
        w.write("a", 0, **rows(store, "a", 0, 5))
    snap = store.snapshot()
    r = store.reader(snap.to_json())  # a snapshot's JSON is accepted directly
    with store.writer(commit_interval_s=0) as w:
        w.write("b", 0, **rows(store, "b", 0, 5))
    after = list(store.stream(snap.to_cursor(), timeout_s=0))  # only what came after the snapshot
    assert [x.traj_id for x in after] == ["b"]
    assert "b" not in r and "b" in r.refresh()
    check_batch(store, ts.read_record(store, after[0]), "b", 0, 5)


def test_checkpoints(location, monkeypatch):
    import tracestore.commit_log as store_mod

    monkeypatch.setattr(store_mod, "CHECKPOINT_MIN_ENTRIES", 2)
    store = make_store(location)
    with store.writer("w", commit_interval_s=0) as w:
        for i in range(5):
            w.write(f"t{i % 2}", (i // 2) * 4, **rows(store, f"t{i % 2}", (i // 2) * 4, (i // 2) * 4 + 4))
            w.flush()
    assert store.compact() == 5 and store.compact() is None
    assert "index/000000000005.parquet" in location.keys()
    # a fresh store object loads entries 0..4 from the checkpoint: a damaged entry is not even read
    entry1 = location.read("log/000000000001.arrow")
    location.write("log/000000000001.arrow", entry1[: len(entry1) // 2])
    fresh = ts.open_store(location.url, storage_options=location.options)
    r = fresh.reader()
    assert r.info("t0").num_tokens == 12 and r.info("t1").num_tokens == 8
    check_batch(fresh, r.read("t0"), "t0", 0, 12)
    rep = ts.verify(fresh)  # verify reads every entry itself and compares the checkpoint
    assert any("log entry 1" in e for e in rep.errors)
    location.write("log/000000000001.arrow", entry1)  # repair
    assert ts.verify(fresh).ok
    # a damaged checkpoint is ignored (with a warning): readers fall back to the log entries
    location.flip("index/000000000005.parquet", 30)
    again = ts.open_store(location.url, storage_options=location.options)
    assert again.reader().info("t0").num_tokens == 12
    assert any("checkpoint" in e for e in ts.verify(again).errors)
    assert ts.info(again)["bytes"]["checkpoints"] > 0


def test_open_args_open_the_same_store_again_and_memory_stores_say_they_cannot(location):
    """Store.open_args is what open_store takes to open the store again (in another process: a trainer's reader);
    an in-memory store lives in its process alone and says so."""
    store = make_store(location)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 2))
    if location.url.startswith("memory://"):
        with pytest.raises(ts.LocationError, match="memory: no other process can open it"):
            store.open_args()
        return
    url, options, retry = store.open_args()
    assert (url, options, retry) == (location.url, dict(location.options or {}), store.backend.retry)
    again = ts.open_store(url, storage_options=options, retry=retry)
    assert again.store_id == store.store_id
    check_batch(again, again.reader().read("t", 0, 2), "t", 0, 2)
