"""logit_bias, allowed_token_ids and bad_words end to end: echo.LLM on tiny random models against
a step-by-step transformers reference that applies vLLM's rules to the logits, and the OpenAI
server (completions and chat) with its errors."""

import pytest
import torch

from echo import LLM, SamplingParams
from tests.entrypoints.test_api_server import NAME, with_server
from tests.helpers import load_hf

PROMPT = [1, 17, 42, 99, 5]
TOKENS = 10


def reference_greedy(model, prompt: list[int], max_tokens: int, logit_bias=None,
                     allowed=None, bad_words_token_ids=None) -> list[int]:
    """Greedy decoding with the whole sequence re-run every step; the rules applied to each
    step's logits as vLLM applies them."""
    output: list[int] = []
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
        if allowed is not None:
            outside = torch.ones_like(logits, dtype=torch.bool)
            outside[allowed] = False
            logits[outside] = float("-inf")
        for word in bad_words_token_ids or []:
            *prefix, last = word
            if len(prefix) <= len(output) and (
                    not prefix or output[len(output) - len(prefix):] == prefix):
                logits[last] = float("-inf")
        for token, bias in (logit_bias or {}).items():
            logits[token] += bias
        output.append(int(logits.argmax()))
    return output


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, **fields)


def occurs(sequence: list[int], tokens: list[int]) -> bool:
    n = len(sequence)
    return any(tokens[i:i + n] == sequence for i in range(len(tokens) - n + 1))


@pytest.fixture(scope="module")
def llama(tiny_llama):
    llm = LLM(str(tiny_llama), device="cpu", num_gpu_blocks_override=128, max_num_seqs=8)
    yield llm, load_hf(tiny_llama)
    llm.shutdown()


def test_llm_rules_match_the_reference_in_one_batch(llama):
    llm, model = llama
    free = reference_greedy(model, PROMPT, TOKENS)
    target = next(t for t in range(3, 128) if t not in free)
    with torch.no_grad():
        first, second = model(torch.tensor([PROMPT])).logits[0, -1].topk(2).values.tolist()
    # the first token loses its lead by half its margin; target gains a little
    bias = {free[0]: -1.5 * (first - second), target: 0.01}
    allowed = sorted({free[3], target, 7, 100})
    word = [free[2], free[3]]  # banned: free[3] right after free[2]
    cases = [
        ({}, free),
        ({"logit_bias": {target: 100.0}}, [target] * TOKENS),
        ({"logit_bias": bias}, reference_greedy(model, PROMPT, TOKENS, logit_bias=bias)),
        ({"allowed_token_ids": allowed},
         reference_greedy(model, PROMPT, TOKENS, allowed=allowed)),
        ({"bad_words_token_ids": [word, [target]]},
         reference_greedy(model, PROMPT, TOKENS, bad_words_token_ids=[word, [target]])),
    ]
    outputs = llm.generate([PROMPT] * len(cases), [greedy(**fields) for fields, _ in cases],
                           use_tqdm=False)
    for (fields, expected), out in zip(cases, outputs):
        assert list(out.outputs[0].token_ids) == expected, fields
    banned = list(outputs[4].outputs[0].token_ids)
    assert banned[:3] == free[:3] and banned[3] != free[3] and not occurs(word, banned)
    assert reference_greedy(model, PROMPT, TOKENS, logit_bias=bias) != free  # bias mattered


def test_llm_allowed_token_ids_restrict_sampling(llama):
    llm, _ = llama
    a, b = 11, 120
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, n=4, seed=3,
                            allowed_token_ids=[a, b])
    out = llm.generate([PROMPT], params, use_tqdm=False)[0]
    tokens = [t for c in out.outputs for t in c.token_ids]
    assert len(tokens) == 64 and set(tokens) == {a, b}  # both drawn, nothing else


def test_llm_refuses_ids_outside_the_vocabulary_by_name(llama):
    llm, _ = llama
    vocab = llm.config.model.arch.vocab_size
    for fields, name in [({"logit_bias": {vocab: 1.0}}, "logit_bias"),
                         ({"allowed_token_ids": [1, vocab + 2]}, "allowed_token_ids"),
                         ({"bad_words_token_ids": [[vocab]]}, "bad_words_token_ids")]:
        with pytest.raises(ValueError, match=f"^SamplingParams.{name}: "):
            llm.generate([PROMPT], greedy(**fields), use_tqdm=False)
    with pytest.raises(ValueError, match="^SamplingParams.bad_words: "):
        llm.generate([PROMPT], greedy(bad_words=["no tokenizer here"]), use_tqdm=False)


def resolved(tokenizer, word: str) -> list[list[int]]:
    params = SamplingParams(bad_words=[word])
    params.update_from_tokenizer(tokenizer)
    return params.bad_words_token_ids


