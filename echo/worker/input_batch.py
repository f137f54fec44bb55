"""The worker's persistent view of running requests, updated from SchedulerOutput diffs.

Each request owns a row of preallocated numpy tables (token ids, block table, sampling
settings); a step's inputs are gathered from those rows with vectorized indexing, so the host
work per step grows with the tokens scheduled, not with Python objects.
"""

from dataclasses import dataclass, field

import numpy as np

from echo.core.sched_output import SchedulerOutput
from echo.sampling_params import SamplingParams


@dataclass
class StepInputs:
    """Host arrays for one step, in the order of scheduler_output.num_scheduled_tokens."""

    req_ids: list[str]
    rows: np.ndarray  # [num_seqs] row of each request
    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_tokens] int64
    block_table: np.ndarray  # [num_seqs, max_blocks] int32
    cu_seqlens_q: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    sample_seq_idx: np.ndarray  # indices (into the seqs) of requests that sample this step
    logits_indices: np.ndarray  # their last token's index in the flat token batch
    # tokens whose value the previous step is still sampling on the device: their index in
    # the flat batch, and the row they belong to
    placeholder_idx: np.ndarray
    placeholder_rows: np.ndarray
    # speculative decoding: per sampling request, its drafts verified this step (0: none); its
    # logits rows are its last 1 + drafts tokens. None when the step has no drafts
    num_drafts: np.ndarray | None = None


