# cython: language_level=3
"""Scheduler: turns a realization request into a plan and runs it.

A plan is the kernels of a subgraph (already compiled for the chosen device), the bytes
each stored node needs and when each temporary can be freed. Plans are cached by the
subgraph's structural key (graph.collect), so a training loop that rebuilds the same graph
every step skips kernelization, optimization and compilation entirely."""
import sys
import time

from cpython.exc cimport PyErr_CheckSignals

from ..errors import AllocationError
from .graph import LEAF
from .kernelizer import kernelize
from .kernel import format_kernel
from .passes import optimize


cdef double _trimmed_mean(list xs):
    """Mean without the largest sample (when there are three or more): one run that the
    hypervisor or another process stalled for milliseconds must not decide a mode, while
    a mode that is slow in many runs still shows."""
    cdef double total = sum(xs)
    if len(xs) >= 3:
        return (total - max(xs)) / (len(xs) - 1)
    return total / len(xs)


cdef enum:
    _WINDOW = 8          # ThreadChoice.WINDOW: runs watched for the current mode
    _PROBE = 4           # ThreadChoice.PROBE: runs of each mode per (interleaved) probe
cdef double _DRIFT = 2.0


cdef class ThreadChoice:
    """Whether a plan program runs on the thread team or on the calling thread, measured
    and kept under watch.

    Waking the team and the barrier after every kernel cost tens of microseconds; on a
    small plan (a training step of a small model) that is more than the threads save, on
    a big one it is nothing. And the answer changes while a program runs: when another
    process takes a core, or the hypervisor steals the team's virtual CPU, each barrier
    waits for a thread that is not running (an MLP step measured 4-20 ms parallel against
    1.5 ms on one thread under one busy process). So:

    - the first runs alternate between the two modes and after RUNS of each (the cold
      first run aside) the faster is kept; plans whose first two runs (one per mode) both
      took longer than LONG_S go parallel at once and start at the longest probe
      interval: barriers are noise there;
    - afterwards every run is timed; every `interval` runs (or at once when the last
      WINDOW runs got DRIFT times slower than at the last decision) a probe runs the two
      modes in turn, PROBE runs each, and the other mode is taken when its mean is below
      SWITCH times the current one's. A probe that loses doubles the interval (up to
      PROBE_MAX), so a plan that is settled pays a few runs in a thousand for the check.

    Every comparison is between runs interleaved in time and uses means without the
    largest run: a noisy machine stalls single runs for milliseconds now and then, and a
    comparison against a window that held such a stall (or a decision on one stalled
    run) sent plans back and forth between the modes, spending half of a benchmark on the
    slower one. Means rather than medians otherwise: under load a parallel plan is fast
    most runs and 10x slower in many of the rest, and the rest is what the user waits for."""
    RUNS = 4
    LONG_S = 2e-3
    COLD_PARALLEL = 1.5  # the cold parallel run within this many serial runs: no contest
    WINDOW = _WINDOW
    PROBE = _PROBE
    PROBE_FIRST = 32
    PROBE_MAX = 2048
    SWITCH = 0.85
    DRIFT = _DRIFT
    cdef public object parallel      # None while measuring, then the mode in use
    cdef public int runs, interval, until_probe, probing, switches
    cdef public double reference     # current mode's time at the last decision
    cdef public tuple times          # first measurements: (serial, parallel) seconds
    cdef double ring[_WINDOW]        # last WINDOW runs of the current mode
    cdef int nring, pos
    cdef list probe_times            # probe runs: (other mode, current mode)

    def __init__(self, can_choose):
        self.parallel = None if can_choose else True
        self.times = ([], [])
        self.runs = 0
        self.nring = 0
        self.probe_times = [[], []]
        self.interval = self.PROBE_FIRST
        self.until_probe = self.PROBE_FIRST
        self.probing = 0
        self.switches = 0
        self.reference = 0.0
        if not can_choose:
            self.until_probe = -1

    @property
    def recent(self):
        """The last (up to WINDOW) run times of the current mode, oldest first."""
        if self.nring < _WINDOW:
            return [self.ring[i] for i in range(self.nring)]
        return [self.ring[(self.pos + i) % _WINDOW] for i in range(_WINDOW)]

    cdef void _restart_window(self, list times):
        self.nring = self.pos = 0
        for t in times[-_WINDOW:]:
            self._push(t)

    cdef inline void _push(self, double seconds):
        if self.nring < _WINDOW:
            self.nring += 1
        self.ring[self.pos] = seconds
        self.pos = (self.pos + 1) % _WINDOW

    cdef double _window_mean(self):
        """Mean of the full window without its slowest run (_trimmed_mean on the C ring:
        this runs after every plan run, so no list is made)."""
        cdef double total = 0.0, top = 0.0
        cdef int i
        for i in range(_WINDOW):
            total += self.ring[i]
            top = max(top, self.ring[i])
        return (total - top) / (_WINDOW - 1)

    @property
    def watching(self):
        """True while runs are timed (False: nothing parallel in the plan to choose)."""
        return self.parallel is None or self.until_probe >= 0

    def next(self):
        """Mode of the next run (True = parallel)."""
        if self.parallel is None:
            return self.runs == 0 or self.runs % 2 == 0
        if self.probing:                 # other mode first, then in turn
            return (not self.parallel) if self.probing % 2 == 0 else self.parallel
        return self.parallel

    def record(self, parallel, double seconds, int debug):
        """Account one run of `seconds` in mode `parallel` (as next() said)."""
        if self.parallel is None:
            self._measure(parallel, seconds, debug)
        elif self.until_probe < 0:
            return                       # nothing parallel in the plan: no choice
        elif self.probing:
            self._probe(parallel, seconds, debug)
        else:
            self._keep(seconds)

    cdef _measure(self, parallel, double seconds, int debug):
        self.runs += 1
        if self.runs == 1:              # cold (first touch of the arena): kept aside
            self.reference = seconds
            return
        if (self.runs == 2 and seconds > self.LONG_S and self.reference > self.LONG_S
                and self.reference < self.COLD_PARALLEL * seconds):
            # long in both modes (a slow first parallel run alone may be a loaded machine),
            # and the cold parallel run not far slower than the serial one (under a busy
            # core a 2.4 ms sampling step took 110 ms parallel, every barrier waiting out a
            # time slice: those plans are measured like short ones): parallel, and the
            # other mode probed only rarely or when the time doubles
            self.parallel = True
            self.interval = self.until_probe = self.PROBE_MAX
            self.reference = 0.0         # set from the first full window (_keep)
            return
        self.times[1 if parallel else 0].append(seconds)
        if min(len(t) for t in self.times) >= self.RUNS:
            s, p = _trimmed_mean(self.times[0]), _trimmed_mean(self.times[1])
            self.parallel = p < s
            self._restart_window(self.times[1 if self.parallel else 0])
            self.reference = min(s, p)
            if debug & 2:
                print(f"zyx: plan runs {'parallel' if self.parallel else 'on one thread'} "
                      f"(mean {s * 1e6:.0f} us serial, {p * 1e6:.0f} us parallel)",
                      file=sys.stderr)

    cdef _keep(self, double seconds):
        self._push(seconds)
        self.until_probe -= 1
        if self.reference == 0.0 and self.nring == _WINDOW:
            self.reference = self._window_mean()
        if self.until_probe <= 0 or (self.nring == _WINDOW and
                                     self._window_mean() > _DRIFT * self.reference):
            self.probing = 2 * _PROBE
            self.probe_times = [[], []]
            self.until_probe = 0

    cdef _probe(self, parallel, double seconds, int debug):
        self.probe_times[0 if parallel != self.parallel else 1].append(seconds)
        self.probing -= 1
        if self.probing:
            return
        alt, cur = _trimmed_mean(self.probe_times[0]), _trimmed_mean(self.probe_times[1])
        if alt < self.SWITCH * cur:
            self.parallel = not self.parallel
            self._restart_window(self.probe_times[0])
            self.switches += 1
            self.reference = alt
            if debug & 2:
                print(f"zyx: plan now runs {'parallel' if self.parallel else 'on one thread'}"
                      f" (mean {alt * 1e6:.0f} us against {cur * 1e6:.0f} us)",
                      file=sys.stderr)
        else:
            self._restart_window(self.probe_times[1])
            self.interval = min(2 * self.interval, self.PROBE_MAX)
            self.reference = cur
        self.until_probe = self.interval


