"""``schemas/FORMAT.md`` and the code in one test: the spec's tables (entry metadata, checkpoint columns, manifest
fields, segment arrays, stored schemas) are parsed and compared with what the code writes."""

from __future__ import annotations

import json
import pathlib
import re
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import traceschemas
import tracestore as ts
from helpers.store import rows
from tracestore.format.entries import _bundle_schema, _checkpoint_schema

ROOT = pathlib.Path(__file__).resolve().parents[2]
SPEC = (ROOT / "schemas" / "FORMAT.md").read_text()


def _table(after: str, header: str) -> list[list[str]]:
    """Rows of the first markdown table whose header line starts with ``header``, after the text ``after``."""
    text = SPEC[SPEC.index(after):]
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append([c.strip().strip("`") for c in line.strip("|").split("|")])
    return out


def _store(tmp_path, version: int = ts.FORMAT_VERSION):
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("a", 64), ts.Site("c", 128, fp4_format="mxfp4"),
                                                  ts.Site("b", 64)],
                            moe_layers=["m1", "m0"], top_k=2, num_experts=300, chunk_rows=8, shard_bytes=512,
                            format_version=version)
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 20))
    return store


def test_entry_metadata_fields(tmp_path):
    store = _store(tmp_path)
    data = (tmp_path / "s" / "log" / "000000000000.arrow").read_bytes()
    meta = json.loads(pa.ipc.open_file(pa.BufferReader(data)).schema.metadata[b"tracestore.entry"])
    spec = {r[0]: r[1] for r in _table("* `tracestore.entry`", "| field | JSON type")}
    assert set(spec) == set(meta)
    kinds = {"integer": int, "string": str, "number": (int, float)}
    for field, kind in spec.items():
        assert isinstance(meta[field], kinds[kind]) and not isinstance(meta[field], bool), field
    assert meta["segment"] == store.read_entry(0).segment.path


def test_checkpoint_columns():
    for after, schema in (("### 3.1 Checkpoints", _checkpoint_schema()), ("**Version 2 checkpoints**", _bundle_schema())):
        spec = _table(after, "| column | type")
        assert [r[0] for r in spec] == schema.names
        assert [r[1] for r in spec] == [str(f.type).replace("double", "float64") for f in schema]
        assert not any(f.nullable for f in schema)


@pytest.mark.parametrize("version", [1, 2, 3])
def test_checkpoint_file_matches(tmp_path, version):
    store = _store(tmp_path, version)
    store.compact()
    table = pq.read_table(next((tmp_path / "s" / "index").iterdir()))
    assert table.schema.remove_metadata() == (_checkpoint_schema() if version == 1 else _bundle_schema())
    assert json.loads(table.schema.metadata[b"tracestore.checkpoint"])["format_version"] == version


def test_results_entry_fields(tmp_path):
    store = _store(tmp_path)
    with store.writer("w", commit_interval_s=0) as w:
        w.write_result("t", reward=1.0, group_id="g0", advantage=0.5, prompt_len=3, response_len=17,
                       finish_reason="stop", extra={"k": 1})
    data = (tmp_path / "s" / "log" / "000000000001.arrow").read_bytes()
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    meta = json.loads(table.schema.metadata[b"tracestore.entry"])
    assert table.num_rows == 0
    spec = {r[0]: r[1] for r in _table("### 3.2 Results entries", "| field | JSON type")}
    assert set(spec) == set(meta) and meta["kind"] == "results"
    fields = [r[0] for r in _table("A result object has exactly", "| field | JSON type")]
    assert sorted(fields) == sorted(meta["results"][0]) and meta["results"][0]["reward"] == 1.0


def test_manifest_fields_are_specified(tmp_path):
    store = _store(tmp_path)
    manifest = json.loads((tmp_path / "s" / "tracestore.json").read_text())
    spec_fields = {r[0] for r in _table("### 2.2 Manifest", "| field | allowed")}
    expanded = set()
    for f in spec_fields:
        expanded.update(x.strip().strip("`") for x in f.split(","))
    keys = set(manifest) - {"format", "created_unix"} | {f"layout.{k}" for k in manifest["layout"]}
    assert keys - {"layout"} <= expanded, keys - expanded
    assert store.manifest == manifest


