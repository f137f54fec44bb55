"""Speculative decoding (n-gram drafts) end to end on the CPU: greedy tokens identical to the
run without speculation, on SmolLM2 with repeated text (where drafts are accepted) and on tiny
random Qwen3 and Llama (where they mostly are not); stops inside an accepted run; no KV block
kept; a prefix reused after rejections."""

import pytest

from echo import LLM, SamplingParams
from tests.helpers import completions

REPEATS = ["The quick brown fox jumps over the lazy dog. " * 3 + "The quick brown",
           "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2,",
           "Write a haiku about the sea."]
SPEC = {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3}


def run(model, prompts, params, speculative: bool, **kwargs):
    kwargs = {"max_model_len": 512, "max_num_seqs": 8, **kwargs}
    llm = LLM(str(model), device="cpu", speculative_config=SPEC if speculative else None,
              **kwargs)
    drafted = accepted = 0
    if speculative:
        scheduler = llm.engine.scheduler
        update = scheduler.update_from_output

        def counting(scheduler_output, runner_output):
            nonlocal drafted, accepted
            for rid, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
                emitted = runner_output.sampled_token_ids[runner_output.req_ids.index(rid)]
                drafted += len(drafts)
                accepted += len(emitted) - 1
            return update(scheduler_output, runner_output)

        scheduler.update_from_output = counting
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.scheduler.kv.usage == 0  # every block back in the pool
        return outputs, drafted, accepted, llm.engine.scheduler
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def smollm2():
    from echo.models.default_model import ensure_default_model

    return ensure_default_model()


def test_greedy_equals_no_speculation_and_drafts_are_accepted(smollm2):
    greedy = SamplingParams(temperature=0, max_tokens=48)
    expected, _, _, _ = run(smollm2, REPEATS, greedy, speculative=False)
    outputs, drafted, accepted, scheduler = run(smollm2, REPEATS, greedy, speculative=True)
    assert completions(outputs) == completions(expected)
    assert accepted > drafted // 3 > 0  # the repeated text is drafted, mostly right
    stats = scheduler.make_stats()  # what vllm:spec_decode_* report
    assert (stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (drafted, accepted)
    per_position = stats.spec_accepted_per_position
    assert sum(per_position) == accepted and per_position == sorted(per_position, reverse=True)


def test_max_tokens_and_stop_strings_inside_an_accepted_run(smollm2):
    prompt = [REPEATS[0]]
    cases = [SamplingParams(temperature=0, max_tokens=n) for n in (3, 6, 7)] + [
        SamplingParams(temperature=0, max_tokens=40, stop=["lazy"]),
        SamplingParams(temperature=0, max_tokens=40, stop=["over the"],
                       include_stop_str_in_output=True)]
    for params in cases:
        expected, _, _, _ = run(smollm2, prompt, params, speculative=False)
        outputs, _, _, _ = run(smollm2, prompt, params, speculative=True)
        assert completions(outputs) == completions(expected), params


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_tiny_random_models_equal_no_speculation(fixture, request):
    model = request.getfixturevalue(fixture)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], list(range(10, 40)) * 2, [1, 2]]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected, _, _, _ = run(model, prompts, greedy, False, num_gpu_blocks_override=64)
    outputs, drafted, _, _ = run(model, prompts, greedy, True, num_gpu_blocks_override=64)
    assert completions(outputs) == completions(expected)
    assert drafted > 0


def test_a_prefix_reused_after_rejections_hits_the_cache_and_gives_the_same_output(smollm2):
    greedy = SamplingParams(temperature=0, max_tokens=32)
    llm = LLM(str(smollm2), device="cpu", max_model_len=512, max_num_seqs=8,
              speculative_config=SPEC)
    try:
        first = llm.generate([REPEATS[1]], greedy, use_tqdm=False)
        hits = llm.engine.scheduler.kv.prefix_cache_hits
        again = llm.generate([REPEATS[1]], greedy, use_tqdm=False)
        assert llm.engine.scheduler.kv.prefix_cache_hits > hits
        assert completions(again) == completions(first)
    finally:
        llm.shutdown()


