"""Follow a live trace store and hand out complete GRPO groups, exactly once.

Data path. A `Follower` tails the store's commit log (`tracestore.Stream`) from a cursor. Token records are kept
as metadata (no tokens) under their trajectory until its *result* arrives; the trajectory is then complete (the
writer commits every token before the result) and joins its GRPO group (``result.group_id``); a group is ready
when ``group_size`` results arrived. A training step takes the next ``groups_per_step`` ready groups in the order
they became ready and drops the ones older than the staleness bound.

Exactly once. The follower's whole state — stream cursor, records of incomplete trajectories, open and ready
groups — is JSON (`Follower.state`) that the trainer keeps in every checkpoint, taken right after the step's
groups were taken. A trainer restarted from checkpoint k resumes the stream at k's cursor and the same groups
come next in the same order (batching depends only on the log order, never on timing), so no trajectory is
trained twice or skipped.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Mapping

import tracestore as ts
from tracerl.errors import ConfigError, FollowError

__all__ = ["Trajectory", "Group", "Taken", "Follower"]


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A complete trajectory: its result and the metadata of its token records (sorted, contiguous from 0)."""

    traj_id: str
    result: ts.Result
    records: tuple[ts.CommittedRecord, ...]
    committed_unix: float  # when the result was committed (its log entry's created_unix)

    @property
    def num_tokens(self) -> int:
        return self.records[-1].token_stop

    @property
    def response_tokens(self) -> int:
        return self.num_tokens - self.result.prompt_len

    @property
    def policy_version(self) -> int:
        return self.result.policy_version

    def to_json(self) -> dict:
        return {"result": self.result.to_json(), "records": [r.to_json() for r in self.records],
                "committed_unix": self.committed_unix}

    @classmethod
    def from_json(cls, d: Mapping) -> Trajectory:
        result = ts.Result.from_json(d["result"])
        return cls(result.traj_id, result, tuple(ts.CommittedRecord.from_json(r) for r in d["records"]), float(d["committed_unix"]))


@dataclasses.dataclass(frozen=True)
class Group:
    """A GRPO group: the ``group_size`` trajectories of one prompt, in the order their results committed."""

    group_id: str
    trajectories: tuple[Trajectory, ...]

    @property
    def policy_version(self) -> int:
        """The oldest policy version among its trajectories (what the staleness bound looks at)."""
        return min(t.policy_version for t in self.trajectories)

    def to_json(self) -> dict:
        return {"group_id": self.group_id, "trajectories": [t.to_json() for t in self.trajectories]}

    @classmethod
    def from_json(cls, d: Mapping) -> Group:
        return cls(d["group_id"], tuple(Trajectory.from_json(t) for t in d["trajectories"]))


def _complete(result: ts.CommittedResult, records: list[ts.CommittedRecord]) -> Trajectory:
    """The trajectory of ``result`` from its records; raises FollowError unless they cover [0, n) without gaps
    and hold at least the prompt."""
    recs = tuple(sorted(records, key=lambda r: r.token_start))
    pos = 0
    for r in recs:
        if r.token_start != pos:
            break
        pos = r.token_stop
    if not recs or pos != recs[-1].token_stop or pos <= result.result.prompt_len:
        have = [(r.token_start, r.token_stop) for r in recs[:8]]
        raise FollowError(f"trajectory {result.traj_id!r}: its result (prompt_len {result.result.prompt_len}) came "
                          f"after token records {have}; a trainer needs contiguous tokens from 0 past the prompt")
    return Trajectory(result.traj_id, result.result, recs, result.created_unix)


@dataclasses.dataclass
class Taken:
    """What `Follower.take` hands out: the groups to train on and the ones dropped as too stale."""

    groups: list[Group]
    stale: list[Group]


