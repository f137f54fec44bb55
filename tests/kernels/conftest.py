"""Kernel tests run on the GPU when there is one, else on CPU tensors through Triton's interpreter.

Triton reads TRITON_INTERPRET when each kernel is decorated (at import of echo_kernels), so it is
set here, before any test module imports the package.
"""

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "echo_kernels" in sys.modules and os.environ["TRITON_INTERPRET"] == "1":
        # imported earlier without the interpreter (a CUDA build of torch on a GPU-less box)
        for name in [m for m in sys.modules if m.startswith("echo_kernels")]:
            del sys.modules[name]

# the repo root (echo_kernels) and this folder (kernel_utils) importable without an install
for _path in (str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parent)):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from kernel_utils import HAS_CUDA, PagedBatch, cdiv  # noqa: E402


def pytest_configure(config):
    # the interpreter turns 1-element loop bounds into ints the way NumPy 1.25+ deprecates
    config.addinivalue_line(
        "filterwarnings", "ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def paged_batch(device):
    def make(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype,
             kv_dtype=None, num_blocks=None, seed=0):
        if num_blocks is None:
            num_blocks = sum(cdiv(c, block_size) for c in ctx_lens) * 2 + 8
        return PagedBatch(q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size,
                          num_blocks, dtype, device, kv_dtype, seed)

    return make
