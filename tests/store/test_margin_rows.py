"""Margin-exception rows (format version 5, FORMAT §2.5): the site key ``hint_encoding``, the codec keys, the version
a store gets, the writer's checks (nothing buffered on a bad write), the segment arrays ``margin_ends.<site>`` /
``margin.<site>``, write-then-read byte for byte on every backend (partial ranges across segment boundaries, 0-byte
rows, all three formats), damaged and truncated objects, verify / info / gc / compact / stream, and S3 through the
fault-injecting proxy."""

from __future__ import annotations

import json
import struct
import time

import crc32c
import numpy as np
import pyarrow as pa
import pytest
import zarr
from helpers.store import _seed, check_batch, rows, store_with_manifest_sites

import tracestore as ts

CODEC = dict(hint_encoding="margin", margin=0.03, scale_margin="inf", value_coding="gamma", block_coding="bitmap",
             scale_payload="lsb")


def msite(name: str, width: int = 64, **kw) -> ts.Site:
    return ts.Site(name, width, **{**CODEC, **kw})


MIXED = [ts.Site("a", 64), msite("m", 256), ts.Site("b", 128, scale_encoding="lsb"), msite("n", 64, max_row_bytes=40)]


# ---------------------------------------------------------------------------------------------- row data
def margin_rows(traj_id: str, site: str, start: int, stop: int, longest: int = 40) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic rows of tokens [start, stop): a pure function of (traj, site, position); about 1 in 4 rows is
    empty, the others 1..longest bytes."""
    parts = []
    for pos in range(start, stop):
        rng = np.random.default_rng(_seed(traj_id, site, pos))
        n = 0 if rng.random() < 0.25 else int(rng.integers(1, longest + 1))
        parts.append(rng.integers(0, 256, n, dtype=np.uint8))
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)
    data = np.concatenate(parts) if parts else np.zeros(0, np.uint8)
    return data.astype(np.uint8), offsets


def write_kwargs(store, traj_id: str, start: int, stop: int) -> dict:
    """``Writer.write`` keywords: the suite's deterministic hints/scales/trace for bits sites, margin rows for the
    others."""
    kw = rows(store, traj_id, start, stop)
    for name in store.margin_arrays:
        del kw["hints"][name], kw["scales"][name]
    longest = {n: min(40, store.sites[n].max_row_bytes) for n in store.margin_arrays}
    kw["rows"] = {n: margin_rows(traj_id, n, start, stop, longest[n]) for n in store.margin_arrays}
    return kw


def bits_sites(store) -> list[str]:
    return [n for n in store.sites if n not in store.margin_arrays]


def check(store, batch, traj_id: str, start: int, stop: int) -> None:
    """A numpy batch equals the deterministic rows, byte for byte (margin rows: data and offsets)."""
    check_batch(store, batch, traj_id, start, stop, sites=bits_sites(store))
    assert set(batch.rows) == set(store.margin_arrays) and not set(batch.hints) & set(store.margin_arrays)
    for name in store.margin_arrays:
        data, offsets = margin_rows(traj_id, name, start, stop, min(40, store.sites[name].max_row_bytes))
        got = batch.rows[name]
        assert got.data.dtype == np.uint8 and got.offsets.dtype == np.int64 and got.offsets.shape == (stop - start + 1,)
        np.testing.assert_array_equal(got.offsets, offsets)
        np.testing.assert_array_equal(got.data, data)


# ---------------------------------------------------------------------------------------------- declaration
def test_margin_site_keeps_its_codec_keys_and_round_trips_through_the_manifest_object():
    site = msite("m", 2048, margin=0.1, scale_margin=0, value_coding="rice3", block_coding="block-bitmap",
                 scale_payload="byte", max_row_bytes=9000)
    d = site.to_dict()
    assert d["hint_encoding"] == "margin" and d["scale_margin"] == 0.0 and d["max_row_bytes"] == 9000
    assert ts.Site.from_dict(d) == site
    inf = msite("m", margin=float("inf"))
    assert inf.to_dict()["margin"] == "inf" and ts.Site.from_dict(inf.to_dict()).margin == float("inf")
    assert msite("m").max_row_bytes == 65536 and msite("m").bytes_per_token == 4
    assert "hint_encoding" not in ts.Site("a", 64).to_dict(4) and ts.Site("a", 64).to_dict(5)["hint_encoding"] == "bits"
    assert "margin" not in ts.Site("a", 64).to_dict(5)  # codec keys only on margin sites


@pytest.mark.parametrize("kw,match", [
    (dict(hint_encoding="bytes"), r"hint_encoding 'bytes' is not one of \['bits', 'margin'\]"),
    (dict(hint_encoding=None), r"hint_encoding None is not one of"),
    (dict(margin=-0.1), r"margin must be a number >= 0 or \"inf\", got -0.1"),
    (dict(margin=float("nan")), r"margin must be a number >= 0"),
    (dict(scale_margin="Infinity"), r"scale_margin must be a number >= 0 or \"inf\", got 'Infinity'"),
    (dict(margin=True), r"margin must be a number"),
    (dict(value_coding="rice31"), r"value_coding 'rice31' is not one of \['all', 'bitmap', 'block-bitmap', "
                                  r"'gamma', 'rice<k>'\] \(k in 0..30\)"),
    (dict(block_coding="huffman"), r"block_coding 'huffman' is not one of"),
    (dict(block_coding="block-bitmap"), r"block_coding 'block-bitmap' needs rows of a multiple of 16 positions; "
                                        r"this site's rows have 4"),
    (dict(scale_payload="bytes"), r"scale_payload 'bytes' is not one of \['byte', 'lsb'\]"),
    (dict(max_row_bytes=0), r"max_row_bytes must be an integer in \[1, 16777216\], got 0"),
    (dict(max_row_bytes=(1 << 24) + 1), r"max_row_bytes must be an integer in \[1, 16777216\]"),
    (dict(max_row_bytes=1.5), r"max_row_bytes must be an integer"),
    (dict(fp4_format="mxfp4"), r"hint_encoding 'margin' is defined for nvfp4 sites with block 16 and "
                               r"scale_encoding 'bytes'"),
    (dict(scale_encoding="lsb"), r"scale hints go in scale_payload 'lsb'"),
    (dict(value_coding=None), r"needs the codec keys .*missing \['value_coding'\]"),
])
def test_bad_margin_declarations_are_declaration_errors(kw, match):
    with pytest.raises((ts.DeclarationError, ts.ShapeError), match=match):
        msite("m", 64, **kw)


def test_codec_keys_on_a_bits_site_are_refused():
    with pytest.raises(ts.DeclarationError, match=r"\['margin', 'value_coding'\] are codec keys of hint_encoding "
                                                  r"'margin'; this site has hint_encoding 'bits'"):
        ts.Site("a", 64, margin=0.1, value_coding="gamma")


def test_a_store_with_a_margin_site_is_version_5_and_others_keep_theirs(tmp_path):
    assert ts.create_store(str(tmp_path / "plain"), [ts.Site("a", 64)]).format_version == 3
    assert ts.create_store(str(tmp_path / "lsb"), [ts.Site("a", 64, scale_encoding="lsb")]).format_version == 4
    assert "hint_encoding" not in (tmp_path / "lsb" / "tracestore.json").read_text()  # a v4 reader reads it
    store = ts.create_store(str(tmp_path / "m"), MIXED)
    assert store.format_version == 5
    manifest = json.loads((tmp_path / "m" / "tracestore.json").read_text())
    assert [s["hint_encoding"] for s in manifest["sites"]] == ["bits", "margin", "bits", "margin"]  # spelled out
    assert [s["scale_encoding"] for s in manifest["sites"]] == ["bytes", "bytes", "lsb", "bytes"]
    assert manifest["sites"][1]["scale_margin"] == "inf" and manifest["sites"][3]["max_row_bytes"] == 40
    assert ts.open_store(str(tmp_path / "m")).sites == store.sites


@pytest.mark.parametrize("version", [3, 4])
def test_margin_in_an_older_version_is_refused_before_anything_is_written(tmp_path, version):
    with pytest.raises(ts.DeclarationError, match=f"needs format version >= 5; the store is version {version}"):
        ts.create_store(str(tmp_path / "s"), MIXED, format_version=version)
    assert not (tmp_path / "s").exists()


# ---------------------------------------------------------------------------------------------- manifest


@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("key,value", [("hint_encoding", "margin"), ("hint_encoding", "bits"), ("margin", 0.1),
                                       ("max_row_bytes", 10)])
def test_version_5_keys_in_versions_1_to_4_are_integrity_errors(tmp_path, version, key, value):
    url = store_with_manifest_sites(tmp_path, version, {"name": "a", "width": 64, key: value})
    with pytest.raises(ts.IntegrityError, match=rf"\['{key}'\] are format-version-5 keys; this manifest declares "
                                                rf"version {version}"):
        ts.open_store(url)


@pytest.mark.parametrize("site,match", [
    ({"hint_encoding": "margin"}, "needs the codec keys"),
    ({"hint_encoding": "margins", **{k: v for k, v in CODEC.items() if k != "hint_encoding"}}, "hint_encoding"),
    ({**CODEC, "margin": None}, "missing \\['margin'\\]"),
    ({**CODEC, "margin": "1e400"}, "margin must be a number"),
    ({**CODEC, "value_coding": 3}, "value_coding 3 is not one of"),
    ({**CODEC, "max_row_bytes": True}, "max_row_bytes must be an integer"),
    ({"hint_encoding": "bits", "scale_payload": "lsb"}, "are codec keys of hint_encoding 'margin'"),
    ({**CODEC, "rows": 3}, "unknown keys \\['rows'\\]"),
])
def test_version_5_manifest_with_bad_margin_keys_is_an_integrity_error(tmp_path, site, match):
    url = store_with_manifest_sites(tmp_path, 5, {"name": "a", "width": 64, **site})
    with pytest.raises(ts.IntegrityError, match=match):
        ts.open_store(url)


def test_version_5_manifest_without_hint_encoding_means_bits(tmp_path):
    url = store_with_manifest_sites(tmp_path, 5, {"name": "a", "width": 64})
    assert not ts.open_store(url).sites["a"].is_margin


def test_a_reader_of_versions_1_to_4_rejects_a_margin_store_at_its_manifest(tmp_path):
    from tracestore.format.keys import check_version

    ts.create_store(str(tmp_path / "s"), MIXED)
    found = json.loads((tmp_path / "s" / "tracestore.json").read_text())["format_version"]
    with pytest.raises(ts.SchemaVersionError, match=r"has version 5; this tracestore writes version 4 and reads "
                                                    r"versions \[1, 2, 3, 4\]"):
        check_version(found, "the manifest", supported=(1, 2, 3, 4), writes=4)


# ---------------------------------------------------------------------------------------------- segment arrays
def test_segment_arrays_hold_the_rows_back_to_back_and_plain_zarr_reads_them(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), MIXED, chunk_rows=4, shard_bytes=300)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **write_kwargs(store, "t", 0, 21))
        w.write("u", 0, **write_kwargs(store, "u", 0, 6))
    assert list(store.array_specs) == ["hints.w64.b16", "scales.w64.b16", "hints.w128.b16.lsb", "scales.w128.b16.lsb",
                                       "margin_ends.m", "margin.m", "margin_ends.n", "margin.n", "token_ids",
                                       "logprobs"]
    group = zarr.open_group(str(tmp_path / "s" / store.read_entry(0).segment.path), mode="r")
    for name in ("m", "n"):
        (d0, o0), (d1, o1) = margin_rows("t", name, 0, 21, 40), margin_rows("u", name, 0, 6, 40)
        ends = group[f"margin_ends.{name}"]
        assert ends.dtype == np.uint32 and ends.shape == (27,)
        np.testing.assert_array_equal(ends[:], np.concatenate([o0[1:], o0[-1] + o1[1:]]))
        data = group[f"margin.{name}"]
        assert data.dtype == np.uint8 and data.shape == (len(d0) + len(d1),)
        np.testing.assert_array_equal(data[:], np.concatenate([d0, d1]))
        meta = json.loads((tmp_path / "s" / store.read_entry(0).segment.path / f"margin.{name}" / "zarr.json")
                          .read_text())
        assert meta["codecs"][0]["configuration"]["chunk_shape"] == [64 * 4]  # 64 bytes per row of chunk_rows
        shard = 256 * max(1, min(300 // 256, -(-data.shape[0] // 256)))
        assert meta["chunk_grid"]["configuration"]["chunk_shape"] == [shard]
    assert group["hints.w64.b16"].shape == (27, 1, 8)  # margin sites are in no hints/scales array
    assert ts.verify(store).ok


def test_a_segment_whose_rows_are_all_empty(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), [msite("m")], chunk_rows=4)
    T = 9
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, rows={"m": (np.zeros(0, np.uint8), np.zeros(T + 1, np.int64))},
                token_ids=np.arange(T), logprobs=np.zeros(T, np.float32))
    seg = tmp_path / "s" / store.read_entry(0).segment.path
    assert sorted(p.name for p in (seg / "margin.m").iterdir()) == ["zarr.json"]  # 0 bytes: no shard
    assert zarr.open_group(str(seg), mode="r")["margin.m"].shape == (0,)
    batch = store.reader().read("t")
    assert batch.rows["m"].data.size == 0 and batch.rows["m"].offsets.tolist() == [0] * (T + 1)
    assert ts.verify(store).ok


# ---------------------------------------------------------------------------------------------- round trip
def _write_many_segments(store, trajs: dict[str, int], step: int = 7, **writer_kw) -> None:
    writer_kw.setdefault("commit_bytes", 900)
    with store.writer("w", commit_interval_s=0, **writer_kw) as w:
        for traj, n in trajs.items():
            for pos in range(0, n, step):
                w.write(traj, pos, **write_kwargs(store, traj, pos, min(n, pos + step)))


def test_round_trip_on_every_backend(location):
    store = ts.create_store(location.url, MIXED, storage_options=location.options, chunk_rows=4, shard_bytes=500,
                            moe_layers=["e"], top_k=2, num_experts=8)
    _write_many_segments(store, {"t0": 90, "t1": 23})
    again = ts.open_store(location.url, storage_options=location.options)
    assert again.format_version == 5 and again.sites == store.sites and again.head() > 4  # many segments
    reader = again.reader()
    check(again, reader.read("t0"), "t0", 0, 90)
    check(again, reader.read("t1"), "t1", 0, 23)
    starts = [r.token_start for e in again.read_entries(0, again.head()) for r in e.records() if r.traj_id == "t0"]
    assert len(starts) > 3
    for a, b in [(1, 2), (starts[1] - 1, starts[1] + 1), (starts[1], starts[3] + 2), (3, 89), (89, 90), (0, 1)]:
        check(again, reader.read("t0", a, b), "t0", a, b)  # crossing records and segments
    one = reader.read("t0", 10, 30, sites=["n"], trace=False)
    assert list(one.rows) == ["n"] and one.hints == {}
    np.testing.assert_array_equal(one.rows["n"].data, margin_rows("t0", "n", 10, 30)[0])
    report = ts.verify(again)
    assert report.ok, report.errors


def test_torch_and_arrow_formats(tmp_path):
    torch = pytest.importorskip("torch")
    store = ts.create_store(str(tmp_path / "s"), MIXED, chunk_rows=4)
    _write_many_segments(store, {"t": 40})
    reader = store.reader()
    data, offsets = margin_rows("t", "m", 5, 33)
    rows_t = reader.read("t", 5, 33, fmt="torch").rows["m"]
    assert rows_t.data.dtype == torch.uint8 and rows_t.offsets.dtype == torch.int64
    assert torch.equal(rows_t.data, torch.from_numpy(data)) and torch.equal(rows_t.offsets, torch.from_numpy(offsets))
    arrow = reader.read("t", 5, 33, fmt="arrow")
    col = arrow.rows["m"]
    assert col.type == pa.large_binary() and len(col) == 28
    assert col.to_pylist() == [data[offsets[t]:offsets[t + 1]].tobytes() for t in range(28)]
    assert reader.read("t", 5, 33).rows["m"].row(3) == col[3].as_py()
    with pytest.raises(ts.ShapeError, match=r"to_arrow: sites \['m', 'n'\] store margin-exception rows"):
        arrow.to_arrow()
    assert arrow.to_arrow_tokens().num_rows == 28
    assert reader.read("t", 0, 4, sites=["a"]).to_arrow().num_rows == 4


def test_feature_slices_apply_to_bits_sites_only(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("a", 256), msite("m", 256)], feature_chunk=128)
    _write_many_segments(store, {"t": 9})
    reader = store.reader()
    with pytest.raises(ts.ShapeError, match=r"features \[0, 128\) invalid for site 'm': it stores margin-exception "
                                            r"rows .* read whole"):
        reader.read("t", features=(0, 128))
    check_batch(store, reader.read("t", sites=["a"], features=(128, 256)), "t", 0, 9, features=(128, 256), sites=["a"])
    check(store, reader.read("t", features=(0, 256)), "t", 0, 9)


def test_margin_only_store_and_byte_budget(tmp_path):
    """With margin sites a stage is full by bytes, not rows: long rows make more, smaller segments, each within the
    buffer budget; ``buffered_bytes`` counts the rows' bytes."""
    store = ts.create_store(str(tmp_path / "s"), [msite("m", 64, max_row_bytes=400)], chunk_rows=4)
    T = 60
    big = np.full(T * 300, 7, np.uint8)
    offsets = np.arange(0, T * 300 + 1, 300, dtype=np.int64)
    with store.writer("w", commit_interval_s=0, commit_bytes=2000) as w:
        w.write("t", 0, rows={"m": (big[:300 * 3], offsets[:4])}, token_ids=np.arange(3),
                logprobs=np.zeros(3, np.float32))
        assert w.buffered_bytes == 3 * 300 + 3 * (4 + 8)
        w.write("t", 3, rows={"m": (big[300 * 3:], offsets[3:] - offsets[3])}, token_ids=np.arange(T - 3),
                logprobs=np.zeros(T - 3, np.float32))
    entries = store.read_entries(0, store.head())
    assert len(entries) >= T * 312 // 2000
    assert all(e.segment.rows * 312 <= 2000 for e in entries)
    batch = store.reader().read("t")
    np.testing.assert_array_equal(batch.rows["m"].offsets, offsets)
    assert batch.rows["m"].data.tobytes() == big.tobytes()


