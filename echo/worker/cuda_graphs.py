"""CUDA graphs for decode-only batches: captured once per bucketed batch size, replayed padded.

A decode step of a small model is dominated by kernel-launch overhead; replaying a captured
graph removes it. Graphs read their inputs from the StepBuffers' persistent tensors and are
captured largest first into one memory pool (smaller graphs reuse the larger ones' memory).
Attention is captured with max_seqlen_k = max_model_len, so its split count covers any context.

With persistent_decode the batch-1 decode graph captures the persistent decoder
(persistent_decoder.py) in place of the model's forward.

Under speculative decoding a step whose every request verifies k drafts is a uniform batch of
1 + k query tokens per sequence: those get graphs of their own (query_len 1 + k), for the batch
sizes up to the one where drafting stops (speculative_config.disable_by_batch_size) whose tokens
fit a step.
"""

from collections.abc import Callable

import torch

from echo.attention.backend import AttentionBackend, KVCache
from echo.layers.attention import ForwardContext
from echo.worker.step_buffers import StepBuffers


def bucket_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256 and every 16 beyond, ending at max_num_seqs."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    size = 16
    while size < max_num_seqs:
        sizes.append(size)
        size += 8 if size < 256 else 16
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[KVCache], buffers: StepBuffers, max_num_seqs: int,
                 max_model_len: int, verify_query_len: int | None = None,
                 max_verify_seqs: int = 0, max_num_tokens: int = 0,
                 batch1_forward: Callable | None = None):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        # the forward of the batch-1 decode graph, when not the model's
        self.batch1_forward = batch1_forward
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(max_num_seqs)
        # query length -> its batch sizes: 1 (decode), and 1 + k under speculative decoding
        self.sizes_of: dict[int, list[int]] = {1: self.sizes}
        if verify_query_len is not None:
            self.sizes_of[verify_query_len] = [
                bs for bs in self.sizes
                if bs <= max_verify_seqs and bs * verify_query_len <= max_num_tokens]
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        # each graph's copies of the hidden states the model keeps for an EAGLE-3 head
        # (LlamaModel.aux_hidden), when it keeps any
        self.aux_hidden: dict[tuple[int, int], list[torch.Tensor]] = {}

    def for_model(self, model: torch.nn.Module, backend: AttentionBackend,
                  kv_caches: list[KVCache]) -> "CudaGraphRunner":
        """Graphs of the same shapes over the same buffers for another model (a draft model
        that computes every step's tokens after the target), not yet captured."""
        other = CudaGraphRunner(model, backend, kv_caches, self.buffers, 1, self.max_model_len)
        other.sizes, other.sizes_of = self.sizes, dict(self.sizes_of)
        return other

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        shapes = [(bs * q, bs, q) for q, sizes in self.sizes_of.items() for bs in sizes]
        for _, bs, q in sorted(shapes, reverse=True):  # the most tokens first
            ids, positions, meta = self.buffers.load_padding(bs, self.max_model_len, q)
            ctx = ForwardContext(self.backend, meta, self.kv_caches)
            forward = self.model
            if (bs, q) == (1, 1) and self.batch1_forward is not None:
                forward = self.batch1_forward
            forward(ids, positions, ctx)  # warm-up: compile and autotune outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = forward(ids, positions, ctx)
            pool = pool or graph.pool()
            self.graphs[bs, q] = (graph, hidden)
            inner = getattr(self.model, "model", None)  # a drafter's head has none
            self.aux_hidden[bs, q] = list(getattr(inner, "aux_hidden", None) or [])
        torch.cuda.synchronize()

    def padded_size(self, num_seqs: int, query_len: int = 1) -> int | None:
        """The smallest captured size that holds the batch, or None if none does."""
        for size in self.sizes_of.get(query_len, ()):
            if size >= num_seqs:
                return size
        return None

    def outputs(self, bs: int) -> torch.Tensor:
        """The hidden states the decode graph of batch size bs writes."""
        return self.graphs[bs, 1][1]

    def replay(self, bs: int, query_len: int = 1) -> torch.Tensor:
        graph, hidden = self.graphs[bs, query_len]
        graph.replay()
        aux = self.aux_hidden.get((bs, query_len))
        if aux:  # where an eager forward would have left them
            self.model.model.aux_hidden = aux
        return hidden
