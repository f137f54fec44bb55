"""A one-shot all-reduce for small messages over peer-mapped (symmetric) memory, multicast off.

NCCL's all-reduce of one decode step's hidden state (8 KiB at batch 1) is latency bound inside
a CUDA graph on two NVLinked H200s, and a TP=2 decode step of Qwen3-8B runs 72 of them.
In a one-shot all-reduce each rank copies its input into a buffer every peer can read, waits at
a barrier on signal pads, and sums all peers' buffers itself: one kernel, no ring. torch's
symmetric-memory ops provide it (torch.ops.symm_mem.one_shot_all_reduce); larger messages stay
on NCCL, whose bandwidth-optimal algorithms win there.

Off by default (ECHO_SYMM_MEM_ALL_REDUCE=1 turns it on): on the two-GPU machine it was slower
per call than NCCL + norm, and the fused all-reduce + norm became the TP default
(docs/benchmarks.md, What was tried and dropped).
"""

import torch


def gpus_reach_each_other(world: int) -> bool:
    """Whether GPUs 0..world-1 can map each other's memory (NVLink or PCIe P2P), as the
    peer-mapped all-reduces need; without it (some PCIe machines, VMs) NCCL routes through the
    host. Every rank sees the same topology, so all ranks decide alike."""
    return all(torch.cuda.can_device_access_peer(a, b)
               for a in range(world) for b in range(world) if a != b)


def enable_symm_mem(group_name: str):
    """torch's symmetric-memory module, set up for the group (older torch releases need that;
    newer ones have no such step)."""
    import torch.distributed._symmetric_memory as symm_mem

    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is not None:
        enable(group_name)
    return symm_mem


class SymmMemAllReduce:
    """Owns one symmetric buffer of `max_bytes` per rank; `fits(x)` says whether x goes here."""

    def __init__(self, group, device: torch.device, max_bytes: int = 1 << 20,
                 dtype: torch.dtype = torch.bfloat16):
        self.group_name = group.group_name
        self.dtype = dtype
        self.max_numel = max_bytes // dtype.itemsize
        symm_mem = enable_symm_mem(self.group_name)
        self.buffer = symm_mem.empty(self.max_numel, dtype=dtype, device=device)
        # collective: every rank maps every peer's buffer and signal pad
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.max_numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        out = torch.ops.symm_mem.one_shot_all_reduce(staged, "sum", self.group_name)
        return out.view_as(x)
