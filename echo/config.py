"""One frozen EngineConfig made of small frozen parts, validated once, never mutated.

`EngineConfig.create(**kwargs)` takes the argument names vLLM users already type (model, dtype,
max_model_len, block_size, ...), resolves the model (a folder, a preset, or the embedded
default), and validates every field with an error that names it.

Every engine argument is written once, here: a field of a part (CacheConfig, SchedulerConfig,
ParallelConfig, DeviceConfig) with its help, choices and command-line aliases in the field's
metadata, or an EngineArg in MODEL_ARGS for the model-level ones. `engine_arg_specs()` lists
them all; the command line (echo/entrypoints/cli.py) builds its flags from that list.
"""

import os
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from echo.models.arch import (
    ModelArch,
    arch_from_hf_config,
    eagle3_config,
    preset_names,
    read_config_json,
)

DTYPES = ("auto", "bfloat16", "float16", "float32")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's names, accepted as they are
LOAD_FORMATS = ("auto", "safetensors", "dummy")
QUANTIZATION_METHODS = ("awq", "compressed-tensors")  # quant_method of the W4A16 checkpoints
# vLLM's names of its own kernels for the same checkpoints, taken as the format they read
QUANTIZATION_ALIASES = {"awq_marlin": "awq"}
# "auto" and "bf16" store K/V in the model dtype; "int8" adds per-token-head float32 scales
KV_CACHE_DTYPES = ("auto", "bf16", "int8")
DEVICES = ("auto", "cuda", "cpu")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
SCHEDULING_POLICIES = ("fcfs", "priority")
DATA_PARALLEL_BACKENDS = ("mp", "ray")
PREEMPTION_MODES = ("recompute", "swap")
KV_OFFLOADING_POLICIES = ("write_through", "write_back")  # SGLang HiCache's names
ROUTER_POLICIES = ("cache_aware", "least_load", "round_robin")  # echo.engine.router's
# the most decode steps per scheduling round trip (num_scheduler_steps)
MAX_SCHEDULER_STEPS = 64
MAX_GRAMMAR_PROCESSES = 64
# on a GPU the grammar work of a few dozen constrained requests outlasts the forward it hides
# behind when the core does it alone (docs/benchmarks.md, Structured outputs)
GPU_GRAMMAR_PROCESSES = 4
DEFAULT_MODEL_NAMES = (None, "", "default")


