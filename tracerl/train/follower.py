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
import logging
import threading
import time
from collections.abc import Mapping

import tracestore as ts
from tracerl.config import SET_ASIDE_REASONS
from tracerl.errors import ConfigError

__all__ = ["Trajectory", "Group", "Taken", "Follower", "SET_ASIDE_REASONS"]

log = logging.getLogger(__name__)


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


def _complete(result: ts.CommittedResult, records: list[ts.CommittedRecord]) -> Trajectory | str:
    """The trajectory of ``result`` from its records, or why there is none: they must cover [0, n) without gaps
    and hold more than the prompt."""
    recs = tuple(sorted(records, key=lambda r: r.token_start))
    pos = 0
    for r in recs:
        if r.token_start != pos:
            break
        pos = r.token_stop
    if not recs:
        return f"its result (prompt_len {result.result.prompt_len}) came with no token records"
    if pos != recs[-1].token_stop or pos <= result.result.prompt_len:
        have = [(r.token_start, r.token_stop) for r in recs[:8]]
        return (f"its result (prompt_len {result.result.prompt_len}) came after token records {have}; a trainer "
                f"needs contiguous tokens from 0 past the prompt")
    return Trajectory(result.traj_id, result.result, recs, result.created_unix)


#: how many set-aside entries the state keeps (the counts cover all of them)
SET_ASIDE_KEPT = 1000
#: how many recently completed trajectories and groups the follower remembers (to name late records,
#: duplicate results and overfull groups as such)
RECENT_TRAJS, RECENT_GROUPS = 2048, 512


@dataclasses.dataclass
class Taken:
    """What `Follower.take` hands out: the groups to train on and the ones dropped as too stale."""

    groups: list[Group]
    stale: list[Group]


