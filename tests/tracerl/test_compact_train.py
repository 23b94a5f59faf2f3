"""The trained forward over margin sites (issue 23): a store whose hinted sites keep margin-exception rows trains a
GRPO step and drives a patched model, each margin site's scales and hints reconstructed from the trainer's own
activation and the stored exceptions (`tracerl.hints.MarginSites`) and then rounded as a bits site is. With margin
inf (everything marked) it is today's layout bit for bit: the same rollout recorded both ways trains to the same
digest. With a finite margin the code agreement is reported, and the values outside the margin whose code differs
from the rollout's are counted; inside the margin nothing differs. CPU, the tiny loop model."""

from __future__ import annotations

import dataclasses
import math

import helpers.fp4  # noqa: F401  (before tracefp4: Triton's interpreter without CUDA, for margin_decode="triton")
import pytest
import torch
from helpers import loop
from helpers.fp4 import HAS_TRITON

import tracefp4
import tracestore as ts
from tracerl.errors import HintMismatchError
from tracerl.hints import HintFeed, MarginSites, decode_margin, pack_micro_batches, patch_model
from tracerl.hints import compact as C
from tracerl.policy import TinyMoESpec, build_model, install_fp4, moe_input_site, plan_sites
from tracerl.rollout import RolloutEngine
from tracerl.runlog import MetricsLog
from tracerl.train import run_training, start_or_resume

INF = float("inf")
#: kind -> (coding, margin, scale margin) of every hinted site; "bits": today's layout
KINDS = {"bits": None, "inf": (C.SiteCoding("all", "all"), INF, INF),
         "finite": (C.SiteCoding("gamma", "bitmap"), 0.1, 0.3)}


def _store(url: str, kind: str) -> ts.Store:
    """A loop store of the tiny model whose sites are kept as ``kind`` says (the metadata of `loop.create`)."""
    bits = loop.create(url if kind == "bits" else url + "-template")
    if kind == "bits":
        return bits
    coding, m, ms = KINDS[kind]
    sites = [C.store_site(n, s.width, coding, m, ms) for n, s in bits.sites.items()]
    return ts.create_store(url, sites, model=bits.model, moe_layers=bits.moe_layers, top_k=bits.top_k,
                           num_experts=bits.num_experts)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Per kind: the store (one rollout batch by version 0, codes recorded, hf decode) and the first step's metrics."""
    out = {}
    for kind in KINDS:
        d = tmp_path_factory.mktemp(kind)
        st = _store(str(d / "store"), kind)
        log = MetricsLog(d / "train.jsonl")
        trainer, follower = start_or_resume(st, loop.train_cfg(), checkpoints=str(d / "ck"), weights_url=st.url,
                                            metrics=log)
        with loop.worker(st, record_codes=True, decode="hf") as w:
            w.sync_weights(timeout_s=30)
            w.generate_batch()
        run_training(trainer, follower, checkpoints=str(d / "ck"), weights_url=st.url, metrics=log, max_steps=1)
        out[kind] = (ts.open_store(st.url), log.records()[0])
    return out


def test_margin_stores_record_the_same_rollout(runs):
    """The precondition of the comparisons: the three stores hold the same tokens (same model, seeds, decode)."""
    toks = {k: [tuple(st.reader().read(t.traj_id).token_ids.tolist()) for t in st.reader().trajectories()]
            for k, (st, _) in runs.items()}
    assert toks["bits"] == toks["inf"] == toks["finite"] and len(toks["bits"]) == 8
    assert runs["inf"][0].format_version == 5 and runs["bits"][0].format_version == 3
    assert all(s.hint_encoding == "margin" for s in runs["finite"][0].sites.values())


def test_margin_inf_trains_the_bits_of_todays_layout(runs):
    a, b = runs["bits"][1], runs["inf"][1]
    assert a["mismatch"]["code_values"] > 0 and a["mismatch"]["code_agreement"] == b["mismatch"]["code_agreement"]
    assert (a["loss"], a["digest"]) == (b["loss"], b["digest"])
    m = b["mismatch"]
    assert m["margin_unmarked"] == 0 and m["margin_marked"] == m["code_values"] and m["margin_unmarked_mismatch"] == 0


