"""Per-step sampling tensors, gathered from the InputBatch rows of the requests that sample.

A verification (speculative decoding) scores several rows per request: the row after its
last token, then one after each draft. Row j of a request sees the j drafts before it as
outputs (`ahead`): its output index, its penalties' counts, its min_tokens and bad-word bans
are those the request would have after accepting them, so each row's distribution is the one
plain decoding would sample from there. The drafts sit in the InputBatch's token_ids right
after the request's tokens (InputBatch.update), which is where those counts read them."""

import numpy as np
import torch

from echo.worker.input_batch import InputBatch
from echo.worker.pinned_ring import PinnedUploadRing
from echo.worker.sampler import SamplingTensors


def build_sampling_tensors(batch: InputBatch, rows: np.ndarray, vocab_size: int,
                           eos_token_ids: tuple[int, ...], device: torch.device,
                           ahead: np.ndarray | None = None,
                           rings: dict[torch.dtype, PinnedUploadRing] | None = None
                           ) -> SamplingTensors:
    """One row per entry of `rows` (a request's row may repeat); ahead: per entry, how many of
    the request's drafts come before it (None: none); rings: upload rings by dtype for the
    per-step inputs (see upload)."""
    if ahead is None:
        ahead = np.zeros(len(rows), np.int64)
    temperature, top_k = batch.temperature[rows], batch.top_k[rows]
    top_p, min_p = batch.top_p[rows], batch.min_p[rows]
    # two host-to-device copies per step (floats, ints), pinned so they do not block
    floats = upload(np.stack([temperature, top_p, min_p]), device, rings)
    ints = upload(np.stack([top_k, batch.seeds[rows], batch.num_output_tokens(rows) + ahead]),
                  device, rings)
    max_logprobs = int(batch.logprobs[rows].max()) if len(rows) else -1
    extra = {}
    if batch.has_penalties[rows].any():
        extra = _penalties(batch, rows, ahead, vocab_size, device)
    extra.update(_token_rules(batch, rows, ahead, vocab_size, eos_token_ids, device))
    return SamplingTensors(
        temperature=floats[0], top_p=floats[1], min_p=floats[2],
        top_k=ints[0], seeds=ints[1], steps=ints[2],
        all_greedy=bool((temperature == 0).all()),
        need_top_k=bool((top_k < vocab_size).any()),
        need_top_p=bool((top_p < 1).any()), need_min_p=bool((min_p > 0).any()),
        max_logprobs=max_logprobs if max_logprobs >= 0 else None, **extra)


def upload(array: np.ndarray, device: torch.device,
           rings: dict[torch.dtype, PinnedUploadRing] | None = None) -> torch.Tensor:
    """A host array on the device, the copy queued behind the step in flight: through the
    ring of its dtype where one is given (a copy by kernel needs host memory that outlives it:
    worker/host_copies.py), else from torch's pinned memory by the copy engine. Only the
    every-step inputs take the rings: the rarer lists (logit_bias, allowed tokens, prompt
    logprob rows) can be long, and a ring they wrapped would make the host wait for the step
    in flight."""
    tensor = torch.from_numpy(array)
    if device.type != "cuda":
        return tensor
    ring = rings.get(tensor.dtype) if rings else None
    if ring is not None:
        return ring.upload(array.reshape(-1)).view(array.shape)
    # pin_memory() draws from torch's caching host allocator, so this costs no cudaHostAlloc
    return tensor.pin_memory().to(device, non_blocking=True)


def _penalties(batch: InputBatch, rows: np.ndarray, ahead: np.ndarray, vocab_size: int,
               device: torch.device) -> dict:
    params = [batch.params[r] for r in rows]
    counts = torch.zeros(len(rows), vocab_size, dtype=torch.float32)
    prompt_mask = torch.zeros(len(rows), vocab_size, dtype=torch.bool)
    for i, row in enumerate(rows):
        prompt_len, total = batch.num_prompt_tokens[row], batch.num_tokens[row] + ahead[i]
        prompt_mask[i, torch.from_numpy(batch.token_ids[row, :prompt_len])] = True
        output = torch.from_numpy(batch.token_ids[row, prompt_len:total])
        counts[i].index_add_(0, output, torch.ones(len(output)))
    per_request = lambda name: torch.tensor(  # noqa: E731
        [getattr(p, name) for p in params], dtype=torch.float32, device=device)
    return {"presence": per_request("presence_penalty"),
            "frequency": per_request("frequency_penalty"),
            "repetition": per_request("repetition_penalty"),
            "output_counts": counts.to(device), "prompt_mask": prompt_mask.to(device)}


