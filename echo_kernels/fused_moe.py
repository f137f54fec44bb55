"""Mixture-of-experts MLP (Qwen3-MoE): routing, grouping tokens by expert, two grouped GEMMs.

moe_routing turns router logits into each token's top-k experts and their softmax weights.
moe_align_block_size sorts the M*k (token, slot) pairs by expert, each expert's group padded to
a multiple of the GEMM's BLOCK_M, so that every BLOCK_M-row tile of the sorted order belongs to
one expert. fused_moe runs the MLP over that order: one grouped GEMM gathers token rows and
multiplies them by the tile's expert's gate_up weight, with SiLU-and-mul in its epilogue; a
second multiplies by the expert's down weight and the routing weight; a last launch sums each
token's k rows. No atomics anywhere: the output is deterministic.

Buffers are sized by bounds that do not depend on the routing (max_padded = M*k + E*(BLOCK_M-1)
sorted slots, max_padded // BLOCK_M tiles), so a CUDA graph can capture a step; tiles past the
routing's padded length carry expert -1 and their programs exit at once.

With few pairs (a decode step of up to four tokens at k = 8) sorting buys little: most pairs
would sit alone in a tile of 16 rows. Then fused_moe_pairs runs each pair as a GEMV on the CUDA
cores (as echo_kernels.linear does for dense layers): one launch for gate_up, one for down,
whose programs also sum a token's k rows: the last of a token's k pairs to finish a column
block adds the k rows in slot order (an arrival count per token and block; the order of the
sum does not depend on which pair arrives last, so the output stays deterministic).
"""

import torch
import triton
import triton.language as tl

from echo_kernels.linear import weight_tile
from echo_kernels.pdl import pdl_options, wait_for_inputs

# (most tokens, (BLOCK_M, BLOCK_N, BLOCK_K, num_warps)), first match wins. At E=128 and k=8 a
# decode batch gives each expert a row or two, so small BLOCK_M wastes less padding; a prefill
# fills larger tiles. From 64 tokens on, the best of bench_kernels' sweep at Qwen3-30B-A3B's
# shapes (H200, 2026-12-04, docs/benchmarks.md Qwen3-MoE: 1.05x, 1.59x, 1.23x and 1.16x the
# earlier table at 64, 256, 1024 and 4096 tokens); up to 32 untuned
_GEMM_CONFIGS = (
    (32, (16, 64, 64, 4)),
    (64, (16, 128, 128, 4)),
    (256, (32, 64, 128, 4)),
    (1024, (64, 64, 64, 4)),
    (None, (128, 128, 64, 8)),
)


# at most this many (token, expert) pairs, each pair is a GEMV of its own (fused_moe_pairs):
# at Qwen3-30B-A3B's k = 8 up to 4 tokens (bench_kernels, H200, 2026-12-04: at 4 tokens 78.6
# against 83.1 us sorted, at 8 149.0 against 135.7)
PAIR_MAX = 32
# (BLOCK_N, BLOCK_K, num_warps) of the pair GEMVs: the best of tools/dev/probe_moe_pair_gemv.py
# at Qwen3-30B-A3B's shapes, one and two tokens (H200, 2026-12-04, docs/benchmarks.md Qwen3-MoE)
PAIR_GATE_UP_CONFIG = (2, 256, 1)
PAIR_DOWN_CONFIG = (8, 128, 2)


def _gemm_config(num_tokens: int) -> tuple[int, int, int, int]:
    for most, config in _GEMM_CONFIGS:
        if most is None or num_tokens <= most:
            return config
    raise AssertionError("unreachable")


# ---------------------------------------------------------------------------------------------
# routing


