"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous vocab slice."""

import torch
import torch.nn.functional as F
from torch import nn

from echo.distributed.communication import all_gather, all_reduce
from echo.distributed.parallel_state import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE,
                 reduce_results: bool = True):
        super().__init__()
        self.tp = tp
        # False: return this rank's partial sums (zero rows for tokens outside its slice)
        self.reduce_results = reduce_results
        self.num_embeddings = num_embeddings
        # ceil so every rank has the same shape; rows past the real vocab stay zero
        self.shard_size = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape {tuple(loaded.shape)} does not match "
                             f"({self.num_embeddings}, {param.shape[1]})")
        # the last rank's slice may run past the vocabulary: its padding rows stay zero
        rows = max(0, min(self.shard_size, self.num_embeddings - self.vocab_start))
        param.data.zero_()
        if rows:
            param.data[:rows].copy_(loaded.narrow(0, self.vocab_start, rows))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(y, self.tp) if self.reduce_results else y


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary, gathered from every rank's slice."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather(F.linear(hidden, self.weight), self.tp, dim=-1)
        return logits[..., : self.num_embeddings] if self.tp.size > 1 else logits
