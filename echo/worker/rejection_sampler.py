"""Speculative decoding's verification: which drafted tokens the target model accepts, and the
token that follows them, so that the emitted tokens are distributed exactly as the target's own
samples (greedy: identical to them).

Per request with k drafts the target scored k + 1 positions. Draft i (token d) is accepted
when, greedy, it is the target's argmax there; random, with probability min(1, p(d) / q(d)),
p the target's distribution at temperature T and q the draft's (a point mass at d for n-gram
drafts: q(d) = 1). At the first rejected draft the request emits a token drawn from the
normalized max(0, p - q) (for a point mass: p without d); when all k are accepted it emits a
bonus token drawn from p at the last position. Random draws use the sampler's counter-based
noise (echo_kernels.reference.uniform_noise_ref) keyed by the request's seed and the output
index of the token, so they depend on nothing else in the batch; the acceptance test reads
one more uniform per position from a column past the vocabulary.

This is the PyTorch implementation, on any device; the step that runs it is not wired into
the engine yet (the scheduler's drafts come next), and a Triton kernel will follow.
"""

import torch

from echo_kernels.reference import uniform_noise_ref


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: list[list[int]],
                     temperature: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                     draft_probs: torch.Tensor | None = None) -> list[list[int]]:
    """target_logits [sum(k_r + 1), V]: request r's k_r + 1 positions, requests in order;
    draft_token_ids: request r's k_r drafts; temperature, seeds, steps [R]: steps is the output
    index of the first token request r emits this step; draft_probs [sum(k_r), V] the draft
    model's distributions (None: point masses, n-gram). Returns each request's emitted
    tokens: its accepted drafts, then one more."""
    device, vocab = target_logits.device, target_logits.shape[1]
    counts = torch.tensor([len(d) + 1 for d in draft_token_ids], device=device)
    num_reqs, width = len(draft_token_ids), int(counts.max())
    # [R, W] padded views: position i of request r is flat row starts[r] + i
    starts = torch.cumsum(counts, 0) - counts
    offsets = torch.arange(width, device=device)
    flat = (starts[:, None] + offsets[None, :]).clamp(max=target_logits.shape[0] - 1)
    logits = target_logits.float()[flat]  # [R, W, V]
    greedy = (temperature == 0)[:, None]
    probs = torch.softmax(logits / torch.where(greedy, 1.0, temperature[:, None])[..., None],
                          dim=-1)
    argmax = logits.argmax(dim=-1)  # [R, W]
    drafts = torch.zeros(num_reqs, width, dtype=torch.long, device=device)
    for r, d in enumerate(draft_token_ids):
        if d:
            drafts[r, :len(d)] = torch.tensor(d, device=device)
    is_draft = offsets[None, :] < (counts - 1)[:, None]

    # one uniform per position past the vocabulary, and Gumbel noise over it, per output index
    positions = (steps[:, None] + offsets[None, :]).reshape(-1)
    noise = uniform_noise_ref(seeds.repeat_interleave(width), positions, vocab + 1)
    noise = noise.reshape(num_reqs, width, vocab + 1)
    accept_u, gumbel = noise[..., vocab], -torch.log(-torch.log(noise[..., :vocab]))

    p_draft = probs.gather(-1, drafts[..., None]).squeeze(-1)
    if draft_probs is None:
        q = torch.zeros_like(probs).scatter_(-1, drafts[..., None], 1.0)
    else:
        q = torch.zeros_like(probs)
        draft_flat = (starts - torch.arange(num_reqs, device=device))[:, None] + offsets[None, :]
        draft_rows = draft_flat.clamp(0, max(draft_probs.shape[0] - 1, 0))
        q = torch.where(is_draft[..., None], draft_probs.float()[draft_rows], q)
    q_draft = q.gather(-1, drafts[..., None]).squeeze(-1)
    accepted = torch.where(greedy, argmax == drafts,
                           accept_u * q_draft <= p_draft) & is_draft
    # the residual max(0, p - q) at a draft position, p itself at the bonus position
    residual = torch.where(is_draft[..., None], (probs - q).clamp(min=0), probs)
    sampled = torch.where(residual.sum(-1) > 0, (residual.log() + gumbel).argmax(-1),
                          (probs.log() + gumbel).argmax(-1))  # p == q: any rejection is moot
    replacement = torch.where(greedy, argmax, sampled)

    # accepted drafts are a prefix: count until the first rejection
    num_accepted = torch.cumprod(accepted.long(), dim=1).sum(dim=1)
    result = []
    for r in range(num_reqs):
        a = int(num_accepted[r])
        result.append(drafts[r, :a].tolist() + [int(replacement[r, a])])
    return result
