"""KVCacheManager: the scheduler's view of KV memory. It allocates blocks for the tokens a request
is scheduled to compute, finds a new request's longest cached prefix, and hides the BlockPool.

Prefix caching keys a full block by a hash chained over (parent block's hash, the block's token
ids); the chain starts from the request's cache salt, so requests with different salts never
share blocks. A block is registered in the cache as soon as the tokens it holds are all known
and scheduled to be computed, before its KV is written. That is safe: the GPU runs steps in
order, so a later step reads it after the write, and within one step each layer stores the
whole batch's KV before attention reads any, so another request in the same step may reuse it.
Freed blocks may still be written by a step in flight for the same reason: whoever gets them
next runs after it.
"""

import hashlib
from typing import NamedTuple

import msgspec

from echo.core.block_pool import BlockHash, BlockPool
from echo.core.request import Request

_encode = msgspec.msgpack.Encoder().encode


class ComputedBlocks(NamedTuple):
    """A request's longest cached prefix: blocks to reuse and the tokens they cover."""

    block_ids: list[int]
    num_tokens: int


NO_COMPUTED_BLOCKS = ComputedBlocks([], 0)


def _skips_cache(request: Request) -> bool:
    """Whether a request may not reuse cached blocks (get_computed_blocks)."""
    return request.sampling_params.prompt_logprobs is not None


def hash_block(parent: BlockHash, token_ids: list[int]) -> BlockHash:
    # sha256 rather than hash(tuple): a collision would silently hand one request another's KV
    return hashlib.sha256(_encode((parent, token_ids))).digest()


def root_hash(cache_salt: str | None) -> BlockHash:
    return hashlib.sha256(_encode(("echo-prefix-root", cache_salt))).digest()


class _RequestBlocks:
    """What the manager keeps per request: its block table and its full blocks' hashes."""

    __slots__ = ("block_ids", "hashes", "num_cached_blocks")

    def __init__(self):
        self.block_ids: list[int] = []
        self.hashes: list[BlockHash] = []  # of full blocks, computed lazily
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission, cumulative
        self.prefix_cache_hits = 0  # of which found in the cache

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest cached prefix of a request that is not yet (or no longer) running.
        Never all of its tokens: the last one is always computed, to have logits to sample from.
        None for a request asking for prompt logprobs (as in vLLM): they need the logits of
        every prompt position, which a reused block never had. Its blocks are still cached.
        """
        if not self.enable_caching or _skips_cache(request):
            return NO_COMPUTED_BLOCKS
        state = self._state(request.request_id)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = self._hashes(request, state, max_blocks)
        block_ids = []
        get_cached = self.pool.get_cached_block
        for block_hash in hashes[:max_blocks]:
            block_id = get_cached(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return ComputedBlocks(block_ids, len(block_ids) * self.block_size)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> list[int] | None:
        """Make room for num_new_tokens more tokens after request.num_computed_tokens (after the
        reused prefix `computed`, when a request is admitted). Returns the newly allocated block
        ids, or None, changing nothing, when the pool cannot supply them."""
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._requests[request.request_id] = _RequestBlocks()
        block_ids = state.block_ids
        num_tokens = request.num_computed_tokens + num_new_tokens
        if computed is None:
            num_needed = -(-num_tokens // self.block_size) - len(block_ids)
            if num_needed <= 0:  # the common decode step: the last block has room
                new_block_ids = []
            elif num_needed <= self.pool.num_free_blocks:
                new_block_ids = self.pool.allocate(num_needed)
                block_ids.extend(new_block_ids)
            else:
                return None
        else:
            num_tokens += computed.num_tokens
            new_block_ids = self._admit(request, state, num_tokens, computed)
            if new_block_ids is None:
                return None

        if self.enable_caching:
            num_full = num_tokens // self.block_size
            if num_full > state.num_cached_blocks:
                # only blocks whose tokens are all known: async placeholders are not tokens yet
                num_full = min(num_full, request.num_tokens // self.block_size)
                if num_full > state.num_cached_blocks:
                    self._cache_full_blocks(request, state, num_full)
        return new_block_ids

    def _admit(self, request: Request, state: _RequestBlocks, num_tokens: int,
               computed: ComputedBlocks) -> list[int] | None:
        """Take the reused prefix blocks and allocate the rest, or change nothing (None)."""
        prefix = computed.block_ids
        num_needed = -(-num_tokens // self.block_size) - len(state.block_ids) - len(prefix)
        # reusing a free cached block takes it off the free list too
        ref_counts = self.pool.ref_counts
        num_available = self.pool.num_free_blocks - sum(1 for b in prefix if ref_counts[b] == 0)
        if num_needed > num_available:
            return None
        if self.enable_caching and not _skips_cache(request):
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += computed.num_tokens
        if prefix:
            self.pool.touch(prefix)
            state.block_ids.extend(prefix)
            state.num_cached_blocks = len(state.block_ids)
        new_block_ids = self.pool.allocate(num_needed) if num_needed > 0 else []
        state.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, request: Request) -> None:
        """Release every block of a request (finished, aborted or preempted) at once."""
        state = self._requests.pop(request.request_id, None)
        if state is not None and state.block_ids:
            self.pool.free(state.block_ids)

    def get_block_ids(self, request: Request) -> list[int]:
        """A copy of the request's block table (safe to hand to an in-process worker)."""
        state = self._requests.get(request.request_id)
        return list(state.block_ids) if state is not None else []

    def num_tracked_requests(self) -> int:
        return len(self._requests)

    def tracked_block_tables(self) -> dict[str, list[int]]:
        """request id -> block table, for invariant checks."""
        return {rid: list(state.block_ids) for rid, state in self._requests.items()}

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _state(self, request_id: str) -> _RequestBlocks:
        state = self._requests.get(request_id)
        if state is None:
            state = self._requests[request_id] = _RequestBlocks()
        return state

    def _cache_full_blocks(self, request: Request, state: _RequestBlocks, num_full: int) -> None:
        hashes = self._hashes(request, state, num_full)
        cache_block, block_ids = self.pool.cache_block, state.block_ids
        for i in range(state.num_cached_blocks, num_full):
            cache_block(block_ids[i], hashes[i])
        state.num_cached_blocks = num_full

    def _hashes(self, request: Request, state: _RequestBlocks, num_blocks: int) -> list[BlockHash]:
        """The request's first num_blocks block hashes (all full blocks), extending the chain."""
        hashes = state.hashes
        if len(hashes) >= num_blocks:
            return hashes
        bs = self.block_size
        prompt, output = request.prompt_token_ids, request.output_token_ids
        num_prompt = len(prompt)
        parent = hashes[-1] if hashes else root_hash(request.cache_salt)
        for i in range(len(hashes), num_blocks):
            start, end = i * bs, (i + 1) * bs
            if end <= num_prompt:
                tokens = prompt[start:end]
            elif start >= num_prompt:
                tokens = output[start - num_prompt : end - num_prompt]
            else:
                tokens = prompt[start:] + output[: end - num_prompt]
            parent = hash_block(parent, tokens)
            hashes.append(parent)
        return hashes
