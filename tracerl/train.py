"""GRPO training that follows a live trace store: exactly-once consumption, checkpoints, weight publication.

Data path. A `Follower` tails the store's commit log (`tracestore.Stream`) from a cursor. Token records are
kept as metadata (no tokens) under their trajectory until its *result* arrives; the trajectory is then complete
(the writer commits every token before the result) and joins its GRPO group (``result.group_id``); a group is
ready when ``group_size`` results arrived. A training step takes the next ``groups_per_step`` ready groups in
the order they became ready, drops the ones older than the staleness bound, packs the trajectories into THD
micro-batches (`tracerl.packing.pack_micro_batches`; with data parallelism each rank takes its `dp_shard`) and
reads their tokens, hints and scales from the store one micro-batch at a time (`tracestore.read_record` on the
records' metadata: nothing but the current micro-batch's tokens is in memory).

Exactly once. The follower's whole state — stream cursor, records of incomplete trajectories, open and ready
groups — is JSON in every checkpoint, taken right after the step's groups were taken. A trainer killed at any
point restarts from its newest checkpoint k: the model, optimizer, RNG and follower are those after step k, the
stream resumes at k's cursor and the same groups come next in the same order (batching depends only on the log
order, never on timing), so no trajectory is trained twice or skipped. Order of a step's side effects:
optimizer step -> checkpoint commit -> metrics line -> weight publication; on restart, a metrics line after the
checkpoint is dropped and a missing one re-appended from the checkpoint, and a version already published
by the killed run is kept.

Update. Advantages are group-normalized (`tracerl.rl.group_advantages`); the loss is `tracerl.rl.policy_loss`,
token-mean over the step's response tokens (each micro-batch's loss is weighted by its share of them, so the
gradient does not depend on the packing). The ratio is taken against the rollout's stored log-probs; with
``tis_cap`` against the trainer's own log-probs, each token weighted by min(exp(logp_trainer - logp_rollout), C).
The model stays bf16 (the numerics the rollout runs and the weights it loads); AdamW updates fp32 master copies,
which are rounded to the bf16 parameters after each step. With ``torch.distributed`` initialized (gloo on CPU,
NCCL on GPUs, launched by ``torchrun``) the gradients of the ranks' slices are summed by ``all_reduce``.

Mismatch per step, always between the rollout and a trainer forward with the *same* weights (the version that
generated the trajectory: the trainer's own for on-policy groups; for stale groups, with ``measure_stale``, the
kept weights of their version in one extra no-gradient forward): |logp_trainer - logp_rollout| statistics and k3
(`tracerl.fidelity.dlogp_stats`), and, where the rollout recorded its codes (`tracerl.rollout`), the code
agreement at hinted sites (`tracerl.fidelity.count_code_matches`). The extra forward changes nothing in training.
"""

from __future__ import annotations

import base64
import collections
import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

import tracestore as ts
from tracestore.format.log import SegmentRef
from tracerl import _safetensors as st
from tracerl import checkpoint as ckpt
from tracerl import fidelity, rl, weights
from tracerl.config import TrainConfig
from tracerl.engine import _sync
from tracerl.errors import CheckpointCorruptError, CheckpointNotFoundError, ConfigError, FollowError
from tracerl.packing import MicroBatch, PackedHints, dp_shard, pack_micro_batches, read_packed
from tracerl.policy import NO_SITE, Policy, build_policy
from tracerl.trainer import QATTrainer

log = logging.getLogger(__name__)

__all__ = ["Trajectory", "Group", "Taken", "Follower", "GRPOTrainer", "MetricsLog", "param_digest",
           "set_deterministic"]

#: where the rollout puts its recorded codes (`tracerl.rollout`): ``result.extra[CODES_KEY]`` names the object
CODES_KEY = "codes_key"


# ---------------------------------------------------------------------------------------------- stream items
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
        return {"result": self.result.to_json(), "records": [_record_json(r) for r in self.records],
                "committed_unix": self.committed_unix}

    @classmethod
    def from_json(cls, d: Mapping) -> Trajectory:
        result = ts.Result.from_json(d["result"])
        return cls(result.traj_id, result, tuple(_record_from(r) for r in d["records"]), float(d["committed_unix"]))


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


def _record_json(r: ts.CommittedRecord) -> list:
    s = r.segment
    return [r.traj_id, r.token_start, r.token_stop, r.policy_version, r.writer_id, r.seq, r.index, r.row_offset,
            [s.path, s.writer_id, s.rows, s.chunk_rows, s.shard_bytes], r.created_unix]


def _record_from(v: Sequence) -> ts.CommittedRecord:
    traj, a, b, pv, wid, seq, idx, ro, seg, created = v
    return ts.CommittedRecord(traj, int(a), int(b), int(pv), wid, int(seq), int(idx), int(ro),
                              SegmentRef(seg[0], seg[1], int(seg[2]), int(seg[3]), int(seg[4])), float(created))


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
            t: [_record_from(r) for r in rs] for t, rs in state.get("pending", {}).items()}
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
                "pending": {t: [_record_json(r) for r in rs] for t, rs in self._pending.items()},
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


