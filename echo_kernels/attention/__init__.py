"""Attention kernels: paged (any mix of decode and prefill, split-KV) and contiguous varlen."""

from echo_kernels.attention.paged import paged_attention, paged_attention_launch
from echo_kernels.attention.varlen import flash_attn_varlen, flash_attn_varlen_launch

__all__ = [
    "flash_attn_varlen",
    "flash_attn_varlen_launch",
    "paged_attention",
    "paged_attention_launch",
]
