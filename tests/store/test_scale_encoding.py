"""The site key ``scale_encoding`` (format version 4, FORMAT §2.2 / §2.4): declaration and manifest checks, the
version a store gets, the writer's row widths, the arrays it writes, and write-then-read on every backend."""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr

import tracestore as ts
from helpers.store import check_batch, rows, store_with_manifest_sites
from tracestore.cli import main

LSB_SITES = [ts.Site("a", 64), ts.Site("b", 256, scale_encoding="lsb"), ts.Site("c", 48, scale_encoding="lsb"),
             ts.Site("d", 256)]


# ---------------------------------------------------------------------------------------------- declaration
@pytest.mark.parametrize("width,want", [(16, 1), (48, 1), (128, 1), (144, 2), (256, 2), (2048, 16)])
def test_lsb_scale_bytes_are_ceil_of_blocks_over_8(width, want):
    site = ts.Site("s", width, scale_encoding="lsb")
    assert site.scale_bytes == want == -(-(width // 16) // 8)
    assert site.bytes_per_token == width // 8 + want
    assert ts.Site("s", width).scale_bytes == width // 16  # the default is today's layout


@pytest.mark.parametrize("bad", ["bits", "LSB", "", 1, None, True])
def test_unknown_scale_encoding_is_a_declaration_error(bad):
    with pytest.raises(ts.DeclarationError, match=r"scale_encoding .* is not one of \['bytes', 'lsb'\]"):
        ts.Site("s", 64, scale_encoding=bad)


@pytest.mark.parametrize("kw", [dict(fp4_format="mxfp4"), dict(block_size=32), dict(fp4_format="mxfp4", block_size=16)])
def test_lsb_needs_nvfp4_with_block_16(kw):
    with pytest.raises(ts.DeclarationError, match="scale_encoding 'lsb' .* nvfp4 sites with block 16"):
        ts.Site("s", 64, scale_encoding="lsb", **kw)


def test_new_stores_take_the_lowest_version_that_holds_them(tmp_path):
    plain = ts.create_store(str(tmp_path / "plain"), [ts.Site("a", 64)])
    assert plain.format_version == 3
    assert "scale_encoding" not in (tmp_path / "plain" / "tracestore.json").read_text()  # a v3 reader reads it
    lsb = ts.create_store(str(tmp_path / "lsb"), LSB_SITES)
    assert lsb.format_version == 4
    manifest = json.loads((tmp_path / "lsb" / "tracestore.json").read_text())
    assert [s["scale_encoding"] for s in manifest["sites"]] == ["bytes", "lsb", "lsb", "bytes"]  # spelled out
    explicit = ts.create_store(str(tmp_path / "v4"), [ts.Site("a", 64)], format_version=4)
    assert explicit.format_version == 4 and explicit.sites["a"].scale_encoding == "bytes"


def test_lsb_in_an_older_version_is_refused_before_anything_is_written(tmp_path):
    with pytest.raises(ts.DeclarationError, match="needs format version >= 4; the store is version 3"):
        ts.create_store(str(tmp_path / "s"), LSB_SITES, format_version=3)
    assert not (tmp_path / "s").exists()


def test_exist_ok_compares_sites_as_values(tmp_path):
    url = str(tmp_path / "s")
    ts.create_store(url, [ts.Site("a", 64)], format_version=4)  # scale_encoding "bytes" spelled out
    assert ts.create_store(url, [ts.Site("a", 64)], exist_ok=True).format_version == 4
    with pytest.raises(ts.StoreExistsError):
        ts.create_store(url, [ts.Site("a", 64, scale_encoding="lsb")], exist_ok=True)


# ---------------------------------------------------------------------------------------------- manifest


@pytest.mark.parametrize("value", ["bits", 0, None, ["lsb"], "Bytes"])
def test_manifest_with_a_bad_scale_encoding_is_an_integrity_error(tmp_path, value):
    url = store_with_manifest_sites(tmp_path, 4, {"name": "a", "width": 64, "scale_encoding": value})
    with pytest.raises(ts.IntegrityError, match="scale_encoding"):
        ts.open_store(url)


def test_manifest_lsb_on_mxfp4_is_an_integrity_error(tmp_path):
    url = store_with_manifest_sites(tmp_path, 4, {"name": "a", "width": 64, "fp4_format": "mxfp4", "scale_encoding": "lsb"})
    with pytest.raises(ts.IntegrityError, match="nvfp4 sites with block 16"):
        ts.open_store(url)


@pytest.mark.parametrize("version", [1, 2, 3])
@pytest.mark.parametrize("value", ["lsb", "bytes"])
def test_scale_encoding_key_in_versions_1_to_3_is_an_integrity_error(tmp_path, version, value):
    url = store_with_manifest_sites(tmp_path, version, {"name": "a", "width": 64, "scale_encoding": value})
    with pytest.raises(ts.IntegrityError, match=f"format-version-4 key; this manifest declares version {version}"):
        ts.open_store(url)


def test_version_4_manifest_without_the_key_means_bytes(tmp_path):
    url = store_with_manifest_sites(tmp_path, 4, {"name": "a", "width": 64})
    assert ts.open_store(url).sites["a"].scale_encoding == "bytes"


def test_a_reader_of_versions_1_to_3_rejects_a_lsb_store_at_its_manifest(tmp_path):
    """What an older tracestore does with a version-4 store: its version check (the same function, with the older
    code's supported versions) refuses the manifest before any site is read."""
    from tracestore.format.keys import check_version

    ts.create_store(str(tmp_path / "s"), LSB_SITES)
    found = json.loads((tmp_path / "s" / "tracestore.json").read_text())["format_version"]
    with pytest.raises(ts.SchemaVersionError, match=r"has version 4; this tracestore writes version 3 and reads "
                                                    r"versions \[1, 2, 3\]"):
        check_version(found, "the manifest", supported=(1, 2, 3), writes=3)


# ---------------------------------------------------------------------------------------------- writer
def test_writer_rejects_scale_bytes_for_a_lsb_site_and_buffers_nothing(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), LSB_SITES)
    good = rows(store, "t", 0, 5)
    bad = dict(good, scales={**good["scales"], "b": np.zeros((5, 16), np.uint8)})  # whole bytes: 256/16
    with store.writer("w", commit_interval_s=0) as w:
        with pytest.raises(ts.ShapeError, match=r"scales\['b'\] must have shape \(5, 2\) .*scale encoding lsb: "
                                                r"ceil\(16 blocks / 8\) bytes .*got \(5, 16\)"):
            w.write("t", 0, **bad)
    assert store.head() == 0  # nothing committed
    with store.writer("w2", commit_interval_s=0) as w:
        with pytest.raises(ts.ShapeError, match=r"scales\['d'\] must have shape \(5, 16\)"):
            w.write("t", 0, **dict(good, scales={**good["scales"], "d": np.zeros((5, 2), np.uint8)}))
    assert store.head() == 0


def test_segment_arrays_of_a_mixed_store(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), LSB_SITES + [ts.Site("e", 256, scale_encoding="lsb")],
                            chunk_rows=8, shard_bytes=512)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 21))
    assert list(store.array_specs)[:8] == ["hints.w64.b16", "scales.w64.b16", "hints.w256.b16.lsb",
                                           "scales.w256.b16.lsb", "hints.w48.b16.lsb", "scales.w48.b16.lsb",
                                           "hints.w256.b16", "scales.w256.b16"]
    group = zarr.open_group(str(tmp_path / "s" / store.read_entry(0).segment.path), mode="r")
    lsb = group["scales.w256.b16.lsb"]
    assert lsb.shape == (21, 2, 2) and list(lsb.attrs["tracestore"]["sites"]) == ["b", "e"]
    np.testing.assert_array_equal(lsb[:, 1], rows(store, "t", 0, 21)["scales"]["e"])
    assert group["scales.w48.b16.lsb"].shape == (21, 1, 1) and group["scales.w256.b16"].shape == (21, 1, 16)
    assert ts.verify(store).ok


