"""Bringing up one rank of a tensor-parallel group: its device, torch.distributed (NCCL on CUDA,
gloo on CPU) and the peer-mapped all-reduces where the GPUs can map each other's memory.

Takes plain values rather than the engine config, so this layer stays below the config.
"""

import os
import sys

import torch

from echo import envs
from echo.distributed.parallel_state import TPGroup
from echo.distributed.symm_mem_all_reduce import gpus_reach_each_other


def init_tp_group(rank: int, size: int, device_type: str, init_method: str, hidden_size: int,
                  dtype: torch.dtype) -> tuple[torch.device, TPGroup]:
    """This rank's device and group; torch.distributed is initialised only when size > 1."""
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        # the ranks share the host's cores: without this each would start one thread per core
        cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                 else os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // size))
    if size == 1:
        return device, TPGroup()
    import torch.distributed as dist

    # device_id binds NCCL to this rank's GPU and creates its communicator now, not lazily
    # inside the first collective (which might be under CUDA graph capture)
    dist.init_process_group(backend, init_method=init_method, world_size=size, rank=rank,
                            device_id=device if backend == "nccl" else None)
    group = dist.group.WORLD
    peers = backend == "nccl" and _gpus_reach_each_other(rank, size)
    small_all_reduce = None
    if peers and envs.symm_mem_all_reduce():
        from echo.distributed.symm_mem_all_reduce import SymmMemAllReduce

        small_all_reduce = SymmMemAllReduce(group, device, dtype=dtype)
    norm_all_reduce = None
    if peers and envs.fused_norm_all_reduce():
        from echo.distributed.norm_all_reduce import NormAllReduce

        norm_all_reduce = NormAllReduce(group, device, hidden_size, dtype)
    return device, TPGroup(rank, size, group, small_all_reduce,
                           reduce_in_norm=norm_all_reduce is not None,
                           norm_all_reduce=norm_all_reduce)


def destroy_tp_group(tp: TPGroup) -> None:
    if tp.group is not None:
        import torch.distributed as dist

        dist.destroy_process_group()


def _gpus_reach_each_other(rank: int, size: int) -> bool:
    if gpus_reach_each_other(size):
        return True
    if rank == 0 and (envs.fused_norm_all_reduce() or envs.symm_mem_all_reduce()):
        print(f"echo: GPUs 0-{size - 1} cannot map each other's memory (no P2P): every "
              "all-reduce takes NCCL", file=sys.stderr, flush=True)
    return False
