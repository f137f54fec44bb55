"""Speculative decoding (n-gram drafts) end to end on the CPU: greedy tokens identical to the
run without speculation, on SmolLM2 with repeated text (where drafts are accepted) and on tiny
random Qwen3 and Llama (where they mostly are not); stops inside an accepted run; no KV block
kept; a prefix reused after rejections."""

import math

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


def test_int8_kv_and_chunked_prefill_beside_verifications(smollm2):
    """An int8 KV cache, and prompts prefilled in chunks of 24 tokens in the steps where the
    other requests verify drafts: the greedy tokens are those without speculation on the same
    cache and budget."""
    prompts = [REPEATS[1], REPEATS[0] * 2, REPEATS[2]]
    greedy = SamplingParams(temperature=0, max_tokens=20)
    kwargs = {"kv_cache_dtype": "int8", "max_num_batched_tokens": 24}
    expected, _, _, _ = run(smollm2, prompts, greedy, speculative=False, **kwargs)
    outputs, drafted, accepted, _ = run(smollm2, prompts, greedy, speculative=True, **kwargs)
    assert completions(outputs) == completions(expected)
    assert accepted > 0 and drafted > accepted


@pytest.mark.slow  # every sampling option through SmolLM2, twice: ~18 s (make test's budget)
def test_every_sampling_option_is_verified_as_plain_decoding_samples(smollm2):
    """Drafts for requests with penalties, logit_bias, bad words, min_tokens and logprobs are
    verified at the distribution plain decoding samples from after the drafts before them:
    greedy tokens and their logprobs equal those without speculation (penalties that count
    the drafts as outputs flip argmaxes on this repeated text when miscounted); top_k=1 at
    temperature 1 is greedy; top-k/top-p/min-p draws stay inside their filter."""
    greedy = dict(temperature=0, max_tokens=24)
    fox = REPEATS[0]
    cases = [(fox, SamplingParams(repetition_penalty=1.3, logprobs=3, **greedy)),
             (REPEATS[1], SamplingParams(presence_penalty=0.6, frequency_penalty=0.3,
                                         **greedy)),
             (fox, SamplingParams(bad_words=["lazy"], logit_bias={578: 2.0}, **greedy)),
             (fox, SamplingParams(min_tokens=20, logprobs=0, **greedy)),
             (REPEATS[1], SamplingParams(temperature=1.0, top_k=1, max_tokens=24)),
             (fox, SamplingParams(temperature=1.0, top_k=3, seed=1, logprobs=3,
                                  max_tokens=24)),
             (fox, SamplingParams(temperature=1.0, top_p=0.3, seed=2, logprobs=20,
                                  max_tokens=24)),
             (fox, SamplingParams(temperature=1.5, min_p=0.2, seed=3, logprobs=1,
                                  max_tokens=24))]
    prompts, params = [p for p, _ in cases], [q for _, q in cases]
    expected, _, _, _ = run(smollm2, prompts, params, speculative=False)
    outputs, drafted, accepted, _ = run(smollm2, prompts, params, speculative=True)
    assert accepted > 0 and drafted > accepted
    greedy_top_1 = run(smollm2, prompts[4:5], SamplingParams(**greedy), speculative=False)[0]
    for i, (got, want) in enumerate(zip(outputs[:5], expected[:4] + greedy_top_1)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids, params[i]
        got_lps, want_lps = got.outputs[0].logprobs, want.outputs[0].logprobs
        assert (got_lps is None) == (want_lps is None)
        for a, b in zip(got_lps or [], want_lps or []):
            assert a.keys() == b.keys()
            assert all(abs(a[t].logprob - b[t].logprob) < 1e-3 for t in a)
    for out in outputs[5:]:
        completion = out.outputs[0]
        assert len(completion.logprobs) == len(completion.token_ids) > 0
    for token, entry in zip(outputs[5].outputs[0].token_ids, outputs[5].outputs[0].logprobs):
        assert entry[token].rank is not None and entry[token].rank <= 3  # top-k 3
    for token, entry in zip(outputs[6].outputs[0].token_ids, outputs[6].outputs[0].logprobs):
        rank = entry[token].rank  # top-p 0.3: the more likely tokens' mass is below 0.3
        assert rank is not None and rank <= 20
        assert sum(math.exp(e.logprob) for e in entry.values() if e.rank < rank) < 0.3
    for token, entry in zip(outputs[7].outputs[0].token_ids, outputs[7].outputs[0].logprobs):
        top = next(e.logprob for e in entry.values() if e.rank == 1)
        # min-p 0.2 on the distribution at temperature 1.5
        assert math.exp((entry[token].logprob - top) / 1.5) >= 0.2 - 1e-4


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


def test_while_drafting_the_next_step_is_launched_before_the_outputs_return(tiny_llama,
                                                                             tmp_path):
    """One step in flight while requests draft, but launched as soon as the drafts are in:
    when a step's outputs come back to the caller, the next step is already on its way."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 30, 30)]
    expected, llm = oracle_engine(tiny_llama, tmp_path, params, oracle_acceptance=0.5)
    engine, in_flight_at_return = llm.engine, []
    step = llm._next_outputs  # the in-process engine's step_overlapped

    def recording():
        outputs = step()
        if outputs is not None and outputs.outputs and engine.scheduler.has_unfinished_requests():
            in_flight_at_return.append(len(engine.in_flight))
        return outputs

    llm._next_outputs = recording
    try:
        outputs = llm.generate(ORACLE_PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert completions(outputs) == completions(expected)
    assert len(in_flight_at_return) > 5 and set(in_flight_at_return) == {1}
