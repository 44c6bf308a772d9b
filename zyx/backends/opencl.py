"""OpenCL backend (through pyopencl): one OpenCL C kernel per zyx kernel, rendered by the
shared C-family renderer with `OpenCLDialect` and lowered to work-groups by `gpu.lower`.

One device per OpenCL device found, each with its own context, in-order queue and pool.
Config (`"opencl"` section of config.json): platform_ids (list of platform numbers to
use, default all), enabled (default true), cache_limit_mb (the freed buffers a device's
pool keeps for reuse, default a tenth of its memory), plan_launches (every plan's kernels
get their own cl.Kernel objects with their arguments set once, `PlanLaunches`; default on,
off on NVIDIA's platform: `plan_launches_default`; ZYX_PLAN_LAUNCHES=0/1 decides). A CPU
OpenCL device (PoCL) ranks below the C backend, so it is the default device only when
ZYX_DEVICE=opencl or the config's "default_device": "opencl" asks for it.
"""
from __future__ import annotations

import shutil
import sys
import time

import numpy as np

from .. import dtype as dt
from .._core import kernel as K
from ..errors import AllocationError, BackendError, DTypeError
from ..codegen.target import DeviceInfo
from . import Buffer, MemoryPool, ProgramCache, run_in_pieces, switch
from .binary_cache import BinaryCache, cache_key
from .blocks import FreeBlocks, configured_limit, default_limit
from ..codegen.cstyle import OpenCLDialect
from ..codegen.gpu.dispatch import (GPU_SUM_BLOCK, WORK_GROUP, lower, own_tiles,
                                    product_parts, register_tiles, schedule_candidates,
                                    tile_min_outputs)

# Below the C backend's estimate (2e10 FLOP/s per core) for any core count: the C backend
# computes on the same CPU faster than PoCL's generic code, so it must stay the default.
CPU_COMPUTE = 1e9
# -w: the shared renderer writes constant operands on purpose (`x || 0` in a NaN-aware
# max); clang's warnings about them are noise
BUILD_OPTIONS = ["-w"]
UNBOUND = object()   # a PlanLaunches slot whose kernel arguments were never set


