"""The KV host tier's memory on one worker and the copies between it and the device cache.

A host block holds one device block's K and V (and an int8 cache's scales) of every layer as one
run of bytes, so storing or loading a block is one host copy, not one per layer and tensor. The
blocks are gathered into (and scattered from) a device staging buffer of whole blocks first,
with one index_select (index_copy_) per cache tensor: every layer's K and V are views of one
tensor (worker/kv_cache.py, StackedKVCache), so a chunk costs the host a few launches, not a
few per layer (a step that starts a load or a store waits for them). Between staging and host,
each run of consecutive host block ids is one copy.

On CUDA the copies go on a side stream of their own, so a step's kernels on the main stream run
while blocks move, a few chunks at a time (the runner issues more while it waits for a step); the
block ids go up through a pinned ring allocated once (pinned_ring.py says why). Two orderings
make that safe: a transfer's gathers and scatters wait for the main stream's work queued before
`start` (the KV it stores was written by earlier steps, the blocks it loads into were read by
them), and `release` makes the main stream wait for a transfer before later kernels reuse its
device blocks. The copy mode ("split") may put the gathers and scatters on a second side
stream, each chunk in a staging slot of its own, so the copy engine can go on to the next
chunk's copy while a scatter waits for SMs that the steps' kernels hold (one stream serialises
copy, scatter, copy); or ("direct") skip staging: each block moves between its host block and
the cache's strided segments in one strided copy per cache tensor by the copy engine
(strided_copy.py), with no kernel and no SM, at the cost of a driver call per block; stores
and loads then go on a stream each, so a swap-out is not queued behind loads.
On CPU (tests, CI) the copies run synchronously inside `start`.
"""

import time
import weakref
from collections import deque
from dataclasses import dataclass, field

import torch

from echo import envs
from echo.worker.kv_cache import KVCacheSpec, StackedKVCache, kv_cache_spec
from echo.worker.pinned_ring import PinnedUploadRing
from echo.worker.strided_copy import StridedCopier, max_pitch

# blocks a host-tier chunk moves through the device staging buffer (counted in the KV budget)
STAGING_BLOCKS = 64
# chunks queued on the side stream and not yet done: two keep the copy engine busy between the
# host's pumps; a whole transfer queued at once (128 chunks of Qwen3-8B) filled the stream's
# command queue, and the host blocked 190 ms issuing it (docs/benchmarks.md, KV offload)
CHUNKS_IN_FLIGHT = 2
# how chunks move (module docstring): "staged" through a staging buffer on one side stream,
# "split" with its gathers and scatters on a second one, "direct" by strided copies without
# staging. ECHO_KV_COPY_MODE (echo/envs.py) picks one; staged by default: direct's strided
# copies ran at two thirds of its rate beside running steps (docs/benchmarks.md, KV offload,
# 2026-12-05); split is not yet timed (tools/dev/gpu_probes.sh kv-split)
COPY_MODES = envs.KV_COPY_MODES


def host_tier_blocks(kv_offloading_size_gib: float, bytes_per_block: int, tp_size: int) -> int:
    """How many blocks the host tier holds. kv_offloading_size is the total over every TP rank
    and every rank keeps its own shard (its KV heads) of each block, so a block costs
    bytes_per_block (one rank's share) times tp_size of it."""
    if not kv_offloading_size_gib >= 0:
        raise ValueError(f"kv_offloading_size_gib: must be >= 0, got {kv_offloading_size_gib!r}")
    if bytes_per_block < 1:
        raise ValueError(f"bytes_per_block: must be >= 1, got {bytes_per_block!r}")
    if tp_size < 1:
        raise ValueError(f"tp_size: must be >= 1, got {tp_size!r}")
    # floor(floor(x) / n) == floor(x / n) for a whole n: exact without float division
    return int(kv_offloading_size_gib * 2**30) // (bytes_per_block * tp_size)


def num_host_blocks(config) -> int:
    """The KV host tier's blocks under an engine config (0 without kv_offloading_size): what
    the core's scheduler counts and every worker allocates."""
    size = config.cache.kv_offloading_size
    if size is None:
        return 0
    return host_tier_blocks(size, kv_cache_spec(config).bytes_per_block(),
                            config.parallel.tensor_parallel_size)


