"""Which tiles make the persistent decode step fastest, and how far is it from its read time?

    python tools/dev/probe_persistent_decode.py [--model qwen3-0.6b] [--context 256] [--sweep]
        [--awq-group 128] [--phases --layers 2]

#27's kernel (echo_kernels/persistent_decode.py) at a preset's real shapes with random bf16
weights, one sequence whose `context` keys are in a paged cache: each tile setting's step
(every layer and the final norm; not the embedding or the LM head) replayed from a CUDA graph
and timed with bench_kernels' bench_graph. Each output is checked against the first
setting's, and a barrier that gave up (a grid that was not co-resident) is reported. Printed:
µs a step, the programs the grid got, and the layer weights' bytes over the time against the
copy bandwidth measured in the same run. --awq-group: the four linear layers as random AWQ
tensors (W4A16) of that group size, and the AWQ phases' settings. --phases: with the default
tiles, launches of the step's first k phases for every k, each launch's µs and its increment
over the one before (what each phase costs, its barrier included).
"""

import argparse
import sys
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import torch  # noqa: E402
from bench_kernels import bench_graph, measure_ceilings  # noqa: E402

from echo.models.arch import PRESETS_DIR, arch_from_hf_config, read_config_json  # noqa: E402
from echo.worker.persistent_decoder import decode_shape  # noqa: E402
from echo_kernels.persistent_decode import (  # noqa: E402
    DecodeShape,
    PersistentDecode,
    PersistentTiles,
    pointer_table,
)

BLOCK_SIZE = 16
DEFAULT_SETTINGS = [dict(), dict(stages=2), dict(balanced_rows=False), dict(block_n=4),
                    dict(block_n=4, balanced_rows=False), dict(block_k=256),
                    dict(programs_per_sm=1), dict(programs_per_sm=3)]
AWQ_SETTINGS = [dict(), dict(awq_stages=2), dict(awq_stages=8), dict(awq_block_k=16),
                dict(awq_cols=128), dict(awq_cols=512), dict(awq_splits=16), dict(awq_splits=64),
                dict(programs_per_sm=3)]
SWEEP = [dict(block_n=n, block_k=k, programs_per_sm=p, max_registers=r)
         for n in (4, 8, 16) for k in (256, 512) for p, r in ((2, None), (3, 168), (4, 128))]


def shape_of(preset: str, layers: int | None) -> DecodeShape:
    arch = arch_from_hf_config(read_config_json(PRESETS_DIR / f"{preset}.json"))
    return decode_shape(arch, BLOCK_SIZE, layers)


class Step:
    """Random weights and a cache holding `context` keys; `decode(tiles)` builds the kernel."""

    def __init__(self, shape: DecodeShape, context: int):
        torch.manual_seed(0)
        h, i, d = shape.hidden_size, shape.intermediate_size, shape.head_dim

        def rand(*size, scale):
            return torch.randn(*size, device="cuda", dtype=torch.bfloat16) * scale

        def norm(n):
            return 1 + rand(n, scale=0.1)

        blocks = -(-(context + 1) // BLOCK_SIZE)
        self.cache = torch.randn(shape.num_layers, 2, blocks + 1, BLOCK_SIZE, shape.num_kv_heads,
                                 d, device="cuda", dtype=torch.bfloat16)
        experts = (shape.num_experts,) if shape.is_moe else ()
        self.layers = [{
            "in_norm": norm(h), "qkv": rand(shape.qkv_size, h, scale=h**-0.5),
            "q_norm": norm(d), "k_norm": norm(d),
            "o_proj": rand(h, shape.num_heads * d, scale=(shape.num_heads * d)**-0.5),
            "post_norm": norm(h), "gate_up": rand(*experts, 2 * i, h, scale=h**-0.5),
            "down": rand(*experts, h, i, scale=i**-0.5),
            "k_cache": self.cache[layer, 0], "v_cache": self.cache[layer, 1],
            **({"router": rand(shape.num_experts, h, scale=h**-0.5)} if experts else {}),
        } for layer in range(shape.num_layers)]
        if shape.awq_group_size:
            for layer in self.layers:
                for name, (n, k) in zip(("qkv", "o_proj", "gate_up", "down"),
                                        shape.linear_sizes, strict=True):
                    layer.update(awq_tensors(name, n, k, shape.awq_group_size))
        # the bytes a step reads: of the experts only the top_k it routes to
        touched = shape.top_k / shape.num_experts if experts else 1.0
        self.weight_bytes = sum(
            t.numel() * t.element_size() * (touched if experts and name in ("gate_up", "down")
                                            else 1.0)
            for layer in self.layers for name, t in layer.items() if not name.endswith("cache"))
        self.shape, self.final_norm = shape, norm(h)
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device="cuda").float() / d))
        freqs = torch.outer(torch.arange(context + 1, device="cuda").float(), inv)
        self.cos_sin = torch.cat((freqs.cos(), freqs.sin()), -1)
        self.embedding = rand(h, scale=1.0)
        self.block_table = torch.arange(blocks + 1, dtype=torch.int32, device="cuda")

        def scalar(value):
            return torch.tensor([value], dtype=torch.int32, device="cuda")

        self.inputs = (scalar(context + 1), scalar(context), scalar(context))

    def decode(self, tiles: PersistentTiles) -> PersistentDecode:
        k = self.cache[0, 0]
        return PersistentDecode(self.shape, pointer_table(self.layers, k.device),
                                self.final_norm, self.cos_sin,
                                (k.stride(0), k.stride(1), k.stride(2)),
                                self.block_table.numel(), tiles)

    def run(self, decode: PersistentDecode) -> torch.Tensor:
        decode.input.copy_(self.embedding[None])
        return decode(self.block_table, *self.inputs)


