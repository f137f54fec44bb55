"""CUDA graphs for decode-only batches: captured once per bucketed batch size (and, for small
batches, context bound), replayed padded.

A decode step of a small model is dominated by kernel-launch overhead; replaying a captured
graph removes it. Graphs read their inputs from the StepBuffers' persistent tensors and are
captured largest first into one memory pool (smaller graphs reuse the larger ones' memory).

Attention's key-split count is fixed when a graph is captured, from the max_seqlen_k it is
captured with. Large batches fill the GPU without splits, so one graph captured for
max_model_len serves every context. Small batches split their keys, as many splits as the
bound allows (one per 256 keys): at a short context a graph captured for max_model_len spreads
a few hundred keys over 16 splits and a merge. So batches of up to SMALL_BATCH sequences get a
graph per context bound (256, 512, ... keys, and max_model_len), and a step replays the one of
the smallest bound that holds its longest context.
"""

import torch

from echo.attention.backend import AttentionBackend, KVCache
from echo.layers.attention import ForwardContext
from echo.worker.step_buffers import StepBuffers

SMALL_BATCH = 8  # batches up to this size get a graph per context bound
SMALLEST_BOUND = 256  # keys

GraphKey = tuple[int, int]  # (batch size, context bound)


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


def context_bounds(batch_size: int, max_model_len: int) -> list[int]:
    """The context bounds a batch size is captured for, ascending, max_model_len last."""
    bounds = []
    if batch_size <= SMALL_BATCH:
        bound = SMALLEST_BOUND
        while bound < max_model_len:
            bounds.append(bound)
            bound *= 2
    return bounds + [max_model_len]


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend,
                 kv_caches: list[KVCache], buffers: StepBuffers, max_num_seqs: int,
                 max_model_len: int):
        self.model, self.backend, self.kv_caches = model, backend, kv_caches
        self.buffers = buffers
        self.max_model_len = max_model_len
        self.sizes = bucket_sizes(max_num_seqs)
        self.bounds = {size: context_bounds(size, max_model_len) for size in self.sizes}
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def keys(self) -> list[GraphKey]:
        """Every captured graph's key, largest first (the capture order)."""
        return [(size, bound) for size in sorted(self.sizes, reverse=True)
                for bound in reversed(self.bounds[size])]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for key in self.keys:
            ids, positions, meta = self.buffers.load_padding(*key)
            ctx = ForwardContext(self.backend, meta, self.kv_caches)
            self.model(ids, positions, ctx)  # warm-up: compile and autotune outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self.model(ids, positions, ctx)
            pool = pool or graph.pool()
            self.graphs[key] = (graph, hidden)
        torch.cuda.synchronize()

    def key_for(self, num_seqs: int, max_seqlen_k: int) -> GraphKey | None:
        """The graph of the smallest size that holds the batch and, of that size, the smallest
        context bound that holds its longest context; None if no graph does."""
        for size in self.sizes:
            if size >= num_seqs:
                bound = next((b for b in self.bounds[size] if b >= max_seqlen_k), None)
                return None if bound is None else (size, bound)
        return None

    def outputs(self, key: GraphKey) -> torch.Tensor:
        """The hidden states the graph writes."""
        return self.graphs[key][1]

    def replay(self, key: GraphKey) -> torch.Tensor:
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden
