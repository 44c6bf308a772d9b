"""Backend dispatch: memory pools, devices, events and configuration (what code generation
knows about a device, DeviceInfo, is zyx.codegen.target's).

A backend is one module in this package with a function

    initialize(config: dict, debug: int) -> (pools, devices)

returning its memory pools and devices (each device names the pool it computes in), or
raising BackendError when its driver or hardware is missing. `initialize_backends` tries
every backend in BACKENDS; a failure is skipped silently (printed under ZYX_DEBUG device
bit) and when nothing is left `NoBackendAvailable` is raised.

MemoryPool interface (all backends):
    allocate(nbytes) -> (Buffer, event)         deallocate(buffer, wait_events)
    host_to_pool(src: ndarray, dst: Buffer, wait_events) -> event
    pool_to_host(src: Buffer, dst: ndarray, wait_events)   (blocking)
    sync_events(events), release_events(events), free_bytes
Device interface:
    info() -> DeviceInfo (zyx.codegen.target), compile(kernel) -> program,
    launch(program, pool, args: list[Buffer], wait_events) -> event, release(program)
Events are opaque backend objects (None means "already complete").
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import stat
import sys
import tempfile
import warnings

from ..errors import BackendError, NoBackendAvailable

# Tried in this order; the first device found is the default when several have equal compute.
BACKENDS = ("c", "opencl", "cuda", "hip", "vulkan", "wgpu", "dummy")


class Buffer:
    """A piece of memory in a pool. `handle` is the pool's own object, `ptr` an address
    where the backend has one, `event` the event its contents become valid at."""
    __slots__ = ("pool", "handle", "nbytes", "ptr", "event", "refs", "borrowed", "__weakref__")

    def __init__(self, pool, handle, nbytes, ptr=0, event=None, borrowed=False):
        self.refs = 1           # graph nodes sharing it (a realized reshape aliases its source)
        self.pool = pool
        self.handle = handle
        self.nbytes = nbytes
        self.ptr = ptr
        self.event = event
        self.borrowed = borrowed   # memory the user owns (zyx.from_numpy): never reused

    def __repr__(self):
        return f"Buffer({type(self.pool).__name__}, {self.nbytes} B)"


class MemoryPool:
    """Base class with the bookkeeping every pool shares."""
    name = "pool"

    def __init__(self, total_bytes):
        self.total_bytes = total_bytes
        self.used_bytes = 0

    @property
    def free_bytes(self):
        return self.total_bytes - self.used_bytes

    def sync_events(self, events):
        """Block until `events` complete. Synchronous pools (host, C, disk) never create
        events, so there is nothing to wait for; asynchronous backends override this."""

    def release_events(self, events):
        """Free event objects without waiting. Nothing to free in synchronous pools."""

    def submit_queued(self):
        """Start the work queued so far without waiting for it. The scheduler calls this
        when a plan's launches are all queued. Pools that record commands until a result
        is needed (Vulkan, WebGPU) submit them here, so the device runs the plan while
        the host builds the next graph instead of after it. Other pools start work as it
        is queued: nothing to do."""

    # True where `copy_region` is implemented: small windows and appends of realized
    # tensors are then copied on the device (Runtime.window_copy, Runtime.concat_copy)
    copies_regions = False
    # copy_region's offsets and byte counts must be multiples of this (WebGPU: 4); the
    # runtime keeps windows and appends that are not on the lazy path
    region_align = 1

    def copy_region(self, src, src_offset, dst, dst_offset, nbytes):
        """Queue a copy of `nbytes` bytes from buffer `src` at byte `src_offset` into
        buffer `dst` (of this pool) at `dst_offset`, after the work already queued that
        writes `src`; returns the copy's event or None (an in-order queue orders later
        work after it)."""
        raise NotImplementedError(f"{type(self).__name__} does not copy regions")


def config_path():
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return os.path.join(base, "zyx", "config.json")


def load_config(path=None, debug=0) -> dict:
    """Read the JSON config; a missing file gives the defaults ({}), and so does a
    malformed one (not JSON, not an object, nested too deeply for the parser, unreadable),
    with a warning naming it and why."""
    path = path or config_path()
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        if not isinstance(cfg, dict):
            raise ValueError("top level is not an object")
        return cfg
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, RecursionError) as e:
        # RecursionError: "[[[[..." deeper than the parser recurses; ValueError covers
        # JSONDecodeError and UnicodeDecodeError
        reason = "nested too deeply" if isinstance(e, RecursionError) else str(e)
        if isinstance(e, OSError):
            reason = e.strerror or str(e)
        warn(f"zyx: ignoring malformed config {path} ({reason[:200]}); using the defaults")
        return {}


_OFF = ("0", "false", "off", "no")


def switch(cfg, key, env, default=True):
    """An on/off setting of a backend: the environment variable `env` when set ("0",
    "false", "off", "no": off), else the config section's `key`, else `default`;
    BackendError when the config's value is not a boolean."""
    value = os.environ.get(env)
    if value is not None:
        return value.strip().lower() not in _OFF
    value = cfg.get(key, default)
    if not isinstance(value, bool):
        raise BackendError(f"{key}={value!r} is not true or false")
    return value


