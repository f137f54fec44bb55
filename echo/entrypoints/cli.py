"""Command line: `python -m echo generate ...` (console script `echollm`)."""

import argparse
import json
import sys

from echo.config import EngineArg, engine_arg_specs
from echo.entrypoints.parsers import REASONING_PARSERS, TOOL_PARSERS
from echo.sampling_params import SamplingParams


def _flag_options(spec: EngineArg) -> dict:
    """argparse options for one engine argument; its default is None, meaning "not given", so
    that the config's own default applies. Bools as vLLM's: a True default can be turned off
    (--no-...), a False one is a switch."""
    shown = ("on" if spec.default else "off") if spec.type is bool else spec.default
    text = spec.help if spec.default is None else f"{spec.help} (default: {shown})"
    options = {"dest": spec.name, "default": None, "help": text.replace("%", "%%")}
    if spec.type is bool:
        options["action"] = argparse.BooleanOptionalAction if spec.default else "store_true"
    elif spec.type is dict:  # a JSON object, as vLLM's --speculative-config
        options["type"] = _json_object
    else:
        options["type"] = spec.type
    if spec.choices is not None:
        options["choices"] = list(spec.choices)
    return options


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags with the names vLLM users type, made from the config's engine arguments
    (echo.config.engine_arg_specs): --max-model-len for max_model_len, plus its aliases."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None,
                   help="local Hugging Face folder, a preset (with --load-format dummy), or "
                        "'default' (embedded SmolLM2-135M-Instruct, the default)")
    for spec in engine_arg_specs():
        g.add_argument("--" + spec.name.replace("_", "-"), *spec.aliases, **_flag_options(spec))


def engine_kwargs(args: argparse.Namespace) -> dict:
    """EngineConfig.create keyword arguments: only the flags that were given."""
    return {spec.name: getattr(args, spec.name) for spec in engine_arg_specs()
            if getattr(args, spec.name, None) is not None}


def _json_list(text: str) -> list:
    value = json.loads(text)
    if not isinstance(value, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {text!r}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _whole_number(text: str, low: int, high: int | None = None) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if high is None and value < low:
        raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
    if high is not None and not low <= value <= high:
        raise argparse.ArgumentTypeError(f"must be in [{low}, {high}], got {value}")
    return value


def port_number(text: str) -> int:
    """argparse type of --port: a TCP port (0: any free one)."""
    return _whole_number(text, 0, 65535)


def positive_int(text: str) -> int:
    """argparse type of a count or size: a whole number >= 1."""
    return _whole_number(text, 1)


def api_key_arg(text: str) -> str:
    """argparse type of --api-key: an empty key (an unset shell variable, say) would leave the
    server open to everyone, so it is refused."""
    if not text:
        raise argparse.ArgumentTypeError("must not be empty (leave the flag out to serve "
                                         "without a key)")
    return text


def add_server_args(srv: argparse.ArgumentParser) -> None:
    """vLLM's `serve` flags, where echo does the same thing."""
    srv.add_argument("model_tag", nargs="?", metavar="MODEL",
                     help="the model, as `vllm serve MODEL` takes it (or --model)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=port_number, default=8000)
    srv.add_argument("--served-model-name", nargs="+", action="extend",
                     help="name(s) clients use for the model; the first is reported "
                          "(default: the model argument)")
    srv.add_argument("--api-key", type=api_key_arg,
                     help="require 'Authorization: Bearer KEY' on /v1 routes "
                          "(default: $ECHO_API_KEY)")
    srv.add_argument("--chat-template",
                     help="a Jinja chat template, or a file holding one, instead of the model's")
    srv.add_argument("--generation-config", default="auto",
                     help="'auto': request defaults (temperature, top_p, top_k, min_p, "
                          "repetition_penalty, max_new_tokens, extra EOS ids) from the model "
                          "folder's generation_config.json; a folder: from its file; 'vllm': "
                          "none (default: auto)")
    logs = srv.add_mutually_exclusive_group()
    logs.add_argument("--enable-log-requests", dest="log_requests", action="store_true",
                      default=False, help="log each request's id, prompt size and parameters")
    logs.add_argument("--disable-log-requests", dest="log_requests", action="store_false",
                      help="do not log requests (the default)")
    srv.add_argument("--log-level", "--uvicorn-log-level", dest="log_level", default="info",
                     choices=["critical", "error", "warning", "info", "debug", "trace"])
    srv.add_argument("--allowed-origins", type=_json_list, default=["*"],
                     help='CORS: a JSON list of origins (default: ["*"])')
    srv.add_argument("--allowed-methods", type=_json_list, default=["*"])
    srv.add_argument("--allowed-headers", type=_json_list, default=["*"])
    srv.add_argument("--allow-credentials", action="store_true")
    srv.add_argument("--ssl-keyfile")
    srv.add_argument("--ssl-certfile")
    srv.add_argument("--root-path", default="",
                     help="the path prefix a proxy serves this server under")
    srv.add_argument("--shutdown-timeout", type=float, default=30.0,
                     help="seconds in-flight requests may finish after SIGTERM")
    srv.add_argument("--max-request-bytes", type=positive_int, default=16 * 2**20)
    chat = srv.add_argument_group("tools and reasoning (chat completions)")
    chat.add_argument("--enable-auto-tool-choice", action="store_true",
                      help="let the model decide when to call tools (tool_choice auto); needs "
                           "--tool-call-parser")
    chat.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS),
                      help="the model's tool-call format: hermes (Qwen), llama3_json (Llama 3)")
    chat.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                      help="split a thinking model's <think> text into reasoning_content; a "
                           "structured output then applies after the reasoning")
    chat.add_argument("--default-chat-template-kwargs", type=_json_object, default=None,
                      help="JSON object of chat template arguments for every request, e.g. "
                           "'{\"enable_thinking\": false}'; a request's own override them")


