"""The replay decode (FP4, the stored tokens forced, every FP4 activation site's codes captured into device
buffers; with margin points also each point's margin marks, computed from the replay's activations) and the bf16
floor decode of one recorded batch, one after the other or side by side."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tracefp4.constants import NVFP4_BLOCK_SIZE
from tracerl.audit.setup import Setup, StoredTrajectory, bound_runtime
from tracerl.config import DECODE_PATHS
from tracerl.errors import ConfigError
from tracerl.rollout import RolloutEngine
from tracerl.runlog import StepFn
from tracerl.util import swapped, to_device


class ReplayEngine(RolloutEngine):
    """A `RolloutEngine` whose captured codes and scales go into dense device buffers ``{site: (codes uint8
    [B, L, W/2], scales uint8 [B, L, W/16])}`` indexed by (batch row, position): nothing goes to the host.

    With ``marks`` (``{site: (value marks uint8 [M, B, L, W/8], block marks uint8 [M, B, L, ceil(W/128)])}``) and
    ``margins`` (M points ``(m, m_s, payload)``), the engine's ``mark_points`` give each point's
    ``tracefp4.margin_marks`` of the activation, scales and hints of each site of ``marks`` on every decode path
    (the marks the rollout's recorder would store at that margin), written into ``marks``."""

    def __init__(self, model, runtime, buffers: dict[str, tuple[torch.Tensor, torch.Tensor]], rids: Sequence[str],
                 marks: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None, margins: Sequence = (),
                 **kwargs):
        super().__init__(model, runtime, keep_codes=True,
                         mark_points=[(m, ms) for m, ms, _ in margins] if marks else (), mark_sites=set(marks or ()),
                         **kwargs)
        self._buffers = buffers
        self._marks = marks or {}
        self._row_of = {r: i for i, r in enumerate(rids)}
        self._last: tuple | None = None

    def _deliver_site(self, rids, pos, site, hints, scales, codes, x=None, marks=None, recorder_marks=None) -> None:
        buf = self._buffers.get(site)
        if buf is None:
            return
        last = self._last
        # The engine hands every site of one forward (or ring) the same rids/pos objects: index them once. The
        # references are held, so an identity match is never a recycled id.
        if last is None or last[0] is not rids or last[1] is not pos:
            b = torch.as_tensor(np.fromiter((self._row_of[r] for r in rids), np.int64, len(rids)))
            p = torch.as_tensor(np.asarray(pos, dtype=np.int64))
            last = self._last = (rids, pos, to_device(b, codes.device), to_device(p, codes.device))
        buf[0][last[2], last[3]] = codes
        buf[1][last[2], last[3]] = scales
        out = self._marks.get(site)
        if out is not None and marks is not None:
            for j, (vm, bm) in enumerate(marks):
                out[0][j, last[2], last[3]] = vm
                out[1][j, last[2], last[3]] = bm


@dataclasses.dataclass
class ReplayBatch:
    """One replay batch: its trajectories, the replayed codes/scales (device), the replay's and the floor's
    log-probs and routes (host)."""

    trajs: list[StoredTrajectory]
    codes: dict[str, torch.Tensor]  # site -> uint8 [B, L, W/2]
    scales: dict[str, torch.Tensor]  # site -> uint8 [B, L, W/16]
    logprobs: list[np.ndarray]  # per trajectory float32 [G_b] (replay)
    experts: dict[int, list[np.ndarray]]  # layer -> per trajectory uint8 [P_b + fed, top_k] (replay)
    floor_logprobs: np.ndarray  # float32 [B, G] by response position (NaN past a trajectory's end)
    floor_experts: dict[int, np.ndarray]  # layer -> uint8 [B, L, top_k] by position
    decode_path: str
    weights: str
    #: site -> (value marks uint8 [M, B, L, W/8], block marks uint8 [M, B, L, ceil(W/128)]) of the margin points
    marks: dict[str, tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=dict)


def dense(per_request: Sequence[np.ndarray], length: int, fill) -> np.ndarray:
    """Per-request arrays [n_b, ...] -> one array [B, length, ...] (``fill`` past each request's end)."""
    out = np.full((len(per_request), length, *per_request[0].shape[1:]), fill, dtype=per_request[0].dtype)
    for b, a in enumerate(per_request):
        out[b, : len(a)] = a[:length]
    return out


def replay_decode_path(s: Setup, engine: RolloutEngine) -> str:
    """The recorded decode path when this machine can run it, else the engine's default."""
    recorded = s.rollout.get("decode") if s.rollout.get("decode") in DECODE_PATHS else "auto"
    with contextlib.suppress(ConfigError):
        engine.decode = recorded
        return engine.decode_path(s.device)
    engine.decode = "auto"
    return engine.decode_path(s.device)


class LineUp:
    """Lines up ``n`` decodes that run side by side: their set-ups (graph capture, prefill) run one at a time,
    and every decode loop starts only when all are set up. A CUDA graph capture forbids device-wide syncs in
    every thread (the prefill's, the end of a decode), so no capture may overlap another decode's work.

    Use: ``with gate.setup(): engine.generate(..., on_ready=gate.ready)`` in each thread. A thread that fails
    before it is ready releases the set-up and breaks the line-up, so the others raise instead of waiting."""

    def __init__(self, n: int):
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(n)
        self._local = threading.local()

    @contextlib.contextmanager
    def setup(self) -> Iterator[None]:
        self._lock.acquire()
        self._local.holding = True
        try:
            yield
        except BaseException:
            self._barrier.abort()
            raise
        finally:
            if self._local.holding:
                self._local.holding = False
                self._lock.release()

    def ready(self) -> None:
        self._local.holding = False
        self._lock.release()
        self._barrier.wait()


def concurrent_decode(cfg_value: str, device: torch.device, path: str) -> bool:
    """Whether the replay and floor decodes run side by side (``auto``: CUDA-graph decodes on a GPU, where a
    decode step of a small batch leaves most of the device idle; on the CPU both would share the same cores)."""
    if cfg_value == "auto":
        return device.type == "cuda" and path == "graph"
    return cfg_value == "on"


def replay_batch(s: Setup, chunk: list[StoredTrajectory], weights: str, step: StepFn, done: dict[str, int],
            totals: dict[str, int], concurrency: str = "auto", margins: Sequence = (),
            margin_sites: Sequence[str] = ()) -> tuple[ReplayBatch, dict[str, Any]]:
    """The replay decode (FP4) and the floor decode (bf16) of one recorded batch, the stored tokens forced; with
    ``margins`` (points ``(m, m_s, payload)``) also their marks at ``margin_sites`` (`ReplayEngine`).

    With `concurrent_decode` the floor runs in a second thread (its own CUDA stream on a GPU) while the replay
    runs in this one: each decode is the same computation as alone (the same captured graph per step, the same
    kernels), so the results are the same bits either way (tests/tracerl/test_audit.py); the runtime's per-call
    state is per thread (`FP4Runtime`), so the two modes do not see each other."""
    rids = [t.traj_id for t in chunk]
    prompts = [t.prompt for t in chunk]
    max_new = max(len(t.response) for t in chunk)
    forced = torch.zeros(len(chunk), max_new, dtype=torch.long)
    for b, t in enumerate(chunk):
        forced[b, : len(t.response)] = torch.as_tensor(t.response)
    length = max(map(len, prompts)) + max_new
    by = s.plan.by_name
    buffers = {n: (torch.zeros(len(chunk), length, by[n].width // 2, dtype=torch.uint8, device=s.device),
                   torch.zeros(len(chunk), length, by[n].width // NVFP4_BLOCK_SIZE, dtype=torch.uint8,
                               device=s.device)) for n in s.observable}
    marks = {n: (torch.zeros(len(margins), len(chunk), length, by[n].width // 8, dtype=torch.uint8, device=s.device),
                 torch.zeros(len(margins), len(chunk), length, -(-by[n].width // 128), dtype=torch.uint8,
                             device=s.device)) for n in (margin_sites if margins else ())}
    temperature = float(s.rollout.get("temperature") or 1.0)
    phases = (("replay decode (FP4, tokens forced)", "fp4_rne_own_scales"),
              ("floor decode (bf16, tokens forced)", "bf16"))
    # The engines leave the model's attention implementation alone (two threads swapping it would race).
    with bound_runtime(s.model, s.replay), swapped(s.model.config, _attn_implementation="sdpa"):
        engines = {"fp4_rne_own_scales": ReplayEngine(s.model, s.replay, buffers, rids, marks, margins,
                                                      attn_implementation=None),
                   "bf16": ReplayEngine(s.model, s.replay, {}, rids, attn_implementation=None)}
        path = replay_decode_path(s, engines["fp4_rne_own_scales"])
        engines["bf16"].decode = engines["fp4_rne_own_scales"].decode
        side_by_side = concurrent_decode(concurrency, s.device, path)

        gate = LineUp(2 if side_by_side else 1)

        def run(phase: str, mode: str) -> tuple[Any, float]:
            base = done[phase]
            stream = (torch.cuda.stream(torch.cuda.Stream(s.device)) if side_by_side and s.device.type == "cuda"
                      else contextlib.nullcontext())
            t0 = time.perf_counter()
            with stream, gate.setup():
                out = engines[mode].generate(prompts, max_new, request_ids=rids, forced_tokens=forced, mode=mode,
                                             temperature=temperature, on_ready=gate.ready,
                                             on_step=lambda d, _t, p=phase, b0=base: step(p, b0 + d, totals[p]))
            done[phase] = base + max_new
            return out, time.perf_counter() - t0

        t0 = time.perf_counter()
        if side_by_side:
            with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="audit-floor") as pool:
                floor_job = pool.submit(run, *phases[1])
                try:
                    roll, replay_s = run(*phases[0])
                except BaseException:
                    concurrent.futures.wait([floor_job])  # the floor is not left running
                    if isinstance(floor_job.exception(), Exception):  # the floor failed first: its error, not the
                        raise floor_job.exception() from None  # replay's broken line-up
                    raise
                floor, floor_s = floor_job.result()  # the floor's own error, if it failed
        else:
            roll, replay_s = run(*phases[0])
            floor, floor_s = run(*phases[1])
        decode_s = time.perf_counter() - t0
    rep = ReplayBatch(chunk, {k: v[0] for k, v in buffers.items()}, {k: v[1] for k, v in buffers.items()},
                  [lp[: len(t.response)] for lp, t in zip(roll.logprobs, chunk)], roll.experts,
                  dense([lp[: len(t.response)] for lp, t in zip(floor.logprobs, chunk)], max_new, np.nan),
                  {la: dense(per, length, 0) for la, per in floor.experts.items()}, path, weights, marks)
    return rep, {"replay_s": replay_s, "floor_s": floor_s, "decode_s": decode_s, "concurrent": side_by_side}
