"""Seeded Gumbel-max sampling in one pass over the logits.

token = argmax(logits / temperature + gumbel(seed, step, token id)); temperature 0 means plain
argmax. The Gumbel noise is a counter-based hash of (seed, output index, token id), computed in
registers, so the [batch, vocab] noise tensor is never written and the logits are read once.
The hash is the one in reference.uniform_noise_ref, bit for bit.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _mix32(x):
    # xor-shift-multiply finalizer on uint32; products wrap mod 2**32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel_argmax_kernel(
    logits_ptr,  # [batch, vocab], any float dtype
    temperature_ptr,  # [batch] float32; 0 = greedy
    seeds_ptr,  # [batch] int64
    steps_ptr,  # [batch] int64
    out_ptr,  # [batch] int64
    vocab,
    stride_b,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    seed = tl.load(seeds_ptr + row)
    step = tl.load(steps_ptr + row).to(tl.uint32)
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = (seed >> 32).to(tl.uint32)
    key = _mix32(seed_hi ^ _mix32(seed_lo ^ _mix32(step)))
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < vocab
        x = tl.load(logits_ptr + row * stride_b + cols, mask=mask, other=float("-inf"))
        bits = _mix32(key ^ _mix32(cols.to(tl.uint32) * 0x9E3779B1))
        bits = _mix32(bits ^ (key >> 5))
        u = ((bits >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        gumbel = -tl.log(-tl.log(u))
        score = tl.where(greedy, x.to(tl.float32), x.to(tl.float32) * inv_t + gumbel)
        take = score > best  # strict: the earliest index wins ties, as torch.argmax
        best = tl.where(take, score, best)
        best_idx = tl.where(take, cols, best_idx)
    top = tl.max(best, 0)
    # among lanes holding the maximum, the smallest token id
    winner = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (excluded tokens at -inf), temperature/seeds/steps [B] -> tokens [B]."""
    assert logits.stride(-1) == 1
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch:
        _gumbel_argmax_kernel[(batch,)](logits, temperature, seeds, steps, out, vocab,
                                        logits.stride(0), BLOCK_V=2048, num_warps=8)
    return out
