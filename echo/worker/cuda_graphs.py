"""CUDA graphs for decode-only batches: captured once per bucketed batch size, replayed padded.

A decode step of a small model is dominated by kernel-launch overhead; replaying a captured
graph removes it. Graphs read their inputs from the StepBuffers' persistent tensors and are
captured largest first into one memory pool (smaller graphs reuse the larger ones' memory).
Attention is captured with max_seqlen_k = max_model_len, so its split count covers any context.
"""

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
                 max_model_len: int):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(max_num_seqs)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for bs in sorted(self.sizes, reverse=True):
            ids, positions, meta = self.buffers.load_padding(bs, self.max_model_len)
            ctx = ForwardContext(self.backend, meta, self.kv_caches)
            self.model(ids, positions, ctx)  # warm-up: compile and autotune outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, ctx)
            pool = pool or graph.pool()
            self.graphs[bs] = (graph, hidden)
        torch.cuda.synchronize()

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds the batch, or None if none does."""
        for size in self.sizes:
            if size >= num_seqs:
                return size
        return None

    def outputs(self, bs: int) -> torch.Tensor:
        """The hidden states the graph of batch size bs writes."""
        return self.graphs[bs][1]

    def replay(self, bs: int) -> torch.Tensor:
        graph, hidden = self.graphs[bs]
        graph.replay()
        return hidden