# vLLM `serve` flags that change nothing in echo, taken so that a vLLM command line starts it:
# (flag, argparse keywords, why it changes nothing); serve prints the reason of each one given
VLLM_FLAGS_WITHOUT_EFFECT = (
    ("--trust-remote-code", {"action": "store_true"}, "echo never runs a model's own code"),
    ("--enable-chunked-prefill", {"action": "store_true"}, "echo always chunks prefills"),
    ("--disable-log-stats", {"action": "store_true"},
     "echo logs no periodic stats (GET /metrics has them)"),
    ("--max-log-len", {"type": int}, "request logs hold sizes and parameters, not prompts"),
    ("--download-dir", {}, "echo never downloads: models are local folders"),
    ("--disable-frontend-multiprocessing", {"action": "store_true"},
     "the API server is echo's frontend process already"),
    ("--swap-space", {"type": float},
     "preempted requests swap to the host tier: --kv-offloading-size with --preemption-mode "
     "swap"),
    ("--disable-hybrid-kv-cache-manager", {"action": "store_true"},
     "echo's models have one kind of attention layer, so one KV cache manager"),
)


def add_vllm_flags_without_effect(srv: argparse.ArgumentParser) -> None:
    group = srv.add_argument_group("vLLM flags taken without effect (serve says why)")
    for flag, kwargs, why in VLLM_FLAGS_WITHOUT_EFFECT:
        group.add_argument(flag, help=why, **kwargs)
    group.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                       help="1 only: echo splits a model by tensor parallelism")
    group.add_argument("--kv-offloading-backend", default="native",
                       help="native only: echo's own host tier, sized by --kv-offloading-size")


def flags_without_effect(args: argparse.Namespace) -> list[str]:
    """A note for each vLLM flag given that changes nothing (ValueError for a pipeline-parallel
    size or a KV offloading backend echo cannot run)."""
    if getattr(args, "pipeline_parallel_size", 1) != 1:
        raise ValueError(f"pipeline_parallel_size: echo has no pipeline parallelism, got "
                         f"{args.pipeline_parallel_size}; use --tensor-parallel-size or "
                         "--data-parallel-size")
    backend = getattr(args, "kv_offloading_backend", "native")
    if backend != "native":
        raise ValueError(f"kv_offloading_backend: echo's host tier is its own (native), there "
                         f"is no {backend!r} connector; give --kv-offloading-size alone")
    notes = []
    for flag, _, why in VLLM_FLAGS_WITHOUT_EFFECT:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value not in (None, False):
            notes.append(f"echo: {flag} has no effect: {why}")
    return notes


def resolve_model(args: argparse.Namespace) -> str:
    """The model from `serve MODEL` or --model (one of them, or both the same)."""
    tag = getattr(args, "model_tag", None)
    if tag and args.model and tag != args.model:
        raise ValueError(f"model: given twice, as {tag!r} and --model {args.model!r}")
    return tag or args.model or "default"


def _generate(args: argparse.Namespace) -> int:
    from echo.entrypoints.llm import LLM

    llm = LLM(resolve_model(args), **engine_kwargs(args))
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

    return serve(args, resolve_model(args), engine_kwargs(args))


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
    add_server_args(srv)
    add_vllm_flags_without_effect(srv)
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
