"""A step's GrammarBitmask applied to its logits: the grammar's disallowed tokens become -inf
before sampling (and before logprobs, as in vLLM, so they report the constrained distribution).
"""

import numpy as np
import torch

from echo.core.sched_output import GrammarBitmask


def apply_grammar_bitmask(logits: torch.Tensor, sample_req_ids: list[str],
                          bitmask: GrammarBitmask) -> torch.Tensor:
    """logits: one row per request in sample_req_ids. In place on the GPU (a Triton kernel);
    elsewhere the PyTorch twin's masked copy is returned."""
    if not bitmask.req_ids:
        return logits
    row_of = {rid: i for i, rid in enumerate(sample_req_ids)}
    indices = torch.tensor([row_of[rid] for rid in bitmask.req_ids], dtype=torch.int64)
    shape = (len(bitmask.req_ids), bitmask.num_words)
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
