"""A step's GrammarBitmask applied to its logits: the grammar's disallowed tokens become -inf
before sampling (and before logprobs, as in vLLM, so they report the constrained distribution).
"""

import numpy as np
import torch

from echo.core.sched_output import GrammarBitmask


def apply_grammar_bitmask(logits: torch.Tensor, first_rows: dict[str, int],
                          bitmask: GrammarBitmask) -> torch.Tensor:
    """first_rows: each sampling request's first logits row (its only one, or with drafts
    the first of its 1 + drafts rows, which take its bitmask rows in order). In place on the
    GPU (a Triton kernel); elsewhere the PyTorch twin's masked copy is returned."""
    if not bitmask.req_ids:
        return logits
    counts = bitmask.row_counts or [1] * len(bitmask.req_ids)
    firsts = np.array([first_rows[rid] for rid in bitmask.req_ids], dtype=np.int64)
    num_rows = int(sum(counts))
    indices = torch.from_numpy(np.repeat(firsts - np.cumsum(counts) + counts, counts)
                               + np.arange(num_rows))
    shape = (num_rows, bitmask.num_words)
    if not logits.is_cuda:
        from echo_kernels.reference import apply_token_bitmask_ref

        rows = torch.from_numpy(np.frombuffer(bitmask.rows, dtype=np.int32).reshape(shape).copy())
        return apply_token_bitmask_ref(logits, rows, indices)
    from echo_kernels import apply_token_bitmask

    # one copy, into pinned memory, then an asynchronous upload behind the step's work
    host = torch.empty(shape, dtype=torch.int32, pin_memory=True)
    host.numpy()[...] = np.frombuffer(bitmask.rows, dtype=np.int32).reshape(shape)
    rows = host.to(logits.device, non_blocking=True)
    apply_token_bitmask(logits, rows, indices.pin_memory().to(logits.device, non_blocking=True))
    return logits
