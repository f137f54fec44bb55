"""Qwen3-MoE's MLP: moe_routing, moe_align_block_size and fused_moe against their PyTorch twins,
and the twins against hand-computed cases (so that a wrong twin fails too)."""

import math

import pytest
import torch

from echo_kernels import fused_moe, fused_moe_from_logits, moe_align_block_size, moe_routing
from echo_kernels.fused_moe import fused_moe_pairs
from echo_kernels.reference import fused_moe_ref, moe_align_block_size_ref, moe_routing_ref


def silu(v: float) -> float:
    return v / (1.0 + math.exp(-v))


# ---------------------------------------------------------------------------------------------
# routing


@pytest.mark.parametrize("impl", [moe_routing, moe_routing_ref])
def test_routing_hand_made(device, impl):
    logits = torch.tensor([[math.log(v) for v in (1.0, 2.0, 3.0, 4.0)],
                           [1.0, 1.0, 1.0, 0.0]], device=device)
    weights, ids = impl(logits, 2, False)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.tolist() == [[3, 2], [0, 1]]  # the tie among 0, 1, 2 goes to the lower ids
    e = math.e
    want = [[0.4, 0.3], [e / (3 * e + 1), e / (3 * e + 1)]]
    torch.testing.assert_close(weights.cpu(), torch.tensor(want), atol=1e-6, rtol=0)
    weights, _ = impl(logits, 2, True)
    torch.testing.assert_close(weights.cpu(), torch.tensor([[4 / 7, 3 / 7], [0.5, 0.5]]),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("rows, experts, top_k", [(1, 8, 2), (17, 8, 2), (33, 60, 4)])
def test_routing_matches_reference(device, dtype, renormalize, rows, experts, top_k):
    torch.manual_seed(0)
    logits = (torch.randn(rows, experts) * 2).to(dtype).to(device)  # fp16/bf16: some ties
    weights, ids = moe_routing(logits, top_k, renormalize)
    want_w, want_ids = moe_routing_ref(logits, top_k, renormalize)
    assert ids.shape == weights.shape == (rows, top_k)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)


