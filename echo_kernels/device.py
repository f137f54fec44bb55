"""What a launch heuristic needs to know about the device its tensors live on."""

import functools

import torch


@functools.lru_cache(maxsize=8)
def sm_count(device: torch.device, without_gpu: int) -> int:
    """The GPU's streaming multiprocessors; on the CPU (Triton's interpreter) `without_gpu`, a
    stand-in each caller picks small enough that its tiny test inputs take the many-program
    paths."""
    if device.type != "cuda":
        return without_gpu
    return torch.cuda.get_device_properties(device).multi_processor_count
