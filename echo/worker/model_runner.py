"""ModelRunner: owns the model, the KV cache and the persistent batch of one worker (one TP rank).

`launch(scheduler_output)` applies the step's diff, runs the forward pass over the mixed batch
and samples for the requests whose tokens are all computed, without waiting for the device;
`collect()` returns the oldest launched step's tokens. `execute_model` is the two in a row.
"""

import sys
from collections import deque

import numpy as np
import torch

from echo import envs
from echo.attention.backend import AttentionMetadata, KVCache, make_backend
from echo.config import EngineConfig
from echo.core.sched_output import SchedulerOutput
from echo.core.step_results import LogprobsEntry, ModelRunnerOutput
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.layers.attention import ForwardContext
from echo.profiling import profiler_window, step_range
from echo.worker.cuda_graphs import CudaGraphRunner
from echo.worker.input_batch import InputBatch, StepInputs
from echo.worker.kernel_warmup import warmup_batches, warmup_metadata, warmup_positions
from echo.worker.kv_cache import KVCacheSpec
from echo.worker.model_loader import build_model
from echo.worker.sampler import Sampler, SamplerOutput
from echo.worker.sampling_inputs import build_sampling_tensors, worst_case_sampling_tensors
from echo.worker.step_buffers import StepBuffers


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
        self.model = build_model(config.model, self.device, tp)
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
        self.input_batch: InputBatch | None = None
        self.buffers: StepBuffers | None = None
        self.graphs: CudaGraphRunner | None = None
        # launched steps, oldest first: outputs ready, or steps still on the device
        self.in_flight: deque[ModelRunnerOutput | _StepInFlight] = deque()
        self.profile_window = profiler_window(f"rank{tp.rank}")  # ECHO_PROFILE_STEPS

    # ---- KV cache -------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        return self.kv_cache_spec.bytes_per_block()

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_gpu_blocks_override is not None:
            return cache.num_gpu_blocks_override
        if self.device.type != "cuda":
            budget = envs.cpu_kv_cache_gib() * 2**30
        else:
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            peak = self.profile_activation_bytes()
            budget = total * cache.gpu_memory_utilization - (total - free) - peak
        num_blocks = int(budget // self.kv_bytes_per_block())
        if num_blocks < 1:
            raise RuntimeError("no memory left for the KV cache: raise gpu_memory_utilization "
                               "or lower max_num_batched_tokens")
        return num_blocks

    def profile_activation_bytes(self) -> int:
        """Peak activation memory of the largest step: every token a one-token sequence."""
        sched = self.config.scheduler
        self.kv_caches = self._allocate_kv_cache(1)
        num_tokens = sched.max_num_batched_tokens
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        ones = torch.ones(num_tokens, dtype=torch.int32, device=self.device)
        meta = AttentionMetadata(
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_table=torch.zeros((num_tokens, 1), dtype=torch.int32, device=self.device),
            cu_seqlens_q=torch.arange(num_tokens + 1, dtype=torch.int32, device=self.device),
            seq_lens=ones, max_seqlen_q=1, max_seqlen_k=1,
            query_lens_cpu=(1,) * num_tokens, seq_lens_cpu=(1,) * num_tokens)
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            hidden = self.model(ids, ids, ForwardContext(self.backend, meta, self.kv_caches))
            logits = self.model.compute_logits(hidden[: sched.max_num_seqs])
            self.sampler(logits, worst_case_sampling_tensors(sched.max_num_seqs,
                                                             self.vocab_size, self.device))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        return self.kv_cache_spec.allocate(num_blocks, self.device)

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache and the step state; capture CUDA graphs where they apply."""
        self.kv_caches = self._allocate_kv_cache(num_blocks)
        if self.tp.rank == 0:  # every rank holds the same number of blocks
            print(f"echo: {self.kv_cache_spec.describe(num_blocks, self.tp.size)}",
                  file=sys.stderr, flush=True)
        sched = self.config.scheduler
        max_blocks = -(-sched.max_model_len // self.config.cache.block_size) + 1
        # +1 token column: a request finishing at max_model_len may still be handed a token
        self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len + 1, max_blocks,
                                      self.config.cache.block_size, self.config.model.seed)
        self.buffers = StepBuffers(sched.max_num_batched_tokens, sched.max_num_seqs, max_blocks,
                                   self.device)
        if self.device.type == "cuda" and envs.tune_small_m():
            self._tune_one_row_linears()  # before capture: the graphs record the choice
        self.graphs = None
        if self.use_cuda_graphs:
            self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_caches, self.buffers,
                                          sched.max_num_seqs, sched.max_model_len)
            self.graphs.capture()
        if self.device.type == "cuda":
            if self.backend.name == "triton":
                self.warm_up_step_shapes()
                self.warm_up_kernel_variants()
            self._warm_up_logits(sched.max_num_seqs)

    @torch.inference_mode()
    def _tune_one_row_linears(self) -> None:
        from echo.worker.linear_tuning import cuda_graph_timer, tune_one_row_linears

        for choice in tune_one_row_linears(self.model, cuda_graph_timer):
            if self.tp.rank == 0:
                print(f"echo: one-row linear {choice.describe()}", file=sys.stderr, flush=True)
        # the timing graphs' private pools stay cached after the graphs are gone; with the KV
        # cache already allocated, eager steps would have to free them first
        torch.cuda.empty_cache()

    @torch.inference_mode()
    def warm_up_step_shapes(self) -> list[torch.Tensor]:
        """Run the eager step shapes of kernel_warmup once, so their kernels compile now; returns
        each batch's logits at its sequences' last tokens. Stores nothing in the cache."""
        sched = self.config.scheduler
        all_logits = []
        for batch in warmup_batches(sched.max_model_len, sched.max_num_batched_tokens,
                                    sched.max_num_seqs):
            meta = warmup_metadata(batch, self.config.cache.block_size, self.device)
            positions = warmup_positions(batch, self.device)
            hidden = self.model(torch.zeros_like(positions), positions,
                                ForwardContext(self.backend, meta, self.kv_caches))
            logits = self.model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])
            self.sampler(logits, worst_case_sampling_tensors(len(batch.query_lens),
                                                             self.vocab_size, self.device))
            all_logits.append(logits)
        return all_logits

    @torch.inference_mode()
    def warm_up_kernel_variants(self) -> None:
        """Compile every attention and sampling kernel variant a step can need, which the
        step shapes above do not all reach (echo_kernels.attention.warmup)."""
        from echo_kernels.attention.warmup import (
            warm_up_paged_attention,
            warm_up_varlen_attention,
        )
        from echo_kernels.sampling import warm_up_gumbel_sample

        cache, attn = self.kv_caches[0], self.model.model.layers[0].self_attn
        # decode batches rotate and store their K/V in the attention launch (triton backend)
        rope = attn.rope_inputs(torch.zeros(1, dtype=torch.long, device=self.device))
        warm_up_paged_attention(attn.num_heads, cache.k, cache.v, cache.k_scale, cache.v_scale,
                                self.config.scheduler.max_model_len, self.dtype,
                                qk_norm=rope.q_norm_weight is not None)
        warm_up_varlen_attention(attn.num_heads, self.num_kv_heads, self.head_dim, self.dtype,
                                 self.device)
        # the sampler reads the LM head's logits, or float32 ones after filters and penalties
        warm_up_gumbel_sample(self.config.scheduler.max_num_seqs, self.vocab_size,
                              [self.dtype, torch.float32], self.device)

    @torch.inference_mode()
    def _warm_up_logits(self, max_rows: int) -> None:
        """Run the LM head once at every row count a step can sample. cuBLAS picks a different
        kernel for many row counts and loads each on first use; measured on an H200, such a
        load stalled the host ~8 ms inside the step while the GPU ran dry (4 ms idle gaps every
        ~10 steps of the offline benchmark). Start-up is the place to pay for it."""
        hidden = torch.zeros(max_rows, self.arch.hidden_size, dtype=self.dtype,
                             device=self.device)
        for rows in range(1, max_rows + 1):
            self.model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(self.device)

    @property
    def use_cuda_graphs(self) -> bool:
        # the torch backend loops over sequences on the host: it cannot be captured
        return (self.device.type == "cuda" and not self.config.device.enforce_eager
                and self.backend.name == "triton")

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
            if self.in_flight and batch.num_with_penalties:
                self._land_all()  # penalties count tokens on the host: they must be there
            batch.update(out, self.vocab_size)
            if out.is_empty:
                self.in_flight.append(ModelRunnerOutput(step_id=out.step_id))
                return
            self.buffers.flip()
            inp = batch.prepare(out)
        with step_range("forward", out.step_id):
            hidden = self.forward(inp)
            logits = self.model.compute_logits(
                hidden[self.buffers.put("logits_indices", inp.logits_indices)])
        with step_range("sample", out.step_id):
            sample_rows = inp.rows[inp.sample_seq_idx]
            sampled = self.sampler(logits, build_sampling_tensors(
                batch, sample_rows, self.vocab_size, self.arch.eos_token_ids, self.device))
            batch.num_pending[sample_rows] += 1
            logprobs = [n if n >= 0 else None for n in batch.logprobs[sample_rows].tolist()]
            self.in_flight.append(_StepInFlight(out.step_id, inp, sample_rows, sampled,
                                                logprobs))

    def oldest_step_done(self) -> bool:
        """Whether collect() would return without waiting for the device."""
        item = self.in_flight[0]
        return isinstance(item, ModelRunnerOutput) or item.ready.query()

    def collect(self) -> ModelRunnerOutput:
        """The oldest launched step's output, waiting for the device if needed."""
        item = self.in_flight.popleft()
        return item if isinstance(item, ModelRunnerOutput) else self._land(item)

    def _land(self, step: "_StepInFlight") -> ModelRunnerOutput:
        step.ready.synchronize()
        with step_range("output", step.step_id):  # after the wait: CPU work only
            token_ids = step.host_tokens.tolist()
            req_ids = [step.inp.req_ids[i] for i in step.inp.sample_seq_idx]
            self.input_batch.append_sampled(req_ids, token_ids)
            return self._runner_output(step, token_ids)

    def _land_all(self) -> None:
        self.in_flight = deque(item if isinstance(item, ModelRunnerOutput) else self._land(item)
                               for item in self.in_flight)

    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Hidden states of every scheduled token: [num_tokens, hidden]."""
        num_seqs, num_tokens = len(inp.seq_lens), len(inp.input_ids)
        if self.graphs is not None and num_tokens == num_seqs:  # decode only
            size = self.graphs.padded_size(num_seqs)
            if size is not None:
                self.buffers.load(inp, pad_seqs_to=size)
                self._fill_placeholders(inp)
                return self.graphs.replay(size)[:num_tokens]
        input_ids, positions, meta = self.buffers.load(inp)
        self._fill_placeholders(inp)
        return self.model(input_ids, positions, ForwardContext(self.backend, meta,
                                                               self.kv_caches))

    def _fill_placeholders(self, inp: StepInputs) -> None:
        if not len(inp.placeholder_idx):
            return
        # only the latest launched step can still owe tokens
        previous = next(i for i in reversed(self.in_flight) if isinstance(i, _StepInFlight))
        index_of_row = {row: i for i, row in enumerate(previous.rows.tolist())}
        source = np.array([index_of_row[r] for r in inp.placeholder_rows.tolist()])
        target = self.buffers.put("placeholder_idx", inp.placeholder_idx)
        source = self.buffers.put("placeholder_src", source)
        self.buffers.tensor("input_ids")[target] = previous.sampled.token_ids[source]

    @staticmethod
    def _runner_output(step: "_StepInFlight", token_ids: list[int]) -> ModelRunnerOutput:
        inp, sampled = step.inp, step.sampled
        sampled_ids: list[list[int]] = [[] for _ in inp.req_ids]
        logprobs: list[LogprobsEntry | None] = [None] * len(inp.req_ids)
        host = None
        if sampled.logprob is not None:
            host = (sampled.logprob.tolist(),
                    sampled.top_ids.tolist() if sampled.top_ids is not None else None,
                    sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None)
        for i, (seq, token, n) in enumerate(zip(inp.sample_seq_idx.tolist(), token_ids,
                                                step.logprobs)):
            sampled_ids[seq] = [token]
            if host is not None and n is not None:
                logprobs[seq] = LogprobsEntry(host[0][i], host[1][i][:n] if n else [],
                                              host[2][i][:n] if n else [])
        return ModelRunnerOutput(step_id=step.step_id, req_ids=inp.req_ids,
                                 sampled_token_ids=sampled_ids,
                                 logprobs=logprobs if host is not None else [])


class _StepInFlight:
    """A launched step: its inputs, and its sampled tokens on their way to the host."""

    def __init__(self, step_id: int, inp: StepInputs, rows: np.ndarray, sampled: SamplerOutput,
                 logprobs: list[int | None]):
        self.step_id, self.inp, self.rows, self.sampled = step_id, inp, rows, sampled
        self.logprobs = logprobs  # top-N asked for by each sampled request
        tokens = sampled.token_ids
        if tokens.is_cuda:
            self.host_tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host_tokens.copy_(tokens, non_blocking=True)
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
