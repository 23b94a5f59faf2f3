"""Bitwise reproducibility of training: deterministic kernels, a fingerprint of the weights' exact bits, and the
RNG states a checkpoint keeps."""

from __future__ import annotations

import ast
import base64
import functools
import hashlib
import json
import os
import random
from collections.abc import Iterable, Mapping

import numpy as np
import torch

__all__ = ["param_digest", "rng_state", "set_deterministic", "set_rng_state"]


def set_deterministic(device: torch.device) -> None:
    """Deterministic kernels for bitwise replay: torch's deterministic algorithms and, on CUDA, the math SDPA
    (the flash / memory-efficient / cuDNN attention backwards accumulate in a scheduling-dependent order) and a
    fixed cuBLAS workspace (set ``CUBLAS_WORKSPACE_CONFIG`` before CUDA starts; the command line does)."""
    torch.use_deterministic_algorithms(True, warn_only=True)
    # With deterministic algorithms torch also fills every new tensor of torch.empty with NaN (a fill kernel and a
    # pass over the memory per allocation: most of the 243,000 fills in one step of the H200 model, and
    # a host-side fill of each 8.8 GB kept-weights snapshot). That fill makes a read of unwritten memory
    # reproducible; nothing here reads memory it has not written (replay is bitwise without it: the tests), so
    # it is only cost.
    torch.utils.deterministic.fill_uninitialized_memory = False
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
    Any single changed bit changes its tensor's sum. Not cryptographic: it tells replays apart, not attackers.

    Sharded parameters (FSDP2's DTensors, sharded along dim 0) are summed shard by shard at their global positions
    and the sums added over the ranks (an integer all-reduce), so a model has the same digest whatever its world
    size, and no rank gathers a whole tensor. Every rank must call it (it is a collective then)."""
    tensors = list(tensors)
    sums, sharded = [], []
    for t in tensors:
        local, first = _local_shard(t.detach())
        sums.append(_bit_sum(local.reshape(-1), first))
        sharded.append(local.shape != t.shape or _is_dtensor(t))
    total = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64)
    if any(sharded):
        import torch.distributed as dist

        reduced = total.clone()
        dist.all_reduce(reduced)  # the shards' sums: exact integer addition, in any order
        mask = torch.tensor(sharded, device=total.device)
        total = torch.where(mask, reduced, total)
    host = total.cpu().numpy().tobytes()
    shapes = json.dumps([list(t.shape) for t in tensors]).encode()
    return hashlib.sha256(host + shapes).hexdigest()[:32]


#: position weights w(0 .. n-1) per device, kept up to `_WEIGHT_CACHE_MAX` positions (int64: 8 bytes each, 1 GiB)
_WEIGHTS: dict[torch.device, torch.Tensor] = {}
_WEIGHT_CACHE_MAX = 1 << 27


def position_weights(first: int, n: int, device: torch.device) -> torch.Tensor:
    """w(p) = (p * 2654435761 mod (2^61 - 1)) * 2 + 1 for p in [first, first + n) (int64 [n], odd). Positions
    below `_WEIGHT_CACHE_MAX` come from a per-device table grown to the largest tensor digested (a slice: no
    launches), the others are computed."""
    end = first + n
    if end > _WEIGHT_CACHE_MAX:
        pos = torch.arange(first, end, device=device, dtype=torch.int64)
        return pos * 2654435761 % _DIGEST_MOD * 2 + 1
    table = _WEIGHTS.get(device)
    if table is None or table.numel() < end:
        size = min(_WEIGHT_CACHE_MAX, max(end, 2 * (0 if table is None else table.numel())))
        pos = torch.arange(size, device=device, dtype=torch.int64)
        table = pos * 2654435761 % _DIGEST_MOD * 2 + 1
        if table.is_cuda:  # once per growth: later digests may run on another stream or thread
            torch.cuda.current_stream(table.device).synchronize()
        _WEIGHTS[device] = table
    return table[first:end]


def _bit_sum(flat: torch.Tensor, first: int) -> torch.Tensor:
    """sum over i of bits(flat[i]) * w(first + i) in wrapping int64, w = `position_weights`. On CUDA one Triton
    pass over the bits (`digest_triton.bit_sum`, the same sum; ~11x less memory traffic) where Triton is
    installed and the positions fit its arithmetic; else the torch form below."""
    if flat.is_cuda and first + flat.numel() <= _triton_max_position():
        from tracerl.train.digest_triton import bit_sum

        return bit_sum(flat, first)
    return _bit_sum_torch(flat, first)


@functools.cache
def _triton_max_position() -> int:
    """`digest_triton.MAX_POSITION`, or -1 where Triton cannot be imported."""
    try:
        from tracerl.train.digest_triton import MAX_POSITION
    except ImportError:
        return -1
    return MAX_POSITION


def _bit_sum_torch(flat: torch.Tensor, first: int) -> torch.Tensor:
    """`_bit_sum` in torch: the bits widened to int64, times a slice of the weight table, summed."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    x = flat.contiguous().view(bits).to(torch.int64)
    return (x * position_weights(first, x.numel(), x.device)).sum()


def _is_dtensor(t: torch.Tensor) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local_shard(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's part of ``t``, the flat global position of its first element): a DTensor's local shard (it
    must be sharded along dim 0 over one mesh dimension, as FSDP2 shards), else ``t`` itself at 0."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t, 0
    assert tuple(t.placements) == (Shard(0),), f"digest of a DTensor placed {t.placements}"  # what FSDP2 makes
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    inner = 1
    for n in t.shape[1:]:
        inner *= n
    return t.to_local(), int(offset[0]) * inner if t.numel() else 0


def rng_state() -> dict:
    st = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
          "numpy": json.loads(json.dumps(np.random.get_state()[1].tolist())), "numpy_pos": int(np.random.get_state()[2]),
          "python": base64.b64encode(repr(random.getstate()).encode()).decode()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        st["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return st


def set_rng_state(st: Mapping) -> None:
    torch.set_rng_state(torch.from_numpy(np.frombuffer(base64.b64decode(st["torch"]), dtype=np.uint8).copy()))
    np.random.set_state(("MT19937", np.asarray(st["numpy"], dtype=np.uint32), int(st["numpy_pos"]), 0, 0.0))
    random.setstate(ast.literal_eval(base64.b64decode(st["python"]).decode()))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())
                                      for s in st["cuda"]])
