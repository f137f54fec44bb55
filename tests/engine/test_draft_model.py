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


@pytest.mark.slow  # SmolLM2 target and draft: ~20 s (make test's budget)
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


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_an_eagle3_head_drafts_from_the_targets_hidden_states(family, tmp_path):
    """method eagle3 with a random head (the published format, written by
    tests/models/test_eagle3.py's helper) on a 6-layer target: drafts are proposed from the
    hidden states entering layers 2, 3 and 3, and the greedy tokens are those without
    speculation; prefix caching and a stop at max_tokens inside accepted runs included."""
    from tests.models.test_eagle3 import write_head

    target = write_tiny_model(tmp_path / "target", family, tie=family == "qwen3", num_layers=6)
    write_head(tmp_path / "head")
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], list(range(10, 40)), [3, 4]]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 9, 33)]
    kwargs = {"num_gpu_blocks_override": 64}
    expected, _ = generate(target, prompts, params, **kwargs)
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    llm = LLM(str(target), device="cpu", max_model_len=512, max_num_seqs=8,
              speculative_config=spec, **kwargs)
    try:
        runner = llm.engine.executor.runner
        assert runner.model.model.aux_layers == (2, 3, 3)
        assert llm.engine.proposer is None  # the workers' head drafts, not the core
        first = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(prompts, params, use_tqdm=False)  # over cached prefixes
        stats = llm.stats()
        assert llm.engine.scheduler.kv.usage == 0
    finally:
        llm.shutdown()
    assert completions(first) == completions(expected) == completions(again)
    assert stats.spec_num_drafts > 0 and stats.spec_num_draft_tokens > stats.spec_num_drafts


def test_an_eagle3_head_split_over_two_ranks_drafts_as_on_one(tmp_path):
    """TP=2 (gloo): the head's attention heads, MLP and LM head split as a Llama layer's; its
    drafts are those of TP=1 (numerics aside) and the tokens those without speculation."""
    from tests.models.test_eagle3 import write_head

    target = write_tiny_model(tmp_path / "target", "llama", tie=False, num_layers=6)
    write_head(tmp_path / "head")
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], list(range(10, 40))]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (20, 14)]
    spec = {"method": "eagle3", "model": str(tmp_path / "head"), "num_speculative_tokens": 3}
    expected, _ = generate(target, prompts, params, num_gpu_blocks_override=64)

    def drafted(tp: int):
        llm = LLM(str(target), device="cpu", max_model_len=512, max_num_seqs=8,
                  num_gpu_blocks_override=64, tensor_parallel_size=tp, speculative_config=spec)
        scheduler, drafts = llm.engine.scheduler, []
        take = scheduler.take_model_drafts
        scheduler.take_model_drafts = lambda d: drafts.append(sorted(d.items())) or take(d)
        try:
            return llm.generate(prompts, params, use_tqdm=False), drafts
        finally:
            llm.shutdown()

    one, one_drafts = drafted(1)
    two, two_drafts = drafted(2)
    assert completions(one) == completions(two) == completions(expected)
    flat = lambda steps: [t for step in steps for _, d in step for t in d]  # noqa: E731
    pairs = list(zip(flat(one_drafts), flat(two_drafts), strict=True))
    assert len(pairs) > 30 and sum(a == b for a, b in pairs) >= 0.95 * len(pairs)


def test_bad_eagle3_heads_are_named(tiny_llama, tmp_path):
    from echo.config import EngineConfig
    from tests.models.test_eagle3 import write_head

    write_head(tmp_path / "head")
    spec = {"method": "eagle3", "model": str(tmp_path / "head")}
    with pytest.raises(ValueError, match="at least 4 layers"):
        EngineConfig.create(str(tiny_llama), device="cpu", speculative_config=spec)
    with pytest.raises(ValueError, match="speculative_config.model.*not an EAGLE-3 head"):
        EngineConfig.create(str(tiny_llama), device="cpu",
                            speculative_config={**spec, "model": str(tiny_llama)})
