"""The torch attention backend on int8 caches: quantizes what it stores like the kernels do,
and attends like echo_kernels' reference over the dequantized cache."""

import pytest
import torch

from echo.attention import torch_backend
from echo.attention.backend import AttentionMetadata, KVCache
from echo.attention.torch_backend import TorchAttentionBackend
from echo_kernels.reference import paged_attention_ref, quantize_int8, store_kv_cache_ref

HEADS, KV_HEADS, DIM, BLOCK, NUM_BLOCKS = 4, 2, 32, 16, 12
SCALE = DIM**-0.5
# (tokens already in the cache, tokens of this step): a decode, a chunked prefill, a prefill
SEQS = [(36, 1), (32, 18), (0, 9)]


def _mixed_step(seqs=SEQS):
    """Scattered block tables, earlier tokens stored, this step's q/k/v and metadata."""
    torch.manual_seed(0)
    blocks = torch.randperm(NUM_BLOCKS)
    per_seq = [-(-(cached + new) // BLOCK) for cached, new in seqs]
    # past a sequence's own blocks the table holds other sequences' blocks, as a reused row can
    table = blocks[:max(per_seq)].repeat(len(seqs), 1).to(torch.int32)
    start = 0
    for i, n in enumerate(per_seq):
        table[i, :n] = blocks[start:start + n]
        start += n

    def slots(i, positions):
        return table[i].long()[positions // BLOCK] * BLOCK + positions % BLOCK

    earlier = torch.cat([slots(i, torch.arange(c)) for i, (c, _) in enumerate(seqs)])
    now = torch.cat([slots(i, torch.arange(c, c + n)) for i, (c, n) in enumerate(seqs)])
    lens = [n for _, n in seqs]
    meta = AttentionMetadata(
        slot_mapping=now, block_table=table,
        cu_seqlens_q=torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        max_seqlen_q=max(lens), max_seqlen_k=max(c + n for c, n in seqs),
        query_lens_cpu=tuple(lens), seq_lens_cpu=tuple(c + n for c, n in seqs))
    k_old, v_old = (torch.randn(len(earlier), KV_HEADS, DIM) for _ in range(2))
    q = torch.randn(sum(lens), HEADS, DIM)
    k, v = (torch.randn(sum(lens), KV_HEADS, DIM) for _ in range(2))
    return (k_old, v_old, earlier), (q, k, v), meta


def _int8_cache() -> KVCache:
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    # NaN scales outside the slots written: reading any other block would poison the output
    return KVCache(torch.zeros(shape, dtype=torch.int8), torch.zeros(shape, dtype=torch.int8),
                   torch.full(shape[:3], float("nan")), torch.full(shape[:3], float("nan")))


def test_int8_attention_equals_reference_on_the_dequantized_cache():
    (k_old, v_old, earlier), (q, k, v), meta = _mixed_step()
    cache = _int8_cache()
    store_kv_cache_ref(k_old, v_old, cache.k, cache.v, earlier, cache.k_scale, cache.v_scale)
    out = TorchAttentionBackend(HEADS, KV_HEADS, DIM, SCALE).forward(q, k, v, cache, meta)
    assert out.isfinite().all()

    # this step's K/V were quantized into their slots
    blocks, offsets = meta.slot_mapping // BLOCK, meta.slot_mapping % BLOCK
    for new, values, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        want_values, want_scales = quantize_int8(new)
        assert torch.equal(values[blocks, offsets], want_values)
        assert torch.equal(scales[blocks, offsets], want_scales)

    deq_k = cache.k.float() * cache.k_scale.nan_to_num(0.0).unsqueeze(-1)
    deq_v = cache.v.float() * cache.v_scale.nan_to_num(0.0).unsqueeze(-1)
    want = paged_attention_ref(q, deq_k, deq_v, meta.block_table, meta.cu_seqlens_q,
                               meta.seq_lens, SCALE)
    # the same float32 math over the same values: far inside the 2e-2 asked of the kernels
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)

    # and int8 stays close to attention over the exact K/V (0.015 off here, outputs up to 3.6)
    exact_k, exact_v = (torch.zeros(NUM_BLOCKS, BLOCK, KV_HEADS, DIM) for _ in range(2))
    slots = torch.cat([earlier, meta.slot_mapping])
    store_kv_cache_ref(torch.cat([k_old, k]), torch.cat([v_old, v]), exact_k, exact_v, slots)
    exact = paged_attention_ref(q, exact_k, exact_v, meta.block_table, meta.cu_seqlens_q,
                                meta.seq_lens, SCALE)
    torch.testing.assert_close(out, exact, atol=5e-2, rtol=0)


@pytest.mark.parametrize("max_elements", [1 << 25, 1])
def test_model_dtype_cache_equals_reference(monkeypatch, max_elements):
    # decodes and 3-token runs of different contexts attend as one batch per query length, or
    # (max_elements 1) one sequence at a time
    monkeypatch.setattr(torch_backend, "_MAX_ELEMENTS", max_elements)
    seqs = [(36, 1), (5, 1), (20, 1), (0, 3), (13, 3), (32, 18)]
    (k_old, v_old, earlier), (q, k, v), meta = _mixed_step(seqs)
    shape = (NUM_BLOCKS, BLOCK, KV_HEADS, DIM)
    cache = KVCache(torch.zeros(shape), torch.zeros(shape))
    store_kv_cache_ref(k_old, v_old, cache.k, cache.v, earlier)
    out = TorchAttentionBackend(HEADS, KV_HEADS, DIM, SCALE).forward(q, k, v, cache, meta)
    want = paged_attention_ref(q, cache.k, cache.v, meta.block_table, meta.cu_seqlens_q,
                               meta.seq_lens, SCALE)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
