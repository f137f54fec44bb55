"""KV-cache sizing and allocation: int8 blocks cost their int8 data plus two float32 scales."""

import dataclasses

import pytest
import torch

from echo.config import EngineConfig
from echo.worker.kv_cache import KVCacheSpec, zeros
from echo.worker.model_runner import ModelRunner

SMALL = KVCacheSpec(num_layers=2, block_size=16, num_kv_heads=2, head_dim=8,
                    model_dtype=torch.bfloat16, kv_cache_dtype="int8")


def test_int8_bytes_per_block_by_hand():
    # 2 layers x 16 tokens x (K, V) x 2 heads x (8 int8 values + one 4-byte scale)
    assert SMALL.bytes_per_block() == 2 * 16 * 2 * 2 * (8 + 4) == 1536
    bf16 = dataclasses.replace(SMALL, kv_cache_dtype="bf16")
    assert bf16.bytes_per_block() == 2 * 16 * 2 * 2 * 8 * 2 == 2048
    assert dataclasses.replace(SMALL, kv_cache_dtype="auto").bytes_per_block() == 2048


def test_int8_holds_1_94x_the_blocks_of_bf16_at_head_dim_128():
    # Llama-3.1-8B's shape
    int8 = KVCacheSpec(32, 16, 8, 128, torch.bfloat16, "int8")
    bf16 = dataclasses.replace(int8, kv_cache_dtype="auto")
    budget = 10 * 2**30
    ratio = (budget // int8.bytes_per_block()) / (budget // bf16.bytes_per_block())
    assert ratio == pytest.approx(256 / 132, rel=1e-4)  # 1.939...


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "bf16", "int8"])
def test_allocation_dtypes_shapes_and_bytes(kv_cache_dtype):
    spec = dataclasses.replace(SMALL, kv_cache_dtype=kv_cache_dtype)
    caches = spec.allocate(5, torch.device("cpu"))
    assert len(caches) == 2
    for cache in caches:
        assert cache.k.shape == cache.v.shape == (5, 16, 2, 8)
        if kv_cache_dtype == "int8":
            assert cache.k.dtype == cache.v.dtype == torch.int8
            assert cache.k_scale.shape == cache.v_scale.shape == (5, 16, 2)
            # a block's scales of one head are contiguous (cache_scales)
            assert cache.k_scale.stride() == cache.v_scale.stride() == (32, 1, 16)
            assert cache.k_scale.dtype == cache.v_scale.dtype == torch.float32
        else:
            assert cache.k.dtype == cache.v.dtype == torch.bfloat16
            assert cache.k_scale is None and cache.v_scale is None
    # the sizing counts exactly the memory the allocation takes
    tensors = [t for c in caches for t in (c.k, c.v, c.k_scale, c.v_scale) if t is not None]
    assert sum(t.numel() * t.element_size() for t in tensors) == 5 * spec.bytes_per_block()


@pytest.mark.parametrize("kv_cache_dtype", ["bf16", "int8"])
def test_every_layer_is_a_view_of_the_stacked_tensors(kv_cache_dtype):
    spec = dataclasses.replace(SMALL, kv_cache_dtype=kv_cache_dtype)
    stacked = spec.allocate_stacked(5, torch.device("cpu"))
    assert stacked.kv.shape == (2, 2, 5, 16, 2, 8)
    for layer, cache in enumerate(stacked.layers):
        assert cache.k.is_contiguous() and cache.v.is_contiguous()  # as the kernels expect
        cache.k[3, 1, 0, 2] = 1 + layer
        cache.v[4, 0, 1, 7] = 5 + layer
        assert stacked.kv[layer, 0, 3, 1, 0, 2] == 1 + layer
        assert stacked.kv[layer, 1, 4, 0, 1, 7] == 5 + layer
        if kv_cache_dtype == "int8":
            cache.v_scale[2, 5, 1] = 9 + layer
            assert stacked.scales[layer, 1, 2, 5, 1] == 9 + layer
    assert int(stacked.kv.count_nonzero()) == 4
    # a block of every layer is one index of each plane: block 3 holds layer 0's K value 1
    planes = stacked.planes()
    assert [p.shape[:2] for p in planes] == [(5, 4)] * len(planes)
    assert sum(p[0].numel() for p in planes) == spec.bytes_per_block()
    assert planes[0][3].view(torch.bfloat16 if kv_cache_dtype == "bf16" else torch.int8)[
        0].reshape(16, 2, 8)[1, 0, 2] == 1


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_a_cpu_cache_is_zero_and_costs_memory_only_where_it_is_used():
    before = _resident_bytes()
    cache = zeros((2, 2**27), torch.bfloat16, torch.device("cpu"))  # 512 MiB
    assert cache.shape == (2, 2**27) and cache.dtype == torch.bfloat16
    assert _resident_bytes() - before < 64 * 2**20  # torch.zeros would have written it all
    probe = cache[:, ::2**20]  # a value from every MiB ...
    assert probe.count_nonzero() == 0  # ... is zero
    cache[1, -1] = 3.5
    assert cache[1, -1].item() == 3.5 and cache[0, -1].item() == 0


