"""The Triton margin-row decoder (`tracerl.hints.compact_triton`, under TRITON_INTERPRET=1 on CPU, compiled on a
GPU): straight into `compact.DenseExceptions`, equal to numpy's `compact.unpack_rows` then `compact.densify` for
every coding and payload, the same errors for damaged rows, bad offsets and unknown codings; `compact.fill` and
`MarginSites` on the dense planes give the bits `compact.reconstruct` gives.

Sizes are small: the interpreter walks each row bit by bit (widths <= 256, a few rows)."""

from __future__ import annotations

import helpers.fp4  # noqa: F401  (selects Triton's interpreter without CUDA, before Triton loads)
import numpy as np
import pytest
import torch
from helpers.fp4 import DEVICE, HAS_TRITON
from helpers.margin import coding_error, damaged_rows, random_exceptions

from tracerl.errors import ConfigError, HintCodingError
from tracerl.hints import compact as C

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="no triton")

CODINGS = ["all", "bitmap", "block-bitmap", "gamma", "rice0", "rice2", "rice7"]


def _dense(p: C.PackedRows) -> C.DenseExceptions:
    from tracerl.hints.compact_triton import unpack_rows_dense

    return unpack_rows_dense(p, DEVICE)


def _want(p: C.PackedRows) -> C.DenseExceptions:
    return C.densify(C.unpack_rows(p)).to(DEVICE)


def _case(seed: int, values: str, blocks: str, payload: str, t: int = 5, w: int = 256, p_v: float | None = None):
    rng = np.random.default_rng(seed)
    p_v = float(rng.choice([0.0, 0.02, 0.2, 0.7])) if p_v is None else p_v
    enc = random_exceptions(rng, t, w, p_v, float(rng.choice([0.0, 0.15, 0.8])), payload, values == "all",
                            blocks == "all")
    return rng, enc, C.pack_rows(enc, C.SiteCoding(values, blocks))


@pytest.mark.parametrize("values", CODINGS)
def test_every_value_coding_decodes_as_numpy(values):
    """Each value coding with three block codings (every block coding three times over the parametrization)."""
    v = CODINGS.index(values)
    for j in (0, 1, 3):
        blocks = CODINGS[(v + j) % len(CODINGS)]
        w = 256 if blocks == "block-bitmap" else 64  # block-bitmap needs a multiple of 16 blocks
        _, enc, p = _case(10 * v + j, values, blocks, ["byte", "lsb"][j % 2], t=3, w=w)
        from tracerl.hints.compact_triton import _launch

        (got,), flags, _ = _launch([p], torch.device(DEVICE))
        assert not flags.any(), "a row that decodes was flagged (it would take the slow path)"
        assert got == _want(p), (values, blocks)
        assert got.shape == enc.shape and got.value_marks.device.type == torch.device(DEVICE).type


@pytest.mark.parametrize("w,t", [(16, 4), (48, 3), (256, 0)])
def test_widths_rows_and_dense_marks(w, t):
    blocks = "block-bitmap" if (w // 16) % 16 == 0 else "gamma"
    for seed, (values, payload) in enumerate([("gamma", "byte"), ("rice1", "lsb"), ("bitmap", "lsb")]):
        _, _, p = _case(seed, values, blocks, payload, t=t, w=w)
        assert _dense(p) == _want(p)


def test_long_unary_runs_and_far_positions():
    """Rice 0 of a gap of ~250 is a run of ~250 ones: the unary part spans several 57-bit windows."""
    vm = torch.zeros(2, 256, dtype=torch.bool)
    vm[0, [0, 255]] = True
    vm[1, [200]] = True
    sm = torch.zeros(2, 16, dtype=torch.bool)
    sm[1, 15] = True
    enc = C.MarginExceptions(vm, torch.tensor([1, 0, 1], dtype=torch.uint8), sm, torch.tensor([77], dtype=torch.uint8),
                             0.1, 0.2, "byte")
    for coding in (C.SiteCoding("rice0", "rice0"), C.SiteCoding("gamma", "bitmap"), C.SiteCoding("rice7", "all")):
        if coding.blocks == "all":
            enc = C.MarginExceptions(vm, enc.hint_bits, torch.ones(2, 16, dtype=torch.bool),
                                     torch.arange(32, dtype=torch.uint8), 0.1, 0.2, "byte")
        p = C.pack_rows(enc, coding)
        assert _dense(p) == _want(p), coding


@pytest.mark.parametrize("seed", range(4))
def test_damaged_rows_raise_what_numpy_raises(seed):
    values, blocks = [("gamma", "bitmap"), ("rice2", "gamma"), ("bitmap", "rice0"), ("block-bitmap", "gamma")][seed]
    wide = "block-bitmap" in (values, blocks)
    rng, _, p = _case(seed, values, blocks, ["byte", "lsb"][seed % 2], t=3, w=256 if wide else 64,
                      p_v=0.05 if wide else None)
    for data, offsets in damaged_rows(rng, p):
        bad = C.PackedRows(data, offsets, p.width, p.coding, p.margin, p.scale_margin, p.scale_payload)
        want = coding_error(C.unpack_rows, bad)
        assert coding_error(_dense, bad) == want, (values, blocks)
        if want is None:
            assert _dense(bad) == _want(bad)


def test_bad_offsets_and_trailing_bits():
    _, _, p = _case(3, "gamma", "gamma", "byte", t=3, w=64)
    grown = np.concatenate([p.data, np.zeros(1, np.uint8)])  # one zero byte more after the last row
    shifted = p.offsets.copy()
    shifted[0] = 1
    for data, offsets, match in ((p.data, shifted, "do not cover"),
                                 (grown, np.concatenate([p.offsets[:-1], [grown.size]]), "after the last field")):
        bad = C.PackedRows(data, offsets, 64, p.coding, 0.1, 0.2)
        want = coding_error(C.unpack_rows, bad)
        assert want is not None and coding_error(_dense, bad) == want and match in want[1]


def test_unknown_codings_raise_config_error_before_decoding():
    from tracerl.hints.compact_triton import unpack_sites_dense

    _, _, p = _case(1, "gamma", "bitmap", "byte", t=2, w=64)
    bad = C.PackedRows(p.data, p.offsets, 64, C.SiteCoding("golomb", "bitmap"), 0.1, 0.2)
    with pytest.raises(ConfigError, match="position coding"):
        unpack_sites_dense({"a": p, "b": bad}, DEVICE)


def test_several_sites_one_call_and_the_first_failing_site_raises():
    from tracerl.hints.compact_triton import unpack_sites_dense

    parts = {f"s{i}": _case(20 + i, c, "bitmap", "lsb", t=3, w=64)[2] for i, c in enumerate(["gamma", "rice1", "all"])}
    got = unpack_sites_dense(parts, DEVICE)
    assert list(got) == list(parts) and all(got[s] == _want(p) for s, p in parts.items())
    as_tensors = {s: C.PackedRows(torch.from_numpy(p.data), torch.from_numpy(p.offsets), p.width, p.coding, p.margin,
                                  p.scale_margin, p.scale_payload) for s, p in parts.items()}  # tensors read as arrays
    assert all(unpack_sites_dense(as_tensors, DEVICE)[s] == got[s] for s in parts)
    p = parts["s1"]
    cut = C.PackedRows(p.data[:-1], np.minimum(p.offsets, p.data.size - 1), 64, p.coding, p.margin, p.scale_margin,
                       p.scale_payload)
    want = coding_error(C.unpack_rows, cut)
    assert want is not None and want[0] is HintCodingError
    assert coding_error(unpack_sites_dense, dict(parts, s1=cut), DEVICE) == want


def test_sites_of_one_coding_share_a_launch_with_their_own_rows_and_errors():
    """Sites of one coding and width are stacked into one launch (with different row counts, and an empty site):
    each gets its own rows back, and a damaged site among them raises what numpy raises for it."""
    from tracerl.hints.compact_triton import unpack_sites_dense

    parts = {f"s{i}": _case(40 + i, "rice2", "gamma", "lsb", t=t, w=64)[2] for i, t in enumerate([3, 1, 0, 4])}
    parts["other"] = _case(50, "gamma", "gamma", "lsb", t=2, w=64)[2]
    got = unpack_sites_dense(parts, DEVICE)
    assert list(got) == list(parts) and all(got[s] == _want(p) for s, p in parts.items())
    p = parts["s3"]
    data = p.data.copy()
    data[-1] ^= 0x01  # a trailing bit of the last row
    want = coding_error(C.unpack_rows, C.PackedRows(data, p.offsets, 64, p.coding, p.margin, p.scale_margin, "lsb"))
    assert want is not None
    damaged = dict(parts, s3=C.PackedRows(data, p.offsets, 64, p.coding, p.margin, p.scale_margin, "lsb"))
    assert coding_error(unpack_sites_dense, damaged, DEVICE) == want


@pytest.mark.parametrize("payload", ["byte", "lsb"])
def test_fill_and_margin_sites_on_dense_planes_equal_reconstruct(payload):
    rng = np.random.default_rng(7)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(0)) * 3
    enc = random_exceptions(rng, 6, 64, 0.3, 0.5, payload)
    p = C.pack_rows(enc, C.SiteCoding("gamma", "bitmap"))
    rec = C.reconstruct(C.unpack_rows(p), x, 0.05)
    dense = _dense(p).to("cpu")
    scales, hints = C.fill(dense, x, 0.05)
    assert torch.equal(scales, rec.scales_e4m3) and torch.equal(hints, rec.hints_packed)
    assert torch.equal(C.reconstruct(dense, x, 0.05).codes_u8, rec.codes_u8)
    assert torch.equal(C.fake_quantize_compact(dense, x, 0.05), C.fake_quantize_compact(enc, x, 0.05))
    with pytest.raises(Exception, match="does not match"):
        C.fill(dense, x[:5], 0.05)


