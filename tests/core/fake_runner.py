"""FakeModelRunner: the workers' side of the SchedulerOutput contract, without a model.

For the scheduler and engine tests. It keeps per-request state from
the diffs exactly as a model runner must (a new request's tokens and block table; running
requests' new blocks; forgetting finished ids first), asserts the diffs agree with its own
bookkeeping, and appends the tokens it samples itself, as real workers do.

With check_kv it also simulates the KV cache: computing a position writes a fingerprint of the
whole token sequence up to it into that position's slot, and every step checks each slot it
reads. A block shared, reused or freed wrongly shows up as an AssertionError there, instead of
as subtly different text. The host tier's copies move those slots to and from host blocks and
are reported done with the step: stores and the loads the step waits for (before_step) before
the step's own work, as on the device, other loads after it (the step may not read them); a
load the plan marks unordered (it may start beside the step before it on a device) must not
fill a block that step used.

The default next token is a function of the whole sequence so far (greedy decoding), so the
same requests give the same outputs under any schedule: chunked, preempted, cached, async.
"""

from collections.abc import Callable

from echo.core.sched_output import SchedulerOutput
from echo.core.step_results import LogprobsEntry, ModelRunnerOutput
from echo.sampling_params import SamplingParams


def fingerprint(prev: int, token_id: int) -> int:
    return hash((prev, token_id))  # ints and tuples of ints hash the same in every process


def default_next_token(token_ids: list[int], vocab_size: int) -> int:
    fp = 0
    for token_id in token_ids:
        fp = fingerprint(fp, token_id)
    return fp % vocab_size


class _WorkerRequest:
    __slots__ = ("token_ids", "fingerprints", "block_ids", "num_computed", "params")

    def __init__(self, token_ids, block_ids, num_computed, params):
        self.token_ids: list[int] = token_ids
        self.fingerprints: list[int] = []
        self.block_ids: list[int] = block_ids
        self.num_computed: int = num_computed
        self.params: SamplingParams = params

    def fingerprints_upto(self, n: int) -> list[int]:
        fps, tokens = self.fingerprints, self.token_ids
        for pos in range(len(fps), n):
            fps.append(fingerprint(fps[-1] if fps else 0, tokens[pos]))
        return fps


