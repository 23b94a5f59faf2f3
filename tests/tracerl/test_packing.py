"""THD packing and DP / CP (zig-zag) / TP slicing, checked against hand-computed indices."""

import numpy as np
import pytest

from tracerl.errors import ConfigError
from tracerl.hints import MicroBatch, Segment, cp_shard, cp_zigzag_ranges, dp_shard, pack_micro_batches, read_packed, tp_feature_range
from tracerl.rollout import MemorySink


def test_zigzag_even_split():
    # L=16, C=2: 4 chunks of 4 -> rank 0: chunks 0,3; rank 1: chunks 1,2
    assert cp_zigzag_ranges(16, 0, 2) == [(0, 4), (12, 16)]
    assert cp_zigzag_ranges(16, 1, 2) == [(4, 8), (8, 12)]


def test_zigzag_uneven_split_worked_example():
    # L=10, C=2: chunk sizes 3,3,2,2 (first L % 4 = 2 chunks one longer)
    assert cp_zigzag_ranges(10, 0, 2) == [(0, 3), (8, 10)]
    assert cp_zigzag_ranges(10, 1, 2) == [(3, 6), (6, 8)]


@pytest.mark.parametrize("length", [1, 7, 37, 199, 256])
@pytest.mark.parametrize("size", [1, 2, 3, 4])
def test_zigzag_partitions_every_token_once(length, size):
    covered = np.zeros(length, dtype=int)
    for r in range(size):
        for lo, hi in cp_zigzag_ranges(length, r, size):
            covered[lo:hi] += 1
    assert (covered == 1).all()


def test_zigzag_balances_causal_work():
    # causal attention work of a chunk [lo, hi) ~ sum of positions; zig-zag makes ranks within 1 chunk of equal.
    work = [sum(sum(range(lo, hi)) for lo, hi in cp_zigzag_ranges(4096, r, 4)) for r in range(4)]
    assert max(work) / min(work) < 1.01


def test_cp_shard_offsets_segments():
    mb = MicroBatch((Segment("a", 0, 10), Segment("b", 100, 108)))
    sh = cp_shard(mb, 1, 2)
    assert [(s.traj_id, s.start, s.stop) for s in sh.segments] == [
        ("a", 3, 6), ("a", 6, 8), ("b", 102, 104), ("b", 104, 106)]
    assert sh.cu_seqlens.tolist() == [0, 3, 5, 7, 9]


def test_tp_feature_range_block_aligned():
    assert tp_feature_range(2048, 0, 4) == (0, 512)
    assert tp_feature_range(2048, 3, 4) == (1536, 2048)
    with pytest.raises(ConfigError, match="blocks"):
        tp_feature_range(48, 0, 2)  # 24 values per rank is not whole 16-value blocks


def test_dp_shard_round_robin_and_rank_check():
    mbs = [MicroBatch((Segment(str(i), 0, 1),)) for i in range(5)]
    assert [m.segments[0].traj_id for m in dp_shard(mbs, 1, 2)] == ["1", "3"]
    with pytest.raises(ConfigError):
        dp_shard(mbs, 2, 2)


def test_pack_micro_batches_first_fit_and_split():
    mbs = pack_micro_batches({"a": 6, "b": 3, "c": 12, "d": 1}, max_tokens=8)
    got = [[(s.traj_id, s.start, s.stop) for s in m.segments] for m in mbs]
    # a(6) -> mb0; b(3) doesn't fit mb0 (room 2) -> mb1; c splits 8+4: c[0:8] -> mb2, c[8:12] -> mb1; d -> mb0
    assert got == [[("a", 0, 6), ("d", 0, 1)], [("b", 0, 3), ("c", 8, 12)], [("c", 0, 8)]]
    assert all(m.num_tokens <= 8 for m in mbs)


def _sink_with(traj_lengths, width=64):
    sink = MemorySink({"s": width})
    for t, n in traj_lengths.items():
        h = (np.arange(n * width // 8) % 251).astype(np.uint8).reshape(n, width // 8) + len(t)
        sc = (np.arange(n * width // 16) % 127).astype(np.uint8).reshape(n, width // 16)
        # written in two pieces, as a recorder flushing a long request would
        k = n // 2
        for lo, hi in ((0, k), (k, n)):
            sink.write(t, lo, hints={"s": h[lo:hi]}, scales={"s": sc[lo:hi]}, token_ids=np.arange(lo, hi),
                       logprobs=np.zeros(hi - lo, np.float32))
    return sink


def test_read_packed_thd_with_cp_and_tp_slices():
    sink = _sink_with({"a": 10, "bb": 6})
    mb = MicroBatch((Segment("a", 0, 10), Segment("bb", 0, 6)))
    full = read_packed(sink, mb, ["s"])
    assert full.cu_seqlens.tolist() == [0, 10, 16]
    assert full.hints["s"].shape == (16, 8) and full.scales["s"].shape == (16, 4)
    part = read_packed(sink, cp_shard(mb, 0, 2), ["s"], features=tp_feature_range(64, 1, 2))
    # CP rank 0 of a (L=10): [0,3)+[8,10); of bb (L=6, sizes 2,2,1,1): [0,2)+[5,6)
    assert part.positions.tolist() == [0, 1, 2, 8, 9, 0, 1, 5]
    rows = np.r_[0:3, 8:10, 10:12, 15:16]
    # TP rank 1 of 2: values [32, 64) -> hint bytes [4, 8), scale bytes [2, 4)
    np.testing.assert_array_equal(part.hints["s"], full.hints["s"][rows, 4:8])
    np.testing.assert_array_equal(part.scales["s"], full.scales["s"][rows, 2:4])
    np.testing.assert_array_equal(part.token_ids, full.token_ids[rows])


def test_read_packed_from_tracestore_matches_memory_sink(tmp_path):
    import tracestore as ts

    mem = _sink_with({"a": 10, "bb": 6})
    store = ts.create_store(str(tmp_path / "s"), [ts.Site("s", 64)])
    with store.writer() as w:
        for t in ("a", "bb"):
            for start, piece in mem._pieces[t]:
                w.write(t, start, hints=piece.hints, scales=piece.scales, token_ids=piece.token_ids,
                        logprobs=piece.logprobs)
    reader = ts.open_store(str(tmp_path / "s")).reader()
    mb = cp_shard(MicroBatch((Segment("a", 0, 10), Segment("bb", 0, 6))), 1, 2)
    feats = tp_feature_range(64, 0, 2)
    got = read_packed(reader, mb, ["s"], features=feats, read_kwargs={"fmt": "numpy"})
    want = read_packed(mem, mb, ["s"], features=feats)
    np.testing.assert_array_equal(got.hints["s"], want.hints["s"])
    np.testing.assert_array_equal(got.scales["s"], want.scales["s"])
    np.testing.assert_array_equal(got.positions, want.positions)
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
