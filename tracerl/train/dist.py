"""torch.distributed as the trainer uses it: rank and world size (1 without a process group), a barrier, and a
flag that is true on every rank when it is true on any."""

from __future__ import annotations

import torch

__all__ = ["rank_world", "barrier", "any_rank", "gather_objects", "max_over_ranks"]


def rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if rank_world()[1] > 1:
        import torch.distributed as dist

        dist.barrier()


def any_rank(flag: bool) -> bool:
    """True on every rank when ``flag`` is true on any (a stop on one rank stops all, at the same step)."""
    rank, world = rank_world()
    if world == 1:
        return flag
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def gather_objects(obj):
    """Every rank's ``obj`` (picklable), in rank order, on every rank; ``[obj]`` without a process group."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world
    dist.all_gather_object(out, obj)
    return out


def max_over_ranks(value: int) -> int:
    """The largest ``value`` of any rank, on every rank."""
    return max(gather_objects(int(value)))
