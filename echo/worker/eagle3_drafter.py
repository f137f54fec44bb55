"""The drafter of speculative method eagle3: an EAGLE-3 head (echo/models/eagle3.py) run by the
worker beside the target, on the hidden states the target keeps for it (LlamaModel.aux_hidden,
the residual stream entering layers 2, L // 2 and L - 3).

The head at position p reads the embedding of the token at p + 1 and a hidden state for p,
and predicts the token at p + 2. Once a step's tokens are on the host, `propose` runs the head
over the positions the step confirmed (a verification's accepted run, a decode's token, a
prefill chunk), each with the next token's embedding and the fused target hidden states, which
writes the head's KV of those positions (one layer, in the target's blocks and slots, as the
draft model's cache); the last position of each drafting request gives its first draft. Then
k - 1 decode steps of the head through MultiStepDecoder, each feeding the head's own output
before its final norm back as the next position's hidden state, give the others; the head's
logits over its draft vocabulary are scattered into the target's (d2t), so drafts are target
ids. Drafts are greedy point masses, as the draft model's.

The head only writes KV in steps that draft (where the step's tokens are landed at once):
positions computed in other steps (two steps in flight above disable_by_batch_size) leave its
KV stale there, which lowers acceptance and never changes an output.
"""

import numpy as np
import torch
from torch import nn

from echo.config import EngineConfig
from echo.core.step_results import ModelRunnerOutput
from echo.distributed.parallel_state import TPGroup
from echo.layers.attention import ForwardContext
from echo.models.arch import eagle3_target_layers
from echo.worker.cuda_graphs import CudaGraphRunner
from echo.worker.draft_model import Drafter
from echo.worker.input_batch import InputBatch, StepInputs
from echo.worker.model_loader import build_eagle3_head
from echo.worker.multi_step import MultiStepDecoder, greedy_sampling
from echo.worker.step_buffers import StepBuffers


class _HeadSteps(nn.Module):
    """The head as MultiStepDecoder drives a model: forward(input ids, positions, context),
    the hidden state carried from one step to the next, and logits over the target's
    vocabulary (tokens outside the draft vocabulary at -inf)."""

    def __init__(self, head: nn.Module, embed: nn.Module, max_rows: int, vocab_size: int,
                 device: torch.device):
        super().__init__()
        self.head, self.embed = head, embed
        self.hidden = torch.zeros(max_rows, head.arch.hidden_size, device=device,
                                  dtype=head.norm.weight.dtype)
        self.vocab_size = vocab_size
        self.target_ids = head.to_target_ids(torch.arange(head.config.draft_vocab_size,
                                                          device=device))

    def forward(self, input_ids, positions, ctx: ForwardContext) -> torch.Tensor:
        rows = input_ids.shape[0]
        out = self.head(self.embed(input_ids), self.hidden[:rows], positions, ctx)
        self.hidden[:rows].copy_(out)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.head.compute_logits(hidden).float()
        full = torch.full((hidden.shape[0], self.vocab_size), float("-inf"),
                          device=hidden.device)
        return full.index_copy_(1, self.target_ids, draft)


