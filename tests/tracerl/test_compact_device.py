"""The torch margin-row codec (`tracerl.hints.compact_device`) against the numpy one (`compact.pack_rows` /
`compact.unpack_rows`), on the CPU (the torch code is device-agnostic; the CPU run is the one CI can make): the
same bytes for random masks of every coding and payload and for the edge cases (no rows, rows without marks, every
position marked, Rice unary runs past the numpy packer's 62-bit pieces), the same typed error for the same bad
input (damaged rows included: the same `HintCodingError` message), the number of host reads per call, and the
recorder / feed / `decode_margin` device paths giving what their host paths give."""

from __future__ import annotations

import types
from collections import Counter

import numpy as np
import pytest
import torch
from helpers.capture import HostTraffic
from helpers.margin import CODINGS, cases, coding_error, damaged_rows, random_exceptions

import tracefp4
import tracestore as ts
from tracerl.errors import ConfigError, HintCodingError, RecorderError
from tracerl.hints import HintFeed, MicroBatch, Segment, decode_margin, read_packed
from tracerl.hints import compact as C
from tracerl.hints import compact_device as D
from tracerl.rollout import RolloutRecorder

VALUE_CODINGS = ["all", "bitmap", "block-bitmap", "gamma", "rice0", "rice1", "rice2", "rice4", "rice7", "rice30"]
BLOCK_CODINGS = ["all", "bitmap", "block-bitmap", "gamma", "rice0", "rice3"]


def _torch_pack(enc, coding):
    data, offsets = D.pack_rows_torch(enc, coding)
    assert data.dtype == torch.uint8 and offsets.dtype == torch.int64
    assert data.device == offsets.device == enc.value_mask.device
    return data.numpy(), offsets.numpy()


def _torch_unpack(packed: C.PackedRows, **kw) -> C.MarginExceptions:
    return D.unpack_rows_torch(packed.data, packed.offsets, packed.width, packed.coding, packed.margin,
                               packed.scale_margin, packed.scale_payload, **kw)


def _same_bytes(enc, coding) -> C.PackedRows:
    """Pack ``enc`` both ways, check the bytes are equal and both decoders give ``enc`` back."""
    want = C.pack_rows(enc, coding)
    data, offsets = _torch_pack(enc, coding)
    np.testing.assert_array_equal(data, want.data, err_msg=str(coding))
    np.testing.assert_array_equal(offsets, want.offsets, err_msg=str(coding))
    got = _torch_unpack(want)
    assert got == C.unpack_rows(want) == enc, coding
    assert got.value_mask.dtype == got.scale_mask.dtype == torch.bool
    assert got.hint_bits.dtype == got.scale_bytes.dtype == torch.uint8
    return want


# ---- equal bytes --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(3))
def test_random_rows_pack_and_unpack_as_numpy_does(seed):
    """The numpy decoder tests' random cases: widths 16..2048, 0..64 rows, densities 0..1, mixed codings."""
    for _, enc, coding in cases(seed, 40):
        _same_bytes(enc, coding)


@pytest.mark.parametrize("payload", ["byte", "lsb"])
@pytest.mark.parametrize("values", VALUE_CODINGS)
def test_every_coding_and_payload_at_odd_sizes(values, payload):
    rng = np.random.default_rng(sum(map(ord, values + payload)))
    for blocks in BLOCK_CODINGS:
        for t, w in ((1, 256), (7, 512), (19, 256)):
            for p in (0.0, 0.02, 0.4, 1.0):
                enc = random_exceptions(rng, t, w, p, float(rng.choice([0.0, 0.2, 1.0])), payload,
                                        full_values=values == "all", full_blocks=blocks == "all")
                _same_bytes(enc, C.SiteCoding(values, blocks))


def _enc_of(mask_v: np.ndarray, mask_b: np.ndarray, payload="byte", seed=0) -> C.MarginExceptions:
    rng = np.random.default_rng(seed)
    top = 2 if payload == "lsb" else 256
    return C.MarginExceptions(torch.from_numpy(mask_v), torch.from_numpy(rng.integers(0, 2, int(mask_v.sum()),
                                                                                      dtype=np.uint8)),
                              torch.from_numpy(mask_b), torch.from_numpy(rng.integers(0, top, int(mask_b.sum()),
                                                                                      dtype=np.uint8)),
                              0.1, 0.2, payload)


