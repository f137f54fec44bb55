"""transformers' own decode step at batch 1, a reference point for echo's bench_latency.

    python tools/bench_hf_reference.py [--model qwen3-30b-a3b] [--input-len 256] [--tokens 32]

Builds the preset's model with transformers (random bf16 weights, on the GPU), prefills one
random prompt of --input-len tokens, then times --tokens greedy decode steps through its
KV cache (median ms per step, after two warm-up steps). Prints one JSON line.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo.models.arch import PRESETS_DIR, read_config_json  # noqa: E402

# the presets name the architecture; transformers' config classes want its model_type
MODEL_TYPES = {"Qwen3MoeForCausalLM": "qwen3_moe", "Qwen3ForCausalLM": "qwen3",
               "LlamaForCausalLM": "llama"}


def build(preset: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = read_config_json(PRESETS_DIR / f"{preset}.json")
    model_type = MODEL_TYPES[cfg["architectures"][0]]
    config = AutoConfig.for_model(model_type, **{k: v for k, v in cfg.items()
                                                 if k != "torch_dtype"})
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return model.eval()


@torch.inference_mode()
def time_decode(model, input_len: int, tokens: int) -> list[float]:
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, input_len), device="cuda")
    out = model(prompt, use_cache=True)
    cache, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
    times = []
    for _ in range(tokens + 2):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model(token, past_key_values=cache, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return times[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-30b-a3b")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    assert torch.cuda.is_available(), "bench_hf_reference needs a CUDA GPU"
    torch.manual_seed(0)
    model = build(args.model)
    params = sum(p.numel() for p in model.parameters())
    times = time_decode(model, args.input_len, args.tokens)
    import transformers

    print(json.dumps({"model": args.model, "transformers": transformers.__version__,
                      "params_billions": round(params / 1e9, 2), "input_len": args.input_len,
                      "ms_per_step_median": round(statistics.median(times), 3),
                      "ms_per_step_min": round(min(times), 3)}))


if __name__ == "__main__":
    main()
