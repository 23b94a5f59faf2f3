"""Where a trainer's micro-batches come from: the committed records of complete trajectories (`RecordSource`),
read ahead of the forward with bounded memory (`read_ahead`), and a next step's micro-batches read in the
background while the current step computes (`BackgroundReads`: in a thread, or in a `ReaderProcess`)."""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import io
import logging
import multiprocessing
import pickle
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import shared_memory
from types import SimpleNamespace
from typing import Any

import numpy as np

import tracestore as ts
from tracerl.errors import ConfigError
from tracerl.hints.packing import MicroBatch, PackedHints, concat_margin_rows, read_packed

log = logging.getLogger(__name__)

__all__ = ["BackgroundReads", "ReaderProcess", "RecordSource", "SnapshotSource", "packed_nbytes", "read_ahead"]


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
            experts={k: cat(lambda p, k=k: p.experts[k]) for k in parts[0].experts},
            rows={s: concat_margin_rows([p.rows[s] for p in parts]) for s in (getattr(parts[0], "rows", None) or {})})


def packed_nbytes(packed: PackedHints) -> int:
    """Bytes of a micro-batch's arrays (token ids, positions, log-probs, hints, scales, experts, margin rows)."""
    arrays = [packed.cu_seqlens, packed.token_ids, packed.positions, packed.logprobs,
              *packed.hints.values(), *packed.scales.values(), *packed.experts.values(),
              *(a for rows in packed.margin.values() for a in rows)]
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


class SnapshotSource:
    """A `tracestore.Reader` of the store's newest snapshot as a `read_packed` source, renewed once when a
    trajectory (or its result) is not in it yet: a reader of the log index, for callers without the trajectories'
    committed records (`RecordSource` reads those directly)."""

    def __init__(self, store: ts.Store, *, renew_after_s: float = 1.0):
        self.store = store
        self.renew_after_s = renew_after_s
        self._renew()

    def _renew(self) -> None:
        self.reader = self.store.reader()
        self._taken = time.monotonic()

    def read(self, traj_id: str, *args, **kwargs):
        try:
            return self.reader.read(traj_id, *args, **kwargs)
        except ts.HintNotFoundError:
            self._renew()  # committed after the snapshot was taken
            return self.reader.read(traj_id, *args, **kwargs)

    def result(self, traj_id: str) -> ts.Result | None:
        """``traj_id``'s result, or None; on a miss the snapshot is renewed when it is ``renew_after_s`` old or
        older (a reader process may have read the trajectory from a newer snapshot than this one; a trajectory
        without a result yet renews it at most once per interval, not at every call)."""
        got = self.reader.result(traj_id)
        if got is None and time.monotonic() - self._taken >= self.renew_after_s:
            self._renew()
            got = self.reader.result(traj_id)
        return got


def _read_until(source: Any, mbs: Sequence[MicroBatch], sites: Sequence[str],
                cap_bytes: int, features: tuple[int, int] | None = None) -> list[tuple[PackedHints, float, float]]:
    """``(packed, loaded_unix, read_seconds)`` of the leading micro-batches of ``mbs``: read in order until those
    read hold ``cap_bytes`` or more (at least one); ``features``: the sites' feature slice (`read_packed`)."""
    done: list[tuple[PackedHints, float, float]] = []
    held = 0
    for mb in mbs:
        if done and held >= cap_bytes:
            break
        t0 = time.perf_counter()
        packed = read_packed(source, mb, sites, features=features, read_kwargs={"fmt": "numpy"})
        done.append((packed, time.time(), time.perf_counter() - t0))
        held += packed_nbytes(packed)
    return done


_CHILD_STORE: ts.Store | None = None  # the store a ReaderProcess's child reads (set by its initializer)
_CHILD_ERROR: BaseException | None = None  # why the initializer could not open it (raised by _child_ready)
_CHILD_SNAPSHOT: SnapshotSource | None = None  # the child's reader of the log index (reads without records)


def _child_open(url: str, storage_options: dict, retry: Any) -> None:
    global _CHILD_STORE, _CHILD_ERROR
    try:
        _CHILD_STORE = ts.open_store(url, storage_options=storage_options or None, retry=retry)
    except Exception as e:  # noqa: BLE001 - a failing initializer would break the pool and lose the error's type
        _CHILD_ERROR = e


def _child_ready() -> int:
    if _CHILD_ERROR is not None:
        raise _CHILD_ERROR
    return 0


def _child_read(records: dict[str, list[ts.CommittedRecord]] | None, mbs: list[MicroBatch], sites: list[str],
                cap_bytes: int, features: tuple[int, int] | None = None
                ) -> tuple[bytes, str | None, list[tuple[int, str, tuple[int, ...]]]]:
    global _CHILD_SNAPSHOT
    assert _CHILD_STORE is not None, "the reader process has no store (initializer not run)"
    if records is None:  # by the log index, from the newest snapshot
        if _CHILD_SNAPSHOT is None:
            _CHILD_SNAPSHOT = SnapshotSource(_CHILD_STORE)
        source: Any = _CHILD_SNAPSHOT
    else:
        source = RecordSource(_CHILD_STORE, {t: SimpleNamespace(records=r) for t, r in records.items()})
    return _to_shared_memory(_read_until(source, mbs, sites, cap_bytes, features))