def test_stream_gc_compact_and_info(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), MIXED, chunk_rows=4, gc_grace_s=1)
    _write_many_segments(store, {"t0": 30, "t1": 12})
    items = list(store.stream(timeout_s=0))
    assert items and all(i.kind == "record" for i in items)
    for rec in items:
        check(store, ts.read_record(store, rec), rec.traj_id, rec.token_start, rec.token_stop)
    orphan = store.writer("crashed", commit_interval_s=0)
    orphan.write("x", 0, **write_kwargs(store, "x", 0, 5))
    orphan._committer.write_segment(orphan._buffer.take())  # never committed
    before = ts.verify(store)
    assert before.ok and len(before.orphan_segments) == 1
    rep = ts.collect_garbage(store, now=time.time() + 1e6)
    assert rep.deleted_segments == before.orphan_segments
    assert not any(k.startswith(rep.deleted_segments[0]) for k in _keys(tmp_path / "s"))
    assert store.compact() == store.head()
    reader = ts.open_store(str(tmp_path / "s")).reader()
    check(store, reader.read("t0"), "t0", 0, 30)
    d = ts.info(store)
    margin = sum((tmp_path / "s" / k).stat().st_size for k in _keys(tmp_path / "s")
                 if k.split("/")[3:4] and k.split("/")[3].startswith(("margin.", "margin_ends.")) and
                 not k.endswith("zarr.json"))
    assert d["bytes"]["margin"] == margin > 0 and d["margin_bytes_per_token"] == margin / 42
    assert d["payload_bytes_per_token"] == (8 + 4) + (16 + 1) + 4 + 4
    assert ts.verify(store).ok


