"""Reference attention in plain PyTorch: runs anywhere (CI uses it on CPU).

K/V are stored and read back through the kernel package's float32 twins, so an int8 cache is
quantized with the Triton kernel's rounding and dequantized on reading. Sequences that run as
many query tokens in the step (every decode, every verification of k drafts) are attended as one
batch, padded to the longest context among them: a loop over sequences cost most of the CPU
test suite's time (20,000 requests decoding through a tiny model spent 117 of 127 s in it).
"""

import torch

from echo.attention.backend import AttentionBackend, AttentionMetadata, KVCache, RopeInputs
from echo_kernels.reference import rms_norm_ref, store_kv_cache_ref

# float32 elements one batched attention may hold (keys, values, scores and probabilities): a
# larger batch of sequences is split, so long contexts never hold all their scores at once
_MAX_ELEMENTS = 1 << 25


def gather_kv_batch(cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
                    kv_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """The first max_len tokens of each sequence's blocks, float32 [seqs, max_len, H, D],
    dequantized if int8; positions at or past a sequence's own length are zero. (The kernels'
    reference reads one sequence with its own gather_kv: kept apart, it checks this one.)"""
    num_blocks, block_size = cache.shape[:2]
    # past a sequence's own blocks the table may hold anything: read some block, then zero it
    blocks = block_table[:, :-(-max_len // block_size)].long().clamp(0, num_blocks - 1)
    x = cache[blocks].flatten(1, 2)[:, :max_len].float()
    if scale is not None:
        x = x * scale[blocks].flatten(1, 2)[:, :max_len].float().unsqueeze(-1)
    outside = torch.arange(max_len, device=x.device)[None, :] >= kv_lens[:, None]
    return x.masked_fill_(outside[:, :, None, None], 0.0)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, rope: RopeInputs | None = None) -> torch.Tensor:
        if rope is not None:
            q, k = rope_reference(rope, q, k)
        store_kv_cache_ref(k, v, cache.k, cache.v, meta.slot_mapping, cache.k_scale,
                           cache.v_scale)
        out = torch.empty_like(q)
        by_query_len: dict[int, list[tuple[int, int, int]]] = {}  # (seq, first token, kv len)
        start = 0
        for i, (q_len, kv_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
            if q_len:
                by_query_len.setdefault(q_len, []).append((i, start, kv_len))
            start += q_len
        head_dim = q.shape[-1]
        for q_len, seqs in by_query_len.items():
            max_kv = max(kv_len for _, _, kv_len in seqs)
            per_seq = max_kv * (2 * self.num_kv_heads * head_dim + 2 * self.num_heads * q_len)
            size = max(1, _MAX_ELEMENTS // per_seq)
            for at in range(0, len(seqs), size):
                self._attend(q, out, cache, meta, q_len, seqs[at:at + size])
        return out

    def _attend(self, q: torch.Tensor, out: torch.Tensor, cache: KVCache,
                meta: AttentionMetadata, q_len: int, seqs: list[tuple[int, int, int]]) -> None:
        """Sequences that each run q_len query tokens, as one batch."""
        device = q.device
        rows = torch.tensor([i for i, _, _ in seqs], device=device)
        kv_lens = torch.tensor([kv_len for _, _, kv_len in seqs], device=device)
        max_kv = int(kv_lens.max())
        table = meta.block_table[rows]
        keys = gather_kv_batch(cache.k, cache.k_scale, table, kv_lens, max_kv)
        values = gather_kv_batch(cache.v, cache.v_scale, table, kv_lens, max_kv)
        # [seqs, q_len] token indices; each query head group shares its KV head
        tokens = (torch.tensor([first for _, first, _ in seqs], device=device)[:, None]
                  + torch.arange(q_len, device=device)[None, :])
        group = self.num_heads // self.num_kv_heads
        queries = q[tokens].float().unflatten(2, (self.num_kv_heads, group))
        scores = torch.einsum("sqhgd,skhd->shgqk", queries, keys) * self.scale
        # query j of a sequence sits at absolute position kv_len - q_len + j, sees keys up to it
        q_pos = kv_lens[:, None] - q_len + torch.arange(q_len, device=device)[None, :]
        hidden = torch.arange(max_kv, device=device)[None, None, :] > q_pos[:, :, None]
        scores.masked_fill_(hidden[:, None, None], float("-inf"))
        probs = scores.softmax(dim=-1)
        attended = torch.einsum("shgqk,skhd->sqhgd", probs, values)
        out[tokens.flatten()] = attended.flatten(0, 1).flatten(1, 2).to(q.dtype)


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
