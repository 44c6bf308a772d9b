"""The kernel autotuner: for each new kernel, time the schedules worth trying on the device
it runs on and keep the fastest, remembered on disk.

What is searched (the candidates come from the code that knows them):
- C backend: a reduce kernel's output layout (`heuristics.upcast_candidates`: the
  heuristic's register tile, no tile, "lanes" tiles with other row and lane counts, window
  lanes, the 4x4 "unroll" tile with and without reduce lanes). All candidates of one
  kernel compile in one compiler run.
- GPU backends: the lowering's knobs (`gpu.schedule_candidates`: work-items per group, row
  cache and warp-shuffle combine for reduce kernels; items, vector width, group size and
  waves for elementwise kernels).

How: every candidate is compiled and launched on buffers of the kernel's own sizes (filled
with ones: no denormals, no zero divisors), warm-up launch first, then `launches` timed
batches (each long enough to time: ~2 ms of launches) whose median is the candidate's
time; the best three are timed once more. The heuristic's choice is timed first and kept
unless another is more than 3% faster, so noise never trades a good schedule for a
lucky one. The search of one kernel stops starting new candidates after `budget_s`
seconds (the heuristic's is always timed).

Results are kept per device identity (backend, device name, compiler and its version,
flags, CPU) in `<cache dir>/schedules/<hash>.json`: a second process, or a second run of a
training script, searches nothing. Deleting the files is safe. An entry is used only when
its label names one of the kernel's current candidates; anything unreadable is ignored
(a malformed file with a warning) and rewritten.

Turn it on with `zyx.autotune()` (or ZYX_AUTOTUNE=1, or the config file's
`"autotune": {"enabled": true}`); plans built before are dropped so the next realization
re-plans with tuning. Off (the default), kernels get the heuristics' schedules and the
stored results are not read: what runs is the same on every machine."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from .backends import cache_dir, warn
from .files import write_atomic
from .errors import BackendError

SCHEMA = 1
DEFAULT_BUDGET_S = 10.0      # per kernel
DEFAULT_LAUNCHES = 3         # timed batches per candidate
MIN_GAIN = 0.03              # a candidate replaces the heuristic's only when this much faster
BATCH_S = 2e-3               # a timed batch repeats the launch for about this long
FINALISTS = 3                # candidates timed a second time


class Settings:
    """The autotuner's knobs (config section "autotune", as in the seeds)."""
    __slots__ = ("enabled", "budget_s", "launches", "save_to_disk", "progress")

    def __init__(self, enabled=False, budget_s=DEFAULT_BUDGET_S, launches=DEFAULT_LAUNCHES,
                 save_to_disk=True, progress=True):
        self.enabled = bool(enabled)
        self.budget_s = float(budget_s)
        self.launches = int(launches)
        self.save_to_disk = bool(save_to_disk)
        self.progress = bool(progress)
        if self.budget_s < 0 or self.launches < 1:
            raise ValueError(f"autotune: budget_s must be >= 0 and launches >= 1, got "
                             f"{budget_s!r} and {launches!r}")

    @classmethod
    def from_config(cls, config, environ=os.environ):
        """Settings from the config file's "autotune" section, ZYX_AUTOTUNE (0/1) over
        its "enabled"; malformed values are ignored with a warning."""
        section = config.get("autotune", {}) if isinstance(config, dict) else {}
        if not isinstance(section, dict):
            warn(f"zyx: ignoring config autotune={section!r} (not an object)")
            section = {}
        known = {k: section[k] for k in cls.__slots__ if k in section}
        env = environ.get("ZYX_AUTOTUNE")
        if env is not None and env.strip() != "":
            known["enabled"] = env.strip().lower() not in ("0", "false", "off", "no")
        try:
            return cls(**known)
        except (TypeError, ValueError) as e:
            warn(f"zyx: ignoring config autotune={section!r}: {e}")
            return cls(enabled=known.get("enabled", False) is True)


