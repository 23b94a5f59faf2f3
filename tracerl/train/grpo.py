"""One GRPO step at a time on the groups a `tracerl.train.Follower` hands out.

Update. Advantages are group-normalized (`tracerl.train.loss.group_advantages`); the loss is
`tracerl.train.loss.policy_loss`, token-mean over the step's response tokens (each micro-batch's loss is weighted
by its share of them, so the gradient does not depend on the packing). The ratio is taken against the rollout's
stored log-probs; with ``tis_cap`` against the trainer's own log-probs, each token weighted by
min(exp(logp_trainer - logp_rollout), C). The forward is bf16 (the numerics the rollout runs and the weights it
loads); AdamW updates fp32 weights, whose rounding the bf16 model is (`tracerl.train.params`). With
``torch.distributed`` initialized (gloo on CPU, NCCL on GPUs, launched by ``torchrun``) they are sharded with
FSDP2 over the ranks (parameters, gradients and optimizer state 1/N per rank), which reduce-scatter the gradients
of their slices; every rank runs the same number of forwards and backwards (a rank with fewer micro-batches than
another runs a zero-weighted stand-in), as the collectives inside them require.

Data. The step packs its trajectories into THD micro-batches (`tracerl.train.packing.pack_micro_batches`; with
data parallelism each rank takes its `dp_shard`) and reads their tokens, hints and scales from the store ahead of
the forward (`tracerl.hints.read_ahead`, bounded memory); when the next step's groups are known (``next_groups``,
`tracerl.train.run_training` peeks at the follower), their micro-batches are read in the background while this step
computes (`tracerl.hints.BackgroundReads`), so a GPU step does not wait for the store.

Mismatch per step, always between the rollout and a trainer forward with the *same* weights (the version that
generated the trajectory: the trainer's own for on-policy groups; for stale groups, with ``measure_stale``, the
kept weights of their version in one extra no-gradient forward; ``measure_stale_every``: the versions 0, N, 2N, ...
are kept, the other stale groups' tokens counted as unmeasured): |logp_trainer - logp_rollout| statistics and k3
(`tracerl.fidelity.dlogp_stats`), and, where the rollout recorded its codes (`tracerl.artifacts.codes`), the code
agreement at hinted sites (`tracerl.fidelity.code_match_counts`). The extra forward changes nothing in training.

Margin sites (tracestore hint encoding ``margin``): a micro-batch's margin rows are read with it (read ahead like
the rest, `PackedHints.margin`) and decoded where the forward runs (`tracerl.hints.decode_margin`, ``decode="auto"``:
on a CUDA device with torch, 238 vs 503 ms for numpy on the host per 1,024-token micro-batch of 20 sites on the H200,
compact-path-h200-device.json; with numpy on a CPU), and the forward quantizes
those sites with `tracerl.hints.MarginSites` (scales and hints reconstructed from the forward's own activation and
the rollout's exceptions); the code agreement then also counts the values outside the margin (unmarked) whose code
differs from the rollout's (``margin_unmarked_mismatch`` of ``margin_unmarked`` values; ``margin_marked_mismatch`` of
``margin_marked``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import io
import itertools
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures.process import BrokenProcessPool
from typing import Any

import numpy as np
import torch

import tracestore as ts
from tracerl import fidelity
from tracerl.artifacts import checkpoints as ckpt
from tracerl.artifacts import tensorfile as st
from tracerl.artifacts import weights
from tracerl.artifacts.codes import RolloutCodes
from tracerl.config import TrainConfig
from tracerl.errors import CheckpointCorruptError, ConfigError, FollowError
from tracerl.hints import (
    BackgroundReads,
    MarginSites,
    MicroBatch,
    PackedHints,
    ReaderProcess,
    RecordSource,
    Segment,
    decode_margin,
    dp_shard,
    pack_micro_batches,
    packed_nbytes,
    read_ahead,
    use_store_scale_encodings,
)
from tracerl.policy import NO_SITE, Policy, build_policy
from tracerl.runlog import json_ready
from tracerl.train import loss as rl
from tracerl.train.determinism import param_digest, rng_state, set_deterministic, set_rng_state
from tracerl.train.dist import gather_objects, rank_world
from tracerl.train.follower import Follower, Group, Taken, Trajectory
from tracerl.train.params import make_params
from tracerl.train.recompute import QATTrainer
from tracerl.util import sync, to_device

log = logging.getLogger(__name__)

__all__ = ["GRPOTrainer"]


# ------------------------------------------------------------------------------------------------- trainer
class GRPOTrainer:
    """The policy, its optimizer and one GRPO step at a time (see the module docstring).

    Args:
        store: the loop store (`tracerl.loop.create_loop_store`); the policy is built from its metadata.
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
        self.rank, self.world = rank_world()
        if cfg.deterministic:
            set_deterministic(self.device)
        torch.manual_seed(cfg.seed)
        self.policy: Policy = build_policy(store.model, self.device, backend=backend)
        use_store_scale_encodings(self.policy.runtime, store)  # lsb sites: scale bytes rebuilt from own amax
        self.qat = QATTrainer(self.policy.model, self.policy.runtime)
        self.sites = [s for s in self.policy.hinted_sites if s != NO_SITE]  # hinted sites: codes, QAT
        #: sites the store keeps as margin-exception rows (they come with each micro-batch, `PackedHints.margin`)
        self.margin_sites = [n for n, s in store.sites.items() if getattr(s, "hint_encoding", "bits") == "margin"]
        self.read_sites = list(store.sites)  # what a micro-batch reads (a hint-free store: its placeholder)
        #: the trainable weights and AdamW: FSDP2-sharded under torch.distributed, else bf16 + fp32 masters
        self.trainable = make_params(self.policy.model, cfg, self.device)
        # Sharded over several ranks, the fake-quantized expert weights are not kept between forwards: a cache would
        # hold every layer's whole (all-gathered) expert stacks on every rank, what sharding is for not to hold.
        self.policy.runtime.cache_weights = self.world == 1
        self.step_num = 0
        self.version = 0
        self.last_metrics: dict | None = None
        self.metrics_path: str | None = None  # the live metrics log (kept in checkpoints, for replay)
        self._history: dict[int, list[torch.Tensor]] = {}  # version -> its weights (measure_stale)
        self._spare: list[list[torch.Tensor]] = []  # evicted versions' buffers, for the next snapshots
        if cfg.max_staleness and cfg.measure_stale and self.device.type == "cuda":
            # every buffer a step may need (the kept versions and the copy of the current one), got now: pinned
            # host memory takes seconds to allocate (8.8 GB on the H200 model), which the first steps paid before
            self._spare = [self.trainable.snapshot_buffers() for _ in range(self._snapshot_pool())]
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._published: concurrent.futures.Future | None = None
        self._codes = RolloutCodes(store)
        # code agreement at the hinted sites against the rollout's recorded codes (not in bf16: no FP4 codes)
        self._want_codes = cfg.code_agreement and bool(self.sites) and cfg.mode != "bf16"
        self._stand_in_batch: PackedHints | None = None
        self._next_reads: BackgroundReads | None = None  # the next step's micro-batches, read while this one computes
        self._reader: ReaderProcess | None = None  # where they are read: this process (a thread) or a child

    def _snapshot_pool(self) -> int:
        """How many weight snapshots exist at once at most: the kept versions no older than ``max_staleness``
        (every ``measure_stale_every``-th), plus the one a step copies."""
        return (self.cfg.max_staleness - 1) // self.cfg.measure_stale_every + 2

    # ---- state ------------------------------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self.policy.model

    def digest(self) -> str:
        """`param_digest` of the fp32 weights (the bf16 model is their rounding; sharded: a collective)."""
        return self.trainable.digest()

    def state(self, follower: Follower) -> dict:
        """The checkpoint's JSON: counters, config, follower, RNG, the weights' digest (a collective when sharded)."""
        return {"step": self.step_num, "version": self.version, "store_id": self.store.store_id,
                "config": self.cfg.to_json(), "follower": follower.state(), "rng": rng_state(),
                "digest": self.digest(), "last_metrics": self.last_metrics, "metrics_path": self.metrics_path,
                "optim_initialized": bool(self.trainable.opt.state),
                "runtime": {"device": self.device.type, "threads": torch.get_num_threads(), "world_size": self.world,
                            "torch": torch.__version__, "sharded": self.trainable.sharded}}

    def save(self, location: str, follower: Follower, *, storage_options: Mapping | None = None) -> None:
        """Commit a checkpoint of this step: the weights and AdamW state as a distributed checkpoint (every rank
        writes its shards; `tracerl.artifacts.checkpoints.save_sharded`) and the trainer's JSON state. Every rank
        calls it."""
        ckpt.save_sharded(location, self.step_num, self.trainable.state_dict(), self.state(follower),
                          storage_options=storage_options)
        if self.rank == 0 and self.cfg.keep_checkpoints is not None:
            ckpt.prune(location, self.cfg.keep_checkpoints, keep=(0,), storage_options=storage_options)

    def restore(self, c: ckpt.Checkpoint, *, log_end: int | None = None) -> Follower:
        """Load checkpoint ``c`` (weights, optimizer, RNG, counters); returns the follower at its cursor. A format-3
        checkpoint's tensors are read from where ``c`` was loaded into this trainer's shards, whatever world size
        wrote them (resharding); a format-2 one (one process) only into an unsharded trainer.

        Everything is read and checked against this trainer's model before anything changes: a checkpoint of
        another store or model raises `CheckpointCorruptError` / `ConfigError` and leaves the trainer as it was."""
        state = c.state
        if state.get("store_id") != self.store.store_id:
            raise ConfigError(f"checkpoint {c.step} belongs to store {state.get('store_id')}, not {self.store.store_id}")
        if c.tensors:
            sd = self.trainable.template(with_optim=bool(state.get("optim_initialized", True)))
            ckpt.load_tensors(c, sd)
            got = param_digest([sd["model"][n] for n in self.trainable.names])
            apply = lambda: self.trainable.load_state_dict(sd)  # noqa: E731
        else:
            master, opt_sd = self._decode_blobs(c)
            got = param_digest(master)
            apply = lambda: self.trainable.load_unsharded(master, opt_sd)  # noqa: E731
        if state.get("digest") and got != state["digest"]:
            raise CheckpointCorruptError(f"checkpoint {c.step}: the saved weights' digest {got} is not the recorded "
                                         f"{state['digest']}")
        follower = Follower(self.store, self.cfg.group_size, state=state["follower"],
                            max_open_groups=self.cfg.max_open_groups, log_end=log_end)
        apply()
        self.policy.runtime.weights_changed()
        set_rng_state(state["rng"])
        self.step_num, self.version = int(state["step"]), int(state["version"])
        self.last_metrics = state.get("last_metrics")
        return follower

    def _decode_blobs(self, c: ckpt.Checkpoint) -> tuple[list[torch.Tensor], dict]:
        """A format-2 checkpoint's fp32 masters (parameter order) and AdamW state, checked against the model."""
        try:
            model_sd, _ = st.decode(c.blobs["model"])
            opt = torch.load(io.BytesIO(c.blobs["optim"]), weights_only=True, map_location="cpu")
            master, opt_sd = opt["master"], opt["opt"]
            if master is None:  # saved before the first update: the bf16 weights widened
                master = [model_sd[n].float() for n in self.trainable.names]
        except (KeyError, RuntimeError, ValueError, TypeError) as e:  # ValueError: st.SafetensorsFormatError
            raise CheckpointCorruptError(f"checkpoint {c.step}: blobs do not decode: {e}") from e
        own = self.model.state_dict()
        if set(model_sd) != set(own) or any(model_sd[k].shape != own[k].shape for k in own) or \
                [tuple(m.shape) for m in master] != [tuple(p.shape) for p in self.trainable.params]:
            raise ConfigError(f"checkpoint {c.step} does not fit this model (names or shapes differ)")
        return master, opt_sd

    def publish(self, url: str, *, storage_options: Mapping | None = None, wait: bool = True) -> None:
        """Publish the bf16 weights as policy ``self.version``: one whole safetensors file, written by rank 0 (every
        rank calls it: sharded weights are gathered). A version that is already published (by a run that was killed
        after publishing it) is kept.

        With ``wait=False`` the weights are copied to host memory here and serialized, hashed and written by a
        background thread while training goes on (for a large model the publication takes as long as several
        steps); the previous publication is waited for first, and `wait_published` waits for the last one and
        raises what it raised. A trainer killed meanwhile has its checkpoint already: the restart publishes that
        version again (`start_or_resume`)."""
        self.wait_published()
        host = self.trainable.full_bf16_state_dict()  # sharded: gathered onto rank 0 (a collective)
        digest = self.digest()
        if self.rank != 0:
            return
        args = (url, self.version, host, {"digest": digest, "mode": self.cfg.mode}, self.step_num, storage_options)
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
            theirs = weights.read_meta(url, version, storage_options=storage_options).get("meta", {}).get("digest")
            if theirs is not None and theirs != meta["digest"]:
                what = (f"policy version {version} at {url} is already published with other weights (digest "
                        f"{theirs}) than this trainer's (digest {meta['digest']})")
                if version == 0:  # the rollouts generate from it: training other weights is off-policy from step 0
                    raise ConfigError(f"{what}: a fresh run must start from the weights its rollouts use; publish to "
                                      "a new weights location, or resume from the checkpoints of the run that "
                                      "published it (a seeded init also differs between CPU and CUDA)")
                log.warning("%s; kept (the rollouts may have generated from it)", what)
            else:
                log.warning("policy version %d is already published (by an earlier run of this trainer%s); kept",
                            version, "" if theirs else ", or without a digest to check")
        if self.cfg.keep_versions is not None:
            weights.prune(url, self.cfg.keep_versions, keep=(0,), storage_options=storage_options)

    # ---- one step ---------------------------------------------------------------------------------------
    def _plan(self, groups: Sequence[Group]) -> tuple[list[Trajectory], dict[str, Trajectory], list[MicroBatch],
                                                       list[MicroBatch]]:
        """A step's trajectories, by id, its micro-batches and this rank's share of them."""
        trajs = [t for g in groups for t in g.trajectories]
        by_id = {t.traj_id: t for t in trajs}
        mbs = pack_micro_batches({t.traj_id: t.num_tokens for t in trajs}, self.cfg.micro_batch_tokens)
        return trajs, by_id, mbs, dp_shard(mbs, self.rank, self.world)

    def read_next_in(self, where: str) -> None:
        """Where `step(next_groups=)` reads the next step's micro-batches: ``"process"`` (a `ReaderProcess`
        spawned now, which opens the store again; a store that cannot be opened in another process, such as
        ``memory://``, or whose reader cannot open it, is read in a thread, with a warning) or ``"thread"`` (a thread
        of this process: what a trainer does until this is called; `run_training` calls it). Raises ConfigError for
        anything else."""
        if where not in ("process", "thread"):
            raise ConfigError(f"read_next_in: got {where!r}; allowed: 'process', 'thread'")
        if where == "thread":
            self.close_reader()
        elif self._reader is None:
            try:
                self._reader = ReaderProcess(self.store)
            except (ConfigError, ts.TraceStoreError, BrokenProcessPool) as e:
                log.warning("no reader process (%s: %s); the next steps are read in a thread", type(e).__name__, e)

    def close_reader(self) -> None:
        """End the reader process of `read_next_in` (if any); later reads ahead run in a thread."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.close()

    def _read_next(self, groups: Sequence[Group]) -> None:
        """Start reading the micro-batches a step on ``groups`` will need, in the background (`BackgroundReads`,
        at most ``read_ahead_bytes`` of them); a later `step` on the same groups takes them over."""
        _, by_id, _, mine = self._plan(groups)
        self._next_reads = BackgroundReads(RecordSource(self.store, by_id), mine, self.read_sites,
                                           self.cfg.read_ahead_bytes, reader=self._reader) if mine else None

    def step(self, taken: Taken, *, ready_since: float | None = None,
             next_groups: Sequence[Group] | None = None) -> dict[str, Any]:
        """One optimizer step on ``taken.groups``; returns the step's metrics (JSON-ready).

        ``ready_since`` (unix time): when the trainer began waiting for these groups. Each trajectory's lag (its
        result's commit -> its micro-batch read from the store into the trainer's host memory; the copy to the
        device follows when that micro-batch is computed) is then also reported from
        ``max(commit, ready_since)`` (``ready_lag_s*``, 0 for a micro-batch already in memory then): the
        pipeline's own latency, without the time a batch queued while the trainer was busy with the previous step.

        ``next_groups``: the groups the next step will train on, when known now (`Follower.peek`): the next
        step's micro-batches are read in the background while this one computes (`BackgroundReads`; in the
        reader process of `read_next_in` from the step's start, in a thread from its last backward), so a step on
        a GPU does not wait for the store. What the next step reads is the
        same either way (committed records never change); for other groups it reads as usual. ``read_s`` counts
        the seconds this step waited for its data, ``read_ahead_s`` the seconds the background took for the
        micro-batches this step took over from it (``read_ahead_micro_batches``)."""
        cfg = self.cfg
        t_start = time.perf_counter()
        trajs, by_id, mbs, mine = self._plan(taken.groups)
        rewards = torch.tensor([t.result.reward for t in trajs], dtype=torch.float32)
        adv = rl.group_advantages(rewards, cfg.group_size, scale=cfg.adv_scale)
        adv_of = dict(zip(by_id, adv.tolist()))
        n_resp = sum(t.response_tokens for t in trajs)
        source = RecordSource(self.store, by_id)
        acc = _StepAccumulator()
        keeping = bool(cfg.max_staleness and cfg.measure_stale)
        if keeping and self.version % cfg.measure_stale_every == 0:
            # this version's weights, copied in the background on a GPU; started once the step's first micro-batch
            # has its margin rows decoded (`_start_snapshot`): the decoder reads its error flags back to the host,
            # and a read queued behind the snapshot's device -> host copies waits for all of them (the H100 trace
            # of the margin store's keeping step: +73 ms)
            reuse = self._spare.pop() if self._spare else None
            acc.snapshot = lambda: self.trainable.snapshot(reuse, background=True)
        fwd_s = read_ahead_s = 0.0
        acc.read = list(dict.fromkeys(seg.traj_id for mb in mine for seg in mb.segments))
        if self._want_codes:
            # the rollout's recorded codes, loaded in the background while the first micro-batch computes: only
            # those of the trajectories whose codes this step compares (this version's, and those of kept versions,
            # measured by `_measure_stale`); the others' would be loaded for nothing
            measured = {self.version, *self._history}
            self._codes.prefetch(by_id[t] for t in acc.read if by_id[t].policy_version in measured)
        t_read = time.perf_counter()
        ahead = self._next_reads.take(mine, self.read_sites) if self._next_reads is not None else []
        self._next_reads = None
        read_s = time.perf_counter() - t_read  # waiting for a background read still under way
        own = read_ahead(source, mine[len(ahead):], self.read_sites, cfg.read_ahead_bytes)
        # In a thread, the next step's read starts when the last backward does: a host-bound forward (Python
        # launching kernels) slows down by more than the read takes when a reading thread competes for the GIL,
        # while the backward runs in autograd's own threads and the optimizer waits on the device (H200: the forward
        # took 0.61 s instead of 0.36 s with the read beside it, trainer-h200-read-next.json).
        start_next = (lambda: self._read_next(next_groups)) if next_groups else None
        if start_next is not None and self._reader is not None:
            start_next()  # a reader process holds no GIL of ours: it reads during the whole step
            start_next = None
        for i, (packed, t_loaded, secs) in enumerate(itertools.chain(ahead, own)):
            for seg in packed.segments:
                acc.lag.setdefault(seg.traj_id, t_loaded - by_id[seg.traj_id].committed_unix)
            if i < len(ahead):
                read_ahead_s += secs
            else:
                read_s += secs
            t1 = time.perf_counter()
            self._micro_batch(packed, by_id, adv_of, n_resp, acc,
                              before_backward=start_next if i == len(mine) - 1 else None)
            fwd_s += time.perf_counter() - t1
        if not mine and start_next is not None:
            start_next()
        # Sharded, every rank runs as many forwards and backwards as the rank with the most micro-batches (their
        # all-gathers and reduce-scatters are collectives): the others run zero-weighted stand-ins.
        for _ in range(-(-len(mbs) // self.world) - len(mine)):
            self._micro_batch(None, by_id, adv_of, n_resp, acc)
        self._start_snapshot(acc)  # (a step without micro-batches)
        self._measure_stale(source, by_id, acc)
        t_reduce = time.perf_counter()
        tick = self._phase_clock(acc)
        totals = self._reduce(acc)
        tick("reduce")
        if keeping:
            # this version's weights (copied while the step computed), for measuring the mismatch of its groups that
            # later steps train on; versions no later step may train on are evicted, their buffers kept for reuse
            # (pinned host memory is slow to get: seconds for the H200 model's 8.8 GB)
            evicted = [self._history.pop(v) for v in sorted(self._history)
                       if v < self.version + 1 - self.cfg.max_staleness]
            self._spare = (self._spare + evicted)[:self._snapshot_pool()]
            if acc.kept is not None:
                self._history[self.version] = acc.kept
        tick("keep_weights")
        grad_norm = self.trainable.step(self.cfg.grad_clip)
        self.policy.runtime.weights_changed()
        if not self.trainable.sharded:  # (FSDP2's unsharded weights exist only around a forward)
            # the next forward's fake-quantized expert weights, launched while the device runs the optimizer
            self.policy.runtime.prequantize_weights()
        sync(self.device)
        tick("optimizer")
        self.step_num += 1
        self.version += 1
        n_tok = sum(t.num_tokens for t in trajs)
        wall = time.perf_counter() - t_start
        lags = np.asarray(sorted(totals["lag"].values()), dtype=np.float64)
        queued = {} if ready_since is None else {
            t: max(0.0, ready_since - by_id[t].committed_unix) for t in totals["lag"] if t in by_id}
        ready_lags = np.asarray(sorted(max(0.0, v - queued.get(t, 0.0)) for t, v in totals["lag"].items()),
                                dtype=np.float64)
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
            "step_s": wall, "read_s": read_s, "read_ahead_s": read_ahead_s,
            "read_ahead_micro_batches": len(ahead), "compute_s": fwd_s, "reduce_s": time.perf_counter() - t_reduce,
            "phases_s": dict(acc.phases) if cfg.time_phases else None,
            "tokens_per_s": n_tok / wall if wall > 0 else math.nan,
            "digest": self.digest(), "world_size": self.world, "rank_traj_ids": totals["rank_traj_ids"],
            "sharded": self.trainable.sharded, "rank_state_bytes": gather_objects(self.trainable.state_bytes()),
            "cuda_max_allocated_bytes": (torch.cuda.max_memory_allocated(self.device)
                                         if self.device.type == "cuda" else None),
        }
        metrics = json_ready(metrics)
        self.last_metrics = metrics
        return metrics

    def _micro_batch(self, packed: PackedHints | None, by_id: Mapping[str, Trajectory], adv_of: Mapping[str, float],
                     n_resp: int, acc: _StepAccumulator, before_backward: Callable[[], None] | None = None) -> None:
        """Forward + backward of one micro-batch; adds its weighted loss stats, mismatch and codes to ``acc``.
        ``packed`` None: a zero-weighted stand-in (a sharded rank with fewer micro-batches than another).
        ``before_backward``: called once the forward and the loss are computed, right before the backward."""
        # codes are compared for this version's trajectories only (older ones in `_measure_stale`, with their
        # version's weights): without any, the forward observes no site (an `effective_codes` pass per hinted site)
        want_codes = self._want_codes and packed is not None and any(
            by_id[s.traj_id].policy_version == self.version for s in packed.segments)
        tick = self._phase_clock(acc)
        fwd, margin = self._forward(packed, observe=want_codes, decoded=lambda: self._start_snapshot(acc))
        tick("forward")
        if packed is None:
            (fwd.logprobs.sum() * 0.0).backward()  # takes part in the gradients' reduce-scatter, adds nothing
            self.trainable.accumulate()
            tick("backward")
        else:
            self._train_on(packed, fwd, by_id, adv_of, n_resp, acc, tick, before_backward)
            self._measure(packed, fwd, by_id, acc, self.version, want_codes, margin)
            self._keep_stale(packed, by_id, acc, margin)
            tick("measure")

    def _train_on(self, packed: PackedHints, fwd, by_id: Mapping[str, Trajectory], adv_of: Mapping[str, float],
                  n_resp: int, acc: _StepAccumulator, tick: Callable[[str], None],
                  before_backward: Callable[[], None] | None = None) -> None:
        """The policy loss of ``packed``'s response tokens (weighted by their share of the step's) and its
        backward, from its forward ``fwd``."""
        cfg = self.cfg
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
        # host -> device without a host sync each (a pageable .to(cuda) waits for the queue to drain)
        sel = to_device(torch.as_tensor(np.flatnonzero(resp)), dev)
        lp = fwd.logprobs.index_select(0, sel)[None]  # (1, R)
        lp_roll = to_device(torch.as_tensor(roll_scored[resp]), dev)[None]
        adv = to_device(torch.as_tensor([adv_of[s.traj_id] for s in segs], dtype=torch.float32), dev)[None]
        mask = torch.ones_like(lp_roll, dtype=torch.bool)
        if cfg.tis_cap is None:
            loss, st = rl.policy_loss(lp, lp_roll, adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      clip_ratio_c=cfg.clip_ratio_c)
        else:
            loss, st = rl.policy_loss(lp, lp.detach(), adv, mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                      clip_ratio_c=cfg.clip_ratio_c, logp_rollout=lp_roll, tis_cap=cfg.tis_cap)
        n = lp.shape[1]
        tick("loss")
        if before_backward is not None:
            before_backward()
        (loss * (n / n_resp)).backward()
        self.trainable.accumulate()
        tick("backward")
        acc.add_stats(st, n)

    def _keep_stale(self, packed: PackedHints, by_id: Mapping[str, Trajectory], acc: _StepAccumulator,
                    margin: Mapping) -> None:
        """Note ``packed`` for the step's stale forwards (`_measure_stale`) when it holds trajectories of an older
        policy version whose weights are kept; count the response tokens of those without kept weights as
        unmeasured. The batch itself is kept, with ``margin`` (its margin exceptions as its forward decoded them,
        so that its stale forwards quantize from the same planes instead of decoding its rows again), while the
        kept batches fit the read-ahead budget, else read (and decoded) again."""
        versions = sorted({by_id[s.traj_id].policy_version for s in packed.segments} - {self.version})
        for v in versions:
            if v in self._history:
                acc.stale.setdefault(v, []).append((packed, margin))
            else:
                acc.sums["_unmeasured"] += sum(by_id[s.traj_id].response_tokens for s in packed.segments
                                               if by_id[s.traj_id].policy_version == v)
        if versions and any(v in self._history for v in versions):
            kept = packed_nbytes(packed)
            if acc.stale_bytes + kept <= self.cfg.read_ahead_bytes:
                acc.stale_bytes += kept
            else:  # over the budget: read it again when its version's weights are swapped in
                for v in versions:
                    if v in self._history:
                        acc.stale[v][-1] = (_Reread(packed), None)

    def _measure_stale(self, source: RecordSource, by_id: Mapping[str, Trajectory], acc: _StepAccumulator) -> None:
        """The mismatch of the step's trajectories of older policy versions: per version, its kept weights swapped
        in once and one no-gradient forward of each micro-batch that holds such trajectories (every micro-batch
        after every backward of the step: the weights are swapped and their FP4 fake quantization redone once per
        version and step, not per micro-batch). Sharded, every rank swaps in every version any rank needs and runs
        as many forwards of it as the busiest rank (they are collectives; the others forward stand-ins)."""
        want_codes = self._want_codes
        tick = self._phase_clock(acc)
        counts = {v: len(b) for v, b in acc.stale.items()}
        if self.trainable.sharded:
            merged: dict[int, int] = {}
            for c in gather_objects(counts):
                for v, n in c.items():
                    merged[v] = max(merged.get(v, 0), n)
            counts = merged
        for v in sorted(counts):
            batches = acc.stale.get(v, [])
            self.policy.runtime.weights_changed()
            with self.trainable.swapped(self._history[v]), torch.no_grad():
                for i in range(counts[v]):
                    packed, margin = batches[i] if i < len(batches) else (None, None)
                    if isinstance(packed, _Reread):
                        packed = packed.read(source, self.read_sites)
                    fwd_v, margin = self._forward(packed, observe=want_codes and packed is not None,
                                                  margin=margin or None)
                    if packed is not None:
                        self._measure(packed, fwd_v, by_id, acc, v, want_codes, margin)
            self.policy.runtime.weights_changed()
        acc.stale.clear()
        tick("stale_versions")

    def _start_snapshot(self, acc: _StepAccumulator) -> None:
        """Start the step's snapshot of this version's weights (``acc.snapshot``, set by `step` when the step keeps
        them) into ``acc.kept``, once."""
        if acc.snapshot is not None:
            acc.kept, acc.snapshot = acc.snapshot(), None

    def _forward(self, packed: PackedHints | None, observe: bool, margin: Mapping | None = None,
                 decoded: Callable[[], None] | None = None) -> tuple[Any, dict]:
        """The trainer's forward of ``packed`` (None: the stand-in) in the configured mode, and the margin exceptions
        of its margin sites (site -> `compact.MarginExceptions` on the device; empty without such sites). Margin
        sites are quantized by `MarginSites`, which the runtime asks first, so the QAT trainer sends no scales or
        hints of them to the device (it sent zero placeholder rows: 33 MB a step on the H200 model's 20 sites).
        ``margin``: the exceptions an earlier forward of the same ``packed`` decoded (a stale forward's micro-batch
        kept from the step's own forward), instead of decoding its rows again. ``decoded``: called once the margin
        rows are decoded (or found to be none), before the forward is launched."""
        cfg = self.cfg
        if margin is None:
            margin = {}
            if packed is not None and self.margin_sites:
                margin = decode_margin(self.store, packed, self.device, decode=cfg.margin_decode)
        if decoded is not None:
            decoded()
        run = dict(observe=observe, replay_routes=cfg.replay_routes, temperature=cfg.temperature, routes=False)
        if not margin:
            return self.qat.token_logprobs(packed or self._stand_in(), cfg.mode, **run), margin
        view = dataclasses.replace(packed, margin={})
        lens = np.diff(packed.cu_seqlens)
        rows = nrows = None
        if self.qat.padded and lens.size:  # the padded layout's row of each THD token (QATTrainer._layout)
            lmax = int(lens.max())
            rows = to_device(torch.as_tensor(np.concatenate([b * lmax + np.arange(k) for b, k in enumerate(lens)])),
                             self.device)
            nrows = len(lens) * lmax
        rt = self.policy.runtime
        with rt.using(substitute=MarginSites(rt, margin, rows=rows, nrows=nrows, chain=rt.substitute)):
            return self.qat.token_logprobs(view, cfg.mode, substituted=tuple(margin), **run), margin

    def _stand_in(self) -> PackedHints:
        """Two tokens of one sequence with zero hints and scales at every read site (and experts 0..k-1, for
        routing replay): a forward that exercises every parameter and carries no response token."""
        if self._stand_in_batch is None:
            sites = self.store.sites
            layers = self.policy.moe_layers
            top_k = self.policy.spec.top_k
            self._stand_in_batch = PackedHints(
                segments=(Segment("stand-in", 0, 2),), cu_seqlens=np.array([0, 2], dtype=np.int64),
                token_ids=np.zeros(2, dtype=np.int64), positions=np.arange(2, dtype=np.int64),
                logprobs=np.full(2, np.nan, dtype=np.float32),
                hints={s: np.zeros((2, site.hint_bytes), dtype=np.uint8) for s, site in sites.items()},
                scales={s: np.zeros((2, site.scale_bytes), dtype=np.uint8) for s, site in sites.items()},
                experts={la: np.tile(np.arange(top_k, dtype=np.uint8), (2, 1)) for la in layers}, features=None)
        return self._stand_in_batch

    def _phase_clock(self, acc: _StepAccumulator) -> Callable[[str], None]:
        """With ``time_phases``: a function that adds the seconds since its last call (after waiting for the
        device) to ``acc.phases[name]``; else one that does nothing."""
        if not self.cfg.time_phases:
            return lambda name: None
        last = [time.perf_counter()]

        def tick(name: str) -> None:
            sync(self.device)
            now = time.perf_counter()
            acc.phases[name] += now - last[0]
            last[0] = now

        sync(self.device)
        last[0] = time.perf_counter()
        return tick

    def _measure(self, packed, fwd, by_id: Mapping[str, Trajectory], acc: _StepAccumulator, version: int,
                 want_codes: bool, margin: Mapping | None = None) -> None:
        """Rollout/trainer mismatch of the response tokens of ``packed``'s trajectories generated by ``version``,
        from a forward with that version's weights (``fwd``): log-probs for |dlogp| and k3, codes at hinted sites."""
        # the code comparison's host work (gathering the rollout's codes into one pinned buffer) and its launches go
        # first, while the device still runs this micro-batch's backward (or forward); the log-probs' read-back
        # below then waits for both, and the counts are read after it without waiting again
        finish = self._count_codes(packed, fwd, by_id, acc, version, margin or {}) if want_codes else None
        seg_of_row = np.repeat(np.arange(len(packed.segments)), np.diff(packed.cu_seqlens))
        roll = np.asarray(packed.logprobs, dtype=np.float32)[fwd.scored]
        ver = np.array([by_id[s.traj_id].policy_version for s in packed.segments])
        keep = np.isfinite(roll) & (ver[seg_of_row[fwd.scored]] == version)
        acc.train_lp.append(fwd.logprobs.detach().float().cpu().numpy()[keep])
        acc.roll_lp.append(roll[keep])
        if finish is not None:
            finish()

    def _count_codes(self, packed, fwd, by_id: Mapping[str, Trajectory], acc: _StepAccumulator, version: int,
                     margin: Mapping | None = None) -> Callable[[], None] | None:
        """Code agreement at hinted sites on the response rows of ``version``'s trajectories, against the rollout's
        recorded codes. Every site's row indices and reference codes go to the device in one host -> device copy
        (not two per site), and sites of one row width are compared in one `fidelity.code_match_counts` over their
        rows stacked, up to `_COMPARE_VALUES` values at a time (its counts are sums over rows, so stacking sites
        adds them up as per-site calls did; the cap bounds its int16 temporaries, which run beside the activations
        kept for the backward).
        The counts stay on the device and are read once per call (one host sync, not one per site), by the function
        returned, which adds them to ``acc`` (None: nothing to compare)."""
        resp = np.isfinite(np.asarray(packed.logprobs))
        off = packed.cu_seqlens
        mine = []
        for i, seg in enumerate(packed.segments):
            traj = by_id[seg.traj_id]
            if traj.policy_version == version:
                keep = resp[int(off[i]):int(off[i + 1])]
                # the kept rows as runs (a segment's response rows are one run): each copied as a plain slice below
                mine.append((seg, traj, _runs(keep), np.arange(int(off[i]), int(off[i + 1]))[keep]))
        sites, parts = [], []  # per site: [(forward rows, the trajectory's codes [tokens, W/2], kept runs)]
        for site in self.sites:
            got = []
            for seg, traj, runs, r in mine:
                ref = self._codes.get(traj, site)
                if ref is not None:
                    got.append((r, ref[seg.start:seg.stop], runs))
            if got:
                sites.append(site)
                parts.append(got)
        if not sites:
            return None
        # The references (84 MB a step on the H200 model) are copied once, straight into one (pinned, on CUDA) host
        # buffer that goes to the device in one copy: a mask, two concatenations and the pinning were four copies on
        # the step's host thread, a cost the bf16 trainer does not have.
        shapes = [(sum(len(r) for r, _, _ in got), got[0][1].shape[1]) for got in parts]
        pin = self.device.type == "cuda"
        idx_host = torch.empty(sum(n for n, _ in shapes), dtype=torch.int64, pin_memory=pin)
        ref_host = torch.empty(sum(n * w for n, w in shapes), dtype=torch.uint8, pin_memory=pin)
        idx_np, ref_np = idx_host.numpy(), ref_host.numpy()
        i_at = r_at = 0
        for got, (_, w) in zip(parts, shapes):
            for r, src, runs in got:
                idx_np[i_at:i_at + len(r)] = r
                out = ref_np[r_at:r_at + len(r) * w].reshape(len(r), w)
                at = 0
                for a, b in runs:
                    out[at:at + b - a] = src[a:b]
                    at += b - a
                i_at, r_at = i_at + len(r), r_at + len(r) * w
        idx_all = idx_host.to(self.device, non_blocking=True)
        ref_all = ref_host.to(self.device, non_blocking=True)
        by_width: dict[int, tuple[list, list]] = {}  # width -> the sites' (codes, references) being stacked
        full: list[tuple[list, list]] = []
        margin_counts = []
        i_at = r_at = 0
        for site, (n, w) in zip(sites, shapes):
            idx = idx_all[i_at:i_at + n]
            ref_d = ref_all[r_at:r_at + n * w].view(n, w)
            i_at, r_at = i_at + n, r_at + n * w
            codes = fwd.codes[site].index_select(0, idx)
            group = by_width.get(codes.shape[1])
            if group is None or sum(c.numel() for c in group[0]) + codes.numel() > _COMPARE_VALUES:
                if group is not None:
                    full.append(group)
                group = by_width[codes.shape[1]] = ([], [])
            group[0].append(codes)
            group[1].append(ref_d)
            if margin and site in margin:
                margin_counts.append(_margin_counts(codes, ref_d, margin[site].value_mask.index_select(0, idx)))
        counts = torch.stack([fidelity.code_match_counts(torch.cat(c) if len(c) > 1 else c[0],
                                                         torch.cat(f) if len(f) > 1 else f[0])
                              for c, f in [*full, *by_width.values()]]).sum(0)
        marked = torch.stack(margin_counts).sum(0) if margin_counts else None

        def finish() -> None:
            acc.codes += np.asarray(counts.tolist(), dtype=np.int64)
            if marked is not None:
                for key, v in zip(_MARGIN_KEYS, marked.tolist()):
                    acc.sums[key] += int(v)
        return finish

    def _reduce(self, acc: _StepAccumulator) -> dict:
        """Sum the step's statistics over the data-parallel ranks (their gradients FSDP2 reduce-scattered already)."""
        train_lp = np.concatenate(acc.train_lp) if acc.train_lp else np.zeros(0, np.float32)
        roll_lp = np.concatenate(acc.roll_lp) if acc.roll_lp else np.zeros(0, np.float32)
        lag, sums, codes = dict(acc.lag), acc.sums, acc.codes
        if self.world > 1:
            keys = sorted(sums)
            gathered = gather_objects((keys, [sums[k] for k in keys], codes.tolist(), lag, train_lp.tolist(),
                                       roll_lp.tolist(), acc.mins, acc.maxs, acc.read))
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
        if any(k in sums for k in _MARGIN_KEYS):  # margin sites with the rollout's codes
            mismatch.update({k[1:]: int(sums.get(k, 0)) for k in _MARGIN_KEYS})
        read = acc.read if self.world > 1 else [acc.read]
        return {"loss_stats": stats, "mismatch": mismatch, "lag": lag, "rank_traj_ids": read}


#: values compared in one `fidelity.code_match_counts` call of `GRPOTrainer._count_codes` (its temporaries are a few
#: int16 copies of them: 64 MiB each at this cap, i.e. four 2,048-wide sites of a 4,096-row micro-batch)
_COMPARE_VALUES = 1 << 25

#: per-step sums of margin-site code agreement (`_margin_counts`), reported without the underscore
_MARGIN_KEYS = ("_margin_marked", "_margin_unmarked", "_margin_marked_mismatch", "_margin_unmarked_mismatch")


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """The ``[start, stop)`` ranges of the True runs of the bool vector ``mask``, in order."""
    edges = np.flatnonzero(np.diff(mask.astype(np.int8), prepend=0, append=0))
    return list(zip(edges[0::2].tolist(), edges[1::2].tolist()))


def _margin_counts(codes: torch.Tensor, packed_ref: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
    """int64 [4] on the codes' device: (marked values, unmarked values, marked values whose code differs from the
    rollout's, unmarked such values) of effective codes uint8 [R, W] against the rollout's packed codes uint8
    [R, W/2] (`fidelity.code_mismatch_mask`), ``marked`` bool [R, W] the rollout's marks."""
    bad = fidelity.code_mismatch_mask(codes, packed_ref)
    marked = marked.to(codes.device)
    return torch.stack([marked.sum(), (~marked).sum(), (bad & marked).sum(), (bad & ~marked).sum()])


class _Reread:
    """A kept micro-batch over the read-ahead budget: only its segments, read from the store again when needed."""

    def __init__(self, packed: PackedHints):
        self.segments = packed.segments

    def read(self, source: RecordSource, sites: list[str]) -> PackedHints:
        return next(iter(read_ahead(source, [MicroBatch(self.segments)], sites, 0)))[0]


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
        #: version -> (micro-batch or `_Reread` stand-in, its margin exceptions as its forward decoded them, on the
        #: device; None when read again) for each micro-batch with its trajectories, for the stale forwards
        self.stale: dict[int, list[tuple[Any, Mapping | None]]] = {}
        self.stale_bytes = 0  # bytes of the kept micro-batches
        #: starts the snapshot of this version's weights (when the step keeps them and it has not started yet)
        self.snapshot: Callable[[], list[torch.Tensor]] | None = None
        self.kept: list[torch.Tensor] | None = None  # that snapshot, once started

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


# ----------------------------------------------------------------------------------------------- the loop


