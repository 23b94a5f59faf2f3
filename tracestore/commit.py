"""The commit protocol of one writer: FORMAT §4 (many writers, no coordinator), one step per method.

1. :meth:`Committer.write_segment` — the stage's rows as one segment: every object written whole, once, under a
   fresh ``data/<writer_id>/<segment_id>/`` (the random part of the id keeps two writers of one id apart); nothing
   references it yet, so nothing of it is visible.
2. :meth:`Committer.sync` — read every log entry not yet seen, up to the head; ``_split`` trims the records to the
   token positions still free (positions another writer committed first are dropped and reported; positions an
   earlier try of this writer committed are neither).
3. ``_claim`` — create ``log/N`` (N = the head) with put-if-absent. If ``log/N`` exists it is read back: naming this
   writer's commit it is ours (an *ambiguous commit*: applied although the client saw an error, or a retry
   answered 412); else another writer won N, and it is step 2 again with N + 1. A failure that leaves the entry
   unreadable is retried with backoff until ``commit_timeout_s`` (``_commit_loop``), then :class:`CommitError`
   leaves the rows with the writer; a later flush that finds an entry naming the commit (step 2) takes it as its
   own.

A segment that a gc entry (format version 3) read in step 2 names is never committed: gc deletes it, so it is written
again under a new name and the claim starts over (FORMAT §6: together with gc's own rule, this keeps gc from deleting
committed data whatever the delay of any request). Results (FORMAT §3.2) take steps 2-3 as a results entry, after
the rows of their stage (:meth:`Committer.commit_results`), each checked again against the log below the position
claimed (the trajectory's tokens one range from 0, more than ``prompt_len`` of them, committed first by this writer).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid

import numpy as np

from ._buffer import SegmentWrite, Stage, TokenRanges
from .errors import CommitError, ObjectNotFoundError, TransientStorageError
from .format.entries import GC, RESULTS, LogEntry, Record, Result, SegmentRef, decode_entry, encode_entry
from .format.keys import log_key
from .format.segment import array_metadata, choose_chunk_rows, group_metadata, layout, margin_layout

__all__ = ["Committer", "claim", "result_problem"]

log = logging.getLogger(__name__)

#: what an entry builder returns to start a claim over (after writing its segment again)
_AGAIN = object()


def claim(store, seq: int, data: bytes, writer_id: str, entry_id: str) -> tuple[str, BaseException | None]:
    """Try to create log entry ``seq`` holding ``data`` (the commit ``entry_id`` of ``writer_id``): ``"ours"``,
    ``"taken"`` (another entry is there) or ``"unknown"`` (the storage failed; the entry may still appear), with the
    storage error seen, if any. After a failed or refused conditional PUT the entry is read back: a PUT that was
    applied although the client saw an error (or whose retry got 412) is the caller's commit, not a lost race.
    Writers and gc (its gc entries) claim positions alike."""
    backend = store.backend
    key = log_key(seq)
    error = None
    try:
        if backend.put_if_absent(key, data):
            return "ours", None
    except TransientStorageError as e:
        error = e
    try:
        existing = decode_entry(backend.get(key), seq, f"{store.url}/{key}")
    except ObjectNotFoundError:
        return "unknown", error  # not applied (or still in flight): try the same position again
    except TransientStorageError as e:
        return "unknown", e
    return ("ours" if existing.writer_id == writer_id and existing.entry_id == entry_id else "taken"), error


def result_problem(result: Result, writer_id: str, ranges: list[tuple[int, int]], owner: str | None) -> str | None:
    """Why ``result`` may not be committed by ``writer_id`` when its trajectory's tokens are ``ranges`` (merged,
    sorted) and ``owner`` committed (or, not committed yet, buffered) the first of them; None when it may (FORMAT
    §3.2: tokens one range ``[0, n)``, ``prompt_len < n``, the result by the trajectory's owner)."""
    if not ranges:
        return "it has no tokens (a result follows the trajectory's tokens)"
    if owner is not None and owner != writer_id:
        return (f"its tokens were first committed by writer {owner!r}, which owns the trajectory (only the owner "
                f"commits its result)")
    if ranges[0][0] != 0 or len(ranges) > 1:
        shown = ", ".join(f"[{a}, {b})" for a, b in ranges[:3]) + (" ..." if len(ranges) > 3 else "")
        return f"its tokens {shown} are not one range from position 0 (a gap)"
    if result.prompt_len >= ranges[0][1]:
        return (f"prompt_len {result.prompt_len} is not less than its {ranges[0][1]} tokens (a result needs at "
                f"least one response token)")
    return None


class Committer:
    """What one writer knows of the log and how it commits (see the module docstring). Thread-safe: one commit or
    log sync at a time; ``state`` (the writer's lock) guards the ranges, sets and counters, which the writer's
    threads read.

    Attributes:
        committed: every committed token range, as far as the log has been read. own: those of this writer's
        segments. owner: per trajectory, the writer id of the entry that committed its first tokens. has_result:
        trajectories whose result is committed. doomed: segments of this writer that a gc entry names (never
        committed). stats: counters of what was committed.
    """

    def __init__(self, store, writer_id: str, commit_timeout_s: float, state: threading.Lock):
        self.store = store
        self.writer_id = writer_id
        self.commit_timeout_s = commit_timeout_s
        self.state = state
        self.committed = TokenRanges()
        self.own = TokenRanges()
        self.attempted: set[str] = set()  # commits this writer tried (entry ids: a log entry naming one is ours)
        self.landed: set[str] = set()  # those of them that a log entry names
        self.has_result: set[str] = set()
        self.owner: dict[str, str] = {}
        self.doomed: set[str] = set()
        self.synced = 0  # log entries read
        self.counter = 0  # this writer's segments and results batches: the writer_seq of its entries
        self.last_error: BaseException | None = None
        #: segments / records / rows / results committed, bytes written (data + log), races lost, segments written
        #: again because a gc entry named them
        self.stats = {"segments": 0, "records": 0, "rows": 0, "data_bytes": 0, "log_bytes": 0, "lost_races": 0,
                      "results": 0, "rewritten": 0}
        self._sync_lock = threading.Lock()  # one log sync / commit at a time

    def sync(self) -> None:
        """Read the log entries this writer has not seen (step 2's first half; also when the writer opens)."""
        with self._sync_lock:
            self._sync_locked()

    def _sync_locked(self) -> None:
        """Read the log entries this writer has not seen (caller holds ``_sync_lock``). An entry naming a segment
        this writer wrote is its own commit, even if the answer to its conditional PUT was lost; a gc entry naming
        one dooms it (it is written again before it is committed)."""
        head = self.store.head()
        if head <= self.synced:
            return
        entries = self.store.read_entries(self.synced, head)
        with self.state:
            for entry in entries:
                own = entry.writer_id == self.writer_id and entry.entry_id in self.attempted
                self.has_result.update(r.traj_id for r in entry.results)
                if entry.kind == GC:
                    self.doomed.update(p for p in entry.segments if p in self.attempted)
                if own and entry.entry_id not in self.landed:
                    self.landed.add(entry.entry_id)
                    log.info("%s: %s was committed as log entry %d by an earlier try", self.writer_id,
                             entry.entry_id, entry.seq)
                for r in entry.records():
                    self.committed.add(r.traj_id, r.token_start, r.token_stop)
                    self.owner.setdefault(r.traj_id, entry.writer_id)
                    if own:
                        self.own.add(r.traj_id, r.token_start, r.token_stop)
            self.synced = head

    def write_segment(self, stage: Stage) -> SegmentWrite:
        """Step 1: encode and write every array of ``stage`` as a new segment, with the group ``zarr.json``. Records
        the write in ``stage.segment``."""
        store = self.store
        rows = stage.rows
        chunk_rows = choose_chunk_rows(rows, store.chunk_rows)
        segment_id = f"{self.counter:08d}-{uuid.uuid4().hex[:12]}"
        self.counter += 1
        path = f"data/{self.writer_id}/{segment_id}"

        # every object of the segment in one put_many: object stores send them concurrently (one round trip
        # per segment instead of one per array); nothing is visible before the log entry references them
        items: dict[str, object] = {}
        margin_site = {data: site for site, (_ends, data) in store.margin_arrays.items()}
        for name, spec in store.array_specs.items():
            if spec.ends:  # a margin site's rows, back to back (FORMAT §2.3): one element per byte
                site = margin_site[name]
                nbytes = stage.margin_len[site]
                lay = margin_layout(spec, nbytes, chunk_rows, store.shard_bytes)
                items[f"{path}/{name}/zarr.json"] = array_metadata(lay)
                parts = lay.encode_parts([stage.margin_data[site][:nbytes]])
                items.update({f"{path}/{k}": v for k, v in parts.items()})
                continue
            lay = layout(spec, rows, chunk_rows, store.shard_bytes)
            if spec.grouped:
                kind = name.split(".", 1)[0]
                columns = [f"{kind}.{m}" for m in spec.members]
            else:
                columns = [name]
            sources = [stage.arrays[c][:rows] for c in columns]
            crcs = [stage.crcs[c] for c in columns] if stage.crc_rows == chunk_rows and lay.n_col == 1 else None
            items[f"{path}/{name}/zarr.json"] = array_metadata(lay)
            items.update({f"{path}/{k}": v for k, v in lay.encode_parts(sources, crcs).items()})
        items[f"{path}/zarr.json"] = group_metadata(
            {"tracestore": {"format_version": store.format_version, "writer_id": self.writer_id,
                            "segment_id": segment_id, "rows": rows, "store_id": store.store_id}})
        self.attempted.add(path)  # from here on a log entry naming it is this writer's
        store.backend.put_many(items, atomic=False)  # fresh objects, read by nobody before an entry names them
        nbytes = sum(len(v) if isinstance(v, (bytes, bytearray)) else sum(len(x) for x in v) for v in items.values())
        stage.segment = SegmentWrite(path, nbytes, rows, chunk_rows)
        return stage.segment

    def _split(self, records: list[Record]) -> tuple[list[Record], list[tuple[str, int, int]],
                                                     list[tuple[str, int, int]]]:
        """Split ``records`` against the committed ranges (caller holds ``state``): the parts still to commit, the
        parts another writer committed first (conflicts), and the records of trajectories whose result another
        writer committed meanwhile (completed: no token follows a result, FORMAT §3.2). Parts that an earlier try of
        this writer committed (an ambiguous commit that did land) are none of them."""
        keep: list[Record] = []
        conflicts: list[tuple[str, int, int]] = []
        completed: list[tuple[str, int, int]] = []
        for r in records:
            t = r.traj_id
            if t in self.has_result:
                completed.extend((t, x, y) for x, y in self.own.uncovered(t, r.token_start, r.token_stop))
                continue
            if self.committed.overlaps(t, r.token_start, r.token_stop) is None:
                keep.append(r)
                continue
            pos = r.token_start
            for a, b in self.committed.uncovered(t, r.token_start, r.token_stop):
                if a > pos:
                    conflicts.extend((t, x, y) for x, y in self.own.uncovered(t, pos, a))
                keep.append(Record(t, a, b, r.row_offset + (a - r.token_start), r.policy_version))
                pos = b
            if pos < r.token_stop:
                conflicts.extend((t, x, y) for x, y in self.own.uncovered(t, pos, r.token_stop))
        return keep, conflicts, completed

    def _commit_loop(self, what: str, build, on_ours) -> list:
        """Claim the next free log position for one commit (see the module docstring); returns what ``build``
        dropped (positions or results another writer committed first).

        ``build(seq)`` runs after the log was read up to ``seq`` (caller state current) and returns ``(entry,
        dropped)``: the entry to claim, None when nothing is left (or an earlier try did land), or :data:`_AGAIN`
        to start over (read the log again, build again). ``on_ours(entry, data)`` books a successful claim.

        Raises:
            CommitError: no position could be claimed before ``commit_timeout_s`` (storage failing); the caller
                keeps its rows/results, and a later flush retries (recognising an entry that did land meanwhile).
            BackendError / IntegrityError: reading the log failed.
        """
        store = self.store
        deadline = time.monotonic() + self.commit_timeout_s
        failures = rewrites = 0
        self.last_error = None
        with self._sync_lock:
            while True:
                self._sync_locked()
                entry, dropped = build(self.synced)
                if entry is _AGAIN:
                    rewrites += 1
                    if time.monotonic() > deadline:
                        # gc named every version of the segment before it could commit: its grace is shorter
                        # than this writer's commits take (liveness only: nothing was committed or lost)
                        raise CommitError(
                            f"writer {self.writer_id!r} could not commit {what} to {store.url} within "
                            f"{self.commit_timeout_s:.0f} s: gc named the segment for deletion {rewrites} times "
                            f"before its commit landed (the store's gc_grace_s {store.gc_grace_s:g} s is shorter "
                            f"than this writer's commits take); it stays buffered and the next flush retries")
                    continue
                if entry is None:
                    return dropped
                data = encode_entry(entry)
                outcome, error = claim(store, entry.seq, data, self.writer_id, entry.entry_id)
                if error is not None:
                    self.last_error = error
                if outcome == "ours":
                    with self.state:
                        self.landed.add(entry.entry_id)
                        self.synced = entry.seq + 1
                        self.stats["log_bytes"] += len(data)
                    store.log.note_head(entry.seq + 1)
                    log.debug("%s: committed %s as log entry %d", self.writer_id, entry.entry_id, entry.seq)
                    on_ours(entry, data)
                    return dropped
                if outcome == "taken":
                    with self.state:
                        self.stats["lost_races"] += 1
                    continue
                failures += 1
                pause = store.backend.retry.delay(failures)
                if time.monotonic() + pause > deadline:
                    raise CommitError(
                        f"writer {self.writer_id!r} could not commit {what} to {store.url} within "
                        f"{self.commit_timeout_s:.0f} s ({failures} failed tries at log entry {entry.seq}); it stays "
                        f"buffered and the next flush retries; last error: {self.last_error}")
                time.sleep(pause)

    def commit_rows(self, stage: Stage) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
        """Steps 2-3 for the stage's segment (written by :meth:`write_segment`): commit it with the stage's records,
        less what another writer committed first; returns the dropped ranges: (conflicts, completed), the latter
        those of trajectories whose result another writer committed first. Never commits a segment that a gc entry
        names (writes it again first)."""
        store = self.store
        records = list(stage.records)
        conflicts: list[tuple[str, int, int]] = []
        completed: list[tuple[str, int, int]] = []
        dropped = (conflicts, completed)

        def build(seq: int):
            nonlocal records
            seg = stage.segment
            if seg.path in self.landed:  # an earlier try whose answer was lost did commit
                return None, dropped
            with self.state:
                records, lost, done = self._split(records)
                conflicts.extend(lost)
                completed.extend(done)
                doomed = seg.path in self.doomed
            if not records:
                log.info("%s: nothing left to commit in %s", self.writer_id, seg.path)
                return None, dropped
            if doomed:
                # a gc entry below seq names the segment: gc deletes it, and no entry after that gc entry may
                # reference it (FORMAT §6); its rows are still here, so write them again under a new name
                log.warning("%s: a gc entry names segment %s (not committed in time); writing it again",
                            self.writer_id, seg.path)
                self.write_segment(stage)
                with self.state:
                    self.stats["rewritten"] += 1
                return _AGAIN, dropped
            return LogEntry(
                seq=seq, writer_id=self.writer_id, writer_seq=int(seg.path.rsplit("/", 1)[1].split("-")[0]),
                segment=SegmentRef(seg.path, self.writer_id, seg.rows, seg.chunk_rows, store.shard_bytes),
                created_unix=time.time(), segment_nbytes=seg.nbytes,
                traj_ids=[r.traj_id for r in records],
                token_start=np.array([r.token_start for r in records], np.int64),
                token_stop=np.array([r.token_stop for r in records], np.int64),
                row_offset=np.array([r.row_offset for r in records], np.int64),
                policy_version=np.array([r.policy_version for r in records], np.int64),
                format_version=store.format_version,
            ), dropped

        def on_ours(entry: LogEntry, data: bytes) -> None:
            seg = stage.segment
            with self.state:
                for r in entry.records():
                    self.committed.add(r.traj_id, r.token_start, r.token_stop)
                    self.own.add(r.traj_id, r.token_start, r.token_stop)
                    self.owner.setdefault(r.traj_id, self.writer_id)
                self.stats["segments"] += 1
                self.stats["rows"] += seg.rows
                self.stats["data_bytes"] += seg.nbytes
                self.stats["records"] += len(entry)

        return self._commit_loop(f"segment {stage.segment.path}", build, on_ours)

    def commit_results(self, stage: Stage) -> tuple[list[str], list[tuple[str, str]]]:
        """Steps 2-3 for the stage's results, as one results entry (after the stage's rows: FORMAT §3.2). Each
        result is checked again against the log below the position claimed; returns what was dropped: the
        trajectories whose result another writer committed first, and ``(trajectory, why)`` of those the log no
        longer allows (:func:`result_problem`: another writer committed the trajectory's first tokens, or tokens
        that leave a gap, since ``write_result`` checked)."""
        if not stage.results_batch:  # kept across retries: a results entry naming it is this writer's
            stage.results_batch = f"{self.counter:08d}-{uuid.uuid4().hex[:12]}"
            self.counter += 1
        batch = stage.results_batch
        entry_id = f"results/{self.writer_id}/{batch}"
        results = list(stage.results)
        exists: list[str] = []
        refused: list[tuple[str, str]] = []
        dropped = (exists, refused)

        def build(seq: int):
            nonlocal results
            if entry_id in self.landed:
                return None, dropped
            keep = []
            with self.state:
                for r in results:
                    if r.traj_id in self.has_result:
                        exists.append(r.traj_id)
                        continue
                    why = result_problem(r, self.writer_id, self.committed.get(r.traj_id),
                                         self.owner.get(r.traj_id))
                    if why is not None:
                        refused.append((r.traj_id, why))
                        continue
                    keep.append(r)
            results = keep
            if not results:
                return None, dropped
            empty = np.zeros(0, np.int64)
            return LogEntry(seq=seq, writer_id=self.writer_id, writer_seq=int(batch.split("-")[0]), segment=None,
                            created_unix=time.time(), segment_nbytes=0, traj_ids=[], token_start=empty,
                            token_stop=empty, row_offset=empty, policy_version=empty, kind=RESULTS,
                            results=tuple(results), batch=batch, format_version=self.store.format_version), dropped

        def on_ours(entry: LogEntry, data: bytes) -> None:
            with self.state:
                self.has_result.update(r.traj_id for r in entry.results)
                self.stats["results"] += len(entry.results)

        self.attempted.add(entry_id)
        return self._commit_loop(f"{len(results)} results", build, on_ours)
