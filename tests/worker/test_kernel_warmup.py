"""kernel_warmup: the start-up step shapes fit the limits, store nothing, and give the same
logits through the Triton kernels (interpreter) as through the PyTorch reference backend."""

import pytest
import torch

from echo.config import EngineConfig
from echo.worker.kernel_warmup import (
    WarmupBatch,
    warmup_batches,
    warmup_metadata,
    warmup_positions,
)
from echo.worker.model_runner import ModelRunner
from echo.worker.startup import warm_up_step_shapes


def test_batches_respect_the_limits():
    batches = warmup_batches(max_model_len=4096, max_num_batched_tokens=16384, max_num_seqs=256)
    assert WarmupBatch((600,) * 8, (2048,) * 8) in batches
    assert WarmupBatch((600, 200), (600, 200)) in batches  # first prefills
    # a 64-token context leaves out every chunk longer than 64 and the 200-token prefill;
    # 3 sequences at most leaves out the 4- and 8-sequence batches
    small = warmup_batches(max_model_len=64, max_num_batched_tokens=128, max_num_seqs=3)
    assert small == [WarmupBatch((1, 1), (64, 64)), WarmupBatch((64,), (64,)),
                     WarmupBatch((10, 20), (10, 20))]


def test_metadata_and_positions():
    batch = WarmupBatch((1, 3), (5, 4))
    meta = warmup_metadata(batch, block_size=2, device=torch.device("cpu"))
    assert meta.cu_seqlens_q.tolist() == [0, 1, 4]
    assert meta.block_table.shape == (2, 3) and not meta.block_table.any()
    assert (meta.slot_mapping == -1).all() and not meta.no_cached_prefix
    assert warmup_positions(batch, torch.device("cpu")).tolist() == [4, 1, 2, 3]
    assert warmup_metadata(WarmupBatch((2, 3), (2, 3)), 2, torch.device("cpu")).no_cached_prefix


@pytest.mark.slow  # every start-up shape through the Triton interpreter: over a minute
def test_triton_kernels_match_the_reference_and_store_nothing(tiny_qwen3):
    def run(backend: str):
        config = EngineConfig.create(str(tiny_qwen3), device="cpu", dtype="float32",
                                     max_model_len=64, max_num_seqs=8,
                                     max_num_batched_tokens=512, attention_backend=backend)
        runner = ModelRunner(config)
        runner.init_kv_cache(8)
        before = [c.k.clone() for c in runner.kv_caches]
        logits = warm_up_step_shapes(runner)
        assert all(torch.equal(b, c.k) for b, c in zip(before, runner.kv_caches, strict=True))
        return logits

    triton_logits, reference = run("triton"), run("torch")
    assert len(reference) == 5  # (1,1), (1,1,1,16), (64,), (64,)*8, (10,20)
    for got, want in zip(triton_logits, reference, strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)
