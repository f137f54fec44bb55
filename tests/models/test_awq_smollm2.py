"""SmolLM2 (real weights) as an AWQ checkpoint packed by the tests' own packer: echo's logits
equal transformers' with the same dequantized weights, and the 4-bit model's perplexity on a
fixed text stays within 5% of the float model's."""

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from echo import LLM, SamplingParams
from tests.helpers import hf_greedy_tokens
from tests.kernels.test_awq import pack_awq, quantize_rtn
from tests.models.test_awq_models import AWQ_CONFIG, GROUP, QUANTIZED

TEXT = ("The sun rose over the quiet village, and the baker opened his shop. Children ran to "
        "school while their parents walked to the market to buy bread, milk and fresh fruit. "
        "In the afternoon it began to rain, so everyone stayed inside and read books by the "
        "fire until the evening came.")


@pytest.fixture(scope="module")
def smollm2_awq(tmp_path_factory):
    """(the AWQ folder, transformers' SmolLM2 with the dequantized weights, the float one)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from echo.models.default_model import ensure_default_model

    source = ensure_default_model()
    folder = tmp_path_factory.mktemp("smollm2_awq")
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    dequantized = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    tensors = {}
    with torch.no_grad():
        for name, param in dequantized.named_parameters():
            if not any(f".{p}." in name for p in QUANTIZED):
                if name != "lm_head.weight":  # tied to the embedding
                    tensors[name] = param.detach().clone().contiguous()
                continue
            w = param.detach().T.contiguous()
            q, z, s = quantize_rtn(w, GROUP)
            stem = name.removesuffix(".weight")
            tensors[f"{stem}.qweight"], tensors[f"{stem}.qzeros"] = pack_awq(q), pack_awq(z)
            tensors[f"{stem}.scales"] = s
            groups = torch.arange(w.shape[0]) // GROUP
            param.copy_(((q - z[groups]).float() * s.float()[groups]).T)
    save_file(tensors, folder / "model.safetensors")
    cfg = json.loads((source / "config.json").read_text())
    cfg["quantization_config"] = AWQ_CONFIG
    (folder / "config.json").write_text(json.dumps(cfg))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).exists():
            shutil.copy(source / name, folder / name)
    return folder, dequantized, base


def perplexity(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


def test_logits_and_greedy_tokens_equal_transformers(smollm2_awq):
    folder, dequantized, _ = smollm2_awq
    llm = LLM(str(folder), device="cpu", max_model_len=512, max_num_seqs=2)
    try:
        ids = llm.input_processor.tokenize(TEXT)[1]
        out = llm.generate([ids[:24]], SamplingParams(temperature=0, max_tokens=16,
                                                      ignore_eos=True, prompt_logprobs=0),
                           use_tqdm=False)[0]
    finally:
        llm.shutdown()
    expected = hf_greedy_tokens(dequantized, ids[:24], 16)
    with torch.no_grad():
        reference = torch.log_softmax(dequantized(torch.tensor([ids[:24]])).logits[0], -1)
    assert out.outputs[0].token_ids == expected
    for position, entry in enumerate(out.prompt_logprobs[1:], 1):  # prompt token logprobs
        token = ids[position]
        assert entry[token].logprob == pytest.approx(reference[position - 1, token].item(),
                                                     abs=1e-3)


def test_four_bit_perplexity_within_five_percent_of_float(smollm2_awq):
    folder, dequantized, base = smollm2_awq
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode(TEXT)
    float_ppl, awq_ppl = perplexity(base, ids), perplexity(dequantized, ids)
    assert awq_ppl < 1.05 * float_ppl, (float_ppl, awq_ppl)
    # and echo's own prompt logprobs give the 4-bit model's perplexity
    llm = LLM(str(folder), device="cpu", max_model_len=512, max_num_seqs=2)
    try:
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0),
                           use_tqdm=False)[0]
    finally:
        llm.shutdown()
    nll = -sum(entry[t].logprob for t, entry in zip(ids[1:], out.prompt_logprobs[1:])) / (
        len(ids) - 1)
    assert math.exp(nll) == pytest.approx(awq_ppl, rel=1e-3)