def test_routing_ties(device):
    torch.manual_seed(1)
    logits = torch.randint(0, 3, (20, 16)).float().to(device)  # three values: ties everywhere
    weights, ids = moe_routing(logits, 5, True)
    want_w, want_ids = moe_routing_ref(logits, 5, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    # descending logits, equal logits in ascending expert id
    picked = logits.gather(1, ids.long())
    assert (picked[:, :-1] >= picked[:, 1:]).all()
    same = picked[:, :-1] == picked[:, 1:]
    assert (ids[:, :-1][same] < ids[:, 1:][same]).all()


# ---------------------------------------------------------------------------------------------
# grouping by expert


@pytest.mark.parametrize("impl", [moe_align_block_size, moe_align_block_size_ref])
def test_align_hand_made(device, impl):
    # pairs 0..5 go to experts 2, 0, 2, 0, 0, 3; expert 1 gets none; sentinel 6
    ids = torch.tensor([[2, 0], [2, 0], [0, 3]], dtype=torch.int32, device=device)
    sorted_ids, expert_ids, num_padded = impl(ids, 4, 4)
    assert sorted_ids.tolist() == [1, 3, 4, 6, 0, 2, 6, 6, 5, 6, 6, 6] + [6] * 6  # 6 + 4 * 3
    assert expert_ids.tolist() == [0, 2, 3, -1]  # 18 // 4 tiles
    assert num_padded.tolist() == [12]


def check_invariants(topk_ids, block_size, num_experts, sorted_ids, expert_ids, num_padded):
    """What the GEMMs rely on, checked without the reference."""
    num_pairs = topk_ids.numel()
    max_padded = num_pairs + num_experts * (block_size - 1)
    assert sorted_ids.shape == (max_padded,) and expert_ids.shape == (max_padded // block_size,)
    n = num_padded.item()
    assert n % block_size == 0 and n <= max_padded
    body = sorted_ids[:n].cpu()
    assert (sorted_ids[n:] == num_pairs).all()
    real = body[body < num_pairs]
    assert torch.equal(real.sort().values, torch.arange(num_pairs))  # every pair once
    flat = topk_ids.flatten().cpu()
    tiles = expert_ids[: n // block_size].cpu()
    assert (expert_ids[n // block_size:] == -1).all()
    assert (tiles[1:] >= tiles[:-1]).all()  # groups in ascending expert order
    owner = tiles.repeat_interleave(block_size)
    is_pair = body < num_pairs
    assert torch.equal(flat[body[is_pair].long()], owner[is_pair].to(flat.dtype))


def routing_case(case: str, rows: int, top_k: int, experts: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rows * 100 + top_k)
    if case == "one_expert":
        return torch.full((rows, top_k), experts - 2, dtype=torch.int32)  # every slot alike
    if case == "gaps":  # experts 1, 3 and 4 get no pair (the distinct-per-row draw avoids them)
        allowed = torch.tensor([e for e in range(experts) if e not in (1, 3, 4)])
        choice = torch.stack([torch.randperm(len(allowed), generator=gen)[:top_k]
                              for _ in range(rows)])
        return allowed[choice].to(torch.int32)
    return torch.stack([torch.randperm(experts, generator=gen)[:top_k]
                        for _ in range(rows)]).to(torch.int32)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("case, rows, top_k, experts", [
    ("random", 1, 2, 8), ("random", 17, 2, 8), ("gaps", 17, 2, 8), ("one_expert", 17, 2, 8),
    ("one_expert", 1, 1, 8),
    ("random", 300, 8, 128),  # 38 chunks of pairs: several steps of the prefix over chunks
])
def test_align_matches_reference(device, block_size, case, rows, top_k, experts):
    ids = routing_case(case, rows, top_k, experts).to(device)
    got = moe_align_block_size(ids, block_size, experts)
    want = moe_align_block_size_ref(ids, block_size, experts)
    for g, w in zip(got, want):
        assert g.dtype == torch.int32 and torch.equal(g, w)
    check_invariants(ids, block_size, experts, *got)


def test_align_reaches_the_bound(device):
    # one pair per expert: every group is block_size - 1 slots of padding, num_padded the bound
    ids = torch.randperm(8).view(4, 2).to(torch.int32).to(device)
    sorted_ids, expert_ids, num_padded = moe_align_block_size(ids, 16, 8)
    assert num_padded.item() == sorted_ids.numel() == 8 + 8 * 15
    assert expert_ids.tolist() == list(range(8))
    for g, w in zip((sorted_ids, expert_ids, num_padded), moe_align_block_size_ref(ids, 16, 8)):
        assert torch.equal(g, w)


# ---------------------------------------------------------------------------------------------
# the MLP


@pytest.mark.parametrize("impl", [fused_moe, fused_moe_ref])
def test_fused_moe_hand_made(device, impl):
    # H=4, I=2, 2 experts of 0/1 weights. Expert 0: g = (x0, x1), u = (x2, x3),
    # y = (a0, a1, a0 + a1, 0); expert 1: g = (x0 + x1, 0), u = (x3, x0), y = (0, 2 a0, 0, 0)
    w13 = torch.tensor([
        [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]],
        [[1, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1], [1, 0, 0, 0]],
    ], dtype=torch.float32)
    w2 = torch.tensor([[[1, 0], [0, 1], [1, 1], [0, 0]],
                       [[0, 0], [2, 0], [0, 0], [0, 0]]], dtype=torch.float32)
    hidden = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, -1.0, 0.0, 2.0]])
    ids = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)
    weights = torch.tensor([[0.25, 0.75], [0.6, 0.4]])
    # token 0: expert 0 a = (3 silu(1), 4 silu(2)); expert 1 a0 = 4 silu(3)
    a0, a1, b0 = 3 * silu(1.0), 4 * silu(2.0), 4 * silu(3.0)
    row0 = [0.25 * a0, 0.25 * a1 + 0.75 * 2 * b0, 0.25 * (a0 + a1), 0.0]
    # token 1: expert 1 a0 = 2 silu(-0.5); expert 0 a = (0 silu(0.5), 2 silu(-1))
    c0, d1 = 2 * silu(-0.5), 2 * silu(-1.0)
    row1 = [0.0, 0.6 * 2 * c0 + 0.4 * d1, 0.4 * d1, 0.0]
    out = impl(*(t.to(device) for t in (hidden, w13, w2, weights, ids)))
    torch.testing.assert_close(out.cpu(), torch.tensor([row0, row1]), atol=1e-5, rtol=1e-5)


