"""Several margin sites through one device call (`compact_device.unpack_sites_torch`, `pack_sites_on_device`):
the sites that share width, coding and scale payload are decoded / packed over their rows stacked, and each site
gets exactly what its own call gives (the same tensors, dtypes and shapes; the same bytes), with the syncs of one
call per such group; a damaged row still raises its own site's message. On the CPU (the torch code is
device-agnostic)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from helpers.margin import coding_error, damaged_rows, random_exceptions

import tracestore as ts
from tracerl.errors import ConfigError, HintCodingError
from tracerl.hints import compact as C
from tracerl.hints import compact_device as D
from tracerl.hints import decode_margin
from tracerl.rollout import RolloutRecorder

FIELDS = ("value_mask", "hint_bits", "scale_mask", "scale_bytes")


@pytest.fixture
def syncs(monkeypatch):
    """The number of `_section_sync` calls (host reads of a pack or decode) made so far."""
    calls = []
    real = D._section_sync

    def counted(values):
        calls.append(len(values))
        return real(values)

    monkeypatch.setattr(D, "_section_sync", counted)
    return calls


def _alone(p: C.PackedRows) -> C.MarginExceptions:
    return D.unpack_rows_torch(p.data, p.offsets, p.width, p.coding, p.margin, p.scale_margin, p.scale_payload,
                               device="cpu")


def _one_by_one(rows: dict[str, C.PackedRows]):
    """What decoding the sites one after the other raises (the first failing site's error), or None."""
    for p in rows.values():
        err = coding_error(_alone, p)
        if err is not None:
            return err
    return None


def _site(rng, t: int, w: int, coding: C.SiteCoding, payload: str, p_value=0.1, margin=0.1) -> C.PackedRows:
    enc = random_exceptions(rng, t, w, p_value, 0.2, payload, full_values=coding.values == "all",
                            full_blocks=coding.blocks == "all")
    enc = C.MarginExceptions(enc.value_mask, enc.hint_bits, enc.scale_mask, enc.scale_bytes, margin, 0.2, payload)
    return C.pack_rows(enc, coding)


def _mixed_sites(rng, values: str, payload: str) -> dict[str, C.PackedRows]:
    """Sites of one group (three row counts, 0 included, and margins that differ: they do not enter the decode),
    a second group of another block coding, one of another width and one of the other payload."""
    a, b = C.SiteCoding(values, "bitmap"), C.SiteCoding(values, "gamma")
    other = "lsb" if payload == "byte" else "byte"
    return {
        "a0": _site(rng, 5, 256, a, payload),
        "b0": _site(rng, 7, 256, b, payload),
        "a1": _site(rng, 0, 256, a, payload),
        "w0": _site(rng, 3, 512, a, payload),
        "a2": _site(rng, 17, 256, a, payload, margin=0.3),
        "b1": _site(rng, 1, 256, b, payload),
        "p0": _site(rng, 4, 256, a, other),
        "a3": _site(rng, 2, 256, a, payload, p_value=0.0),
    }


def _assert_same(got: C.MarginExceptions, want: C.MarginExceptions) -> None:
    assert got == want
    for f in FIELDS:
        g, w = getattr(got, f), getattr(want, f)
        assert g.dtype == w.dtype and g.shape == w.shape and g.device == w.device and g.is_contiguous(), f


# ---- decode -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("payload", ["byte", "lsb"])
@pytest.mark.parametrize("values", ["all", "bitmap", "block-bitmap", "gamma", "rice0", "rice3"])
def test_batched_decode_equals_each_sites_own_and_numpys(values, payload, syncs):
    rng = np.random.default_rng(sum(map(ord, values + payload)))
    rows = _mixed_sites(rng, values, payload)
    got = D.unpack_sites_torch(rows, "cpu")
    assert list(got) == list(rows)
    per_call = 2 if values in ("gamma", "rice0", "rice3") else 1
    # 4 calls: a0 a1 a2 a3 | b0 b1 | w0 | p0 (8 when each site is decoded on its own)
    assert len(syncs) == 4 * per_call
    for s, p in rows.items():
        _assert_same(got[s], _alone(p))
        assert got[s] == C.unpack_rows(p), s
        assert (got[s].margin, got[s].scale_payload) == (p.margin, p.scale_payload)


@pytest.mark.parametrize("values,per_call", [("bitmap", 1), ("gamma", 2)])
def test_five_sites_of_one_coding_cost_the_syncs_of_one_decode(values, per_call, syncs):
    rng = np.random.default_rng(3)
    coding = C.SiteCoding(values, "bitmap")
    rows = {f"s{i}": _site(rng, 9, 512, coding, "byte") for i in range(5)}
    got = D.unpack_sites_torch(rows, "cpu")
    assert len(syncs) == per_call
    syncs.clear()
    want = {s: _alone(p) for s, p in rows.items()}
    assert len(syncs) == 5 * per_call and got == want


def test_a_group_past_the_caps_is_cut_into_several_calls(monkeypatch, syncs):
    rng = np.random.default_rng(4)
    coding = C.SiteCoding("all", "all")  # every site the same bytes
    rows = {f"s{i}": _site(rng, 8, 256, coding, "lsb") for i in range(5)}
    assert len({p.nbytes for p in rows.values()}) == 1
    monkeypatch.setitem(D._BATCH_CAPS, "cpu", (1 << 30, 2 * 8 * 256, 1))  # two sites a decode
    got = D.unpack_sites_torch(rows, "cpu")
    assert len(syncs) == 3
    for s, p in rows.items():
        _assert_same(got[s], _alone(p))
    syncs.clear()
    monkeypatch.setitem(D._BATCH_CAPS, "cpu", (2 * rows["s0"].nbytes + 1, 1 << 30, 1))  # and by bytes
    assert D.unpack_sites_torch(rows, "cpu") == got and len(syncs) == 3
    syncs.clear()
    marks = {f"s{i}": _marks(rng, 8, 256, 0.1, coding, "lsb") for i in range(5)}
    monkeypatch.setitem(D._BATCH_CAPS, "cpu", (1, 1, 2 * 8 * 256))  # two sites a pack, whatever the decode's
    packed = D.pack_sites_on_device(torch.device("cpu"), marks)
    assert len(syncs) == 3
    for s, m in marks.items():
        own = D.pack_marks_on_device(torch.device("cpu"), *m)
        assert np.array_equal(packed[s][0], own[0]) and np.array_equal(packed[s][1], own[1])


def test_host_tensors_stack_and_other_rows_decode_alone(syncs):
    """CPU tensors are host rows too; int32 offsets are not what the stack takes: that site goes alone."""
    rng = np.random.default_rng(6)
    coding = C.SiteCoding("bitmap", "bitmap")
    p = [_site(rng, t, 256, coding, "byte") for t in (3, 4, 5)]
    rows = {"np": p[0],
            "tensor": C.PackedRows(torch.from_numpy(p[1].data), torch.from_numpy(p[1].offsets), 256, coding, 0.1, 0.2),
            "int32": C.PackedRows(p[2].data, p[2].offsets.astype(np.int32), 256, coding, 0.1, 0.2)}
    got = D.unpack_sites_torch(rows, "cpu")
    assert len(syncs) == 2
    for s, q in zip(rows, p):
        assert got[s] == C.unpack_rows(q), s


def test_no_sites():
    assert D.unpack_sites_torch({}, "cpu") == {}


# ---- decode errors ------------------------------------------------------------------------------------------
def _grow_row(p: C.PackedRows, r: int) -> C.PackedRows:
    """Row ``r`` one byte longer (a non-zero byte after its last field)."""
    data = np.insert(p.data, p.offsets[r + 1], np.uint8(0x5A))
    offsets = np.concatenate([p.offsets[: r + 1], p.offsets[r + 1:] + 1])
    return C.PackedRows(data, offsets, p.width, p.coding, p.margin, p.scale_margin, p.scale_payload)


@pytest.mark.parametrize("values", ["bitmap", "gamma", "rice2"])
def test_a_damaged_row_in_the_second_site_of_a_group_names_its_own_row(values):
    rng = np.random.default_rng(7)
    coding = C.SiteCoding(values, "bitmap")
    rows = {f"s{i}": _site(rng, 6, 256, coding, "byte") for i in range(3)}
    rows["s1"] = _grow_row(rows["s1"], 4)
    want = coding_error(_alone, rows["s1"])
    assert want is not None and want[0] is HintCodingError and want[1].startswith("row 4: ")
    assert coding_error(D.unpack_sites_torch, rows, "cpu") == want == coding_error(C.unpack_rows, rows["s1"])


@pytest.mark.parametrize("seed", range(3))
def test_damaged_rows_raise_what_decoding_site_by_site_raises(seed):
    """The numpy decoder tests' damaged rows (a flipped bit, a row a byte shorter or longer) in one site of a mixed
    set: the error of the first failing site in order, with its own message; without an error, the same results."""
    rng = np.random.default_rng(200 + seed)
    raised = 0
    for values in ("bitmap", "block-bitmap", "gamma", "rice1"):
        rows = _mixed_sites(rng, values, ["byte", "lsb"][seed % 2])
        for victim in ("a2", "b1", "w0"):
            p = rows[victim]
            for data, offsets in damaged_rows(rng, p):
                bad = dict(rows)
                bad[victim] = C.PackedRows(data, offsets, p.width, p.coding, p.margin, p.scale_margin,
                                           p.scale_payload)
                want = _one_by_one(bad)
                assert coding_error(D.unpack_sites_torch, bad, "cpu") == want, (values, victim)
                if want is None:
                    got = D.unpack_sites_torch(bad, "cpu")
                    assert all(got[s] == _alone(q) for s, q in bad.items())
                else:
                    raised += 1
    assert raised > 10


def test_the_first_failing_site_in_order_raises():
    rng = np.random.default_rng(8)
    g = C.SiteCoding("gamma", "bitmap")
    rows = {"x0": _site(rng, 4, 256, g, "byte"), "y0": _site(rng, 4, 512, g, "byte"),
            "x1": _site(rng, 4, 256, g, "byte")}
    rows["x1"] = _grow_row(rows["x1"], 1)
    rows["y0"] = _grow_row(rows["y0"], 2)
    err = coding_error(D.unpack_sites_torch, rows, "cpu")
    assert err == coding_error(_alone, rows["y0"]) and err[1].startswith("row 2: ")


def test_bad_offsets_and_unknown_codings_as_site_by_site():
    rng = np.random.default_rng(9)
    g = C.SiteCoding("gamma", "bitmap")
    rows = {f"s{i}": _site(rng, 4, 256, g, "byte") for i in range(3)}
    shifted = rows["s1"].offsets.copy()
    shifted[0] = 1  # stacked, this would read as the bytes of the site before
    bad = dict(rows, s1=C.PackedRows(rows["s1"].data, shifted, 256, g, 0.1, 0.2))
    err = coding_error(D.unpack_sites_torch, bad, "cpu")
    assert err == _one_by_one(bad) and "do not cover" in err[1]
    golomb = dict(rows, s2=C.PackedRows(rows["s2"].data, rows["s2"].offsets, 256, C.SiteCoding("golomb", "bitmap"),
                                        0.1, 0.2))
    with pytest.raises(ConfigError, match="position coding"):
        D.unpack_sites_torch(golomb, "cpu")
    # a damaged site before the one of the unknown coding raises first, as decoding site by site does
    both = dict(golomb, s0=_grow_row(rows["s0"], 0))
    assert coding_error(D.unpack_sites_torch, both, "cpu") == _one_by_one(both) == coding_error(_alone, both["s0"])


# ---- pack ---------------------------------------------------------------------------------------------------
def _marks(rng, t: int, w: int, p: float, coding: C.SiteCoding, payload: str) -> D.SiteMarks:
    full_v, full_b = coding.values == "all", coding.blocks == "all"
    vm = np.full((t, w // 8), 255, np.uint8) if full_v else np.packbits(rng.random((t, w)) < p, axis=1)
    bm = (np.full((t, -(-w // 128)), 255, np.uint8) if full_b
          else np.packbits(rng.random((t, -(-w // 128) * 8)) < 0.2, axis=1))
    return (vm, bm, rng.integers(0, 256, (t, w // 8), dtype=np.uint8),
            rng.integers(0, 127, (t, w // 16), dtype=np.uint8), coding, payload)


def _numpy_rows(m: D.SiteMarks) -> tuple[np.ndarray, np.ndarray]:
    enc = C.exceptions_from_marks(*(torch.from_numpy(a) for a in m[:4]), 0.1, 0.2, m[5])
    return C.store_rows(C.pack_rows(enc, m[4]))


@pytest.mark.parametrize("payload", ["byte", "lsb"])
@pytest.mark.parametrize("values", ["all", "bitmap", "block-bitmap", "gamma", "rice0", "rice3"])
def test_batched_pack_is_each_sites_own_pack_byte_for_byte(values, payload, syncs):
    rng = np.random.default_rng(sum(map(ord, values + payload)) + 1)
    a, b = C.SiteCoding(values, "bitmap"), C.SiteCoding(values, "rice1")
    other = "lsb" if payload == "byte" else "byte"
    sites = {"a0": _marks(rng, 5, 256, 0.1, a, payload), "b0": _marks(rng, 3, 256, 0.1, b, payload),
             "a1": _marks(rng, 0, 256, 0.1, a, payload), "a2": _marks(rng, 11, 256, 0.3, a, payload),
             "w0": _marks(rng, 4, 512, 0.1, a, payload), "p0": _marks(rng, 2, 256, 0.1, a, other),
             "a3": _marks(rng, 2, 256, 0.0, a, payload)}
    got = D.pack_sites_on_device(torch.device("cpu"), sites)
    assert list(got) == list(sites)
    assert len(syncs) == 4  # a0 a1 a2 a3 | b0 | w0 | p0: one sync a call
    for s, m in sites.items():
        data, offsets = got[s]
        own = D.pack_marks_on_device(torch.device("cpu"), *m)
        assert data.dtype == np.uint8 and offsets.dtype == np.int64 and data.flags.c_contiguous
        np.testing.assert_array_equal(data, own[0], err_msg=s)
        np.testing.assert_array_equal(offsets, own[1], err_msg=s)
        want = _numpy_rows(m)
        np.testing.assert_array_equal(data, want[0], err_msg=s)
        np.testing.assert_array_equal(offsets, want[1], err_msg=s)


def test_a_failing_pack_raises_its_own_sites_message():
    """``all`` with a position unmarked in the second site of a group: its own pack's message (which counts that
    site's positions), not the stack's."""
    rng = np.random.default_rng(10)
    coding = C.SiteCoding("all", "bitmap")
    sites = {f"s{i}": _marks(rng, 3, 256, 1.0, coding, "byte") for i in range(3)}
    vm = sites["s1"][0].copy()
    vm[2, 5] = 0
    sites["s1"] = (vm, *sites["s1"][1:])
    want = coding_error(D.pack_marks_on_device, torch.device("cpu"), *sites["s1"])
    assert want is not None and want[0] is ConfigError and f"of {3 * 256} are not" in want[1]
    assert coding_error(D.pack_sites_on_device, torch.device("cpu"), sites) == want


# ---- the recorder and decode_margin -------------------------------------------------------------------------
class _Sink:
    """A `TraceSink` whose store declares margin sites; keeps the rows it is given."""

    def __init__(self, sites):
        self.store = types.SimpleNamespace(sites=sites)
        self.rows: list = []

    def write(self, traj_id, token_start, *, rows=None, **_):
        self.rows.append((traj_id, token_start, rows))

    def flush(self):
        pass


def test_the_recorder_packs_sites_of_one_coding_in_one_call(monkeypatch):
    g, r = C.SiteCoding("gamma", "bitmap"), C.SiteCoding("rice2", "gamma")
    decl = {"s0": C.store_site("s0", 256, g, 0.1, 0.3), "s1": C.store_site("s1", 256, r, 0.1, 0.3, "lsb"),
            "s2": C.store_site("s2", 256, g, 0.2, 0.1), "s3": C.store_site("s3", 512, g, 0.1, 0.3)}
    rng = np.random.default_rng(11)
    marks = {s: _marks(rng, 12, d.width, 0.1, C.SiteCoding(d.value_coding, d.block_coding), d.scale_payload)
             for s, d in decl.items()}
    calls = []  # the rows of each device pack
    real = D.pack_marks_on_device
    monkeypatch.setattr(D, "pack_marks_on_device", lambda *a, **k: calls.append(a[1].shape[0]) or real(*a, **k))
    sinks = {}
    for pack in ("host", "device"):
        sinks[pack] = sink = _Sink(decl)
        rec = RolloutRecorder(sink, {s: d.width for s, d in decl.items()}, flush_tokens=4, drain_every=2,
                              margin_pack=pack)
        rec.begin("a")
        for step in range(12):
            for s, (vm, bm, h, sc, _, _) in marks.items():
                rec.record_sites(["a"], [step], s, torch.from_numpy(h[step:step + 1]),
                                 torch.from_numpy(sc[step:step + 1]),
                                 marks=(torch.from_numpy(vm[step:step + 1]), torch.from_numpy(bm[step:step + 1])))
            rec.record_tokens(["a"], [step], torch.tensor([1]), torch.zeros(1))
            rec.step()
        rec.close()
    host, dev = sinks["host"].rows, sinks["device"].rows
    assert len(host) == len(dev) >= 2
    # per write of n rows: s0 and s2 stacked (2n rows), s1 and s3 alone
    assert len(calls) == 3 * len(dev)
    for i, (_, _, rows) in enumerate(dev):
        n = len(rows["s1"][1]) - 1
        assert sorted(calls[3 * i: 3 * i + 3]) == [n, n, 2 * n]
    for (ta, sa, ra), (tb, sb, rb) in zip(host, dev):
        assert (ta, sa) == (tb, sb) and list(ra) == list(rb) == list(decl)
        for s in decl:
            np.testing.assert_array_equal(ra[s][0], rb[s][0])
            np.testing.assert_array_equal(ra[s][1], rb[s][1])


def test_decode_margin_on_the_device_decodes_a_group_in_one_call(tmp_path, syncs):
    rng = np.random.default_rng(12)
    g, r = C.SiteCoding("gamma", "bitmap"), C.SiteCoding("bitmap", "block-bitmap")
    decl = [C.store_site("s0", 256, g, 0.1, 0.3), C.store_site("s1", 256, r, 0.1, 0.3),
            C.store_site("s2", 256, g, 0.05, 0.3, "byte"), C.store_site("s3", 256, g, 0.1, 0.3)]
    store = ts.create_store(str(tmp_path / "s"), decl)
    packed = {d.name: _site(rng, 9, 256, C.SiteCoding(d.value_coding, d.block_coding), d.scale_payload,
                            margin=d.margin) for d in decl}
    hints = types.SimpleNamespace(margin={s: C.store_rows(p) for s, p in packed.items()})  # as a PackedHints
    host = decode_margin(store, hints, "cpu")
    syncs.clear()
    dev = decode_margin(store, hints, "cpu", decode="device")
    assert len(syncs) == 2 + 1  # s0 s2 s3 (gamma values: two syncs) | s1 (one)
    assert dev == host and list(dev) == list(packed)
    for s, rows in hints.margin.items():
        _assert_same(dev[s], _alone(C.packed_from_store(store.sites[s], rows)))
