"""WebGPU backend (through wgpu-py, wgpu-native underneath): one WGSL compute shader per
zyx kernel, written by `zyx.codegen.wgsl`.

One device per adapter chosen (config `wgpu.adapter`), each with its own GPUDevice, queue
and pool. What it does to keep wgpu's Python-side cost per dispatch (40-75 us) off the
critical path:

* Pipelines are cached by WGSL source, bind group layouts and pipeline layouts by the
  number of buffers, bind groups by the exact buffers bound (pool buffers are reused, so a
  realization run again binds the same ones): a second identical realization creates no
  GPU object.
* Dispatches are recorded into one pending command encoder and one compute pass (WebGPU
  orders dispatches of a pass: each sees the previous ones' storage writes); the encoder
  is submitted once a plan's dispatches are all recorded (the scheduler's
  `submit_queued`: the GPU runs a realization while Python builds the next graph), when
  the host needs data (a read, `synchronize`), before an upload (a queue write runs
  before the commands of the next submit, so pending dispatches that still read the
  buffer's old contents are submitted first) and after MAX_PENDING dispatches.
* Reads copy into persistent MAP_READ staging buffers (grown to the largest read, kept)
  instead of wgpu-py's `queue.read_buffer`, which creates and waits on a new buffer every
  call.

Limits come from the adapter and are requested when the device is created (WebGPU's
defaults are far below what GPUs offer): the storage binding and buffer sizes, storage
buffers per shader stage (a kernel with more buffers is refused at compile time, when the
plan is built), workgroup sizes and the workgroups per dispatch dimension (the writer
folds larger grids into 2-D).

Dtypes: no float64, int64 or uint64 (core WGSL has neither); kernels using them are refused
with UnsupportedDTypeError naming the device. bool, 8- and 16-bit integers, float16 and
bfloat16 are packed in u32 words by the writer. The device says fp64 = False, so the
runtime computes its float helpers in float32.

Config (`"wgpu"` section of config.json): enabled (default true), adapter ("high-performance"
(default) or "low-power": the power preference; "all": every adapter wgpu lists, one zyx
device each), backend (only adapters of that wgpu backend type, e.g. "Vulkan"),
memory_mb (the pool's size: WebGPU does not report the adapter's memory; default the
device-local heap Vulkan reports for the same GPU, else 8192; 2048 for a CPU adapter),
cache_limit_mb (freed buffers kept for reuse, default a tenth of the pool), shader_checks
(the run-time checks naga adds to zyx's shaders, see wgpu_direct.py: "bounds" (default:
index clamping kept, loop counters left out), "none", "loops", "bounds,loops", or
"standard": wgpu's own `create_shader_module`, every check; env ZYX_WGPU_SHADER_CHECKS
overrides it).
"""
from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np

from .. import dtype as dt
from .._core import kernel as K
from ..errors import AllocationError, BackendError, DeviceLimitError, UnsupportedDTypeError
from ..codegen.target import DeviceInfo
from ..codegen.wgsl import gemm as wgsl_gemm
from ..codegen.wgsl import supports, write
from ..codegen.wgsl.writer import BUFFER_DTYPES, strategies, uniform_args
from . import Buffer, MemoryPool, ProgramCache, run_in_pieces, switch
from . import wgpu_direct
from .blocks import FreeBlocks, configured_limit, default_limit
from .vkmemory import device_local_bytes

# A CPU adapter (lavapipe) ranks below the C backend (2e10 FLOP/s per core), as PoCL does
CPU_COMPUTE = 1e9
# WebGPU reports no clock or core count. A GPU adapter ranks below CUDA and OpenCL on the
# same GPU (their estimates come from SMs and clocks: an H100 is 6.7e13 through CUDA,
# 5.2e11 through OpenCL) and above the C backend on up to 16 cores (2e10 each)
GPU_COMPUTE = 4e11
LLVMPIPE_LOOP_CAP = 65535
MAX_PENDING = 64             # dispatches recorded before the encoder is submitted anyway
LIMITS = ("max-storage-buffer-binding-size", "max-buffer-size",
          "max-storage-buffers-per-shader-stage", "max-compute-workgroups-per-dimension",
          "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x",
          "max-compute-workgroup-size-y", "max-compute-workgroup-size-z",
          "max-compute-workgroup-storage-size", "max-bindings-per-bind-group",
          "max-uniform-buffers-per-shader-stage", "max-uniform-buffer-binding-size",
          "min-storage-buffer-offset-alignment", "min-uniform-buffer-offset-alignment")


