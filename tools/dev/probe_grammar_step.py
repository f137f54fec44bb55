"""What the core's grammar work costs per decode step on this host, by strategy: advancing N
matchers by one sampled token each (accept) and filling their next bitmask rows (fill).

    python tools/dev/probe_grammar_step.py [--rows 64] [--vocab 151936] [--threads 1 2 4 8]

The grammar and widths are tools/bench_structured.py's (its JSON schema, built as the engine
builds it and compiled against the embedded SmolLM2 tokenizer at --vocab; --counted-whitespace:
with the whitespace bound compiled into the grammar, as the engine had it until 2026-12-04,
which this probe did not see then); each step samples a random allowed token per row, as
dummy weights do. Every strategy replays the same token sequences on fresh matchers:
- accept loop: accept_token per matcher in one thread (what StructuredOutputManager.accept does)
- accept batch: xgrammar's BatchGrammarMatcher.batch_accept_token, one call for every matcher
- accept on K threads: the matchers split into K slices, a thread each (xgrammar releases the
  GIL inside accept_token)
- fill loop / fill batch: fill_next_token_bitmask per matcher, or BatchGrammarMatcher's fill
- accept + fill on K threads: each thread advances its slice and fills its rows
- engine pass: StructuredOutputManager.accept_and_fill, what the core runs (each request
  advanced, then its row filled, with the reasoning gate and the whitespace bound), in the busy
  loop and over --grammar-processes processes (the core's wait, rows packed)
- accept loop beside a busy thread: the accept loop while another Python thread runs bytecode
  without pause (each return from accept_token, which releases the GIL, waits for it back)
"""

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xgrammar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_structured import SCHEMA  # noqa: E402

from echo import StructuredOutputsParams  # noqa: E402
from echo.structured_output.grammar_spec import MAX_JSON_WHITESPACE, build_grammar  # noqa: E402


