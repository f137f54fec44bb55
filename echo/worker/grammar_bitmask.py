"""A step's GrammarBitmask applied to its logits: the grammar's disallowed tokens become -inf
before sampling (and before logprobs, as in vLLM, so they report the constrained distribution).
"""

import numpy as np
import torch

from echo.core.sched_output import GrammarBitmask
from echo.worker.pinned_ring import PinnedUploadRing


def apply_grammar_bitmask(logits: torch.Tensor, first_rows: dict[str, int],
                          bitmask: GrammarBitmask,
                          ring: PinnedUploadRing | None = None) -> torch.Tensor:
    """first_rows: each sampling request's first logits row (its only one, or with drafts
    the first of its 1 + drafts rows, which take its bitmask rows in order). In place on the
    GPU (a Triton kernel; the mask rows and their logits rows go up through `ring`, an int32
    PinnedUploadRing); elsewhere the PyTorch twin's masked copy is returned."""
    if not bitmask.req_ids:
        return logits
    counts = bitmask.row_counts or [1] * len(bitmask.req_ids)
    firsts = np.array([first_rows[rid] for rid in bitmask.req_ids], dtype=np.int64)
    num_rows = int(sum(counts))
    indices = (np.repeat(firsts - np.cumsum(counts) + counts, counts) + np.arange(num_rows))
    shape = (num_rows, bitmask.num_words)
    words = np.frombuffer(bitmask.rows, dtype=np.int32)
    if not logits.is_cuda:
        from echo_kernels.reference import apply_token_bitmask_ref

        return apply_token_bitmask_ref(logits, torch.from_numpy(words.reshape(shape).copy()),
                                       torch.from_numpy(indices))
    from echo_kernels import apply_token_bitmask

    # through pinned memory allocated once (a fresh pinned block per step could cost a
    # synchronizing cudaHostAlloc), uploaded asynchronously behind the step's work
    apply_token_bitmask(logits, ring.upload(words).view(shape),
                        ring.upload(indices.astype(np.int32)))
    return logits
