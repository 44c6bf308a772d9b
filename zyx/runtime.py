"""The one owner of global state: the graph, devices and pools, the plan cache, the random
generator, debug mask and config. Tensors talk to the runtime; the runtime talks to the
scheduler; nothing else holds state.

ZYX_DEBUG is a bitmask: 1 devices, 2 scheduling, 4 kernel IR, 8 generated source,
16 memory, 32 compilation, 64 performance (time per realization).
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import weakref

import numpy as np

from . import bounds
from . import host_eval
from . import dtype as dt
from . import tuning
from ._core.graph import Graph, CONST, LEAF, PAD, RESHAPE, mask_cuts
from ._core import scheduler
from ._core import valuecheck
from .backends import cudnn, initialize_backends, load_config, warn
from .backends.disk import DiskMemoryPool
from .backends.host import HostMemoryPool
from .codegen.target import FLOAT32_PRECISIONS
from .device import BACKEND_TYPES, Device
from .errors import BackendError, IndexOutOfRangeError, UnsupportedDTypeError, ZyxError

DEBUG_DEVICES, DEBUG_SCHEDULE, DEBUG_IR, DEBUG_SOURCE, DEBUG_MEMORY, DEBUG_COMPILE, \
    DEBUG_PERF = 1, 2, 4, 8, 16, 32, 64


# Plan cache entries kept in memory (config "max_plans"). A dropped plan's compiled library
# is unloaded once no other plan shares it (the disk cache keeps it for the next time), so
# this also bounds the libraries mapped: ~35 KB each, 5,000 shapes mapped 180 MB.
MAX_PLANS = 1024


def _float32_precision(value, source):
    """`value` when it is one of FLOAT32_PRECISIONS, else ValueError naming `source`."""
    if value not in FLOAT32_PRECISIONS:
        raise ValueError(f"{source} must be one of {FLOAT32_PRECISIONS}, got {value!r}")
    return value


def _env_debug():
    try:
        return int(os.environ.get("ZYX_DEBUG", "0"), 0)
    except ValueError:
        return 0


def _max_plans(config):
    n = config.get("max_plans", MAX_PLANS)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        warn(f"zyx: ignoring max_plans={n!r}: not a positive integer; using {MAX_PLANS}")
        return MAX_PLANS
    return n


# writes of a small box of a realized tensor of at least this many bytes go into its memory
# (config "inplace_region_bytes"; Runtime.region_fits): smaller ones stay one fused
# functional update, cheaper than copies issued one by one. In host memory the copy is a
# numpy assignment; on a GPU each run of the box is a copy command costing host time,
# while the functional update costs device bandwidth the host loop hides: on an H200 a
# decode step with eight 8 MiB caches ran 1.19x slower in place, so GPUs take it only
# for caches of 64 MiB and more (config "inplace_region_device_bytes")
INPLACE_REGION_BYTES = 1 << 16
INPLACE_REGION_DEVICE_BYTES = 1 << 26
# a box copied into device memory takes one copy command per contiguous run of it
MAX_REGION_RUNS = 64


def _bytes_setting(config, name, default):
    n = config.get(name, default)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        warn(f"zyx: ignoring {name}={n!r}: not an integer >= 0; using {default}")
        return default
    return n


def _last_cut(shape, box):
    """The last axis the box ((start, length) per axis) does not cover whole, or -1."""
    cut = -1
    for d, ((start, n), size) in enumerate(zip(box, shape)):
        if (start, n) != (0, size):
            cut = d
    return cut


def region_runs(shape, box, most=None):
    """The contiguous runs ((first element, elements) in row-major order) that the box
    ((start, length) per axis) of a tensor of `shape` covers, in the box's own row-major
    order: axes after the last one the box cuts are whole, so each run spans them (there
    are as many runs as the box has positions on the axes up to that one, exclusive).
    None, without making the list, when there would be more than `most` runs."""
    cut = _last_cut(shape, box)
    if cut < 0:
        return [(0, math.prod(shape))]
    if most is not None and math.prod(n for _, n in box[:cut]) > most:
        return None
    run = box[cut][1] * math.prod(shape[cut + 1:])
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    starts = [0]
    for d in range(cut, -1, -1):
        start, n = box[d]
        step = strides[d]
        base = start * step
        lengths = range(n) if d < cut else (0,)
        starts = [base + i * step + s for i in lengths for s in starts]
    return [(s, run) for s in sorted(starts)]


def _growing_sizes(config):
    v = config.get("growing_sizes", True)
    if not isinstance(v, bool):
        warn(f"zyx: ignoring growing_sizes={v!r}: not true or false; using true")
        return True
    return v


def distinct_hardware(devices):
    """`devices` with each physical device once: among those whose DeviceInfo.hardware
    key is the same (one GPU reached through CUDA, OpenCL, Vulkan...), only the one of
    most compute stays (the first listed, i.e. BACKENDS order, on ties). Devices without
    a key all stay."""
    best = {}
    for d in devices:
        key = d.info().hardware
        if key and (key not in best or d.info().compute > best[key].info().compute):
            best[key] = d
    return [d for d in devices if not d.info().hardware or best[d.info().hardware] is d]


def check_dtype(dev, dtype, name_of):
    """Raise UnsupportedDTypeError (a DTypeError) when device `dev` cannot hold tensors of
    `dtype` (DeviceInfo.dtypes lists the dtype names it supports; empty: all); the
    message gives zyx's name for the device (`name_of(dev)`, asked only then)."""
    info = dev.info()
    allowed = info.dtypes
    if allowed and dtype.name not in allowed:
        raise UnsupportedDTypeError(f"{dtype.name} is not supported by device "
                                    f"{name_of(dev)} ({info.name})")


def _preferred_backend(config):
    """ZYX_DEVICE, else the config's "default_device": (backend name, index or None).
    Either a backend name ("c", "opencl", "cuda") or a device name ("cpu", "cuda:1")."""
    name = os.environ.get("ZYX_DEVICE") or config.get("default_device")
    if name is not None and not isinstance(name, str):
        warn(f"zyx: ignoring default_device={name!r}: not a device name")
        return None, None
    if not name:
        return None, None
    backend, _, index = name.strip().partition(":")
    backend = {v: k for k, v in BACKEND_TYPES.items()}.get(backend, backend)
    if index and not index.isdigit():
        warn(f"zyx: ignoring the index of default device {name!r}: not a number")
        index = ""
    return backend, (int(index) if index else None)


def _backend_of(device):
    """Backend name of a device: its module's name in zyx.backends (c, opencl, dummy...)."""
    return getattr(device, "backend", None) or type(device).__module__.rsplit(".", 1)[-1]


class _Family:
    """Graphs of one skeleton (_values_plan): the first one's key and the key indices
    whose values have differed from it. Plan keys hold the object (hashed by identity)."""
    __slots__ = ("first", "vary", "skeleton", "values")

    def __init__(self, first, skeleton, values):
        self.first = first
        self.vary = set()
        self.skeleton = skeleton    # its key in Runtime._families
        self.values = values        # collect's (key index, position) of its values

    def skeleton_of(self, flat):
        """The skeleton of a graph whose structural key is `flat`, were it of this
        family: flat with this family's value entries masked as collect masks them (a
        graph of the family has its values at the same key indices)."""
        if len(flat) != len(self.first):
            return None
        key = list(flat)
        for ki, _ in self.values:
            if key[ki - 1] != PAD:
                key[ki] = None                  # a CONST's scalar
                continue
            arg = key[ki]
            if not (isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[0], tuple)):
                # not a PAD's arg: a source position that equals PAD's code precedes it,
                # so the graph is not of this family
                return None
            key[ki] = mask_cuts(arg)
        return tuple(key)


