"""Bad input and damaged stores: typed errors, clear messages, and an unchanged store."""

from __future__ import annotations

import json

import time

import numpy as np
import pytest
import torch

import tracestore as ts
from helpers.store import rows

SITES = [ts.Site("s0", 64), ts.Site("s1", 128, fp4_format="mxfp4")]


@pytest.fixture
def store(location):
    st = ts.create_store(location.url, SITES, moe_layers=["m0"], top_k=2, num_experts=8, chunk_rows=8,
                         storage_options=location.options)
    with st.writer("base", commit_interval_s=0) as w:
        w.write("t", 0, **rows(st, "t", 0, 20))
    return st


HOSTILE = ["../x", "/abs", "", "a" * 201, "a\x00b", "a/b", "..", "a..b", " x", "x\n", "x\\y", "é", ".hidden",
           "-dash"]


def test_hostile_ids(location, store):
    before = location.snapshot()
    w = store.writer("w", commit_interval_s=0)
    r = store.reader()
    for bad in HOSTILE + [5, None, b"bytes"]:
        with pytest.raises(ts.InvalidIdError) as e:
            w.write(bad, 0, **rows(store, "t", 0, 3))
        assert "trajectory id" in str(e.value)
        with pytest.raises(ts.InvalidIdError):
            r.read(bad)
    w.close()
    for bad in ["../w", "/w", "", "w/x", "w\x00"]:
        with pytest.raises(ts.InvalidIdError):
            store.writer(bad)
    assert location.snapshot() == before


def _bad_inputs(store):
    good = rows(store, "t", 20, 24)
    T = 4

    def mod(**kw):
        d = {k: (dict(v) if isinstance(v, dict) else v) for k, v in good.items()}
        for k, v in kw.items():
            if "." in k:
                a, b = k.split(".", 1)
                if v is None:
                    del d[a][b]
                else:
                    d[a][b] = v
            else:
                d[k] = v
        return d

    return [
        ("hints dtype", ts.DTypeError, mod(**{"hints.s0": good["hints"]["s0"].astype(np.int16)})),
        ("hints float tensor", ts.DTypeError, mod(**{"hints.s0": torch.zeros(T, 8)})),
        ("hints width", ts.ShapeError, mod(**{"hints.s0": np.zeros((T, 9), np.uint8)})),
        ("hints rows", ts.ShapeError, mod(**{"hints.s0": np.zeros((T + 1, 8), np.uint8)})),
        ("scales width", ts.ShapeError, mod(**{"scales.s1": np.zeros((T, 8), np.uint8)})),
        ("unknown site", ts.UnknownSiteError, mod(**{"hints.zzz": np.zeros((T, 8), np.uint8)})),
        ("missing site", ts.ShapeError, mod(**{"scales.s1": None})),
        ("token ids float", ts.DTypeError, mod(token_ids=np.zeros(T, np.float32))),
        ("token ids 2-D", ts.ShapeError, mod(token_ids=np.zeros((T, 1), np.int64))),
        ("token ids overflow", ts.DTypeError, mod(token_ids=np.full(T, 2**40, np.int64))),
        ("logprobs int", ts.DTypeError, mod(logprobs=np.zeros(T, np.int32))),
        ("logprobs length", ts.ShapeError, mod(logprobs=np.zeros(T + 2, np.float32))),
        ("experts missing", ts.ShapeError, mod(experts=None)),
        ("experts unknown layer", ts.UnknownSiteError, mod(**{"experts.m9": np.zeros((T, 2), np.int64)})),
        ("experts range", ts.ShapeError, mod(**{"experts.m0": np.full((T, 2), 8, np.int64)})),
        ("experts top_k", ts.ShapeError, mod(**{"experts.m0": np.zeros((T, 3), np.int64)})),
        ("experts dtype", ts.DTypeError, mod(**{"experts.m0": np.zeros((T, 2), np.float32)})),
        ("policy version", ts.DTypeError, mod(policy_version=1.5)),
        ("empty", ts.ShapeError, {**mod(), "token_ids": np.zeros(0, np.int64)}),
    ]