def _check(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")


def _check_choice(value, name: str, choices) -> None:
    _check(value in choices, name, f"{value!r} is not one of {list(choices)}")


def _check_int(value, name: str) -> None:
    # bool is an int subclass and 2.0 == 2: both would pass the range checks and fail later,
    # far from the argument that caused it
    _check(type(value) is int, name, f"must be an integer, got {value!r}")


def _check_bool(value, name: str) -> None:
    _check(type(value) is bool, name, f"must be True or False, got {value!r}")


@dataclass(frozen=True)
class EngineArg:
    """One engine argument as users pass it: an EngineConfig.create keyword, or a flag."""

    name: str  # the create() keyword; the flag is --name-with-dashes
    type: type  # int, float, str or bool (the type of a given value; None means "not given")
    default: object  # what applies when it is not given (None: derived, see help)
    help: str
    choices: tuple | None = None
    aliases: tuple[str, ...] = ()  # other command-line spellings (vLLM's, SGLang's)


def _arg(default, help: str, choices: tuple | None = None, aliases: tuple[str, ...] = ()):
    """A part's field that is also an engine argument: its metadata is the rest of EngineArg."""
    return field(default=default,
                 metadata={"help": help, "choices": choices, "aliases": aliases})


# the create() arguments that go into ModelConfig, whose fields are the resolved values
MODEL_ARGS = (
    EngineArg("tokenizer", str, None,
              "local Hugging Face folder to load the tokenizer from (default: the model's)"),
    EngineArg("dtype", str, "auto",
              "weights and activations dtype; auto: float32 on CPU, else the model's "
              "bfloat16/float16 (bfloat16 for float32 models)",
              choices=(*DTYPES, *DTYPE_ALIASES)),
    EngineArg("max_model_len", int, None,
              "longest sequence, prompt plus output, in tokens (default: the model's "
              "max_position_embeddings)"),
    EngineArg("load_format", str, "auto",
              "weights format; dummy: random weights of the model's shapes (presets, "
              "benchmarks)", choices=LOAD_FORMATS),
    EngineArg("seed", int, 0,
              "engine seed: dummy weights and the sampling of requests that give no seed"),
    EngineArg("quantization", str, None,
              "the checkpoint's weight format, checked against its config.json's "
              "quantization_config (read from there when not given)",
              choices=(*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES)),
    EngineArg("speculative_config", dict, None,
              'speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
              '"num_speculative_tokens": 4, "prompt_lookup_max": 4}'),
)
_MODEL_DEFAULTS = {a.name: a.default for a in MODEL_ARGS}


@dataclass(frozen=True)
class ModelConfig:
    model: str  # what the user asked for: a folder, a preset name or "default"
    path: Path | None  # the folder weights and tokenizer come from; None for presets
    arch: ModelArch
    dtype: str  # resolved: bfloat16, float16 or float32
    max_model_len: int
    tokenizer: Path | None = None
    load_format: str = _MODEL_DEFAULTS["load_format"]
    seed: int = _MODEL_DEFAULTS["seed"]

    def __post_init__(self):
        _check_choice(self.dtype, "dtype", DTYPES[1:])
        _check_choice(self.load_format, "load_format", LOAD_FORMATS)
        _check_int(self.max_model_len, "max_model_len")
        _check_int(self.seed, "seed")
        _check(self.max_model_len >= 1, "max_model_len", f"must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _arg(16, "tokens per KV cache block: 8, 16, 32, 64 or 128")
    gpu_memory_utilization: float = _arg(
        0.9, "fraction of the GPU's memory the engine may use (weights, activations, KV cache)")
    num_gpu_blocks_override: int | None = _arg(
        None, "number of KV cache blocks, instead of sizing the cache by profiling")
    enable_prefix_caching: bool = _arg(
        True, "reuse the KV cache blocks of a shared prompt prefix")
    kv_cache_dtype: str = _arg(
        "auto", "KV cache dtype; auto and bf16: the model dtype; int8: half the bytes per "
        "token (about twice the context), with per-token-head scales", choices=KV_CACHE_DTYPES)
    kv_offloading_size: float | None = _arg(
        None, "GiB of host memory (pinned on cuda) for a second tier of the prefix cache: "
        "finished requests' blocks are copied there, and a later prompt's prefix found there "
        "is loaded instead of recomputed (all TP ranks of a replica together; each "
        "data-parallel replica has its own)")
    preemption_mode: str = _arg(
        "recompute", "what preemption does with a request's blocks: recompute, free them "
        "(the GPU prefix cache may still hold them); swap, also copy them to the host tier "
        "(needs kv_offloading_size)", choices=PREEMPTION_MODES)
    kv_offloading_policy: str = _arg(
        "write_through", "when blocks go to the host tier: write_through, a finished "
        "request's full blocks as it finishes; write_back, a cached block only when the GPU "
        "evicts it (the step that reuses the block waits for its copy)",
        choices=KV_OFFLOADING_POLICIES)

    def __post_init__(self):
        _check_int(self.block_size, "block_size")
        if self.num_gpu_blocks_override is not None:
            _check_int(self.num_gpu_blocks_override, "num_gpu_blocks_override")
        _check(type(self.gpu_memory_utilization) in (int, float), "gpu_memory_utilization",
               f"must be a number, got {self.gpu_memory_utilization!r}")
        _check_bool(self.enable_prefix_caching, "enable_prefix_caching")
        _check(self.block_size in (8, 16, 32, 64, 128), "block_size",
               f"must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        _check(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization",
               f"must be in (0, 1], got {self.gpu_memory_utilization}")
        _check(self.num_gpu_blocks_override is None or self.num_gpu_blocks_override >= 1,
               "num_gpu_blocks_override", f"must be >= 1, got {self.num_gpu_blocks_override}")
        _check_choice(self.kv_cache_dtype, "kv_cache_dtype", KV_CACHE_DTYPES)
        if self.kv_offloading_size is not None:
            _check(type(self.kv_offloading_size) in (int, float) and self.kv_offloading_size > 0,
                   "kv_offloading_size", f"must be a positive number of GiB, got "
                   f"{self.kv_offloading_size!r}")
            _check(self.enable_prefix_caching, "kv_offloading_size",
                   "the host tier holds prefix-cache blocks: it needs enable_prefix_caching")
        _check_choice(self.preemption_mode, "preemption_mode", PREEMPTION_MODES)
        _check(self.preemption_mode == "recompute" or self.kv_offloading_size is not None,
               "preemption_mode", "swap needs a host tier: give kv_offloading_size")
        _check_choice(self.kv_offloading_policy, "kv_offloading_policy", KV_OFFLOADING_POLICIES)
        _check(self.kv_offloading_policy == "write_through" or self.kv_offloading_size is not None,
               "kv_offloading_policy", "write_back needs a host tier: give kv_offloading_size")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = _arg(256, "most sequences in one step")
    max_num_batched_tokens: int = _arg(
        8192, "most tokens in one step; when not given, raised to max_num_seqs if that is larger")
    max_model_len: int = 4096  # not an argument of its own: the model's, copied by create()
    async_scheduling: bool = _arg(
        True, "schedule the next step while the current one runs on the device")
    scheduling_policy: str = _arg(
        "fcfs", "fcfs: requests are served in arrival order, and a request's priority must be "
        "0; priority: by each request's priority (lower first), then arrival, and preemption "
        "takes the running request of the worst priority", choices=SCHEDULING_POLICIES)
    num_scheduler_steps: int = _arg(
        1, "decode steps run on the device per scheduling round trip (vLLM v0's multi-step "
        "decoding) while every running request decodes with plain sampling and none waits: "
        "fewer host round trips per token for small models at small batch; outputs then "
        "arrive that many tokens at a time")
    grammar_processes: int = _arg(
        0, "helper processes that advance structured requests' grammars and fill their token "
        "masks, side by side and outside the engine core's GIL, started with the first "
        "structured request; 0: the core's busy loop does it (when not given: "
        f"{GPU_GRAMMAR_PROCESSES} on a GPU with {GPU_GRAMMAR_PROCESSES * 2} or more CPU cores, "
        "else 0)")

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len",
                     "num_scheduler_steps", "grammar_processes"):
            _check_int(getattr(self, name), name)
        _check_bool(self.async_scheduling, "async_scheduling")
        _check_choice(self.scheduling_policy, "scheduling_policy", SCHEDULING_POLICIES)
        _check(self.max_num_seqs >= 1, "max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        _check(self.max_num_batched_tokens >= self.max_num_seqs, "max_num_batched_tokens",
               f"must be >= max_num_seqs ({self.max_num_seqs}), got {self.max_num_batched_tokens}")
        _check(1 <= self.num_scheduler_steps <= MAX_SCHEDULER_STEPS, "num_scheduler_steps",
               f"must be in [1, {MAX_SCHEDULER_STEPS}], got {self.num_scheduler_steps}")
        _check(0 <= self.grammar_processes <= MAX_GRAMMAR_PROCESSES, "grammar_processes",
               f"must be in [0, {MAX_GRAMMAR_PROCESSES}], got {self.grammar_processes}")

    def check_priority(self, priority) -> None:
        """A request's priority, as vLLM takes it: any 64-bit integer under the priority
        policy (lower is served first), only 0 under fcfs."""
        _check(type(priority) is int and -2**63 <= priority < 2**63, "priority",
               f"must be a 64-bit integer, got {priority!r}")
        _check(priority == 0 or self.scheduling_policy == "priority", "priority",
               f"{priority} given, but the engine schedules fcfs: start it with "
               "scheduling_policy='priority' (--scheduling-policy priority) to use priorities")


@dataclass(frozen=True)
class ParallelConfig:
    # -tp is vLLM's short form, --tp-size SGLang's
    tensor_parallel_size: int = _arg(
        1, "number of tensor-parallel ranks (GPUs on cuda, processes on cpu)",
        aliases=("--tp", "-tp", "--tp-size"))
    # data parallelism: replicas of the whole engine (each with its tensor-parallel ranks)
    # behind one frontend; the core of each replica sees only its own part
    data_parallel_size: int = _arg(
        1, "number of engine replicas behind one frontend, each with its own EngineCore and "
        "tensor-parallel workers", aliases=("-dp", "--dp", "--dp-size"))
    data_parallel_backend: str = _arg(
        "mp", "how replicas run: mp, processes on this node; ray, Ray actors on a cluster",
        choices=DATA_PARALLEL_BACKENDS)
    ray_address: str | None = _arg(
        None, "the Ray cluster of --data-parallel-backend ray (default: RAY_ADDRESS, else a "
        "local cluster started for the engine)")
    router_policy: str = _arg(
        "cache_aware", "which replica takes a request: cache_aware, the one whose recent "
        "prompts share its longest prefix unless it is much busier; least_load; round_robin",
        choices=ROUTER_POLICIES)

    def __post_init__(self):
        for name in ("tensor_parallel_size", "data_parallel_size"):
            _check_int(getattr(self, name), name)
            _check(getattr(self, name) >= 1, name, f"must be >= 1, got {getattr(self, name)}")
        _check_choice(self.data_parallel_backend, "data_parallel_backend",
                      DATA_PARALLEL_BACKENDS)
        _check_choice(self.router_policy, "router_policy", ROUTER_POLICIES)
        _check(self.ray_address is None or isinstance(self.ray_address, str), "ray_address",
               f"must be a string, got {self.ray_address!r}")


@dataclass(frozen=True)
class DeviceConfig:
    # both resolved by create()
    device: str = _arg("auto", "auto: cuda when available, else cpu", choices=DEVICES)
    attention_backend: str = _arg(
        "auto", "attention kernels; auto: triton on cuda, torch elsewhere",
        choices=ATTENTION_BACKENDS)
    enforce_eager: bool = _arg(False, "run the model eagerly, without CUDA graphs")
    persistent_decode: bool = _arg(
        False, "batch-1 decode steps of a Llama, Qwen3 (bf16 or AWQ) or Qwen3-MoE model in one "
        "persistent kernel launch (one GPU, no int8 KV; other models and batches run as "
        "usual)")

    def __post_init__(self):
        _check_choice(self.device, "device", DEVICES)
        _check_choice(self.attention_backend, "attention_backend", ATTENTION_BACKENDS)
        _check_bool(self.enforce_eager, "enforce_eager")
        _check_bool(self.persistent_decode, "persistent_decode")


# "oracle" is for benchmarking only (tools/bench_spec.py)
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle3", "oracle")
DRAFTING_MODELS = ("draft_model", "eagle3")  # methods whose drafter the workers run
ORACLE_ACCEPTANCE_DEFAULT = 0.75


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's speculative_config. ngram: drafts from prompt lookup over the request's own
    tokens; verified in one step of 1 + k tokens per request (docs/ARCHITECTURE.md,
    Speculative decoding). draft_model: a smaller model with the target's vocabulary (model:
    a local folder, or a preset with dummy weights) proposes k tokens per step, run by the
    same workers with its own KV cache (echo/worker/draft_model.py). eagle3: an EAGLE-3 head
    (model: its folder) drafts from the target's hidden states (echo/models/eagle3.py,
    echo/worker/eagle3_drafter.py). oracle, for benchmarking
    only: the target's own greedy tokens recorded by an earlier run (oracle_path), each right
    with probability oracle_acceptance (echo/core/oracle_proposer.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4  # k
    # draft_model and eagle3 only: the draft model (as the target model is given) or head
    model: str | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # no drafts in a step with more running requests than this (None: always draft): at large
    # batches a step is compute-bound and verifying drafts stops paying
    disable_by_batch_size: int | None = None
    # oracle only: a JSON file of [[prompt ids, continuation ids], ...]
    oracle_path: str | None = None
    # oracle only: the probability that each draft is right (None: ORACLE_ACCEPTANCE_DEFAULT)
    oracle_acceptance: float | None = None

    def __post_init__(self):
        name = "speculative_config"
        _check_choice(self.method, f"{name}.method", SPECULATIVE_METHODS)
        for field_name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            _check_int(getattr(self, field_name), f"{name}.{field_name}")
        _check(1 <= self.num_speculative_tokens <= 16, f"{name}.num_speculative_tokens",
               f"must be in [1, 16], got {self.num_speculative_tokens}")
        _check(1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
               f"{name}.prompt_lookup_min",
               f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
               f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None:
            _check_int(self.disable_by_batch_size, f"{name}.disable_by_batch_size")
        if self.method in DRAFTING_MODELS:
            _check(isinstance(self.model, str) and self.model != "", f"{name}.model",
                   f"method {self.method!r} needs the draft's folder, got {self.model!r}")
        else:
            _check(self.model is None, f"{name}.model",
                   f"only for methods {', '.join(DRAFTING_MODELS)}, not {self.method!r}")
        if self.method != "oracle":
            for field_name in ("oracle_path", "oracle_acceptance"):
                _check(getattr(self, field_name) is None, f"{name}.{field_name}",
                       f"only for method 'oracle', not {self.method!r}")
            return
        path = self.oracle_path
        _check(isinstance(path, str) and path != "", f"{name}.oracle_path",
               f"method 'oracle' needs the JSON file of recorded continuations, got {path!r}")
        try:  # read by the engine core (echo/core/oracle_proposer.py): fail here if it cannot
            with open(path, "rb"):
                readable = True
        except OSError:
            readable = False
        _check(readable, f"{name}.oracle_path", f"{path!r} is not a readable file")
        if self.oracle_acceptance is None:  # frozen: the default is set once, here
            object.__setattr__(self, "oracle_acceptance", ORACLE_ACCEPTANCE_DEFAULT)
        acceptance = self.oracle_acceptance
        _check(type(acceptance) in (int, float) and 0 <= acceptance <= 1,
               f"{name}.oracle_acceptance", f"must be a number in [0, 1], got {acceptance!r}")

    @staticmethod
    def from_dict(value) -> "SpeculativeConfig":
        _check(isinstance(value, dict), "speculative_config",
               f"must be a JSON object, got {value!r}")
        known = {f.name for f in fields(SpeculativeConfig)}
        unknown = sorted(set(value) - known)
        _check(not unknown, "speculative_config",
               f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return SpeculativeConfig(**value)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    speculative: SpeculativeConfig | None = None
    # speculative_config.model, resolved as the target is (methods draft_model and eagle3)
    draft_model: ModelConfig | None = None

    def __post_init__(self):
        arch = self.model.arch
        tp = self.parallel.tensor_parallel_size
        if self.draft_model is not None:
            self._check_draft(self.draft_model.arch, tp)
        # each rank holds whole heads and an equal slice of the MLP; names are config.json's
        _check(arch.num_heads % tp == 0, "tensor_parallel_size",
               f"{tp} does not divide the model's num_attention_heads ({arch.num_heads})")
        # fewer KV heads than ranks: each KV head is replicated on tp / num_kv_heads ranks
        _check(arch.num_kv_heads % tp == 0 or tp % arch.num_kv_heads == 0,
               "tensor_parallel_size", f"{tp} neither divides nor is a multiple of the model's "
               f"num_key_value_heads ({arch.num_kv_heads})")
        _check(arch.intermediate_size % tp == 0, "tensor_parallel_size",
               f"{tp} does not divide the model's intermediate_size ({arch.intermediate_size})")
        # vocab_size needs no check: the vocab-parallel embedding pads it to a multiple of tp
        if self.device.device == "cuda":
            import torch

            visible = torch.cuda.device_count()
            _check(visible > 0, "device", "cuda needs a CUDA GPU, but none is visible "
                   "(device='cpu' runs on the CPU)")
            _check(tp <= visible, "tensor_parallel_size",
                   f"{tp} ranks need {tp} GPUs, but {visible} CUDA device(s) are visible")
            dp = self.parallel.data_parallel_size
            # Ray places replicas over its cluster's GPUs, which this node need not have
            _check(self.parallel.data_parallel_backend == "ray" or dp * tp <= visible,
                   "data_parallel_size", f"{dp} replicas of {tp} rank(s) need {dp * tp} GPUs, "
                   f"but {visible} CUDA device(s) are visible")
        _check(self.model.max_model_len == self.scheduler.max_model_len, "max_model_len",
               "model and scheduler disagree")
        _check(self.speculative is None or self.scheduler.num_scheduler_steps == 1,
               "num_scheduler_steps", f"{self.scheduler.num_scheduler_steps} cannot be combined "
               "with speculative_config: a step with drafts is verified on the host")

    def _check_draft(self, draft: ModelArch, tp: int) -> None:
        name = "speculative_config.model"
        _check(draft.vocab_size == self.model.arch.vocab_size, name,
               f"the draft's vocab_size {draft.vocab_size} differs from the target's "
               f"{self.model.arch.vocab_size}: a draft model must share the tokenizer")
        # the host tier copies the target's blocks only: the draft's would be stale
        _check(self.cache.kv_offloading_size is None, "kv_offloading_size",
               f"cannot be combined with speculative_config method {self.speculative.method!r}"
               " yet")
        if self.speculative.method == "eagle3":
            target = self.model.arch
            _check(draft.hidden_size == target.hidden_size, name,
                   f"the head's hidden_size {draft.hidden_size} differs from the target's "
                   f"{target.hidden_size}")
            _check(target.num_layers >= 4, name, "an EAGLE-3 head needs a target of at least "
                   f"4 layers, not {target.num_layers}")
        for size, what in ((draft.num_heads, "num_attention_heads"),
                           (draft.intermediate_size, "intermediate_size")):
            _check(size % tp == 0, name, f"tensor_parallel_size {tp} does not divide the "
                   f"draft's {what} ({size})")
        _check(draft.num_kv_heads % tp == 0 or tp % draft.num_kv_heads == 0, name,
               f"tensor_parallel_size {tp} neither divides nor is a multiple of the draft's "
               f"num_key_value_heads ({draft.num_kv_heads})")
        if self.speculative.method == "eagle3":
            return  # the head's rotary table is built for max_model_len
        _check(self.model.max_model_len <= draft.max_position_embeddings
               or draft.rope_scaling is not None, name,
               f"max_model_len {self.model.max_model_len} exceeds the draft's "
               f"max_position_embeddings ({draft.max_position_embeddings})")

    @staticmethod
    def create(model: str | None = None, **kwargs) -> "EngineConfig":
        """Build from vLLM-style keyword arguments; unknown names are an error, not ignored."""
        return _create(model, **kwargs)


ENGINE_PARTS = (CacheConfig, SchedulerConfig, ParallelConfig, DeviceConfig)
_ALIASES = {"tp": "tensor_parallel_size"}  # create() keywords; the flags' are in the metadata
# max_model_len is a model argument; the scheduler's copy is filled from the resolved value
_PART_FIELDS = {part: {f.name for f in fields(part)} - _MODEL_DEFAULTS.keys()
                for part in ENGINE_PARTS}


def _value_type(annotation) -> type:
    """int for `int | None`: None is "not given", never a value of its own."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    return args[0] if args else annotation


def engine_arg_specs() -> Iterator[EngineArg]:
    """Every argument EngineConfig.create takes besides the model: MODEL_ARGS, then the parts'
    fields in their order (the command line offers them in this order)."""
    yield from MODEL_ARGS
    for part, names in _PART_FIELDS.items():
        hints = typing.get_type_hints(part)
        for f in fields(part):
            if f.name not in names:
                continue
            if "help" not in f.metadata:
                raise TypeError(f"{part.__name__}.{f.name}: an engine argument needs its "
                                "metadata (declare it with _arg)")
            yield EngineArg(f.name, _value_type(hints[f.name]), f.default, f.metadata["help"],
                            f.metadata["choices"], f.metadata["aliases"])


def _resolve_model(model: str | None, load_format: str) -> tuple[Path | None, dict]:
    if model in DEFAULT_MODEL_NAMES:
        from echo.models.default_model import ensure_default_model

        path = ensure_default_model()
        return path, read_config_json(path / "config.json")
    path = Path(model).expanduser()
    if path.is_dir():
        return path, read_config_json(path / "config.json")
    if model in preset_names():
        _check(load_format == "dummy", "model",
               f"{model!r} is a preset (shapes only); echo never downloads weights: pass "
               "load_format='dummy' for random weights, or a local folder with safetensors")
        from echo.models.arch import PRESETS_DIR

        return None, read_config_json(PRESETS_DIR / f"{model}.json")
    raise FileNotFoundError(
        f"model: {model!r} is not a local folder, a preset ({', '.join(preset_names())}) "
        "or 'default'; echo never downloads models"
    )


def _resolve_dtype(dtype: str, arch: ModelArch, device: str) -> str:
    _check_choice(dtype, "dtype", (*DTYPES, *DTYPE_ALIASES))
    dtype = DTYPE_ALIASES.get(dtype, dtype)
    if dtype != "auto":
        return dtype
    if device == "cpu":
        return "float32"  # CPU matmuls in half precision are slow and inexact
    return arch.dtype if arch.dtype in DTYPES[1:] and arch.dtype != "float32" else "bfloat16"


def _resolve_device(device: str) -> str:
    _check_choice(device, "device", DEVICES)
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _create(model: str | None, **kwargs) -> EngineConfig:
    # vLLM's trust_remote_code is taken and has no effect: echo never runs a model's own code
    kwargs.pop("trust_remote_code", None)
    kwargs = {_ALIASES.get(k, k): v for k, v in kwargs.items() if v is not None}
    parts = {}
    for part, names in _PART_FIELDS.items():
        parts[part] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    model_kwargs = {k: kwargs.pop(k) for k in list(kwargs) if k in _MODEL_DEFAULTS}
    if kwargs:
        raise TypeError(f"unknown engine argument(s): {', '.join(sorted(kwargs))}")

    # the parts that do not depend on the model first: a bad value fails before the model is
    # resolved (the default model is converted on first use, which takes a while)
    cache = CacheConfig(**parts[CacheConfig])
    parallel = ParallelConfig(**parts[ParallelConfig])
    device_cfg = DeviceConfig(**parts[DeviceConfig])
    load_format = model_kwargs.get("load_format", _MODEL_DEFAULTS["load_format"])
    _check_choice(load_format, "load_format", LOAD_FORMATS)
    given = {**model_kwargs, **parts[SchedulerConfig]}
    for name in ("max_model_len", "max_num_seqs"):  # compared below, before their parts check
        if name in given:
            _check_int(given[name], name)
    path, hf_config = _resolve_model(model, load_format)
    arch = arch_from_hf_config(hf_config, source=f"{path or model}/config.json")
    quantization = model_kwargs.get("quantization")
    if quantization is not None:
        _check_choice(quantization, "quantization", (*QUANTIZATION_METHODS, *QUANTIZATION_ALIASES))
        quantization = QUANTIZATION_ALIASES.get(quantization, quantization)
        _check(arch.quantization is not None, "quantization",
               f"{quantization!r} given, but {path or model}/config.json has no "
               "quantization_config: the weights are not quantized")
        _check(arch.quantization.method == quantization, "quantization",
               f"{quantization!r} given, but {path or model}/config.json's weights are "
               f"{arch.quantization.method!r}")

    device = _resolve_device(device_cfg.device)
    backend = device_cfg.attention_backend
    if backend == "auto":
        backend = "triton" if device == "cuda" else "torch"
    device_cfg = replace(device_cfg, device=device, attention_backend=backend)

    max_model_len = model_kwargs.get("max_model_len", arch.max_position_embeddings)
    _check(max_model_len <= arch.max_position_embeddings or arch.rope_scaling is not None,
           "max_model_len", f"{max_model_len} exceeds the model's max_position_embeddings "
           f"({arch.max_position_embeddings})")
    tokenizer = model_kwargs.get("tokenizer")
    if tokenizer and not Path(tokenizer).expanduser().is_dir():
        raise FileNotFoundError(f"tokenizer: {tokenizer!r} is not a local folder")
    model_cfg = ModelConfig(
        model=str(model or "default"),
        path=path,
        arch=arch,
        dtype=_resolve_dtype(model_kwargs.get("dtype", _MODEL_DEFAULTS["dtype"]), arch, device),
        max_model_len=max_model_len,
        tokenizer=Path(tokenizer).expanduser() if tokenizer else path,
        load_format=load_format,
        seed=model_kwargs.get("seed", _MODEL_DEFAULTS["seed"]),
    )
    sched = parts[SchedulerConfig]
    default = SchedulerConfig()
    sched.setdefault("max_num_batched_tokens", max(
        default.max_num_batched_tokens, sched.get("max_num_seqs", default.max_num_seqs)))
    # the cores this process may run on (a container's share, not the host's)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    spare_cores = (cores or 1) >= 2 * GPU_GRAMMAR_PROCESSES
    sched.setdefault("grammar_processes",
                     GPU_GRAMMAR_PROCESSES if device == "cuda" and spare_cores else 0)
    spec = model_kwargs.get("speculative_config")
    spec = SpeculativeConfig.from_dict(spec) if spec is not None else None
    draft = None
    if spec is not None and spec.method in DRAFTING_MODELS:
        try:
            draft_path, draft_hf = _resolve_model(spec.model, load_format)
            source = f"{draft_path or spec.model}/config.json"
            if spec.method == "eagle3":
                _check(draft_path is not None, "model", "an EAGLE-3 head is a local folder")
                draft_arch = eagle3_config(draft_hf, source).arch
            else:
                draft_arch = arch_from_hf_config(draft_hf, source=source)
        except (FileNotFoundError, ValueError) as e:
            raise ValueError(f"speculative_config.model: {e}") from None
        draft = replace(model_cfg, model=spec.model, path=draft_path, tokenizer=draft_path,
                        arch=draft_arch)
    return EngineConfig(
        model=model_cfg,
        cache=cache,
        scheduler=SchedulerConfig(max_model_len=model_cfg.max_model_len, **sched),
        parallel=parallel,
        device=device_cfg,
        speculative=spec,
        draft_model=draft,
    )
