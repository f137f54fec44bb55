"""Speculative decoding's speedup against its acceptance length, with the oracle proposer.

    python tools/bench_spec.py [--model llama-3.1-8b] [--load-format dummy] [--batch-size 1]
        [--input-len 256] [--output-len 256] [--num-speculative-tokens 4]
        [--acceptance 0.5,0.77,0.9] [--iters 3] [--tp N] [--disable-by-batch-size N]
        [--token-determined] [--draft-model M] [--eagle3-head DIR|random] [--no-oracle]
        [--json F]

First the batch runs without speculation (greedy, ignore_eos), timed as tools/bench_latency.py
times it: a warm-up of the same shapes, then per iteration the batch for one token (prefill
alone) and for --output-len tokens; the difference over the extra tokens is the time per
decode step, the median over iterations is reported. Its outputs are the target's greedy
continuations: they are written to the oracle's file (--oracle-path, else a temporary one).
Then the same prompts run again, timed the same way, with speculative_config {"method":
"oracle", "num_speculative_tokens": k, "oracle_path": ..., "oracle_acceptance": p}: first at
p = 0, whose outputs replace the file's continuations (every token then comes from the first
row of a 1 + k verification: with dummy weights, near-tie argmaxes flip between one-token
decoding and verification numerics, and the later runs' rows agree with a verification run's),
then for each p of --acceptance. The oracle proposes the target's own next tokens, each right
with probability p (echo/core/oracle_proposer.py), so the mechanism's cost and gain are
measured with any weights, dummy ones included.

Reports per p: decode tok/s, the speedup over the run without speculation, the measured mean
acceptance length (1 + accepted drafts per verification, from the engine's SchedulerStats:
1 + spec_num_accepted_tokens / spec_num_drafts over the timed runs) next to the expected
1 + sum_{i=1..k} p^i (a little above the measured one on short outputs: the last steps of a
request may draft fewer than k), whether every output equals the p = 0 recording (greedy
verification is lossless; a difference means a verification's argmax differed between rows),
and whether the recording equals the run without speculation (with real weights it should;
with dummy ones numerics may flip it). Each configuration runs in a fresh process, so one
engine's memory is gone before the next starts. Prefix caching is off so every run prefills.
--json writes it all; runs on the CPU too (--device cpu, a tiny model folder with
--load-format auto).
"""

import argparse
import json
import multiprocessing
import random
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from echo import LLM, SamplingParams  # noqa: E402
from echo.core.oracle_proposer import OracleProposer, save_continuations  # noqa: E402


