"""Aligning stored hints with the trainer's packed micro-batches and parallel ranks.

A micro-batch is a list of segments ``(traj_id, start, stop)`` concatenated along the token axis (THD layout:
tokens x hidden, no batch dim) with ``cu_seqlens`` = [0, len0, len0+len1, ...]. Each rank reads only its own
part of the store:

- data parallel: rank r of D takes micro-batches r, r+D, r+2D, ... (`dp_shard`);
- context parallel, Megatron's zig-zag split: each sequence of length L is cut into 2*C chunks (the first
  ``L % (2C)`` chunks one token longer), and rank r takes chunks r and 2C-1-r, which balances causal-attention
  work (`cp_zigzag_ranges`);
- tensor parallel: rank r of P takes a contiguous, block-aligned slice [lo, hi) of each site's features, i.e.
  hint bytes [lo/8, hi/8) and scale bytes [lo/16, hi/16) (`tp_feature_range`).

`read_packed` issues one ranged read per (segment, CP chunk) with ``features=(lo, hi)`` against any hint
source with tracestore's ``Reader.read`` signature, so no rank loads whole trajectories.

Worked example (C=2, L=10): chunks of sizes 3,3,2,2 -> [0,3) [3,6) [6,8) [8,10); rank 0 gets [0,3)+[8,10),
rank 1 gets [3,6)+[6,8).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from tracerl.errors import ConfigError
from tracerl.policy import BLOCK


@dataclasses.dataclass(frozen=True)
class Segment:
    traj_id: str
    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ConfigError(f"segment {self.traj_id!r}: need 0 <= start <= stop, got [{self.start}, {self.stop})")

    def __len__(self) -> int:
        return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    segments: tuple[Segment, ...]

    @property
    def cu_seqlens(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(s) for s in self.segments])]).astype(np.int64)

    @property
    def num_tokens(self) -> int:
        return int(sum(len(s) for s in self.segments))


def pack_micro_batches(lengths: Mapping[str, int], max_tokens: int) -> list[MicroBatch]:
    """Greedy first-fit packing of whole trajectories (in the given order) into micro-batches of <= max_tokens.

    A trajectory longer than ``max_tokens`` is split into consecutive segments.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1, got {max_tokens}")
    batches: list[list[Segment]] = []
    room: list[int] = []
    for traj, n in lengths.items():
        start = 0
        while start < n:
            take = min(n - start, max_tokens)
            for i, r in enumerate(room):
                if r >= take:
                    batches[i].append(Segment(traj, start, start + take))
                    room[i] -= take
                    break
            else:
                batches.append([Segment(traj, start, start + take)])
                room.append(max_tokens - take)
            start += take
    return [MicroBatch(tuple(b)) for b in batches]


def dp_shard(micro_batches: Sequence[MicroBatch], rank: int, size: int) -> list[MicroBatch]:
    """Micro-batches of data-parallel rank ``rank`` of ``size`` (round robin)."""
    _check_rank("data-parallel", rank, size)
    return list(micro_batches[rank::size])


def cp_zigzag_ranges(length: int, rank: int, size: int) -> list[tuple[int, int]]:
    """Token ranges [start, stop) (relative to the sequence) of context-parallel rank ``rank`` of ``size``.

    Megatron zig-zag: 2*size chunks, rank r gets chunks r and 2*size-1-r. Empty chunks are dropped.
    """
    _check_rank("context-parallel", rank, size)
    n = 2 * size
    base, extra = divmod(length, n)
    bounds = np.concatenate([[0], np.cumsum([base + (1 if i < extra else 0) for i in range(n)])])
    out = []
    for c in (rank, n - 1 - rank):
        lo, hi = int(bounds[c]), int(bounds[c + 1])
        if hi > lo:
            out.append((lo, hi))
    return out


def cp_shard(mb: MicroBatch, rank: int, size: int) -> MicroBatch:
    """The micro-batch as context-parallel rank ``rank`` sees it: each segment's zig-zag chunks."""
    segs = []
    for s in mb.segments:
        for lo, hi in cp_zigzag_ranges(len(s), rank, size):
            segs.append(Segment(s.traj_id, s.start + lo, s.start + hi))
    return MicroBatch(tuple(segs))


def tp_feature_range(width: int, rank: int, size: int, block: int = BLOCK) -> tuple[int, int]:
    """Block-aligned feature slice [lo, hi) of tensor-parallel rank ``rank`` of ``size`` for a site of ``width``."""
    _check_rank("tensor-parallel", rank, size)
    if width % (block * size):
        raise ConfigError(
            f"site width {width} does not split into {size} tensor-parallel slices of whole {block}-value blocks"
        )
    per = width // size
    return rank * per, (rank + 1) * per