def _keys(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_stores_without_margin_sites_read_and_write_as_before(tmp_path):
    """Old layouts are untouched: a version-3 and a version-4 store written and read by this code have no
    margin arrays, no hint_encoding key, and their batches have no rows."""
    for version, sites in ((3, [ts.Site("a", 64)]), (4, [ts.Site("a", 64, scale_encoding="lsb")])):
        url = str(tmp_path / f"v{version}")
        store = ts.create_store(url, sites)
        with store.writer("w", commit_interval_s=0) as w:
            w.write("t", 0, **rows(store, "t", 0, 11))
        assert store.format_version == version and "hint_encoding" not in (tmp_path / f"v{version}" /
                                                                            "tracestore.json").read_text()
        seg = tmp_path / f"v{version}" / store.read_entry(0).segment.path
        assert not any(p.name.startswith("margin") for p in seg.iterdir())
        batch = ts.open_store(url).reader().read("t")
        check_batch(store, batch, "t", 0, 11)
        assert batch.rows == {}
        assert json.loads((seg / "zarr.json").read_text())["attributes"]["tracestore"]["format_version"] == version


# ---------------------------------------------------------------------------------------------- writer rejections
def _bad(kw: dict, site: str = "m", data=None, offsets=None, value=None) -> dict:
    kw = {**kw, "rows": dict(kw["rows"])}
    d, o = kw["rows"][site]
    kw["rows"][site] = value if value is not None else (d if data is None else data, o if offsets is None else offsets)
    return kw


@pytest.mark.parametrize("how,error,match", [
    ("data int8", ts.DTypeError, r"rows\['m'\] data must be uint8, got int8"),
    ("data float", ts.DTypeError, r"rows\['m'\] data must be uint8, got float32"),
    ("data list", ts.DTypeError, r"rows\['m'\] data: expected a numpy array or torch tensor, got list"),
    ("data 2-D", ts.ShapeError, r"rows\['m'\] data must be 1-D \[n bytes\], got shape \(\d+, 1\)"),
    ("offsets float", ts.DTypeError, r"rows\['m'\] offsets must be integers \(int64\), got float64"),
    ("offsets T", ts.ShapeError, r"rows\['m'\] offsets must have shape \(6,\) \(T \+ 1 for T=5 tokens.*got \(5,\)"),
    ("offsets start", ts.ShapeError, r"offsets must start at 0 and end at the data's size \d+, got offsets\[0\] = 1"),
    ("offsets end", ts.ShapeError, r"offsets must start at 0 and end at the data's size (\d+), got .*offsets\[5\] = "),
    ("offsets decrease", ts.ShapeError, r"offsets must be non-decreasing, got offsets\[2\] = 9 > offsets\[3\] = 3"),
    ("row too long", ts.ShapeError, r"rows\['n'\]: row 1 has 41 bytes; site 'n' allows at most max_row_bytes = 40"),
    ("not a pair", ts.DTypeError, r"rows\['m'\] must be a pair \(data uint8 \[n\], offsets int64 \[T \+ 1\]\)"),
    ("rows for a bits site", ts.SiteEncodingError, r"rows: site\(s\) \['a'\] have hint_encoding 'bits': give them "
                                                   r"in hints= and scales="),
    ("hints for a margin site", ts.SiteEncodingError, r"hints: site\(s\) \['m'\] have hint_encoding 'margin'.*give "
                                                      r"them in rows="),
    ("scales for a margin site", ts.SiteEncodingError, r"scales: site\(s\) \['n'\] have hint_encoding 'margin'"),
    ("rows missing", ts.ShapeError, r"rows: missing site\(s\) \['n'\]; every declared site is required"),
    ("rows unknown", ts.UnknownSiteError, r"rows: unknown site\(s\) \['zz'\]"),
    ("rows none", ts.ShapeError, r"rows: missing site\(s\) \['m', 'n'\]"),
])
def test_bad_rows_are_refused_and_nothing_changes(location, how, error, match):
    store = ts.create_store(location.url, MIXED, storage_options=location.options)
    good = write_kwargs(store, "t", 0, 5)
    data, off = good["rows"]["m"]
    bad = {
        "data int8": lambda: _bad(good, data=data.astype(np.int8)),
        "data float": lambda: _bad(good, data=data.astype(np.float32)),
        "data list": lambda: _bad(good, data=data.tolist()),
        "data 2-D": lambda: _bad(good, data=data[:, None]),
        "offsets float": lambda: _bad(good, offsets=off.astype(np.float64)),
        "offsets T": lambda: _bad(good, offsets=off[:-1]),
        "offsets start": lambda: _bad(good, offsets=np.r_[1, off[1:]]),
        "offsets end": lambda: _bad(good, offsets=np.r_[off[:-1], off[-1] - 1] if off[-1] else np.r_[off[:-1], 1]),
        "offsets decrease": lambda: _bad(good, data=np.zeros(12, np.uint8), offsets=np.array([0, 4, 9, 3, 10, 12])),
        "row too long": lambda: _bad(good, "n", data=np.zeros(46, np.uint8), offsets=np.array([0, 1, 42, 42, 45, 46])),
        "not a pair": lambda: _bad(good, value=data),
        "rows for a bits site": lambda: {**good, "rows": {**good["rows"], "a": (data, off)}},
        "hints for a margin site": lambda: {**good, "hints": {**good["hints"], "m": np.zeros((5, 32), np.uint8)}},
        "scales for a margin site": lambda: {**good, "scales": {**good["scales"], "n": np.zeros((5, 4), np.uint8)}},
        "rows missing": lambda: {**good, "rows": {"m": good["rows"]["m"]}},
        "rows unknown": lambda: {**good, "rows": {**good["rows"], "zz": (data, off)}},
        "rows none": lambda: {**good, "rows": None},
    }[how]()
    before = location.snapshot()
    with store.writer("w", commit_interval_s=0) as w:
        with pytest.raises(error, match=match):
            w.write("t", 0, **bad)
        assert w.buffered_bytes == 0
    assert location.snapshot() == before and store.head() == 0  # nothing buffered, nothing written


def test_rows_for_a_store_without_margin_sites(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("a", 64)])
    kw = rows(store, "t", 0, 3)
    with store.writer("w", commit_interval_s=0) as w:
        with pytest.raises(ts.SiteEncodingError, match=r"\(this store has none; its sites: \['a'\]\)"):
            w.write("t", 0, **kw, rows={"a": (np.zeros(0, np.uint8), np.zeros(4, np.int64))})
        w.write("t", 0, **kw, rows={})  # nothing to give: accepted
    check_batch(store, store.reader().read("t"), "t", 0, 3)


