"""Attention with echo_kernels on CUDA: one paged-attention launch for the whole mixed batch, after
one launch that rotates q/k and stores the step's K/V (pure prefills with no cached prefix read
K/V contiguously instead). Decode batches rotate and store inside the attention launch."""

import torch

from echo.attention.backend import AttentionBackend, AttentionMetadata, KVCache, RopeInputs


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, rope: RopeInputs | None = None) -> torch.Tensor:
        from echo_kernels import (
            flash_attn_varlen,
            paged_attention,
            rotary_embedding,
            store_kv_cache,
        )
        from echo_kernels.attention.paged import NewKV

        if rope is None:
            store_kv_cache(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale,
                           cache.v_scale)
        elif meta.no_cached_prefix:
            rotary_embedding(rope.positions, q, k, rope.cos_sin_cache, True, rope.q_norm_weight,
                             rope.k_norm_weight, rope.eps, v=v, k_cache=cache.k, v_cache=cache.v,
                             slot_mapping=meta.slot_mapping, k_scale=cache.k_scale,
                             v_scale=cache.v_scale)
        if meta.no_cached_prefix:
            return flash_attn_varlen(q, k, v, meta.cu_seqlens_q, meta.cu_seqlens_q,
                                     meta.max_seqlen_q, meta.max_seqlen_q, self.scale,
                                     causal=True)
        new_kv = None if rope is None else NewKV(
            k, v, meta.slot_mapping, rope.positions, rope.cos_sin_cache, rope.q_norm_weight,
            rope.k_norm_weight, rope.eps)
        return paged_attention(q, cache.k, cache.v, meta.block_table, meta.cu_seqlens_q,
                               meta.seq_lens, meta.max_seqlen_q, meta.max_seqlen_k, self.scale,
                               cache.k_scale, cache.v_scale, seq_order=meta.seq_order,
                               new_kv=new_kv)
