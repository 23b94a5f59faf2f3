"""Scale hints (the store's scale encoding lsb, FORMAT §2.4) on the tracerl side: the bit layout, the trainer's
reconstruction (exact for identical activations, and whenever its scale position is within 1/2 step of the
rollout's), the runtime that takes scale-hint rows, the recorder that writes them, the feed that reads them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tracefp4
import tracestore as ts
from tracerl.errors import ConfigError, HintMismatchError, RecorderError
from tracerl.hints import HintFeed, fake_quantize_scale_hints, pack_scale_lsb, reconstruct_scales, unpack_scale_lsb
from tracerl.hints.compact import encode_margin_exceptions, reconstruct, scale_position
from tracerl.hints.scalehints import scale_bytes_per_token, use_store_scale_encodings
from tracerl.policy import TinyMoESpec, build_model, install_fp4, moe_input_site, plan_sites
from tracerl.rollout import MemorySink, RolloutRecorder


def _x(t: int, w: int, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    """Heavy-tailed activations: per-row magnitudes over 6 decades, so blocks span most E4M3 exponents."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(t, w, generator=gen) * (torch.rand(t, 1, generator=gen) * 14 - 7).exp()).to(dtype)


def _bits(a: torch.Tensor) -> torch.Tensor:
    return a.view({torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[a.dtype])


# ------------------------------------------------------------------------------------------------ layout
def test_pack_layout_is_lsb_first_and_zero_padded():
    scales = torch.tensor([[0x01, 0x02, 0x03], [0x7E, 0x7F, 0x10]], dtype=torch.uint8)
    assert pack_scale_lsb(scales).tolist() == [[0b101], [0b010]]
    nine = torch.tensor([[1, 0, 0, 0, 0, 0, 0, 3, 5]], dtype=torch.uint8)
    assert pack_scale_lsb(nine).tolist() == [[0b1000_0001, 0b1]]


@pytest.mark.parametrize("blocks", [1, 3, 8, 9, 16, 17, 128])
def test_unpack_inverts_pack(blocks):
    s = torch.randint(0, 256, (37, blocks), dtype=torch.uint8, generator=torch.Generator().manual_seed(blocks))
    packed = pack_scale_lsb(s)
    assert packed.shape == (37, -(-blocks // 8))
    assert torch.equal(unpack_scale_lsb(packed, blocks), s & 1)


def test_session_host_packing_equals_pack_scale_lsb():
    """tracerl.sglang.session packs with numpy (no torch import there): the same bytes."""
    s = np.random.default_rng(0).integers(0, 256, (11, 19), dtype=np.uint8)
    host = np.packbits(s & 1, axis=1, bitorder="little")
    assert np.array_equal(host, pack_scale_lsb(torch.from_numpy(s)).numpy())


def test_layout_errors_are_typed():
    with pytest.raises(tracefp4.DTypeError, match="uint8"):
        pack_scale_lsb(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(tracefp4.ShapeError, match=r"\[\.\.\., 2\] \(ceil\(9 / 8\) bytes\); got \[4, 1\]"):
        unpack_scale_lsb(torch.zeros(4, 1, dtype=torch.uint8), 9)
    with pytest.raises(tracefp4.ShapeError, match="scale_lsb must have shape"):
        reconstruct_scales(_x(4, 256), 1.0, torch.zeros(4, 16, dtype=torch.uint8))  # whole bytes, not hints
    assert scale_bytes_per_token(2048, "lsb") == 16 and scale_bytes_per_token(2048, "bytes") == 128
    with pytest.raises(ConfigError, match="unknown scale encoding"):
        scale_bytes_per_token(256, "lsB")


# ------------------------------------------------------------------------------------------------ the rule
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 16), (37, 48), (64, 256)])
def test_identical_activations_give_the_rollouts_bytes_and_codes_bit_for_bit(dtype, shape):
    x = _x(*shape, dtype=dtype)
    x[0, :16] = 0  # an all-zero block (t clamps to 2^-9: byte 1)
    if shape[1] >= 48:
        x[0, 16] = float("nan")
        x[0, 33] = float("inf")
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g)
    rec = reconstruct_scales(x, g, pack_scale_lsb(q.scales))
    assert torch.equal(rec, q.scales)
    want = tracefp4.fake_quantize(x, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints, backend="reference")
    got = fake_quantize_scale_hints(x, g, pack_scale_lsb(q.scales), q.hints, backend="reference")
    assert torch.equal(_bits(got), _bits(want))


