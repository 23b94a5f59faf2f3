"""The rollout's recorded codes beside a store (`tracerl.artifacts.codes`, schemas/ARTIFACTS.md §4): written as
safetensors, the ``.npz`` of older stores read the same way, loaded ahead in the background, and a missing or
damaged object only removes the measurement while a storage failure is raised (never read as "absent")."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import struct

import numpy as np
import pytest

import tracestore as ts
from tracerl.artifacts.codes import AREA, CODES_KEY, RolloutCodes, put_codes

SITES = [ts.Site("s0", 64), ts.Site("s1", 32)]


@dataclasses.dataclass
class Traj:
    result: ts.Result


def _codes(ids, seed=0):
    g = np.random.default_rng(seed)
    lens = {rid: int(g.integers(3, 9)) for rid in ids}
    return {s.name: [g.integers(0, 256, (lens[rid], s.width // 2), dtype=np.uint8) for rid in ids] for s in SITES}


def _trajs(key, ids):
    return [Traj(ts.Result(rid, 0.0, extra={CODES_KEY: key})) for rid in ids]


def test_put_then_get_is_every_array_byte_for_byte(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    ids = ["a", "b", "c"]
    codes = _codes(ids)
    key = put_codes(store, "w0", 7, ids, codes)
    assert key == f"{AREA}/codes/w0/000007.safetensors" and (tmp_path / "s" / key).is_file()
    rc = RolloutCodes(store)
    for i, t in enumerate(_trajs(key, ids)):
        for s in SITES:
            got = rc.get(t, s.name)
            assert got.dtype == np.uint8 and np.array_equal(got, codes[s.name][i])
        assert rc.get(t, "nope") is None
    assert rc.get(Traj(ts.Result("x", 0.0)), "s0") is None  # a result that names no codes


def test_the_object_is_the_safetensors_the_page_describes(tmp_path):
    """ARTIFACTS.md §4, read with the standard library and NumPy only: 8-byte little-endian header length, the
    JSON header (dtype U8, shape, data offsets), the bytes."""
    store = ts.create_store(str(tmp_path / "s"), SITES)
    codes = _codes(["a"])
    key = put_codes(store, "w0", 0, ["a"], codes)
    raw = (tmp_path / "s" / key).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    assert header.pop("__metadata__") == {"format": "tracerl-codes-1"}
    assert set(header) == {"a/s0", "a/s1"}
    for name, h in header.items():
        a, b = h["data_offsets"]
        arr = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.uint8).reshape(h["shape"])
        assert h["dtype"] == "U8" and np.array_equal(arr, codes[name.split("/")[1]][0])


def test_npz_objects_of_older_stores_read_the_same(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    ids = ["a", "b"]
    codes = _codes(ids, seed=1)
    buf = io.BytesIO()
    np.savez(buf, **{f"{rid}/{s}": per[i] for s, per in codes.items() for i, rid in enumerate(ids)})
    store.area(AREA).put("codes/w0/000000.npz", buf.getvalue())
    rc = RolloutCodes(store)
    for i, t in enumerate(_trajs(f"{AREA}/codes/w0/000000.npz", ids)):
        assert np.array_equal(rc.get(t, "s1"), codes["s1"][i])


def test_prefetch_loads_in_the_background_and_keeps_the_step(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    keys, trajs, want = [], [], {}
    for b in range(6):  # more batches than the default cache of 4
        ids = [f"t{b}-{i}" for i in range(2)]
        codes = _codes(ids, seed=b)
        key = put_codes(store, "w0", b, ids, codes)
        keys.append(key)
        trajs += _trajs(key, ids)
        want.update({(rid, s): codes[s][i] for s in codes for i, rid in enumerate(ids)})
    rc = RolloutCodes(store)
    rc.prefetch(trajs)
    try:
        assert rc._pool is not None and rc.keep == 6
        for t in trajs:  # every batch of the step is still cached: none is read twice
            for s in ("s0", "s1"):
                assert np.array_equal(rc.get(t, s), want[(t.result.traj_id, s)])
        assert list(rc._cache) == keys
    finally:
        rc.close()


@pytest.mark.parametrize("damage", ["missing", "truncated", "garbage", "npz-garbage"])
def test_a_missing_or_damaged_object_only_removes_the_measurement(tmp_path, caplog, damage):
    store = ts.create_store(str(tmp_path / "s"), SITES)
    key = put_codes(store, "w0", 0, ["a"], _codes(["a"]))
    path = tmp_path / "s" / key
    raw = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(raw[:-5])
    elif damage == "garbage":
        path.write_bytes(b"\x00" * 40)
    else:
        key = f"{AREA}/codes/w0/000001.npz"
        store.area(AREA).put("codes/w0/000001.npz", b"PK\x03\x04 not a zip")
    before = sorted(p.name for p in (tmp_path / "s").rglob("*"))
    rc = RolloutCodes(store)
    with caplog.at_level(logging.WARNING, logger="tracerl.artifacts.codes"):
        assert rc.get(_trajs(key, ["a"])[0], "s0") is None
    assert ("missing" if damage == "missing" else "unreadable") in caplog.text and key in caplog.text
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == before  # nothing changed


@pytest.mark.s3
def test_a_storage_failure_is_raised_not_read_as_absent(moto_endpoint, s3_bucket, monkeypatch):
    """Behind the fault proxy: a 503 on the codes object's GET is a BackendError where the codes are asked for
    (foreground and prefetched), and the next ask reads it again."""
    from helpers.faults import FaultProxy, no_s3fs_retries

    no_s3fs_retries(monkeypatch)
    name, _client, _opts = s3_bucket
    with FaultProxy(moto_endpoint) as proxy:
        store = ts.create_store(f"s3://{name}/c", SITES, storage_options=proxy.storage_options(),
                                retry=ts.RetryPolicy(attempts=1))
        codes = _codes(["a"])
        key = put_codes(store, "w0", 0, ["a"], codes)
        t = _trajs(key, ["a"])[0]
        for prefetch in (False, True):
            rc = RolloutCodes(store)
            proxy.add("error", "GET", r"/codes/w0/000000\.safetensors", times=None, code="ServiceUnavailable")
            if prefetch:
                rc.prefetch([t])
            with pytest.raises(ts.BackendError):
                rc.get(t, "s0")
            proxy.clear()
            assert np.array_equal(rc.get(t, "s0"), codes["s0"][0])
            rc.close()


@pytest.mark.parametrize("bad", [42, ["audit/codes/w0/000000.safetensors"], "log/000000000001.arrow",
                                 "audit/codes/../../tracestore.json", "audit/codes/w0//x.safetensors"])
def test_a_result_that_names_no_codes_object_only_removes_the_measurement(tmp_path, caplog, bad):
    """A damaged ``extra[CODES_KEY]`` (not a string, outside audit/codes/, a name the store refuses) reads nothing
    else and stops nothing: no codes for that trajectory, one warning, the store unchanged."""
    store = ts.create_store(str(tmp_path / "s"), SITES)
    put_codes(store, "w0", 0, ["a"], _codes(["a"]))
    before = sorted(p.name for p in (tmp_path / "s").rglob("*"))
    rc = RolloutCodes(store)
    t = Traj(ts.Result("a", 0.0, extra={CODES_KEY: bad}))
    with caplog.at_level(logging.WARNING, logger="tracerl.artifacts.codes"):
        assert rc.get(t, "s0") is None and rc.get(t, "s1") is None
        rc.prefetch([t])
        assert rc.get(t, "s0") is None
    rc.close()
    assert len([r for r in caplog.records if "no code agreement" in r.getMessage()]) == 1
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == before
