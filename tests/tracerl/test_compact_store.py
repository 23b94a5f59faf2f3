"""Margin exceptions through the store (tracestore format version 5): `compact.pack_rows` output written to a
margin site and `compact.unpack_rows` of what the reader returns give back equal `MarginExceptions`, for every
position coding, both scale payloads, token ranges that cross segments, and every read format."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tracefp4
import tracestore as ts
from tracerl.errors import ConfigError
from tracerl.hints import compact as C


def _enc(t: int, w: int, margin: float, scale_margin: float, payload: str, seed: int = 0) -> C.MarginExceptions:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, w, generator=gen) * torch.exp(2 * torch.randn(t, 1, generator=gen))
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    return C.encode_margin_exceptions(x, g, q.scales, q.hints, margin, scale_margin, scale_payload=payload)


def _slice(enc: C.MarginExceptions, a: int, b: int) -> C.MarginExceptions:
    """Tokens [a, b) of ``enc`` (the marked payloads of those rows, in row-major order)."""
    vm, sm = enc.value_mask, enc.scale_mask
    hv = int(vm[:a].sum()), int(vm[:b].sum())
    hs = int(sm[:a].sum()), int(sm[:b].sum())
    return C.MarginExceptions(vm[a:b], enc.hint_bits[hv[0]:hv[1]], sm[a:b], enc.scale_bytes[hs[0]:hs[1]],
                              enc.margin, enc.scale_margin, enc.scale_payload)


@pytest.mark.parametrize("coding,margin,scale_margin,payload", [
    (C.SiteCoding("gamma", "bitmap"), 0.03, math.inf, "lsb"),
    (C.SiteCoding("rice2", "gamma"), 0.1, 0.3, "byte"),
    (C.SiteCoding("block-bitmap", "rice0"), 0.25, 0.0, "byte"),
    (C.SiteCoding("bitmap", "bitmap"), 0.0, 0.0, "lsb"),  # nothing marked: every row holds only its position bits
    (C.SiteCoding("all", "all"), math.inf, math.inf, "byte"),  # everything: today's information
])
def test_pack_write_read_unpack_round_trip(tmp_path, coding, margin, scale_margin, payload):
    T, W = 70, 256
    encs = {"t0": _enc(T, W, margin, scale_margin, payload, seed=1), "t1": _enc(9, W, margin, scale_margin, payload, 2)}
    packed = {t: C.pack_rows(e, coding) for t, e in encs.items()}
    site = C.store_site("layers.3.moe_in", W, coding, margin, scale_margin, payload)
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("plain", 64), site], chunk_rows=8)
    assert store.format_version == 5 and store.sites[site.name] == site
    with store.writer("w", commit_interval_s=0, commit_bytes=600) as w:
        for t, p in packed.items():
            n = len(p.offsets) - 1
            for a in range(0, n, 16):  # several writes, several segments
                b = min(n, a + 16)
                data, off = C.store_rows(p)
                sub = (data[off[a]:off[b]], off[a:b + 1] - off[a])
                w.write(t, a, hints={"plain": np.zeros((b - a, 8), np.uint8)},
                        scales={"plain": np.zeros((b - a, 4), np.uint8)}, token_ids=np.arange(b - a),
                        logprobs=np.zeros(b - a, np.float32), rows={site.name: sub})
    reopened = ts.open_store(str(tmp_path / "s"))
    assert reopened.head() > 2
    reader = reopened.reader()
    got_site = reopened.sites[site.name]
    for t, enc in encs.items():
        batch = reader.read(t, sites=[site.name], trace=False)
        back = C.packed_from_store(got_site, batch.rows[site.name])
        np.testing.assert_array_equal(back.data, packed[t].data)  # byte for byte
        np.testing.assert_array_equal(back.offsets, packed[t].offsets)
        assert C.unpack_rows(back) == enc
    for fmt in ("numpy", "torch", "arrow"):
        part = reader.read("t0", 13, 51, sites=[site.name], fmt=fmt, trace=False).rows[site.name]
        assert C.unpack_rows(C.packed_from_store(got_site, part)) == _slice(encs["t0"], 13, 51), fmt
    assert ts.verify(reopened).ok


def test_store_site_carries_the_codec_keys_and_refuses_bad_ones():
    site = C.store_site("s", 512, C.SiteCoding("rice3", "block-bitmap"), 0.1, math.inf, "lsb", max_row_bytes=4096)
    assert (site.hint_encoding, site.value_coding, site.block_coding, site.scale_payload, site.max_row_bytes) == (
        "margin", "rice3", "block-bitmap", "lsb", 4096)
    assert site.to_dict()["scale_margin"] == "inf"
    with pytest.raises(ts.DeclarationError, match="value_coding 'rice99'"):
        C.store_site("s", 512, C.SiteCoding("rice99", "bitmap"), 0.1, 0.1)
    with pytest.raises(ConfigError, match="is not a margin site"):
        C.packed_from_store(ts.Site("s", 64), (np.zeros(0, np.uint8), np.zeros(1, np.int64)))
