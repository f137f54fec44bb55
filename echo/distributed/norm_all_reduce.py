"""The peer-writable inboxes behind echo_kernels.all_reduce_norm, for one tensor-parallel group.

On by default under CUDA with NCCL (ECHO_FUSED_NORM_ALL_REDUCE=0 turns it off): the
row-parallel layers (o_proj, down_proj) leave their partial sums unreduced and the RMSNorm after
each one all-reduces, adds the residual and normalises in one launch. Rows beyond `max_rows`
(long prefill chunks) take NCCL and the ordinary fused_add_rms_norm.
"""

import torch

from echo.distributed.symm_mem_all_reduce import enable_symm_mem


class NormAllReduce:
    """This rank's inbox (two slots of max_rows x hidden per sender), written by every peer."""

    def __init__(self, group, device: torch.device, hidden_size: int, dtype: torch.dtype,
                 max_rows: int = 1024):
        from echo_kernels.all_reduce_norm import inbox_dtype, inbox_elements, not_arrived

        symm_mem = enable_symm_mem(group.group_name)
        self.hidden_size, self.dtype, self.max_rows = hidden_size, dtype, max_rows
        # at most one program per SM: all are resident at once, as their peers wait for them
        programs = torch.cuda.get_device_properties(device).multi_processor_count
        world = group.size()
        self.inbox = symm_mem.empty(inbox_elements(world, max_rows, hidden_size),
                                    dtype=inbox_dtype(dtype), device=device)
        self.inbox.fill_(not_arrived(dtype))
        torch.cuda.synchronize(device)  # empty on every rank before any peer can write
        inboxes = symm_mem.rendezvous(self.inbox, group.group_name)  # collective
        self.rank = inboxes.rank
        self.inbox_offsets = _offsets(inboxes.buffer_ptrs, self.rank, self.inbox)
        self.calls = torch.zeros(programs, dtype=torch.int32, device=device)

    def fits(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.hidden_size
        return (x.dtype == self.dtype and x.shape[-1] == self.hidden_size
                and rows <= self.max_rows and x.is_contiguous())

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from echo_kernels.all_reduce_norm import all_reduce_add_rms_norm

        return all_reduce_add_rms_norm(x, residual, weight, eps, self.rank, self.inbox,
                                       self.inbox_offsets, self.calls)


def _offsets(ptrs: list[int], rank: int, local: torch.Tensor) -> torch.Tensor:
    """Each rank's allocation relative to this rank's, in elements (peers share one address
    space, so a kernel reaches a peer's copy of `local` as local pointer + offset)."""
    size = local.element_size()
    assert all((p - ptrs[rank]) % size == 0 for p in ptrs)
    return torch.tensor([(p - ptrs[rank]) // size for p in ptrs], dtype=torch.int64,
                        device=local.device)
