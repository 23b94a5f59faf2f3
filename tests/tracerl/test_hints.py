"""The public API for other trainers (`tracerl.hints`): the hint feed gives each rank exactly its slice and the union
is the whole batch, in order, read ahead with bounded memory, errors where their batch would be; the model patcher
makes a stock Hugging Face model compute what tracerl's own FP4 model computes (bit for bit, every mode, with and
without routing replay), refuses a model it was not written for with one typed line and no change, and its
removal restores the original forward bit for bit; a training step written against these two alone shows the same
code agreement as tracerl's trainer on the same store."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import tracestore as ts
from helpers import loop
from tracerl import fidelity
from tracerl.artifacts import weights
from tracerl.errors import ConfigError, HintMismatchError, PatchError
from tracerl.hints import HintFeed, MicroBatch, Segment, pack_micro_batches, patch_model
from tracerl.hints.feed import _Queue
from tracerl.policy import TinyMoESpec, build_model, build_policy, moe_input_site, plan_sites
from tracerl.rollout import RolloutWorker, run_rollout
from tracerl.train import Follower, GRPOTrainer, QATTrainer


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A loop store with one batch (8 trajectories, codes recorded) by version 0."""
    st = loop.create(str(tmp_path_factory.mktemp("hints") / "store"))
    weights.publish(st.url, 0, build_policy(st.model).model.state_dict())
    with RolloutWorker(st, loop.rollout_cfg(record_codes=True)) as worker:
        run_rollout(worker, max_batches=1)
    return ts.open_store(st.url)


def _batches(store, tokens=24):
    lens = {t.traj_id: t.num_tokens for t in store.reader().trajectories() if t.complete}
    return pack_micro_batches(lens, tokens)


