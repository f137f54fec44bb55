"""Router: which engine replica serves a request when several replicas of one model sit behind
one frontend (data parallelism).

Three policies:
- round_robin: the available replicas in turn, in index order.
- least_load: the available replica with the fewest requests in flight from this frontend; ties
  go to fewer waiting requests, then lower KV cache usage (as last reported by the replica),
  then the lower index. The in-flight count is the frontend's own and changes the moment a
  request is routed, so a burst does not herd onto the replica whose report is oldest.
- cache_aware (the idea of SGLang's cache-aware router, written for echo): send a request to the
  replica most likely to hold its prompt's prefix in its KV cache, unless that replica is
  overloaded. The router keeps, per replica, a bounded index of the block hashes of the prompts
  it sent there (PrefixIndex, a generational LRU): a guess at that replica's prefix cache, never
  a copy of it (the replica evicts on its own, and the router is not told).

The router is pure bookkeeping: it neither sends nor receives anything, and its memory is bounded
by max_blocks_per_replica hashes per replica whatever the number of requests.
"""

from bisect import bisect_left
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat, starmap

ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")

_ROOT = "echo-router"

# generations of each replica's PrefixIndex (chosen by measurement, see there)
PREFIX_INDEX_SEGMENTS = 16
# hashes of dropped generations freed per PrefixIndex.insert, at least (see there)
PREFIX_INDEX_RECLAIM = 256


class NoReplicaError(RuntimeError):
    """choose() was called while every replica is out of the rotation."""