class _RecordSource:
    """`tracerl.packing.read_packed`'s source over complete trajectories' record metadata: a range of a
    trajectory is read from the records that cover it (`tracestore.read_record`), without a Reader (which would
    index the whole log)."""

    def __init__(self, store: ts.Store, trajs: Mapping[str, Trajectory]):
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


class _RolloutCodes:
    """The rollout's recorded codes (`tracerl.rollout` writes one ``.npz`` per generation batch beside the
    store and names it in each result's extra), loaded on demand and cached for a few batches."""

    def __init__(self, store: ts.Store, keep: int = 4):
        self.store = store
        self.keep = keep
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    def get(self, traj: Trajectory, site: str) -> np.ndarray | None:
        """uint8 [num_tokens, W/2] packed codes of ``traj`` at ``site``, or None when not recorded."""
        key = traj.result.extra.get(CODES_KEY) if isinstance(traj.result.extra, Mapping) else None
        if not key:
            return None
        arrays = self._cache.get(key)
        if arrays is None:
            try:
                arrays = dict(np.load(io.BytesIO(self.store.backend.get(key))))
            except ts.ObjectNotFoundError:
                log.warning("codes %s of %s are missing; no code agreement for it", key, traj.traj_id)
                arrays = {}
            self._cache[key] = arrays
            while len(self._cache) > self.keep:
                self._cache.popitem(last=False)
        return arrays.get(f"{traj.traj_id}/{site}")


# ------------------------------------------------------------------------------------------------- helpers
def set_deterministic(device: torch.device) -> None:
    """Deterministic kernels for bitwise replay: torch's deterministic algorithms and, on CUDA, the math SDPA
    (the flash / memory-efficient / cuDNN attention backwards accumulate in a scheduling-dependent order) and a
    fixed cuBLAS workspace (set ``CUBLAS_WORKSPACE_CONFIG`` before CUDA starts; the command line does)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(False)
        if hasattr(torch.backends.cuda, "enable_cudnn_sdp"):
            torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


_DIGEST_MOD = (1 << 61) - 1


def param_digest(tensors: Iterable[torch.Tensor]) -> str:
    """A fingerprint of tensors' exact bits, computed on their device: per tensor, the bit patterns (as integers)
    times odd position weights, summed in int64 (wrapping: integer sums are exact and order-free, so the digest
    is deterministic on any device); the per-tensor sums and shapes are then hashed with sha256 on the host.
    Any single changed bit changes its tensor's sum. Not cryptographic: it tells replays apart, not attackers."""
    tensors = list(tensors)
    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        x = flat.view(bits).to(torch.int64)
        w = torch.arange(x.numel(), device=x.device, dtype=torch.int64) * 2654435761 % _DIGEST_MOD * 2 + 1
        sums.append((x * w).sum())
    host = torch.stack(sums).cpu().numpy().tobytes() if sums else b""
    shapes = json.dumps([list(t.shape) for t in tensors]).encode()
    return hashlib.sha256(host + shapes).hexdigest()[:32]


def _rng_state() -> dict:
    st = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
          "numpy": json.loads(json.dumps(np.random.get_state()[1].tolist())), "numpy_pos": int(np.random.get_state()[2]),
          "python": base64.b64encode(repr(random.getstate()).encode()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return st


def _set_rng_state(st: Mapping) -> None:
    import ast

    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(st["torch"]), dtype=np.uint8).copy()))
    np.random.set_state(("MT19937", np.asarray(st["numpy"], dtype=np.uint32), int(st["numpy_pos"]), 0, 0.0))
    random.setstate(ast.literal_eval(base64.b64decode(st["python"]).decode()))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())
                                      for s in st["cuda"]])


class MetricsLog:
    """Per-step metrics as JSON lines (one object per step, ``step`` increasing), appended and flushed per step.

    `truncate_after(step)` drops lines of later steps (and a torn last line), atomically (temp file + rename):
    a trainer that restarts from checkpoint ``step`` rewrites what the killed run logged after it."""

    def __init__(self, path: str | os.PathLike | None):
        self.path = None if path is None else Path(path)

    def records(self) -> list[dict]:
        if self.path is None or not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line torn by a kill: the end of what was logged
        return out

    def truncate_after(self, step: int) -> None:
        if self.path is None or not self.path.exists():
            return
        keep = [r for r in self.records() if r.get("step", 0) <= step]
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(json.dumps(r, allow_nan=True) + "\n" for r in keep))
        os.replace(tmp, self.path)

    def append(self, record: Mapping) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())


def json_ready(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN: a statistic of nothing) replaced by None, recursively."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {k: json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_ready(v) for v in obj]
    return obj


