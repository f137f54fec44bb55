"""Attention kernels: paged (any mix of decode and prefill, split-KV) and contiguous varlen."""

from echo_kernels.attention.paged import paged_attention
from echo_kernels.attention.varlen import flash_attn_varlen

__all__ = ["flash_attn_varlen", "paged_attention"]
