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
  overloaded. The router keeps, per replica, an LRU index of the block hashes of the prompts it
  sent there: a guess at that replica's prefix cache, never a copy of it (the replica evicts on
  its own, and the router is not told).

The router is pure bookkeeping: it neither sends nor receives anything, and its memory is bounded
by max_blocks_per_replica hashes per replica whatever the number of requests.
"""

from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

ROUTING_POLICIES = ("cache_aware", "least_load", "round_robin")

_ROOT = "echo-router"


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
    max_blocks_per_replica: int = 1 << 16  # LRU bound of each replica's prefix index

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


def _matched(hashes: list[int], index: OrderedDict) -> int:
    """How many leading hashes are in the index, by binary search.

    Valid because each index is prefix-closed along a chain: _insert touches a prompt's hashes
    last-block-first, so a block's ancestors are always at least as recent as the block and LRU
    eviction takes a chain's tail before its head. If hashes[k] is present, so are hashes[:k]
    (barring a collision, which costs a mis-route at worst). Logarithmic instead of linear in the
    prompt's blocks, for each replica.
    """
    if not hashes or hashes[0] not in index:  # the common miss (another prefix) in one lookup
        return 0
    lo, hi = 1, len(hashes)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if hashes[mid - 1] in index:
            lo = mid
        else:
            hi = mid - 1
    return lo


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
        # per replica: block hash -> None, least recently routed first
        self._indexes: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
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
        return _matched(hashes, self._indexes[index])

    def index_size(self, index: int) -> int:
        """Block hashes in a replica's prefix index (at most max_blocks_per_replica)."""
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
        best, best_len = least, 0
        for index in self._available:
            n = _matched(hashes, self._indexes[index])
            if n > best_len or (n == best_len and n and self._load(index) < self._load(best)):
                best, best_len = index, n
        # no replica holds any of it, or the one that does is overloaded: balance instead. The
        # chosen replica then gets the prefix too, so a hot prefix spreads over replicas as the
        # load demands
        if best_len == 0 or (self.in_flight[best] - self.in_flight[least]
                             > self.config.balance_abs_threshold):
            best = least
        self._insert(best, hashes)
        return best

    def _insert(self, index: int, hashes: list[int]) -> None:
        lru = self._indexes[index]
        move_to_end = lru.move_to_end
        # last block first, so the prefix ends up the most recent: shared heads outlive the
        # unique tails, and _matched's binary search stays valid (see there)
        for h in reversed(hashes):
            if h in lru:
                move_to_end(h)
            else:
                lru[h] = None
        # the one cost not bounded per request: at its bound the OrderedDict still rehashes
        # now and then as evictions leave holes (measured about 8 ms at 65,536 hashes, every
        # few tens of thousands of new ones), as any dict-based index with churn does
        for _ in range(len(lru) - self.config.max_blocks_per_replica):
            lru.popitem(last=False)