def test_bad_rows_leave_store_unchanged(location, store):
    before = location.snapshot()
    w = store.writer("w", commit_interval_s=0)
    for what, err, kwargs in _bad_inputs(store):
        with pytest.raises(err) as e:
            w.write("t", 20, **kwargs)
        assert str(e.value), what
    for start, stop in [(0, 4), (19, 23), (5, 6)]:  # overlaps the committed [0, 20)
        with pytest.raises(ts.OverlapError) as e:
            w.write("t", start, **rows(store, "t", start, stop))
        assert "[0, 20)" in str(e.value) and "'t'" in str(e.value)
    with pytest.raises(ts.ShapeError):
        w.write("t", -1, **rows(store, "t", 0, 2))
    assert w.buffered_bytes == 0
    w.close()
    assert location.snapshot() == before


def test_bad_store_declarations(location):
    with pytest.raises(ts.ShapeError):
        ts.create_store(location.url, [], storage_options=location.options)
    with pytest.raises(ts.ShapeError):
        ts.create_store(location.url, [ts.Site("a", 64), ts.Site("a", 64)], storage_options=location.options)
    with pytest.raises(ts.InvalidIdError):
        ts.create_store(location.url, SITES, moe_layers=["../m"], top_k=1, num_experts=2,
                        storage_options=location.options)
    with pytest.raises(ts.ShapeError):
        ts.create_store(location.url, SITES, moe_layers=["m"], top_k=0, num_experts=2, storage_options=location.options)
    assert location.keys() == []


def test_flipped_byte_is_an_integrity_error(location, store):
    shard = next(k for k in location.keys() if "/hints." in k and not k.endswith("zarr.json"))
    location.flip(shard, 100)
    with pytest.raises(ts.IntegrityError) as e:
        store.reader().read("t", 0, 20)
    msg = str(e.value)
    assert "crc32c" in msg and shard in msg and "'t'" in msg
    report = ts.verify(store)
    assert not report.ok and any(shard in err and "crc32c" in err for err in report.errors)
    # other arrays are still readable: the damage is local to the chunk
    assert store.reader().read("t", 0, 20, sites=[], trace=True).token_ids.shape == (20,)


def test_missing_shard_is_an_integrity_error(location, store):
    shard = next(k for k in location.keys() if "/scales." in k and not k.endswith("zarr.json"))
    location.delete(shard)
    with pytest.raises(ts.IntegrityError) as e:
        store.reader().read("t", 0, 5)
    assert "'t'" in str(e.value)
    assert not ts.verify(store).ok