def run_in_pieces(count, stops, run):
    """A plan's launch record run between stops: `run(first, end)` makes launches
    first..end-1 of `count`, and each stop's fns ([(launch index, [fn...])], ascending:
    scheduler.execute's `ready` callbacks) are called once the launches before its index
    were made, before the rest are."""
    first = 0
    for end, fns in stops + [(count, ())]:
        if end > first:
            run(first, end)
        for fn in fns:
            fn()
        first = max(first, end)


def warn(message):
    """A warning users see once per message (config values ignored, cache not usable...)."""
    warnings.warn(message, RuntimeWarning, stacklevel=3)


_CACHE_DIRS = {}   # requested path -> directory actually used (one check, one warning)


def cache_dir() -> str:
    """The kernel cache directory, `$XDG_CACHE_HOME/zyx` (or `~/.cache/zyx`), created 0700.

    Libraries in it are loaded into the process, so it must be ours alone (as ssh and pip
    demand of their directories): owned by this user and not group/world-writable. A
    directory that is not, or that cannot be created, is replaced by a private temporary
    one (removed at exit), with a warning: zyx still computes, it only recompiles."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    d = os.path.join(base, "zyx")
    if d not in _CACHE_DIRS:
        problem = _untrusted_reason(d)
        if problem is None:
            _CACHE_DIRS[d] = d
        else:
            private = tempfile.mkdtemp(prefix="zyx-cache-")   # mkdtemp makes it 0700
            atexit.register(shutil.rmtree, private, True)
            warn(f"zyx: not using kernel cache {d}: {problem}; compiling into the private "
                 f"directory {private} for this process")
            _CACHE_DIRS[d] = private
    return _CACHE_DIRS[d]


def _untrusted_reason(d):
    """Why directory `d` cannot hold the kernel cache (None when it can), creating it
    when missing (mode 0700: the umask can only take bits away from it).

    `d` itself is examined with lstat, so a symbolic link is judged as a link: one that
    another user owns is refused (someone else chose where zyx would write and load
    from, and can re-point it at any time), and so is one of ours whose target is missing
    or fails the checks a directory does (owned by this user, not group/world-writable).
    A link of ours to a directory of ours is accepted: only this user could have made it
    and only this user can change it or what it points at, exactly as for the directory
    itself (e.g. ~/.cache/zyx linked to a larger disk)."""
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass       # a dangling symbolic link or a file in the way: examined below
    except OSError as e:
        return f"cannot create it ({e.strerror})"
    try:
        st = os.lstat(d)
    except OSError as e:
        return f"cannot examine it ({e.strerror})"
    uid = os.getuid() if hasattr(os, "getuid") else None
    what = "it"
    if stat.S_ISLNK(st.st_mode):
        if uid is not None and st.st_uid != uid:
            return f"it is a symbolic link owned by uid {st.st_uid}, not by this user"
        target = "?"
        try:
            target = os.readlink(d)
            st = os.stat(d)
        except OSError as e:
            return f"it is a symbolic link to a missing or unreachable {target!r} ({e.strerror})"
        what = f"the symbolic link's target {os.path.realpath(d)}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{what} is not a directory"
    if uid is not None and st.st_uid != uid:
        return f"{what} is owned by uid {st.st_uid}, not by this user"
    if st.st_mode & 0o022:
        return f"{what} is group- or world-writable (mode {stat.S_IMODE(st.st_mode):o})"
    return None


class ProgramCache:
    """For a device that builds one program per kernel: `compile(kernel)` builds it once
    with the device's `compile_variant(kernel, None)` and keeps it in `self._programs`
    (kernel -> program, made by the device); `forget(program)` drops it from there when it
    is the one kept (the autotuner's variants never are)."""

    def compile(self, kernel):
        prog = self._programs.get(kernel)
        if prog is None:
            prog = self._programs[kernel] = self.compile_variant(kernel, None)
        return prog

    def forget(self, program):
        if self._programs.get(program.kernel) is program:
            del self._programs[program.kernel]


def device_ids(cfg, count, section):
    """The device ordinals a backend's config section (`section`, e.g. "cuda") selects
    with `device_ids` (all `count` by default); BackendError when malformed."""
    ids = cfg.get("device_ids")
    if ids is None:
        return list(range(count))
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):
        raise BackendError(f"{section}.device_ids={ids!r} is not a list of integers")
    return [i for i in ids if 0 <= i < count]