class Follower:
    """Tails a store and assembles complete GRPO groups (see the module docstring).

    Args:
        store: an open `tracestore.Store` (format version 2: results).
        group_size: trajectories per group (G); a result whose ``extra["group_size"]`` says otherwise is set aside.
        state: `state()` of an earlier follower (resume), or None to start at ``cursor``.
        cursor: a stream cursor to start from (None: the log's beginning); ignored with ``state``.
        max_open_groups: the most incomplete groups held at once.
        max_pending: the most trajectories held with token records but no result yet.

    Memory: the follower holds metadata only (a record is ~100 bytes); tokens are read per micro-batch by the
    trainer. The metadata is bounded: at most ``max_open_groups`` open groups and ``max_pending`` pending
    trajectories (beyond them the oldest is set aside: groups that never complete mean a rollout with another group
    size or lost results), the last `RECENT_TRAJS` / `RECENT_GROUPS` completed ids, plus the ready groups it has read ahead of the trainer, at most one step's worth beyond the step
    being taken, because `take` stops reading the log once it has enough.

    What GRPO cannot use never stops the follower: a result without a group id or with another group size, a
    trajectory whose tokens do not cover [0, n) past the prompt, a second result for a trajectory, a group
    with more than ``group_size`` results, the oldest open group when more than ``max_open_groups`` are open,
    the oldest pending trajectory when more than ``max_pending`` (default ``max_open_groups * group_size``) are
    (records without a result) are *set aside*: never trained on, logged in one line each, counted in
    ``counts`` (``set_aside`` and ``set_aside.<reason>``, in every step's metrics) and listed in `set_aside`
    (the last `SET_ASIDE_KEPT`, kept in the checkpoint's state; ``tracerl set-aside`` lists them). Which
    items are set aside depends only on the log's order, so a resumed trainer decides the same.
    """

    def __init__(self, store: ts.Store, group_size: int, *, state: Mapping | None = None, cursor: str | None = None,
                 poll_interval_s: float = 0.05, max_open_groups: int = 4096, max_pending: int | None = None,
                 log_end: int | None = None):
        if group_size < 2:
            raise ConfigError(f"group_size={group_size}: a GRPO group needs at least 2 trajectories")
        self.store = store
        self.group_size = group_size
        self.poll_interval_s = poll_interval_s
        self.max_open_groups = max_open_groups
        self.max_pending = max_open_groups * group_size if max_pending is None else max_pending
        state = dict(state or {})
        self._stream = store.stream(state.get("cursor", cursor), poll_interval_s=poll_interval_s, timeout_s=0)
        self._pending: dict[str, list[ts.CommittedRecord]] = {
            t: [ts.CommittedRecord.from_json(r) for r in rs] for t, rs in state.get("pending", {}).items()}
        self._open: dict[str, list[Trajectory]] = {
            g: [Trajectory.from_json(t) for t in ts_] for g, ts_ in state.get("open", {}).items()}
        self._ready: collections.deque[Group] = collections.deque(Group.from_json(g) for g in state.get("ready", []))
        self.counts: collections.Counter = collections.Counter(state.get("counts", {}))
        #: the last `SET_ASIDE_KEPT` trajectories set aside: {traj_id, group_id, reason, seq, detail}
        self.set_aside: collections.deque[dict] = collections.deque(state.get("set_aside", []), maxlen=SET_ASIDE_KEPT)
        recent = state.get("recent", {})
        self._done_trajs = dict.fromkeys(recent.get("trajs", []))  # insertion-ordered sets, oldest first
        self._done_groups = dict.fromkeys(recent.get("groups", []))
        #: with a pinned snapshot (replay): log entries from this one on are never consumed
        self.log_end = log_end
        self._at_end = False

    def state(self) -> dict:
        """JSON of everything needed to resume exactly here (cursor, pending records, open and ready groups, counts,
        what was set aside, the recently completed ids)."""
        return {"cursor": self._stream.cursor,
                "pending": {t: [r.to_json() for r in rs] for t, rs in self._pending.items()},
                "open": {g: [t.to_json() for t in ts_] for g, ts_ in self._open.items()},
                "ready": [g.to_json() for g in self._ready],
                "counts": dict(self.counts), "set_aside": list(self.set_aside),
                "recent": {"trajs": list(self._done_trajs), "groups": list(self._done_groups)}}

    @property
    def cursor(self) -> str:
        return self._stream.cursor

    @property
    def ready(self) -> int:
        return len(self._ready)

    def _consume(self, item) -> None:
        if item.kind == "record":
            self.counts["records"] += 1
            if item.traj_id in self._done_trajs:
                self._aside(item.traj_id, "", "tokens_after_result", item.seq,
                            f"tokens [{item.token_start}, {item.token_stop})")
                return
            self._pending.setdefault(item.traj_id, []).append(item)
            if len(self._pending) > self.max_pending:
                oldest = next(iter(self._pending))
                recs = self._pending.pop(oldest)
                self._aside(oldest, "", "never_completed", item.seq, f"{len(recs)} token records")
            return
        self.counts["results"] += 1
        res = item.result
        gid = res.group_id
        if item.traj_id in self._done_trajs:
            self._aside(item.traj_id, gid, "duplicate_result", item.seq, "")
            return
        traj = _complete(item, self._pending.pop(item.traj_id, []))
        self._remember(self._done_trajs, item.traj_id, RECENT_TRAJS)
        if isinstance(traj, str):
            self._aside(item.traj_id, gid, "tokens", item.seq, traj)
            return
        if not gid:
            self._aside(item.traj_id, gid, "no_group_id", item.seq, "")
            return
        declared = res.extra.get("group_size") if isinstance(res.extra, Mapping) else None
        if declared is not None and declared != self.group_size:
            self._aside(item.traj_id, gid, "group_size", item.seq,
                        f"declares {declared!r}, this trainer takes groups of {self.group_size}")
            return
        if gid in self._done_groups:
            self._aside(item.traj_id, gid, "group_overfull", item.seq, f"the group had {self.group_size} already")
            return
        members = self._open.setdefault(gid, [])
        members.append(traj)
        if len(members) == self.group_size:
            del self._open[gid]
            self._remember(self._done_groups, gid, RECENT_GROUPS)
            self._ready.append(Group(gid, tuple(members)))
        elif len(self._open) > self.max_open_groups:
            oldest = next(iter(self._open))
            for t in self._open.pop(oldest):
                self._aside(t.traj_id, oldest, "group_incomplete", item.seq,
                            f"{len(self._open) + 1} groups were open, max_open_groups={self.max_open_groups}")

    @staticmethod
    def _remember(recent: dict, key: str, cap: int) -> None:
        recent[key] = None
        if len(recent) > cap:
            del recent[next(iter(recent))]

    def _aside(self, traj_id: str, group_id: str, reason: str, seq: int, detail: str) -> None:
        """Set a trajectory aside: never trained on; counted, listed, logged in one line."""
        self.counts["set_aside"] += 1
        self.counts[f"set_aside.{reason}"] += 1
        self.set_aside.append({"traj_id": traj_id, "group_id": group_id, "reason": reason, "seq": seq,
                               "detail": detail})
        log.warning("set aside trajectory %r (group %r, log entry %d): %s%s", traj_id, group_id, seq,
                    SET_ASIDE_REASONS[reason], f": {detail}" if detail else "")

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

    def peek(self, n: int, *, version: int, max_staleness: int) -> list[Group] | None:
        """The groups `take` with these arguments would hand out if called now, without taking them (None when
        fewer than ``n`` fresh enough groups are ready; never waits). Reads what is committed now as `take` does,
        in the log's order, so peeking changes nothing `take` later returns: a later ``take(n, version=version,
        max_staleness=max_staleness)`` returns these groups (the log only grows, and groups become ready in its
        order). For reading a step's data before it starts (`GRPOTrainer.step`'s ``next_groups``)."""
        if not self.fill(n, version=version, max_staleness=max_staleness):
            return None
        fresh: list[Group] = []
        for g in self._ready:
            if g.policy_version >= version - max_staleness:
                fresh.append(g)
                if len(fresh) == n:
                    break
        return fresh

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
