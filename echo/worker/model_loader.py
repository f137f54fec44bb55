"""Build a model and fill its weights: from local safetensors (single or sharded) or at random."""

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from echo import envs
from echo.config import ModelConfig
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.checkpoint_tensor import CheckpointTensor, whole
from echo.layers.compressed_tensors import as_awq_tensors
from echo.layers.linear import LinearBase
from echo.layers.quantization import PACK_QUANTIZED
from echo.models.registry import model_class

INDEX_FILE = "model.safetensors.index.json"


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = [folder / s for s in shards]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise FileNotFoundError(f"{index} names missing shard(s): {', '.join(missing)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {folder} has no *.safetensors weights")
    return files


def iterate_weights(folder: Path) -> Iterator[tuple[str, CheckpointTensor]]:
    """Every tensor of the checkpoint, unread: a weight loader reads the part its rank keeps
    (valid until the next item, while its file is open)."""
    for path in safetensors_files(folder):
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, CheckpointTensor(f.get_slice(name))
        except Exception as e:  # safetensors raises its own error types for corrupt files
            if isinstance(e, ValueError) and str(path) in str(e):
                raise
            raise ValueError(f"{path}: cannot read safetensors file ({e})") from None


def _default_loader(param: nn.Parameter, loaded: CheckpointTensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"shape {tuple(loaded.shape)} does not match {tuple(param.shape)}")
    param.data.copy_(whole(loaded))


def load_weights(model: nn.Module, folder: Path) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    mapping = getattr(model, "packed_modules_mapping", {})
    # a model's own names first (a mixture of experts' per-expert tensors)
    map_name = getattr(model, "map_checkpoint_name", lambda name: None)
    tied = model.arch.tie_word_embeddings
    loaded: set[str] = set()
    weights = iterate_weights(folder)
    quant = model.arch.quantization
    if quant is not None and quant.format == PACK_QUANTIZED:
        weights = as_awq_tensors(weights, quant, next(model.parameters()).device)
    for name, weight in weights:
        if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
            continue
        shard_id = None
        mapped = map_name(name)
        if mapped is not None:
            name, shard_id = mapped
        else:
            for fragment, (fused, shard) in mapping.items():
                if f".{fragment}." in name:
                    name, shard_id = name.replace(f".{fragment}.", f".{fused}."), shard
                    break
        param = params.get(name)
        if param is None:
            raise ValueError(f"{folder}: checkpoint tensor "
                             f"{getattr(weight, 'source_name', name)!r} has no place in the model")
        try:
            getattr(param, "weight_loader", _default_loader)(param, weight, shard_id)
        except ValueError as e:
            raise ValueError(f"{folder}: {getattr(weight, 'source_name', name)}: {e}") from None
        loaded.add(name)
    expected = {n for n in params if not (tied and n == "lm_head.weight")}
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"{folder}: checkpoint lacks {len(missing)} weight(s), e.g. {missing[:3]}")


def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Random weights of the right shapes: speed does not depend on their values."""
    generator = None
    for name, param in model.named_parameters():
        if param.is_meta:  # shapes only (tests, planning): nothing to fill
            continue
        if generator is None:  # drawn on the parameters' own device: fast for 8B models
            generator = torch.Generator(device=param.device).manual_seed(seed)
        if "norm" in name:
            param.data.fill_(1.0)
        elif not param.is_floating_point():  # AWQ's packed int32 nibbles: any bits will do
            param.data.random_(generator=generator)
        else:
            param.data.normal_(0.0, 0.02, generator=generator)


def _construct(make, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """make() with its parameters created in dtype, on device."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            return make()
    finally:
        torch.set_default_dtype(previous)


def build_model(config: ModelConfig, device: torch.device, tp: TPGroup = SINGLE,
                awq_tensor_cores: bool = True) -> nn.Module:
    """The model with its weights; awq_tensor_cores: AWQ layers repacked for the tensor-core
    kernels where ECHO_AWQ_MMA allows (the persistent decode step reads AutoAWQ's layout)."""
    model = _construct(lambda: model_class(config.arch.family)(config.arch, tp,
                                                               config.max_model_len),
                       getattr(torch, config.dtype), device)
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed)
    else:
        load_weights(model, config.path)
    if config.arch.quantization is not None and awq_tensor_cores and envs.awq_tensor_cores():
        for module in model.modules():
            if isinstance(module, LinearBase):
                module.use_awq_tensor_cores(envs.awq_sum_inside())
    return model.eval()


def build_eagle3_head(folder: Path, dtype: torch.dtype, device: torch.device,
                      max_position: int | None = None, tp: TPGroup = SINGLE) -> nn.Module:
    """An EAGLE-3 head (echo/models/eagle3.py) from its folder: config.json and safetensors;
    under tensor parallelism its attention heads, MLP and LM head are split as a Llama
    layer's are (fc is replicated)."""
    from echo.models.arch import eagle3_config, read_config_json
    from echo.models.eagle3 import Eagle3Head

    config = eagle3_config(read_config_json(folder / "config.json"),
                           source=f"{folder}/config.json")
    head = _construct(lambda: Eagle3Head(config, tp, max_position), dtype, device)
    load_weights(head, folder)
    return head.eval()
