"""Margin exceptions (`tracerl.hints.compact`): the trainer's rule reproduces the rollout's codes wherever its value
lies within the stored margin, margin 0 is round-to-nearest with own scales and a margin covering everything is
today's hint-guided rounding bit for bit, the position codings round-trip with the byte counts they claim, and
bad input raises typed errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import tracefp4
from helpers.fp4 import assert_bits_equal
from tracerl.errors import ConfigError, HintCodingError
from tracerl.hints import compact as C

INF = math.inf
CODINGS = ["bitmap", "block-bitmap", "gamma", "rice0", "rice2", "rice5"]


def _rollout(t=48, w=256, seed=0, dtype=torch.float32):
    """Rollout activations with a spread of magnitudes (so every ladder interval and many E4M3 binades occur),
    their global scale and today's quantization."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(t, w, generator=gen) * torch.exp(2 * torch.randn(t, 1, generator=gen))).to(dtype)
    g = tracefp4.compute_global_scale(x)
    return x, g, tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")


def _perturb(x, rel, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (x.float() * (1 + rel * torch.randn(x.shape, generator=gen))).to(x.dtype)


def _codes(q):
    return tracefp4.unpack_codes(q.codes)


# ---- the exactness property ---------------------------------------------------------------------------------
@pytest.mark.parametrize("margin,scale_margin,payload", [(0.02, 0.1, "byte"), (0.1, 0.3, "byte"), (0.25, 0.2, "lsb"),
                                                         (0.5, 0.5, "lsb")])
def test_codes_equal_inside_the_margin_and_mismatches_outside_are_counted(margin, scale_margin, payload):
    x, g, q = _rollout()
    xt = _perturb(x, 0.02)  # 2% noise: many values move further than the smaller margins, some blocks change scale
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, margin, scale_margin, scale_payload=payload)
    rec = C.reconstruct(enc, xt, g)
    st = C.margin_stats(enc, rec, _codes(q), x, xt, g, q.scales)
    assert st["within_margin"] > 0.2 * st["values"]
    assert st["within_margin_mismatch"] == 0
    # every mismatch is outside the margin, and the counts add up
    assert st["moved_mismatch"] == st["code_mismatch"] == st["unmarked_mismatch"] + st["marked_mismatch"]
    assert st["code_mismatch"] <= st["value_mismatch"] <= st["code_mismatch"] + st["wrong_scale_values"]
    # independently of margin_stats: positions with the reconstructed scale, the codes compared up to +-0
    u_r = C.ladder_position(x.float() * _r(q.scales, g))
    u_t = C.ladder_position(xt.float() * _r(rec.scales_e4m3, g))
    inside = (u_t - u_r).abs() < min(margin, 0.5)
    c_t, c_r = rec.codes_u8, _codes(q)
    equal = (c_t == c_r) | (((c_t & 7) == 0) & ((c_r & 7) == 0))
    assert bool(equal[inside].all())
    # blocks: inside the scale margin (or marked, with whole bytes) the scale byte is the rollout's
    w_r = C.scale_position(_t(x, g))
    w_t = C.scale_position(_t(xt, g))
    ok = (w_t - w_r).abs() < (min(scale_margin, 0.5) if payload == "lsb" else scale_margin)
    if payload == "byte":
        ok |= enc.scale_mask
    assert ok.sum() > 0.2 * ok.numel()
    assert torch.equal(rec.scales_e4m3[ok], q.scales[ok])


def test_the_noise_of_the_property_test_does_cross_boundaries():
    """The property test above would pass trivially if nothing differed: round-to-nearest on the same noise
    mismatches codes and scales."""
    x, g, q = _rollout()
    xt = _perturb(x, 0.02)
    own = tracefp4.quantize(xt, "nvfp4", global_scale=g, backend="reference")
    assert int((own.scales != q.scales).sum()) > 20
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, 0.02, 0.1)
    st = C.margin_stats(enc, C.reconstruct(enc, xt, g), _codes(q), x, xt, g, q.scales)
    assert st["code_mismatch"] > 0 and st["unmarked_mismatch"] > 0


