"""echo.LLM end to end on tiny random models: greedy output equals transformers' generate."""

import pytest
import torch

from echo import LLM, SamplingParams
from tests.helpers import hf_greedy_tokens, load_hf

PROMPTS = [[1, 17, 42, 99, 5], [1, 3], list(range(10, 60)), [1] + [7, 8, 9] * 9]


def hf_greedy(folder, prompt: list[int], max_new_tokens: int) -> list[int]:
    return hf_greedy_tokens(load_hf(folder), prompt, max_new_tokens)


def make_llm(folder, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "num_gpu_blocks_override": 128, "max_num_seqs": 8, **kwargs}
    return LLM(str(folder), **kwargs)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen3"])
def test_batched_greedy_equals_transformers_generate(fixture, request):
    folder = request.getfixturevalue(fixture)
    llm = make_llm(folder)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_token_ids == prompt
        assert out.outputs[0].token_ids == hf_greedy(folder, prompt, 32)
        assert out.outputs[0].finish_reason == "length"


def test_chunked_prefill_and_small_budget_do_not_change_greedy_output(tiny_qwen3):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    reference = make_llm(tiny_qwen3).generate(PROMPTS, params, use_tqdm=False)
    chunked = make_llm(tiny_qwen3, max_num_batched_tokens=16, max_num_seqs=4).generate(
        PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in chunked] == \
        [o.outputs[0].token_ids for o in reference]


def test_stop_token_ids_and_max_tokens(tiny_llama):
    llm = make_llm(tiny_llama)
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    tokens = free[0].outputs[0].token_ids
    stop_at = tokens[5]
    first = tokens.index(stop_at)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                    stop_token_ids=[stop_at], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == tokens[: first + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_at)


def test_eos_finishes_unless_ignored(tiny_llama):
    llm = make_llm(tiny_llama)
    tokens = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12,
                                                       ignore_eos=True),
                          use_tqdm=False)[0].outputs[0].token_ids
    # pretend the 4th generated token is the end-of-sequence token
    llm2 = make_llm(tiny_llama)
    llm2.engine.eos_token_ids = (tokens[3],)
    out = llm2.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=12),
                        use_tqdm=False)[0].outputs[0]
    first = tokens.index(tokens[3])
    assert out.token_ids == tokens[: first + 1] and out.finish_reason == "stop"


def test_seeded_sampling_reproduces_and_n_gives_distinct_samples(tiny_qwen3):
    llm = make_llm(tiny_qwen3)
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=7, ignore_eos=True)
    a = llm.generate(PROMPTS, params, use_tqdm=False)
    # same seed, different batch composition: same tokens
    b = llm.generate(PROMPTS[::-1], params, use_tqdm=False)[::-1]
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    many = llm.generate([PROMPTS[0]], SamplingParams(n=3, temperature=1.0, max_tokens=12,
                                                     seed=1, ignore_eos=True), use_tqdm=False)
    samples = [c.token_ids for c in many[0].outputs]
    assert [c.index for c in many[0].outputs] == [0, 1, 2]
    assert len({tuple(s) for s in samples}) == 3


