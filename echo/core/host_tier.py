"""HostTier: the bookkeeping of the KV cache's host-memory tier (kv_offloading_size), below the
GPU prefix cache.

Host blocks hold copies of full GPU blocks, keyed by the same chained block hashes as the GPU
prefix cache, LRU within the tier. A host block is in one of three states:
- free;
- storing: a GPU block is being copied into it; not findable until the copy is reported done;
- valid: findable by its hash. Loads pin it (a copy to the GPU reads it), so it is not evicted
  or overwritten while a load is in flight.
The memory itself and the copies are the workers' (echo/worker/kv_transfer.py); this class only
decides which host block holds what, so the scheduler never sees a host address either.
"""

from collections import OrderedDict

from echo.core.block_pool import BlockHash


class HostTier:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # lowest ids first
        self._valid: OrderedDict[BlockHash, int] = OrderedDict()  # least recently used first
        self._storing: dict[int, BlockHash] = {}  # host block -> the hash it will hold
        self._storing_hashes: set[BlockHash] = set()
        self._pins: dict[int, int] = {}  # host block -> loads reading it

    def __contains__(self, block_hash: BlockHash) -> bool:
        """Whether the tier holds (or is storing) this block: no second store is needed."""
        return block_hash in self._valid or block_hash in self._storing_hashes

    def lookup(self, block_hash: BlockHash) -> int | None:
        """The valid host block holding this hash, made the most recently used."""
        host_block = self._valid.get(block_hash)
        if host_block is not None:
            self._valid.move_to_end(block_hash)
        return host_block

    def start_store(self, block_hash: BlockHash) -> int | None:
        """A host block for a new copy of this hash: a free one, else the least recently used
        valid one that no load reads. None when every block is storing or pinned."""
        if self._free:
            host_block = self._free.pop()
        else:
            victim = next((h for h, b in self._valid.items() if b not in self._pins), None)
            if victim is None:
                return None
            host_block = self._valid.pop(victim)
        self._storing[host_block] = block_hash
        self._storing_hashes.add(block_hash)
        return host_block

    def finish_store(self, host_block: int) -> None:
        block_hash = self._storing.pop(host_block)
        self._storing_hashes.discard(block_hash)
        self._valid[block_hash] = host_block

    def pin(self, host_block: int) -> None:
        self._pins[host_block] = self._pins.get(host_block, 0) + 1

    def unpin(self, host_block: int) -> None:
        count = self._pins[host_block] - 1
        if count:
            self._pins[host_block] = count
        else:
            del self._pins[host_block]

    def reset(self) -> None:
        """Forget every stored block (the caller checked no copy is in flight)."""
        assert not self._storing and not self._pins, "host tier reset during a transfer"
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._valid.clear()

    @property
    def num_valid(self) -> int:
        return len(self._valid)

    def check(self) -> None:
        """Every host block is free, storing or valid, exactly once; pins are on valid blocks
        (tests call this after runs with aborts)."""
        valid = list(self._valid.values())
        every = sorted(self._free + list(self._storing) + valid)
        if every != list(range(self.num_blocks)):
            raise AssertionError(f"host blocks lost or doubled: {len(every)} accounted of "
                                 f"{self.num_blocks}")
        stray = set(self._pins) - set(valid)
        if stray:
            raise AssertionError(f"pins on host blocks that are not valid: {sorted(stray)}")
