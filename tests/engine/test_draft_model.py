"""Speculative method draft_model end to end on the CPU: greedy tokens identical to the run
without speculation with SmolLM2 as its own draft (nearly every draft accepted) and with a
tiny random draft of the target's vocabulary (nearly none accepted); stops and max_tokens
inside accepted runs; no KV block kept; bad drafts named."""

import pytest

from echo import LLM, SamplingParams
from tests.helpers import completions, write_tiny_model

PROMPTS = ["The capital of France is", "Write a haiku about the sea.",
           "1, 2, 3, 4, 5, 1, 2, 3,"]


@pytest.fixture(scope="module")
def smollm2():
    from echo.models.default_model import ensure_default_model

    return str(ensure_default_model())


def generate(model, prompts, params, draft=None, k=4, **kwargs):
    spec = None if draft is None else {"method": "draft_model", "model": str(draft),
                                       "num_speculative_tokens": k}
    llm = LLM(str(model), device="cpu", max_model_len=512, max_num_seqs=8,
              speculative_config=spec, **kwargs)
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.kv.usage == 0  # every block back in the pool
        return outputs, llm.stats()
    finally:
        llm.shutdown()


def test_smollm2_as_its_own_draft_accepts_nearly_everything(smollm2):
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (24, 30, 17)]
    expected, _ = generate(smollm2, PROMPTS, params)
    got, stats = generate(smollm2, PROMPTS, params, draft=smollm2)
    assert completions(got) == completions(expected)
    assert stats.spec_num_drafts > 0
    # the same model proposes the target's own argmax: all but near-ties are accepted
    assert stats.spec_num_accepted_tokens >= 0.9 * stats.spec_num_draft_tokens
    # a stop string inside an accepted run: cut there, as without speculation
    stop = [SamplingParams(temperature=0, max_tokens=30, stop=[o.outputs[0].text.split()[2]])
            for o in expected]
    expected, _ = generate(smollm2, PROMPTS, stop)
    got, _ = generate(smollm2, PROMPTS, stop, draft=smollm2)
    assert completions(got) == completions(expected)


def test_a_random_draft_of_the_same_vocabulary_changes_nothing(tiny_llama, tmp_path):
    draft = write_tiny_model(tmp_path / "draft", "qwen3", tie=True, seed=7)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], list(range(10, 40)), [3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 9, 33)]
    kwargs = {"num_gpu_blocks_override": 64}
    expected, _ = generate(tiny_llama, prompts, params, **kwargs)
    got, stats = generate(tiny_llama, prompts, params, draft=draft, k=3, **kwargs)
    assert completions(got) == completions(expected)
    assert [len(o.outputs[0].token_ids) for o in got] == [20, 9, 33]
    assert stats.spec_num_drafts > 0
    assert stats.spec_num_accepted_tokens <= 0.2 * stats.spec_num_draft_tokens


def test_bad_draft_models_are_named(tiny_llama, tiny_llama_kv1_odd_vocab, tmp_path):
    def config(**spec):
        from echo.config import EngineConfig

        return EngineConfig.create(str(tiny_llama), device="cpu",
                                   speculative_config={"method": "draft_model", **spec})

    with pytest.raises(ValueError, match="speculative_config.model"):
        config()  # no model
    with pytest.raises(ValueError, match="speculative_config.model"):
        config(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="speculative_config.model.*vocab_size"):
        config(model=str(tiny_llama_kv1_odd_vocab))
    with pytest.raises(ValueError, match="speculative_config.model"):
        from echo.config import SpeculativeConfig

        SpeculativeConfig(method="ngram", model=str(tiny_llama))


def test_tensor_parallel_draft_and_random_sampling(tiny_llama, tmp_path):
    """TP=2 (gloo): target and draft split over both ranks give TP=1's tokens, seeded random
    sampling included (verification draws from the request's own noise)."""
    draft = write_tiny_model(tmp_path / "draft", "qwen3", tie=True, seed=7)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], [3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=15, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=2, max_tokens=19, ignore_eos=True)]
    kwargs = {"num_gpu_blocks_override": 64}
    one, _ = generate(tiny_llama, prompts, params, draft=draft, k=3, **kwargs)
    two, stats = generate(tiny_llama, prompts, params, draft=draft, k=3,
                          tensor_parallel_size=2, **kwargs)
    assert completions(two) == completions(one) and stats.spec_num_drafts > 0
    plain, _ = generate(tiny_llama, prompts[:1], params[:1], **kwargs)
    assert completions(one)[:1] == completions(plain)  # greedy: lossless
