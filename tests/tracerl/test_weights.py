"""Policy-version publishing (`tracerl.artifacts.weights`) on every backend (local, memory, S3 through moto): round trip,
immutability, corruption -> typed errors, and readers that never see a partial version."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

import tracestore as ts
from helpers import artifacts
from tracerl.artifacts import weights as W
from tracerl.errors import ConfigError


def _sd(v: float, n: int = 64) -> dict[str, torch.Tensor]:
    return {"a.weight": torch.full((n, 16), float(v)), "b.bias": torch.arange(n, dtype=torch.bfloat16) + v,
            "c.idx": torch.tensor([int(v), 7], dtype=torch.int64)}


class _Toy(torch.nn.Module):
    def __init__(self, n: int = 64):
        super().__init__()
        self.a = torch.nn.Linear(16, n, bias=False)
        self.b = torch.nn.Module()
        self.b.bias = torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16))
        self.c = torch.nn.Module()
        self.c.register_buffer("idx", torch.zeros(2, dtype=torch.int64))


def _blob_key(location, version: int) -> str:
    return artifacts.fields(location.read(W.sidecar_key(version)))["key"]


def test_round_trip(location):
    url, opts = location.url, location.options
    assert W.latest_version(url, storage_options=opts) is None
    key = W.publish(url, 0, _sd(0), {"qat_mode": "fp4_hints", "cursor": {"log_end": 3}}, step=0,
                    storage_options=opts)
    assert key == "weights/000000000000.json"
    W.publish(url, 5, _sd(5), step=50, parent_version=0, storage_options=opts)  # versions need not be consecutive
    assert W.list_versions(url, storage_options=opts) == [0, 5]
    assert W.latest_version(url, storage_options=opts) == 5
    sd, side = W.load_state_dict(url, 0, storage_options=opts)
    for k, v in _sd(0).items():
        assert sd[k].dtype == v.dtype and torch.equal(sd[k], v)
    assert side["meta"] == {"qat_mode": "fp4_hints", "cursor": {"log_end": 3}} and side["step"] == 0
    model = _Toy()
    side = W.load(url, None, model, storage_options=opts)  # None: the latest
    assert side["version"] == 5 and side["parent_version"] == 0 and side["step"] == 50
    assert torch.equal(model.a.weight, torch.full((64, 16), 5.0)) and model.c.idx.tolist() == [5, 7]
    assert W.read_meta(url, storage_options=opts)["version"] == 5
    # exactly two objects per version: the tensors under their hash, the sidecar
    keys = [k for k in location.keys() if k.startswith("weights/")]
    assert sorted(keys) == sorted([_blob_key(location, 0), "weights/000000000000.json",
                                   _blob_key(location, 5), "weights/000000000005.json"])


def test_versions_are_immutable(location):
    url, opts = location.url, location.options
    W.publish(url, 1, _sd(1), storage_options=opts)
    before = location.snapshot()
    with pytest.raises(W.VersionExistsError, match="already published"):
        W.publish(url, 1, _sd(2), storage_options=opts)
    assert location.snapshot() == before
    assert torch.equal(W.load_state_dict(url, 1, storage_options=opts)[0]["a.weight"], _sd(1)["a.weight"])


def test_missing_versions(location):
    url, opts = location.url, location.options
    with pytest.raises(W.VersionNotFoundError, match="no policy version has been published"):
        W.load(url, None, _Toy(), storage_options=opts)
    W.publish(url, 2, _sd(2), storage_options=opts)
    with pytest.raises(W.VersionNotFoundError, match="no policy version 3"):
        W.load_state_dict(url, 3, storage_options=opts)
    assert isinstance(W.VersionNotFoundError("x"), LookupError)


def test_uncommitted_blob_is_invisible(location):
    """A publisher killed after writing the tensors but before the sidecar leaves nothing a reader sees."""
    url, opts = location.url, location.options
    W.publish(url, 0, _sd(0), storage_options=opts)
    location.write("weights/000000000001-0123456789abcdef.safetensors", b"half a publish")
    assert W.latest_version(url, storage_options=opts) == 0
    W.publish(url, 1, _sd(1), storage_options=opts)  # the version can still be published
    assert torch.equal(W.load_state_dict(url, 1, storage_options=opts)[0]["a.weight"], _sd(1)["a.weight"])


def test_loaded_tensors_are_views_of_one_buffer_and_writable(location):
    """load_state_dict reads the blob once into one buffer and hands out views of it (no second copy): equal to
    what was published, writable, and a write to one changes no other tensor."""
    url, opts = location.url, location.options
    sd = _sd(3)
    W.publish(url, 0, sd, storage_options=opts)
    got, _ = W.load_state_dict(url, 0, storage_options=opts)
    assert got.keys() == sd.keys() and all(torch.equal(got[k], sd[k]) for k in sd)
    assert len({t.untyped_storage().data_ptr() for t in got.values() if t.numel()}) == 1
    before = {k: v.clone() for k, v in got.items()}
    first = next(k for k in got if got[k].numel())
    got[first].add_(1)
    assert all(torch.equal(got[k], before[k]) for k in got if k != first)


def test_a_blob_longer_than_its_commit_says_is_an_integrity_error(location):
    url, opts = location.url, location.options
    W.publish(url, 0, _sd(0), storage_options=opts)
    key = _blob_key(location, 0)
    location.write(key, location.read(key) + b"\0")
    with pytest.raises(W.WeightsIntegrityError, match="more than"):
        W.load_state_dict(url, 0, storage_options=opts)


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete"])
def test_corrupt_tensors_raise_integrity_error(location, damage):
    url, opts = location.url, location.options
    W.publish(url, 0, _sd(0), storage_options=opts)
    key = _blob_key(location, 0)
    data = location.read(key)
    if damage == "flip":
        location.flip(key, len(data) - 3)  # inside the last tensor's bytes: still a valid safetensors file
    elif damage == "truncate":
        location.write(key, data[:-10])
    else:
        location.delete(key)
    model = _Toy()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(W.WeightsIntegrityError) as e:
        W.load(url, 0, model, storage_options=opts)
    assert isinstance(e.value, ts.IntegrityError)  # one except clause catches store and weights corruption
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())  # nothing was loaded


@pytest.mark.parametrize("edit", ["garbage", "other-kind", "other-version", "wrong-checksum", "bad-checksum",
                                  "bool-bytes", "format", "flipped-digit", "fields-checksum"])
def test_corrupt_sidecar(location, edit):
    """Fields that describe something else (re-checksummed, as a buggy writer would leave them) and fields changed
    after they were written (a flipped digit in ``step`` was read as is before format 3) are integrity errors."""
    url, opts = location.url, location.options
    W.publish(url, 0, _sd(0), step=12, storage_options=opts)
    key = W.sidecar_key(0)
    raw = location.read(key)
    side = artifacts.fields(raw)
    kind = W.KIND
    if edit == "garbage":
        location.write(key, b"\xff{not json")
    elif edit == "flipped-digit":
        location.write(key, raw.replace(b'\\"step\\": 12', b'\\"step\\": 13'))
        assert location.read(key) != raw
    elif edit == "fields-checksum":
        location.write(key, artifacts.wrap(kind, side, crc="0" * 8))
    else:
        if edit == "other-kind":
            kind = "something.else"
        side.update({"other-kind": {}, "other-version": {"version": 1},
                     "wrong-checksum": {"crc32c": "0" * 8}, "bad-checksum": {"crc32c": "XYZ"},
                     "bool-bytes": {"bytes": True}, "format": {}}[edit])
        location.write(key, artifacts.wrap(kind, side, format_version=99 if edit == "format" else 3))
    err = ts.SchemaVersionError if edit == "format" else W.WeightsIntegrityError
    with pytest.raises(err):
        W.load_state_dict(url, 0, storage_options=opts)


def test_concurrent_reader_never_sees_a_partial_version(location):
    """A publisher thread commits versions 0..K of 1 MiB tensors whose values equal the version while a reader
    polls latest_version and loads it: every load verifies and holds exactly its version's values."""
    url, opts = location.url, location.options
    k_last = 12
    errors: list[BaseException] = []
    seen: list[int] = []
    done = threading.Event()

    def publisher():
        try:
            for v in range(k_last + 1):
                W.publish(url, v, {"w": torch.full((256, 1024), float(v))}, storage_options=opts)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors.append(e)
        finally:
            done.set()

    def reader():
        try:
            while True:
                finished = done.is_set()
                v = W.latest_version(url, storage_options=opts)
                if v is not None:
                    sd, side = W.load_state_dict(url, v, storage_options=opts)
                    assert side["version"] == v and bool((sd["w"] == float(v)).all()), v
                    seen.append(v)
                if finished:
                    return
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=publisher), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert seen and seen[-1] == k_last and seen == sorted(seen)


