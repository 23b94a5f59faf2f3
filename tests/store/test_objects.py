"""Application areas beside a store (``tracestore.objects``): one suite for every backend (local, memory, S3 on
moto), checked through the raw accessor rather than the API under test; the same calls through the
fault-injecting proxy (throttling, resets, requests applied but answered with an error, an endpoint that is down);
and maintenance (gc, verify, compact, info) leaving every application area alone (FORMAT §2)."""

from __future__ import annotations

import time

import pytest

import tracestore as ts
from helpers.store import race, rows

SITES = [ts.Site("s0", 64)]
FAST = ts.RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=10)


@pytest.fixture
def area(location):
    a = ts.open_area(location.url, "weights", storage_options=location.options)
    yield a, location
    a.close()


# ------------------------------------------------------------------ the shared suite
def test_put_get_roundtrip(area):
    a, raw = area
    a.put("000000000007.safetensors", b"blob")
    assert raw.read("weights/000000000007.safetensors") == b"blob"
    a.put("000000000007.safetensors", [b"bl", memoryview(b"o"), bytearray(b"b!")])  # gather list, replaces
    assert raw.read("weights/000000000007.safetensors") == b"blob!" and a.get("000000000007.safetensors") == b"blob!"
    a.put("run1/report.html", b"<html>")
    assert raw.read("weights/run1/report.html") == b"<html>"
    assert a.key("run1/report.html") == "weights/run1/report.html"
    assert a.describe("x.json") == f"{raw.url}/weights/x.json"
    with pytest.raises(ts.ObjectNotFoundError):
        a.get("missing.json")


def test_read_into_fills_the_buffer_straight_from_the_object(area):
    a, raw = area
    data = bytes(range(256)) * 41  # 10,496 bytes
    raw.write("weights/blob.safetensors", data)
    buf = bytearray(len(data) + 7)  # longer than the object: fewer bytes read, the rest untouched
    buf[-7:] = b"x" * 7
    assert a.read_into("blob.safetensors", buf) == len(data)
    assert bytes(buf[:len(data)]) == data and buf[-7:] == b"x" * 7
    head = memoryview(bytearray(100))
    assert a.read_into("blob.safetensors", head) == 100 and bytes(head) == data[:100]
    with pytest.raises(ts.ObjectNotFoundError):
        a.read_into("missing.safetensors", bytearray(4))
    with pytest.raises(ts.InvalidIdError):
        a.read_into("../log/x", bytearray(4))
    for bad in (b"read-only", "text", 7):
        with pytest.raises(ts.OptionTypeError, match="writable"):
            a.read_into("blob.safetensors", bad)


def test_put_if_absent_is_exclusive(area):
    a, raw = area
    assert a.put_if_absent("000000000001.json", b"first") is True
    assert a.put_if_absent("000000000001.json", b"second") is False
    assert raw.read("weights/000000000001.json") == b"first"
    assert a.put_if_absent("000000000002.json", [b"par", b"ts"]) is True
    assert raw.read("weights/000000000002.json") == b"parts"
    for name in ("race/0.json", "race/1.json", "race/2.json"):  # 8 writers at once: one wins
        wins = race(a.put_if_absent, name)
        assert len(wins) == 1 and raw.read(f"weights/{name}") == f"writer-{wins[0]}".encode()


def test_list_exists_delete(area):
    a, raw = area
    for k in ["weights/000000000001.json", "weights/000000000001.safetensors", "weights/sub/x", "weightsx/y",
              "checkpoints/000000000001.json", "weights/.000000000002.json.deadbeef.partial"]:
        raw.write(k, k.encode())
    listed = a.list()
    assert [o.key for o in listed] == ["000000000001.json", "000000000001.safetensors", "sub/x"]
    assert {o.key: o.size for o in listed}["sub/x"] == len("weights/sub/x") and all(o.mtime > 0 for o in listed)
    assert [o.key for o in a.list("000000000001.")] == ["000000000001.json", "000000000001.safetensors"]
    assert [o.key for o in a.list("sub/")] == ["sub/x"] and a.list("nothing") == []
    assert a.exists("sub/x") and not a.exists("sub") and not a.exists("000000000002.json")
    a.delete("sub/x")
    a.delete("sub/x")  # absent: fine
    assert "weights/sub/x" not in raw.keys()
    a.delete_many(["000000000001.json", "000000000001.safetensors", "absent.json"])
    assert sorted(k for k in raw.keys() if not k.endswith(".partial")) == ["checkpoints/000000000001.json",
                                                                           "weightsx/y"]
    raw.write("weights/new.json", b"n")  # a listing sees objects created behind the area's back (no cache)
    assert [o.key for o in a.list()] == ["new.json"] and a.exists("new.json") and a.get("new.json") == b"n"


