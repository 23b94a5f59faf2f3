"""The segment codec on odd sizes: every layout (rows, chunk rows, shard size, site groups, column chunks)
reads back exactly through range reads, and plain zarr agrees."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import zarr

from tracestore.storage._local import LocalBackend
from tracestore.format.segment import ArraySpec, ReadTargets, array_metadata, choose_chunk_rows, layout

SPECS = [
    ArraySpec("hints.g", np.dtype(np.uint8), (3, 8), ("a", "b", "c"), 0),
    ArraySpec("hints.cc", np.dtype(np.uint8), (2, 8), ("a", "b"), 2),  # 4 column chunks per site
    ArraySpec("token_ids", np.dtype("<i4"), ()),
    ArraySpec("experts", np.dtype("<u2"), (2, 3)),
]


def _sources(spec: ArraySpec, rows: int, rng) -> list[np.ndarray]:
    if spec.grouped:
        return [rng.integers(0, 256, (rows, spec.row_shape[1]), dtype=np.uint8) for _ in spec.members]
    return [rng.integers(0, 1000, (rows, *spec.row_shape)).astype(spec.dtype)]


@pytest.mark.parametrize("rows,chunk_target,shard_bytes", [(1, 4, 64), (7, 3, 40), (37, 8, 300), (199, 64, 5000),
                                                            (64, 16, 1 << 20)])
def test_segment_roundtrip_odd_sizes(tmp_path, rows, chunk_target, shard_bytes):
    rng = np.random.default_rng(rows)
    be = LocalBackend(str(tmp_path))
    cr = choose_chunk_rows(rows, chunk_target)
    assert cr <= chunk_target and (-(-rows // cr)) * cr - rows < -(-rows // chunk_target)
    for spec in SPECS:
        lay = layout(spec, rows, cr, shard_bytes)
        srcs = _sources(spec, rows, rng)
        be.put(f"seg/{spec.name}/zarr.json", array_metadata(lay))
        for key, parts in lay.encode_parts(srcs).items():
            be.put(f"seg/{key}", parts)
        # zarr agrees
        z = zarr.open_array(str(tmp_path / "seg" / spec.name), mode="r")
        full = np.stack(srcs, axis=1) if spec.grouped else srcs[0]
        np.testing.assert_array_equal(z[:], full)
        # range reads of every shape
        spans = {(0, rows), (rows - 1, rows), (rows // 3, max(rows // 3 + 1, 2 * rows // 3))}
        for r0, r1 in spans:
            if spec.grouped:
                width = spec.row_shape[1]
                for members in ([0], [len(spec.members) - 1], list(range(len(spec.members)))):
                    for b0, b1 in {(0, width), (2, 6), (0, 2), (4, 8)}:
                        outs = {k: (np.full((r1 - r0, b1 - b0), 7, np.uint8), b0, b1) for k in members}
                        flats = lay.flat_ranges((k, b0, b1) for k in members)  # what the reader requests
                        t = ReadTargets()
                        for rng_, chunks in lay.plan("seg", r0, r1, flats):
                            t.add(rng_, lay, chunks, outs, r0, r1, str)
                        t.finish(be.readinto_ranges(t.build()))
                        for k in members:
                            np.testing.assert_array_equal(outs[k][0], srcs[k][r0:r1, b0:b1])
            else:
                out = np.zeros((r1 - r0, *spec.row_shape), spec.dtype)
                t = ReadTargets()
                for rng_, chunks in lay.plan("seg", r0, r1):
                    t.add(rng_, lay, chunks, {0: (out, 0, 0)}, r0, r1, str)
                t.finish(be.readinto_ranges(t.build()))
                np.testing.assert_array_equal(out, srcs[0][r0:r1])
        # verify's expectation of every shard matches what was written
        for s in range(lay.n_shards):
            data = be.get(f"seg/{lay.shard_key(s)}")
            size, index = lay.expected_index(s)
            assert len(data) == size and data.endswith(index)


def test_choose_chunk_rows_pads_little():
    for rows, target in itertools.product([1, 2, 37, 1000, 8729], [1, 7, 256, 1024]):
        cr = choose_chunk_rows(rows, target)
        n = -(-rows // cr)
        assert cr <= target and n * cr - rows < n


def test_flat_ranges_request_only_the_needed_column_chunks():
    lay = layout(SPECS[1], 10, 4, 1 << 20)  # 2 sites x 4 column chunks of 2 bytes
    assert (lay.n_col, lay.col_chunk) == (4, 2)
    assert lay.flat_ranges([(0, 0, 8), (1, 0, 8)]) == [(0, 8)]  # whole rows of both sites: one range
    assert lay.flat_ranges([(1, 2, 6), (0, 2, 6)]) == [(1, 3), (5, 7)]  # a slice of each site, in site order
    assert lay.flat_ranges([(0, 3, 8), (1, 0, 1)]) == [(1, 5)]  # partial chunks round outwards; touching merge
    assert lay.flat_ranges([(1, 0, 2)]) == [(4, 5)]
