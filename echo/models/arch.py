"""The shape of a model, read from a Hugging Face config.json (or a preset) into a frozen record.

Both forms of rotary settings are accepted: the old top-level `rope_theta` + `rope_scaling`, and
the newer `rope_parameters` dict that carries the theta itself.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from echo.layers.quantization import AwqConfig, parse_quantization
from echo.layers.rope_scaling import RopeScaling

# architectures[0] in config.json -> echo's model family
SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "LlamaForCausalLM": "llama",
                           "Qwen3MoeForCausalLM": "qwen3_moe"}
PRESETS_DIR = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class ModelArch:
    family: str  # "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    dtype: str  # the checkpoint's torch dtype name, e.g. "bfloat16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    attention_bias: bool = False
    mlp_bias: bool = False
    # mixture of experts (Qwen3-MoE); num_experts 0: a dense model
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every this-many-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # dense layers among the sparse ones
    quantization: AwqConfig | None = None  # config.json's quantization_config (AWQ)

    def is_sparse_layer(self, layer_idx: int) -> bool:
        """Whether layer layer_idx has experts (transformers' Qwen3-MoE rule)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def read_config_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"model folder {path.parent} has no config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _as_tuple(ids) -> tuple[int, ...]:
    if ids is None:
        return ()
    return tuple(ids) if isinstance(ids, list) else (int(ids),)


def _positive_int(value, name: str, source: str) -> int:
    """A config.json size: a whole number >= 1 (written as a number or its text)."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or (isinstance(value, float) and value != number):
        raise ValueError(f"{source}: {name} must be a whole number >= 1, got {value!r}")
    return number


def _rope(cfg: dict) -> tuple[float, RopeScaling | None]:
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    for name, value in (("rope_parameters", params), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ValueError(f"config.json: {name} must be an object, got {value!r}")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    merged = {**scaling, **params}
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type != "llama3":
        raise ValueError(f"config.json: rope type {rope_type!r} is not supported (default, llama3)")
    return float(theta), RopeScaling(
        rope_type="llama3",
        factor=float(merged["factor"]),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(merged.get("original_max_position_embeddings", 8192)),
    )


def arch_from_hf_config(cfg: dict, source: str = "config.json") -> ModelArch:
    names = cfg.get("architectures") or []
    family = SUPPORTED_ARCHITECTURES.get(names[0]) if names else None
    if family is None:
        raise ValueError(
            f"{source}: architectures={names!r} is not supported; "
            f"echo runs {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    try:
        def size(name: str, default: int | None = None) -> int:
            return _positive_int(cfg[name] if default is None else cfg.get(name) or default,
                                 name, source)

        num_heads = size("num_attention_heads")
        hidden = size("hidden_size")
        num_kv_heads = size("num_key_value_heads", num_heads)
        if num_heads % num_kv_heads:
            raise ValueError(f"{source}: num_attention_heads ({num_heads}) must be a multiple "
                             f"of num_key_value_heads ({num_kv_heads})")
        eps = float(cfg.get("rms_norm_eps", 1e-6))
        if not eps > 0:
            raise ValueError(f"{source}: rms_norm_eps must be > 0, got {eps}")
        theta, scaling = _rope(cfg)
        return ModelArch(
            family=family,
            vocab_size=size("vocab_size"),
            hidden_size=hidden,
            intermediate_size=size("intermediate_size"),
            num_layers=size("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=size("head_dim", max(hidden // num_heads, 1)),
            rms_norm_eps=eps,
            rope_theta=theta,
            rope_scaling=scaling,
            max_position_embeddings=size("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            dtype=str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_tuple(cfg.get("eos_token_id")),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            quantization=parse_quantization(cfg.get("quantization_config"), source),
            **(_moe_fields(cfg, source) if family == "qwen3_moe" else {}),
        )
    except KeyError as e:
        raise ValueError(f"{source}: missing field {e.args[0]!r}") from None


def _moe_fields(cfg: dict, source: str) -> dict:
    # newer transformers write num_local_experts, older num_experts
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if not experts:
        raise KeyError("num_experts")
    fields = dict(num_experts=int(experts),
                  num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                  moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                  norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                  decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                  mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()))
    if not 1 <= fields["num_experts_per_tok"] <= fields["num_experts"]:
        raise ValueError(f"{source}: num_experts_per_tok ({fields['num_experts_per_tok']}) must "
                         f"be in [1, num_experts={fields['num_experts']}]")
    if fields["decoder_sparse_step"] < 1:
        raise ValueError(f"{source}: decoder_sparse_step must be >= 1, got "
                         f"{fields['decoder_sparse_step']}")
    return fields


# EAGLE-3 draft heads (echo/models/eagle3.py): their config.json, read here with the others'
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3",)


@dataclass(frozen=True)
class Eagle3Config:
    arch: ModelArch  # the decoder layer's shapes (a Llama layer's, but for q/k/v's input)
    draft_vocab_size: int
    target_hidden_size: int  # of each of the three hidden states fc fuses


def eagle3_config(cfg: dict, source: str = "config.json") -> Eagle3Config:
    names = cfg.get("architectures") or []
    if not names or names[0] not in EAGLE3_ARCHITECTURES:
        raise ValueError(f"{source}: architectures={names!r} is not an EAGLE-3 head "
                         f"({', '.join(EAGLE3_ARCHITECTURES)})")
    arch = arch_from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"]}, source)
    if arch.num_layers != 1:
        raise ValueError(f"{source}: num_hidden_layers={arch.num_layers}: an EAGLE-3 head has "
                         "one decoder layer")
    return Eagle3Config(arch, int(cfg.get("draft_vocab_size") or arch.vocab_size),
                        int(cfg.get("target_hidden_size") or arch.hidden_size))


def eagle3_target_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers whose incoming hidden states the head fuses."""
    return 2, num_target_layers // 2, num_target_layers - 3