def _round4(n):
    """Bytes a buffer of n bytes takes: a multiple of 16 (uniform bindings read 16-byte
    vectors; copies need multiples of 4)."""
    return max((n + 15) & ~15, 16)


class WGPUMemoryPool(MemoryPool):
    """Storage buffers of one GPUDevice. Freed buffers are kept by size and handed out again
    (realizations allocate the same sizes every step, and bind groups cached on those
    buffers then match again). Holds the device's pending command encoder, shared by the
    device's dispatches and the pool's copies."""
    name = "wgpu"

    def __init__(self, wgpu, device, max_buffer, total_bytes, cache_limit=None):
        super().__init__(total_bytes)
        self.wgpu = wgpu
        self.device = device
        self.queue = device.queue
        self.max_buffer = max_buffer
        self._blocks = FreeBlocks(default_limit(self.total_bytes, cache_limit))
        # UNIFORM too: small read-only buffers of a kernel over the storage-buffer limit
        # are bound as uniform buffers (uniform_args)
        self.usage = (wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.UNIFORM
                      | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
        self.encoder = None          # pending command encoder
        self.cpass = None            # its open compute pass
        self.pending = 0             # dispatches recorded since the last submit
        self.submits = 0             # queue.submit calls (tests count them)
        self.staging = None          # MAP_READ buffer reused by every read
        self.staging_created = 0
        self.on_trim = None          # the device's hook: forget bind groups of freed buffers
        # the pending encoder is one object: threads reading results while another records
        # dispatches take turns (wgpu-native aborts on an encoder used from two threads)
        self.lock = threading.RLock()

    # -- buffers ----------------------------------------------------------------------------
    def allocate(self, nbytes):
        with self.lock:
            if nbytes > self.free_bytes:
                raise AllocationError(f"wgpu pool: {nbytes} bytes requested, {self.free_bytes} free")
            size = _round4(nbytes)
            if size > self.max_buffer:
                raise AllocationError(f"wgpu pool: {nbytes} bytes exceed the device's largest "
                                      f"buffer ({self.max_buffer} bytes)")
            handle = self._blocks.take(size)
            if handle is None:
                handle = self._new_buffer(size)
            self.used_bytes += nbytes
            return Buffer(self, handle, nbytes), None

    def _new_buffer(self, size):
        try:
            return self.device.create_buffer(size=size, usage=self.usage)
        except Exception:          # noqa: BLE001 - wgpu raises its own error types
            self.trim()
            try:
                return self.device.create_buffer(size=size, usage=self.usage)
            except Exception as e:  # noqa: BLE001
                raise AllocationError(f"wgpu pool: cannot allocate {size} bytes: {e}") from None

    def deallocate(self, buf, wait_events=()):
        with self.lock:
            # commands are submitted in order: later dispatches reusing this buffer run after
            # the ones still reading it
            self.used_bytes -= buf.nbytes
            # (arithmetic inline: this also runs at interpreter exit, globals gone)
            if self._blocks.put(buf.handle, ((buf.nbytes + 15) & ~15) or 16):
                self.trim(self._blocks.limit * 3 // 4)
            buf.handle = None

    @property
    def cached_bytes(self):
        """Bytes of the freed buffers kept for reuse."""
        return self._blocks.cached_bytes

    def trim(self, keep=0):
        """Release kept free buffers until at most `keep` bytes stay kept (0: all). Pending
        commands are submitted first (they may use them); bind groups naming them are
        dropped by the device's hook."""
        with self.lock:
            dropped = list(self._blocks.evict(keep))
            if dropped:
                self.flush()
                if self.on_trim is not None:
                    self.on_trim(dropped)

        # -- the pending encoder ----------------------------------------------------------------
    def compute_pass(self):
        """The open compute pass of the pending encoder (begun when needed)."""
        if self.cpass is None:
            if self.encoder is None:
                self.encoder = self.device.create_command_encoder()
            self.cpass = self.encoder.begin_compute_pass()
        return self.cpass

    def _end_pass(self):
        if self.cpass is not None:
            self.cpass.end()
            self.cpass = None

    def transfer_encoder(self):
        """The pending encoder with no compute pass open (begun when needed), for copies
        recorded between passes, in queue order with the dispatches around them."""
        self._end_pass()
        if self.encoder is None:
            self.encoder = self.device.create_command_encoder()
        return self.encoder

    def flush(self):
        """Submit the pending encoder, if any (one queue.submit for everything recorded)."""
        with self.lock:
            if self.encoder is None:
                return
            self._end_pass()
            self.queue.submit([self.encoder.finish()])
            self.submits += 1
            self.encoder = None
            self.pending = 0

    def submit_queued(self):
        """Submit the pending encoder (the scheduler's call once a plan's dispatches are
        recorded): the GPU runs them while the host builds the next graph."""
        self.flush()

    def dispatched(self):
        self.pending += 1
        if self.pending >= MAX_PENDING:
            self.flush()

    # -- copies -----------------------------------------------------------------------------
    def host_to_pool(self, src, dst, wait_events=()):
        with self.lock:
            if dst.nbytes == 0:
                return None
            data = np.ascontiguousarray(src).reshape(-1).view(np.uint8)
            if data.nbytes % 4:
                data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
            self.flush()      # pending dispatches may still read dst's old contents
            self.queue.write_buffer(dst.handle, 0, data)
            return None

    copies_regions = True
    region_align = 4     # copy_buffer_to_buffer takes offsets and sizes in whole words

    def copy_region(self, src, src_offset, dst, dst_offset, nbytes):
        """copy_buffer_to_buffer in the pending encoder, between compute passes (queue
        order: after the dispatches writing src)."""
        with self.lock:
            if nbytes:
                self.transfer_encoder().copy_buffer_to_buffer(src.handle, src_offset,
                                                              dst.handle, dst_offset, nbytes)
            return None

    def _staging(self, size):
        if self.staging is None or self.staging.size < size:
            cap = 1 << max(size - 1, 255).bit_length()
            self.staging = self.device.create_buffer(
                size=cap, usage=self.wgpu.BufferUsage.MAP_READ | self.wgpu.BufferUsage.COPY_DST)
            self.staging_created += 1
        return self.staging

    def pool_to_host(self, src, dst, wait_events=()):
        with self.lock:
            if src.nbytes == 0:
                return
            size = _round4(src.nbytes)
            staging = self._staging(size)
            self.transfer_encoder().copy_buffer_to_buffer(src.handle, 0, staging, 0, size)
            self.flush()
            staging.map_sync(self.wgpu.MapMode.READ, 0, size)
            try:
                data = staging.read_mapped(0, size, copy=False)
                dst.reshape(-1).view(np.uint8)[:] = np.frombuffer(data, np.uint8, src.nbytes)
            finally:
                staging.unmap()

    def wait(self):
        """Submit what is pending and wait until the queue has run it: a 4-byte copy into
        the staging buffer, whose mapping completes after every earlier submit."""
        with self.lock:
            staging = self._staging(4)
            self.transfer_encoder().clear_buffer(staging, 0, 4)
            self.flush()
            staging.map_sync(self.wgpu.MapMode.READ, 0, 4)
            staging.unmap()


class WGPUProgram:
    """A kernel's pipelines (one per pass) and what a dispatch needs: the WGSL kernel
    (workgroups, buffers) and the scratch buffer of a split reduction (allocated at the
    first launch, kept with the program: dispatches on the one queue never overlap)."""
    __slots__ = ("kernel", "wgsl", "pipelines", "layout", "scratch", "arena", "__weakref__")

    def __init__(self, kernel, wgsl, pipelines, layout):
        self.kernel = kernel
        self.wgsl = wgsl
        self.pipelines = pipelines
        self.layout = layout
        self.scratch = None
        self.arena = None            # the uniform buffer of its launch values (UniformPlan)

    @property
    def source(self):
        return self.wgsl.source


UNBOUND = object()   # a WGPUPlanLaunches slot no run has bound yet
# naga's run-time checks kept in zyx's shaders (wgpu_direct.py). On an H200 (benches/
# gpu_vk_bandwidth_sweep.py wgpu) the loop counters doubled a 256M sum (0.54 against 0.30
# ms) and slowed softmax 16384x4096 by half (0.336 against 0.214 ms); index clamping cost
# nothing measurable (0.301 and 0.214 ms), so it stays as a guard.
DEFAULT_SHADER_CHECKS = "bounds"


class WGPUPlanLaunches:
    """Every dispatch of a plan's kernels on one WebGPU device, prepared once
    (WGPUDevice.prepare_launches) and recorded over the plan's slot table of
    scheduler.layout_memory (slot 0: the arena of temporaries, bound as ranges at their
    offsets; 1..: the leaves and the buffers that outlive the run).

    Each kernel keeps the native handle of its bind group; a run that binds other buffers
    to a slot fetches the bind groups of the kernels using that slot again (from the
    device's cache: a training loop alternates between a few buffer sets). A run is then,
    per dispatch, three direct wgpu-native calls (wgpu_direct.Recorder)."""

    def __init__(self, device, kernels, nslots):
        self.device = device
        self.pool = device.pool
        rec = self.recorder = device.recorder
        # per kernel: [slot refs, program, native pipelines and grids, native bind group,
        # the bind group]
        self.kernels = []
        self.users = [[] for _ in range(nslots)]     # per slot: indices of kernels using it
        for program, slots in kernels:
            wgsl = program.wgsl
            if wgsl.scratch and program.scratch is None:
                program.scratch = self.pool._new_buffer(_round4(wgsl.scratch))
            refs = []
            for i, ((where, x), (d, n, _)) in enumerate(zip(slots, program.kernel.args)):
                size = _round4(n * d.itemsize)
                refs.append((i, 0, x, size) if where == "a" else (i, x, 0, None))
            for _, k, _, _ in refs:
                if not self.users[k] or self.users[k][-1] != len(self.kernels):
                    self.users[k].append(len(self.kernels))
            passes = [(rec.handle(p), gx, gy)
                      for p, (_, (gx, gy)) in zip(program.pipelines, wgsl.passes)]
            self.kernels.append([refs, program, passes, None, None])
        self.kernel_ends = list(range(1, len(self.kernels) + 1))
        self.bound = [UNBOUND] * nslots

    @staticmethod
    def suits(device, kernels):
        """Whether a plan of `kernels` can be prepared: no kernel passes arguments through
        uniform buffers (an arena range bound as a uniform and as storage in one dispatch
        is a usage conflict; those copies also end the compute pass), and every arena
        range fits a storage binding and the largest buffer."""
        most = min(device.limits["max-storage-buffer-binding-size"], device.pool.max_buffer)
        for program, slots in kernels:
            u = program.wgsl.uniforms
            if u.single or u.arena:
                return False
            for (where, x), (d, n, _) in zip(slots, program.kernel.args):
                if where == "a" and x + _round4(n * d.itemsize) > most:
                    return False
        return True

    def _group(self, entry, table):
        refs, program = entry[0], entry[1]
        handles = []
        for i, k, off, size in refs:
            h = table[k].handle
            handles.append((i, h) if size is None else (i, h, off, size))
        if program.scratch is not None:
            handles.append((len(refs), program.scratch))
        # the group object is kept with the kernel: the device's cache may drop it, and
        # its native handle must live while the plan records it
        entry[4] = self.device.bind_group(program.layout, handles)
        return self.recorder.handle(entry[4])

    def run(self, table, stops=None):
        """Record the plan over `table` (Buffers; slot 0 None when the plan has no arena).
        `stops` ([(kernel index, [fn...])], ascending): call each fn once the kernels
        before that index were recorded, before the rest are."""
        bound = self.bound
        for k, buf in enumerate(table):
            handle = None if buf is None else buf.handle
            if handle is not bound[k]:
                bound[k] = handle
                for j in self.users[k]:
                    self.kernels[j][3] = None
        for entry in self.kernels:
            if entry[3] is None:
                entry[3] = self._group(entry, table)
        if stops:
            run_in_pieces(len(self.kernels), stops, self._record)
        else:
            self._record(0, len(self.kernels))

    def _record(self, first, end):
        pool, rec = self.pool, self.recorder
        cp = rec.handle(pool.compute_pass())
        for entry in self.kernels[first:end]:
            group = entry[3]
            for pipeline, gx, gy in entry[2]:
                rec.dispatch(cp, pipeline, group, gx, gy)
                pool.dispatched()
                if pool.cpass is None:        # the encoder was just submitted
                    cp = rec.handle(pool.compute_pass())


class WGPUDevice(ProgramCache):
    backend = "wgpu"
    fp64 = False

    def __init__(self, wgpu, adapter, device, pool, limits, debug=0, shader_checks=None):
        self.wgpu = wgpu
        # run-time check bits for naga (wgpu_direct.py); None: wgpu's standard path
        if shader_checks is None:
            shader_checks = wgpu_direct.parse_checks(DEFAULT_SHADER_CHECKS)
        self.shader_checks = shader_checks if wgpu_direct.available(device) else None
        # dispatches recorded by direct wgpu-native calls (wgpu_direct.Recorder); None:
        # through wgpu-py's methods
        self.recorder = wgpu_direct.Recorder() if wgpu_direct.available(device) else None
        # a cached plan's dispatches recorded from one prepared list (WGPUPlanLaunches;
        # initialize reads the switch), temporaries bound at arena offsets of this
        # alignment (storage and uniform bindings' offset alignment, at least 64)
        self.plan_launches = True
        self.arena_align = max(64, int(limits.get("min-storage-buffer-offset-alignment", 256)),
                               int(limits.get("min-uniform-buffer-offset-alignment", 256)))
        self.adapter = adapter
        self.device = device
        self.pool = pool
        self.limits = limits
        self.debug = debug
        info = adapter.info
        self.adapter_name = info.get("device") or info.get("description") or "adapter"
        self.is_cpu = str(info.get("adapter_type", "")).lower() == "cpu"
        self.features = set(device.features)
        # llvmpipe (lavapipe) ends every shader's loops after 65,535 iterations silently
        self.loop_cap = LLVMPIPE_LOOP_CAP if "llvmpipe" in self.adapter_name.lower() else 0
        self.compiled = 0              # shader modules + pipelines built (zyx.stats)
        self.pipelines_created = 0
        self.bind_groups_created = 0
        self._by_source = {}           # WGSL source -> compute pipeline
        self._programs = {}            # zyx kernel -> WGPUProgram
        self._layouts = {}             # buffer count -> (bind group layout, pipeline layout)
        self._bind_groups = {}         # (layout id, buffer handles) -> bind group
        self.schedules = {}            # zyx kernel -> strategy the autotuner chose
        pool.on_trim = self._forget_buffers
        self._info = self._make_info()

    def _make_info(self):
        lim = self.limits
        info = self.adapter.info
        compute = GPU_COMPUTE if not self.is_cpu else CPU_COMPUTE
        di = DeviceInfo(name=f"WebGPU {self.adapter_name} ({info.get('backend_type', '')})",
                        compute=compute,
                        max_global_work_dims=(lim["max-compute-workgroups-per-dimension"],) * 3,
                        max_local_threads=lim["max-compute-invocations-per-workgroup"],
                        max_local_work_dims=(lim["max-compute-workgroup-size-x"],
                                             lim["max-compute-workgroup-size-y"],
                                             lim["max-compute-workgroup-size-z"]),
                        local_mem_size=lim["max-compute-workgroup-storage-size"],
                        warp_size=32 if not self.is_cpu else 1,
                        register_tiles=False, window_tiles=False,
                        own_tiles=_no_tiles,
                        # one reduce loop per sum: the writer spreads long loops over a
                        # workgroup and combines them by a tree, which is the blocking
                        sum_block=1 << 30,
                        dtypes=tuple(d.name for d in BUFFER_DTYPES),
                        extra={"fp64": False, "cpu": self.is_cpu, "limits": dict(lim)})
        return di

    def info(self):
        return self._info

    @property
    def identity(self):
        info = self.adapter.info
        return f"wgpu|{self.adapter_name}|{info.get('description', '')}|{info.get('backend_type', '')}"

    # -- compile ----------------------------------------------------------------------------
    def schedule_candidates(self, kernel):
        """[(label, schedule)] the autotuner may time: the heuristic's choice (None) first,
        then invocations per workgroup for elementwise kernels ("ew:"), and for kernels
        with loops the other product tiles of a gemm kernel ("gemm:") and the writer's
        strategies (serial, rows) with their workgroup sizes ("group:")."""
        out = [("default", None)]
        most = self.limits["max-compute-invocations-per-workgroup"]
        if not any(op[0] == K.LOOP for op in kernel.ops):
            return out + [(f"ew:wg={n},per={p}", ("serial", n, p)) for n in (64, 256, 512)
                          for p in (1, 2, 4, 8) if n <= most]
        tiles = wgsl_gemm.candidates(kernel.ops, self.products())
        out += [(f"gemm:{t.label()}", ("gemm", t, None)) for t in tiles]
        return out + [(f"group:{s},wg={n}", (s, n, None)) for s in strategies(kernel)
                      for n in (64, 128, 256, 512) if n <= most]

    def products(self, tile=None):
        """The writer's product tiles for this device (wgsl/gemm.py `Products`, None with
        ZYX_WGSL_GEMM=0): its workgroup limits, its loop cap, and as compute units the
        host's cores for a CPU adapter, wgsl_gemm.GPU_UNITS else (WebGPU reports none)."""
        return wgsl_gemm.products(self.limits, self.units, self.loop_cap, tile)

    @property
    def units(self):
        """Compute units the writers plan for: the host's cores for a CPU adapter,
        wgsl_gemm.GPU_UNITS else (WebGPU reports none)."""
        return (os.cpu_count() or 1) if self.is_cpu else wgsl_gemm.GPU_UNITS

    def compile_variant(self, kernel, schedule):
        """A program of `kernel` written with `schedule` (a strategy name, None: the chosen
        or default one), not kept: the autotuner times these and releases them."""
        wgsl = self.render(kernel, schedule)
        layout = self._layout(len(kernel.args), bool(wgsl.scratch), wgsl.uniforms)
        return WGPUProgram(kernel, wgsl, [self._pipeline(src, layout[1])
                                          for src, _ in wgsl.passes], layout[0])

    def render(self, kernel, schedule=None):
        """The WGSLKernel of `kernel`, or UnsupportedDTypeError / BackendError when the
        device cannot run it (checked here, when the plan is built, never at launch)."""
        if schedule is None:
            schedule = self.schedules.get(kernel)
        strategy, wg, per = schedule if schedule is not None else (None, None, None)
        products = None
        if strategy in (None, "gemm"):   # ("gemm", Tile, None): a tile the autotuner times
            products = self.products(wg if strategy == "gemm" else None)
            wg = None if strategy == "gemm" else wg
        for d, n, _ in kernel.args:
            if _round4(n * d.itemsize) > self.limits["max-storage-buffer-binding-size"]:
                raise AllocationError(f"wgpu device {self.adapter_name}: a buffer of {n} "
                                      f"{d.name} exceeds the largest storage binding "
                                      f"({self.limits['max-storage-buffer-binding-size']} bytes)")
        why = supports(kernel)
        if why is not None:
            if "elements" in why or "workgroup" in why:
                raise BackendError(f"wgpu device {self.adapter_name}: cannot run a kernel "
                                   f"with {why}")
            raise UnsupportedDTypeError(f"{why} are not supported by WebGPU device "
                                        f"wgpu ({self.adapter_name}): WGSL has no "
                                        f"float64, int64 or uint64")
        most = self.limits["max-storage-buffers-per-shader-stage"]
        uniforms = uniform_args(kernel, most, self.limits.get("max-uniform-buffers-per-shader-stage", 0))
        nbuf = len(kernel.args) - len(uniforms.single) - len(uniforms.arena)
        if nbuf > most:
            raise DeviceLimitError(f"wgpu device {self.adapter_name}: a kernel with {nbuf} "
                               f"buffers exceeds the device's {most} storage buffers per "
                               f"shader stage (maxStorageBuffersPerShaderStage)")
        wgsl = write(kernel, self.limits["max-compute-workgroups-per-dimension"],
                     self.limits["max-compute-invocations-per-workgroup"],
                     "shader-f64" in self.features, uniforms, strategy, wg, per, products,
                     self.units)
        if self.loop_cap and wgsl.iterations > self.loop_cap:
            raise DeviceLimitError(f"wgpu device {self.adapter_name}: this driver stops shader "
                               f"loops after {self.loop_cap} iterations and the kernel's "
                               f"invocations loop {wgsl.iterations} times (a wrong result "
                               f"would follow); run it on another device")
        return wgsl

    def _layout(self, n, scratch, uniforms):
        """(bind group layout, pipeline layout) of n argument bindings (those in the arena
        left out), the scratch buffer at n, the arena at n + 1."""
        key = (n, scratch, uniforms.key())
        got = self._layouts.get(key)
        if got is None:
            w = self.wgpu
            kinds = [(i, w.BufferBindingType.uniform if i in uniforms.single
                      else w.BufferBindingType.storage)
                     for i in range(n) if i not in uniforms.arena]
            if scratch:
                kinds.append((n, w.BufferBindingType.storage))
            if uniforms.arena:
                kinds.append((n + 1, w.BufferBindingType.uniform))
            entries = [{"binding": i, "visibility": w.ShaderStage.COMPUTE,
                        "buffer": {"type": t}} for i, t in kinds]
            bgl = self.device.create_bind_group_layout(entries=entries)
            got = self._layouts[key] = (bgl, self.device.create_pipeline_layout(
                bind_group_layouts=[bgl]))
        return got

    def compile_many(self, kernels):
        """Programs of a plan's kernels (checked and built at plan time)."""
        return [self.compile(k) for k in kernels]

    def _pipeline(self, src, layout):
        pipeline = self._by_source.get(src)
        if pipeline is None:
            if self.debug & 8:
                print(f"zyx: WGSL source\n{src}", file=sys.stderr)
            t0 = time.perf_counter()
            try:
                module = None
                if self.shader_checks is not None:
                    module = wgpu_direct.shader_module(self.device, src, self.shader_checks)
                if module is None:
                    module = self.device.create_shader_module(code=src)
                pipeline = self.device.create_compute_pipeline(
                    layout=layout, compute={"module": module, "entry_point": "main"})
            except Exception as e:   # noqa: BLE001 - wgpu's validation errors
                raise BackendError(f"wgpu: shader build failed on {self.adapter_name}:\n{e}\n"
                                   f"--- source ---\n{src}") from None
            self._by_source[src] = pipeline
            self.compiled += 1
            self.pipelines_created += 1
            if self.debug & 32:
                print(f"zyx: wgpu built a pipeline in {(time.perf_counter() - t0) * 1e3:.1f} ms",
                      file=sys.stderr)
        return pipeline

    # -- launch -----------------------------------------------------------------------------
    def bind_group(self, layout, handles):
        """The bind group of `handles` ((binding, buffer) pairs, the whole buffer bound, or
        (binding, buffer, offset, size) for a range) in `layout`, cached by the buffers
        and ranges."""
        key = (id(layout), *[(id(e[1]), *e[2:]) for e in handles])
        got = self._bind_groups.get(key)
        if got is None:
            if len(self._bind_groups) >= 8192:
                self._bind_groups.clear()
            got = self.device.create_bind_group(layout=layout, entries=[
                {"binding": e[0], "resource": {"buffer": e[1], "offset": e[2] if len(e) > 2 else 0,
                                               "size": e[3] if len(e) > 2 else e[1].size}}
                for e in handles])
            # the handles are kept with the entry: an id is only unique while its object lives
            self._bind_groups[key] = (got, [e[1] for e in handles])
            self.bind_groups_created += 1
            return got
        return got[0]

    def _forget_buffers(self, dropped):
        ids = {id(h) for h in dropped}
        self._bind_groups = {k: v for k, v in self._bind_groups.items()
                             if not ids.intersection(e[0] for e in k[1:])}
        for h in dropped:
            h.destroy()

    def launch(self, program, pool, args, wait_events=()):
        wgsl = program.wgsl
        arena = wgsl.uniforms.arena
        n = len(args)
        handles = [(i, b.handle) for i, b in enumerate(args) if i not in arena]
        if wgsl.scratch:
            if program.scratch is None:   # (under the runtime's lock: one plan at a time)
                program.scratch = pool._new_buffer(_round4(wgsl.scratch))
            handles.append((n, program.scratch))
        if arena and program.arena is None:
            program.arena = pool._new_buffer(_round4(4 * wgsl.uniforms.arena_words))
        if arena:
            handles.append((n + 1, program.arena))
        with pool.lock:
            if arena:
                # the arena's values are copied in between passes, in queue order: this
                # dispatch reads the values of this launch
                encoder = pool.transfer_encoder()
                for a, off in arena.items():
                    size = (args[a].nbytes + 3) & ~3
                    encoder.copy_buffer_to_buffer(args[a].handle, 0, program.arena, 4 * off,
                                                  size)
            self._record(program, pool, wgsl, handles)
        return None          # one queue, in order: later commands see the results

    def _record(self, program, pool, wgsl, handles):
        bg = self.bind_group(program.layout, handles)
        cp = pool.compute_pass()
        rec = self.recorder
        # dispatches of one pass run in order, each seeing the previous one's writes
        for pipeline, (_, (gx, gy)) in zip(program.pipelines, wgsl.passes):
            if rec is not None:
                rec.dispatch(rec.handle(cp), rec.handle(pipeline), rec.handle(bg), gx, gy)
            else:
                cp.set_pipeline(pipeline)
                cp.set_bind_group(0, bg)
                cp.dispatch_workgroups(gx, gy, 1)
            pool.dispatched()
            if pool.cpass is None:           # the encoder was just submitted
                cp = pool.compute_pass()

    def prepare_launches(self, kernels, nslots):
        """The plan-level launch record of `kernels` ([(program, slots)], scheduler's
        prepare_launches): a WGPUPlanLaunches; None where switched off (`plan_launches`:
        config key, ZYX_PLAN_LAUNCHES=0), where wgpu-native cannot be called directly, or
        where the plan does not suit one (WGPUPlanLaunches.suits)."""
        if not self.plan_launches or self.recorder is None:
            return None
        if not WGPUPlanLaunches.suits(self, kernels):
            return None
        return WGPUPlanLaunches(self, kernels, nslots)

    def run_launches(self, launcher, table, stops=None):
        """Record a WGPUPlanLaunches over the plan's slot table; `stops`: see
        WGPUPlanLaunches.run."""
        with self.pool.lock:
            launcher.run(table, stops)

    def synchronize(self):
        """Submit what is pending and wait until the device has run it."""
        self.pool.wait()

    def forget_programs(self):
        self._programs.clear()

    def release(self, program):
        self.forget(program)
        own = [b for b in (program.scratch, program.arena) if b is not None]
        if own:
            self.pool.flush()                # pending dispatches may use them
            self._forget_buffers(own)
            program.scratch = program.arena = None


def _no_tiles(ops):
    """DeviceInfo.own_tiles: nothing to leave untiled, kernelize adds no register tiles
    here (register_tiles=False) and the writer's product tiles (codegen/wgsl/gemm.py) take
    the plain kernels; not None marks a GPU device."""
    return False


def _adapters(wgpu, cfg):
    choice = cfg.get("adapter", "high-performance")
    backend = cfg.get("backend")
    if choice not in ("high-performance", "low-power", "all"):
        raise BackendError(f"wgpu.adapter={choice!r}: expected 'high-performance', "
                           f"'low-power' or 'all'")
    if choice == "all" or backend:
        found = wgpu.gpu.enumerate_adapters_sync()
        if backend:
            found = [a for a in found
                     if str(a.info.get("backend_type", "")).lower() == str(backend).lower()]
        return found if choice == "all" else found[:1]
    a = wgpu.gpu.request_adapter_sync(power_preference=choice)
    return [a] if a is not None else []


def adapter_memory(adapter, cfg):
    """The pool size of a device on `adapter`, in bytes. WebGPU does not say how much
    memory an adapter has: the config's memory_mb; else, for a GPU adapter over Vulkan,
    the device-local heap Vulkan reports for the same PCI ids (so the pool, and the freed
    buffers it keeps for reuse, a tenth of it, scale with the GPU: with a guessed 8 GiB, a
    1 GB tensor freed every step was released and allocated again); else 8 GiB, or 2 GiB
    for a CPU adapter (which shares the host's memory)."""
    if "memory_mb" in cfg:
        return int(cfg["memory_mb"]) << 20
    info = adapter.info
    if str(info.get("adapter_type", "")).lower() == "cpu":
        return 2048 << 20
    if str(info.get("backend_type", "")).lower() == "vulkan":
        found = device_local_bytes(int(info.get("vendor_id", -1)), int(info.get("device_id", -1)))
        if found:
            return found
    return 8192 << 20


def initialize(cfg, debug=0):
    try:
        import wgpu          # lazily: a missing package only skips this backend
    except (ImportError, OSError) as e:
        raise BackendError(f"wgpu: cannot import wgpu-py ({e})") from None
    try:
        adapters = _adapters(wgpu, cfg)
    except BackendError:
        raise
    except Exception as e:   # noqa: BLE001 - no Vulkan/Metal/D3D driver, broken loader
        raise BackendError(f"wgpu: no adapter ({e})") from None
    if not adapters:
        raise BackendError("wgpu: no adapter found")
    limit = configured_limit(cfg)
    checks = wgpu_direct.parse_checks(os.environ.get("ZYX_WGPU_SHADER_CHECKS")
                                       or cfg.get("shader_checks", DEFAULT_SHADER_CHECKS))
    pools, devices = [], []
    for a in adapters:
        offered = a.limits
        want = {k: offered[k] for k in LIMITS if k in offered}
        # shader-f64: float64 totals of long float sums inside kernels (not tensors)
        features = [f for f in ("timestamp-query", "shader-f64") if f in a.features]
        try:
            device = a.request_device_sync(required_features=features, required_limits=want)
        except Exception as e:   # noqa: BLE001
            if debug & 1:
                print(f"zyx: wgpu adapter {a.info.get('device')} refused a device: {e}",
                      file=sys.stderr)
            continue
        lim = {k: int(device.limits[k]) for k in LIMITS if k in device.limits}
        max_buffer = min(lim["max-buffer-size"], lim["max-storage-buffer-binding-size"])
        total = adapter_memory(a, cfg)
        pool = WGPUMemoryPool(wgpu, device, max_buffer, total, limit)
        pools.append(pool)
        devices.append(WGPUDevice(wgpu, a, device, pool, lim, debug, checks))
        devices[-1].plan_launches = switch(cfg, "plan_launches", "ZYX_PLAN_LAUNCHES", True)
        if debug & 1:
            print(f"zyx: wgpu device {devices[-1].info().name}", file=sys.stderr)
    if not devices:
        raise BackendError("wgpu: no adapter gave a device")
    return pools, devices