def test_each_rank_gets_exactly_its_slice_and_the_union_is_the_batch(store):
    mbs = _batches(store)
    reader = store.reader()
    rows = {}
    for dp in (0, 1):
        for cp in (0, 1):
            for tp in (0, 1):
                feed = HintFeed(store, dp=(dp, 2), cp=(cp, 2), tp=(tp, 2))
                for mb in feed.iterate(mbs):
                    for site, (lo, hi) in mb.features.items():
                        assert mb.hints[site].shape[1] == (hi - lo) // 8 and mb.scales[site].shape[1] == (hi - lo) // 16
                    off = mb.cu_seqlens.tolist()
                    for i, seg in enumerate(mb.segments):
                        want = reader.read(seg.traj_id, seg.start, seg.stop, fmt="numpy")
                        got = slice(off[i], off[i + 1])
                        assert np.array_equal(mb.token_ids[got].numpy(), want.token_ids)
                        assert np.array_equal(mb.positions[got].numpy(), np.arange(seg.start, seg.stop))
                        for site, (lo, hi) in mb.features.items():
                            assert np.array_equal(mb.hints[site][got].numpy(), want.hints[site][:, lo // 8:hi // 8])
                            assert np.array_equal(mb.scales[site][got].numpy(),
                                                  want.scales[site][:, lo // 16:hi // 16])
                        for tok in range(seg.start, seg.stop):
                            rows.setdefault((seg.traj_id, tok), set()).add((dp, cp, tp))
                        assert float(mb.rewards[i]) == reader.result(seg.traj_id).reward
    whole = {(s.traj_id, t) for mb in mbs for s in mb.segments for t in range(s.start, s.stop)}
    assert set(rows) == whole
    # every token once per tensor-parallel rank, in exactly one (dp, cp) slice
    assert all(len({(d, c) for d, c, _ in owners}) == 1 and len(owners) == 2 for owners in rows.values())


def test_the_feed_hands_out_in_order_and_raises_where_the_bad_batch_is(store):
    mbs = _batches(store)
    bad = MicroBatch((Segment("no-such-trajectory", 0, 4),))
    got = []
    with pytest.raises(ts.HintNotFoundError):
        for mb in HintFeed(store).iterate([*mbs[:2], bad, *mbs[2:]]):
            got.append(mb.segments)
    assert got == [mb.segments for mb in mbs[:2]]


def test_reading_ahead_holds_at_most_the_cap():
    q = _Queue(cap=100)
    assert q.put("a", 60) and q.held == 60
    blocked = threading.Event()

    def producer():
        q.put("b", 60)  # 120 > 100: waits for the consumer
        blocked.set()

    t = threading.Thread(target=producer)
    t.start()
    assert not blocked.wait(0.3) and q.held == 60
    assert q.get() == "a"
    assert blocked.wait(5) and q.held == 60
    q.close()
    t.join()
    assert q.put("c", 1) is False  # closed: the producer stops


@pytest.mark.parametrize("mode", ["fp4_hints", "fp4_rne_own_scales", "fp4_rne_rollout_scales"])
@pytest.mark.parametrize("replay", [False, True])
def test_a_patched_stock_model_computes_what_tracerls_model_does(store, mode, replay):
    ours = build_policy(store.model)
    stock = build_model(TinyMoESpec(**store.model["spec"]), seed=int(store.model["seed"]))
    patch = patch_model(stock, store, routing_replay=replay)
    for mb in HintFeed(store).iterate(_batches(store)[:2]):
        a = QATTrainer(ours.model, ours.runtime).token_logprobs(mb.host, mode, replay_routes=replay, observe=True)
        b = QATTrainer(stock, patch.runtime).token_logprobs(mb.host, mode, replay_routes=replay, observe=True)
        assert torch.equal(a.logprobs, b.logprobs)
        assert a.codes.keys() == b.codes.keys() and all(torch.equal(a.codes[s], b.codes[s]) for s in a.codes)


def _forward(model, mb):
    return model(input_ids=mb.token_ids[None], position_ids=mb.positions[None], use_cache=False).logits


def test_removing_the_patch_restores_the_forward_bit_for_bit(store):
    stock = build_model(TinyMoESpec(**store.model["spec"]), seed=0)
    mb = next(iter(HintFeed(store).iterate(_batches(store)[:1])))
    with torch.no_grad():
        before = _forward(stock, mb)
        with patch_model(stock, store) as patch, patch.micro_batch(mb):
            during = _forward(stock, mb)
        after = _forward(stock, mb)
    assert not torch.equal(before, during)  # it did change what the model computes
    assert torch.equal(before, after)
    assert all(not m._forward_pre_hooks and not m._forward_hooks and "forward" not in m.__dict__
               for m in stock.modules())


def _hooks(model) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) + ("forward" in m.__dict__) for m in model.modules())


@pytest.mark.parametrize("change, message", [
    ("unknown site", "has no module"),
    ("width", "width"),
    ("kv", "KV-cache"),
    ("no scale", "no global scale"),
])
def test_a_model_the_patch_was_not_written_for_is_refused_and_left_unchanged(store, change, message):
    model = build_model(TinyMoESpec(**store.model["spec"]), seed=0)
    plan = plan_sites(model, hint_layers="all")
    scales = dict(store.model["global_scales"])
    if change == "unknown site":
        other = build_model(TinyMoESpec(**{**store.model["spec"], "num_layers": 3}), seed=0)
        plan = plan_sites(other, hint_layers="all")
        scales = {s.name: 1e-3 for s in plan.sites}
    elif change == "width":
        other = build_model(TinyMoESpec(**{**store.model["spec"], "hidden_size": 128}), seed=0)
        plan = plan_sites(other, hint_layers="all")
        scales = {s.name: 1e-3 for s in plan.sites}
    elif change == "kv":
        plan = plan_sites(model, hint_layers="all", kv_fp4=True)
        scales = {s.name: 1e-3 for s in plan.sites}
    else:
        scales.pop(moe_input_site(0))
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(PatchError, match=message) as e:
        patch_model(model, plan, global_scales=scales)
    assert "\n" not in str(e.value)
    assert _hooks(model) == 0 and all(torch.equal(sd[k], v) for k, v in model.state_dict().items())


def test_rows_that_do_not_fit_the_forward_are_a_typed_error(store):
    stock = build_model(TinyMoESpec(**store.model["spec"]), seed=0)
    a = next(iter(HintFeed(store).iterate(_batches(store)[:1])))
    with patch_model(stock, store) as patch, patch.micro_batch(a), pytest.raises(HintMismatchError, match="needs scales"):
        stock(input_ids=a.token_ids[None, :-1], position_ids=a.positions[None, :-1], use_cache=False)  # one row short


def test_a_step_against_the_api_alone_agrees_like_tracerls_trainer(store):
    """The README's example step (a stock model, FSDP2, AdamW, the feed and the patch) measures the same code
    agreement at the hinted sites as `tracerl train`'s first step on the same store (same weights, same packing)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cfg = loop.train_cfg(micro_batch_tokens=64)
    follower = Follower(store, cfg.group_size)
    taken = follower.take(cfg.groups_per_step, version=0, max_staleness=cfg.max_staleness, timeout_s=30)
    ours = GRPOTrainer(store, cfg).step(taken)["mismatch"]
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        model = build_model(TinyMoESpec(**store.model["spec"]), seed=int(store.model["seed"]))
        patch = patch_model(model, store)
        model.float()
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for unit in [*model.model.layers, model]:
            fully_shard(unit, mp_policy=mp)
        trajs = [t for g in taken.groups for t in g.trajectories]
        match = total = 0
        for mb in HintFeed(store, codes=True).iterate(pack_micro_batches({t.traj_id: t.num_tokens for t in trajs},
                                                                          cfg.micro_batch_tokens)):
            with torch.no_grad(), patch.micro_batch(mb, observe=True):
                _forward(model, mb)
            rows = mb.response.nonzero()[:, 0]
            for site, codes in patch.codes.items():
                m, n, _, _ = fidelity.count_code_matches(codes[rows], mb.codes[site][rows])
                match, total = match + m, total + n
    finally:
        dist.destroy_process_group()
    assert total == ours["code_values"] > 0
    assert match / total == ours["code_agreement"]


def _same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.segments == y.segments and x.features == y.features
        for k in ("cu_seqlens", "token_ids", "positions", "policy_versions"):
            assert torch.equal(getattr(x, k), getattr(y, k)), k
        for k in ("logprobs", "rewards"):
            assert torch.equal(getattr(x, k).nan_to_num(7.0), getattr(y, k).nan_to_num(7.0)), k
        for k in ("hints", "scales", "experts", "codes"):
            dx, dy = getattr(x, k), getattr(y, k)
            assert dx.keys() == dy.keys() and all(torch.equal(dx[s], dy[s]) for s in dx), k


def test_a_reader_process_hands_out_what_the_reading_thread_does(store):
    """``reader="process"``: the batches (by the log index and from the trajectories' records, whole and as
    tensor-parallel slices, with the recorded codes) are the reading thread's byte for byte, one child serves
    several iterations, an error keeps its type and position, `close` ends the child; "auto" on the CPU is a
    thread; a memory store cannot be read by another process (a typed error)."""
    mbs = _batches(store)
    cfg = loop.train_cfg()
    taken = Follower(store, cfg.group_size).take(cfg.groups_per_step, version=0, max_staleness=cfg.max_staleness,
                                                  timeout_s=30)
    trajs = {t.traj_id: t for g in taken.groups for t in g.trajectories}  # with their committed records
    mine = pack_micro_batches({t: tr.num_tokens for t, tr in trajs.items()}, 24)
    assert HintFeed(store).reader == "thread"
    with HintFeed(store, reader="process", codes=True) as feed:
        assert feed.reader == "process"
        _same_batches(list(feed.iterate(mbs)), list(HintFeed(store, codes=True, reader="thread").iterate(mbs)))
        _same_batches(list(feed.iterate(mine, trajectories=trajs)),
                      list(HintFeed(store, codes=True, reader="thread").iterate(mine, trajectories=trajs)))
        child = feed._process
        got = []
        with pytest.raises(ts.HintNotFoundError):
            for mb in feed.iterate([*mbs[:1], MicroBatch((Segment("no-such-trajectory", 0, 4),)), *mbs[1:]]):
                got.append(mb.segments)
        assert got == [mbs[0].segments] and feed._process is child  # the same child after an error
    assert feed._process is None
    with HintFeed(store, reader="process", tp=(1, 2)) as feed:
        _same_batches(list(feed.iterate(mbs[:2])), list(HintFeed(store, tp=(1, 2), reader="thread").iterate(mbs[:2])))
    mem = ts.create_store("memory://feed-reader-test", [ts.Site("s", 32)])
    with pytest.raises(ConfigError, match="cannot be opened in another process"):
        HintFeed(mem, reader="process")
    with pytest.raises(ConfigError, match="reader must be one of"):
        HintFeed(store, reader="fork")
    assert HintFeed(mem).reader == "thread"


def test_a_snapshot_source_finds_a_result_committed_after_it(tmp_path):
    """`SnapshotSource.result`: a result committed after the snapshot is found once the snapshot is
    ``renew_after_s`` old; a miss within that interval does not renew it (no renewal at every call)."""
    from tracerl.hints.source import SnapshotSource

    st = ts.create_store(str(tmp_path / "s"), [ts.Site("s", 32)])
    with st.writer("w", commit_interval_s=0) as w:
        w.write("a", 0, hints={"s": np.zeros((2, 4), np.uint8)}, scales={"s": np.zeros((2, 2), np.uint8)},
                token_ids=np.arange(2), logprobs=np.zeros(2, np.float32))
        w.flush()
        slow, fast = SnapshotSource(st, renew_after_s=3600), SnapshotSource(st, renew_after_s=0)
        assert slow.result("a") is None and fast.result("a") is None
        w.write_result("a", reward=1.5)
    kept = slow.reader
    assert slow.result("a") is None and slow.reader is kept  # within the interval: the old snapshot
    assert fast.result("a").reward == 1.5
