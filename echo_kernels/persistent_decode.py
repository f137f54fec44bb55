"""One decode step of a Llama/Qwen3/Qwen3-MoE model at batch 1 in one persistent launch.

At batch 1 a step reads every weight once, and each launch streams only a few MB: on an H200
Qwen3-0.6B's 112 GEMVs reach under 40% of the copy bandwidth one launch at a time, and the
step costs twice its weights' read time (docs/benchmarks.md, Decode latency at batch 1). Here
a grid of co-resident programs walks every layer in one launch; grid-wide barriers separate
the phases whose inputs are a whole vector that other programs wrote (attention, which needs
only its head's rows, waits on a count per KV head instead: _mark_qkv_ready):

  qkv        the residual sum, its RMSNorm (every program computes it: the vector is a few KB)
             and the q/k/v GEMV
  attention  per (KV head, key split): Qwen3's q/k norm, RoPE, the new K/V into the paged
             cache (the last split, which reads that token), online softmax over the split;
             the last split of a KV head to finish merges the splits (an arrival count)
  o_proj     the GEMV plus the residual
  gate_up    the norm again, the gate and up GEMVs, SwiGLU (a program's row block holds the
             same rows of both)
  down       the GEMV; the next layer's qkv phase adds the residual

or, where every layer's MLP is a mixture of experts, in place of the last two:

  router     the norm, the router's logits
  experts    every program routes for itself (softmax, top-k, renormalized), then the chosen
             experts' gate_up rows and SwiGLU, [top_k, I]
  down       each row block of the output sums the k experts' down projections by weight

and a last phase norms the residual stream for the LM head (which stays a cuBLAS call). Every
GEMV phase streams a program's rows in [BLOCK_N, BLOCK_K] tiles, several in flight through
shared memory (Triton's pipeliner), one stream across its row blocks (_gemv_stream). Rounding
follows the separate kernels' (norm.py, activation.py, the attention kernels): the same points
in the model dtype, float32 arithmetic.

The grid must be co-resident, or a barrier would wait forever: PersistentDecode sizes it from
the compiled kernel's occupancy, and a barrier that polls past SPIN_LIMIT gives up and sets an
error flag instead of hanging. Triton's interpreter runs programs one after another, so on the
CPU each phase is a launch of its own (PersistentDecode.__call__), the same code without the
barriers.
"""

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from echo_kernels.attention.common import LOG2E, online_softmax_step
from echo_kernels.awq import _ONE_BITS, _group_offsets, _unpack_offsets
from echo_kernels.device import sm_count
from echo_kernels.fused_moe import route_row
from echo_kernels.norm import apply_rms
from echo_kernels.rope import rotated_rows

# the pointer table's columns (pointer_table): each layer's tensors, by address. The four
# linear layers' weights first (a mixture of experts: gate_up and down are the stacked experts
# [E, 2I, H] and [E, H, I]; AWQ: qweight [K, N / 8]), then, with AWQ weights, their qzeros
# LINEARS columns after each weight and their scales 2 * LINEARS after
_LINEARS = ("qkv", "o_proj", "gate_up", "down")
COLUMNS = (*_LINEARS, *(f"{name}_zeros" for name in _LINEARS),
           *(f"{name}_scales" for name in _LINEARS),
           "in_norm", "q_norm", "k_norm", "post_norm", "k_cache", "v_cache", "router")
(QKV, O_PROJ, GATE_UP, DOWN), LINEARS = (
    tuple(tl.constexpr(column) for column in range(len(_LINEARS))), tl.constexpr(len(_LINEARS)))
IN_NORM, Q_NORM, K_NORM, POST_NORM, K_CACHE, V_CACHE, ROUTER = (
    tl.constexpr(COLUMNS.index(name)) for name in COLUMNS[3 * len(_LINEARS):])
NUM_POINTERS = tl.constexpr(len(COLUMNS))
# sync buffer: barrier arrivals, programs done, error flag, then per KV head the attention
# splits' arrival count and its qkv rows' (_mark_qkv_ready), then the AWQ column blocks'
SYNC_ARRIVALS, SYNC_DONE, SYNC_ERROR, SYNC_HEADS = (tl.constexpr(i) for i in range(4))
SPIN_LIMIT = tl.constexpr(1 << 22)


@triton.jit
def _grid_barrier(sync_ptr, target):
    """Wait until `target` arrivals in all (every program once a barrier since the launch)."""
    tl.debug_barrier()  # this program's stores before its arrival (the atomic releases them)
    tl.atomic_add(sync_ptr + SYNC_ARRIVALS, 1, sem="release", scope="gpu")
    _wait_for(sync_ptr + SYNC_ARRIVALS, target, sync_ptr)


@triton.jit
def _wait_for(count_ptr, target, sync_ptr):
    """Poll the count until it reaches target; past SPIN_LIMIT polls give up and set the error
    flag instead of hanging."""
    polls = 0
    # NOTE: the add of 0 compiles to an acquire load, not an atomic (sm_90 SASS: LDG.STRONG.GPU
    # then CCTL.IVALL, which drops this SM's L1 lines): polls do not queue on the address, and
    # every load after the wait reads what the other programs wrote
    while (tl.atomic_add(count_ptr, 0, sem="acquire", scope="gpu") < target) & (
            polls < SPIN_LIMIT):
        polls += 1
    if polls >= SPIN_LIMIT:
        tl.store(sync_ptr + SYNC_ERROR, 1)
    tl.debug_barrier()


@triton.jit
def _mark_qkv_ready(ready_ptr, first, end, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr):
    """After this program stored the qkv outputs [first, end): an arrival at each KV head any
    of whose q, k or v rows lie there (ready_ptr [KV_HEADS]). The attention of a head waits
    for its own rows (_wait_qkv_ready), not for the whole GEMV behind a grid barrier."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    h = tl.arange(0, triton.next_power_of_2(KV_HEADS))
    q = h * GROUP * HEAD_DIM
    k = (HEADS + h) * HEAD_DIM
    v = (HEADS + KV_HEADS + h) * HEAD_DIM
    touched = (((first < q + GROUP * HEAD_DIM) & (q < end)) | ((first < k + HEAD_DIM) & (k < end))
               | ((first < v + HEAD_DIM) & (v < end)))
    tl.debug_barrier()  # every thread's stores before the arrivals (the atomics release them)
    tl.atomic_add(ready_ptr + h, 1, mask=touched & (h < KV_HEADS) & (first < end),
                  sem="release", scope="gpu")


@triton.jit
def _qkv_units(kv_head, unit, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr):
    """How many of the qkv GEMV's units (output runs [u * unit, (u + 1) * unit), each marked
    once by the program that stores it) hold any of the KV head's q, k or v rows."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    q0 = kv_head * GROUP * HEAD_DIM // unit
    q1 = ((kv_head + 1) * GROUP * HEAD_DIM - 1) // unit
    k0 = (HEADS + kv_head) * HEAD_DIM // unit
    k1 = ((HEADS + kv_head + 1) * HEAD_DIM - 1) // unit
    v0 = (HEADS + KV_HEADS + kv_head) * HEAD_DIM // unit
    v1 = ((HEADS + KV_HEADS + kv_head + 1) * HEAD_DIM - 1) // unit
    # the three runs of units are in order; neighbours may share their end unit
    return (q1 - q0 + 1) + (k1 - k0 + 1) + (v1 - v0 + 1) - (q1 == k0) - (k1 == v0)


@triton.jit
def _wait_qkv_ready(sync_ptr, ready_ptr, expected, BARRIERS: tl.constexpr):
    """Wait until `expected` units of the head's qkv rows have arrived. Without barriers (the
    interpreter, a launch a phase) the qkv phase has run: the count must be exact."""
    if BARRIERS:
        _wait_for(ready_ptr, expected, sync_ptr)
    elif tl.load(ready_ptr) != expected:
        tl.store(sync_ptr + SYNC_ERROR, 1)
    tl.debug_barrier()