class Plan:
    __slots__ = ("steps", "nbytes", "free_after", "targets", "leaves", "device", "stored",
                 "nkernels", "runner", "launcher", "slot", "owned", "root", "arena_bytes",
                 "nslots", "threads", "last_used", "params", "bound", "kernel_of")

    def __init__(self, steps, nbytes, free_after, targets, leaves, device, stored):
        self.steps = steps
        self.nbytes = nbytes
        self.free_after = free_after
        self.targets = targets
        self.leaves = leaves
        self.device = device
        self.stored = stored
        self.nkernels = sum(1 for st in steps if st.kernel is not None and nbytes.get(st.args[0]))
        self.runner = None     # a device-side program running every kernel (compile_plan)
        self.launcher = None   # the device's launches of every kernel (prepare_launches)
        self.last_used = 0     # the runtime's realization count when it last ran (plan LRU)
        self.params = None     # values read at launch (runtime._values_plan), if any
        self.bound = None      # a plan at a bound on a growing size: its bounds.BoundGraph
        self.kernel_of = None  # position -> index of the launched kernel writing it (ready)


ARENA_ALIGN = 64


def layout_memory(plan, int align=ARENA_ALIGN):
    """Where every stored position lives when the device runs the whole plan at once.

    Leaves and the buffers that outlive the plan (targets, and a temporary a target
    aliases) get their own pool buffers, passed as slots 1.. of a pointer table. Every
    other temporary gets an offset in one arena (slot 0) allocated per run; temporaries
    whose lifetimes do not overlap share bytes (first fit), so memory stays near the
    peak a kernel-by-kernel run would need while the host allocates once. `align`: the
    arena offsets' alignment in bytes (a multiple of ARENA_ALIGN: OpenCL sub-buffers
    must start at the device's base address alignment)."""
    steps = plan.steps
    root = {}
    for st in steps:
        if st.alias:
            out, src = st.args
            root[out] = root.get(src, src)
    leaves = set(plan.leaves)
    owned = []
    for t in plan.targets:
        r = root.get(t, t)
        if r not in leaves and plan.stored[r] and r not in owned:
            owned.append(r)
    slot = {}
    for p in plan.leaves:
        slot[p] = ("t", len(slot) + 1)
    for p in owned:
        slot[p] = ("t", len(slot) + 1)
    # lifetimes of arena temporaries, in kernel steps: [written, last read]
    start, end = {}, {}
    for si, st in enumerate(steps):
        if st.alias:
            continue
        for o in st.args[:st.nout]:
            out = root.get(o, o)
            if out not in slot:
                start.setdefault(out, si)
                end.setdefault(out, si)
        for a in st.args[st.nout:]:
            r = root.get(a, a)
            if r not in slot:
                end[r] = si
    live = []          # (offset, size, last step) of placed temporaries
    top = 0
    for p in sorted(start, key=start.get):
        size = (plan.nbytes.get(p, 0) + align - 1) // align * align
        live = [b for b in live if b[2] >= start[p]]
        off = 0
        for b in sorted(live):
            if off + size <= b[0]:
                break
            off = max(off, b[0] + b[1])
        live.append((off, size, end[p]))
        top = max(top, off + size)
        slot[p] = ("a", off)
    for p, r in root.items():
        if r in slot:
            slot[p] = slot[r]
    plan.slot = slot
    plan.owned = owned
    plan.root = root
    plan.arena_bytes = top
    plan.nslots = 1 + len(plan.leaves) + len(owned)


