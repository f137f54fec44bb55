"""Several decode steps per launch (SchedulerOutput.num_decode_steps; num_scheduler_steps).

When every request of a decode batch samples plainly (temperature and seed; no filters,
penalties, token rules, grammar or logprobs), a step needs nothing from the host: each sampled
token is the next step's input, positions and context lengths grow by one, and the next KV slot
follows from the block table, whose blocks the scheduler allocated for all the steps. So the
runner runs forward, sample and advance N times on the device and copies the N x B tokens to
the host once: one host round trip per N tokens, which is what bounds a small model at small
batch (docs/benchmarks.md, Decode latency at batch 1). Tokens computed past a request's stop are
thrown away when the scheduler cuts its tokens at the first stop.

With CUDA graphs, sampling and the advance are a second graph per batch size, captured over the
forward graph's output and the StepBuffers' persistent inputs, so a step costs the host two
replays and one copy. Eagerly (CPU, enforce_eager) the same functions run op by op, with the
attention metadata's host fields advanced by the host.
"""

import dataclasses
from collections.abc import Callable

import numpy as np
import torch

from echo.attention.backend import AttentionBackend, AttentionMetadata, KVCache
from echo.layers.attention import ForwardContext
from echo.worker.cuda_graphs import CudaGraphRunner
from echo.worker.sampler import gumbel_sample
from echo.worker.step_buffers import StepBuffers
from echo_kernels.decode_advance import advance_decode, warm_up_advance_decode
from echo_kernels.reference import advance_decode_ref


def advance_decode_inputs(input_ids: torch.Tensor, positions: torch.Tensor,
                          meta: AttentionMetadata, sample_steps: torch.Tensor,
                          tokens: torch.Tensor, block_size: int,
                          max_position: int | None = None) -> None:
    """Turn a decode batch's inputs (StepBuffers.load's views) into the next step's, on the
    device: the sampled token is each sequence's next input, one position and one context
    token further, stored at the slot the block table gives that position. Padding rows (slot
    -1: they store nothing) stay as they are, so the same captured graph serves any batch up to
    its size. A row reaching max_position (a draft model's steps past max_model_len) stores
    nothing from then on. One kernel on CUDA (echo_kernels.decode_advance), its PyTorch twin
    elsewhere."""
    advance = advance_decode if tokens.is_cuda else advance_decode_ref
    advance(input_ids, positions, meta.slot_mapping, meta.seq_lens, sample_steps, tokens,
            meta.block_table, block_size, max_position)


def advanced_metadata(meta: AttentionMetadata, steps: int) -> AttentionMetadata:
    """The host fields of a decode batch's metadata `steps` steps later (eager forward)."""
    if steps == 0:
        return meta
    return dataclasses.replace(
        meta, max_seqlen_k=meta.max_seqlen_k + steps, no_cached_prefix=False,
        seq_lens_cpu=tuple(n + steps for n in meta.seq_lens_cpu))


def greedy_sampling(buffers: StepBuffers, rows: int) -> None:
    """Sampling fields of a decode batch that samples greedily (a drafter's steps)."""
    zeros = np.zeros(rows, np.int64)
    buffers.put("temperature", zeros.astype(np.float32))
    buffers.put("seeds", zeros)
    buffers.put("sample_steps", zeros)


class MultiStepDecoder:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[KVCache], buffers: StepBuffers, graphs: CudaGraphRunner | None,
                 block_size: int, max_num_seqs: int, max_steps: int, device: torch.device,
                 max_position: int | None = None, persistent: Callable | None = None):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        # a one-row forward in place of the model's when not replaying (persistent_decoder.py)
        self.persistent = persistent
        self.buffers, self.graphs, self.block_size = buffers, graphs, block_size
        self.max_position = max_position  # advance_decode_inputs' bound
        self.tokens = torch.zeros(max_steps, max_num_seqs, dtype=torch.int64, device=device)
        # batch size -> (graph, its sampled tokens): sampling and advance over the forward
        # graph of that size
        self.sample_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        if device.type == "cuda":  # eager sampling (no graphs, tensor parallelism) too
            warm_up_advance_decode(device, block_size, max_position)

    def sample_and_advance(self, hidden: torch.Tensor, input_ids: torch.Tensor,
                           positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        rows = meta.num_seqs
        buffers = self.buffers
        logits = self.model.compute_logits(hidden[:rows])
        sample_steps = buffers.tensor("sample_steps")
        tokens = gumbel_sample(logits, buffers.tensor("temperature")[:rows],
                               buffers.tensor("seeds")[:rows], sample_steps[:rows])
        advance_decode_inputs(input_ids, positions, meta, sample_steps, tokens, self.block_size,
                              self.max_position)
        return tokens

    @torch.inference_mode()
    def capture(self) -> None:
        """A sampling graph per captured forward size, largest first into one pool."""
        pool = None
        for size in sorted(self.graphs.sizes, reverse=True):
            ids, positions, meta = self.buffers.load_padding(size, self.graphs.max_model_len)
            hidden = self.graphs.outputs(size)
            self.sample_and_advance(hidden, ids, positions, meta)  # compile outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                tokens = self.sample_and_advance(hidden, ids, positions, meta)
            pool = pool or graph.pool()
            self.sample_graphs[size] = (graph, tokens)
        torch.cuda.synchronize()

    def run(self, num_steps: int, num_seqs: int, input_ids: torch.Tensor,
            positions: torch.Tensor, meta: AttentionMetadata, replay: bool) -> torch.Tensor:
        """[num_steps, num_seqs] sampled tokens, from inputs already in the StepBuffers (padded
        to a captured size when `replay`, with the sampling fields filled)."""
        rows = meta.num_seqs
        sample_graph = self.sample_graphs.get(rows) if replay else None
        for step in range(num_steps):
            if replay:
                hidden = self.graphs.replay(rows)
            else:
                forward = self.persistent if self.persistent is not None and rows == 1 \
                    else self.model
                hidden = forward(input_ids, positions, ForwardContext(
                    self.backend, advanced_metadata(meta, step), self.kv_caches))
            if sample_graph is not None:
                sample_graph[0].replay()
                tokens = sample_graph[1]
            else:
                tokens = self.sample_and_advance(hidden, input_ids, positions, meta)
            self.tokens[step, :rows].copy_(tokens)
        tokens = self.tokens[:num_steps, :num_seqs]
        # on the CPU nothing copies them out before the next launch overwrites them
        return tokens if tokens.is_cuda else tokens.clone()