@triton.jit
def _pointer(table_ptr, layer, column, dtype: tl.constexpr):
    """Column `column` of the layer's row of the pointer table, as a pointer to dtype. Torch
    allocations start 16-byte aligned (pointer_table checks): said here, Triton vectorises the
    loads through it (16-bit loads otherwise, from a pointer it knows nothing about)."""
    address = tl.load(table_ptr + layer * NUM_POINTERS + column)
    return tl.multiple_of(address.to(tl.pointer_type(dtype)), 16)


@triton.jit
def _block_rows(first, end, N, GATED: tl.constexpr, BLOCK_N: tl.constexpr):
    """The weight rows of the row block whose outputs start at `first`, and which of them are
    real (outputs before `end`). GATED (gate_up, N = 2I, outputs j < I): the first half of the
    block are gate rows j, the second half the up rows I + j of the same j."""
    offs = tl.arange(0, BLOCK_N)
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        j = first + offs % HALF
        return tl.where(offs < HALF, j, N // 2 + j), j < end
    rows = first + offs
    return rows, rows < end


@triton.jit
def _phase_span(N, GATED: tl.constexpr, BALANCED: tl.constexpr, BLOCK_N: tl.constexpr):
    """(first output, end, step) of this program's row blocks in a GEMV phase of N weight rows.
    Strided: the blocks pid, pid + grid, ... of BLOCK_N rows. BALANCED: an equal run of
    outputs a program, in blocks: no program reads more than one block beyond the others, so
    the phase's tail does not run on a few programs' loads alone (512 blocks for 396 programs
    would leave 116 programs streaming a second block while the rest wait)."""
    grid = tl.num_programs(0)
    per_block: tl.constexpr = BLOCK_N // (1 + GATED)
    outputs = N // (1 + GATED)
    if BALANCED:
        per_program = tl.cdiv(outputs, grid)
        first = tl.program_id(0) * per_program
        return first, tl.minimum(first + per_program, outputs), per_block
    return tl.program_id(0) * per_block, outputs, per_block * grid


# what a stream of GEMV row blocks is (_gemv_stream): row blocks of one weight; gate_up row
# blocks of the routed experts ([top_k, I] outputs); or each row block's top_k experts' down
# projections summed by their routing weights
ROWS, EXPERT_ROWS, EXPERT_SUM = (tl.constexpr(i) for i in range(3))


@triton.jit
def _tile(w_base, rows, ok, k0, K: tl.constexpr, EVEN: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [rows, k0:k0 + BLOCK_K] weight tile; rows not ok (and columns past K) read nothing."""
    offs_k = tl.arange(0, BLOCK_K)
    ptrs = w_base + rows[:, None].to(tl.int64) * K + k0 + offs_k[None, :]
    if EVEN:
        w = tl.load(ptrs, mask=ok[:, None], other=0.0)
    else:
        w = tl.load(ptrs, mask=ok[:, None] & (k0 + offs_k[None, :] < K), other=0.0)
    return w


@triton.jit
def _segment(seg, MODE: tl.constexpr, w_ptr, first, end, step, route_ids, N: tl.constexpr,
             K: tl.constexpr, BLOCK_N: tl.constexpr, TOP_K: tl.constexpr,
             BLOCK_TOPK: tl.constexpr):
    """Row block `seg` of this program's stream (_gemv_stream): (its weight's base, its first
    output, the end of the outputs, its top-k slot)."""
    if MODE == ROWS:
        base = w_ptr
        o0 = first + seg * step
        stop = end
        j = seg * 0
    else:
        if MODE == EXPERT_ROWS:  # blocks pid, pid + grid, ... of [top_k, N / 2 outputs]
            per_expert: tl.constexpr = (N // 2 + BLOCK_N // 2 - 1) // (BLOCK_N // 2)
            block = tl.program_id(0) + seg * tl.num_programs(0)
            j = block // per_expert
            o0 = block % per_expert * (BLOCK_N // 2)
            stop = N // 2
        else:  # EXPERT_SUM: the k experts of each of the program's row blocks in turn
            j = seg % TOP_K
            o0 = first + seg // TOP_K * step
            stop = end
        slots = tl.arange(0, BLOCK_TOPK)
        expert = tl.sum(tl.where(slots == j, route_ids, 0)).to(tl.int64)
        base = w_ptr + expert * (N * K)
    return base, o0, stop, j


@triton.jit
def _gemv_stream(w_ptr, x_ptr, out_ptr, resid_ptr, first, end, step, route_w, route_ids,
                 MODE: tl.constexpr, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
                 EPILOGUE: tl.constexpr, EVEN: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, TOP_K: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                 STAGES: tl.constexpr, dtype: tl.constexpr):
    """This program's row blocks of W[N, K] @ x (_segment: MODE) as one stream of tiles,
    STAGES - 1 of them in flight from the first to the last, across blocks (a loop a block
    left each block's first tile a memory latency to wait for: a routed expert's down
    projection is three tiles of 256 at Qwen3-30B-A3B's shapes, and a phase of two latency-
    bound tiles a program took 7-10 us on the H200 whatever its size).

    Epilogues at a block's end: ROWS as EPILOGUE says (_epilogue); EXPERT_ROWS SwiGLU into
    out_ptr[slot] from the float32 sums (fused_moe's pair kernel); EXPERT_SUM each expert's
    weighted rows rounded, the k summed in slot order, stored after the last (fused_moe's)."""
    TILES: tl.constexpr = (K + BLOCK_K - 1) // BLOCK_K
    if MODE == ROWS:
        count = tl.cdiv(end - first, step)
    elif MODE == EXPERT_ROWS:
        per_expert: tl.constexpr = (N // 2 + BLOCK_N // 2 - 1) // (BLOCK_N // 2)
        count = tl.cdiv(TOP_K * per_expert - tl.program_id(0), tl.num_programs(0))
    else:
        count = tl.cdiv(end - first, step) * TOP_K
    count = tl.maximum(count, 0)
    slots = tl.arange(0, BLOCK_TOPK)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    total = tl.zeros([BLOCK_N], tl.float32)
    # NOTE: every tile's address is a function of t alone, so Triton's pipeliner can stage
    # STAGES - 1 tiles ahead through shared memory (cp.async), across blocks
    for t in tl.range(0, count * TILES, num_stages=STAGES):
        kk = t % TILES
        base, o0, stop, j = _segment(t // TILES, MODE, w_ptr, first, end, step, route_ids, N, K,
                                     BLOCK_N, TOP_K, BLOCK_TOPK)
        rows, ok = _block_rows(o0, stop, N, GATED, BLOCK_N)
        w = _tile(base, rows, ok, kk * BLOCK_K, K, EVEN, BLOCK_K)
        # another program wrote x: read it from L2 (.cg), never a stale L1 line
        x_at = x_ptr + kk * BLOCK_K + offs_k[None, :]
        if MODE == EXPERT_SUM:
            x_at += j * K  # each slot's SwiGLU output
        if EVEN:
            x = tl.load(x_at, cache_modifier=".cg")
        else:
            x = tl.load(x_at, mask=kk * BLOCK_K + offs_k[None, :] < K, other=0.0,
                        cache_modifier=".cg")
        acc += w.to(tl.float32) * x.to(tl.float32)
        if kk == TILES - 1:
            y = tl.sum(acc, 1)
            acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
            if MODE == ROWS:
                _epilogue(y, rows, ok, o0, stop, out_ptr, resid_ptr, EPILOGUE, BLOCK_N, dtype)
            elif MODE == EXPERT_ROWS:
                _store_swiglu(y, o0, stop, out_ptr + j * (N // 2), BLOCK_N, dtype, True)
            else:
                weight = tl.sum(tl.where(slots == j, route_w, 0.0))
                total += (weight * y).to(dtype).to(tl.float32)
                if j == TOP_K - 1:
                    tl.store(out_ptr + rows, total.to(dtype), mask=ok)
                    total = tl.zeros([BLOCK_N], tl.float32)


@triton.jit
def _residual_sum(resid_ptr, delta_ptr, add_delta, cols, H: tl.constexpr, dtype: tl.constexpr):
    """resid + delta (delta when add_delta) at cols, rounded to dtype as the model's sum is."""
    mask = cols < H
    r = tl.load(resid_ptr + cols, mask=mask, other=0.0, cache_modifier=".cg")
    d = tl.load(delta_ptr + cols, mask=mask & add_delta, other=0.0, cache_modifier=".cg")
    return (r.to(tl.float32) + d.to(tl.float32)).to(dtype)


@triton.jit
def _normed_input(resid_ptr, delta_ptr, add_delta, w_ptr, xn_ptr, sum_ptr, eps,
                  H: tl.constexpr, BLOCK: tl.constexpr, dtype: tl.constexpr):
    """xn = RMSNorm(resid + delta) (delta when add_delta), written to xn_ptr by every program
    (the same values: each needs all of it for its GEMV rows); the sum also to sum_ptr by
    program 0 when sum_ptr is given. fused_add_rms_norm's rounding. One load of the vector
    when BLOCK covers H (the pass is a chain of memory latencies: two of them a pass of 512
    columns at Qwen3-0.6B's 1024 cost ~2 us a phase); else two passes of BLOCK columns (the
    sum recomputed from L2 rather than held: registers bound the grid)."""
    offs = tl.arange(0, BLOCK)
    if BLOCK >= H:
        s = _residual_sum(resid_ptr, delta_ptr, add_delta, offs, H, dtype)
        w = tl.load(w_ptr + offs, mask=offs < H)
        if sum_ptr is not None:
            if tl.program_id(0) == 0:
                tl.store(sum_ptr + offs, s, mask=offs < H)
        sf = s.to(tl.float32)
        rstd = tl.math.rsqrt(tl.sum(sf * sf, 0) / H + eps)
        tl.store(xn_ptr + offs, apply_rms(sf, rstd, w, dtype), mask=offs < H)
    else:
        squares = tl.zeros([BLOCK], tl.float32)
        for c0 in tl.range(0, H, BLOCK):
            s = _residual_sum(resid_ptr, delta_ptr, add_delta, c0 + offs, H, dtype)
            if sum_ptr is not None:
                if tl.program_id(0) == 0:
                    tl.store(sum_ptr + c0 + offs, s, mask=c0 + offs < H)
            sf = s.to(tl.float32)
            squares += sf * sf
        rstd = tl.math.rsqrt(tl.sum(squares, 0) / H + eps)
        for c0 in tl.range(0, H, BLOCK):
            cols = c0 + offs
            s = _residual_sum(resid_ptr, delta_ptr, add_delta, cols, H, dtype)
            w = tl.load(w_ptr + cols, mask=cols < H)
            tl.store(xn_ptr + cols, apply_rms(s.to(tl.float32), rstd, w, dtype), mask=cols < H)
    tl.debug_barrier()  # every thread's part of xn written before any thread reads it


@triton.jit
def _attention_item(table_ptr, layer, item, qkv_ptr, attn_ptr, part_ptr, sync_ptr,
                    block_table_ptr, seq_len, pos, slot, cos_sin_ptr, stride_cos,
                    stride_kb, stride_kt, stride_kh, qk_scale, eps, n_splits, per_split,
                    qkv_unit, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                    HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, BLOCK_T: tl.constexpr, HAS_QK_NORM: tl.constexpr,
                    BARRIERS: tl.constexpr, dtype: tl.constexpr, cache_dtype: tl.constexpr):
    """One (KV head, key split) of the step's attention, once the head's qkv rows are stored
    (qkv_unit: _qkv_units'); the split that finishes last for its KV head merges them all
    into attn_ptr."""
    GROUP: tl.constexpr = HEADS // KV_HEADS
    kv_head = item % KV_HEADS
    split = item // KV_HEADS
    g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    q_norm = _pointer(table_ptr, layer, Q_NORM, dtype)
    k_norm = _pointer(table_ptr, layer, K_NORM, dtype)
    k_cache = _pointer(table_ptr, layer, K_CACHE, cache_dtype)
    v_cache = _pointer(table_ptr, layer, V_CACHE, cache_dtype)
    ready = sync_ptr + SYNC_HEADS + KV_HEADS + kv_head
    _wait_qkv_ready(sync_ptr, ready,
                    _qkv_units(kv_head, qkv_unit, HEADS, KV_HEADS, HEAD_DIM), BARRIERS)
    q = rotated_rows(qkv_ptr, (kv_head * GROUP + g) * HEAD_DIM, g < GROUP, cos_sin_ptr,
                     stride_cos, pos, q_norm, eps, HEAD_DIM, True, HAS_QK_NORM)
    lo = split * per_split
    hi = tl.minimum(lo + per_split, seq_len)
    if (split == n_splits - 1) & (slot >= 0):
        # the new token's K/V, which only this split reads: store, then read back as a key
        one = tl.arange(0, 1)
        k_new = rotated_rows(qkv_ptr, (HEADS + kv_head + one) * HEAD_DIM, one == 0,
                             cos_sin_ptr, stride_cos, pos, k_norm, eps, HEAD_DIM, True,
                             HAS_QK_NORM)
        v_new = tl.load(qkv_ptr + (HEADS + KV_HEADS + kv_head) * HEAD_DIM + offs_d,
                        cache_modifier=".cg")
        at = (slot // BLOCK_SIZE).to(tl.int64) * stride_kb + (slot % BLOCK_SIZE) * stride_kt \
            + kv_head * stride_kh
        tl.store(k_cache + at + one[:, None] * 0 + offs_d[None, :], k_new.to(cache_dtype))
        tl.store(v_cache + at + offs_d, v_new.to(cache_dtype))
        tl.debug_barrier()
    qf = q.to(tl.float32)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    offs_t = tl.arange(0, BLOCK_T)
    # NOTE: staged by Triton's pipeliner (the block ids a stage before their K/V): a key step
    # waited two memory latencies one after the other, ~1 us, four of them a 64-key split
    for t0 in tl.range(lo, hi, BLOCK_T, num_stages=3):
        t = t0 + offs_t
        in_range = t < hi
        blk = tl.load(block_table_ptr + t // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
        at = blk * stride_kb + (t % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_cache + at[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0,
                    cache_modifier=".cg")
        v = tl.load(v_cache + at[:, None] + offs_d[None, :], mask=in_range[:, None], other=0.0,
                    cache_modifier=".cg")
        qk = tl.sum(qf[:, None, :] * k.to(tl.float32)[None, :, :], 2) * qk_scale
        qk = tl.where(in_range[None, :], qk, float("-inf"))
        p, alpha, l_i, m_i = online_softmax_step(l_i, m_i, qk)
        # p rounded to the cache dtype, as the attention kernels' p @ V takes it
        p = p.to(dtype).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :], 1)
    # the split's unnormalised output, max and sum; then its arrival
    part = part_ptr + ((kv_head * SPLITS_PAD + split) * GROUP_PAD + g) * (HEAD_DIM + 2)
    tl.store(part[:, None] + offs_d[None, :], acc)
    tl.store(part + HEAD_DIM, m_i)
    tl.store(part + HEAD_DIM + 1, l_i)
    tl.debug_barrier()  # every thread's stores before the arrival (the atomic releases them)
    arrivals = sync_ptr + SYNC_HEADS + kv_head
    if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == n_splits - 1:
        # for the next layer: every split of this one has arrived (and so has passed its wait)
        tl.store(arrivals, 0)
        tl.store(ready, 0)
        s = tl.arange(0, SPLITS_PAD)
        parts = part_ptr + ((kv_head * SPLITS_PAD + s[:, None]) * GROUP_PAD + g[None, :]) \
            * (HEAD_DIM + 2)  # [SPLITS_PAD, GROUP_PAD]
        s_ok = (s < n_splits)[:, None]
        m = tl.load(parts + HEAD_DIM, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(parts + HEAD_DIM + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
        m_max = tl.max(m, 0)
        w = tl.where(s_ok, tl.math.exp2(m - m_max[None, :]), 0.0)
        denom = tl.sum(w * l_s, 0)
        # the outputs a split at a time: [SPLITS_PAD, GROUP_PAD, HEAD_DIM] at once would
        # take more registers than the rest of the kernel
        out = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for i in tl.range(0, n_splits, num_stages=3):
            part_i = part_ptr + ((kv_head * SPLITS_PAD + i) * GROUP_PAD + g) * (HEAD_DIM + 2)
            a = tl.load(part_i[:, None] + offs_d[None, :], cache_modifier=".cg")
            w_i = tl.sum(tl.where(s[:, None] == i, w, 0.0), 0)
            out += a * w_i[:, None]
        out = out / tl.where(denom == 0.0, 1.0, denom)[:, None]
        heads = kv_head * GROUP + g
        tl.store(attn_ptr + heads[:, None] * HEAD_DIM + offs_d[None, :], out.to(dtype),
                 mask=(g < GROUP)[:, None])


@triton.jit
def _after_phase(sync_ptr, barriers, next_phase, phase_hi, BARRIERS: tl.constexpr):
    """The grid barrier between a phase and the next when this launch runs the next (the
    count of barriers so far, updated)."""
    if BARRIERS & (next_phase < phase_hi):
        barriers += 1
        _grid_barrier(sync_ptr, barriers * tl.num_programs(0))
    return barriers


@triton.jit
def _store_swiglu(y, first, end, act_ptr, BLOCK_N: tl.constexpr, dtype: tl.constexpr,
                  EXPERT: tl.constexpr):
    """silu(gate) * up of a gated row block's GEMV outputs y ([gate rows, up rows]) into
    act_ptr[first:end]. Rounding: a dense MLP's as activation.py's on gate_up's stored output;
    an expert's as fused_moe's pair kernel, from the float32 sums, rounded once."""
    if EXPERT:
        gate, up = tl.split(tl.trans(tl.reshape(y, [2, BLOCK_N // 2])))
        act = gate / (1.0 + tl.math.exp2(-gate * 1.4426950408889634)) * up
    else:
        gate, up = tl.split(tl.trans(tl.reshape(y.to(dtype), [2, BLOCK_N // 2])))
        gf = gate.to(tl.float32)
        silu = (gf / (1.0 + tl.math.exp2(-gf * 1.4426950408889634))).to(dtype)
        act = silu.to(tl.float32) * up.to(tl.float32)
    j = first + tl.arange(0, BLOCK_N // 2)
    tl.store(act_ptr + j, act.to(dtype), mask=j < end)


# what a GEMV phase does with its outputs (_gemv_phase)
STORE, ADD_RESIDUAL, SWIGLU = (tl.constexpr(i) for i in range(3))


@triton.jit
def _gemv_phase(w_ptr, x_ptr, out_ptr, resid_ptr, ready_ptr, N: tl.constexpr,
                K: tl.constexpr, GATED: tl.constexpr, EPILOGUE: tl.constexpr,
                EVEN: tl.constexpr, BALANCED: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, STAGES: tl.constexpr, dtype: tl.constexpr):
    """This program's row blocks (_phase_span) of out = W[N, K] @ x (_gemv_stream). EPILOGUE:
    STORE the outputs, ADD_RESIDUAL (out = y + resid, rounded as the model's sum), or SWIGLU
    (GATED blocks of [gate rows, up rows] -> silu(gate) * up, N // 2 outputs). ready_ptr: the
    qkv GEMV's, whose units (a program's run, or a strided block) are marked when stored."""
    first, end, step = _phase_span(N, GATED, BALANCED, BLOCK_N)
    _gemv_stream(w_ptr, x_ptr, out_ptr, resid_ptr, first, end, step, None, None, ROWS, N, K,
                 GATED, EPILOGUE, EVEN, BLOCK_N, BLOCK_K, 1, 1, STAGES, dtype)
    if ready_ptr is not None:
        # after the whole run: one release fence a program, not one a block
        if BALANCED:
            _mark_qkv_ready(ready_ptr, first, end, HEADS, KV_HEADS, HEAD_DIM)
        else:
            for o0 in range(first, end, step):
                _mark_qkv_ready(ready_ptr, o0, tl.minimum(o0 + BLOCK_N, end), HEADS, KV_HEADS,
                                HEAD_DIM)


@triton.jit
def _epilogue(y, rows, ok, first, end, out_ptr, resid_ptr, EPILOGUE: tl.constexpr,
              BLOCK_N: tl.constexpr, dtype: tl.constexpr):
    """A GEMV's float32 outputs y [BLOCK_N] at rows (those ok real) into out_ptr as EPILOGUE
    says (_gemv_phase); SWIGLU: y a gated block ([gate, up] of the outputs first..)."""
    if EPILOGUE == SWIGLU:
        _store_swiglu(y, first, end, out_ptr, BLOCK_N, dtype, False)
    elif EPILOGUE == ADD_RESIDUAL:
        r = tl.load(resid_ptr + rows, mask=ok, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + rows, (y.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype),
                 mask=ok)
    else:
        tl.store(out_ptr + rows, y.to(dtype), mask=ok)


# --- AWQ weights (W4A16) ---
# AWQ's qweight is K-major ([K, N / 8] int32, awq.py), so an output's weights are a column of
# nibbles down every K row, and a program cannot take whole outputs as the phases above do
# (Llama-3.1-8B's o_proj in strips of 256 columns is 16 strips of 1 MB). An AWQ phase splits K
# as awq_gemv does: items of (column block, K split) fill the grid, each adds its rows into
# float32 partial sums, and the last split of a column block to arrive (an acquire-release
# count, as the attention merge) sums the partials in split order and applies the epilogue.
# The arithmetic is awq_gemv's: weights as 1 + q u (_unpack_offsets), zero and scale folded in
# once a group (_group_offsets).


@triton.jit
def _awq_layout(N: tl.constexpr, K: tl.constexpr, COLS: tl.constexpr, BLOCK_K: tl.constexpr,
                SPLITS: tl.constexpr):
    """(column blocks, K splits a block, K tiles a split) of an AWQ phase: splits enough for an
    item a program, at most SPLITS, whole tiles each. (A gated block's COLS / 2 outputs take
    COLS columns: the count is the same.)"""
    blocks = tl.cdiv(N, COLS)
    k_tiles: tl.constexpr = K // BLOCK_K
    splits = tl.minimum(tl.minimum(tl.cdiv(tl.num_programs(0), blocks), SPLITS), k_tiles)
    tiles = tl.cdiv(k_tiles, splits)
    return blocks, tl.cdiv(k_tiles, tiles), tiles


@triton.jit
def _awq_item(item, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
              COLS: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr):
    """Item `item` of an AWQ phase: (column block, split, first and end K tile, its packs
    [COLS / 8] (qweight's int32 columns), which are read, and their output columns [COLS] in
    _unpack_offsets' order). GATED: the first half are gate packs, the second the up packs of
    the same outputs (N / 16 packs on)."""
    blocks, splits, tiles = _awq_layout(N, K, COLS, BLOCK_K, SPLITS)
    block = item // splits
    split = item % splits
    PACKS: tl.constexpr = COLS // 8
    p = tl.arange(0, PACKS)
    if GATED:
        HALF: tl.constexpr = PACKS // 2
        j = block * HALF + p % HALF
        packs = tl.where(p < HALF, j, N // 16 + j)
        ok = j < N // 16
    else:
        packs = block * PACKS + p
        ok = packs < N // 8
    cols = tl.reshape(packs[:, None] * 8 + tl.arange(0, 8)[None, :], [COLS])
    first = split * tiles
    return block, split, first, tl.minimum(first + tiles, K // BLOCK_K), packs, ok, cols


@triton.jit
def _awq_tile(qw_ptr, tile, packs, ok, N: tl.constexpr, BLOCK_K: tl.constexpr):
    """qweight's int32 [BLOCK_K, packs] at K tile `tile`."""
    rows = tile * BLOCK_K + tl.arange(0, BLOCK_K)
    return tl.load(qw_ptr + rows[:, None].to(tl.int64) * (N // 8) + packs[None, :],
                   mask=ok[None, :], other=0)


@triton.jit
def _awq_phase(qw_ptr, qz_ptr, sc_ptr, x_ptr, out_ptr, resid_ptr, ready_ptr, part_ptr,
               counts_ptr, one_bits, N: tl.constexpr, K: tl.constexpr, GATED: tl.constexpr,
               EPILOGUE: tl.constexpr, QGROUP: tl.constexpr, COLS: tl.constexpr,
               BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, STAGES: tl.constexpr,
               HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
               dtype: tl.constexpr):
    """This program's items of out = x @ W, W [K, N] AWQ (qweight, qzeros, scales at qw_ptr,
    qz_ptr, sc_ptr). Partial sums go to part_ptr [blocks, SPLITS, COLS] float32, arrivals to
    counts_ptr [blocks] (zero on entry, left zero); EPILOGUE and ready_ptr as _gemv_phase's
    (a unit is a column block)."""
    # float32 x: the 1 of each weight taken off, as awq_gemv's EXACT
    EXACT: tl.constexpr = dtype == tl.float32
    TILES: tl.constexpr = QGROUP // BLOCK_K  # tiles a group
    blocks, splits, _ = _awq_layout(N, K, COLS, BLOCK_K, SPLITS)
    grid = tl.num_programs(0)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, COLS)
    for item in range(tl.program_id(0), blocks * splits, grid):
        block, split, first, end, packs, ok, cols = _awq_item(item, N, K, GATED, COLS, BLOCK_K,
                                                             SPLITS)
        acc = tl.zeros([BLOCK_K, COLS], tl.float32)
        x_sum = tl.zeros([BLOCK_K], tl.float32)
        total = tl.zeros([COLS], tl.float32)
        # NOTE: Triton's pipeliner stages these int32 tiles through shared memory (cp.async,
        # STAGES - 1 ahead): the bytes in flight cost no registers, where a tile held ahead
        # by hand in registers left too few for the unpacked weights (offline sm_90 compiles
        # of Llama-3.1-8B's shapes: 208 bytes of spills at 168 registers)
        for tile in tl.range(first, end, num_stages=STAGES):
            packed = _awq_tile(qw_ptr, tile, packs, ok, N, BLOCK_K)
            x = tl.load(x_ptr + tile * BLOCK_K + offs_k, cache_modifier=".cg").to(tl.float32)
            w = tl.reshape(_unpack_offsets(packed, one_bits), (BLOCK_K, COLS))
            if EXACT:
                w -= 1.0
            acc += x[:, None] * w
            x_sum += x
            # a group's last tile or the split's: the group's sums into the total (across
            # threads once a group, not a tile)
            if (tile % TILES == TILES - 1) | (tile == end - 1):
                z, s_u = _group_offsets(qz_ptr, sc_ptr, tile // TILES, packs, ok, cols, N,
                                        N // 8, one_bits)
                if EXACT:
                    z -= 1.0
                total += s_u * (tl.sum(acc, 0) - z * tl.sum(x_sum, 0))
                acc = tl.zeros([BLOCK_K, COLS], tl.float32)
                x_sum = tl.zeros([BLOCK_K], tl.float32)
        tl.store(part_ptr + (block * SPLITS + split) * COLS + offs_c, total)
        tl.debug_barrier()  # every thread's partials before the arrival (the atomic releases)
        if tl.atomic_add(counts_ptr + block, 1, sem="acq_rel", scope="gpu") == splits - 1:
            tl.store(counts_ptr + block, 0)  # for the next phase: every split has arrived
            s = tl.arange(0, SPLITS)
            parts = tl.load(part_ptr + (block * SPLITS + s[:, None]) * COLS + offs_c[None, :],
                            mask=(s < splits)[:, None], other=0.0, cache_modifier=".cg")
            _epilogue(tl.sum(parts, 0), cols, cols < N, block * (COLS // 2), N // 2, out_ptr,
                      resid_ptr, EPILOGUE, COLS, dtype)
            if ready_ptr is not None:
                _mark_qkv_ready(ready_ptr, block * COLS, tl.minimum(block * COLS + COLS, N),
                                HEADS, KV_HEADS, HEAD_DIM)


@triton.jit
def _linear_phase(table_ptr, layer, COLUMN: tl.constexpr, x_ptr, out_ptr, resid_ptr,
                  ready_ptr, awq_part_ptr, counts_ptr, one_bits, N: tl.constexpr,
                  K: tl.constexpr, GATED: tl.constexpr, EPILOGUE: tl.constexpr,
                  EVEN: tl.constexpr, BALANCED: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, AWQ: tl.constexpr, QGROUP: tl.constexpr,
                  AWQ_COLS: tl.constexpr, AWQ_BLOCK_K: tl.constexpr, AWQ_SPLITS: tl.constexpr,
                  AWQ_STAGES: tl.constexpr, HEADS: tl.constexpr, KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, STAGES: tl.constexpr, dtype: tl.constexpr):
    """The GEMV phase of the layer's linear COLUMN, dense (_gemv_phase) or AWQ (_awq_phase)."""
    if AWQ:
        _awq_phase(_pointer(table_ptr, layer, COLUMN, tl.int32),
                   _pointer(table_ptr, layer, COLUMN + LINEARS, tl.int32),
                   _pointer(table_ptr, layer, COLUMN + 2 * LINEARS, dtype), x_ptr, out_ptr,
                   resid_ptr, ready_ptr, awq_part_ptr, counts_ptr, one_bits, N, K, GATED,
                   EPILOGUE, QGROUP, AWQ_COLS, AWQ_BLOCK_K, AWQ_SPLITS, AWQ_STAGES, HEADS,
                   KV_HEADS, HEAD_DIM, dtype)
    else:
        _gemv_phase(_pointer(table_ptr, layer, COLUMN, dtype), x_ptr, out_ptr, resid_ptr,
                    ready_ptr, N, K, GATED, EPILOGUE, EVEN, BALANCED, BLOCK_N, BLOCK_K, HEADS,
                    KV_HEADS, HEAD_DIM, STAGES, dtype)


@triton.jit
def _persistent_decode_kernel(
    table_ptr,  # int64 [num_layers, NUM_POINTERS]
    final_norm_ptr,  # [H]
    out_ptr,  # [H]: the last layer's residual stream, normed
    resid_ptr,  # [2, H]: [0] the embedding on entry, then the stream after o_proj; [1] before
    delta_ptr,  # [H]: the MLP's output, not yet added
    xn_ptr,  # [H]: the normed input of the qkv and gate_up (router, experts) GEMVs
    qkv_ptr,  # [(HEADS + 2 * KV_HEADS) * HEAD_DIM]
    attn_ptr,  # [HEADS * HEAD_DIM]
    act_ptr,  # [INTER], a mixture of experts [TOP_K, INTER]: SwiGLU's output
    logits_ptr,  # [EXPERTS]: the router's (IS_MOE)
    part_ptr,  # float32 [KV_HEADS, SPLITS_PAD, GROUP_PAD, HEAD_DIM + 2]: split partials
    awq_part_ptr,  # float32 [column blocks, AWQ_SPLITS, AWQ_COLS]: AWQ phases' partial sums
    sync_ptr,  # int32 [SYNC_HEADS + 2 * KV_HEADS + AWQ column blocks], zero on entry and exit
    block_table_ptr,  # [max_blocks] int32: the sequence's cache blocks
    seq_len_ptr,  # [1] int32, the context including the new token
    position_ptr,  # [1] the new token's position
    slot_ptr,  # [1] where its K/V go (-1: not stored)
    cos_sin_ptr,  # [max_position, HEAD_DIM] float32: cos, then sin
    stride_cos,
    stride_kb,  # the caches' strides: between blocks, tokens in a block, KV heads
    stride_kt,
    stride_kh,
    eps,
    qk_scale,  # softmax scale * log2(e)
    one_bits,  # 0x3F800000 (awq.py's _offset_window: an argument, so mask and OR fuse)
    num_layers,
    phase_lo,  # the phases to run: [phase_lo, phase_hi) of num_layers * LAYER_PHASES + 1
    phase_hi,
    max_splits,  # key splits at most (<= SPLITS_PAD, at most the programs per KV head)
    H: tl.constexpr,
    INTER: tl.constexpr,  # the MLP's (an expert's) intermediate size
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SPLIT_TOKENS: tl.constexpr,  # keys per split at least
    BLOCK_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # every GEMV's N and K are multiples of its row block and BLOCK_K
    HAS_QK_NORM: tl.constexpr,
    IS_MOE: tl.constexpr,  # every layer's MLP is a mixture of experts (router, experts)
    EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BLOCK_E: tl.constexpr,  # EXPERTS and TOP_K rounded up to powers of two
    BLOCK_TOPK: tl.constexpr,
    BARRIERS: tl.constexpr,  # False under the interpreter: a launch runs one phase
    BALANCED: tl.constexpr,  # _phase_span: an equal run of rows a program, or strided blocks
    AWQ: tl.constexpr,  # the four linear layers' weights are AWQ's (qweight, qzeros, scales)
    QGROUP: tl.constexpr,  # AWQ's group size
    AWQ_COLS: tl.constexpr,  # columns an AWQ item (a power of two, at least 16)
    AWQ_BLOCK_K: tl.constexpr,  # K rows an AWQ tile (divides QGROUP)
    AWQ_SPLITS: tl.constexpr,  # K splits a column block at most (a power of two)
    AWQ_STAGES: tl.constexpr,  # qweight tiles an AWQ item stages (Triton's pipeliner)
    GEMV_STAGES: tl.constexpr,  # weight tiles a bf16 GEMV phase stages (Triton's pipeliner)
    NORM_BLOCK: tl.constexpr,  # columns a step of the RMSNorms (H in one when it fits)
):
    dtype: tl.constexpr = out_ptr.dtype.element_ty
    cache_dtype: tl.constexpr = dtype
    # qkv, attention, o_proj, then gate_up and down, or router, experts' gate_up, their down
    LAYER_PHASES: tl.constexpr = 5 + IS_MOE
    QKV_N: tl.constexpr = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    O_K: tl.constexpr = HEADS * HEAD_DIM
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    seq_len = tl.load(seq_len_ptr)
    pos = tl.load(position_ptr)
    slot = tl.load(slot_ptr)
    # key splits: as many as the programs per KV head allow, SPLIT_TOKENS keys each at least
    n_splits = tl.minimum(max_splits, tl.cdiv(seq_len, SPLIT_TOKENS))
    per_split = tl.cdiv(tl.cdiv(seq_len, n_splits), BLOCK_T) * BLOCK_T
    n_splits = tl.cdiv(seq_len, per_split)
    barriers = 0
    # AWQ phases' arrival counts, one a column block
    counts_ptr = sync_ptr + SYNC_HEADS + 2 * KV_HEADS
    # the attention of a KV head waits for its qkv rows alone (_mark_qkv_ready), not behind
    # a grid barrier: the qkv GEMV's units, in outputs
    if AWQ:
        qkv_unit = AWQ_COLS
    elif BALANCED:
        qkv_unit = tl.cdiv(QKV_N, grid)
    else:
        qkv_unit = BLOCK_N
    for layer in range(num_layers):
        base = layer * LAYER_PHASES
        # --- qkv: residual + delta, the input norm, the GEMV ---
        if (phase_lo <= base) & (base < phase_hi):
            _normed_input(resid_ptr, delta_ptr, layer > 0, _pointer(table_ptr, layer, IN_NORM,
                          dtype), xn_ptr, resid_ptr + H, eps, H, NORM_BLOCK, dtype)
            _linear_phase(table_ptr, layer, QKV, xn_ptr, qkv_ptr, None,
                          sync_ptr + SYNC_HEADS + KV_HEADS, awq_part_ptr, counts_ptr, one_bits,
                          QKV_N, H, False, STORE, EVEN, BALANCED, BLOCK_N, BLOCK_K, AWQ, QGROUP,
                          AWQ_COLS, AWQ_BLOCK_K, AWQ_SPLITS, AWQ_STAGES, HEADS, KV_HEADS,
                          HEAD_DIM, GEMV_STAGES, dtype)
        # --- attention ---
        if (phase_lo <= base + 1) & (base + 1 < phase_hi):
            for item in range(pid, KV_HEADS * n_splits, grid):
                _attention_item(table_ptr, layer, item, qkv_ptr, attn_ptr, part_ptr, sync_ptr,
                                block_table_ptr, seq_len, pos, slot, cos_sin_ptr, stride_cos,
                                stride_kb, stride_kt, stride_kh, qk_scale, eps, n_splits,
                                per_split, qkv_unit, HEADS, KV_HEADS, HEAD_DIM, GROUP_PAD,
                                SPLITS_PAD, BLOCK_SIZE, BLOCK_T, HAS_QK_NORM, BARRIERS, dtype,
                                cache_dtype)
            barriers = _after_phase(sync_ptr, barriers, base + 2, phase_hi, BARRIERS)
        # --- o_proj and the residual: resid[0] = o + resid[1] ---
        if (phase_lo <= base + 2) & (base + 2 < phase_hi):
            _linear_phase(table_ptr, layer, O_PROJ, attn_ptr, resid_ptr, resid_ptr + H, None,
                          awq_part_ptr, counts_ptr, one_bits, H, O_K, False, ADD_RESIDUAL, EVEN,
                          BALANCED, BLOCK_N, BLOCK_K, AWQ, QGROUP, AWQ_COLS, AWQ_BLOCK_K,
                          AWQ_SPLITS, AWQ_STAGES, HEADS, KV_HEADS, HEAD_DIM, GEMV_STAGES, dtype)
            barriers = _after_phase(sync_ptr, barriers, base + 3, phase_hi, BARRIERS)
        if IS_MOE:
            # --- the router: the post-attention norm, the router's logits ---
            if (phase_lo <= base + 3) & (base + 3 < phase_hi):
                _normed_input(resid_ptr, delta_ptr, False, _pointer(table_ptr, layer,
                              POST_NORM, dtype), xn_ptr, None, eps, H, NORM_BLOCK, dtype)
                _gemv_phase(_pointer(table_ptr, layer, ROUTER, dtype), xn_ptr, logits_ptr, None,
                            None, EXPERTS, H, False, STORE, EVEN, BALANCED, BLOCK_N, BLOCK_K,
                            HEADS, KV_HEADS, HEAD_DIM, GEMV_STAGES, dtype)
                barriers = _after_phase(sync_ptr, barriers, base + 4, phase_hi, BARRIERS)
            # --- the chosen experts' gate_up and SwiGLU: [TOP_K, INTER] ---
            if (phase_lo <= base + 4) & (base + 4 < phase_hi):
                route_w, route_ids = route_row(logits_ptr, EXPERTS, TOP_K, RENORMALIZE, BLOCK_E,
                                               BLOCK_TOPK)
                _gemv_stream(_pointer(table_ptr, layer, GATE_UP, dtype), xn_ptr, act_ptr, None,
                             0, 0, 0, route_w, route_ids, EXPERT_ROWS, 2 * INTER, H, True, STORE,
                             EVEN, BLOCK_N, BLOCK_K, TOP_K, BLOCK_TOPK, GEMV_STAGES, dtype)
                barriers = _after_phase(sync_ptr, barriers, base + 5, phase_hi, BARRIERS)
            # --- their down projections, weighted and summed: delta ---
            if (phase_lo <= base + 5) & (base + 5 < phase_hi):
                route_w, route_ids = route_row(logits_ptr, EXPERTS, TOP_K, RENORMALIZE, BLOCK_E,
                                               BLOCK_TOPK)
                first, end, step = _phase_span(H, False, BALANCED, BLOCK_N)
                _gemv_stream(_pointer(table_ptr, layer, DOWN, dtype), act_ptr, delta_ptr, None,
                             first, end, step, route_w, route_ids, EXPERT_SUM, H, INTER, False,
                             STORE, EVEN, BLOCK_N, BLOCK_K, TOP_K, BLOCK_TOPK, GEMV_STAGES,
                             dtype)
                barriers = _after_phase(sync_ptr, barriers, base + 6, phase_hi, BARRIERS)
        else:
            # --- gate_up: the post-attention norm, both GEMVs, SwiGLU ---
            if (phase_lo <= base + 3) & (base + 3 < phase_hi):
                _normed_input(resid_ptr, delta_ptr, False, _pointer(table_ptr, layer,
                              POST_NORM, dtype), xn_ptr, None, eps, H, NORM_BLOCK, dtype)
                _linear_phase(table_ptr, layer, GATE_UP, xn_ptr, act_ptr, None, None,
                              awq_part_ptr, counts_ptr, one_bits, 2 * INTER, H, True, SWIGLU,
                              EVEN, BALANCED, BLOCK_N, BLOCK_K, AWQ, QGROUP, AWQ_COLS,
                              AWQ_BLOCK_K, AWQ_SPLITS, AWQ_STAGES, HEADS, KV_HEADS, HEAD_DIM,
                              GEMV_STAGES, dtype)
                barriers = _after_phase(sync_ptr, barriers, base + 4, phase_hi, BARRIERS)
            # --- down: delta = W_down @ act ---
            if (phase_lo <= base + 4) & (base + 4 < phase_hi):
                _linear_phase(table_ptr, layer, DOWN, act_ptr, delta_ptr, None, None,
                              awq_part_ptr, counts_ptr, one_bits, H, INTER, False, STORE, EVEN,
                              BALANCED, BLOCK_N, BLOCK_K, AWQ, QGROUP, AWQ_COLS, AWQ_BLOCK_K,
                              AWQ_SPLITS, AWQ_STAGES, HEADS, KV_HEADS, HEAD_DIM, GEMV_STAGES,
                              dtype)
                barriers = _after_phase(sync_ptr, barriers, base + 5, phase_hi, BARRIERS)
    # --- the final norm of resid[0] + delta, one program ---
    last = num_layers * LAYER_PHASES
    if (phase_lo <= last) & (last < phase_hi) & (pid == 0):
        _normed_input(resid_ptr, delta_ptr, num_layers > 0, final_norm_ptr, out_ptr, None, eps,
                      H, NORM_BLOCK, dtype)
    if BARRIERS:
        # the last program out zeroes the counts for the next launch: every program has
        # passed the last barrier, so none reads them again
        if tl.atomic_add(sync_ptr + SYNC_DONE, 1, sem="acq_rel", scope="gpu") == grid - 1:
            tl.store(sync_ptr + SYNC_ARRIVALS, 0)
            tl.store(sync_ptr + SYNC_DONE, 0)


@dataclass(frozen=True)
class DecodeShape:
    """What the kernel specialises on: a Llama/Qwen3 decoder's sizes, or Qwen3-MoE's (every
    layer's MLP a mixture of experts)."""

    hidden_size: int
    intermediate_size: int  # a mixture of experts: each expert's
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    block_size: int  # the paged cache's tokens per block
    eps: float  # every RMSNorm's (the model's rms_norm_eps)
    qk_norm: bool  # Qwen3's per-head q/k RMSNorm
    num_experts: int = 0  # 0: a dense MLP
    top_k: int = 0
    norm_topk_prob: bool = False  # the top-k routing weights renormalized to sum to 1
    # AWQ's group size where the four linear layers hold AWQ weights (W4A16); 0: dense
    awq_group_size: int = 0

    @property
    def qkv_size(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def linear_sizes(self) -> tuple[tuple[int, int], ...]:
        """(N, K) of the qkv, o_proj, gate_up and down GEMVs (an expert's, for experts)."""
        h, inter = self.hidden_size, self.intermediate_size
        return ((self.qkv_size, h), (h, self.num_heads * self.head_dim), (2 * inter, h),
                (h, inter))

    @property
    def layer_phases(self) -> int:
        """qkv, attention, o_proj, gate_up, down; or router, experts' gate_up, their down."""
        return 6 if self.is_moe else 5


@dataclass(frozen=True)
class PersistentTiles:
    """The launch's tile sizes: block_n x block_k from tools/dev/probe_persistent_gemv.py,
    programs_per_sm from probe_persistent_decode.py (H200, Qwen3-0.6B, 2026-12-05: 956 us a
    step at 2 an SM against 1,119 at 3 and 1,224 at 4; stages 2-8 within 4%)."""

    block_n: int = 8  # GEMV rows a block (gate_up: half gate, half up)
    # weight tiles a program stages through shared memory (Triton's pipeliner): stages - 1 in
    # flight across its row blocks (_gemv_stream)
    stages: int = 4
    # None: the largest of 512, 256, 128 that divides every GEMV's K (no masked tiles)
    block_k: int | None = None
    # keys a step of the attention loop; None: 16, fewer for larger GQA groups, so the
    # [group, keys, head_dim] products stay at 4096 floats (8 x 16 x 128 spilled registers in
    # offline sm_90 compiles of Qwen3-30B-A3B's attention)
    block_t: int | None = None
    split_tokens: int = 64  # keys a split at least
    programs_per_sm: int = 2  # at most: fewer when the compiled kernel's occupancy says so
    num_warps: int = 4
    # registers a thread at most (ptxas' maxnreg): unbounded, sm_90 code takes 217-255 at
    # Qwen3-0.6B/8B shapes, two programs an SM; 168 spills nothing and lets three in (offline
    # compiles, cuobjdump -res-usage)
    max_registers: int | None = 168
    # a GEMV phase's rows an equal run a program (True) or blocks strided over the programs
    # (the probe's): _phase_span
    balanced_rows: bool = True
    # AWQ phases (_awq_phase): columns an item (256: one 128-byte line of a K row, and few
    # enough partial sums: at Llama-3.1-8B's o_proj 16 blocks of 25 splits write 0.4 MB
    # against the 8 MB weight), K rows a tile (capped by the group size: 32 rows take 3.5
    # instructions a weight in the tile loop and spill nothing, 16 rows 3.9 and 40 bytes of
    # stack, in offline sm_90 compiles of Llama-3.1-8B's shapes), K splits at most
    awq_cols: int = 256
    awq_block_k: int = 32
    awq_splits: int = 32
    # qweight tiles an AWQ item has in shared memory (4 KB each at 32 x 256): 4 keeps 12 KB a
    # program in flight, ~5 MB over the grid, about what the bf16 phases' two 8 KB tiles hold
    awq_stages: int = 4


def pointer_table(layers: list[dict[str, torch.Tensor]], device: torch.device) -> torch.Tensor:
    """int64 [num_layers, len(COLUMNS)]: each layer's tensors (named as in COLUMNS) by address.
    Columns a model lacks (Llama's q/k norms) may be left out: the kernel never reads them."""
    table = torch.zeros(len(layers), len(COLUMNS), dtype=torch.int64)
    for layer, tensors in enumerate(layers):
        for name, tensor in tensors.items():
            if tensor.data_ptr() % 16 or not tensor.is_contiguous():
                raise ValueError(f"persistent decode: layer {layer}'s {name} must be "
                                 "contiguous and 16-byte aligned")
            table[layer, COLUMNS.index(name)] = tensor.data_ptr()
    return table.to(device)


class PersistentDecode:
    """The kernel's scratch buffers and launch for one model. `table` (pointer_table) holds
    each layer's tensors by address: they must live as long as this object is called."""

    def __init__(self, shape: DecodeShape, table: torch.Tensor, final_norm: torch.Tensor,
                 cos_sin: torch.Tensor, cache_strides: tuple[int, int, int],
                 max_blocks: int, tiles: PersistentTiles = PersistentTiles(),
                 programs: int | None = None):
        if tiles.block_n % 2 or shape.num_heads % shape.num_kv_heads:
            raise ValueError("persistent decode: block_n must be even and num_heads a "
                             "multiple of num_kv_heads")
        h, kv_heads = shape.hidden_size, shape.num_kv_heads
        self.group_pad = triton.next_power_of_2(shape.num_heads // kv_heads)
        gemv_sizes = (*shape.linear_sizes, (shape.num_experts or tiles.block_n, h))
        if tiles.block_k is None:
            tiles = replace(tiles, block_k=next(
                (b for b in (512, 256, 128) if all(k % b == 0 for _, k in gemv_sizes)), 512))
        if tiles.block_t is None:
            tiles = replace(tiles, block_t=max(1, min(
                16, 4096 // (self.group_pad * triton.next_power_of_2(shape.head_dim)))))
        awq_blocks = 0
        if shape.awq_group_size:
            group = shape.awq_group_size
            if shape.is_moe:
                raise ValueError("persistent decode: AWQ weights with a mixture of experts")
            if (tiles.awq_cols < 16 or tiles.awq_cols & (tiles.awq_cols - 1)
                    or tiles.awq_splits & (tiles.awq_splits - 1)):
                raise ValueError("persistent decode: awq_cols (at least 16) and awq_splits "
                                 "must be powers of two")
            if any(k % group for _, k in shape.linear_sizes) or shape.intermediate_size % 8 \
                    or any(n % 8 for n, _ in shape.linear_sizes):
                raise ValueError("persistent decode: AWQ needs every K a multiple of the "
                                 f"group size {group} and every N (gate and up) of 8")
            tiles = replace(tiles, awq_block_k=math.gcd(tiles.awq_block_k, group))
            awq_blocks = max(triton.cdiv(n, tiles.awq_cols) for n, _ in shape.linear_sizes)
        self.shape, self.table, self.final_norm, self.cos_sin = shape, table, final_norm, cos_sin
        self.cache_strides, self.tiles = cache_strides, tiles
        device, dtype = final_norm.device, final_norm.dtype
        self.on_gpu = device.type == "cuda"
        self.programs = programs or (sm_count(device, without_gpu=3) * tiles.programs_per_sm)
        # splits a KV head: every program busy at long contexts, as the split kernel does
        self.max_splits = max(1, min(self.programs // kv_heads,
                                     triton.cdiv(max_blocks * shape.block_size,
                                                 tiles.split_tokens)))
        self.splits_pad = triton.next_power_of_2(self.max_splits)

        def empty(*size, dtype=dtype):
            return torch.zeros(*size, dtype=dtype, device=device)

        self.resid = empty(2, h)
        self.delta, self.xn, self.out = empty(h), empty(h), empty(h)
        self.qkv = empty(shape.qkv_size)
        self.attn = empty(shape.num_heads * shape.head_dim)
        self.act = empty(max(shape.top_k, 1) * shape.intermediate_size)
        self.logits = empty(max(shape.num_experts, 1))
        self.parts = empty(kv_heads, self.splits_pad, self.group_pad, shape.head_dim + 2,
                           dtype=torch.float32)
        self.awq_parts = empty(max(awq_blocks * tiles.awq_splits * tiles.awq_cols, 1),
                               dtype=torch.float32)
        self.sync = empty(SYNC_HEADS.value + 2 * kv_heads + awq_blocks, dtype=torch.int32)
        self.even = (all(n % tiles.block_n == 0 and k % tiles.block_k == 0
                         for n, k in gemv_sizes)
                     and shape.intermediate_size % (tiles.block_n // 2) == 0)
        if self.on_gpu:
            self.programs = self._co_resident(self.programs)
            # fewer programs than asked: fewer splits (SPLITS_PAD, compiled in, still bounds it)
            self.max_splits = max(1, min(self.max_splits, self.programs // kv_heads))

    @property
    def input(self) -> torch.Tensor:
        """[1, hidden]: where the caller puts the token's embedding before a call (an
        embedding lookup can write it here, no copy)."""
        return self.resid[:1]

    def __call__(self, block_table: torch.Tensor, seq_len: torch.Tensor,
                 position: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """The last layer's residual stream, normed ([hidden], a buffer reused by every call),
        from `input`: the embedding of the token at `position`, whose K/V go to cache slot
        `slot` of a sequence of seq_len tokens (it included) in the blocks of block_table."""
        last = self.shape.num_layers * self.shape.layer_phases + 1
        if self.on_gpu:
            self._launch(block_table, seq_len, position, slot, 0, last, True)
        else:  # the interpreter runs programs in turn: a launch a phase, no barriers
            for phase in range(last):
                self._launch(block_table, seq_len, position, slot, phase, phase + 1, False)
        return self.out

    def error(self) -> bool:
        """Whether a barrier gave up waiting (the grid was not co-resident): the outputs of
        that launch are wrong."""
        return bool(self.sync[SYNC_ERROR.value].item())

    def _args(self, block_table, seq_len, position, slot, phase_lo, phase_hi, barriers):
        shape, tiles = self.shape, self.tiles
        stride_kb, stride_kt, stride_kh = self.cache_strides
        args = (self.table, self.final_norm, self.out, self.resid, self.delta, self.xn, self.qkv,
                self.attn, self.act, self.logits, self.parts, self.awq_parts, self.sync,
                block_table, seq_len, position, slot,
                self.cos_sin, self.cos_sin.stride(0), stride_kb, stride_kt, stride_kh,
                shape.eps, shape.head_dim**-0.5 * LOG2E, _ONE_BITS, shape.num_layers, phase_lo,
                phase_hi, self.max_splits)
        constexprs = dict(
            H=shape.hidden_size,
            INTER=shape.intermediate_size, HEADS=shape.num_heads, KV_HEADS=shape.num_kv_heads,
            HEAD_DIM=shape.head_dim, GROUP_PAD=self.group_pad, SPLITS_PAD=self.splits_pad,
            SPLIT_TOKENS=tiles.split_tokens, BLOCK_SIZE=shape.block_size,
            BLOCK_T=tiles.block_t, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k,
            EVEN=self.even, HAS_QK_NORM=shape.qk_norm, IS_MOE=shape.is_moe,
            EXPERTS=shape.num_experts, TOP_K=shape.top_k, RENORMALIZE=shape.norm_topk_prob,
            BLOCK_E=triton.next_power_of_2(max(shape.num_experts, 1)),
            BLOCK_TOPK=triton.next_power_of_2(max(shape.top_k, 1)), BARRIERS=barriers,
            BALANCED=tiles.balanced_rows, AWQ=shape.awq_group_size > 0,
            QGROUP=max(shape.awq_group_size, 1), AWQ_COLS=tiles.awq_cols,
            AWQ_BLOCK_K=tiles.awq_block_k, AWQ_SPLITS=tiles.awq_splits,
            AWQ_STAGES=tiles.awq_stages, GEMV_STAGES=tiles.stages,
            NORM_BLOCK=min(triton.next_power_of_2(shape.hidden_size), 4096),
            num_warps=tiles.num_warps)
        if self.on_gpu and tiles.max_registers is not None:
            constexprs["maxnreg"] = tiles.max_registers
        return args, constexprs

    def _launch(self, *step_args) -> None:
        args, constexprs = self._args(*step_args)
        _persistent_decode_kernel[(self.programs,)](*args, **constexprs)

    def _co_resident(self, wanted: int) -> int:
        """At most `wanted` programs, as many an SM as the compiled kernel's registers, shared
        memory and threads let be resident at once (a barrier needs every program running)."""
        device = self.out.device
        # the engine's dtypes (int32 block table and lengths, int64 positions and slots), so
        # this compiles the variant its steps launch
        int32, int64 = (torch.zeros(1, dtype=t, device=device) for t in (torch.int32, torch.int64))
        args, constexprs = self._args(int32, int32, int64, int64, 0, 1, True)
        kernel = _persistent_decode_kernel.warmup(*args, **constexprs, grid=(wanted,))
        _ = kernel.run  # loads the binary, which sets n_regs
        props = torch.cuda.get_device_properties(device)
        threads = 32 * self.tiles.num_warps
        regs = -(-max(kernel.n_regs, 1) // 8) * 8 * threads
        per_sm = min(props.max_threads_per_multi_processor // threads,
                     props.regs_per_multiprocessor // regs,
                     # an SM's shared memory is at least one block's opt-in maximum
                     props.shared_memory_per_block_optin // max(kernel.metadata.shared, 1))
        programs = min(wanted, per_sm * props.multi_processor_count)
        if programs < 1:
            raise RuntimeError("persistent decode: the kernel does not fit an SM")
        return programs