def _r(scales, g):
    from tracefp4 import reference as ref
    r = ref.div_rn(ref.div_rn(torch.ones_like(g), g), ref.e4m3_decode(scales))
    return r.repeat_interleave(16, dim=1)


def _t(x, g):
    from tracefp4 import reference as ref
    a = x.float().abs().reshape(x.shape[0], -1, 16).amax(-1)
    return ref.div_rn(ref.div_rn(a, 6.0), g).clamp(2.0**-9, 448.0)


def test_a_value_exactly_at_the_margin_is_unmarked_and_one_just_inside_keeps_its_code():
    """g = 1 and a block amax of 6 give scale 1.0 and v = x. 0.6875 sits at u = 1.375, 1/8 from the boundary
    u = 1.5 (x = 0.75): with margin 1/8 it is not marked; the trainer at 0.75 - 2^-12 (inside) rounds to code 1 as
    the rollout did, at 0.75 (a move of exactly the margin: outside) the tie goes to code 2 and is counted."""
    m = 0.125
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1], x[0, 2] = 6.0, 0.6875, 0.7
    g = torch.tensor(1.0)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    assert q.scales[0, 0].item() == 0x38  # E4M3 1.0
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, m, 0.0)
    assert enc.value_mask[0].tolist()[:3] == [False, False, True]  # 0.7: u = 1.4, 0.1 from the boundary
    for xt1, code, outside in ((0.75 - 2.0**-12, 1, 0), (0.75, 2, 1)):
        xt = x.clone()
        xt[0, 1] = xt1
        rec = C.reconstruct(enc, xt, g)
        assert rec.codes_u8[0, 1].item() == code
        st = C.margin_stats(enc, rec, _codes(q), x, xt, g, q.scales)
        assert (st["within_margin_mismatch"], st["moved_mismatch"]) == (0, outside)


