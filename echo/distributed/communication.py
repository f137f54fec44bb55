"""Collectives over a TPGroup; identity when the group has one rank."""

import torch
import torch.distributed as dist

from echo.distributed.parallel_state import TPGroup


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The sum over ranks; may return a new tensor rather than reduce x in place."""
    if tp.size == 1:
        return x
    if tp.small_all_reduce is not None and tp.small_all_reduce.fits(x):
        return tp.small_all_reduce(x)
    dist.all_reduce(x, group=tp.group)
    return x


def all_gather(x: torch.Tensor, tp: TPGroup, dim: int = -1) -> torch.Tensor:
    """Concatenate each rank's shard along `dim`, in rank order."""
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=dim)