def _host_values(node):
    """A realized node's values as a new numpy array of its shape, in its dtype's host
    representation (bfloat16 as its uint16 bits)."""
    out = np.empty(node.shape, dtype=node.dtype.np)
    buf = node.buffer
    if out.nbytes:
        buf.pool.pool_to_host(buf, out, [buf.event] if buf.event is not None else [])
    return out


def _host_view(node):
    """A realized leaf's values in host memory (the C backend's pool), as a numpy view of
    its buffer: no copy, in its dtype's host representation."""
    d = node.dtype
    count = math.prod(node.shape)
    return node.buffer.handle[:count * d.itemsize].view(d.np).reshape(node.shape)


_RAN = object()     # _values_plan's answer when _bound_realize ran the graph


class _BoundFamily:
    """Graphs of one shape skeleton (bounds.py): the first one's shapes and args, the
    fitted bounds.Template once a second one differed in sizes (False: not a family), and
    the sizes n that got ordinary plans, and the size of the last graph run at a bound.
    Plan keys hold the object (hashed by identity)."""
    __slots__ = ("first", "template", "exact", "last")

    def __init__(self, first):
        self.first = first
        self.template = None
        self.exact = set()
        self.last = -1


class Runtime:
    def __init__(self):
        self.graph = Graph()
        self.graph.free_buffer = self._free_buffer
        self.debug = _env_debug()
        self.config = None
        self.pools = None
        self.devices = None
        self.preferred = None    # backend name the default device must come from, if any
        self._ranked = []        # candidate devices, most compute first (device())
        self.default = None      # set_default_device's choice (None: the ranking's first)
        self.unavailable = []    # "backend: why" for every backend that did not start
        self._names = []         # (Device name, backend device) for every device
        self._pool_device = {}   # id(pool) -> backend device computing in it
        # True once tensors may live on more than one device (device=, .to(),
        # set_default_device): realizations then choose their device from their inputs
        # instead of taking the default.
        self._multi = False
        self.plans = {}
        # skeleton key -> _Family (first graph's key, the entries that varied): _values_plan
        self._families = {}
        # the family the last graph with values found: the next one (a training step's
        # next draw) is usually of it, and then needs no second collect for its skeleton
        self._last_family = None
        # id(leaf node) -> (node, buffer, epoch, values): _leaf_read (holding the node
        # keeps its id from being reused while it is kept)
        self._leaf_reads = {}
        # (device, shape skeleton) -> _BoundFamily: _bound_realize
        self._bound_families = {}
        # Threads realize one at a time: realization mutates the plan cache, the pools and
        # the graph (targets become leaves), and two threads realizing the same tensor at
        # once each computed it and one result leaked. Re-entrant: freeing a buffer takes
        # it too, and realization frees buffers.
        self.lock = threading.RLock()
        self._local = threading.local()     # per thread: .pending (see `pending`)
        self.max_plans = MAX_PLANS
        # zyx.set_float32_matmul_precision; written into every device's DeviceInfo
        self.float32_matmul_precision = _float32_precision(
            os.environ.get("ZYX_FLOAT32_MATMUL_PRECISION", "").strip() or "highest",
            "ZYX_FLOAT32_MATMUL_PRECISION")
        # zyx.backends.cudnn.allow_tf32 (on, as torch's; env ZYX_CONV_TF32=0 turns it
        # off); written into every device's DeviceInfo
        self.conv_tf32 = os.environ.get("ZYX_CONV_TF32", "1").strip() not in ("0", "false")
        cudnn.bind(lambda: self.conv_tf32, self.set_conv_tf32)
        self.growing_sizes = True   # config "growing_sizes": bounds.py's plans at a bound
        # configs "inplace_region_bytes" (host memory), "inplace_region_device_bytes"
        # (device memory): see region_fits
        self.inplace_region_bytes = INPLACE_REGION_BYTES
        self.inplace_region_device_bytes = INPLACE_REGION_DEVICE_BYTES
        # functions called after every realization (zyx.inplace finishes the writes it
        # left for the realization there: a box of a tensor copied into its memory)
        self.after_realize = []
        self.checks = Checks()  # value checks (indices, divisors) run with the realization
        # the random generator's state (zyx/random.py): the device generator's key and call
        # number; a numpy Generator for host algorithms (randperm, orthogonal_, shuffling)
        self.seed = 0
        self.rng_calls = 0
        self.rng = np.random.Generator(np.random.PCG64(0))
        self.stats = {"kernels_compiled": 0, "kernels_launched": 0, "plans_built": 0,
                      "plan_cache_hits": 0, "realizations": 0,
                      "backward_replays": 0, "kernels_tuned": 0, "schedules_reused": 0,
                      "bound_runs": 0, "plan_replays": 0}
        self.autotune = tuning.Settings()   # from the config at init (zyx.autotune)
        self._tuners = {}        # id(device) -> tuning.Tuner, while tuning is on
        # zyx.jit's capture in progress (a jit.Recorder), else None: told of every plan a
        # realization runs (`before`), asked which constants its replays change (`varies`)
        self.recorder = None

    # -- devices --------------------------------------------------------------------------
    def init(self, only=None):
        """Initialize backends (done lazily on first use; call to pick backends explicitly)."""
        self.config = load_config(debug=self.debug)
        self.max_plans = _max_plans(self.config)
        self.growing_sizes = _growing_sizes(self.config)
        self.inplace_region_bytes = _bytes_setting(self.config, "inplace_region_bytes",
                                                   INPLACE_REGION_BYTES)
        self.inplace_region_device_bytes = _bytes_setting(
            self.config, "inplace_region_device_bytes", INPLACE_REGION_DEVICE_BYTES)
        self.autotune = tuning.Settings.from_config(self.config)
        self._tuners = {}
        reasons = []
        self.pools, self.devices = initialize_backends(self.config, self.debug, only, reasons)
        self.unavailable = reasons
        self.preferred, preferred_index = _preferred_backend(self.config)
        self._ranked = self._rank_devices(preferred_index)
        self._names = self._name_devices()
        self._pool_device = {id(d.pool): d for d in self.devices}
        for d in self.devices:
            d.info().float32_precision = self.float32_matmul_precision
            d.info().conv_tf32 = self.conv_tf32
        self.default = None
        self._multi = False
        self._drop_plans()     # their programs are unloaded with them

    def _ensure(self):
        if self.devices is None:
            self.init()

    def device(self):
        """The default device: set_default_device's, else the most compute among those
        with room (ranked once by `init`; this runs on every realization)."""
        self._ensure()
        if self.default is not None:
            return self.default
        ranked = self._ranked
        if len(ranked) > 1:
            for d in ranked:
                if d.pool.free_bytes > 0:
                    return d
        return ranked[0]

    def _rank_devices(self, index=None):
        """The devices a realization may run on, most compute first: those of the backend
        ZYX_DEVICE / config "default_device" names (a backend that ranks below others by
        compute, like OpenCL on a CPU, is used only when asked for), or all devices, with
        a warning, when none is of that backend. `index` (ZYX_DEVICE=cuda:1) puts that
        device of the backend first."""
        devices = self.devices
        if self.preferred is not None:
            found = [d for d in devices if _backend_of(d) == self.preferred]
            if found and index is not None:
                if index < len(found):
                    first = found[index]
                    rest = sorted((d for d in found if d is not first),
                                  key=lambda d: d.info().compute, reverse=True)
                    return [first] + rest
                warn(f"zyx: default device {self.preferred}:{index} does not exist; "
                     f"using {self.preferred}'s others")
            if found:
                devices = found
            else:
                warn(f"zyx: default device {self.preferred!r} is not available; using the "
                     "others")
                self.preferred = None
        if self.preferred is None:      # one physical GPU counts once, by its fastest API
            devices = distinct_hardware(devices)
        # stable: equal compute keeps the backends' order
        return sorted(devices, key=lambda d: d.info().compute, reverse=True)

    def _name_devices(self):
        """(Device, backend device) pairs: "cpu" for the C backend, "<type>:<i>" for the
        i-th device of any other backend, each Device carrying name, memory and compute."""
        names, count = [], {}
        for d in self.devices:
            kind = BACKEND_TYPES.get(_backend_of(d), _backend_of(d))
            i = count.get(kind, 0)
            count[kind] = i + 1
            name = Device(kind, None if kind == "cpu" else i)
            info = d.info()
            name.backend, name.name, name.compute = _backend_of(d), info.name, info.compute
            name.memory = getattr(d.pool, "total_bytes", None)
            names.append((name, d))
        return names

    def names(self):
        """Every device as a Device name (zyx.devices())."""
        self._ensure()
        return [n for n, _ in self._names]

    def name_of(self, dev):
        """The Device name of backend device `dev`."""
        for n, d in self._names:
            if d is dev:
                return n
        raise BackendError(f"device {dev!r} is not one of this runtime's devices")

    def resolve(self, spec):
        """The backend device that a device name ("cuda:0", Device, "cpu") refers to; a
        clear error naming what was found (and why a backend is missing) otherwise."""
        self._ensure()
        if spec in self.devices:       # already a backend device
            return spec
        want = spec if isinstance(spec, Device) else Device(spec)
        same_type = [(n, d) for n, d in self._names if n.type == want.type]
        for n, d in same_type:
            if want.index is None or n.index == want.index or (n.index is None and
                                                                want.index == 0):
                return d
        if same_type:
            raise BackendError(f"device {want} does not exist: {len(same_type)} {want.type} "
                               f"device(s) found ({', '.join(str(n) for n, _ in same_type)})")
        backend = {v: k for k, v in BACKEND_TYPES.items()}.get(want.type, want.type)
        why = [r for r in self.unavailable if r.startswith(backend + ":")]
        raise BackendError(f"device {want} is not available"
                           + (f" ({why[0]})" if why else "") + "; devices found: "
                           + ", ".join(str(n) for n, _ in self._names))

    def set_default_device(self, spec):
        """Make `spec` the device new tensors are created on and constant-only graphs run
        on (None: back to the most compute)."""
        self._ensure()
        self.default = None if spec is None else self.resolve(spec)
        if len(self.devices) > 1:
            self._multi = True

    def synchronize(self, spec=None):
        """Wait for the work queued on one device (all devices when None). Realizations
        on a GPU return once their kernels are queued; reading a value waits by itself,
        so this is for timing (torch.cuda.synchronize)."""
        self._ensure()
        for d in (self.devices if spec is None else [self.resolve(spec)]):
            sync = getattr(d, "synchronize", None)
            if sync is not None:
                sync()

    def _pools_of(self, spec):
        """The memory pools of one device (`spec`: a device name or Device), every pool
        when None."""
        self._ensure()
        if spec is None:
            return list(self.pools)
        return [self.resolve(spec).pool]

    def memory_allocated(self, spec=None):
        """Bytes of live tensors and plan buffers in the device's pool (all pools: None)."""
        return sum(p.used_bytes for p in self._pools_of(spec))

    def memory_reserved(self, spec=None):
        """memory_allocated plus the freed blocks the pool keeps for reuse."""
        return sum(p.used_bytes + getattr(p, "cached_bytes", 0) for p in self._pools_of(spec))

    def empty_cache(self, spec=None):
        """Give the freed blocks the pools keep for reuse back to the driver (or the OS)."""
        with self.lock:
            for p in self._pools_of(spec):
                trim = getattr(p, "trim", None)
                if trim is not None:
                    trim()

    def placed_on(self, dev):
        """Note that a tensor was put on `dev` explicitly (device=, .to()): from then on
        realizations look at where their inputs live."""
        if not self._multi and dev is not self.device():
            self._multi = True

    def _device_for(self, order):
        """The device a realization of the subgraph `order` runs on: the default one while
        every tensor lives there; otherwise the device holding most bytes of its inputs
        (ties: the one with more compute, a GPU the user put tensors on over the CPU, then
        the default one; input-less graphs: the default device). Inputs elsewhere move to
        it, once (`_move_to_pool`)."""
        default = self.device()
        if not self._multi:
            return default
        weight = self._input_bytes(order)
        if len(weight) == 1:      # the usual case: every input on one device
            for d in weight:
                return d
        if not weight:
            return default
        return max(weight, key=lambda d: (weight[d], d.info().compute, d is default))

    def _input_bytes(self, order):
        """{device: bytes (+1 each) of the realized leaves of `order` living there}."""
        graph = self.graph
        pool_device = self._pool_device
        weight = {}
        for nid in order:
            node = graph.get(nid)
            if node.op == LEAF:
                dev = pool_device.get(id(node.buffer.pool))
                if dev is not None:
                    weight[dev] = weight.get(dev, 0) + node.buffer.nbytes + 1
        return weight

    def device_of(self, nid):
        """The backend device tensor `nid` lives on (a lazy tensor: where it would be
        computed)."""
        self._ensure()
        node = self.graph.get(nid)
        if node.op == LEAF:
            dev = self._pool_device.get(id(node.buffer.pool))
            return dev if dev is not None else self.device()
        if not self._multi:
            return self.device()
        order, _ = self.graph.collect([nid])
        return self._device_for(order)

    def copy_to(self, nid, dev):
        """A new leaf on device `dev` holding tensor `nid`'s values (computed first where
        it lives). Through host memory; the source is unchanged."""
        check_dtype(dev, self.graph.get(nid).dtype, self.name_of)
        self.realize([nid])
        node = self.graph.get(nid)
        src = node.buffer
        host = np.empty(src.nbytes, dtype=np.uint8)
        if src.nbytes:
            src.pool.pool_to_host(src, host, [src.event] if src.event is not None else [])
        with self.lock:
            buf, _ = dev.pool.allocate(src.nbytes)
        buf.event = dev.pool.host_to_pool(host, buf, []) if src.nbytes else None
        self.placed_on(dev)
        if self.debug & DEBUG_MEMORY:
            self._print_copy(node, src.pool, dev.pool)
        return self.graph.leaf(buf, tuple(node.shape), node.dtype)

    def _where(self, pool):
        dev = self._pool_device.get(id(pool))
        return str(self.name_of(dev)) if dev is not None else getattr(pool, "name", "pool")

    def _print_copy(self, node, src_pool, dst_pool):
        shape = "x".join(map(str, node.shape)) or "scalar"
        print(f"zyx: copy {shape} {node.dtype.name} ({node.buffer.nbytes if node.buffer is not None else 0} B) "
              f"{self._where(src_pool)} -> {self._where(dst_pool)}", file=sys.stderr)

    # -- memory ---------------------------------------------------------------------------
    def _free_buffer(self, buf):
        with self.lock:     # any thread drops tensors; the pool counts must not race
            buf.refs -= 1
            if buf.refs > 0:
                return
            if buf.pool is not None and buf.handle is not None:
                buf.pool.deallocate(buf, [buf.event] if buf.event is not None else [])

    def pool_bytes(self):
        """Bytes currently handed out by every pool (what a leak test watches)."""
        self._ensure()
        return sum(p.used_bytes for p in self.pools)

    @staticmethod
    def open_file(path):
        """A memory pool over the bytes of the file at `path` (mapped lazily, read-only):
        zyx.io's loaders make leaves of `pool.view(offset, nbytes)` buffers in it."""
        return DiskMemoryPool(path)

    def from_numpy(self, arr: np.ndarray, dtype, device=None) -> int:
        """A leaf holding a copy of `arr`, on `device` (a backend device; default device
        when None)."""
        self._ensure()
        check_dtype(device or self.device(), dtype, self.name_of)
        if device is not None:
            self.placed_on(device)
        pool = (device or self.device()).pool
        shape = tuple(arr.shape)            # ascontiguousarray turns 0-d into (1,)
        arr = np.ascontiguousarray(arr)
        with self.lock:
            buf, _ = pool.allocate(arr.nbytes)
        buf.event = pool.host_to_pool(arr, buf, [])
        if self.debug & DEBUG_MEMORY:
            print(f"zyx: copy {'x'.join(map(str, shape)) or 'scalar'} {dtype.name} "
                  f"({arr.nbytes} B) numpy -> {self._where(pool)}", file=sys.stderr)
        return self.graph.leaf(buf, shape, dtype)

    def share_numpy(self, arr: np.ndarray, dtype, device=None):
        """A leaf reading `arr`'s memory in place when the device computes in host memory
        (zyx.from_numpy); None when a copy is needed (another device, odd layout)."""
        self._ensure()
        pool = (device or self.device()).pool
        if not hasattr(pool, "borrow") or not arr.flags.c_contiguous or \
                not arr.dtype.isnative or arr.nbytes == 0:
            return None
        return self.graph.leaf(pool.borrow(arr), tuple(arr.shape), dtype)

    def _move_to_pool(self, node, pool):
        """Bring a leaf living in another pool (disk, other device) into `pool`, once."""
        src = node.buffer
        if self.debug & DEBUG_MEMORY:
            self._print_copy(node, src.pool, pool)
        host = np.empty(src.nbytes, dtype=np.uint8)
        src.pool.pool_to_host(src, host, [src.event] if src.event is not None else [])
        buf, _ = pool.allocate(src.nbytes)
        buf.event = pool.host_to_pool(host, buf, [])
        node.buffer = buf
        self._free_buffer(src)
        return buf

    # -- realization ----------------------------------------------------------------------
    @property
    def pending(self):
        """Weak refs to tensors the calling thread's next realization computes (defer).
        Per thread: another thread's realization must not take in this thread's gradients
        (its plan key would then depend on how the threads interleave)."""
        try:
            return self._local.pending
        except AttributeError:
            self._local.pending = pending = []
            return pending

    @pending.setter
    def pending(self, value):
        self._local.pending = value

    def defer(self, tensors):
        """Compute `tensors` with the next realization on their device, whatever it is
        for: backward()'s gradients then share one plan with the optimizer update that
        reads them (`_take_pending`).

        Held weakly: a deferred tensor the user dropped (a loss nobody kept, gradients
        cleared by zero_grad()) can never be read, so it is neither kept alive nor
        computed."""
        pending = self.pending
        if len(pending) > 256:     # backward() after backward() with nothing realized
            pending[:] = [r for r in pending if r() is not None]
        pending.extend([weakref.ref(t) for t in tensors])

    def realize(self, ids, device=None, ready=None):
        """Compute the nodes `ids` (and what this thread deferred) and turn them into
        leaves; one thread at a time (see `lock`). `device` (a backend device) forces
        where; otherwise `_device_for` chooses.

        `ready` ({node id among `ids`: fn}): each fn is called once, `fn(buffer, fresh)`,
        as soon as that node's value is queued, while the plan's later kernels may still
        be queued after it (scheduler.execute says what `fresh` means): work started
        there (a collective on another stream) overlaps the rest of the plan. A node
        already computed, or computed some other way, is handed over when the
        realization ends."""
        with self.lock:
            self._realize_ready(ids, device, ready)
            for fn in self.after_realize:
                fn()

    def _realize_ready(self, ids, device, ready):
        """realize's work (the lock held): the plan, then the `ready` calls of nodes the
        plan did not hand over."""
        if not ready:
            self._realize(ids, device)
            return
        fired = set()
        calls = {i: self._once(fn, i, fired) for i, fn in ready.items()}
        self._realize(ids, device, calls)
        for i, fn in calls.items():
            if i not in fired:
                node = self.graph.get(i)
                if node.op != LEAF:   # not stored by the plan: computed on its own
                    self._realize([i], device)
                    node = self.graph.get(i)
                fn(node.buffer, False)

    @staticmethod
    def _once(fn, i, fired):
        def call(buffer, fresh):
            fired.add(i)
            fn(buffer, fresh)
        return call

    def _realize(self, ids, device=None, ready=None):
        pending = self.pending
        if pending:
            if device is None and self._multi:   # where the targets alone run
                device = self._device_for(self.graph.collect(list(ids))[0])
            live = self._take_pending(pending, device)   # strong refs until the plan has run
            ids = list(ids) + [t._id for t in live]
        ids = [i for i in ids if self.graph.get(i).op != LEAF]
        if not ids:
            return
        t0 = time.perf_counter() if self.debug & DEBUG_PERF else 0.0
        self._ensure()
        order, key, ids, checks = self._collect_checked(ids)
        dev = device if device is not None else self._device_for(order)
        key = (id(dev), key)
        plan = self.plans.get(key)
        if plan is None:
            plan = self._values_plan(order, key, ids, dev, checks, t0)
            if plan is _RAN:    # run through a plan at a bound on a growing size
                if self.recorder is not None:
                    self.recorder.unsupported("a size that grows (a plan at a bound)")
                return
            if plan is None:
                plan = scheduler.build_plan(self.graph, order, ids, dev, self.debug,
                                            None, self.tuner(dev))
                self._keep_plan(key, plan)
        else:
            self.stats["plan_cache_hits"] += 1
        plan.last_used = self.stats["realizations"]
        if self.recorder is not None:
            self.recorder.before(plan, order, ids, dev, checks)
        if ready:
            ready = {p: ready[order[p]] for p in plan.targets if order[p] in ready}
        if plan.params is None:
            self._execute_checked(plan, order, dev, ids, checks, ready)
        else:
            leaves = self._param_leaves(plan, order, dev)
            try:
                self._execute_checked(plan, order + leaves, dev, ids, checks, ready)
            finally:
                for nid in leaves:
                    self.graph.release(nid)
        self._realized(ids, plan, t0)

    def replay(self, plan, order, dev, verify=None):
        """Run a cached `plan` on node ids `order` (its leaves and placeholder targets at
        the positions the plan reads and writes; zyx.jit's replays): the targets become
        leaves. `verify`: scheduler.execute's (value checks)."""
        with self.lock:
            scheduler.execute(plan, self.graph, order, dev.pool, self._move_to_pool,
                              self.stats, self.debug, verify)
            plan.last_used = self.stats["realizations"]
            self.stats["realizations"] += 1
            self.stats["plan_replays"] += 1

    def _take_pending(self, refs, dev):
        """The deferred tensors (`refs`, the pending list) a realization on `dev` computes,
        taken off the list. All of them while tensors live on one device (`dev` None).
        Otherwise only those that run on `dev`: one deferred on another device stays
        pending until a realization there (or its own read). Taken along, it would make
        the targets run where its inputs live, or move those inputs here for good: a read
        of a CPU tensor would compute it on a GPU that may lack its dtype (WGSL has no
        int64) or pull a GPU model's parameters to the host."""
        self.pending = []
        live = [t for t in (r() for r in refs) if t is not None]
        if dev is None or not live:
            return live
        collect = self.graph.collect
        weight = self._input_bytes(collect([t._id for t in live])[0])
        if set(weight) <= {dev} and (weight or dev is self.device()):
            return live           # the usual case: all of it runs on `dev` anyway
        take, wait = [], []
        for t in live:
            (take if self._device_for(collect([t._id])[0]) is dev else wait).append(t)
        if wait:
            self.defer(wait)
        return take

    def _realized(self, ids, plan, t0):
        self.stats["realizations"] += 1
        if self.debug & DEBUG_PERF:
            print(f"zyx: realized {len(ids)} tensor(s), {len(plan.steps)} kernel(s) in "
                  f"{(time.perf_counter() - t0) * 1e6:.1f} us", file=sys.stderr)

    def _keep_plan(self, key, plan):
        if len(self.plans) >= self.max_plans:
            self._drop_least_recent_plan()
        self.plans[key] = plan
        self.stats["plans_built"] += 1
        self.stats["kernels_compiled"] += plan.nkernels

    # -- autotuning ------------------------------------------------------------------------
    def tuner(self, dev):
        """The tuning.Tuner of `dev` while tuning is on (zyx.autotune), else None;
        devices without an `identity` (the dummy device) are never tuned."""
        if not self.autotune.enabled or not hasattr(dev, "identity"):
            return None
        t = self._tuners.get(id(dev))
        if t is None or t.device is not dev:
            t = self._tuners[id(dev)] = tuning.Tuner(dev, self.autotune, self.stats)
        return t

    def _drop_plans(self):
        """Forget every cached plan and size family: the next realizations plan anew."""
        self.plans.clear()
        self._families.clear()
        self._last_family = None
        self._bound_families.clear()

    def set_float32_matmul_precision(self, precision):
        """zyx.set_float32_matmul_precision: the setting the GPU lowerings read; plans and
        compiled GPU programs made under another setting are dropped."""
        precision = _float32_precision(precision, "float32 matmul precision")
        with self.lock:
            if precision == self.float32_matmul_precision:
                return
            self.float32_matmul_precision = precision
            self._precision_changed()

    def set_conv_tf32(self, allow):
        """zyx.backends.cudnn.allow_tf32: whether float32 convolutions may run on TF32
        tensor cores whatever set_float32_matmul_precision says (torch's default: they
        may); plans and compiled GPU programs made under the other setting are dropped."""
        allow = bool(allow)
        with self.lock:
            if allow == self.conv_tf32:
                return
            self.conv_tf32 = allow
            self._precision_changed()

    def _precision_changed(self):
        """Write the precision settings into every device's DeviceInfo and drop what was
        lowered under the old ones."""
        self._drop_plans()
        for d in self.devices or ():
            d.info().float32_precision = self.float32_matmul_precision
            d.info().conv_tf32 = self.conv_tf32
            forget = getattr(d, "forget_programs", None)
            if forget is not None:
                forget()

    def set_autotune(self, settings):
        """Use `settings` (a tuning.Settings) from now on; cached plans are dropped when
        tuning is switched on or off, so the next realization plans with (or without) it."""
        with self.lock:
            self._ensure()
            if settings.enabled != self.autotune.enabled:
                self._drop_plans()
            self.autotune = settings
            self._tuners = {}

    # -- values read at launch ----------------------------------------------------------------
    def _values_plan(self, order, key, ids, dev, checks, t0):
        """On a plan-cache miss, the plan of a graph that differs from one seen before only
        in values: constants' scalars and slice starts (`x[i:i + n]`, a PAD cutting an axis
        on both sides). None when there is none: then an ordinary plan, with every value in
        its kernels' source, is built.

        Graphs are grouped by their "skeleton", the structural key with every such value
        masked. The first graph of a skeleton gets an ordinary plan and is remembered; a
        later one with other values turns the entries that differ into parameters: its plan
        reads them at launch from parameter leaves (`_param_leaves`), so every graph that
        differs from the first only there reuses that one plan. Windows into realized
        tensors (`_is_window`: `data[i:i + T]`, `X[i]`) are parameters from the first
        graph on, so a loop over them compiles once. What still specializes a
        kernel: shapes, dtypes, ops, the fill and amounts of real pads, and every value
        that has not changed yet (it stays a literal, so x * 1.0 still folds).

        A graph of a new skeleton may be one whose sizes grew: `_bound_realize` runs it
        then (returns _RAN), before a values family is made for it."""
        flat = key[1]
        family = self._last_family
        if family is not None and family.skeleton[0] == key[0] and \
                family.skeleton[1] == family.skeleton_of(flat):
            values = family.values      # (no second walk of the graph)
        else:
            values = []
            skel = (key[0], self.graph.collect(ids, values)[1])
            if not values:
                return _RAN if self._bound_realize(order, ids, dev, checks, t0) else None
            family = self._families.get(skel)
        new_family = family is None
        if new_family:
            if self._bound_realize(order, ids, dev, checks, t0):
                return _RAN
            if len(self._families) >= 4 * self.max_plans:
                self._families.clear()
            family = self._families[skel] = _Family(flat, skel, values)
            # a window into a realized tensor (a batch `data[i:i + T]`, a row `X[i]`) is a
            # value from the start: its start is what changes from one graph to the next
            family.vary.update([ki for ki, cpos in values if self._is_window(order[cpos])])
        self._last_family = family
        if self.recorder is not None:
            # zyx.jit replays this plan with other values there (random draws' counters)
            family.vary.update([ki for ki, cpos in values
                                if self.recorder.varies(order[cpos])])
        if new_family and not family.vary:
            return None
        first, vary = family.first, family.vary
        for ki, _ in values:
            if ki not in vary and flat[ki] != first[ki]:
                vary.add(ki)
        if not vary:
            return None     # the first graph again, its plan dropped from the cache
        # the plan for this family's varying entries and the values of the others (vary
        # only grows, so its size tells which entries `fixed` holds)
        fixed = tuple([flat[ki] for ki, _ in values if ki not in vary])
        vkey = ("values", family, len(vary), fixed)
        plan = self.plans.get(vkey)
        if plan is None:
            plan = self._build_values_plan(order, ids, dev,
                                           [cpos for ki, cpos in values if ki in vary])
            self._keep_plan(vkey, plan)
            if new_family:
                # this graph's own key too: a window taken again at the same place (a
                # fixed slice every step) then finds the plan without a second collect;
                # an entry like any other, so the cache stays within max_plans (and the
                # plan just built is not the least recently used one)
                plan.last_used = self.stats["realizations"]
                if len(self.plans) >= self.max_plans:
                    self._drop_least_recent_plan()
                self.plans[key] = plan
        else:
            self.stats["plan_cache_hits"] += 1
        return plan

    # -- sizes that grow (bounds.py) -----------------------------------------------------------
    def _bound_realize(self, order, ids, dev, checks, t0):
        """On a plan-cache miss, run a graph that differs from an earlier graph of its shape
        skeleton only in a size that grows (autoregressive sampling's context) through the
        family's plan at a bound on that size (see bounds.py). False when there is none:
        the first graph of a skeleton and graphs that do not follow the fit get an ordinary
        plan, and so do the first two sizes of a family: a size that takes a third value is
        one that grows (a training loop's last, smaller batch is planned exactly, as
        before). Staging is a copy through the host, so graphs whose growing inputs and
        results exceed bounds.STAGE_LIMIT bytes keep a plan per size too. Value checks
        computed in the plan are reductions of their operand to a flag: at the bound they
        skip the positions past the real size like any other."""
        if not self.growing_sizes:
            return False
        graph = self.graph
        skel, sizes = bounds.skeleton(graph, ids)
        skel = (id(dev), skel)
        fam = self._bound_families.get(skel)
        if fam is None:
            if len(self._bound_families) >= bounds.MAX_FAMILIES:
                self._bound_families.clear()
            self._bound_families[skel] = _BoundFamily(bounds.observe(graph, order, sizes))
            return False
        t = fam.template
        if t is None:
            t = bounds.fit(graph, order, fam.first, bounds.observe(graph, order, sizes))
            if t is None:
                return False     # the same sizes again (its plan dropped, or other values)
            if type(t) is str:
                if self.debug & DEBUG_SCHEDULE:
                    print(f"zyx: sizes changed, a plan per size: {t}", file=sys.stderr)
                t = False
            else:
                fam.exact.add(t.first[t.ref[0]][0][t.ref[1]])   # the first graph's n
            fam.template = t
        if t is False:
            return False
        bind = t.bind(graph, order, sizes)
        if bind is None:
            return False
        n, starts, consts = bind
        if len(fam.exact) < 2 or n in fam.exact or n == fam.last:
            # (the same size twice in a row has stopped growing, a sampling loop's context
            # once cropped: planned exactly, later steps find that plan by their key)
            fam.exact.add(n)
            return False
        fam.last = n
        B = bounds.bound_for(n)
        pkey = ("bound", fam, B)
        plan = self.plans.get(pkey)
        if plan is None:
            if bounds.staged_bytes(t, graph, order, ids, B) > bounds.STAGE_LIMIT:
                return False
            plan = self._build_bound_plan(order, ids, dev, t, B)
            self._keep_plan(pkey, plan)
        else:
            self.stats["plan_cache_hits"] += 1
        plan.last_used = self.stats["realizations"]
        self._run_bound(plan, order, ids, dev, checks, n, starts, consts)
        self.stats["bound_runs"] += 1
        self._realized(ids, plan, t0)
        return True

    def _build_bound_plan(self, order, ids, dev, t, B):
        graph = self.graph
        fdt = dt.float64 if getattr(dev, "fp64", True) else dt.float32
        trace = graph.trace     # the bound graph's nodes belong to no backward template
        graph.trace = None
        try:
            bg = bounds.build_bound_graph(graph, order, ids, t, B, fdt)
            try:
                plan = scheduler.build_plan(graph, bg.order, bg.targets, dev, self.debug,
                                            bg.params, self.tuner(dev))
            finally:
                for nid in reversed(bg.added):
                    graph.release(nid)
        finally:
            if trace is not None:
                graph.trace = trace
        plan.bound = bg
        if self.debug & DEBUG_SCHEDULE:
            print(f"zyx: plan for a growing size up to {B}, {len(bg.int_spec)} size(s) and "
                  f"start(s) read at launch", file=sys.stderr)
        return plan

    def _run_bound(self, plan, order, ids, dev, checks, n, starts, consts):
        """Run a bound plan on the graph `order` at size n: stage its growing inputs, pass
        the sizes and values at launch, copy results with a growing size out."""
        bg = plan.bound
        graph = self.graph
        ints, floats = bg.values(n, starts, consts)
        ex = [0] * len(bg.order)     # only leaf and target positions are read
        made, outs = [], []
        try:
            for bpos, role, x in bg.leaves:
                if role == "leaf":
                    ex[bpos] = order[x]
                    continue
                if role == "stage":
                    nid = self._staged(order[x], bg.shapes[bpos], dev)
                elif role == "iota":
                    nid = self._param_leaf(np.arange(x, dtype=np.int32), dt.int32, dev)
                elif role == "ints":
                    nid = self._param_leaf(np.array(ints, np.int64), dt.int64, dev)
                else:
                    nid = self._param_leaf(np.array(floats, bg.fdt.np), bg.fdt, dev)
                made.append(nid)
                ex[bpos] = nid
            for bpos, p, varying in bg.outputs:
                if varying:
                    ph = graph.leaf(None, bg.shapes[bpos], graph.get(order[p]).dtype)
                    made.append(ph)
                    outs.append((ph, order[p]))
                    ex[bpos] = ph
                else:
                    ex[bpos] = order[p]
            self._execute_checked(plan, ex, dev, ids, checks)
            for ph, nid in outs:
                self._copy_out(ph, nid, dev)
        finally:
            for nid in made:
                graph.release(nid)

    def concat_copy(self, nids, axis):
        """A new realized leaf concatenating the realized leaves `nids` (one dtype, one
        pool) along `axis`, or None when they are not that. In host memory (the C
        backend's pool) they are joined with numpy; in a pool that copies regions
        (MemoryPool.copies_regions: CUDA, HIP, OpenCL, Vulkan, WebGPU) when every axis
        before `axis` has length 1, so the result is the parts' bytes one after the
        other, by device copies. tensor.cat takes this for small parts that need no
        gradient: a sampling loop's `idx = cat([idx, nxt], 1)` then stays a leaf, not a
        graph that grows by one cat per step (and plans anew every step)."""
        graph = self.graph
        nodes = [graph.get(i) for i in nids]
        first = nodes[0]
        pool = getattr(first.buffer, "pool", None)
        if pool is None:
            return None
        for n in nodes:
            if n.op != LEAF or n.dtype is not first.dtype or n.buffer.pool is not pool:
                return None
        if isinstance(pool, HostMemoryPool):
            return self._leaf_in(pool, np.concatenate([_host_view(n) for n in nodes], axis),
                                 first.dtype)
        if not self._device_copies(pool) or math.prod(first.shape[:axis]) != 1:
            return None
        shape = list(first.shape)
        shape[axis] = sum(n.shape[axis] for n in nodes)
        size = first.dtype.itemsize
        return self._copied_leaf(pool, shape, first.dtype,
                                 [(n.buffer, 0, math.prod(n.shape) * size) for n in nodes])

    def _copied_leaf(self, pool, shape, dtype, pieces):
        """A new realized leaf of `shape` in `pool`, its bytes the `pieces` ((buffer,
        byte offset, bytes) of realized leaves in pool) one after the other, by device
        copies (MemoryPool.copy_region); None when an offset or a size is not a multiple
        of the pool's `region_align`."""
        align = pool.region_align
        at = 0
        for _, offset, nbytes in pieces:
            if offset % align or nbytes % align or at % align:
                return None
            at += nbytes
        with self.lock:
            buf, _ = pool.allocate(math.prod(shape) * dtype.itemsize)
        at = 0
        for src, offset, nbytes in pieces:
            buf.event = pool.copy_region(src, offset, buf, at, nbytes)
            at += nbytes
        return self.graph.leaf(buf, tuple(shape), dtype)

    def copies_leaf(self, nid):
        """Whether node `nid` is a realized leaf that window_copy and concat_copy take:
        in host memory, or in a pool that copies regions on its device."""
        node = self.graph.get(nid)
        if node.op != LEAF:
            return False
        pool = getattr(node.buffer, "pool", None)
        return isinstance(pool, HostMemoryPool) or self._device_copies(pool)

    def _device_copies(self, pool):
        # (not while zyx.jit captures: its replays rerun plans, not copies made outside)
        return getattr(pool, "copies_regions", False) and self.recorder is None

    def window_copy(self, nid, pads, shape):
        """A new realized leaf of `shape` holding the window that shrinking `pads`
        ((before, after) per axis, none positive) cut from the realized leaf `nid`, or
        None when `nid` is not one copies_leaf takes. The window must be one contiguous
        block of the row-major buffer (tensor._one_block). In host memory it is copied by
        numpy, in a pool that copies regions by one device copy. tensor's basic indexing
        takes this for small windows that need no gradient: a sampling loop's
        `idx[:, -T:]` of its growing tokens is then a leaf of one shape every step, so
        the step's plan is found by its key, with no staging of a growing size
        (bounds.py) every token."""
        if not self.copies_leaf(nid):
            return None
        node = self.graph.get(nid)
        pool = node.buffer.pool
        if isinstance(pool, HostMemoryPool):
            window = _host_view(node)[tuple([slice(-b, n + a) for (b, a), n
                                             in zip(pads, node.shape)])]
            return self._leaf_in(pool, np.ascontiguousarray(window).reshape(shape),
                                 node.dtype)
        if math.prod(shape) <= 1:
            # a single element stays a view: reading it reads its base, whose values
            # _leaf_read keeps (`for i in ix: data[i:i + T]` reads ix once, not each i)
            return None
        start, stride = 0, 1
        for (b, _), n in zip(reversed(pads), reversed(node.shape)):
            start += -b * stride
            stride *= n
        size = node.dtype.itemsize
        return self._copied_leaf(pool, shape, node.dtype,
                                 [(node.buffer, start * size, math.prod(shape) * size)])

    def region_fits(self, nid, box):
        """Whether a write of the box ((start, length) per axis) of node `nid` may go into
        nid's memory (write_region) rather than make a new tensor: nid is a realized leaf
        over a buffer of its own (no other leaf aliases it, not borrowed) in host memory
        of at least `inplace_region_bytes` bytes, or in a pool that copies regions of at
        least `inplace_region_device_bytes` (not while zyx.jit captures), and the box is
        at most a quarter of it, in at most MAX_REGION_RUNS runs on a device, each whole
        words of the pool's region_align."""
        node = self.graph.get(nid)
        if node.op != LEAF or self.recorder is not None or not self.copies_leaf(nid):
            return False
        buf = node.buffer
        pool = buf.pool
        host = isinstance(pool, HostMemoryPool)
        least = self.inplace_region_bytes if host else self.inplace_region_device_bytes
        if buf.refs != 1 or buf.borrowed or buf.nbytes < least:
            return False
        count = math.prod(n for _, n in box)
        if count == 0 or 4 * count > math.prod(node.shape):
            return False
        if host:
            return True
        runs = region_runs(node.shape, box, MAX_REGION_RUNS)
        if runs is None:
            return False
        align = pool.region_align
        size = node.dtype.itemsize
        return all((s * size) % align == 0 and (n * size) % align == 0 for s, n in runs)

    def write_region(self, nid, box, vid):
        """Copy the realized leaf `vid` (the box's lengths as its shape, nid's dtype and
        pool) into the box ((start, length) per axis) of the realized leaf `nid`, in nid's
        memory, after the work queued so far; False (nothing copied) when either is not a
        realized leaf or they differ in dtype, pool or shape. The caller checked
        region_fits, and that nothing reads nid's old values any more. A key/value cache
        written at one position (`cache[:, :, t] = k`) then copies k, not the cache
        (zyx.inplace)."""
        node, v = self.graph.get(nid), self.graph.get(vid)
        if node.op != LEAF or v.op != LEAF or v.dtype is not node.dtype \
                or v.buffer.pool is not node.buffer.pool \
                or v.shape != tuple(n for _, n in box):
            return False
        pool = node.buffer.pool
        if isinstance(pool, HostMemoryPool):
            _host_view(node)[tuple(slice(s, s + n) for s, n in box)] = _host_view(v)
        else:
            size, at = node.dtype.itemsize, 0
            for start, n in region_runs(node.shape, box):
                pool.copy_region(v.buffer, at * size, node.buffer, start * size, n * size)
                at += n
        self._leaf_reads.pop(id(node), None)     # the values kept for host reads changed
        return True

    def _staged(self, nid, shape, dev):
        """A leaf of `shape` holding leaf `nid` in its leading corner, zeros elsewhere."""
        node = self.graph.get(nid)
        out = np.zeros(shape, node.dtype.np)
        out[tuple([slice(0, s) for s in node.shape])] = _host_values(node)
        return self._param_leaf(out, node.dtype, dev)

    def _copy_out(self, ph, nid, dev):
        """Realize node `nid` as the leading corner of the bound result in leaf `ph`."""
        node = self.graph.get(nid)
        full = _host_values(self.graph.get(ph))
        part = np.ascontiguousarray(full[tuple([slice(0, s) for s in node.shape])])
        pool = dev.pool
        buf, _ = pool.allocate(part.nbytes)
        buf.event = pool.host_to_pool(part, buf, [])
        self.graph.set_buffer(nid, buf)

    def _is_window(self, nid):
        """Node `nid` cuts a window of at most a quarter of some axis out of a realized
        tensor (a PAD of a LEAF cutting that axis on both sides)."""
        node = self.graph.get(nid)
        if node.op != PAD:
            return False
        src = self.graph.get(node.srcs[0])
        if src.op != LEAF:
            return False
        for d, (before, after) in enumerate(node.arg[0]):
            if before <= 0 and after <= 0 and src.shape[d] >= 4 * node.shape[d]:
                return True
        return False

    def _build_values_plan(self, order, ids, dev, positions):
        """A plan whose kernels read the values of the nodes at `positions` from parameter
        leaves appended to `order`: an int64 leaf (slice starts, integer and bool
        constants) and a float64 one (float constants; float32 on a device without
        float64)."""
        spec = []       # (position, axis or -1 for a constant, reads the float leaf)
        for p in positions:
            node = self.graph.get(order[p])
            if node.op == CONST:
                spec.append((p, -1, node.dtype.is_float))
            else:
                for d, (before, after) in enumerate(node.arg[0]):
                    if before <= 0 and after <= 0:
                        spec.append((p, d, False))
        n_float = sum(1 for s in spec if s[2])
        n_int = len(spec) - n_float
        fdt = dt.float64 if getattr(dev, "fp64", True) else dt.float32
        ext = list(order)
        leaf_pos = {}
        for is_float, n in ((False, n_int), (True, n_float)):
            if n:
                leaf_pos[is_float] = len(ext)
                ext.append(self._param_leaf(np.zeros(n, fdt.np if is_float else np.int64),
                                            fdt if is_float else dt.int64, dev))
        params, count = {}, {False: 0, True: 0}
        for p, axis, is_float in spec:
            params[(p, axis)] = (leaf_pos[is_float], count[is_float])
            count[is_float] += 1
        try:
            plan = scheduler.build_plan(self.graph, ext, ids, dev, self.debug, params,
                                        self.tuner(dev))
        finally:
            for nid in ext[len(order):]:
                self.graph.release(nid)
        plan.params = (spec, fdt, n_int, n_float)
        if self.debug & DEBUG_SCHEDULE:
            print(f"zyx: plan reads {len(spec)} value(s) at launch", file=sys.stderr)
        return plan

    def _param_leaves(self, plan, order, dev):
        """The node ids of a values plan's parameter leaves, holding this graph's values."""
        spec, fdt, n_int, n_float = plan.params
        ints, floats = [], []
        graph = self.graph
        for p, axis, is_float in spec:
            arg = graph.get(order[p]).arg
            if axis >= 0:
                ints.append(-arg[0][axis][0])
            elif is_float:
                floats.append(arg)
            else:
                v = int(arg)
                ints.append(v - (1 << 64) if v >= 1 << 63 else v)   # uint64: same bits
        out = []
        if n_int:
            out.append(self._param_leaf(np.array(ints, np.int64), dt.int64, dev))
        if n_float:
            out.append(self._param_leaf(np.array(floats, fdt.np), fdt, dev))
        return out

    def _param_leaf(self, arr, dtype, dev):
        return self._leaf_in(dev.pool, arr, dtype)

    def _leaf_in(self, pool, arr, dtype):
        """A new realized leaf in `pool` holding the numpy array `arr` (of dtype's host
        representation)."""
        with self.lock:
            buf, _ = pool.allocate(arr.nbytes)
        buf.event = pool.host_to_pool(arr, buf, [])
        return self.graph.leaf(buf, tuple(arr.shape), dtype)

    def _drop_least_recent_plan(self):
        """Make room in the bounded plan cache: the plan that ran longest ago goes (its
        library is unloaded once no other plan holds it), so a hot training-step plan
        survives a burst of one-off shapes. A scan over the cache, paid only when a new plan
        is built into a full cache; a hit only stamps `last_used` (re-inserting the key
        would hash the long structural key twice more per realization)."""
        oldest = min(self.plans.items(), key=lambda kv: kv[1].last_used)[0]
        del self.plans[oldest]

    # -- value checks (zyx.set_checks) ------------------------------------------------------
    def _collect_checked(self, ids):
        """graph.collect of `ids`, and the checks watching a node of that subgraph:
        (order, key, ids plus the flag targets, checks).

        A check whose operand is a realized leaf (the usual index: a batch of labels) is
        read on the host before the plan runs and adds nothing to the plan. Any other adds
        its flag as one more tiny target of the same plan (no extra round trip; part of
        the structural key, so a repeated step keeps its cached plan). Flags of every live
        check are collected at once, then those whose watched node the targets do not
        read are dropped and the rest collected again (never in a training step, where
        every live check is read)."""
        checks = self.checks.live(self.graph) if self.checks.watch and self.checks.on else ()
        while True:
            flags = [c.flag._id for c in checks if c.flag is not None]
            all_ids = ids + flags if flags else ids
            order, key = self.graph.collect(all_ids)
            if not checks:
                return order, key, all_ids, ()
            where = order if len(checks) < 4 else set(order)
            read = [c for c in checks if c.nid in where]
            if len(read) == len(checks):
                return order, key, all_ids, read
            unread_flags = False
            for c in checks:
                if c.nid not in where and c.flag is not None:
                    c.flag = None        # it holds its operand's graph: made again if needed
                    unread_flags = True
            if not unread_flags:
                return order, key, all_ids, read
            checks = read

    def _execute_checked(self, plan, order, dev, ids, checks, ready=None):
        """Run the plan, checks first: host checks before it runs, flags after it ran and
        before any target is bound (the scheduler then frees what it allocated). A failed
        check leaves every tensor, parameter and deferred gradient as it was. `ready`:
        scheduler.execute's."""
        if not checks:
            scheduler.execute(plan, self.graph, order, dev.pool, self._move_to_pool,
                              self.stats, self.debug, None, ready)
            return
        flagged = [c for c in checks if c.flag is not None]
        verify = self._verify_flags(flagged, plan.targets[len(ids) - len(flagged):]) \
            if flagged else None
        try:
            for c in checks:
                if c.flag is None:
                    self.checks.check_leaf(c)
            scheduler.execute(plan, self.graph, order, dev.pool, self._move_to_pool,
                              self.stats, self.debug, verify, ready)
        except BaseException as exc:
            for c in checks:        # a flag holds its operand's graph: made again if needed
                c.flag = None
            if isinstance(exc, _ChecksFailed):
                raise self.checks.error(exc.checks, self.graph, self.to_numpy) from None
            raise
        for c in flagged:           # computed: they hold a buffer (made again if needed)
            c.flag = None

    def _verify_flags(self, flagged, positions):
        """scheduler.execute's `verify`: raise _ChecksFailed when a flag is set."""
        def verify(buffer_of):
            bad = [c for c, p in zip(flagged, positions) if self.checks.is_set(buffer_of(p))]
            if bad:
                raise _ChecksFailed(bad)
        return verify

    def host_item(self, nid):
        """Node `nid`'s value computed on the host as a numpy array, without a
        realization, when it is a few exact integer ops on small realized tensors
        (host_eval.py: an element of a device tensor of indices plus a constant, used as
        a slice bound); None otherwise, and while deferred work waits for a realization."""
        if self.pending or self.graph.get(nid).op == LEAF:
            return None
        watched = self.checks.watch if self.checks.on else ()
        return host_eval.evaluate(self.graph, nid, self._leaf_read, watched)

    def _leaf_read(self, node):
        """A realized node's values (host_item's reads), kept for the next reads until a
        realization or a replay may have written device memory: nanoGPT's batching reads
        an element of the same tensor of starts 128 times a batch, and each read of
        device memory waits for the device. Host memory is read in place every time, and
        borrowed buffers (DLPack: another library may write them) are never kept."""
        buf = node.buffer
        if isinstance(buf.pool, HostMemoryPool) or buf.borrowed:
            return _host_values(node)
        epoch = (self.stats["realizations"], self.stats["plan_replays"])
        kept = self._leaf_reads.get(id(node))
        if kept is not None and kept[1] is buf and kept[2] == epoch:
            return kept[3]
        values = _host_values(node)
        values.flags.writeable = False
        if len(self._leaf_reads) >= 16:
            self._leaf_reads.clear()
        self._leaf_reads[id(node)] = (node, buf, epoch, values)
        return values

    def to_numpy(self, nid) -> np.ndarray:
        self.realize([nid])
        node = self.graph.get(nid)
        d = node.dtype
        out = _host_values(node)
        if d is dt.bfloat16:
            out = (out.astype(np.uint32) << 16).view(np.float32)
        return out


