"""Reference attention in plain PyTorch: runs anywhere (CI uses it on CPU), loops per sequence.

K/V are stored and read back through the kernel package's float32 twins, so an int8 cache is
quantized with the Triton kernel's rounding and dequantized one sequence's blocks at a time.
"""

import torch

from echo.attention.backend import AttentionBackend, AttentionMetadata, KVCache, RopeInputs
from echo.layers.rotary import rope_reference
from echo_kernels.reference import gather_kv, store_kv_cache_ref


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, rope: RopeInputs | None = None) -> torch.Tensor:
        if rope is not None:
            q, k = rope_reference(rope, q, k)
        store_kv_cache_ref(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale,
                           cache.v_scale)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            # float32 [kv_len, heads, d]: the sequence's own blocks only, dequantized if int8
            keys = gather_kv(cache.k, cache.k_scale, meta.block_table[i], kv_len)
            values = gather_kv(cache.v, cache.v_scale, meta.block_table[i], kv_len)
            keys = keys.repeat_interleave(group, dim=1)
            values = values.repeat_interleave(group, dim=1)
            queries = q[start:start + q_len]
            # [heads, q_len, kv_len] in fp32
            scores = torch.einsum("qhd,khd->hqk", queries.float(), keys) * self.scale
            # query i sits at absolute position kv_len - q_len + i and sees keys up to it
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            scores.masked_fill_(k_pos > q_pos, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, values).to(q.dtype)
            start += q_len
        return out
