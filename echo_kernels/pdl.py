"""Programmatic dependent launch (Hopper and newer), on unless ECHO_PDL=0.

Launched with PDL, a kernel may start while the kernel before it in the stream is finishing:
its programs get resident early and run up to `wait_for_inputs`, which blocks until that kernel
has completed and its writes are visible. Every echo kernel calls it before touching memory an
earlier kernel may write (only the GEMV reads its weight tile first), then lets the next kernel
start launching. At batch 1 a decode step is ~350 launches of a few microseconds each, and the
launch gap between dependent kernels is what PDL hides. Kernels that are not PDL-aware (cuBLAS,
torch) keep full stream order on both sides.
"""

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@functools.lru_cache(maxsize=8)
def use_pdl(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or newer, unless ECHO_PDL=0."""
    return (os.environ.get("ECHO_PDL", "1") == "1" and device.type == "cuda"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def pdl_options(device: torch.device) -> dict:
    """The launch keywords of an echo kernel: its USE_PDL flag and Triton's launch_pdl, set
    together (a kernel launched with PDL must wait in wait_for_inputs)."""
    on = use_pdl(device)
    return {"USE_PDL": on, "launch_pdl": on}


@triton.jit
def wait_for_inputs(USE_PDL: tl.constexpr):
    """Under PDL: wait for the previous kernel's writes, then allow the next kernel to launch."""
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
