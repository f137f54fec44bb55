"""Helpers shared by the kernel tests: paged batches over NaN-poisoned caches, comparisons."""

import torch

from echo.attention.backend import cache_scales

HAS_CUDA = torch.cuda.is_available()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PagedBatch:
    """A random batch over a paged cache whose unused slots are all NaN.

    Each sequence gets random distinct blocks from the pool; block-table entries past a
    sequence's blocks point at other NaN-filled blocks, so any read past a context shows up.
    """

    def __init__(self, q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size,
                 num_blocks, dtype, device, kv_dtype=None, seed=0):
        from echo_kernels import store_kv_cache

        gen = torch.Generator(device="cpu").manual_seed(seed)
        kv_dtype = kv_dtype or dtype
        self.q_lens, self.ctx_lens = list(q_lens), list(ctx_lens)
        assert all(q <= c for q, c in zip(self.q_lens, self.ctx_lens, strict=True))
        num_seqs = len(ctx_lens)
        blocks_per_seq = [cdiv(c, block_size) for c in ctx_lens]
        max_blocks = max(blocks_per_seq) + 2
        assert sum(blocks_per_seq) + max_blocks <= num_blocks, "pool too small"
        perm = torch.randperm(num_blocks, generator=gen)
        used, spare = perm[: sum(blocks_per_seq)], perm[sum(blocks_per_seq):]
        table = spare[torch.randint(len(spare), (num_seqs, max_blocks), generator=gen)]
        start = 0
        for s, nb in enumerate(blocks_per_seq):
            table[s, :nb] = used[start:start + nb]
            start += nb
        self.block_table = table.to(torch.int32).to(device)

        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if kv_dtype == torch.int8:
            self.k_cache = torch.zeros(shape, dtype=torch.int8, device=device)
            self.v_cache = torch.zeros(shape, dtype=torch.int8, device=device)
            # the engine's layout; NaN where no token was stored, so a read of one shows
            self.k_scale, self.v_scale = (cache_scales(*shape[:3], device, fill=float("nan"))
                                          for _ in range(2))
        else:
            self.k_cache = torch.full(shape, float("nan"), dtype=kv_dtype, device=device)
            self.v_cache = torch.full(shape, float("nan"), dtype=kv_dtype, device=device)
            self.k_scale = self.v_scale = None
        # the context's K/V go in through store_kv_cache, as in the engine
        slots = torch.cat([
            self.block_table[s, torch.arange(c, device=device) // block_size].long() * block_size
            + torch.arange(c, device=device) % block_size
            for s, c in enumerate(ctx_lens)
        ])
        total = slots.shape[0]
        k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        store_kv_cache(k, v, self.k_cache, self.v_cache, slots, self.k_scale, self.v_scale)

        cu = [0]
        for q_len in q_lens:
            cu.append(cu[-1] + q_len)
        self.cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(ctx_lens, dtype=torch.int32, device=device)
        self.q = torch.randn(cu[-1], num_heads, head_dim, generator=gen).to(dtype).to(device)
        self.max_seqlen_q, self.max_seqlen_k = max(q_lens), max(ctx_lens)
        self.scale = head_dim**-0.5

    def run(self, **kwargs) -> torch.Tensor:
        from echo_kernels.attention import paged_attention

        out = torch.full_like(self.q, float("nan"))
        res = paged_attention(
            self.q, self.k_cache, self.v_cache, self.block_table, self.cu_seqlens_q,
            self.seq_lens, self.max_seqlen_q, self.max_seqlen_k, self.scale,
            self.k_scale, self.v_scale, out=out, **kwargs)
        assert res is out
        return out

    def reference(self) -> torch.Tensor:
        from echo_kernels.reference import paged_attention_ref

        return paged_attention_ref(self.q, self.k_cache, self.v_cache, self.block_table,
                                   self.cu_seqlens_q, self.seq_lens, self.scale, self.k_scale,
                                   self.v_scale)


def assert_close(out: torch.Tensor, ref: torch.Tensor, atol: float) -> None:
    assert not out.isnan().any(), "NaN in output (unwritten row or poisoned slot read)"
    err = (out.float() - ref.float()).abs().max().item()
    assert err <= atol, f"max abs error {err:.3g} > {atol:.3g}"