def test_logprobs_match_transformers(tiny_llama):
    llm = make_llm(tiny_llama)
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=4, logprobs=3,
                                                    ignore_eos=True), use_tqdm=False)
    comp = out[0].outputs[0]
    hf = load_hf(tiny_llama)
    ids = PROMPTS[0] + comp.token_ids
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    for i, (token, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[len(PROMPTS[0]) - 1 + i]
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(3)
        assert [t for t, lp in entry.items() if lp.rank is not None] == top.indices.tolist()
        assert entry[token].rank == 1


def test_bad_input_fails_before_queuing_and_llm_keeps_working(tiny_llama):
    llm = make_llm(tiny_llama, max_model_len=64)
    good = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPTS[0], list(range(1, 70))], good, use_tqdm=False)
    for field, value in [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0),
                         ("top_p", 1.5), ("top_k", -2)]:
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: value})
    # errors name what the caller passed: the prompt, or the key of vLLM's TokensPrompt
    with pytest.raises(ValueError, match=r"prompt: every id must be an int in \[0, 128\)"):
        llm.generate([[1, 2, 10_000]], good, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_token_ids: every id"):
        llm.generate([{"prompt_token_ids": [1, -1]}], good, use_tqdm=False)
    for prompt, field in ((None, "prompt"), (3.5, "prompt"),
                          ({"prompt_token_ids": None}, "prompt_token_ids")):
        with pytest.raises(ValueError, match=f"{field}: expected a string"):
            llm.generate([prompt], good, use_tqdm=False)
    for prompts in (None, 5):
        with pytest.raises(ValueError, match="prompts: expected a prompt"):
            llm.generate(prompts, good, use_tqdm=False)
    for params in ({"max_tokens": 2}, 5, "greedy", [good, {"max_tokens": 2}]):
        with pytest.raises(ValueError, match="sampling_params: expected a SamplingParams"):
            llm.generate([PROMPTS[0], PROMPTS[1]], params, use_tqdm=False)
    with pytest.raises(ValueError, match="messages: expected a list"):
        llm.chat({"role": "user", "content": "hi"}, good, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate([PROMPTS[0]], good, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_one_prompt_in_any_form_is_one_request(tiny_llama):
    """A lone {"prompt_token_ids": ...} dict (vLLM's TokensPrompt) is one prompt, as a lone
    id list is: not a sequence of its keys."""
    llm = make_llm(tiny_llama)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ids = [5, 6, 7, 8]
    as_list = llm.generate([ids], params, use_tqdm=False)
    for prompt in (ids, {"prompt_token_ids": ids}):
        out = llm.generate(prompt, params, use_tqdm=False)
        assert len(out) == 1 and out[0].prompt_token_ids == ids
        assert out[0].outputs[0].token_ids == as_list[0].outputs[0].token_ids


def test_text_prompts_need_a_tokenizer_for_presetless_folders(tiny_llama):
    llm = make_llm(tiny_llama)
    with pytest.raises(Exception, match="tokenizer|Tokenizer|prompt"):
        llm.generate("hello", use_tqdm=False)


def test_preset_with_dummy_weights_generates_token_ids():
    llm = LLM("qwen3-0.6b", load_format="dummy", device="cpu", max_model_len=64,
              num_gpu_blocks_override=16, max_num_seqs=2)
    out = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [3, 3]
    assert all(0 <= t < 151936 for o in out for t in o.outputs[0].token_ids)


def test_repetition_penalty_equals_transformers(tiny_llama):
    llm = make_llm(tiny_llama)
    out = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=16,
                                                   repetition_penalty=1.5, ignore_eos=True),
                       use_tqdm=False)
    hf = load_hf(tiny_llama)
    hf.generation_config.eos_token_id = None
    for prompt, o in zip(PROMPTS[:2], out):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                              repetition_penalty=1.5, pad_token_id=0)[0, len(prompt):]
        assert o.outputs[0].token_ids == ref.tolist()


def test_min_tokens_holds_back_stop_tokens(tiny_llama):
    llm = make_llm(tiny_llama)
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12,
                                                     ignore_eos=True), use_tqdm=False)
    stop = free[0].outputs[0].token_ids[1]
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12, min_tokens=6,
                                                    stop_token_ids=[stop], ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert stop not in out.token_ids[:6]
    assert len(out.token_ids) >= 6


