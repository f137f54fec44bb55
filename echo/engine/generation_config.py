"""Request defaults from a model's generation_config.json, as vLLM's `--generation-config`:
`auto` reads the model folder's file, a folder path reads that folder's, `vllm` uses none.

A request that leaves a sampling field out gets the file's value; one that sets it keeps its
own. EOS ids the file lists beyond the model's own become extra stop tokens, as vLLM adds them.
"""

import json
from dataclasses import dataclass, field
from pathlib import Path

from echo.sampling_params import SamplingParams

# generation_config.json's names -> SamplingParams' (vLLM reads the same ones)
_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
           "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


@dataclass(frozen=True)
class GenerationDefaults:
    values: dict = field(default_factory=dict)  # SamplingParams field -> default
    extra_eos_token_ids: tuple[int, ...] = ()

    def get(self, name: str, fallback):
        return self.values.get(name, fallback)


def load_generation_defaults(source: str, model_path: Path | None,
                             model_eos_token_ids: tuple[int, ...] = ()) -> GenerationDefaults:
    """source: 'auto', 'vllm' or a folder holding generation_config.json."""
    if source == "vllm":
        return GenerationDefaults()
    if source == "auto":
        if model_path is None:  # a preset: no folder, no file
            return GenerationDefaults()
        folder = model_path
    else:
        folder = Path(source).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"generation_config: {source!r} is not 'auto', 'vllm' or "
                                    "a folder")
    path = folder / "generation_config.json"
    if not path.is_file():
        if source != "auto":
            raise FileNotFoundError(f"generation_config: {path} does not exist")
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"generation_config: {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path} does not hold a JSON object")
    values = {ours: raw[theirs] for theirs, ours in _FIELDS.items() if raw.get(theirs) is not None}
    try:  # a bad value fails here, at start-up, not in every request that leaves it out
        SamplingParams(**values)
    except (TypeError, ValueError) as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    eos = raw.get("eos_token_id")
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    extra = tuple(t for t in eos if isinstance(t, int) and t not in model_eos_token_ids)
    return GenerationDefaults(values, extra)