def test_a_finite_margin_trains_and_counts_the_codes_outside_the_margin_that_differ(runs):
    a, f = runs["bits"][1], runs["finite"][1]
    m = f["mismatch"]
    assert math.isfinite(f["loss"]) and f["step"] == 1
    assert m["code_values"] == a["mismatch"]["code_values"] > 0
    assert m["margin_marked"] + m["margin_unmarked"] == m["code_values"] and 0 < m["margin_marked"] < m["code_values"]
    mism = round((1 - m["code_agreement"]) * m["code_values"])
    assert m["margin_marked_mismatch"] + m["margin_unmarked_mismatch"] == mism
    assert 0.9 < m["code_agreement"] <= 1.0
    print(f"finite margin: code agreement {m['code_agreement']:.6f} (bits layout {a['mismatch']['code_agreement']:.6f})"
          f", {m['margin_unmarked_mismatch']} of {m['margin_unmarked']} values outside the margin differ, "
          f"{m['margin_marked_mismatch']} of {m['margin_marked']} marked")


def _mbs(store, tokens=24):
    return pack_micro_batches({t.traj_id: t.num_tokens for t in store.reader().trajectories() if t.complete}, tokens)


def test_a_patched_model_on_a_margin_inf_store_computes_what_it_does_on_the_bits_store(runs):
    outs = {}
    for kind in ("bits", "inf"):
        st = runs[kind][0]
        stock = build_model(TinyMoESpec(**st.model["spec"]), seed=int(st.model["seed"]))
        patch = patch_model(stock, st)
        outs[kind] = []
        for mb in HintFeed(st).iterate(_mbs(st)[:2]):
            assert (set(mb.margin) == set(st.sites)) == (kind == "inf")
            with torch.no_grad(), patch.micro_batch(mb, observe=True):
                logits = stock(input_ids=mb.token_ids[None], position_ids=mb.positions[None], use_cache=False).logits
            outs[kind].append((logits, dict(patch.codes)))
    for (la, ca), (lb, cb) in zip(outs["bits"], outs["inf"]):
        assert torch.equal(la, lb) and ca.keys() == cb.keys() and all(torch.equal(ca[s], cb[s]) for s in ca)


