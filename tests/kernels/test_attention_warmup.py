"""The start-up warm-up launches every paged-attention variant that real batches pick."""

import itertools

import pytest
import torch

from echo_kernels.attention import common, paged
from echo_kernels.attention.paged import plan_launch
from echo_kernels.attention.warmup import (
    paged_attention_warmups,
    warm_up_paged_attention,
    warm_up_varlen_attention,
)


def batches():
    """Query runs of decode batches, decodes mixed with a chunk, and prefill chunks."""
    for num_seqs in (1, 2, 5, 9, 40, 200, 1000):
        yield [1] * num_seqs
    for decodes, chunk in itertools.product((0, 1, 3, 30, 300), (2, 3, 8, 17, 40, 100, 900)):
        yield [1] * decodes + [chunk]
    for num_seqs, chunk in itertools.product((2, 4, 8, 40, 300), (9, 64, 120, 1000)):
        yield [chunk] * num_seqs


@pytest.fixture
def as_on_an_h200(monkeypatch):
    """Plans as the GPU makes them (its tiles, 132 SMs), host-side only."""
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(paged, "interpreting", lambda: False)
    monkeypatch.setattr(paged, "sm_count", lambda device, without_gpu: 132)


@pytest.mark.parametrize("heads, kv_heads, head_dim, is_int8",
                         [(32, 8, 128, False), (32, 8, 128, True), (16, 1, 128, False),
                          (40, 8, 64, True), (32, 1, 128, False), (64, 2, 128, True)])
@pytest.mark.parametrize("has_new_kv", [True, False])
def test_every_plan_of_a_real_batch_is_warmed_up(as_on_an_h200, heads, kv_heads, head_dim,
                                                 is_int8, has_new_kv):
    device = torch.device("cuda")  # only for the SM count above; nothing is launched
    variants = {launch.plan.variant for launch in
                paged_attention_warmups(heads, kv_heads, head_dim, is_int8, device, has_new_kv)}
    seen = set()
    for q_lens, max_k, ordered in itertools.product(batches(), (300, 4096, 32768),
                                                    (True, False)):
        plan = plan_launch(sum(q_lens), len(q_lens), kv_heads, heads // kv_heads, head_dim,
                           is_int8, max(q_lens), max(max_k, max(q_lens)), ordered, device,
                           has_new_kv=has_new_kv)
        assert plan.variant in variants, (q_lens, max_k, ordered, plan)
        seen.add(plan.variant)
    # and reach every variant: the warm-up compiles none for nothing (with GQA groups of 16
    # and more, some tile classes never get runs of several tokens, or any run at all)
    assert seen == variants


# a model that gives attention no K/V (fp16 cache), and one that does, with the q/k norm (int8)
@pytest.mark.parametrize("kv_dtype,qk_norm", [(torch.float16, None), (torch.int8, True)])
def test_warm_up_runs_every_variant(device, paged_batch, kv_dtype, qk_norm):
    batch = paged_batch([1], [40], 4, 2, 32, 16, torch.float16, kv_dtype=kv_dtype)
    caches = [c if c is None else c.clone() for c in
              (batch.k_cache, batch.v_cache, batch.k_scale, batch.v_scale)]
    warm_up_paged_attention(4, *caches, 256, torch.float16, qk_norm)
    for cache, before in zip(caches, (batch.k_cache, batch.v_cache, batch.k_scale,
                                      batch.v_scale), strict=True):
        assert cache is None or torch.equal(cache.nan_to_num(), before.nan_to_num())  # no store
    launches = paged_attention_warmups(4, 2, 32, kv_dtype == torch.int8, torch.device(device),
                                       qk_norm is not None)
    # two tile classes, each with one tile per sequence or not (ordered or not), split or not;
    # one-token runs given their K/V also rotate them in the launch
    assert len(launches) == len({launch.plan.variant for launch in launches}) >= 10
    assert any(launch.plan.fused_rope for launch in launches) == (qk_norm is not None)
    configs = warm_up_varlen_attention(4, 2, 32, torch.float16, torch.device(device))
    assert len(configs) == len(set(configs)) >= 2
