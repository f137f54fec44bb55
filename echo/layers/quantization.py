"""Quantized checkpoints: what config.json's quantization_config says, checked before any weight
is built. AutoAWQ's W4A16 "gemm" format today (the tensors are described in linear.py)."""

from dataclasses import dataclass

AWQ_PACK = 8  # 4-bit values per int32


@dataclass(frozen=True)
class AwqConfig:
    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()

    def applies_to(self, prefix: str) -> bool:
        """Whether the linear layer named prefix (model.layers.3.mlp.down_proj, ...) is
        quantized: every one but those modules_to_not_convert names."""
        return not any(name and name in prefix for name in self.modules_to_not_convert)


def parse_quantization(cfg: dict | None, source: str) -> AwqConfig | None:
    """config.json's quantization_config -> AwqConfig (None: not quantized); ValueError naming
    the field for what echo cannot run."""
    if not cfg:
        return None
    where = f"{source}: quantization_config"
    method = str(cfg.get("quant_method", "")).lower()
    if method != "awq":
        raise ValueError(f"{where}.quant_method: {method!r} is not supported (awq)")
    bits = cfg.get("bits", cfg.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}.bits: only 4-bit AWQ is supported, got {bits!r}")
    group_size = cfg.get("group_size", cfg.get("q_group_size"))
    if group_size not in (32, 64, 128):
        raise ValueError(f"{where}.group_size: must be 32, 64 or 128, got {group_size!r}")
    if cfg.get("zero_point", True) is not True:
        raise ValueError(f"{where}.zero_point: only AWQ with zero points is supported")
    version = str(cfg.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}.version: {version!r} is not supported (gemm)")
    if cfg.get("desc_act"):
        raise ValueError(f"{where}.desc_act: act-order is not supported")
    skip = cfg.get("modules_to_not_convert") or ()
    return AwqConfig(int(group_size), tuple(str(m) for m in skip))