def test_margin_sites_round_within_the_margin_as_the_rollout_did():
    """Layer 0's MoE input (its activation does not depend on any FP4 site) with exceptions encoded from a perturbed
    copy of the trainer's activation (a stand-in for the rollout's): the patched forward's codes are
    `compact.reconstruct`'s; no value within the margin differs from the rollout's code; those that differ are
    counted; at margin inf the forward equals the bits layout's with the rollout's hints and scales, bit for bit."""
    spec = TinyMoESpec(**loop.SPEC, vocab_size=64)
    model = build_model(spec, seed=0)
    plan = plan_sites(model, hint_layers="0")
    site = moe_input_site(0)
    calib = build_model(spec, seed=0)
    scales = RolloutEngine(calib, install_fp4(calib, plan)).calibrate([[1, 2, 3, 4, 5, 6]])
    patch = patch_model(model, plan, global_scales=scales)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4]])
    seen = []
    quant = patch.runtime.quant

    def spy(name, x):
        if name == site:
            seen.append(x.detach().clone())
        return quant(name, x)

    patch.runtime.quant = spy
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)  # outside micro_batch: own scales
    x_t = seen.pop()
    g = patch.runtime.global_scales[site]
    gen = torch.Generator().manual_seed(1)
    x_r = (x_t.float() * (1 + 0.03 * torch.randn(x_t.shape, generator=gen))).to(x_t.dtype)
    q = tracefp4.quantize(x_r, global_scale=g, backend="reference")
    codes_r = tracefp4.unpack_codes(q.codes)

    @dataclasses.dataclass
    class Batch:
        hints: dict
        scales: dict
        margin: dict
        experts: dict = dataclasses.field(default_factory=dict)

    def forward(batch):
        with torch.no_grad(), patch.micro_batch(batch, observe=True):
            logits = model(input_ids=ids, use_cache=False).logits
        assert torch.equal(seen.pop(), x_t)  # the same activation in every mode
        return logits, patch.codes[site]

    for coding, m, ms in (KINDS["finite"][0], 0.1, 0.3), (C.SiteCoding("rice2", "gamma"), 0.25, 0.0):
        enc = C.encode_margin_exceptions(x_r, g, q.scales, q.hints, m, ms)
        enc = C.unpack_rows(C.pack_rows(enc, coding))  # through the bytes a store keeps
        _, codes = forward(Batch({}, {}, {site: enc}))
        rec = C.reconstruct(enc, x_t, g)
        zero = ((codes & 7) == 0) & ((rec.codes_u8 & 7) == 0)
        assert torch.equal(torch.where(zero, 0, codes), torch.where(zero, 0, rec.codes_u8))
        st = C.margin_stats(enc, rec, codes_r, x_r, x_t, g, q.scales)
        assert st["within_margin"] > 0 and st["within_margin_mismatch"] == 0
        assert st["code_mismatch"] == st["moved_mismatch"] > 0  # the perturbation moves some values past the margin
        assert 0 < st["marked_values"] < st["values"]
    enc = C.encode_margin_exceptions(x_r, g, q.scales, q.hints, INF, INF)
    la, ca = forward(Batch({}, {}, {site: enc}))
    lb, cb = forward(Batch({site: q.hints}, {site: q.scales}, {}))
    assert torch.equal(la, lb) and torch.equal(ca, cb)
    # a padded forward: rows the batch does not cover get scale 0; the covered rows round as the THD rows would
    q2 = tracefp4.quantize(x_r[:2], global_scale=g, backend="reference")
    hook = MarginSites(patch.runtime, {site: C.encode_margin_exceptions(x_r[:2], g, q2.scales, q2.hints, INF, INF)},
                       rows=torch.tensor([0, 2]), nrows=3)
    with patch.runtime.using(mode="fp4_hints"):
        y = hook(site, torch.cat([x_t[:1], x_t[5:6], x_t[1:2]]))
        with pytest.raises(HintMismatchError, match="does not fit margin exceptions"):
            hook(site, x_t[:4])
        assert hook("no-such-site", x_t) is None
    want = tracefp4.fake_quantize(x_t[:2], "nvfp4", global_scale=g, scales=q2.scales, hints=q2.hints)
    assert torch.equal(y[1], torch.zeros_like(y[1])) and torch.equal(y[[0, 2]], want)

def test_decode_margin_of_a_store_batch_equals_the_feeds(runs):
    st = runs["finite"][0]
    mb = _mbs(st)[0]
    (batch,) = list(HintFeed(st).iterate([mb]))
    got = decode_margin(st, batch.host)
    assert got.keys() == batch.margin.keys() and all(got[s] == batch.margin[s] for s in got)


def test_where_every_code_and_scale_agrees_a_finite_margin_trains_todays_bits(runs):
    """On this rollout the trainer reproduces every recorded code at the finite margin too (the tiny model's decode
    and recompute agree): then the forward, the loss and the update are the bits layout's."""
    a, f = runs["bits"][1], runs["finite"][1]
    assert f["mismatch"]["code_agreement"] == a["mismatch"]["code_agreement"] == 1.0
    assert (a["loss"], a["digest"]) == (f["loss"], f["digest"])


def test_the_audit_refuses_margin_sites_in_one_typed_line(runs):
    from tracerl.audit.setup import check_metadata
    from tracerl.errors import ConfigError

    check_metadata(runs["bits"][0], "cpu")  # the same metadata with bits sites is audited
    with pytest.raises(ConfigError, match="keep margin-exception rows"):
        check_metadata(runs["finite"][0], "cpu")


def test_a_rollout_worker_records_margin_sites_on_every_decode_path(runs):
    """The worker turns margin capture on for a store with margin sites, whatever its decode path (the static
    path's rows: tests/tracerl/test_compact_capture.py)."""
    import torch

    st = runs["finite"][0]
    for decode in ("static", "hf"):
        with loop.worker(st, decode=decode) as w:
            assert w.engine.margin_capture and w.engine.decode_path(torch.device("cpu")) == decode


