"""logit_bias, allowed_token_ids and bad words through the worker's sampling path (InputBatch ->
build_sampling_tensors -> Sampler), against a plain per-row PyTorch reference of vLLM's rules."""

import math

import numpy as np
import pytest
import torch

from echo.sampling_params import SamplingParams
from echo.worker.input_batch import InputBatch, TokenRules
from echo.worker.sampler import Sampler
from echo.worker.sampling_inputs import build_sampling_tensors

V = 64
EOS = (2,)
CPU = torch.device("cpu")
NEG_INF = float("-inf")


def reference_logits(logits: torch.Tensor, params: list[SamplingParams],
                     outputs: list[list[int]], eos=EOS) -> torch.Tensor:
    """vLLM's processing, one row at a time: allowed ids, bad words, min_tokens, logit bias."""
    out = logits.clone().float()
    for i, (p, output) in enumerate(zip(params, outputs)):
        row = out[i]
        if p.allowed_token_ids is not None:
            outside = torch.ones(len(row), dtype=torch.bool)
            outside[p.allowed_token_ids] = False
            row[outside] = NEG_INF
        for word in p.bad_words_token_ids or []:
            *prefix, last = word
            if len(word) > len(output) + 1:
                continue
            tail = output[len(output) - len(prefix):] if prefix else []
            if tail == prefix:
                row[last] = NEG_INF
        if len(output) < p.min_tokens:
            for t in (*eos, *p.stop_token_ids):
                row[t] = NEG_INF
        for token, bias in (p.logit_bias or {}).items():
            row[token] += bias
    return out


def make_batch(requests: list[tuple[SamplingParams, list[int]]], max_model_len: int = 32):
    """An InputBatch holding each (params, output so far) after a 3-token prompt."""
    batch = InputBatch(len(requests), max_model_len, 4, 16)
    for i, (params, output) in enumerate(requests):
        batch.add(f"r{i}", [1, 5, 9], list(output), params, [0], 3 + len(output), V)
    rows = np.array([batch.row_of[f"r{i}"] for i in range(len(requests))], dtype=np.int64)
    return batch, rows


def sample(logits, requests, **kwargs):
    batch, rows = make_batch(requests, **kwargs)
    t = build_sampling_tensors(batch, rows, V, EOS, CPU)
    return Sampler()(logits[:len(requests)], t), t


def greedy(**fields) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=None, **fields)


def test_bias_allowed_and_bad_words_match_the_reference_greedy():
    torch.manual_seed(0)
    logits = torch.randn(12, V) * 3
    top = logits.argmax(-1).tolist()
    low = logits.argmin(-1).tolist()
    x, y = 40, 41
    requests = [
        (greedy(), [7]),  # no rules: unchanged
        (greedy(logit_bias={low[1]: 100.0}), [7]),  # the least likely token wins
        (greedy(logit_bias={top[2]: -100.0, 3: 0.5}), []),  # the most likely one loses
        (greedy(allowed_token_ids=[10, 20, 30]), [7]),
        (greedy(allowed_token_ids=[10, 20], logit_bias={top[4]: 100.0}), []),  # stays inside
        (greedy(bad_words_token_ids=[[top[5]]]), []),  # one-token word: always banned
        (greedy(bad_words_token_ids=[[x, y, top[6]]]), [7, x, y]),  # its prefix just made
        (greedy(bad_words_token_ids=[[x, y, top[7]]]), [x, y, 7]),  # prefix, then another
        (greedy(bad_words_token_ids=[[x, y, top[8]]]), [y]),  # too short for the prefix
        (greedy(bad_words_token_ids=[[x, top[9]], [top[9]]]), [x]),  # both apply
        (greedy(min_tokens=3, allowed_token_ids=[EOS[0], 11, 12], stop_token_ids=[11]), [7]),
        (greedy(logit_bias={5: 2.5, 6: -1.0}, bad_words_token_ids=[[y, 5]]), [y]),
    ]
    out, _ = sample(logits, requests)
    expected = reference_logits(logits, [p for p, _ in requests], [o for _, o in requests])
    assert out.token_ids.tolist() == expected.argmax(-1).tolist()
    tokens = out.token_ids.tolist()
    assert tokens[0] == top[0]
    assert tokens[1] == low[1]
    assert tokens[2] != top[2]
    assert tokens[3] in (10, 20, 30) and tokens[4] in (10, 20)
    assert tokens[5] != top[5] and tokens[6] != top[6] and tokens[9] != top[9]
    assert tokens[7] == top[7] and tokens[8] == top[8]  # no prefix yet: allowed
    assert tokens[10] == 12  # EOS and the stop token wait for min_tokens