class _ArraysOut(pickle.Pickler):
    """Pickles an object with its numpy arrays left out (``arrays``), named by their index."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays: list[np.ndarray] = []

    def persistent_id(self, obj: Any) -> int | None:
        if type(obj) is np.ndarray and obj.dtype != object:
            self.arrays.append(obj)
            return len(self.arrays) - 1
        return None


def _to_shared_memory(obj: Any) -> tuple[bytes, str | None, list[tuple[int, str, tuple[int, ...]]]]:
    """``obj`` as (its pickle without its numpy arrays, the name of a shared memory block holding the arrays'
    bytes, each array's (offset, dtype, shape)): a read of tens of MB crosses to the caller as one small message,
    so the caller's thread that receives it does not take the GIL once per pipe buffer (64 KiB) from a thread
    launching GPU kernels. The caller owns (and unlinks) the block (`_from_shared_memory`)."""
    buf = io.BytesIO()
    pickler = _ArraysOut(buf)
    pickler.dump(obj)
    spans, total = [], 0
    for a in pickler.arrays:
        spans.append((total, a.dtype.str, a.shape))
        total += -(-a.nbytes // 64) * 64  # 64-byte aligned
    if not pickler.arrays:
        return buf.getvalue(), None, []
    shm = shared_memory.SharedMemory(create=True, size=max(total, 1))
    try:
        for a, (off, _, _) in zip(pickler.arrays, spans):
            np.ndarray(a.shape, a.dtype, buffer=shm.buf, offset=off)[...] = a
    finally:
        shm.close()
    return buf.getvalue(), shm.name, spans


def _from_shared_memory(payload: bytes, name: str | None, spans: list[tuple[int, str, tuple[int, ...]]]) -> Any:
    """What `_to_shared_memory` packed, with its arrays copied out of the block, which is then unlinked."""
    if name is None:
        return pickle.loads(payload)
    shm = shared_memory.SharedMemory(name=name)
    views: list[np.ndarray] = []

    class _ArraysIn(pickle.Unpickler):
        def persistent_load(self, pid: int) -> np.ndarray:
            return views[pid].copy()

    try:
        views.extend(np.ndarray(shape, np.dtype(dt), buffer=shm.buf, offset=off) for off, dt, shape in spans)
        return _ArraysIn(io.BytesIO(payload)).load()
    finally:
        views.clear()  # the block can only be closed once no array looks into it; unlinked even if that fails
        try:
            shm.close()
        finally:
            shm.unlink()


@contextlib.contextmanager
def _without_main_module() -> Iterator[None]:
    """While a child is spawned: ``spawn`` would run the caller's main script again in the child (a training script
    without an ``if __name__ == "__main__"`` guard, as torchrun scripts often are, would start training there), but
    the child needs nothing of it: everything it runs is in this module. Hiding the main module's spec and file
    while the child is started makes spawn leave it out, as it does for an interactive session."""
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    missing = object()
    saved = {k: main.__dict__.get(k, missing) for k in ("__spec__", "__file__")}
    main.__spec__ = None
    main.__dict__.pop("__file__", None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is missing:
                main.__dict__.pop(k, None)
            else:
                main.__dict__[k] = v


class ReaderProcess:
    """A child process that reads micro-batches of one store for `BackgroundReads`, so that no reading Python
    competes with the caller's for the GIL (a reading thread slowed a host-bound H200 step by more than the read
    took, trainer-h200-read-next*.json).

    ``ReaderProcess(store)`` spawns the child (``spawn``: safe beside CUDA) and waits until it has opened the store
    again by its URL and options (`ts.Store.open_args`; a BackendError / StoreNotFoundError of that open is raised
    here, and the child ended); it raises ConfigError for a store that cannot be opened in another process (``memory://``; use
    a thread there). Its reads come back to the caller through shared memory (the arrays' bytes; a
    pipe carries the rest) and are copied out of it when taken. `close` ends the child; a child that died is
    replaced at the next `submit`."""

    def __init__(self, store: ts.Store):
        try:
            self._init = store.open_args()
        except ts.LocationError as e:
            raise ConfigError(f"the store {store.url} cannot be opened in another process ({e}); read it in a "
                              "thread instead") from e
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._start()

    def _start(self) -> None:
        self._pool = concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn"), initializer=_child_open, initargs=self._init)
        # the child starts now (the executor spawns it in submit) and is waited for (1-3 s: it imports torch), so no
        # read waits for it later
        with _without_main_module():
            ready = self._pool.submit(_child_ready)
        try:
            ready.result()
        except BaseException:  # the child could not open the store: nothing left running
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
            raise

    def submit(self, trajs: Mapping[str, Any] | None, mbs: Sequence[MicroBatch], sites: Sequence[str],
               cap_bytes: int, *, features: tuple[int, int] | None = None) -> concurrent.futures.Future:
        """Read the leading micro-batches of ``mbs`` (at most ``cap_bytes``, at least one) of the trajectories
        ``trajs`` (traj_id -> anything with ``records``; None: by the store's log index, from the newest snapshot,
        as `SnapshotSource`) in the child, ``features`` the sites' feature slice (`read_packed`); the future's raw
        result goes through `take_result` to a list of ``(packed, loaded_unix, read_seconds)``."""
        records = None if trajs is None else {
            t: list(trajs[t].records) for t in dict.fromkeys(s.traj_id for mb in mbs for s in mb.segments)}
        args = (_child_read, records, list(mbs), list(sites), cap_bytes, features)
        if self._pool is None:
            self._start()
        assert self._pool is not None
        try:
            return self._pool.submit(*args)
        except BrokenProcessPool:
            log.warning("the reader process died; starting another")
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._start()
            return self._pool.submit(*args)

    @staticmethod
    def take_result(future: concurrent.futures.Future) -> list[tuple[PackedHints, float, float]]:
        """The ``(packed, loaded_unix, read_seconds)`` of a `submit`, copied out of shared memory (numpy copies,
        which release the GIL); raises what the child's read raised (its type kept: tracestore's errors pickle)."""
        return _from_shared_memory(*future.result())

    def close(self) -> None:
        """End the child (waits for a read under way)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)


