"""Trainer checkpoints (`tracerl.artifacts.checkpoints`) on every backend (local, memory, S3 through moto): round trip,
immutability, corruption and absence -> typed errors that change nothing, pruning."""

from __future__ import annotations

import json

import pytest

from helpers import artifacts
from tracerl.artifacts import checkpoints as C
from tracerl.errors import CheckpointCorruptError, CheckpointExistsError, CheckpointNotFoundError, ConfigError


def _blobs(step: int) -> dict[str, bytes]:
    return {"model": bytes(range(256)) * (step + 1), "optim": f"optimizer {step}".encode()}


def test_round_trip_and_latest(location):
    url, opts = location.url, location.options
    assert C.latest_step(url, storage_options=opts) is None
    with pytest.raises(CheckpointNotFoundError):
        C.load(url, storage_options=opts)
    for step in (0, 3, 7):
        key = C.save(url, step, _blobs(step), {"step": step, "cursor": f"c{step}"}, storage_options=opts)
        assert key == C.manifest_key(step)
    assert C.list_steps(url, storage_options=opts) == [0, 3, 7]
    c = C.load(url, storage_options=opts)  # the newest
    assert (c.step, c.state, c.blobs) == (7, {"step": 7, "cursor": "c7"}, _blobs(7))
    assert C.load(url, 3, storage_options=opts).blobs == _blobs(3)
    with pytest.raises(CheckpointNotFoundError):
        C.load(url, 4, storage_options=opts)


def test_immutable_and_bad_input(location):
    url, opts = location.url, location.options
    C.save(url, 1, _blobs(1), {"a": 1}, storage_options=opts)
    before = location.snapshot()
    with pytest.raises(CheckpointExistsError):
        C.save(url, 1, _blobs(2), {"a": 2}, storage_options=opts)
    with pytest.raises(ConfigError):
        C.save(url, 2, {"Bad/Name": b"x"}, {}, storage_options=opts)
    with pytest.raises(ConfigError):
        C.save(url, 2, _blobs(2), {"nan": float("nan")}, storage_options=opts)
    with pytest.raises(ConfigError):
        C.save(url, -1, _blobs(2), {}, storage_options=opts)
    assert location.snapshot() == before  # nothing written by any refusal


@pytest.mark.parametrize("damage", ["flip_blob", "delete_blob", "manifest_not_json", "manifest_other_kind",
                                    "manifest_other_version", "manifest_wrong_step", "manifest_wrong_checksum",
                                    "manifest_format_1_fields", "manifest_flipped_digit"])
def test_corruption_is_a_typed_error(location, damage):
    url, opts = location.url, location.options
    C.save(url, 5, _blobs(5), {"x": 1}, storage_options=opts)
    man_key = C.manifest_key(5)
    raw = location.read(man_key)
    man = artifacts.fields(raw)
    blob = man["blobs"]["model"]["key"]
    if damage == "flip_blob":
        location.flip(blob, 100)
    elif damage == "delete_blob":
        location.delete(blob)
    elif damage == "manifest_not_json":
        location.write(man_key, b"{not json")
    elif damage == "manifest_wrong_checksum":  # a well-formed checksum that is not the blob's
        ref = man["blobs"]["model"]
        ref["crc32c"] = f"{int(ref['crc32c'], 16) ^ 1:08x}"
        ref["key"] = ref["key"].rsplit("-", 1)[0] + f"-{ref['crc32c']}.model"
        location.write(ref["key"], location.read(blob))
        location.write(man_key, artifacts.wrap(C.KIND, man))
    elif damage == "manifest_format_1_fields":  # format 2 says crc32c; a sha256 reference does not describe it
        import hashlib

        data = location.read(blob)
        man["blobs"]["model"] = {"key": blob, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
        location.write(man_key, artifacts.wrap(C.KIND, man))
    elif damage == "manifest_flipped_digit":  # the caller's state, changed after the commit: read as is before
        location.write(man_key, raw.replace(b'\\"x\\": 1', b'\\"x\\": 7'))
        assert location.read(man_key) != raw
    elif damage == "manifest_other_kind":
        location.write(man_key, artifacts.wrap("something.else", man))
    elif damage == "manifest_other_version":
        location.write(man_key, artifacts.wrap(C.KIND, man, format_version=99))
    else:
        location.write(man_key, artifacts.wrap(C.KIND, {**man, "step": 6}))
    before = location.snapshot()
    with pytest.raises(CheckpointCorruptError):
        C.load(url, storage_options=opts)
    assert location.snapshot() == before


def test_format_1_checkpoints_still_load(location):
    """A checkpoint committed by format 1 (sha256 in the manifest and the keys) loads and verifies."""
    import hashlib

    url, opts = location.url, location.options
    refs = {}
    for name, data in _blobs(4).items():
        sha = hashlib.sha256(data).hexdigest()
        refs[name] = {"key": f"{C.PREFIX}{4:012d}-{sha[:16]}.{name}", "sha256": sha, "bytes": len(data)}
        location.write(refs[name]["key"], data)
    man = {"kind": C.KIND, "format_version": 1, "step": 4, "created_unix": 0.0, "blobs": refs, "state": {"s": 4}}
    location.write(C.manifest_key(4), json.dumps(man).encode())
    c = C.load(url, storage_options=opts)
    assert (c.step, c.state, c.blobs) == (4, {"s": 4}, _blobs(4))
    location.flip(refs["model"]["key"], 7)
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        C.load(url, 4, storage_options=opts)


def test_prune_keeps_newest_and_first(location):
    url, opts = location.url, location.options
    for step in range(6):
        C.save(url, step, _blobs(step), {}, storage_options=opts)
    assert C.prune(url, 2, keep=(0,), storage_options=opts) == [1, 2, 3]
    assert C.list_steps(url, storage_options=opts) == [0, 4, 5]
    # no blob of a pruned checkpoint is left behind
    keys = [k for k in location.keys() if k.startswith(C.PREFIX)]
    assert len(keys) == 3 * 3
    with pytest.raises(ConfigError):
        C.prune(url, 0, storage_options=opts)


def test_manifest_kind_is_format_data():
    """The manifest's ``kind`` is part of the format (readers check it): it did not move with the module."""
    assert C.KIND == "tracerl.checkpoint"
