"""What each tensor-parallel rank runs in the TP tests: build the model for its rank, then greedy
decoding over a paged KV cache with the torch attention backend, recording every step's logits.

The same `greedy_with_logits` runs in the test process for TP=1, so the two sides share
everything but the sharding. Rank programs are module-level functions so that spawned
processes can import them.
"""

import os
import sys
import traceback
from datetime import timedelta
from itertools import accumulate
from pathlib import Path

import torch

from echo.attention.backend import AttentionMetadata, KVCache, make_backend
from echo.config import EngineConfig
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.attention import ForwardContext
from echo.worker.model_loader import build_model

BLOCK = 16
MAX_BLOCKS_PER_SEQ = 8  # 128 tokens per sequence: enough for every prompt plus its output
COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a rank whose peer died fails instead of hanging


class PagedModel:
    """One rank's model with its own KV cache; sequence i owns a fixed run of blocks."""

    def __init__(self, folder: Path, tp: TPGroup, num_seqs: int):
        config = EngineConfig.create(str(folder), device="cpu", dtype="float32",
                                     tensor_parallel_size=tp.size)
        self.model = build_model(config.model, torch.device("cpu"), tp)
        attn = self.model.model.layers[0].self_attn  # this rank's share of the heads
        self.backend = make_backend("torch", attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                    attn.head_dim**-0.5)
        shape = (num_seqs * MAX_BLOCKS_PER_SEQ, BLOCK, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [KVCache(torch.zeros(shape), torch.zeros(shape))
                          for _ in range(config.model.arch.num_layers)]
        self.block_table = torch.arange(num_seqs * MAX_BLOCKS_PER_SEQ,
                                        dtype=torch.int32).view(num_seqs, MAX_BLOCKS_PER_SEQ)

    @torch.inference_mode()
    def step(self, seqs: list[list[int]], num_cached: list[int]) -> torch.Tensor:
        """Compute every sequence's tokens after its first num_cached[i] (whose K/V are in the
        cache already); logits for each computed token, sequences one after another."""
        ids, positions, slots, query_lens = [], [], [], []
        for i, (tokens, cached) in enumerate(zip(seqs, num_cached)):
            pos = torch.arange(cached, len(tokens))
            ids.append(torch.tensor(tokens[cached:]))
            positions.append(pos)
            slots.append(self.block_table[i, pos // BLOCK].long() * BLOCK + pos % BLOCK)
            query_lens.append(len(tokens) - cached)
        seq_lens = [len(t) for t in seqs]
        meta = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            block_table=self.block_table[: len(seqs)],
            cu_seqlens_q=torch.tensor([0, *accumulate(query_lens)], dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            max_seqlen_q=max(query_lens), max_seqlen_k=max(seq_lens),
            no_cached_prefix=not any(num_cached),
            query_lens_cpu=tuple(query_lens), seq_lens_cpu=tuple(seq_lens))
        hidden = self.model(torch.cat(ids), torch.cat(positions),
                            ForwardContext(self.backend, meta, self.kv_caches))
        return self.model.compute_logits(hidden)


def greedy_with_logits(folder: Path, tp: TPGroup, prompts: list[list[int]],
                       max_new_tokens: int) -> dict:
    """Prefill every prompt in one step, then decode one token per sequence per step.
    Returns each step's logits and each sequence's generated tokens."""
    paged = PagedModel(folder, tp, len(prompts))
    seqs = [list(p) for p in prompts]
    num_cached = [0] * len(seqs)
    step_logits = []
    for _ in range(max_new_tokens):
        logits = paged.step(seqs, num_cached)
        step_logits.append(logits)
        last_rows = torch.tensor([len(s) - c for s, c in zip(seqs, num_cached)]).cumsum(0) - 1
        num_cached = [len(s) for s in seqs]
        for seq, token in zip(seqs, logits[last_rows].argmax(-1).tolist()):
            seq.append(token)
    return {"logits": step_logits,
            "tokens": [s[len(p):] for s, p in zip(seqs, prompts)]}


def run_rank(rank: int, world_size: int, init_file: str, jobs: list[tuple[str, str]],
             prompts: list[list[int]], max_new_tokens: int, out_dir: str) -> None:
    """One rank of a gloo group: run every (name, model folder) job and save what it saw to
    out_dir/{name}.rank{rank}.pt; on failure, save the traceback to out_dir/rank{rank}.error.
    Exit code 0 only when every job ran."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # the ranks share the host's cores
    exit_code = 1
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
        for name, folder in jobs:
            # NAME:reduce_in_norm: the RMSNorms do the row-parallel layers' all-reduces
            tp = TPGroup(rank, world_size, dist.group.WORLD,
                         reduce_in_norm=name.endswith(":reduce_in_norm"))
            result = greedy_with_logits(Path(folder), tp, prompts, max_new_tokens)
            torch.save(result, Path(out_dir) / f"{name}.rank{rank}.pt")
        dist.destroy_process_group()
        exit_code = 0
    except BaseException:
        (Path(out_dir) / f"rank{rank}.error").write_text(traceback.format_exc())
    finally:
        # NOTE: skip the interpreter's teardown, as echo's own worker does: gloo's threads
        # sometimes abort there ("terminate called without an active exception", SIGABRT)
        # even after destroy_process_group, about one run in four here
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def run_single(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> dict:
    return greedy_with_logits(folder, SINGLE, prompts, max_new_tokens)
