"""Memory pool, programs and device shared by the GPU backends that drive the hardware
through a CUDA-style driver API: CUDA (cuda-bindings) and HIP (hip-python), whose calls
match one to one. Each backend supplies a *driver*: an object bound to one device, its
context and its one stream, with these methods (addresses are Python ints):

    make_current()                       make the device's context current on this thread
    alloc(nbytes) -> ptr                 device memory; raises DeviceOutOfMemory when full
    free(ptr)                            mem_info() -> (free bytes, total bytes)
    host_alloc(nbytes) -> ptr            pinned host memory;  host_free(ptr)
    copy_to_device(dst, src, nbytes)     async on the stream (src: a pinned address)
    copy_to_host(dst, src, nbytes)       async on the stream (dst: a pinned address)
    copy_device(dst, src, nbytes)        device to device, async on the stream
    event_create() / event_record(ev) / event_sync(ev) / event_destroy(ev) / stream_sync()
    event_query(ev) -> bool              True once the work recorded before `ev` has run
    wait_guards                          callables run before the host blocks on the stream
                                         (stream_sync, event_sync): zyx.distributed's NCCL
                                         watchdog, which must see a hung collective first
    module_load(image: bytes) -> module  function(module, name) -> fn   module_unload(module)
    launch(fn, groups, local_size, params_address)   1-D launch on the stream
    prepared_launch(fn, groups, local_size, params_address) -> call   (optional) a
                                         no-argument callable making that launch
    allow_shared(fn, nbytes) -> nbytes   (CUDA) let `fn` have `nbytes` of dynamic shared
                                         memory; launch and prepared_launch then get
                                         shared=nbytes (only for Launch.shared > 0)
    encode_tensor_map(out, spec, ptr)    (CUDA) write the tma.TensorMap `spec` for the
                                         buffer at `ptr` into the 128 bytes at `out`
                                         (only for launches with Launch.maps)

and the device subclass supplies `_make_info()`; its compiler (rtc.RuntimeCompiler) turns
sources into binaries through the disk cache. Everything here runs on that single in-order stream, so a kernel
launched after a copy sees the copy, and a buffer freed after the kernels reading it were
enqueued can be handed out again at once: no events between our own operations.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import time
from functools import partial

import numpy as np

from ..errors import AllocationError, BackendError
from . import Buffer, MemoryPool, ProgramCache, device_ids, run_in_pieces, switch
from .blocks import FreeBlocks, configured_limit, default_limit
from ..codegen.gpu.dispatch import lower, own_tiles, product_parts, schedule_candidates
from ..codegen.gpu.nvidia.tma import MAP_BYTES

# Host<->device copies go through two pinned staging slots (a page-locked copy runs at
# the bus's speed, a pageable one is staged by the driver anyway, synchronously). Copies
# larger than a slot are split into chunks, alternating slots so that filling or draining
# one overlaps the DMA of the other.
STAGING_MAX = 16 << 20
STAGING_MIN = 64 << 10


class DeviceOutOfMemory(BackendError):
    """Raised by a driver's alloc when the device has no room for the block."""


