"""SamplingParams.prompt_logprobs (vLLM's RequestOutput.prompt_logprobs) against transformers'
log_softmax of its own logits, whole and over chunked prefill, and the completions endpoint's
echo / prompt_logprobs as lm-evaluation-harness's local-completions loglikelihood reads them."""

import json

import pytest
import torch

from echo import LLM, SamplingParams
from tests.entrypoints.test_api_server import NAME, with_server
from tests.helpers import load_hf

PROMPTS = [list(range(3, 40)), [1, 5, 9, 33, 7], [1, 2], [7], [1] + list(range(90, 127)) * 2]


def make_llm(folder, **kwargs) -> LLM:
    kwargs = {"device": "cpu", "dtype": "float32", "num_gpu_blocks_override": 128,
              "max_num_seqs": 8, **kwargs}
    return LLM(str(folder), **kwargs)


def reference(folder, prompts):
    hf = load_hf(folder)
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0].float().log_softmax(-1) for p in prompts]


def check_against(outputs, prompts, refs, top_n: int):
    for prompt, out, ref in zip(prompts, outputs, refs):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for j in range(1, len(prompt)):
            row, token, entry = ref[j - 1], prompt[j], entries[j]
            assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
            assert entry[token].rank == int((row >= row[token]).sum())
            top = row.topk(top_n) if top_n else None
            ranked = {t: lp for t, lp in entry.items() if t != token}
            if top_n:  # the top-N, in rank order, beside the prompt token
                expected = dict(zip(top.indices.tolist(), top.values.tolist()))
                assert set(ranked) == set(expected) - {token}
                for t, lp in entry.items():
                    if t in expected:
                        assert lp.logprob == pytest.approx(expected[t], abs=1e-4)
                        if t != token:
                            assert lp.rank == top.indices.tolist().index(t) + 1
            else:
                assert not ranked


@pytest.mark.parametrize("budget", [None, 16, 5])  # whole prompts, chunked, tiny chunks
def test_prompt_logprobs_match_transformers(tiny_llama, budget):
    kwargs = {"max_num_batched_tokens": budget, "max_num_seqs": min(budget, 8)} if budget else {}
    llm = make_llm(tiny_llama, **kwargs)
    refs = reference(tiny_llama, PROMPTS)
    params = [SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=n)
              for n in (5, 0, 20, 5, 3)]
    plain = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    # a request without prompt logprobs shares the batch: its output is unchanged
    outputs = llm.generate(PROMPTS + [PROMPTS[0]], params + [plain], use_tqdm=False)
    assert outputs[-1].prompt_logprobs is None
    assert outputs[-1].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    for out, p, ref, sp in zip(outputs, PROMPTS, refs, params):
        check_against([out], [p], [ref], sp.prompt_logprobs)


