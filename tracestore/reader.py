"""Random access over a snapshot of the log: :class:`Reader` builds an in-memory index (trajectory -> records) from
the log entries below the snapshot and reads token ranges through :func:`tracestore.batch.read_pieces` (only the
inner chunks a request touches, every chunk's crc32c checked); :class:`TrajectoryInfo` says what the snapshot holds
of one trajectory, results (format version 2) included.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from traceschemas import result_schema, trajectory_schema

from .batch import Piece, TraceBatch, read_pieces
from .errors import HintNotFoundError, ShapeError
from .format.cursor import Snapshot
from .format.keys import check_id
from .format.entries import LogEntry, Result, merge_ranges

__all__ = ["Reader", "TrajectoryInfo"]


@dataclass(frozen=True)
class TrajectoryInfo:
    """What the snapshot holds of one trajectory.

    ``num_tokens``: committed tokens contiguous from position 0 (what a trainer can read from the start);
    ``ranges``: all committed token ranges, merged; ``committed_tokens``: their total.
    """

    traj_id: str
    num_tokens: int
    committed_tokens: int
    ranges: tuple[tuple[int, int], ...]
    num_records: int
    policy_versions: tuple[int, ...]
    writers: tuple[str, ...]
    first_seq: int
    last_seq: int
    #: the trajectory's committed result (format version 2), None while the trajectory is not complete
    result: Result | None = None

    @property
    def complete(self) -> bool:
        """Whether the trajectory's result is committed (FORMAT §3.2)."""
        return self.result is not None


