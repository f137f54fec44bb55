"""Structured outputs through the engine (echo.LLM and EngineCore, CPU) on a tiny random model
that speaks SmolLM2's vocabulary: random weights are the hostile case, as the grammar alone
keeps the output valid. Validity is checked by independent parsers (json + jsonschema, re)."""

import json
import os
import re
import threading

import jsonschema
import pytest

from echo import LLM, SamplingParams, StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "color", "tags"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON:"


def make_llm(folder, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "num_gpu_blocks_override": 256, "max_num_seqs": 16,
              "max_model_len": 512, **kwargs}
    return LLM(str(folder), **kwargs)


def json_params(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=200,
                          structured_outputs=StructuredOutputsParams(json=SCHEMA), **kwargs)


def assert_valid(outputs) -> list[str]:
    texts = []
    for out in outputs:
        for completion in out.outputs:
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), SCHEMA)
            texts.append(completion.text)
    return texts


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    engine = make_llm(tiny_chat_model)
    yield engine
    engine.shutdown()


def test_json_schema_holds_over_seeds_and_async_equals_sync(llm, tiny_chat_model):
    params = [json_params(seed) for seed in range(10)]
    before = llm.stats()
    outputs = llm.generate([PROMPT] * 10, params, use_tqdm=False)
    texts = assert_valid(outputs)
    assert len(set(texts)) > 5  # the seeds sampled different objects
    # each constrained token was sampled in a step whose bitmask the core filled
    after = llm.stats()
    longest = max(len(o.outputs[0].token_ids) for o in outputs)
    assert after.grammar_bitmask_steps - before.grammar_bitmask_steps >= longest
    assert after.grammar_accept_seconds > before.grammar_accept_seconds
    free = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=60),
                        use_tqdm=False)[0].outputs[0].text
    with pytest.raises(ValueError):  # the same model unconstrained writes no such object
        jsonschema.validate(json.loads(free), SCHEMA)
    # one step in flight: the bitmask goes with its step at once instead of after the
    # previous step's tokens; the tokens are the same
    sync = make_llm(tiny_chat_model, async_scheduling=False)
    try:
        assert [o.outputs[0].text for o in sync.generate([PROMPT] * 10, params,
                                                          use_tqdm=False)] == texts
    finally:
        sync.shutdown()


