"""The draft model of speculative method draft_model: a smaller model with the target's
vocabulary, run by the same worker (and the same TP ranks), that proposes k tokens per request
for the target to verify in its next step.

Its KV cache has as many blocks as the target's and is indexed by the same block tables and
slots: the draft computes every token the target computes (`follow`, right after the target's
forward over the same inputs, replaying a graph of the same shape when the target did), so a
block holds both models' KV of the same tokens, and prefix caching, preemption and block reuse
need nothing of their own. Rejected drafts leave KV in slots the next steps overwrite, as the
target's do.

Once a step's tokens are on the host, `propose` decodes k steps from each drafting request's
last token with multi_step.MultiStepDecoder over the draft's model and cache (its own CUDA
graphs, one sampling graph per batch size), greedily: the drafts are point masses, which the
rejection sampler verifies losslessly for greedy and random requests alike (vLLM's EAGLE
proposer drafts greedily too). The k tokens' KV goes into slots the scheduler allocated past
the step's own (KVCacheManager.num_lookahead_tokens); positions at or past max_model_len store
nothing.
"""

import numpy as np
import torch
from torch import nn

from echo.attention.backend import AttentionMetadata, KVCache, make_backend
from echo.config import EngineConfig
from echo.distributed.parallel_state import TPGroup
from echo.layers.attention import ForwardContext
from echo.worker.cuda_graphs import CudaGraphRunner
from echo.worker.input_batch import InputBatch, StepInputs
from echo.worker.kv_cache import KVCacheSpec
from echo.worker.model_loader import build_model
from echo.worker.multi_step import MultiStepDecoder, greedy_sampling
from echo.worker.step_buffers import StepBuffers


class Drafter:
    """What a drafter run by the worker has besides its model: a KV cache of `num_layers`
    layers shaped as its attention `attn` is, with as many blocks as the target's; the
    attention backend; the StepBuffers it shares with the target."""

    def __init__(self, config: EngineConfig, device: torch.device, num_layers: int,
                 attn: nn.Module, dtype: torch.dtype):
        self.config, self.device = config, device
        self.num_tokens = config.speculative.num_speculative_tokens  # k
        self.kv_cache_spec = KVCacheSpec(num_layers, config.cache.block_size, attn.num_kv_heads,
                                         attn.head_dim, dtype, config.cache.kv_cache_dtype)
        self.backend = make_backend(config.device.attention_backend, attn.num_heads,
                                    attn.num_kv_heads, attn.head_dim, attn.head_dim**-0.5)
        self.kv_caches: list[KVCache] = []
        self.decoder: MultiStepDecoder | None = None
        self.buffers: StepBuffers | None = None

    def bytes_per_block(self) -> int:
        return self.kv_cache_spec.bytes_per_block()

    def allocate(self, num_blocks: int, buffers: StepBuffers) -> None:
        self.buffers = buffers
        self.kv_caches = self.kv_cache_spec.allocate(num_blocks, self.device)


class DraftModel(Drafter):
    def __init__(self, config: EngineConfig, tp: TPGroup, device: torch.device):
        draft = config.draft_model
        self.tp = tp
        self.model = build_model(draft, device, tp)
        super().__init__(config, device, draft.arch.num_layers,
                         self.model.model.layers[0].self_attn, getattr(torch, draft.dtype))
        self.graphs: CudaGraphRunner | None = None

    def init_kv_cache(self, num_blocks: int, buffers: StepBuffers,
                      target_graphs: CudaGraphRunner | None) -> None:
        """The cache, and graphs of the shapes the target captured (when it did)."""
        sched = self.config.scheduler
        self.allocate(num_blocks, buffers)
        if target_graphs is not None:
            self.graphs = target_graphs.for_model(self.model, self.backend, self.kv_caches)
            self.graphs.capture()
        self.decoder = MultiStepDecoder(
            self.model, self.backend, self.kv_caches, buffers, self.graphs,
            self.config.cache.block_size, sched.max_num_seqs, self.num_tokens, self.device,
            max_position=sched.max_model_len)
        if self.graphs is not None and self.tp.size == 1:
            self.decoder.capture()

    def follow(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
               graph: tuple[int, int] | None) -> None:
        """Compute the draft's KV of the step's tokens: the inputs the target's forward read
        (in the StepBuffers), replaying the graph of (batch size, query length) it replayed."""
        if graph is not None:
            self.graphs.replay(*graph)
        else:
            self.model(input_ids, positions, ForwardContext(self.backend, meta, self.kv_caches))

    def propose(self, batch: InputBatch, req_ids: list[str], inp: StepInputs | None = None,
                output=None) -> dict[str, list[int]]:
        """k greedy drafts after each request's last token (all on the host already; the
        step's inputs and output are the EAGLE-3 drafter's business, not this one's)."""
        req_ids = [r for r in req_ids if r in batch.row_of]
        if not req_ids:
            return {}
        rows = np.array([batch.row_of[r] for r in req_ids], dtype=np.int64)
        num = len(rows)
        buffers = self.buffers
        buffers.flip()
        size = self.graphs.padded_size(num) if self.graphs is not None else None
        input_ids, positions_t, meta = buffers.load(batch.last_token_inputs(req_ids, rows),
                                                    pad_seqs_to=size)
        greedy_sampling(buffers, meta.num_seqs)
        tokens = self.decoder.run(self.num_tokens, num, input_ids, positions_t, meta,
                                  replay=size is not None).tolist()  # [k, num]
        return {rid: [step[i] for step in tokens] for i, rid in enumerate(req_ids)}