def test_the_margin_helpers_are_public_in_tracerl_hints():
    import tracerl.hints as H
    from tracerl.hints import packing, patch

    names = ["MarginExceptions", "Reconstruction", "SiteCoding", "PackedRows", "encode_margin_exceptions",
             "exceptions_from_marks", "reconstruct", "fake_quantize_compact", "margin_stats", "choose_coding",
             "pack_rows", "unpack_rows", "store_site", "store_rows", "packed_from_store"]
    assert all(getattr(H, n) is getattr(C, n) and n in H.__all__ for n in names)
    assert H.concat_margin_rows is packing.concat_margin_rows and "concat_margin_rows" in H.__all__
    assert H.MarginSites is patch.MarginSites and H.decode_margin is patch.decode_margin
    assert {"MarginSites", "decode_margin"} <= set(H.__all__) and len(set(H.__all__)) == len(H.__all__)


def test_margin_rows_are_read_ahead_in_a_reader_process_byte_for_byte(runs):
    """A trainer reads a margin store's rows with the rest of each micro-batch (RecordSource -> PackedHints.margin),
    so they are read ahead too: through a ReaderProcess (shared memory) they arrive equal to a read in place."""
    import types

    import numpy as np

    from tracerl.hints import BackgroundReads, ReaderProcess, RecordSource, read_ahead
    st = runs["finite"][0]
    records: dict[str, list] = {}
    for item in st.stream(cursor=None, timeout_s=0.5):
        if item.kind == "record":
            records.setdefault(item.traj_id, []).append(item)
    trajs = {t: types.SimpleNamespace(records=r) for t, r in records.items()}
    mbs = pack_micro_batches({t: r[-1].token_stop for t, r in records.items()}, 64)
    sites = list(st.sites)
    here = [p for p, _, _ in read_ahead(RecordSource(st, trajs), mbs, sites, 1 << 30)]
    assert all(set(p.margin) == set(sites) and not p.hints for p in here)
    reader = ReaderProcess(st)
    try:
        ahead = BackgroundReads(RecordSource(st, trajs), mbs, sites, 1 << 30, reader=reader).take(mbs, sites)
    finally:
        reader.close()
    assert len(ahead) == len(here) == len(mbs)
    for (p, _, _), q in zip(ahead, here):
        for s in sites:
            for x, y in zip(p.margin[s], q.margin[s]):
                np.testing.assert_array_equal(x, y)
                assert x.dtype == y.dtype
        np.testing.assert_array_equal(p.token_ids, q.token_ids)


def test_triton_decoded_margin_rows_train_and_patch_as_the_host_decoded(runs, tmp_path):
    """``margin_decode="triton"`` (`compact_triton`, under TRITON_INTERPRET=1 on the CPU): the feed hands out
    `DenseExceptions` equal to the host decode laid out, a patched model computes the same logits and codes from
    them, and a trainer on the same store trains step 1 to the same loss, digest and code agreement."""
    if not HAS_TRITON:
        pytest.skip("no triton")
    st = runs["finite"][0]
    mb = _mbs(st)[0]
    (host,) = list(HintFeed(st).iterate([mb]))
    (dense,) = list(HintFeed(st, margin_decode="triton").iterate([mb]))
    assert dense.margin.keys() == host.margin.keys()
    assert all(isinstance(dense.margin[s], C.DenseExceptions) and dense.margin[s] == C.densify(host.margin[s])
               and torch.equal(dense.margin[s].value_mask, host.margin[s].value_mask) for s in host.margin)
    got = decode_margin(st, host.host, decode="triton")
    assert all(got[s] == dense.margin[s] for s in got)
    stock = build_model(TinyMoESpec(**st.model["spec"]), seed=int(st.model["seed"]))
    patch = patch_model(stock, st)
    outs = []
    for batch in (host, dense):
        with torch.no_grad(), patch.micro_batch(batch, observe=True):
            logits = stock(input_ids=batch.token_ids[None], position_ids=batch.positions[None], use_cache=False).logits
        outs.append((logits, dict(patch.codes)))
    (la, ca), (lb, cb) = outs
    assert torch.equal(la, lb) and ca.keys() == cb.keys() and all(torch.equal(ca[s], cb[s]) for s in ca)

    log = MetricsLog(tmp_path / "train.jsonl")
    trainer, follower = start_or_resume(st, loop.train_cfg(margin_decode="triton"), checkpoints=str(tmp_path / "ck"),
                                        weights_url=str(tmp_path / "w"), metrics=log)
    run_training(trainer, follower, checkpoints=str(tmp_path / "ck"), weights_url=str(tmp_path / "w"), metrics=log,
                 max_steps=1)
    want, rec = runs["finite"][1], log.records()[0]
    assert (rec["loss"], rec["digest"]) == (want["loss"], want["digest"])
    assert rec["mismatch"] == want["mismatch"]


def test_margin_decode_is_checked_by_the_config_and_the_decoders():
    from tracerl.config import TrainConfig
    from tracerl.errors import ConfigError

    with pytest.raises(ConfigError, match="margin_decode='gpu'; supported: auto, device, host, triton"):
        TrainConfig(margin_decode="gpu").check()
    with pytest.raises(ConfigError, match="margin_decode must be one of"):
        HintFeed(ts.create_store("memory://decode-check", [ts.Site("s", 16)]), margin_decode="gpu")
    with pytest.raises(ConfigError, match="decode must be one of"):
        decode_margin(None, None, decode="gpu")


def test_a_loop_store_can_keep_its_hinted_sites_as_margin_rows(tmp_path):
    """`create_loop_store(margin=)` (benchmark_trainer --margin): every hinted site a margin site in the coding
    asked for, at the margins and payload given; a coding the sites cannot take is tracestore's DeclarationError,
    and nothing is created."""
    from tracerl.loop import create_loop_store
    from tracerl.policy import make_task

    task = make_task(**loop.TASK)
    spec = TinyMoESpec(**loop.SPEC, vocab_size=task.vocab_size)
    st = create_loop_store(str(tmp_path / "m"), spec, task, calibration_prompts=4, margin=(0.05, 0.1, "lsb"),
                           margin_coding="rice2:gamma")
    plain = create_loop_store(str(tmp_path / "b"), spec, task, calibration_prompts=4)
    assert list(st.sites) == list(plain.sites) and st.format_version == 5
    for s in st.sites.values():
        assert (s.hint_encoding, s.value_coding, s.block_coding, s.margin, s.scale_margin, s.scale_payload) == (
            "margin", "rice2", "gamma", 0.05, 0.1, "lsb")
    for coding in ("golomb:bitmap", "gamma:block-bitmap"):  # unknown; rows of 4 blocks are no multiple of 16
        with pytest.raises(ts.DeclarationError, match="coding"):
            create_loop_store(str(tmp_path / "x"), spec, task, calibration_prompts=4, margin=(0.05, 0.1, "byte"),
                              margin_coding=coding)
        assert not (tmp_path / "x").exists()


def test_margin_sites_send_no_scales_or_hints_to_the_device(runs, tmp_path, monkeypatch):
    """The trainer's forward on a margin store hands the QAT forward no rows for its margin sites (`MarginSites`
    quantizes them; zero placeholder rows were 33 MB a step on the H200 model), and its log-probs are those of
    the same batch from the bits store."""
    from tracerl.train.recompute import QATTrainer

    seen = []
    real = QATTrainer._provided

    def spy(self, packed, mode, rows, nrows, device, skip=()):
        out = real(self, packed, mode, rows, nrows, device, skip=skip)
        seen.append((set(skip), set(out)))
        return out

    monkeypatch.setattr(QATTrainer, "_provided", spy)
    lps = {}
    for kind in ("bits", "inf"):
        st = runs[kind][0]
        trainer, _ = start_or_resume(st, loop.train_cfg(), checkpoints=str(tmp_path / kind), weights_url=st.url,
                                     metrics=MetricsLog(tmp_path / f"{kind}.jsonl"))
        (batch,) = list(HintFeed(st).iterate([_mbs(st)[0]]))
        with torch.no_grad():
            fwd, margin = trainer._forward(batch.host, observe=False)
        lps[kind] = fwd.logprobs
        skip, provided = seen[-1]
        assert skip == set(margin) and not (skip & provided)
        assert (skip, provided) == ((set(), set(st.sites)) if kind == "bits" else (set(st.sites), set()))
    assert torch.equal(lps["bits"], lps["inf"])


