"""BlockPool: the KV cache's fixed-size blocks, their reference counts and the prefix-cache index.

A block is in use while its reference count is positive (one reference per request whose block
table holds it). A free block is either plain or cached: a cached block still holds the KV of
a full block of tokens, is findable by that block's hash, and can be taken back by a request
with the same prefix until it is evicted. Allocation takes plain blocks first, then evicts
cached ones in LRU order (least recently freed first).

The pool also counts epochs (one per step the scheduler plans, advanced by the KV cache
manager) and stamps each block with the epoch it was last freed in, so a copy by another
stream can tell blocks that no step still in flight may use (free_since) from those a step
planned after they were freed may still read or write.
"""

from collections import OrderedDict, deque
from collections.abc import Iterable

BlockHash = bytes


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # hash -> block id, in use or free
        # NOTE: popped from the end, so the lowest ids go out first (deterministic for tests),
        # then the most recently freed; the other end holds those freed longest ago
        self._free_plain: deque[int] = deque(range(num_blocks - 1, -1, -1))
        # free cached blocks, least recently freed first; OrderedDict gives O(1) removal from
        # the middle when a prefix hit takes one back
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        # (block id, hash) of each cached block allocation evicted, for a caller that sets a
        # list here and drains it (the host tier's write-back); None: not recorded
        self.evicted: list[tuple[int, BlockHash]] | None = None
        self.epoch = 0
        self._freed_at = [-1] * num_blocks  # the epoch each block last became free in

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def free_block_ids(self) -> list[int]:
        """Every free block, plain then cached in eviction order (for tests and checks)."""
        return [*reversed(self._free_plain), *self._free_cached]

    def allocate(self, n: int, settled_before: int | None = None) -> list[int]:
        """Take n free blocks (plain first, then the least recently freed cached ones). With
        settled_before, blocks free since before that epoch go first (plain ones freed longest
        ago, then cached ones in LRU order): for a copy on another stream, which must not
        write a block a step in flight may still use."""
        if n > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {n} blocks, only {self.num_free_blocks} free")
        plain, cached, refs = self._free_plain, self._free_cached, self.ref_counts
        ids = []
        if settled_before is not None:
            freed_at = self._freed_at
            while len(ids) < n and plain and freed_at[plain[0]] < settled_before:
                ids.append(plain.popleft())
            while len(ids) < n and cached and freed_at[next(iter(cached))] < settled_before:
                ids.append(self._take_cached())
        while len(ids) < n:
            ids.append(plain.pop() if plain else self._take_cached())
        for block_id in ids:
            refs[block_id] = 1
        return ids

    def _take_cached(self) -> int:
        """The least recently freed cached block, evicted from the prefix cache."""
        block_id, _ = self._free_cached.popitem(last=False)
        self._evict(block_id)
        return block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add a user to cached blocks found by a prefix hit, taking free ones off the free list."""
        refs = self.ref_counts
        for block_id in block_ids:
            if refs[block_id] == 0:
                del self._free_cached[block_id]
            refs[block_id] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one user from each block. Pass a request's blocks in order: they are released
        last-first, so a sequence's tail is evicted before the prefix others are likelier to share.
        """
        refs, freed_at, epoch = self.ref_counts, self._freed_at, self.epoch
        for block_id in reversed(block_ids):
            refs[block_id] -= 1
            if refs[block_id] == 0:
                freed_at[block_id] = epoch
                if self.block_hashes[block_id] is None:
                    self._free_plain.append(block_id)
                else:
                    self._free_cached[block_id] = None
            elif refs[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")

    def free_since(self, block_ids: Iterable[int], epoch: int) -> bool:
        """Whether every one of these blocks has been free (or never used) since before
        `epoch` began, so that nothing planned from `epoch` on holds it."""
        freed_at = self._freed_at
        return all(freed_at[block_id] < epoch for block_id in block_ids)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Make a full, computed block findable by its hash. If another block already holds the
        same tokens (two requests computed it at once), this one stays plain."""
        if not self.enable_caching or self.block_hashes[block_id] is not None:
            return
        if block_hash not in self._cached:
            self._cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash

    def is_cached(self, block_id: int) -> bool:
        return self.block_hashes[block_id] is not None

    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, as in vLLM:
        a reset usually means the KV is stale (new weights), and used blocks cannot be dropped."""
        if self.num_used_blocks:
            return False
        for block_id in self._free_cached:
            self.block_hashes[block_id] = None
            self._free_plain.append(block_id)
        self._free_cached.clear()
        self._cached.clear()
        self._free_plain = deque(sorted(self._free_plain, reverse=True))
        return True

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        self.block_hashes[block_id] = None
        del self._cached[block_hash]
        if self.evicted is not None:
            self.evicted.append((block_id, block_hash))