@dataclass
class TokenRules:
    """One request's logit_bias, allowed_token_ids and bad words, as arrays of the ids inside
    the vocabulary, built once when the request joins the batch."""

    bias_ids: np.ndarray | None = None  # [K] int64
    bias_values: np.ndarray | None = None  # [K] float32
    allowed_ids: np.ndarray | None = None  # [A] int64
    always_banned: np.ndarray | None = None  # [S] int64: single-token bad words
    # multi-token bad words: (the tokens before the last, the last)
    sequences: list[tuple[list[int], int]] = field(default_factory=list)
    longest_prefix: int = 0

    @staticmethod
    def of(params: SamplingParams, vocab_size: int) -> "TokenRules | None":
        if not params.has_token_rules:
            return None
        rules = TokenRules()
        if params.logit_bias:
            bias = [(t, b) for t, b in params.logit_bias.items() if t < vocab_size]
            rules.bias_ids = np.array([t for t, _ in bias], dtype=np.int64)
            rules.bias_values = np.array([b for _, b in bias], dtype=np.float32)
        if params.allowed_token_ids is not None:
            rules.allowed_ids = np.unique(np.array(
                [t for t in params.allowed_token_ids if t < vocab_size], dtype=np.int64))
        words = [ids for ids in params.bad_words_token_ids or []
                 if all(t < vocab_size for t in ids)]
        rules.always_banned = np.array(sorted({ids[0] for ids in words if len(ids) == 1}),
                                       dtype=np.int64)
        rules.sequences = [(ids[:-1], ids[-1]) for ids in words if len(ids) > 1]
        rules.longest_prefix = max((len(prefix) for prefix, _ in rules.sequences), default=0)
        return rules

    def banned_after(self, output: np.ndarray) -> np.ndarray:
        """The bad-word tokens banned next, given the output so far (vLLM's rule: a word's
        last token, where the output ends with the word's earlier tokens)."""
        tail = output[max(0, len(output) - self.longest_prefix):].tolist()
        banned = [last for prefix, last in self.sequences
                  if len(prefix) <= len(tail) and tail[len(tail) - len(prefix):] == prefix]
        if not banned:
            return self.always_banned
        return np.concatenate([self.always_banned, np.array(banned, dtype=np.int64)])


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 block_size: int, seed: int = 0):
        self.block_size = block_size
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        # tokens sampled on the device whose values have not reached the host yet
        self.num_pending = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.zeros(max_num_reqs, dtype=np.float32)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeds = np.zeros(max_num_reqs, dtype=np.int64)
        self.logprobs = np.full(max_num_reqs, -1, dtype=np.int64)  # top-N asked for; -1: none
        self.min_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.has_penalties = np.zeros(max_num_reqs, dtype=bool)
        self.token_rules: list[TokenRules | None] = [None] * max_num_reqs
        self.has_token_rules = np.zeros(max_num_reqs, dtype=bool)
        # sampling reads the request's output tokens on the host: penalties, multi-token bad
        # words; the runner lands the steps in flight first while any such request is held
        self.reads_outputs = np.zeros(max_num_reqs, dtype=bool)
        self.num_reading_outputs = 0  # requests held now that read their outputs on the host
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_reqs - 1, -1, -1))
        # seeds for requests that gave none: same sequence on every TP rank
        self._seed_rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return len(self.row_of)

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.params[row] = None
            self.num_reading_outputs -= int(self.reads_outputs[row])
            self.has_penalties[row] = self.reads_outputs[row] = False
            self.token_rules[row] = None
            self.has_token_rules[row] = False
            self.free_rows.append(row)

    def add(self, req_id: str, prompt: list[int], output: list[int], params: SamplingParams,
            block_ids: list[int], num_computed: int, vocab_size: int) -> None:
        if req_id in self.row_of:
            self.remove(req_id)
        row = self.free_rows.pop()
        self.row_of[req_id] = row
        tokens = prompt + output
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_pending[row] = 0
        self.num_prompt_tokens[row] = len(prompt)
        self.num_computed[row] = num_computed
        self.num_blocks[row] = 0
        self.append_blocks(row, block_ids)
        self.params[row] = params
        self.temperature[row] = 0.0 if params.greedy else params.temperature
        self.top_k[row] = params.top_k if params.top_k > 0 else vocab_size
        self.top_p[row] = params.top_p
        self.min_p[row] = params.min_p
        self.logprobs[row] = -1 if params.logprobs is None else params.logprobs
        self.min_tokens[row] = params.min_tokens
        self.has_penalties[row] = params.has_penalties
        rules = TokenRules.of(params, vocab_size)
        self.token_rules[row] = rules
        self.has_token_rules[row] = rules is not None
        self.reads_outputs[row] = params.has_penalties or bool(rules and rules.sequences)
        self.num_reading_outputs += int(self.reads_outputs[row])
        seed = params.seed
        self.seeds[row] = seed if seed is not None else int(self._seed_rng.integers(0, 2**62))

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        start = self.num_blocks[row]
        self.block_table[row, start:start + len(block_ids)] = block_ids
        self.num_blocks[row] = start + len(block_ids)

    def update(self, out: SchedulerOutput, vocab_size: int) -> None:
        """Apply one step's diff: forget finished requests, add new ones, extend the rest."""
        for req_id in out.finished_req_ids:
            self.remove(req_id)
        for new in out.scheduled_new_reqs:
            self.add(new.req_id, new.prompt_token_ids, new.output_token_ids, new.sampling_params,
                     new.block_ids, new.num_computed_tokens, vocab_size)
        cached = out.scheduled_cached_reqs
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids,
                                            cached.num_computed_tokens):
            row = self.row_of[req_id]
            if blocks:
                self.append_blocks(row, blocks)
            self.num_computed[row] = computed
        for req_id, drafts in out.scheduled_spec_decode_tokens.items():
            # after the known tokens, tentatively: they become tokens only if accepted
            row = self.row_of[req_id]
            self.token_ids[row, self.num_tokens[row]:self.num_tokens[row] + len(drafts)] = drafts

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        # NOTE: array methods and ufuncs rather than numpy's module functions (np.cumsum,
        # np.repeat, np.nonzero): those dispatch through Python first, and with one step in
        # flight the device waits for every call, each a few µs with the caches cold
        # (docs/benchmarks.md, Speculative decoding)
        scheduled = out.num_scheduled_tokens
        req_ids = list(scheduled)
        row_of = self.row_of
        rows = np.array([row_of[r] for r in req_ids], dtype=np.int64)
        counts = np.fromiter(scheduled.values(), dtype=np.int64, count=len(req_ids))
        starts = self.num_computed[rows]
        cu = np.zeros(len(req_ids) + 1, dtype=np.int32)
        np.add.accumulate(counts, out=cu[1:])
        token_rows = rows.repeat(counts)
        positions = (starts - cu[:-1]).repeat(counts) + np.arange(cu[-1], dtype=np.int64)
        seq_lens = (starts + counts).astype(np.int32)
        max_blocks = int(self.num_blocks[rows].max()) if len(rows) else 0
        known = self.num_tokens[rows]
        samples = (seq_lens >= known + self.num_pending[rows]).nonzero()[0]
        logits_indices, num_drafts = cu[1:][samples] - 1, None
        spec = out.scheduled_spec_decode_tokens
        if not spec:
            # positions at or past the host's tokens hold values still on the device
            placeholders = (positions >= known.repeat(counts)).nonzero()[0]
        else:
            # with drafts one step is in flight: nothing is pending, and the positions past
            # the host's tokens are the drafts written in update()
            placeholders = np.zeros(0, dtype=np.int64)
            num_drafts = np.array([len(spec.get(req_ids[i], ())) for i in samples.tolist()],
                                  dtype=np.int64)
            # each request's rows: its drafts' and its last token's, the run ending at its
            # last token; row i of them all is (its request's last + 1 - rows through it) + i
            per_request = num_drafts + 1
            logits_indices = ((logits_indices + 1 - np.add.accumulate(per_request))
                              .repeat(per_request) + np.arange(per_request.sum()))
        return StepInputs(
            req_ids=req_ids,
            rows=rows,
            input_ids=self.token_ids[token_rows, positions],
            positions=positions,
            slot_mapping=self.slots(token_rows, positions),
            block_table=self.block_table[rows, :max_blocks],
            cu_seqlens_q=cu,
            seq_lens=seq_lens,
            sample_seq_idx=samples,
            logits_indices=logits_indices,
            placeholder_idx=placeholders,
            placeholder_rows=token_rows[placeholders],
            num_drafts=num_drafts,
        )

    def slots(self, token_rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """The KV slot of each (row, position), from the rows' block tables."""
        block, offset = np.divmod(positions, self.block_size)
        # an int64 scalar: the int32 block ids times it are int64 slots
        return self.block_table[token_rows, block] * np.int64(self.block_size) + offset

    def runs_inputs(self, req_ids: list[str], rows: np.ndarray, positions: np.ndarray,
                    counts: np.ndarray, input_ids: np.ndarray) -> StepInputs:
        """A step of its own over the given runs of positions (count per request, positions
        flattened), each run's last position sampled: a drafter's inputs over rows of this
        batch, whose blocks are allocated for them."""
        cu = np.zeros(len(rows) + 1, np.int32)
        np.cumsum(counts, out=cu[1:])
        none = np.zeros(0, np.int64)
        max_blocks = int(self.num_blocks[rows].max()) if len(rows) else 1
        return StepInputs(
            req_ids=req_ids, rows=rows, input_ids=input_ids, positions=positions,
            slot_mapping=self.slots(np.repeat(rows, counts), positions),
            block_table=self.block_table[rows, :max_blocks], cu_seqlens_q=cu,
            seq_lens=(positions[cu[1:] - 1] + 1).astype(np.int32),
            sample_seq_idx=np.arange(len(rows)), logits_indices=cu[1:] - 1,
            placeholder_idx=none, placeholder_rows=none)

    def last_token_inputs(self, req_ids: list[str], rows: np.ndarray) -> StepInputs:
        """A decode step over each row's last token (a drafter's first step)."""
        positions = self.num_tokens[rows] - 1
        return self.runs_inputs(req_ids, rows, positions, np.ones(len(rows), np.int64),
                                self.token_ids[rows, positions])

    def num_output_tokens(self, rows: np.ndarray) -> np.ndarray:
        """Generated so far, counting tokens still on the device."""
        return self.num_tokens[rows] + self.num_pending[rows] - self.num_prompt_tokens[rows]

    def append_tokens(self, req_id: str, token_ids: list[int]) -> None:
        """Several tokens of one request at once (accepted drafts and the token after)."""
        row = self.row_of[req_id]
        start = self.num_tokens[row]
        self.token_ids[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)

    def append_sampled(self, req_ids: list[str], token_ids: list[int]) -> None:
        """Tokens that reached the host; requests forgotten meanwhile are skipped."""
        row_of = self.row_of
        rows = np.fromiter((row_of.get(r, -1) for r in req_ids), dtype=np.int64,
                           count=len(req_ids))
        held = rows >= 0
        rows, tokens = rows[held], np.asarray(token_ids, dtype=np.int64)[held]
        self.token_ids[rows, self.num_tokens[rows]] = tokens
        self.num_tokens[rows] += 1
        self.num_pending[rows] = np.maximum(self.num_pending[rows] - 1, 0)