def make_prompts(vocab_size: int, batch_size: int, input_len: int, seed: int = 0):
    """batch_size distinct random prompts (the oracle tells requests apart by prompt)."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for _ in range(100 * batch_size):
        prompt = [rng.randrange(vocab_size) for _ in range(input_len)]
        if prompt not in prompts:
            prompts.append(prompt)
            if len(prompts) == batch_size:
                return prompts
    raise ValueError(f"cannot draw {batch_size} distinct prompts of {input_len} tokens")


def time_decode(engine_args: dict, prompts: list[list[int]], output_len: int,
                iters: int) -> dict:
    """bench_latency's measurement of one engine: prefill and per-step decode times (medians),
    every timed run's output token ids, and the speculative decoding counters of the timed
    runs (the one-token runs draft nothing)."""
    token_determined = engine_args.pop("token_determined", False)
    llm = LLM(**engine_args)
    try:
        if token_determined:
            make_logits_token_determined(llm)
        vocab_size = llm.config.model.arch.vocab_size
        if any(t >= vocab_size for p in prompts for t in p):
            raise ValueError(f"prompt token ids past the model's vocabulary ({vocab_size})")

        def run(tokens: int) -> tuple[float, list[list[int]]]:
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=tokens)
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            return time.perf_counter() - start, [list(o.outputs[0].token_ids) for o in outputs]

        _, warm_up = run(output_len)  # every kernel shape of the measured runs compiled here
        before = llm.stats()
        prefill_s, per_token_s, outputs = [], [], [warm_up]
        for _ in range(iters):
            prefill, _ = run(1)
            full, tokens = run(output_len)
            prefill_s.append(prefill)
            per_token_s.append((full - prefill) / (output_len - 1))
            outputs.append(tokens)
        after = llm.stats()
    finally:
        llm.shutdown()
    ms = statistics.median(per_token_s) * 1e3
    per_position = [a - b for a, b in zip(after.spec_accepted_per_position,
                                          before.spec_accepted_per_position
                                          + [0] * len(after.spec_accepted_per_position))]
    return {"prefill_ms": round(statistics.median(prefill_s) * 1e3, 2),
            "decode_ms_per_step": round(ms, 3),
            "decode_tok_per_s": round(len(prompts) * 1e3 / ms, 1),
            "outputs": outputs,
            "num_drafts": after.spec_num_drafts - before.spec_num_drafts,
            "num_draft_tokens": after.spec_num_draft_tokens - before.spec_num_draft_tokens,
            "num_accepted_tokens": (after.spec_num_accepted_tokens
                                    - before.spec_num_accepted_tokens),
            "accepted_per_position": per_position}


@torch.inference_mode()
def make_logits_token_determined(llm: LLM) -> None:
    """Zero every layer's o_proj and down_proj (an in-process engine, tensor_parallel_size 1):
    each layer then adds exactly nothing to the residual stream, the logits are a function of
    the input token alone with margins of random 4096-wide dot products, and one-token decoding
    and a verification's rows agree on every argmax. Every kernel still runs on the same shapes
    (zeros are multiplied like any value), so the step costs what it did; with plain dummy
    weights the logits are near ties whose argmax flips with either step's numerics."""
    for layer in llm.engine.executor.runner.model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def write_random_eagle3_head(folder: Path, model: str, load_format: str,
                             draft_vocab_size: int, seed: int = 0) -> Path:
    """An EAGLE-3 head with random weights in the published format (bfloat16), shaped for the
    target as the published Llama-3.1-8B head is (the target's attention and MLP widths, one
    layer, draft_vocab_size tokens of the target's vocabulary): its cost per step is that of
    a trained head, its drafts are rejected."""
    from safetensors.torch import save_file

    from echo.config import EngineConfig

    arch = EngineConfig.create(model, load_format=load_format).model.arch
    h, inter, d = arch.hidden_size, arch.intermediate_size, arch.head_dim
    draft_vocab_size = min(draft_vocab_size, arch.vocab_size)
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(torch.bfloat16)

    kept = torch.randperm(arch.vocab_size, generator=g)[:draft_vocab_size].sort().values
    t2d = torch.zeros(arch.vocab_size, dtype=torch.bool)
    t2d[kept] = True
    ones = torch.ones(h, dtype=torch.bfloat16)
    weights = {
        "fc.weight": rand(h, 3 * h),
        "midlayer.input_layernorm.weight": ones, "midlayer.hidden_norm.weight": ones.clone(),
        "midlayer.self_attn.q_proj.weight": rand(arch.num_heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(arch.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(arch.num_kv_heads * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, arch.num_heads * d),
        "midlayer.post_attention_layernorm.weight": ones.clone(),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": ones.clone(), "lm_head.weight": rand(draft_vocab_size, h),
        "d2t": kept - torch.arange(draft_vocab_size), "t2d": t2d,
    }
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": h, "intermediate_size": inter, "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads, "head_dim": d, "num_hidden_layers": 1,
        "vocab_size": arch.vocab_size, "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": arch.rms_norm_eps, "rope_theta": arch.rope_theta,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}))
    return folder


def time_draft_model(args: argparse.Namespace, prompts: list[list[int]],
                     expected: list[list[int]], base: dict, method: str = "draft_model",
                     model: str | None = None) -> dict:
    """The same prompts with speculative method draft_model (--draft-model) or eagle3
    (--eagle3-head): the cost of a step that verifies k drafts and has the drafter propose k
    more, and the speedup that cost gives at an acceptance length L (L tokens per step
    against one per baseline step). With random weights nearly every draft is rejected, so
    the step is measured at length ~1; its cost hardly depends on the length (the drafter
    runs the same forwards whatever was accepted)."""
    k = args.num_speculative_tokens
    model = model or args.draft_model
    spec = {"method": method, "model": model, "num_speculative_tokens": k,
            "disable_by_batch_size": args.disable_by_batch_size}
    run = in_fresh_process(time_decode, {**engine_args(args), "speculative_config": spec},
                           prompts, args.output_len, args.iters)
    outputs = run.pop("outputs")
    drafts = run["num_drafts"]
    length = 1 + run["num_accepted_tokens"] / drafts if drafts else 1.0
    step_ms = run["decode_ms_per_step"] * length  # per verification, not per token
    row = {"method": method, "model": model, **run, "acceptance_length": round(length, 3),
           "ms_per_verification_step": round(step_ms, 3),
           "outputs_equal_baseline": all(o == expected for o in outputs),
           "speedup_at_length": {
               str(n): round(n * base["decode_ms_per_step"] / step_ms, 3) for n in (2, 3, 4)}}
    print(f"  {method} {model}: {step_ms:.3f} ms per verification step "
          f"(acceptance length {length:.2f}); speedup at length 2/3/4: "
          + " / ".join(f"{v:.2f}x" for v in row["speedup_at_length"].values()))
    return row


