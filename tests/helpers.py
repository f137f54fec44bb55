"""Test helpers: tiny random models saved in Hugging Face's own format by transformers."""

from pathlib import Path

import torch

VOCAB = 128


def write_tiny_model(folder: Path, family: str, tie: bool, rope_scaling: bool = False,
                     sharded: bool = False, seed: int = 0, num_kv_heads: int = 2,
                     vocab_size: int = VOCAB, num_layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                  num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=num_kv_heads,
                  max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0, rms_norm_eps=1e-6)
    if family == "qwen3":
        config = Qwen3Config(head_dim=32, rope_theta=10000.0, **common)
        model_cls = Qwen3ForCausalLM
    else:
        rope = {"rope_type": "default", "rope_theta": 10000.0}
        if rope_scaling:
            rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64}
        config = LlamaConfig(rope_parameters=rope, **common)
        model_cls = LlamaForCausalLM
    torch.manual_seed(seed)
    model = randomize_norms(model_cls(config).to(torch.float32))
    model.save_pretrained(folder, max_shard_size="100KB" if sharded else "5GB")
    return folder


def randomize_norms(model):
    """Random norm weights too (transformers starts them at 1), so a wrong norm weight shows
    up; returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def hf_greedy_tokens(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' raw greedy continuation (EOS does not stop it)."""
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def echo_greedy_tokens(folder: Path, prompts: list[list[int]], max_new_tokens: int,
                       **engine_args) -> list[list[int]]:
    """echo.LLM's greedy tokens for each prompt (EOS ignored), the engine shut down after."""
    from echo import LLM, SamplingParams

    llm = LLM(str(folder), **{"device": "cpu", "num_gpu_blocks_override": 64,
                              "max_num_seqs": 4, **engine_args})
    try:
        greedy = SamplingParams(temperature=0, max_tokens=max_new_tokens, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    finally:
        llm.shutdown()


def load_hf(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def write_tiny_chat_model(folder: Path, tokenizer_source: Path) -> Path:
    """A tiny random Llama that speaks SmolLM2's vocabulary, with its tokenizer and chat
    template: real text in and out, at test speed (the output is gibberish)."""
    import json
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer_config = json.loads((tokenizer_source / "config.json").read_text())
    config = LlamaConfig(vocab_size=tokenizer_config["vocab_size"], hidden_size=64,
                         intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                 "special_tokens_map.json"):
        if (tokenizer_source / name).exists():
            shutil.copy(tokenizer_source / name, folder / name)
    return folder


def completions(outputs) -> list[tuple]:
    """(token ids, text, finish reason) of every completion of LLM.generate's outputs."""
    return [(c.token_ids, c.text, c.finish_reason) for o in outputs for c in o.outputs]
