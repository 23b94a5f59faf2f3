"""Margin exceptions end to end (issue 23, stage 3): the reference engine with ``margin_capture=True`` records a
store's margin site as margin-exception rows equal to `compact.encode_margin_exceptions` of the activation it
quantized, and the hint feed hands the trainer `MarginExceptions` whose `reconstruct` is `compact.reconstruct`.
CPU, a tiny random MoE."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracefp4
from helpers.capture import spy_on_site
import tracestore as ts
from tracerl.errors import ConfigError, RecorderError
from tracerl.hints import HintFeed, MicroBatch, Segment
from tracerl.hints import compact as C
from tracerl.policy import TinyMoESpec, build_model, install_fp4, moe_input_site, plan_sites
from tracerl.rollout import RolloutEngine, RolloutRecorder

TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4, top_k=2,
            moe_intermediate_size=32, vocab_size=128)
PROMPTS = [[5, 9, 17, 33, 2, 7], [3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]]
CODING = C.SiteCoding("gamma", "bitmap")
MARGIN, SCALE_MARGIN = 0.1, 0.3
NEW = 5


def _rollout(tmp_path, decode="hf", marks_stream=False, device="cpu", fuse_marks=True):
    spec = TinyMoESpec(family="qwen3-moe", **TINY)
    model = build_model(spec, seed=0, attn_implementation="eager").to(device)
    rt = install_fp4(model, plan_sites(model, hint_layers="0,1"))
    margin_site, bits_site = moe_input_site(1), moe_input_site(0)
    store = ts.create_store(str(tmp_path / "s"), [ts.Site(bits_site, 64),
                                                 C.store_site(margin_site, 64, CODING, MARGIN, SCALE_MARGIN, "byte")],
                            model={"global_scales": {}})
    eng = RolloutEngine(model, rt, decode=decode, margin_capture=True, marks_stream=marks_stream,
                        fuse_marks=fuse_marks)
    eng.calibrate(PROMPTS)
    seen = spy_on_site(rt, margin_site)
    writer = store.writer("rollout", commit_interval_s=0)
    eng.recorder = RolloutRecorder(writer, {bits_site: 64, margin_site: 64}, flush_tokens=4)
    res = eng.generate(PROMPTS, NEW, seed=0)
    writer.close()
    return store, eng, rt, res, seen, margin_site, bits_site


@pytest.mark.parametrize("decode,fuse", [("hf", True), ("static", True), ("static", False)])
def test_engine_records_margin_rows_equal_to_the_encoding_of_its_activation(tmp_path, decode, fuse):
    """On the hf path the recorder marks the activation it is handed; on the static path the step marks it into
    its capture ring (in the capture kernel's pass, or by a marks launch of its own): either way the rows are the
    encoding of the activation the step quantized."""
    store, eng, rt, res, seen, site, bits_site = _rollout(tmp_path, decode, fuse_marks=fuse)
    assert eng.decode_path(torch.device("cpu")) == decode
    assert eng.recorder.margin_sites == {site: store.sites[site]}
    g = rt.global_scales[site]
    reader = store.reader()
    # decode step k feeds each request's token at position len(prompt) + k: rows of seen[k + 1] in batch order
    for k in range(NEW):
        x = seen[k + 1]
        q = tracefp4.quantize(x, global_scale=g, backend="reference")
        want = C.encode_margin_exceptions(x, g, q.scales, q.hints, MARGIN, SCALE_MARGIN)
        for b, p in enumerate(PROMPTS):
            batch = reader.read(f"req-{b}", len(p) + k, len(p) + k + 1)
            got = C.unpack_rows(C.packed_from_store(store.sites[site], batch.rows[site]))
            one = C.pack_rows(C.MarginExceptions(want.value_mask[b:b + 1], want.hint_bits[
                want.value_mask[:b].sum():want.value_mask[:b + 1].sum()], want.scale_mask[b:b + 1],
                want.scale_bytes[want.scale_mask[:b].sum():want.scale_mask[:b + 1].sum()], MARGIN, SCALE_MARGIN),
                CODING)
            assert batch.rows[site].row(0) == one.data.tobytes(), (k, b)
            assert got == C.unpack_rows(one)
            assert site not in batch.hints and bits_site in batch.hints
    assert any(C.unpack_rows(C.packed_from_store(store.sites[site], reader.read("req-0").rows[site]))
               .value_mask.any(dim=1))  # something is marked at m = 0.1
    assert ts.verify(store).ok


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the graph path needs CUDA")
@pytest.mark.parametrize("marks_stream,fuse", [(False, True), (True, False), (False, False)])
def test_graph_decode_records_the_rows_the_static_step_records(tmp_path, marks_stream, fuse):
    """On CUDA, the graph decode (its marks in the capture kernel, or by their own launch in the step's stream or on
    a side stream of it) records every request's margin and bits rows byte for byte as the eager static step with
    its marks launched apart in the step's stream."""
    (tmp_path / "static").mkdir()
    (tmp_path / "graph").mkdir()
    stores = [_rollout(tmp_path / name, decode, ms, "cuda", fz)[0]
              for name, decode, ms, fz in (("static", "static", False, False), ("graph", "graph", marks_stream, fuse))]
    readers = [s.reader() for s in stores]
    site, bits_site = moe_input_site(1), moe_input_site(0)
    for b, p in enumerate(PROMPTS):
        want, got = (r.read(f"req-{b}") for r in readers)
        for part in ("data", "offsets"):
            assert np.asarray(getattr(got.rows[site], part)).tobytes() == np.asarray(
                getattr(want.rows[site], part)).tobytes(), (b, part)
        assert np.array_equal(np.asarray(got.hints[bits_site]), np.asarray(want.hints[bits_site])), b


def test_feed_hands_out_margin_exceptions_and_reconstructs(tmp_path):
    store, eng, rt, res, seen, site, bits_site = _rollout(tmp_path)
    g = float(rt.global_scales[site])
    lens = [len(s) for s in res.sequences]
    mb = MicroBatch(tuple(Segment(f"req-{i}", 0, n) for i, n in enumerate(lens)))
    feed = HintFeed(store, global_scales={site: g, bits_site: float(rt.global_scales[bits_site])})
    (batch,) = list(feed.iterate([mb]))
    assert set(batch.margin) == {site} and site not in batch.hints and bits_site in batch.hints
    enc = batch.margin[site]
    assert enc.shape == (sum(lens), 64)
    reader = store.reader()
    parts = [C.unpack_rows(C.packed_from_store(store.sites[site], reader.read(f"req-{i}").rows[site]))
             for i in range(len(lens))]
    assert torch.equal(enc.value_mask, torch.cat([p.value_mask for p in parts]))
    assert torch.equal(enc.hint_bits, torch.cat([p.hint_bits for p in parts]))
    x = torch.randn(sum(lens), 64)
    rec = batch.reconstruct(site, x, backend="reference")
    want = C.reconstruct(enc, x, torch.tensor(g), backend="reference")
    assert torch.equal(rec.scales_e4m3, want.scales_e4m3) and torch.equal(rec.hints_packed, want.hints_packed)
    with pytest.raises(ConfigError, match="is not a margin site of this batch"):
        batch.reconstruct(bits_site, x)
    with pytest.raises(ConfigError, match="read whole: no tensor-parallel slice"):
        HintFeed(store, tp=(0, 2))


def test_margin_sites_need_the_explicit_option_and_the_activation(tmp_path):
    spec = TinyMoESpec(family="qwen3-moe", **TINY)
    model = build_model(spec, seed=0, attn_implementation="eager")
    rt = install_fp4(model, plan_sites(model, hint_layers="1"))
    site = moe_input_site(1)
    store = ts.create_store(str(tmp_path / "s"), [C.store_site(site, 64, CODING, MARGIN, SCALE_MARGIN)])
    with store.writer("w", commit_interval_s=0) as writer:
        rec = RolloutRecorder(writer, {site: 64})
        eng = RolloutEngine(model, rt, recorder=rec, decode="hf")
        eng.calibrate(PROMPTS)
        with pytest.raises(ConfigError, match=r"declares margin sites .* pass margin_capture=True"):
            eng.generate(PROMPTS, 2)
        with pytest.raises(ConfigError, match=r"declares margin sites .* pass margin_capture=True"):
            RolloutEngine(model, rt, recorder=rec, decode="static").generate(PROMPTS, 2)
        rec.begin("r")
        with pytest.raises(RecorderError, match="needs its activation x"):
            rec.record_sites(["r"], [0], site, torch.zeros(1, 8, dtype=torch.uint8),
                             torch.zeros(1, 4, dtype=torch.uint8))
        with pytest.raises(RecorderError, match=r"marks \(1, 4\) torch.uint8 .* expected uint8 \(1, 8\)"):
            rec.record_sites(["r"], [0], site, torch.zeros(1, 8, dtype=torch.uint8),
                             torch.zeros(1, 4, dtype=torch.uint8),
                             marks=(torch.zeros(1, 4, dtype=torch.uint8), torch.zeros(1, 1, dtype=torch.uint8)))
    assert store.head() == 0


def test_unfilled_rows_carry_no_marks(tmp_path):
    """The last sampled token gets no forward without feed_last: its row marks nothing (round to nearest)."""
    site = "s"
    store = ts.create_store(str(tmp_path / "s"), [C.store_site(site, 64, CODING, MARGIN, SCALE_MARGIN)])
    with store.writer("w", commit_interval_s=0) as writer:
        rec = RolloutRecorder(writer, {site: 64})
        rec.begin("r")
        x = torch.randn(3, 64)
        g = tracefp4.compute_global_scale(x)
        q = tracefp4.quantize(x, global_scale=g, backend="reference")
        rec.record_sites(["r"] * 3, [0, 1, 2], site, q.hints, q.scales, x=x, global_scale=g)
        rec.record_tokens(["r"] * 4, [0, 1, 2, 3], torch.arange(4), torch.zeros(4))
        rec.end("r")
    got = C.unpack_rows(C.packed_from_store(store.sites[site], store.reader().read("r").rows[site]))
    want = C.encode_margin_exceptions(x, g, q.scales, q.hints, MARGIN, SCALE_MARGIN)
    assert torch.equal(got.value_mask[:3], want.value_mask) and torch.equal(got.hint_bits, want.hint_bits)
    assert not got.value_mask[3].any() and not got.scale_mask[3].any()
    np.testing.assert_array_equal(store.reader().read("r").token_ids, np.arange(4))


def test_benchmark_smoke_runs(tmp_path):
    """benchmarks/benchmark_compact_path.py --smoke (CPU) runs and writes its JSON: every phase timed, both paths."""
    import json

    from helpers import benchmarks

    mod = benchmarks.load("benchmark_compact_path")
    out = tmp_path / "r.json"
    assert mod.main(["--smoke", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["smoke"] and set(res["phases"]) >= {"plain_write", "margin_pack", "margin_unpack", "margin_reconstruct"}
    assert res["per_decode_step"]["margin_ms"] > 0 and res["stores"]["margin"]["bytes"]["margin"] > 0


def test_a_memory_sink_keeps_margin_rows_as_a_store_does(tmp_path):
    """The same rollout (static decode) into a store and into a MemorySink that declares the same margin site: the
    sink's rows are the store's, byte for byte, whole and sliced; bad declarations and writes are refused."""
    from tracerl.rollout import MemorySink

    store, eng, rt, res, seen, site, bits_site = _rollout(tmp_path, "static")
    widths = {bits_site: 64, site: 64}
    sink = MemorySink(widths, margin_sites={site: store.sites[site]})
    eng.recorder = RolloutRecorder(sink, widths, flush_tokens=4)
    eng.generate(PROMPTS, NEW, seed=0)
    assert eng.recorder.margin_sites == {site: store.sites[site]}
    reader = store.reader()
    for b, p in enumerate(PROMPTS):
        for lo, hi in ((0, None), (2, len(p) + 3)):
            want = reader.read(f"req-{b}", lo, hi).rows[site]
            got = sink.read(f"req-{b}", lo, hi)
            data, off = got.rows[site]
            n = (hi or sink.num_tokens(f"req-{b}")) - lo
            assert len(off) == n + 1 and len(got.token_ids) == n
            assert [bytes(data[off[i]:off[i + 1]]) for i in range(n)] == [want.row(i) for i in range(n)]
            assert site not in got.hints and bits_site in got.hints
    with pytest.raises(RecorderError, match="declared with hint encoding margin"):
        MemorySink(widths, margin_sites={bits_site: ts.Site(bits_site, 64)})
    with pytest.raises(RecorderError, match="lacks sites"):
        sink.write("x", 0, hints={bits_site: np.zeros((1, 8), np.uint8)}, scales={bits_site: np.zeros((1, 4), np.uint8)},
                   token_ids=np.zeros(1, np.int64), logprobs=np.zeros(1, np.float32))


@pytest.mark.parametrize("decode", ["hf", "static"])
def test_mark_points_mark_only_their_sites(decode):
    """`RolloutEngine(mark_points=, mark_sites=)` hands marks for the sites named and no others (no mark kernels
    for the rest), on both paths, one pair per point in order (margin inf marks every value, scale margin 0 no
    block)."""
    spec = TinyMoESpec(family="qwen3-moe", **TINY)
    model = build_model(spec, seed=0, attn_implementation="eager")
    rt = install_fp4(model, plan_sites(model, hint_layers="0,1"))
    marked, other = moe_input_site(1), moe_input_site(0)
    got = {}

    class Spy(RolloutEngine):
        def _deliver_site(self, rids, pos, site, hints, scales, codes, x=None, marks=None, recorder_marks=None):
            got.setdefault(site, []).append(marks)

    eng = Spy(model, rt, decode=decode, keep_codes=True, mark_points=[(0.1, 0.1), (float("inf"), 0.0)],
              mark_sites={marked})
    eng.calibrate(PROMPTS)
    eng.generate(PROMPTS, NEW, seed=0)
    assert got[other] and all(m is None for m in got[other])
    assert got[marked] and all(len(m) == 2 for m in got[marked])
    for vm, bm in (m[1] for m in got[marked]):  # margin inf: every value marked, scale margin 0: no block
        assert bool((vm == 255).all()) and not bool(bm.any())