def test_racing_publishers_one_wins(location):
    url, opts = location.url, location.options
    results: dict[int, str] = {}
    barrier = threading.Barrier(4)

    def go(i):
        barrier.wait()
        try:
            W.publish(url, 9, _sd(100 + i), storage_options=opts)
            results[i] = "ok"
        except W.VersionExistsError:
            results[i] = "exists"

    threads = [threading.Thread(target=go, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in results.items() if r == "ok"]
    assert len(results) == 4 and len(winners) == 1
    sd, _ = W.load_state_dict(url, 9, storage_options=opts)
    assert torch.equal(sd["a.weight"], _sd(100 + winners[0])["a.weight"])  # the committed blob is the winner's


def test_load_if_newer(tmp_path):
    url = str(tmp_path / "store")
    model = _Toy()
    assert W.load_if_newer(url, model, None) is None
    W.publish(url, 0, _sd(0))
    assert W.load_if_newer(url, model, None)["version"] == 0
    assert W.load_if_newer(url, model, 0) is None
    W.publish(url, 1, _sd(1))
    assert W.load_if_newer(url, model, 0)["version"] == 1 and model.c.idx.tolist() == [1, 7]


def test_model_mismatch_loads_nothing(tmp_path):
    url = str(tmp_path / "store")
    W.publish(url, 0, _sd(0, n=32))
    model = _Toy(n=64)
    before = model.a.weight.detach().clone()
    with pytest.raises(ConfigError, match="shape mismatches"):
        W.load(url, 0, model)
    assert torch.equal(model.a.weight, before)
    W.publish(url, 1, {"a.weight": torch.zeros(64, 16)})
    with pytest.raises(ConfigError, match="missing"):
        W.load(url, 1, model)


def test_bad_arguments(tmp_path):
    url = str(tmp_path / "store")
    for bad in (-1, 1.0, True, "3", 10**12):
        with pytest.raises(ConfigError, match="policy version"):
            W.publish(url, bad, _sd(0))
    with pytest.raises(ConfigError, match="JSON"):
        W.publish(url, 0, _sd(0), {"x": object()})
    with pytest.raises(ConfigError, match="only tensors"):
        W.publish(url, 0, {"a": [1, 2]})
    shared = torch.zeros(4, 4)
    with pytest.raises(ConfigError, match="safetensors"):
        W.publish(url, 0, {"a": shared, "b": shared})
    assert W.latest_version(url) is None  # nothing was committed by the refused calls


def test_tiny_moe_model_round_trip(tmp_path):
    """The demo's model family: a bf16 Qwen3-MoE state dict comes back bit for bit into another instance."""
    from tracerl.policy import TinyMoESpec, build_model

    spec = TinyMoESpec(num_layers=2, vocab_size=64)
    src, dst = build_model(spec, seed=1), build_model(spec, seed=2)
    url = str(tmp_path / "store")
    W.publish(url, 0, src.state_dict(), {"spec": "tiny"})
    W.load(url, 0, dst)
    for (k, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items()):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), k


