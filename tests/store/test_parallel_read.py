"""Local reads shared by several threads (`LocalBackend.read_threads`): the same bytes as one thread, and the same
typed errors for a corrupt or missing object (the first failing request's), with nothing left half-done."""

from __future__ import annotations

import os

import numpy as np
import pytest

import tracestore as ts
from helpers.store import check_batch, rows

SITES = [ts.Site("s0", 512), ts.Site("s1", 1024)]
TRAJS = {f"t{j}": 300 + 97 * j for j in range(6)}


def _store(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES, moe_layers=["l0", "l1"], top_k=2, num_experts=8,
                            chunk_rows=16)
    with store.writer("w", commit_bytes=64 << 10) as w:
        for traj, n in TRAJS.items():
            for a in range(0, n, 50):
                w.write(traj, a, **rows(store, traj, a, min(n, a + 50)))
    return store


def _threads(store, n: int, threshold: int) -> None:
    store.backend.read_threads = n  # instance attributes: this store only
    store.backend.parallel_read_bytes = threshold


def _read_all(store) -> dict:
    reader = store.reader()
    return {t: reader.read(t, 0, n) for t, n in TRAJS.items()}


def test_parallel_reads_equal_one_thread(tmp_path):
    store = _store(tmp_path)
    _threads(store, 1, 1 << 40)
    serial = _read_all(store)
    calls = []
    original = type(store.backend)._read_run

    def counting(self, requests, ks, *a):
        calls.append(len(ks))
        return original(self, requests, ks, *a)

    type(store.backend)._read_run = counting
    try:
        _threads(store, 4, 1)
        parallel = _read_all(store)
    finally:
        type(store.backend)._read_run = original
    assert len(calls) > len(TRAJS)  # the reads really were split across threads
    for t, n in TRAJS.items():
        check_batch(store, parallel[t], t, 0, n)
        for name in ("token_ids", "logprobs"):
            assert np.array_equal(getattr(parallel[t], name), getattr(serial[t], name))
        for s in SITES:
            assert np.array_equal(parallel[t].hints[s.name], serial[t].hints[s.name])
            assert np.array_equal(parallel[t].scales[s.name], serial[t].scales[s.name])


@pytest.mark.parametrize("damage", ["flip", "delete", "flip-all"])
def test_parallel_reads_fail_like_one_thread(tmp_path, damage):
    """One damaged object, or every data object (then every thread's run fails, and the error raised must still
    be the one of the earliest request, as one thread reading in order meets it)."""
    store = _store(tmp_path)
    data_dir = tmp_path / "s" / "data"
    segs = sorted(p for p in data_dir.rglob("*") if p.is_file() and "hints" in str(p))
    if damage == "flip-all":
        victims = [p for p in data_dir.rglob("*") if p.is_file() and p.name != "zarr.json"]
    else:
        victims = [max(segs, key=lambda p: p.stat().st_size)]
    for victim in victims:
        if damage.startswith("flip"):
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0x10
            victim.write_bytes(bytes(data))
        else:
            os.unlink(victim)
    errors = []
    for n, threshold in ((1, 1 << 40), (4, 1)):
        _threads(store, n, threshold)
        reader = store.reader()
        with pytest.raises(ts.TraceStoreError) as e:
            for t, n_tok in TRAJS.items():
                reader.read(t, 0, n_tok)
        errors.append(e.value)
    assert type(errors[0]) is type(errors[1])
    assert isinstance(errors[1], ts.IntegrityError if damage == "flip" else (ts.IntegrityError, ts.ObjectNotFoundError))
    assert str(errors[0]) == str(errors[1])  # the same (first failing) request is named


@pytest.mark.parametrize("sizes, n", [([5] * 10, 2), ([1, 1, 100, 1], 3), ([7], 4), ([0, 0, 3], 2), (list(range(1, 40)), 4)])
def test_even_runs_tile_the_requests_in_order(sizes, n):
    from tracestore.storage._local import even_runs

    runs = even_runs(sizes, n)
    assert 1 <= len(runs) <= n and all(len(r) for r in runs)
    assert [k for r in runs for k in r] == list(range(len(sizes)))  # contiguous, in order, every item once
    if len(runs) == n:
        assert max(sum(sizes[k] for k in r) for r in runs) <= sum(sizes) / n + max(sizes)
