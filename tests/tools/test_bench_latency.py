"""bench_latency --rank-share-of: the one-GPU stand-in for a rank of a tp=N model must hold
exactly the weights that rank holds."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

from bench_latency import rank_share_config  # noqa: E402

from echo.distributed.parallel_state import SINGLE, TPGroup  # noqa: E402
from echo.models.arch import PRESETS_DIR, arch_from_hf_config, read_config_json  # noqa: E402
from echo.models.registry import model_class  # noqa: E402


def weight_shapes(hf_config: dict, tp: TPGroup) -> dict[str, tuple[int, ...]]:
    arch = arch_from_hf_config(hf_config)
    with torch.device("meta"):  # shapes only: no memory for 8B parameters
        model = model_class(arch.family)(arch, tp, max_position=64)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


@pytest.mark.parametrize("preset,tp", [("qwen3-8b", 2), ("llama-3.1-8b", 2),
                                       ("llama-3.1-8b", 16),  # KV heads replicated
                                       ("qwen3-0.6b", 4)])
def test_share_holds_the_weights_of_a_rank(preset, tp):
    hf_config = read_config_json(PRESETS_DIR / f"{preset}.json")
    rank = weight_shapes(hf_config, TPGroup(rank=tp - 1, size=tp))
    share = weight_shapes(rank_share_config(hf_config, tp), SINGLE)
    assert share == rank
