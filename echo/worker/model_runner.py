"""ModelRunner: owns the model, the KV cache and the persistent batch of one worker (one TP rank).

Start-up (KV sizing, tuning, graph capture, warm-ups) is worker/startup.py's; this file is the
step.

`launch(scheduler_output)` applies the step's diff, runs the forward pass over the mixed batch
and samples for the requests whose tokens are all computed, without waiting for the device;
`collect()` returns the oldest launched step's tokens. `execute_model` is the two in a row.
A step with structured requests (SchedulerOutput.structured_req_ids) stops after the forward
pass: `apply_grammar_bitmask` masks its logits and samples, once the core has filled the mask
from the previous step's tokens (docs/ARCHITECTURE.md, Structured outputs).

Speculative decoding: a step with drafts is verified (rejection_sampler.py) and landed before
it returns; a step that names draft_req_ids lands at once too, and the drafter proposes the
next drafts from its tokens (ModelRunnerOutput.draft_token_ids).

Prompt logprobs (SamplingParams.prompt_logprobs): a prefill chunk of a request that asked for
them runs the LM head over its prompt positions too (those rows only, a slice at a time), and
the step's output carries the chunk's logprobs; the frontend joins the chunks.
"""

import sys
import time
from collections import deque

import numpy as np
import torch

from echo import envs
from echo.attention.backend import KVCache, make_backend
from echo.config import EngineConfig
from echo.core.sched_output import GrammarBitmask, SchedulerOutput
from echo.core.step_results import LogprobsEntry, ModelRunnerOutput, PromptLogprobs
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.attention import ForwardContext
from echo.profiling import profiler_window, step_range
from echo.worker import startup
from echo.worker.cuda_graphs import CudaGraphRunner
from echo.worker.draft_model import DraftModel
from echo.worker.eagle3_drafter import Eagle3Drafter
from echo.worker.grammar_bitmask import apply_grammar_bitmask
from echo.worker.host_copies import copies_by_kernel, copy_pinned
from echo.worker.input_batch import InputBatch, StepInputs
from echo.worker.kv_cache import KVCacheSpec
from echo.worker.kv_transfer import HostKVCache, KVTransfers, num_host_blocks
from echo.worker.model_loader import build_model
from echo.worker.multi_step import MultiStepDecoder
from echo.worker.persistent_decoder import PersistentDecoder
from echo.worker.pinned_ring import PinnedUploadRing
from echo.worker.rejection_sampler import flat_drafts, rejection_sample
from echo.worker.sampler import (
    Sampler,
    SamplerOutput,
    SamplingTensors,
    raw_logprobs,
    target_distribution,
)
from echo.worker.sampling_inputs import build_sampling_tensors, upload
from echo.worker.step_buffers import StepBuffers

