"""Speculative decoding's rejection sampler in two launches, no host sync.

Request r scored rows cu[r] .. cu[r + 1] - 1 of the logits: one per draft, then the row after
the last draft (draft id -1). The first launch takes one program per row and walks its
vocabulary twice: the softmax's max and sum at the request's temperature, then one argmax that
is the target's greedy token, or the Gumbel-max draw from the residual max(0, p - q) at a draft
row (for a point-mass draft, p without the draft) or from p at the last row; it stores that
token and whether the draft is accepted (greedy: it is the argmax; random: u * q(d) <= p(d)).
The second launch takes one program per request and keeps the accepted drafts up to the first
rejection, then the first launch's token there. The noise is the sampler's (sampling.py):
Gumbel over the vocabulary and the acceptance uniform at column `vocab`, keyed by the request's
seed and the output index of the row, so rows draw what reference.rejection_sample_ref draws.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs
from echo_kernels.sampling import noise_key, uniform_noise

BLOCK_V = 2048


@triton.jit(do_not_specialize=["vocab"])
def _score_rows_kernel(
    logits_ptr,  # [rows, vocab], any float dtype
    draft_ptr,  # [rows] int64: the draft scored at the row, -1 after the last draft
    draft_probs_ptr,  # [rows, vocab] float (HAS_Q): the draft model's q at each draft row
    row_request_ptr,  # [rows] int32
    cu_rows_ptr,  # [requests + 1] int32
    temperature_ptr,  # [requests] float32; 0 = greedy
    seeds_ptr,  # [requests] int64
    steps_ptr,  # [requests] int64: output index of the request's first row
    token_ptr,  # [rows] int64 out: the target's token at the row
    accept_ptr,  # [rows] int8 out: the row's draft is accepted
    vocab,
    stride_l,
    stride_q,
    BLOCK_V: tl.constexpr,
    HAS_Q: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    request = tl.load(row_request_ptr + row)
    temperature = tl.load(temperature_ptr + request)
    greedy = temperature == 0.0
    inv_t = 1.0 / tl.where(greedy, 1.0, temperature)
    step = tl.load(steps_ptr + request) + row - tl.load(cu_rows_ptr + request)
    key = noise_key(tl.load(seeds_ptr + request), step)
    draft = tl.load(draft_ptr + row)
    logits = logits_ptr + row * stride_l
    lanes = tl.arange(0, BLOCK_V)

    # max and sum of exp(l / T - max) over the vocabulary, per lane, then reduced
    run_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
    run_sum = tl.zeros([BLOCK_V], tl.float32)
    if not greedy:
        for start in range(0, vocab, BLOCK_V):
            cols = start + lanes
            x = tl.load(logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            x = x * inv_t
            new_max = tl.maximum(run_max, x)
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - safe) + tl.exp(x - safe)
            run_max = new_max
    row_max = tl.max(run_max, 0)
    safe_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    row_sum = tl.sum(run_sum * tl.exp(run_max - safe_max), 0)
    inv_sum = 1.0 / tl.where(row_sum > 0, row_sum, 1.0)

    # the residual's Gumbel-max (the target's argmax when greedy), and p's as a fallback for
    # a residual that is zero everywhere (p == q: any rejection there is moot)
    best = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK_V], tl.int32)
    best_p = tl.full([BLOCK_V], float("-inf"), tl.float32)
    best_p_idx = tl.zeros([BLOCK_V], tl.int32)
    if greedy:
        # the argmax alone: a greedy row draws no noise (its hash and two logs per column cost
        # a batch-1 verification ~100 µs when computed and dropped)
        for start in range(0, vocab, BLOCK_V):
            cols = start + lanes
            x = tl.load(logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            take = x > best  # strict: the earliest index wins ties, as torch.argmax
            best = tl.where(take, x, best)
            best_idx = tl.where(take, cols, best_idx)
    else:
        for start in range(0, vocab, BLOCK_V):
            cols = start + lanes
            mask = cols < vocab
            x = tl.load(logits + cols, mask=mask, other=float("-inf")).to(tl.float32)
            gumbel = -tl.log(-tl.log(uniform_noise(key, cols)))
            plain = x * inv_t + gumbel
            if HAS_Q:
                q = tl.load(draft_probs_ptr + row * stride_q + cols, mask=mask & (draft >= 0),
                            other=0.0).to(tl.float32)
                residual = tl.maximum(tl.exp(x * inv_t - safe_max) * inv_sum - q, 0.0)
                score = tl.where(draft >= 0, tl.log(residual) + gumbel, plain)
            else:
                score = tl.where(cols == draft, float("-inf"), plain)
            take = score > best
            best = tl.where(take, score, best)
            best_idx = tl.where(take, cols, best_idx)
            take_p = plain > best_p
            best_p = tl.where(take_p, plain, best_p)
            best_p_idx = tl.where(take_p, cols, best_p_idx)
    top = tl.max(best, 0)
    token = tl.min(tl.where(best == top, best_idx, 2147483647), 0)
    top_p = tl.max(best_p, 0)
    token_p = tl.min(tl.where(best_p == top_p, best_p_idx, 2147483647), 0)
    token = tl.where(top == float("-inf"), token_p, token)

    has_draft = draft >= 0
    safe_draft = tl.where(has_draft, draft, 0)
    x_draft = tl.load(logits + safe_draft).to(tl.float32)
    p_draft = tl.exp(x_draft * inv_t - safe_max) * inv_sum
    if HAS_Q:
        q_draft = tl.load(draft_probs_ptr + row * stride_q + safe_draft).to(tl.float32)
    else:
        q_draft = 1.0
    accept_u = uniform_noise(key, vocab)
    accepted = tl.where(greedy, token == draft, accept_u * q_draft <= p_draft) & has_draft
    tl.store(token_ptr + row, token.to(tl.int64))
    tl.store(accept_ptr + row, accepted.to(tl.int8))


@triton.jit(do_not_specialize=["width"])
def _emit_kernel(
    draft_ptr,  # [rows] int64
    token_ptr,  # [rows] int64
    accept_ptr,  # [rows] int8
    cu_rows_ptr,  # [requests + 1] int32
    out_ptr,  # [requests, width] int64: emitted tokens, then -1
    width,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    request = tl.program_id(0)
    first = tl.load(cu_rows_ptr + request)
    count = tl.load(cu_rows_ptr + request + 1) - first
    offs = tl.arange(0, BLOCK_W)
    inside = offs < count
    accepted = tl.load(accept_ptr + first + offs, mask=inside, other=0) != 0
    # the first position that is not an accepted draft (the last row never is)
    num_accepted = tl.min(tl.where(accepted | (offs >= count), BLOCK_W, offs), 0)
    draft = tl.load(draft_ptr + first + offs, mask=inside, other=-1)
    token = tl.load(token_ptr + first + offs, mask=inside, other=-1)
    out = tl.where(offs < num_accepted, draft, tl.where(offs == num_accepted, token, -1))
    tl.store(out_ptr + request.to(tl.int64) * width + offs, out, mask=offs < width)


def rejection_sample(logits: torch.Tensor, draft_ids: torch.Tensor, cu_rows: torch.Tensor,
                     temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                     width: int, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, V]; draft_ids [rows] int64, -1 at each request's last row; cu_rows
    [R + 1] int32; temperature, seeds, steps [R]; width >= the most rows of a request;
    draft_probs [rows, V] (None: point-mass drafts). Returns [R, width] int64: each request's
    accepted drafts, the token after them, then -1."""
    assert logits.stride(-1) == 1
    rows, vocab = logits.shape
    num_requests = cu_rows.shape[0] - 1
    device = logits.device
    out = torch.empty(num_requests, width, dtype=torch.int64, device=device)
    if not rows:
        return out.fill_(-1)
    counts = cu_rows[1:] - cu_rows[:-1]
    row_request = torch.repeat_interleave(torch.arange(num_requests, dtype=torch.int32,
                                                       device=device), counts, output_size=rows)
    tokens = torch.empty(rows, dtype=torch.int64, device=device)
    accepted = torch.empty(rows, dtype=torch.int8, device=device)
    has_q = draft_probs is not None
    if has_q:
        assert draft_probs.shape == logits.shape and draft_probs.stride(-1) == 1
    pdl = pdl_options(device)
    _score_rows_kernel[(rows,)](
        logits, draft_ids, draft_probs if has_q else logits, row_request, cu_rows, temperature,
        seeds, steps, tokens, accepted, vocab, logits.stride(0),
        draft_probs.stride(0) if has_q else 0, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(vocab)),
        HAS_Q=has_q, num_warps=8, **pdl)
    _emit_kernel[(num_requests,)](draft_ids, tokens, accepted, cu_rows, out, width,
                                  BLOCK_W=triton.next_power_of_2(width), **pdl)
    return out


def warm_up_rejection_sample(vocab: int, max_width: int, dtype: torch.dtype,
                             device: torch.device) -> None:
    """Compile the variants that requests of up to max_width rows need (point-mass drafts or
    a draft model's q; the padded width of the second launch) for logits of dtype."""
    zeros = torch.zeros(1, dtype=torch.int64, device=device)
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    logits = torch.zeros(1, vocab, dtype=dtype, device=device)
    drafts = torch.tensor([-1], device=device)
    for q in (None, torch.zeros(1, vocab, dtype=torch.float32, device=device)):
        width = 1
        while True:
            rejection_sample(logits, drafts, cu, zeros.float(), zeros, zeros, width, q)
            if width >= max_width:
                break
            width = min(2 * width, max_width)