def test_regex_choice_and_grammar_with_logprobs_and_penalties(llm):
    grammar = 'root ::= term (("+" | "-" | "*") term){0,3}\nterm ::= [1-9] [0-9]?'
    cases = [
        (StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"),
         lambda text: re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", text)),
        (StructuredOutputsParams(choice=["yes", "no", 'it "depends"']),
         lambda text: text in ("yes", "no", 'it "depends"')),
        (StructuredOutputsParams(grammar=grammar),
         lambda text: re.fullmatch(r"[1-9][0-9]?([-+*][1-9][0-9]?){0,3}", text)),
    ]
    for constraint, check in cases:
        params = [SamplingParams(temperature=1.0, seed=seed, max_tokens=40, logprobs=3,
                                 presence_penalty=1.5, repetition_penalty=1.3,
                                 structured_outputs=constraint) for seed in range(6)]
        for out in llm.generate([PROMPT] * 6, params, use_tqdm=False):
            completion = out.outputs[0]
            assert completion.finish_reason == "stop" and check(completion.text), \
                (constraint, completion.text)
            # logprobs are of the constrained distribution: the sampled token's is finite
            for token, entry in zip(completion.token_ids, completion.logprobs):
                assert entry[token].logprob > float("-inf")


def test_n_with_a_seed_reproduces(llm):
    params = json_params(7, n=2)
    first, again = (llm.generate([PROMPT], params, use_tqdm=False)[0] for _ in range(2))
    assert assert_valid([first]) == assert_valid([again])
    assert first.outputs[0].text != first.outputs[1].text  # two samples, not one twice


def test_preempted_requests_stay_valid_and_equal_an_unpreempted_run(tiny_chat_model, llm):
    prompts = [PROMPT + " " + "and more " * k for k in range(8)]
    params = [json_params(seed) for seed in range(8)]
    expected = assert_valid(llm.generate(prompts, params, use_tqdm=False))
    tight = make_llm(tiny_chat_model, num_gpu_blocks_override=20, max_num_batched_tokens=64)
    try:
        texts = assert_valid(tight.generate(prompts, params, use_tqdm=False))
        assert tight.engine.scheduler.num_preemptions > 0
    finally:
        tight.shutdown()
    assert texts == expected


def test_chunked_prefill_and_prefix_caching_keep_the_constraint(tiny_chat_model, llm):
    shared = "A long shared preamble about people and their data. " * 12
    prompts = [shared + "First:", shared + "Second:"]
    params = [json_params(1), json_params(2)]
    expected = assert_valid(llm.generate(prompts, params, use_tqdm=False))
    chunked = make_llm(tiny_chat_model, max_num_batched_tokens=32, max_num_seqs=2)
    try:
        texts = assert_valid(chunked.generate(prompts, params, use_tqdm=False))
        assert chunked.engine.scheduler.kv.prefix_cache_hits > 0
    finally:
        chunked.shutdown()
    assert texts == expected


@pytest.mark.parametrize("grammar_processes", [0, 2])
def test_drafts_are_verified_with_the_grammars_mask_at_each_position(tiny_chat_model, llm,
                                                                     grammar_processes):
    """n-gram speculation for structured requests (drafts from a prompt holding JSON of the
    schema's shape): each draft's row is masked as plain decoding would mask it there, so
    the outputs stay valid, the greedy one equals the run without speculation, and drafts
    are accepted; the same with the matchers in grammar processes."""
    prompt = ('Like {"name": "ann", "age": 7, "color": "red", "tags": ["a", "b"]}, '
              'describe a person as JSON:')
    greedy = SamplingParams(temperature=0, max_tokens=200,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params = [greedy] + [json_params(seed) for seed in range(4)]
    expected = assert_valid(llm.generate([prompt], greedy, use_tqdm=False))
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    drafting = make_llm(tiny_chat_model, speculative_config=spec,
                        grammar_processes=grammar_processes)
    try:
        texts = assert_valid(drafting.generate([prompt] * 5, params, use_tqdm=False))
        stats = drafting.stats()
        assert drafting.engine.scheduler.kv.usage == 0
    finally:
        drafting.shutdown()
    assert texts[0] == expected[0]
    assert stats.spec_num_accepted_tokens > 0 and stats.spec_num_drafts > 0


def test_grammar_processes_mask_as_the_busy_loop_does(tiny_chat_model, llm):
    """Matchers sharded over two grammar processes: the same seeded outputs as the busy
    loop's, n = 2 included; the processes end with the engine."""
    params = [json_params(seed) for seed in range(6)] + [json_params(7, n=2)]
    expected = assert_valid(llm.generate([PROMPT] * 7, params, use_tqdm=False))
    sharded = make_llm(tiny_chat_model, grammar_processes=2)
    try:
        assert assert_valid(sharded.generate([PROMPT] * 7, params, use_tqdm=False)) == expected
        pids = sharded.engine.structured.grammar_process_pids()
        assert len(pids) == 2
    finally:
        sharded.shutdown()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_tensor_parallel_workers_apply_the_same_mask(tiny_chat_model, llm):
    params = [json_params(seed) for seed in range(4)]
    expected = assert_valid(llm.generate([PROMPT] * 4, params, use_tqdm=False))
    tp = make_llm(tiny_chat_model, tensor_parallel_size=2)
    try:
        assert assert_valid(tp.generate([PROMPT] * 4, params, use_tqdm=False)) == expected
    finally:
        tp.shutdown()


def test_bad_constraints_fail_before_queuing(llm):
    bad = [(dict(json={"type": "objec"}), "structured_outputs.json"),
           (dict(regex="a(b"), "structured_outputs.regex"),
           (dict(grammar="root ::= missing"), "structured_outputs.grammar"),
           (dict(regex="x" * 100_001), "structured_outputs.regex")]
    for constraint, field in bad:
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate([PROMPT], SamplingParams(
                structured_outputs=StructuredOutputsParams(**constraint)), use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["b"])
    # and the engine serves the next request
    assert_valid(llm.generate([PROMPT], json_params(0), use_tqdm=False))


def test_a_compiling_grammar_holds_up_nobody(llm, monkeypatch):
    """While one request's grammar compiles, a plain request runs to the end; then the
    structured one is admitted and finishes valid."""
    from echo.engine.messages import EngineCoreRequest

    core = llm.engine
    pool = core.structured.compiler
    release = threading.Event()
    compile_now = pool._compile
    monkeypatch.setattr(pool, "_compile", lambda p: (release.wait(30), compile_now(p))[1])
    ids = llm.input_processor.tokenize(PROMPT)[1]
    slow = json_params(3)
    slow.structured_outputs = StructuredOutputsParams(json={**SCHEMA, "title": "fresh"})
    core.add_request(EngineCoreRequest("slow", ids, slow))
    core.add_request(EngineCoreRequest("plain", ids, SamplingParams(max_tokens=8,
                                                                    ignore_eos=True)))
    finished = {}
    for _ in range(200):
        outputs = core.step_overlapped()
        for out in outputs.outputs if outputs else []:
            if out.finished:
                finished[out.request_id] = out
        if "plain" in finished:
            break
    assert "plain" in finished and "slow" not in finished
    assert core.scheduler.requests["slow"].num_computed_tokens == 0  # not admitted yet
    release.set()
    tokens = []
    while core.has_work():
        outputs = core.step_overlapped()
        for out in outputs.outputs if outputs else []:
            if out.request_id == "slow":
                tokens += out.new_token_ids
                finished.setdefault("slow", out) if out.finished else None
    assert finished["slow"].finish_reason == "stop"
    text = llm.input_processor.tokenizer.decode(tokens[:-1])  # the last is EOS
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_grammar_that_does_not_compile_in_time_fails_its_request(llm, monkeypatch):
    from echo.engine.messages import EngineCoreRequest
    from echo.structured_output import manager

    core = llm.engine
    pool = core.structured.compiler
    release = threading.Event()
    monkeypatch.setattr(pool, "_compile", lambda p: release.wait(30))
    monkeypatch.setattr(manager, "COMPILE_TIMEOUT_S", 0.2)
    ids = llm.input_processor.tokenize(PROMPT)[1]
    params = json_params(4)
    params.structured_outputs = StructuredOutputsParams(regex="timed out [a-z]+")
    core.add_request(EngineCoreRequest("late", ids, params))
    errors = []
    try:
        for _ in range(400):
            outputs = core.step_overlapped()
            errors += [o for o in (outputs.outputs if outputs else []) if o.finished]
            if errors or not core.has_work():
                break
    finally:
        release.set()
    assert [(o.request_id, o.finish_reason) for o in errors] == [("late", "error")]
    assert "did not compile within" in errors[0].error
    assert not core.has_work()


@pytest.mark.gpu
def test_gpu_masks_with_the_kernel_and_graphs_and_async_equals_sync(tiny_chat_model):
    """On the GPU the mask is the Triton kernel's and decodes replay CUDA graphs."""
    params = [json_params(seed) for seed in range(16)]
    texts = []
    for async_scheduling in (True, False):
        gpu = make_llm(tiny_chat_model, device="cuda", async_scheduling=async_scheduling)
        try:
            texts.append(assert_valid(gpu.generate([PROMPT] * 16, params, use_tqdm=False)))
        finally:
            gpu.shutdown()
    assert texts[0] == texts[1] and len(set(texts[0])) > 8


@pytest.mark.gpu
def test_gpu_drafts_verified_with_masks_per_position(tiny_chat_model):
    """On the GPU, n-gram drafts of structured requests: the kernel masks each draft's row,
    verification batches replay their graphs; outputs stay valid."""
    prompt = ('Like {"name": "ann", "age": 7, "color": "red", "tags": ["a", "b"]}, '
              'describe a person as JSON:')
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3}
    gpu = make_llm(tiny_chat_model, device="cuda", speculative_config=spec)
    try:
        assert_valid(gpu.generate([prompt] * 8, [json_params(seed) for seed in range(8)],
                                  use_tqdm=False))
        assert gpu.stats().spec_num_accepted_tokens > 0
    finally:
        gpu.shutdown()