def test_describe_names_dtype_blocks_tokens_and_gib():
    spec = KVCacheSpec(32, 16, 8, 128, torch.bfloat16, "int8")
    num_blocks = 12345
    gib = num_blocks * spec.bytes_per_block() / 2**30
    assert spec.describe(num_blocks) == \
        f"KV cache: int8, 12345 blocks of 16 tokens (197,520 tokens, {gib:.1f} GiB)"
    assert dataclasses.replace(spec, kv_cache_dtype="auto").describe(2, num_ranks=2) == \
        "KV cache: bfloat16, 2 blocks of 16 tokens (32 tokens, 0.0 GiB on each of 2 GPUs)"


def test_runner_sizes_allocates_and_reports_an_int8_cache(tiny_llama, monkeypatch, capsys):
    monkeypatch.setenv("ECHO_CPU_KV_CACHE_GIB", str(2**-10))  # 1 MiB of cache on the CPU

    def runner(kv_cache_dtype):
        config = EngineConfig.create(str(tiny_llama), device="cpu", dtype="float32",
                                     max_model_len=128, max_num_seqs=2,
                                     kv_cache_dtype=kv_cache_dtype)
        return ModelRunner(config)

    int8, normal = runner("int8"), runner("auto")
    # tiny_llama: 2 layers, 2 KV heads of 16 dims, float32 model
    assert int8.kv_bytes_per_block() == 2 * 16 * 2 * 2 * (16 + 4)
    assert normal.kv_bytes_per_block() == 2 * 16 * 2 * 2 * 16 * 4
    num_blocks = int8.determine_num_blocks()
    assert num_blocks == 2**20 // int8.kv_bytes_per_block() == 409
    assert normal.determine_num_blocks() == 2**20 // normal.kv_bytes_per_block() == 128

    capsys.readouterr()
    int8.init_kv_cache(num_blocks)
    assert "KV cache: int8, 409 blocks of 16 tokens (6,544 tokens, 0.0 GiB)" in \
        capsys.readouterr().err
    assert len(int8.kv_caches) == 2
    assert all(c.k.dtype == torch.int8 and c.k_scale.shape == (409, 16, 2)
               for c in int8.kv_caches)


def test_a_host_tier_takes_its_staging_buffer_from_the_budget(tiny_llama, monkeypatch):
    from echo.worker.kv_transfer import STAGING_BLOCKS, num_host_blocks

    monkeypatch.setenv("ECHO_CPU_KV_CACHE_GIB", str(2**-10))  # 1 MiB: 128 float32 blocks
    config = EngineConfig.create(str(tiny_llama), device="cpu", dtype="float32",
                                 max_model_len=128, max_num_seqs=2, kv_offloading_size=0.001)
    runner = ModelRunner(config)
    bpb = 2 * 16 * 2 * 2 * 16 * 4  # 2 layers x 16 tokens x (K, V) x 2 heads x 16 dims x 4 bytes
    assert STAGING_BLOCKS == 64
    assert runner.determine_num_blocks() == 128 - 64
    runner.init_kv_cache(64)
    # the worker's host tier holds the blocks the core counts: 0.001 GiB over 8 KiB blocks
    assert runner.kv_transfers.host.num_blocks == num_host_blocks(config) \
        == int(0.001 * 2**30) // bpb == 131