def moe_inputs(rows, experts, top_k, hidden_size, inter, dtype, device, case="random", seed=0):
    """Hidden rows and weights scaled so that every stage is O(1); routing by `case`."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, hidden_size, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden_size, generator=gen) * hidden_size**-0.5
    w2 = torch.randn(experts, hidden_size, inter, generator=gen) * inter**-0.5
    ids = routing_case(case, rows, top_k, experts)
    weights = torch.rand(rows, top_k, generator=gen)
    weights = weights / weights.sum(-1, keepdim=True)
    return (hidden.to(dtype).to(device), w13.to(dtype).to(device), w2.to(dtype).to(device),
            weights.to(device), ids.to(device))


TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.float16: (5e-3, 1e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows, pairs", [(1, None), (3, None), (17, None), (1, False),
                                         (17, True)])
def test_fused_moe_matches_reference(device, dtype, rows, pairs):
    # None: by the pair count (1 and 3 rows of k=2 are pair GEMVs, 17 rows are sorted)
    inputs = moe_inputs(rows, 8, 2, 64, 32, dtype, device)
    out = fused_moe(*inputs, pairs=pairs)
    assert out.shape == (rows, 64) and out.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, fused_moe_ref(*inputs), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case, rows, hidden_size, inter, block_m, pairs", [
    ("gaps", 17, 64, 32, None, False),
    ("one_expert", 17, 64, 32, None, False),  # two tiles of one expert (34 pairs), rest skipped
    ("one_expert", 17, 64, 32, 32, False),
    ("random", 5, 96, 48, 32, False),  # H and I not multiples of the tiles: masked K, N tails
    ("one_expert", 3, 64, 32, None, True),  # every pair's GEMV reads the same expert
    ("random", 5, 96, 48, None, True),  # masked K and N tails in both GEMVs
])
def test_fused_moe_routing_cases(device, dtype, case, rows, hidden_size, inter, block_m,
                                 pairs):
    inputs = moe_inputs(rows, 8, 2, hidden_size, inter, dtype, device, case, seed=1)
    out = fused_moe(*inputs, block_m=block_m, pairs=pairs)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, fused_moe_ref(*inputs), atol=atol, rtol=rtol)


@pytest.mark.parametrize("gate_up, down", [
    ((32, 64, 2), (4, 16, 1)),  # 15 gate_up programs zero 80 arrival counts: several each
    ((4, 16, 1), (32, 32, 2)),  # two down blocks a token, 8 gate_up blocks a pair
])
def test_fused_moe_pairs_tiles(device, gate_up, down):
    # 5 tokens, k = 3 of 8 experts: every token's sum waits for three pairs per column block
    inputs = moe_inputs(5, 8, 3, 64, 32, torch.float32, device, seed=2)
    out = fused_moe_pairs(*inputs, gate_up_config=gate_up, down_config=down)
    torch.testing.assert_close(out, fused_moe_ref(*inputs), atol=1e-5, rtol=1e-5)


def moe_from_logits_ref(hidden, w13, w2, logits, top_k, renormalize):
    return fused_moe_ref(hidden, w13, w2, *moe_routing_ref(logits, top_k, renormalize))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("rows, experts, top_k", [(1, 8, 2), (4, 6, 3), (17, 8, 2)])
def test_fused_moe_from_logits_matches_reference(device, dtype, renormalize, rows, experts,
                                                 top_k):
    # 1 and 4 rows: moe_routing, then the pair GEMVs (6 experts: a masked tail in the
    # routing's block of 8); 17 rows (34 pairs): moe_routing, then the sorted tiles
    hidden, w13, w2, _, _ = moe_inputs(rows, experts, top_k, 64, 32, dtype, device, seed=3)
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(rows, experts, generator=gen) * 2).to(dtype).to(device)
    out = fused_moe_from_logits(hidden, w13, w2, logits, top_k, renormalize)
    assert out.shape == (rows, 64) and out.dtype == dtype
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(
        out, moe_from_logits_ref(hidden, w13, w2, logits, top_k, renormalize), atol=atol,
        rtol=rtol)


def test_fused_moe_from_logits_ties(device):
    # three logit values over 16 experts (and one row all equal): the routing must pick the
    # reference's experts, ties to the lower id, or the rows come from other weights
    hidden, w13, w2, _, _ = moe_inputs(3, 16, 5, 64, 32, torch.float32, device, seed=4)
    logits = torch.randint(0, 3, (3, 16), generator=torch.Generator().manual_seed(4)).float()
    logits[2] = 1.0
    logits = logits.to(device)
    for renormalize in (False, True):
        out = fused_moe_from_logits(hidden, w13, w2, logits, 5, renormalize)
        torch.testing.assert_close(
            out, moe_from_logits_ref(hidden, w13, w2, logits, 5, renormalize), atol=1e-5,
            rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [20, 64, 256, 1024, 1500])
def test_gpu_default_tiles_fit_in_each_dtype(dtype, rows):
    # one row count for each of the grouped GEMMs' default tiles (k = 2: over PAIR_MAX pairs)
    hidden, w13, w2, weights, ids = moe_inputs(rows, 8, 2, 256, 128, dtype, "cuda")
    out = fused_moe(hidden, w13, w2, weights, ids)
    want = fused_moe_ref(hidden, w13, w2, weights, ids)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 64, 1024])
def test_gpu_qwen3_30b_shapes(rows):
    # Qwen3-30B-A3B's MoE layer: 128 experts, 8 per token, H=2048, I=768; routing from logits
    hidden, w13, w2, _, _ = moe_inputs(rows, 128, 8, 2048, 768, torch.bfloat16, "cuda")
    logits = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    weights, ids = moe_routing(logits, 8, True)
    want_w, want_ids = moe_routing_ref(logits, 8, True)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, atol=1e-6, rtol=1e-5)
    out = fused_moe(hidden, w13, w2, weights, ids)
    # bf16 rounding of silu(g) * u, of each pair's row and of the sum vs a float32 twin
    want = fused_moe_ref(hidden, w13, w2, weights, ids)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    # the model's entry point: the same routing, then the same kernels
    torch.testing.assert_close(fused_moe_from_logits(hidden, w13, w2, logits, 8, True), out)