def _child(conn, fn, args) -> None:
    try:
        conn.send((True, fn(*args)))
    except BaseException:
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()


def in_fresh_process(fn, *args):
    """fn(*args) in a spawned process (not a daemon: the engine may start its own workers)."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(sender, fn, args), daemon=False)
    process.start()
    sender.close()
    try:
        ok, value = receiver.recv()
    except EOFError:
        process.join()
        raise RuntimeError(
            f"the benchmark process died (exit code {process.exitcode})") from None
    process.join()
    if not ok:
        raise RuntimeError(f"the benchmark process failed:\n{value}")
    return value


def vocab_size_of(args: argparse.Namespace) -> int:
    from echo.config import EngineConfig

    config = EngineConfig.create(args.model, **engine_args(args, model_only=True))
    return config.model.arch.vocab_size


def engine_args(args: argparse.Namespace, model_only: bool = False) -> dict:
    kwargs = {"load_format": args.load_format, "max_model_len": args.max_model_len,
              "device": args.device}
    if model_only:
        return kwargs
    kwargs.update(model=args.model, max_num_seqs=args.batch_size, enable_prefix_caching=False,
                  kv_cache_dtype=args.kv_cache_dtype, enforce_eager=args.enforce_eager,
                  tensor_parallel_size=args.tp)
    if args.num_gpu_blocks_override is not None:
        kwargs["num_gpu_blocks_override"] = args.num_gpu_blocks_override
    if args.token_determined:
        kwargs["token_determined"] = True
    return kwargs


def parse_acceptance(text: str) -> list[float]:
    values = [float(v) for v in text.split(",") if v.strip()]
    if not values or not all(0 <= v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"need probabilities in [0, 1], got {text!r}")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--num-speculative-tokens", "-k", type=int, default=4)
    parser.add_argument("--acceptance", type=parse_acceptance, default="0.5,0.77,0.9",
                        help="comma-separated probabilities that each draft is right")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-gpu-blocks-override", type=int)
    parser.add_argument("--disable-by-batch-size", type=int,
                        help="speculative_config.disable_by_batch_size: no drafts in a step "
                             "with more running requests")
    parser.add_argument("--draft-model",
                        help="also time speculative method draft_model with this draft (a "
                             "folder, or a preset with --load-format dummy)")
    parser.add_argument("--eagle3-head",
                        help="also time speculative method eagle3 with this head's folder, or "
                             "'random': a random head shaped for the target")
    parser.add_argument("--eagle3-draft-vocab", type=int, default=32000,
                        help="the random head's draft vocabulary (the published "
                             "Llama-3.1-8B head's: 32000)")
    parser.add_argument("--no-oracle", action="store_true",
                        help="skip the oracle's runs (time the drafters only)")
    parser.add_argument("--token-determined", action="store_true",
                        help="zero every layer's o_proj and down_proj, so that the logits "
                             "depend on the input token alone and argmaxes do not flip with "
                             "numerics (dummy weights; tensor parallelism 1)")
    parser.add_argument("--oracle-path", help="keep the oracle's file here (else a temporary)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.output_len < 2:
        parser.error("--output-len must be at least 2")
    if args.no_oracle and not (args.draft_model or args.eagle3_head):
        parser.error("--no-oracle times nothing without --draft-model or --eagle3-head")
    if args.token_determined and args.tp != 1:
        parser.error("--token-determined needs --tp 1 (it edits the in-process engine's weights)")
    if args.batch_size < 1 or args.input_len < 1 or args.iters < 1:
        parser.error("--batch-size, --input-len and --iters must be at least 1")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    k = args.num_speculative_tokens
    prompts = make_prompts(vocab_size_of(args), args.batch_size, args.input_len)
    base = in_fresh_process(time_decode, engine_args(args), prompts, args.output_len,
                            args.iters)
    continuations = base.pop("outputs")
    deterministic = all(run == continuations[0] for run in continuations)
    result = {"model": args.model, "batch_size": args.batch_size, "input_len": args.input_len,
              "output_len": args.output_len, "num_speculative_tokens": k, "iters": args.iters,
              "kv_cache_dtype": args.kv_cache_dtype, "enforce_eager": args.enforce_eager,
              "tp": args.tp, "disable_by_batch_size": args.disable_by_batch_size,
              "token_determined": args.token_determined,
              "baseline": {key: base[key] for key in
                           ("prefill_ms", "decode_ms_per_step", "decode_tok_per_s")},
              "baseline_deterministic": deterministic, "speculative": []}
    print(f"{args.model} B={args.batch_size} in={args.input_len} out={args.output_len} k={k}")
    print(f"  no speculation: prefill {base['prefill_ms']} ms, decode "
          f"{base['decode_ms_per_step']:.3f} ms/step ({base['decode_tok_per_s']:,} tok/s)"
          + ("" if deterministic else "  (NOT deterministic across runs)"))
    with tempfile.TemporaryDirectory() as folder:
        oracle_path = args.oracle_path or str(Path(folder) / "oracle.json")
        save_continuations(oracle_path, {tuple(p): c for p, c in zip(prompts, continuations[0])})
        # acceptance 0 first: every token is the first row of a 1 + k verification, and its
        # outputs become the oracle's continuations, so later runs' rows agree with them
        # (with dummy weights one-token decoding's numerics flip near-tie argmaxes)
        for p in [] if args.no_oracle else [0.0] + [p for p in args.acceptance if p != 0.0]:
            spec = {"method": "oracle", "num_speculative_tokens": k,
                    "oracle_path": oracle_path, "oracle_acceptance": p,
                    "disable_by_batch_size": args.disable_by_batch_size}
            run = in_fresh_process(time_decode, {**engine_args(args), "speculative_config": spec},
                                   prompts, args.output_len, args.iters)
            outputs = run.pop("outputs")
            if p == 0.0:
                recorded = outputs[0]
                result["recording_equals_baseline"] = recorded == continuations[0]
                save_continuations(oracle_path, {tuple(p): c for p, c in zip(prompts, recorded)})
            mismatched = sum(tokens != expected for run_outputs in outputs
                             for tokens, expected in zip(run_outputs, recorded))
            drafts = run["num_drafts"]
            row = {"acceptance": p,
                   "expected_acceptance_length": round(
                       1 + OracleProposer.expected_accepted(p, k), 3),
                   "acceptance_length": round(1 + run["num_accepted_tokens"] / drafts, 3)
                   if drafts else None,
                   **run,
                   "speedup": round(run["decode_tok_per_s"] / base["decode_tok_per_s"], 3),
                   "outputs_equal": mismatched == 0, "mismatched_outputs": mismatched}
            result["speculative"].append(row)
            length = "n/a" if row["acceptance_length"] is None else row["acceptance_length"]
            print(f"  oracle p={p:<5}: decode {row['decode_ms_per_step']:.3f} ms/step "
                  f"({row['decode_tok_per_s']:,} tok/s, {row['speedup']:.2f}x), acceptance "
                  f"length {length} (expected {row['expected_acceptance_length']}), outputs "
                  + ("equal" if mismatched == 0 else
                     f"DIFFER ({mismatched} of {(args.iters + 1) * args.batch_size})"))
        if args.draft_model:
            result["draft_model"] = time_draft_model(args, prompts, continuations[0], base)
        if args.eagle3_head:
            head = args.eagle3_head
            if head == "random":
                head = str(write_random_eagle3_head(Path(folder) / "eagle3", args.model,
                                                    args.load_format, args.eagle3_draft_vocab))
            result["eagle3"] = time_draft_model(args, prompts, continuations[0], base,
                                                "eagle3", head)
    if args.no_oracle:
        return _finish(args, result)
    result["outputs_equal"] = all(r["outputs_equal"] for r in result["speculative"])
    print("greedy outputs with speculation equal the recording (acceptance 0): "
          + ("yes" if result["outputs_equal"] else "NO") + "; the recording equals the run "
          "without speculation: " + ("yes" if result["recording_equals_baseline"] else
                                     "no (numerics)"))
    return _finish(args, result)


def _finish(args: argparse.Namespace, result: dict) -> dict:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":  # the benchmark's processes are spawned: keep this guard
    main()