def allowed_tokens(row: np.ndarray, vocab: int) -> np.ndarray:
    bits = (row.view(np.uint32)[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    return np.nonzero(bits.ravel()[:vocab])[0]


def sample_sequences(grammar, rows: int, steps: int, vocab: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    matchers = [xgrammar.GrammarMatcher(grammar) for _ in range(rows)]
    mask = np.zeros((rows, -(-vocab // 32)), dtype=np.int32)
    sequences = [[] for _ in range(rows)]
    for _ in range(steps):
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
            token = int(rng.choice(allowed_tokens(mask[i], vocab)))
            sequences[i].append(token)
            assert m.accept_token(token)
    return sequences


def timed_steps(grammar, sequences, vocab: int, step, untimed=None) -> float:
    """Mean ms per step of step(matchers, tokens, mask) over the sequences, fresh matchers;
    untimed(matchers, tokens, mask) runs before it each step (the fills' own accepts)."""
    rows, steps = len(sequences), len(sequences[0])
    matchers = [xgrammar.GrammarMatcher(grammar) for _ in range(rows)]
    mask = np.zeros((rows, -(-vocab // 32)), dtype=np.int32)
    total = 0.0
    for s in range(steps):
        tokens = [seq[s] for seq in sequences]
        if untimed is not None:
            untimed(matchers, tokens, mask)
        start = time.perf_counter()
        step(matchers, tokens, mask)
        total += time.perf_counter() - start
    return 1e3 * total / steps


def engine_pass(tokenizer, vocab: int, sequences, num_processes: int = 0) -> float:
    """Mean ms per step of the core's own pass over the same token sequences, in the busy
    loop or over num_processes grammar processes."""
    from echo import SamplingParams
    from echo.core.request import Request
    from echo.core.step_results import EngineCoreOutput
    from echo.structured_output.manager import StructuredOutputManager

    rows, steps = len(sequences), len(sequences[0])
    manager = StructuredOutputManager(lambda: tokenizer, vocab, (tokenizer.eos_token_id,), rows,
                                      num_processes=num_processes)
    try:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(json=SCHEMA))
        ids = [f"r{i}" for i in range(rows)]
        for rid in ids:
            manager.add(Request(rid, [0], params))
        while manager.compiling:
            manager.wait_for_compiles(60)
            if manager.poll():
                raise RuntimeError("the schema did not compile")
        manager.accept_and_fill([], -1, ids)  # untimed: the processes' start and first fill
        total = 0.0
        for step in range(steps):
            outputs = [EngineCoreOutput(rid, [seq[step]]) for rid, seq in zip(ids, sequences)]
            start = time.perf_counter()
            refused, _ = manager.accept_and_fill(outputs, step, ids)
            total += time.perf_counter() - start
            if refused:
                raise RuntimeError(f"refused: {refused[:2]}")
        return 1e3 * total / steps
    finally:
        manager.shutdown()


def beside_busy_thread(measure):
    """measure() while another thread spins in Python."""
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        return measure()
    finally:
        stop.set()
        spinner.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--grammar-processes", type=int, nargs="*", default=[2, 4],
                        help="engine pass over this many grammar processes, for each")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default=None, help="default: the embedded SmolLM2's")
    parser.add_argument("--counted-whitespace", action="store_true",
                        help="the JSON whitespace bounded in the grammar (xgrammar's "
                             "max_whitespace_cnt), as the engine compiled it before 2026-12-04")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from echo.models.default_model import ensure_default_model

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or str(ensure_default_model()))
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=args.vocab,
                                                   stop_token_ids=[tokenizer.eos_token_id])
    # the grammar the engine compiles for this schema, or the whitespace bound compiled in
    if args.counted_whitespace:
        grammar_spec = xgrammar.Grammar.from_json_schema(
            json.dumps(SCHEMA), any_whitespace=True, max_whitespace_cnt=MAX_JSON_WHITESPACE)
    else:
        grammar_spec = build_grammar(StructuredOutputsParams(json=SCHEMA))
    grammar = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False) \
        .compile_grammar(grammar_spec)
    sequences = sample_sequences(grammar, args.rows, args.steps, args.vocab, args.seed)
    batch = xgrammar.BatchGrammarMatcher()

    def accept(matchers, tokens, _mask, indices=None):
        for i in indices if indices is not None else range(len(matchers)):
            matchers[i].accept_token(tokens[i])

    def fill_loop(matchers, _tokens, mask, indices=None):
        for i in indices if indices is not None else range(len(matchers)):
            matchers[i].fill_next_token_bitmask(mask, i)

    def both(matchers, tokens, mask, indices=None):
        accept(matchers, tokens, mask, indices)
        fill_loop(matchers, tokens, mask, indices)

    results = {"rows": args.rows, "vocab": args.vocab,
               "accept_loop_ms": timed_steps(grammar, sequences, args.vocab, accept),
               "accept_batch_ms": timed_steps(
                   grammar, sequences, args.vocab,
                   lambda m, tokens, _mask: xgrammar.BatchGrammarMatcher.batch_accept_token(
                       m, tokens)),
               "fill_loop_ms": timed_steps(grammar, sequences, args.vocab, fill_loop, accept),
               "fill_batch_ms": timed_steps(
                   grammar, sequences, args.vocab,
                   lambda m, _t, mask: batch.batch_fill_next_token_bitmask(m, mask), accept)}
    for threads in args.threads:
        with ThreadPoolExecutor(threads) as pool:
            def split(work, pool=pool, threads=threads):
                def step(matchers, tokens, mask):
                    slices = [range(k, len(matchers), threads) for k in range(threads)]
                    list(pool.map(lambda idx: work(matchers, tokens, mask, idx), slices))
                return step

            results[f"accept_threads{threads}_ms"] = timed_steps(grammar, sequences,
                                                                 args.vocab, split(accept))
            results[f"accept_fill_threads{threads}_ms"] = timed_steps(grammar, sequences,
                                                                      args.vocab, split(both))
    if not args.counted_whitespace:
        results["engine_pass_ms"] = engine_pass(tokenizer, args.vocab, sequences)
        for count in args.grammar_processes:
            results[f"engine_pass_processes{count}_ms"] = engine_pass(
                tokenizer, args.vocab, sequences, count)
    results["accept_loop_beside_busy_thread_ms"] = beside_busy_thread(
        lambda: timed_steps(grammar, sequences, args.vocab, accept))
    for key, value in results.items():
        print(f"{key:<28} {value:.3f}" if isinstance(value, float) else f"{key:<28} {value}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