def pick_bad_word(tokenizer, free: list[int]) -> tuple[int, str, list[list[int]]]:
    """A two-token stretch free[i:i+2] whose text, as a bad word, resolves to those tokens
    (the word's sequences not found earlier)."""
    for i in range(len(free) - 1):
        word = tokenizer.decode(free[i:i + 2])
        sequences = resolved(tokenizer, word)
        if free[i:i + 2] in sequences and all(len(s) == 2 for s in sequences) \
                and not any(occurs(s, free[:i + 1]) for s in sequences):
            return i, word, sequences
    raise AssertionError(f"no usable two-token word in {free}")


def test_server_fields_and_errors_through_the_openai_shape(tiny_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    vocab = tokenizer.vocab_size
    model = load_hf(tiny_chat_model)
    prompt = "Once upon a time there was"
    prompt_ids = tokenizer.encode(prompt)
    free = reference_greedy(model, prompt_ids, 12)
    i, word, sequences = pick_bad_word(tokenizer, free)
    expected_banned = reference_greedy(model, prompt_ids, 12, bad_words_token_ids=sequences)
    target = next(t for t in range(100, 1000) if t not in free)
    base = {"model": NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    chat = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
            "ignore_eos": True, "return_token_ids": True}
    bad = [
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"5": -101}}, "logit_bias"),
        ({"logit_bias": {"five": 1}}, "logit_bias"),
        ({"logit_bias": {str(vocab): 1}}, "logit_bias"),
        ({"logit_bias": {"-3": 1}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [4, vocab]}, "allowed_token_ids"),
        ({"bad_words": ["  "]}, "bad_words"),
        ({"bad_words": ["x"] * 1000}, "bad_words"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 10**6}, "truncate_prompt_tokens"),  # past max_model_len
    ]

    async def test(http, client):
        r = {}
        r["free"] = await http.post("/v1/completions", json=base)
        r["bias"] = await http.post("/v1/completions", json={
            **base, "logit_bias": {str(target): 100}})
        r["bad_words"] = await http.post("/v1/completions", json={**base, "bad_words": [word]})
        r["chat_allowed"] = await http.post("/v1/chat/completions", json={
            **chat, "temperature": 1.0, "seed": 5, "allowed_token_ids": [target, 200]})
        r["chat_bias"] = await http.post("/v1/chat/completions", json={
            **chat, "temperature": 0, "logit_bias": {str(target): 100}})
        r["errors"] = [await http.post("/v1/completions", json={**base, **fields})
                       for fields, _ in bad]
        r["chat_error"] = await http.post("/v1/chat/completions", json={
            **chat, "allowed_token_ids": []})
        r["truncated"] = await http.post("/v1/completions", json={
            **base, "truncate_prompt_tokens": 3, "echo": True})
        r["chat_truncated"] = await http.post("/v1/chat/completions", json={
            **chat, "temperature": 0, "truncate_prompt_tokens": 2})
        r["as_ids"] = await http.post("/v1/completions", json={
            **base, "logprobs": 1, "return_tokens_as_token_ids": True})
        return r

    r = with_server(tiny_chat_model, test)
    ids = lambda response: response.json()["choices"][0]["token_ids"]  # noqa: E731
    assert r["free"].status_code == 200, r["free"].text
    assert ids(r["free"]) == free
    assert ids(r["bias"]) == [target] * 12
    assert r["bias"].json()["choices"][0]["text"] == tokenizer.decode([target] * 12)
    banned = ids(r["bad_words"])
    assert banned == expected_banned
    assert banned[:i + 1] == free[:i + 1] and banned[i + 1] != free[i + 1]
    assert not any(occurs(s, banned) for s in sequences)
    assert r["chat_allowed"].status_code == 200, r["chat_allowed"].text
    assert set(ids(r["chat_allowed"])) <= {target, 200} and len(ids(r["chat_allowed"])) == 8
    assert ids(r["chat_bias"]) == [target] * 8
    # vLLM's truncate_prompt_tokens: the model saw the prompt's last 3 tokens alone, and they
    # are what the usage counts and the echo repeats
    truncated = r["truncated"].json()
    assert ids(r["truncated"]) == reference_greedy(model, prompt_ids[-3:], 12)
    assert truncated["usage"]["prompt_tokens"] == 3
    assert truncated["choices"][0]["text"].startswith(tokenizer.decode(prompt_ids[-3:]))
    assert r["chat_truncated"].json()["usage"]["prompt_tokens"] == 2
    # vLLM's return_tokens_as_token_ids: logprobs name the tokens by id
    assert r["as_ids"].json()["choices"][0]["logprobs"]["tokens"] == [
        f"token_id:{t}" for t in free]
    for response, (fields, field) in zip(r["errors"] + [r["chat_error"]],
                                         bad + [({}, "allowed_token_ids")]):
        assert response.status_code == 400, (fields, response.text)
        error = response.json()["error"]
        assert error["param"] == field and field in error["message"], (fields, error)
