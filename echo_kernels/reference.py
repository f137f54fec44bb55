"""Pure-PyTorch twins of every kernel, in float32 math: the ground truth of the kernel tests.

Slow (Python loops over sequences, host syncs) and meant only for tests and benchmarks. Where a
kernel rounds to the model dtype at a point Hugging Face's modules do, the twin rounds there too.
"""

import torch
import torch.nn.functional as F


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: (values int8, scale = absmax / 127 float32)."""
    x = x.float()
    absmax = x.abs().amax(-1)
    inv = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    y = x * inv.unsqueeze(-1)
    y = torch.where(y >= 0, torch.floor(y + 0.5), torch.ceil(y - 0.5)).clamp(-127, 127)
    return y.to(torch.int8), absmax / 127.0


def store_kv_cache_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    """In place, like store_kv_cache."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    for src, cache, scale in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if cache.dtype == torch.int8:
            values, sc = quantize_int8(src)
            cache[blocks, offsets] = values
            scale[blocks, offsets] = sc
        else:
            cache[blocks, offsets] = src.to(cache.dtype)


def gather_kv(cache, scale, block_table_row, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence from a paged cache, float32 [length, H, D]."""
    block_size = cache.shape[1]
    blocks = block_table_row[: -(-length // block_size)].long()
    x = cache[blocks].flatten(0, 1)[:length].float()
    if cache.dtype == torch.int8:
        x = x * scale[blocks].flatten(0, 1)[:length].float().unsqueeze(-1)
    return x


def _attend(q, k, v, softmax_scale: float, causal: bool) -> torch.Tensor:
    """q [Lq, H, D], k/v [Lk, Hkv, D] float32; bottom-right causal; rows seeing no key -> 0."""
    lq, num_heads, _ = q.shape
    lk, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
    if causal:
        q_pos = torch.arange(lq, device=q.device) + (lk - lq)
        visible = torch.arange(lk, device=q.device)[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, v)


def paged_attention_ref(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens,
                        softmax_scale: float, k_scale=None, v_scale=None) -> torch.Tensor:
    """float32 [num_tokens, num_heads, head_dim]; rows of tokens outside every run stay 0."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens_q.tolist()
    for s, ctx in enumerate(seq_lens.tolist()):
        if cu[s + 1] == cu[s]:
            continue
        k = gather_kv(k_cache, k_scale, block_table[s], ctx)
        v = gather_kv(v_cache, v_scale, block_table[s], ctx)
        out[cu[s]:cu[s + 1]] = _attend(q[cu[s]:cu[s + 1]].float(), k, v, softmax_scale, True)
    return out


def flash_attn_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale: float,
                          causal: bool = True) -> torch.Tensor:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for s in range(len(cq) - 1):
        out[cq[s]:cq[s + 1]] = _attend(q[cq[s]:cq[s + 1]].float(), k[ck[s]:ck[s + 1]].float(),
                                       v[ck[s]:ck[s + 1]].float(), softmax_scale, causal)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face's LlamaRMSNorm: (x.float() * rsqrt(mean(x^2) + eps)).to(dtype) * weight."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (y.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual), the sum rounded to x's dtype."""
    s = (x.float() + residual.float()).to(x.dtype)
    return rms_norm_ref(s, weight, eps), s


def rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox: bool = True,
                         q_norm_weight=None, k_norm_weight=None, eps: float = 1e-6):
    """Rotated float32 copies (q, k), after the per-head RMSNorm when its weights are given."""
    half = cos_sin_cache.shape[1] // 2
    cos = cos_sin_cache[positions.long(), :half].float().unsqueeze(1)
    sin = cos_sin_cache[positions.long(), half:].float().unsqueeze(1)

    def rotate(x, norm_weight):
        if norm_weight is not None:
            x = rms_norm_ref(x, norm_weight, eps)
        x = x.float()
        if is_neox:
            x1, x2 = x[..., :half], x[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

    return rotate(q, q_norm_weight), rotate(k, k_norm_weight)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    x = x.float()
    return F.silu(x[..., :d]) * x[..., d:]


_M32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """The 32-bit finalizer of sampling.py on int64 tensors holding 32-bit values (int64
    products wrap, which keeps the low 32 bits exact)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform_noise_ref(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B] seeds, [B] output indices -> [B, vocab] uniforms in (0, 1), deterministic."""
    key = _mix32((seeds >> 32) ^ _mix32((seeds & _M32) ^ _mix32(steps)))
    token = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = _mix32(key[:, None] ^ _mix32(token * 0x9E3779B1)[None, :])
    bits = _mix32(bits ^ (key[:, None] >> 5))
    # 23 bits, so that u < 1 exactly in float32 (echo_kernels/sampling.py says why)
    return ((bits >> 9).float() + 0.5) * (1.0 / (1 << 23))


def gumbel_sample_ref(logits, temperature, seeds, steps) -> torch.Tensor:
    """argmax(logits / T + Gumbel noise) per row; T = 0 rows take the plain argmax."""
    logits = logits.float()
    greedy = temperature == 0
    scaled = logits / torch.where(greedy, 1.0, temperature)[:, None]
    gumbel = -torch.log(-torch.log(uniform_noise_ref(seeds, steps, logits.shape[-1])))
    return torch.where(greedy, logits.argmax(-1), (scaled + gumbel).argmax(-1))


def advance_decode_ref(input_ids, positions, slots, seq_lens, sample_steps, tokens,
                       block_table, block_size: int, max_position: int | None = None) -> None:
    """In place over the first tokens.shape[0] rows of each: where the row's slot is a real one
    (>= 0), the token becomes its input, and its position, context length and sample index grow
    by one; then each row's slot is its position's place in its block table (the block index
    clamped to the table), or -1 for a padding row or, given max_position, a row at it (whose
    position stays at max_position - 1)."""
    rows = tokens.shape[0]
    input_ids, positions = input_ids[:rows], positions[:rows]
    slots, seq_lens, sample_steps = slots[:rows], seq_lens[:rows], sample_steps[:rows]
    real = slots >= 0
    input_ids.copy_(torch.where(real, tokens, input_ids))
    positions.add_(real)
    seq_lens.add_(real)
    sample_steps.add_(real)
    index = torch.div(positions, block_size, rounding_mode="floor").clamp_(
        max=block_table.shape[1] - 1)
    block = block_table[:rows].gather(1, index[:, None]).squeeze(1).long()
    if max_position is not None:
        real &= positions < max_position
        positions.clamp_(max=max_position - 1)
    slots.copy_(torch.where(real, block * block_size + positions % block_size, -1))


def rejection_sample_ref(logits, draft_ids, cu_rows, temperature, seeds, steps, width: int,
                         draft_probs=None) -> torch.Tensor:
    """Speculative verification (echo_kernels.rejection's arguments and result). A draft d is
    accepted, greedy, when it is the argmax, else with probability min(1, p(d) / q(d)), q a
    point mass at d without draft_probs; the token after the accepted drafts is the argmax
    (greedy), a draw from the normalized max(0, p - q) at a rejected draft (from p where that is
    zero), or from p after the last draft. The acceptance uniform is column `vocab` of the
    row's noise, the Gumbel noise columns 0 .. vocab - 1."""
    rows, vocab = logits.shape
    counts = (cu_rows[1:] - cu_rows[:-1]).long()
    request = torch.repeat_interleave(torch.arange(len(counts), device=logits.device), counts)
    temperature = temperature.float()[request]
    greedy = temperature == 0
    x = logits.float()
    has_draft = draft_ids >= 0
    if bool(greedy.all()):  # no noise to draw (what the kernel computes for greedy rows)
        token = x.argmax(-1)
        accepted = (token == draft_ids) & has_draft
    else:
        position = torch.arange(rows, device=logits.device) - cu_rows[:-1].long()[request]
        noise = uniform_noise_ref(seeds[request], steps[request] + position, vocab + 1)
        accept_u, gumbel = noise[:, vocab], -torch.log(-torch.log(noise[:, :vocab]))
        probs = torch.softmax(x / torch.where(greedy, 1.0, temperature)[:, None], dim=-1)
        draft = draft_ids.clamp(min=0)[:, None]
        if draft_probs is None:
            q = torch.zeros_like(probs).scatter_(-1, draft, 1.0)
        else:
            q = draft_probs.float()
        q = torch.where(has_draft[:, None], q, 0.0)
        p_draft = probs.gather(-1, draft)[:, 0]
        accepted = torch.where(greedy, x.argmax(-1) == draft_ids,
                               accept_u * q.gather(-1, draft)[:, 0] <= p_draft)
        accepted &= has_draft
        residual = (probs - q).clamp(min=0)
        sampled = torch.where(residual.sum(-1) > 0, (residual.log() + gumbel).argmax(-1),
                              (probs.log() + gumbel).argmax(-1))
        token = torch.where(greedy, x.argmax(-1), sampled)
    out = torch.full((len(counts), width), -1, dtype=torch.int64, device=logits.device)
    for r in range(len(counts)):
        first, last = int(cu_rows[r]), int(cu_rows[r + 1]) - 1
        n = 0
        while first + n < last and accepted[first + n]:
            n += 1
        out[r, :n] = draft_ids[first:first + n]
        out[r, n] = token[first + n]
    return out


def apply_token_bitmask_ref(logits: torch.Tensor, bitmask: torch.Tensor,
                            indices: torch.Tensor | None = None) -> torch.Tensor:
    """A copy of logits with -inf where xgrammar's bitmask (int32 words, token t = bit t % 32 of
    word t // 32) disallows a token; columns past the mask's coverage are disallowed."""
    out = logits.clone()
    rows = range(bitmask.shape[0]) if indices is None else indices.tolist()
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1).bool()  # [num_masks, words*32]
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    for mask_row, row in enumerate(rows):
        out[row].masked_fill_(~allowed[mask_row, :vocab], float("-inf"))
    return out


