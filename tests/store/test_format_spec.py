"""``schemas/FORMAT.md`` and the code in one test: the spec's tables (entry metadata, checkpoint columns, manifest
fields, segment arrays, stored schemas) are parsed and compared with what the code writes."""

from __future__ import annotations

import json
import pathlib
import re

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


@pytest.mark.parametrize("version", [1, 2])
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
