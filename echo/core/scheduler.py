"""Scheduler: one rule, no phases (docs/ARCHITECTURE.md, Scheduling).

Every request has num_tokens (prompt + generated) and num_computed_tokens; each step hands out
a token budget so requests catch up. Running requests go first, in admission order: a decode
needs one token, an unfinished prefill takes a chunk. Then waiting requests are admitted in
arrival order, within max_num_seqs. Chunked prefill, mixed batches and prefix caching all
follow from this.

scheduling_policy="priority" (vLLM's): the waiting queue is a heap by (priority, arrival), lower
first, and the running list is kept in that order too (sorted insertion on admission), so
running requests go first in priority order, and preemption, which takes the last running
request, takes the one of the worst priority (latest arrival among equals). Under fcfs the
waiting queue is a deque, running is in admission order, and the victim is the most recently
admitted request.

Two rules keep long prompts from hurting others:
- every running request keeps one token of the budget reserved for each running request after
  it, so a long prefill admitted early never starves later decodes;
- while requests wait for a seat, running prefills together take at most
  long_prefill_token_threshold tokens, and a waiting request with others behind it takes at
  most that much too; the rest is left for admissions, and what admissions leave unused goes
  back to the running prefills. A short prompt behind a long one thus gets its first token
  while the long prefill is still going.

Async scheduling: the engine may call schedule() for step N+1 before update_from_output() of
step N. So schedule() advances num_computed_tokens at once and counts the token a step will
sample as a placeholder; the next schedule() treats it as present. update_from_output() turns
placeholders into tokens and ignores requests that finished meanwhile.

Several decode steps per launch (num_scheduler_steps = N): a step in which every scheduled
request decodes one token with plain sampling, none is admitted and none waits runs N steps on
the device (SchedulerOutput.num_decode_steps), fewer when a request has fewer tokens left. Its
requests get the KV slots of all N positions and N placeholders; update_from_output() cuts
their tokens at the first stop, as it does for accepted drafts.

Structured outputs: a waiting request whose grammar is still compiling is passed over (it
keeps its place) so it holds nobody up; the step lists the requests with a grammar that
sample in it (structured_req_ids), whose token bitmask the engine sends after the step.
"""

import time
from bisect import insort
from collections import deque
from collections.abc import Iterable

from echo import envs
from echo.config import CacheConfig, SchedulerConfig
from echo.core.kv_cache_manager import JOINED_LOAD_MAX_BLOCKS, KVCacheManager
from echo.core.length_limit import check_request_length, length_limit
from echo.core.request import Request, RequestStatus
from echo.core.request_queue import PriorityWaitingQueue, priority_key
from echo.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from echo.core.step_results import EngineCoreOutput, ModelRunnerOutput, SchedulerStats
from echo.core.stop_checker import check_stop


