"""Reference attention in plain PyTorch: runs anywhere (CI uses it on CPU), loops per sequence."""

import torch

from echo.attention.backend import AttentionBackend, AttentionMetadata, KVCache


def store_kv(k: torch.Tensor, v: torch.Tensor, cache: KVCache, slot_mapping: torch.Tensor):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    cache.k.view(-1, *cache.k.shape[2:])[slots] = k[keep].to(cache.k.dtype)
    cache.v.view(-1, *cache.v.shape[2:])[slots] = v[keep].to(cache.v.dtype)


def gather_kv(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence: [length, kv_heads, d]."""
    return cache[block_ids].flatten(0, 1)[:length]


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        store_kv(k, v, cache, meta.slot_mapping)
        out = torch.empty_like(q)
        group = self.num_heads // self.num_kv_heads
        block_size = cache.k.shape[1]
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            blocks = meta.block_table[i, : -(-kv_len // block_size)]
            keys = gather_kv(cache.k, blocks, kv_len).repeat_interleave(group, dim=1)
            values = gather_kv(cache.v, blocks, kv_len).repeat_interleave(group, dim=1)
            queries = q[start:start + q_len]
            # [heads, q_len, kv_len] in fp32
            scores = torch.einsum("qhd,khd->hqk", queries.float(), keys.float()) * self.scale
            # query i sits at absolute position kv_len - q_len + i and sees keys up to it
            q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            scores.masked_fill_(k_pos > q_pos, float("-inf"))
            probs = scores.softmax(dim=-1)
            out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, values.float()).to(
                q.dtype)
            start += q_len
        return out
