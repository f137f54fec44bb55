"""The persistent batch-1 decode kernel against a PyTorch decode step built from the references.

On the CPU the interpreter runs each phase as its own launch (no barriers); on a GPU the whole
step is one launch, so the `gpu` case also checks the barriers and the split merge's atomics.
"""

import math

import pytest
import torch
from kernel_utils import HAS_CUDA

from echo_kernels.persistent_decode import (
    DecodeShape,
    PersistentDecode,
    PersistentTiles,
    pointer_table,
)
from echo_kernels.reference import (
    awq_dequantize_ref,
    fused_add_rms_norm_ref,
    fused_moe_ref,
    moe_routing_ref,
    paged_attention_ref,
    rms_norm_ref,
    rotary_embedding_ref,
    silu_and_mul_ref,
    store_kv_cache_ref,
)
from tests.kernels.test_awq import awq_tensors

DEVICE = "cuda" if HAS_CUDA else "cpu"
LINEARS = ("qkv", "o_proj", "gate_up", "down")


class RandomDecoder:
    """Random layer weights, a paged cache holding `context` earlier tokens of one sequence
    in scattered blocks (NaN everywhere else), and a rotary table."""

    def __init__(self, shape: DecodeShape, context: int, dtype, seed=0, num_blocks=None):
        """shape.awq_group_size: the four linear layers as random AWQ tensors, the reference
        holding their float32 dequantization (awq_linear_ref's product)."""
        gen = torch.Generator().manual_seed(seed)
        self.shape, self.dtype, self.context = shape, dtype, context
        h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim

        def rand(*size, scale=1.0, offset=0.0):
            return (torch.randn(*size, generator=gen) * scale + offset).to(dtype).to(DEVICE)

        experts = (shape.num_experts,) if shape.is_moe else ()
        self.layers = [{
            "in_norm": rand(h, scale=0.1, offset=1.0),
            "qkv": rand(shape.qkv_size, h, scale=h**-0.5),
            "q_norm": rand(d, scale=0.1, offset=1.0),
            "k_norm": rand(d, scale=0.1, offset=1.0),
            "o_proj": rand(h, shape.num_heads * d, scale=(shape.num_heads * d)**-0.5),
            "post_norm": rand(h, scale=0.1, offset=1.0),
            "gate_up": rand(*experts, 2 * i, h, scale=h**-0.5),
            "down": rand(*experts, h, i, scale=i**-0.5),
            **({"router": rand(shape.num_experts, h)} if shape.is_moe else {}),
        } for _ in range(shape.num_layers)]
        self.awq = [{} for _ in range(shape.num_layers)]
        if shape.awq_group_size:
            for layer, (weights, packed) in enumerate(zip(self.layers, self.awq, strict=True)):
                for i, (name, (n, k)) in enumerate(zip(LINEARS, shape.linear_sizes,
                                                       strict=True)):
                    qweight, qzeros, scales = awq_tensors(k, n, shape.awq_group_size, DEVICE,
                                                          seed=100 * seed + 4 * layer + i)
                    scales = scales.to(dtype)
                    packed.update({name: qweight, f"{name}_zeros": qzeros,
                                   f"{name}_scales": scales})
                    weights[name] = awq_dequantize_ref(qweight, qzeros, scales,
                                                       shape.awq_group_size).T
        self.final_norm = rand(h, scale=0.1, offset=1.0)
        bs = shape.block_size
        blocks = -(-(context + 1) // bs)
        num_blocks = num_blocks or 2 * blocks + 3
        cache_shape = (shape.num_layers, 2, num_blocks, bs, shape.num_kv_heads, d)
        self.cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=DEVICE)
        # the sequence's blocks scattered over the pool; spare table entries point at NaN
        perm = torch.randperm(num_blocks, generator=gen)
        self.block_table = torch.cat((perm[:blocks], perm[blocks:blocks + 2])).to(
            torch.int32).to(DEVICE)
        tokens = torch.arange(context, device=DEVICE)
        slots = self.block_table[tokens // bs].long() * bs + tokens % bs
        for layer in range(shape.num_layers):
            kv = torch.randn(2, context, shape.num_kv_heads, d, generator=gen).to(dtype)
            store_kv_cache_ref(kv[0].to(DEVICE), kv[1].to(DEVICE), self.cache[layer, 0],
                               self.cache[layer, 1], slots)
        self.position = context
        self.slot = int(self.block_table[context // bs]) * bs + context % bs
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(context + 8).float(), inv)
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1).to(DEVICE)
        self.embedding = rand(h)

    def kernel(self, tiles=None, programs=None) -> PersistentDecode:
        table = pointer_table([{**weights, **self.awq[layer], "k_cache": self.cache[layer, 0],
                                "v_cache": self.cache[layer, 1]}
                               for layer, weights in enumerate(self.layers)], DEVICE)
        k = self.cache[0, 0]
        return PersistentDecode(self.shape, table, self.final_norm, self.cos_sin,
                                (k.stride(0), k.stride(1), k.stride(2)),
                                max_blocks=self.block_table.numel(),
                                tiles=tiles or PersistentTiles(),
                                programs=programs)

    def run(self, decode: PersistentDecode) -> torch.Tensor:
        def scalar(value):
            return torch.tensor([value], dtype=torch.int32, device=DEVICE)

        decode.input.copy_(self.embedding[None])
        return decode(self.block_table, scalar(self.context + 1), scalar(self.position),
                      scalar(self.slot)).clone()

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The normed hidden state and the cache after the step, from the references, in the
        model's order (the engine's separate kernels' rounding points)."""
        shape, dtype = self.shape, self.dtype
        cache = self.cache.clone()
        positions = torch.tensor([self.position], device=DEVICE)
        slots = torch.tensor([self.slot], device=DEVICE)
        hidden, residual = None, self.embedding[None]
        q_size = shape.num_heads * shape.head_dim
        kv_size = shape.num_kv_heads * shape.head_dim
        for layer, w in enumerate(self.layers):
            if hidden is None:
                x = rms_norm_ref(residual, w["in_norm"], shape.eps)
            else:
                x, residual = fused_add_rms_norm_ref(hidden, residual, w["in_norm"], shape.eps)
            qkv = (x.float() @ w["qkv"].float().T).to(dtype)
            q, k, v = qkv.split([q_size, kv_size, kv_size], -1)
            q = q.view(1, shape.num_heads, shape.head_dim)
            k = k.view(1, shape.num_kv_heads, shape.head_dim)
            v = v.view(1, shape.num_kv_heads, shape.head_dim)
            norms = (w["q_norm"], w["k_norm"]) if shape.qk_norm else (None, None)
            q, k = rotary_embedding_ref(positions, q, k, self.cos_sin, True, *norms, shape.eps)
            q, k = q.to(dtype), k.to(dtype)
            store_kv_cache_ref(k, v, cache[layer, 0], cache[layer, 1], slots)
            attn = paged_attention_ref(
                q, cache[layer, 0], cache[layer, 1], self.block_table[None],
                torch.tensor([0, 1], device=DEVICE), torch.tensor([self.context + 1]),
                shape.head_dim**-0.5).to(dtype).view(1, -1)
            o = (attn.float() @ w["o_proj"].float().T).to(dtype)
            x, residual = fused_add_rms_norm_ref(o, residual, w["post_norm"], shape.eps)
            if shape.is_moe:
                logits = (x.float() @ w["router"].float().T).to(dtype)
                weights, ids = moe_routing_ref(logits, shape.top_k, shape.norm_topk_prob)
                if dtype == torch.float32:
                    hidden = fused_moe_ref(x, w["gate_up"], w["down"], weights, ids)
                else:  # fused_moe's pair kernels' rounding: each act, each weighted row
                    hidden = moe_pairs_rounded(x, w["gate_up"], w["down"], weights, ids)
                continue
            gate_up = (x.float() @ w["gate_up"].float().T).to(dtype)
            act = silu_and_mul_ref(gate_up).to(dtype)
            hidden = (act.float() @ w["down"].float().T).to(dtype)
        out, _ = fused_add_rms_norm_ref(hidden, residual, self.final_norm, shape.eps)
        return out[0], cache


def moe_pairs_rounded(x, w13, w2, weights, ids) -> torch.Tensor:
    """One token's experts as fused_moe's pair kernels round (x's dtype): each expert's
    SwiGLU from float32 sums, rounded; each weighted down row rounded; the rows summed in
    float32 in slot order."""
    total = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
    for weight, expert in zip(weights[0].tolist(), ids[0].tolist(), strict=True):
        act = silu_and_mul_ref(x[0].float() @ w13[expert].float().T).to(x.dtype)
        total += (weight * (act.float() @ w2[expert].float().T)).to(x.dtype).float()
    return total.to(x.dtype)[None]


def qwen3_like(**overrides) -> DecodeShape:
    sizes = dict(hidden_size=64, intermediate_size=96, num_heads=4, num_kv_heads=2,
                 head_dim=16, num_layers=2, block_size=4, eps=1e-6, qk_norm=True)
    return DecodeShape(**{**sizes, **overrides})


def check(decoder: RandomDecoder, decode: PersistentDecode, tol: float) -> None:
    """The step's output and cache against the reference's, within tol of their largest
    magnitude (bfloat16: a GEMV's summation order flips the last bit of some outputs, and a
    layer carries those on)."""
    want, want_cache = decoder.reference()
    got = decoder.run(decode)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=0)
    # the new token's K/V landed at its slot in every layer; nothing else changed
    cache_scale = want_cache.float().nan_to_num().abs().max().item()
    torch.testing.assert_close(decoder.cache.float(), want_cache.float(),
                               atol=tol * cache_scale, rtol=0, equal_nan=True)
    assert not decode.error()
    # the counts are back at zero for the next launch
    assert not decode.sync.any()


