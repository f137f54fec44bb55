"""rejection_sample: the kernel emits what its PyTorch twin emits, greedy and random, for
point-mass drafts and for a draft model's distributions."""

import pytest
import torch

from echo_kernels.reference import rejection_sample_ref
from echo_kernels.rejection import rejection_sample


def batch(counts: list[int], vocab: int, device, with_q: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    logits = torch.randn(rows, vocab, generator=g) * 2
    cu = torch.tensor([0] + counts).cumsum(0).to(torch.int32)
    drafts = torch.randint(0, vocab, (rows,), generator=g)
    greedy_argmax = logits.argmax(-1)
    # about half the drafts are the target's likeliest token, so runs get accepted
    likely = torch.rand(rows, generator=g) < 0.6
    drafts = torch.where(likely, greedy_argmax, drafts)
    drafts[cu[1:].long() - 1] = -1  # each request's last row follows its drafts
    temperature = torch.rand(len(counts), generator=g) + 0.3
    temperature[::3] = 0.0
    seeds = torch.randint(0, 2**62, (len(counts),), generator=g)
    steps = torch.randint(0, 1000, (len(counts),), generator=g)
    q = torch.softmax(torch.randn(rows, vocab, generator=g), -1) if with_q else None
    args = [logits, drafts, cu, temperature, seeds, steps]
    return [a.to(device) for a in args], (q.to(device) if with_q else None)


@pytest.mark.parametrize("with_q", [False, True])
def test_kernel_matches_reference(device, with_q):
    counts = [5, 1, 3, 5, 2, 5, 4, 1]
    args, q = batch(counts, 300, device, with_q)
    got = rejection_sample(*args, width=6, draft_probs=q)
    expected = rejection_sample_ref(*args, width=6, draft_probs=q)
    assert torch.equal(got.cpu(), expected.cpu())
    emitted = (got >= 0).sum(-1).cpu()
    assert (emitted >= 1).all() and (emitted <= torch.tensor(counts)).all()
    assert (emitted > 1).any() and (emitted < torch.tensor(counts)).any()


def test_greedy_by_hand(device):
    vocab = 8
    logits = torch.full((6, vocab), -1.0)
    for row, token in enumerate([3, 5, 1, 4, 4, 6]):
        logits[row, token] = 2.0
    drafts = torch.tensor([3, 7, -1, 4, -1, -1])
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    zeros = torch.zeros(3, dtype=torch.int64)
    args = [t.to(device) for t in (logits, drafts, cu, zeros.float(), zeros, zeros)]
    got = rejection_sample(*args, width=4).cpu()
    assert got.tolist() == [[3, 5, -1, -1], [4, 4, -1, -1], [6, -1, -1, -1]]


def test_a_residual_of_zero_draws_from_the_target(device):
    # the draft's q equals p: the residual is zero, every draft accepted except by the
    # acceptance draw's rounding; the fallback is still a token of p's support
    vocab = 16
    logits = torch.full((2, vocab), float("-inf"))
    logits[:, 2] = logits[:, 9] = 0.0
    q = torch.softmax(logits, -1)
    drafts = torch.tensor([9, -1])
    cu = torch.tensor([0, 2], dtype=torch.int32)
    args = [t.to(device) for t in (logits, drafts, cu, torch.ones(1), torch.tensor([7]),
                                   torch.tensor([0]))]
    got = rejection_sample(*args, width=2, draft_probs=q.to(device)).cpu()
    assert got[0, 0] == 9 and got[0, 1] in (2, 9)
    assert torch.equal(got, rejection_sample_ref(*args, width=2, draft_probs=q.to(device)).cpu())


@pytest.mark.gpu
def test_gpu_kernel_matches_reference_at_a_real_vocabulary():
    counts = [5] * 16 + [1] * 4
    args, q = batch(counts, 151936, "cuda", with_q=True)
    got = rejection_sample(*args, width=5, draft_probs=q)
    expected = rejection_sample_ref(*args, width=5, draft_probs=q)
    # the device's exp/log may differ from torch's in the last bit: a near-tie can flip
    assert (got == expected).all(-1).float().mean().item() >= 0.9
    args, _ = batch(counts, 151936, "cuda", with_q=False)
    got = rejection_sample(*args, width=5)
    assert (got == rejection_sample_ref(*args, width=5)).all(-1).float().mean().item() >= 0.9
