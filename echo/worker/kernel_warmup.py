"""Start-up runs of the step shapes that CUDA graphs do not cover, so Triton compiles their kernel
variants before the first request rather than inside it.

Triton compiles a kernel once per combination of its compile-time parameters. Decode batches
are compiled while their CUDA graphs are captured; prefills, prefill chunks mixed with decodes
and eager decodes pick among a handful of attention tile classes, with and without key splits,
each compiled at its first appearance. A serving run on a freshly started H200 (Qwen3-8B)
showed inter-token gaps the size of such compilations (docs/benchmarks.md, History 7939db3).
"""

from dataclasses import dataclass

import numpy as np
import torch

from echo.attention.backend import AttentionMetadata
from echo.worker.step_buffers import longest_first


@dataclass(frozen=True)
class WarmupBatch:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]  # context including the query run


def warmup_batches(max_model_len: int, max_num_batched_tokens: int,
                   max_num_seqs: int) -> list[WarmupBatch]:
    """Mixed-batch shapes that reach each attention path: short and long query runs over a
    cached prefix, with few sequences (key splits) and with many (none), and first prefills
    (no cached prefix). Shapes that do not fit the limits are left out."""
    ctx = min(2048, max_model_len)
    chunk = min(600, ctx)
    candidates = [
        WarmupBatch((1, 1), (ctx, ctx)),  # eager decode, split keys
        WarmupBatch((1, 1, 1, 16), (ctx,) * 4),  # decodes + a short chunk
        WarmupBatch((1, 1, 1, 100), (ctx,) * 4),  # decodes + a longer chunk
        WarmupBatch((chunk,), (ctx,)),  # one long chunk over a prefix
        WarmupBatch((chunk,) * 8, (ctx,) * 8),  # many long chunks
        WarmupBatch((chunk, 200), (chunk, 200)),  # first prefills
        WarmupBatch((10, 20), (10, 20)),  # short first prefills
    ]
    return [b for b in candidates
            if len(b.query_lens) <= max_num_seqs
            and sum(b.query_lens) <= max_num_batched_tokens
            and max(b.seq_lens) <= max_model_len
            and all(0 < q <= s for q, s in zip(b.query_lens, b.seq_lens, strict=True))]


def warmup_metadata(batch: WarmupBatch, block_size: int, device: torch.device
                    ) -> AttentionMetadata:
    """Metadata whose block tables all point at cache block 0 and whose tokens store nothing
    (slot -1): the run reads whatever the cache holds and changes none of it."""
    q_lens, seq_lens = batch.query_lens, batch.seq_lens
    num_tokens = sum(q_lens)
    max_blocks = -(-max(seq_lens) // block_size)
    cu = torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_table=torch.zeros((len(q_lens), max_blocks), dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        seq_order=torch.from_numpy(longest_first(np.array(seq_lens))).to(device),
        max_seqlen_q=max(q_lens), max_seqlen_k=max(seq_lens),
        no_cached_prefix=q_lens == seq_lens,
        query_lens_cpu=q_lens, seq_lens_cpu=seq_lens)


def warmup_positions(batch: WarmupBatch, device: torch.device) -> torch.Tensor:
    """Each token's position: the run is the last query_len tokens of its context."""
    return torch.cat([torch.arange(s - q, s) for q, s in
                      zip(batch.query_lens, batch.seq_lens, strict=True)]).to(device)