def _check_addressable(graph, list order):
    """Kernels index with 64-bit integers: a tensor of 2**63 bytes or more cannot be
    computed (nor stored anywhere); say so instead of overflowing in the index math."""
    cdef object n
    for nid in order:
        node = graph.get(nid)
        n = node.dtype.itemsize
        for d in node.shape:
            n *= d
        if n >= 2 ** 63:
            raise AllocationError(
                f"a tensor of shape {tuple(node.shape)} and dtype {node.dtype} would take "
                f"{n} bytes, beyond what 64-bit indices address (2**63 bytes)")


def build_plan(graph, list order, list target_ids, device, int debug=0, dict params=None,
               tuner=None):
    """`params`: kernelize's (values read at launch from parameter leaves at the end of
    `order`); `tuner`: a tuning.Tuner for `device` (None: heuristic schedules), which
    picks CPU kernels' output layouts in kernelize and GPU kernels' launch schedules
    before they are compiled."""
    t0 = time.perf_counter()
    _check_addressable(graph, order)
    info = device.info()
    steps, stored = kernelize(graph, order, target_ids, info.preferred_vector_size,
                              info.register_tiles, info.sum_block, params, tuner,
                              info.tile_min_outputs, info.window_tiles, info.own_tiles)
    pos = {nid: p for p, nid in enumerate(order)}
    targets = [pos[t] for t in target_ids]
    nbytes = {}
    for p, s in enumerate(stored):
        if s:
            node = graph.get(order[p])
            n = node.dtype.itemsize
            for d in node.shape:
                n *= d
            nbytes[p] = n
    # last step that reads each temporary (targets are kept)
    last = {}
    for si, st in enumerate(steps):
        for a in st.args[st.nout:]:
            if stored[a]:
                last[a] = si
    keep = set(targets)
    free_after = [[] for _ in steps]
    for p, si in last.items():
        if p not in keep:
            free_after[si].append(p)
    live = [st for st in steps if st.kernel is not None]
    for st in live:
        st.kernel = optimize(st.kernel)
        if debug & 4:
            print(format_kernel(st.kernel), file=sys.stderr)
    leaves = [p for p in range(len(order)) if graph.get(order[p]).op == LEAF]
    plan = Plan(steps, nbytes, free_after, targets, leaves, device, stored)
    if hasattr(device, "compile_plan"):
        # the device runs the whole plan from one call (one launch, one thread team)
        layout_memory(plan)
        plan.runner = device.compile_plan(
            [(st.kernel, [plan.slot[a] for a in st.args]) for st in live
             if nbytes.get(st.args[0])], plan.nslots)
        plan.threads = ThreadChoice(getattr(plan.runner, "parallel", False))
    else:
        if tuner is not None:
            for st in live:
                if nbytes.get(st.args[0]):
                    tuner.choose_lowering(st.kernel)
        if hasattr(device, "compile_many"):
            programs = device.compile_many([st.kernel for st in live])
        else:
            programs = [device.compile(st.kernel) for st in live]
        for st, prog in zip(live, programs):
            st.program = prog
        if hasattr(device, "prepare_launches"):
            prepare_launches(plan, device, live)
    if debug & 2:
        print(f"zyx: plan of {len(steps)} kernel(s) for {len(order)} nodes in "
              f"{(time.perf_counter() - t0) * 1e3:.2f} ms", file=sys.stderr)
    return plan


