"""What a stream hands out, one item per committed thing: a :class:`CommittedRecord` per committed token range and
(format version 2) a :class:`CommittedResult` per committed trajectory result, made from log entries by
:func:`records_of`. Readers, streams and applications (a trainer's checkpoint keeps records as JSON) share them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .errors import IntegrityError, InvalidIdError
from .format.keys import INT64_MAX, INT64_MIN, check_id, is_int
from .format.entries import LogEntry, Result, SegmentRef

__all__ = ["CommittedRecord", "CommittedResult", "records_of"]


@dataclass(frozen=True)
class CommittedRecord:
    """A committed token range ``[token_start, token_stop)`` of ``traj_id``: record ``index`` of log entry ``seq``."""

    traj_id: str
    token_start: int
    token_stop: int
    policy_version: int
    writer_id: str
    seq: int
    index: int
    row_offset: int
    segment: SegmentRef = field(repr=False)
    created_unix: float = 0.0

    #: what a stream item is: "record" (tokens) or "result" (a trajectory became complete)
    kind = "record"

    @property
    def num_tokens(self) -> int:
        return self.token_stop - self.token_start

    def to_json(self) -> list:
        """The record as a JSON list (what trainer checkpoints store; :meth:`from_json` reads it back):
        ``[traj_id, token_start, token_stop, policy_version, writer_id, seq, index, row_offset,
        [segment.path, segment.writer_id, segment.rows, segment.chunk_rows, segment.shard_bytes], created_unix]``."""
        s = self.segment
        return [self.traj_id, self.token_start, self.token_stop, self.policy_version, self.writer_id, self.seq,
                self.index, self.row_offset, [s.path, s.writer_id, s.rows, s.chunk_rows, s.shard_bytes],
                self.created_unix]

    @classmethod
    def from_json(cls, v: object) -> CommittedRecord:
        """The record of a :meth:`to_json` list, every field checked (ids as FORMAT §2.1, token positions and row
        numbers as a log entry's, the segment path ``data/<writer_id>/<segment_id>``).

        Raises:
            IntegrityError: ``v`` is not such a list (says which field arrived as what, and what is allowed).
        """
        def bad(what: str) -> IntegrityError:
            return IntegrityError(f"not a committed record: {what}; expected [traj_id, token_start, token_stop, "
                                  f"policy_version, writer_id, seq, index, row_offset, [segment path, writer_id, "
                                  f"rows, chunk_rows, shard_bytes], created_unix], got {v!r:.200}")

        if not isinstance(v, (list, tuple)) or len(v) != 10:
            raise bad("a list of 10 values is needed")
        traj, start, stop, pv, wid, seq, index, row, seg, created = v
        if not isinstance(seg, (list, tuple)) or len(seg) != 5:
            raise bad("the segment must be a list of 5 values")
        path, seg_wid, rows, chunk_rows, shard_bytes = seg
        ints = {"token_start": (start, 0), "seq": (seq, 0), "index": (index, 0), "row_offset": (row, 0),
                "token_stop": (stop, start + 1 if is_int(start) else 1), "segment rows": (rows, 1),
                "chunk_rows": (chunk_rows, 1), "shard_bytes": (shard_bytes, 1), "policy_version": (pv, INT64_MIN)}
        for name, (value, lo) in ints.items():
            if not is_int(value) or not lo <= value <= INT64_MAX:
                raise bad(f"{name} must be an int in [{lo}, 2**63 - 1], got {value!r:.40}")
        if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
            raise bad(f"created_unix must be a finite number, got {created!r:.40}")
        try:
            check_id(traj)
            check_id(wid, "writer id")
            parts = path.split("/") if isinstance(path, str) else []
            if len(parts) != 3 or parts[0] != "data" or parts[1] != wid or seg_wid != wid:
                raise bad(f"the segment path must be data/<writer_id>/<segment_id> of writer {wid!r}, got "
                          f"{path!r:.80} (writer {seg_wid!r:.40})")
            check_id(parts[2], "segment id")
        except InvalidIdError as e:
            raise bad(str(e)) from e
        return cls(traj, int(start), int(stop), int(pv), wid, int(seq), int(index), int(row),
                   SegmentRef(path, wid, int(rows), int(chunk_rows), int(shard_bytes)), float(created))


@dataclass(frozen=True)
class CommittedResult:
    """A committed trajectory result (format version 2): item ``index`` of results entry ``seq``. From here on the
    trajectory is complete; every token its writer buffered before the result was committed earlier in the log."""

    traj_id: str
    result: Result
    writer_id: str
    seq: int
    index: int
    created_unix: float = 0.0

    kind = "result"

    @property
    def reward(self) -> float:
        return self.result.reward


def records_of(entry: LogEntry) -> list[CommittedRecord | CommittedResult]:
    """What a stream yields of a log entry, in order: its records (CommittedRecord), or its results
    (CommittedResult)."""
    if entry.results:
        return [CommittedResult(r.traj_id, r, entry.writer_id, entry.seq, i, entry.created_unix)
                for i, r in enumerate(entry.results)]
    return [CommittedRecord(r.traj_id, r.token_start, r.token_stop, r.policy_version, entry.writer_id, entry.seq, i,
                            r.row_offset, entry.segment, entry.created_unix)
            for i, r in enumerate(entry.records())]
