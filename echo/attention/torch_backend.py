"""Reference attention in plain PyTorch: runs anywhere (CI uses it on CPU), loops per sequence.

K/V are stored and read back through the kernel package's float32 twins, so an int8 cache is
quantized with the Triton kernel's rounding and dequantized one sequence's blocks at a time.
"""

import torch

from echo.attention.backend import AttentionBackend, AttentionMetadata, KVCache, RopeInputs
from echo_kernels.reference import gather_kv, rms_norm_ref, store_kv_cache_ref


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


def rotary_reference(positions: torch.Tensor, x: torch.Tensor, cos_sin_cache: torch.Tensor):
    """x: [tokens, heads, head_dim] -> rotated copy, in x's dtype (math as Hugging Face's)."""
    cos, sin = cos_sin_cache[positions].to(x.dtype).unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rope_reference(rope: RopeInputs, q: torch.Tensor, k: torch.Tensor):
    """Rotated copies of q [tokens, heads, d] and k [tokens, kv_heads, d], as Hugging Face's
    modules compute them."""
    if rope.q_norm_weight is not None:
        q = rms_norm_ref(q, rope.q_norm_weight, rope.eps)
        k = rms_norm_ref(k, rope.k_norm_weight, rope.eps)
    return (rotary_reference(rope.positions, q, rope.cos_sin_cache),
            rotary_reference(rope.positions, k, rope.cos_sin_cache))