@pytest.mark.parametrize("coding", [C.SiteCoding(v, b) for v in VALUE_CODINGS[1:] for b in ("gamma", "bitmap")])
def test_no_rows_empty_rows_and_full_rows(coding):
    w = 256
    for t in (0, 1, 5):
        _same_bytes(_enc_of(np.zeros((t, w), bool), np.zeros((t, w // 16), bool)), coding)  # nothing marked
        _same_bytes(_enc_of(np.ones((t, w), bool), np.ones((t, w // 16), bool), "lsb"), coding)  # everything
    mixed = np.zeros((6, w), bool)
    mixed[1, [0, 255]] = mixed[3] = mixed[4, 17] = True  # rows 0, 2, 5 without marks
    blocks = np.zeros((6, w // 16), bool)
    blocks[5, 15] = True
    packed = _same_bytes(_enc_of(mixed, blocks), coding)
    assert packed.offsets[-1] == packed.data.size


def test_long_rice_unary_runs():
    """Rice k = 0 and k = 1 with gaps whose unary part is longer than 62 ones (numpy writes it in pieces), up to the
    longest the numpy packer takes (63 pieces: q = 3905), in a row of 4096."""
    w = 4096
    mask = np.zeros((3, w), bool)
    mask[0, [0, 200, 263, 4095]] = True  # gaps 1, 200, 63, 3832
    mask[1, [3905, 4000]] = True  # the first gap: q = 3905 at k = 0
    mask[2, [62, 125]] = True  # q = 62 and 62: exactly one full piece
    for k in (0, 1, 3):
        _same_bytes(_enc_of(mask, np.zeros((3, w // 16), bool)), C.SiteCoding(f"rice{k}", "gamma"))


def test_the_bits_of_a_known_row():
    """compact's hand-written example row, packed by torch."""
    mask = np.zeros((1, 16), dtype=bool)
    mask[0, [0, 3, 10]] = True
    enc = C.MarginExceptions(torch.from_numpy(mask), torch.tensor([1, 0, 1], dtype=torch.uint8),
                             torch.ones(1, 1, dtype=torch.bool), torch.tensor([0x38], dtype=torch.uint8), 0.1, 0.1)
    data, offsets = _torch_pack(enc, C.SiteCoding("gamma", "gamma"))
    want = "00100" "1" "011" "00111" "101" "010" "1" "00111000" "000"
    assert "".join(f"{b:08b}" for b in data.tolist()) == want and offsets.tolist() == [0, 4]
    data, _ = _torch_pack(enc, C.SiteCoding("rice1", "bitmap"))
    assert "".join(f"{b:08b}" for b in data.tolist()) == "00100" "00" "100" "11100" "101" "1" "00111000" "00000"


# ---- the same errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("coding,mask_v,mask_b,match", [
    (C.SiteCoding("golomb", "gamma"), np.zeros((2, 32), bool), np.zeros((2, 2), bool), "position coding"),
    (C.SiteCoding("gamma", "rice31"), np.zeros((2, 32), bool), np.zeros((2, 2), bool), "position coding"),
    (C.SiteCoding("gamma", "block-bitmap"), np.zeros((2, 32), bool), np.zeros((2, 2), bool), "block-bitmap"),
    (C.SiteCoding("all", "gamma"), np.eye(2, 32, dtype=bool), np.zeros((2, 2), bool), "every position"),
    (C.SiteCoding("gamma", "all"), np.zeros((2, 32), bool), np.eye(2, 2, dtype=bool), "every position"),
    (C.SiteCoding("rice0", "gamma"), np.eye(1, 4096, 3906, dtype=bool), np.zeros((1, 256), bool), "unary pieces"),
    (C.SiteCoding("gamma", "rice0"), np.zeros((1, 4096 * 16), bool), np.eye(1, 4096, 3906, dtype=bool),
     "unary pieces"),
])
def test_bad_codings_raise_config_error_as_numpy_does(coding, mask_v, mask_b, match):
    enc = _enc_of(mask_v, mask_b)
    want, got = coding_error(C.pack_rows, enc, coding), coding_error(D.pack_rows_torch, enc, coding)
    assert want is not None and got is not None and got[0] is want[0] is ConfigError, (want, got)
    assert match in got[1] and got[1] == want[1]


def test_exceptions_whose_counts_differ_from_their_marks_are_hint_coding_errors():
    """numpy's packer fails with an IndexError (or writes garbage) there; the torch one raises what
    `compact.reconstruct` raises for the same exceptions."""
    enc = _enc_of(np.eye(2, 32, dtype=bool), np.eye(2, 2, dtype=bool))
    for bad in (C.MarginExceptions(enc.value_mask, enc.hint_bits[:1], enc.scale_mask, enc.scale_bytes, 0.1, 0.2),
                C.MarginExceptions(enc.value_mask, enc.hint_bits, enc.scale_mask, torch.zeros(3, dtype=torch.uint8),
                                   0.1, 0.2)):
        with pytest.raises(HintCodingError, match="hold"):
            D.pack_rows_torch(bad, C.SiteCoding("gamma", "gamma"))
    with pytest.raises(tracefp4.ShapeError):
        D.pack_rows_torch(C.MarginExceptions(enc.value_mask, enc.hint_bits, enc.scale_mask[:1], enc.scale_bytes[:1],
                                             0.1, 0.2), C.SiteCoding("gamma", "gamma"))


@pytest.mark.parametrize("seed", range(3))
def test_damaged_rows_raise_the_numpy_decoders_error(seed):
    """The numpy decoder tests' damaged rows (a flipped bit, a row a byte shorter or longer): the torch decoder
    raises exactly where numpy does, with the same message, and otherwise decodes the same exceptions."""
    raised = 0
    for rng, enc, coding in cases(100 + seed, 40):
        packed = C.pack_rows(enc, coding)
        if packed.data.size == 0:
            continue
        for data, offsets in damaged_rows(rng, packed):
            bad = C.PackedRows(data, offsets, packed.width, coding, 0.1, 0.2, enc.scale_payload)
            want, got = coding_error(C.unpack_rows, bad), coding_error(_torch_unpack, bad)
            assert want == got, coding
            if want is None:
                assert _torch_unpack(bad) == C.unpack_rows(bad)
            else:
                raised += 1
    assert raised > 20


def test_bad_offsets_and_trailing_bits():
    enc = _enc_of(np.eye(3, 64, dtype=bool), np.zeros((3, 4), bool))
    coding = C.SiteCoding("gamma", "bitmap")
    p = C.pack_rows(enc, coding)
    shifted = p.offsets.copy()
    shifted[1] += 1
    grown = np.concatenate([p.data, [0x01]]).astype(np.uint8)
    for data, offsets, match in ((p.data, p.offsets[:-1], "do not cover"),
                                 (p.data, np.zeros(0, np.int64), "do not cover"),
                                 (p.data, p.offsets[::-1].copy(), "do not cover"),
                                 (p.data, shifted, ""),
                                 (grown, np.concatenate([p.offsets[:-1], [grown.size]]), "after the last field")):
        bad = C.PackedRows(data, offsets, 64, coding, 0.1, 0.2)
        want, got = coding_error(C.unpack_rows, bad), coding_error(_torch_unpack, bad)
        assert want is not None and want == got and match in got[1]
    with pytest.raises(ConfigError, match="position coding"):
        D.unpack_rows_torch(p.data, p.offsets, 64, C.SiteCoding("gamma", "golomb"), 0.1, 0.2)


# ---- syncs, devices -----------------------------------------------------------------------------------------
def _host_reads(fn, *args, **kw) -> Counter:
    with HostTraffic() as traffic:
        fn(*args, **kw)
    return Counter(op for (op, path, *_), n in traffic.calls.items() for _ in range(n)
                   if path.startswith("tracerl/"))


@pytest.mark.parametrize("values,reads", [("bitmap", 1), ("all", 1), ("block-bitmap", 1), ("gamma", 2),
                                          ("rice3", 2)])
def test_one_host_read_per_pack_and_one_or_two_per_unpack(values, reads):
    """`HostTraffic` sees every torch call that brings a value to the host: a pack reads its sizes once, an unpack
    once (twice with a gamma / Rice value coding: the codeword count), and nothing else (no nonzero, no boolean
    masks)."""
    rng = np.random.default_rng(5)
    enc = random_exceptions(rng, 9, 256, 1.0 if values == "all" else 0.1, 0.3, "byte", full_values=values == "all")
    coding = C.SiteCoding(values, "rice1")
    assert _host_reads(D.pack_rows_torch, enc, coding) == Counter({"tolist": 1})
    packed = C.pack_rows(enc, coding)
    assert _host_reads(_torch_unpack, packed) == Counter({"tolist": reads})


def test_it_runs_on_the_cpu_device_from_host_arrays_and_tensors():
    """Real CPU tensors (not meta: the codec reads its sizes), numpy input moved to ``device``, tensor input kept on
    its own device, and the outputs where the input was."""
    rng = np.random.default_rng(9)
    enc = random_exceptions(rng, 11, 512, 0.05, 0.2, "lsb")
    coding = C.SiteCoding("rice2", "gamma")
    packed = C.pack_rows(enc, coding)
    for data, offsets, kw in ((packed.data, packed.offsets, {"device": "cpu"}),
                              (torch.from_numpy(packed.data), torch.from_numpy(packed.offsets), {})):
        got = D.unpack_rows_torch(data, offsets, 512, coding, 0.1, 0.2, "lsb", **kw)
        assert got == enc
        assert {getattr(got, f).device.type for f in ("value_mask", "hint_bits", "scale_mask", "scale_bytes")} == {
            "cpu"}
    assert D.unpack_sites_torch({"a": packed}, "cpu") == {"a": enc}
    meta = C.MarginExceptions(*(getattr(enc, f).to("meta") for f in ("value_mask", "hint_bits", "scale_mask",
                                                                      "scale_bytes")), 0.1, 0.2, "lsb")
    with pytest.raises((RuntimeError, NotImplementedError)):  # a meta tensor has no value to read: it cannot run
        D.pack_rows_torch(meta, coding)


def _rollout(t=24, w=256, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, w, generator=gen) * torch.exp(2 * torch.randn(t, 1, generator=gen))
    g = tracefp4.compute_global_scale(x)
    q = tracefp4.quantize(x, "nvfp4", global_scale=g, backend="reference")
    return x, g, q


@pytest.mark.parametrize("coding,margin,scale_margin,payload", [
    (C.SiteCoding("gamma", "bitmap"), 0.1, 0.3, "byte"),
    (C.SiteCoding("rice2", "all"), 0.03, float("inf"), "lsb"),
    (C.SiteCoding("all", "gamma"), float("inf"), 0.2, "byte"),
])
def test_pack_marks_equals_packing_the_exceptions_of_the_marks(coding, margin, scale_margin, payload):
    x, g, q = _rollout()
    vm, bm = tracefp4.margin_marks(x, g, q.scales, q.hints, margin, scale_margin, backend="reference")
    enc = C.exceptions_from_marks(vm, bm, q.hints, q.scales, margin, scale_margin, payload)
    want = C.store_rows(C.pack_rows(enc, coding))
    data, offsets = D.pack_marks_torch(vm, bm, q.hints, q.scales, coding, payload)
    np.testing.assert_array_equal(data.numpy(), want[0])
    np.testing.assert_array_equal(offsets.numpy(), want[1])
    host = D.pack_marks_on_device(torch.device("cpu"), vm.numpy(), bm.numpy(), q.hints.numpy(), q.scales.numpy(),
                                  coding, payload)
    assert all(isinstance(a, np.ndarray) for a in host) and host[0].dtype == np.uint8 and host[1].dtype == np.int64
    np.testing.assert_array_equal(host[0], want[0])
    np.testing.assert_array_equal(host[1], want[1])


# ---- the recorder, the feed, decode_margin --------------------------------------------------------------------
SITE = "layers.1.moe_in"
CODING = C.SiteCoding("gamma", "bitmap")


class _Sink:
    """A `TraceSink` whose store declares one margin site; keeps the rows it is given."""

    def __init__(self):
        self.store = types.SimpleNamespace(sites={SITE: C.store_site(SITE, 256, CODING, 0.1, 0.3, "byte")})
        self.rows: list = []

    def write(self, traj_id, token_start, *, rows=None, **_):
        self.rows.append((traj_id, token_start, rows[SITE]))

    def flush(self):
        pass


@pytest.mark.parametrize("how", ["device", "auto"])
def test_the_recorder_packs_the_same_rows_on_the_device(how):
    """``margin_pack="device"`` packs on the marks' device (the CPU here) and writes the bytes the host path
    writes; ``"auto"`` on the CPU is the host path."""
    x, g, q = _rollout(t=12)
    sinks = {}
    for pack in ("host", how):
        sinks[pack] = sink = _Sink()
        rec = RolloutRecorder(sink, {SITE: 256}, flush_tokens=4, drain_every=2, margin_pack=pack)
        for r in ("a", "b"):
            rec.begin(r)
        for step in range(6):
            rows = slice(2 * step, 2 * step + 2)
            rec.record_sites(["a", "b"], [step, step], SITE, q.hints[rows], q.scales[rows], x=x[rows], global_scale=g)
            rec.record_tokens(["a", "b"], [step, step], torch.tensor([1, 2]), torch.zeros(2))
            rec.step()
        rec.close()
    host, dev = sinks["host"].rows, sinks[how].rows
    assert len(host) == len(dev) > 2
    for (ta, sa, (da, oa)), (tb, sb, (db, ob)) in zip(host, dev):
        assert (ta, sa) == (tb, sb) and isinstance(db, np.ndarray) and isinstance(ob, np.ndarray)
        np.testing.assert_array_equal(da, db)
        np.testing.assert_array_equal(oa, ob)
    with pytest.raises(RecorderError, match="margin_pack"):
        RolloutRecorder(_Sink(), {SITE: 256}, margin_pack="gpu")


@pytest.fixture(scope="module")
def margin_store(tmp_path_factory):
    x, g, q = _rollout(t=40)
    enc = C.encode_margin_exceptions(x, g, q.scales, q.hints, 0.1, 0.3)
    data, off = C.store_rows(C.pack_rows(enc, CODING))
    site = C.store_site(SITE, 256, CODING, 0.1, 0.3, "byte")
    store = ts.create_store(str(tmp_path_factory.mktemp("m") / "s"), [ts.Site("plain", 64), site],
                            model={"global_scales": {SITE: float(g)}})
    with store.writer("w", commit_interval_s=0) as w:
        for t, (a, b) in (("t0", (0, 25)), ("t1", (25, 40))):
            w.write(t, 0, hints={"plain": np.zeros((b - a, 8), np.uint8)}, scales={"plain": np.zeros((b - a, 4),
                                                                                                    np.uint8)},
                    token_ids=np.arange(b - a), logprobs=np.zeros(b - a, np.float32),
                    rows={SITE: (data[off[a]:off[b]], off[a:b + 1] - off[a])})
    return ts.open_store(store.url), enc


def test_the_feed_decodes_on_the_device_what_the_reading_thread_decodes(margin_store):
    store, enc = margin_store
    mb = MicroBatch((Segment("t1", 3, 15), Segment("t0", 0, 25)))
    (host,) = HintFeed(store, margin_decode="host").iterate([mb])
    (dev,) = HintFeed(store, margin_decode="device").iterate([mb])
    assert HintFeed(store).margin_on_device is False  # "auto" on the CPU: the reading thread decodes
    assert set(dev.margin) == set(host.margin) == {SITE} and dev.margin[SITE] == host.margin[SITE]
    assert dev.margin[SITE].shape == (37, 256) and dev.margin[SITE].value_mask.sum() > 0
    with pytest.raises(ConfigError, match="margin_decode"):
        HintFeed(store, margin_decode="gpu")


def test_decode_margin_on_the_device_equals_the_host_decode(margin_store):
    store, enc = margin_store
    packed = read_packed(store.reader(), MicroBatch((Segment("t0", 0, 25), Segment("t1", 0, 15))), [SITE],
                         read_kwargs={"fmt": "numpy"})
    host = decode_margin(store, packed, "cpu")
    assert host == decode_margin(store, packed, "cpu", decode="device") == decode_margin(store, packed, "cpu",
                                                                                          decode="auto")
    assert host[SITE] == enc
    with pytest.raises(ConfigError, match="decode"):
        decode_margin(store, packed, "cpu", decode="gpu")


def test_auto_is_the_triton_decoder_on_cuda_and_numpy_elsewhere(monkeypatch):
    """"auto" resolves by device: numpy on the CPU; on CUDA the Triton decoder, or the torch codec without Triton
    (`resolve_margin_decode` only looks at the device type and Triton's presence: no GPU needed)."""
    import importlib.util

    assert D.resolve_margin_decode("auto", "cpu") == "host"
    assert D.resolve_margin_decode("auto", "cuda") == "triton"
    for named in ("host", "device", "triton"):
        assert D.resolve_margin_decode(named, "cuda") == named == D.resolve_margin_decode(named, "cpu")
    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find(name, *a))
    assert D.resolve_margin_decode("auto", "cuda") == "device"
    with pytest.raises(ConfigError, match="decode must be one of"):
        D.resolve_margin_decode("gpu", "cpu")


def test_the_device_codec_is_public_in_tracerl_hints():
    import tracerl.hints as H

    for n in ("pack_rows_torch", "pack_marks_torch", "pack_marks_on_device", "unpack_rows_torch",
              "unpack_sites_torch"):
        assert getattr(H, n) is getattr(D, n) and n in H.__all__
    assert set(CODINGS) <= set(VALUE_CODINGS) | {"rice3", "rice5", "rice8"}