def test_writer_takes_objects_with_data_and_offsets_and_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")

    class Packed:  # what tracerl.hints.compact.PackedRows looks like to the store
        def __init__(self, data, offsets):
            self.data, self.offsets = data, offsets

    store = ts.create_store(str(tmp_path / "s"), MIXED)
    kw = write_kwargs(store, "t", 0, 6)
    (dm, om), (dn, on) = kw["rows"]["m"], kw["rows"]["n"]
    kw["rows"] = {"m": Packed(dm, om), "n": (torch.from_numpy(dn), torch.from_numpy(on))}
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **kw)
    check(store, store.reader().read("t"), "t", 0, 6)


# ---------------------------------------------------------------------------------------------- damaged objects
def _store_with_segments(location, **kw):
    store = ts.create_store(location.url, MIXED, storage_options=location.options, chunk_rows=4, shard_bytes=300)
    _write_many_segments(store, {"t": 30}, **kw)
    return store


def _ends_key(store, name: str = "m", seq: int = 0) -> str:
    return f"{store.read_entry(seq).segment.path}/margin_ends.{name}/0"


def test_flipped_row_end_is_a_crc_error_naming_the_object(location):
    store = _store_with_segments(location)
    key = _ends_key(store)
    location.flip(key, 2)
    with pytest.raises(ts.IntegrityError, match=rf"crc32c mismatch: object .*{key} chunk"):
        store.reader().read("t")
    report = ts.verify(store)
    assert any("crc32c mismatch" in e and key in e for e in report.errors), report.errors
    assert any("margin.m not checked: its row ends margin_ends.m failed" in e for e in report.errors)


def test_consistent_but_damaged_row_ends_are_an_integrity_error_naming_the_object(location):
    """Ends written with a valid crc32c but not non-decreasing (a buggy writer): the reader refuses them."""
    store = _store_with_segments(location)
    key = _ends_key(store)
    raw = bytearray(location.read(key))
    chunk = 4 * 4  # chunk_rows 4 x uint32
    ends = np.frombuffer(bytes(raw[:chunk]), "<u4").copy()
    ends[2] = ends[1] + 100_000  # row 2 longer than max_row_bytes, row 3 negative
    raw[:chunk] = ends.tobytes()
    raw[chunk:chunk + 4] = struct.pack("<I", crc32c.crc32c(ends.tobytes()))
    location.write(key, bytes(raw))
    ends_obj = key.rsplit("/", 1)[0]
    with pytest.raises(ts.IntegrityError, match=rf"damaged row ends: object .*{ends_obj} rows \[0, \d+\)"):
        store.reader().read("t", 0, 4)
    report = ts.verify(store)
    assert any(e.startswith("damaged row ends") and ends_obj in e for e in report.errors), report.errors


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_truncated_or_missing_rows_shard_is_an_integrity_error(location, damage):
    store = _store_with_segments(location)
    seg = store.read_entry(0).segment.path
    key = f"{seg}/margin.m/0"
    if damage == "truncated":
        location.write(key, location.read(key)[:-30])
    else:
        location.delete(key)
    with pytest.raises(ts.IntegrityError, match=r"short read|missing"):
        store.reader().read("t")
    errors = ts.verify(store).errors
    assert any(key in e and ("bytes, expected" in e or "missing" in e) for e in errors), errors


