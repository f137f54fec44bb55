"""Grammar compilation on worker threads, one compiled grammar per constraint, cached.

Compiling against the tokenizer (walking the vocabulary for every grammar state) is the costly
part: tens of milliseconds for a JSON schema, more for large grammars. It runs on a small
thread pool, xgrammar's C++ releasing the GIL, so the busy loop keeps stepping while it runs.
The cache holds futures by the constraint's key (the tokenizer is the engine's, fixed), so
requests sharing a schema share one compilation, also while it is still running.
"""

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar

from echo.sampling_params import StructuredOutputsParams
from echo.structured_output.grammar_spec import build_grammar
from echo.structured_output.whitespace import WhitespaceTokens

COMPILE_THREADS = 2
# compiled grammars kept for reuse; each holds per-state token masks, from kilobytes for a
# regex to a few megabytes for a large schema
CACHE_ENTRIES = 256


class GrammarCompilerPool:
    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int,
                 stop_token_ids: tuple[int, ...]):
        """load_tokenizer: returns the model's Hugging Face tokenizer; called once, on the
        first compile (a core that serves no structured request never loads it)."""
        self._load_tokenizer = load_tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        # the vocabulary's whitespace-only tokens: set with the compiler, so before any
        # compile finishes
        self.whitespace: WhitespaceTokens | None = None
        self._compiler_lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="echo-grammar")
        self._cache: OrderedDict[tuple, Future] = OrderedDict()

    def submit(self, params: StructuredOutputsParams) -> Future:
        """The compiled grammar of params, as a future (shared by equal constraints)."""
        key = params.key
        future = self._cache.get(key)
        if future is not None:
            self._cache.move_to_end(key)
            if not future.done() or future.exception() is None:
                return future
        future = self._pool.submit(self._compile, params)
        self._cache[key] = future
        while len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)  # a request holding it keeps its own reference
        return future

    def num_compiling(self) -> int:
        return sum(not f.done() for f in self._cache.values())

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, params: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        return self._get_compiler().compile_grammar(build_grammar(params))

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                tokenizer = self._load_tokenizer()
                if tokenizer is None:
                    raise ValueError("structured_outputs: this model has no tokenizer to "
                                     "compile a grammar against")
                # the model's vocabulary size (the LM head's, often padded past the
                # tokenizer's): the mask must cover every logit; ids past the tokenizer's are
                # never allowed. The stop tokens are the engine's EOS ids
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self._vocab_size, stop_token_ids=self._stop_token_ids)
                self.whitespace = WhitespaceTokens.from_vocab(info.decoded_vocab,
                                                              self._vocab_size)
                # our cache above replaces xgrammar's, which would hold each grammar twice
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1,
                                                          cache_enabled=False)
            return self._compiler