def _token_rules(batch: InputBatch, rows: np.ndarray, ahead: np.ndarray, vocab_size: int,
                 eos_token_ids: tuple[int, ...], device: torch.device) -> dict:
    """logit_bias as (row, token) pairs and their biases; the banned [B, V] mask built on the
    device from index lists: EOS and stop tokens until a request has min_tokens outputs,
    every token outside a request's allowed_token_ids, its bad-word tokens due now. Nothing
    (no per-step work past two vector tests) while no request here has any of them."""
    pending = np.nonzero(batch.min_tokens[rows] > batch.num_output_tokens(rows) + ahead)[0]
    ruled = np.nonzero(batch.has_token_rules[rows])[0]
    if not len(pending) and not len(ruled):
        return {}
    ban_rows, ban_ids = [], []  # per row: its index in this step and the token ids it bans
    allow_rows, allow_ids, restricted = [], [], []
    bias_rows, bias_ids, bias_values = [], [], []
    for i in pending.tolist():
        stop_ids = batch.params[rows[i]].stop_token_ids
        stops = [t for t in (*eos_token_ids, *stop_ids) if t < vocab_size]
        ban_rows.append(np.full(len(stops), i))
        ban_ids.append(np.array(stops, dtype=np.int64))
    for i in ruled.tolist():
        row = rows[i]
        rules = batch.token_rules[row]
        if rules.bias_ids is not None:
            bias_rows.append(np.full(len(rules.bias_ids), i))
            bias_ids.append(rules.bias_ids)
            bias_values.append(rules.bias_values)
        if rules.allowed_ids is not None:
            restricted.append(i)
            allow_rows.append(np.full(len(rules.allowed_ids), i))
            allow_ids.append(rules.allowed_ids)
        now = rules.always_banned
        if rules.sequences:  # its output is all on the host: reads_outputs has it landed
            now = rules.banned_after(batch.token_ids[
                row, batch.num_prompt_tokens[row]:batch.num_tokens[row] + ahead[i]])
        if len(now):
            ban_rows.append(np.full(len(now), i))
            ban_ids.append(now)
    extra = {}
    if bias_rows:
        extra["bias_index"] = upload(_pairs(bias_rows, bias_ids), device)
        extra["bias_values"] = upload(np.concatenate(bias_values), device)
    if restricted or ban_rows:
        banned = torch.zeros(len(rows), vocab_size, dtype=torch.bool, device=device)
        if restricted:
            banned[upload(np.array(restricted, dtype=np.int64), device)] = True
            allowed = upload(_pairs(allow_rows, allow_ids), device)
            banned[allowed[0], allowed[1]] = False
        if ban_rows:
            index = upload(_pairs(ban_rows, ban_ids), device)
            banned[index[0], index[1]] = True
        extra["banned"] = banned
    return extra


def _pairs(rows: list[np.ndarray], ids: list[np.ndarray]) -> np.ndarray:
    """[2, K] int64: the row (within the step) and the token id of each entry."""
    return np.stack([np.concatenate(rows).astype(np.int64),
                     np.concatenate(ids).astype(np.int64)])


def worst_case_sampling_tensors(n: int, vocab_size: int, device: torch.device
                                ) -> SamplingTensors:
    """Every sampling feature on, for measuring the sampler's peak memory."""
    full = lambda v, dt: torch.full((n,), v, dtype=dt, device=device)  # noqa: E731
    counts = torch.zeros(n, vocab_size, device=device)
    return SamplingTensors(
        full(0.7, torch.float32), full(50, torch.int64), full(0.9, torch.float32),
        full(0.05, torch.float32), full(1, torch.int64), full(0, torch.int64),
        all_greedy=False, need_top_k=True, need_top_p=True, need_min_p=True, max_logprobs=20,
        presence=full(0.1, torch.float32), frequency=full(0.1, torch.float32),
        repetition=full(1.1, torch.float32), output_counts=counts,
        prompt_mask=counts > 0, banned=counts > 0,
        bias_index=torch.stack([torch.arange(n, device=device)] * 2) % vocab_size,
        bias_values=full(1.0, torch.float32))