def test_sampled_requests_and_requests_without_drafts_share_a_step(smollm2):
    """Seeded sampling with drafts, top-p requests (no drafts) beside them: outputs are valid
    and the seeded ones reproduce."""
    params = [SamplingParams(temperature=0.8, seed=7, max_tokens=24),
              SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=24),
              SamplingParams(temperature=0, max_tokens=24, logprobs=2)]
    first, _, _, _ = run(smollm2, REPEATS, params, speculative=True)
    again, _, _, _ = run(smollm2, REPEATS, params, speculative=True)
    assert completions(first) == completions(again)
    plain, _, _, _ = run(smollm2, REPEATS[2:], params[2:], speculative=False)
    assert completions(first)[2] == completions(plain)[0]  # greedy, no drafts: unchanged
    assert len(first[2].outputs[0].logprobs) == len(first[2].outputs[0].token_ids)



ORACLE_PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 5], list(range(10, 40)), [3, 4]]


def oracle_engine(model, tmp_path, params, **spec):
    """The outputs without speculation of ORACLE_PROMPTS, and an engine whose oracle drafts
    them (k = 4, with the given speculative_config fields)."""
    from echo.core.oracle_proposer import save_continuations

    expected, _, _, _ = run(model, ORACLE_PROMPTS, params, False, num_gpu_blocks_override=64)
    path = tmp_path / "oracle.json"
    save_continuations(path, {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids)
                              for o in expected})
    spec = {"method": "oracle", "num_speculative_tokens": 4, "oracle_path": str(path), **spec}
    return expected, LLM(str(model), device="cpu", max_model_len=512, max_num_seqs=8,
                         num_gpu_blocks_override=64, speculative_config=spec)


@pytest.mark.parametrize("acceptance", [1.0, 0.0, 0.6])
def test_oracle_drafts_give_the_tokens_without_speculation(tiny_llama, tmp_path, acceptance):
    """The oracle proposes the run's own greedy continuations: the outputs do not change, and
    the engine's counters agree with the acceptance (1: every draft accepted, k a step; 0: one
    wrong draft a step, none accepted)."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected, llm = oracle_engine(tiny_llama, tmp_path, greedy, oracle_acceptance=acceptance)
    try:
        outputs = llm.generate(ORACLE_PROMPTS, greedy, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert completions(outputs) == completions(expected)
    drafts, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    assert stats.spec_num_drafts > 0 and sum(stats.spec_accepted_per_position) == accepted
    if acceptance == 1.0:
        # 23 tokens after the first: 4 verifications of 1 + 4, then 3 left to draw: 2 drafts
        assert accepted == drafts == 3 * (4 * 4 + 2)
        assert stats.spec_num_drafts == 3 * 5
    elif acceptance == 0.0:
        # one token a step: 22 verifications of min(4, tokens left after the step's own)
        assert accepted == 0 and stats.spec_num_drafts == 3 * 22
        assert drafts == 3 * (19 * 4 + 3 + 2 + 1)
    else:
        assert 0 < accepted < drafts


def test_above_the_batch_size_cutoff_two_steps_overlap_and_drafts_resume_below(tiny_llama,
                                                                               tmp_path):
    """disable_by_batch_size 2 with three requests: nobody drafts and two steps are in flight
    (async scheduling, as without speculation); once the shortest request ends, the two left
    draft again with one step in flight. Greedy tokens equal those without speculation."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (8, 30, 30)]
    expected, llm = oracle_engine(tiny_llama, tmp_path, params, oracle_acceptance=1.0,
                                  disable_by_batch_size=2)
    engine, depths = llm.engine, []  # (steps in flight, running, drafts) at each launch
    launch = engine.executor.execute_model_async

    def recording(scheduler_output):
        depths.append((len(engine.in_flight) + 1, len(engine.scheduler.running),
                       bool(scheduler_output.scheduled_spec_decode_tokens)))
        return launch(scheduler_output)

    engine.executor.execute_model_async = recording
    try:
        outputs = llm.generate(ORACLE_PROMPTS, params, use_tqdm=False)
        stats = llm.stats()
    finally:
        llm.shutdown()
    assert completions(outputs) == completions(expected)
    assert any(d == 2 and r == 3 for d, r, _ in depths)  # overlapped above the cutoff
    assert not any(spec and r > 2 for _, r, spec in depths)  # no drafts above it
    assert all(d == 1 for d, _, spec in depths if spec)  # a step with drafts runs alone
    assert stats.spec_num_accepted_tokens > 0  # the two left drafted, all accepted