def _dist() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ------------------------------------------------------------------------------------------------- trainer
class GRPOTrainer:
    """The policy, its optimizer and one GRPO step at a time (see the module docstring).

    Args:
        store: the loop store (`tracerl.policy.create_loop_store`); the policy is built from its metadata.
        cfg: `TrainConfig` (checked here).
        device: torch device of the model and the optimizer.
        backend: tracefp4 kernel backend (``auto``: Triton on CUDA).

    Raises ConfigError for a bad config or a store that is not a loop store.
    """

    def __init__(self, store: ts.Store, cfg: TrainConfig, *, device: str | torch.device = "cpu",
                 backend: str = "auto"):
        cfg.check()
        self.store = store
        self.cfg = cfg
        self.device = torch.device(device)
        self.rank, self.world = _dist()
        if cfg.deterministic:
            set_deterministic(self.device)
        torch.manual_seed(cfg.seed)
        self.policy: Policy = build_policy(store.model, self.device, backend=backend)
        self.qat = QATTrainer(self.policy.model, self.policy.runtime)
        self.sites = [s for s in self.policy.hinted_sites if s != NO_SITE]  # hinted sites: codes, QAT
        self.read_sites = list(store.sites)  # what a micro-batch reads (a hint-free store: its placeholder)
        self.params = [p for p in self.policy.model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        # fused on CUDA: one elementwise kernel per step, without the multi-GB temporaries of the foreach path
        self.opt = torch.optim.AdamW(self.master, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay,
                                     eps=1e-8, fused=True if self.device.type == "cuda" else None)
        self.step_num = 0
        self.version = 0
        self.last_metrics: dict | None = None
        self.metrics_path: str | None = None  # the live metrics log (kept in checkpoints, for replay)
        self._history: dict[int, list[torch.Tensor]] = {}  # version -> its bf16 parameters (measure_stale)
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._published: concurrent.futures.Future | None = None
        self._codes = _RolloutCodes(store)

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    def digest(self) -> str:
        """`param_digest` of the fp32 master weights (the bf16 model is their rounding)."""
        return param_digest(self.master)

    def blobs(self) -> dict[str, Any]:
        """Checkpoint blobs: ``model`` (safetensors of the bf16 state dict, as `tracerl._safetensors.encode` parts:
        no serialization copy) and ``optim`` (torch.save of the fp32 master weights, None while they are the bf16
        weights widened, and the AdamW state)."""
        buf = io.BytesIO()
        # Before the first update the masters are the bf16 weights widened (exactly): not stored twice.
        fresh = not self.opt.state and all(torch.equal(m, p.float()) for m, p in zip(self.master, self.params))
        master = None if fresh else [m.detach().cpu() for m in self.master]
        torch.save({"master": master, "opt": self.opt.state_dict()}, buf)
        model = st.encode({k: v.detach().cpu().contiguous() for k, v in self.model.state_dict().items()})
        return {"model": model, "optim": buf.getvalue()}

    def state(self, follower: Follower) -> dict:
        return {"step": self.step_num, "version": self.version, "store_id": self.store.store_id,
                "config": self.cfg.to_json(), "follower": follower.state(), "rng": _rng_state(),
                "digest": self.digest(), "last_metrics": self.last_metrics, "metrics_path": self.metrics_path,
                "runtime": {"device": self.device.type, "threads": torch.get_num_threads(), "world_size": self.world,
                            "torch": torch.__version__}}

    def save(self, location: str, follower: Follower, *, storage_options: Mapping | None = None) -> None:
        """Commit a checkpoint of this step (rank 0 only; other ranks hold the same state)."""
        if self.rank == 0:
            ckpt.save(location, self.step_num, self.blobs(), self.state(follower), storage_options=storage_options)
            if self.cfg.keep_checkpoints is not None:
                ckpt.prune(location, self.cfg.keep_checkpoints, keep=(0,), storage_options=storage_options)

    def restore(self, c: ckpt.Checkpoint, *, log_end: int | None = None) -> Follower:
        """Load checkpoint ``c`` (model, optimizer, RNG, counters); returns the follower at its cursor.

        Everything is decoded and checked against this trainer's model before anything changes: a checkpoint of
        another store or model raises `CheckpointCorruptError` / `ConfigError` and leaves the trainer as it was."""
        state = c.state
        if state.get("store_id") != self.store.store_id:
            raise ConfigError(f"checkpoint {c.step} belongs to store {state.get('store_id')}, not {self.store.store_id}")
        try:
            model_sd, _ = st.decode(c.blobs["model"])
            opt = torch.load(io.BytesIO(c.blobs["optim"]), weights_only=True, map_location="cpu")
            master, opt_sd = opt["master"], opt["opt"]
            if master is None:  # saved before the first update: the bf16 weights widened
                names = [n for n, p in self.model.named_parameters() if p.requires_grad]
                master = [model_sd[n].float() for n in names]
        except (KeyError, RuntimeError, ValueError, TypeError) as e:  # ValueError: st.SafetensorsFormatError
            raise CheckpointCorruptError(f"checkpoint {c.step}: blobs do not decode: {e}") from e
        own = self.model.state_dict()
        if set(model_sd) != set(own) or any(model_sd[k].shape != own[k].shape for k in own) or \
                [tuple(m.shape) for m in master] != [tuple(m.shape) for m in self.master]:
            raise ConfigError(f"checkpoint {c.step} does not fit this model (names or shapes differ)")
        if state.get("digest") and param_digest(master) != state["digest"]:
            raise CheckpointCorruptError(f"checkpoint {c.step}: the saved weights' digest {param_digest(master)} is "
                                         f"not the recorded {state['digest']}")
        follower = Follower(self.store, self.cfg.group_size, state=state["follower"],
                            max_open_groups=self.cfg.max_open_groups, log_end=log_end)
        self.model.load_state_dict(model_sd)
        with torch.no_grad():
            for m, v in zip(self.master, master):
                m.copy_(v)
        self.opt.load_state_dict(opt_sd)
        _set_rng_state(state["rng"])
        self.step_num, self.version = int(state["step"]), int(state["version"])
        self.last_metrics = state.get("last_metrics")
        return follower

    def publish(self, url: str, *, storage_options: Mapping | None = None, wait: bool = True) -> None:
        """Publish the bf16 weights as policy ``self.version`` (rank 0). A version that is already published
        (by a run that was killed after publishing it) is kept.

        With ``wait=False`` the weights are copied to host memory here and serialized, hashed and written by a
        background thread while training goes on (for a large model the publication takes as long as several
        steps); the previous publication is waited for first, and `wait_published` waits for the last one and
        raises what it raised. A trainer killed meanwhile has its checkpoint already: the restart publishes that
        version again (`start_or_resume`)."""
        if self.rank != 0:
            return
        self.wait_published()
        host = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}
        args = (url, self.version, host, {"digest": self.digest(), "mode": self.cfg.mode}, self.step_num,
                storage_options)
        if wait:
            self._publish(*args)
            return
        if self._publisher is None:
            self._publisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tracerl-publish")
        self._published = self._publisher.submit(self._publish, *args)

    def wait_published(self) -> None:
        """Wait for a publication started with ``wait=False``; raises what it raised."""
        pending, self._published = self._published, None
        if pending is not None:
            pending.result()

    def _publish(self, url, version, state, meta, step, storage_options) -> None:
        try:
            weights.publish(url, version, state, meta, step=step, parent_version=version - 1 if version else None,
                            storage_options=storage_options)
        except weights.VersionExistsError:
            log.warning("policy version %d is already published (by an earlier run of this trainer); kept", version)
        if self.cfg.keep_versions is not None:
            weights.prune(url, self.cfg.keep_versions, keep=(0,), storage_options=storage_options)

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self, taken: Taken, *, ready_since: float | None = None) -> dict[str, Any]:
        """One optimizer step on ``taken.groups``; returns the step's metrics (JSON-ready).

        ``ready_since`` (unix time): when the trainer began waiting for these groups. Each trajectory's lag (its
        result's commit -> its micro-batch read from the store into the trainer's host memory; the copy to the
        device follows when that micro-batch is computed) is then also reported from
        ``max(commit, ready_since)`` (``ready_lag_s*``): the pipeline's own latency, without the time a batch
        queued while the trainer was busy with the previous step."""
        cfg = self.cfg
        t_start = time.perf_counter()
        trajs = [t for g in taken.groups for t in g.trajectories]
        by_id = {t.traj_id: t for t in trajs}
        rewards = torch.tensor([t.result.reward for t in trajs], dtype=torch.float32)
        adv = rl.group_advantages(rewards, cfg.group_size, scale=cfg.adv_scale)
        adv_of = dict(zip(by_id, adv.tolist()))
        mbs = pack_micro_batches({t.traj_id: t.num_tokens for t in trajs}, cfg.micro_batch_tokens)
        mine = dp_shard(mbs, self.rank, self.world)
        n_resp = sum(t.response_tokens for t in trajs)
        source = _RecordSource(self.store, by_id)
        acc = _StepAccumulator()
        read_s = fwd_s = 0.0
        acc.read = list(dict.fromkeys(seg.traj_id for mb in mine for seg in mb.segments))
        for packed, t_loaded, secs in read_ahead(source, mine, self.read_sites, cfg.read_ahead_bytes):
            for seg in packed.segments:
                acc.lag.setdefault(seg.traj_id, t_loaded - by_id[seg.traj_id].committed_unix)
            t1 = time.perf_counter()
            self._micro_batch(packed, by_id, adv_of, n_resp, acc)
            read_s += secs
            fwd_s += time.perf_counter() - t1
        t_reduce = time.perf_counter()
        tick = self._phase_clock(acc)
        totals = self._reduce(acc)
        tick("reduce")
        if self.cfg.max_staleness and self.cfg.measure_stale:
            # this version's weights, for measuring the mismatch of its groups that later steps train on
            evicted = [self._history.pop(v) for v in sorted(self._history)
                       if v < self.version + 1 - self.cfg.max_staleness]
            spare = evicted[0] if evicted else None  # its buffers are reused (pinned host memory is slow to get)
            self._history[self.version] = [self._keep(p, None if spare is None else spare[i])
                                           for i, p in enumerate(self.params)]
        tick("keep_weights")
        grad_norm = self._optimizer_step()
        _sync(self.device)
        tick("optimizer")
        self.step_num += 1
        self.version += 1
        n_tok = sum(t.num_tokens for t in trajs)
        wall = time.perf_counter() - t_start
        lags = np.asarray(sorted(totals["lag"].values()), dtype=np.float64)
        queued = {} if ready_since is None else {
            t: max(0.0, ready_since - by_id[t].committed_unix) for t in totals["lag"] if t in by_id}
        ready_lags = np.asarray(sorted(v - queued.get(t, 0.0) for t, v in totals["lag"].items()), dtype=np.float64)
        metrics = {
            "step": self.step_num, "version": self.version, "time_unix": time.time(), "mode": cfg.mode,
            "groups": len(taken.groups), "trajectories": len(trajs), "traj_ids": list(by_id),
            "stale_groups": len(taken.stale), "stale_traj_ids": [t.traj_id for g in taken.stale for t in g.trajectories],
            "policy_versions": sorted({t.policy_version for t in trajs}),
            "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(trajs) > 1 else 0.0,
            "tokens": n_tok, "response_tokens": n_resp,
            "grad_norm": grad_norm, **totals["loss_stats"],
            "lag_s_median": float(np.median(lags)) if lags.size else math.nan,
            "lag_s_max": float(lags.max()) if lags.size else math.nan, "lag_s": lags.tolist(),
            "ready_lag_s_median": float(np.median(ready_lags)) if ready_since is not None and ready_lags.size else None,
            "ready_lag_s": ready_lags.tolist() if ready_since is not None else None,
            "mismatch": totals["mismatch"],
            "step_s": wall, "read_s": read_s, "compute_s": fwd_s, "reduce_s": time.perf_counter() - t_reduce,
            "phases_s": dict(acc.phases) if cfg.time_phases else None,
            "tokens_per_s": n_tok / wall if wall > 0 else math.nan,
            "digest": self.digest(), "world_size": self.world, "rank_traj_ids": totals["rank_traj_ids"],
        }
        metrics = json_ready(metrics)
        self.last_metrics = metrics
        return metrics

    def _micro_batch(self, packed, by_id: Mapping[str, Trajectory], adv_of: Mapping[str, float], n_resp: int,
                     acc: _StepAccumulator) -> None:
        """Forward + backward of one micro-batch; adds its weighted loss stats, mismatch and codes to ``acc``."""
        cfg = self.cfg
        want_codes = cfg.code_agreement and bool(self.sites) and cfg.mode != "bf16"
        tick = self._phase_clock(acc)
        fwd = self.qat.token_logprobs(packed, cfg.mode, observe=want_codes, replay_routes=cfg.replay_routes,
                                      temperature=cfg.temperature, routes=False)
        tick("forward")
        seg_of_row = np.repeat(np.arange(len(packed.segments)), np.diff(packed.cu_seqlens))
        roll_scored = np.asarray(packed.logprobs, dtype=np.float32)[fwd.scored]
        resp = np.isfinite(roll_scored)  # response tokens (prompt tokens carry NaN)
        rows = fwd.scored[resp]
        segs = [packed.segments[i] for i in seg_of_row[rows]]
        expected = sum(max(0, min(s.stop, by_id[s.traj_id].num_tokens) - max(s.start, by_id[s.traj_id].result.prompt_len))
                       for s in packed.segments)
        if len(rows) != expected:
            raise FollowError(f"micro-batch of {[s.traj_id for s in packed.segments][:4]}: {len(rows)} tokens carry a "
                              f"rollout log-prob, the results' prompt lengths imply {expected}")
        dev = self.device
        sel = torch.as_tensor(np.flatnonzero(resp)).to(dev)
        lp = fwd.logprobs.index_select(0, sel)[None]  # (1, R)
        lp_roll = torch.as_tensor(roll_scored[resp]).to(dev)[None]
        adv = torch.as_tensor([adv_of[s.traj_id] for s in segs], dtype=torch.float32).to(dev)[None]
        mask = torch.ones_like(lp_roll, dtype=torch.bool)
        if cfg.tis_cap is None:
            loss, st = rl.policy_loss(lp, lp_roll, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      clip_ratio_c=cfg.clip_ratio_c)
        else:
            loss, st = rl.policy_loss(lp, lp.detach(), adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      clip_ratio_c=cfg.clip_ratio_c, logp_rollout=lp_roll, tis_cap=cfg.tis_cap)
        n = lp.shape[1]
        tick("loss")
        (loss * (n / n_resp)).backward()
        self._accumulate_grads()
        tick("backward")
        acc.add_stats(st, n)
        self._measure(packed, fwd, by_id, acc, self.version, want_codes)
        tick("measure")
        stale = sorted({by_id[s.traj_id].policy_version for s in packed.segments} - {self.version})
        for v in stale:  # the mismatch of older groups needs the weights that generated them
            snap = self._history.get(v)
            if snap is None:
                acc.sums["_unmeasured"] += sum(by_id[s.traj_id].response_tokens for s in packed.segments
                                               if by_id[s.traj_id].policy_version == v)
                continue
            with self._weights(snap), torch.no_grad():
                fwd_v = self.qat.token_logprobs(packed, cfg.mode, observe=want_codes, replay_routes=cfg.replay_routes,
                                                temperature=cfg.temperature, routes=False)
            self._measure(packed, fwd_v, by_id, acc, v, want_codes)
        tick("stale_versions")

    def _phase_clock(self, acc: _StepAccumulator) -> Callable[[str], None]:
        """With ``time_phases``: a function that adds the seconds since its last call (after waiting for the
        device) to ``acc.phases[name]``; else one that does nothing."""
        if not self.cfg.time_phases:
            return lambda name: None
        last = [time.perf_counter()]

        def tick(name: str) -> None:
            _sync(self.device)
            now = time.perf_counter()
            acc.phases[name] += now - last[0]
            last[0] = now

        _sync(self.device)
        last[0] = time.perf_counter()
        return tick

    def _keep(self, p: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of parameter ``p`` for `_history` (into ``into`` when given): on the host (pinned) for a GPU
        model, whose memory the optimizer needs; on the CPU as it is."""
        if into is not None:
            return into.copy_(p.detach())
        if p.device.type == "cuda":
            return torch.empty(p.shape, dtype=p.dtype, pin_memory=True).copy_(p.detach())
        return p.detach().clone()

    @contextlib.contextmanager
    def _weights(self, snapshot: list[torch.Tensor]):
        """The bf16 parameters of an earlier version for the block (swapped in: no copy on the CPU, one host ->
        device copy for a GPU model, freed after the block)."""
        current = [p.data for p in self.params]
        try:
            for p, t in zip(self.params, snapshot):
                p.data = t.to(p.device, non_blocking=True)
            yield
        finally:
            for p, t in zip(self.params, current):
                p.data = t

    def _measure(self, packed, fwd, by_id: Mapping[str, Trajectory], acc: _StepAccumulator, version: int,
                 want_codes: bool) -> None:
        """Rollout/trainer mismatch of the response tokens of ``packed``'s trajectories generated by ``version``,
        from a forward with that version's weights (``fwd``): log-probs for |dlogp| and k3, codes at hinted sites."""
        seg_of_row = np.repeat(np.arange(len(packed.segments)), np.diff(packed.cu_seqlens))
        roll = np.asarray(packed.logprobs, dtype=np.float32)[fwd.scored]
        ver = np.array([by_id[s.traj_id].policy_version for s in packed.segments])
        keep = np.isfinite(roll) & (ver[seg_of_row[fwd.scored]] == version)
        acc.train_lp.append(fwd.logprobs.detach().float().cpu().numpy()[keep])
        acc.roll_lp.append(roll[keep])
        if want_codes:
            self._count_codes(packed, fwd, by_id, acc, version)

    def _count_codes(self, packed, fwd, by_id: Mapping[str, Trajectory], acc: _StepAccumulator, version: int) -> None:
        """Code agreement at hinted sites on the response rows of ``version``'s trajectories, against the rollout's
        recorded codes: per site, one comparison over every such row of the micro-batch (one host -> device copy
        of the reference codes and one count per site, not per trajectory and site)."""
        resp = np.isfinite(np.asarray(packed.logprobs))
        off = packed.cu_seqlens
        mine = [(i, seg, by_id[seg.traj_id]) for i, seg in enumerate(packed.segments)
                if by_id[seg.traj_id].policy_version == version]
        for site in self.sites:
            rows, refs = [], []
            for i, seg, traj in mine:
                ref = self._codes.get(traj, site)
                if ref is None:
                    continue
                keep = resp[int(off[i]):int(off[i + 1])]
                rows.append(np.arange(int(off[i]), int(off[i + 1]))[keep])
                refs.append(ref[seg.start:seg.stop][keep])
            if not refs:
                continue
            idx = torch.as_tensor(np.concatenate(rows)).to(self.device)
            m, t, bad, one = fidelity.count_code_matches(fwd.codes[site].index_select(0, idx),
                                                         torch.as_tensor(np.concatenate(refs)).to(self.device))
            acc.codes += np.array([m, t, bad, one], dtype=np.int64)

    def _reduce(self, acc: _StepAccumulator) -> dict:
        """Sum gradients and statistics over the data-parallel ranks (``all_reduce``; nothing with one rank)."""
        train_lp = np.concatenate(acc.train_lp) if acc.train_lp else np.zeros(0, np.float32)
        roll_lp = np.concatenate(acc.roll_lp) if acc.roll_lp else np.zeros(0, np.float32)
        lag, sums, codes = dict(acc.lag), acc.sums, acc.codes
        if self.world > 1:
            import torch.distributed as dist

            flat = torch.cat([m.grad.reshape(-1) for m in self.master])
            dist.all_reduce(flat)  # the sum of every rank's slice (each already weighted by its token share)
            off = 0
            for m in self.master:
                m.grad.copy_(flat[off:off + m.numel()].view_as(m))
                off += m.numel()
            keys = sorted(sums)
            gathered: list = [None] * self.world
            dist.all_gather_object(gathered, (keys, [sums[k] for k in keys], codes.tolist(), lag,
                                              train_lp.tolist(), roll_lp.tolist(), acc.mins, acc.maxs, acc.read))
            sums, codes, lag = collections.Counter(), np.zeros(4, np.int64), {}
            tl, rlp, mins, maxs = [], [], {}, {}
            acc.read = [r for *_, r in gathered]
            for ks, vs, cs, lg, t_, r_, mn, mx, _ in gathered:
                for k, v in zip(ks, vs):
                    sums[k] += v
                codes += np.asarray(cs, dtype=np.int64)
                lag.update(lg)
                tl.extend(t_)
                rlp.extend(r_)
                for k, v in mn.items():
                    mins[k] = min(mins.get(k, v), v)
                for k, v in mx.items():
                    maxs[k] = max(maxs.get(k, v), v)
            train_lp, roll_lp = np.asarray(tl, np.float32), np.asarray(rlp, np.float32)
            acc.mins, acc.maxs = mins, maxs
        n = sums.get("_tokens", 0.0)
        stats = {k: (v / n if n else math.nan) for k, v in sums.items() if not k.startswith("_")}
        stats.update({k: v for k, v in acc.mins.items()})
        stats.update({k: v for k, v in acc.maxs.items()})
        mismatch = fidelity.dlogp_stats(train_lp, roll_lp)
        mismatch["code_agreement"] = float(codes[0] / codes[1]) if codes[1] else math.nan
        mismatch["code_values"] = int(codes[1])
        mismatch["unmeasured_tokens"] = int(sums.get("_unmeasured", 0))  # stale, without their version's weights
        mismatch["code_mismatch_one_step_share"] = float(codes[3] / codes[2]) if codes[2] else math.nan
        read = acc.read if self.world > 1 else [acc.read]
        return {"loss_stats": stats, "mismatch": mismatch, "lag": lag, "rank_traj_ids": read}

    def _accumulate_grads(self) -> None:
        """Add the micro-batch's bf16 gradients to the fp32 masters' (the sum over micro-batches is then fp32,
        not a bf16 running sum) and clear them."""
        for p, m in zip(self.params, self.master):
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            if p.grad is not None:
                m.grad.add_(p.grad.detach().to(m.dtype))
                p.grad = None

    def _optimizer_step(self) -> float:
        """Clip the fp32 master gradients, AdamW, round the masters to the bf16 parameters; the norm before
        clipping. A rank without micro-batches contributes zero gradients."""
        for m in self.master:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, self.cfg.grad_clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for p, m in zip(self.params, self.master):
                p.copy_(m)
        return norm


class _StepAccumulator:
    """Per-step sums over micro-batches: loss statistics weighted by response tokens, min/max statistics,
    on-policy log-probs for the mismatch, code counts, the lag of each trajectory."""

    _MIN = ("ratio_min",)
    _MAX = ("ratio_max",)

    def __init__(self):
        self.sums: collections.Counter = collections.Counter()
        self.mins: dict[str, float] = {}
        self.maxs: dict[str, float] = {}
        self.train_lp: list[np.ndarray] = []
        self.roll_lp: list[np.ndarray] = []
        self.codes = np.zeros(4, dtype=np.int64)  # matching, values, mismatching, one step apart
        self.lag: dict[str, float] = {}
        self.read: list = []  # trajectories whose tokens this rank read (all ranks' after the reduce)
        self.phases: collections.Counter = collections.Counter()  # seconds per phase (time_phases)

    def add_stats(self, st: Mapping[str, float], n: int) -> None:
        self.sums["_tokens"] += n
        for k, v in st.items():
            if k == "tokens" or not math.isfinite(v):
                continue
            if k in self._MIN:
                self.mins[k] = min(self.mins.get(k, v), v)
            elif k in self._MAX:
                self.maxs[k] = max(self.maxs.get(k, v), v)
            else:
                self.sums[k] += v * n


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


# ----------------------------------------------------------------------------------------------- the loop
def run_training(trainer: GRPOTrainer, follower: Follower, *, checkpoints: str, weights_url: str | None,
                 metrics: MetricsLog, max_steps: int | None = None, stop: threading.Event | None = None,
                 wait_timeout_s: float | None = None, storage_options: Mapping | None = None,
                 on_step: Callable[[dict], None] | None = None) -> int:
    """Follow the store and train until ``max_steps`` steps (counted from 0, so a resumed run stops at the same
    step), ``stop`` is set, or no group became ready for ``wait_timeout_s``; returns the steps taken now.

    Per step: take groups -> `GRPOTrainer.step` -> checkpoint (every ``checkpoint_every`` steps) -> metrics line
    -> publish the new version to ``weights_url`` (when given; in the background, overlapping the next step,
    and waited for before this returns)."""
    done = 0
    try:
        done = _train_steps(trainer, follower, checkpoints, weights_url, metrics, max_steps, stop, wait_timeout_s,
                            storage_options, on_step)
    finally:
        trainer.wait_published()  # the last version is committed before this returns
    return done


def _train_steps(trainer, follower, checkpoints, weights_url, metrics, max_steps, stop, wait_timeout_s,
                 storage_options, on_step) -> int:
    cfg = trainer.cfg
    done = 0
    while max_steps is None or trainer.step_num < max_steps:
        if _any_rank(stop is not None and stop.is_set()):
            break
        ready_since = time.time()
        taken = follower.take(cfg.groups_per_step, version=trainer.version, max_staleness=cfg.max_staleness,
                              stop=stop, timeout_s=wait_timeout_s)
        if _any_rank(taken is None):
            break
        m = trainer.step(taken, ready_since=ready_since)  # (also the trainer's last_metrics, kept by the checkpoint)
        m["follower"] = {"cursor": follower.cursor, "ready_groups": follower.ready, **dict(follower.counts)}
        if cfg.checkpoint_every and trainer.step_num % cfg.checkpoint_every == 0:
            trainer.save(checkpoints, follower, storage_options=storage_options)
        if trainer.rank == 0:
            metrics.append(m)
        if weights_url is not None:
            trainer.publish(weights_url, storage_options=storage_options, wait=False)
        done += 1
        if on_step is not None:
            on_step(m)
    return done


def _barrier() -> None:
    if _dist()[1] > 1:
        import torch.distributed as dist

        dist.barrier()


def _any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (a stop on one rank stops all, at the same step)."""
    rank, world = _dist()
    if world == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def start_or_resume(store: ts.Store, cfg: TrainConfig, *, checkpoints: str, weights_url: str | None,
                    metrics: MetricsLog, device: str | torch.device = "cpu", cursor: str | None = None,
                    storage_options: Mapping | None = None, backend: str = "auto") -> tuple[GRPOTrainer, Follower]:
    """A trainer and its follower: restored from the newest checkpoint at ``checkpoints`` (its config wins over
    ``cfg``), or fresh (seeded init, following from ``cursor``), with checkpoint 0 committed and version 0
    published. The metrics log is brought in line with the checkpoint (later lines dropped, the checkpoint's own
    step re-appended when missing), and the checkpoint's version published if the killed run had not.

    Raises CheckpointCorruptError for a newest checkpoint that fails its checks (nothing is changed: no older
    checkpoint is silently taken instead)."""
    latest = ckpt.latest_step(checkpoints, storage_options=storage_options)
    _barrier()  # every rank has decided before rank 0 writes checkpoint 0 of a fresh run
    if latest is None:
        trainer = GRPOTrainer(store, cfg, device=device, backend=backend)
        trainer.metrics_path = None if metrics.path is None else str(metrics.path.resolve())
        follower = Follower(store, cfg.group_size, cursor=cursor, max_open_groups=cfg.max_open_groups)
        if cfg.checkpoint_every:
            trainer.save(checkpoints, follower, storage_options=storage_options)
        elif any(r.get("step", 0) > 0 for r in metrics.records()):
            raise CheckpointNotFoundError(
                f"no checkpoint at {checkpoints} but the metrics log {metrics.path} has trained steps: a run started "
                "with checkpoint_every=0 cannot resume; start a new run (new metrics log and weights) or checkpoint")
        if trainer.rank == 0:
            metrics.truncate_after(0)
    else:
        c = ckpt.load(checkpoints, latest, storage_options=storage_options)
        saved = TrainConfig.from_json(c.state["config"])
        if saved != cfg:
            diff = {k: (v, getattr(cfg, k)) for k, v in dataclasses.asdict(saved).items() if getattr(cfg, k) != v}
            log.warning("resuming with the checkpoint's config; the given one differs in %s", diff)
        trainer = GRPOTrainer(store, saved, device=device, backend=backend)
        trainer.metrics_path = None if metrics.path is None else str(metrics.path.resolve())
        follower = trainer.restore(c)
        if trainer.rank == 0:
            metrics.truncate_after(trainer.step_num)
            logged = {r.get("step") for r in metrics.records()}
            if trainer.last_metrics is not None and trainer.step_num not in logged:
                metrics.append(trainer.last_metrics)
        log.info("resumed from checkpoint %d (policy version %d)", c.step, trainer.version)
    if weights_url is not None:
        trainer.publish(weights_url, storage_options=storage_options)
    return trainer, follower
