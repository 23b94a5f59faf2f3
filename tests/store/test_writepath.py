"""The write path's checksums computed while rows are buffered: writes of any size, across chunk and segment
boundaries, and flushes of partial segments, produce the same stored bytes as checksums computed at flush."""

from __future__ import annotations

import pytest

import tracestore as ts
import tracestore._buffer as buffer_mod
from helpers.store import check_batch, rows

SITES = [ts.Site("s0", 64), ts.Site("s1", 128, fp4_format="mxfp4")]


def _write(url: str, *, feature_chunk: int = 0):
    store = ts.create_store(url, SITES, moe_layers=["m0", "m1"], top_k=2, num_experts=8, chunk_rows=64,
                            feature_chunk=feature_chunk)
    # ~1,100 rows per buffer: full segments, chunk-crossing writes, then a partial segment at close
    with store.writer("w", commit_bytes=1100 * 44, commit_interval_s=0) as w:
        pos = {"a": 0, "b": 0}
        for n in (7, 57, 64, 1, 300, 129, 1000, 63, 65, 2):
            for traj in ("a", "b"):
                w.write(traj, pos[traj], **rows(store, traj, pos[traj], pos[traj] + n))
                pos[traj] += n
        w.flush()
        w.write("c", 0, **rows(store, "c", 0, 10))  # a segment smaller than one chunk
    return store, pos


@pytest.mark.parametrize("feature_chunk", [0, 32])
def test_buffered_checksums_match(tmp_path, monkeypatch, feature_chunk):
    store, pos = _write(str(tmp_path / "pre"), feature_chunk=feature_chunk)
    report = ts.verify(store)
    assert report.ok, report.errors
    r = store.reader()
    for traj, n in pos.items():
        check_batch(store, r.read(traj), traj, 0, n)
    check_batch(store, r.read("c"), "c", 0, 10)

    # the same writes with every checksum computed at flush store byte-identical shards
    monkeypatch.setattr(buffer_mod.Stage, "chunk_crcs", lambda self, name, r, n: ([], 0))
    plain, _ = _write(str(tmp_path / "flush"), feature_chunk=feature_chunk)

    def shards(st):
        out = {}
        for e in st.reader().entries:
            for o in st.backend.list(e.segment.path + "/"):
                if not o.key.endswith("zarr.json"):
                    out[(e.seq, o.key[len(e.segment.path):])] = st.backend.get(o.key)
        return out

    a, b = shards(store), shards(plain)
    assert a.keys() == b.keys() and a == b
