"""Command line: `python -m echo generate ...` (console script `echollm`)."""

import argparse
import sys

from echo.config import KV_CACHE_DTYPES
from echo.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags with the names vLLM users type; each maps to an EngineConfig.create kwarg."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="default",
                   help="local Hugging Face folder, a preset (with --load-format dummy), or "
                        "'default' (embedded SmolLM2-135M-Instruct)")
    g.add_argument("--tokenizer")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"])
    g.add_argument("--max-model-len", type=int)
    g.add_argument("--block-size", type=int)
    g.add_argument("--gpu-memory-utilization", type=float)
    g.add_argument("--num-gpu-blocks-override", type=int)
    g.add_argument("--max-num-seqs", type=int)
    g.add_argument("--max-num-batched-tokens", type=int)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None)
    # -tp is vLLM's short form, --tp-size SGLang's
    g.add_argument("--tensor-parallel-size", "--tp", "-tp", "--tp-size", type=int,
                   dest="tensor_parallel_size")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES))
    g.add_argument("--enforce-eager", action="store_true", default=None)
    g.add_argument("--load-format", choices=["auto", "safetensors", "dummy"])
    g.add_argument("--seed", type=int)
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--device", choices=["auto", "cuda", "cpu"])
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"])


ENGINE_ARG_NAMES = (
    "tokenizer", "dtype", "max_model_len", "block_size", "gpu_memory_utilization",
    "num_gpu_blocks_override", "max_num_seqs", "max_num_batched_tokens",
    "enable_prefix_caching", "tensor_parallel_size", "kv_cache_dtype", "enforce_eager",
    "load_format", "seed", "async_scheduling", "device", "attention_backend",
)


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARG_NAMES
            if getattr(args, name, None) is not None}


def _generate(args: argparse.Namespace) -> int:
    from echo.entrypoints.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.sampling_seed,
                            ignore_eos=args.ignore_eos)
    prompts = args.prompt or ["What is the capital of France?"]
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params,
                           use_tqdm=False)
    else:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        print(f"> {prompt}\n{out.outputs[0].text}\n")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from echo.entrypoints.serve import serve

    return serve(args, engine_kwargs(args))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="echollm", description="echo LLM engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap prompts in the model's chat template (default on)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=-1)
    gen.add_argument("--sampling-seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.set_defaults(handler=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_engine_args(srv)
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--served-model-name", action="append",
                     help="name(s) clients use for the model (default: --model)")
    srv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1 routes "
                     "(default: $ECHO_API_KEY)")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may finish after SIGTERM")
    srv.add_argument("--max-request-bytes", type=int, default=16 * 2**20)
    srv.add_argument("--log-level", default="info")
    srv.set_defaults(handler=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, FileNotFoundError, TypeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the engine failed to start (a worker's traceback is inside)
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
