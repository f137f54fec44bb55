"""gumbel_sample: the fused kernel draws what its PyTorch twin draws, from softmax(logits/T)."""

import pytest
import torch

from echo_kernels import gumbel_sample
from echo_kernels.reference import gumbel_sample_ref


def inputs(batch: int, vocab: int, device, dtype=torch.float32, greedy_every: int = 4):
    torch.manual_seed(0)
    logits = (torch.randn(batch, vocab, device=device) * 3).to(dtype)
    temperature = torch.rand(batch, device=device) * 1.5 + 0.2
    temperature[::greedy_every] = 0.0
    seeds = torch.randint(0, 2**62, (batch,), device=device, dtype=torch.int64)
    steps = torch.randint(0, 5000, (batch,), device=device, dtype=torch.int64)
    return logits, temperature, seeds, steps


def test_kernel_matches_reference(device):
    args = inputs(12, 3000, device)
    args[0][3, 100:] = float("-inf")  # excluded tokens are never drawn
    got, expected = gumbel_sample(*args), gumbel_sample_ref(*args)
    assert torch.equal(got, expected)
    assert got[3] < 100
    assert torch.equal(got[::4], args[0][::4].argmax(-1))  # temperature 0: greedy


@pytest.mark.parametrize("num_chunks", [2, 3])
def test_vocabulary_chunks_match_reference_and_break_ties_low(device, num_chunks):
    # 5000 tokens in chunks of 2048 (the last one ragged), reduced by a second launch
    logits, temperature, seeds, steps = inputs(6, 5000, device)
    logits[0, 4500] = logits[0, 4100] = 50.0  # a tie inside the last chunk
    logits[4, 4999] = logits[4, 2100] = logits[4, 2500] = 60.0  # ties across chunks
    logits[2, :] = float("-inf")  # nothing allowed: token 0, as torch.argmax
    got = gumbel_sample(logits, temperature, seeds, steps, num_chunks=num_chunks)
    assert torch.equal(got, gumbel_sample_ref(logits, temperature, seeds, steps))
    assert got[0] == 4100 and got[4] == 2100 and got[2] == 0


def test_small_batches_split_the_vocabulary(device):
    from echo_kernels.sampling import MIN_CHUNK, num_vocab_chunks

    # the interpreter counts 4 SMs: 8 programs wanted
    assert num_vocab_chunks(1, 20 * MIN_CHUNK, torch.device("cpu")) == 8
    assert num_vocab_chunks(1, MIN_CHUNK + 1, torch.device("cpu")) == 2
    assert num_vocab_chunks(16, 20 * MIN_CHUNK, torch.device("cpu")) == 1


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_and_softmax():
    logits, temperature, seeds, steps = inputs(256, 151936, "cuda", torch.bfloat16)
    got, expected = gumbel_sample(logits, temperature, seeds, steps), \
        gumbel_sample_ref(logits, temperature, seeds, steps)
    # the device's log may differ from torch's in the last bit: a near-tie can flip, rarely
    assert (got == expected).float().mean().item() > 0.98
    # one row, as at batch 1: the vocabulary is split over the SMs, the draw is the same
    one = [t[:4] for t in (logits, temperature, seeds, steps)]
    assert torch.equal(torch.cat([gumbel_sample(*(t[i:i + 1] for t in one)) for i in range(4)]),
                       got[:4])
    # frequencies over many seeds follow softmax(logits / T)
    row = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0], device="cuda")
    n = 200_000
    draws = gumbel_sample(row.expand(n, -1).contiguous(), torch.full((n,), 0.8, device="cuda"),
                          torch.arange(n, device="cuda", dtype=torch.int64),
                          torch.zeros(n, device="cuda", dtype=torch.int64))
    freq = torch.bincount(draws, minlength=5).float() / n
    assert (freq - (row / 0.8).softmax(-1)).abs().max().item() < 0.005


def test_warm_up_launches_each_variant_once_per_dtype(device):
    from echo_kernels.sampling import MIN_CHUNK, warm_up_gumbel_sample

    if device != "cpu":
        pytest.skip("the interpreter's 4 SMs fix the chunk counts below")
    # vocab of 2.5 chunks, 8 programs wanted: batch 1-3 take 3 chunks (padded to 4 by the
    # reduction), batch 4-7 take 2, batch 8 and up read whole rows
    variants = warm_up_gumbel_sample(12, MIN_CHUNK * 5 // 2, [torch.float32, torch.float16],
                                     torch.device("cpu"))
    assert variants == {(True, 4), (True, 2), (False, 1)}


@pytest.mark.gpu
def test_gpu_rows_of_one_upload_share_a_compiled_kernel():
    from triton import knobs

    # temperature, seeds and steps as rows of stacked uploads (sampling_inputs.py): with 3 rows
    # of 3, row 0 is 16-byte aligned and row 1 is not
    logits = torch.randn(3, 5000, device="cuda")
    floats = torch.zeros(3, 3, device="cuda")
    ints = torch.zeros(3, 3, dtype=torch.int64, device="cuda")
    gumbel_sample(logits, floats[0], ints[0], ints[0])  # compiled here, if not before
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: compiled.append(fn.name)
    try:
        got = gumbel_sample(logits, floats[1], ints[1], ints[1])
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
    assert torch.equal(got, logits.argmax(-1))  # temperature 0: greedy
