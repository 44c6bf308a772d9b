"""Export lowered GPU kernels for an H100 (CUDA spellings of the GPU hooks) to JSON, so
benches/gpu_lowering_h100.py can time them with CuPy on a machine without zyx's build.

Run here: python benches/gpu_lowering_export.py OUT.json"""
import json
import sys

import numpy as np

import zyx
from zyx.codegen.target import DeviceInfo
from zyx.codegen.gpu import dispatch as gpu
from zyx.codegen.cstyle import CDialect
from zyx._core.kernelizer import kernelize
from zyx._core.passes import optimize

H100 = DeviceInfo(name="H100", max_local_threads=1024, warp_size=32, num_cores=132,
                  local_mem_size=228 * 1024, register_tiles=False)


class CUDASketch(CDialect):
    """The GPU hooks with CUDA's spellings (only for this bench: float32 kernels)."""
    name = "cuda"
    prelude = ("#define INFINITY __int_as_float(0x7f800000)\n"
               "#define NAN __int_as_float(0x7fffffff)\n")
    kernel_prefix = 'extern "C" __global__ void'
    global_qualifier = ""
    local_qualifier = "__shared__ "
    restrict = "__restrict__"

    def group_id(self, axis=0):
        return "blockIdx.x"

    def local_id(self, axis=0):
        return "threadIdx.x"

    def local_size(self, axis=0):
        return "blockDim.x"

    def barrier(self, scope=None):
        return "__syncthreads()"


def kernels_of(t):
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64, False)
    return [optimize(s.kernel) for s in steps if s.kernel is not None]


def export(name, t):
    out = []
    for k in kernels_of(t):
        g = gpu.lower(k, CUDASketch(), H100)
        out.append({"bench": name, "source": g.source, "strategy": g.strategy,
                    "index_bits": g.index_bits, "scratch": g.scratch,
                    "args": [(d.name, n, ro) for d, n, ro in k.args],
                    "launches": [(l.entry, l.groups, l.local_size, l.args) for l in g.launches]})
    return out


def main(path):
    f32 = np.float32
    big = zyx.from_numpy(np.empty(2 ** 28, f32))
    a = zyx.from_numpy(np.empty(2 ** 26, f32))
    b = zyx.from_numpy(np.empty(2 ** 26, f32))
    s = zyx.from_numpy(np.empty((16384, 4096), f32))
    rows = zyx.from_numpy(np.empty((4096, 16384), f32))
    benches = (export("sum256M", big.sum()) + export("mean256M", big.mean())
               + export("max256M", big.max())
               + export("chain64M", ((a * 1.5 + b).relu() * 2 - 1))
               + export("softmax16384x4096", s.softmax(-1))
               + export("rowsum4096x16384", rows.sum(axis=1))
               + export("colsum4096x16384", rows.sum(axis=0)))
    json.dump(benches, open(path, "w"))
    for bch in benches:
        print(bch["bench"], bch["strategy"], bch["index_bits"], bch["launches"])


if __name__ == "__main__":
    main(sys.argv[1])
