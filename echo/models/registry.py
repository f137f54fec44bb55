"""Model family name -> model class."""

from torch import nn

from echo.models.llama import LlamaForCausalLM
from echo.models.qwen3 import Qwen3ForCausalLM
from echo.models.qwen3_moe import Qwen3MoeForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "qwen3_moe": Qwen3MoeForCausalLM,
}


def model_class(family: str) -> type[nn.Module]:
    return MODEL_CLASSES[family]
