"""Dummy backend: allocates bookkeeping-only buffers and "compiles"/"launches" without
running anything. It lets scheduler and fusion tests count kernels, plans and bytes without
a compiler. Used only when asked for by name (`initialize_backends(..., only=["dummy"])`,
`zyx._RT.init(only=["dummy"])`), never in place of a backend that failed to start: values
read back are zeros."""
from __future__ import annotations

import numpy as np

from ..errors import AllocationError
from ..codegen.target import DeviceInfo
from . import Buffer, MemoryPool


class DummyMemoryPool(MemoryPool):
    name = "dummy"

    def __init__(self, total_bytes=1 << 40):
        super().__init__(total_bytes)
        self.allocations = 0

    def allocate(self, nbytes):
        if nbytes > self.free_bytes:
            raise AllocationError(f"dummy pool: {nbytes} bytes requested, {self.free_bytes} free")
        self.used_bytes += nbytes
        self.allocations += 1
        return Buffer(self, object(), nbytes), None

    def deallocate(self, buf, wait_events=()):
        self.used_bytes -= buf.nbytes
        buf.handle = None

    def host_to_pool(self, src, dst, wait_events=()):
        return None

    def pool_to_host(self, src, dst, wait_events=()):
        dst.reshape(-1).view(np.uint8)[:] = 0


class DummyProgram:
    __slots__ = ("kernel",)

    def __init__(self, kernel):
        self.kernel = kernel


class DummyDevice:
    def __init__(self, pool, debug=0):
        self.pool = pool
        self.debug = debug
        self.kernels = []        # every kernel "compiled", in order
        self.compiled = 0        # how many (zyx.stats' compiler_runs, as other devices)
        self.launched = 0
        self._programs = {}
        self._info = DeviceInfo(name="dummy", compute=1.0)

    def info(self):
        return self._info

    def compile(self, kernel):
        prog = self._programs.get(kernel)
        if prog is None:
            prog = self._programs[kernel] = DummyProgram(kernel)
            self.kernels.append(kernel)
            self.compiled += 1
        return prog

    def launch(self, program, pool, args, wait_events=()):
        self.launched += 1
        return None

    def release(self, program):
        self._programs.pop(program.kernel, None)


def initialize(cfg, debug=0):
    pool = DummyMemoryPool(int(cfg.get("bytes", 1 << 40)))
    return [pool], [DummyDevice(pool, debug)]
