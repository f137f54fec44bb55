"""Speculative decoding's verification: which drafted tokens the target model accepts, and the
token that follows them, so that the emitted tokens are distributed exactly as the target's own
samples (greedy: identical to them).

Per request with k drafts the target scored k + 1 rows. Draft i (token d) is accepted when,
greedy, it is the target's argmax there; random, with probability min(1, p(d) / q(d)), p the
target's distribution at temperature T and q the draft's (a point mass at d for n-gram drafts:
q(d) = 1). At the first rejected draft the request emits a token drawn from the normalized
max(0, p - q) (for a point mass: p without d); when all k are accepted it emits a bonus token
drawn from p at the last row. Random draws use the sampler's counter-based noise keyed by the
request's seed and the output index of the token, so they depend on nothing else in the batch;
the acceptance test reads one more uniform per row from a column past the vocabulary.

On the GPU this is echo_kernels.rejection (two launches, no host sync); elsewhere its PyTorch
twin, which draws the same tokens.
"""

import numpy as np
import torch


def rejection_sample(logits: torch.Tensor, draft_ids: torch.Tensor, cu_rows: torch.Tensor,
                     temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                     width: int, draft_probs: torch.Tensor | None = None) -> torch.Tensor:
    """logits [rows, V]: request r's drafts' rows cu_rows[r] .. cu_rows[r + 1] - 2, then the row
    after its last draft; draft_ids [rows] (-1 at those last rows); temperature, seeds, steps
    [R] (steps: the output index of the request's first row); width >= any request's rows;
    draft_probs [rows, V], the draft model's q (None: point masses). Returns [R, width] int64:
    each request's accepted drafts, then one more token, then -1."""
    if logits.is_cuda:
        from echo_kernels.rejection import rejection_sample as kernel

        return kernel(logits, draft_ids, cu_rows, temperature, seeds, steps, width, draft_probs)
    from echo_kernels.reference import rejection_sample_ref

    return rejection_sample_ref(logits, draft_ids, cu_rows, temperature, seeds, steps, width,
                                draft_probs)


def flat_drafts(drafts: list[list[int]]) -> tuple[np.ndarray, np.ndarray, int]:
    """Requests' drafts as rejection_sample takes them: draft ids per row (-1 at each request's
    row after its drafts), cu_rows, and the width of the result."""
    counts = np.array([len(d) + 1 for d in drafts], dtype=np.int32)
    cu = np.zeros(len(drafts) + 1, dtype=np.int32)
    np.cumsum(counts, out=cu[1:])
    ids = np.full(int(cu[-1]), -1, dtype=np.int64)
    for r, d in enumerate(drafts):
        ids[cu[r]:cu[r] + len(d)] = d
    return ids, cu, int(counts.max()) if len(counts) else 1
