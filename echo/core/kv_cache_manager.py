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

With a host tier (kv_offloading_size, echo/core/host_tier.py) the manager also hides a second
level under the prefix cache. A request's full blocks are written through to the host when it
finishes (and when it is preempted, with store_on_preempt): each store pins its GPU block with
one reference until the workers report the copy done, so nobody overwrites it meanwhile. With
write_back they are not: a cached block goes to the host only when an allocation evicts it,
and the step that reuses it waits for that copy on the device (a swap-out's ordering). A
waiting request whose prefix continues on the host gets GPU blocks for that part and a load;
it waits (is_loading) until the load is reported done, when the blocks join the GPU prefix
cache like any computed block; they stay held for the request until its admission finds them
there (so the steps in between cannot evict them), or until it is freed. Transfers leave with a step
(take_transfers: the step's stores as one, each request's load as one of its own, so a request
is admitted once its own blocks have landed) and come back done with a step's output
(transfers_done); the scheduler never sees a host block. With early loads (ECHO_KV_EARLY_LOADS,
which sets joined_load_max_blocks), a load whose GPU blocks have all been free since before the
step in flight was planned (BlockPool.free_since) and that is small is joined: the workers start
it at once, beside that step (KVTransfer.ordered is False), its blocks join the prefix cache at
once and its request is admitted in the step that carries the load, whose kernels wait for it
on the device (KVTransfer.before_step); the load keeps its own reference on the blocks until
reported done. Other loads wait for the steps before them and for their report.
"""

import hashlib
from collections.abc import Iterable
from time import monotonic
from typing import NamedTuple

import msgspec

from echo.core.block_pool import BlockHash, BlockPool
from echo.core.host_tier import HostTier
from echo.core.request import Request
from echo.core.sched_output import KVTransfer

_encode = msgspec.msgpack.Encoder().encode

# A joined load's step waits on the device for it and for the copies queued before it, so
# they should land while the step before it runs: 128 blocks are ~300 MB of Qwen3-8B's KV
# (2.36 MB a block), ~5.5 ms at the ~55 GB/s of pinned copies, about one decode step of 32
# requests on an H100. A load behind more waits for its report instead, and stalls nobody.
JOINED_LOAD_MAX_BLOCKS = 128


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


class _Transfer:
    """A step's stores, or one request's load."""

    __slots__ = ("stores", "swaps", "loads", "load_hashes", "owner", "started", "ordered",
                 "joined")

    def __init__(self, owner: str | None = None):
        self.stores: list[tuple[int, int]] = []  # each pins its GPU block until done
        # preempted blocks (swap), freed at once: the step that carries them orders its own
        # work after them on the device, since it may reuse the blocks
        self.swaps: list[tuple[int, int]] = []
        self.loads: list[tuple[int, int]] = []
        self.load_hashes: list[BlockHash] = []
        self.owner = owner  # the request a load is for
        self.started = 0.0  # monotonic() when a step took it
        self.ordered = True  # waits for the steps before it on the device (KVTransfer.ordered)
        self.joined = False  # a load whose request runs in the step that carries it

    def __bool__(self) -> bool:
        return bool(self.stores or self.swaps or self.loads)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 num_host_blocks: int = 0, num_lookahead_tokens: int = 0,
                 max_model_len: int | None = None, write_back: bool = False,
                 joined_load_max_blocks: int = 0):
        self.block_size = block_size
        # slots past a request's scheduled tokens, up to max_model_len, that the workers may
        # write in the same step: a drafter's KV for the tokens it proposes
        self.num_lookahead_tokens = num_lookahead_tokens
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self._requests: dict[str, _RequestBlocks] = {}
        self.prefix_cache_queries = 0  # tokens looked up at admission, cumulative
        self.prefix_cache_hits = 0  # of which found in the cache
        # the host tier (None without kv_offloading_size) and its transfers: the stores and the
        # loads gathered for the next step, and those started (by transfer id) not yet done
        self.host = HostTier(num_host_blocks) if num_host_blocks and enable_caching else None
        self.write_back = write_back and self.host is not None
        # joined loads (the module's docstring) of at most this many blocks; 0: none
        self.joined_load_max_blocks = joined_load_max_blocks
        if self.write_back:
            self.pool.evicted = []
        self._next_stores = _Transfer()
        self._next_loads: list[_Transfer] = []
        self._transfers: dict[int, _Transfer] = {}
        self._next_transfer_id = 0
        self._loading: set[str] = set()  # requests waiting for their loads
        self._loaded: dict[str, list[int]] = {}  # loaded blocks held until admission
        self._abandoned: set[str] = set()  # freed while loading: their loads are not held
        self._loaded_once: set[str] = set()  # a request loads once; after that it computes
        self._released: list[int] = []  # transfers seen done, for the workers
        self.host_queries = 0  # tokens looked up in the host tier, cumulative
        self.host_hits = 0  # of which found there (and loaded)
        self.stored_blocks = 0  # cumulative
        self.loaded_blocks = 0
        # requests whose loads landed, and the seconds from the step that started each load to
        # the output that reported it done (what a load adds to a request's first token)
        self.loads_done = 0
        self.load_wait_seconds = 0.0
        self.loads_joined = 0  # of which joined: their requests did not wait for the report

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
        if computed is not None:
            num_tokens += computed.num_tokens
        num_slots = num_tokens
        if self.num_lookahead_tokens:
            num_slots = max(num_tokens, min(num_tokens + self.num_lookahead_tokens,
                                            self.max_model_len))
        if computed is None:
            num_needed = -(-num_slots // self.block_size) - len(block_ids)
            if num_needed <= 0:  # the common decode step: the last block has room
                new_block_ids = []
            elif num_needed <= self.pool.num_free_blocks:
                new_block_ids = self._allocate(num_needed)
                block_ids.extend(new_block_ids)
            else:
                return None
        else:
            new_block_ids = self._admit(request, state, num_slots, computed)
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
        held = self._loaded.pop(request.request_id, None)
        if held:  # loaded from the host for this admission: the block table holds them now
            self.pool.free(held)
        new_block_ids = self._allocate(num_needed) if num_needed > 0 else []
        state.block_ids.extend(new_block_ids)
        return new_block_ids

    def free(self, request: Request, store: bool = True, preempted: bool = False) -> None:
        """Release every block of a request (finished, aborted or preempted) at once; with a
        host tier and `store`, its full blocks not yet on the host are copied there (see
        _store for what a preemption changes)."""
        rid = request.request_id
        self._loaded_once.discard(rid)
        if rid in self._loading:
            self._abandoned.add(rid)
        held = self._loaded.pop(rid, None)
        if held:
            self.pool.free(held)
        state = self._requests.pop(rid, None)
        if state is None or not state.block_ids:
            return
        if store and self.host is not None and (preempted or not self.write_back):
            self._store(zip(state.block_ids[:state.num_cached_blocks], state.hashes),
                        pin=not preempted)
        self.pool.free(state.block_ids)

    def _allocate(self, n: int, settled_before: int | None = None) -> list[int]:
        """pool.allocate, and with write_back a copy to the host of each cached block it evicted
        that the host lacks: unpinned, like a swap-out, since the block is reused at once (the
        step waits for the copy on the device; a full or busy tier drops the block)."""
        block_ids = self.pool.allocate(n, settled_before)
        evicted = self.pool.evicted
        if evicted:
            self._store(evicted, pin=False)
            evicted.clear()
        return block_ids

    def _store(self, blocks: Iterable[tuple[int, BlockHash]], pin: bool) -> None:
        """Queue copies of the full blocks (block id, hash) the host lacks. Pinned (finished
        requests): the GPU block keeps a reference until the copy is done, and nothing waits.
        Unpinned (a preemption, which must free blocks now, or a write-back's eviction): the next
        step waits for the copy on the device before its own kernels, which may overwrite
        them."""
        host = self.host
        stores = self._next_stores.stores if pin else self._next_stores.swaps
        for block_id, block_hash in blocks:
            if block_hash in host:
                continue
            host_block = host.start_store(block_hash)
            if host_block is None:  # every host block is busy: the rest is not kept
                break
            if pin:
                self.pool.touch([block_id])
            stores.append((block_id, host_block))

    # ---- the host tier ---------------------------------------------------------------------

    def start_load(self, request: Request, computed: ComputedBlocks) -> bool:
        """Load the part of a waiting request's prefix that continues on the host after its
        GPU prefix `computed`, into newly allocated GPU blocks. True if a load started: the
        request then waits (is_loading) and is admitted once it is done, unless the load is
        joined: its blocks are then cached and held for the request, which get_computed_blocks
        finds through them at once."""
        rid = request.request_id
        if (self.host is None or _skips_cache(request) or rid in self._loaded_once
                or rid in self._loading):
            return False
        state = self._state(rid)
        max_blocks = (request.num_tokens - 1) // self.block_size
        first = len(computed.block_ids)
        if first >= max_blocks:
            return False
        hashes = self._hashes(request, state, max_blocks)
        found = []
        for block_hash in hashes[first:max_blocks]:
            host_block = self.host.lookup(block_hash)
            if host_block is None:
                break
            found.append((host_block, block_hash))
        self.host_queries += (max_blocks - first) * self.block_size
        # a step planned after one of these blocks was freed may still use it: it is in flight
        # (planned in the last epoch; after a plan that went nowhere, in the one before), so
        # only a load into blocks free since before both may start before it on the device
        # (joined loads; without them every load waits for the steps before it)
        settled_before = self.pool.epoch - 1 if self.joined_load_max_blocks else None
        # keep the GPU prefix out of reach of this allocation (it may be free and cached)
        self.pool.touch(computed.block_ids)
        try:
            found = found[:max(0, self.pool.num_free_blocks)]
            if not found:
                return False
            # pinned first: with write_back the allocation may store the GPU blocks it evicts,
            # and a store may take the least recently used unpinned host block
            for host_block, _ in found:
                self.host.pin(host_block)
            # blocks no step in flight uses first: the load may then be joined
            block_ids = self._allocate(len(found), settled_before)
        finally:
            self.pool.free(computed.block_ids)
        self.host_hits += len(found) * self.block_size
        transfer = _Transfer(owner=rid)
        for (host_block, block_hash), block_id in zip(found, block_ids):
            transfer.loads.append((host_block, block_id))
            transfer.load_hashes.append(block_hash)
        # joined: settled blocks, and small, counting the copies queued before the load on the
        # workers' side stream, which the step waits for too. Only a joined load starts beside
        # the step in flight (unordered): a load that waits for its report gained nothing by
        # starting early (docs/benchmarks.md, KV offload, 2026-12-05 evening)
        transfer.joined = (settled_before is not None
                           and self.pool.free_since(block_ids, settled_before)
                           and len(block_ids) + self._queued_blocks()
                           <= self.joined_load_max_blocks)
        transfer.ordered = not transfer.joined
        self._next_loads.append(transfer)
        self._loaded_once.add(rid)
        if transfer.joined:  # nothing runs before it lands: the step that reads them waits
            for block_id, block_hash in zip(block_ids, transfer.load_hashes):
                self.pool.cache_block(block_id, block_hash)
            self.pool.touch(block_ids)  # held for the request; the load keeps its reference
            self._loaded[rid] = block_ids
        else:
            self._loading.add(rid)
        return True

    def _queued_blocks(self) -> int:
        """Blocks of the copies started and not seen done, and of the loads gathered so far."""
        return sum(len(t.stores) + len(t.swaps) + len(t.loads)
                   for t in [*self._transfers.values(), *self._next_loads])

    def is_loading(self, request: Request) -> bool:
        return request.request_id in self._loading

    @property
    def loads_in_flight(self) -> bool:
        """Some request's blocks are on their way from the host tier."""
        return bool(self._loading)

    @property
    def num_loading_requests(self) -> int:
        """Requests whose loads are in flight or done and held: each will want a seat."""
        return len(self._loading) + len(self._loaded)

    def drop_held_loads(self) -> bool:
        """Stop holding loaded blocks for their requests (they stay cached): when the head of
        the queue cannot be admitted, blocks held for requests behind it must not be what
        keeps it out; nor may they cost a running request its seat. Whether any were held."""
        dropped = bool(self._loaded)
        for held in self._loaded.values():
            self.pool.free(held)
        self._loaded.clear()
        return dropped

    def take_transfers(self) -> tuple[list[KVTransfer], list[int]]:
        """The copies gathered for the next step, in the order the workers start them, and the
        transfers seen done since the last step (the workers may now reuse their blocks). The
        step's stores go before its loads (a load may fill a block a swap-out frees, and the
        workers run a stream's copies in order), except joined loads that fill no block a
        swap-out reads: they go first, so as not to queue behind stores that wait for the step
        in flight."""
        released, self._released = self._released, []
        stores = self._next_stores
        swapped = {block_id for block_id, _ in stores.swaps}
        early, late = [], [stores] if stores else []
        for load in self._next_loads:
            goes_early = not load.ordered and swapped.isdisjoint(b for _, b in load.loads)
            (early if goes_early else late).append(load)
        gathered = early + late
        self._next_stores, self._next_loads = _Transfer(), []
        plans, now = [], monotonic() if gathered else 0.0
        for transfer in gathered:
            transfer.started = now
            transfer_id = self._next_transfer_id
            self._next_transfer_id += 1
            self._transfers[transfer_id] = transfer
            plans.append(KVTransfer(transfer_id, transfer.stores + transfer.swaps,
                                    transfer.loads, bool(transfer.swaps) or transfer.joined,
                                    transfer.ordered))
        self.pool.epoch += 1  # a step's plan is complete: what is freed from now on, it may use
        return plans, released

    @property
    def transfers_pending(self) -> bool:
        """Copies gathered for the next step or started and not reported done: the engine
        keeps stepping (with nothing else to run, steps that only carry or poll them)."""
        return bool(self._transfers or self._next_stores or self._next_loads)

    def transfers_done(self, transfer_ids: list[int]) -> None:
        """The workers finished these transfers: stored host blocks become findable and their
        GPU blocks are unpinned; loaded GPU blocks join the prefix cache and their request may
        be admitted (aborted meanwhile: the blocks are cached all the same)."""
        for transfer_id in transfer_ids:
            transfer = self._transfers.pop(transfer_id)
            for _, host_block in transfer.stores + transfer.swaps:
                self.host.finish_store(host_block)
                self.stored_blocks += 1
            if transfer.stores:  # unpinned
                self.pool.free([block_id for block_id, _ in transfer.stores])
            if transfer.loads:
                for (host_block, block_id), block_hash in zip(transfer.loads,
                                                              transfer.load_hashes):
                    self.host.unpin(host_block)
                    self.pool.cache_block(block_id, block_hash)
                loaded = [block_id for _, block_id in transfer.loads]
                self.loaded_blocks += len(loaded)
                self.loads_done += 1
                if transfer.joined:  # its request did not wait; the load's reference goes
                    self.loads_joined += 1
                    self.pool.free(loaded)
                else:
                    self._load_landed(transfer.owner, loaded, transfer.started)
            self._released.append(transfer_id)

    def _load_landed(self, rid: str, loaded: list[int], started: float) -> None:
        """A request waiting for its load may be admitted: its blocks are held for it (aborted
        meanwhile: they stay cached, held by nobody)."""
        self.load_wait_seconds += monotonic() - started
        self._loading.discard(rid)
        if rid in self._abandoned:
            self._abandoned.discard(rid)
            self.pool.free(loaded)
        else:
            self._loaded[rid] = loaded

    def num_held_blocks(self, request: Request) -> int:
        state = self._requests.get(request.request_id)
        return len(state.block_ids) if state is not None else 0

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
        """Forget every cached prefix, on the GPU and on the host (stale KV, say new weights);
        refused while any block is in use or any copy in flight."""
        if self.transfers_pending or self._loaded:
            return False
        if not self.pool.reset_prefix_cache():
            return False
        if self.host is not None:
            self.host.reset()
        return True

    def check_invariants(self) -> None:
        """Every GPU block's reference count is what holds it (request block tables, stores
        pinning it, loads filling it) and the free lists hold exactly the blocks nobody holds;
        the host tier accounts for each of its blocks (tests call this after runs with
        aborts)."""
        holders = [0] * self.pool.num_blocks
        for state in self._requests.values():
            for block_id in state.block_ids:
                holders[block_id] += 1
        for held in self._loaded.values():
            for block_id in held:
                holders[block_id] += 1
        for transfer in [*self._transfers.values(), self._next_stores, *self._next_loads]:
            for block_id, _ in transfer.stores:
                holders[block_id] += 1
            for _, block_id in transfer.loads:
                holders[block_id] += 1
        if holders != self.pool.ref_counts:
            wrong = [b for b, (h, r) in enumerate(zip(holders, self.pool.ref_counts)) if h != r]
            raise AssertionError(f"reference counts differ from holders at blocks {wrong[:8]}")
        free = sorted(self.pool.free_block_ids())
        if free != [b for b, h in enumerate(holders) if h == 0]:
            raise AssertionError("free lists and unreferenced blocks differ")
        if self.host is not None:
            self.host.check()

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