@pytest.mark.parametrize("kind", ["bias", "allowed", "bad_words"])
def test_rows_without_rules_sample_as_without_them(kind):
    torch.manual_seed(1)
    logits = torch.randn(4, V)
    rules = {"bias": {"logit_bias": {3: 50.0}}, "allowed": {"allowed_token_ids": [1, 2]},
             "bad_words": {"bad_words_token_ids": [[8, 9], [4]]}}[kind]
    plain = [(SamplingParams(seed=s, max_tokens=None), [8]) for s in range(4)]
    mixed = [plain[0], (SamplingParams(seed=1, max_tokens=None, **rules), [8]), *plain[2:]]
    a, _ = sample(logits, plain)
    b, _ = sample(logits, mixed)
    assert a.token_ids[[0, 2, 3]].tolist() == b.token_ids[[0, 2, 3]].tolist()


def test_sampled_frequencies_follow_the_processed_distribution():
    draws = 20_000
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, 0.2])
    vocab = len(logits)
    params = SamplingParams(max_tokens=None, logit_bias={3: 2.0, 0: -1.0},
                            allowed_token_ids=[0, 1, 3, 4], bad_words_token_ids=[[5, 4]])
    batch = InputBatch(draws, 8, 1, 16)
    for i in range(draws):
        batch.add(f"r{i}", [1], [5], params, [0], 2, vocab)  # output [5]: token 4 banned
    rows = np.arange(draws)[::-1].copy()
    t = build_sampling_tensors(batch, rows, vocab, EOS, CPU)
    tokens = Sampler()(logits.expand(draws, -1), t).token_ids
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    expected = reference_logits(logits[None], [params], [[5]])[0].softmax(-1)
    assert freq[[2, 4, 5]].sum().item() == 0
    assert (freq - expected).abs().max().item() < 0.015, (freq, expected)


def test_logprobs_stay_those_of_the_raw_logits():
    torch.manual_seed(2)
    logits = torch.randn(2, V)
    requests = [(greedy(logprobs=3, logit_bias={5: 100.0}), []),
                (greedy(logprobs=3, allowed_token_ids=[6]), [])]
    out, _ = sample(logits, requests)
    raw = logits.log_softmax(-1)
    assert out.token_ids.tolist() == [5, 6]
    torch.testing.assert_close(out.logprob, raw[[0, 1], [5, 6]])
    torch.testing.assert_close(out.top_logprobs, raw.topk(3).values)
    assert torch.equal(out.top_ids, raw.topk(3).indices)


def test_no_rules_no_masks_and_only_needed_tensors():
    logits = torch.randn(3, V)
    _, t = sample(logits, [(greedy(), [1]), (greedy(), []), (greedy(), [4, 4])])
    assert t.banned is None and t.bias_index is None and t.bias_values is None
    _, t = sample(logits, [(greedy(), [1]), (greedy(logit_bias={3: 1.0}), [])])
    assert t.banned is None
    assert t.bias_index.tolist() == [[1], [3]] and t.bias_values.tolist() == [1.0]
    _, t = sample(logits, [(greedy(bad_words_token_ids=[[7, 8]]), [1])])
    assert t.banned is None  # its prefix is not there yet: nothing to ban
    _, t = sample(logits, [(greedy(), []), (greedy(bad_words_token_ids=[[7, 8]]), [7])])
    assert t.banned.nonzero().tolist() == [[1, 8]]


def test_multi_token_bad_words_make_the_runner_land_outputs_first():
    batch = InputBatch(4, 16, 2, 16)
    batch.add("single", [1], [], greedy(bad_words_token_ids=[[3]]), [0], 1, V)
    batch.add("bias", [1], [], greedy(logit_bias={3: 1.0}), [0], 1, V)
    assert batch.num_reading_outputs == 0  # their rules do not read the output
    batch.add("multi", [1], [], greedy(bad_words_token_ids=[[3, 4]]), [0], 1, V)
    batch.add("penalty", [1], [], greedy(presence_penalty=0.5), [0], 1, V)
    assert batch.num_reading_outputs == 2
    batch.remove("multi")
    assert batch.num_reading_outputs == 1 and not batch.has_token_rules[2]
    batch.remove("penalty")
    batch.remove("single")
    assert batch.num_reading_outputs == 0