@pytest.mark.parametrize("counts,w", [([3], 48), ([1, 2], 48), ([5, 4], 16), ([7], 64)])
def test_the_kernel_sees_aligned_arrays_and_unspecialized_counts(monkeypatch, counts, w):
    """Whatever the row counts, total bytes and width, every array the decode kernel gets starts 16-byte aligned
    and its row and bit counts are not specialized: Triton specializes a pointer on 16-byte alignment and an int
    on ``== 1`` / ``% 16``, so a micro-batch of another size compiled the kernel again mid-training (a 5.5 s step)."""
    from tracerl.hints import compact_triton as CT

    k = CT._unpack_dense_kernel
    # the interpreter's function keeps the decorator's arguments as given; a compiled JITFunction keeps them as
    # argument indices (triton 3.x before 3.6) or names (3.6)
    kept = k.kwargs["do_not_specialize"] if hasattr(k, "kwargs") else [
        n if isinstance(n, str) else k.arg_names[n] for n in k.do_not_specialize]
    assert {"T", "NBITS"} <= set(kept)
    seen = []
    real = CT._unpack_dense_kernel

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                seen.append(args)
                return real[grid](*args, **kw)
            return launch

    monkeypatch.setattr(CT, "_unpack_dense_kernel", Spy())
    parts = {f"s{i}": _case(60 + i, "gamma", "bitmap", "byte", t=t, w=w)[2] for i, t in enumerate(counts)}
    got = CT.unpack_sites_dense(parts, DEVICE)
    assert all(got[s] == _want(p) for s, p in parts.items())
    (args,) = seen
    arrays = [a for a in args if isinstance(a, torch.Tensor)]
    assert len(arrays) == 7  # data, offsets, four planes, flags
    assert all(a.data_ptr() % 16 == 0 for a in arrays), [a.data_ptr() % 16 for a in arrays]
