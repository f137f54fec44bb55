"""echo's Triton kernels. Each has a float32 PyTorch twin in echo_kernels.reference.

Kernels run on the device of their tensors; CPU tensors need Triton's interpreter
(TRITON_INTERPRET=1, read when the kernels are defined, i.e. at import).
"""

import os

import torch

# NOTE: a CPU-only torch build can run these kernels only through the interpreter, so turn it on
# before the @triton.jit decorators below read it. (No torch.cuda call here: probing the driver
# at import would break processes that fork later.)
if torch.version.cuda is None and torch.version.hip is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from echo_kernels.activation import silu_and_mul  # noqa: E402
from echo_kernels.attention import flash_attn_varlen, paged_attention  # noqa: E402
from echo_kernels.awq import awq_gemm, awq_gemv, awq_linear  # noqa: E402
from echo_kernels.cache import store_kv_cache  # noqa: E402
from echo_kernels.fused_moe import (  # noqa: E402
    fused_moe,
    fused_moe_from_logits,
    moe_align_block_size,
    moe_routing,
)
from echo_kernels.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from echo_kernels.rejection import rejection_sample  # noqa: E402
from echo_kernels.rope import rotary_embedding  # noqa: E402
from echo_kernels.sampling import gumbel_sample  # noqa: E402
from echo_kernels.token_bitmask import apply_token_bitmask  # noqa: E402

__all__ = [
    "apply_token_bitmask",
    "awq_gemm",
    "awq_gemv",
    "awq_linear",
    "flash_attn_varlen",
    "fused_add_rms_norm",
    "fused_moe",
    "fused_moe_from_logits",
    "gumbel_sample",
    "moe_align_block_size",
    "moe_routing",
    "paged_attention",
    "rejection_sample",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "store_kv_cache",
]
