"""Plan replays on Vulkan: every dispatch of a plan recorded once into a command buffer,
submitted again whenever the plan runs over the same buffers.

Why: recording a dispatch through the Python bindings costs 15-30 us of host time
(descriptor-set lookup, barrier bookkeeping, three driver calls), which bounds small
training steps (an MLP step of 18 kernels took twice zyx CUDA's time, whose plans replay
as CUDA graphs). A training loop runs each step's plan over buffers the pool hands back
(parameters and optimizer states alternate between two or three sets, the batches
between the loader's few), so the same slot tables come back. A plan keeps up to
REPLAY_VARIANTS recordings, each keyed by the buffers of the slot table it was recorded
for (scheduler.layout_memory: slot 0 the arena of temporaries, bound at their offsets;
slots 1.. the leaves and the buffers that outlive the run). A run whose buffers match a
recording is one vkQueueSubmit, together with the batch of commands recorded before it
(uploads). A slot table seen for the first time is recorded into that batch, as a
dispatch-by-dispatch run would be (a plan run once, or over buffers that never come
back, makes no recording); seen again (among the last SEEN_TABLES), it gets a recording
of its own, the oldest dropped past REPLAY_VARIANTS.

A recording owns its command buffer (SIMULTANEOUS_USE: it may be submitted again while
an earlier submission is still running, which the queue orders before it) and binds the
context's cached descriptor sets (one per kernel and buffer set: a plan recorded again
for buffers it saw before allocates none). It starts with a global barrier (ordered
after everything submitted before) and puts a barrier before each dispatch that touches
a slot an earlier dispatch since the last barrier wrote (or writes one it read); the
arena counts as one slot, since temporaries whose lifetimes do not overlap share its
bytes.

Recordings are freed once the device has run their last submission: when the plan is
dropped, when one is evicted, when a buffer they bind is destroyed (the pool's trim
waits for the device first) or when the descriptor-set cache is emptied - `Recordings`
of the context keeps that bookkeeping.
"""
from __future__ import annotations

import itertools
import weakref

REPLAY_VARIANTS = 64     # recordings a plan keeps (a loop cycles batches x parameter sets)
SEEN_TABLES = 128        # slot tables a plan remembers having run once
_BIND_COMPUTE = 1        # VK_PIPELINE_BIND_POINT_COMPUTE


class Recording:
    """One recorded plan run: its command buffer, the serials of the buffers it binds, the
    number of the batch it was last submitted with, and its place (owner dict, key) in
    the plan's recordings."""
    __slots__ = ("cmd", "serials", "seq", "owner", "key", "__weakref__")

    def __init__(self, cmd, serials, owner, key):
        self.cmd = cmd
        self.serials = serials
        self.seq = 0
        self.owner = owner
        self.key = key


class Recordings:
    """A context's recordings by the buffers they bind, and the dropped ones waiting for
    the device to finish with them (freed by `collect`)."""

    def __init__(self, vk, device, cmd_pool):
        self.vk = vk
        self.device = device
        self.cmd_pool = cmd_pool
        self.by_buffer = {}      # _Handle.serial -> set of Recordings binding it
        self.retired = []        # dropped Recordings, freed once their batch has run
        self.recorded = 0        # recordings made (tests count them)
        self.replayed = 0        # submissions of an existing recording

    def add(self, rec):
        for s in rec.serials:
            self.by_buffer.setdefault(s, set()).add(rec)

    def drop(self, rec):
        """Take `rec` out of its plan and the index; freed by `collect` once run."""
        if rec.owner.get(rec.key) is rec:
            del rec.owner[rec.key]
        for s in rec.serials:
            users = self.by_buffer.get(s)
            if users is not None:
                users.discard(rec)
                if not users:
                    del self.by_buffer[s]
        self.retired.append(rec)

    def drop_all(self, owner):
        """Drop every recording of a plan (its launcher was garbage collected)."""
        for rec in list(owner.values()):
            self.drop(rec)

    def drop_everything(self):
        """Drop every recording (the descriptor sets they bind were freed)."""
        for rec in {r for users in self.by_buffer.values() for r in users}:
            self.drop(rec)

    def forget_buffer(self, serial):
        """Drop the recordings binding the buffer being destroyed."""
        for rec in list(self.by_buffer.get(serial, ())):
            self.drop(rec)

    def collect(self, done):
        """Free the dropped recordings whose last submission is batch `done` or older."""
        if not self.retired:
            return
        vk, keep = self.vk, []
        for rec in self.retired:
            if rec.seq > done:
                keep.append(rec)
                continue
            vk.vkFreeCommandBuffers(self.device, self.cmd_pool, 1, [rec.cmd])
        self.retired = keep


