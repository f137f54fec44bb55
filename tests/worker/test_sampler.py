"""Sampler behaviour against hand-made distributions and softmax."""

import math

import pytest
import torch

from echo.worker.sampler import Sampler, SamplingTensors, apply_penalties
from echo_kernels.reference import uniform_noise_ref as uniform_noise


def tensors(batch: int, vocab: int, temperature=1.0, top_k=None, top_p=1.0, min_p=0.0,
            seeds=None, steps=None, logprobs=None, **penalties) -> SamplingTensors:
    full = lambda v, dt: torch.full((batch,), v, dtype=dt)  # noqa: E731
    top_k = vocab if top_k is None else top_k
    return SamplingTensors(
        temperature=full(temperature, torch.float32), top_k=full(top_k, torch.int64),
        top_p=full(top_p, torch.float32), min_p=full(min_p, torch.float32),
        seeds=torch.arange(batch, dtype=torch.int64) * 7919 + 1 if seeds is None else seeds,
        steps=torch.zeros(batch, dtype=torch.int64) if steps is None else steps,
        all_greedy=temperature == 0, need_top_k=top_k < vocab, need_top_p=top_p < 1,
        need_min_p=min_p > 0, max_logprobs=logprobs, **penalties)


def frequencies(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float() / len(tokens)


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
DRAWS = 40_000


def draw(probs: torch.Tensor, **kwargs) -> torch.Tensor:
    logits = probs.log().expand(DRAWS, -1)
    return Sampler()(logits, tensors(DRAWS, len(probs), **kwargs)).token_ids


def test_noise_is_uniform_and_deterministic():
    seeds = torch.tensor([3, 3, 4], dtype=torch.int64)
    steps = torch.tensor([0, 0, 0], dtype=torch.int64)
    u = uniform_noise(seeds, steps, 50_000)
    assert torch.equal(u[0], u[1]) and not torch.equal(u[0], u[2])
    assert 0 < u.min() and u.max() < 1
    # mean 1/2 and variance 1/12 of U(0, 1), within sampling error
    assert abs(u.mean().item() - 0.5) < 0.005
    assert abs(u.var().item() - 1 / 12) < 0.002
    # consecutive steps of one seed are uncorrelated
    a = uniform_noise(seeds[:1], torch.tensor([0]), 50_000)[0]
    b = uniform_noise(seeds[:1], torch.tensor([1]), 50_000)[0]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.02


def test_noise_never_reaches_one_so_excluded_tokens_never_win():
    """Seed 70's first draw is, for token 91,466, the top 24-bit value, which rounds to 1.0 in
    float32: Gumbel noise +inf, and -inf + inf = NaN won the argmax. 23 bits keep u < 1."""
    u = uniform_noise(torch.tensor([70]), torch.tensor([0]), 131_072)
    assert u.max() < 1
    logits = torch.full((1, 131_072), float("-inf"))
    logits[0, 5] = 0.0  # the only token allowed (a grammar's mask, say)
    assert Sampler()(logits, tensors(1, 131_072, seeds=torch.tensor([70]))).token_ids.tolist() \
        == [5]


def test_temperature_frequencies_match_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    for temperature in (0.5, 1.0, 1.7):
        tokens = Sampler()(logits.expand(DRAWS, -1),
                           tensors(DRAWS, 5, temperature=temperature)).token_ids
        expected = (logits / temperature).softmax(-1)
        total_variation = 0.5 * (frequencies(tokens, 5) - expected).abs().sum().item()
        assert total_variation < 0.012, (temperature, total_variation)


def test_same_seed_same_tokens_other_seed_other_tokens():
    logits = torch.randn(1, 1000).expand(64, -1)
    steps = torch.arange(64, dtype=torch.int64)
    same = torch.full((64,), 1234, dtype=torch.int64)
    a = Sampler()(logits, tensors(64, 1000, seeds=same, steps=steps)).token_ids
    b = Sampler()(logits, tensors(64, 1000, seeds=same, steps=steps)).token_ids
    c = Sampler()(logits, tensors(64, 1000, seeds=same + 1, steps=steps)).token_ids
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_top_k_one_is_greedy():
    logits = torch.randn(32, 300)
    greedy = Sampler()(logits, tensors(32, 300, temperature=0.0)).token_ids
    top1 = Sampler()(logits, tensors(32, 300, temperature=1.3, top_k=1)).token_ids
    assert torch.equal(greedy, logits.argmax(-1))
    assert torch.equal(top1, greedy)


@pytest.mark.parametrize("top_p,kept", [(0.75, [0, 1]), (0.85, [0, 1, 2]), (0.4, [0])])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p, kept):
    freq = frequencies(draw(PROBS, top_p=top_p), 4)
    dropped = [i for i in range(4) if i not in kept]
    assert freq[dropped].sum().item() == 0
    expected = PROBS[kept] / PROBS[kept].sum()
    assert (freq[kept] - expected).abs().max().item() < 0.01


def test_min_p_drops_tokens_below_fraction_of_top():
    # threshold 0.2 * 0.5 = 0.1: only the 0.05 token goes
    freq = frequencies(draw(PROBS, min_p=0.2), 4)
    assert freq[3].item() == 0
    expected = PROBS[:3] / PROBS[:3].sum()
    assert (freq[:3] - expected).abs().max().item() < 0.01


def test_top_k_keeps_k_most_likely():
    freq = frequencies(draw(PROBS, top_k=2), 4)
    assert freq[2:].sum().item() == 0
    assert abs(freq[0].item() - 0.5 / 0.8) < 0.01


def test_penalties_match_hand_computed_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0]])
    counts = torch.tensor([[2.0, 1.0, 0.0, 0.0]])  # tokens 0 (twice) and 1 in the output
    prompt = torch.tensor([[False, False, True, False]])  # token 2 in the prompt
    t = tensors(1, 4, presence=torch.tensor([0.5]), frequency=torch.tensor([0.25]),
                repetition=torch.tensor([2.0]), output_counts=counts, prompt_mask=prompt)
    got = apply_penalties(logits, t)
    expected = torch.tensor([[2.0 / 2 - 0.25 * 2 - 0.5, -1.0 * 2 - 0.25 - 0.5, 0.5 / 2, 3.0]])
    torch.testing.assert_close(got, expected)


def test_logprobs_are_the_raw_distribution():
    logits = torch.randn(3, 50)
    out = Sampler()(logits, tensors(3, 50, temperature=0.0, logprobs=5))
    ref = logits.log_softmax(-1)
    torch.testing.assert_close(out.logprob, ref.gather(-1, out.token_ids[:, None]).squeeze(-1))
    torch.testing.assert_close(out.top_logprobs, ref.topk(5).values)
    assert torch.equal(out.top_ids, ref.topk(5).indices)
    assert math.isclose(out.top_logprobs[0, 0].item(), out.logprob[0].item())