class ResultTupleDriver:
    """What the drivers over cuda-bindings and hip-python share: their calls all return
    (result code, values...), and the memory, copy, event and module calls below take the
    same arguments in both APIs. A subclass sets `label` ("CUDA"), `SUCCESS` and `OOM`
    (its success and out-of-memory codes), `ordinal`, `stream`, `_error_name` (the
    binding's cuGetErrorName-like call), `api` (the binding module), `PREFIX` ("cu",
    "hip") and in `CALLS` the names of the calls the two APIs name differently; the others
    are PREFIX + their name in `SAME_NAMES`."""
    SAME_NAMES = {"mem_info": "MemGetInfo", "copy_to_device": "MemcpyHtoDAsync",
                  "copy_to_host": "MemcpyDtoHAsync", "copy_device": "MemcpyDtoDAsync",
                  "event_record": "EventRecord",
                  "event_sync": "EventSynchronize", "event_destroy": "EventDestroy",
                  "stream_sync": "StreamSynchronize", "function": "ModuleGetFunction",
                  "module_unload": "ModuleUnload", "event_query": "EventQuery",
                  "stream_wait_event": "StreamWaitEvent"}
    PREFIX = ""
    CALLS = {}       # "alloc", "free", "host_free"
    NOT_READY = 600  # CUDA_ERROR_NOT_READY and hipErrorNotReady: an event still pending
    wait_guards = ()  # replaced (never mutated) by add_wait_guard / remove_wait_guard

    def _name(self, what):
        return self.CALLS.get(what) or self.PREFIX + self.SAME_NAMES[what]

    def _call(self, what, *args):
        """The API's call for `what` with `args`, its result checked."""
        name = self._name(what)
        return self.check(getattr(self.api, name)(*args), name)

    def mem_info(self):
        return self._call("mem_info")

    def alloc(self, nbytes):
        name = self._name("alloc")
        err, ptr = getattr(self.api, name)(nbytes)
        if err is self.OOM:
            raise DeviceOutOfMemory(self.error_name(err))
        self.check((err,), f"{name}({nbytes})")
        return int(ptr)

    def free(self, ptr):
        self._call("free", ptr)

    def host_free(self, ptr):
        self._call("host_free", ptr)

    def copy_to_device(self, dst, src, nbytes):
        self._call("copy_to_device", dst, src, nbytes, self.stream)

    def copy_to_host(self, dst, src, nbytes):
        self._call("copy_to_host", dst, src, nbytes, self.stream)

    def copy_device(self, dst, src, nbytes):
        self._call("copy_device", dst, src, nbytes, self.stream)

    def event_record(self, ev, stream=None):
        """Record `ev` on this device's stream (or on `stream`, another of its streams)."""
        self._call("event_record", ev, self.stream if stream is None else stream)

    def stream_wait_event(self, ev, stream=None):
        """Make work queued later on this device's stream (or on `stream`) wait until
        `ev` has happened, without the host waiting."""
        self._call("stream_wait_event", self.stream if stream is None else stream, ev, 0)

    def event_sync(self, ev):
        for guard in self.wait_guards:
            guard()
        self._call("event_sync", ev)

    def event_query(self, ev):
        """True once everything enqueued before `ev` was recorded has run (no waiting)."""
        name = self._name("event_query")
        res = getattr(self.api, name)(ev)
        err = res[0] if isinstance(res, tuple) else res
        if err is self.SUCCESS or int(err) == 0:
            return True
        if int(err) == self.NOT_READY:
            return False
        self.check((err,), name)
        return False

    def add_wait_guard(self, guard):
        """Run `guard()` before every host wait on this stream (it may raise)."""
        self.wait_guards = self.wait_guards + (guard,)

    def remove_wait_guard(self, guard):
        self.wait_guards = tuple(g for g in self.wait_guards if g != guard)  # bound methods: ==

    def event_destroy(self, ev):
        self._call("event_destroy", ev)

    def stream_sync(self):
        for guard in self.wait_guards:
            guard()
        self._call("stream_sync", self.stream)

    def function(self, module, name):
        fn = self._name("function")
        return self.check(getattr(self.api, fn)(module, name.encode()), f"{fn}({name})")

    def module_unload(self, module):
        self._call("module_unload", module)

    def check(self, result, what):
        """The value(s) of a (result, values...) tuple; BackendError naming the call and
        the error otherwise."""
        err = result[0]
        if err is not self.SUCCESS and int(err) != 0:
            raise BackendError(f"{self.label}: {what} failed on device {self.ordinal}: "
                               f"{self.error_name(err)}")
        return result[1] if len(result) == 2 else result[1:]

    @property
    def stream_handle(self):
        """The stream as the integer DLPack exchanges (cudaStream_t / hipStream_t)."""
        return int(self.stream)

    def error_name(self, err):
        try:
            res = self._error_name(err)
            if isinstance(res, tuple):       # cuda-bindings: (CUresult, name)
                res = res[1] if int(res[0]) == 0 else str(err)
            return res.decode() if isinstance(res, bytes) else str(res)
        except Exception:     # naming an error must never hide it
            return str(err)


_CURRENT = threading.local()   # the driver whose context zyx last made current, per thread


def ensure_current(driver):
    """Make `driver`'s context current unless zyx already did on this thread (a new thread
    has no current context; several devices take turns). One attribute read when nothing
    changed, instead of a driver call on every operation."""
    if getattr(_CURRENT, "driver", None) is not driver:
        driver.make_current()
        _CURRENT.driver = driver


class _StagingSlot:
    """A pinned host block and the event after the last copy that used it."""
    __slots__ = ("ptr", "nbytes", "event", "pending")

    def __init__(self):
        self.ptr = 0
        self.nbytes = 0
        self.event = None
        self.pending = False    # a copy reading or writing the block may still run

    def ready(self, driver, nbytes):
        """Wait until no copy uses the block, grow it to hold `nbytes`; its address."""
        if self.pending:
            driver.event_sync(self.event)
            self.pending = False
        if self.nbytes < nbytes:
            if self.ptr:
                driver.host_free(self.ptr)
                self.ptr = 0
            size = STAGING_MIN
            while size < nbytes:
                size *= 2
            self.ptr = driver.host_alloc(size)
            self.nbytes = size
        if self.event is None:
            self.event = driver.event_create()
        return self.ptr

    def mark_used(self, driver):
        driver.event_record(self.event)
        self.pending = True

    def close(self, driver):
        if self.pending:
            driver.event_sync(self.event)
        if self.ptr:
            driver.host_free(self.ptr)
        if self.event is not None:
            driver.event_destroy(self.event)
        self.ptr, self.nbytes, self.event, self.pending = 0, 0, None, False


