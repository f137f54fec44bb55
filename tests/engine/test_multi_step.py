"""Several decode steps per launch (num_scheduler_steps) end to end on the CPU: the tokens of
greedy and seeded runs equal those of one step per launch, on SmolLM2 (EOS, stop strings and
max_tokens landing inside a launch) and on tiny random Qwen3 and Llama; requests that need the
host between tokens keep one step per launch; no KV block kept; a prefix cached after a run cut
at a stop gives the same output again."""

import pytest

from echo import LLM, SamplingParams
from tests.helpers import completions

PROMPTS = ["The quick brown fox", "1, 2, 3, 4,", "Write a haiku about the sea.",
           "What is the capital of France?"]


def run(model, prompts, params, steps: int, **kwargs):
    """The completions, and the decode steps of every launch that scheduled tokens."""
    kwargs = {"max_model_len": 256, "max_num_seqs": 8, **kwargs}
    llm = LLM(str(model), device="cpu", num_scheduler_steps=steps, **kwargs)
    scheduler = llm.engine.scheduler
    schedule, launches = scheduler.schedule, []

    def recording():
        output = schedule()
        if not output.is_empty:
            launches.append(output.num_decode_steps)
        return output

    scheduler.schedule = recording
    try:
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert scheduler.kv.usage == 0  # every block back in the pool
        assert not scheduler.requests and not llm.engine.in_flight
        return completions(outputs), launches
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def smollm2():
    from echo.models.default_model import ensure_default_model

    return ensure_default_model()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=40),
    [SamplingParams(temperature=1.0, seed=s, max_tokens=n) for s, n in
     ((1, 29), (2, 3), (3, 17), (4, 6))],
    SamplingParams(temperature=0, max_tokens=40, stop=["sea", " 7"]),
], ids=["greedy", "seeded", "stop-strings"])
def test_tokens_equal_one_step_per_launch(smollm2, params):
    expected, single = run(smollm2, PROMPTS, params, steps=1)
    got, launches = run(smollm2, PROMPTS, params, steps=8)
    assert got == expected
    assert set(single) == {1}
    assert 8 in launches  # the decodes ran 8 steps a launch ...
    assert len(launches) < len(single) / 3  # ... so far fewer launches carried them


def test_max_tokens_and_eos_inside_a_launch(smollm2):
    """max_tokens 2, 5, 9, 13 end inside or at the end of a launch of 4 (the launch is cut
    short for the request with fewer tokens left); an EOS before max_tokens ends its request
    in the middle of one (the chat answer stops on its own)."""
    prompts = PROMPTS[:3] + [PROMPTS[3]]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (2, 5, 9, 13)]
    expected, _ = run(smollm2, prompts, params, steps=1)
    got, launches = run(smollm2, prompts, params, steps=4)
    assert got == expected
    assert {2, 3, 4} & set(launches)
    llm_params = SamplingParams(temperature=0, max_tokens=200)
    chat = [[{"role": "user", "content": "Say hi."}]]
    answers = []
    for steps in (1, 8):
        llm = LLM(str(smollm2), device="cpu", max_model_len=512, num_scheduler_steps=steps)
        try:
            answers.append(completions(llm.chat(chat, llm_params)))
            assert llm.engine.scheduler.kv.usage == 0
        finally:
            llm.shutdown()
    assert answers[0] == answers[1] and answers[0][0][2] == "stop"


@pytest.mark.parametrize("fixture", ["tiny_qwen3", "tiny_llama"])
def test_tiny_random_models(fixture, request):
    model = request.getfixturevalue(fixture)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], list(range(10, 40)) * 2, [1, 2]]
    params = SamplingParams(temperature=0.7, seed=11, n=2, max_tokens=37, ignore_eos=True)
    expected, _ = run(model, prompts, params, steps=1, num_gpu_blocks_override=64)
    got, launches = run(model, prompts, params, steps=16, num_gpu_blocks_override=64)
    assert got == expected
    assert 16 in launches


def test_requests_that_need_the_host_decode_one_step_a_launch(smollm2):
    """Penalties, logprobs and top-p requests next to plain ones: no launch runs more than
    one step while they run, and every output is as without multi-step."""
    params = [SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=40)]
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[1]]
    expected, _ = run(smollm2, prompts, params, steps=1)
    got, launches = run(smollm2, prompts, params, steps=8)
    assert got == expected
    # the plain request goes on alone after the others finish: only then several steps
    first_multi = next(i for i, n in enumerate(launches) if n > 1)
    assert first_multi >= 12 and all(n > 1 for n in launches[first_multi:-1])


def test_a_prefix_cached_after_a_run_cut_at_a_stop_gives_the_same_output(smollm2):
    params = SamplingParams(temperature=0, max_tokens=40, stop=["human"])  # 17 tokens in all
    llm = LLM(str(smollm2), device="cpu", max_model_len=256, num_scheduler_steps=8)
    try:
        first = completions(llm.generate(PROMPTS[2:3], params, use_tqdm=False))
        prompt = llm.get_tokenizer().encode(PROMPTS[2]) + list(first[0][0])
        hits = llm.engine.scheduler.kv.prefix_cache_hits
        longer = completions(llm.generate([{"prompt_token_ids": prompt}], params,
                                          use_tqdm=False))
        assert llm.engine.scheduler.kv.prefix_cache_hits > hits
    finally:
        llm.shutdown()
    expected, _ = run(smollm2, [{"prompt_token_ids": prompt}], params, steps=1,
                      enable_prefix_caching=False)
    assert longer == expected


def test_tensor_parallel_ranks_agree(tiny_qwen3):
    prompts = [[1, 5, 9, 5, 9, 5, 9, 5], [3, 4]]
    params = SamplingParams(temperature=0.9, seed=2, max_tokens=19, ignore_eos=True)
    expected, _ = run(tiny_qwen3, prompts, params, steps=1, num_gpu_blocks_override=64)
    got, launches = run(tiny_qwen3, prompts, params, steps=8, num_gpu_blocks_override=64,
                        tensor_parallel_size=2)
    assert got == expected and 8 in launches
