"""EngineCore start-up: one sequence of max_model_len tokens must fit in the KV cache."""

import pytest

from echo.config import EngineConfig
from echo.engine.core import EngineCore


def config(folder, **kwargs) -> EngineConfig:
    return EngineConfig.create(str(folder), device="cpu", dtype="float32", **kwargs)


def test_a_max_model_len_the_cache_cannot_hold_is_refused_with_the_largest_that_fits(
        tiny_llama, monkeypatch):
    # tiny_llama: 2 layers x (K and V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes = 8 KiB per
    # block, so 128 KiB of CPU cache holds 16 blocks: 256 tokens
    monkeypatch.setenv("ECHO_CPU_KV_CACHE_GIB", str(2**-13))
    with pytest.raises(ValueError, match=r"max_model_len: 512 tokens need 32 KV-cache blocks "
                                         r"of 16, but the cache holds 16 \(256 tokens\): pass "
                                         r"max_model_len <= 256"):
        EngineCore(config(tiny_llama, max_model_len=512))
    core = EngineCore(config(tiny_llama, max_model_len=256))  # exactly full
    assert core.num_blocks == 16
    # an explicit block count is the user's choice: the scheduler then refuses what never fits
    assert EngineCore(config(tiny_llama, max_model_len=512, num_gpu_blocks_override=4)
                      ).num_blocks == 4
