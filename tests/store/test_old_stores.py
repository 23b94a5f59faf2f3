"""Stores that older code wrote (``tests/store/data/format_v1``, ``format_v2``: written by tracestore 42469c1 with
``data/make_old_stores.py``) read unchanged with this code (format 3): the same records, bytes, results and
checkpoint, ``verify`` clean, not one stored byte changed by reading; writers append entries of the store's own
version; and ``gc`` of a version-1/2 store, which has no gc entries to fence writers with, deletes no segment
without ``force`` (FORMAT §6.3)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pyarrow as pa
import pytest

import tracestore as ts
from helpers.store import check_batch, rows

DATA = Path(__file__).parent / "data"
TOKENS = {"t0": 10, "t1": 9, "t2": 5}  # and, in format 2, a result "empty" without tokens


def _copy(tmp_path, version: int) -> Path:
    dst = tmp_path / f"v{version}"
    shutil.copytree(DATA / f"format_v{version}", dst)
    return dst


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("version", [1, 2])
def test_old_store_reads_unchanged(tmp_path, version):
    root = _copy(tmp_path, version)
    before = _files(root)
    store = ts.open_store(str(root))
    assert store.format_version == version and store.head() == (4 if version == 2 else 3)
    reader = store.reader()
    assert sorted(reader.traj_ids()) == sorted([*TOKENS] + (["empty"] if version == 2 else []))
    for t, n in TOKENS.items():
        check_batch(store, reader.read(t, 0, n, fmt="numpy"), t, 0, n)
    assert [reader.info(t).policy_versions for t in sorted(TOKENS)] == [(0,), (1,), (2,)]
    results = [r.to_json() for r in reader.results()]
    if version == 2:
        assert [r["traj_id"] for r in results] == ["t0", "t1", "empty"]
        assert results[0] == {"traj_id": "t0", "reward": 1.5, "group_id": "g0", "advantage": 0.25, "prompt_len": 4,
                              "response_len": 6, "policy_version": 0, "finish_reason": "stop",
                              "extra": {"k": [1, "é"]}}
    else:
        assert results == []
    items = [(i.kind, i.traj_id) for i in store.stream(timeout_s=0)]
    assert items[-1] == ("record", "t2") and len(items) == 3 + 3 * (version == 2) + 1
    report = ts.verify(store)  # format 2 allowed a result without tokens: no rule of version 3 is held against it
    assert report.ok, report.errors
    assert len(report.orphan_segments) == 1
    out = tmp_path / "records.parquet"
    assert ts.export_table(store, str(out))["rows"] == 4
    assert _files(root) == before  # reading, streaming, verifying and exporting changed no byte


@pytest.mark.parametrize("version", [1, 2])
def test_old_store_gc_and_writers(tmp_path, version):
    root = _copy(tmp_path, version)
    store = ts.open_store(str(root))
    orphan = ts.verify(store).orphan_segments
    before = _files(root)
    rep = ts.collect_garbage(store, now=time.time() + 1e7)  # the orphan is old, but no gc entry can fence writers
    assert rep.kept_segments == orphan and rep.deleted_segments == [] and rep.gc_entries == []
    assert _files(root) == before
    with store.writer("w3", commit_interval_s=0) as w:
        w.write("t3", 0, **rows(store, "t3", 0, 4))
        if version == 2:
            w.write_result("t3", reward=2.0, prompt_len=1)
    fresh = ts.open_store(str(root))
    for key in sorted((root / "log").iterdir()):  # every entry, old and new, is of the store's version
        meta = json.loads(pa.ipc.open_file(pa.BufferReader(key.read_bytes())).schema.metadata[b"tracestore.entry"])
        assert meta["format_version"] == version and meta.get("kind", "segment") in ("segment", "results")
    rep = ts.collect_garbage(fresh, now=time.time() + 1e7, force=True)  # no writer runs: force deletes it
    assert rep.deleted_segments == orphan and rep.gc_entries == []
    report = ts.verify(ts.open_store(str(root)))
    assert report.ok and report.orphan_segments == [], report.errors
    check_batch(fresh, ts.open_store(str(root)).reader().read("t3", 0, 4, fmt="numpy"), "t3", 0, 4)