class Eagle3Drafter(Drafter):
    def __init__(self, config: EngineConfig, target: nn.Module, tp: TPGroup,
                 device: torch.device):
        self.target, self.tp = target, tp
        dtype = getattr(torch, config.model.dtype)
        self.head = build_eagle3_head(config.draft_model.path, dtype, device,
                                      max_position=config.model.max_model_len, tp=tp)
        target.model.aux_layers = eagle3_target_layers(config.model.arch.num_layers)
        super().__init__(config, device, 1, self.head.midlayer.self_attn, dtype)
        self.steps: _HeadSteps | None = None
        self.graphs: CudaGraphRunner | None = None

    def init_kv_cache(self, num_blocks: int, buffers: StepBuffers,
                      target_graphs: CudaGraphRunner | None) -> None:
        """The head's cache, and graphs of its decode steps when the target captured graphs
        (the first pass over a step's confirmed positions has a shape per step: eager)."""
        sched = self.config.scheduler
        self.allocate(num_blocks, buffers)
        self.steps = _HeadSteps(self.head, self.target.model.embed_tokens, sched.max_num_seqs,
                                self.config.model.arch.vocab_size, self.device)
        if target_graphs is not None:
            drafting = min(sched.max_num_seqs,
                           self.config.speculative.disable_by_batch_size or sched.max_num_seqs)
            self.graphs = CudaGraphRunner(self.steps, self.backend, self.kv_caches, buffers,
                                          drafting, sched.max_model_len)
            self.graphs.capture()
        self.decoder = MultiStepDecoder(
            self.steps, self.backend, self.kv_caches, buffers, self.graphs,
            self.config.cache.block_size, sched.max_num_seqs, max(1, self.num_tokens - 1),
            self.device, max_position=sched.max_model_len)
        if self.graphs is not None and self.tp.size == 1:  # as the draft model's
            self.decoder.capture()

    def follow(self, *args, graph=None) -> None:
        """Nothing while the target computes: the head needs the step's tokens (propose)."""

    def propose(self, batch: InputBatch, req_ids: list[str], inp: StepInputs,
                output: ModelRunnerOutput) -> dict[str, list[int]]:
        first, flat = self._first_pass_inputs(batch, inp, output)
        wanted = set(req_ids)
        drafting = [i for i, r in enumerate(first.req_ids) if r in wanted]
        if not drafting:
            return {}
        buffers = self.buffers
        buffers.flip()
        input_ids, positions, meta = buffers.load(first)
        index = torch.from_numpy(flat).to(self.device)  # one upload for the three layers
        aux = [h[index] for h in self.target.model.aux_hidden]
        out = self.head(self.target.model.embed_tokens(input_ids), self.head.fuse(aux),
                        positions, ForwardContext(self.backend, meta, self.kv_caches))
        last = torch.from_numpy(first.logits_indices[drafting].astype(np.int64)).to(self.device)
        tokens = [self.steps.compute_logits(out[last]).argmax(-1)]
        names = [first.req_ids[i] for i in drafting]
        if self.num_tokens > 1:
            self.steps.hidden[:len(drafting)].copy_(out[last])
            tokens.extend(self._decode(batch, names, first.rows[drafting], tokens[0]))
        host = torch.stack(tokens).tolist()  # [k, drafting]
        return {rid: [step[j] for step in host] for j, rid in enumerate(names)}

    @staticmethod
    def _first_pass_inputs(batch: InputBatch, inp: StepInputs,
                           output: ModelRunnerOutput) -> tuple[StepInputs, np.ndarray]:
        """The positions the step confirmed per request (a verification: the accepted run;
        else every token it computed), each with the token after it, and each position's
        row among the step's tokens (the target's hidden states)."""
        cu = inp.cu_seqlens_q
        emitted = dict(zip(output.req_ids, output.sampled_token_ids, strict=True))
        drafts = {}
        if inp.num_drafts is not None:
            drafts = {inp.req_ids[s]: int(k) for s, k in zip(inp.sample_seq_idx, inp.num_drafts)}
        flat, req_ids, rows, counts = [], [], [], []
        for i, rid in enumerate(inp.req_ids):
            row = batch.row_of.get(rid)
            confirmed = len(emitted.get(rid, ())) if drafts.get(rid) else int(cu[i + 1] - cu[i])
            if row is None or confirmed <= 0:
                continue
            flat.append(np.arange(cu[i], cu[i] + confirmed))
            req_ids.append(rid)
            rows.append(row)
            counts.append(confirmed)
        flat = np.concatenate(flat) if flat else np.zeros(0, np.int64)
        rows = np.asarray(rows, np.int64)
        positions = inp.positions[flat]
        next_tokens = batch.token_ids[np.repeat(rows, counts), positions + 1]
        return batch.runs_inputs(req_ids, rows, positions, np.asarray(counts, np.int64),
                                 next_tokens), flat

    def _decode(self, batch: InputBatch, req_ids: list[str], rows: np.ndarray,
                first_drafts: torch.Tensor) -> list[torch.Tensor]:
        """k - 1 steps of the head after the first drafts: position num_tokens - 1 reads the
        first draft's embedding and the first pass's output."""
        buffers, num = self.buffers, len(rows)
        buffers.flip()
        size = self.graphs.padded_size(num) if self.graphs is not None else None
        input_ids, positions, meta = buffers.load(batch.last_token_inputs(req_ids, rows),
                                                  pad_seqs_to=size)
        input_ids[:num].copy_(first_drafts)
        greedy_sampling(buffers, meta.num_seqs)
        return list(self.decoder.run(self.num_tokens - 1, num, input_ids, positions, meta,
                                     replay=size is not None))