def test_segment_arrays_and_axis_orders(tmp_path):
    store = _store(tmp_path)
    seg = tmp_path / "s" / store.read_entry(0).segment.path
    names = sorted(p.name for p in seg.iterdir() if p.is_dir())
    spec_names = [r[0] for r in _table("### 2.3 Segments", "| array | shape")]
    patterns = [re.escape(n).replace("<W>", r"\d+").replace("<B>", r"\d+") for n in spec_names]
    assert all(any(re.fullmatch(p, n) for p in patterns) for n in names), names
    hints = json.loads((seg / "hints.w64.b16" / "zarr.json").read_text())
    assert hints["attributes"]["tracestore"]["sites"] == ["a", "b"]  # manifest order, listed on the array
    experts = json.loads((seg / "experts" / "zarr.json").read_text())
    assert experts["data_type"] == "uint16" and experts["shape"][1:] == [2, 2]  # [rows, L (m1, m0), top_k]
    order = list(store.array_specs)
    assert order == ["hints.w64.b16", "scales.w64.b16", "hints.w128.b32", "scales.w128.b32", "token_ids",
                     "logprobs", "experts"]


def test_which_schemas_are_stored():
    described = set(traceschemas.describe()["schemas"])
    assert described == {"log_entry", "record", "token", "trajectory", "result"}
    intro = SPEC[:SPEC.index("## 1.")]
    assert "only\n`log_entry` is stored" in intro or "only `log_entry` is stored" in intro.replace("\n", " ")


def test_verify_checks_group_consistency(tmp_path):
    store = _store(tmp_path)
    group = tmp_path / "s" / store.read_entry(0).segment.path / "zarr.json"
    meta = json.loads(group.read_text())
    meta["attributes"]["tracestore"]["writer_id"] = "someone-else"
    group.write_text(json.dumps(meta))
    report = ts.verify(ts.open_store(str(tmp_path / "s")))
    assert not report.ok and any("writer_id" in e for e in report.errors), report.errors


def test_gc_entry_fields(tmp_path):
    store = _store(tmp_path)
    orphan = store.writer("crashed", commit_interval_s=0)
    orphan.write("x", 0, **rows(store, "x", 0, 4))
    orphan._committer.write_segment(orphan._buffer.take())  # never committed
    rep = ts.collect_garbage(store, now=time.time() + 1e6)
    assert rep.gc_entries == [1]
    data = (tmp_path / "s" / "log" / "000000000001.arrow").read_bytes()
    table = pa.ipc.open_file(pa.BufferReader(data)).read_all()
    meta = json.loads(table.schema.metadata[b"tracestore.entry"])
    spec = {r[0]: r[1] for r in _table("### 6.1 gc entries", "| field | JSON type")}
    assert set(spec) == set(meta) and meta["kind"] == "gc" and table.num_rows == 0
    kinds = {"integer": int, "string": str, "number": (int, float), "array": list}
    assert all(isinstance(meta[f], kinds[k]) and not isinstance(meta[f], bool) for f, k in spec.items())
    assert meta["segments"] == rep.deleted_segments and meta["batch"].startswith(f"{meta['writer_seq']:08d}-")


# ------------------------------------------------------------------ zarr.json compared as JSON values (FORMAT §2.3)
def _zarr_python_metadata(tmp_path, lay) -> bytes:
    """The zarr.json zarr-python itself writes for an array of layout ``lay`` (an independent writer)."""
    import zarr
    from zarr.codecs import Crc32cCodec

    spec = lay.spec
    where = tmp_path / "zp" / spec.name
    zarr.create_array(store=str(where), shape=(lay.rows, *spec.row_shape), dtype=spec.dtype, chunks=lay.chunk_shape,
                      shards=(lay.shard_rows, *spec.row_shape), compressors=[Crc32cCodec()], filters=None,
                      fill_value=0, chunk_key_encoding={"name": "v2", "separator": "."}, zarr_format=3,
                      attributes={"tracestore": {"sites": list(spec.members)}} if spec.grouped else {})
    return (where / "zarr.json").read_bytes()


