"""The read path at sizes where its optimizations engage: requests split into pieces (~1 MiB of whole chunks),
each checked on the reading thread as soon as the backend has filled it, and output arenas recycled once nothing
references them."""

from __future__ import annotations

import numpy as np
import pytest

import tracestore as ts
from helpers.store import check_batch, rows

SITES = [ts.Site(f"s{i}", 4096) for i in range(4)]  # 3 KiB of hints + scales per token
T = 1536  # ~4.6 MiB of outputs per read: above the arena threshold


@pytest.fixture
def store(location):
    st = ts.create_store(location.url, SITES, moe_layers=["m0", "m1"], top_k=2, num_experts=8, chunk_rows=256,
                         storage_options=location.options)
    with st.writer("w", commit_interval_s=0) as w:
        for traj in ("a", "b"):
            w.write(traj, 0, **rows(st, traj, 0, T))
    return st


def test_large_reads_are_correct(store):
    r = store.reader()
    for traj in ("a", "b"):
        check_batch(store, r.read(traj), traj, 0, T)
        check_batch(store, r.read(traj, 100, T - 77), traj, 100, T - 77)  # partial first/last chunks
        check_batch(store, r.read(traj, 0, T, features=(1024, 2048)), traj, 0, T, features=(1024, 2048))


@pytest.mark.parametrize("where", [0.1, 0.5, 0.95])
def test_flipped_byte_in_any_piece(location, store, where):
    shard = next(k for k in location.keys() if "/hints." in k and not k.endswith("zarr.json"))
    size = len(location.read(shard))
    location.flip(shard, int(size * where))
    with pytest.raises(ts.IntegrityError) as e:
        for traj in ("a", "b"):
            store.reader().read(traj)
    msg = str(e.value)
    assert "crc32c" in msg and shard in msg and "trajectory" in msg


def test_output_arenas_are_reused_only_when_free(store):
    from tracestore import batch as batch_mod

    batch_mod._pool.arenas = []  # this thread's pool, left over from other tests
    r = store.reader()
    first = r.read("a")
    base = id(first.hints["s0"].base)  # an id: a reference would keep the arena busy
    assert first.hints["s0"].ctypes.data % 4096 == 0  # page-aligned outputs
    kept = {k: v.copy() for k, v in first.hints.items()}
    second = r.read("b")  # ``first`` is alive: its memory must not be reused
    assert id(second.hints["s0"].base) != base
    for k, v in kept.items():
        assert np.array_equal(first.hints[k], v)
    check_batch(store, first, "a", 0, T)
    view = first.scales["s3"][5:9]  # a view keeps the arena alive as well
    del first, kept
    third = r.read("b")
    assert id(third.hints["s0"].base) != base
    assert id(view.base) == base
    del view
    fourth = r.read("a")  # now nothing references the arena of the first read
    check_batch(store, fourth, "a", 0, T)
    check_batch(store, third, "b", 0, T)
    assert id(fourth.hints["s0"].base) == base  # recycled (same thread, same size, nothing references it)


def test_torch_and_arrow_outputs_survive_later_reads(store):
    pytest.importorskip("torch")
    r = store.reader()
    arrow = r.read("a", fmt="arrow")
    ref = r.read("a")
    kept = {k: v.copy() for k, v in ref.hints.items()}
    del ref
    for _ in range(3):
        r.read("b")
    for k, v in kept.items():
        got = np.frombuffer(arrow.hints[k].buffers()[1], np.uint8)[: v.size].reshape(v.shape)
        assert np.array_equal(got, v)