class _ChecksFailed(Exception):
    """Internal: flags of the realization that just ran were set (never seen by users)."""

    def __init__(self, checks):
        super().__init__()
        self.checks = checks


class Checks:
    """The registry of value checks: {watched node id: valuecheck.Check}. Entries whose
    node was realized or released are dropped by the next realization. `make_flag(check)`
    (set by zyx.tensor) builds a check's flag."""

    def __init__(self):
        self.on = True
        self.watch = {}
        self.make_flag = None
        self._byte = np.zeros(1, dtype=np.uint8)

    def add(self, graph, nid, opid, lo, hi, exempt, inside, error, message, info=()):
        watch = self.watch
        if len(watch) > 64:      # graphs built and dropped with no realization between
            valuecheck.sweep(watch, graph.nodes.items)
        watch[nid] = valuecheck.Check(nid, graph.get(nid), opid, graph.get(opid), lo, hi,
                                      exempt, inside, error, message, info)

    def live(self, graph):
        """Checks whose watched node is still unrealized (valuecheck.live)."""
        return valuecheck.live(self.watch, graph.nodes.items, self.make_flag)

    check_leaf = staticmethod(valuecheck.check_leaf)

    def is_set(self, buf):
        b = self._byte
        if buf.nbytes:
            buf.pool.pool_to_host(buf, b, [buf.event] if buf.event is not None else [])
        return bool(b[0])

    def error(self, checks, graph, to_numpy):
        """The exception for the first failed flag: its operand is read to name the value
        (computable: its own checks ran before it), through a new node so that the
        operand itself stays as it was."""
        for c in checks:
            shape = c.opnode.shape
            nid = graph.add(RESHAPE, shape, (c.opid,), shape, c.opnode.dtype)
            try:
                values = to_numpy(nid)
            finally:
                graph.release(nid)
            v = c.first_bad(np.ascontiguousarray(values))
            if v is not None:
                return c.exception(v)
        return IndexOutOfRangeError("an index check failed, but the values read again "
                                    "are in range (did a borrowed numpy array change?)")


RT = Runtime()