@pytest.mark.parametrize("name", ["", "/abs", "a//b", "a/", "a/../b", "..", ".", "a/./b", "x.json.partial",
                                  "a\\b", "nul\x00", "tab\tname", "x" * 513, 7, None])
def test_bad_object_names_are_refused_before_any_io(area, name):
    a, raw = area
    before = raw.keys()
    for call in (lambda: a.put(name, b"x"), lambda: a.put_if_absent(name, b"x"), lambda: a.get(name),
                 lambda: a.exists(name), lambda: a.delete(name), lambda: a.delete_many(["ok.json", name]),
                 lambda: a.key(name)):
        with pytest.raises(ts.InvalidIdError) as e:
            call()
        assert isinstance(e.value, ValueError)
    assert raw.keys() == before


@pytest.mark.parametrize("area_name", ["log", "data", "index", "tracestore.json", "", "Weights", "1st", "a/b",
                                       "a" * 65, None])
def test_bad_area_names_are_refused(location, area_name):
    with pytest.raises(ts.InvalidIdError, match="area name"):
        ts.open_area(location.url, area_name, storage_options=location.options)
    assert location.keys() == []


def test_store_area_shares_the_store_backend(location):
    store = ts.create_store(location.url, SITES, storage_options=location.options)
    assert ts.RESERVED_AREAS == ("weights", "checkpoints", "audit", "quantizer")
    for name in ts.RESERVED_AREAS:
        with store.area(name) as a:
            assert (a.url, a.area) == (store.url, name)
            a.put("x.json", name.encode())
    with pytest.raises(ts.InvalidIdError):
        store.area("log")
    # closing an area of the store left the store usable
    with store.writer(commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 4))
    assert store.reader().traj_ids() == ["t"]
    assert [location.read(f"{n}/x.json") for n in ts.RESERVED_AREAS] == [n.encode() for n in ts.RESERVED_AREAS]
    with ts.open_area(location.url, "checkpoints", storage_options=location.options) as other:
        assert other.get("x.json") == b"checkpoints"


# ------------------------------------------------------------------ maintenance leaves the areas alone
def test_gc_verify_compact_info_leave_application_areas_alone(location):
    store = ts.create_store(location.url, SITES, storage_options=location.options, gc_grace_s=60)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 8))
    store_keys = set(location.keys())
    # what an application keeps beside the store, including keys that look like store garbage
    app = {"weights/000000000001.json": b"{}", "weights/.000000000002.json.0123abcd.partial": b"half",
           "checkpoints/data/w/00000000-0123456789ab/zarr.json": b"{}", "audit/log/000000000099.arrow": b"junk",
           "audit/index/000000000005.parquet": b"junk", "other-app/x.partial": b"stale"}
    for key, data in app.items():
        location.write(key, data)
    if hasattr(location, "set_mtime"):
        for key in app:
            location.set_mtime(key, time.time() - 1e6)  # older than any grace period
    rep = ts.verify(store)
    assert rep.ok, rep.errors
    assert rep.orphan_segments == [] and rep.partial_objects == []
    gc = ts.collect_garbage(store, now=time.time() + 1e7)
    assert gc.deleted_objects == 0 and gc.deleted_segments == [] and gc.young_segments == []
    assert ts.compact(store) == 1
    d = ts.info(store)
    assert d["bytes"]["other"] == 0 and d["bytes"]["partial"] == 0
    assert d["bytes"]["total"] == sum(len(location.read(k)) for k in location.keys() if k not in app)
    assert {k: location.read(k) for k in app} == app  # nothing in an area was changed or deleted
    assert set(location.keys()) - set(app) == store_keys | {"index/000000000001.parquet"}


def test_gc_deleting_garbage_never_touches_the_reserved_areas(location):
    """Every area tracerl uses (FORMAT §2: weights/, checkpoints/, audit/, quantizer/), holding keys that look like
    old store garbage, while gc announces and deletes a real orphan segment: only the orphan goes."""
    assert set(ts.RESERVED_AREAS) == {"weights", "checkpoints", "audit", "quantizer"}
    store = ts.create_store(location.url, SITES, storage_options=location.options, gc_grace_s=60)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 8))
    orphan = store.writer("crashed", commit_interval_s=0)
    orphan.write("x", 0, **rows(store, "x", 0, 8))
    stage = orphan._buffer.take()
    orphan._committer.write_segment(stage)  # written, never committed
    app = {}
    for area in ts.RESERVED_AREAS:
        app.update({f"{area}/data/w/00000000-0123456789ab/zarr.json": b"{}", f"{area}/.x.0123abcd.partial": b"half",
                    f"{area}/log/000000000000.arrow": b"junk", f"{area}/000000000001/w.json": b"{}"})
    for key, data in app.items():
        location.write(key, data)
    if hasattr(location, "set_mtime"):
        for key in app:
            location.set_mtime(key, time.time() - 1e6)
    rep = ts.collect_garbage(store, now=time.time() + 1e7)
    assert rep.deleted_segments == [stage.segment.path] and rep.gc_entries == [1]
    assert {k: location.read(k) for k in app} == app
    assert not any(k.startswith(stage.segment.path) for k in location.keys())
    assert ts.verify(store).ok