def _check_rank(what: str, rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(f"{what} rank {rank} of size {size}: need size >= 1 and 0 <= rank < size")


@dataclasses.dataclass
class PackedHints:
    """One rank's view of a micro-batch in THD layout (T = sum of its segments' lengths)."""

    segments: tuple[Segment, ...]
    cu_seqlens: np.ndarray  # int64 [S+1]
    token_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T], position of each token in its trajectory
    logprobs: np.ndarray  # float32 [T], rollout log-probs (NaN for prompt tokens)
    hints: dict[str, np.ndarray]  # site -> uint8 [T, (hi-lo)/8]
    scales: dict[str, np.ndarray]  # site -> uint8 [T, (hi-lo)/16] (scale encoding lsb: scale hints, 1 bit per block)
    experts: dict[str, np.ndarray]  # moe layer -> uint8 [T, top_k]
    features: tuple[int, int] | None
    policy_versions: np.ndarray | None = None  # int64 [T], when the source records them
    #: site -> (data uint8 [n], offsets int64 [T + 1]): the margin-exception rows of the sites the store keeps as
    #: such (tracestore format 5, hint encoding margin; `tracerl.hints.compact` decodes them); those sites have no
    #: hints/scales entry
    margin: dict[str, tuple[np.ndarray, np.ndarray]] = dataclasses.field(default_factory=dict)


def read_packed(
    source: Any,
    mb: MicroBatch,
    sites: Sequence[str],
    *,
    features: tuple[int, int] | None = None,
    read_kwargs: Mapping[str, Any] | None = None,
) -> PackedHints:
    """Read ``mb``'s token ranges of ``sites`` (feature slice ``features``) from ``source`` into THD arrays.

    ``source.read(traj_id, start, stop, sites=..., features=...)`` is tracestore's ``Reader.read`` (pass
    ``read_kwargs={"fmt": "numpy"}``) or `tracerl.rollout.recorder.MemorySink.read`. Sites the source hands out as
    margin-exception rows (``batch.rows``: a store's margin sites) go to ``PackedHints.margin``, the rows of the
    segments concatenated in order (offsets ``[T + 1]``).
    """
    parts = [
        source.read(s.traj_id, s.start, s.stop, sites=list(sites), features=features, **(read_kwargs or {}))
        for s in mb.segments
    ]
    for s, p in zip(mb.segments, parts):
        got = len(np.asarray(p.token_ids))
        if got != len(s):
            raise ConfigError(f"segment {s}: the source returned {got} tokens, expected {len(s)}")

    def cat(get):
        return np.concatenate([np.asarray(get(p)) for p in parts]) if parts else np.zeros(0)

    layers = list(parts[0].experts) if parts and parts[0].experts else []
    given = (getattr(parts[0], "rows", None) or {}) if parts else {}
    margin_sites = [s for s in sites if s in given]
    bits = [s for s in sites if s not in given]
    return PackedHints(
        segments=mb.segments,
        cu_seqlens=mb.cu_seqlens,
        token_ids=cat(lambda p: p.token_ids).astype(np.int64),
        positions=cat(lambda p: p.positions).astype(np.int64),
        logprobs=cat(lambda p: p.logprobs).astype(np.float32),
        hints={s: cat(lambda p, s=s: p.hints[s]) for s in bits},
        scales={s: cat(lambda p, s=s: p.scales[s]) for s in bits},
        margin={s: concat_margin_rows([p.rows[s] for p in parts]) for s in margin_sites},
        experts={la: cat(lambda p, la=la: p.experts[la]) for la in layers},
        features=features,
        policy_versions=(cat(lambda p: p.policy_version).astype(np.int64)
                         if parts and getattr(parts[0], "policy_version", None) is not None else None),
    )


def concat_margin_rows(parts: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Margin rows of consecutive token ranges, each (data uint8 [n_i], offsets int64 [T_i + 1] from 0), as one
    (data [sum n_i], offsets [sum T_i + 1])."""
    datas = [np.asarray(d, dtype=np.uint8) for d, _ in parts]
    offs = [np.asarray(o, dtype=np.int64) for _, o in parts]
    shift = np.cumsum([0] + [len(d) for d in datas[:-1]])
    offsets = np.concatenate([np.zeros(1, np.int64)] + [o[1:] + k for o, k in zip(offs, shift)])
    return (np.concatenate(datas) if datas else np.zeros(0, np.uint8)), offsets