def test_a_block_with_the_rollouts_codes_but_another_scale_counts_as_value_mismatches():
    """g = 1: the rollout's block (amax 6) has scale 1.0; the trainer's (amax 6.6) has 1.125 and, with its own
    scale (nothing stored), the same codes 7 and 2 for 6.6 and 1.0: 0 code mismatches, 2 value mismatches (the
    zeros dequantize to 0 either way)."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6.0, 1.0
    xt = x.clone()
    xt[0, 0] = 6.6
    g = torch.tensor(1.0)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, 0.0, 0.0)
    st = C.margin_stats(enc, C.reconstruct(enc, xt, g), _codes(q), x, xt, g, q.scales)
    assert (st["code_mismatch"], st["scale_mismatch"], st["value_mismatch"]) == (0, 1, 2)


# ---- the two ends of the margin ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_margin_zero_stores_nothing_and_is_round_to_nearest(dtype):
    x, g, q = _rollout(dtype=dtype)
    xt = _perturb(x, 0.01)
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, 0.0, 0.0)
    assert int(enc.value_mask.sum()) == int(enc.scale_mask.sum()) == 0
    assert enc.hint_bits.numel() == enc.scale_bytes.numel() == 0
    assert_bits_equal(C.fake_quantize_compact(enc, xt, g, backend="reference"),
                      tracefp4.fake_quantize(xt, "nvfp4", global_scale=g, backend="reference"))
    own = tracefp4.quantize(xt, "nvfp4", global_scale=g, backend="reference")
    rec = C.reconstruct(enc, xt, g)
    assert torch.equal(rec.codes_u8, _codes(own)) and torch.equal(rec.scales_e4m3, own.scales)
    coding, _ = C.choose_coding(enc)
    packed = C.pack_rows(enc, coding)
    assert packed.nbytes == x.shape[0]  # gamma(1) + gamma(1): two bits, one byte per row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_margin_covering_everything_is_todays_hint_guided_rounding_bit_for_bit(dtype):
    x, g, q = _rollout(dtype=dtype)
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30], dtype=dtype)
    xt = _perturb(x, 0.05)
    xt[1, :4] = torch.tensor([float("nan"), -float("inf"), 0.0, -0.0], dtype=dtype)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    today = tracefp4.fake_quantize(xt, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints, backend="reference")
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, INF, INF)
    assert bool(enc.value_mask.all()) and bool(enc.scale_mask.all())
    assert_bits_equal(C.fake_quantize_compact(enc, xt, g, backend="reference"), today)
    rec = C.reconstruct(enc, xt, g)
    assert torch.equal(rec.scales_e4m3, q.scales) and torch.equal(rec.hints_packed, q.hints)


def test_a_finite_margin_that_covers_every_value_is_hint_guided_rounding_too():
    x, g, q = _rollout()
    xt = _perturb(x, 0.05)
    # every |u| of these values is below 100, so d(u) < 100 - 6.5 everywhere; every scale distance is <= 1/2
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, 100.0, 0.75)
    assert bool(enc.value_mask.all()) and bool(enc.scale_mask.all())
    assert_bits_equal(C.fake_quantize_compact(enc, xt, g, backend="reference"),
                      tracefp4.fake_quantize(xt, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints,
                                             backend="reference"))


def test_scale_hints_reproduce_the_rollout_scales_under_small_noise():
    x, g, q = _rollout()
    xt = _perturb(x, 0.002)  # moves w by ~0.03: every block stays within half an E4M3 step
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, INF, INF, scale_payload="lsb")
    assert set(enc.scale_bytes.tolist()) <= {0, 1}
    rec = C.reconstruct(enc, xt, g)
    assert torch.equal(rec.scales_e4m3, q.scales)
    assert_bits_equal(C.fake_quantize_compact(enc, xt, g, backend="reference"),
                      tracefp4.fake_quantize(xt, "nvfp4", global_scale=g, scales=q.scales, hints=q.hints,
                                             backend="reference"))


def test_hints_that_disagree_with_the_activation_are_always_marked():
    """An engine whose arithmetic put a value on the other side of a boundary: its hint bit is kept at any margin."""
    x, g, q = _rollout(t=4)
    bits = tracefp4.unpack_hints(q.hints).to(torch.uint8)
    bits[2, 17] ^= 1
    enc = C.encode_margin_exceptions(x, g, q.scales, tracefp4.pack_hints(bits), 0.0, 0.0)
    assert enc.value_mask.nonzero().tolist() == [[2, 17]]
    assert enc.hint_bits.tolist() == [int(bits[2, 17])]


# ---- distances ------------------------------------------------------------------------------------------
def test_ladder_positions_and_distances_on_every_ladder_value_and_boundary():
    ladder = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    assert C.ladder_position(ladder).tolist() == list(range(8))
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert C.ladder_position(mids).tolist() == [k + 0.5 for k in range(7)]
    assert C.boundary_distance(C.ladder_position(mids)).tolist() == [0.0] * 7
    assert C.boundary_distance(C.ladder_position(ladder)).tolist() == [0.5] * 8
    assert C.boundary_distance(C.ladder_position(torch.tensor([-2.2, 8.0]))).tolist() == pytest.approx([0.3, 1.5])
    # every positive E4M3 value sits at its own byte, every E4M3 midpoint half way
    b = torch.arange(1, 127, dtype=torch.uint8)
    vals = tracefp4.reference.e4m3_decode(b)
    assert C.scale_position(vals).tolist() == list(range(1, 127))
    mid = (vals[:-1].double() + vals[1:].double()) / 2
    assert C.scale_position(mid.float()).tolist() == [k + 0.5 for k in range(1, 126)]


# ---- position coding ------------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", ["byte", "lsb"])
@pytest.mark.parametrize("margin,scale_margin", [(0.0, 0.0), (0.03, 0.1), (0.3, 0.4), (INF, INF)])
def test_pack_unpack_round_trip_with_the_byte_count_it_claims(margin, scale_margin, payload):
    x, g, q = _rollout(t=24)
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, margin, scale_margin, scale_payload=payload)
    best, totals = C.choose_coding(enc)
    assert totals["values"][best.values] == min(totals["values"].values())
    for values in CODINGS:
        for blocks in ("bitmap", "gamma", "rice1", "block-bitmap"):
            coding = C.SiteCoding(values, blocks)
            packed = C.pack_rows(enc, coding)
            assert C.unpack_rows(packed) == enc, coding
            per_row = C.packed_row_bytes(enc, coding)
            assert np.array_equal(np.diff(packed.offsets), per_row) and packed.nbytes == per_row.sum()
            vm, sm = enc.value_mask.numpy(), enc.scale_mask.numpy()
            bits = (C.row_bits(vm, values) + vm.sum(1) + C.row_bits(sm, blocks)
                    + (1 if payload == "lsb" else 8) * sm.sum(1))
            assert np.array_equal(per_row, (bits + 7) // 8)


@pytest.mark.parametrize("payload,per_row", [("byte", 256 // 8 + 256 // 16), ("lsb", 256 // 8 + 256 // 128)])
def test_todays_layout_is_margin_inf_with_every_position_marked(payload, per_row):
    """m = m_s = inf picks the ``all`` coding: no position bits, every hint bit and every scale byte: today's
    W/8 + W/16 bytes per row (with scale hints W/8 + W/128)."""
    x, g, q = _rollout(t=8)
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, INF, INF, scale_payload=payload)
    coding, totals = C.choose_coding(enc)
    assert coding == C.SiteCoding("all", "all") and totals["values"]["all"] == 0
    packed = C.pack_rows(enc, coding)
    assert packed.nbytes == 8 * per_row and C.today_bytes_per_token([256]) == 48
    assert C.unpack_rows(packed) == enc
    partial = C.encode_margin_exceptions(x, g, q.scales, q.hints, 0.1, INF)
    assert "all" not in C.choose_coding(partial)[1]["values"]
    with pytest.raises(ConfigError, match="every position"):
        C.pack_rows(partial, C.SiteCoding("all", "all"))


def test_row_bits_and_bytes_of_a_known_row():
    """Positions {0, 3, 10} of a row of 16 and one marked block, hints 1, 0, 1, scale byte 0x38.
    gamma: gamma(4) = 00100, gaps 1, 3, 7 -> 1, 011, 00111; rice1: gaps - 1 = 0, 2, 6 -> 0|0, 10|0, 1110|0."""
    mask = np.zeros((1, 16), dtype=bool)
    mask[0, [0, 3, 10]] = True
    assert C.row_bits(mask, "bitmap").tolist() == [16]
    assert C.row_bits(mask, "block-bitmap").tolist() == [17]
    assert C.row_bits(mask, "gamma").tolist() == [5 + 1 + 3 + 5]
    assert C.row_bits(mask, "rice1").tolist() == [5 + 2 + 3 + 5]
    assert C.row_bits(np.zeros((2, 16), dtype=bool), "gamma").tolist() == [1, 1]
    enc = C.MarginExceptions(torch.from_numpy(mask), torch.tensor([1, 0, 1], dtype=torch.uint8),
                             torch.ones(1, 1, dtype=torch.bool), torch.tensor([0x38], dtype=torch.uint8), 0.1, 0.1)
    packed = C.pack_rows(enc, C.SiteCoding("gamma", "gamma"))
    # 00100 1 011 00111 | 101 | gamma(2) = 010, gap 1 = 1 | 00111000 | padding 000
    want = "00100" "1" "011" "00111" "101" "010" "1" "00111000" "000"
    assert "".join(f"{b:08b}" for b in packed.data.tolist()) == want
    assert packed.offsets.tolist() == [0, 4]
    rice = C.pack_rows(enc, C.SiteCoding("rice1", "bitmap"))
    want = "00100" "00" "100" "11100" "101" "1" "00111000" "00000"
    assert "".join(f"{b:08b}" for b in rice.data.tolist()) == want


def test_long_gaps_in_rice0_round_trip():
    """Rice with k = 0 writes a gap of 200 as 199 ones: split in pieces of at most 62 bits."""
    mask = torch.zeros(2, 256, dtype=torch.bool)
    mask[0, [0, 200, 255]] = True
    enc = C.MarginExceptions(mask, torch.tensor([1, 1, 0], dtype=torch.uint8), torch.zeros(2, 16, dtype=torch.bool),
                             torch.zeros(0, dtype=torch.uint8), 0.1, 0.1)
    packed = C.pack_rows(enc, C.SiteCoding("rice0", "gamma"))
    assert C.unpack_rows(packed) == enc
    assert C.row_bits(mask.numpy(), "rice0").tolist() == [5 + 1 + 200 + 55, 1]


def test_damaged_rows_raise_hint_coding_errors():
    x, g, q = _rollout(t=4)
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, 0.1, 0.2)
    packed = C.pack_rows(enc, C.SiteCoding("gamma", "gamma"))
    short = C.PackedRows(packed.data[:-1], np.minimum(packed.offsets, packed.data.size - 1), 256, packed.coding,
                         0.1, 0.2)
    with pytest.raises(HintCodingError):
        C.unpack_rows(short)
    extra = np.concatenate([packed.data, np.full(1, 0xFF, np.uint8)])
    with pytest.raises(HintCodingError, match="after the last field"):
        C.unpack_rows(C.PackedRows(extra, np.concatenate([packed.offsets[:-1], [extra.size]]), 256, packed.coding,
                                   0.1, 0.2))
    with pytest.raises(HintCodingError, match="do not cover"):
        C.unpack_rows(C.PackedRows(packed.data, packed.offsets[:-1], 256, packed.coding, 0.1, 0.2))
    bad = C.MarginExceptions(enc.value_mask, enc.hint_bits[1:], enc.scale_mask, enc.scale_bytes, 0.1, 0.2)
    with pytest.raises(HintCodingError, match="hold"):
        C.reconstruct(bad, x, g)


# ---- typed errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("margin", [-0.1, float("nan"), True, "0.1", None])
def test_bad_margins_raise_config_error(margin):
    x, g, q = _rollout(t=2)
    with pytest.raises(ConfigError, match="margin"):
        C.encode_margin_exceptions(x, g, q.scales, q.hints, margin, 0.1)
    with pytest.raises(ConfigError, match="scale_margin"):
        C.encode_margin_exceptions(x, g, q.scales, q.hints, 0.1, margin)


def test_bad_tensors_raise_typed_errors():
    x, g, q = _rollout(t=2)
    enc_args = (g, q.scales, q.hints, 0.1, 0.1)
    with pytest.raises(tracefp4.DTypeError):
        C.encode_margin_exceptions(x.to(torch.int32), *enc_args)
    with pytest.raises(tracefp4.ShapeError):
        C.encode_margin_exceptions(x.reshape(-1), *enc_args)
    with pytest.raises(tracefp4.ShapeError):
        C.encode_margin_exceptions(x[:, :24], g, q.scales, q.hints[:, :3], 0.1, 0.1)
    with pytest.raises(tracefp4.DTypeError, match="scales_e4m3"):
        C.encode_margin_exceptions(x, g, q.scales.float(), q.hints, 0.1, 0.1)
    with pytest.raises(tracefp4.ShapeError, match="scales_e4m3"):
        C.encode_margin_exceptions(x, g, q.scales[:, :3], q.hints, 0.1, 0.1)
    with pytest.raises(tracefp4.ShapeError, match="hints_packed"):
        C.encode_margin_exceptions(x, g, q.scales, q.hints[:1], 0.1, 0.1)
    with pytest.raises(ConfigError, match="global_scale"):
        C.encode_margin_exceptions(x, -1.0, q.scales, q.hints, 0.1, 0.1)
    with pytest.raises(tracefp4.ShapeError, match="global_scale"):
        C.encode_margin_exceptions(x, torch.ones(2), q.scales, q.hints, 0.1, 0.1)
    with pytest.raises(ConfigError, match="scale_payload"):
        C.encode_margin_exceptions(x, *enc_args, scale_payload="nibble")
    enc = C.encode_margin_exceptions(x, *enc_args)
    with pytest.raises(tracefp4.ShapeError, match="does not match"):
        C.reconstruct(enc, x[:1], g)
    with pytest.raises(ConfigError, match="position coding"):
        C.pack_rows(enc, C.SiteCoding("golomb", "gamma"))
    with pytest.raises(ConfigError, match="block-bitmap"):
        C.row_bits(np.zeros((1, 8), dtype=bool), "block-bitmap")
    # every error is also the built-in type callers catch
    assert issubclass(tracefp4.DTypeError, TypeError) and issubclass(HintCodingError, ValueError)