class VulkanPlanLaunches:
    """Every dispatch of a plan on one Vulkan device (VulkanDevice.prepare_launches), run
    over the plan's slot table by replaying a recording (see the module docstring)."""

    def __init__(self, device, kernels, nslots):
        ctx = device.ctx
        self.ctx = ctx
        vk = self.vk = device.vk
        # a global barrier's stages: every compute and transfer command
        self.every = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        self.steps = []          # (program, [(kind, x)] per binding: "t" slot, "a" arena
        for program, slots in kernels:    # offset, "s" a scratch _Handle)
            if program.scratch_bytes and program.scratch is None:
                program.scratch = [ctx.new_buffer(nb, host=False)
                                   for nb in program.scratch_bytes]
            binds = list(slots) + [("s", h) for h in (program.scratch or ())]
            self.steps.append((program, binds))
        # per kernel: the index after its last dispatch
        self.kernel_ends = list(itertools.accumulate(len(p.pipelines) for p, _ in self.steps))
        self.recordings = {}     # slot table key -> Recording, oldest first
        self.seen = {}           # slot tables run once without a recording, oldest first
        weakref.finalize(self, ctx.recordings.drop_all, self.recordings)

    def run(self, table, stops=None):
        """Submit the plan over `table` (Buffers; None for an empty arena). `stops`
        ([(launch index, [fn...])]): each fn is called once every dispatch was queued."""
        key = tuple(None if b is None else b.handle.serial for b in table)
        ctx = self.ctx
        rec = self.recordings.get(key)
        if rec is not None:
            ctx.recordings.replayed += 1
            rec.seq = ctx.submit_with(rec.cmd, self)
        elif self.seen.pop(key, False):
            rec = self._record(table, key)
            if rec is None:
                self._one_kernel_at_a_time(table)
            else:
                rec.seq = ctx.submit_with(rec.cmd, self)
        else:
            self.seen[key] = True
            if len(self.seen) > SEEN_TABLES:
                del self.seen[next(iter(self.seen))]
            self._into_batch(table)
        for _, fns in stops or ():
            for fn in fns:
                fn()

    def _into_batch(self, table):
        """Record the plan's dispatches into the context's pending batch (a slot table
        met for the first time)."""
        found = self._sets(table)         # (first: a full set cache waits for the device)
        if found is None:
            self._one_kernel_at_a_time(table)
        else:
            self._batch_record(self.steps, found[0])

    def _one_kernel_at_a_time(self, table):
        """Record the plan into the pending batches one kernel at a time, each fetching
        its set first (a fetch that empties the set cache waits for the device, which
        submits the batch): for a plan with more kernels than the cache holds sets."""
        for program, binds in self.steps:
            self._batch_record([(program, binds)], [self._set(table, program, binds)])

    def _batch_record(self, steps, sets):
        """Record `steps` (with their descriptor sets) into the context's pending batch,
        between two global barriers (the batch's own hazard sets name buffers, not slots:
        they start afresh after them)."""
        self.ctx.record_fenced(lambda cmd: self._dispatches(cmd, steps, sets), self.every,
                               sum(len(program.pipelines) for program, _ in steps), self)

    def _record(self, table, key):
        """A Recording of the plan over `table`'s buffers, kept under `key`; None when
        the plan needs more descriptor sets than the context's cache holds."""
        vk, ctx = self.vk, self.ctx
        found = self._sets(table)
        if found is None:                 # more kernels than the set cache holds
            return None
        if len(self.recordings) >= REPLAY_VARIANTS:
            ctx.recordings.drop(next(iter(self.recordings.values())))
        sets, serials = found
        cmd = vk.vkAllocateCommandBuffers(ctx.device, vk.VkCommandBufferAllocateInfo(
            commandPool=ctx.cmd_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY,
            commandBufferCount=1))[0]
        vk.vkBeginCommandBuffer(cmd, vk.VkCommandBufferBeginInfo(
            flags=vk.VK_COMMAND_BUFFER_USAGE_SIMULTANEOUS_USE_BIT))
        ctx.barrier(cmd, self.every, 0)  # after everything submitted before
        self._dispatches(cmd, self.steps, sets)
        vk.vkEndCommandBuffer(cmd)
        rec = Recording(cmd, frozenset(serials), self.recordings, key)
        self.recordings[key] = rec
        ctx.recordings.add(rec)
        ctx.recordings.recorded += 1
        return rec

    def _sets(self, table):
        """(descriptor set or None per kernel, serials of the buffers bound) of the plan
        over `table`, from the context's set cache; fetched again whole if the cache was
        emptied meanwhile (which frees the sets fetched before). None when it is emptied
        again: the plan needs more sets than the cache holds."""
        ctx = self.ctx
        cache = ctx.sets
        for _ in range(2):
            clears = cache.clears
            sets, serials = [], set()
            for program, binds in self.steps:
                sets.append(self._set(table, program, binds, serials))
            if cache.clears == clears:
                return sets, serials
        return None

    def _set(self, table, program, binds, serials=None):
        """A kernel's descriptor set over `table` (None when it binds nothing), its
        buffers' serials added to `serials`."""
        if not binds:
            return None
        ctx = self.ctx
        bound = [self._bound(ctx, table, kind, x) for kind, x in binds]
        if serials is not None:
            serials.update(h.serial for h, _ in bound)
        return ctx.sets.get(program.nargs, program.set_layout, bound, ctx.wait)

    def _dispatches(self, cmd, steps, sets):
        """Record every dispatch of `steps` into `cmd` with its descriptor set (`sets`,
        per kernel), a barrier before each one that touches a slot written (or writes
        one read) since the last."""
        vk, ctx = self.vk, self.ctx
        lib, ffi = vk.lib, vk.ffi
        written, read = set(), set()
        for (program, binds), dset in zip(steps, sets):
            slots = [self._resource(kind, x) for kind, x in binds]
            writes = {s for s, ro in zip(slots, program.readonly) if not ro}
            for pipe, (gx, gy) in zip(program.pipelines, program.grids):
                if not (written.isdisjoint(slots) and read.isdisjoint(writes)):
                    ctx.barrier(cmd, self.every, 0)
                    written.clear()
                    read.clear()
                read.update(slots)
                written.update(writes)
                lib.vkCmdBindPipeline(cmd, _BIND_COMPUTE, pipe)
                if dset is not None:
                    lib.vkCmdBindDescriptorSets(cmd, _BIND_COMPUTE, program.layout, 0, 1,
                                                dset, 0, ffi.NULL)
                lib.vkCmdDispatch(cmd, gx, gy, 1)

    @staticmethod
    def _bound(ctx, table, kind, x):
        """(_Handle, byte offset) a binding reads: a slot's buffer, the arena at an offset
        (an empty temporary, at the arena's end or with no arena at all, binds the
        context's placeholder: a binding has at least one element), or a program's
        scratch buffer."""
        if kind == "s":
            return x, 0
        if kind == "a":
            arena = table[0]
            if arena is None or x >= arena.handle.size:
                return ctx.placeholder(), 0
            return arena.handle, x
        return table[x].handle, 0

    @staticmethod
    def _resource(kind, x):
        """What a binding's hazards are tracked by: its slot, the whole arena, or the
        scratch buffer."""
        if kind == "a":
            return "a"
        if kind == "s":
            return ("s", x.serial)
        return x
