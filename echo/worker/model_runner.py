"""ModelRunner: owns the model, the KV cache and the persistent batch of one worker (one TP rank).

`execute_model(scheduler_output)` applies the step's diff, runs the forward pass over the mixed
batch, samples for the requests whose prompt is fully computed, and returns their tokens.
"""

import numpy as np
import torch

from echo import envs
from echo.attention.backend import AttentionMetadata, KVCache, make_backend
from echo.config import EngineConfig
from echo.core.sched_output import SchedulerOutput
from echo.distributed.parallel_state import SINGLE, TPGroup
from echo.engine.messages import LogprobsEntry, ModelRunnerOutput
from echo.layers.attention import ForwardContext
from echo.models.loader import build_model
from echo.worker.input_batch import InputBatch, StepInputs
from echo.worker.sampler import Sampler, SamplerOutput, SamplingTensors


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: TPGroup = SINGLE,
                 device: torch.device | None = None):
        self.config = config
        self.tp = tp
        self.device = device or torch.device(config.device.device)
        self.arch = config.model.arch
        self.dtype = getattr(torch, config.model.dtype)
        self.model = build_model(config.model, self.device, tp)
        attn = self.model.model.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim
        self.backend = make_backend(config.device.attention_backend, attn.num_heads,
                                    self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        self.sampler = Sampler()
        self.vocab_size = self.arch.vocab_size
        self.kv_caches: list[KVCache] = []
        self.input_batch: InputBatch | None = None

    # ---- KV cache -------------------------------------------------------------------------

    def kv_bytes_per_block(self) -> int:
        per_token = 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize
        return per_token * self.config.cache.block_size * self.arch.num_layers

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
        self.init_kv_cache(1)
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
            self.sampler(logits, self._profile_sampling(sched.max_num_seqs))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        self.kv_caches = []
        torch.cuda.empty_cache()
        return peak

    def _profile_sampling(self, n: int) -> SamplingTensors:
        full = lambda v, dt: torch.full((n,), v, dtype=dt, device=self.device)  # noqa: E731
        counts = torch.zeros(n, self.vocab_size, device=self.device)
        return SamplingTensors(
            full(0.7, torch.float32), full(50, torch.int64), full(0.9, torch.float32),
            full(0.05, torch.float32), full(1, torch.int64), full(0, torch.int64),
            all_greedy=False, need_top_k=True, need_top_p=True, need_min_p=True, max_logprobs=20,
            presence=full(0.1, torch.float32), frequency=full(0.1, torch.float32),
            repetition=full(1.1, torch.float32), output_counts=counts,
            prompt_mask=counts > 0, banned=counts > 0)

    def init_kv_cache(self, num_blocks: int) -> None:
        shape = (num_blocks, self.config.cache.block_size, self.num_kv_heads, self.head_dim)
        self.kv_caches = [
            KVCache(torch.zeros(shape, dtype=self.dtype, device=self.device),
                    torch.zeros(shape, dtype=self.dtype, device=self.device))
            for _ in range(self.arch.num_layers)
        ]
        sched = self.config.scheduler
        max_blocks = -(-sched.max_model_len // self.config.cache.block_size)
        if self.input_batch is None:
            # +1 token column: a request finishing at max_model_len may still be handed a token
            self.input_batch = InputBatch(sched.max_num_seqs, sched.max_model_len + 1,
                                          max_blocks + 1, self.config.cache.block_size,
                                          self.config.model.seed)

    # ---- one step -------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, out: SchedulerOutput) -> ModelRunnerOutput:
        batch = self.input_batch
        batch.update(out, self.vocab_size)
        if out.is_empty:
            return ModelRunnerOutput(step_id=out.step_id)
        inp = batch.prepare(out)
        hidden = self.forward(inp)
        logits = self.model.compute_logits(hidden[self._to_device(inp.logits_indices)])
        sample_rows = inp.rows[inp.sample_seq_idx]
        sampled = self.sampler(logits, self._sampling_tensors(sample_rows))
        token_ids = sampled.token_ids.tolist()
        batch.append_sampled(sample_rows, token_ids)
        return self._runner_output(out.step_id, inp, sample_rows, token_ids, sampled)

    def forward(self, inp: StepInputs) -> torch.Tensor:
        """Hidden states of every scheduled token: [num_tokens, hidden]."""
        ctx = ForwardContext(self.backend, self._attention_metadata(inp), self.kv_caches)
        return self.model(self._to_device(inp.input_ids), self._to_device(inp.positions), ctx)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        tensor = torch.from_numpy(array)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor

    def _attention_metadata(self, inp: StepInputs) -> AttentionMetadata:
        query_lens = np.diff(inp.cu_seqlens_q)
        return AttentionMetadata(
            slot_mapping=self._to_device(inp.slot_mapping),
            block_table=self._to_device(inp.block_table),
            cu_seqlens_q=self._to_device(inp.cu_seqlens_q),
            seq_lens=self._to_device(inp.seq_lens),
            max_seqlen_q=int(query_lens.max()),
            max_seqlen_k=int(inp.seq_lens.max()),
            query_lens_cpu=tuple(query_lens.tolist()),
            seq_lens_cpu=tuple(inp.seq_lens.tolist()),
        )

    def _sampling_tensors(self, rows: np.ndarray) -> SamplingTensors:
        b = self.input_batch
        params = [b.params[r] for r in rows]
        dev = lambda a: self._to_device(np.ascontiguousarray(a))  # noqa: E731
        top_k = b.top_k[rows]
        top_p = b.top_p[rows]
        min_p = b.min_p[rows]
        temperature = b.temperature[rows]
        logprobs = [p.logprobs for p in params if p.logprobs is not None]
        kwargs = {}
        if any(p.has_penalties for p in params):
            kwargs = self._penalty_tensors(rows, params)
        banned = self._banned_tokens(rows, params)
        if banned is not None:
            kwargs["banned"] = banned
        return SamplingTensors(
            temperature=dev(temperature), top_k=dev(top_k), top_p=dev(top_p), min_p=dev(min_p),
            seeds=dev(b.seeds[rows]), steps=dev(b.num_tokens[rows] - b.num_prompt_tokens[rows]),
            all_greedy=bool((temperature == 0).all()),
            need_top_k=bool((top_k < self.vocab_size).any()),
            need_top_p=bool((top_p < 1).any()), need_min_p=bool((min_p > 0).any()),
            max_logprobs=max(logprobs) if logprobs else None, **kwargs)

    def _penalty_tensors(self, rows: np.ndarray, params) -> dict:
        b, n, v = self.input_batch, len(rows), self.vocab_size
        counts = torch.zeros(n, v, dtype=torch.float32)
        prompt_mask = torch.zeros(n, v, dtype=torch.bool)
        for i, row in enumerate(rows):
            prompt_len, total = b.num_prompt_tokens[row], b.num_tokens[row]
            prompt_mask[i, torch.from_numpy(b.token_ids[row, :prompt_len])] = True
            out = torch.from_numpy(b.token_ids[row, prompt_len:total])
            counts[i].index_add_(0, out, torch.ones(len(out)))
        pick = lambda name: np.array([getattr(p, name) for p in params], np.float32)  # noqa
        return {"presence": self._to_device(pick("presence_penalty")),
                "frequency": self._to_device(pick("frequency_penalty")),
                "repetition": self._to_device(pick("repetition_penalty")),
                "output_counts": counts.to(self.device), "prompt_mask": prompt_mask.to(self.device)}

    def _banned_tokens(self, rows: np.ndarray, params) -> torch.Tensor | None:
        """EOS and stop tokens are banned until a request has min_tokens outputs."""
        b = self.input_batch
        pending = [i for i, (row, p) in enumerate(zip(rows, params))
                   if p.min_tokens > b.num_tokens[row] - b.num_prompt_tokens[row]]
        if not pending:
            return None
        banned = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool)
        for i in pending:
            stops = [t for t in (*self.arch.eos_token_ids, *params[i].stop_token_ids)
                     if t < self.vocab_size]
            banned[i, stops] = True
        return banned.to(self.device)

    def _runner_output(self, step_id: int, inp: StepInputs, rows: np.ndarray,
                       token_ids: list[int], sampled: SamplerOutput) -> ModelRunnerOutput:
        sampled_ids: list[list[int]] = [[] for _ in inp.req_ids]
        logprobs: list[LogprobsEntry | None] = [None] * len(inp.req_ids)
        host = None
        if sampled.logprob is not None:
            host = (sampled.logprob.tolist(),
                    sampled.top_ids.tolist() if sampled.top_ids is not None else None,
                    sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None)
        for i, (seq, row, token) in enumerate(zip(inp.sample_seq_idx.tolist(), rows, token_ids)):
            sampled_ids[seq] = [token]
            n = self.input_batch.params[row].logprobs
            if host is not None and n is not None:
                logprobs[seq] = LogprobsEntry(host[0][i], host[1][i][:n] if n else [],
                                              host[2][i][:n] if n else [])
        return ModelRunnerOutput(step_id=step_id, req_ids=inp.req_ids,
                                 sampled_token_ids=sampled_ids,
                                 logprobs=logprobs if host is not None else [])
