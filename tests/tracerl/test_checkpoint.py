"""Trainer checkpoints (`tracerl.checkpoint`) on every backend (local, memory, S3 through moto): round trip,
immutability, corruption and absence -> typed errors that change nothing, pruning."""

from __future__ import annotations

import json

import pytest

from tracerl import checkpoint as C
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
                                    "manifest_other_version", "manifest_wrong_step"])
def test_corruption_is_a_typed_error(location, damage):
    url, opts = location.url, location.options
    C.save(url, 5, _blobs(5), {"x": 1}, storage_options=opts)
    man_key = C.manifest_key(5)
    man = json.loads(location.read(man_key))
    blob = man["blobs"]["model"]["key"]
    if damage == "flip_blob":
        location.flip(blob, 100)
    elif damage == "delete_blob":
        location.delete(blob)
    elif damage == "manifest_not_json":
        location.write(man_key, b"{not json")
    else:
        field, value = {"manifest_other_kind": ("kind", "something.else"),
                        "manifest_other_version": ("format_version", 99),
                        "manifest_wrong_step": ("step", 6)}[damage]
        location.write(man_key, json.dumps({**man, field: value}).encode())
    before = location.snapshot()
    with pytest.raises(CheckpointCorruptError):
        C.load(url, storage_options=opts)
    assert location.snapshot() == before


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