# ---------------------------------------------------------------------------------------------- round trip
def test_round_trip_on_every_backend(location):
    store = ts.create_store(location.url, LSB_SITES, storage_options=location.options, chunk_rows=8,
                            shard_bytes=700, moe_layers=["m"], top_k=2, num_experts=8)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t0", 0, **rows(store, "t0", 0, 30))
        w.write("t1", 0, **rows(store, "t1", 0, 7))
    again = ts.open_store(location.url, storage_options=location.options)
    assert again.format_version == 4 and again.sites == store.sites
    reader = again.reader()
    check_batch(again, reader.read("t0"), "t0", 0, 30)
    check_batch(again, reader.read("t1", 2, 6), "t1", 2, 6)
    assert reader.read("t0").scales["b"].shape == (30, 2)
    assert ts.verify(again).ok
    assert ts.info(again)["payload_bytes_per_token"] == (8 + 4) + (32 + 2) + (6 + 1) + (32 + 16)


def test_feature_slices_of_a_lsb_site(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("b", 384, scale_encoding="lsb"), ts.Site("a", 384)],
                            feature_chunk=128)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 9))
    reader = store.reader()
    for lo, hi in [(0, 128), (128, 384), (256, 384), (0, 384)]:
        check_batch(store, reader.read("t", features=(lo, hi)), "t", 0, 9, features=(lo, hi))
    assert store.array_specs["scales.w384.b16.lsb"].col_chunk == 1
    with pytest.raises(ts.ShapeError, match=r"multiples of 128 \(8 scale bits per byte of blocks of 16"):
        reader.read("t", sites=["b"], features=(16, 128))


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_create_and_info(tmp_path, capsys):
    url = str(tmp_path / "s")
    assert main(["create", url, "--sites", "2", "--width", "256", "--scale-encoding", "lsb"]) == 0
    assert "68 payload bytes/token" in capsys.readouterr().out  # 2 x (32 + 2)
    assert main(["info", url]) == 0
    text = capsys.readouterr().out
    assert "tracestore v4" in text and "scales: lsb (scale hints), 2 B/token" in text
    assert main(["info", url, "--json"]) == 0
    assert [s["scale_encoding"] for s in json.loads(capsys.readouterr().out)["sites"]] == ["lsb", "lsb"]
    table = tmp_path / "t.json"
    table.write_text(json.dumps([{"name": "x", "width": 64}, {"name": "y", "width": 64, "scale_encoding": "bytes"}]))
    assert main(["create", str(tmp_path / "t"), "--site-table", str(table), "--scale-encoding", "lsb"]) == 0
    assert [s.scale_encoding for s in ts.open_store(str(tmp_path / "t")).sites.values()] == ["lsb", "bytes"]


def test_cli_lsb_on_mxfp4_is_one_line_exit_2(tmp_path, capsys):
    url = str(tmp_path / "s")
    assert main(["create", url, "--sites", "1", "--width", "64", "--fp4-format", "mxfp4",
                 "--scale-encoding", "lsb"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "nvfp4 sites with block 16" in err
    assert not (tmp_path / "s").exists()


def test_cli_help_names_the_option(capsys):
    with pytest.raises(SystemExit):
        main(["create", "--help"])
    assert "--scale-encoding {bytes,lsb}" in capsys.readouterr().out
