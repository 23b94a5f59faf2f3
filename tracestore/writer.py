"""The writer: the public class over the row buffer (:mod:`tracestore._buffer`) and the commit protocol
(:mod:`tracestore.commit`).

Life of a write::

    write(traj, start, hints=..., ...)   check everything (dtype, shape, sites, ids: tracestore._rows; overlap)
                                         -> copy into the filling buffer
    ... buffer reaches commit_bytes, or commit_interval_s passed, or flush()/close()
    flush:  1. segment = one Zarr v3 group data/<writer_id>/<seq>-<random>/ ; every array written whole, once
            2. commit  = put-if-absent of log/<N> (N = first free log position), after re-checking the records
                         against every entry < N; on a lost race read entry N and try N+1 (tracestore.commit)

A record becomes visible exactly when its log entry exists. A writer killed before step 2 leaves an unreferenced
segment (invisible; ``collect_garbage`` removes it); one killed after step 2 has committed.

Flushes run on a background thread while the caller keeps writing into a second buffer (generation does not
stall on storage); each buffer holds ``min(commit_bytes, max_buffer_bytes / 2)`` bytes of rows, so buffered
rows never exceed ``max_buffer_bytes``. Commits of one writer happen in order.
"""

from __future__ import annotations

import logging
import math
import os
import re
import socket
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ._buffer import RowBuffer, Stage
from ._closing import Closing
from ._rows import CheckedWrite, check_write
from .commit import Committer, result_problem
from .errors import (
    BackendError,
    OptionError,
    OverlapError,
    ResultError,
    ResultExistsError,
    SchemaVersionError,
    TrajectoryCompleteError,
    TraceStoreError,
)
from .format.entries import Result, check_result, merge_ranges
from .format.keys import check_id

__all__ = ["Writer"]

log = logging.getLogger(__name__)


