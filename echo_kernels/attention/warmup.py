"""Compile, at start-up, every attention kernel variant a serving engine can meet.

Triton compiles a kernel once per combination of its compile-time flags. Which combination a
step needs depends on its batch: tile class, one tile per sequence or not, longest-first order,
key splits, rotating the step's K/V in the launch (decode) or not and, after a split, the
merge's padded split count. A variant first met while serving compiles inside that step (every
stream stalls for the compilation): on a Qwen3-8B server a concurrency-64 benchmark compiled
attention variants after start-up (docs/benchmarks.md, History 58437c0). These functions launch
each variant once on dummy sequences (one key each, in cache block 0; nothing is stored)
instead.
"""

import itertools
from dataclasses import dataclass

import torch
import triton

from echo_kernels.attention.common import tile_classes
from echo_kernels.attention.paged import (
    LaunchPlan,
    NewKV,
    max_num_splits,
    paged_attention,
    plan_launch,
    wave_size,
)
from echo_kernels.attention.reduce import merge_splits
from echo_kernels.attention.varlen import flash_attn_varlen


@dataclass(frozen=True)
class WarmupLaunch:
    plan: LaunchPlan
    num_seqs: int  # one query token and one key each
    max_seqlen_q: int  # the bounds that select the plan
    max_seqlen_k: int


def paged_attention_warmups(num_heads: int, num_kv_heads: int, head_dim: int, is_int8: bool,
                            device: torch.device, has_new_kv: bool = False
                            ) -> list[WarmupLaunch]:
    """One dummy launch per paged_attention variant (host-side: nothing runs). has_new_kv: the
    model gives paged_attention the step's K/V to rotate and store (NewKV), so its decode
    batches take the fused launch."""
    group = num_heads // num_kv_heads
    launches = []
    for first, last, config in tile_classes(head_dim, is_int8):
        # a batch's rows per sequence are m x group for m query tokens (batch_tile_config)
        last = first + 2 * group if last is None else last
        tokens = [m for m in range(1, last // group + 1) if first <= m * group <= last]
        # one tile per sequence: m tokens fit a tile. Not: a run longer than the tile, or
        # runs of different lengths (m >= 2 on average, the longest longer)
        one_tile_options = ([True] if any(m * group <= config.block_m for m in tokens) else []) \
            + ([False] if any(m >= 2 or m * group > config.block_m for m in tokens) else [])
        wave = wave_size(config, device)
        for one_tile in one_tile_options:
            # given the K/V, one-token runs rotate them in the launch; only runs of 2+ tokens
            # that still fit one tile take the one-tile launch without
            fused_options = [True] if has_new_kv and one_tile and 1 in tokens else []
            if not (has_new_kv and one_tile) or any(
                    m >= 2 and m * group <= config.block_m for m in tokens):
                fused_options.append(False)
            for fused, ordered, splits in itertools.product(
                    fused_options, (True, False) if one_tile else (False,), (1, 2)):
                # ordered: more programs than one wave
                num_seqs = wave // (num_kv_heads * splits) + 1 if ordered else 2
                max_q = 1 if one_tile else config.block_m // group + 1
                max_k = splits * config.block_n
                plan = plan_launch(num_seqs, num_seqs, num_kv_heads, group, head_dim, is_int8,
                                   max_q, max_k, True, device, splits, config, fused)
                assert plan.variant == (config, one_tile, ordered, splits > 1, fused), plan
                launches.append(WarmupLaunch(plan, num_seqs, max_q, max_k))
    return launches


def warm_up_paged_attention(num_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                            max_seqlen_k: int, dtype: torch.dtype,
                            qk_norm: bool | None = None) -> None:
    """Launch every paged_attention variant over this cache (queries of `dtype`) once, reading
    cache block 0, and the split merge for every padded split count up to max_seqlen_k's.
    qk_norm: the model gives paged_attention its K/V (NewKV), with q/k norm weights or not;
    None: it does not."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    is_int8 = k_cache.dtype == torch.int8
    device = k_cache.device
    for launch in paged_attention_warmups(num_heads, num_kv_heads, head_dim, is_int8, device,
                                          qk_norm is not None):
        n = launch.num_seqs
        seqs = torch.arange(n + 1, dtype=torch.int32, device=device)
        new_kv = None
        if launch.plan.fused_rope:  # stores nothing: every slot is -1
            kv = torch.zeros(n, num_kv_heads, head_dim, dtype=dtype, device=device)
            norm = torch.ones(head_dim, dtype=dtype, device=device) if qk_norm else None
            new_kv = NewKV(kv, kv, torch.full((n,), -1, device=device),
                           torch.zeros(n, dtype=torch.long, device=device),
                           torch.zeros(1, head_dim, device=device), norm, norm)
        paged_attention(torch.zeros(n, num_heads, head_dim, dtype=dtype, device=device),
                        k_cache, v_cache, torch.zeros(n, 1, dtype=torch.int32, device=device),
                        seqs, torch.ones(n, dtype=torch.int32, device=device),
                        launch.max_seqlen_q, launch.max_seqlen_k, 1.0, k_scale, v_scale,
                        seq_order=seqs[:-1], num_splits=launch.plan.num_splits,
                        config=launch.plan.config, new_kv=new_kv)
    most_splits = max(max_num_splits(max_seqlen_k, config)
                      for _, _, config in tile_classes(head_dim, is_int8))
    for pad in (2**i for i in range(1, triton.next_power_of_2(most_splits).bit_length())):
        merge_splits(torch.zeros(1, num_heads, pad, head_dim, device=device),
                     torch.zeros(1, num_heads, pad, 2, device=device),
                     torch.empty(1, num_heads, head_dim, dtype=dtype, device=device))


def warm_up_varlen_attention(num_heads: int, num_kv_heads: int, head_dim: int,
                             dtype: torch.dtype, device: torch.device) -> list:
    """Launch flash_attn_varlen once per tile class; returns the classes' tiles."""
    configs = [config for _, _, config in tile_classes(head_dim)]
    cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
    q = torch.zeros(1, num_heads, head_dim, dtype=dtype, device=device)
    kv = torch.zeros(1, num_kv_heads, head_dim, dtype=dtype, device=device)
    for config in configs:
        flash_attn_varlen(q, kv, kv, cu, cu, 1, 1, 1.0, config=config)
    return configs
