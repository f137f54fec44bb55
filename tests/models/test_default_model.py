"""The embedded SmolLM2-135M-Instruct: real weights, real tokenizer, answers like transformers."""

import pytest
import torch

from echo import LLM, SamplingParams
from echo.models.default_model import ensure_default_model

QUESTIONS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def smollm2():
    return ensure_default_model()


@pytest.fixture(scope="module")
def llm(smollm2):
    return LLM("default", device="cpu", dtype="float32", max_model_len=512, max_num_seqs=4)


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_greedy_chat_matches_transformers(smollm2, llm):
    from transformers import AutoModelForCausalLM

    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                       SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    tokenizer = llm.get_tokenizer()
    for question, out in zip(QUESTIONS, outputs):
        ids = chat_ids(tokenizer, question)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            expected = hf.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)[0, len(ids):].tolist()
        assert out.outputs[0].token_ids == expected, question


def test_capital_of_france_is_paris(llm):
    out = llm.chat([{"role": "user", "content": QUESTIONS[0]}],
                   SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ends on its own end-of-turn token