# float32 logits elements per slice of prompt-logprob rows: bounds their memory (128 MiB)
PROMPT_LOGITS_ELEMENTS = 1 << 25


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup = SINGLE,
                 device: torch.device | None = None):
        self.config = config
        self.tp = tp
        if envs.log_compiles():
            from echo.worker.compile_log import log_compiles

            log_compiles(f"rank{tp.rank}")
        self.device = device or torch.device(config.device.device)
        self.arch = config.model.arch
        self.dtype = getattr(torch, config.model.dtype)
        self.model = build_model(config.model, self.device, tp,
                                 awq_tensor_cores=not config.device.persistent_decode)
        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.kv_cache_spec = KVCacheSpec(self.arch.num_layers, config.cache.block_size,
                                         self.num_kv_heads, self.head_dim, self.dtype,
                                         config.cache.kv_cache_dtype)
        self.backend = make_backend(config.device.attention_backend, attn.num_heads,
                                    self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.sampler = Sampler()
        self.vocab_size = self.arch.vocab_size
        self.kv_caches: list[KVCache] = []
        self.kv_transfers: KVTransfers | None = None  # the KV host tier's copies, if any
        self.input_batch: InputBatch | None = None
        self.buffers: StepBuffers | None = None
        self.graphs: CudaGraphRunner | None = None
        self.multi_step: MultiStepDecoder | None = None  # with num_scheduler_steps > 1
        # persistent_decode: a one-token step's forward in one launch (persistent_decoder.py)
        self.persistent: PersistentDecoder | None = None
        # speculative methods draft_model and eagle3: the drafter, its cache beside the
        # target's (draft_model.py, eagle3_drafter.py)
        self.drafter: DraftModel | Eagle3Drafter | None = None
        if config.draft_model is not None and config.speculative.method == "eagle3":
            self.drafter = Eagle3Drafter(config, self.model, tp, self.device)
        elif config.draft_model is not None:
            self.drafter = DraftModel(config, tp, self.device)
        # step id -> the requests the drafter proposes for once the step's tokens land
        self.draft_req_ids: dict[int, list[str]] = {}
        # launched steps, oldest first: outputs ready, or steps still on the device
        self.in_flight: deque[ModelRunnerOutput | _StepInFlight] = deque()
        # a launched step with structured requests, forwarded but not sampled until its
        # GrammarBitmask arrives: (step id, inputs, hidden states, logits, sampling tensors)
        self.awaiting_bitmask: tuple | None = None
        self._bitmask_ring: PinnedUploadRing | None = None  # made by the first bitmask
        # the sampling inputs' uploads by dtype (CUDA), held until their copies ran
        # (host_copies.py): three values a row, room for several steps of a full batch
        size = 4 * 3 * config.scheduler.max_num_batched_tokens
        self.sampling_rings = ({dtype: PinnedUploadRing(size, self.device, dtype)
                                for dtype in (torch.float32, torch.int64)}
                               if self.device.type == "cuda" else None)
        self.copies_by_kernel = copies_by_kernel(self.device)  # the step's own copies
        # request id -> the top-N of prompt logprobs it asked for, while its prompt is scored
        self.prompt_logprobs: dict[str, int] = {}
        self.profile_window = profiler_window(f"rank{tp.rank}")  # ECHO_PROFILE_STEPS
        # seconds spent waiting for launched steps' tokens: the rest of a step's wall time is
        # host work (tools/bench_latency.py reports both)
        self.device_wait_s = 0.0

    # ---- start-up (echo/worker/startup.py) ------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        """A block's bytes, the draft model's share included: both caches hold every block."""
        draft = self.drafter.bytes_per_block() if self.drafter is not None else 0
        return self.kv_cache_spec.bytes_per_block() + draft

    def determine_num_blocks(self) -> int:
        return startup.determine_num_blocks(self)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache and the step state, then tune, capture and warm up (startup.py)."""
        stacked = self.kv_cache_spec.allocate_stacked(num_blocks, self.device)
        self.kv_caches = stacked.layers
        if self.tp.rank == 0:  # every rank holds the same number of blocks
            print(f"echo: {self.kv_cache_spec.describe(num_blocks, self.tp.size)}",
                  file=sys.stderr, flush=True)
        if self.config.cache.kv_offloading_size is not None:
            # the host tier: this rank's share of every host block
            host = HostKVCache(self.kv_cache_spec, num_host_blocks(self.config),
                               pin=self.device.type == "cuda")
            self.kv_transfers = KVTransfers(stacked, host, self.device)
        sched = self.config.scheduler
        max_blocks = -(-sched.max_model_len // self.config.cache.block_size) + 1
        # +1 token column: a request finishing at max_model_len may still be handed a token
        self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len + 1, max_blocks,
                                      self.config.cache.block_size, self.config.model.seed)
        self.buffers = StepBuffers(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks,
                                   self.device)
        self.persistent = startup.persistent_decoder(self)
        self.graphs = startup.prepare_step_path(self)
        if sched.num_scheduler_steps > 1:
            self.multi_step = startup.prepare_multi_step(self)
        if self.drafter is not None:
            self.drafter.init_kv_cache(num_blocks, self.buffers, self.graphs)

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        self.launch(out)
        return self.collect()

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput) -> None:
        """Start a step on the device without waiting for it. A token the previous step is
        still sampling is copied into this step's inputs on the device: no host round trip."""
        self.profile_window.on_step(out.step_id)
        batch = self.input_batch
        with step_range("prepare", out.step_id):
            if self.in_flight and batch.num_reading_outputs:
                self._land_all()  # penalties count tokens on the host: they must be there
            if self.prompt_logprobs or any(new.sampling_params.prompt_logprobs is not None
                                           for new in out.scheduled_new_reqs):
                self._track_prompt_logprobs(out)
            batch.update(out, self.vocab_size)
            if self.kv_transfers is not None and out.has_kv_transfers:
                self._start_kv_transfers(out)
            if out.is_empty:
                self.in_flight.append(ModelRunnerOutput(step_id=out.step_id))
                return
            self.buffers.flip()
            inp = batch.prepare(out)
            if out.draft_req_ids:
                self.draft_req_ids[out.step_id] = out.draft_req_ids
        if out.num_decode_steps > 1:
            self._launch_decode_steps(out.step_id, inp, out.num_decode_steps)
            return
        with step_range("forward", out.step_id):
            hidden = self.forward(inp)
            logits = self.model.compute_logits(
                hidden[self.buffers.put("logits_indices", inp.logits_indices)])
        if out.structured_req_ids:  # sampled by apply_grammar_bitmask, once the mask is here
            # the sampling inputs go up now: the mask's arrival is on the step's critical
            # path, so the host does as little as it can after it
            tensors = None if inp.num_drafts is not None else self._sampling_tensors(inp)
            self.awaiting_bitmask = (out.step_id, inp, hidden, logits, tensors)
            return
        self._sample(out.step_id, inp, hidden, logits)

    def _launch_decode_steps(self, step_id: int, inp: StepInputs, num_steps: int) -> None:
        """Several decode steps on the device, their tokens landed together (multi_step.py)."""
        batch, buffers = self.input_batch, self.buffers
        num_seqs = len(inp.rows)
        if len(inp.sample_seq_idx) != num_seqs:
            raise RuntimeError(f"step {step_id}: {num_steps} decode steps for a batch in which "
                               "not every request samples")
        rows = inp.rows
        with step_range("forward", step_id):
            size = self.graphs.padded_size(num_seqs) if self.graphs is not None else None
            input_ids, positions, meta = buffers.load(inp, pad_seqs_to=size)
            pad = (0, meta.num_seqs - num_seqs)  # padding rows sample greedily, unused
            buffers.put("temperature", np.pad(batch.temperature[rows], pad))
            buffers.put("seeds", np.pad(batch.seeds[rows], pad))
            buffers.put("sample_steps", np.pad(batch.num_output_tokens(rows), pad))
            self._fill_placeholders(inp, input_ids)
            tokens = self.multi_step.run(num_steps, num_seqs, input_ids, positions, meta,
                                         replay=size is not None)
        batch.num_pending[rows] += num_steps
        self.in_flight.append(_StepInFlight(step_id, inp, rows, SamplerOutput(tokens[-1]),
                                            [None] * num_seqs, self.copies_by_kernel,
                                            all_tokens=tokens))

    @torch.inference_mode()
    def apply_grammar_bitmask(self, bitmask: GrammarBitmask) -> None:
        """Sample the launched step that waits for its bitmask (structured outputs)."""
        step_id, inp, hidden, logits, tensors = self.awaiting_bitmask
        if bitmask.step_id != step_id:
            raise RuntimeError(f"bitmask of step {bitmask.step_id} for step {step_id}")
        self.awaiting_bitmask = None
        with step_range("bitmask", step_id):
            per_request = 1 if inp.num_drafts is None else inp.num_drafts + 1
            firsts = np.cumsum(np.broadcast_to(per_request, len(inp.sample_seq_idx))) - per_request
            if self._bitmask_ring is None and logits.is_cuda:
                # room for two steps of full masks, so one upload never waits for the last
                rows = 2 * self.config.scheduler.max_num_seqs * per_request
                self._bitmask_ring = PinnedUploadRing(rows * (bitmask.num_words + 1),
                                                      self.device, torch.int32)
            logits = apply_grammar_bitmask(
                logits, {inp.req_ids[i]: int(f) for i, f in zip(inp.sample_seq_idx, firsts)},
                bitmask, self._bitmask_ring)
        self._sample(step_id, inp, hidden, logits, tensors)

    def _sample(self, step_id: int, inp: StepInputs, hidden: torch.Tensor,
                logits: torch.Tensor, tensors: SamplingTensors | None = None) -> None:
        self._sample_step(step_id, inp, hidden, logits, tensors)
        draft_req_ids = self.draft_req_ids.pop(step_id, None)
        if draft_req_ids:  # the drafter needs the step's tokens: land them now
            step = self.in_flight.pop()
            output = step if isinstance(step, ModelRunnerOutput) else self._land(step)
            with step_range("draft", step_id):
                output.draft_token_ids = self.drafter.propose(self.input_batch, draft_req_ids,
                                                              inp, output)
            self.in_flight.append(output)

    def _sampling_tensors(self, inp: StepInputs) -> SamplingTensors:
        """The sampler's inputs for a step without drafts, on the device."""
        return build_sampling_tensors(self.input_batch, inp.rows[inp.sample_seq_idx],
                                      self.vocab_size, self.arch.eos_token_ids, self.device,
                                      rings=self.sampling_rings)

    def _sample_step(self, step_id: int, inp: StepInputs, hidden: torch.Tensor,
                     logits: torch.Tensor, tensors: SamplingTensors | None = None) -> None:
        """tensors: the sampling inputs, if built already (a step that waited for its mask)."""
        if inp.num_drafts is not None:
            with step_range("verify", step_id):
                self.in_flight.append(self._verify(step_id, inp, hidden, logits))
            return
        batch = self.input_batch
        with step_range("sample", step_id):
            sample_rows = inp.rows[inp.sample_seq_idx]
            if tensors is None:
                tensors = self._sampling_tensors(inp)
            sampled = self.sampler(logits, tensors)
            batch.num_pending[sample_rows] += 1
            logprobs = [n if n >= 0 else None for n in batch.logprobs[sample_rows].tolist()]
            prompt = self._prompt_logprobs(inp, hidden) if self.prompt_logprobs else None
            self.in_flight.append(_StepInFlight(step_id, inp, sample_rows, sampled,
                                                logprobs, self.copies_by_kernel, prompt))

    def _verify(self, step_id: int, inp: StepInputs, hidden: torch.Tensor,
                logits: torch.Tensor) -> ModelRunnerOutput:
        """A step with drafts (speculative decoding; one step in flight): every sampling
        request's rows (one per draft, then the one after; a request without drafts has that
        one only) through the rejection sampler, against the distribution plain decoding
        would sample from at each row (sampling_inputs.py: a row sees the drafts before it as
        outputs; sampler.target_distribution); landed on the host before returning."""
        batch, put = self.input_batch, self.buffers.put
        seqs, counts = inp.sample_seq_idx, inp.num_drafts
        rows = inp.rows[seqs]
        draft_ids, cu_rows, width = flat_drafts(
            [batch.token_ids[r, batch.num_tokens[r]:batch.num_tokens[r] + k]
             for r, k in zip(rows, counts)])
        ahead = np.arange(len(draft_ids)) - np.repeat(cu_rows[:-1], counts + 1)
        t = build_sampling_tensors(batch, np.repeat(rows, counts + 1), self.vocab_size,
                                   self.arch.eos_token_ids, self.device, ahead,
                                   self.sampling_rings)
        raw = raw_logprobs(logits, t)
        target, temperature = target_distribution(logits, t)
        cu = put("cu_draft_rows", cu_rows)
        firsts = cu[:-1]  # each request's first row: its temperature, seed and output index
        emitted = rejection_sample(target, put("draft_ids", draft_ids), cu, temperature[firsts],
                                   t.seeds[firsts], t.steps[firsts], width)
        if raw is not None:  # the emitted tokens' logprobs at the rows that drew them
            at = torch.minimum(firsts[:, None] + torch.arange(width, device=cu.device),
                               cu[1:, None] - 1)
            own = raw[at, emitted.clamp(min=0)].tolist()
            top = raw.topk(t.max_logprobs, dim=-1) if t.max_logprobs > 0 else None
            top_ids = top.indices[at].tolist() if top is not None else None
            top_lps = top.values[at].tolist() if top is not None else None
        # host work before the wait: the device idles through what follows it
        sampled_ids: list[list[int]] = [[] for _ in inp.req_ids]
        logprobs: list[list[LogprobsEntry] | None] = [None] * len(inp.req_ids)
        asked = list(zip(seqs.tolist(), batch.logprobs[rows].tolist()))
        emitted = _landed(emitted, self.copies_by_kernel).tolist()
        for i, (seq, n) in enumerate(asked):
            tokens = [token for token in emitted[i] if token >= 0]
            sampled_ids[seq] = tokens
            batch.append_tokens(inp.req_ids[seq], tokens)
            if raw is not None and n >= 0:
                logprobs[seq] = [LogprobsEntry(own[i][j], top_ids[i][j][:n] if n else [],
                                               top_lps[i][j][:n] if n else [])
                                 for j in range(len(tokens))]
        output = ModelRunnerOutput(step_id=step_id, req_ids=inp.req_ids,
                                   sampled_token_ids=sampled_ids,
                                   logprobs=logprobs if raw is not None else [])
        if self.prompt_logprobs:  # prefill chunks beside the drafts may score their prompts
            prompt = self._prompt_logprobs(inp, hidden)
            output.prompt_logprobs = prompt.to_host() if prompt else {}
        return output

    def _track_prompt_logprobs(self, out: SchedulerOutput) -> None:
        for req_id in out.finished_req_ids:
            self.prompt_logprobs.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            n = new.sampling_params.prompt_logprobs
            if n is not None:
                self.prompt_logprobs[new.req_id] = n

    def _prompt_logprobs(self, inp: StepInputs, hidden: torch.Tensor) -> "_PromptLogprobs | None":
        """Queue the logprobs of the prompt tokens this step's chunks score: a position's
        logits score the next token, so a chunk covering positions [s, e) of a prompt of L
        tokens scores tokens s+1 .. min(e, L-1). Those rows only go through the LM head."""
        batch, asked = self.input_batch, self.prompt_logprobs
        cu, positions = inp.cu_seqlens_q, inp.positions
        runs, flat, targets, scored = [], [], [], []
        for i, req_id in enumerate(inp.req_ids):
            n = asked.get(req_id)
            if n is None:
                continue
            first, row = int(cu[i]), int(inp.rows[i])
            start = int(positions[first])
            last = int(batch.num_prompt_tokens[row]) - 1
            end = min(start + int(cu[i + 1]) - first, last)
            if end == last:  # the prompt is scored: nothing more to track for it
                scored.append(req_id)
            if end <= start:
                continue  # a chunk that only holds the last prompt token
            runs.append((req_id, start + 1, end - start, n))
            flat.append(np.arange(first, first + end - start))
            targets.append(batch.token_ids[row, start + 1:end + 1])
        for req_id in scored:  # a preempted request comes back new, and is tracked again
            del asked[req_id]
        if not runs:
            return None
        flat_idx = upload(np.concatenate(flat), self.device)
        target_ids = upload(np.concatenate(targets), self.device)
        top_n = max(run[3] for run in runs)
        rows = hidden[flat_idx]
        step = max(1, PROMPT_LOGITS_ELEMENTS // self.vocab_size)
        pieces = []
        for a in range(0, len(rows), step):
            logprobs = torch.log_softmax(self.model.compute_logits(rows[a:a + step]), dim=-1,
                                         dtype=torch.float32)
            own = logprobs.gather(-1, target_ids[a:a + step, None])
            rank = (logprobs >= own).sum(dim=-1)  # ties ranked last, as vLLM
            top = logprobs.topk(top_n, dim=-1) if top_n else None
            pieces.append((own.squeeze(-1), rank, top.indices if top else None,
                           top.values if top else None))
        own, rank, top_ids, top_lps = (
            torch.cat(parts) if parts[0] is not None else None for parts in zip(*pieces))
        return _PromptLogprobs(runs, own, rank, top_ids, top_lps, self.copies_by_kernel)

    def oldest_step_done(self) -> bool:
        """Whether collect() would return without waiting for the device."""
        item = self.in_flight[0]
        return isinstance(item, ModelRunnerOutput) or item.ready.query()

    def collect(self) -> ModelRunnerOutput:
        """The oldest launched step's output, waiting for the device if needed."""
        item = self.in_flight.popleft()
        output = item if isinstance(item, ModelRunnerOutput) else self._land(item)
        transfers = self.kv_transfers
        if transfers is not None:
            output.finished_kv_transfers = transfers.poll_done()
            if output.finished_kv_transfers:
                output.kv_transfer_totals = (*transfers.bytes_moved, transfers.seconds)
        return output

    def _start_kv_transfers(self, out: SchedulerOutput) -> None:
        """Order this rank's work after the copies the scheduler saw done, then start this
        step's own copies (docs/ARCHITECTURE.md, KV offload)."""
        transfers = self.kv_transfers
        if out.released_kv_transfers:
            transfers.release(out.released_kv_transfers)
        if out.kv_transfers:
            with step_range("kv-transfers", out.step_id):
                for plan in out.kv_transfers:
                    transfers.start(plan.transfer_id, [d for d, _ in plan.stores],
                                    [h for _, h in plan.stores], [h for h, _ in plan.loads],
                                    [d for _, d in plan.loads], plan.ordered)
                    if plan.before_step:
                        transfers.wait_on_device(plan.transfer_id)

    def _land(self, step: "_StepInFlight") -> ModelRunnerOutput:
        start = time.perf_counter()
        transfers = self.kv_transfers
        # a transfer queues only a chunk or two at a time (KVTransfers): feed it the next while
        # the step runs, so the copy engine does not idle until the next poll
        while transfers is not None and transfers.unissued and not step.ready.query():
            transfers.pump()
        step.ready.synchronize()
        self.device_wait_s += time.perf_counter() - start
        with step_range("output", step.step_id):  # after the wait: CPU work only
            token_ids = step.host_tokens.tolist()
            req_ids = [step.inp.req_ids[i] for i in step.inp.sample_seq_idx]
            if step.host_tokens.dim() == 1:
                self.input_batch.append_sampled(req_ids, token_ids)
                return self._runner_output(step, [[t] for t in token_ids])
            for tokens_of_step in token_ids:  # [steps, requests]
                self.input_batch.append_sampled(req_ids, tokens_of_step)
            return self._runner_output(step, [list(t) for t in zip(*token_ids)])

    def _land_all(self) -> None:
        self.in_flight = deque(item if isinstance(item, ModelRunnerOutput) else self._land(item)
                               for item in self.in_flight)

    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Hidden states of every scheduled token: [num_tokens, hidden]."""
        num_seqs, num_tokens = len(inp.seq_lens), len(inp.input_ids)
        query_len = num_tokens // max(num_seqs, 1)
        # decodes, or decodes verifying the same number of drafts each
        cu = inp.cu_seqlens_q
        if (self.graphs is not None and num_tokens == query_len * num_seqs
                and (query_len == 1 or (cu[1:] - cu[:-1] == query_len).all())):
            size = self.graphs.padded_size(num_seqs, query_len)
            if size is not None:
                input_ids, _, _ = self.buffers.load(inp, pad_seqs_to=size)
                self._fill_placeholders(inp, input_ids)
                hidden = self.graphs.replay(size, query_len)[:num_tokens]
                if self.drafter is not None:
                    self.drafter.follow(None, None, None, graph=(size, query_len))
                return hidden
        input_ids, positions, meta = self.buffers.load(inp)
        self._fill_placeholders(inp, input_ids)
        forward = self.persistent if self.persistent is not None and num_tokens == 1 \
            else self.model
        hidden = forward(input_ids, positions, ForwardContext(self.backend, meta, self.kv_caches))
        if self.drafter is not None:
            self.drafter.follow(input_ids, positions, meta, graph=None)
        return hidden

    def _fill_placeholders(self, inp: StepInputs, input_ids: torch.Tensor) -> None:
        """Write the tokens the previous step is still sampling into this step's input_ids
        (StepBuffers.load's view), on the device."""
        if not len(inp.placeholder_idx):
            return
        # only the latest launched step can still owe tokens
        previous = next(i for i in reversed(self.in_flight) if isinstance(i, _StepInFlight))
        index_of_row = {row: i for i, row in enumerate(previous.rows.tolist())}
        source = np.array([index_of_row[r] for r in inp.placeholder_rows.tolist()])
        target = self.buffers.put("placeholder_idx", inp.placeholder_idx)
        source = self.buffers.put("placeholder_src", source)
        input_ids[target] = previous.sampled.token_ids[source]

    @staticmethod
    def _runner_output(step: "_StepInFlight", token_ids: list[list[int]]) -> ModelRunnerOutput:
        """token_ids: each sampling request's tokens, in sample_seq_idx order."""
        inp, sampled = step.inp, step.sampled
        sampled_ids: list[list[int]] = [[] for _ in inp.req_ids]
        logprobs: list[list[LogprobsEntry] | None] = [None] * len(inp.req_ids)
        host = None
        if sampled.logprob is not None:
            host = (sampled.logprob.tolist(),
                    sampled.top_ids.tolist() if sampled.top_ids is not None else None,
                    sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None)
        for i, (seq, tokens, n) in enumerate(zip(inp.sample_seq_idx.tolist(), token_ids,
                                                 step.logprobs)):
            sampled_ids[seq] = tokens
            if host is not None and n is not None:
                logprobs[seq] = [LogprobsEntry(host[0][i], host[1][i][:n] if n else [],
                                               host[2][i][:n] if n else [])]
        return ModelRunnerOutput(step_id=step.step_id, req_ids=inp.req_ids,
                                 sampled_token_ids=sampled_ids,
                                 logprobs=logprobs if host is not None else [],
                                 prompt_logprobs=step.prompt.to_host() if step.prompt else {})


def _landed(tensor: torch.Tensor, by_kernel: bool) -> torch.Tensor:
    """A device tensor on the host once the work before it is done: copied to pinned memory
    behind it and waited for, which ends as the copy does (a .tolist() of the device tensor
    starts its own copy after the wait)."""
    host = _to_host_async(tensor, by_kernel)
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
    return host


def _to_host_async(tensor: torch.Tensor | None, by_kernel: bool) -> torch.Tensor | None:
    if tensor is None or not tensor.is_cuda:
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return copy_pinned(host, tensor, by_kernel)


class _PromptLogprobs:
    """A step's prompt logprobs on the device: one run of prompt tokens per request that asked
    (request id, first token scored, tokens, top-N), their rows concatenated."""

    def __init__(self, runs: list[tuple[str, int, int, int]], own: torch.Tensor,
                 rank: torch.Tensor, top_ids: torch.Tensor | None, top_lps: torch.Tensor | None,
                 by_kernel: bool):
        self.runs = runs
        # copied to pinned memory behind the step, as its sampled tokens are: landing them
        # after the step's event then reads host memory instead of waiting for the next step
        self.own, self.rank, self.top_ids, self.top_lps = (
            _to_host_async(t, by_kernel) for t in (own, rank, top_ids, top_lps))

    def to_host(self) -> dict[str, PromptLogprobs]:
        own, rank = self.own.tolist(), self.rank.tolist()
        top_ids = self.top_ids.tolist() if self.top_ids is not None else None
        top_lps = self.top_lps.tolist() if self.top_lps is not None else None
        result, at = {}, 0
        for req_id, start, count, n in self.runs:
            end = at + count
            entry = PromptLogprobs(start, own[at:end], rank[at:end])
            if n:
                entry.top_token_ids = [ids[:n] for ids in top_ids[at:end]]
                entry.top_logprobs = [lps[:n] for lps in top_lps[at:end]]
            result[req_id] = entry
            at = end
        return result


class _StepInFlight:
    """A launched step: its inputs, and its sampled tokens on their way to the host. With
    several decode steps, all_tokens [steps, requests] land and sampled holds the last step's,
    which the next launch may read as inputs."""

    def __init__(self, step_id: int, inp: StepInputs, rows: np.ndarray, sampled: SamplerOutput,
                 logprobs: list[int | None], by_kernel: bool,
                 prompt: _PromptLogprobs | None = None, all_tokens: torch.Tensor | None = None):
        self.step_id, self.inp, self.rows, self.sampled = step_id, inp, rows, sampled
        self.logprobs = logprobs  # top-N asked for by each sampled request
        self.prompt = prompt  # its host copies are queued before the event below
        tokens = sampled.token_ids if all_tokens is None else all_tokens
        if tokens.is_cuda:
            self.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            copy_pinned(self.host_tokens, tokens, by_kernel)
            self.ready = torch.cuda.Event()
            self.ready.record()
        else:
            self.host_tokens, self.ready = tokens, _NoEvent()


class _NoEvent:
    """Stands in for a CUDA event on the CPU, where the step has already run."""

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True