# ------------------------------------------------------------------ S3 through the fault-injecting proxy
@pytest.fixture
def faulty(proxy, s3_bucket):
    """(area through the proxy, raw location without it)."""
    from helpers.store import RawS3

    name, client, options = s3_bucket
    a = ts.open_area(f"s3://{name}/run", "weights", storage_options=proxy.storage_options(), retry=FAST)
    yield a, RawS3(name, "run", client, options)
    a.close()


@pytest.mark.s3
@pytest.mark.parametrize("action", ["apply_error", "apply_reset"])
def test_put_if_absent_applied_but_answered_with_an_error_is_ours(proxy, faulty, action):
    a, raw = faulty
    proxy.add(action, "PUT", r"/weights/000000000003\.json$", code="InternalError")
    assert a.put_if_absent("000000000003.json", b"sidecar") is True  # the retry got 412; read back: ours
    assert proxy.stats[action] == 1 and raw.read("weights/000000000003.json") == b"sidecar"
    # another writer's object is not ours, even when the answer to our request was lost
    proxy.add(action, "PUT", r"/weights/000000000003\.json$", code="InternalError")
    assert a.put_if_absent("000000000003.json", b"another sidecar") is False
    assert raw.read("weights/000000000003.json") == b"sidecar"


@pytest.mark.s3
def test_put_if_absent_whose_outcome_cannot_be_read_back_raises(proxy, faulty):
    a, raw = faulty
    proxy.add("error", "PUT", r"/weights/x\.json$", times=None)  # never applied
    proxy.add("error", "GET", r"/weights/x\.json$", times=None)
    with pytest.raises(ts.ThrottledError, match="x.json"):
        a.put_if_absent("x.json", b"v")
    assert "weights/x.json" not in raw.keys()
    proxy.clear()
    assert a.put_if_absent("x.json", b"v") is True


@pytest.mark.s3
def test_throttling_and_resets_are_retried(proxy, faulty):
    a, raw = faulty
    proxy.add("error", "PUT", r"/weights/", times=2)  # 503 SlowDown twice
    a.put("blob.safetensors", b"weights")
    proxy.add("reset", "GET", r"/weights/", times=2)
    assert a.get("blob.safetensors") == b"weights"
    proxy.add("error", "HEAD", r"/weights/", times=2, code="InternalError")
    assert a.exists("blob.safetensors")
    proxy.add("reset", "GET", r"list-type|prefix=", times=1)
    assert [o.key for o in a.list()] == ["blob.safetensors"]
    assert proxy.stats["error"] >= 4 and proxy.stats["reset"] >= 2
    assert raw.read("weights/blob.safetensors") == b"weights"


@pytest.mark.s3
def test_a_failing_storage_is_never_read_as_absent(proxy, faulty):
    a, raw = faulty
    raw.write("weights/there.json", b"1")
    proxy.add("error", "HEAD", r"/weights/there\.json$", times=None)
    with pytest.raises(ts.ThrottledError):
        a.exists("there.json")
    proxy.add("error", "GET", r"/weights/there\.json$", times=None, code="InternalError")
    with pytest.raises(ts.TransientStorageError) as e:
        a.get("there.json")
    assert not isinstance(e.value, ts.ObjectNotFoundError)
    with pytest.raises(ts.TransientStorageError) as e:
        a.read_into("there.json", bytearray(1))
    assert not isinstance(e.value, ts.ObjectNotFoundError)
    proxy.clear()
    proxy.down()
    for call in (lambda: a.get("there.json"), lambda: a.exists("there.json"), lambda: a.list(),
                 lambda: a.read_into("there.json", bytearray(1)),
                 lambda: a.put_if_absent("new.json", b"x"), lambda: a.delete("there.json")):
        with pytest.raises(ts.EndpointError):
            call()
    proxy.up()
    assert a.get("there.json") == b"1" and [o.key for o in a.list()] == ["there.json"]