def prepare_launches(plan, device, list live):
    """Give `plan` the device's launch record of all its kernels (`device.prepare_launches`:
    each kernel's launches with a parameter block packed once, only the buffers that
    moved since the last run rewritten), run by execute_runner with one call and the
    memory of layout_memory (one arena for the temporaries). A device that declines
    (returns None: switched off, or a kernel it cannot prepare) keeps the kernel-by-kernel
    path."""
    layout_memory(plan, getattr(device, "arena_align", ARENA_ALIGN))
    launcher = device.prepare_launches(
        [(st.program, [plan.slot[a] for a in st.args]) for st in live
         if plan.nbytes.get(st.args[0])], plan.nslots)
    if launcher is not None:
        plan.launcher = launcher


def leaf_buffers(plan, graph, list order, pool, move_to_pool):
    """{position: buffer} of the plan's leaves, each in `pool` (moved there the first time
    a leaf from another pool, e.g. the disk, is read)."""
    cdef dict bufs = {}
    cdef Py_ssize_t p
    for p in plan.leaves:
        node = graph.get(order[p])
        b = node.buffer
        if b.pool is not pool:
            b = move_to_pool(node, pool)
        bufs[p] = b
    return bufs


def execute_runner(plan, graph, list order, pool, move_to_pool, stats, int debug=0,
                   verify=None, dict ready=None):
    """Run a plan compiled into one device program (`plan.runner`) or prepared as one
    launch record (`plan.launcher`): allocate the arena and the buffers that outlive the
    run, fill the slot table (addresses for a runner, Buffers for a launcher), make one
    call. `verify(buffer_of)` (the runtime's value checks) runs before any target is bound.
    `ready`: see execute (a launcher calls them between its launches, a runner after its
    one call).

    Anything raised before the results reach the graph (an allocation failure, a
    KeyboardInterrupt during the call, a failed check) frees what this run allocated:
    the targets stay lazy and the pool is as before."""
    cdef list table = [None if plan.launcher is not None else 0] * plan.nslots
    cdef dict bufs = leaf_buffers(plan, graph, order, pool, move_to_pool)
    cdef Py_ssize_t p
    cdef list made = []         # buffers allocated here and not yet handed to the graph
    cdef bint launcher = plan.launcher is not None
    cdef list waits = None      # events of leaves still being written (other queues)
    calls = None                # _ReadyCalls of `ready`
    free = graph.free_buffer
    slot = plan.slot
    for p in plan.leaves:
        b = bufs[p]
        if launcher:
            table[slot[p][1]] = b
            if b.event is not None:
                waits = (waits or []) + [b.event]
        else:
            table[slot[p][1]] = b.ptr
    nbytes = plan.nbytes
    root = plan.root
    arena = None
    try:
        for p in plan.owned:
            b, _ = pool.allocate(nbytes[p])
            made.append(b)
            bufs[p] = b
            table[slot[p][1]] = b if launcher else b.ptr
        if plan.arena_bytes:
            arena, _ = pool.allocate(plan.arena_bytes)
            made.append(arena)
            table[0] = arena if launcher else arena.ptr
        calls = _ready_calls(plan, ready, bufs, root, made) if ready else None
        if calls is not None and verify is None:
            _fire(calls, -1)              # leaves: ready before anything runs
        if launcher:
            if waits:
                pool.sync_events(waits)
            if calls is None or verify is not None:
                plan.device.run_launches(plan.launcher, table)
            else:
                plan.device.run_launches(plan.launcher, table,
                                         _launch_stops(plan.launcher, calls))
        else:
            _run_program(plan, table, debug)
        pool.submit_queued()
        # a Ctrl-C that arrived during the call is raised here, while `made` still says
        # what to free, not later inside the graph bookkeeping below
        PyErr_CheckSignals()
        if verify is not None:
            verify(lambda p: bufs[root.get(p, p)])
        if calls is not None:
            _fire(calls, None)            # a runner's, or all of them once checked
    except BaseException:
        for b in made:
            if calls is None or not _handed(calls, b):   # a collective may still write it
                free(b)
        raise
    stats["kernels_launched"] += plan.nkernels
    if arena is not None:
        free(arena)
    seen = set()
    for p in plan.targets:
        if p in seen or not plan.stored[p]:
            continue
        seen.add(p)
        r = root.get(p, p)
        b = bufs[r]
        if r != p:
            b.refs += 1      # shared with the aliased leaf / buffer
        graph.set_buffer(order[p], b)
    for p in plan.owned:     # owned temporaries only a target's alias kept alive
        if p not in seen:
            free(bufs[p])


