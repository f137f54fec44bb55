"""Copies between pinned host memory and the device done by a kernel, not the copy engine.

A kernel reads (or writes) page-locked host memory over the bus directly: with unified virtual
addressing a pinned tensor's address is valid on the device (Triton's launcher resolves it with
cuPointerGetAttribute, as for any pointer argument). The copy then runs on the SMs of the stream
it is queued on, in that stream's order, and never waits behind copies other streams queued on
the copy engine: the KV host tier keeps that engine busy with chunks of hundreds of megabytes,
and a step's few-kilobyte input upload or token download queued behind them would hold up the
step (docs/benchmarks.md, KV offload). Meant for small copies: each word crosses the bus on its
own load or store, so a large copy is faster on the copy engine.
"""

import torch
import triton
import triton.language as tl

# words a program moves: a few kilobytes, so a step's upload takes one to a few programs
BLOCK_WORDS = 1024
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


# one compiled variant a word type: the length and the addresses change from copy to copy (a
# ring's ranges start anywhere), and a compilation inside a step would stall it
@triton.jit(do_not_specialize=["n"], do_not_specialize_on_alignment=["src_ptr", "dst_ptr"])
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)


def _word(*tensors: torch.Tensor) -> torch.dtype:
    """The widest integer type whose size divides every tensor's bytes and address."""
    return next(w for w in _WORDS
                if all(t.nbytes % w.itemsize == 0 and t.data_ptr() % w.itemsize == 0
                       for t in tensors))


def copy_by_kernel(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """dst's bytes := src's, by a kernel on the current stream; either may be pinned host
    memory (the other on the device). Both contiguous, with as many bytes. Returns dst."""
    if src.nbytes != dst.nbytes:
        raise ValueError(f"src: {src.nbytes} bytes, dst: {dst.nbytes}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    if src.nbytes == 0:
        return dst
    word = _word(src, dst)
    n = src.nbytes // word.itemsize
    source, target = (t.reshape(-1).view(torch.uint8).view(word) for t in (src, dst))
    _copy_kernel[(triton.cdiv(n, BLOCK_WORDS),)](source, target, n, BLOCK=BLOCK_WORDS)
    return dst