@pytest.mark.parametrize("context,max_splits", [(0, 2), (5, 2), (37, 4)])
def test_qwen3_shapes_float32(context, max_splits):
    # tiles smaller than the GEMVs, several blocks per program, several key splits
    decoder = RandomDecoder(qwen3_like(), context, torch.float32)
    tiles = PersistentTiles(block_n=4, block_k=32, block_t=4, split_tokens=8)
    decode = decoder.kernel(tiles, programs=9)
    assert decode.max_splits == max_splits and decode.even
    check(decoder, decode, tol=1e-5)


@pytest.mark.parametrize("balanced", [True, False])
def test_llama_shapes_ragged_tiles(balanced):
    """No q/k norm, a GQA group of 3 (padded to 4), sizes no tile divides (masked tiles), a
    block size the keys' step does not divide; rows in equal runs a program or strided."""
    shape = qwen3_like(hidden_size=48, intermediate_size=40, num_heads=6, num_kv_heads=2,
                       qk_norm=False, block_size=8, num_layers=3)
    decoder = RandomDecoder(shape, 29, torch.float32, seed=1)
    tiles = PersistentTiles(block_n=4, block_k=32, block_t=4, split_tokens=4,
                            balanced_rows=balanced)
    decode = decoder.kernel(tiles, programs=3)
    assert not decode.even
    check(decoder, decode, tol=1e-5)