@triton.jit
def _moe_routing_kernel(
    logits_ptr,  # [M, E] any float dtype
    weights_ptr,  # [M, TOP_K] float32
    ids_ptr,  # [M, TOP_K] int32
    num_rows,
    num_experts,
    stride_l,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_R: tl.constexpr,  # rows per program
    BLOCK_E: tl.constexpr,  # experts, a power of two
    BLOCK_K: tl.constexpr,  # TOP_K rounded up to a power of two
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    row_ok = rows < num_rows
    in_e = experts[None, :] < num_experts
    x = tl.load(logits_ptr + rows[:, None].to(tl.int64) * stride_l + experts[None, :],
                mask=row_ok[:, None] & in_e, other=0.0).to(tl.float32)
    # -inf only past E: a row past M of all -inf would compute -inf - -inf
    x = tl.where(in_e, x, float("-inf"))
    top = tl.max(x, 1)
    p = tl.exp(x - top[:, None])
    p = p / tl.sum(p, 1)[:, None]
    taken = ~in_e  # experts past E are never picked, even when every real logit is -inf
    w_out = tl.zeros([BLOCK_R, BLOCK_K], tl.float32)
    id_out = tl.zeros([BLOCK_R, BLOCK_K], tl.int32)
    for j in tl.static_range(TOP_K):
        # picked on the logits, not the probabilities: softmax is monotone, and two logits that
        # differ stay ordered even where their probabilities round to the same float32 (the
        # reference sorts the same logits, so the two agree exactly); ties: the lower id
        cand = tl.where(taken, float("-inf"), x)
        best = tl.max(cand, 1)
        pick = tl.min(tl.where((cand == best[:, None]) & ~taken, experts[None, :], BLOCK_E), 1)
        chosen = experts[None, :] == pick[:, None]
        w_out = tl.where(slots[None, :] == j, tl.sum(tl.where(chosen, p, 0.0), 1)[:, None], w_out)
        id_out = tl.where(slots[None, :] == j, pick[:, None], id_out)
        taken = taken | chosen
    if RENORMALIZE:
        w_out = w_out / tl.sum(w_out, 1)[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    out_ok = row_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, w_out, mask=out_ok)
    tl.store(ids_ptr + out, id_out, mask=out_ok)


def moe_routing(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                num_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] (any float dtype) -> (weights [M, top_k] float32, expert ids
    [M, top_k] int32): softmax over E in float32, the top_k experts in descending order (ties
    to the lower expert id), weights divided by their sum when `renormalize` (Qwen3-MoE's
    norm_topk_prob). The weights stay float32; Hugging Face rounds them to the model dtype.
    num_warps defaults to a warp per 256 logits of a program, 1 to 4: on one warp a row's
    reductions need no shared memory (one token of 128 experts, moe_routing + fused_moe: 23.7 us
    against 25.7 with four warps; H200, tools/dev/probe_moe_pair_gemv.py, 2026-12-04)."""
    assert router_logits.dim() == 2 and router_logits.stride(1) == 1
    assert router_logits.is_floating_point()
    num_rows, num_experts = router_logits.shape
    assert 1 <= top_k <= num_experts
    device = router_logits.device
    weights = torch.empty(num_rows, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_rows, top_k, dtype=torch.int32, device=device)
    if not num_rows:
        return weights, ids
    block_e = triton.next_power_of_2(num_experts)
    block_r = max(1, min(16, 2048 // block_e, triton.next_power_of_2(num_rows)))
    _moe_routing_kernel[(triton.cdiv(num_rows, block_r),)](
        router_logits, weights, ids, num_rows, num_experts, router_logits.stride(0),
        TOP_K=top_k, RENORMALIZE=renormalize, BLOCK_R=block_r, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), **pdl_options(device),
        num_warps=num_warps or max(1, min(4, block_r * block_e // 256)))
    return weights, ids


@triton.jit
def route_row(logits_ptr, num_experts, top_k, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """One token's routing, moe_routing's rule: (weights [BLOCK_K] float32, expert ids [BLOCK_K]
    int32) from its logits at logits_ptr. A loop over the k picks where _moe_routing_kernel
    unrolls them: the persistent decode step routes a token in every program, where the
    unrolled picks spill (sm_90)."""
    experts = tl.arange(0, BLOCK_E)
    slots = tl.arange(0, BLOCK_K)
    in_e = experts < num_experts
    # past L1: a program of a later launch may find an earlier step's logits there
    x = tl.load(logits_ptr + experts, mask=in_e, other=0.0, cache_modifier=".cg")
    x = tl.where(in_e, x.to(tl.float32), float("-inf"))
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    taken = ~in_e
    weights = tl.zeros([BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_K], tl.int32)
    for j in tl.range(0, top_k):
        candidates = tl.where(taken, float("-inf"), x)
        best = tl.max(candidates, 0)
        pick = tl.min(tl.where((candidates == best) & ~taken, experts, BLOCK_E), 0)
        chosen = experts == pick
        weights = tl.where(slots == j, tl.sum(tl.where(chosen, p, 0.0), 0), weights)
        ids = tl.where(slots == j, pick, ids)
        taken = taken | chosen
    if RENORMALIZE:
        weights = weights / tl.sum(weights, 0)
    return weights, ids


# ---------------------------------------------------------------------------------------------
# grouping by expert: count per chunk of pairs, prefix sums, scatter


@triton.jit
def _expert_one_hot(ids_ptr, chunk, num_pairs, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """(pair indices [BLOCK_T], their expert ids, one-hot [BLOCK_T, BLOCK_E] int32) of one
    chunk; pairs past the end have id -1 and an all-zero row."""
    pairs = chunk * BLOCK_T + tl.arange(0, BLOCK_T)
    ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=-1)
    one_hot = (ids[:, None] == tl.arange(0, BLOCK_E)[None, :]).to(tl.int32)
    return pairs, ids, one_hot


@triton.jit
def _moe_count_kernel(
    ids_ptr,  # [num_pairs] int32, the flattened topk_ids
    counts_ptr,  # [num_chunks, BLOCK_E] int32: pairs of each expert in each chunk
    num_pairs,
    BLOCK_T: tl.constexpr,  # pairs per chunk
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    chunk = tl.program_id(0)
    _, _, one_hot = _expert_one_hot(ids_ptr, chunk, num_pairs, BLOCK_T, BLOCK_E)
    tl.store(counts_ptr + chunk * BLOCK_E + tl.arange(0, BLOCK_E), tl.sum(one_hot, 0))


@triton.jit
def _moe_prefix_kernel(
    counts_ptr,  # [num_chunks, BLOCK_E] int32
    chunk_base_ptr,  # [num_chunks, BLOCK_E] int32 out: expert e's pairs in earlier chunks
    expert_start_ptr,  # [BLOCK_E] int32 out: where expert e's group starts in sorted_ids
    sorted_ids_ptr,  # [max_padded] int32 out: the sentinel everywhere no pair goes
    expert_ids_ptr,  # [num_blocks] int32 out
    num_padded_ptr,  # [1] int32 out
    num_chunks,
    num_pairs,  # also the sentinel
    max_padded,
    num_blocks,
    BLOCK_SIZE: tl.constexpr,  # the GEMM's BLOCK_M
    BLOCK_PAD: tl.constexpr,  # BLOCK_SIZE rounded up to a power of two
    BLOCK_C: tl.constexpr,  # chunks per step
    BLOCK_E: tl.constexpr,
    BLOCK_B: tl.constexpr,  # tiles (and sentinel slots) per step
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    experts = tl.arange(0, BLOCK_E)
    # running exclusive prefix over chunks: what keeps each expert's pairs in flattened order
    total = tl.zeros([BLOCK_E], tl.int32)
    for c0 in range(0, num_chunks, BLOCK_C):
        chunks = c0 + tl.arange(0, BLOCK_C)
        offs = chunks[:, None] * BLOCK_E + experts[None, :]
        ok = chunks[:, None] < num_chunks
        counts = tl.load(counts_ptr + offs, mask=ok, other=0)
        tl.store(chunk_base_ptr + offs, tl.cumsum(counts, 0) - counts + total[None, :], mask=ok)
        total += tl.sum(counts, 0)
    padded = (total + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE  # 0 for an expert without pairs
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    num_padded = tl.sum(padded, 0)
    tl.store(expert_start_ptr + experts, starts)
    tl.store(num_padded_ptr, num_padded)
    # each group's padding, then everything past the last group, holds the sentinel
    pad = tl.arange(0, BLOCK_PAD)
    tl.store(sorted_ids_ptr + starts[:, None] + total[:, None] + pad[None, :],
             tl.full([BLOCK_E, BLOCK_PAD], num_pairs, tl.int32),
             mask=pad[None, :] < (padded - total)[:, None])
    for p0 in range(num_padded, max_padded, BLOCK_B):
        slots = p0 + tl.arange(0, BLOCK_B)
        tl.store(sorted_ids_ptr + slots, tl.full([BLOCK_B], num_pairs, tl.int32),
                 mask=slots < max_padded)
    # a tile's expert: how many groups end at or before its first slot (empty groups included)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        first = blocks * BLOCK_SIZE
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(expert_ids_ptr + blocks, tl.where(first < num_padded, expert, -1),
                 mask=blocks < num_blocks)


@triton.jit
def _moe_scatter_kernel(
    ids_ptr,  # [num_pairs] int32
    chunk_base_ptr,  # [num_chunks, BLOCK_E] int32
    expert_start_ptr,  # [BLOCK_E] int32
    sorted_ids_ptr,  # [max_padded] int32 out: each pair's flattened index at its slot
    num_pairs,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    chunk = tl.program_id(0)
    pairs, ids, one_hot = _expert_one_hot(ids_ptr, chunk, num_pairs, BLOCK_T, BLOCK_E)
    # a pair's rank among the chunk's pairs of its expert, in flattened order
    rank = tl.sum(tl.cumsum(one_hot, 0) * one_hot, 1) - 1
    ok = ids >= 0
    base = tl.load(expert_start_ptr + ids, mask=ok, other=0)
    base += tl.load(chunk_base_ptr + chunk * BLOCK_E + ids, mask=ok, other=0)
    tl.store(sorted_ids_ptr + base + rank, pairs, mask=ok)


def max_padded_slots(num_pairs: int, block_size: int, num_experts: int) -> int:
    """The most slots moe_align_block_size can fill, whatever the routing: each expert's group
    is padded by at most block_size - 1."""
    return num_pairs + num_experts * (block_size - 1)


def moe_align_block_size(topk_ids: torch.Tensor, block_size: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """topk_ids [M, k] int32 (each in [0, num_experts)) -> (sorted_ids [max_padded] int32,
    expert_ids [max_padded // block_size] int32, num_padded [1] int32).

    sorted_ids holds the flattened pair indices t*k + j grouped by expert in ascending expert
    order, ascending within a group (stable), each group padded to a multiple of block_size
    with the sentinel M*k; an expert without pairs gets no group. Slots from num_padded to
    max_padded = M*k + num_experts*(block_size-1) hold the sentinel too. expert_ids[b] is the
    expert of slots b*block_size.., -1 for tiles at or past num_padded.
    """
    assert topk_ids.dtype == torch.int32 and topk_ids.dim() == 2 and topk_ids.is_contiguous()
    assert block_size >= 1 and num_experts >= 1
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_padded = max_padded_slots(num_pairs, block_size, num_experts)
    num_blocks = max_padded // block_size
    block_e = triton.next_power_of_2(num_experts)
    block_t = max(16, min(256, 8192 // block_e))
    num_chunks = max(1, triton.cdiv(num_pairs, block_t))
    counts = torch.empty(num_chunks, block_e, dtype=torch.int32, device=device)
    chunk_base = torch.empty_like(counts)
    expert_start = torch.empty(block_e, dtype=torch.int32, device=device)
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    pdl = pdl_options(device)
    _moe_count_kernel[(num_chunks,)](topk_ids, counts, num_pairs, BLOCK_T=block_t,
                                     BLOCK_E=block_e, **pdl)
    _moe_prefix_kernel[(1,)](
        counts, chunk_base, expert_start, sorted_ids, expert_ids, num_padded, num_chunks,
        num_pairs, max_padded, num_blocks, BLOCK_SIZE=block_size,
        BLOCK_PAD=triton.next_power_of_2(block_size), BLOCK_C=max(1, 2048 // block_e),
        BLOCK_E=block_e, BLOCK_B=max(16, 8192 // block_e), **pdl)
    _moe_scatter_kernel[(num_chunks,)](topk_ids, chunk_base, expert_start, sorted_ids,
                                       num_pairs, BLOCK_T=block_t, BLOCK_E=block_e, **pdl)
    return sorted_ids, expert_ids, num_padded


# ---------------------------------------------------------------------------------------------
# the grouped GEMMs


@triton.jit
def _tile_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """The pair index of each row of tile pid_m and whether it is a pair (not the sentinel)."""
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return pairs, pairs < num_pairs


@triton.jit
def _moe_gate_up_kernel(
    hidden_ptr,  # [M, H]
    w13_ptr,  # [E, 2I, H]: gate rows 0..I-1, up rows I..2I-1
    act_ptr,  # [M*k, I] out: silu(gate) * up of each pair, in hidden's dtype
    sorted_ids_ptr,  # [max_padded] int32
    expert_ids_ptr,  # [max_padded // BLOCK_M] int32, -1 = skip
    num_pairs,
    top_k,
    hidden_size,
    inter_size,
    stride_hm,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,  # tl.dot's input_precision ("ieee" for float32 inputs)
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    num_n = tl.cdiv(inter_size, BLOCK_N)
    # n fastest: the programs of one tile read its gathered rows while they are in L2
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return
    pairs, is_pair = _tile_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    tokens = tl.where(is_pair, pairs // top_k, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = hidden_ptr + tokens[:, None] * stride_hm + offs_k[None, :]
    # weight tiles [BLOCK_K, BLOCK_N], read transposed out of the [2I, H] rows
    g_ptrs = (w13_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None])
    u_ptrs = g_ptrs + inter_size * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        k_ok = k0 + offs_k < hidden_size
        x = tl.load(x_ptrs + k0, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
        w_ok = k_ok[:, None] & col_ok[None, :]
        acc_g = tl.dot(x, tl.load(g_ptrs + k0, mask=w_ok, other=0.0), acc_g,
                       input_precision=PRECISION)
        acc_u = tl.dot(x, tl.load(u_ptrs + k0, mask=w_ok, other=0.0), acc_u,
                       input_precision=PRECISION)
    act = acc_g / (1.0 + tl.math.exp2(-acc_g * 1.4426950408889634)) * acc_u
    out = act_ptr + pairs[:, None].to(tl.int64) * inter_size + cols[None, :]
    tl.store(out, act.to(act_ptr.dtype.element_ty), mask=is_pair[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr,  # [M*k, I]
    w2_ptr,  # [E, H, I]
    weights_ptr,  # [M*k] float32 routing weights
    out_ptr,  # [M*k, H] out: weight * (w2[e] @ act) of each pair, in hidden's dtype
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    hidden_size,
    inter_size,
    stride_we,
    stride_wn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    num_n = tl.cdiv(hidden_size, BLOCK_N)
    pid_m = tl.program_id(0) // num_n
    pid_n = tl.program_id(0) % num_n
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:
        return
    pairs, is_pair = _tile_pairs(sorted_ids_ptr, pid_m, num_pairs, BLOCK_M)
    rows = tl.where(is_pair, pairs, 0).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden_size
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + rows[:, None] * inter_size + offs_k[None, :]
    w_ptrs = (w2_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn
              + offs_k[:, None])
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = k0 + offs_k < inter_size
        a = tl.load(a_ptrs + k0, mask=is_pair[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
    acc *= tl.load(weights_ptr + rows, mask=is_pair, other=0.0)[:, None]
    out = out_ptr + rows[:, None] * hidden_size + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=is_pair[:, None] & col_ok[None, :])


@triton.jit
def _moe_sum_kernel(
    rows_ptr,  # [M, TOP_K, H]
    out_ptr,  # [M, H]
    hidden_size,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden_size
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(TOP_K):
        acc += tl.load(rows_ptr + (token * TOP_K + j) * hidden_size + cols, mask=mask,
                       other=0.0).to(tl.float32)
    tl.store(out_ptr + token * stride_om + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# a few pairs: a GEMV each


@triton.jit
def _moe_pair_gate_up_kernel(
    hidden_ptr,  # [M, H]
    w13_ptr,  # [E, 2I, H]
    act_ptr,  # [M*k, I] out: silu(gate) * up of each pair, in hidden's dtype
    ids_ptr,  # [M*k] int32, the flattened topk_ids
    arrivals_ptr,  # [num_arrivals] int32 out: zeroed here for the down kernel
    num_arrivals,
    top_k,
    hidden_size,
    inter_size,
    stride_hm,
    stride_we,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # inter_size % BLOCK_N == 0 and hidden_size % BLOCK_K == 0
    USE_PDL: tl.constexpr,
):
    num_n = tl.cdiv(inter_size, BLOCK_N)
    pair = tl.program_id(0) // num_n
    cols = (tl.program_id(0) % num_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    wait_for_inputs(USE_PDL)
    for a in range(tl.program_id(0), num_arrivals, tl.num_programs(0)):
        tl.store(arrivals_ptr + a, 0)
    token = (pair // top_k).to(tl.int64)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    g_ptrs = (w13_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
              + offs_k[None, :])
    u_ptrs = g_ptrs + inter_size * stride_wn
    x_ptrs = hidden_ptr + token * stride_hm + offs_k
    acc_g = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_u = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        x = tl.load(x_ptrs + k0, mask=k0 + offs_k < hidden_size, other=0.0)
        x = x.to(tl.float32)[None, :]
        acc_g += weight_tile(g_ptrs, cols, offs_k, k0, inter_size, hidden_size, EVEN) * x
        acc_u += weight_tile(u_ptrs, cols, offs_k, k0, inter_size, hidden_size, EVEN) * x
    g = tl.sum(acc_g, 1)
    act = g / (1.0 + tl.math.exp2(-g * 1.4426950408889634)) * tl.sum(acc_u, 1)
    tl.store(act_ptr + pair.to(tl.int64) * inter_size + cols, act.to(act_ptr.dtype.element_ty),
             mask=cols < inter_size)


@triton.jit
def _moe_pair_down_kernel(
    act_ptr,  # [M*k, I]
    w2_ptr,  # [E, H, I]
    weights_ptr,  # [M*k] float32 routing weights
    ids_ptr,  # [M*k] int32
    rows_ptr,  # [M*k, H] out: weight * (w2[e] @ act) of each pair, in hidden's dtype
    arrivals_ptr,  # [M, cdiv(H, BLOCK_N)] int32, zeroed by the gate_up kernel
    out_ptr,  # [M, H] out: the sum of each token's k rows
    hidden_size,
    inter_size,
    stride_we,
    stride_wn,
    stride_om,
    TOP_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # hidden_size % BLOCK_N == 0 and inter_size % BLOCK_K == 0
    USE_PDL: tl.constexpr,
):
    num_n = tl.cdiv(hidden_size, BLOCK_N)
    pair = (tl.program_id(0) // num_n).to(tl.int64)
    block = tl.program_id(0) % num_n
    cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # the routing finished before the gate_up kernel let this one launch (gate_up waited for
    # it), so the expert and the first weight tile load while gate_up is still finishing; past
    # L1, which may hold an earlier step's at the same address
    expert = tl.load(ids_ptr + pair, cache_modifier=".cg").to(tl.int64)
    weight = tl.load(weights_ptr + pair, cache_modifier=".cg")
    w_ptrs = (w2_ptr + expert * stride_we + cols[:, None].to(tl.int64) * stride_wn
              + offs_k[None, :])
    w_next = weight_tile(w_ptrs, cols, offs_k, 0, hidden_size, inter_size, EVEN)
    wait_for_inputs(USE_PDL)
    a_ptrs = act_ptr + pair * inter_size + offs_k
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        w = w_next
        # past the last tile the mask is all false: no memory is read
        w_next = weight_tile(w_ptrs, cols, offs_k, k0 + BLOCK_K, hidden_size, inter_size,
                             False)
        a = tl.load(a_ptrs + k0, mask=k0 + offs_k < inter_size, other=0.0)
        acc += w.to(tl.float32) * a.to(tl.float32)[None, :]
    col_ok = cols < hidden_size
    row = tl.sum(acc, 1) * weight
    tl.store(rows_ptr + pair * hidden_size + cols, row.to(rows_ptr.dtype.element_ty), mask=col_ok)
    # every thread's stores before the arrival (the atomic releases them device-wide)
    tl.debug_barrier()
    token = pair // TOP_K
    arrival = arrivals_ptr + token * num_n + block
    if tl.atomic_add(arrival, 1, sem="acq_rel", scope="gpu") == TOP_K - 1:
        # the last of the token's pairs here: its k rows are written, sum them in slot order
        total = tl.zeros([BLOCK_N], tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(rows_ptr + (token * TOP_K + j) * hidden_size + cols, mask=col_ok,
                             other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(out_ptr + token * stride_om + cols, total.to(out_ptr.dtype.element_ty),
                 mask=col_ok)


def fused_moe_pairs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                    gate_up_config: tuple[int, int, int] = PAIR_GATE_UP_CONFIG,
                    down_config: tuple[int, int, int] = PAIR_DOWN_CONFIG) -> torch.Tensor:
    """fused_moe with each (token, expert) pair a GEMV (the arguments and the result as there);
    the configs are (BLOCK_N, BLOCK_K, num_warps) of the gate_up and the down kernel."""
    num_tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    inter_size = w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    device, dtype = hidden.device, hidden.dtype
    weights, ids = topk_weights.contiguous().view(-1), topk_ids.contiguous().view(-1)
    out = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
    act = torch.empty(num_pairs, inter_size, dtype=dtype, device=device)
    rows = torch.empty(num_pairs, hidden_size, dtype=dtype, device=device)
    pdl = pdl_options(device)
    up_n, up_k, up_warps = gate_up_config
    down_n, down_k, down_warps = down_config
    up_k = min(up_k, triton.next_power_of_2(hidden_size))
    down_k = min(down_k, triton.next_power_of_2(inter_size))
    num_down_n = triton.cdiv(hidden_size, down_n)
    arrivals = torch.empty(num_tokens, num_down_n, dtype=torch.int32, device=device)
    _moe_pair_gate_up_kernel[(num_pairs * triton.cdiv(inter_size, up_n),)](
        hidden, w13, act, ids, arrivals, arrivals.numel(), top_k, hidden_size, inter_size,
        hidden.stride(0), w13.stride(0), w13.stride(1), BLOCK_N=up_n, BLOCK_K=up_k,
        EVEN=inter_size % up_n == 0 and hidden_size % up_k == 0, num_warps=up_warps, **pdl)
    _moe_pair_down_kernel[(num_pairs * num_down_n,)](
        act, w2, weights, ids, rows, arrivals, out, hidden_size, inter_size, w2.stride(0),
        w2.stride(1), out.stride(0), TOP_K=top_k, BLOCK_N=down_n, BLOCK_K=down_k,
        EVEN=hidden_size % down_n == 0 and inter_size % down_k == 0, num_warps=down_warps,
        **pdl)
    return out


def fused_moe_from_logits(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                          router_logits: torch.Tensor, top_k: int,
                          renormalize: bool) -> torch.Tensor:
    """The whole MoE MLP from the router's logits [M, E]: moe_routing's weights and experts,
    then fused_moe's result. (Routing inside the pair GEMVs instead, which saves the routing
    launch, lost on an H100: e3d54d2, docs/benchmarks.md.)"""
    assert router_logits.dim() == 2 and router_logits.stride(1) == 1
    num_tokens = hidden.shape[0]
    assert router_logits.shape == (num_tokens, w13.shape[0]) and 1 <= top_k <= w13.shape[0]
    return fused_moe(hidden, w13, w2, *moe_routing(router_logits, top_k, renormalize))


def _check_moe_inputs(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> None:
    assert hidden.dim() == 2 and hidden.stride(1) == 1
    num_experts, two_inter, hidden_size = w13.shape
    assert hidden.shape[1] == hidden_size and w13.stride(2) == 1
    assert w2.shape == (num_experts, hidden_size, two_inter // 2) and w2.stride(2) == 1
    assert w13.dtype == w2.dtype == hidden.dtype


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              block_m: int | None = None, block_n: int | None = None,
              block_k: int | None = None, num_warps: int | None = None,
              num_stages: int | None = None, pairs: bool | None = None) -> torch.Tensor:
    """hidden [M, H], w13 [E, 2I, H] (gate rows, then up: transformers' Qwen3-MoE
    experts.gate_up_proj), w2 [E, H, I], topk_weights [M, k] float32, topk_ids [M, k] int32
    -> out [M, H] in hidden's dtype: out[t] = sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u)
    with [g; u] = w13[e] @ hidden[t], e = topk_ids[t, j].

    Products accumulate in float32; silu(g) * u and each pair's weighted row are rounded to
    hidden's dtype (what the next GEMM and the k-way sum read), the sum over k is float32.
    `pairs` (each pair a GEMV, fused_moe_pairs) defaults to at most PAIR_MAX pairs; otherwise
    the grouped GEMMs' tiles (block_m, also the sorted groups' padding) default to a config
    chosen by M. The overrides are for bench_kernels' sweep and the tests.
    """
    _check_moe_inputs(hidden, w13, w2)
    num_tokens, hidden_size = hidden.shape
    num_experts, two_inter, _ = w13.shape
    inter_size = two_inter // 2
    assert topk_ids.dtype == torch.int32 and topk_weights.dtype == torch.float32
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    top_k = topk_ids.shape[1]
    num_pairs = topk_ids.numel()
    if not num_tokens:
        return torch.empty(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if pairs is None:
        pairs = num_pairs <= PAIR_MAX
    if pairs:
        return fused_moe_pairs(hidden, w13, w2, topk_weights, topk_ids)
    tile_m, tile_n, tile_k, warps = _gemm_config(num_tokens)
    # the tiles were tuned for 2-byte weights: float32 halves BLOCK_K to keep their shared
    # memory (in float32 the 64-token tile needed 272 KiB, over the H200's 227)
    tile_k = tile_k * 2 // hidden.element_size()
    block_m, block_n, block_k = block_m or tile_m, block_n or tile_n, block_k or tile_k
    sorted_ids, expert_ids, _ = moe_align_block_size(topk_ids.contiguous(), block_m,
                                                     num_experts)
    num_m = expert_ids.shape[0]
    act = torch.empty(num_pairs, inter_size, dtype=hidden.dtype, device=hidden.device)
    rows = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    out = torch.empty(num_tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    pdl = pdl_options(hidden.device)
    gemm = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "PRECISION": precision,
            "num_warps": num_warps or warps, **pdl}
    if num_stages is not None:
        gemm["num_stages"] = num_stages
    _moe_gate_up_kernel[(num_m * triton.cdiv(inter_size, block_n),)](
        hidden, w13, act, sorted_ids, expert_ids, num_pairs, top_k, hidden_size, inter_size,
        hidden.stride(0), w13.stride(0), w13.stride(1), **gemm)
    _moe_down_kernel[(num_m * triton.cdiv(hidden_size, block_n),)](
        act, w2, topk_weights.contiguous(), rows, sorted_ids, expert_ids, num_pairs,
        hidden_size, inter_size, w2.stride(0), w2.stride(1), **gemm)
    block = min(1024, triton.next_power_of_2(hidden_size))
    _moe_sum_kernel[(num_tokens, triton.cdiv(hidden_size, block))](
        rows, out, hidden_size, out.stride(0), TOP_K=top_k, BLOCK=block, **pdl,
        num_warps=max(1, min(4, block // 256)))
    return out