def test_exact_within_half_a_step_and_only_there():
    """Noisy trainer activations: every block whose own scale position is within 1/2 E4M3 step of the rollout's
    gets the rollout's byte; with 3% relative noise some blocks move further (and those may miss): both occur."""
    x_r = _x(512, 256, dtype=torch.float32, seed=1)
    g = tracefp4.compute_global_scale(x_r)
    q = tracefp4.quantize(x_r, "nvfp4", global_scale=g)
    x_t = x_r * (1 + 0.03 * torch.randn(x_r.shape, generator=torch.Generator().manual_seed(2)))
    rec = reconstruct_scales(x_t, g, pack_scale_lsb(q.scales))

    def w(x):
        amax = x.abs().reshape(x.shape[0], -1, 16).amax(-1)
        return scale_position(torch.clamp((amax / 6) / g, 2.0 ** -9, 448.0))

    close = (w(x_t) - w(x_r)).abs() < 0.5
    assert bool(torch.equal(rec[close], q.scales[close]))
    assert int((~close).sum()) > 0 and int((rec != q.scales).sum()) > 0  # the noise does cross half a step
    assert int((rec != q.scales)[close].sum()) == 0


def test_the_rule_is_compacts_scale_hint_rule():
    """The same bytes as stage 1's reference (`compact.reconstruct`, scale_payload='lsb', every block marked)."""
    x_r = _x(64, 256, seed=3)
    g = tracefp4.compute_global_scale(x_r)
    q = tracefp4.quantize(x_r, "nvfp4", global_scale=g)
    x_t = (x_r.float() * 1.01).to(torch.bfloat16)
    enc = encode_margin_exceptions(x_r, g, q.scales, q.hints, float("inf"), float("inf"), scale_payload="lsb")
    assert torch.equal(reconstruct(enc, x_t, g).scales_e4m3, reconstruct_scales(x_t, g, pack_scale_lsb(q.scales)))


# ------------------------------------------------------------------------------------------------ runtime
TINY = dict(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32, num_experts=4, top_k=2,
            moe_intermediate_size=32, vocab_size=128)


def _runtime():
    model = build_model(TinyMoESpec(**TINY), seed=0)
    rt = install_fp4(model, plan_sites(model, hint_layers="all"))
    rt.set_global_scales({s.name: 0.01 for s in rt.plan.sites})
    return rt


def test_runtime_with_scale_hints_is_todays_forward_for_the_rollouts_activations():
    rt = _runtime()
    site = moe_input_site(1)
    x = _x(33, 64)
    g = rt.global_scales[site]
    q = tracefp4.quantize(x, "nvfp4", global_scale=g)
    with rt.using(mode="fp4_hints", provided={site: (q.scales, q.hints)}):
        want = rt.quant(site, x)
    use_store_scale_encodings(rt, {site: "lsb"})
    with rt.using(mode="fp4_hints", provided={site: (pack_scale_lsb(q.scales), q.hints)}):
        got = rt.quant(site, x)
        with pytest.raises(HintMismatchError, match=r"needs scale hints \[33, 1\] .*got \(33, 4\)"):
            rt.provided = {site: (q.scales, q.hints)}  # bytes where hints are declared
            rt.quant(site, x)
    assert torch.equal(_bits(got), _bits(want))


def test_set_scale_encodings_checks_before_changing_anything():
    rt = _runtime()
    with pytest.raises(ConfigError, match="unknown .*supported: bytes, lsb"):
        rt.set_scale_encodings({moe_input_site(0): "bits"})
    with pytest.raises(ConfigError, match="not hinted by the plan"):
        rt.set_scale_encodings({"model.layers.0.nothing": "lsb"})
    assert rt.scale_encodings == {}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_fused_kernel_is_this_rule(dtype):
    """`tracefp4.fake_quantize_lsb` (what the runtime runs; its reference backend, which tests/kernels holds the
    Triton kernel to bit for bit) picks `reconstruct_scales`' bytes and gives `fake_quantize_scale_hints`' output
    bit for bit, for the trainer's own (perturbed) activations, and so does the runtime's forward at an lsb site."""
    backend = "reference"
    x_r = _x(40, 256, seed=4).to(dtype)
    g = tracefp4.compute_global_scale(x_r)
    q = tracefp4.quantize(x_r, "nvfp4", global_scale=g)
    x_t = (x_r.float() * (1 + 0.02 * torch.randn(x_r.shape, generator=torch.Generator().manual_seed(1)))).to(dtype)
    lsb = pack_scale_lsb(q.scales)
    y, s = tracefp4.fake_quantize_lsb(x_t, g, lsb, hints=q.hints, backend=backend)
    assert torch.equal(s, reconstruct_scales(x_t, g, lsb))
    want = fake_quantize_scale_hints(x_t, g, lsb, q.hints, backend="reference")
    assert torch.equal(torch.isnan(y), torch.isnan(want))
    assert torch.equal(_bits(y.nan_to_num(0.0)), _bits(want.nan_to_num(0.0)))
    rt = _runtime()
    site = moe_input_site(1)
    x = _x(33, 64)
    gs = rt.global_scales[site]
    qs = tracefp4.quantize(x, "nvfp4", global_scale=gs)
    xt = (x.float() * 1.03).to(x.dtype)
    rt.set_scale_encodings({site: "lsb"})
    lsb_s = pack_scale_lsb(qs.scales)
    with rt.using(mode="fp4_hints", provided={site: (lsb_s, qs.hints)}):
        got = rt.quant(site, xt)
    assert torch.equal(_bits(got), _bits(fake_quantize_scale_hints(xt, gs, lsb_s, qs.hints, backend="reference")))


