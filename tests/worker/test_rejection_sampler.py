"""Speculative verification: greedy emits exactly the target's argmax tokens; random emits
tokens distributed as the target's own samples (chi-square over 20,000 seeded draws on an
8-token vocabulary), for n-gram drafts (point masses) and for a draft model's distributions."""

import torch

from echo.worker import rejection_sampler
from echo_kernels.reference import gumbel_sample_ref

V = 8
DRAWS = 20_000
# chi-square critical values at p = 0.001: 7 and 63 degrees of freedom
CHI2_7, CHI2_63 = 24.32, 103.4


def rejection_sample(logits, drafts: list[list[int]], temperature, seeds, steps,
                     draft_probs=None) -> list[list[int]]:
    """The worker's rejection_sample over per-request draft lists; draft_probs one row per
    draft (the rows after each request's drafts get none)."""
    ids, cu, width = rejection_sampler.flat_drafts(drafts)
    if draft_probs is not None:  # aligned with the logits' rows
        aligned = torch.zeros(len(ids), draft_probs.shape[1])
        aligned[torch.from_numpy(ids >= 0)] = draft_probs
        draft_probs = aligned
    out = rejection_sampler.rejection_sample(logits, torch.from_numpy(ids), torch.from_numpy(cu),
                                             temperature, seeds, steps, width, draft_probs)
    return [[t for t in row if t >= 0] for row in out.tolist()]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    # argmax per position: 3, 5, 1 (request 0, two drafts); 4, 4 (request 1, one draft); 6
    # (request 2, no draft)
    logits = torch.full((6, V), -1.0)
    for row, token in enumerate([3, 5, 1, 4, 4, 6]):
        logits[row, token] = 2.0
    out = rejection_sample(logits, [[3, 7], [4], []], torch.zeros(3), torch.arange(3),
                           torch.zeros(3, dtype=torch.long))
    assert out == [[3, 5], [4, 4], [6]]
    logits[1, 7] = 3.0  # now draft 7 is the argmax at position 1: both accepted, bonus 1
    out = rejection_sample(logits, [[3, 7], [4], []], torch.zeros(3), torch.arange(3),
                           torch.zeros(3, dtype=torch.long))
    assert out == [[3, 7, 1], [4, 4], [6]]


def _target(seed: int) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5


def test_random_first_token_follows_the_target_for_point_mass_drafts():
    p0, p1 = _target(0), _target(1)
    logits = torch.stack([p0, p1]).repeat(DRAWS, 1)  # each request: 1 draft, 2 positions
    probs = torch.softmax(torch.stack([p0, p1]) / 0.8, dim=-1)
    draft = int(probs[0].argsort()[-2])  # a plausible but not the likeliest token
    out = rejection_sample(logits, [[draft]] * DRAWS, torch.full((DRAWS,), 0.8),
                           torch.arange(DRAWS) + 1, torch.full((DRAWS,), 5))
    first = torch.bincount(torch.tensor([o[0] for o in out]), minlength=V).float()
    assert chi_square(first, probs[0]) < CHI2_7
    # after an accepted draft, the bonus token follows the target at the next position
    second = torch.bincount(torch.tensor([o[1] for o in out if len(o) == 2]),
                            minlength=V).float()
    assert second.sum() > 0.8 * DRAWS * float(probs[0, draft])  # accepted about p(draft)
    assert chi_square(second, probs[1]) < CHI2_7


def test_random_pairs_follow_the_target_for_draft_model_distributions():
    """Two drafts from a draft model's q; where fewer than two tokens come out, the second is
    the next step's plain sample (as the engine would draw it): the pair follows p0 x p1."""
    p0, p1, p2 = _target(2), _target(3), _target(4)
    q = torch.softmax(torch.stack([_target(5), _target(6)]), dim=-1)  # the draft's two steps
    g = torch.Generator().manual_seed(9)
    drafts = torch.stack([torch.multinomial(q[0], DRAWS, replacement=True, generator=g),
                          torch.multinomial(q[1], DRAWS, replacement=True, generator=g)], 1)
    seeds = torch.arange(DRAWS) + 3
    out = rejection_sample(torch.stack([p0, p1, p2]).repeat(DRAWS, 1), drafts.tolist(),
                           torch.ones(DRAWS), seeds, torch.zeros(DRAWS, dtype=torch.long),
                           draft_probs=q.repeat(DRAWS, 1))
    next_step = gumbel_sample_ref(p1.repeat(DRAWS, 1), torch.ones(DRAWS), seeds,
                                  torch.ones(DRAWS, dtype=torch.long))
    pairs = torch.tensor([o[0] * V + (o[1] if len(o) > 1 else int(next_step[i]))
                          for i, o in enumerate(out)])
    probs = torch.softmax(torch.stack([p0, p1]), dim=-1)
    joint = (probs[0][:, None] * probs[1][None, :]).flatten()
    assert chi_square(torch.bincount(pairs, minlength=V * V).float(), joint) < CHI2_63
    assert sum(len(o) > 1 for o in out) > DRAWS // 10  # drafts were accepted, often


def test_draws_depend_on_the_seed_and_output_index_only():
    logits = torch.stack([_target(7), _target(8)])
    one = rejection_sample(logits, [[1]], torch.ones(1), torch.tensor([42]), torch.tensor([3]))
    batch = rejection_sample(torch.cat([logits.flip(0), logits]), [[2], [1]], torch.ones(2),
                             torch.tensor([5, 42]), torch.tensor([0, 3]))
    assert batch[1] == one[0]
