"""A ModelRunner's start-up: how many KV blocks fit, then, once the cache exists, what makes the
first requests as fast as later ones.

1. `determine_num_blocks`: on CUDA, run the largest step once (every token a one-token
   sequence) to measure peak activation memory; the KV cache gets what is left of
   gpu_memory_utilization.
2. `prepare_step_path`, after the cache is allocated: time the one-row GEMV against cuBLAS per
   linear shape (linear_tuning.py, before capture: the graphs record the choice), capture the
   decode CUDA graphs, run the eager step shapes and every kernel variant once so Triton
   compiles them now (kernel_warmup.py, echo_kernels/attention/warmup.py), and run the LM head
   at every row count.

The step itself (launch/collect) is model_runner.py's; these functions only read the runner.
"""

import sys

import torch

from echo import envs
from echo.layers.attention import ForwardContext
from echo.worker.cuda_graphs import CudaGraphRunner
from echo.worker.kernel_warmup import (
    WarmupBatch,
    warmup_batches,
    warmup_metadata,
    warmup_positions,
)
from echo.worker.kv_transfer import staging_blocks
from echo.worker.sampling_inputs import worst_case_sampling_tensors


def determine_num_blocks(runner) -> int:
    cache = runner.config.cache
    if cache.num_gpu_blocks_override is not None:
        return cache.num_gpu_blocks_override
    if runner.device.type != "cuda":
        budget = envs.cpu_kv_cache_gib() * 2**30
    else:
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(runner.device)
        peak = profile_activation_bytes(runner)
        budget = total * cache.gpu_memory_utilization - (total - free) - peak
    if cache.kv_offloading_size is not None:  # the host tier's staging buffer, on the device
        budget -= staging_blocks() * runner.kv_cache_spec.bytes_per_block()
    num_blocks = int(budget // runner.kv_bytes_per_block())
    if num_blocks < 1:
        raise RuntimeError("no memory left for the KV cache: raise gpu_memory_utilization "
                           "or lower max_num_batched_tokens")
    return num_blocks


@torch.inference_mode()
def profile_activation_bytes(runner) -> int:
    """Peak activation memory of the largest step: every token a one-token sequence."""
    sched, device = runner.config.scheduler, runner.device
    caches = runner.kv_cache_spec.allocate(1, device)
    num_tokens = sched.max_num_batched_tokens
    ids = torch.zeros(num_tokens, dtype=torch.int64, device=device)
    meta = warmup_metadata(WarmupBatch((1,) * num_tokens, (1,) * num_tokens),
                           runner.config.cache.block_size, device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    hidden = runner.model(ids, ids, ForwardContext(runner.backend, meta, caches))
    logits = runner.model.compute_logits(hidden[: sched.max_num_seqs])
    runner.sampler(logits, worst_case_sampling_tensors(sched.max_num_seqs, runner.vocab_size,
                                                       device))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches, hidden, logits
    torch.cuda.empty_cache()
    return peak


def uses_cuda_graphs(runner) -> bool:
    # the torch backend loops over sequences on the host: it cannot be captured
    return (runner.device.type == "cuda" and not runner.config.device.enforce_eager
            and runner.backend.name == "triton")


def prepare_step_path(runner) -> CudaGraphRunner | None:
    """Tune, capture and warm up over the allocated cache; returns the captured graphs."""
    sched = runner.config.scheduler
    if runner.device.type == "cuda" and envs.tune_small_m():
        tune_one_row_linears(runner)  # before capture: the graphs record the choice
    graphs = None
    if uses_cuda_graphs(runner):
        spec = runner.config.speculative
        graphs = CudaGraphRunner(
            runner.model, runner.backend, runner.kv_caches, runner.buffers, sched.max_num_seqs,
            sched.max_model_len,
            verify_query_len=None if spec is None else 1 + spec.num_speculative_tokens,
            max_verify_seqs=(spec and spec.disable_by_batch_size) or sched.max_num_seqs,
            max_num_tokens=sched.max_num_batched_tokens,
            batch1_forward=runner.persistent)
        graphs.capture()
        if runner.persistent is not None:
            runner.persistent.raise_if_failed()
    if runner.device.type == "cuda":
        if runner.backend.name == "triton":
            warm_up_step_shapes(runner)
            warm_up_kernel_variants(runner)
        warm_up_logits(runner, sched.max_num_seqs)
    return graphs


def persistent_decoder(runner):
    """The persistent one-token step when asked for and the model allows it (else None, with
    the reason on stderr: the usual step runs). The batch-1 decode graph captures it; eagerly
    (enforce_eager, the CPU) a step of one token runs it."""
    if not runner.config.device.persistent_decode:
        return None
    from echo.worker.persistent_decoder import PersistentDecoder, unsupported_reason

    reason = unsupported_reason(runner.model, runner.kv_caches, runner.tp.size)
    if reason is not None:
        if runner.tp.rank == 0:
            print(f"echo: persistent_decode is off: {reason}", file=sys.stderr, flush=True)
        return None
    block_size = runner.config.cache.block_size
    max_blocks = -(-runner.config.scheduler.max_model_len // block_size) + 1
    return PersistentDecoder(runner.model, runner.kv_caches, block_size, max_blocks)


def prepare_multi_step(runner):
    """The decoder of several steps per launch (multi_step.py), its sampling captured over
    each forward graph on one rank (with tensor parallelism the LM head's all-gather stays
    outside graphs, as today, and the sampling runs eagerly)."""
    from echo.worker.multi_step import MultiStepDecoder

    sched = runner.config.scheduler
    decoder = MultiStepDecoder(runner.model, runner.backend, runner.kv_caches, runner.buffers,
                               runner.graphs, runner.config.cache.block_size,
                               sched.max_num_seqs, sched.num_scheduler_steps, runner.device,
                               persistent=runner.persistent)
    if runner.graphs is not None and runner.tp.size == 1:
        decoder.capture()
    return decoder


@torch.inference_mode()
def tune_one_row_linears(runner) -> None:
    from echo.worker.linear_tuning import RUN_PROGRAMS, cuda_graph_timer
    from echo.worker.linear_tuning import tune_one_row_linears as tune

    runs = RUN_PROGRAMS if envs.gemv_runs() else ()
    for choice in tune(runner.model, cuda_graph_timer, gemv_runs=runs):
        if runner.tp.rank == 0:
            print(f"echo: one-row linear {choice.describe()}", file=sys.stderr, flush=True)
    # the timing graphs' private pools stay cached after the graphs are gone; with the KV
    # cache already allocated, eager steps would have to free them first
    torch.cuda.empty_cache()


@torch.inference_mode()
def warm_up_step_shapes(runner) -> list[torch.Tensor]:
    """Run the eager step shapes of kernel_warmup once, so their kernels compile now; returns
    each batch's logits at its sequences' last tokens. Stores nothing in the cache."""
    sched, device = runner.config.scheduler, runner.device
    all_logits = []
    for batch in warmup_batches(sched.max_model_len, sched.max_num_batched_tokens,
                                sched.max_num_seqs):
        meta = warmup_metadata(batch, runner.config.cache.block_size, device)
        positions = warmup_positions(batch, device)
        hidden = runner.model(torch.zeros_like(positions), positions,
                              ForwardContext(runner.backend, meta, runner.kv_caches))
        logits = runner.model.compute_logits(hidden[meta.cu_seqlens_q[1:].long() - 1])
        runner.sampler(logits, worst_case_sampling_tensors(len(batch.query_lens),
                                                           runner.vocab_size, device))
        all_logits.append(logits)
    return all_logits


@torch.inference_mode()
def warm_up_kernel_variants(runner) -> None:
    """Compile every attention and sampling kernel variant a step can need, which the step
    shapes above do not all reach (echo_kernels.attention.warmup)."""
    from echo_kernels.attention.warmup import warm_up_paged_attention, warm_up_varlen_attention
    from echo_kernels.sampling import warm_up_gumbel_sample

    cache, attn = runner.kv_caches[0], runner.model.model.layers[0].self_attn
    # decode batches rotate and store their K/V in the attention launch (triton backend)
    rope = attn.rope_inputs(torch.zeros(1, dtype=torch.long, device=runner.device))
    warm_up_paged_attention(attn.num_heads, cache.k, cache.v, cache.k_scale, cache.v_scale,
                            runner.config.scheduler.max_model_len, runner.dtype,
                            qk_norm=rope.q_norm_weight is not None)
    warm_up_varlen_attention(attn.num_heads, runner.num_kv_heads, runner.head_dim,
                             runner.dtype, runner.device)
    # the sampler reads the LM head's logits, or float32 ones after filters and penalties
    warm_up_gumbel_sample(runner.config.scheduler.max_num_seqs, runner.vocab_size,
                          [runner.dtype, torch.float32], runner.device)
    if runner.config.speculative is not None:
        from echo_kernels.rejection import warm_up_rejection_sample

        width = 1 + runner.config.speculative.num_speculative_tokens
        warm_up_rejection_sample(runner.vocab_size, width, runner.dtype, runner.device)


@torch.inference_mode()
def warm_up_logits(runner, max_rows: int) -> None:
    """Run the LM head once at every row count a step can sample. cuBLAS picks a different
    kernel for many row counts and loads each on first use, stalling the host inside the step
    while the GPU runs dry (docs/benchmarks.md); start-up is the place to pay for it."""
    hidden = torch.zeros(max_rows, runner.arch.hidden_size, dtype=runner.dtype,
                         device=runner.device)
    for rows in range(1, max_rows + 1):
        runner.model.compute_logits(hidden[:rows])
    torch.cuda.synchronize(runner.device)