class ScheduleStore:
    """The chosen schedules of one device, {kernel key: entry}, kept in a JSON file."""

    def __init__(self, identity, directory=None, save=True):
        self.identity = identity
        self.save_enabled = save
        name = hashlib.sha256(identity.encode()).hexdigest()[:24] + ".json"
        self.path = os.path.join(directory or os.path.join(cache_dir(), "schedules"), name)
        self.entries = self._read(complain=True)

    def _read(self, complain=False):
        """The entries of the file ({} when missing, of another identity or schema, or
        malformed: then searched again and rewritten; `complain`: with a warning)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, RecursionError) as e:
            # ValueError: not JSON or not UTF-8; RecursionError: nested deeper than the
            # parser recurses ("[[[[...")
            if complain:
                why = "nested too deeply" if isinstance(e, RecursionError) else \
                    ((e.strerror if isinstance(e, OSError) else None) or str(e))[:200]
                warn(f"zyx: ignoring malformed autotune schedules {self.path} ({why}); "
                     f"kernels are tuned again")
            return {}
        if not isinstance(data, dict) or data.get("schema") != SCHEMA \
                or data.get("identity") != self.identity \
                or not isinstance(data.get("entries"), dict):
            return {}
        return {k: v for k, v in data["entries"].items()
                if isinstance(v, dict) and isinstance(v.get("label"), str)}

    def get(self, key, labels):
        """The index in `labels` of the stored choice for `key`, or None (no entry, or one
        naming a schedule that is not a candidate now: stale, ignored)."""
        entry = self.entries.get(key)
        if entry is None:
            return None
        try:
            return labels.index(entry["label"])
        except ValueError:
            return None

    def put(self, key, entry):
        self.entries[key] = entry
        if not self.save_enabled:
            return
        try:
            os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
            merged = dict(self._read())      # another process may have added entries
            merged.update(self.entries)
            self.entries = merged
            write_atomic(self.path, json.dumps({"schema": SCHEMA, "identity": self.identity,
                                                "entries": merged}).encode())
        except OSError as e:
            self.save_enabled = False
            warn(f"zyx: autotune results are not saved ({self.path}: {e})")


def kernel_key(kind, kernel):
    """A stable name of `kernel` across processes (its content, not Python's hash)."""
    return kind + ":" + hashlib.sha256(repr(kernel.key).encode()).hexdigest()[:32]


def lowering_key(kernel, info):
    """The stored name of `kernel`'s lowering schedule: its content and, where float32
    products may run on TF32 (zyx.set_float32_matmul_precision), that setting: the
    fastest schedule of one need not be the fastest of the other ("highest" keeps the
    name it always had). A convolution that zyx.backends.cudnn.allow_tf32 puts on TF32
    at "highest" is named as at "high"."""
    key = kernel_key("lowering", kernel)
    precision = info.float32_precision
    if precision == "highest" and info.conv_tf32:
        from .codegen.gpu import gemm      # (the CPU's tuning never gets here)
        p = gemm.plan(kernel.ops)
        if p is not None and gemm.reads_windows(p):
            precision = "high"
    return key if precision == "highest" else f"{key}:{precision}"


def _fill(dtype, numel):
    """Host data for a timing buffer: ones of `dtype` (bfloat16 travels as its bits)."""
    if dtype.name == "bfloat16":
        return np.full(max(numel, 1), 0x3F80, np.uint16)
    return np.ones(max(numel, 1), dtype.np)


class Tuner:
    """Searches schedules for the kernels of one device (build_plan calls it)."""

    def __init__(self, device, settings, stats, store=None):
        self.device = device
        self.settings = settings
        self.stats = stats
        self.store = store if store is not None else ScheduleStore(
            device.identity, save=settings.save_to_disk)
        self.searched = 0            # kernels searched by this tuner (progress numbering)

    # -- the two hooks ----------------------------------------------------------------------
    def choose_layout(self, base, labels, kernels):
        """Index of the fastest of `kernels` (the output layouts of the reduce kernel
        `base`, the heuristic's first), from the store or by timing them."""
        key = kernel_key("layout", base)
        found = self.store.get(key, labels)
        if found is not None:
            self.stats["schedules_reused"] += 1
            return found
        from ._core.passes import optimize
        dev = self.device
        runnable = [optimize(k) for k in kernels]
        if hasattr(dev, "compile_many"):
            try:
                programs = dev.compile_many(runnable)      # one compiler run for them all
            except BackendError as e:
                # a layout the compiler refuses must not fail the realization: keep the
                # heuristic's (compiled on its own by the plan, as without tuning)
                self._skipped(labels, e)
                return 0
            compile_one = programs.__getitem__
        else:
            compile_one = lambda i: dev.compile(runnable[i])    # noqa: E731
        best, times = self._search(labels, compile_one, runnable, release=False)
        self._remember(key, labels, best, times)
        return best

    def choose_lowering(self, kernel):
        """Pick the lowering schedule of `kernel` on a GPU device (device.schedules)."""
        dev = self.device
        if not hasattr(dev, "schedule_candidates"):
            return
        cands = dev.schedule_candidates(kernel)
        if len(cands) < 2:
            return
        labels = [label for label, _ in cands]
        key = lowering_key(kernel, dev.info())
        best = self.store.get(key, labels)
        if best is not None:
            self.stats["schedules_reused"] += 1
        else:
            best, times = self._search(
                labels, lambda i: dev.compile_variant(kernel, cands[i][1]),
                [kernel] * len(cands), release=True)
            self._remember(key, labels, best, times)
        if cands[best][1] is None:
            dev.schedules.pop(kernel, None)
        else:
            dev.schedules[kernel] = cands[best][1]

    # -- search ---------------------------------------------------------------------------
    def _remember(self, key, labels, best, times):
        self.stats["kernels_tuned"] += 1
        self.store.put(key, {"label": labels[best], "us": round(times[best] * 1e6, 3),
                             "default_us": round(times[0] * 1e6, 3),
                             "tried": len(times), "candidates": len(labels)})

    def _search(self, labels, compile_one, kernels, release):
        """(best index, {index: seconds}) of the candidates, timed within the budget."""
        t_start = time.perf_counter()
        self.searched += 1
        budget = self.settings.budget_s
        pool = self.device.pool
        buffers = {}                 # (dtype, numel) -> [buffer, ...] shared by candidates
        programs = {}
        times = {}
        try:
            for i in range(len(labels)):
                if i and time.perf_counter() - t_start > budget:
                    break
                try:
                    programs[i] = compile_one(i)
                    times[i] = self._time(programs[i], self._args(kernels[i], buffers, pool))
                except BackendError as e:
                    if i == 0:
                        raise        # the heuristic's schedule fails without tuning too
                    self._skipped(labels[i:i + 1], e)   # never worse than not tuning
                    programs.pop(i, None)
                    continue
                self._progress(labels, times, i + 1, t_start)
            finalists = sorted(times, key=times.get)[:FINALISTS]
            if len(finalists) > 1 and time.perf_counter() - t_start <= budget:
                for i in finalists:
                    again = self._time(programs[i], self._args(kernels[i], buffers, pool))
                    times[i] = min(times[i], again)
        finally:
            if release:
                for prog in programs.values():
                    self.device.release(prog)
            for bufs in buffers.values():
                for b in bufs:
                    pool.deallocate(b)
        best = min(times, key=times.get)
        if best != 0 and times[best] > times[0] * (1.0 - MIN_GAIN):
            best = 0
        self._progress(labels, times, len(labels), t_start, done=best)
        return best, times

    def _skipped(self, labels, error):
        """A candidate that failed to compile or launch is left out (ZYX_DEBUG=32 says)."""
        self.stats["schedules_failed"] = self.stats.get("schedules_failed", 0) + len(labels)
        if getattr(self.device, "debug", 0) & 32:
            print(f"zyx autotune: skipping {', '.join(labels)}: {error}", file=sys.stderr)

    def _args(self, kernel, buffers, pool):
        """Buffers for the kernel's arguments: one per argument, equal ones shared between
        candidates (they have the same arguments, maybe in another order)."""
        out = []
        used = {}
        for dtype, numel, _ in kernel.args:
            sig = (dtype, numel)
            k = used.get(sig, 0)
            used[sig] = k + 1
            have = buffers.setdefault(sig, [])
            if len(have) <= k:
                buf, _ = pool.allocate(max(numel, 1) * dtype.itemsize)
                pool.host_to_pool(_fill(dtype, numel), buf)
                have.append(buf)
            out.append(have[k])
        return out

    def _time(self, program, args):
        """Seconds per launch of `program`: the median of `launches` timed batches."""
        dev = self.device
        pool = dev.pool
        sync = getattr(dev, "synchronize", None) or (lambda: None)
        sync()
        t0 = time.perf_counter()
        dev.launch(program, pool, args)
        sync()
        first = max(time.perf_counter() - t0, 1e-7)
        reps = max(1, min(1000, int(BATCH_S / first)))
        samples = []
        for _ in range(self.settings.launches):
            t0 = time.perf_counter()
            for _ in range(reps):
                dev.launch(program, pool, args)
            sync()
            samples.append((time.perf_counter() - t0) / reps)
        samples.sort()
        return samples[len(samples) // 2]

    def _progress(self, labels, times, tried, t_start, done=None):
        if not self.settings.progress:
            return
        n = len(labels)
        width = 20
        fill = width * tried // n
        best = min(times, key=times.get)
        head = (f"zyx autotune: kernel {self.searched} [{'#' * fill}{'.' * (width - fill)}] "
                f"{len(times)}/{n} schedules, best {labels[best]} {times[best] * 1e6:.1f} us")
        err = sys.stderr
        tty = getattr(err, "isatty", lambda: False)()
        if done is None:
            if tty:
                err.write("\r" + head + "\x1b[K")
                err.flush()
            return
        line = (f"zyx autotune: kernel {self.searched}: {labels[done]} "
                f"{times[done] * 1e6:.1f} us (heuristic {times[0] * 1e6:.1f} us), "
                f"{len(times)}/{n} schedules in {time.perf_counter() - t_start:.2f} s")
        err.write(("\r" + line + "\x1b[K\n") if tty else line + "\n")
        err.flush()
