"""What a step produces: the rank-0 worker's ModelRunnerOutput (to the core) and the scheduler's
per-request EngineCoreOutput and SchedulerStats (to the frontend).

They sit next to SchedulerOutput because the scheduler both consumes the one and produces the
others; the engine layer above only carries them between processes.
"""

import msgspec


class LogprobsEntry(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of one sampled token: its own, and the top-N alternatives."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class PromptLogprobs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Logprobs of a run of prompt tokens: entry i is prompt token `start + i`, scored by the
    logits at the position before it (the first prompt token has none, so start >= 1)."""

    start: int
    logprobs: list[float] = []  # of the prompt token itself
    ranks: list[int] = []  # its rank among the vocabulary, 1 = most likely
    top_token_ids: list[list[int]] = []  # the top-N per entry ([] when N = 0)
    top_logprobs: list[list[float]] = []


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    req_ids: list[str] = []
    # per request: [] while its prefill is unfinished, else the tokens sampled this step (one,
    # or a verification's accepted drafts and the token after)
    sampled_token_ids: list[list[int]] = []
    # per request, parallel to sampled_token_ids: an entry per sampled token; None where no
    # logprobs were asked for
    logprobs: list[list[LogprobsEntry] | None] = []
    # request id -> the prompt logprobs this step's chunk produced (requests that asked only)
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    # KV host-tier transfers (SchedulerOutput.kv_transfers) this rank finished since
    # its last output, by transfer id, and this rank's cumulative bytes stored and loaded and
    # copy seconds (the metrics' figures: every rank moves the same share)
    finished_kv_transfers: list[int] = []
    kv_transfer_totals: tuple[int, int, float] | None = None
    # speculative methods draft_model and eagle3: request id -> the drafter's k tokens after
    # the step's (SchedulerOutput.draft_req_ids)
    draft_token_ids: dict[str, list[int]] = {}


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of blocks in use
    prefix_cache_queries: int = 0  # tokens looked up, cumulative
    prefix_cache_hits: int = 0  # tokens found, cumulative
    num_preemptions: int = 0  # cumulative
    num_total_blocks: int = 0
    # speculative decoding, cumulative: verifications (a request's drafts in one step), drafts,
    # accepted drafts, and accepted drafts by their position in the run
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = []
    # the KV cache's host tier, cumulative: tokens looked up there at admission, found there
    # (and loaded), blocks stored and loaded
    kv_host_queries: int = 0
    kv_host_hits: int = 0
    kv_stored_blocks: int = 0
    kv_loaded_blocks: int = 0
    # requests whose host-tier loads landed, and the seconds each waited for them (from the
    # step that started the load to the output that reported it done), summed
    kv_loads: int = 0
    kv_load_wait_seconds: float = 0.0
    kv_loads_joined: int = 0  # of kv_loads: run in the step that loaded them, no wait counted
    # ... and the bytes and copy seconds of all ranks together
    kv_stored_bytes: int = 0
    kv_loaded_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    # structured outputs, cumulative: the seconds advancing grammars past sampled tokens and
    # filling token bitmasks (host work on the step's critical path: the core's, or with
    # grammar processes the slowest process's each step), and the steps whose bitmask it filled
    grammar_accept_seconds: float = 0.0
    grammar_fill_seconds: float = 0.0
    grammar_bitmask_steps: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[LogprobsEntry] = []
    finish_reason: str | None = None  # stop, length, abort, error
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    error: str | None = None
    # seconds from the request's arrival to its first scheduling; on its first output that
    # carries tokens only
    queue_time: float | None = None
    # prompt logprobs of the step's prefill chunk; may come on an output without tokens
    prompt_logprobs: PromptLogprobs | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