@dataclass(frozen=True)
class RouterConfig:
    num_replicas: int
    policy: str = "cache_aware"
    block_size: int = 16  # tokens per hashed block: the engine's KV block size
    # cache_aware gives up the longest match when its replica has more than this many requests
    # in flight beyond the least loaded one (SGLang's balance_abs_threshold)
    balance_abs_threshold: int = 8
    max_blocks_per_replica: int = 1 << 16  # bound of each replica's prefix index

    def __post_init__(self):
        if self.policy not in ROUTING_POLICIES:
            raise ValueError(f"policy must be one of {ROUTING_POLICIES}, got {self.policy!r}")
        for name, minimum in (("num_replicas", 1), ("block_size", 1),
                              ("balance_abs_threshold", 0), ("max_blocks_per_replica", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's last reported load (update_stats)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


def block_hashes(prompt_token_ids: Sequence[int], block_size: int,
                 cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks: h_i covers blocks 0..i, so equal h_i means an
    equal prefix (the same chaining as the KV cache manager, salt included, so prompts that
    cannot share KV there are not routed as if they could).

    Python's hash() over tuples rather than the KV cache manager's sha256: this is a routing
    heuristic, where a collision only costs a cache miss, while sha256 costs about 1 µs per
    block (a 2k-token prompt has 128). hash() of ints is the same in every process; of the salt
    string it varies per process (PYTHONHASHSEED), which does not matter because the hashes are
    only ever compared with others made by the same router.
    """
    h = hash((_ROOT, cache_salt))
    hashes = []
    append = hashes.append
    # (parent, block as a tuple) rather than (parent, *block): slicing one tuple of the whole
    # prompt is about 40% faster than unpacking a list slice into a new tuple, and as good a key
    tokens = tuple(prompt_token_ids)
    for end in range(block_size, len(tokens) + 1, block_size):
        h = hash((h, tokens[end - block_size:end]))
        append(h)
    return hashes


class PrefixIndex:
    """A set of block hashes bounded to `capacity` that evicts the least recently inserted
    first, a whole generation at a time: a generational (segmented) LRU.

    The hashes live in up to `segments` sets (generations) of capacity // segments each, newest
    first. New hashes go into the newest; when it is full a new empty one starts and, once there
    are `segments`, the oldest is dropped: no longer looked up, and freed over the next inserts
    (_reclaim). Inserting a hash held in an older set moves it into the newest (a touch). So at
    most segments * (capacity // segments) <= capacity hashes are held, (segments - 1) /
    segments of that at least once full, and the most recently inserted are the ones kept,
    give or take a generation.

    Why not an OrderedDict LRU, one eviction per new hash: at 65,536 hashes its dict rehashes
    now and then as evictions leave holes, and single choose() calls took 5-9 ms (2-13 ms of
    CPU time) every few thousand requests in tools/bench_router.py at 1,000 requests/s: a stall
    of the frontend's event loop. Here no set holds more than capacity // segments hashes, so
    growing one costs tens of µs, and none is rebuilt for holes: the only deletions (touches)
    are in older sets, which take no more inserts. The price: an absent hash is looked up in
    every set (16 probes, under 1 µs), and eviction is a generation coarse.

    16 sets by measurement at the default 65,536 (same bench, 2 and 8 replicas, CPU time per
    choose() on the 2-core development machine): a set of 4,096 grows to 8,192 slots at most
    (128 KiB; last resized at 1,229 hashes), where with 8 sets one of 8,192 resizes once more
    at 4,915, to 32,768 slots (512 KiB, 128 page faults while the index still grows: calls of
    0.65-0.8 ms); 32 sets cost 5-20 µs more at the median (an absent hash probed in twice as
    many sets) for no better worst case.

    Prefix-closed along a chain, which matched()'s binary search relies on: if a prompt's
    hashes[k] is held, so are hashes[:k] (barring a hash collision, which costs a mis-route at
    worst). insert() puts a prompt's hashes into the newest set last block first, starting a
    newer set when that one fills, so each block ends up in a generation at least as new as the
    block after it; a touch only happens inside such an insert, which then moves every ancestor
    of the touched hash (the same prompt's earlier hashes) into the newest generation too. So a
    parent is never in an older generation than its child, and eviction drops only the oldest
    generation: if a child survives, its generation was not the oldest, nor is its parent's.
    """

    __slots__ = ("capacity", "segment_capacity", "max_segments", "_segments", "_retired")

    def __init__(self, capacity: int, segments: int = PREFIX_INDEX_SEGMENTS):
        if capacity < 1 or segments < 1:
            raise ValueError(f"capacity and segments must be >= 1, got {capacity}, {segments}")
        self.max_segments = min(segments, capacity)
        self.segment_capacity = capacity // self.max_segments
        self.capacity = self.max_segments * self.segment_capacity  # <= the capacity asked for
        self._segments: list[set[int]] = [set()]  # newest first
        # dropped generations (no longer looked up), freed a little per insert: see _reclaim
        self._retired: list[set[int]] = []

    def __len__(self) -> int:
        return sum(map(len, self._segments))

    def __contains__(self, h: int) -> bool:
        for segment in self._segments:
            if h in segment:
                return True
        return False

    def clear(self) -> None:
        # in O(1): the sets are freed by later inserts, as dropped generations are
        self._retired.extend(self._segments)
        self._segments = [set()]

    def matched(self, hashes: list[int]) -> int:
        """How many leading hashes are held, by binary search (valid because the index is
        prefix-closed along a chain, see the class): logarithmic instead of linear in the
        prompt's blocks."""
        if not hashes:
            return 0
        segments = self._segments
        h = hashes[0]
        for segment in segments:  # the common miss (another prefix) in one probe per set
            if h in segment:
                break
        else:
            return 0
        lo, hi = 1, len(hashes)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            h = hashes[mid - 1]
            for segment in segments:
                if h in segment:
                    lo = mid
                    break
            else:
                hi = mid - 1
        return lo

    def insert(self, hashes: list[int], matched: int) -> None:
        """Make a prompt's hashes the most recent, last block first; `matched` is
        self.matched(hashes), just computed: hashes[matched:] are known to be absent."""
        capacity = self.segment_capacity
        newest = self._segments[0]
        # the new tail, in slices that fit the newest set (order within a set is moot: it is
        # one generation)
        end = len(hashes)
        while end > matched:
            room = capacity - len(newest)
            if room <= 0:
                newest = self._roll()
                room = capacity
            start = max(matched, end - room)
            newest.update(hashes[start:end])
            end = start
        # the held head: move each hash not in the newest set yet there. Along a held chain the
        # generations only get older towards the tail (see the class), so its hashes sit in runs
        # in a few sets: look in the set of the previous find first
        if matched and not newest.issuperset(hashes[:matched]):
            found = newest
            for k in range(matched - 1, -1, -1):
                h = hashes[k]
                if h in newest:
                    continue
                if h in found:
                    found.discard(h)
                else:
                    for segment in self._segments:
                        if h in segment:
                            # an older set: it takes no more inserts, so its holes are moot
                            segment.discard(h)
                            found = segment
                            break
                    # not found: it was in the oldest set, dropped by a roll of this insert
                if len(newest) >= capacity:
                    newest = self._roll()
                newest.add(h)
        if self._retired:
            self._reclaim()

    def _roll(self) -> set[int]:
        """Start a new newest set, dropping the oldest once there are max_segments."""
        segments = self._segments
        if len(segments) >= self.max_segments:
            self._retired.append(segments.pop())
        newest: set[int] = set()
        segments.insert(0, newest)
        return newest

    def _reclaim(self) -> None:
        """Free some of the dropped generations' hashes: PREFIX_INDEX_RECLAIM, or more where
        held and dropped ones together exceed the capacity, so that between calls they never do.

        Why not free a dropped set at once: its hashes are int objects in cold memory, each one
        deallocated; in the bench a set of 4,096 took 190-250 µs to free at once, as much as
        the rest of a routing decision, and popped 256 at a time (in C, through starmap) they
        take 40-100 µs in each of about 16 inserts after a drop. And clear() costs nothing when
        a replica leaves, where freeing 65,536 hashes at once takes milliseconds.
        """
        retired = self._retired
        n = max(PREFIX_INDEX_RECLAIM, len(self) + sum(map(len, retired)) - self.capacity)
        while retired and n > 0:
            last = retired[-1]
            if len(last) <= n:
                n -= len(last)
                retired.pop()  # frees it
            else:
                deque(starmap(last.pop, repeat((), n)), 0)
                return


class Router:
    def __init__(self, num_replicas: int, policy: str = "cache_aware", block_size: int = 16,
                 balance_abs_threshold: int = 8, max_blocks_per_replica: int = 1 << 16):
        self.config = RouterConfig(num_replicas, policy, block_size, balance_abs_threshold,
                                   max_blocks_per_replica)
        self.num_replicas = num_replicas
        self.in_flight = [0] * num_replicas  # requests routed and not yet finished, per replica
        self.stats = [ReplicaStats()] * num_replicas
        self._is_available = [True] * num_replicas
        self._available = list(range(num_replicas))  # sorted: ties and round_robin follow it
        # per replica: the block hashes of the prompts routed there, most recent kept
        self._indexes = [PrefixIndex(max_blocks_per_replica) for _ in range(num_replicas)]
        self._next = 0  # round_robin: the lowest index the next turn may take
        self._policy = {"cache_aware": self._cache_aware, "least_load": self._least_load,
                        "round_robin": self._round_robin}[policy]

    @property
    def available(self) -> list[int]:
        return list(self._available)

    def choose(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> int:
        """The replica for a new request, which is counted in flight there until finished()."""
        if not self._available:
            raise NoReplicaError(f"no replica is available: all {self.num_replicas} are out of "
                                 "the rotation")
        index = self._policy(prompt_token_ids, cache_salt)
        self.in_flight[index] += 1
        return index

    def finished(self, index: int) -> None:
        """A request routed to `index` ended (finished, aborted or failed)."""
        self._check_index(index)
        # never below 0: a replica that left had its count reset, and its requests' ends may
        # still arrive afterwards
        if self.in_flight[index] > 0:
            self.in_flight[index] -= 1

    def set_available(self, index: int, available: bool) -> None:
        """Take a replica out of the rotation (it died or is restarting) or put it back."""
        self._check_index(index)
        if not available:
            # a restarted replica's cache is empty and its requests are gone
            self._indexes[index].clear()
            self.in_flight[index] = 0
            self.stats[index] = ReplicaStats()
        self._is_available[index] = bool(available)
        self._available = [i for i, up in enumerate(self._is_available) if up]

    def update_stats(self, index: int, num_running: int, num_waiting: int,
                     kv_cache_usage: float) -> None:
        """The replica's own report of its load; breaks least_load's in-flight ties."""
        self._check_index(index)
        self.stats[index] = ReplicaStats(num_running, num_waiting, kv_cache_usage)

    def matched_blocks(self, prompt_token_ids: Sequence[int], cache_salt: str | None,
                       index: int) -> int:
        """How many of the prompt's leading full blocks the router believes `index` holds."""
        self._check_index(index)
        hashes = block_hashes(prompt_token_ids, self.config.block_size, cache_salt)
        return self._indexes[index].matched(hashes)

    def index_size(self, index: int) -> int:
        """Block hashes in a replica's prefix index (at most max_blocks_per_replica: at most
        PrefixIndex.capacity, which is max_blocks_per_replica rounded down to a multiple of the
        generations' count)."""
        self._check_index(index)
        return len(self._indexes[index])

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_replicas:
            raise ValueError(f"index must be in [0, {self.num_replicas}), got {index}")

    def _load(self, index: int) -> tuple[int, int, float]:
        stats = self.stats[index]
        return self.in_flight[index], stats.num_waiting, stats.kv_cache_usage

    # the policies: each returns an available index, `choose` counts it

    def _round_robin(self, prompt_token_ids, cache_salt) -> int:
        available = self._available
        # the first available replica at or after the cursor, wrapping around: a replica that
        # leaves is skipped without disturbing the others' order
        pos = bisect_left(available, self._next)
        index = available[pos] if pos < len(available) else available[0]
        self._next = index + 1
        return index

    def _least_load(self, prompt_token_ids=None, cache_salt=None) -> int:
        # min() keeps the first of equal keys, and _available is sorted: ties go to the lower index
        return min(self._available, key=self._load)

    def _cache_aware(self, prompt_token_ids, cache_salt) -> int:
        least = self._least_load()
        hashes = block_hashes(prompt_token_ids, self.config.block_size, cache_salt)
        if not hashes:  # shorter than one block: nothing to share
            return least
        best, best_len, least_len = least, 0, 0
        for index in self._available:
            n = self._indexes[index].matched(hashes)
            if index == least:
                least_len = n
            if n > best_len or (n == best_len and n and self._load(index) < self._load(best)):
                best, best_len = index, n
        # no replica holds any of it, or the one that does is overloaded: balance instead. The
        # chosen replica then gets the prefix too, so a hot prefix spreads over replicas as the
        # load demands
        if best_len == 0 or (self.in_flight[best] - self.in_flight[least]
                             > self.config.balance_abs_threshold):
            best, best_len = least, least_len
        self._insert(best, hashes, best_len)
        return best

    def _insert(self, index: int, hashes: list[int], matched: int) -> None:
        # last block first, so the prefix ends up the most recent: shared heads outlive the
        # unique tails, and matched()'s binary search stays valid (see PrefixIndex). Bounded
        # per request: the index's sets hold max_blocks_per_replica // PREFIX_INDEX_SEGMENTS
        # hashes each (4,096 by default), so a set's growth costs tens of µs, and a dropped one
        # is freed a few hundred hashes per insert; an OrderedDict LRU of 65,536 rehashed now
        # and then as evictions left holes (5-9 ms every few thousand requests in
        # tools/bench_router.py)
        self._indexes[index].insert(hashes, matched)