def _default_writer_id() -> str:
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:60] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class Writer(Closing):
    """Buffers per-token rows of one or many trajectories and commits them in whole segments.

    Use as a context manager or call :meth:`close`. Thread-safe. Full buffers are written and committed by a
    background flusher thread while ``write`` continues in a second buffer (it waits only if both are full);
    a timer commits buffered rows older than ``commit_interval_s`` (0 disables it; then rows are committed on
    size, on :meth:`flush` and on :meth:`close`). A commit that fails in the background is raised by the next
    ``write``/``flush``/``close`` and its rows are kept and retried at the next flush.

    Args:
        store: the open store.
        writer_id: names this writer's segments ``data/<writer_id>/...``; default ``<host>-<pid>-<random>``.
            Restarting with the same id is safe (segment names carry a random part; already committed token
            ranges are rejected with OverlapError, or skipped with ``skip_committed=True``).
        commit_bytes: commit a segment once this many row bytes are buffered (64 MiB: ~8,700 tokens of the
            default 20 x 2048 site table).
        commit_interval_s: commit buffered rows at the latest this long after the oldest was written.
        max_buffer_bytes: hard bound of buffered row bytes (a long trajectory spans several segments).
        skip_committed: ``write`` silently skips token positions already committed for the trajectory and
            buffers only the rest, and positions that another writer commits first while they are buffered are
            dropped without an error (idempotent re-runs and writers racing on one trajectory). Without it any
            overlap with a committed range raises OverlapError, and a lost race is reported by the next
            ``flush``/``close`` (OverlapError with ``.conflicts``). Overlaps with this writer's own buffered rows
            always raise.
        commit_timeout_s: deadline of one commit (claiming a log position) while the storage fails; then
            CommitError, the rows stay buffered and the next flush retries. Transient failures within it are
            retried with backoff; a commit whose answer was lost is recognised by reading the entry back.

    Every commit claims the first free log position with put-if-absent; a segment that a gc entry names (gc is
    about to delete it: it was not committed within the grace period) is written again under a new name before it
    is committed (FORMAT §6).

    Raises:
        BackendError: the store's backend cannot create-if-absent (read-only fsspec filesystems).
    """

    def __init__(self, store, writer_id: str | None = None, *, commit_bytes: int = 64 << 20,
                 commit_interval_s: float = 5.0, max_buffer_bytes: int = 256 << 20, skip_committed: bool = False,
                 commit_timeout_s: float = 120.0):
        if not store.backend.supports_put_if_absent:
            raise BackendError(f"{store.url}: backend {store.backend!r} cannot commit (no atomic create-if-absent)")
        self.store = store
        self.writer_id = check_id(writer_id if writer_id is not None else _default_writer_id(), "writer id")
        if commit_bytes <= 0 or max_buffer_bytes <= 0 or commit_interval_s < 0:
            raise OptionError(f"commit_bytes={commit_bytes}, max_buffer_bytes={max_buffer_bytes} must be > 0 and "
                              f"commit_interval_s={commit_interval_s} >= 0")
        if not (isinstance(commit_timeout_s, (int, float)) and math.isfinite(commit_timeout_s) and commit_timeout_s > 0):
            raise OptionError(f"commit_timeout_s must be a finite number of seconds > 0, got {commit_timeout_s!r}")
        self.commit_timeout_s = float(commit_timeout_s)
        self.commit_bytes = int(commit_bytes)
        self.max_buffer_bytes = int(max_buffer_bytes)
        self.commit_interval_s = float(commit_interval_s)
        self.skip_committed = bool(skip_committed)
        # two buffers: one filling, one being written by the flusher thread
        flush_bytes = min(self.commit_bytes, self.max_buffer_bytes // 2)
        self._token_nbytes = sum(int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                                 for dt, shape in store.row_columns.values())
        capacity = max(1, flush_bytes // self._token_nbytes)
        if capacity >= store.chunk_rows:
            # full segments hold whole inner chunks (no padding, chunk boundaries at multiples of chunk_rows)
            capacity -= capacity % store.chunk_rows
        self._lock = threading.RLock()  # one write / flush / handoff at a time
        self._state = threading.Lock()  # guards the committer's ranges and stats, the buffer's pending ones, _lost*
        # margin sites' rows vary in length: their bytes count against the buffer's budget as they arrive
        self._buffer = RowBuffer(store.row_columns, capacity, 0 if store.feature_chunk else store.chunk_rows,
                                 {m: ends for m, (ends, _) in store.margin_arrays.items()}, flush_bytes)
        self._committer = Committer(store, self.writer_id, self.commit_timeout_s, self._state)
        self._error: BaseException | None = None
        self._flusher: ThreadPoolExecutor | None = None
        self._inflight = None  # (future, stage) being written and committed by the flusher thread
        self._failed: Stage | None = None  # a stage whose commit failed; retried at the next flush
        self._lost: list[tuple[str, int, int]] = []  # ranges dropped at commit (another writer was first)
        self._lost_complete: list[tuple[str, int, int]] = []  # ranges dropped: another writer committed a result
        self._lost_results: list[str] = []  # results dropped at commit (another writer committed one first)
        self._refused_results: list[tuple[str, str]] = []  # results dropped at commit: the log no longer allows them
        self._closed = False
        #: counters: segments / records / rows / results committed, bytes written (data + log), races lost
        self.stats = self._committer.stats
        self._committer.sync()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.commit_interval_s > 0:
            self._ticker = threading.Thread(target=self._tick, name=f"tracestore-writer-{self.writer_id}", daemon=True)
            self._ticker.start()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True) and self.buffered_bytes:
            warnings.warn(f"tracestore writer {self.writer_id!r} was not closed: {self.buffered_bytes} buffered "
                          f"bytes were never committed", ResourceWarning, stacklevel=2)

    def __repr__(self) -> str:
        return f"Writer({self.store.url!r}, writer_id={self.writer_id!r}, buffered={self.buffered_bytes})"

    def committed(self, traj_id: str) -> list[tuple[int, int]]:
        """Committed token ranges ``[(start, stop), ...]`` of ``traj_id`` (merged), after reading new log entries."""
        check_id(traj_id)
        self._committer.sync()
        with self._state:
            return self._committer.committed.get(traj_id)

    # ------------------------------------------------------------------ write
    def write(self, traj_id: str, token_start: int, *, hints: Mapping | None = None, scales: Mapping | None = None,
              token_ids, logprobs, experts: Mapping | None = None, policy_version: int = 0,
              rows: Mapping | None = None) -> None:
        """Buffer tokens ``[token_start, token_start + T)`` of ``traj_id``.

        Args:
            hints: ``{site: uint8 [T, width/8]}`` for every declared site of hint encoding ``bits`` (bit i = LSB of
                code i, LSB first); None means ``{}`` (a store whose sites are all margin sites).
            scales: ``{site: uint8 [T, site.scale_bytes]}`` for the same sites: the scale bytes ``[T,
                width/block_size]``, or with the site's scale encoding ``lsb`` their LSBs ``[T, ceil(width/block_size/8)]``
                (bit b of a row = LSB of block b's E4M3 byte, LSB first; FORMAT §2.4).
            rows: ``{site: (data, offsets)}`` for every declared site of hint encoding ``margin`` (FORMAT §2.5): its
                T margin-exception rows, opaque bytes, row t = ``data[offsets[t]:offsets[t + 1]]``; ``data`` uint8
                ``[n]``, ``offsets`` integer ``[T + 1]`` (int64), ``offsets[0] == 0``, non-decreasing, ``offsets[T]
                == n``, no row longer than the site's ``max_row_bytes`` (0-byte rows are allowed). Instead of the
                pair, any object with ``.data`` and ``.offsets`` (``tracerl.hints.compact.PackedRows``).
            token_ids: integer ``[T]`` (stored int32).
            logprobs: floating ``[T]`` (stored float32).
            experts: ``{moe_layer: integer [T, top_k]}`` for every declared MoE layer (required iff the store
                declares MoE layers), values in ``[0, num_experts)``.
            policy_version: int64 policy version that generated these tokens.
            Arrays may be numpy arrays or torch tensors (CPU or CUDA; copied to host memory).

        Everything is validated before anything is buffered; on error the writer and the store are unchanged.

        Raises:
            InvalidIdError, ShapeError, DTypeError, UnknownSiteError, SiteEncodingError (a ShapeError: hints or
            scales for a margin site, rows for a bits site), OverlapError (range overlaps one committed
            or buffered for ``traj_id``), TrajectoryCompleteError (an OverlapError: ``traj_id`` has a result,
            committed as far as this writer has read the log, or buffered by it: no token follows a result),
            TraceStoreError (writer closed / a background commit failed),
            BackendError (a commit triggered by this write failed; buffered rows stay buffered and are retried).
            A storage error raised part-way through a long write (a full buffer could not be handed on because
            the previous commit failed) carries ``buffered_to``: the tokens of this write before that position
            are buffered and will be committed; write the rest again starting there. Errors raised before
            anything was buffered have ``buffered_to == token_start``.
        """
        w = check_write(self.store, traj_id, token_start, hints=hints, scales=scales, token_ids=token_ids,
                        logprobs=logprobs, experts=experts, policy_version=policy_version, rows=rows)
        with self._lock:
            self._check_open()
            parts = self._reserve(w.traj_id, w.token_start, w.token_start + w.T)
            if parts:
                self._buffer_parts(w, parts)

    def write_result(self, traj_id: str, *, reward: float, group_id: str = "", advantage: float | None = None,
                     prompt_len: int = 0, response_len: int = 0, policy_version: int = 0, finish_reason: str = "",
                     extra: Mapping | None = None) -> None:
        """Buffer the result of ``traj_id``; it commits (as a results log entry, FORMAT §3.2) after every token of
        the trajectory this writer buffered before it, so a trajectory is *complete* exactly when its result is
        committed. Fields as :class:`~tracestore.format.entries.Result` (``reward`` finite, ``group_id`` an id or "",
        ``advantage`` finite or None, lengths >= 0, ``policy_version`` int64, ``finish_reason`` a short word,
        ``extra`` a JSON object of at most 16 KiB and 32 levels). Needs a format-version-2 store.

        The result must fit the trajectory's tokens, committed (as far as this writer has read the log) and buffered
        by this writer: one range ``[0, n)`` (none missing), ``prompt_len < n``, and the first of them committed (or,
        not committed yet, buffered) by this writer's id. The commit checks it again against the log below the
        position it claims (another writer may have committed the trajectory's tokens first); a result it drops
        then is reported by the next ``flush``/``close`` (ResultError; with ``skip_committed`` logged only). Every
        check runs before anything is buffered, on values of any size (bounded work).

        Raises:
            SchemaVersionError: the store is format version 1 (it cannot hold results).
            ResultExistsError: the trajectory already has a result, committed (as far as this writer has read the
                log) or buffered by this writer; with ``skip_committed`` a committed one is skipped silently.
            InvalidIdError / ResultError: a bad field, or a result that does not fit the trajectory's tokens as
                above (nothing is buffered).
            TraceStoreError / BackendError: as :meth:`write`.
        """
        if self.store.format_version < 2:
            raise SchemaVersionError(f"{self.store.url} is a format-version-1 store, which cannot hold trajectory "
                                     f"results (version 2 can); create a new store to record results")
        result = check_result(Result(traj_id, reward, group_id, advantage, prompt_len, response_len,
                                     policy_version, finish_reason, {} if extra is None else extra))
        with self._lock:
            self._check_open()
            committer = self._committer
            with self._state:
                committed = traj_id in committer.has_result
                if committed and self.skip_committed:
                    log.info("%s: %s already has a committed result; skipped", self.writer_id, traj_id)
                    return
                if committed or traj_id in self._buffer.pending_results:
                    where = "committed" if committed else "buffered by this writer"
                    raise ResultExistsError(f"trajectory {traj_id!r} already has a result {where} in "
                                            f"{self.store.url}", [(traj_id, 0, 0)])
                ranges = merge_ranges(sorted(committer.committed.get(traj_id) + self._buffer.pending.get(traj_id)))
                why = result_problem(result, self.writer_id, ranges, committer.owner.get(traj_id))
                if why is not None:
                    raise ResultError(f"result of {traj_id!r} refused by writer {self.writer_id!r} of "
                                      f"{self.store.url}: {why} (FORMAT §3.2)")
                self._buffer.pending_results.add(traj_id)
            self._buffer.add_result(result)

    def _reserve(self, traj_id: str, start: int, stop: int) -> list[tuple[int, int]]:
        """The parts of ``[start, stop)`` to buffer (all of it, or with ``skip_committed`` the positions not yet
        committed), marked pending. Raises OverlapError (and marks nothing) on an overlap with committed or
        buffered positions."""
        committed, pending = self._committer.committed, self._buffer.pending
        with self._state:
            parts = [(start, stop)]
            hit = committed.overlaps(traj_id, start, stop)
            if hit is not None and self.skip_committed:
                parts = committed.uncovered(traj_id, start, stop)
                log.info("%s: %s [%d, %d): skipping committed positions, writing %s", self.writer_id, traj_id,
                         start, stop, parts)
                hit = None
            where = "committed"
            if hit is None:
                where = "buffered by this writer"
                hit = next((h for a, b in parts if (h := pending.overlaps(traj_id, a, b)) is not None), None)
            if hit is not None:
                raise OverlapError(
                    f"trajectory {traj_id!r}: tokens [{start}, {stop}) overlap [{hit[0]}, {hit[1]}) "
                    f"already {where} in {self.store.url}", [(traj_id, start, stop)])
            if parts and (traj_id in self._committer.has_result or traj_id in self._buffer.pending_results):
                where = "committed" if traj_id in self._committer.has_result else "buffered by this writer"
                raise TrajectoryCompleteError(
                    f"trajectory {traj_id!r}: tokens [{start}, {stop}) after its result ({where}) in "
                    f"{self.store.url}: a trajectory is complete once its result is committed, no token follows it "
                    f"(FORMAT §3.2)", [(traj_id, start, stop)])
            for a, b in parts:
                pending.add(traj_id, a, b)
        return parts

    def _buffer_parts(self, w: CheckedWrite, parts: list[tuple[int, int]]) -> None:
        """Copy the reserved ``parts`` of a checked write into the buffer (caller holds ``_lock``)."""
        traj_id, token_start = w.traj_id, w.token_start
        done = [0]
        try:
            for a, b in parts:
                done[0] = a - token_start
                self._buffer.append(traj_id, token_start, a - token_start, b - token_start, w.columns,
                                    w.policy_version, done, self._handoff, w.margin)
            done[0] = w.T
            if self._due():
                self._handoff()
        except TraceStoreError as e:
            # a full buffer could not be handed on (the previous commit failed): say how far this write got
            e.buffered_to = token_start + done[0]
            raise
        finally:
            # after a failure part-way, what never reached the buffer is not pending
            with self._state:
                for a, b in parts:
                    if token_start + done[0] < b:
                        self._buffer.pending.subtract(traj_id, max(a, token_start + done[0]), b)

    def _check_open(self) -> None:
        if self._closed:
            raise TraceStoreError(f"writer {self.writer_id!r} of {self.store.url} is closed")
        if self._error is not None:  # a commit of the flusher thread failed: raise it here, once
            err, self._error = self._error, None
            raise err

    def _due(self) -> bool:
        oldest = self._buffer.oldest
        return (oldest is not None and self.commit_interval_s > 0
                and time.monotonic() - oldest >= self.commit_interval_s)

    def _tick(self) -> None:
        period = max(0.01, min(self.commit_interval_s / 4, 1.0))
        while not self._stop.wait(period):
            with self._lock:
                if self._closed or not self._due() or self._error is not None:
                    continue
                try:
                    self._handoff()
                except Exception as e:  # surfaced by the next write/flush/close
                    log.warning("%s: background commit failed: %s", self.writer_id, e)
                    self._error = e

    # ------------------------------------------------------------------ flush / commit
    def flush(self) -> None:
        """Write and commit everything buffered.

        Raises:
            OverlapError: since the last flush()/close(), commits (this one or automatic ones) dropped token ranges
                that another writer had committed first; ``.conflicts`` lists them, everything else was committed.
                TrajectoryCompleteError (an OverlapError): ranges of trajectories whose result another writer
                committed first. ResultExistsError (an OverlapError): results of trajectories that another writer
                completed first. ResultError: results the log no longer allowed when they committed (another
                writer committed the trajectory's first tokens, or tokens that leave a gap).
            BackendError: storage failure (rows stay buffered; a later flush retries).
        """
        with self._lock:
            self._check_open()
            self._handoff(wait=True)
            self._check_open()
            self._raise_lost()

    def _raise_lost(self) -> None:
        """Raise what commits dropped since the last report, as one error: its type is the first kind below that
        occurred, its message and ``.conflicts`` list every kind (``(traj_id, 0, 0)`` for a result)."""
        with self._state:
            lost, self._lost = self._lost, []
            complete, self._lost_complete = self._lost_complete, []
            lost_results, self._lost_results = self._lost_results, []
            refused, self._refused_results = self._refused_results, []

        def ranges(xs):
            return ", ".join(f"{t}[{a}:{b})" for t, a, b in xs[:5]) + (" ..." if len(xs) > 5 else "")

        parts = []
        if refused:
            parts.append((ResultError, f"{len(refused)} result(s) the log no longer allowed when they committed ("
                          + "; ".join(f"{t!r}: {why}" for t, why in refused[:3]) + ")",
                          [(t, 0, 0) for t, _ in refused]))
        if complete:
            parts.append((TrajectoryCompleteError, f"{len(complete)} token range(s) of trajectories whose result "
                          f"another writer committed first ({ranges(complete)})", complete))
        if lost_results:
            parts.append((ResultExistsError, f"{len(lost_results)} result(s) of trajectories another writer "
                          f"committed a result for first ({', '.join(repr(t) for t in lost_results[:5])})",
                          [(t, 0, 0) for t in lost_results]))
        if lost:
            parts.append((OverlapError, f"{len(lost)} token range(s) that lost a commit race: another writer "
                          f"committed them first ({ranges(lost)})", lost))
        if not parts:
            return
        message = "not committed: " + "; ".join(m for _, m, _ in parts) + "; they were dropped, everything else was committed"
        conflicts = [c for _, _, cs in parts for c in cs]
        cls = parts[0][0]
        if cls is ResultError:
            err = ResultError(message)
            err.conflicts = conflicts
            raise err
        raise cls(message, conflicts)

    def close(self) -> None:
        """Commit what is buffered and stop the background threads. Idempotent once it succeeded.

        Raises as :meth:`flush`. After a storage error nothing buffered is lost: the writer stays open (without
        its commit timer) and ``close()`` (or ``flush()``) can be called again. After an OverlapError the writer
        is closed (everything else was committed)."""
        if self._closed:
            return
        self._stop.set()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        with self._lock:
            try:
                self._check_open()
                self._handoff(wait=True)
                self._check_open()
            except BaseException:
                self._shutdown_flusher()
                raise
            self._closed = True
            self._shutdown_flusher()
            self._raise_lost()

    def _shutdown_flusher(self) -> None:
        self._wait_inflight()
        if self._flusher is not None:
            self._flusher.shutdown(wait=True)
            self._flusher = None

    @property
    def buffered_bytes(self) -> int:
        """Row bytes buffered and not yet committed (the filling buffer and the one being written)."""
        nbytes = self._buffer.nbytes
        inflight = self._inflight
        if inflight is not None:
            nbytes += inflight[1].nbytes
        return nbytes

    def _handoff(self, wait: bool = False) -> None:
        """Give the filling buffer to the flusher thread (after the previous one is done) and continue in a
        spare buffer, so that writes overlap with encoding and I/O; ``wait``: also wait until it is committed.
        Caller holds ``_lock``."""
        if self._failed is not None:  # retry a failed commit first, synchronously (raises if it fails again)
            failed, self._failed = self._failed, None
            try:
                self._flush_stage(failed)
            except BaseException:
                self._failed = failed
                raise
        if self._buffer.has_data:
            self._wait_inflight()
            if self._failed is not None:  # the previous commit just failed: surface it, keep this buffer
                self._check_open()
            stage = self._buffer.take()
            if self._flusher is None:
                self._flusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tracestore-{self.writer_id}")
            self._inflight = (self._flusher.submit(self._flush_stage, stage), stage)
        if wait:
            self._wait_inflight()

    def _wait_inflight(self) -> None:
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        future, stage = inflight
        try:
            future.result()
        except Exception as e:  # keep the rows for a retry; raise at the next call
            log.warning("%s: commit failed (rows kept for a retry): %s", self.writer_id, e)
            self._failed = stage
            self._error = e

    def _flush_stage(self, stage: Stage) -> None:
        """Commit ``stage`` (flusher thread, or the caller for a retry): its rows as a segment (written unless a
        failed earlier try already wrote it and it is still young), then its results as a results entry, so that
        a trajectory's result never commits before its tokens. Raises on failure; the stage keeps what is not
        committed yet."""
        if stage.rows and not stage.rows_committed:
            if stage.segment is None:
                self._committer.write_segment(stage)
            conflicts, complete = self._committer.commit_rows(stage)
            stage.rows_committed = True
            with self._state:
                for r in stage.records:
                    self._buffer.pending.subtract(r.traj_id, r.token_start, r.token_stop)
                if complete:
                    log.warning("%s: %d token range(s) of trajectories another writer completed first were dropped: "
                                "%s", self.writer_id, len(complete), complete[:5])
                    if not self.skip_committed:
                        self._lost_complete.extend(complete)
                if conflicts:
                    if self.skip_committed:  # another writer committed these positions first: nothing to report
                        log.info("%s: %d token range(s) were committed by another writer first; skipped: %s",
                                 self.writer_id, len(conflicts), conflicts[:5])
                    else:  # reported by the next flush()/close() (OverlapError with the list)
                        log.warning("%s: %d token range(s) lost a commit race and were dropped: %s",
                                    self.writer_id, len(conflicts), conflicts[:5])
                        self._lost.extend(conflicts)
        if stage.results:
            dropped, refused = self._committer.commit_results(stage)
            with self._state:
                self._buffer.pending_results.difference_update(r.traj_id for r in stage.results)
                if refused:
                    log.warning("%s: %d result(s) the log no longer allows were dropped: %s", self.writer_id,
                                len(refused), refused[:3])
                if not self.skip_committed:
                    self._lost_results.extend(dropped)
                    self._refused_results.extend(refused)
        self._buffer.recycle(stage)