def initialize_backends(config: dict, debug: int = 0, only=None, reasons=None):
    """Try every backend; return (pools, devices). Disabled or failing ones are skipped;
    why each was skipped is appended to `reasons` when given (as "name: why").

    The dummy device computes nothing (it reads back zeros), so it is tried only when
    `only` names it: enabling it in the config cannot make it stand in for a backend that
    failed to start."""
    pools, devices = [], []
    reasons = [] if reasons is None else reasons
    for name in (only or [b for b in BACKENDS if b != "dummy"]):
        bcfg = config.get(name, {})
        if not isinstance(bcfg, dict):
            warn(f"zyx: ignoring config section {name}={bcfg!r}: not an object")
            bcfg = {}
        if not bcfg.get("enabled", True if only else name != "dummy"):
            reasons.append(f"{name}: disabled in config")
            if debug & 1:
                print(f"zyx: backend {name} disabled in config", file=sys.stderr)
            continue
        try:
            mod = importlib.import_module(f".{name}", __name__)
            p, d = mod.initialize(bcfg, debug)
        except ImportError as e:
            missing = isinstance(e, ModuleNotFoundError) and e.name == f"{__name__}.{name}"
            reasons.append(f"{name}: " + ("not part of this version of zyx" if missing
                                          else f"unavailable ({e})"))
            if debug & 1:
                print(f"zyx: backend {name} unavailable: {e}", file=sys.stderr)
            continue
        except Exception as e:  # a broken driver must not stop the others
            reasons.append(f"{name}: failed to initialize ({e})")
            if debug & 1:
                print(f"zyx: backend {name} failed to initialize: {e}", file=sys.stderr)
            continue
        pools.extend(p)
        devices.extend(d)
        if debug & 1:
            for dev in d:
                print(f"zyx: device {dev.info().name} ({name})", file=sys.stderr)
    if not devices:
        raise NoBackendAvailable("no backend could be initialized:\n  " + "\n  ".join(reasons)
                                 + "\n(run with ZYX_DEBUG=1 to see them as they happen)")
    return pools, devices