def _unregister(data: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(data.data_ptr())


class HostKVCache:
    """The host tier's memory on one worker: `data` [num_host_blocks, bytes_per_block] uint8, a
    block's K, V (and int8 scales) of every layer one contiguous run, so a block moves in one
    copy. Pinned with cudaHostRegister rather than pin_memory=True: torch's pinned allocator
    rounds a request up to a power of two (a 70 GiB tier would lock 128 GiB). The memory is not
    zeroed: a block's bytes mean something only once a store has written them."""

    def __init__(self, spec: KVCacheSpec, num_host_blocks: int, pin: bool):
        if num_host_blocks < 0:
            raise ValueError(f"num_host_blocks: must be >= 0, got {num_host_blocks}")
        self.spec = spec
        self.num_blocks = num_host_blocks
        self.bytes_per_block = spec.bytes_per_block()
        self.data = torch.empty(num_host_blocks, self.bytes_per_block, dtype=torch.uint8)
        self.pinned = pin and self.data.numel() > 0
        if self.pinned:
            error = torch.cuda.cudart().cudaHostRegister(self.data.data_ptr(), self.data.nbytes, 0)
            if int(error) != 0:
                raise RuntimeError(f"cudaHostRegister of the {self.data.nbytes / 2**30:.1f} GiB "
                                   f"KV host tier failed: {error}")
            # at exit the process's memory goes anyway; unregistering then may meet a torn-down
            # CUDA context
            weakref.finalize(self, _unregister, self.data).atexit = False


@dataclass
class _Transfer:
    stored_bytes: int
    loaded_bytes: int
    device_ids: list[int]  # the stores' device blocks, then the loads'
    chunks: deque  # (store?, first, end position in device_ids, host ids) not issued yet
    # the main stream's work at start (CUDA); None for an early load, which waits for nothing
    ready: torch.cuda.Event | None = None
    index: torch.Tensor | None = None  # device_ids on the device, uploaded with the first chunk
    end: torch.cuda.Event | None = None  # after its last chunk (CUDA)
    timings: list = field(default_factory=list)  # each chunk's copy (begin, end) events (CUDA)
    wall_s: float = 0.0  # on CPU, where the copies are done in start
    reported: bool = False

    @property
    def issued(self) -> bool:
        return not self.chunks and self.end is not None


def _runs(ids: list[int]):
    """(position, first id, length) of each run of consecutive ids."""
    pos = 0
    while pos < len(ids):
        length = 1
        while pos + length < len(ids) and ids[pos + length] == ids[pos] + length:
            length += 1
        yield pos, ids[pos], length
        pos += length


def _check_ids(name: str, ids: list[int], limit: int, unique: bool = False) -> None:
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise ValueError(f"{name}: ids must be in [0, {limit}), got {bad}")
    if unique and len(set(ids)) != len(ids):
        raise ValueError(f"{name}: a block may be written once per transfer, got {ids}")


class KVTransfers:
    """Copies between the device KV cache (as KVCacheSpec.allocate_stacked makes it) and a
    HostKVCache. Transfers are identified by the caller's ids; one is pending from
    `start` until `release`. On CUDA a transfer's chunks are issued a few at a time (at most
    chunks_in_flight queued on the side stream), by start and then by each poll_done and pump,
    so a transfer of gigabytes never blocks the host. Memory: a staging buffer of
    max_blocks_per_chunk blocks (chunks_in_flight of them when split, none when direct; on CUDA
    it counts against the GPU beside the KV cache: staging_blocks), chunk-sized temporaries, a
    pinned ring for the block ids, and a few events per pending transfer's chunks."""

    def __init__(self, device_cache: StackedKVCache, host: HostKVCache, device: torch.device,
                 max_blocks_per_chunk: int = STAGING_BLOCKS,
                 chunks_in_flight: int = CHUNKS_IN_FLIGHT, copy_mode: str | None = None):
        if max_blocks_per_chunk < 1:
            raise ValueError(f"max_blocks_per_chunk: must be >= 1, got {max_blocks_per_chunk}")
        if chunks_in_flight < 1:
            raise ValueError(f"chunks_in_flight: must be >= 1, got {chunks_in_flight}")
        copy_mode = envs.kv_copy_mode() if copy_mode is None else copy_mode
        if copy_mode not in COPY_MODES:
            raise ValueError(f"copy_mode: must be one of {COPY_MODES}, got {copy_mode!r}")
        self.host, self.device = host, torch.device(device)
        self.max_blocks_per_chunk, self.chunks_in_flight = max_blocks_per_chunk, chunks_in_flight
        self.num_device_blocks = device_cache.kv.shape[2]
        # each cache tensor as [num_blocks, 2 * num_layers, words] with its word range inside a
        # host block: K and V of every layer, then (int8) every layer's scales. Words are the
        # widest integers the byte counts allow: the gather and scatter kernels then handle an
        # eighth of the elements they would as bytes (they share the GPU with the steps)
        planes = device_cache.planes()
        bytes_per_block = sum(plane[0].numel() for plane in planes)
        if bytes_per_block != host.bytes_per_block:
            raise ValueError(f"host: its blocks are {host.bytes_per_block} bytes, the device "
                             f"cache's {bytes_per_block}")
        word = next(w for w in (torch.int64, torch.int32, torch.int16, torch.uint8)
                    if all(plane.shape[-1] % w.itemsize == 0 for plane in planes))
        self._parts: list[tuple[torch.Tensor, int, int]] = []
        offset = 0
        for plane in planes:
            plane = plane.view(word)
            size = plane[0].numel()
            self._parts.append((plane, offset, offset + size))
            offset += size
        self._cuda = self.device.type == "cuda"
        # the host <-> device copies; the gathers and scatters on the same stream or, split, on
        # a second one (the staging slot's and the chunk's events order the two)
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self.copy_mode = copy_mode
        self.split_streams = copy_mode == "split" and self._cuda
        self.direct = copy_mode == "direct"
        self._kernel_stream = (torch.cuda.Stream(self.device) if self.split_streams
                               else self._stream)
        # direct: stores (device to host) on a stream of their own, so a swap-out the next
        # step waits for is not queued behind loads going the other way (the copy engines of
        # the two directions run at once); a load waits for the stores issued before it
        self._store_stream = (torch.cuda.Stream(self.device) if self.direct and self._cuda
                              else self._stream)
        self._last_store: torch.cuda.Event | None = None
        if self.direct:  # each cache tensor's block: height segments of width bytes, pitch apart
            self._geometry = direct_geometry(self._parts)
            if self._cuda:
                pitch = max(pitch for _, _, pitch, _, _, _ in self._geometry)
                index = self.device.index
                limit = max_pitch(torch.cuda.current_device() if index is None else index)
                if pitch > limit:
                    raise ValueError(f"copy_mode: 'direct' needs the KV cache's segment pitch "
                                     f"({pitch} bytes: blocks x segment bytes) within the "
                                     f"device's maximum pitch ({limit}); use 'staged'")
            self._to_host = StridedCopier(to_device=False, stream=self._store_stream)
            self._to_device = StridedCopier(to_device=True, stream=self._stream)
        # a transfer's device ids: a store and a load of every device block fit without growing
        self._ids = (PinnedUploadRing(2 * self.num_device_blocks, self.device)
                     if self._cuda and not self.direct else None)
        # (on the CPU, where chunks are copied one at a time, split takes one slot like staged)
        mode = "staged" if copy_mode == "split" and not self.split_streams else copy_mode
        slots = staging_blocks(max_blocks_per_chunk, chunks_in_flight, mode) // max_blocks_per_chunk
        self._staging = torch.empty(slots, max_blocks_per_chunk, offset, dtype=word,
                                    device=self.device)
        self._slot_free: list[torch.cuda.Event | None] = [None] * slots  # after its last use
        self._next_slot = 0
        self._host_words = host.data.view(word)
        self._pending: dict[int, _Transfer] = {}  # by start order
        self._in_flight: deque[torch.cuda.Event] = deque()  # the end of each queued chunk
        self._stored_bytes = self._loaded_bytes = 0
        self._seconds = 0.0
        if self._cuda and host.num_blocks and self.num_device_blocks:
            # the first gather and scatter load their kernels and the side stream's first
            # temporaries, which wait for the whole device: here, not behind a running step.
            # Device block 0 goes to the host and comes back unchanged; nothing is counted
            self.start(-1, [0], [0], [0], [0])
            self.wait_all()
            del self._pending[-1]

    @property
    def bytes_moved(self) -> tuple[int, int]:
        """(stored, loaded) bytes of the transfers poll_done has reported."""
        return self._stored_bytes, self._loaded_bytes

    @property
    def seconds(self) -> float:
        """Copy time of the transfers poll_done has reported: on CUDA the sum of their chunks'
        host <-> device copies on the copy stream (from 2026-12-05 not their gathers and
        scatters, which may overlap the next chunk's copy; nor waits), on CPU the wall time of
        start."""
        return self._seconds

    @property
    def queued_chunks(self) -> int:
        """Chunks issued to the side stream and not seen done at the last issue (CUDA)."""
        return len(self._in_flight)

    def start(self, transfer_id: int, store_device_blocks: list[int],
              store_host_blocks: list[int], load_host_blocks: list[int],
              load_device_blocks: list[int], ordered: bool = True) -> None:
        """Copy device block store_device_blocks[i] into host block store_host_blocks[i], then
        host block load_host_blocks[j] into device block load_device_blocks[j] (stores first,
        so a transfer may store a block and load into it). Returns at once on CUDA. Its copies
        wait for the work queued on the current stream, unless `ordered` is False (a load
        into blocks no queued work uses, KVTransfer.ordered: the scheduler's early loads)."""
        if transfer_id in self._pending:
            raise ValueError(f"transfer_id: {transfer_id} is still pending (not released)")
        if not ordered and store_device_blocks:
            raise ValueError("ordered: a transfer that stores reads KV queued work wrote; only "
                             "a load may be unordered")
        if len(store_device_blocks) != len(store_host_blocks):
            raise ValueError(f"store_host_blocks: {len(store_host_blocks)} ids for "
                             f"{len(store_device_blocks)} store_device_blocks")
        if len(load_host_blocks) != len(load_device_blocks):
            raise ValueError(f"load_device_blocks: {len(load_device_blocks)} ids for "
                             f"{len(load_host_blocks)} load_host_blocks")
        _check_ids("store_device_blocks", store_device_blocks, self.num_device_blocks)
        _check_ids("store_host_blocks", store_host_blocks, self.host.num_blocks, unique=True)
        _check_ids("load_host_blocks", load_host_blocks, self.host.num_blocks)
        _check_ids("load_device_blocks", load_device_blocks, self.num_device_blocks, unique=True)
        step, num_stores = self.max_blocks_per_chunk, len(store_device_blocks)
        num_loads = len(load_host_blocks)
        chunks = deque((True, i, min(i + step, num_stores), store_host_blocks[i:i + step])
                       for i in range(0, num_stores, step))
        chunks.extend((False, num_stores + i, num_stores + min(i + step, num_loads),
                       load_host_blocks[i:i + step]) for i in range(0, num_loads, step))
        transfer = _Transfer(num_stores * self.host.bytes_per_block,
                             len(load_device_blocks) * self.host.bytes_per_block,
                             store_device_blocks + load_device_blocks, chunks)
        self._pending[transfer_id] = transfer
        if not self._cuda:
            began = time.perf_counter()
            transfer.index = torch.tensor(transfer.device_ids, dtype=torch.int64)
            while transfer.chunks:
                chunk = transfer.chunks.popleft()
                if self.direct:
                    self._direct_copies(transfer, *chunk)
                else:
                    self._copy_chunk(transfer, *chunk)
            transfer.wall_s = time.perf_counter() - began
            return
        # the blocks stored were written, and those loaded into were last used, by kernels
        # queued on the main stream so far: the first chunk waits for them
        if ordered:
            transfer.ready = torch.cuda.Event()
            transfer.ready.record(torch.cuda.current_stream(self.device))
        self._issue()

    def poll_done(self) -> list[int]:
        """Ids of started transfers that have completed, oldest first, each reported once. Never
        blocks: issues more chunks where the side stream has room, then queries events. A
        transfer is reported only after those started before it (in direct mode a load may
        finish before an earlier store; it waits for its report)."""
        self._issue()
        done = []
        for transfer_id, transfer in self._pending.items():
            if transfer.reported:
                continue
            if self._cuda and not (transfer.issued and transfer.end.query()):
                break
            transfer.reported = True
            self._stored_bytes += transfer.stored_bytes
            self._loaded_bytes += transfer.loaded_bytes
            self._seconds += (transfer.wall_s if not self._cuda else
                              sum(b.elapsed_time(e) for b, e in transfer.timings) / 1e3)
            transfer.timings.clear()
            done.append(transfer_id)
        return done

    def release(self, transfer_ids: list[int]) -> None:
        """The scheduler has seen these transfers done and reuses their device blocks: the
        current stream waits (on the GPU, the host goes on) for each one, because on another TP
        rank the copies may lag the rank that reported them, and a later kernel must not
        overwrite a block still being stored or read one still being loaded. Unknown or already
        released ids are ignored, so releasing twice is harmless. A transfer released before
        poll_done reported it is left out of bytes_moved and seconds."""
        for transfer_id in transfer_ids:
            if transfer_id in self._pending:
                self.wait_on_device(transfer_id)
                del self._pending[transfer_id]

    def wait_on_device(self, transfer_id: int) -> None:
        """Make the current stream wait (on the GPU; the host goes on) for a started transfer,
        which stays pending for poll_done: the step after a swap-out reuses its blocks. Chunks
        not issued yet are issued now, whatever the side stream holds."""
        transfer = self._pending[transfer_id]
        if self._cuda:
            self._issue(through=transfer)
            torch.cuda.current_stream(self.device).wait_event(transfer.end)

    def wait_all(self) -> None:
        """Block until every started transfer is complete (shutdown, tests)."""
        if self._cuda:
            self._issue(through=next(reversed(self._pending.values()), None))
            for stream in {self._stream, self._kernel_stream, self._store_stream}:
                stream.synchronize()

    @property
    def unissued(self) -> bool:
        """Whether a pending transfer has chunks not issued yet: pump() while waiting."""
        return self._cuda and any(not t.issued for t in self._pending.values())

    def pump(self) -> None:
        """Issue more chunks where the side stream has room (a host that waits for a step calls
        this in its wait, so the copy engine is fed between polls). Never blocks."""
        self._issue()

    def _issue(self, through: _Transfer | None = None) -> None:
        """Issue chunks in start order while fewer than chunks_in_flight are queued, and every
        chunk up to and including `through`'s last. (On CPU, start has done the copies.)
        Staged chunks end in issue order whichever stream ends them (a load's on the kernel
        stream, a store's on the copy stream; each waits for the chunk before it on the
        other); direct ones may not (stores and loads on a stream each), which only makes the
        count of chunks in flight conservative."""
        if not self._cuda:
            return
        while self._in_flight and self._in_flight[0].query():
            self._in_flight.popleft()
        for transfer in self._pending.values():
            while not transfer.issued:
                if through is None and len(self._in_flight) >= self.chunks_in_flight:
                    return
                if transfer.index is None and not self.direct:
                    # the gathers and scatters touch device blocks the main stream used
                    with torch.cuda.stream(self._kernel_stream):
                        if transfer.ready is not None:
                            self._kernel_stream.wait_event(transfer.ready)
                        transfer.index = self._ids.upload(transfer.device_ids)
                if transfer.chunks:
                    done = self._issue_chunk(transfer, *transfer.chunks.popleft())
                else:  # a transfer that moves nothing: done once the main stream's work is
                    done = torch.cuda.Event()
                    done.record(self._kernel_stream)
                self._in_flight.append(done)
                if not transfer.chunks:
                    transfer.end = done
            if transfer is through:
                return

    def _issue_chunk(self, transfer: _Transfer, store: bool, first: int, end: int,
                     host_ids: list[int]) -> torch.cuda.Event:
        """Queue a chunk in the next staging slot (direct: its strided copies); returns the
        event after its last work."""
        if self.direct:
            stream = self._store_stream if store else self._stream
            # the copies touch device blocks the main stream used; a load may fill a block a
            # store issued before it reads (a swap-out in the same step)
            if transfer.ready is not None:
                stream.wait_event(transfer.ready)
            if not store and self._last_store is not None:
                stream.wait_event(self._last_store)
            begin = torch.cuda.Event(enable_timing=True)
            copied = torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            self._direct_copies(transfer, store, first, end, host_ids)
            copied.record(stream)
            if store:
                self._last_store = copied
            transfer.timings.append((begin, copied))
            return copied
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self._staging)
        free = self._slot_free[slot]  # the slot's previous chunk has read or written it
        copy, kernels = self._stream, self._kernel_stream
        begin = torch.cuda.Event(enable_timing=True)
        copied = torch.cuda.Event(enable_timing=True)
        if store:
            with torch.cuda.stream(kernels):
                if free is not None:
                    kernels.wait_event(free)
                self._gather(transfer, slot, first, end)
                gathered = torch.cuda.Event()
                gathered.record(kernels)
            with torch.cuda.stream(copy):
                copy.wait_event(gathered)
                begin.record(copy)
                self._host_copies(slot, host_ids, store=True)
                copied.record(copy)
            done = copied
        else:
            with torch.cuda.stream(copy):
                if free is not None:
                    copy.wait_event(free)
                begin.record(copy)
                self._host_copies(slot, host_ids, store=False)
                copied.record(copy)
            with torch.cuda.stream(kernels):
                kernels.wait_event(copied)
                self._scatter(transfer, slot, first, end)
                done = torch.cuda.Event()
                done.record(kernels)
        transfer.timings.append((begin, copied))
        self._slot_free[slot] = done
        return done

    def _copy_chunk(self, transfer: _Transfer, store: bool, first: int, end: int,
                    host_ids: list[int]) -> None:
        """A chunk's gather and host copies, or host copies and scatter, in program order
        (CPU)."""
        if store:
            self._gather(transfer, 0, first, end)
            self._host_copies(0, host_ids, store=True)
        else:
            self._host_copies(0, host_ids, store=False)
            self._scatter(transfer, 0, first, end)

    def _direct_copies(self, transfer: _Transfer, store: bool, first: int, end: int,
                       host_ids: list[int]) -> None:
        """A chunk's blocks straight between the cache and their host blocks: per block and
        cache tensor, one strided copy of its 2 * num_layers segments."""
        copier = self._to_host if store else self._to_device
        host_base, bytes_per_block = self.host.data.data_ptr(), self.host.bytes_per_block
        for device_id, host_id in zip(transfer.device_ids[first:end], host_ids):
            host_block = host_base + host_id * bytes_per_block
            for base, block_stride, pitch, width, height, offset in self._geometry:
                device_block = base + device_id * block_stride
                if store:
                    copier.copy(host_block + offset, width, device_block, pitch, width, height)
                else:
                    copier.copy(device_block, pitch, host_block + offset, width, width, height)

    def _gather(self, transfer: _Transfer, slot: int, first: int, end: int) -> None:
        # device ids are slices of the transfer's one upload: an upload per chunk costs the host
        # more than the chunk's own launches
        index, n, staging = transfer.index[first:end], end - first, self._staging[slot]
        for plane, a, b in self._parts:
            staging[:n, a:b].copy_(plane.index_select(0, index).view(n, -1))

    def _scatter(self, transfer: _Transfer, slot: int, first: int, end: int) -> None:
        index, n, staging = transfer.index[first:end], end - first, self._staging[slot]
        for plane, a, b in self._parts:
            plane.index_copy_(0, index, staging[:n, a:b].view(n, *plane.shape[1:]))

    def _host_copies(self, slot: int, host_ids: list[int], store: bool) -> None:
        """Between the staging slot and the host tier, a copy per run of consecutive host ids."""
        staging = self._staging[slot]
        for pos, first_id, length in _runs(host_ids):
            host = self._host_words[first_id:first_id + length]
            if store:
                host.copy_(staging[pos:pos + length], non_blocking=True)
            else:
                staging[pos:pos + length].copy_(host, non_blocking=True)