class _ReadyCall:
    """One `ready` callback of a run: `fn(buffer, fresh)` once the kernel at index
    `kernel` of the plan's launches was queued (-1: a leaf, ready before any)."""
    __slots__ = ("kernel", "fn", "buffer", "fresh", "fired")

    def __init__(self, kernel, fn, buffer, fresh):
        self.kernel = kernel
        self.fn = fn
        self.buffer = buffer
        self.fresh = fresh
        self.fired = False

    def fire(self):
        if not self.fired:
            self.fired = True
            self.fn(self.buffer, self.fresh)


def _kernel_of(plan):
    """{position: index among the plan's launched kernels of the kernel writing it}."""
    if plan.kernel_of is None:
        kernel_of, k = {}, 0
        for st in plan.steps:
            if st.kernel is not None and plan.nbytes.get(st.args[0]):
                for o in st.args[:st.nout]:
                    kernel_of[o] = k
                k += 1
        plan.kernel_of = kernel_of
    return plan.kernel_of


def _ready_calls(plan, dict ready, dict bufs, dict root, list made):
    """The _ReadyCalls of `ready` ({target position: fn}) in launch order. A target is
    `fresh` when the run computed it into a buffer of its own (not a leaf's, not one
    another target holds too)."""
    kernel_of = _kernel_of(plan)
    leaves = set(plan.leaves)
    users = {}                  # buffer position -> how many targets it holds
    for p in set(plan.targets):
        r = root.get(p, p)
        users[r] = users.get(r, 0) + 1
    calls = []
    for p, fn in ready.items():
        r = root.get(p, p)
        # a buffer the run made that holds this target alone (itself, or a temporary
        # only this target's reshape keeps)
        fresh = r not in leaves and users.get(r) == 1 and any(bufs[r] is b for b in made)
        calls.append(_ReadyCall(-1 if r in leaves else kernel_of.get(r, -1), fn, bufs[r],
                                fresh))
    calls.sort(key=lambda c: c.kernel)
    return calls