class _UploadRing:
    """Pinned memory for small host->device copies (a batch of inputs, a scalar the
    optimizer rewrites every step). Copies take consecutive pieces of a ring cut into
    segments; an event is recorded on the stream when the ring moves past a segment, and
    a segment is reused only after that event (a lap later), so a training loop's
    uploads never wait for the device the way one reused staging block would (that wait
    is a host synchronization with the previous step's kernels)."""
    SIZE = 16 << 20
    SEGMENTS = 8
    MAX_PIECE = 1 << 20        # larger copies use the staging slots
    ALIGN = 256

    def __init__(self):
        self.base = 0
        self.seg = self.SIZE // self.SEGMENTS
        self.current = 0           # segment in use
        self.off = 0               # next free byte inside it
        self.events = [None] * self.SEGMENTS
        self.pending = [False] * self.SEGMENTS

    def take(self, driver, nbytes):
        """Address of `nbytes` of pinned memory no enqueued copy still reads."""
        if not self.base:
            self.base = driver.host_alloc(self.SIZE)
        size = -(-nbytes // self.ALIGN) * self.ALIGN
        if self.off + size > self.seg:
            self._leave(driver)
        ptr = self.base + self.current * self.seg + self.off
        self.off += size
        return ptr

    def _leave(self, driver):
        c = self.current
        if self.events[c] is None:
            self.events[c] = driver.event_create()
        driver.event_record(self.events[c])      # after every copy out of segment c
        self.pending[c] = True
        self.current = nxt = (c + 1) % self.SEGMENTS
        if self.pending[nxt]:                    # its copies were enqueued a lap ago
            driver.event_sync(self.events[nxt])
            self.pending[nxt] = False
        self.off = 0

    def close(self, driver):
        for i, ev in enumerate(self.events):
            if ev is not None:
                if self.pending[i]:
                    driver.event_sync(ev)
                driver.event_destroy(ev)
        if self.base:
            driver.host_free(self.base)
        self.base = 0
        self.events = [None] * self.SEGMENTS
        self.pending = [False] * self.SEGMENTS


class DriverMemoryPool(MemoryPool):
    """Device memory with a caching allocator: freed blocks are kept by size and handed out
    again (blocks.FreeBlocks: at most `cache_limit` bytes, default a tenth of the device,
    config `cache_limit_mb`). When the device is full the kept blocks are released and the
    allocation retried. `used_bytes` counts live buffers only, like the other pools;
    `cached_bytes` the free blocks kept (torch's memory_reserved is their sum)."""

    def __init__(self, driver, name, cache_limit=None):
        _, total = driver.mem_info()
        super().__init__(total)
        self.name = name
        self.driver = driver
        self._blocks = FreeBlocks(default_limit(total, cache_limit))
        self._slots = (_StagingSlot(), _StagingSlot())
        self._ring = _UploadRing()
        # copies from several threads (one reads a result while another uploads a batch)
        # share the staging memory: one copy at a time
        self._copy_lock = threading.Lock()
        self._next_slot = 0
        self._driver_free = None   # (cuMemGetInfo's free bytes, when asked)

    @property
    def cache_limit(self):
        return self._blocks.limit

    @property
    def cached_bytes(self):
        return self._blocks.cached_bytes

    @property
    def free_bytes(self):
        """The driver's free memory plus the cached blocks. Runtime.device() reads this on
        every realization when several devices exist, so the driver is asked again only
        after this pool allocated or released device memory, or a second later (other
        processes allocate too)."""
        now = time.monotonic()
        seen = self._driver_free
        if seen is None or now - seen[1] > 1.0:
            ensure_current(self.driver)
            seen = self._driver_free = (self.driver.mem_info()[0], now)
        return seen[0] + self.cached_bytes

    def allocate(self, nbytes):
        ptr = self._blocks.take(nbytes)
        if ptr is None:
            ptr = self.raw_alloc(nbytes)
        self.used_bytes += nbytes
        return Buffer(self, ptr, nbytes, ptr), None

    def raw_alloc(self, nbytes):
        """A new device block (not counted in used_bytes: scratch buffers use it too);
        releases the cached blocks and retries once when the device is full."""
        ensure_current(self.driver)
        self._driver_free = None
        size = max(nbytes, 1)     # a zero-byte allocation is an error in CUDA
        try:
            return self.driver.alloc(size)
        except DeviceOutOfMemory:
            self.trim()
            try:
                return self.driver.alloc(size)
            except DeviceOutOfMemory as e:
                raise AllocationError(f"{self.name} pool: cannot allocate {nbytes} bytes: "
                                      f"{e}") from None

    def borrow_device(self, owner):
        """A buffer over device memory someone else owns (zyx.from_dlpack): `owner.ptr`,
        `owner.nbytes`; never pooled, never counted; dropping it drops `owner`."""
        return Buffer(self, owner, owner.nbytes, owner.ptr, borrowed=True)

    def deallocate(self, buf, wait_events=()):
        if buf.borrowed:
            # the owner (a DLPack producer) may free the memory once zyx's kernels that
            # read it ran: wait for them, then let go
            ensure_current(self.driver)
            self.driver.stream_sync()
            buf.handle = None
            buf.ptr = 0
            return
        # the stream is in order: kernels enqueued later that reuse this block run after
        # the ones still reading it
        self.used_bytes -= buf.nbytes
        over = self._blocks.put(buf.handle, buf.nbytes)
        buf.handle = None
        buf.ptr = 0
        if over:
            # down to 3/4 of the bound: a loop freeing past it drains the stream once in
            # a while, not at every free
            self.trim(self.cache_limit * 3 // 4)

    def trim(self, keep=0):
        """Release kept free blocks to the driver, the ones freed longest ago first, until
        at most `keep` bytes stay kept (0: every block; zyx.empty_cache)."""
        if self.cached_bytes <= keep:
            return
        ensure_current(self.driver)
        self.driver.stream_sync()      # a block may still be read by an enqueued kernel
        for ptr in self._blocks.evict(keep):
            self.driver.free(ptr)
        self._driver_free = None

    def _slot(self):
        slot = self._slots[self._next_slot]
        self._next_slot ^= 1
        return slot

    copies_regions = True

    def copy_region(self, src, src_offset, dst, dst_offset, nbytes):
        """A device-to-device copy on the stream (in order after the kernels writing src)."""
        if nbytes:
            ensure_current(self.driver)
            self.driver.copy_device(dst.ptr + dst_offset, src.ptr + src_offset, nbytes)
        return None

    def host_to_pool(self, src, dst, wait_events=()):
        with self._copy_lock:
            return self._host_to_pool(src, dst, wait_events)

    def pool_to_host(self, src, dst, wait_events=()):
        with self._copy_lock:
            self._pool_to_host(src, dst, wait_events)

    def _host_to_pool(self, src, dst, wait_events=()):
        """Copy through pinned staging. Returns None before the last chunk's DMA finishes:
        the caller may drop `src` (it was copied into the slot) and the stream orders the
        kernels after the copy; the slot's event keeps it from being overwritten early."""
        n = dst.nbytes
        if n == 0:
            return None
        drv = self.driver
        ensure_current(drv)
        self.sync_events(wait_events)
        src = np.ascontiguousarray(src)
        base = src.ctypes.data
        if n <= _UploadRing.MAX_PIECE:
            staging = self._ring.take(drv, n)
            ctypes.memmove(staging, base, n)
            drv.copy_to_device(dst.ptr, staging, n)
            return None
        chunk = min(n, STAGING_MAX)
        for off in range(0, n, chunk):
            size = min(chunk, n - off)
            slot = self._slot()
            staging = slot.ready(drv, size)
            ctypes.memmove(staging, base + off, size)
            drv.copy_to_device(dst.ptr + off, staging, size)
            slot.mark_used(drv)
        return None

    def _pool_to_host(self, src, dst, wait_events=()):
        """Blocking copy into `dst` (a C-contiguous array of src.nbytes bytes): each chunk
        goes to a pinned slot on the stream; while the next chunk's DMA runs, the previous
        slot is copied out."""
        n = src.nbytes
        if n == 0:
            return
        drv = self.driver
        if not dst.flags.c_contiguous:       # copy into a contiguous array, then into dst
            tmp = np.empty(dst.shape, dst.dtype)
            self._pool_to_host(src, tmp, wait_events)
            dst[...] = tmp
            return
        ensure_current(drv)
        self.sync_events(wait_events)
        out = dst.ctypes.data
        if n <= STAGING_MAX:
            # one chunk (the usual read-back): wait on the stream, not on an event, which
            # is one driver call fewer; everything enqueued is then done, both slots too
            slot = self._slot()
            staging = slot.ready(drv, n)
            drv.copy_to_host(staging, src.ptr, n)
            drv.stream_sync()
            for s in self._slots:
                s.pending = False
            ctypes.memmove(out, staging, n)
            return
        chunk = STAGING_MAX
        waiting = []          # (slot, offset, size) copied to the slot, not yet to dst
        for off in range(0, n, chunk):
            size = min(chunk, n - off)
            slot = self._slot()
            if waiting and waiting[0][0] is slot:   # both slots busy: drain the older
                self._drain(*waiting.pop(0), out)
            staging = slot.ready(drv, size)
            drv.copy_to_host(staging, src.ptr + off, size)
            slot.mark_used(drv)
            waiting.append((slot, off, size))
        for item in waiting:
            self._drain(*item, out)

    def _drain(self, slot, off, size, out):
        self.driver.event_sync(slot.event)
        slot.pending = False
        ctypes.memmove(out + off, slot.ptr, size)

    def sync_events(self, events):
        for ev in events:
            if ev is not None:
                self.driver.event_sync(ev)

    def release_events(self, events):
        for ev in events:
            if ev is not None:
                self.driver.event_destroy(ev)

    def close(self):
        """Free everything this pool holds (cached blocks, staging); live buffers are the
        caller's."""
        self.trim()
        for slot in self._slots:
            slot.close(self.driver)
        self._ring.close(self.driver)


class _MapParameter:
    """A tensor map parameter of one prepared launch (tma.TensorMap): 128 bytes, 64-byte
    aligned, that the driver encodes for the address of its buffer, again only when the
    buffer moved (the launch copies the parameters, so a later launch may re-encode
    while an earlier one still runs)."""
    __slots__ = ("slot", "spec", "memory", "address", "bound", "encode")

    def __init__(self, slot, spec, encode):
        self.slot = slot            # the launch parameter holding the mapped buffer
        self.spec = spec
        self.memory = np.zeros(MAP_BYTES + 64, np.uint8)
        self.address = (self.memory.ctypes.data + 63) & ~63
        self.bound = None
        self.encode = encode

    def bind(self, buffer_address):
        """Encode the map for the buffer at `buffer_address` (unless it is the last
        one); False, encoding nothing, where a map cannot start there (misaligned)."""
        if buffer_address != self.bound:
            if not self.spec.aligned(buffer_address):
                return False
            self.encode(self.address, self.spec, buffer_address)
            self.bound = buffer_address
        return True


class _PreparedLaunch:
    """One Launch of a loaded program with its parameter block built once: `values` holds
    one device address per kernel parameter and `params` the addresses of those values
    (the `void**` the driver reads), then of the launch's tensor maps (`maps`), so a
    launch only writes the pointer values (and re-encodes a map whose buffer moved)."""
    __slots__ = ("fn", "groups", "local_size", "sources", "values", "params", "address",
                 "call", "maps")

    def __init__(self, fn, launch, driver):
        self.fn = fn
        self.groups = launch.groups
        self.local_size = launch.local_size
        # >= 0: the i-th buffer Device.launch receives; < 0: scratch buffer -1 - j
        self.sources = [i if kind == "arg" else -1 - i for kind, i in launch.args]
        n = max(len(self.sources), 1)
        self.values = np.zeros(n, np.uint64)
        base = self.values.ctypes.data
        self.maps = []
        if launch.maps:
            encode = getattr(driver, "encode_tensor_map", None)
            if encode is None:
                raise BackendError(f"{type(driver).__name__} cannot encode tensor maps")
            self.maps = [_MapParameter(launch.args.index(m.source), m, encode)
                         for m in launch.maps]
        self.params = np.array([base + 8 * j for j in range(n)] +
                               [m.address for m in self.maps], np.uint64)
        self.address = self.params.ctypes.data
        # what enqueues it: everything but the parameter values is fixed, so a driver may
        # convert its arguments once (CUDADriver.prepared_launch) instead of per launch
        prepared = getattr(driver, "prepared_launch", None)
        # (dynamic shared memory is passed only where a kernel asks for it: CUDA's)
        more = {"shared": driver.allow_shared(fn, launch.shared)} if launch.shared else {}
        self.call = (prepared(fn, self.groups, self.local_size, self.address, **more)
                     if prepared is not None else
                     partial(driver.launch, fn, self.groups, self.local_size, self.address,
                             **more))


class _Address:
    """A buffer address standing in for a Buffer where DriverDevice.launch reads `ptr`."""
    __slots__ = ("ptr",)

    def __init__(self, ptr):
        self.ptr = ptr


class DriverPlanLaunches:
    """Every launch of a plan's kernels on one DriverDevice, prepared once
    (DriverDevice.prepare_launches, run by run_launches with the plan's slot table of
    scheduler.layout_memory: slot 0 the arena of temporaries, slots 1.. the leaves and
    the buffers that outlive the run).

    All parameter values sit in one array; each launch's `void**` block points into it
    (then at its own tensor maps), and each launch's driver call is made once. A run
    compares each slot's address with the one the values hold and rewrites only the
    values of the slots that moved (and the tensor maps of their buffers), then makes the
    launches: one call each, or, on a driver with graphs (`driver.graph_api`), from the
    second run on one replay of the plan's graph (graphs.GraphReplay), its nodes rebound
    where a buffer moved. Nothing is allocated per run."""
    GRAPH_MIN_LAUNCHES = 2    # a graph replay costs about one launch

    def __init__(self, device, kernels, nslots):
        self.device = device
        driver = device.driver
        self.kernels = kernels
        self.calls = []           # per launch: the no-argument call making it
        self.blocks = []          # per launch: its uint64 `void**` block (kept alive)
        self.maps = []            # per launch: its own _MapParameters ([] without maps)
        self.node_params = []     # per launch: (fn, groups, local_size, shared, address)
        positions = [[] for _ in range(nslots)]       # (value index, byte offset)
        users = [set() for _ in range(nslots)]        # launches reading each slot
        fixed = []                                    # (value index, scratch address)
        specs = []
        nvalues = 0
        self.kernel_ends = []     # per kernel: the index after its last launch
        for program, slots in kernels:
            scratch = program.scratch
            if scratch is None and program.gpu.scratch:
                scratch = program.scratch = [device.pool.raw_alloc(n)
                                             for n in program.gpu.scratch]
            for pl, launch in zip(program.launches, program.gpu.launches):
                li = len(specs)
                for j, i in enumerate(pl.sources):
                    if i < 0:
                        fixed.append((nvalues + j, scratch[-1 - i]))
                        continue
                    where, x = slots[i]
                    k, off = (0, x) if where == "a" else (x, 0)
                    positions[k].append((nvalues + j, off))
                    users[k].add(li)
                specs.append((pl, launch, nvalues))
                nvalues += max(len(pl.sources), 1)
            self.kernel_ends.append(len(specs))
        self.values = values = np.zeros(max(nvalues, 1), np.uint64)
        for j, ptr in fixed:
            values[j] = ptr
        base = values.ctypes.data
        prepared = getattr(driver, "prepared_launch", None)
        self.mapped = []          # indices of the launches with tensor maps
        for li, (pl, launch, first) in enumerate(specs):
            maps = [_MapParameter(m.slot, m.spec, m.encode) for m in pl.maps]
            n = max(len(pl.sources), 1)
            block = np.array([base + 8 * (first + j) for j in range(n)] +
                             [m.address for m in maps], np.uint64)
            address = block.ctypes.data
            more = {"shared": driver.allow_shared(pl.fn, launch.shared)} \
                if launch.shared else {}
            self.calls.append(
                prepared(pl.fn, pl.groups, pl.local_size, address, **more)
                if prepared is not None else
                partial(driver.launch, pl.fn, pl.groups, pl.local_size, address, **more))
            self.blocks.append(block)
            self.maps.append(maps)
            self.node_params.append((pl.fn, pl.groups, pl.local_size, launch.shared,
                                     address))
            if maps:
                self.mapped.append(li)
                for m in maps:        # a map of a scratch buffer: bound for good now
                    if pl.sources[m.slot] < 0:
                        m.bind(int(values[first + m.slot]))
        self.first = [first for _, _, first in specs]
        self.positions = positions
        self.launches_of_slot = [sorted(u) for u in users]
        self.bound = [-1] * nslots    # the address each slot's values hold (-1: none yet)
        self.runs = 0
        self.graph = None
        self.pieces = {}          # (first, end) launch range -> its GraphReplay (stops)
        api = getattr(driver, "graph_api", None)
        if api is not None and len(self.calls) >= self.GRAPH_MIN_LAUNCHES:
            self.graph = self._replay_of(0, len(self.calls))

    def _replay_of(self, first, end):
        """A GraphReplay of launches first..end-1 (the whole plan, or a piece of it
        between two stops)."""
        from .graphs import GraphReplay
        api = self.device.driver.graph_api
        return GraphReplay(api, [api.node_params(*p) for p in self.node_params[first:end]],
                           [[i - first for i in li if first <= i < end]
                            for li in self.launches_of_slot], self.device.debug)

    def run(self, table, stops=None):
        """Launch the plan over `table` (Buffers, None for an empty arena). `stops`
        ([(launch index, [fn...])], ascending): call each fn once the launches before
        that index were queued, before the rest are (a collective then starts on another
        stream while the plan's later kernels run); each piece between stops replays as
        a graph of its own."""
        values = self.values
        bound = self.bound
        moved = None
        for k, buf in enumerate(table):
            ptr = 0 if buf is None else buf.ptr
            if ptr != bound[k]:
                bound[k] = ptr
                for j, off in self.positions[k]:
                    values[j] = ptr + off
                if moved is None:
                    moved = [k]
                else:
                    moved.append(k)
        if moved is not None and self.mapped and not self._bind_maps(moved):
            self._run_unmapped(table, stops)
            return
        self.runs += 1
        if stops:
            run_in_pieces(len(self.calls), stops, self._run_piece)
            return
        if self.graph is not None and self.runs > 1:
            try:
                self.graph.replay(tuple(bound))
                return
            except BackendError as e:     # a driver refusing graphs: plain launches
                self._drop_graph(e)
        for call in self.calls:
            call()

    def _run_piece(self, first, end):
        if self.graph is not None and self.runs > 1 and \
                end - first >= self.GRAPH_MIN_LAUNCHES:
            piece = self.pieces.get((first, end))
            if piece is None:
                piece = self.pieces[(first, end)] = self._replay_of(first, end)
            try:
                piece.replay(tuple(self.bound))
                return
            except BackendError as e:
                self._drop_graph(e)
        for call in self.calls[first:end]:
            call()

    def _bind_maps(self, moved):
        """Encode the tensor maps of the buffers in the slots `moved`; False (and every
        slot marked unbound) where one cannot start at its buffer (misaligned)."""
        lis = set()
        for k in moved:
            lis.update(self.launches_of_slot[k])
        values = self.values
        for li in self.mapped:
            if li in lis:
                first = self.first[li]
                for m in self.maps[li]:
                    if not m.bind(int(values[first + m.slot])):
                        self.bound = [-1] * len(self.bound)
                        return False
        return True

    def _run_unmapped(self, table, stops=None):
        """This run kernel by kernel through DriverDevice.launch, which takes the kernels
        lowered without tensor maps where a buffer is misaligned for them."""
        device, pool = self.device, self.device.pool
        kernel_at = {end: k for k, end in enumerate(self.kernel_ends)}
        after = {kernel_at[end]: fns for end, fns in stops or ()}   # fns due after kernel k
        for k, (program, slots) in enumerate(self.kernels):
            args = []
            for where, x in slots:
                buf = table[0 if where == "a" else x]
                args.append(_Address((0 if buf is None else buf.ptr) +
                                     (x if where == "a" else 0)))
            device.launch(program, pool, args)
            for fn in after.get(k, ()):
                fn()

    def _drop_graph(self, error):
        if self.device.debug & 64:
            print(f"zyx: graph replay off for this plan ({error})", file=sys.stderr)
        graph, self.graph = self.graph, None
        graph.close()
        self._close_pieces()

    def _close_pieces(self):
        pieces, self.pieces = self.pieces, {}
        for piece in pieces.values():
            piece.close()

    def close(self):
        """Destroy the plan's graphs (the plan is dropped)."""
        if self.graph is not None:
            self.graph.close()
            self.graph = None
        self._close_pieces()

    def __del__(self):
        try:
            self.close()
        except Exception:     # at interpreter exit the driver may be gone already
            pass


class DriverProgram:
    """A lowered kernel loaded on one device: its module, prepared launches and scratch
    buffers (allocated at the first launch and kept: launches on the in-order stream never
    overlap, so the program's launches can share them from one realization to the next)."""
    __slots__ = ("kernel", "gpu", "module", "launches", "scratch", "unmapped", "__weakref__")

    def __init__(self, kernel, gpu, module, launches):
        self.kernel = kernel
        self.gpu = gpu
        self.module = module
        self.launches = launches
        self.scratch = None
        # the kernel lowered without tensor maps, for buffers a map cannot start at
        # (made at the first such launch)
        self.unmapped = None

    @property
    def source(self):
        return self.gpu.source


class DriverDevice(ProgramCache):
    """A GPU device behind a driver: lowers kernels with `dialect`, compiles them to a
    binary with `compiler` (an rtc.RuntimeCompiler: memory and disk cached), loads one
    module per distinct source and enqueues every launch of a program in order on the
    stream."""
    backend = "gpu"
    plan_launches = True       # prepare_launches on (open_devices reads the switch)
    # a plan's temporaries share one arena (scheduler.layout_memory): each starts where a
    # block of its own would (cuMemAlloc's alignment), so vector loads and tensor maps
    # see the alignment they saw before
    arena_align = 256

    def __init__(self, driver, pool, dialect, compiler, debug=0):
        self.driver = driver
        self.pool = pool
        self.dialect = dialect
        self.compiler = compiler
        self.debug = debug
        self._programs = {}        # zyx kernel -> DriverProgram
        self._modules = {}         # source -> [module, programs using it]
        self.schedules = {}        # zyx kernel -> lowering schedule the autotuner chose
        self._info = self._make_info()
        self._info.own_tiles = own_tiles(self._info)
        self._info.product_parts = product_parts(self._info)

    def info(self):
        return self._info

    @property
    def compiled(self):
        """Compiler runs in this process (zyx.stats()["compiler_runs"] sums them)."""
        return self.compiler.compiled

    @property
    def identity(self):
        """What a tuned schedule depends on besides the kernel (autotune's cache key)."""
        c = self.compiler
        return f"{self.backend}|{self._info.name}|{c.version}|{c.target}"

    def schedule_candidates(self, kernel):
        """Lowering schedules the autotuner may time for `kernel` (gpu.schedule_candidates)."""
        return schedule_candidates(kernel, self._info)

    def render(self, kernel, name="zyx_k", schedule=None):
        """The lowered kernel (gpu.GPUKernel): source and launches, with `schedule` or the
        one the autotuner chose for it."""
        if schedule is None:
            schedule = self.schedules.get(kernel)
        return lower(kernel, self.dialect, self._info, name, schedule)

    def compile_many(self, kernels):
        """`compile` of each of `kernels`, the sources not compiled yet compiled in parallel
        first (RuntimeCompiler.binaries)."""
        todo = [k for k in dict.fromkeys(kernels) if k not in self._programs]
        if len(todo) > 1:
            lowered = [self.render(k) for k in todo]
            self.compiler.binaries([g.source for g in lowered
                                    if g.source not in self._modules])
            for k, g in zip(todo, lowered):
                self._programs[k] = self.compile_variant(k, None, g)
        return [self.compile(k) for k in kernels]

    def compile_variant(self, kernel, schedule, gpu=None):
        """A program of `kernel` lowered with `schedule` (None: the chosen or default one),
        not kept for later plans: the autotuner times these and releases them. `gpu`: the
        kernel already lowered so (compile_many)."""
        # (render overridden with the older (kernel, name) signature still works)
        if gpu is None:
            gpu = self.render(kernel) if schedule is None else \
                self.render(kernel, schedule=schedule)
        src = gpu.source
        ensure_current(self.driver)
        entry = self._modules.get(src)
        if entry is None:
            if self.debug & 8:
                print(f"zyx: {self.backend} source\n{src}", file=sys.stderr)
            module = self.driver.module_load(self.compiler.binary(src))
            entry = self._modules[src] = [module, 0]
        entry[1] += 1
        fns = {}
        launches = []
        for launch in gpu.launches:
            fn = fns.get(launch.entry)
            if fn is None:
                fn = fns[launch.entry] = self.driver.function(entry[0], launch.entry)
            launches.append(_PreparedLaunch(fn, launch, self.driver))
        return DriverProgram(kernel, gpu, entry[0], launches)

    def launch(self, program, pool, args, wait_events=()):
        ensure_current(self.driver)
        if wait_events:
            pool.sync_events(wait_events)
        scratch = program.scratch
        if scratch is None and program.gpu.scratch:
            scratch = program.scratch = [pool.raw_alloc(n) for n in program.gpu.scratch]
        for pl in program.launches:
            values = pl.values
            j = 0
            for i in pl.sources:
                values[j] = args[i].ptr if i >= 0 else scratch[-1 - i]
                j += 1
            if pl.maps and not all([m.bind(int(values[m.slot])) for m in pl.maps]):
                # (a program with maps runs nothing before their launch but a copy into
                # its own scratch (kcopy.py): starting over runs nothing twice that
                # the user sees)
                return self.launch(self._unmapped(program), pool, args)
            pl.call()
        return None     # one in-order stream: whatever comes next runs after

    def _unmapped(self, program):
        """`program`'s kernel lowered with its schedule but no tensor maps (tma.py: a
        buffer misaligned for them, such as a DLPack tensor's view)."""
        if program.unmapped is None:
            schedule = dict(self.schedules.get(program.kernel) or {})
            schedule["gemm_knobs"] = dict(schedule.get("gemm_knobs") or {}, tma=0)
            program.unmapped = self.compile_variant(program.kernel, schedule)
        return program.unmapped

    def make_current(self):
        """Make this device's context current on this thread, whatever is current now
        (another library may have changed it): a DLPack producer such as PyTorch checks
        the current device against its tensor's."""
        self.driver.make_current()
        _CURRENT.driver = self.driver

    def prepare_launches(self, kernels, nslots):
        """The plan-level launch record of `kernels` ([(program, slots)], scheduler's
        prepare_launches): a DriverPlanLaunches; None where switched off
        (`plan_launches`: config key, ZYX_PLAN_LAUNCHES=0)."""
        if not self.plan_launches:
            return None
        ensure_current(self.driver)
        return DriverPlanLaunches(self, kernels, nslots)

    def run_launches(self, launcher, table, stops=None):
        """Run a DriverPlanLaunches over the plan's slot table (Buffers); `stops`: see
        DriverPlanLaunches.run."""
        ensure_current(self.driver)
        launcher.run(table, stops)

    def synchronize(self):
        """Wait until everything queued on this device's stream has run."""
        ensure_current(self.driver)
        self.driver.stream_sync()

    @property
    def dlpack_stream(self):
        """The stream a DLPack producer must order its work before (zyx.from_dlpack)."""
        return self.driver.stream_handle

    def forget_programs(self):
        """Release every kept program (the lowering's settings changed: the next plans
        compile anew)."""
        for prog in list(self._programs.values()):
            self.release(prog)

    def release(self, program):
        if program.unmapped is not None:
            self.release(program.unmapped)
            program.unmapped = None
        self.forget(program)
        ensure_current(self.driver)
        if program.scratch:
            self.driver.stream_sync()          # the last launch may still use them
            for ptr in program.scratch:
                self.driver.free(ptr)
            program.scratch = None
        entry = self._modules.get(program.gpu.source)
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                self.driver.stream_sync()
                self.driver.module_unload(entry[0])
                del self._modules[program.gpu.source]


def open_devices(cfg, count, label, make_driver, pool_class, device_class, debug=0):
    """(pools, devices) of the `count` devices the config's `device_ids` selects, each a
    `device_class(driver, pool, debug)` over `make_driver(ordinal)` and its
    `pool_class(driver, cache_limit)`; BackendError naming `label` when none is selected."""
    pools, devices = [], []
    limit = configured_limit(cfg)
    plan_launches = switch(cfg, "plan_launches", "ZYX_PLAN_LAUNCHES")
    for ordinal in device_ids(cfg, count, label.lower()):
        driver = make_driver(ordinal)
        ensure_current(driver)
        pool = pool_class(driver, limit)
        pools.append(pool)
        device = device_class(driver, pool, debug)
        device.plan_launches = plan_launches
        devices.append(device)
    if not devices:
        raise BackendError(f"{label}: no device selected ({count} found, "
                           f"device_ids={cfg.get('device_ids')!r})")
    return pools, devices
