"""Where a trainer's micro-batches come from: the committed records of complete trajectories (`RecordSource`),
read ahead of the forward with bounded memory (`read_ahead`), and a next step's micro-batches read in the
background while the current step computes (`BackgroundReads`)."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

import tracestore as ts
from tracerl.hints.packing import MicroBatch, PackedHints, read_packed

log = logging.getLogger(__name__)

__all__ = ["BackgroundReads", "RecordSource", "packed_nbytes", "read_ahead"]


class RecordSource:
    """`read_packed`'s source over trajectories' committed records: a range of a trajectory is read from the
    records that cover it (`tracestore.read_record`), without a Reader (which would index the whole log).

    ``trajs``: traj_id -> anything with the trajectory's ``records`` (`tracestore.CommittedRecord`s covering its
    tokens), e.g. a `tracerl.train.Trajectory`."""

    def __init__(self, store: ts.Store, trajs: Mapping[str, Any]):
        self.store = store
        self.trajs = trajs

    def read(self, traj_id: str, start: int, stop: int, *, sites=None, features=None, **kwargs):
        parts = []
        for r in self.trajs[traj_id].records:
            lo, hi = max(start, r.token_start), min(stop, r.token_stop)
            if lo < hi:
                parts.append(ts.read_record(self.store, r, start=lo, stop=hi, sites=sites, features=features,
                                            **kwargs))

        def cat(get):
            return np.concatenate([np.asarray(get(p)) for p in parts])

        return SimpleNamespace(
            token_ids=cat(lambda p: p.token_ids), positions=cat(lambda p: p.positions),
            logprobs=cat(lambda p: p.logprobs), policy_version=cat(lambda p: p.policy_version),
            hints={s: cat(lambda p, s=s: p.hints[s]) for s in parts[0].hints},
            scales={s: cat(lambda p, s=s: p.scales[s]) for s in parts[0].scales},
            experts={k: cat(lambda p, k=k: p.experts[k]) for k in parts[0].experts})


def packed_nbytes(packed: PackedHints) -> int:
    """Bytes of a micro-batch's arrays (token ids, positions, log-probs, hints, scales, experts)."""
    arrays = [packed.cu_seqlens, packed.token_ids, packed.positions, packed.logprobs,
              *packed.hints.values(), *packed.scales.values(), *packed.experts.values()]
    return sum(int(a.nbytes) for a in arrays)


def read_ahead(source: Any, mbs: Sequence[MicroBatch], sites: Sequence[str],
               cap_bytes: int) -> Iterator[tuple[PackedHints, float, float]]:
    """Yield ``(packed, loaded_unix, read_seconds)`` for each micro-batch of ``mbs`` in order, reading ahead of
    the consumer: before each yield, further micro-batches are read while those read and not yet yielded hold at
    most ``cap_bytes`` (at least one is always read). With the default cap a step's whole batch is read before its
    first forward, so its lag is the store's, not the time the trainer computes on earlier micro-batches."""
    queue: collections.deque = collections.deque()
    held = 0
    it = iter(mbs)
    more = True
    while True:
        while more and (not queue or held < cap_bytes):
            mb = next(it, None)
            if mb is None:
                more = False
                break
            t0 = time.perf_counter()
            packed = read_packed(source, mb, sites, read_kwargs={"fmt": "numpy"})
            n = packed_nbytes(packed)
            queue.append((packed, time.time(), time.perf_counter() - t0, n))
            held += n
        if not queue:
            return
        packed, loaded, secs, n = queue.popleft()
        held -= n
        yield packed, loaded, secs


def _layout(mbs: Sequence[MicroBatch], sites: Sequence[str]) -> tuple:
    """What a read of ``mbs`` returns is a function of this key alone (committed records never change)."""
    return (tuple(sites), tuple(tuple((s.traj_id, s.start, s.stop) for s in mb.segments) for mb in mbs))


class BackgroundReads:
    """Micro-batches of a coming step, read in a daemon thread while the caller computes the current one.

    ``BackgroundReads(source, mbs, sites, cap_bytes)`` starts reading ``mbs`` in order (`read_packed`, numpy
    arrays in host memory), stopping once those read hold ``cap_bytes`` or more (at least one is read, as
    `read_ahead` does). `take` hands the reads over to a step that reads the same micro-batches: it waits for the
    thread and returns the leading ``(packed, loaded_unix, read_seconds)`` it read (possibly fewer than asked
    for: the caller reads the rest itself), or ``[]`` when the step reads other micro-batches or other sites, or
    the background read failed (logged at INFO; the caller's own read then meets the same error with its own
    context, so a storage failure is never hidden or read as "absent"). Committed records never change, so data
    read ahead is the data a read at the step would return, byte for byte.

    The thread holds the GIL only between its storage calls and numpy copies; a caller computing on a GPU
    overlaps the read with its kernels."""

    def __init__(self, source: Any, mbs: Sequence[MicroBatch], sites: Sequence[str], cap_bytes: int):
        self._key = _layout(mbs, sites)
        self._done: list[tuple[PackedHints, float, float]] = []
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(source, list(mbs), list(sites), cap_bytes),
                                        name="tracerl-read-next-step", daemon=True)
        self._thread.start()

    def _run(self, source: Any, mbs: list[MicroBatch], sites: list[str], cap_bytes: int) -> None:
        held = 0
        try:
            for mb in mbs:
                if self._done and held >= cap_bytes:
                    break
                t0 = time.perf_counter()
                packed = read_packed(source, mb, sites, read_kwargs={"fmt": "numpy"})
                self._done.append((packed, time.time(), time.perf_counter() - t0))
                held += packed_nbytes(packed)
        except BaseException as e:  # noqa: BLE001 - handed to take(), which re-reads in the caller
            self._error = e

    def take(self, mbs: Sequence[MicroBatch], sites: Sequence[str]) -> list[tuple[PackedHints, float, float]]:
        """The reads done for ``mbs`` / ``sites`` (see the class docstring); waits for the thread first."""
        self._thread.join()
        if _layout(mbs, sites) != self._key:
            log.debug("read ahead for other micro-batches than the step's: dropped")
            return []
        if self._error is not None:
            log.info("reading the next step ahead failed (%s: %s); the step reads it again",
                     type(self._error).__name__, self._error)
            return []
        return self._done