class OpenCLMemoryPool(MemoryPool):
    """Device buffers (cl.Buffer). Freed buffers are kept by size and handed out again, as
    realizations allocate the same sizes every step; they are released when the device
    runs out of memory."""
    name = "opencl"

    def __init__(self, cl, ctx, queue, total_bytes, cache_limit=None):
        super().__init__(total_bytes)
        self.cl = cl
        self.ctx = ctx
        self.queue = queue
        self._blocks = FreeBlocks(default_limit(total_bytes, cache_limit))  # freed buffers
        self._uploads = []  # events of queued host->device copies (each holds its array)

    def allocate(self, nbytes):
        if nbytes > self.free_bytes:
            raise AllocationError(f"opencl pool: {nbytes} bytes requested, "
                                  f"{self.free_bytes} free")
        handle = self._blocks.take(nbytes)
        if handle is None:
            handle = self._new_buffer(nbytes)
        self.used_bytes += nbytes
        return Buffer(self, handle, nbytes), None

    def _new_buffer(self, nbytes):
        cl = self.cl
        size = max(nbytes, 1)     # OpenCL refuses zero-sized buffers
        try:
            return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size)
        except (cl.MemoryError, cl.RuntimeError):
            self.trim()           # the cached buffers may be what fills the device
            try:
                return cl.Buffer(self.ctx, cl.mem_flags.READ_WRITE, size)
            except (cl.MemoryError, cl.RuntimeError) as e:
                raise AllocationError(f"opencl pool: cannot allocate {nbytes} bytes: {e}") \
                    from None

    def deallocate(self, buf, wait_events=()):
        # the queue is in order: later kernels reusing this buffer run after the ones
        # still reading it, so it can go back to the free list at once
        self.used_bytes -= buf.nbytes
        if self._blocks.put(buf.handle, buf.nbytes):
            self.trim(self._blocks.limit * 3 // 4)
        buf.handle = None

    def _forget_finished_uploads(self):
        done = self.cl.command_execution_status.COMPLETE
        self._uploads = [ev for ev in self._uploads
                         if ev.command_execution_status != done]

    @property
    def cached_bytes(self):
        """Bytes of the freed buffers kept for reuse."""
        return self._blocks.cached_bytes

    def trim(self, keep=0):
        """Release kept free buffers, the ones freed longest ago first, until at most
        `keep` bytes stay kept (0: all; zyx.empty_cache). OpenCL frees a buffer's memory
        once the commands using it have run."""
        for b in self._blocks.evict(keep):
            b.release()

    def host_to_pool(self, src, dst, wait_events=()):
        """Queue the copy and return: a blocking write on the in-order queue would wait for
        every kernel queued before it (a host synchronization per uploaded batch). The
        data is first copied into an array of our own, so the caller may change or drop
        `src` at once; pyopencl's event for a non-blocking copy holds that array until the
        copy ran, and we hold the events until they complete."""
        if dst.nbytes == 0:
            return None
        own = np.array(src, copy=True, order="C")
        ev = self.cl.enqueue_copy(self.queue, dst.handle, own,
                                  wait_for=list(wait_events) or None, is_blocking=False)
        self._uploads.append(ev)
        if len(self._uploads) > 64:
            self._forget_finished_uploads()
        return None      # the queue is in order: kernels after it see the data

    copies_regions = True

    def copy_region(self, src, src_offset, dst, dst_offset, nbytes):
        """clEnqueueCopyBuffer on the in-order queue: after the kernels writing src."""
        if nbytes:
            self.cl.enqueue_copy(self.queue, dst.handle, src.handle, byte_count=nbytes,
                                 src_offset=src_offset, dst_offset=dst_offset)
        return None

    def pool_to_host(self, src, dst, wait_events=()):
        if src.nbytes == 0:
            return
        self.cl.enqueue_copy(self.queue, dst.reshape(-1).view(np.uint8), src.handle,
                             wait_for=list(wait_events) or None, is_blocking=True)
        self._uploads.clear()     # in order: every copy queued before has run

    def sync_events(self, events):
        events = [e for e in events if e is not None]
        if events:
            self.cl.wait_for_events(events)


class OpenCLProgram:
    """A lowered kernel built for one device: its cl.Kernel per launch and the scratch
    buffers its launches share (allocated on first use, kept with the program: launches
    on the in-order queue never overlap)."""
    __slots__ = ("kernel", "gpu", "built", "fns", "scratch", "__weakref__")

    def __init__(self, cl, kernel, gpu, built):
        self.kernel = kernel
        self.gpu = gpu
        self.built = built       # the cl.Program (PlanLaunches makes kernels of its own)
        # one cl.Kernel per launch (a kernel object holds its arguments; a program built
        # once may serve several zyx kernels with the same source)
        self.fns = [cl.Kernel(built, launch.entry) for launch in gpu.launches]
        self.scratch = None

    @property
    def source(self):
        return self.gpu.source


class PlanLaunches:
    """Every launch of a plan's kernels on one OpenCL device, prepared once
    (OpenCLDevice.prepare_launches) and run over the plan's slot table of
    scheduler.layout_memory (slot 0: the arena of temporaries, 1..: the leaves and the
    buffers that outlive the run).

    A cl.Kernel holds its arguments, so the plan gets cl.Kernel objects of its own (the
    programs' are shared with every other plan running the same kernel): the scratch
    arguments are set once, a slot's arguments only when its buffer changed since the
    last run, the arena's temporaries as sub-buffers made again only when the arena is
    another buffer. A run is then one enqueue per launch."""

    def __init__(self, device, kernels, nslots):
        cl = device.cl
        self.cl = cl
        self.queue = device.pool.queue
        self.launches = []        # (cl.Kernel, global size, local size)
        self.kernel_ends = []     # per kernel: the index after its last launch
        self.users = [[] for _ in range(nslots)]     # per slot: (cl.Kernel, arg, offset)
        for program, slots in kernels:
            if program.gpu.scratch and program.scratch is None:
                program.scratch = [device.pool._new_buffer(n) for n in program.gpu.scratch]
            for launch in program.gpu.launches:
                kern = cl.Kernel(program.built, launch.entry)
                for j, (kind, i) in enumerate(launch.args):
                    if kind != "arg":
                        kern.set_arg(j, program.scratch[i])
                        continue
                    where, x = slots[i]
                    if where == "a":
                        self.users[0].append((kern, j, x))
                    else:
                        self.users[x].append((kern, j, 0))
                self.launches.append((kern, (launch.global_size,), (launch.local_size,)))
            self.kernel_ends.append(len(self.launches))
        # the handle each slot's arguments hold; UNBOUND until the first run sets them (a
        # slot's handle may be None, an empty tensor's buffer: its arguments are still set,
        # to NULL, or the launch fails with INVALID_KERNEL_ARGS)
        self.bound = [UNBOUND] * nslots
        self.subs = {}                    # arena offset -> sub-buffer of the bound arena

    def run(self, table, stops=None):
        """Enqueue the plan over `table` (Buffers, None for an empty arena). `stops`
        ([(launch index, [fn...])], ascending): call each fn once the launches before
        that index were enqueued, before the rest are."""
        bound = self.bound
        for k, buf in enumerate(table):
            handle = None if buf is None else buf.handle
            if handle is not bound[k]:
                bound[k] = handle
                if k == 0 and handle is not None:
                    self.subs = {}
                    for kern, j, off in self.users[0]:
                        kern.set_arg(j, self._sub(buf, off))
                else:
                    for kern, j, _ in self.users[k]:
                        kern.set_arg(j, handle)
        if stops:
            run_in_pieces(len(self.launches), stops, self._enqueue)
        else:
            self._enqueue(0, len(self.launches))

    def _enqueue(self, first, end):
        enqueue, queue = self.cl.enqueue_nd_range_kernel, self.queue
        for kern, global_size, local_size in self.launches[first:end]:
            enqueue(queue, kern, global_size, local_size)

    def _sub(self, arena, offset):
        """The arena's bytes from `offset` on, as a buffer (the offsets are multiples of
        the device's base address alignment: OpenCLDevice.arena_align)."""
        sub = self.subs.get(offset)
        if sub is None:
            sub = arena.handle if offset == 0 else \
                arena.handle.get_sub_region(offset, arena.nbytes - offset)
            self.subs[offset] = sub
        return sub


def _warp_size(cl, d, is_cpu):
    """SIMD width the device schedules work-items in: NVIDIA's warp, AMD's wavefront, 32
    for other GPUs, 1 for CPU devices (PoCL)."""
    for attr in ("warp_size_nv", "wavefront_width_amd"):
        try:
            return int(getattr(d, attr))
        except (AttributeError, cl.Error):
            continue
    return 1 if is_cpu else 32


def _uses_float64(kernel):
    return any(op[0] != K.CONST and op[1] is dt.float64 for op in kernel.ops)


class OpenCLDevice(ProgramCache):
    backend = "opencl"

    def __init__(self, cl, cl_device, pool, debug=0):
        self.cl = cl
        self.dev = cl_device
        self.pool = pool
        self.debug = debug
        self.dialect = OpenCLDialect()
        self.extensions = set(cl_device.extensions.split())
        self.fp64 = "cl_khr_fp64" in self.extensions
        self._by_source = {}     # OpenCL source -> built cl.Program (PoCL builds are slow)
        self.compiled = 0        # programs built from source in this process (zyx.stats)
        # the binary cache key holds what the binary depends on besides the source
        self._fingerprint = "|".join(x.strip() for x in (
            cl_device.platform.name, cl_device.platform.version, cl_device.name,
            cl_device.version, cl_device.driver_version))
        self._disk = BinaryCache("opencl", "bin")
        self._programs = {}      # zyx kernel -> OpenCLProgram
        self.schedules = {}      # zyx kernel -> lowering schedule the autotuner chose
        self.plan_launches = True    # prepare_launches on (initialize reads the switch)
        # sub-buffers (a plan's temporaries in its arena) start at the base alignment
        self.arena_align = max(64, cl_device.mem_base_addr_align // 8)
        self._info = self._make_info()
        self._info.own_tiles = own_tiles(self._info)
        self._info.product_parts = product_parts(self._info)

    def _make_info(self):
        d, cl = self.dev, self.cl
        is_cpu = bool(d.type & cl.device_type.CPU)
        width = max(d.preferred_vector_width_float, 1)
        compute = float(d.max_compute_units * max(d.max_clock_frequency, 1) * 1e6 * width * 2)
        if is_cpu:
            compute = min(compute, CPU_COMPUTE)
        dtypes = tuple(x.name for x in (dt.bool_, dt.uint8, dt.uint16, dt.uint32, dt.uint64,
                                        dt.int8, dt.int16, dt.int32, dt.int64, dt.float16,
                                        dt.bfloat16, dt.float32)) + (("float64",) if self.fp64 else ())
        return DeviceInfo(name=f"OpenCL {d.name.strip()} ({d.platform.name.strip()})",
                          compute=compute,
                          max_local_threads=d.max_work_group_size,
                          max_local_work_dims=tuple(d.max_work_item_sizes),
                          local_mem_size=d.local_mem_size,
                          preferred_vector_size=width * 4,
                          num_cores=d.max_compute_units,
                          warp_size=_warp_size(cl, d, is_cpu),
                          register_tiles=register_tiles(), window_tiles=False,
                          tile_min_outputs=tile_min_outputs(d.max_compute_units),
                          sum_block=GPU_SUM_BLOCK,
                          dtypes=dtypes,
                          extra={"fp16": "cl_khr_fp16" in self.extensions, "fp64": self.fp64,
                                 "cpu": is_cpu})

    def info(self):
        return self._info

    @property
    def identity(self):
        """What a tuned schedule depends on besides the kernel (autotune's cache key)."""
        return f"opencl|{self._fingerprint}"

    def schedule_candidates(self, kernel):
        """Lowering schedules the autotuner may time for `kernel` (gpu.schedule_candidates)."""
        return schedule_candidates(kernel, self._info)

    def render(self, kernel, name="zyx_k", schedule=None):
        """The lowered kernel (gpu.GPUKernel): OpenCL C source and launches, with
        `schedule` or the one the autotuner chose for it."""
        if _uses_float64(kernel) and not self.fp64:
            raise DTypeError(f"float64 is not supported by OpenCL device {self.dev.name.strip()} "
                             f"(no cl_khr_fp64)")
        if schedule is None:
            schedule = self.schedules.get(kernel)
        gpu = lower(kernel, self.dialect, self._info, name, schedule)
        if self.fp64:
            gpu.source = "#pragma OPENCL EXTENSION cl_khr_fp64 : enable\n" + gpu.source
        return gpu

    def compile_variant(self, kernel, schedule):
        """A program of `kernel` lowered with `schedule` (None: the chosen or default one),
        not kept for later plans: the autotuner times these and releases them."""
        # (render overridden with the older (kernel, name) signature still works)
        gpu = self.render(kernel) if schedule is None else self.render(kernel, schedule=schedule)
        src = gpu.source
        built = self._by_source.get(src)
        if built is None:
            if self.debug & 8:
                print(f"zyx: OpenCL source\n{src}", file=sys.stderr)
            built = self._by_source[src] = self._build(src)
        return OpenCLProgram(self.cl, kernel, gpu, built)

    def _build(self, src):
        """The built cl.Program of `src`: from the disk cache (the device's own binary,
        verified like the C backend's libraries) or compiled and stored there."""
        cl, ctx = self.cl, self.pool.ctx
        key = cache_key(src, self._fingerprint, BUILD_OPTIONS)
        binary = self._disk.load(key)
        if binary is not None:
            try:
                return cl.Program(ctx, [self.dev], [binary]).build(options=BUILD_OPTIONS)
            except cl.Error:          # a driver update can refuse an old binary
                self._disk.discard(key)
        t0 = time.perf_counter()
        try:
            built = cl.Program(ctx, src).build(options=BUILD_OPTIONS)
        except cl.Error as e:
            raise BackendError(f"OpenCL build failed on {self.dev.name.strip()}:\n{e}\n"
                               f"--- source ---\n{src}") from None
        self.compiled += 1
        if self.debug & 32:
            print(f"zyx: OpenCL compiled a program for {self.dev.name.strip()} in "
                  f"{(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)
        try:
            binaries = built.get_info(cl.program_info.BINARIES)
            if binaries and binaries[0]:
                self._disk.store(key, bytes(binaries[0]))
        except cl.Error:
            pass                      # a device that cannot return binaries: no disk cache
        return built

    def launch(self, program, pool, args, wait_events=()):
        gpu = program.gpu
        if gpu.scratch and program.scratch is None:
            program.scratch = [pool._new_buffer(n) for n in gpu.scratch]
        wait = list(wait_events) or None
        ev = None
        for fn, launch in zip(program.fns, gpu.launches):
            handles = [args[i].handle if kind == "arg" else program.scratch[i]
                       for kind, i in launch.args]
            # cl.Kernel objects hold their arguments: set and enqueue under one call
            ev = fn(pool.queue, (launch.global_size,), (launch.local_size,), *handles,
                    wait_for=wait)
            wait = None     # the queue is in order: later launches follow the first
        return ev

    def prepare_launches(self, kernels, nslots):
        """The plan-level launch record of `kernels` ([(program, slots)], scheduler's
        prepare_launches): a PlanLaunches; None where switched off (`plan_launches`:
        config key, ZYX_PLAN_LAUNCHES=0)."""
        return PlanLaunches(self, kernels, nslots) if self.plan_launches else None

    def run_launches(self, launcher, table, stops=None):
        """Run a PlanLaunches over the plan's slot table; `stops`: see PlanLaunches.run."""
        launcher.run(table, stops)

    def synchronize(self):
        """Wait until everything queued on this device has run."""
        self.pool.queue.finish()
        self.pool._uploads.clear()

    def release(self, program):
        self.forget(program)
        for b in program.scratch or ():
            b.release()
        program.scratch = None


def plan_launches_default(platform_name):
    """Whether plans run through PlanLaunches when neither ZYX_PLAN_LAUNCHES nor the
    config says: not on NVIDIA's OpenCL. There, releasing the sub-buffers that hold a
    plan's arena temporaries segfaulted inside the driver (clReleaseMemObject, an H200,
    driver of 2026-11: when plans were dropped, and again when the release waited for the
    queue to finish and came before the parent's), while the kernel-by-kernel path, which
    makes no sub-buffers, passed the same tests."""
    return "NVIDIA" not in platform_name.upper()


def _platforms(cl, cfg):
    platforms = cl.get_platforms()
    ids = cfg.get("platform_ids")
    if ids is None:
        return platforms
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        raise BackendError(f"opencl.platform_ids={ids!r} is not a list of integers")
    return [platforms[i] for i in ids if 0 <= i < len(platforms)]


def _check_platform(platform):
    """Raise BackendError for a platform known not to build kernels here. PoCL links each
    kernel with the system `ld` and, when there is none, aborts the whole process
    (SIGABRT) at the first build: that cannot be caught, so it is checked up front."""
    if "Portable Computing Language" in platform.name and shutil.which("ld") is None:
        raise BackendError("OpenCL: PoCL needs a linker (ld) on PATH to build kernels")


_PROBE = "__kernel void zyx_probe(__global float* x) { x[get_global_id(0)] = 1.0f; }"


def _cannot_build(cl, ctx):
    """Why a trivial kernel does not build on the context's device (None when it does).
    Some drivers list a device that cannot compile anything: PoCL's LLVM fails with
    "unknown target CPU 'generic'" on a CPU it does not recognize (a VM hiding its model),
    which would otherwise fail every realization instead of skipping the device."""
    try:
        cl.Program(ctx, _PROBE).build()
    except cl.Error as e:
        lines = [ln.strip() for ln in str(e).splitlines() if "error" in ln.lower()]
        return lines[-1] if lines else str(e).strip().splitlines()[0]
    return None


def initialize(cfg, debug=0):
    import pyopencl as cl    # lazily: a missing driver only skips this backend

    pools, devices, reasons = [], [], []
    limit = configured_limit(cfg)
    for platform in _platforms(cl, cfg):
        try:
            _check_platform(platform)
        except BackendError as e:
            reasons.append(str(e))
            continue
        try:
            found = platform.get_devices()
        except cl.Error:      # a platform with no devices raises instead of returning []
            continue
        for d in found:
            if d.max_work_group_size < WORK_GROUP:
                continue      # launches use groups of WORK_GROUP work-items
            ctx = cl.Context([d])
            problem = _cannot_build(cl, ctx)
            if problem:
                reasons.append(f"OpenCL device {d.name.strip()} ({platform.name.strip()}) "
                               f"cannot build kernels: {problem}")
                if debug & 1:
                    print(f"zyx: skipping {reasons[-1]}", file=sys.stderr)
                continue
            queue = cl.CommandQueue(ctx, d)
            pool = OpenCLMemoryPool(cl, ctx, queue, d.global_mem_size, limit)
            pools.append(pool)
            device = OpenCLDevice(cl, d, pool, debug)
            device.plan_launches = switch(cfg, "plan_launches", "ZYX_PLAN_LAUNCHES",
                                          plan_launches_default(platform.name))
            devices.append(device)
    if not devices:
        raise BackendError("; ".join(reasons) or "OpenCL: no platform has a usable device")
    return pools, devices
