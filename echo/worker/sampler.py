"""Batched sampling on the device: logit bias, token bans (min_tokens, allowed_token_ids, bad
words), penalties, temperature, top-k/top-p/min-p, seeded draws.

Every request carries a seed (one is drawn for requests that gave none). Random draws are a
counter-based hash of (seed, output index, token id) turned into Gumbel noise, so a request's
tokens depend only on its own seed and logits: the same seed gives the same output whatever
else shares the batch, every tensor-parallel rank draws the same token, and there is no
per-request generator, loop or host sync. On the GPU the noise and the argmax are one fused
kernel (echo_kernels.sampling) that never writes the noise out.
"""

from dataclasses import dataclass

import torch


def gumbel_sample(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  steps: torch.Tensor) -> torch.Tensor:
    """One fused pass on the GPU; the PyTorch twin (same hash, bit for bit) elsewhere."""
    if logits.is_cuda:
        from echo_kernels import gumbel_sample as kernel

        return kernel(logits, temperature, seeds, steps)
    from echo_kernels.reference import gumbel_sample_ref

    return gumbel_sample_ref(logits, temperature, seeds, steps)


@dataclass(frozen=True)
class SamplingTensors:
    """One row per request that samples this step, all on the logits' device."""

    temperature: torch.Tensor  # [B] f32; 0 = greedy
    top_k: torch.Tensor  # [B] i64; vocab size = no limit
    top_p: torch.Tensor  # [B] f32
    min_p: torch.Tensor  # [B] f32
    seeds: torch.Tensor  # [B] i64
    steps: torch.Tensor  # [B] i64, index of the output token being sampled
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    max_logprobs: int | None = None  # None: nobody asked for logprobs
    # penalties, only when some row has one
    presence: torch.Tensor | None = None  # [B] f32
    frequency: torch.Tensor | None = None  # [B] f32
    repetition: torch.Tensor | None = None  # [B] f32
    output_counts: torch.Tensor | None = None  # [B, V] f32, occurrences in the output so far
    prompt_mask: torch.Tensor | None = None  # [B, V] bool, token appears in the prompt
    # [B, V] bool: EOS before min_tokens, tokens outside allowed_token_ids, bad words
    banned: torch.Tensor | None = None
    # logit_bias, only when some row has one: [2, K] i64 (row, token id), [K] f32 bias
    bias_index: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [B] i64
    logprob: torch.Tensor | None = None  # [B] f32 of the sampled token
    top_ids: torch.Tensor | None = None  # [B, N] i64
    top_logprobs: torch.Tensor | None = None  # [B, N] f32


def apply_penalties(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    counts = t.output_counts
    seen = t.prompt_mask | (counts > 0)
    rep = t.repetition[:, None].expand_as(logits)
    # repetition (as in CTRL / Hugging Face): shrink positive logits, grow negative ones
    logits = torch.where(seen & (logits > 0), logits / rep, logits)
    logits = torch.where(seen & (logits <= 0), logits * rep, logits)
    logits = logits - t.frequency[:, None] * counts
    return logits - t.presence[:, None] * (counts > 0).float()


def apply_top_k_top_p_min_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Set excluded tokens to -inf. top-p keeps the smallest set of most likely tokens whose
    probability reaches top_p; min-p drops tokens below min_p times the top probability."""
    if t.need_min_p:
        probs = logits.softmax(dim=-1)
        threshold = t.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    if not (t.need_top_k or t.need_top_p):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    drop = ranks >= t.top_k[:, None]
    if t.need_top_p:
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop |= mass_before >= t.top_p[:, None]
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def target_distribution(logits: torch.Tensor, t: SamplingTensors
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits to draw each row's token from and the temperature to draw them at: logit
    bias, penalties and bans applied; with top-k/top-p/min-p, the temperature-scaled logits
    filtered, drawn at temperature 1 (greedy rows at 0). The sampler draws from it, the
    rejection sampler verifies drafts against it."""
    # vLLM's order: allowed ids, bad words, min_tokens, logit_bias, then penalties; the
    # bans are -inf, which bias and penalties leave -inf, so they are applied last here
    if t.bias_values is not None:
        logits = logits.float().index_put((t.bias_index[0], t.bias_index[1]),
                                          t.bias_values, accumulate=True)
    if t.output_counts is not None:
        logits = apply_penalties(logits.float(), t)
    if t.banned is not None:
        logits = logits.masked_fill(t.banned, float("-inf"))
    if t.all_greedy or not (t.need_top_k or t.need_top_p or t.need_min_p):
        return logits, t.temperature
    # the filters act on the temperature-scaled distribution
    is_greedy = t.temperature == 0
    scaled = logits.float() / torch.where(is_greedy, 1.0, t.temperature)[:, None]
    return apply_top_k_top_p_min_p(scaled, t), is_greedy.logical_not().float()


def raw_logprobs(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor | None:
    """logprobs of the raw logits, before any processing, as vLLM's default
    (logprobs_mode=raw_logprobs): logit_bias, bans and penalties do not change them. None
    when nobody asked for logprobs."""
    return logits.float().log_softmax(dim=-1) if t.max_logprobs is not None else None


class Sampler:
    def __call__(self, logits: torch.Tensor, t: SamplingTensors) -> SamplerOutput:
        raw = raw_logprobs(logits, t)
        logits, temperature = target_distribution(logits, t)
        if t.all_greedy and not logits.is_cuda:
            token_ids = logits.argmax(dim=-1)  # the twin would draw noise nobody uses
        else:
            # greedy on the GPU too: the kernel's argmax spreads a small batch's rows over the
            # SMs; torch's argmax of one row was slower (docs/benchmarks.md, What was tried
            # and dropped: Sampling)
            token_ids = gumbel_sample(logits, temperature, t.seeds, t.steps)
        if raw is None:
            return SamplerOutput(token_ids)
        logprob = raw.gather(-1, token_ids[:, None]).squeeze(-1)
        top = raw.topk(t.max_logprobs, dim=-1) if t.max_logprobs > 0 else None
        return SamplerOutput(token_ids, logprob, top.indices if top else None,
                             top.values if top else None)