class Follower:
    """Tails a store and assembles complete GRPO groups (see the module docstring).

    Args:
        store: an open `tracestore.Store` (format version 2: results).
        group_size: trajectories per group (G); a result whose ``extra["group_size"]`` says otherwise is an error.
        state: `state()` of an earlier follower (resume), or None to start at ``cursor``.
        cursor: a stream cursor to start from (None: the log's beginning); ignored with ``state``.
        max_open_groups: the most incomplete groups held at once.

    Memory: the follower holds metadata only (a record is ~100 bytes); tokens are read per micro-batch by the
    trainer. The metadata is bounded by what the rollout has in flight: at most ``max_open_groups`` open groups
    (more raises `FollowError`: groups that never complete mean a rollout with another group size or lost
    results), plus the ready groups it has read ahead of the trainer, at most one step's worth beyond the step
    being taken, because `take` stops reading the log once it has enough.

    Raises FollowError (from `take`) for a result without a group id or with another group size, a trajectory
    whose tokens do not cover [0, n), or too many open groups.
    """

    def __init__(self, store: ts.Store, group_size: int, *, state: Mapping | None = None, cursor: str | None = None,
                 poll_interval_s: float = 0.05, max_open_groups: int = 4096, log_end: int | None = None):
        if group_size < 2:
            raise ConfigError(f"group_size={group_size}: a GRPO group needs at least 2 trajectories")
        self.store = store
        self.group_size = group_size
        self.poll_interval_s = poll_interval_s
        self.max_open_groups = max_open_groups
        state = dict(state or {})
        self._stream = store.stream(state.get("cursor", cursor), poll_interval_s=poll_interval_s, timeout_s=0)
        self._pending: dict[str, list[ts.CommittedRecord]] = {
            t: [ts.CommittedRecord.from_json(r) for r in rs] for t, rs in state.get("pending", {}).items()}
        self._open: dict[str, list[Trajectory]] = {
            g: [Trajectory.from_json(t) for t in ts_] for g, ts_ in state.get("open", {}).items()}
        self._ready: collections.deque[Group] = collections.deque(Group.from_json(g) for g in state.get("ready", []))
        self.counts: collections.Counter = collections.Counter(state.get("counts", {}))
        #: with a pinned snapshot (replay): log entries from this one on are never consumed
        self.log_end = log_end
        self._at_end = False

    def state(self) -> dict:
        """JSON of everything needed to resume exactly here (cursor, pending records, open and ready groups)."""
        return {"cursor": self._stream.cursor,
                "pending": {t: [r.to_json() for r in rs] for t, rs in self._pending.items()},
                "open": {g: [t.to_json() for t in ts_] for g, ts_ in self._open.items()},
                "ready": [g.to_json() for g in self._ready],
                "counts": dict(self.counts)}

    @property
    def cursor(self) -> str:
        return self._stream.cursor

    @property
    def ready(self) -> int:
        return len(self._ready)

    def _consume(self, item) -> None:
        if item.kind == "record":
            self.counts["records"] += 1
            self._pending.setdefault(item.traj_id, []).append(item)
            return
        self.counts["results"] += 1
        res = item.result
        traj = _complete(item, self._pending.pop(item.traj_id, []))
        if not res.group_id:
            raise FollowError(f"trajectory {item.traj_id!r} has a result without a group_id; GRPO needs groups")
        declared = res.extra.get("group_size") if isinstance(res.extra, Mapping) else None
        if declared is not None and declared != self.group_size:
            raise FollowError(f"trajectory {item.traj_id!r} belongs to a group of {declared}; this trainer takes "
                              f"groups of {self.group_size}")
        members = self._open.setdefault(res.group_id, [])
        members.append(traj)
        if len(members) == self.group_size:
            del self._open[res.group_id]
            self._ready.append(Group(res.group_id, tuple(members)))
        elif len(self._open) > self.max_open_groups:
            raise FollowError(f"{len(self._open)} groups are open (incomplete) at once, more than max_open_groups="
                              f"{self.max_open_groups}: results of another group size, or lost trajectories?")

    def _fresh(self, version: int, max_staleness: int) -> int:
        return sum(g.policy_version >= version - max_staleness for g in self._ready)

    def fill(self, n: int, *, version: int = 0, max_staleness: int | None = None) -> bool:
        """Read what is committed now until ``n`` ready groups are fresh enough (all count when
        ``max_staleness`` is None); True when they are. Never waits."""
        def enough() -> bool:
            if max_staleness is None:
                return len(self._ready) >= n
            return self._fresh(version, max_staleness) >= n

        while not enough():
            items = [] if self._at_end else self._stream.poll(max_records=256)
            if not items:
                return False
            for item in items:
                if self.log_end is not None and item.seq >= self.log_end:
                    self._at_end = True  # past the pinned snapshot: this and later items do not exist here
                    break
                self._consume(item)
        return True

    def take(self, n: int, *, version: int, max_staleness: int, stop: threading.Event | None = None,
             timeout_s: float | None = None) -> Taken | None:
        """The next ``n`` ready groups whose policy version is at least ``version - max_staleness``; older ones
        met on the way are dropped and returned in ``stale``. Waits until there are ``n``; returns None (having
        taken and dropped nothing) when ``stop`` was set or ``timeout_s`` passed first.

        Which groups come out depends only on the log's order and the versions passed, never on timing: a
        resumed or replayed trainer takes the same ones."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.fill(n, version=version, max_staleness=max_staleness):
            if (stop is not None and stop.is_set()) or (deadline is not None and time.monotonic() >= deadline):
                return None
            time.sleep(self.poll_interval_s)
        groups: list[Group] = []
        stale: list[Group] = []
        while len(groups) < n:
            g = self._ready.popleft()
            (groups if g.policy_version >= version - max_staleness else stale).append(g)
        self.counts["groups"] += len(groups)
        self.counts["stale_groups"] += len(stale)
        return Taken(groups, stale)
