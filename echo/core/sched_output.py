"""SchedulerOutput: what the core tells the workers each step, as diffs rather than full state.

Workers keep each request's tokens and block ids between steps. A request appears in
`scheduled_new_reqs` the first time it is scheduled, and again after a preemption (with the
tokens it had generated, since the workers forgot it); afterwards only its new blocks and its
computed-token count travel. Workers append the tokens they sample themselves.
"""

import msgspec

from echo.sampling_params import SamplingParams


class KVTransfer(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Copies between the GPU KV cache and the host tier, reported done as a whole
    (ModelRunnerOutput.finished_kv_transfers). A step's stores travel as one transfer and each
    request's load as one of its own, so a request waits for its own blocks, not for every
    block loaded beside them."""

    transfer_id: int
    # [GPU block, host block]: KV that earlier steps wrote
    stores: list[tuple[int, int]] = []
    # [host block, GPU block]: into blocks nothing reads until the transfer is reported done,
    # but the step that carries a joined load (before_step)
    loads: list[tuple[int, int]] = []
    # the step's kernels wait for the copies on the device: it reuses blocks these stores read
    # (a preemption's swap-out), or reads the blocks this load fills (a joined load: its
    # request was admitted with it, KVCacheManager.start_load)
    before_step: bool = False
    # the copies wait for the work queued on the device before them (the KV a store reads was
    # written by earlier steps; a step still in flight may use a block a load fills). False
    # for a load into blocks no step in flight uses (KVCacheManager.start_load): it may run
    # beside that step, and its request be admitted a step sooner
    ordered: bool = True


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # tokens generated before a preemption; the workers recompute their KV
    output_token_ids: list[int] = []


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Requests the workers already hold, as parallel lists."""

    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []  # blocks appended since the last step
    num_computed_tokens: list[int] = []  # before this step's tokens


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    step_id: int
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    # req_id -> tokens to compute this step; a request samples a token when this step brings
    # its computed tokens up to all of its tokens
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # requests the workers must forget before this step: finished, aborted or preempted
    finished_req_ids: list[str] = []
    # requests with a grammar that sample this step: the step's GrammarBitmask follows it,
    # and the workers sample only once it is there (the forward pass does not wait)
    structured_req_ids: list[str] = []
    # speculative decoding: request id -> the draft tokens scheduled after its last token; the
    # step computes them with it and verifies them (num_scheduled_tokens counts them)
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # the KV cache's host tier (docs/ARCHITECTURE.md, KV offload): copies the workers start
    # with this step, in order, on a stream of their own
    kv_transfers: list[KVTransfer] = []
    # transfers the scheduler saw done: each worker orders its later work after them on its
    # own device (another rank's copies may lag rank 0's report), then forgets them
    released_kv_transfers: list[int] = []
    # decode steps the workers run before returning (every request then samples one token per
    # step, each step's input the token the one before sampled: docs/ARCHITECTURE.md)
    num_decode_steps: int = 1
    # speculative methods draft_model and eagle3: the requests the workers' drafter proposes
    # k tokens for once this step's tokens are known (ModelRunnerOutput.draft_token_ids)
    draft_req_ids: list[str] = []

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    @property
    def has_kv_transfers(self) -> bool:
        return bool(self.kv_transfers or self.released_kv_transfers)


class GrammarBitmask(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The tokens each constrained request may sample this step, sent after its step: bit
    j % 32 of word j // 32 of a request's row is set when token j is allowed (xgrammar's
    layout). Rows are raw int32 bytes, C order, one per request in req_ids; requests of
    structured_req_ids missing here (still reasoning, say) sample unconstrained."""

    step_id: int
    req_ids: list[str] = []
    num_words: int = 0  # per row: ceil(vocab_size / 32)
    rows: bytes = b""
    # speculative decoding: rows per request (one per draft it verifies, then one); [] when
    # every request has one
    row_counts: list[int] = []