# ------------------------------------------------------------------------------------------------ recorder, feed
def _record(sink, rows: int = 20, width: int = 256):
    rec = RolloutRecorder(sink, {"s": width}, flush_tokens=8, drain_every=2)
    rec.begin("r0")
    x = _x(rows, width)
    q = tracefp4.quantize(x, "nvfp4", global_scale=tracefp4.compute_global_scale(x))
    for p in range(rows):
        rec.record_tokens(["r0"], [p], torch.tensor([p]), torch.tensor([-0.5]))
        rec.record_sites(["r0"], [p], "s", q.hints[p:p + 1], q.scales[p:p + 1])
        rec.step()
    rec.end("r0")
    return q


def test_recorder_packs_scale_hints_for_a_lsb_store(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("s", 256, scale_encoding="lsb")])
    with store.writer() as writer:
        q = _record(writer)  # the encoding comes from the writer's store
    got = store.reader().read("r0")
    assert got.scales["s"].shape == (20, 2)
    np.testing.assert_array_equal(got.scales["s"], pack_scale_lsb(q.scales).numpy())
    np.testing.assert_array_equal(got.hints["s"], q.hints.numpy())
    sink = MemorySink({"s": 256}, scale_encodings={"s": "lsb"})
    _record(sink)
    np.testing.assert_array_equal(sink.read("r0").scales["s"], got.scales["s"])
    np.testing.assert_array_equal(sink.read("r0", features=(128, 256)).scales["s"], got.scales["s"][:, 1:])
    bytes_sink = MemorySink({"s": 256})
    _record(bytes_sink)
    np.testing.assert_array_equal(bytes_sink.read("r0").scales["s"], q.scales.numpy())  # default unchanged


def test_recorder_refuses_scales_of_another_width():
    rec = RolloutRecorder(MemorySink({"s": 256}, scale_encodings={"s": "lsb"}), {"s": 256})
    rec.begin("r0")
    with pytest.raises(RecorderError, match=r"scales \(1, 2\); expected the E4M3 bytes \[N, 16\]"):
        rec.record_sites(["r0"], [0], "s", torch.zeros(1, 32, dtype=torch.uint8), torch.zeros(1, 2, dtype=torch.uint8))
    with pytest.raises(RecorderError, match="scale encodings"):
        MemorySink({"s": 256}, scale_encodings={"s": "bits"})


def test_feed_hands_out_scale_hints_and_their_encoding(tmp_path):
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("s", 256, scale_encoding="lsb"), ts.Site("b", 256)])
    with store.writer() as w:
        w.write("t", 0, hints={"s": np.ones((5, 32), np.uint8), "b": np.ones((5, 32), np.uint8)},
                scales={"s": np.full((5, 2), 3, np.uint8), "b": np.full((5, 16), 9, np.uint8)},
                token_ids=np.arange(5), logprobs=np.zeros(5, np.float32))
    for rank in (0, 1):
        feed = HintFeed(store, tp=(rank, 2))
        assert feed.features == {"s": (128 * rank, 128 * (rank + 1)), "b": (128 * rank, 128 * (rank + 1))}
        (batch,) = list(feed.iterate([[("t", 0, 5)]]))
        assert batch.scale_encodings == {"s": "lsb", "b": "bytes"}
        assert tuple(batch.scales["s"].shape) == (5, 1) and tuple(batch.scales["b"].shape) == (5, 8)
    with pytest.raises(ConfigError, match="slices of whole 128-value blocks"):
        HintFeed(store, sites=["s"], tp=(0, 4))
    rt = _runtime()  # a store's sites that the plan does not hint are left out
    assert use_store_scale_encodings(rt, {"s": "lsb", moe_input_site(0): "lsb"}) == {moe_input_site(0): "lsb"}
    assert rt.scale_encodings == {moe_input_site(0): "lsb"}


# ------------------------------------------------------------------------------------------------ audit / planner
def test_planner_prices_both_encodings():
    from tracerl.audit import plan as ap

    assert ap.site_bytes_per_token(2048) == 384 and ap.site_bytes_per_token(2048, "lsb") == 272
    assert ap.site_bytes_per_token(256, "lsb") == 34 and ap.site_bytes_per_token(48, "lsb") == 7
    with pytest.raises(ConfigError, match="unknown scale encoding"):
        ap.site_bytes_per_token(256, "bits")
    model = build_model(TinyMoESpec(**TINY), seed=0)
    units = ap.attribution_groups(plan_sites(model, hint_layers="all"), 2, 2)
    moe = [u for u in units if u.kind == "moe_input"]
    point = ap.curve_point(len(moe), moe, 1e-3, 1e-4, 5e-4)
    widths = len([s for u in moe for s in u.sites]) * 64
    assert point["bytes_per_token_by_encoding"] == {"bytes": widths // 8 + widths // 16,
                                                    "lsb": point["bytes_per_token"] - len(point["sites"]) * 3}