def test_format_1_versions_still_load(location):
    """A version published by format 1 (sha256 in the sidecar and the key) loads and verifies; a flipped byte in
    its blob is still caught."""
    import hashlib

    from safetensors.torch import save  # what format-1 publishers wrote with

    url, opts = location.url, location.options
    blob = save(_sd(0), metadata={"tracerl.version": "0"})
    sha = hashlib.sha256(blob).hexdigest()
    key = f"{W.WEIGHTS_PREFIX}{0:012d}-{sha[:16]}.safetensors"
    side = {"kind": W.KIND, "format_version": 1, "version": 0, "key": key, "sha256": sha, "bytes": len(blob),
            "created_unix": 0.0, "step": None, "parent_version": None, "tensors": 1, "meta": {}}
    location.write(key, blob)
    location.write(W.sidecar_key(0), json.dumps(side).encode())
    tensors, got = W.load_state_dict(url, 0, storage_options=opts)
    assert got["format_version"] == 1 and all(torch.equal(tensors[k], v) for k, v in _sd(0).items())
    location.flip(key, len(blob) - 3)
    with pytest.raises(W.WeightsIntegrityError, match="sha256"):
        W.load_state_dict(url, 0, storage_options=opts)


def test_rollout_prefetch_raises_a_corrupt_version_and_retries_a_pruned_one(tmp_path, monkeypatch):
    """The rollout's background reader hands a version that fails its checks while still committed to the worker
    as WeightsIntegrityError (once, not a tight loop re-reading it), and looks again for a version whose sidecar was
    pruned meanwhile."""
    from tracerl.rollout.worker import _Prefetch

    url = str(tmp_path / "w")
    W.publish(url, 0, _sd(0))
    blob = tmp_path / "w" / artifacts.fields((tmp_path / "w" / W.sidecar_key(0)).read_bytes())["key"]
    blob.write_bytes(blob.read_bytes()[:-10])  # committed, but truncated
    calls = []
    real = W.load_state_dict

    def counting(*a, **kw):
        calls.append(a)
        return real(*a, **kw)

    monkeypatch.setattr(W, "load_state_dict", counting)
    p = _Prefetch(url, None, poll_interval_s=0.05)
    p._thread.join(timeout=10)
    assert not p._thread.is_alive()  # stopped on the corrupt version
    with pytest.raises(W.WeightsIntegrityError):
        p.take(None)
    assert len(calls) == 1
    p.close()
    assert p._committed(0)
    (tmp_path / "w" / W.sidecar_key(0)).unlink()  # as if pruned
    assert not p._committed(0)
    W.publish(url, 1, _sd(1))
    p = _Prefetch(url, None, poll_interval_s=0.05)
    deadline = time.monotonic() + 10
    got = None
    while got is None and time.monotonic() < deadline:
        got = p.take(None)
        time.sleep(0.01)
    p.close()
    assert got is not None and got[1]["version"] == 1 and torch.equal(got[0]["a.weight"], _sd(1)["a.weight"])


def test_sidecar_kind_is_format_data():
    """The sidecar's ``kind`` is part of the format (readers check it): it did not move with the module."""
    assert W.KIND == "tracerl.weights"