def staging_blocks(max_blocks_per_chunk: int = STAGING_BLOCKS,
                   chunks_in_flight: int = CHUNKS_IN_FLIGHT, copy_mode: str | None = None) -> int:
    """Blocks of device memory KVTransfers stages chunks in: a chunk's, split one chunk's for
    each chunk in flight, direct none (copy_mode: ECHO_KV_COPY_MODE's when not given)."""
    copy_mode = envs.kv_copy_mode() if copy_mode is None else copy_mode
    if copy_mode == "direct":
        return 0
    return max_blocks_per_chunk * (chunks_in_flight if copy_mode == "split" else 1)


def direct_geometry(parts: list[tuple[torch.Tensor, int, int]]
                     ) -> list[tuple[int, int, int, int, int, int]]:
    """Per cache tensor (KVTransfers._parts: its [num_blocks, 2 * num_layers, words] view and
    word range in a host block), in bytes: its address, block stride, segment pitch, segment
    width, segments, and its offset in a host block."""
    geometry = []
    for plane, first_word, _ in parts:
        word = plane.element_size()
        if plane.stride(2) != 1:
            raise ValueError(f"a KV cache tensor's segments must be contiguous, got strides "
                             f"{plane.stride()}")
        geometry.append((plane.data_ptr(), plane.stride(0) * word, plane.stride(1) * word,
                         plane.shape[2] * word, plane.shape[1], first_word * word))
    return geometry
