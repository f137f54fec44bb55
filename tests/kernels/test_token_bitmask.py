"""apply_token_bitmask against its PyTorch twin and a hand-made case: xgrammar's layout, token t
allowed when bit t % 32 of word t // 32 is set."""

import pytest
import torch

from echo_kernels import apply_token_bitmask
from echo_kernels.reference import apply_token_bitmask_ref

INF = float("inf")


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """Bool [rows, V] -> int32 words [rows, ceil(V / 32)], written from the layout's definition
    (independently of the reference's unpacking)."""
    rows, vocab = allowed.shape
    words = torch.zeros(rows, -(-vocab // 32), dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # bit 31 set: a negative int32
    return words.to(torch.int32)


def test_hand_made_mask(device):
    logits = torch.arange(40, dtype=torch.float32, device=device).repeat(2, 1)
    allowed = torch.zeros(1, 40, dtype=torch.bool)
    allowed[0, [0, 5, 31, 32, 39]] = True  # bit 31 of word 0 is the int32's sign bit
    apply_token_bitmask(logits, pack(allowed).to(device), torch.tensor([1], device=device))
    assert logits[0].tolist() == list(range(40))  # a row without a mask row is untouched
    want = [float(t) if t in (0, 5, 31, 32, 39) else -INF for t in range(40)]
    assert logits[1].tolist() == want


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("vocab, mask_vocab", [(1000, 1000), (130, 100)])
def test_matches_the_reference(device, dtype, vocab, mask_vocab):
    # (130, 100): an LM head padded past the tokenizer's vocabulary: the extra columns go
    torch.manual_seed(0)
    logits = torch.randn(6, vocab, device=device).to(dtype)
    allowed = torch.rand(3, mask_vocab) < 0.3
    bitmask = pack(allowed).to(device)
    indices = torch.tensor([4, 0, 2], device=device)
    want = apply_token_bitmask_ref(logits, bitmask, indices)
    apply_token_bitmask(logits, bitmask, indices)
    assert torch.equal(logits, want)
    assert torch.isinf(logits[[1, 3, 5]]).sum() == 0  # unmasked rows keep every logit
    kept = torch.isfinite(logits[4, :mask_vocab]).cpu()
    assert torch.equal(kept, allowed[0]) and torch.isinf(logits[4, mask_vocab:]).all()


@pytest.mark.gpu
def test_gpu_real_vocabulary():
    vocab = 151936
    logits = torch.randn(64, vocab, device="cuda", dtype=torch.bfloat16)
    bitmask = torch.randint(-2**31, 2**31 - 1, (40, -(-vocab // 32)), dtype=torch.int32,
                            device="cuda")
    indices = torch.randperm(64, device="cuda")[:40]
    want = apply_token_bitmask_ref(logits, bitmask, indices)
    apply_token_bitmask(logits, bitmask, indices)
    assert torch.equal(logits, want)