def awq_tensors(name: str, n: int, k: int, group: int) -> dict[str, torch.Tensor]:
    """Random AWQ tensors of a [k, n] weight: every nibble random, scales ~ 1 / (6 sqrt(k))
    so the outputs stay about the inputs' size."""
    def bits(*size):
        return torch.randint(-2**31, 2**31 - 1, size, dtype=torch.int32, device="cuda")

    scales = (torch.rand(k // group, n, device="cuda") + 0.5) / (6 * k**0.5)
    return {name: bits(k, n // 8), f"{name}_zeros": bits(k // group, n // 8),
            f"{name}_scales": scales.to(torch.bfloat16)}


def phase_times(step: Step) -> None:
    """µs of launches of phases [0, k) for every k (the kernel's own phase_lo/phase_hi, the
    sync counts zeroed in front of each launch, since a partial step leaves them set)."""
    decode = step.decode(PersistentTiles())
    phases = step.shape.num_layers * step.shape.layer_phases + 1
    before = 0.0
    for hi in range(1, phases + 1):
        def launch(hi=hi):
            decode.input.copy_(step.embedding[None])
            decode.sync.zero_()
            decode._launch(step.block_table, *step.inputs, 0, hi, True)
        us = bench_graph([launch], inner=1) * 1e3
        layer, phase = divmod(hi - 1, step.shape.layer_phases)
        print(f"phases [0, {hi:3d}) (layer {layer}, phase {phase}): {us:8.1f} us "
              f"(+{us - before:6.1f})", flush=True)
        before = us


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="qwen3-0.6b", help="a preset (qwen3-30b-a3b too)")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--layers", type=int, help="fewer layers than the preset's")
    parser.add_argument("--sweep", action="store_true", help=f"{len(SWEEP)} settings")
    parser.add_argument("--awq-group", type=int, default=0,
                        help="AWQ linear layers of this group size (their settings)")
    parser.add_argument("--phases", action="store_true",
                        help="each phase's time: launches of the first k phases")
    args = parser.parse_args()
    shape = replace(shape_of(args.model, args.layers), awq_group_size=args.awq_group)
    step = Step(shape, args.context)
    if args.phases:
        phase_times(step)
        return
    copy_tbs = measure_ceilings()["copy_TBps"]
    floor_us = step.weight_bytes / copy_tbs / 1e6
    print(f"{args.model}: {shape.num_layers} layers, {step.weight_bytes / 1e6:.0f} MB of "
          f"layer weights read a step; copy bandwidth {copy_tbs:.2f} TB/s: {floor_us:.1f} us at it",
          flush=True)
    want = None
    settings = AWQ_SETTINGS if args.awq_group else SWEEP if args.sweep else DEFAULT_SETTINGS
    for setting in settings:
        tiles = PersistentTiles(**setting)
        decode = step.decode(tiles)
        got = step.run(decode).float().clone()
        if decode.error():
            print(f"{setting}: a barrier gave up waiting ({decode.programs} programs)",
                  flush=True)
            continue
        want = got if want is None else want
        err = ((got - want).abs().max() / want.abs().max()).item()
        us = bench_graph([lambda decode=decode: step.run(decode)], inner=1) * 1e3
        print(f"{str(setting):<60} {us:8.1f} us  {decode.programs:4d} programs  "
              f"{step.weight_bytes / us / 1e6:5.2f} TB/s ({floor_us / us:5.1%} of copy)  "
              f"vs first {err:.1e}", flush=True)


if __name__ == "__main__":
    main()
