"""Seeded Gumbel-max sampling in one pass over the logits.

token = argmax(logits / temperature + gumbel(seed, step, token id)); temperature 0 means plain
argmax. The Gumbel noise is a counter-based hash of (seed, output index, token id), computed in
registers, so the [batch, vocab] noise tensor is never written and the logits are read once.
The hash is the one in reference.uniform_noise_ref, bit for bit.

A row is one program when the batch fills the GPU. A small batch would leave most SMs idle
while one program walks a 150k-token vocabulary, so its rows are split into vocabulary chunks
whose (best score, token) pairs a second launch reduces; ties go to the smallest token id
either way, as torch.argmax.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.device import sm_count
from echo_kernels.pdl import pdl_options, wait_for_inputs

BLOCK_V = 2048  # tokens per loop step
MIN_CHUNK = 4 * BLOCK_V  # a chunk is worth a program only if it streams this many tokens
_PROGRAMS_PER_SM = 2


@triton.jit
def _mix32(x):
    # xor-shift-multiply finalizer on uint32; products wrap mod 2**32
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def noise_key(seed, step):
    """The hash of (seed int64, output index) that a row's uniforms are drawn under."""
    seed_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    seed_hi = (seed >> 32).to(tl.uint32)
    return _mix32(seed_hi ^ _mix32(seed_lo ^ _mix32(step.to(tl.uint32))))


@triton.jit
def uniform_noise(key, cols):
    """Uniforms in (0, 1) for token ids cols under a row's noise_key."""
    bits = _mix32(key ^ _mix32(cols.to(tl.uint32) * 0x9E3779B1))
    bits = _mix32(bits ^ (key >> 5))
    # 23 bits: with 24, the top value + 0.5 rounds to 1.0 in float32, whose Gumbel noise
    # is +inf, and a uniformly random token would win 1 in 2**24 draws per token
    return ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)


# NOTE: these three are read once per program, so their alignment gains nothing; left to
# specialise, it changed with the batch size (rows of one upload, sampling_inputs.py) and
# compiled the kernel again inside a serving step
@triton.jit(do_not_specialize_on_alignment=["temperature_ptr", "seeds_ptr", "steps_ptr"])
def _gumbel_argmax_kernel(
    logits_ptr,  # [batch, vocab], any float dtype
    temperature_ptr,  # [batch] float32; 0 = greedy
    seeds_ptr,  # [batch] int64
    steps_ptr,  # [batch] int64
    out_ptr,  # [batch] int64 (not SPLIT)
    part_score_ptr,  # [batch, num_chunks] float32 (SPLIT)
    part_token_ptr,  # [batch, num_chunks] int32 (SPLIT)
    vocab,
    stride_b,
    chunk_len,  # tokens per chunk, a multiple of BLOCK_V (SPLIT)
    BLOCK_V: tl.constexpr,
    SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    key = noise_key(tl.load(seeds_ptr + row), tl.load(steps_ptr + row))
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    if SPLIT:
        lo = chunk * chunk_len
        hi = tl.minimum(vocab, lo + chunk_len)
    else:
        lo = 0
        hi = vocab
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = cols < hi
        x = tl.load(logits_ptr + row * stride_b + cols, mask=mask, other=float("-inf"))
        gumbel = -tl.log(-tl.log(uniform_noise(key, cols)))
        score = tl.where(greedy, x.to(tl.float32), x.to(tl.float32) * inv_t + gumbel)
        take = score > best  # strict: the earliest index wins ties, as torch.argmax
        best = tl.where(take, score, best)
        best_idx = tl.where(take, cols, best_idx)
    top = tl.max(best, 0)
    # among lanes holding the maximum, the smallest token id
    winner = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    if SPLIT:
        num_chunks = tl.num_programs(1)
        tl.store(part_score_ptr + row * num_chunks + chunk, top)
        tl.store(part_token_ptr + row * num_chunks + chunk, winner)
    else:
        tl.store(out_ptr + row, winner.to(tl.int64))


@triton.jit(do_not_specialize=["num_chunks"])  # changes with the batch size
def _best_chunk_kernel(
    part_score_ptr,  # [batch, num_chunks] float32
    part_token_ptr,  # [batch, num_chunks] int32
    out_ptr,  # [batch] int64
    num_chunks,
    BLOCK_C: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    mask = offs < num_chunks
    score = tl.load(part_score_ptr + row * num_chunks + offs, mask=mask, other=float("-inf"))
    token = tl.load(part_token_ptr + row * num_chunks + offs, mask=mask, other=2147483647)
    top = tl.max(score, 0)
    # the smallest id among the chunks' maxima, as within a chunk (a row of only -inf: 0)
    winner = tl.min(tl.where((score == top) & mask, token, 2147483647), 0)
    tl.store(out_ptr + row, winner.to(tl.int64))


def num_vocab_chunks(batch: int, vocab: int, device: torch.device) -> int:
    """Chunks per row: enough programs for every SM when the batch alone is not."""
    target = _PROGRAMS_PER_SM * sm_count(device, without_gpu=4)
    return max(1, min(triton.cdiv(target, batch), triton.cdiv(vocab, MIN_CHUNK)))


def _chunking(batch: int, vocab: int, device: torch.device,
              num_chunks: int | None = None) -> tuple[int, int]:
    """(chunks per row, tokens per chunk) of a launch."""
    if num_chunks is None:
        num_chunks = num_vocab_chunks(batch, vocab, device)
    chunk_len = triton.cdiv(triton.cdiv(vocab, num_chunks), BLOCK_V) * BLOCK_V
    return triton.cdiv(vocab, chunk_len), chunk_len


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor, num_chunks: int | None = None) -> torch.Tensor:
    """logits [B, V] (excluded tokens at -inf), temperature/seeds/steps [B] -> tokens [B]."""
    assert logits.stride(-1) == 1
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if not batch:
        return out
    num_chunks, chunk_len = _chunking(batch, vocab, logits.device, num_chunks)
    split = num_chunks > 1
    if split:
        part_score = torch.empty(batch, num_chunks, dtype=torch.float32, device=logits.device)
        part_token = torch.empty(batch, num_chunks, dtype=torch.int32, device=logits.device)
    else:
        part_score = part_token = out  # unused
    pdl = pdl_options(logits.device)
    _gumbel_argmax_kernel[(batch, num_chunks)](
        logits, temperature, seeds, steps, out, part_score, part_token, vocab,
        logits.stride(0), chunk_len, BLOCK_V=BLOCK_V, SPLIT=split, num_warps=8, **pdl)
    if split:
        _best_chunk_kernel[(batch,)](part_score, part_token, out, num_chunks,
                                     BLOCK_C=triton.next_power_of_2(num_chunks), **pdl)
    return out


def warm_up_gumbel_sample(max_batch: int, vocab: int, dtypes: list[torch.dtype],
                          device: torch.device) -> set[tuple[bool, int]]:
    """Launch gumbel_sample once for each compile-time variant that batches of 1..max_batch
    rows need (split or not, the reduction's padded chunk count), with logits of each dtype, so
    that none compiles inside a serving step; returns the variants."""
    variants = set()
    for batch in range(1, max_batch + 1):
        num_chunks, _ = _chunking(batch, vocab, device)
        variant = (num_chunks > 1, triton.next_power_of_2(num_chunks))
        if variant in variants:
            continue
        variants.add(variant)
        zeros = torch.zeros(batch, dtype=torch.int64, device=device)
        for dtype in dtypes:
            gumbel_sample(torch.zeros(batch, vocab, dtype=dtype, device=device),
                          zeros.float(), zeros, zeros)
    return variants