def test_tensor_parallel_llm_runs_workers_and_equals_one_rank(tiny_llama):
    import os

    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    # unseeded: each rank draws the request seeds from its own generator, seeded alike; a rank
    # that sampled differently would feed a different token into its share of the next step
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, ignore_eos=True)
    one_rank = make_llm(tiny_llama)
    expected = [one_rank.generate(PROMPTS, p, use_tqdm=False) for p in (greedy, sampled)]
    llm = make_llm(tiny_llama, tensor_parallel_size=2)
    pids = llm.engine.executor.worker_pids
    try:
        outs = [llm.generate(PROMPTS, p, use_tqdm=False) for p in (greedy, sampled)]
    finally:
        llm.shutdown()
    tokens = [[o.outputs[0].token_ids for o in run] for run in outs]
    assert tokens == [[o.outputs[0].token_ids for o in run] for run in expected]
    assert tokens[1] != tokens[0]  # the sampled run did sample
    assert len(pids) == 2
    for pid in pids:  # shutdown waited for the workers: none is left running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_engine_process_gives_the_same_outputs_and_ends_its_process(tiny_llama):
    import os

    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=8, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    expected = make_llm(tiny_llama).generate(PROMPTS, params, use_tqdm=False)
    llm = make_llm(tiny_llama, engine_process=True)
    core_pid = llm.client.core.proc.pid
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        again = llm.generate(PROMPTS[:1], params[0], use_tqdm=False)
        stats = llm.stats()
        assert llm.num_gpu_blocks == 128
    finally:
        llm.shutdown()
    assert [[c.token_ids for c in o.outputs] for o in outs] == \
        [[c.token_ids for c in o.outputs] for o in expected]
    assert len(outs[1].outputs) == 2
    got, want = outs[2].outputs[0].logprobs, expected[2].outputs[0].logprobs
    assert [sorted(e) for e in got] == [sorted(e) for e in want]
    assert again[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert stats.num_running == 0 and stats.kv_cache_usage == 0
    with pytest.raises(ProcessLookupError):
        os.kill(core_pid, 0)


def test_engine_process_death_fails_generate_promptly(tiny_llama):
    import os
    import signal
    import threading
    import time

    from echo.engine.core_client import EngineDeadError

    llm = make_llm(tiny_llama, engine_process=True, max_model_len=512)
    pid = llm.client.core.proc.pid
    killer = threading.Timer(0.5, os.kill, (pid, signal.SIGKILL))
    params = SamplingParams(temperature=0, max_tokens=480, ignore_eos=True)
    try:
        killer.start()
        start = time.monotonic()
        with pytest.raises(EngineDeadError, match="exited"):
            llm.generate(PROMPTS * 2, params, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        killer.cancel()
        llm.shutdown()


def test_out_of_vocabulary_stop_token_ids_are_refused_as_the_server_refuses_them(tiny_llama):
    llm = make_llm(tiny_llama)
    try:
        with pytest.raises(ValueError, match=r"stop_token_ids: token ids must be in \[0, 128\)"):
            llm.generate([[1, 2, 3]], SamplingParams(stop_token_ids=[5, 10**12]), use_tqdm=False)
        assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, stop_token_ids=[127]),
                            use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.shutdown()


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(tiny_llama):
    """vLLM's truncate_prompt_tokens: the model sees the last k prompt tokens (-1: as many as
    max_model_len holds), so the output is transformers' on those tokens alone; a k past
    max_model_len or below -1 is refused by name."""
    llm = make_llm(tiny_llama, max_model_len=64)
    long = list(range(1, 81))  # past max_model_len
    cut = llm.generate([PROMPTS[2], long], [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, truncate_prompt_tokens=7),
        SamplingParams(temperature=0, max_tokens=None, ignore_eos=True,
                       truncate_prompt_tokens=-1)], use_tqdm=False)
    assert cut[0].prompt_token_ids == PROMPTS[2][-7:]
    assert cut[0].outputs[0].token_ids == hf_greedy(tiny_llama, PROMPTS[2][-7:], 6)
    # all 64 positions taken by the prompt: the one token sampled after it, then the limit
    assert cut[1].prompt_token_ids == long[-64:]
    assert cut[1].outputs[0].token_ids == hf_greedy(tiny_llama, long[-64:], 1)
    with pytest.raises(ValueError, match="truncate_prompt_tokens: 65 is greater than "
                                         "max_model_len"):
        llm.generate([long], SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)
    for value in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=value)