def plain_sampling(params) -> bool:
    """Temperature (or greedy) sampling of the raw distribution, nothing the host must see
    between two tokens: what several decode steps per launch sample. Requests with
    top-k/top-p/min-p, penalties, token rules, grammars or logprobs decode one token a launch
    (speculative decoding verifies drafts for any request)."""
    return (params.top_k in (-1, 0) and params.top_p == 1 and params.min_p == 0
            and not params.has_penalties and not params.has_token_rules
            and params.structured_outputs is None and params.logprobs is None
            and params.min_tokens == 0)


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_gpu_blocks: int,
        *,
        long_prefill_token_threshold: int | None = None,
        num_host_blocks: int = 0,
        tensor_parallel_size: int = 1,
        draft_model_tokens: int = 0,
        spec_max_batch_size: int | None = None,
    ):
        """draft_model_tokens: k when a drafter run by the workers proposes (speculative
        methods draft_model and eagle3), else 0; spec_max_batch_size: speculative_config's
        disable_by_batch_size, whatever proposes."""
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.block_size = cache_config.block_size
        if long_prefill_token_threshold is None:
            long_prefill_token_threshold = max(1, self.max_num_batched_tokens // 2)
        if not 1 <= long_prefill_token_threshold <= self.max_num_batched_tokens:
            raise ValueError(
                f"long_prefill_token_threshold must be in [1, max_num_batched_tokens="
                f"{self.max_num_batched_tokens}], got {long_prefill_token_threshold}")
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.num_scheduler_steps = scheduler_config.num_scheduler_steps
        # a drafter in the workers writes the KV of the k tokens it proposes after the step's
        # own: their slots are allocated with the step's (lookahead)
        self.draft_model_tokens = draft_model_tokens
        self.spec_max_batch_size = spec_max_batch_size
        joined_limit = envs.kv_joined_load_blocks()
        if not envs.kv_early_loads():
            joined_limit = 0
        elif joined_limit is None:
            joined_limit = JOINED_LOAD_MAX_BLOCKS
        self.kv = KVCacheManager(num_gpu_blocks, self.block_size,
                                 cache_config.enable_prefix_caching, num_host_blocks,
                                 num_lookahead_tokens=draft_model_tokens,
                                 max_model_len=self.max_model_len,
                                 write_back=cache_config.kv_offloading_policy == "write_back",
                                 joined_load_max_blocks=joined_limit)
        # a preempted request's blocks go to the host tier (swap) or are only freed
        self.store_on_preempt = cache_config.preemption_mode == "swap"
        self.tensor_parallel_size = tensor_parallel_size
        # rank 0's cumulative (bytes stored, bytes loaded, copy seconds) of the host tier
        self.kv_transfer_totals: tuple[int, int, float] = (0, 0, 0.0)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.by_priority = scheduler_config.scheduling_policy == "priority"
        self._check_priority = scheduler_config.check_priority
        # fcfs: a deque in arrival order; priority: a heap by (priority, arrival)
        self.waiting: deque[Request] | PriorityWaitingQueue = (
            PriorityWaitingQueue() if self.by_priority else deque())
        self.running: list[Request] = []  # in admission order; by priority_key under priority
        # ids the workers must forget before the next step
        self._finished_req_ids: list[str] = []
        self._step_id = 0
        self.num_preemptions = 0
        # speculative decoding, cumulative (SchedulerStats' spec_* fields)
        self.spec_num_drafts = self.spec_num_draft_tokens = self.spec_num_accepted = 0
        self.spec_accepted_per_position: list[int] = []

    # ---- requests in and out -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it is malformed or could never fit in the KV cache."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request {rid!r} is already queued or running")
        self._check_priority(request.priority)
        num_prompt = request.num_prompt_tokens
        try:
            check_request_length(num_prompt, self.max_model_len)
        except ValueError as e:
            raise ValueError(f"request {rid!r}: {e}") from None
        request.token_limit = length_limit(num_prompt, request.max_tokens, self.max_model_len)
        num_tokens = max(num_prompt, request.token_limit)
        num_blocks = self.kv.num_blocks_for(num_tokens)
        if num_blocks > self.kv.num_blocks:
            raise ValueError(
                f"request {rid!r} can never fit in the KV cache: prompt length {num_prompt} + "
                f"max_tokens {num_tokens - num_prompt} = {num_tokens} tokens need {num_blocks} "
                f"blocks of {self.block_size}, but the cache has {self.kv.num_blocks} blocks "
                f"({self.kv.num_blocks * self.block_size} tokens); lower max_tokens or the "
                "prompt length")
        request.status = RequestStatus.WAITING
        self.requests[rid] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish requests as aborted and free their blocks now; unknown ids are ignored.
        A step in flight may still write KV into those blocks: harmless, since a block freed
        now is only handed out to a step that runs after it."""
        outputs = []
        aborted_running, aborted_waiting = set(), set()
        for rid in request_ids:
            request = self.requests.pop(rid, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                aborted_running.add(rid)
                self._finished_req_ids.append(rid)
            else:  # waiting or preempted: the workers do not hold it
                aborted_waiting.add(rid)
            self.kv.free(request)
            request.status = RequestStatus.FINISHED_ABORTED
            outputs.append(EngineCoreOutput(rid, [], finish_reason="abort",
                                            num_cached_tokens=max(request.num_cached_tokens, 0)))
        if aborted_running:
            self.running = [r for r in self.running if r.request_id not in aborted_running]
        if aborted_waiting:
            self.waiting = type(self.waiting)(
                r for r in self.waiting if r.request_id not in aborted_waiting)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Decide this step's work. The output carries finished_req_ids even when it schedules
        no tokens: the engine must still hand such an output to the workers."""
        budget = self.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        spec_tokens: dict[str, list[int]] = {}
        new_block_ids: dict[str, list[int]] = {}
        scheduled_running: list[Request] = []
        throttled: list[Request] = []  # prefills held back for admissions; topped up at the end
        running = self.running
        # running prefills share this while requests wait for a seat
        prefill_allowance = (self.long_prefill_token_threshold
                             if self.waiting and len(running) < self.max_num_seqs else budget)
        preempted = False
        allocate_slots = self.kv.allocate_slots

        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            # len()s rather than the num_tokens property: this runs per request per step
            in_flight = request.num_output_placeholders
            total = len(request.prompt_token_ids) + len(request.output_token_ids) + in_flight
            num_new = total - request.num_computed_tokens
            # nothing to compute until an in-flight token comes back, or, once the tokens in
            # flight reach max_tokens / max_model_len, nothing but a token to throw away
            if num_new <= 0 or (in_flight and total >= request.token_limit):
                i += 1
                continue
            limit = budget - (len(running) - i - 1)
            if request.spec_token_ids:  # a decode and its drafts, verified in this step
                num_new = self._schedule_drafts(request, num_new, limit, spec_tokens)
            elif num_new > 1:
                if prefill_allowance < min(num_new, limit):
                    throttled.append(request)
                limit = min(limit, prefill_allowance)
                if limit <= 0:
                    i += 1
                    continue
            if num_new > limit:
                num_new = limit
            blocks = allocate_slots(request, num_new)
            if blocks is None and self.kv.drop_held_loads():  # before taking anyone's seat
                blocks = allocate_slots(request, num_new)
            while blocks is None:
                # the most recently admitted (fcfs) or the worst priority: the last, never one
                # scheduled already
                victim = running.pop()
                self._preempt(victim)
                preempted = True
                if victim is request:
                    break
                blocks = allocate_slots(request, num_new)
            if blocks is None:
                spec_tokens.pop(request.request_id, None)
                break
            if num_new > 1 and request.request_id not in spec_tokens:
                prefill_allowance -= num_new
            num_scheduled[request.request_id] = num_new
            new_block_ids[request.request_id] = blocks
            scheduled_running.append(request)
            budget -= num_new
            i += 1

        new_reqs: list[Request] = []
        if not preempted:  # admitting right after preempting would only thrash
            budget = self._admit_waiting(budget, num_scheduled, new_reqs, throttled)
        if throttled and budget > 0:
            budget = self._top_up(throttled, budget, num_scheduled, new_block_ids,
                                  scheduled_running)
        num_steps = 1
        if (self.num_scheduler_steps > 1 and scheduled_running and not new_reqs
                and not spec_tokens and not self.waiting and not preempted):
            num_steps = self._decode_steps(scheduled_running, new_block_ids)
        return self._make_output(num_scheduled, new_block_ids, scheduled_running, new_reqs,
                                 spec_tokens, num_steps)

    def _decode_steps(self, scheduled: list[Request], new_block_ids: dict[str, list[int]]) -> int:
        """How many decode steps this step runs on the device: num_scheduler_steps, or fewer
        when a request has fewer tokens left, if every request decodes its last token with
        plain sampling and the pool holds the KV slots of every step (else 1)."""
        steps = self.num_scheduler_steps
        for request in scheduled:
            total = request.num_tokens + request.num_output_placeholders
            if (total - request.num_computed_tokens != 1 or request.grammar is not None
                    or not plain_sampling(request.sampling_params)):
                return 1
            steps = min(steps, request.token_limit - total)
        if steps <= 1:
            return 1
        kv = self.kv
        if sum(kv.num_blocks_for(r.num_computed_tokens + steps) for r in scheduled) > (
                kv.num_free_blocks + sum(kv.num_held_blocks(r) for r in scheduled)):
            return 1  # more steps only while no request would have to wait for a block
        for request in scheduled:
            new_block_ids[request.request_id] += kv.allocate_slots(request, steps)
        return steps

    @staticmethod
    def _schedule_drafts(request: Request, num_new: int, limit: int,
                         spec_tokens: dict[str, list[int]]) -> int:
        """The decode token plus as many of its drafts as the budget allows."""
        drafts = request.spec_token_ids[:max(0, limit - num_new)]
        request.spec_token_ids = []
        if drafts:
            spec_tokens[request.request_id] = drafts
        return num_new + len(drafts)

    def _admit_waiting(self, budget: int, num_scheduled: dict[str, int],
                       new_reqs: list[Request], throttled: list[Request]) -> int:
        waiting, running = self.waiting, self.running
        compiling: list[Request] = []  # waiting for their grammar: the others go ahead
        while waiting and budget > 0 and len(running) < self.max_num_seqs:
            request = waiting[0]
            if request.grammar is not None and not request.grammar.ready:
                compiling.append(waiting.popleft())
                continue
            if request.num_output_placeholders:
                break  # preempted with a token still in flight: wait until it comes back
            if self.kv.is_loading(request):  # its prefix is on its way from the host tier
                compiling.append(waiting.popleft())
                continue
            computed = self.kv.get_computed_blocks(request)
            # a load only for a request that will find a seat: loaded blocks are held for it
            if (len(running) + self.kv.num_loading_requests < self.max_num_seqs
                    and self.kv.start_load(request, computed)):
                if self.kv.is_loading(request):
                    compiling.append(waiting.popleft())
                    continue
                # joined: its step waits for the load on the device; its blocks are cached
                computed = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - computed.num_tokens, budget)
            held_back = (num_new > self.long_prefill_token_threshold and len(waiting) > 1
                         and len(running) + 1 < self.max_num_seqs)
            if held_back:  # leave room for the requests behind it
                num_new = self.long_prefill_token_threshold
            if self.kv.allocate_slots(request, num_new, computed) is None:
                self.kv.drop_held_loads()  # loads held for others must not keep it out
                break  # nobody overtakes the head of the queue
            waiting.popleft()
            if self.by_priority:
                insort(running, request, key=priority_key)  # after its equals
            else:
                running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = computed.num_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed.num_tokens
                request.first_scheduled_time = time.time()
            num_scheduled[request.request_id] = num_new
            new_reqs.append(request)
            if held_back:
                throttled.append(request)
            budget -= num_new
        for request in reversed(compiling):  # back at the head, in their order (loads too)
            waiting.appendleft(request)
        return budget

    def _top_up(self, throttled: list[Request], budget: int, num_scheduled: dict[str, int],
                new_block_ids: dict[str, list[int]], scheduled_running: list[Request]) -> int:
        """Give the budget admissions left unused back to the prefills held back for them."""
        for request in throttled:
            if budget == 0:
                break
            rid = request.request_id
            if request.status != RequestStatus.RUNNING:
                continue  # preempted later in the same step
            already = num_scheduled.get(rid, 0)
            remaining = (request.num_tokens + request.num_output_placeholders
                         - request.num_computed_tokens - already)
            extra = min(remaining, budget)
            if extra <= 0:
                continue
            blocks = self.kv.allocate_slots(request, already + extra)
            if blocks is None:
                continue  # no preemption for a top-up
            if rid in new_block_ids:
                new_block_ids[rid].extend(blocks)
            elif rid not in num_scheduled:
                new_block_ids[rid] = blocks
                scheduled_running.append(request)
            # else: admitted this step; NewRequestData carries its whole block table
            num_scheduled[rid] = already + extra
            budget -= extra
        return budget

    def _make_output(self, num_scheduled: dict[str, int], new_block_ids: dict[str, list[int]],
                     scheduled_running: list[Request], new_reqs: list[Request],
                     spec_tokens: dict[str, list[int]], num_steps: int = 1) -> SchedulerOutput:
        cached_ids, cached_blocks, cached_computed = [], [], []
        structured: list[str] = []
        for request in scheduled_running:
            rid = request.request_id
            cached_ids.append(rid)
            cached_blocks.append(new_block_ids[rid])
            computed = request.num_computed_tokens
            cached_computed.append(computed)
            # _advance, inlined: this runs per request per step; drafts are computed past the
            # tokens, so a request with drafts is past them (>=); each decode step past the
            # first computes the token the one before it sampled
            computed = request.num_computed_tokens = computed + num_scheduled[rid] + num_steps - 1
            if computed >= (len(request.prompt_token_ids) + len(request.output_token_ids)
                            + request.num_output_placeholders):
                request.num_output_placeholders += num_steps
                if request.grammar is not None:
                    structured.append(rid)
        new_data = []
        for request in new_reqs:
            new_data.append(NewRequestData(
                req_id=request.request_id,
                # copies: an in-process worker may keep and extend these lists
                prompt_token_ids=list(request.prompt_token_ids),
                sampling_params=request.sampling_params,
                block_ids=self.kv.get_block_ids(request),
                num_computed_tokens=request.num_computed_tokens,
                output_token_ids=list(request.output_token_ids),
            ))
            samples = self._advance(request, num_scheduled[request.request_id])
            if samples and request.grammar is not None:
                structured.append(request.request_id)
        draft_req_ids = self._draft_requests(scheduled_running, new_reqs) \
            if self.draft_model_tokens else []
        finished, self._finished_req_ids = self._finished_req_ids, []
        transfers, released = self.kv.take_transfers()
        output = SchedulerOutput(
            step_id=self._step_id,
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=CachedRequestData(cached_ids, cached_blocks, cached_computed),
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=sum(num_scheduled.values()),
            finished_req_ids=finished,
            structured_req_ids=structured,
            scheduled_spec_decode_tokens=spec_tokens,
            kv_transfers=transfers,
            released_kv_transfers=released,
            num_decode_steps=num_steps,
            draft_req_ids=draft_req_ids,
        )
        self._step_id += 1
        return output

    @staticmethod
    def _advance(request: Request, num_new: int) -> bool:
        """Count the step's tokens as computed; True if the step samples a token for it."""
        computed = request.num_computed_tokens = request.num_computed_tokens + num_new
        if computed == (len(request.prompt_token_ids) + len(request.output_token_ids)
                        + request.num_output_placeholders):
            request.num_output_placeholders += 1
            return True
        return False

    def _preempt(self, request: Request) -> None:
        """Free a running request's blocks and requeue it at the front (under priority: where
        its priority and arrival put it), to be recomputed (its prefix is reused if still
        cached). A token it has in flight is kept when it arrives."""
        self.kv.free(request, store=self.store_on_preempt, preempted=True)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        self._finished_req_ids.append(request.request_id)

    # ---- results -------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, finish requests that are done, and report both."""
        if runner_output.finished_kv_transfers:
            self.kv.transfers_done(runner_output.finished_kv_transfers)
            if runner_output.kv_transfer_totals is not None:
                self.kv_transfer_totals = runner_output.kv_transfer_totals
        outputs = []
        finished_running: set[str] = set()
        logprobs = runner_output.logprobs
        prompt_logprobs = runner_output.prompt_logprobs
        requests = self.requests
        spec = scheduler_output.scheduled_spec_decode_tokens
        for i, rid in enumerate(runner_output.req_ids):
            new_token_ids = runner_output.sampled_token_ids[i]
            if not new_token_ids:  # mid-prefill
                if prompt_logprobs and rid in prompt_logprobs and rid in requests:
                    outputs.append(EngineCoreOutput(rid, [],
                                                    prompt_logprobs=prompt_logprobs[rid]))
                continue
            request = requests.get(rid)
            if request is None:
                continue  # finished or aborted while this step was in flight: discard
            placeholders = request.num_output_placeholders - len(new_token_ids)
            request.num_output_placeholders = placeholders if placeholders > 0 else 0
            if spec and rid in spec:  # rejected drafts: their KV is recomputed, not kept
                self._count_verification(len(spec[rid]), len(new_token_ids) - 1)
                request.num_computed_tokens -= len(spec[rid]) + 1 - len(new_token_ids)
            if len(new_token_ids) == 1:  # the usual case, without a call
                request.output_token_ids.append(new_token_ids[0])
                status = check_stop(request)
            else:
                new_token_ids, status = self._append_tokens(request, new_token_ids)
            entries = logprobs[i] if logprobs else None
            output = EngineCoreOutput(rid, new_token_ids,
                                      entries[:len(new_token_ids)] if entries else [],
                                      None, None, request.num_cached_tokens)
            if prompt_logprobs:  # the last chunk of a prompt comes with its first token
                output.prompt_logprobs = prompt_logprobs.get(rid)
            if len(request.output_token_ids) == len(new_token_ids):  # its first output
                output.queue_time = request.first_scheduled_time - request.arrival_time
            if status is not None:
                was_running = request.status == RequestStatus.RUNNING
                request.status = status
                output.finish_reason = request.finish_reason
                output.stop_reason = request.stop_reason
                self._release_finished(request, was_running)
                if was_running:
                    finished_running.add(rid)
            outputs.append(output)
        if finished_running:
            self.running = [r for r in self.running if r.request_id not in finished_running]
        if runner_output.draft_token_ids:
            self.take_model_drafts(runner_output.draft_token_ids)
        return outputs

    def _append_tokens(self, request: Request,
                       token_ids: list[int]) -> tuple[list[int], RequestStatus | None]:
        """Append tokens one by one, up to the first that finishes the request (its status)."""
        output_ids = request.output_token_ids
        for n, token_id in enumerate(token_ids, 1):
            output_ids.append(token_id)
            status = check_stop(request)
            if status is not None:
                return token_ids[:n], status
        return token_ids, None

    def _release_finished(self, request: Request, was_running: bool) -> None:
        """Forget a finished request (the caller drops a running one from self.running)."""
        del self.requests[request.request_id]
        self.kv.free(request)
        if was_running:
            self._finished_req_ids.append(request.request_id)
        else:
            # preempted while its token was in flight; the workers forgot it at preemption
            self.waiting.remove(request)

    # ---- speculative decoding ------------------------------------------------------------

    def _count_verification(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted += num_accepted
        per_position = self.spec_accepted_per_position
        if len(per_position) < num_drafts:
            per_position.extend([0] * (num_drafts - len(per_position)))
        for position in range(num_accepted):
            per_position[position] += 1

    def _draft_requests(self, scheduled_running: list[Request],
                        new_reqs: list[Request]) -> list[str]:
        """The requests the workers' drafter proposes for after this step: those that sample
        in it (a token in flight for it now) and have tokens left after it."""
        if self.drafts_paused():
            return []
        return [r.request_id for requests in (scheduled_running, new_reqs) for r in requests
                if r.num_output_placeholders
                and r.token_limit - r.num_tokens - r.num_output_placeholders > 0]

    def take_model_drafts(self, drafts: dict[str, list[int]]) -> None:
        """The draft model's proposals from a step's output, for the requests' next step: cut
        to what max_tokens and max_model_len leave after the tokens they now have."""
        requests = self.requests
        for rid, tokens in drafts.items():
            request = requests.get(rid)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, aborted or preempted meanwhile
            limit = request.token_limit - request.num_tokens - 1
            if (limit > 0 and not request.num_output_placeholders
                    and request.num_computed_tokens == request.num_tokens - 1):
                request.spec_token_ids = tokens[:limit]

    def drafts_paused(self) -> bool:
        """Whether more requests run than speculative_config.disable_by_batch_size: nobody
        drafts then."""
        cutoff = self.spec_max_batch_size
        return cutoff is not None and len(self.running) > cutoff

    def propose_drafts(self, propose) -> None:
        """Give each running decode its drafts for the next step: propose(token ids, limit)
        returns at most limit tokens (limit: what max_tokens and max_model_len leave after
        the token the step samples anyway). None while drafts_paused()."""
        if self.drafts_paused():
            return
        for request in self.running:
            if request.num_output_placeholders:
                continue
            limit = request.token_limit - request.num_tokens - 1
            if limit > 0 and request.num_computed_tokens == request.num_tokens - 1:
                request.spec_token_ids = propose(
                    request.prompt_token_ids + request.output_token_ids, limit)

    # ---- introspection -------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        kv = self.kv
        stored, loaded, seconds = self.kv_transfer_totals
        tp = self.tensor_parallel_size  # each rank moved its own share of every block
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_total_blocks=self.kv.num_blocks,
            spec_num_drafts=self.spec_num_drafts,
            spec_num_draft_tokens=self.spec_num_draft_tokens,
            spec_num_accepted_tokens=self.spec_num_accepted,
            spec_accepted_per_position=list(self.spec_accepted_per_position),
            kv_host_queries=kv.host_queries,
            kv_host_hits=kv.host_hits,
            kv_stored_blocks=kv.stored_blocks,
            kv_loaded_blocks=kv.loaded_blocks,
            kv_loads=kv.loads_done,
            kv_load_wait_seconds=kv.load_wait_seconds,
            kv_loads_joined=kv.loads_joined,
            kv_stored_bytes=stored * tp,
            kv_loaded_bytes=loaded * tp,
            kv_transfer_seconds=seconds,
        )

    def reset_prefix_cache(self) -> bool:
        """Forget all cached prefixes; False (nothing done) while any request holds blocks."""
        return self.kv.reset_prefix_cache()