def test_truncated_log_entry(location, store):
    key = "log/000000000000.arrow"
    data = location.read(key)
    location.write(key, data[: len(data) // 2])
    with pytest.raises(ts.IntegrityError) as e:
        store.reader()
    assert key in str(e.value)
    report = ts.verify(store)
    assert not report.ok and key.split("/")[1].split(".")[0] in report.errors[0]
    with pytest.raises(ts.IntegrityError):
        ts.collect_garbage(store, now=time.time() + 1e6)  # refuses to delete anything while an entry is unreadable


def _rewrite_log_entry(location, key: str, edit) -> None:
    """Replace the Arrow table of log entry ``key`` with ``edit(table)``, written raw (no tracestore code)."""
    import pyarrow as pa

    table = edit(pa.ipc.open_file(pa.BufferReader(location.read(key))).read_all())
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as wr:
        wr.write_table(table)
    location.write(key, sink.getvalue().to_pybytes())


def test_corrupt_log_entry_crc(location, store):
    import pyarrow as pa

    def bump_token_start(table):  # token_start 0 -> 5, crc left as it was
        cols = table.columns
        return pa.table([cols[0], pa.array([5], pa.int64()), *cols[2:]], schema=table.schema)

    _rewrite_log_entry(location, "log/000000000000.arrow", bump_token_start)
    with pytest.raises(ts.IntegrityError) as e:
        store.reader()
    assert "crc32c" in str(e.value)


def test_unsupported_versions(location, store):
    def version_99(table):
        meta = dict(table.schema.metadata)
        d = json.loads(meta[b"tracestore.entry"])
        d["format_version"] = 99
        meta[b"tracestore.entry"] = json.dumps(d).encode()
        return table.replace_schema_metadata(meta)

    _rewrite_log_entry(location, "log/000000000000.arrow", version_99)
    with pytest.raises(ts.SchemaVersionError) as e:
        store.reader()
    assert "99" in str(e.value) and "[1, 2, 3, 4, 5]" in str(e.value)

    manifest = json.loads(location.read("tracestore.json"))
    manifest["format_version"] = 99
    location.write("tracestore.json", json.dumps(manifest).encode())
    with pytest.raises(ts.SchemaVersionError) as e:
        ts.open_store(location.url, storage_options=location.options)
    assert "99" in str(e.value) and "[1, 2, 3, 4, 5]" in str(e.value)
    location.write("tracestore.json", b"{not json")
    with pytest.raises(ts.IntegrityError):
        ts.open_store(location.url, storage_options=location.options)


def test_partial_and_stray_files_are_ignored_and_collected(location, store):
    location.write("log/.000000000001.arrow.deadbeef.partial", b"half an entry")
    location.write("data/ghost/00000000-0123456789ab/hints.w64.b16/0.0.0", b"orphan")
    r = store.reader()
    assert r.snapshot.log_end == 1 and r.info("t").num_tokens == 20
    assert list(store.stream(timeout_s=0))[0].traj_id == "t"
    rep = ts.verify(store)
    assert rep.ok and rep.orphan_segments == ["data/ghost/00000000-0123456789ab"]
    young = ts.collect_garbage(store)  # default grace (1 h): nothing is old enough
    assert young.deleted_objects == 0 and young.young_segments
    dry = ts.collect_garbage(store, dry_run=True, now=time.time() + 1e6)
    assert dry.deleted_objects == 2 and "data/ghost/00000000-0123456789ab/hints.w64.b16/0.0.0" in location.keys()
    rep = ts.collect_garbage(store, now=time.time() + 1e6)
    assert rep.deleted_segments == ["data/ghost/00000000-0123456789ab"] and rep.deleted_objects == 2
    assert not any("ghost" in k or k.endswith(".partial") for k in location.keys())
    assert ts.verify(store).ok and store.reader().info("t").num_tokens == 20


def test_bad_arguments_raise_typed_errors_that_are_still_the_builtin_ones(tmp_path):
    """Every argument check raises a tracestore error that says what arrived and what is allowed, and is still the
    ValueError / TypeError / OverflowError it was, so ``except ValueError`` keeps working."""
    from tracestore.format.entries import encode_checkpoint

    store = ts.create_store(str(tmp_path / "s"), [ts.Site("s0", 64)])
    with store.writer(commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
        w.write_result("t", reward=1.0)
    checks = [
        (lambda: ts.RetryPolicy(attempts=0), ts.OptionError, ValueError, "attempts"),
        (lambda: ts.RetryPolicy(deadline_s=float("nan")), ts.OptionError, ValueError, "deadline_s"),
        (lambda: store.writer(commit_bytes=0), ts.OptionError, ValueError, "commit_bytes"),
        (lambda: store.writer(commit_timeout_s=float("inf")), ts.OptionError, ValueError, "commit_timeout_s"),
        (lambda: store.reader().read("t", fmt="pandas"), ts.OptionError, ValueError, "fmt"),
        (lambda: store.reader().read("t", pin_memory=True), ts.OptionError, ValueError, "pin_memory"),
        (lambda: ts.create_store(str(tmp_path / "m"), [ts.Site("s0", 64)], model={"x": {1, 2}}), ts.OptionTypeError,
         TypeError, "JSON"),
        (lambda: ts.Result.from_json({"traj_id": "t"}), ts.ResultError, ValueError, "fields"),
        (lambda: ts.Result.from_json({**ts.Result("t", 1.0).to_json(), "extra": [1]}), ts.ResultError, TypeError,
         "extra"),
        (lambda: encode_checkpoint(store.read_entries(0, 2), version=1), ts.EntryVersionError, ValueError,
         "version-1"),
    ]
    for call, typed, builtin, match in checks:
        with pytest.raises(typed, match=match) as e:
            call()
        assert isinstance(e.value, builtin) and isinstance(e.value, ts.TraceStoreError)
    result = next(i for i in store.stream(timeout_s=0) if i.kind == "result")
    with pytest.raises(ts.OptionTypeError, match="CommittedRecord") as e:
        store.stream(timeout_s=0).read(result)
    assert isinstance(e.value, TypeError)
    assert issubclass(ts.ArrowOverflowError, OverflowError) and issubclass(ts.ArrowOverflowError, ts.ShapeError)


def test_error_classes_live_in_the_errors_module():
    import ast
    import pathlib

    root = pathlib.Path(ts.__file__).parent
    elsewhere = []
    for path in root.rglob("*.py"):
        if path.name == "errors.py" and path.parent == root:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and any(
                    getattr(b, "id", getattr(b, "attr", "")).endswith(("Error", "Exception")) for b in node.bases):
                elsewhere.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
    assert not elsewhere, elsewhere
