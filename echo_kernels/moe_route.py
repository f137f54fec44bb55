"""One token's routing over a mixture of experts' logits, inside another kernel: the persistent
decode step routes in every program, and the router's GEMV in its last program
(echo_kernels.linear). moe_routing (fused_moe.py) is the launch of its own for many tokens."""

import triton
import triton.language as tl


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