def test_prompt_logprobs_skip_the_prefix_cache_and_survive_n_and_preemption(tiny_llama):
    prompt = PROMPTS[4]
    ref = reference(tiny_llama, [prompt])
    llm = make_llm(tiny_llama)
    warm = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([prompt], warm, use_tqdm=False)  # its blocks are now cached
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2)
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    check_against([again], [prompt], ref, 2)
    # each of n samples computes them; the request reports them once
    many = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=4,
                                                 ignore_eos=True, prompt_logprobs=2),
                        use_tqdm=False)[0]
    check_against([many], [prompt], ref, 2)
    # a cache too small for all at once: requests are preempted and recomputed
    small = make_llm(tiny_llama, num_gpu_blocks_override=12, max_num_batched_tokens=32)
    prompts = [prompt[:60], prompt[10:70], prompt[5:65], prompt[20:]]
    outs = small.generate(prompts, SamplingParams(temperature=0, max_tokens=80, ignore_eos=True,
                                                  prompt_logprobs=1), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    check_against(outs, prompts, reference(tiny_llama, prompts), 1)


def test_prompt_logprobs_are_bounded():
    for value in (-1, 21):
        with pytest.raises(ValueError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=value)


def test_completions_echo_gives_lm_eval_its_loglikelihoods(tiny_chat_model):
    prompt = "The capital of France is Paris"
    llm = LLM(str(tiny_chat_model), device="cpu", num_gpu_blocks_override=256,
              max_num_seqs=8, max_model_len=256)
    offline = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=1,
                                                  prompt_logprobs=1), use_tqdm=False)[0]
    ids = offline.prompt_token_ids
    other = llm.get_tokenizer().encode("One two three four")
    other_lp = llm.generate([other], SamplingParams(temperature=0, max_tokens=1,
                                                    prompt_logprobs=1), use_tqdm=False)[0]

    async def test(http, client):
        bodies = {
            # lm-eval's local-completions loglikelihood request (tokenized_requests: id lists)
            "lm_eval": {"model": NAME, "prompt": [ids, other], "temperature": 0,
                        "max_tokens": 1, "logprobs": 1, "seed": 1234, "echo": True},
            "text": {"prompt": prompt, "temperature": 0, "max_tokens": 1, "logprobs": 1,
                     "echo": True},
            "only_prompt": {"prompt": prompt, "max_tokens": 0, "logprobs": 1, "echo": True},
            "no_logprobs": {"prompt": prompt, "max_tokens": 2, "temperature": 0,
                            "echo": True, "ignore_eos": True},
            "field": {"prompt": prompt, "max_tokens": 1, "temperature": 0,
                      "prompt_logprobs": 2},
            "stream": {"prompt": prompt, "max_tokens": 2, "temperature": 0, "logprobs": 1,
                       "echo": True, "stream": True, "ignore_eos": True},
            "zero_without_echo": {"prompt": prompt, "max_tokens": 0},
            "streamed_field": {"prompt": prompt, "prompt_logprobs": 1, "stream": True},
        }
        return {k: await http.post("/v1/completions", json=b) for k, b in bodies.items()}

    r = with_server(tiny_chat_model, test)
    generated = offline.outputs[0]

    def expected_token_logprobs(out):
        return [None] + [e[t].logprob for t, e in zip(out.prompt_token_ids[1:],
                                                      out.prompt_logprobs[1:])]

    assert r["lm_eval"].status_code == 200, r["lm_eval"].text
    choices = sorted(r["lm_eval"].json()["choices"], key=lambda c: c["index"])
    for choice, out in zip(choices, [offline, other_lp]):
        lp = choice["logprobs"]
        n = len(out.prompt_token_ids)
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"]) == n + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][:n] == pytest.approx(expected_token_logprobs(out), abs=1e-5)
        assert choice["text"].startswith(llm.get_tokenizer().decode(out.prompt_token_ids))
        # what lm-eval's parse_logprobs does with ctxlen 1
        continuation = lp["token_logprobs"][1:-1]
        assert sum(continuation) == pytest.approx(sum(expected_token_logprobs(out)[1:]),
                                                  abs=1e-4)
        for token_lp, top in zip(continuation, lp["top_logprobs"][1:-1]):
            assert 1 <= len(top) <= 2 and max(top.values()) >= token_lp
    tokens = choices[0]["logprobs"]["tokens"]
    assert "".join(tokens[:len(ids)]) == prompt

    text = r["text"].json()["choices"][0]
    assert text["text"] == prompt + generated.text
    assert text["logprobs"]["token_logprobs"][0] is None
    assert text["logprobs"]["token_logprobs"][1:len(ids)] == pytest.approx(
        expected_token_logprobs(offline)[1:], abs=1e-5)
    assert text["logprobs"]["token_logprobs"][-1] == pytest.approx(
        generated.logprobs[0][generated.token_ids[0]].logprob, abs=1e-5)

    only = r["only_prompt"].json()
    assert only["choices"][0]["text"] == prompt
    assert len(only["choices"][0]["logprobs"]["token_logprobs"]) == len(ids)
    assert only["usage"]["completion_tokens"] == 0
    assert only["usage"]["prompt_tokens"] == len(ids)

    plain = r["no_logprobs"].json()["choices"][0]
    assert plain["text"].startswith(prompt) and plain["logprobs"] is None

    field = r["field"].json()["choices"][0]
    assert field["text"] == generated.text  # no echo: the prompt only in prompt_logprobs
    assert field["prompt_logprobs"][0] is None and len(field["prompt_logprobs"]) == len(ids)
    for token, entry in zip(ids[1:], field["prompt_logprobs"][1:]):
        assert 1 <= len(entry) <= 3 and entry[str(token)]["rank"] >= 1  # itself + top-2
    assert [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], field["prompt_logprobs"][1:])
            ] == pytest.approx(expected_token_logprobs(offline)[1:], abs=1e-5)

    events = [line[len("data: "):] for line in r["stream"].text.splitlines()
              if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events if e != "[DONE]"]
    assert chunks[0]["text"].startswith(prompt)
    streamed = [v for c in chunks if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert len(streamed) == len(ids) + 2 and streamed[0] is None
    assert streamed[1:len(ids)] == pytest.approx(expected_token_logprobs(offline)[1:], abs=1e-5)

    for key, field_name in (("zero_without_echo", "max_tokens"),
                            ("streamed_field", "prompt_logprobs")):
        assert r[key].status_code == 400, r[key].text
        assert r[key].json()["error"]["param"] == field_name


@pytest.mark.gpu
@pytest.mark.parametrize("budget", [None, 16])
def test_prompt_logprobs_on_gpu_match_transformers(tiny_llama, budget):
    """The triton backend with CUDA graphs (tf32 products: tolerances as the GPU logits')."""
    kwargs = {"max_num_batched_tokens": budget} if budget else {}
    llm = make_llm(tiny_llama, device="cuda", num_gpu_blocks_override=256, max_model_len=512,
                   **kwargs)
    refs = reference(tiny_llama, PROMPTS)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=5)
    plain = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outputs = llm.generate(PROMPTS + PROMPTS, [params] * len(PROMPTS) + [plain] * len(PROMPTS),
                           use_tqdm=False)
    for prompt, out, ref in zip(PROMPTS, outputs, refs):
        entries = out.prompt_logprobs
        assert len(entries) == len(prompt) and entries[0] is None
        for j in range(1, len(prompt)):
            row, entry = ref[j - 1].cuda(), entries[j]
            assert entry[prompt[j]].logprob == pytest.approx(row[prompt[j]].item(), abs=2e-2)
            ranked = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= 5)
            assert [r for r, _, _ in ranked] == [1, 2, 3, 4, 5]
            for _, t, lp in ranked:
                assert lp == pytest.approx(row[t].item(), abs=2e-2)
            assert ranked[-1][2] >= row.topk(5).values[-1].item() - 2e-2
