"""Quantized checkpoints: what config.json's quantization_config says, checked before any weight
is built. W4A16 in two checkpoint formats, one runtime layout: AutoAWQ's "gemm" tensors (the
layout linear.py and the kernels use), and compressed-tensors' "pack-quantized" ones (what
llm-compressor writes), read as AWQ's at load time (compressed_tensors.py)."""

import re
from dataclasses import dataclass

AWQ_PACK = 8  # 4-bit values per int32
GROUP_SIZES = (32, 64, 128)
AWQ = "awq"
PACK_QUANTIZED = "pack-quantized"


@dataclass(frozen=True)
class AwqConfig:
    """A W4A16 model: groups of group_size inputs share a scale and a zero point. `format` is
    the checkpoint's (AWQ or PACK_QUANTIZED); `symmetric` (pack-quantized only) means its
    checkpoint has no zero points (every one is the midpoint, 8)."""

    group_size: int
    modules_to_not_convert: tuple[str, ...] = ()
    format: str = AWQ
    symmetric: bool = False

    @property
    def method(self) -> str:
        """quant_method as config.json names it (and the `quantization` argument)."""
        return AWQ if self.format == AWQ else "compressed-tensors"

    def applies_to(self, prefix: str) -> bool:
        """Whether the linear layer named prefix (model.layers.3.mlp.down_proj, ...) is
        quantized: AutoAWQ skips the modules_to_not_convert whose name is part of it;
        compressed-tensors its `ignore` entries, each a module name or "re:" and a pattern
        matched at the name's start."""
        if self.format == AWQ:
            return not any(name and name in prefix for name in self.modules_to_not_convert)
        return not any(re.match(rule[3:], prefix) if rule.startswith("re:") else rule == prefix
                       for rule in self.modules_to_not_convert)


def parse_quantization(cfg: dict | None, source: str) -> AwqConfig | None:
    """config.json's quantization_config -> AwqConfig (None: not quantized); ValueError naming
    the field for what echo cannot run."""
    if not cfg:
        return None
    where = f"{source}: quantization_config"
    method = str(cfg.get("quant_method", "")).lower()
    if method == "compressed-tensors":
        return _parse_compressed_tensors(cfg, where)
    if method != AWQ:
        raise ValueError(f"{where}.quant_method: {method!r} is not supported "
                         f"(awq, compressed-tensors)")
    bits = cfg.get("bits", cfg.get("w_bit"))
    if bits != 4:
        raise ValueError(f"{where}.bits: only 4-bit AWQ is supported, got {bits!r}")
    group_size = cfg.get("group_size", cfg.get("q_group_size"))
    if group_size not in GROUP_SIZES:
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


def _parse_compressed_tensors(cfg: dict, where: str) -> AwqConfig:
    """One config group of 4-bit integer weights in groups, activations left alone, every
    Linear its target, packed ("pack-quantized"): llm-compressor's W4A16 schemes."""
    fmt = cfg.get("format")
    if fmt != PACK_QUANTIZED:
        raise ValueError(f"{where}.format: {fmt!r} is not supported (pack-quantized, W4A16)")
    if cfg.get("kv_cache_scheme"):
        raise ValueError(f"{where}.kv_cache_scheme: a quantized KV cache from the checkpoint is "
                         f"not supported (echo's own is kv_cache_dtype)")
    groups = cfg.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise ValueError(f"{where}.config_groups: exactly one group is supported, got "
                         f"{len(groups) if isinstance(groups, dict) else groups!r}")
    (name, group), = groups.items()
    ignore = cfg.get("ignore") or ()
    for rule in ignore:
        if str(rule).startswith("re:"):
            try:
                re.compile(str(rule)[3:])
            except re.error as e:
                raise ValueError(f"{where}.ignore: {rule!r} is not a valid pattern ({e})") \
                    from None
    where = f"{where}.config_groups.{name}"
    targets = group.get("targets", ["Linear"])
    if targets != ["Linear"]:
        raise ValueError(f"{where}.targets: only [\"Linear\"] is supported, got {targets!r}")
    for field in ("input_activations", "output_activations"):
        if group.get(field):
            raise ValueError(f"{where}.{field}: only weight quantization (W4A16) is supported")
    weights = group.get("weights") or {}
    checks = (("num_bits", weights.get("num_bits") == 4, "must be 4"),
              ("type", weights.get("type", "int") == "int", "must be int"),
              ("strategy", weights.get("strategy") in ("group", None), "must be group"),
              ("group_size", weights.get("group_size") in GROUP_SIZES, "must be 32, 64 or 128"),
              ("actorder", not weights.get("actorder"), "act-order is not supported"),
              ("dynamic", not weights.get("dynamic"), "must be false"),
              ("symmetric", isinstance(weights.get("symmetric", True), bool), "must be a bool"))
    for field, ok, rule in checks:
        if not ok:
            raise ValueError(f"{where}.weights.{field}: {rule}, got {weights.get(field)!r}")
    return AwqConfig(int(weights["group_size"]), tuple(str(m) for m in ignore), PACK_QUANTIZED,
                     weights.get("symmetric", True))