class Reader:
    """Random access to the records committed in a snapshot (default: the log head when created).

    Raises (constructor): SnapshotError (foreign/future snapshot), IntegrityError / SchemaVersionError (a log
    entry fails its checks).
    """

    def __init__(self, store, snapshot: Snapshot | str | None = None):
        self.store = store
        self.snapshot = store.check_snapshot(snapshot)
        self._entries = store.read_entries(0, self.snapshot.log_end)
        index: dict[str, list[tuple]] = {}
        self._results: dict[str, tuple[int, Result]] = {}  # traj -> (seq, result); the first one counts
        for entry in self._entries:
            for t, s, e, ro, pv in entry.records():
                index.setdefault(t, []).append((s, e, entry.seq, ro, pv))
            for r in entry.results:
                self._results.setdefault(r.traj_id, (entry.seq, r))
        self._index: dict[str, tuple[np.ndarray, ...]] = {}
        for t, recs in index.items():
            recs.sort()
            a = np.array(recs, dtype=np.int64).reshape(-1, 5)
            self._index[t] = (a[:, 0].copy(), a[:, 1].copy(), a[:, 2].copy(), a[:, 3].copy(), a[:, 4].copy())

    def __repr__(self) -> str:
        return f"Reader({self.store.url!r}, log_end={self.snapshot.log_end}, trajectories={len(self._index)})"

    def refresh(self) -> Reader:
        """A reader at the current log head (entries already read are not read again)."""
        return Reader(self.store, None)

    @property
    def entries(self) -> list[LogEntry]:
        return list(self._entries)

    def __contains__(self, traj_id: str) -> bool:
        return traj_id in self._index or traj_id in self._results

    def traj_ids(self) -> list[str]:
        """Every trajectory with committed tokens or a committed result, sorted."""
        return sorted(set(self._index) | set(self._results))

    def _records(self, traj_id: str) -> tuple[np.ndarray, ...]:
        """``(starts, stops, seqs, row_offsets, policy_versions)`` of ``traj_id``'s records, sorted by start.

        Raises HintNotFoundError: the snapshot holds no record of ``traj_id``."""
        recs = self._index.get(traj_id)
        if recs is None:
            raise HintNotFoundError(f"trajectory {traj_id!r} has no committed records in {self.store.url} "
                                    f"(snapshot log_end {self.snapshot.log_end})")
        return recs

    def info(self, traj_id: str) -> TrajectoryInfo:
        """What the snapshot holds of ``traj_id``. Raises HintNotFoundError (no records and no result)."""
        check_id(traj_id)
        result = self.result(traj_id)
        if traj_id not in self._index and result is not None:  # a result without tokens
            seq = self._results[traj_id][0]
            return TrajectoryInfo(traj_id, 0, 0, (), 0, (result.policy_version,),
                                  (self._entries[seq].writer_id,), seq, seq, result)
        starts, stops, seqs, _ro, pvs = self._records(traj_id)
        ranges = merge_ranges(zip(starts.tolist(), stops.tolist()))
        num = ranges[0][1] if ranges and ranges[0][0] == 0 else 0
        writers = sorted({self._entries[q].writer_id for q in set(seqs.tolist())})
        return TrajectoryInfo(traj_id, num, int((stops - starts).sum()), tuple(ranges), len(starts),
                              tuple(sorted(set(pvs.tolist()))), tuple(writers), int(seqs.min()), int(seqs.max()),
                              result)

    def result(self, traj_id: str) -> Result | None:
        """The committed result of ``traj_id`` in the snapshot, or None (not complete)."""
        hit = self._results.get(traj_id)
        return None if hit is None else hit[1]

    def results(self) -> list[Result]:
        """Every committed result in the snapshot, in log order."""
        return [r for _seq, r in sorted(self._results.values(), key=lambda x: x[0])]

    def complete_traj_ids(self) -> list[str]:
        """Trajectories whose result is committed, in the order their results were committed."""
        return [r.traj_id for r in self.results()]

    def results_table(self) -> pa.Table:
        """:meth:`results` as Arrow, in ``traceschemas.result_schema()`` (with the committing entry's ``seq``)."""
        rows = sorted(self._results.values(), key=lambda x: x[0])
        cols: dict = {name: [] for name in result_schema().names}
        for seq, r in rows:
            d = r.to_json()
            d["extra"] = json.dumps(d["extra"], sort_keys=True)
            d["seq"] = seq
            for k in cols:
                cols[k].append(d[k])
        return pa.table(cols, schema=result_schema())

    def trajectories(self) -> list[TrajectoryInfo]:
        """One :class:`TrajectoryInfo` per trajectory, sorted by id."""
        return [self.info(t) for t in self.traj_ids()]

    def trajectories_table(self) -> pa.Table:
        """:meth:`trajectories` as Arrow, in ``traceschemas.trajectory_schema()``."""
        infos = self.trajectories()
        cols = {
            "traj_id": [i.traj_id for i in infos], "num_tokens": [i.num_tokens for i in infos],
            "committed_tokens": [i.committed_tokens for i in infos], "num_records": [i.num_records for i in infos],
            "min_policy_version": [min(i.policy_versions) for i in infos],
            "max_policy_version": [max(i.policy_versions) for i in infos],
            "first_seq": [i.first_seq for i in infos], "last_seq": [i.last_seq for i in infos],
        }
        return pa.table(cols, schema=trajectory_schema())

    def _pieces(self, traj_id: str, start: int, stop: int | None) -> tuple[int, list[Piece]]:
        check_id(traj_id)
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
            raise ShapeError(f"start must be an int >= 0, got {start!r}")
        if stop is not None and (isinstance(stop, bool) or not isinstance(stop, (int, np.integer)) or stop <= start):
            raise ShapeError(f"stop must be an int > start ({start}), got {stop!r}")
        starts, stops, seqs, ros, pvs = self._records(traj_id)
        i = int(np.searchsorted(starts, start, side="right")) - 1
        pieces: list[Piece] = []
        pos = start
        while True:
            if i < 0 or i >= len(starts) or not (starts[i] <= pos < stops[i]):
                if stop is None and pieces:
                    break
                have = ", ".join(f"[{a}, {b})" for a, b in self.info(traj_id).ranges[:8])
                raise HintNotFoundError(
                    f"trajectory {traj_id!r}: token {pos} is not committed in {self.store.url} (snapshot log_end "
                    f"{self.snapshot.log_end}); committed ranges: {have}")
            end = int(stops[i]) if stop is None else min(int(stops[i]), int(stop))
            seq = int(seqs[i])
            pieces.append(Piece(seq, self._entries[seq].segment, pos, end, int(ros[i]) + pos - int(starts[i]),
                                 int(pvs[i])))
            pos = end
            if stop is not None and pos >= stop:
                break
            i += 1
        return pos, pieces

    def read(self, traj_id: str, start: int = 0, stop: int | None = None, *, sites: Sequence[str] | None = None,
             features: tuple[int, int] | None = None, fmt: str = "numpy", pin_memory: bool = False,
             trace: bool = True) -> TraceBatch:
        """Tokens ``[start, stop)`` of ``traj_id`` (``stop=None``: up to the end of the contiguous committed run).

        Args:
            sites: subset of site names (default all). features: ``(lo, hi)`` value indices, multiples of the
                site's block size and of 8, applied to every requested site (a margin site is read whole: only
                ``(0, width)`` for it). fmt: "numpy" | "torch" | "arrow". Margin sites (hint encoding ``margin``)
                come back in ``batch.rows[site]`` (data + offsets ``[T + 1]`` for the range), not in hints/scales.
            pin_memory: torch outputs in pinned host memory (falls back with a warning without CUDA).
            trace: also read token ids, log-probs and experts (False: hints/scales/policy_version only).

        Raises:
            HintNotFoundError: a requested position is not committed in the snapshot. UnknownSiteError,
            ShapeError (bad range / feature slice), InvalidIdError, IntegrityError (crc mismatch, missing data:
            the message names the object and the trajectory).
        """
        stop_, pieces = self._pieces(traj_id, start, stop)
        return read_pieces(self.store, traj_id, int(start), stop_, pieces, sites=sites, features=features, fmt=fmt,
                           pin_memory=pin_memory, trace=trace)
