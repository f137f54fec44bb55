"""Structured outputs' token bitmask applied to logits in place: a disallowed token's logit
becomes -inf before sampling.

The mask is xgrammar's layout (what its matchers fill): int32 words `[rows, ceil(V / 32)]`,
token t allowed when bit t % 32 of word t // 32 is set. Only the rows with a grammar have a
mask row; `indices` names the logits row each mask row applies to, so a batch where few
requests are constrained uploads and touches only theirs. Logit columns past the mask's
coverage (an LM head padded beyond the tokenizer's vocabulary) are disallowed.
"""

import torch
import triton
import triton.language as tl

from echo_kernels.pdl import pdl_options, wait_for_inputs


@triton.jit
def _apply_token_bitmask_kernel(
    logits_ptr,  # [num_rows, vocab], written where a token is disallowed
    bitmask_ptr,  # [num_masks, words] int32
    indices_ptr,  # [num_masks] int64: the logits row of each mask row
    vocab,
    words,
    stride_logits,
    stride_mask,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    wait_for_inputs(USE_PDL)
    mask_row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = cols < vocab
    word = tl.load(bitmask_ptr + mask_row * stride_mask + cols // 32,
                   mask=in_vocab & (cols // 32 < words), other=0)
    allowed = ((word >> (cols % 32)) & 1) != 0
    row = tl.load(indices_ptr + mask_row)
    # only the disallowed columns are written: a mask that allows most tokens costs few stores
    tl.store(logits_ptr + row * stride_logits + cols,
             tl.full((BLOCK,), float("-inf"), logits_ptr.dtype.element_ty),
             mask=in_vocab & ~allowed)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor,
                        indices: torch.Tensor | None = None) -> None:
    """logits [num_rows, vocab] (any float dtype, rows contiguous); bitmask [num_masks, words]
    int32; indices [num_masks] int64, the logits row of each mask row (default: row i for
    mask row i). In place."""
    assert logits.dim() == 2 and logits.stride(1) == 1
    assert bitmask.dtype == torch.int32 and bitmask.dim() == 2 and bitmask.stride(1) == 1
    if indices is None:
        indices = torch.arange(bitmask.shape[0], device=logits.device)
    assert indices.shape == (bitmask.shape[0],)
    num_masks, vocab = bitmask.shape[0], logits.shape[1]
    if num_masks == 0:
        return
    block = min(4096, triton.next_power_of_2(vocab))
    _apply_token_bitmask_kernel[(num_masks, triton.cdiv(vocab, block))](
        logits, bitmask, indices.to(torch.int64), vocab, bitmask.shape[1], logits.stride(0),
        bitmask.stride(0), BLOCK=block, **pdl_options(logits.device),
        num_warps=max(1, min(8, block // 512)))