def test_token_rules_drop_ids_outside_the_vocabulary():
    # the frontend refuses them; a request reaching the worker some other way cannot crash it
    rules = TokenRules.of(greedy(logit_bias={3: 1.0, V + 5: 2.0}, allowed_token_ids=[4, V],
                                 bad_words_token_ids=[[V + 1], [5], [V, 6]]), V)
    assert rules.bias_ids.tolist() == [3] and rules.bias_values.tolist() == [1.0]
    assert rules.allowed_ids.tolist() == [4]
    assert rules.always_banned.tolist() == [5] and rules.sequences == []
    assert TokenRules.of(greedy(), V) is None


@pytest.mark.parametrize("fields,field", [
    ({"logit_bias": {3: 100.5}}, "logit_bias"),
    ({"logit_bias": {3: -101}}, "logit_bias"),
    ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"bad_words": ["ok", "  "]}, "bad_words"),
    ({"bad_words": "word"}, "bad_words"),
    ({"bad_words_token_ids": [[]]}, "bad_words_token_ids"),
])
def test_invalid_fields_are_named(fields, field):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: "):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields,field", [
    ({"logit_bias": {V: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [0, V + 3]}, "allowed_token_ids"),
    ({"bad_words_token_ids": [[1, V]]}, "bad_words_token_ids"),
])
def test_ids_outside_the_vocabulary_are_named(fields, field):
    params = SamplingParams(**fields)
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}: token ids must be in "
                                         rf"\[0, {V}\)"):
        params.check_token_ids(V)
    SamplingParams(logit_bias={V - 1: -100}, allowed_token_ids=[0]).check_token_ids(V)


def test_bad_words_resolve_as_vllm_with_and_without_a_leading_space(tiny_chat_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_chat_model))
    words = ["hello", " big world", "Zebra", "!"]
    params = SamplingParams(bad_words=words)
    params.update_from_tokenizer(tokenizer)
    expected = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        expected.append(plain)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            expected.append(spaced)
    assert params.bad_words_token_ids == expected
    assert any(len(ids) > 1 for ids in expected) and any(len(ids) == 1 for ids in expected)
    # the ids reach the worker: each one-token word is banned from the first token on
    singles = {ids[0] for ids in expected if len(ids) == 1}
    rules = TokenRules.of(params, tokenizer.vocab_size)
    assert set(rules.always_banned.tolist()) == singles
    with pytest.raises(ValueError, match="^SamplingParams.bad_words: "):
        SamplingParams(bad_words=["x"]).update_from_tokenizer(None)


def reference_penalties(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                        output: list[int]) -> torch.Tensor:
    """vLLM's penalties on one row: repetition over prompt and output, then frequency and
    presence over the output."""
    row = logits.clone()
    for token in set(prompt) | set(output):
        row[token] = row[token] / p.repetition_penalty if row[token] > 0 else (
            row[token] * p.repetition_penalty)
    for token in set(output):
        row[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return row


def test_each_verification_row_sees_the_drafts_before_it_as_outputs():
    """A request verifying drafts (speculative decoding) is scored at one row per draft and
    one after: build_sampling_tensors with `ahead` gives row j the distribution plain decoding
    would have after accepting the first j drafts: penalties count them, a bad word they
    complete is banned, min_tokens counts them, the noise index moves on."""
    from echo.worker.sampler import target_distribution

    x, y = 20, 21
    params = greedy(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.5,
                    min_tokens=3, bad_words_token_ids=[[x, y, 30]])
    output, drafts = [7], [x, y, 7]
    batch, rows = make_batch([(params, output)])
    row = int(rows[0])
    start = batch.num_tokens[row]
    batch.token_ids[row, start:start + len(drafts)] = drafts  # as InputBatch.update puts them
    ahead = np.arange(len(drafts) + 1)
    t = build_sampling_tensors(batch, np.repeat(rows, len(ahead)), V, EOS, CPU, ahead)
    logits = torch.randn(len(ahead), V, generator=torch.Generator().manual_seed(0)) * 3
    got, _ = target_distribution(logits, t)
    for j in ahead:
        seen = output + drafts[:j]
        expected = reference_logits(logits[j:j + 1], [params], [seen])[0]
        expected = reference_penalties(expected, params, [1, 5, 9], seen)
        torch.testing.assert_close(got[j], expected, msg=f"row {j}")
    assert t.steps.tolist() == [1, 2, 3, 4]
    assert got[2, 30] == NEG_INF and got[1, 30] > NEG_INF  # x, y drafted: the word's end
    assert got[1, EOS[0]] == NEG_INF and got[2, EOS[0]] > NEG_INF  # 3 outputs from row 2 on