def test_rows_longer_than_the_array_are_caught_by_verify(tmp_path):
    """Ends that point past the stored rows (with valid checksums) are a verify error: the array's length is the
    last end."""
    from helpers.store import RawLocal

    location = RawLocal(str(tmp_path / "s"))
    store = _store_with_segments(location)
    seg = store.read_entry(0).segment
    meta_key = f"{seg.path}/margin.m/zarr.json"
    meta = json.loads(location.read(meta_key))
    meta["shape"] = [meta["shape"][0] + 1]
    location.write(meta_key, json.dumps(meta).encode())
    assert any("margin.m/zarr.json differs" in e for e in ts.verify(store).errors)


# ---------------------------------------------------------------------------------------------- S3 through faults
def test_s3_through_the_fault_proxy(proxy, s3_bucket):
    """Reads of margin rows whose GETs answer 503 are retried and return the same bytes; a segment PUT that fails
    keeps the rows, and the next flush commits them."""
    name, client, options = s3_bucket
    url = f"s3://{name}/st"
    fast = ts.RetryPolicy(attempts=4, base_delay_s=0.01, max_delay_s=0.05, deadline_s=10)
    store = ts.create_store(url, MIXED, storage_options=proxy.storage_options(), retry=fast, chunk_rows=4)
    with store.writer("w", commit_interval_s=0) as w:
        proxy.add("error", "PUT", r"/margin\.m/", times=None)
        w.write("t", 0, **write_kwargs(store, "t", 0, 20))
        with pytest.raises(ts.BackendError):
            w.flush()
        proxy.clear()
        assert store.head() == 0  # the rows are kept for the retry
        w.flush()
    proxy.add("error", "GET", r"/margin(_ends)?\.[mn]/", times=3)
    check(store, store.reader().read("t", 3, 17), "t", 3, 17)
    assert proxy.stats["error"] >= 3
    assert ts.verify(ts.open_store(url, storage_options=options)).ok


# ---------------------------------------------------------------------------------------------- CLI
def test_cli_info_and_show_name_margin_sites(tmp_path, capsys):
    from tracestore.cli import main

    store = ts.create_store(str(tmp_path / "s"), MIXED)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **write_kwargs(store, "t", 0, 6))
    assert main(["info", str(tmp_path / "s")]) == 0
    text = capsys.readouterr().out
    assert "tracestore v5" in text and "m: width 256 nvfp4 (block 16), margin rows (gamma/bitmap, margin 0.03/inf, " \
                                      "scale payload lsb)" in text and "margin " in text.split("bytes ", 1)[1]
    assert main(["show", str(tmp_path / "s"), "t", "--tokens", "2:5", "--json", "--full"]) == 0
    shown = json.loads(capsys.readouterr().out)["tokens"]["sites"]
    data, offsets = margin_rows("t", "n", 2, 5)
    assert shown["n"] == {"margin_rows": [data[offsets[i]:offsets[i + 1]].tobytes().hex() for i in range(3)]}
    assert set(shown["a"]) == {"hints", "scales"}