def test_a_stale_forward_quantizes_from_the_planes_its_micro_batch_decoded(tmp_path, monkeypatch):
    """With the rollout one version ahead on a finite-margin store, each step's stale forward of a kept micro-batch
    uses the margin exceptions the step's own forward decoded (its rows are decoded once, not twice) and measures
    what decoding them again measures: the same mismatch, code counts, loss and weights."""
    from tracerl.train import grpo

    calls = []
    real = grpo.decode_margin
    monkeypatch.setattr(grpo, "decode_margin", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = {}
    for reuse in (True, False):
        d = tmp_path / str(reuse)
        st = _store(str(d / "store"), "finite")
        log = MetricsLog(d / "train.jsonl")
        trainer, follower = start_or_resume(st, loop.train_cfg(max_staleness=1, measure_stale_every=1),
                                            checkpoints=str(d / "ck"), weights_url=st.url, metrics=log)
        if not reuse:  # every forward decodes its rows itself
            own = trainer._forward
            trainer._forward = lambda packed, observe, margin=None, own=own, **k: own(packed, observe, **k)
        calls.clear()
        seen = []  # decodes so far, after each step
        loop.train_one_version_ahead(trainer, follower, st, d / "ck", log, 2, record_codes=True, decode="hf",
                                     after_step=lambda: seen.append(len(calls)))
        out[reuse] = (log.records(), [seen[0], seen[1] - seen[0]])
    (got, n_reuse), (want, n_again) = out[True], out[False]
    assert [m["policy_versions"] for m in got] == [[0], [0]]
    assert got[1]["mismatch"]["code_values"] > 0 and got[1]["mismatch"]["unmeasured_tokens"] == 0
    assert n_reuse[0] == n_again[0] and n_again[1] == 2 * n_reuse[1] > 0  # step 2: one decode per micro-batch
    for a, b in zip(got, want):
        assert (a["mismatch"], a["loss"], a["digest"]) == (b["mismatch"], b["loss"], b["digest"])


def test_a_keeping_step_starts_its_weight_snapshot_after_the_first_margin_decode(tmp_path, monkeypatch):
    """A step that keeps its version's weights queues their device -> host copies only after its first micro-batch's
    margin rows are decoded: the decoder reads its error flags back to the host, and on a GPU that read waits behind
    every copy queued before it (+73 ms on the H100 at 20 layers). One snapshot per keeping step, as before."""
    from tracerl.train import grpo

    events = []
    real = grpo.decode_margin
    monkeypatch.setattr(grpo, "decode_margin", lambda *a, **k: events.append("decode") or real(*a, **k))
    st = _store(str(tmp_path / "store"), "finite")
    log = MetricsLog(tmp_path / "train.jsonl")
    trainer, follower = start_or_resume(st, loop.train_cfg(max_staleness=1, measure_stale_every=1),
                                        checkpoints=str(tmp_path / "ck"), weights_url=st.url, metrics=log)
    snap = trainer.trainable.snapshot
    trainer.trainable.snapshot = lambda *a, **k: events.append("snapshot") or snap(*a, **k)
    per_step = []
    loop.train_one_version_ahead(trainer, follower, st, tmp_path / "ck", log, 2, record_codes=True, decode="hf",
                                 after_step=lambda: per_step.append(events[:]) or events.clear())
    assert len(per_step) == 2
    for ev in per_step:  # every step keeps its version (measure_stale_every=1)
        assert ev.count("snapshot") == 1 and ev[0] == "decode", ev
    assert [m["mismatch"]["unmeasured_tokens"] for m in log.records()] == [0, 0]
