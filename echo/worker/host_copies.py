"""A step's small copies between pinned host memory and the device: its input uploads and its
sampled tokens' download.

Through the copy engine (torch's non_blocking copy_), with the KV host tier moving chunks of
hundreds of megabytes, a step's few-kilobyte copy queued on that engine waits behind them, and
the step with it (docs/benchmarks.md, KV offload). So on CUDA they move by a kernel on the
step's own stream (echo_kernels/host_copy.py), in that stream's order; ECHO_STEP_COPIES=engine
puts them back on the copy engine. The host memory must stay alive until the stream has passed
the copy: torch records a pinned block's use by copy_, not by a kernel, so every caller here
holds its buffer (step buffers, upload rings, a step's token buffer until it lands).
"""

import torch

from echo import envs
from echo_kernels.host_copy import copy_by_kernel


def copies_by_kernel(device: torch.device | str) -> bool:
    """Whether copies to and from `device` go by kernel (CUDA, unless ECHO_STEP_COPIES=engine):
    read once by each holder of such buffers, not at every copy."""
    return torch.device(device).type == "cuda" and envs.step_copy_mode() == "kernel"


def copy_pinned(dst: torch.Tensor, src: torch.Tensor, by_kernel: bool) -> torch.Tensor:
    """dst := src between pinned host memory and the device (either way), queued on the current
    stream, by kernel where by_kernel (copies_by_kernel) and both are contiguous; a host dst may
    be read once an event recorded after this has completed. Returns dst."""
    if by_kernel and dst.is_contiguous() and src.is_contiguous():
        return copy_by_kernel(dst, src)
    return dst.copy_(src, non_blocking=True)
