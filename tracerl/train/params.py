"""The trainable weights of the GRPO trainer and their optimizer, unsharded or sharded with FSDP2.

Both keep what the rollout runs and loads — a bf16 model — and train fp32 weights under it with AdamW:

- `PlainParams` (one process, no process group): the model's bf16 parameters, an fp32 master copy of each, AdamW
  on the masters; after each micro-batch's backward the bf16 gradients are added into the masters' fp32 gradients
  (`accumulate`), after each step the masters are rounded into the bf16 parameters.
- `ShardedParams` (under ``torch.distributed``, any world size, gloo on CPU or NCCL on GPUs): the model's parameters
  *are* the fp32 weights, sharded by FSDP2 (``fully_shard``: one unit per decoder block and the root) over a 1-D
  `DeviceMesh` of the ranks, with a mixed-precision policy that all-gathers them as bf16 for the forward and the
  backward and reduce-scatters the gradients in fp32 (summed, not averaged: every rank's loss is already weighted
  by its share of the step's tokens). Parameters, gradients and AdamW state are 1/N per rank.

The two are the same arithmetic: the bf16 weights a forward sees are the round-to-nearest of the fp32 weights, the
gradients arrive in bf16 and are summed in fp32, AdamW updates fp32; at world size 1 they give the same bits
(`tests/tracerl/test_fsdp.py`). Where the FP4 fake quantization of the expert weights happens is the same too: in
the MoE block's forward (`tracerl.policy.FP4MoEBlock`), on the bf16 weights it receives — with FSDP2 these are the
all-gathered, unsharded ones, so each expert stack is quantized whole, once per forward unless it is cached
(`FP4Runtime.weight`; the cache is invalidated by `weights_changed` whenever the weights change).

Checkpoint state (`state_dict`, `template`, `load_state_dict`) is one form for both, keyed by parameter name:
``{"model": {name: fp32 weights}, "optim": {name: {"step", "exp_avg", "exp_avg_sq"}}}`` (AdamW's state; absent
before the first update), whole tensors for `PlainParams` and DTensor shards for `ShardedParams`, so
`torch.distributed.checkpoint` saves either and loads it into either at any world size (resharding). The optimizer's
hyperparameters are not in it: they come from the configuration a checkpoint records. (torch's
``get_optimizer_state_dict`` would give a similar form, but it initializes the state of an optimizer that has not
stepped yet by running a step with learning rate 0 — for AdamW that sets ``step`` to 1, so a checkpoint at step 0
would change the bias correction of every later update.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from tracerl.errors import CheckpointCorruptError
from tracerl.train.determinism import param_digest
from tracerl.train.dist import rank_world

__all__ = ["PlainParams", "ShardedParams", "make_params"]


def _adamw(params, cfg, device: torch.device) -> torch.optim.AdamW:
    # fused on CUDA: one elementwise kernel per step, without the multi-GB temporaries of the foreach path
    return torch.optim.AdamW(params, lr=cfg.lr, betas=tuple(cfg.betas), weight_decay=cfg.weight_decay, eps=1e-8,
                             fused=True if device.type == "cuda" else None)


class PlainParams:
    """bf16 parameters, fp32 masters, AdamW on the masters (one process; see the module docstring)."""

    sharded = False

    def __init__(self, model: torch.nn.Module, cfg, device: torch.device):
        self.model = model
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = _adamw(self.master, cfg, device)
        self.rank, self.world = 0, 1
        self.grad_bytes = 0
        self._copy_stream = None  # a CUDA side stream for snapshots taken while the step computes
        self._snapshot_done = None  # the CUDA event of the last such snapshot
        self._digest: tuple[tuple[int, ...], str] | None = None  # (the masters' version counters, their digest)

    # ---- a step --------------------------------------------------------------------------------------
    def accumulate(self) -> None:
        """Add the micro-batch's bf16 gradients to the fp32 masters' (the sum over micro-batches is then fp32,
        not a bf16 running sum) and clear them."""
        into, grads = [], []
        for p, m in zip(self.params, self.master):
            if m.grad is None:
                m.grad = torch.zeros_like(m)
            if p.grad is not None:
                into.append(m.grad)
                grads.append(p.grad.detach())
                p.grad = None
        if into:  # one multi-tensor op instead of a cast and an add per parameter (bf16 -> fp32 is exact)
            torch._foreach_add_(into, grads)

    def step(self, grad_clip: float) -> float:
        """Clip the fp32 gradients, AdamW, round the masters into the bf16 parameters; the norm before clipping.
        A parameter without a gradient gets zeros. Waits (on the device) for a snapshot still copying the bf16
        parameters before writing them."""
        self._wait_snapshot()
        for m in self.master:
            if m.grad is None:
                m.grad = torch.zeros_like(m)
        norm = float(torch.nn.utils.clip_grad_norm_(self.master, grad_clip))
        self.grad_bytes = _nbytes(m.grad for m in self.master)
        self.opt.step()
        self._digest = None  # also where a fused optimizer kernel would not bump the version counters
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():  # round every master into its bf16 parameter (one multi-tensor copy)
            torch._foreach_copy_(self.params, self.master)
        return norm

    def digest(self) -> str:
        """`param_digest` of the fp32 weights (the bf16 model is their rounding). Computed once per state of the
        weights: a step asks for it for its metrics line, its checkpoint and its publication, and any in-place
        change of a master (the optimizer, a load) bumps its version counter, which the cached digest is keyed on."""
        key = tuple(m._version for m in self.master)
        if self._digest is None or self._digest[0] != key:
            self._digest = (key, param_digest(self.master))
        return self._digest[1]

    def state_bytes(self) -> dict[str, int]:
        """Bytes this process holds of the trained state: parameters (the bf16 model and the fp32 masters),
        gradients (fp32, as of the last step) and AdamW state."""
        return {"params": _nbytes(self.params) + _nbytes(self.master), "grads": self.grad_bytes,
                "optim": _optim_bytes(self.opt)}

    # ---- weights of earlier versions (the mismatch of stale groups) -----------------------------------
    def snapshot(self, reuse: list[torch.Tensor] | None = None, *, background: bool = False) -> list[torch.Tensor]:
        """A copy of the bf16 weights (into ``reuse``, an evicted snapshot, when given): on the host (pinned) for a
        GPU model, whose memory the optimizer needs; on the CPU as they are.

        ``background`` (a GPU model): the device -> host copies run on a side stream while the caller goes on
        computing with the same weights (a step's forwards and backwards: the copy engine and the SMs work at the
        same time); `step` waits for them before it writes the weights. The host must not read the returned
        tensors before that (a swap-in for a later forward is ordered after it on the device)."""
        if not self.params or self.params[0].device.type != "cuda":
            return [reuse[i].copy_(p.detach()) if reuse is not None else p.detach().clone()
                    for i, p in enumerate(self.params)]
        dev = self.params[0].device
        if background:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(dev)
            self._copy_stream.wait_stream(torch.cuda.current_stream(dev))  # the weights as of now
        with torch.cuda.stream(self._copy_stream) if background else contextlib.nullcontext():
            out = [(reuse[i] if reuse is not None else torch.empty(p.shape, dtype=p.dtype, pin_memory=True))
                   .copy_(p.detach(), non_blocking=background) for i, p in enumerate(self.params)]
            if background:
                self._snapshot_done = torch.cuda.Event()
                self._snapshot_done.record(self._copy_stream)
        return out

    def snapshot_buffers(self) -> list[torch.Tensor]:
        """Empty tensors to take a `snapshot` into (``reuse``): the bf16 parameters' shapes, pinned host memory
        for a GPU model (slow to get: seconds for the H200 model's 8.8 GB, so the trainer gets them once, at its
        start), plain host memory otherwise."""
        pin = bool(self.params) and self.params[0].device.type == "cuda"
        return [torch.empty(p.shape, dtype=p.dtype, pin_memory=pin) for p in self.params]

    def _wait_snapshot(self) -> None:
        """Order everything after this on the current stream behind a background snapshot's copies."""
        if self._snapshot_done is not None:
            torch.cuda.current_stream(self.params[0].device).wait_event(self._snapshot_done)
            self._snapshot_done = None

    @contextlib.contextmanager
    def swapped(self, snapshot: list[torch.Tensor]) -> Iterator[None]:
        """The weights of ``snapshot`` in the model for the block (no copy on the CPU, one host -> device copy for
        a GPU model, freed after the block)."""
        current = [p.data for p in self.params]
        try:
            for p, t in zip(self.params, snapshot):
                p.data = t.to(p.device, non_blocking=True)
            yield
        finally:
            for p, t in zip(self.params, current):
                p.data = t

    # ---- checkpoints and publication ------------------------------------------------------------------
    def full_bf16_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict as the rollout loads it (bf16 parameters, buffers), on the host."""
        return {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint form (see the module docstring): fp32 weights and AdamW state by name (live tensors)."""
        return _state(self.names, self.master, self.opt)

    def template(self, with_optim: bool) -> dict[str, Any]:
        """Tensors of `state_dict`'s shapes to load a checkpoint into (fresh memory: nothing live is touched until
        `load_state_dict`)."""
        return _template(self.names, self.master, with_optim)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a filled `template`: the masters, their rounding into the bf16 parameters, the AdamW state."""
        with torch.no_grad():
            for name, m, p in zip(self.names, self.master, self.params):
                m.copy_(sd["model"][name])
                p.copy_(m)
        _load_optim(self.opt, self.names, self.master, sd.get("optim") or {})

    def load_unsharded(self, master: list[torch.Tensor], opt_sd: dict) -> None:
        """Load a format-2 checkpoint's parts: the fp32 masters (in parameter order) and ``torch.optim``'s own
        index-keyed AdamW state."""
        with torch.no_grad():
            for m, p, v in zip(self.master, self.params, master):
                m.copy_(v)
                p.copy_(m)
        self.opt.load_state_dict(opt_sd)


class ShardedParams:
    """FSDP2-sharded fp32 weights with bf16 compute and AdamW on the shards (see the module docstring)."""

    sharded = True

    def __init__(self, model: torch.nn.Module, cfg, device: torch.device):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        self.rank, self.world = rank_world()
        self.mesh = init_device_mesh(device.type, (self.world,))
        model.float()  # the fp32 weights; compute stays bf16 (the policy below)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        units = [*model.model.layers, model]  # one unit per decoder block, and the root (embeddings, norm, head)
        for unit in units:
            fully_shard(unit, mesh=self.mesh, mp_policy=mp)
        for unit in units:
            # sum, not average: each rank's loss is already weighted by its share of the step's response tokens;
            # sum-only collectives, because gloo has no pre-scaled reduction
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
        self.model = model
        self.units = units
        self.names = [n for n, p in model.named_parameters() if p.requires_grad]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = _adamw(self.params, cfg, device)
        self.grad_bytes = 0

    def accumulate(self) -> None:
        """Nothing: FSDP2 reduce-scatters each backward's gradients and adds them to the shards' fp32 gradients."""

    def step(self, grad_clip: float) -> float:
        """Clip the global gradient norm (over every rank's shards), AdamW on the shards; the norm before clipping.
        A parameter without a gradient (a rank that had no data: see `GRPOTrainer`) gets zeros."""
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        norm = torch.nn.utils.clip_grad_norm_(self.params, grad_clip)
        norm = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        self.grad_bytes = _nbytes(p.grad for p in self.params)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return norm

    def digest(self) -> str:
        """`param_digest` of the fp32 weights, shard by shard (the same digest as unsharded; a collective)."""
        return param_digest(self.params)

    def state_bytes(self) -> dict[str, int]:
        """Bytes this rank holds of the trained state: its fp32 parameter shards, gradient shards (as of the last
        step) and AdamW state (the bf16 all-gathered weights exist only during a unit's forward and backward)."""
        return {"params": _nbytes(p.to_local() for p in self.params), "grads": self.grad_bytes,
                "optim": _optim_bytes(self.opt)}

    def snapshot(self, reuse: list[torch.Tensor] | None = None, *, background: bool = False) -> list[torch.Tensor]:
        """The bf16 rounding of this rank's fp32 weight shards (pinned host memory on a GPU; ``background`` is
        accepted and the copy made at once, before the call returns): what the forward
        computes with, since the mixed-precision policy casts the all-gathered shards to bf16 the same way (round to
        nearest even), so a forward with the snapshot swapped in gives the version's bits; half the bytes of the
        fp32 shards to copy and keep."""
        out = []
        for i, p in enumerate(self.params):
            local = p.detach().to_local().to(torch.bfloat16)
            if reuse is not None:
                out.append(reuse[i].copy_(local))
            elif local.device.type == "cuda":
                out.append(torch.empty(local.shape, dtype=local.dtype, pin_memory=True).copy_(local))
            else:
                out.append(local)  # (a new tensor already)
        return out

    def snapshot_buffers(self) -> list[torch.Tensor]:
        """Empty tensors to take a `snapshot` into (``reuse``): the bf16 shapes of this rank's shards, pinned host
        memory on a GPU."""
        return [torch.empty(p.to_local().shape, dtype=torch.bfloat16, pin_memory=p.device.type == "cuda")
                for p in self.params]

    @contextlib.contextmanager
    def swapped(self, snapshot: list[torch.Tensor]) -> Iterator[None]:
        """The weights of ``snapshot`` in the shards for the block (copied in and back: the forward all-gathers
        from the shards' storage). Every rank must enter it (the forwards inside are collectives).

        Every unit is resharded on the way in and out: the root unit keeps its all-gathered weights after a forward
        (FSDP2's default, as its backward needs them at once), and a forward after the block would otherwise run
        with the snapshot's embeddings and head (measured: a 30% different loss one step later at 2 ranks)."""
        self._reshard()
        saved = []
        with torch.no_grad():
            for p, t in zip(self.params, snapshot):
                local = p.to_local()
                saved.append(local.clone())
                local.copy_(t, non_blocking=True)
        try:
            yield
        finally:
            self._reshard()
            with torch.no_grad():
                for p, t in zip(self.params, saved):
                    p.to_local().copy_(t)

    def _reshard(self) -> None:
        for unit in self.units:
            unit.reshard()

    def full_bf16_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model's state dict in bf16 (parameters rounded as the forward rounds them, buffers as they
        are), gathered onto rank 0's host; other ranks get an empty dict. A collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return {}
        trained = set(self.names)
        return {k: v.to(torch.bfloat16) if k in trained else v for k, v in full.items()}

    def state_dict(self) -> dict[str, Any]:
        """The checkpoint form (see the module docstring): this rank's DTensor shards by name (live tensors)."""
        return _state(self.names, self.params, self.opt)

    def template(self, with_optim: bool) -> dict[str, Any]:
        """DTensors sharded as the weights, to load a checkpoint into (fresh memory)."""
        return _template(self.names, self.params, with_optim)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a filled `template` into the shards and the AdamW state."""
        with torch.no_grad():
            for name, p in zip(self.names, self.params):
                p.to_local().copy_(sd["model"][name].to_local())
        _load_optim(self.opt, self.names, self.params, sd.get("optim") or {})

    def load_unsharded(self, master: list[torch.Tensor], opt_sd: dict) -> None:
        raise CheckpointCorruptError("a format-2 checkpoint (one process, unsharded) cannot be loaded into an FSDP2 "
                                     "trainer; resume it with one process without torchrun, or start anew")


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(tensors) -> int:
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors if t is not None)


def _optim_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(_nbytes(v for v in s.values() if isinstance(v, torch.Tensor)) for s in opt.state.values())


#: AdamW's state per parameter, as the checkpoint form names it
OPTIM_KEYS = ("step", "exp_avg", "exp_avg_sq")


def _state(names: list[str], weights: list[torch.Tensor], opt: torch.optim.Optimizer) -> dict[str, Any]:
    optim = {n: {k: opt.state[w][k] for k in OPTIM_KEYS} for n, w in zip(names, weights) if w in opt.state}
    return {"model": dict(zip(names, weights)), "optim": optim}


def _template(names: list[str], weights: list[torch.Tensor], with_optim: bool) -> dict[str, Any]:
    model = {n: torch.empty_like(w, requires_grad=False) for n, w in zip(names, weights)}
    optim = {n: {"step": torch.zeros((), dtype=torch.float32), "exp_avg": torch.empty_like(w, requires_grad=False),
                 "exp_avg_sq": torch.empty_like(w, requires_grad=False)} for n, w in zip(names, weights)}
    return {"model": model, "optim": optim if with_optim else {}}


def _load_optim(opt: torch.optim.Optimizer, names: list[str], weights: list[torch.Tensor], optim: dict) -> None:
    """AdamW's state from the checkpoint form (hyperparameters stay the optimizer's own); empty: a fresh optimizer."""
    index = {id(w): i for i, w in enumerate(p for g in opt.param_groups for p in g["params"])}
    state = {index[id(w)]: dict(optim[n]) for n, w in zip(names, weights) if n in optim}
    opt.load_state_dict({"state": state, "param_groups": opt.state_dict()["param_groups"]})


def make_params(model: torch.nn.Module, cfg, device: torch.device) -> PlainParams | ShardedParams:
    """`ShardedParams` under torch.distributed (a process group of any size), else `PlainParams`."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return ShardedParams(model, cfg, device)
    return PlainParams(model, cfg, device)