def _segment_arrays(tmp_path):
    from tracestore.format.segment import layout

    store = _store(tmp_path)
    seg = store.read_entry(0).segment
    root = tmp_path / "s" / seg.path
    return store, [(root / name / "zarr.json", layout(spec, seg.rows, seg.chunk_rows, seg.shard_bytes))
                   for name, spec in store.array_specs.items()]


def test_zarr_json_written_by_zarr_python_passes_verify(tmp_path):
    """An independent writer's correct segment passes verify: every array's zarr.json replaced by what
    zarr-python writes for it (indented, other key order). Before: verify compared bytes and failed every array."""
    store, arrays = _segment_arrays(tmp_path)
    for path, lay in arrays:
        theirs = _zarr_python_metadata(tmp_path, lay)
        assert theirs != path.read_bytes()
        path.write_bytes(theirs)
    report = ts.verify(ts.open_store(str(tmp_path / "s")))
    assert report.ok, report.errors


def _edit(meta: dict, how: str) -> dict:
    sharding = meta["codecs"][0]["configuration"]
    if how == "uint8 endian little":
        sharding["codecs"][0] = {"name": "bytes", "configuration": {"endian": "little"}}
    elif how == "uint8 endian big":
        sharding["codecs"][0] = {"name": "bytes", "configuration": {"endian": "big"}}
    elif how == "optional members left out":
        for k in ("storage_transformers",) + (("attributes",) if meta["attributes"] == {} else ()):
            del meta[k]
        meta["chunk_key_encoding"] = {"name": "v2"}
    elif how == "index endian big":
        sharding["index_codecs"][0]["configuration"]["endian"] = "big"
    elif how == "inner endian missing":
        sharding["codecs"][0].pop("configuration", None)
    elif how == "chunk shape":
        sharding["chunk_shape"][0] += 1
    elif how == "extra member":
        meta["dimension_names"] = ["rows"] + [None] * (len(meta["shape"]) - 1)
    elif how == "sites attribute missing":
        meta["attributes"] = {}
    return meta


@pytest.mark.parametrize("how,ok", [
    ("uint8 endian little", True), ("uint8 endian big", True), ("optional members left out", True),
    ("index endian big", False), ("inner endian missing", False), ("chunk shape", False), ("extra member", False),
    ("sites attribute missing", False),
])
def test_zarr_json_compared_as_json_values(tmp_path, how, ok):
    """Equal meaning passes whatever the bytes; any other difference is an error naming the array. uint8 arrays'
    bytes codec may carry any endian (meaningless for one byte); multi-byte arrays and every index must say little."""
    store, arrays = _segment_arrays(tmp_path)
    touched = []
    for path, lay in arrays:
        multi = lay.spec.dtype.itemsize > 1
        if how.startswith("uint8") and multi or how == "inner endian missing" and not multi:
            continue
        if how == "sites attribute missing" and not lay.spec.grouped:
            continue
        path.write_text(json.dumps(_edit(json.loads(path.read_text()), how), indent=1, sort_keys=True))
        touched.append(lay.spec.name)
    errors = ts.verify(ts.open_store(str(tmp_path / "s"))).errors
    if ok:
        assert errors == []
    else:
        assert {n for n in touched if any(f"{n}/zarr.json differs" in e for e in errors)} == set(touched), errors


def test_scale_encoding_table(tmp_path):
    """§2.4's table: every encoding the code knows, its scale bytes per token and the formats that take it."""
    from tracestore.format.keys import SCALE_ENCODINGS

    spec = {r[0]: r for r in _table("### 2.4 Scale encodings", "| scale_encoding")}
    assert list(spec) == list(SCALE_ENCODINGS)
    per_token = {"W/B": lambda w, b: w // b, "ceil(W/B/8)": lambda w, b: -(-(w // b) // 8)}
    for enc, (_, nbytes, _, formats) in spec.items():
        allowed = {f.strip().split()[0].strip("`") for f in formats.split(",")}
        for fmt in ("nvfp4", "mxfp4"):
            for width in (32, 96, 2048):
                if fmt in allowed:
                    site = ts.Site("s", width, fp4_format=fmt, scale_encoding=enc)
                    assert site.scale_bytes == per_token[nbytes](width, site.block_size), (enc, fmt, width)
                else:
                    with pytest.raises(ts.DeclarationError):
                        ts.Site("s", width, fp4_format=fmt, scale_encoding=enc)
    # the arrays of a store with both encodings are the ones §2.3 names
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("a", 64), ts.Site("b", 64, scale_encoding="lsb")])
    with store.writer("w", commit_interval_s=0) as w:
        w.write("t", 0, **rows(store, "t", 0, 3))
    seg = tmp_path / "s" / store.read_entry(0).segment.path
    spec_names = [r[0] for r in _table("### 2.3 Segments", "| array | shape")]
    patterns = [re.escape(n).replace("<W>", r"\d+").replace("<B>", r"\d+") for n in spec_names]
    names = sorted(p.name for p in seg.iterdir() if p.is_dir())
    assert "scales.w64.b16.lsb" in names
    assert all(any(re.fullmatch(p, n) for p in patterns) for n in names), names


