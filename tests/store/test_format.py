"""The on-disk format: plain zarr-python reads the segments; schemas match their JSON description."""

from __future__ import annotations

import json
import pathlib

import numpy as np
import pytest
import zarr

import traceschemas
import tracestore as ts
from helpers.store import rows

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_schema_json_matches_code():
    for version in traceschemas.SUPPORTED_FORMAT_VERSIONS:
        assert json.loads((ROOT / "schemas" / f"tracestore_v{version}.json").read_text()) == traceschemas.describe(version)
    assert ts.FORMAT_VERSION == traceschemas.FORMAT_VERSION == 5
    assert traceschemas.SUPPORTED_FORMAT_VERSIONS == (1, 2, 3, 4, 5)


def test_format_md_exists_and_names_the_version():
    text = (ROOT / "schemas" / "FORMAT.md").read_text()
    for needle in ["format_version", "If-None-Match", "crc32c", "log/", "data/", "SchemaVersionError"]:
        assert needle in text


@pytest.mark.parametrize("feature_chunk", [0, 32])
def test_plain_zarr_reads_segments(tmp_path, feature_chunk):
    sites = [ts.Site("a", 64), ts.Site("b", 64), ts.Site("c", 128, fp4_format="mxfp4")]
    store = ts.create_store(str(tmp_path / "s"), sites, moe_layers=["m0", "m1"], top_k=2, num_experts=16,
                            chunk_rows=8, shard_bytes=300, feature_chunk=feature_chunk)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t0", 0, **rows(store, "t0", 0, 29))
        w.write("t1", 0, **rows(store, "t1", 0, 6))
    entry = store.read_entry(0)
    group = zarr.open_group(str(tmp_path / "s" / entry.segment.path), mode="r")
    assert group.attrs["tracestore"]["rows"] == 35
    want0, want1 = rows(store, "t0", 0, 29), rows(store, "t1", 0, 6)
    hints = group["hints.w64.b16"]
    assert hints.shape == (35, 2, 8) and list(hints.attrs["tracestore"]["sites"]) == ["a", "b"]
    np.testing.assert_array_equal(hints[:29, 1], want0["hints"]["b"])
    np.testing.assert_array_equal(group["scales.w128.b32"][29:, 0], want1["scales"]["c"])
    np.testing.assert_array_equal(group["token_ids"][:29], want0["token_ids"])
    np.testing.assert_array_equal(group["logprobs"][29:], want1["logprobs"])
    np.testing.assert_array_equal(group["experts"][:29, 1], want0["experts"]["m1"])
    # zarr checks the same crc32c: a flipped byte fails there too
    shard = tmp_path / "s" / entry.segment.path / "token_ids" / "0"
    data = bytearray(shard.read_bytes())
    data[3] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(Exception, match="(?i)checksum"):
        zarr.open_group(str(tmp_path / "s" / entry.segment.path), mode="r")["token_ids"][:]
    with pytest.raises(ts.IntegrityError):
        store.reader().read("t0")


def test_overhead_at_the_default_site_table(tmp_path):
    """20 sites x 2048 nvfp4 values: index + log + metadata stay well under 1% of the payload."""
    sites = [ts.Site(f"layers.{20 + i}.moe_in", 2048) for i in range(20)]
    store = ts.create_store(str(tmp_path / "s"), sites)
    assert store.payload_bytes_per_token == 7680
    T = 2000
    z = {s.name: np.zeros((T, s.hint_bytes), np.uint8) for s in sites}
    sc = {s.name: np.zeros((T, s.scale_bytes), np.uint8) for s in sites}
    with store.writer("w", commit_interval_s=0) as w:
        for t in range(4):
            w.write(f"t{t}", 0, hints=z, scales=sc, token_ids=np.zeros(T, np.int64),
                    logprobs=np.zeros(T, np.float32))
    d = ts.info(store)
    assert d["tokens"] == 8000
    assert d["overhead"] < 0.01, d
