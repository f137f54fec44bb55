"""Random sampling with speculation is lossless at the engine level: over 20,000 seeded
requests on a 16-token model, the first two output tokens (the second verified against a
draft) follow the target's own distribution, computed by transformers, for the draft model
and for n-gram drafts (chi-square over the 256 pairs)."""

import pytest
import torch

from echo import LLM, SamplingParams
from tests.helpers import load_hf, write_tiny_model

VOCAB, DRAWS, TEMPERATURE = 16, 20_000, 1.3
PROMPT = [3, 7, 3, 7, 3]  # repeats: n-gram lookup finds drafts after any 7 or 3
CHI2_255 = 330.5  # chi-square critical value at p = 0.001, 255 degrees of freedom


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("spec_sampling")
    target = write_tiny_model(folder / "target", "llama", tie=False, vocab_size=VOCAB)
    draft = write_tiny_model(folder / "draft", "qwen3", tie=True, vocab_size=VOCAB, seed=5)
    return target, draft


def pair_probabilities(target) -> torch.Tensor:
    """P(t1, t2) = p(t1 | prompt) p(t2 | prompt, t1) at TEMPERATURE, by transformers."""
    model = load_hf(target)
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([PROMPT])).logits[0, -1] / TEMPERATURE, -1)
        batch = torch.tensor([PROMPT + [t] for t in range(VOCAB)])
        second = torch.softmax(model(batch).logits[:, -1] / TEMPERATURE, -1)
    return (first[:, None] * second).flatten()


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_emitted_pairs_follow_the_target(models, method):
    target, draft = models
    spec = ({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}
            if method == "draft_model" else
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    llm = LLM(str(target), device="cpu", max_model_len=64, max_num_seqs=1024,
              max_num_batched_tokens=8192, num_gpu_blocks_override=4096,
              enable_prefix_caching=False, speculative_config=spec)
    params = [SamplingParams(temperature=TEMPERATURE, seed=i, max_tokens=3, ignore_eos=True)
              for i in range(DRAWS)]
    try:
        outputs = llm.generate([{"prompt_token_ids": PROMPT}] * DRAWS, params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    pairs = torch.tensor([o.outputs[0].token_ids[0] * VOCAB + o.outputs[0].token_ids[1]
                          for o in outputs])
    counts = torch.bincount(pairs, minlength=VOCAB * VOCAB).float()
    expected = pair_probabilities(target) * DRAWS
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < CHI2_255, chi2
    # the second tokens were verifications (max_tokens 3 leaves room for a draft)
    # (n-gram finds a draft only after a first token the prompt holds: 3 or 7)
    assert stats.spec_num_drafts > (DRAWS // 2 if method == "draft_model" else DRAWS // 20)
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
