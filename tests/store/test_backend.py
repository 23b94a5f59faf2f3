"""One backend test suite for every backend (local, memory, S3 on moto). Checks go through the raw accessor
(os / boto3 / the memory dict), not through the backend under test."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.store import race
from tracestore import BackendError, ByteRange, ObjectNotFoundError, open_backend


@pytest.fixture
def pair(location):
    return open_backend(location.url, location.options), location


def test_put_get_roundtrip(pair):
    be, raw = pair
    be.put("a/b/c.bin", b"hello")
    assert raw.read("a/b/c.bin") == b"hello"
    be.put("a/b/c.bin", [b"he", memoryview(b"llo"), bytearray(b"!")])  # gather list, replaces
    assert raw.read("a/b/c.bin") == b"hello!"
    assert be.get("a/b/c.bin") == b"hello!"
    assert be.get_range("a/b/c.bin", 1, 4) == b"ell"
    assert be.get_range("a/b/c.bin", 4, 100) == b"o!"
    assert be.get_ranges([ByteRange("a/b/c.bin", 0, 2), ByteRange("a/b/c.bin", 3, 6)]) == [b"he", b"lo!"]
    with pytest.raises(ObjectNotFoundError):
        be.get("missing")
    with pytest.raises(ObjectNotFoundError):
        be.get_range("missing", 0, 1)
    assert be.get_many(["a/b/c.bin", "missing"]) == [b"hello!", None]


def test_put_many_and_readinto(pair):
    be, raw = pair
    arr = np.arange(1000, dtype=np.int32)
    be.put_many({"x/0": [memoryview(arr).cast("B"), b"tail"], "x/1": b"one"}, atomic=False)
    assert raw.read("x/0") == arr.tobytes() + b"tail" and raw.read("x/1") == b"one"
    out = np.zeros(10, np.int32)
    crc = bytearray(4)
    counts = be.readinto_ranges([(ByteRange("x/0", 40, 84), [memoryview(out).cast("B"), memoryview(crc)])])
    assert counts == [44] and out.tolist() == list(range(10, 20)) and bytes(crc) == arr[20:21].tobytes()
    short = bytearray(10)
    assert be.readinto_ranges([(ByteRange("x/1", 0, 10), [memoryview(short)])]) == [3]


def test_put_if_absent_is_exclusive(pair):
    be, raw = pair
    assert be.put_if_absent("log/1", b"first") is True
    assert be.put_if_absent("log/1", b"second") is False
    assert raw.read("log/1") == b"first"


def test_put_if_absent_race(pair):
    be, raw = pair
    for round_ in range(3):
        key = f"race/key{round_}"
        wins = race(be.put_if_absent, key)
        assert len(wins) == 1 and raw.read(key) == f"writer-{wins[0]}".encode()


def test_list_exists_delete(pair):
    be, raw = pair
    for k in ["p/a", "p/b/c", "q/d", "pp"]:
        raw.write(k, k.encode())
    assert [o.key for o in be.list("p/")] == ["p/a", "p/b/c"]
    assert [o.key for o in be.list("")] == ["p/a", "p/b/c", "pp", "q/d"]
    assert {o.key: o.size for o in be.list("q/")} == {"q/d": 3}
    assert all(o.mtime > 0 for o in be.list(""))
    assert be.exists("p/b/c") and not be.exists("p/b")
    be.delete("p/b/c")
    be.delete("p/b/c")  # absent: ignored
    assert "p/b/c" not in raw.keys() and not be.exists("p/b/c")
    be.delete_many(["p/a", "pp"])
    assert raw.keys() == ["q/d"]
    # a listing sees objects created behind the backend's back (no stale cache)
    raw.write("q/e", b"new")
    assert be.get("q/e") == b"new" and be.get_many(["q/e"]) == [b"new"]
    assert [o.key for o in be.list("q/")] == ["q/d", "q/e"] and be.exists("q/e")


def test_read_only_fsspec_filesystem_refuses_commits(tmp_path):
    import fsspec

    from tracestore.storage._fsspec import FsspecBackend

    fs = fsspec.filesystem("file")
    be = FsspecBackend(fs, str(tmp_path), f"file://{tmp_path}")
    assert be.supports_put_if_absent is False
    with pytest.raises(BackendError):
        be.put_if_absent("x", b"1")
    be.put("y/z", b"1")
    assert be.get("y/z") == b"1" and [o.key for o in be.list("")] == ["y/z"]