def _fire(list calls, upto):
    """Fire the calls whose kernel index is at most `upto` (None: all)."""
    for c in calls:
        if upto is None or c.kernel <= upto:
            c.fire()


def _launch_stops(launcher, list calls):
    """[(launch end, [fire...])]: where a launcher stops to call back, from its
    `kernel_ends` (the launch index after each kernel's last launch)."""
    stops = {}
    ends = launcher.kernel_ends
    for c in calls:
        if c.kernel >= 0:
            stops.setdefault(ends[c.kernel], []).append(c.fire)
    return sorted(stops.items())


def _handed(list calls, b):
    return any(c.fired and c.buffer is b for c in calls)


cdef void _run_program(plan, list table, int debug) except *:
    """One call of the plan's program, on the thread team or not as its ThreadChoice says
    (timed while the choice is being measured)."""
    cdef ThreadChoice threads = plan.threads
    parallel = threads.next()
    if threads.parallel is None or threads.until_probe >= 0:
        t0 = time.perf_counter()
        plan.device.run_plan(plan.runner, table, parallel)
        threads.record(parallel, time.perf_counter() - t0, debug)
    else:
        plan.device.run_plan(plan.runner, table, parallel)


def execute(plan, graph, list order, pool, move_to_pool, stats, int debug=0, verify=None,
            dict ready=None):
    """Run `plan` on the subgraph `order`; realized targets become LEAF nodes.
    `verify`: see execute_runner. `ready` ({target position: fn}): each fn is called
    once, `fn(buffer, fresh)`, as soon as the kernel computing that target was queued
    (on a GPU it may still be running; before the run ends, while later kernels are
    still to be queued) with the buffer that will hold the value; `fresh` says the run
    computed it into a buffer of its own (not a leaf's or another target's), which the
    callback may then write through work ordered after that kernel (a collective). With
    value checks (`verify`) the calls come after the run, once the values are checked."""
    cdef dict bufs = {}
    cdef Py_ssize_t p, si
    if plan.runner is not None or plan.launcher is not None:
        execute_runner(plan, graph, order, pool, move_to_pool, stats, debug, verify, ready)
        return
    device = plan.device
    bufs = leaf_buffers(plan, graph, order, pool, move_to_pool)
    nbytes = plan.nbytes
    free_after = plan.free_after
    launched = 0
    free = graph.free_buffer
    calls = []               # _ReadyCalls in the order their targets are computed
    aliased = {st.args[1] for st in plan.steps if st.alias} if ready else ()
    if ready:
        for p in plan.leaves:
            if p in ready:
                calls.append(_ReadyCall(-1, ready[p], bufs[p], False))
    try:
        if verify is None:
            _fire(calls, None)
        for si, st in enumerate(plan.steps):
            out = st.args[0]
            if st.alias:   # a contiguous reshape of a buffer: share it, copy nothing
                buf = bufs[st.args[1]]
                buf.refs += 1
                bufs[out] = buf
                if ready and out in ready:
                    calls.append(_ReadyCall(si, ready[out], buf, False))
                    if verify is None:
                        calls[-1].fire()
                for p in free_after[si]:
                    free(bufs.pop(p))
                continue
            for o in st.args[:st.nout]:
                bufs[o], ev = pool.allocate(nbytes[o])
            if st.program is not None and nbytes[out]:
                ev = device.launch(st.program, pool, [bufs[a] for a in st.args],
                                   [bufs[a].event for a in st.args[st.nout:]
                                    if bufs[a].event is not None])
                for o in st.args[:st.nout]:
                    bufs[o].event = ev
                launched += 1
            if ready:
                for o in st.args[:st.nout]:
                    if o in ready:
                        calls.append(_ReadyCall(si, ready[o], bufs[o], o not in aliased))
                        if verify is None:
                            calls[-1].fire()
            for p in free_after[si]:
                free(bufs.pop(p))
        pool.submit_queued()
        PyErr_CheckSignals()
        if verify is not None:
            verify(bufs.__getitem__)
            _fire(calls, None)
    except BaseException:     # as in execute_runner: free what this run holds, re-raise
        leaves = set(plan.leaves)
        for p, buf in bufs.items():
            if p not in leaves and not _handed(calls, buf):
                free(buf)
        raise
    stats["kernels_launched"] += launched
    seen = set()
    for p in plan.targets:
        if p in seen or not plan.stored[p]:
            continue
        seen.add(p)
        graph.set_buffer(order[p], bufs[p])