class FakeModelRunner:
    def __init__(self, block_size: int, num_blocks: int, vocab_size: int = 1000,
                 next_token: Callable[[str, list[int]], int] | None = None,
                 check_kv: bool = True, transfer_delay: int = 0):
        """transfer_delay: how many steps later than its own a transfer is reported done."""
        self.block_size = block_size
        self.transfer_delay = transfer_delay
        self._reports: list[tuple[int, int]] = []  # (the step count it is due at, transfer id)
        self._steps = 0
        self.num_blocks = num_blocks
        self.vocab_size = vocab_size
        self.next_token = next_token
        self.check_kv = check_kv
        self.requests: dict[str, _WorkerRequest] = {}
        self.kv: list[int | None] = [None] * (num_blocks * block_size)
        self.host: dict[int, list[int | None]] = {}  # host block -> its slots
        self._last_step_blocks: set[int] = set()  # every block of the requests last scheduled
        self.loads = 0  # the host tier's loads run

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for rid in so.finished_req_ids:
            assert rid in self.requests, f"told to forget unknown request {rid!r}"
            del self.requests[rid]
        for new in so.scheduled_new_reqs:
            assert new.req_id not in self.requests, f"{new.req_id!r} added twice"
            self._check_new_blocks(new.block_ids, [])
            self.requests[new.req_id] = _WorkerRequest(
                list(new.prompt_token_ids) + list(new.output_token_ids), list(new.block_ids),
                new.num_computed_tokens, new.sampling_params)
        cached = so.scheduled_cached_reqs
        for rid, block_ids, num_computed in zip(cached.req_ids, cached.new_block_ids,
                                                cached.num_computed_tokens, strict=True):
            req = self.requests[rid]
            assert req.num_computed == num_computed, (
                f"{rid}: scheduler says {num_computed} computed, worker has {req.num_computed}")
            self._check_new_blocks(block_ids, req.block_ids)
            req.block_ids.extend(block_ids)
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        self._copy_kv(so, before_step=True)

        steps = so.num_decode_steps
        assert steps == 1 or set(so.num_scheduled_tokens.values()) == {1}, (
            f"{steps} decode steps in a step with prefill chunks")
        sampled = {rid: [] for rid in so.num_scheduled_tokens}
        for sub_step in range(steps):  # each decode step after the first: one token each
            self._compute(so.num_scheduled_tokens if sub_step == 0 else
                          dict.fromkeys(so.num_scheduled_tokens, 1), sampled)
        self._copy_kv(so, before_step=False)
        req_ids, logprobs = list(sampled), []
        for rid in req_ids:
            params = self.requests[rid].params
            logprobs.append(None if not sampled[rid] or params.logprobs is None
                            else [LogprobsEntry(logprob=-float(t % 7)) for t in sampled[rid]])
        self._last_step_blocks = {b for rid in so.num_scheduled_tokens
                                  for b in self.requests[rid].block_ids}
        self._steps += 1
        self._reports += [(self._steps + self.transfer_delay, t.transfer_id)
                          for t in so.kv_transfers]
        done = [tid for due, tid in self._reports if due <= self._steps]
        self._reports = [(due, tid) for due, tid in self._reports if due > self._steps]
        return ModelRunnerOutput(so.step_id, req_ids, list(sampled.values()), logprobs,
                                 finished_kv_transfers=done)

    def _copy_kv(self, so: SchedulerOutput, before_step: bool) -> None:
        """The step's stores, and the loads its kernels wait for (KVTransfer.before_step),
        before its own work; other loads after it, since on a device the step need not see
        them."""
        bs, kv = self.block_size, self.kv
        for transfer in so.kv_transfers:
            if before_step:
                for device_block, host_block in transfer.stores:
                    self.host[host_block] = kv[device_block * bs:(device_block + 1) * bs]
            if transfer.before_step != before_step:
                continue
            if transfer.loads:
                self.loads += 1
            for host_block, device_block in transfer.loads:
                assert transfer.ordered or device_block not in self._last_step_blocks, (
                    f"an unordered load fills block {device_block}, which the step before "
                    f"it uses")
                kv[device_block * bs:(device_block + 1) * bs] = self.host[host_block]

    def _compute(self, num_scheduled: dict[str, int], sampled: dict[str, list[int]]) -> None:
        """One forward pass over the scheduled tokens, then a token for each request whose
        known tokens are all computed."""
        for rid, num in num_scheduled.items():
            req = self.requests[rid]
            end = req.num_computed + num
            assert num >= 1, f"{rid}: scheduled {num} tokens"
            assert end <= len(req.token_ids), f"{rid}: scheduled past its known tokens"
            assert len(req.block_ids) * self.block_size >= end, f"{rid}: too few blocks"
            if self.check_kv:
                self._write_kv(req, req.num_computed, end)
        if self.check_kv:
            # as on the GPU, where each layer stores the whole batch's KV before attention
            # reads any, so a request may reuse blocks another writes in the same step
            for rid, num in num_scheduled.items():
                self._read_kv(rid, self.requests[rid], self.requests[rid].num_computed + num)
        for rid, num in num_scheduled.items():
            req = self.requests[rid]
            end = req.num_computed = req.num_computed + num
            if end == len(req.token_ids):
                token_id = self._sample(rid, req.token_ids)
                req.token_ids.append(token_id)
                sampled[rid].append(token_id)

    def _sample(self, rid: str, token_ids: list[int]) -> int:
        if self.next_token is not None:
            return self.next_token(rid, token_ids)
        return default_next_token(token_ids, self.vocab_size)

    def _check_new_blocks(self, new_ids: list[int], held: list[int]) -> None:
        assert all(0 <= b < self.num_blocks for b in new_ids), f"block id out of range: {new_ids}"
        assert len(set(new_ids) | set(held)) == len(new_ids) + len(held), "block listed twice"

    def _write_kv(self, req: _WorkerRequest, start: int, end: int) -> None:
        fps, bs, kv = req.fingerprints_upto(end), self.block_size, self.kv
        for pos in range(start, end):
            kv[req.block_ids[pos // bs] * bs + pos % bs] = fps[pos]

    def _read_kv(self, rid: str, req: _WorkerRequest, end: int) -> None:
        """Attention reads the whole context; every slot must hold what this sequence wrote."""
        fps, bs, kv = req.fingerprints, self.block_size, self.kv
        for pos in range(end):
            got = kv[req.block_ids[pos // bs] * bs + pos % bs]
            assert got == fps[pos], f"{rid}: wrong KV at position {pos} (block {pos // bs})"