def test_repeated_steps_reuse_the_buffers():
    """A second step over the first's cache: the split counts and scratch left by the first
    do not leak into it."""
    decoder = RandomDecoder(qwen3_like(num_layers=1), 11, torch.float32, seed=2)
    decode = decoder.kernel(PersistentTiles(block_n=4, block_k=32, block_t=4, split_tokens=4),
                            programs=4)
    decoder.run(decode)
    decoder.context, decoder.position = 12, 12
    bs = decoder.shape.block_size
    decoder.slot = int(decoder.block_table[12 // bs]) * bs + 12 % bs
    decoder.embedding = decoder.embedding.flip(0)
    check(decoder, decode, tol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
def test_mixture_of_experts_float32(renormalize):
    """Qwen3-MoE's layers: router, top-k routing, the chosen experts' GEMVs summed by their
    weights; more experts than the routing picks, and several row blocks an expert."""
    shape = qwen3_like(num_experts=8, top_k=3, norm_topk_prob=renormalize,
                       intermediate_size=24)
    decoder = RandomDecoder(shape, 13, torch.float32, seed=5)
    decode = decoder.kernel(PersistentTiles(block_n=4, block_k=32, block_t=4, split_tokens=4),
                            programs=5)
    check(decoder, decode, tol=1e-5)


def test_bfloat16_close_to_the_reference():
    decoder = RandomDecoder(qwen3_like(), 21, torch.bfloat16, seed=3)
    decode = decoder.kernel(PersistentTiles(block_n=4, block_k=32, block_t=4, split_tokens=8),
                            programs=4)
    check(decoder, decode, tol=2e-2)


@pytest.mark.parametrize("group,cols,block_k,programs", [
    (32, 32, 16, 9),  # several column blocks and K splits; splits end inside groups
    (16, 16, 8, 5),  # a gated block of one gate and one up pack; more items than programs
    (64, 256, 16, 3),  # one column block wider than every GEMV (masked packs)
])
def test_awq_weights_float32(group, cols, block_k, programs):
    """AWQ linear layers (W4A16): items of (column block, K split), the last split of a block
    summing the partials and applying the epilogue (the qkv store, o_proj's residual, gate_up's
    SwiGLU over gate and up packs, down), against the dequantized weights."""
    shape = qwen3_like(awq_group_size=group, intermediate_size=128)
    decoder = RandomDecoder(shape, 9, torch.float32, seed=7)
    tiles = PersistentTiles(block_n=4, block_k=32, block_t=4, split_tokens=4, awq_cols=cols,
                            awq_block_k=block_k, awq_splits=4)
    decode = decoder.kernel(tiles, programs=programs)
    check(decoder, decode, tol=1e-5)


def test_awq_bfloat16_close_to_the_reference():
    decoder = RandomDecoder(qwen3_like(awq_group_size=32, num_heads=8, num_kv_heads=2,
                                       qk_norm=False), 17, torch.bfloat16, seed=8)
    decode = decoder.kernel(PersistentTiles(block_t=4, split_tokens=8, awq_cols=64), programs=7)
    check(decoder, decode, tol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("context", [1, 300, 4000])
def test_one_launch_on_the_gpu(context):
    """Qwen3-0.6B's per-layer shapes over 4 layers, one launch with the grid barriers."""
    shape = DecodeShape(hidden_size=1024, intermediate_size=3072, num_heads=16, num_kv_heads=8,
                        head_dim=128, num_layers=4, block_size=16, eps=1e-6, qk_norm=True)
    decoder = RandomDecoder(shape, context, torch.bfloat16, seed=4)
    decode = decoder.kernel()
    assert decode.programs >= decode.max_splits * shape.num_kv_heads
    check(decoder, decode, tol=3e-2)
    assert math.isfinite(decode.out.float().sum().item())


@pytest.mark.gpu
def test_one_launch_mixture_of_experts_on_the_gpu():
    """Qwen3-30B-A3B's per-layer shapes (128 experts, top-8, GQA group 8) over 2 layers."""
    shape = DecodeShape(hidden_size=2048, intermediate_size=768, num_heads=32, num_kv_heads=4,
                        head_dim=128, num_layers=2, block_size=16, eps=1e-6, qk_norm=True,
                        num_experts=128, top_k=8, norm_topk_prob=True)
    decoder = RandomDecoder(shape, 700, torch.bfloat16, seed=6)
    decode = decoder.kernel()
    assert decode.tiles.block_k == 256 and decode.tiles.block_t == 4 and decode.even
    check(decoder, decode, tol=3e-2)


@pytest.mark.gpu
def test_one_launch_awq_on_the_gpu():
    """Llama-3.1-8B's per-layer shapes with AWQ linear layers (group 128), one launch: the
    column blocks' split counts and the pipelined qweight tiles at real sizes."""
    shape = DecodeShape(hidden_size=4096, intermediate_size=14336, num_heads=32,
                        num_kv_heads=8, head_dim=128, num_layers=1, block_size=16, eps=1e-5,
                        qk_norm=False, awq_group_size=128)
    decoder = RandomDecoder(shape, 500, torch.bfloat16, seed=9)
    decode = decoder.kernel()
    check(decoder, decode, tol=3e-2)