def test_margin_site_keys_and_arrays(tmp_path):
    """§2.5's table names exactly the codec keys the code knows, each refused out of its allowed range; the arrays
    of a store with margin sites are the ones §2.3 names, in its order."""
    from tracestore.format.keys import (
        DEFAULT_MAX_ROW_BYTES,
        HINT_ENCODINGS,
        MARGIN_KEYS,
        MARGIN_OPTIONAL_KEYS,
        MAX_ROW_BYTES_LIMIT,
        SCALE_PAYLOADS,
    )

    spec = {r[0]: r for r in _table("### 2.5 Hint encodings", "| key | allowed")}
    assert list(spec) == [*MARGIN_KEYS, *MARGIN_OPTIONAL_KEYS]
    assert f"default {DEFAULT_MAX_ROW_BYTES}" in spec["max_row_bytes"][1] and "2^24" in spec["max_row_bytes"][1]
    assert [x.strip(" `") for x in spec["scale_payload"][1].split(",")] == list(SCALE_PAYLOADS)
    assert "`bits`, `margin`" in SPEC and list(HINT_ENCODINGS) == ["bits", "margin"]
    codec = dict(hint_encoding="margin", margin=0.1, scale_margin="inf", value_coding="rice30", block_coding="all",
                 scale_payload="byte")
    for coding in ("all", "bitmap", "block-bitmap", "gamma", "rice0", "rice30"):
        ts.Site("m", 256 * 16, **{**codec, "value_coding": coding, "block_coding": coding})
    for key, bad in (("value_coding", "rice31"), ("margin", -1), ("scale_payload", "bytes"),
                     ("max_row_bytes", MAX_ROW_BYTES_LIMIT + 1)):
        with pytest.raises(ts.DeclarationError):
            ts.Site("m", 64, **{**codec, key: bad})
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("a", 64), ts.Site("m", 64, **codec)], chunk_rows=4)
    with store.writer("w", commit_interval_s=0) as w:
        kw = rows(store, "t", 0, 5)
        del kw["hints"]["m"], kw["scales"]["m"]
        w.write("t", 0, **kw, rows={"m": (np.arange(7, dtype=np.uint8), np.array([0, 0, 3, 3, 6, 7]))})
    seg = tmp_path / "s" / store.read_entry(0).segment.path
    spec_names = [r[0] for r in _table("### 2.3 Segments", "| array | shape")]
    patterns = [re.escape(n).replace("<W>", r"\d+").replace("<B>", r"\d+").replace(re.escape("<site>"), "m")
                for n in spec_names]
    names = [p.name for p in seg.iterdir() if p.is_dir()]
    assert all(any(re.fullmatch(p, n) for p in patterns) for n in names), names
    assert list(store.array_specs) == ["hints.w64.b16", "scales.w64.b16", "margin_ends.m", "margin.m", "token_ids",
                                       "logprobs"]
    ends = json.loads((seg / "margin_ends.m" / "zarr.json").read_text())
    data = json.loads((seg / "margin.m" / "zarr.json").read_text())
    assert ends["data_type"] == "uint32" and ends["shape"] == [5]
    assert data["data_type"] == "uint8" and data["shape"] == [7]
    cr = store.read_entry(0).segment.chunk_rows
    assert cr == 3 and data["codecs"][0]["configuration"]["chunk_shape"] == [64 * cr]  # C = 64 * the entry's
