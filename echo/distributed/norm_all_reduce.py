"""The peer-readable buffers behind echo_kernels.all_reduce_norm, for one tensor-parallel group.

On by default under CUDA with NCCL (ECHO_FUSED_NORM_ALL_REDUCE=0 turns it off): the
row-parallel layers (o_proj, down_proj) leave their partial sums unreduced and the RMSNorm after
each one all-reduces, adds the residual and normalises in one launch. Rows beyond `max_rows`
(long prefill chunks) take NCCL and the ordinary fused_add_rms_norm.
"""

import torch

from echo.distributed.symm_mem_all_reduce import enable_symm_mem


class NormAllReduce:
    """This rank's buffer (two halves of max_rows x hidden) and signal pad, mapped by every
    peer."""

    def __init__(self, group, device: torch.device, hidden_size: int, dtype: torch.dtype,
                 max_rows: int = 1024):
        symm_mem = enable_symm_mem(group.group_name)
        self.hidden_size, self.dtype, self.max_rows = hidden_size, dtype, max_rows
        # at most one program per SM: all are resident at once, as their peers wait for them
        programs = torch.cuda.get_device_properties(device).multi_processor_count
        self.buffer = symm_mem.empty(2 * max_rows * hidden_size, dtype=dtype, device=device)
        buffers = symm_mem.rendezvous(self.buffer, group.group_name)
        self.rank, world = buffers.rank, buffers.world_size
        self.signals = symm_mem.empty(programs * world, dtype=torch.int32, device=device)
        self.signals.zero_()
        torch.cuda.synchronize(device)  # zeroed on every rank before any peer can signal
        pads = symm_mem.rendezvous(self.signals, group.group_name)  # collective
        self.buffer_offsets = _offsets(buffers.buffer_ptrs, self.rank, self.buffer)
        self.signal_offsets = _offsets(pads.buffer_ptrs, self.rank, self.signals)
        self.calls = torch.zeros(programs, dtype=torch.int32, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.hidden_size
        return (x.dtype == self.dtype and x.shape[-1] == self.hidden_size
                and rows <= self.max_rows and x.is_contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from echo_kernels.all_reduce_norm import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(x, residual, weight, eps, self.rank, self.buffer,
                                       self.buffer_offsets, self.signals, self.signal_offsets,
                                       self.calls)


def _offsets(ptrs: list[int], rank: int, local: torch.Tensor) -> torch.Tensor:
    """Each rank's allocation relative to this rank's, in elements (peers share one address
    space, so a kernel reaches a peer's copy of `local` as local pointer + offset)."""
    size = local.element_size()
    assert all((p - ptrs[rank]) % size == 0 for p in ptrs)
    return torch.tensor([(p - ptrs[rank]) // size for p in ptrs], dtype=torch.int64,
                        device=local.device)