class BackgroundReads:
    """Micro-batches of a coming step, read in the background while the caller computes the current one.

    ``BackgroundReads(source, mbs, sites, cap_bytes, reader=None)`` starts reading ``mbs`` in order (`read_packed`,
    numpy arrays in host memory), stopping once those read hold ``cap_bytes`` or more (at least one is read, as
    `read_ahead` does): in a daemon thread, or, given a `ReaderProcess` of the source's store (``source`` then a
    `RecordSource`), in that process. `take` hands the reads over to a step that reads the same micro-batches: it
    waits for the read and returns the leading ``(packed, loaded_unix, read_seconds)`` it read (possibly fewer
    than asked for: the caller reads the rest itself), or ``[]`` when the step reads other micro-batches or other
    sites, or the background read failed (logged at INFO; the caller's own read then meets the same error with
    its own context, so a storage failure is never hidden or read as "absent"). Committed records never change,
    so data read ahead is the data a read at the step would return, byte for byte.

    A thread holds the GIL between its storage calls and numpy copies, which a host-bound caller (Python
    launching GPU kernels) feels; a process does not."""

    def __init__(self, source: Any, mbs: Sequence[MicroBatch], sites: Sequence[str], cap_bytes: int,
                 reader: ReaderProcess | None = None):
        self._key = _layout(mbs, sites)
        self._done: list[tuple[PackedHints, float, float]] = []
        self._error: BaseException | None = None
        self._future: concurrent.futures.Future | None = None
        self._thread: threading.Thread | None = None
        self._arrived = threading.Event()
        if reader is not None:
            try:
                self._future = reader.submit(source.trajs, mbs, sites, cap_bytes)
            except Exception as e:  # noqa: BLE001 - handed to take(), which re-reads in the caller
                self._error = e
                self._arrived.set()
                return
            # copied out of shared memory by the thread that sees the read arrive (numpy copies without the GIL),
            # not by the caller's, which launches kernels meanwhile
            self._future.add_done_callback(self._copy_out)
            return
        self._thread = threading.Thread(target=self._run, args=(source, list(mbs), list(sites), cap_bytes),
                                        name="tracerl-read-next-step", daemon=True)
        self._thread.start()

    def _copy_out(self, future: concurrent.futures.Future) -> None:
        try:
            self._done = _from_shared_memory(*future.result())
        except BaseException as e:  # noqa: BLE001 - a failed read or a dead child: the caller reads again
            self._error = e
        finally:
            self._arrived.set()

    def _run(self, source: Any, mbs: list[MicroBatch], sites: list[str], cap_bytes: int) -> None:
        try:
            self._done = _read_until(source, mbs, sites, cap_bytes)
        except BaseException as e:  # noqa: BLE001 - handed to take(), which re-reads in the caller
            self._error = e

    def take(self, mbs: Sequence[MicroBatch], sites: Sequence[str]) -> list[tuple[PackedHints, float, float]]:
        """The reads done for ``mbs`` / ``sites`` (see the class docstring); waits for the read first."""
        if self._thread is not None:
            self._thread.join()
        else:
            self._arrived.wait()
        if _layout(mbs, sites) != self._key:
            log.debug("read ahead for other micro-batches than the step's: dropped")
            return []
        if self._error is not None:
            log.info("reading the next step ahead failed (%s: %s); the step reads it again",
                     type(self._error).__name__, self._error)
            return []
        return self._done