def moe_routing_ref(router_logits: torch.Tensor, top_k: int,
                    renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [M, k], expert ids int32 [M, k]): softmax over the experts in float32,
    the k largest logits in descending order, ties to the lower id (a stable descending sort;
    softmax is monotone, so these are the k largest probabilities)."""
    logits = router_logits.float()
    probs = torch.softmax(logits, dim=-1)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, order)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights, order.to(torch.int32)


def moe_align_block_size_ref(topk_ids: torch.Tensor, block_size: int, num_experts: int
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted_ids, expert_ids, num_padded) as moe_align_block_size defines them: the flattened
    pair indices of each expert in ascending order, experts in ascending order, each group padded
    to a multiple of block_size with the sentinel M*k; no group for an expert without pairs;
    sentinel slots up to M*k + num_experts*(block_size-1), expert -1 for the tiles there."""
    flat = topk_ids.flatten().long()
    sentinel = flat.numel()
    max_padded = sentinel + num_experts * (block_size - 1)
    slots, experts = [], []
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten().tolist()  # ascending
        if not pairs:
            continue
        padded = -(-len(pairs) // block_size) * block_size
        slots += pairs + [sentinel] * (padded - len(pairs))
        experts += [e] * (padded // block_size)
    num_padded = len(slots)
    slots += [sentinel] * (max_padded - num_padded)
    experts += [-1] * (max_padded // block_size - len(experts))
    device = topk_ids.device
    return (torch.tensor(slots, dtype=torch.int32, device=device),
            torch.tensor(experts, dtype=torch.int32, device=device),
            torch.tensor([num_padded], dtype=torch.int32, device=device))


def fused_moe_ref(hidden, w13, w2, topk_weights, topk_ids) -> torch.Tensor:
    """sum_j topk_weights[t, j] * w2[e] @ (silu(g) * u), [g; u] = w13[e] @ hidden[t] (gate rows
    first), e = topk_ids[t, j]; all in float32, cast to hidden's dtype at the end."""
    x = hidden.float()
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tokens, slots = (topk_ids == e).nonzero(as_tuple=True)
        if not len(tokens):
            continue
        gate_up = x[tokens] @ w13[e].float().T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = act @ w2[e].float().T
        out.index_add_(0, tokens, y * topk_weights[tokens, slots].float()[:, None])
    return out.to(hidden.dtype)


# AutoAWQ's unpacking order: output column 8j + r of a row sits at nibble AWQ_REVERSE_ORDER[r]
# (bits 4 * AWQ_REVERSE_ORDER[r] ..) of packed int32 j; its packer wrote column 8j + [0, 2, 4,
# 6, 1, 3, 5, 7][i] at nibble i, and this is that permutation's inverse
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def awq_unpack_ref(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] packed the AutoAWQ way -> int64 [R, 8C] of 4-bit values 0..15, in column
    order."""
    shifts = 4 * torch.tensor(AWQ_REVERSE_ORDER, dtype=torch.int64, device=packed.device)
    return ((packed.long()[:, :, None] >> shifts) & 15).flatten(1)


def _awq_weight_f32(qweight, qzeros, scales, group_size) -> torch.Tensor:
    q = awq_unpack_ref(qweight)
    z = awq_unpack_ref(qzeros).repeat_interleave(group_size, 0)
    return (q - z).float() * scales.float().repeat_interleave(group_size, 0)


def awq_dequantize_ref(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """AutoAWQ "gemm" tensors (qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales [K/G, N])
    -> W [K, N] in scales' dtype: W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]."""
    return _awq_weight_f32(qweight, qzeros, scales, group_size).to(scales.dtype)


def awq_linear_ref(x, qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    """x [M, K] @ W [K, N], W dequantized in float32 (not rounded to scales' dtype), the product
    in float32, cast to x's dtype."""
    return (x.float() @ _awq_weight_f32(qweight, qzeros, scales, group_size)).to(x.dtype)
