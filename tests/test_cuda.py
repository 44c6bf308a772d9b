"""The CUDA backend.

Without a GPU (runs anywhere NVRTC is pip-installed): real kernels from zyx graphs are
lowered with CUDADialect and compiled by NVRTC to sm_90a cubins; the verified disk cache of
binaries; NVRTC target selection; the shared pool and launch path (gpudriver.py) against
a driver that keeps "device" memory on the host; initialize's BackendError without a
driver.

With an NVIDIA GPU: the numerical cases of gpu_cases.py run on the CUDA device alone
(the runtime is re-initialized with only=["cuda"] for them, and restored after); they skip
with the reason ("no NVIDIA driver: ...") where `initialize` fails.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import os
import re

import numpy as np
import pytest

import zyx
from zyx._core import kernel as K
from zyx.backends import gpudriver
from zyx.codegen.target import DeviceInfo
from zyx.codegen.gpu.nvidia import products
from zyx.codegen.gpu import gemm
from zyx.backends.binary_cache import BinaryCache
from zyx.codegen.cstyle import CUDADialect
from zyx.codegen.gpu.dispatch import lower
from zyx.codegen.gpu.program import GPUKernel, Launch
from zyx.errors import AllocationError, BackendError

from gpu_cases import *  # noqa: F401,F403  (numerical cases, run on the CUDA device)
from gpu_cases import GRAPHS, kernels_of
from conftest import only_backend


# -- helpers -----------------------------------------------------------------------------

def nvrtc_or_skip():
    try:
        from zyx.backends.cuda import import_bindings
        return import_bindings()[1]
    except ImportError as e:
        pytest.skip(f"cuda-bindings is not installed: {e}")


@pytest.fixture
def compiler(tmp_path):
    """An NVRTC compiler for sm_90a whose disk cache is a fresh directory."""
    from zyx.backends.cuda import nvrtc_compiler
    nvrtc = nvrtc_or_skip()
    try:
        comp = nvrtc_compiler((9, 0), nvrtc=nvrtc)
    except BackendError as e:
        pytest.skip(f"NVRTC is not available: {e}")
    comp.disk = BinaryCache("cuda", "cubin", str(tmp_path))
    return comp


# -- codegen: zyx graphs -> CUDA C++ -> NVRTC cubins (no GPU needed) ---------------------

@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_graph_kernels_compile_to_cubins(name, compiler):
    made = GRAPHS[name]()
    outs = made if isinstance(made, tuple) else (made,)
    kernels = [k for t in outs for k in kernels_of(t)]
    assert kernels, f"{name}: the graph made no kernel"
    for k in kernels:
        gpu = lower(k, CUDADialect(), DeviceInfo(), "zyx_k")
        assert 'extern "C" __global__ void zyx_k(' in gpu.source
        assert "blockIdx.x" in gpu.source and "__restrict__" in gpu.source
        assert "get_group_id" not in gpu.source and "__kernel" not in gpu.source
        cubin = compiler.binary(gpu.source)
        assert cubin[:4] == b"\x7fELF", "NVRTC did not return a cubin (ELF)"
        for launch in gpu.launches:
            assert launch.entry.encode() in cubin   # the entry point is in the symbol table


def test_half_types_are_stored_as_16_bits_and_computed_in_float(compiler):
    (k,) = kernels_of(zyx.Tensor(np.ones((9, 5), np.float16)) * 3 + 1)
    src = lower(k, CUDADialect(), None).source
    assert "unsigned short* __restrict__ g0" in src       # stored as 16 bits
    assert "zyx_h2f(" in src and "zyx_f2h(" in src        # converted on load/store
    assert "cvt.f32.f16" in src and "cvt.rn.f16.f32" in src
    assert "__half" not in src and "#include" not in src  # NVRTC has no cuda_fp16.h built in
    assert compiler.binary(src)[:4] == b"\x7fELF"


# an H100 as the CUDA backend describes it: the elementwise strategy keeps its full steps
_H100 = DeviceInfo(name="H100", max_local_threads=1024, warp_size=32, num_cores=132,
                   register_tiles=False)


def _ew_graphs():
    def f(*s, d=np.float32):
        return zyx.Tensor(np.ones(s, d))
    big = f(2 ** 16).reshape(1, 2 ** 16).expand(2 ** 16, 2 ** 16)     # 2**32: 64-bit index
    m = 2 ** 22
    return {
        "chain": lambda: ((f(2 ** 24) * 1.5 + 0.5).sin() * 0.25 + f(2 ** 24)).tanh(),
        "ragged_bias": lambda: f(1000, 1001) + f(1001) * f(1000, 1),
        "half": lambda: f(m, d=np.float16) * 3 + f(m, d=np.float16),           # ushort4
        "bf16": lambda: f(m).cast("bfloat16") * 3,                              # ushort4 out
        "int8": lambda: f(m, d=np.int8) * 3 + (f(m) > 0).cast("int8"),          # char4
        "bool": lambda: f(m, d=np.bool_) ^ (f(m) > 0),                          # uchar4
        "int64": lambda: f(m, d=np.int64) * 3 + f(m, d=np.int64),               # longlong2
        "double": lambda: f(m, d=np.float64) * 2,                               # double2
        "transposed": lambda: f(2048, 2048).T * 2,
        "index64": lambda: big * 2,
    }


@pytest.mark.parametrize("variant", ["", "items=1,vec=1", "items=2,vec=8,local=512",
                                     "items=16,vec=2,local=128,waves=4"])
def test_elementwise_variants_compile_to_cubins(variant, compiler, monkeypatch):
    from zyx.codegen.gpu import elementwise
    monkeypatch.setenv(elementwise.EW_ENV, variant)
    want_vec = elementwise.elementwise_variant(variant)["vec"]
    for name, build in _ew_graphs().items():
        (k,) = kernels_of(build())
        if name == "transposed":     # a local tile by default (transpose.py): asked by name
            assert lower(k, CUDADialect(), _H100, "zyx_k").strategy == "transpose"
            assert compiler.binary(lower(k, CUDADialect(), _H100).source)[:4] == b"\x7fELF"
        g = lower(k, CUDADialect(), _H100, "zyx_k", {"elementwise": {}})
        assert g.strategy == "elementwise", name
        if name == "index64":
            assert g.index_bits == 64 and "const long long zyx_base" in g.source
        if name == "transposed" or want_vec == 1:
            assert g.variant["vec"] == 1, name
        elif name != "index64":
            assert g.variant["vec"] == want_vec and g.variant["vector_accesses"] >= 1, name
        assert compiler.binary(g.source)[:4] == b"\x7fELF", name
    if want_vec == 4:       # the default: 16-byte loads and stores of the chain
        (k,) = kernels_of(_ew_graphs()["chain"]())
        src = lower(k, CUDADialect(), _H100).source
        assert "*(const float4*)(g" in src and "*(float4*)(g0" in src


def _group_graphs():
    def f(*s, d=np.float32):
        return zyx.Tensor(np.random.default_rng(3).standard_normal(s).astype(d))
    return {
        "softmax": lambda: f(64, 4096).softmax(-1),                 # row cache + store loop
        "layer_norm": lambda: zyx.nn.functional.layer_norm(f(32, 1000), (1000,)),
        "log_softmax": lambda: f(16, 2048).log_softmax(-1),
        "argmax": lambda: f(64, 4096).argmax(axis=1),                  # int64 accumulator
        "sum_f64": lambda: f(256, 4096, d=np.float64).sum(1),
        "big_sum": lambda: f(2 ** 22).sum(),                         # group + partials
        "any": lambda: (f(64, 4096) > 3).any(1),                      # bool: local memory
    }


@pytest.mark.parametrize("variant", ["", "warp=0", "cache=0", "local=1024", "local=64",
                                     "local=32,warp=1"])
def test_group_variants_compile_to_cubins(variant, compiler, monkeypatch):
    from zyx.codegen.gpu import reduce
    monkeypatch.setenv(reduce.GROUP_ENV, variant)
    var = reduce.group_variant(variant)
    for name, build in _group_graphs().items():
        for k in kernels_of(build()):
            g = lower(k, CUDADialect(), _H100, "zyx_k")
            if not g.strategy.startswith("group"):
                continue
            assert compiler.binary(g.source)[:4] == b"\x7fELF", name
            shuffled = "__shfl_xor_sync(0xffffffffu" in g.source
            assert shuffled == (var["warp"] == 1 and name != "any"), name
            if name == "softmax":      # cached when a work-item's share fits its registers
                fits = 4096 // g.variant["local"] <= reduce.ROW_CACHE_ITEMS
                assert (g.source.count("g1[") == 1) == (var["cache"] == 1 and fits)


_LAUNCH_SHIM = r"""
typedef struct { void *f; unsigned d[7]; void *stream, **params, **extra;
                 unsigned long long p0; } rec_t;
rec_t zyx_last;
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                   unsigned bz, unsigned shm, void *stream, void **params, void **extra) {
  unsigned d[7] = {gx, gy, gz, bx, by, bz, shm};
  for (int i = 0; i < 7; i++) zyx_last.d[i] = d[i];
  zyx_last.f = f; zyx_last.stream = stream; zyx_last.params = params;
  zyx_last.extra = extra; zyx_last.p0 = *(unsigned long long *)params[0];
  return gx == 0 ? 1 : 0;      /* CUDA_ERROR_INVALID_VALUE for an empty grid */
}
"""


class _LaunchRecord(ctypes.Structure):
    _fields_ = [("f", ctypes.c_void_p), ("d", ctypes.c_uint * 7), ("stream", ctypes.c_void_p),
                ("params", ctypes.c_void_p), ("extra", ctypes.c_void_p), ("p0", ctypes.c_uint64)]


def test_direct_launch_passes_cuLaunchKernel_its_arguments(tmp_path, monkeypatch):
    # the ctypes launch path against a stand-in for the driver's cuLaunchKernel (no GPU
    # here): the same 11 arguments cuda-bindings would pass, the parameter block read
    # through kernelParams, and a failure raised as BackendError
    import shutil
    import subprocess
    from zyx.backends import cuda
    drv = nvrtc_or_skip() and cuda.import_bindings()[0]
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in driver library")
    (tmp_path / "shim.c").write_text(_LAUNCH_SHIM)
    so = tmp_path / "libshim.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(tmp_path / "shim.c")], check=True)
    lib = ctypes.CDLL(str(so))
    d = object.__new__(cuda.CUDADriver)
    d.drv, d.label, d.ordinal = drv, "CUDA", 0
    d.SUCCESS, d._error_name = drv.CUresult.CUDA_SUCCESS, drv.cuGetErrorName
    d.stream = drv.CUstream(0x5678)
    d._direct = cuda.direct_launch(lib)
    assert d._direct is not None
    pl = gpudriver._PreparedLaunch(drv.CUfunction(0x1234), Launch("k", 96, 256, [("arg", 0)]), d)
    pl.values[0] = 0xDEADBEEF
    pl.call()
    rec = _LaunchRecord.in_dll(lib, "zyx_last")
    assert (rec.f, list(rec.d), rec.stream) == (0x1234, [96, 1, 1, 256, 1, 1, 0], 0x5678)
    assert rec.params == pl.address and rec.extra is None and rec.p0 == 0xDEADBEEF
    empty = gpudriver._PreparedLaunch(drv.CUfunction(0x1234), Launch("k", 0, 256, [("arg", 0)]), d)
    with pytest.raises(BackendError, match="cuLaunchKernel"):
        empty.call()
    monkeypatch.setenv("ZYX_CUDA_LAUNCH", "bindings")
    assert cuda.direct_launch(lib) is None


_GRAPH_SHIM = r"""
#include <stddef.h>
/* CUDA_KERNEL_NODE_PARAMS_v1 as cuda.h declares it */
typedef struct { void *func; unsigned gx, gy, gz, bx, by, bz, shm;
                 void **kernelParams; void **extra; } params_t;
typedef struct { void *func; unsigned gx, bx, shm; unsigned long long p0; void *dep;
                 void *node; } rec_t;
rec_t zyx_nodes[8], zyx_set;
int zyx_nnodes, zyx_launches;
void *zyx_exec, *zyx_stream;
static void record(rec_t *r, const params_t *p) {
  r->func = p->func; r->gx = p->gx; r->bx = p->bx; r->shm = p->shm;
  r->p0 = *(unsigned long long *)p->kernelParams[0];
}
int cuGraphCreate(void **g, unsigned flags) { *g = (void *)0x6000; zyx_nnodes = 0; return 0; }
int cuGraphAddKernelNode(void **node, void *g, void **deps, size_t n, const params_t *p) {
  rec_t *r = &zyx_nodes[zyx_nnodes];
  record(r, p);
  r->dep = n ? deps[0] : 0;
  *node = r->node = (void *)(size_t)(0x7000 + zyx_nnodes++);
  return 0;
}
int cuGraphInstantiateWithFlags(void **e, void *g, unsigned long long flags) {
  *e = (void *)0x8000; return g == (void *)0x6000 ? 0 : 1;
}
int cuGraphExecKernelNodeSetParams(void *e, void *node, const params_t *p) {
  record(&zyx_set, p); zyx_set.node = node; return p->gx == 0 ? 1 : 0;
}
int cuGraphLaunch(void *e, void *s) { zyx_exec = e; zyx_stream = s; zyx_launches++; return 0; }
int cuGraphExecDestroy(void *e) { return 0; }
int cuGraphDestroy(void *g) { return 0; }
"""


class _NodeRecord(ctypes.Structure):
    _fields_ = [("func", ctypes.c_void_p), ("gx", ctypes.c_uint), ("bx", ctypes.c_uint),
                ("shm", ctypes.c_uint), ("p0", ctypes.c_uint64), ("dep", ctypes.c_void_p),
                ("node", ctypes.c_void_p)]


def test_cuda_graph_calls_pass_the_driver_its_arguments(tmp_path):
    """cuda.CUDAGraphs against a stand-in for the driver's graph calls (no GPU here):
    kernel nodes with CUDA_KERNEL_NODE_PARAMS laid out as cuda.h's v1 struct, each node
    after the one before, the parameter values read through kernelParams when a node is
    added or rewritten, the replay on the device's stream, a failure raised as
    BackendError naming the call."""
    import shutil
    import subprocess
    import types
    from zyx.backends import cuda
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in driver library")
    (tmp_path / "graphs.c").write_text(_GRAPH_SHIM)
    so = tmp_path / "libgraphs.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(so), str(tmp_path / "graphs.c")],
                   check=True)
    lib = ctypes.CDLL(str(so))

    def check(err, what):
        raise BackendError(f"CUDA: {what} failed: {err}")
    api = cuda.CUDAGraphs(lib, 0x5678, check)
    values = np.array([0xA0, 0xB0], np.uint64)
    blocks = [np.array([values.ctypes.data + 8 * i], np.uint64) for i in range(2)]
    params = [api.node_params(0x1234, 96, 256, 0, blocks[0].ctypes.data),
              api.node_params(0x1240, 1, 64, 4096, blocks[1].ctypes.data)]
    graph, nodes = api.build(params)
    recs = (_NodeRecord * 8).in_dll(lib, "zyx_nodes")
    assert [(r.func, r.gx, r.bx, r.shm, r.p0) for r in recs[:2]] == [
        (0x1234, 96, 256, 0, 0xA0), (0x1240, 1, 64, 4096, 0xB0)]
    assert recs[0].dep is None and recs[1].dep == nodes[0].value == 0x7000
    exe = api.instantiate(graph)
    api.launch(exe)
    assert ctypes.c_void_p.in_dll(lib, "zyx_exec").value == 0x8000
    assert ctypes.c_void_p.in_dll(lib, "zyx_stream").value == 0x5678
    values[1] = 0xC0                 # the second launch's buffer moved: its node rewritten
    api.set_params(exe, nodes[1], params[1])
    done = _NodeRecord.in_dll(lib, "zyx_set")
    assert (done.node, done.func, done.p0, done.shm) == (0x7001, 0x1240, 0xC0, 4096)
    with pytest.raises(BackendError, match="cuGraphExecKernelNodeSetParams"):
        api.set_params(exe, nodes[0], api.node_params(0x1234, 0, 256, 0,
                                                      blocks[0].ctypes.data))
    api.destroy(graph, exe)
    with pytest.raises(AttributeError):         # a driver without the calls: no graphs
        cuda.CUDAGraphs(types.SimpleNamespace(cuLaunchKernel=None), 0, check)


def test_nan_and_infinity_literals_compile(compiler):
    t = zyx.Tensor(np.random.randn(4).astype(np.float32)).maximum(zyx.Tensor(np.array([np.nan, np.inf, -np.inf, 1.0], np.float32)))
    for k in kernels_of(t * float("inf")):
        src = lower(k, CUDADialect(), None).source
        assert compiler.binary(src)[:4] == b"\x7fELF"


# an H100 as the CUDA backend describes it, with its compute capability and NVIDIA's
# product lowerings: 16-bit products go to tensor cores (codegen/gpu/nvidia/mma.py)
_H100_CC = DeviceInfo(name="H100", max_local_threads=1024, warp_size=32, num_cores=2,
                      local_mem_size=48 * 1024, register_tiles=False, extra={"cc": (9, 0)},
                      product_lowerings=(products.lower_product,),
                      k_major_windows=products.k_major_windows)


def _untiled_kernels(t):
    """The kernels of `t` as a GPU device makes them: no register tiles."""
    from zyx._core.kernelizer import kernelize
    from zyx._core.passes import optimize
    from zyx.codegen.gpu.dispatch import GPU_SUM_BLOCK
    g = zyx._RT.graph
    order, _ = g.collect([t._id])
    steps, _ = kernelize(g, order, [t._id], 64, False, GPU_SUM_BLOCK)
    return [optimize(s.kernel) for s in steps if s.kernel is not None]


def _untiled_kernel(t):
    """The one kernel of `t` as a GPU device makes it."""
    (k,) = _untiled_kernels(t)
    return k


def _mma_products(dtype):
    """16-bit products with each operand stored K-fastest or not, a computed operand, an
    epilogue, a batch, a ragged size and a long K (block totals)."""
    def t(*s):
        return zyx.Tensor(np.ones(s, np.float32)).cast(dtype).realize()
    return {
        "nn": lambda: t(200, 72) @ t(72, 136),
        "tn": lambda: t(72, 200).T @ t(72, 136),
        "nt": lambda: t(200, 72) @ t(136, 72).T,
        "tt": lambda: t(72, 200).T @ t(136, 72).T,
        "computed": lambda: (t(200, 72) * 2 + 1) @ t(72, 136).exp(),
        "epilogue": lambda: (t(3, 64, 40) @ t(3, 40, 96) + t(96)).relu(),
        "long_k": lambda: t(64, 9000) @ t(9000, 64),
    }


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("want", [t[:2] for t in gemm.TILES])
def test_tensor_core_kernels_compile_to_cubins(dtype, want, compiler, monkeypatch):
    from zyx.codegen.cstyle import HIPDialect, OpenCLDialect
    turing = dataclasses.replace(_H100_CC, extra={"cc": (7, 5)})
    specs = ("", "mk=64,double=1", "mk=16,vector=0")
    for n, (name, build) in enumerate(_mma_products(dtype).items()):
        k = _untiled_kernel(build())
        # each tile with each K step of the knobs ("mk=64,double=1" is too big for two
        # buffers in 48 KiB with the larger tiles: one buffer then)
        monkeypatch.setenv(gemm.GEMM_ENV, specs[n % 3])
        g = lower(k, CUDADialect(), _H100_CC, "zyx_k", {"gemm": want})
        assert g.strategy == "mma", name
        assert g.variant["k"] == (gemm.variant()["mk"] or g.variant["k"])
        assert g.variant["k"] == 32 or name != "nn"        # 16-byte copies of both
        assert g.variant["mma"] == ("bf16" if dtype == "bfloat16" else "f16")
        assert f"mma.sync.aligned.m16n8k16.row.col.f32.{g.variant['mma']}" in g.source
        if name in ("nn", "tn", "nt", "tt"):   # rows-fastest tiles are read transposed
            transposed = re.search(r"zyx_ldm[24]t\(zyx_f", g.source) is not None
            assert transposed == (name != "nt"), name
        assert compiler.binary(g.source)[:4] == b"\x7fELF", name
        if name == "long_k":
            assert "zyx_t[i][j][q] += zyx_c[i][j][q]" in g.source
        # no tensor cores: HIP, OpenCL, a Turing GPU, float32, or mma=0
        for dl, info in ((HIPDialect(), _H100_CC), (OpenCLDialect(), _H100_CC),
                         (CUDADialect(), turing)):
            assert lower(k, dl, info, "zyx_k", {"gemm": want}).strategy == "gemm", name
    k = _untiled_kernel(zyx.Tensor(np.ones((200, 72), np.float32)) @
                        zyx.Tensor(np.ones((72, 136), np.float32)))
    assert lower(k, CUDADialect(), _H100_CC, "zyx_k", {"gemm": want}).strategy == "gemm"


_HOPPER = dataclasses.replace(_H100_CC, extra={"cc": (9, 0), "arch": "sm_90a",
                                               "smem_optin": 227 * 1024, "tma": True})


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("spec", ["", "wn=128,stages=3", "stages=6", "wm=256,wn=128",
                                  "tma=0", "tma=0,wm=256,wn=128", "tma=0,stages=6"])
def test_wgmma_kernels_compile_to_cubins(dtype, spec, compiler, monkeypatch):
    """16-bit products of plain loads on a Hopper device compiled for sm_90a, with 128 x
    128 tiles: warpgroup products (wgmma.py) for every layout of the operands (the
    instruction's transpose bits: 0 for a K-major tile, 1 for an MN-major one), with
    the stages' dynamic shared memory on the launch; operands copied through tensor maps
    by a producer warpgroup (two maps on the launch) unless "tma=0" or the device has no
    tensor maps. Computed operands, block totals, smaller tiles, sm_90 (no "a"), too
    little shared memory and wgmma=0 stay on mma.sync."""
    from zyx.codegen.gpu.nvidia import wgmma
    monkeypatch.setenv(gemm.GEMM_ENV, spec)
    var = gemm.variant()
    bits = {"nn": "0, 1", "tn": "1, 1", "nt": "0, 0", "tt": "1, 0", "epilogue": "0, 1"}
    no_maps = dataclasses.replace(_HOPPER, extra=dict(_HOPPER.extra, tma=False))
    for name, build in _mma_products(dtype).items():
        k = _untiled_kernel(build())
        g = lower(k, CUDADialect(), _HOPPER, "zyx_k", {"gemm": (128, 128)})
        if name not in bits:            # a computed operand, block totals
            assert g.strategy == "mma", name
            continue
        assert g.strategy == "wgmma", name
        br, bc, n_stages = g.variant["rows"], g.variant["cols"], g.variant["stages"]
        p = gemm.plan(k.ops)
        ptx = "bf16" if dtype == "bfloat16" else "f16"
        assert f"m64n{bc}k16.f32.{ptx}.{ptx}" in g.source
        assert f"p, 1, 1, {bits[name]};" in g.source, name
        launch = g.launches[0]
        # (6 stages of 128 x 256 do not fit: those keep cp.async)
        fits = spec != "stages=6" or wgmma.tma_shape(p, _HOPPER, var)[1] == 128
        assert wgmma.tma_usable(k.ops, p, _HOPPER, var) == ("tma=0" not in spec and fits)
        if not wgmma.tma_usable(k.ops, p, _HOPPER, var):
            assert (br, bc, n_stages) == wgmma.shape(p, _HOPPER, var)
            assert launch.shared == wgmma.smem_bytes(br, bc, n_stages) > 48 << 10
            assert launch.local_size == 2 * br       # a warpgroup per 64 rows
            assert not launch.maps and "cp.async.cg" in g.source
        else:
            assert g.variant["tma"] == 1
            assert (br, bc, n_stages) == wgmma.tma_shape(p, _HOPPER, var)
            assert launch.shared >= wgmma.smem_bytes(br, bc, n_stages) > 48 << 10
            assert launch.shared <= _HOPPER.extra["smem_optin"]
            assert launch.local_size == 128 * (br // 64 + 1)   # and the producer's
            assert [m.arg for m in launch.maps] == [1, 2] or name == "epilogue"
            assert "cp.async.bulk.tensor" in g.source and "setmaxnreg" in g.source
            assert lower(k, CUDADialect(), no_maps, "zyx_k",
                         {"gemm": (128, 128)}).launches[0].maps == []
        assert compiler.binary(g.source)[:4] == b"\x7fELF", name
        for info, want in ((_HOPPER, (64, 64)), (_H100_CC, (128, 128)),
                           (dataclasses.replace(_HOPPER, extra=dict(_HOPPER.extra,
                                                                    smem_optin=48 << 10)),
                            (128, 128))):
            assert lower(k, CUDADialect(), info, "zyx_k", {"gemm": want}).strategy == "mma"
    monkeypatch.setenv(gemm.GEMM_ENV, spec + ",wgmma=0")
    k = _untiled_kernel(_mma_products(dtype)["nn"]())
    assert lower(k, CUDADialect(), _HOPPER, "zyx_k", {"gemm": (128, 128)}).strategy == "mma"


def test_wgmma_takes_products_of_at_most_64_cols_through_tensor_maps(compiler):
    """Attention's probabilities @ values (64 cols, batched over two axes: 4-dimensional
    maps) on Hopper: 128 x 64 tiles of m64n64 warpgroup products fed through tensor
    maps; without maps ("tma=0" or a driver without them) they stay on mma.sync."""
    def t(*s):
        return zyx.Tensor(np.ones(s, np.float32)).cast("bfloat16").realize()
    k = _untiled_kernel(t(2, 3, 200, 72) @ t(2, 3, 72, 64))
    g = lower(k, CUDADialect(), _HOPPER, "zyx_k", {"gemm": (128, 64)})
    assert g.strategy == "wgmma" and g.variant["cols"] == 64 and g.variant["tma"] == 1
    assert "m64n64k16.f32.bf16.bf16" in g.source and "zyx_tma4(" in g.source
    assert [len(m.dims) for m in g.launches[0].maps] == [4, 4]
    assert compiler.binary(g.source)[:4] == b"\x7fELF"
    no_maps = dataclasses.replace(_HOPPER, extra=dict(_HOPPER.extra, tma=False))
    assert lower(k, CUDADialect(), no_maps, "zyx_k", {"gemm": (128, 64)}).strategy == "mma"
    with_env = gemm.variant("tma=0")
    assert not wgmma_usable(k, (128, 64), with_env)


def test_window_plan_of_a_channels_last_convolution(compiler, monkeypatch):
    """A 16-bit convolution over a channels-last image on Hopper: the plan's sides
    exchanged (the window on the rows), the window's map walking pixels with its taps
    folded into the pixel coordinate, the weights' map with a dimension per tap, the
    consumers zeroing rows outside the image; the cubin compiles. "tma=0", float32 at
    "highest" and NCHW windows keep the other lowerings; TF32 takes it with K-major
    weights."""
    import zyx.nn.functional as F
    from zyx.codegen.gpu.nvidia import wgmma
    monkeypatch.setattr(F, "GPU_IMAGE_MIN", 0)
    monkeypatch.setattr(F, "_channels_last_input", lambda x, cg: True)

    def conv(dtype):
        x = zyx.Tensor(np.ones((4, 32, 30, 30), np.float32)).cast(dtype).realize()
        w = zyx.Tensor(np.ones((64, 32, 3, 3), np.float32)).cast(dtype).realize()
        return _untiled_kernels(F.conv2d(x, w, padding=1))[-1]
    k = conv("bfloat16")
    p = gemm.plan(k.ops)
    q = wgmma.window_plan(p, k.ops, CUDADialect(), _HOPPER, gemm.variant(""))
    assert q is not None and q.rows == p.cols and q.a == p.b and q.nc == 64
    g = lower(k, CUDADialect(), _HOPPER, "zyx_k", None)
    assert g.strategy == "wgmma" and g.variant["tma"] == 1 and g.variant["cols"] == 64
    window, weights = g.launches[0].maps
    assert window.dims == [32, 4 * 30 * 30] and window.strides == [64]
    assert len(weights.dims) == 4 and weights.box == [64, 64, 1, 1]
    assert "zyx_zero16(zyx_cur + zyx_fo" in g.source and "bar.sync %0, 128" in g.source
    assert compiler.binary(g.source)[:4] == b"\x7fELF"
    assert wgmma.window_plan(p, k.ops, CUDADialect(), _HOPPER, gemm.variant("tma=0")) is None
    f32 = conv("float32")       # (float32 at "highest": only the FMA tiles take it)
    assert wgmma.window_plan(gemm.plan(f32.ops), f32.ops, CUDADialect(), _HOPPER,
                             gemm.variant("fma=0")) is None
    # TF32 ("high"): K-major weights (F._window_weights), k8 products without transpose
    # bits, as must a plain product with both operands K-major; a @ b keeps mma.sync
    monkeypatch.setattr(F, "_window_weights", lambda x, w, out_size: True)
    hopper_tf32 = dataclasses.replace(_HOPPER, float32_precision="high")
    g = lower(conv("float32"), CUDADialect(), hopper_tf32, "zyx_k", None)
    assert g.strategy == "wgmma" and g.variant["mma"] == "tf32"
    assert "m64n64k8.f32.tf32.tf32" in g.source and "p, 1, 1;" in g.source
    assert [m.box[0] for m in g.launches[0].maps] == [32, 32]
    assert compiler.binary(g.source)[:4] == b"\x7fELF"
    a = zyx.Tensor(np.ones((256, 96), np.float32)).realize()
    b = zyx.Tensor(np.ones((384, 96), np.float32)).realize()
    g = lower(_untiled_kernel(a @ b.T), CUDADialect(), hopper_tf32, "zyx_k",
              {"gemm": (128, 128)})
    assert g.strategy == "wgmma" and g.variant["mma"] == "tf32"
    assert compiler.binary(g.source)[:4] == b"\x7fELF"
    c = zyx.Tensor(np.ones((96, 384), np.float32)).realize()
    assert lower(_untiled_kernel(a @ c), CUDADialect(), hopper_tf32, "zyx_k",
                 {"gemm": (128, 128)}).strategy == "mma"
    # float32 at "highest": FMA tiles fed by the same maps, 256 x 64, rows across lanes
    # (the NCHW output is contiguous along the pixels); "fma=0": the float tiles
    g = lower(conv("float32"), CUDADialect(), _HOPPER, "zyx_k", None)
    assert g.strategy == "tmafma" and (g.variant["rows"], g.variant["cols"]) == (256, 64)
    assert "fmaf(" in g.source and "wgmma.mma_async" not in g.source
    assert "zyx_a1 = zyx_lane;" in g.source and "bar.sync 1, 256;" in g.source
    assert g.launches[0].local_size == 384
    assert compiler.binary(g.source)[:4] == b"\x7fELF"
    monkeypatch.setenv(gemm.GEMM_ENV, "fma=0")
    assert lower(conv("float32"), CUDADialect(), _HOPPER, "zyx_k", None).strategy != "tmafma"
    # grouped and dilated windows (not checked on a GPU with this lowering) keep mma.sync
    x = zyx.Tensor(np.ones((4, 32, 30, 30), np.float32)).cast("bfloat16").realize()
    for w, kw in ((zyx.Tensor(np.ones((64, 16, 3, 3), np.float32)), {"groups": 2}),
                  (zyx.Tensor(np.ones((64, 32, 3, 3), np.float32)), {"dilation": 2,
                                                                      "padding": 2})):
        k = _untiled_kernels(F.conv2d(x, w.cast("bfloat16").realize(),
                                      **dict({"padding": 1}, **kw)))[-1]
        assert wgmma.window_plan(gemm.plan(k.ops), k.ops, CUDADialect(), _HOPPER,
                                 gemm.variant("")) is None, kw
    monkeypatch.setattr(F, "_channels_last_input", lambda x, cg: False)
    nchw = conv("bfloat16")
    assert wgmma.window_plan(gemm.plan(nchw.ops), nchw.ops, CUDADialect(), _HOPPER,
                             gemm.variant("")) is None


def wgmma_usable(k, tile, var):
    from zyx.codegen.gpu.nvidia import wgmma
    return wgmma.usable(gemm.plan(k.ops), k.ops, CUDADialect(), _HOPPER, tile, var)


@pytest.mark.parametrize("layout", ["nn", "tn", "nt", "tt"])
def test_float32_products_take_fma_tiles_in_every_operand_layout(layout, compiler):
    """float32 products at "highest" on Hopper: FMA tiles fed by tensor maps whichever
    way each operand is stored. A K-major operand is copied in boxes of 32 K by the
    tile's side, an MN-major one (`a @ b`'s b) in blocks of 32 rows (cols) by 32 K, and
    the consumers read it two float4 per K."""
    from zyx.codegen.gpu.nvidia import wgmma

    def t(*s):
        return zyx.Tensor(np.ones(s, np.float32)).realize()
    a = t(200, 72) if layout[0] == "n" else t(72, 200).T
    b = t(72, 136) if layout[1] == "n" else t(136, 72).T
    k = _untiled_kernel(a @ b)
    g = lower(k, CUDADialect(), _HOPPER, "zyx_k", {"gemm": (128, 128)})
    assert g.strategy == "tmafma" and (g.variant["rows"], g.variant["cols"]) == (128, 128)
    boxes = [m.box for m in g.launches[0].maps]
    assert boxes == [[32, 128] if layout[0] == "n" else [32, 32],
                     [32, 32] if layout[1] == "n" else [32, 128]]
    # an MN-major side: four block copies of 32 rows (cols), read two float4 per K
    assert g.source.count("&zyx_mapb,") == (4 if layout[1] == "n" else 1)
    assert g.source.count("&zyx_mapa,") == (4 if layout[0] == "t" else 1)
    assert ("zyx_bv[2 * kk + 1] =" in g.source) == (layout[1] == "n")
    assert ("zyx_av[2 * kk + 1] =" in g.source) == (layout[0] == "t")
    assert "wgmma.mma_async" not in g.source
    assert compiler.binary(g.source)[:4] == b"\x7fELF"
    assert wgmma.fma_products(gemm.plan(k.ops), _HOPPER)


@pytest.mark.parametrize("layout,k", [("nn", 72), ("tn", 70), ("tt", 72)])
def test_tf32_products_copy_mn_major_operands_k_major_first(layout, k, compiler, monkeypatch):
    """TF32 warpgroup products read both operands K-major: an MN-major one (`a @ b`'s b)
    is copied K-major into a scratch buffer by a first launch (kcopy.py, rows padded to
    a multiple of 4 values: "tn" copies both operands of 70 K), and the product's map
    reads that copy. Products with too few rows on the other side, and the knob
    kcopy=0, keep mma.sync."""
    from zyx.codegen.gpu.nvidia import kcopy

    def t(*s):
        return zyx.Tensor(np.ones(s, np.float32)).realize()
    m, n = 600, 700
    a = t(m, k) if layout[0] == "n" else t(k, m).T
    b = t(k, n) if layout[1] == "n" else t(n, k).T
    hopper_tf32 = dataclasses.replace(_HOPPER, float32_precision="high")
    kern = _untiled_kernel(a @ b)
    g = lower(kern, CUDADialect(), hopper_tf32, "zyx_k", {"gemm": (128, 128)})
    copies = [layout[0] == "t", layout[1] == "n"]
    assert g.strategy == "wgmma" and g.variant["mma"] == "tf32"
    assert g.variant.get("kcopy", 0) == sum(copies)
    *first, product = g.launches
    assert [ln.entry for ln in first] == [f"zyx_k_kcopy{j}" for j in range(sum(copies))]
    assert product.args[-sum(copies):] == [("scratch", j) for j in range(sum(copies))]
    # a copy: K (padded to 72 values) fastest, then the side; 32-value boxes of K
    for mp, side, copied in zip(product.maps, (m, n), copies):
        assert mp.scratch == copied and mp.box[0] == 32
        if copied:
            assert mp.dims == [k, side] and mp.strides == [72 * 4]
    assert g.scratch == [72 * s * 4 for s, c in zip((m, n), copies) if c]
    assert compiler.binary(g.source)[:4] == b"\x7fELF"
    monkeypatch.setenv(gemm.GEMM_ENV, "kcopy=0")
    assert lower(kern, CUDADialect(), hopper_tf32, "zyx_k",
                 {"gemm": (128, 128)}).strategy == "mma"
    monkeypatch.delenv(gemm.GEMM_ENV)
    small = _untiled_kernel(t(kcopy.MIN_OTHER - 8, k) @ t(k, n))
    assert lower(small, CUDADialect(), hopper_tf32, "zyx_k",
                 {"gemm": (128, 128)}).strategy == "mma"


def test_wgmma_shape_choice():
    """256 x 128 tiles with 4 stages where a product has two of them per SM, else 128 x
    128 with 3 (two groups per SM); the knobs override them."""
    from zyx.codegen.gpu.nvidia import wgmma
    k = _untiled_kernel(zyx.Tensor(np.ones((1024, 64), np.float32)).cast("bfloat16") @
                        zyx.Tensor(np.ones((64, 1024), np.float32)).cast("bfloat16"))
    p = gemm.plan(k.ops)
    var = gemm.variant("")
    assert wgmma.shape(p, _HOPPER, var) == (256, 128, 4)     # 32 tall tiles, 2 SMs
    many = dataclasses.replace(_HOPPER, num_cores=132)
    assert wgmma.shape(p, many, var) == (128, 128, 3)
    assert wgmma.shape(p, _HOPPER, gemm.variant("wn=256")) == (128, 256, 4)
    short = gemm.plan(_untiled_kernel(
        zyx.Tensor(np.ones((384, 64), np.float32)).cast("bfloat16") @
        zyx.Tensor(np.ones((64, 4096), np.float32)).cast("bfloat16")).ops)
    assert wgmma.shape(short, _HOPPER, var) == (128, 128, 3)   # 2 x 256 rows idle 128
    assert wgmma.shape(p, many, gemm.variant("wm=256,wn=256,stages=5")) == (256, 256, 5)


def test_tensor_map_tiles_are_256_cols_only_for_products_of_more_than_128():
    """The tensor-map lowering's 128 x 256 tiles where the product has more than 128
    cols and a tile per SM; a product of 128 cols keeps 128-col tiles (256 would
    multiply half zeros: H200, conv2d 64x128x28x28 bfloat16 0.107 -> 0.076 ms)."""
    from zyx.codegen.gpu.nvidia import wgmma
    many = dataclasses.replace(_HOPPER, num_cores=132)

    def plan(rows, cols):
        return gemm.plan(_untiled_kernel(
            zyx.Tensor(np.ones((rows, 64), np.float32)).cast("bfloat16") @
            zyx.Tensor(np.ones((64, cols), np.float32)).cast("bfloat16")).ops)
    var = gemm.variant("")
    assert wgmma.tma_shape(plan(50176, 128), many, var)[:2] == (128, 128)
    assert wgmma.tma_shape(plan(50176, 192), many, var)[:2] == (128, 256)
    assert wgmma.tma_shape(plan(4096, 4096), many, var)[:2] == (128, 256)
    assert wgmma.tma_shape(plan(50176, 64), many, var)[:2] == (128, 64)
    assert wgmma.tma_shape(plan(50176, 128), many, gemm.variant("wn=256"))[:2] == (128, 256)


def test_gemm_knobs_refuse_bad_wgmma_values():
    for spec in ("wn=64", "wm=512", "stages=2", "stages=9"):
        with pytest.raises(ValueError, match="wm|wn|stages"):
            gemm.variant(spec)


@pytest.fixture
def tf32_precision():
    """float32 products allowed on TF32 for one test (zyx.set_float32_matmul_precision)."""
    before = zyx.get_float32_matmul_precision()
    zyx.set_float32_matmul_precision("high")
    yield
    zyx.set_float32_matmul_precision(before)


@pytest.mark.parametrize("want", [t[:2] for t in gemm.TILES])
def test_tf32_kernels_compile_to_cubins(want, compiler, monkeypatch):
    """float32 products with precision "high": TF32 mma.sync with operands rounded by
    cvt.rna, both local layouts of each operand (ldmatrix for K-fastest tiles, word reads
    for rows-fastest ones), computed operands, an epilogue, block totals, a convolution;
    float32 tiles again with "highest", and never outside CUDA C on sm_80+."""
    from zyx.codegen.cstyle import HIPDialect, OpenCLDialect
    import zyx.nn.functional as F
    tf32 = dataclasses.replace(_H100_CC, float32_precision="high")
    turing = dataclasses.replace(tf32, extra={"cc": (7, 5)})

    def t(*s):
        return zyx.Tensor(np.ones(s, np.float32)).realize()
    cases = dict(_mma_products("float32"))
    cases["conv"] = lambda: F.conv2d(t(2, 8, 12, 12), t(16, 8, 3, 3), padding=1)
    specs = ("", "mk=32,double=1", "vector=0,prefetch=0")
    for n, (name, build) in enumerate(cases.items()):
        ks = [k for k in _untiled_kernels(build()) if gemm.plan(k.ops) is not None]
        assert ks, name
        k = ks[-1]
        monkeypatch.setenv(gemm.GEMM_ENV, specs[n % 3])
        g = lower(k, CUDADialect(), tf32, "zyx_k", {"gemm": want})
        assert g.strategy == "mma" and g.variant["mma"] == "tf32", name
        assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in g.source
        assert "cvt.rna.tf32.f32" in g.source and "zyx_tf32(" in g.source
        assert compiler.binary(g.source)[:4] == b"\x7fELF", name
        for dl, info in ((HIPDialect(), tf32), (OpenCLDialect(), tf32),
                         (CUDADialect(), turing)):
            assert lower(k, dl, info, "zyx_k", {"gemm": want}).strategy == "gemm", name
        assert lower(k, CUDADialect(), _H100_CC, "zyx_k", {"gemm": want}).strategy == "gemm"


def test_convolutions_alone_run_on_tf32_with_allow_tf32(compiler):
    """zyx.backends.cudnn.allow_tf32 (DeviceInfo.conv_tf32) at precision "highest": a
    convolution's products, forward and both gradients, lower to TF32 mma.sync, while
    matrix products (a @ b, a linear layer and its gradients) stay float32 tiles; off,
    the convolution's do too."""
    import zyx.nn.functional as F
    conv_tf32 = dataclasses.replace(_H100_CC, conv_tf32=True)

    def t(*s, grad=False):
        return zyx.Tensor(np.ones(s, np.float32), requires_grad=grad).realize()
    x, w = t(4, 16, 16, 16, grad=True), t(32, 16, 3, 3, grad=True)
    y = F.conv2d(x, w, padding=1)
    gx, gw = zyx.autograd.grad([y], [x, w], [t(*y.shape)])
    a, b = t(64, 96, grad=True), t(96, 80, grad=True)
    m = a @ b
    ga, gb = zyx.autograd.grad([m], [a, b], [t(64, 80)])
    want = gemm.TILES[0][:2]

    def lowered(v, info):
        ks = [k for k in _untiled_kernels(v) if gemm.plan(k.ops) is not None]
        assert ks
        return lower(ks[-1], CUDADialect(), info, "zyx_k", {"gemm": want})
    for name, v in (("conv", y), ("conv dgrad", gx), ("conv wgrad", gw)):
        g = lowered(v, conv_tf32)
        assert g.strategy == "mma" and g.variant["mma"] == "tf32", name
        assert compiler.binary(g.source)[:4] == b"\x7fELF", name
        assert lowered(v, _H100_CC).strategy == "gemm", name
    for name, v in (("matmul", m), ("grad a", ga), ("grad b", gb)):
        assert lowered(v, conv_tf32).strategy == "gemm", name


def test_allow_tf32_setting_reaches_every_device():
    """Setting zyx.backends.cudnn.allow_tf32 writes every device's DeviceInfo and drops
    the plans made under the other value (the suite runs with it off)."""
    assert zyx.backends.cudnn.allow_tf32 is False
    x = zyx.Tensor(np.ones((4, 4), np.float32))
    (x @ x).realize()
    assert zyx._RT.plans
    zyx.backends.cudnn.allow_tf32 = True
    try:
        assert zyx.backends.cudnn.allow_tf32 is True
        assert all(d.info().conv_tf32 for d in zyx._RT.devices)
        assert not zyx._RT.plans
    finally:
        zyx.backends.cudnn.allow_tf32 = False
    assert not any(d.info().conv_tf32 for d in zyx._RT.devices)


def test_float32_matmul_precision_setting():
    assert zyx.get_float32_matmul_precision() == "highest"
    with pytest.raises(ValueError, match="highest"):
        zyx.set_float32_matmul_precision("fast")
    x = zyx.Tensor(np.ones((4, 4), np.float32))
    (x @ x).realize()
    assert zyx._RT.plans
    zyx.set_float32_matmul_precision("medium")
    try:
        assert zyx.get_float32_matmul_precision() == "medium"
        # the setting reaches code generation through every device's DeviceInfo
        assert all(d.info().float32_precision == "medium" for d in zyx._RT.devices)
        assert not zyx._RT.plans          # plans made under the old setting are dropped
        np.testing.assert_array_equal((x @ x).numpy(), np.full((4, 4), 4, np.float32))
    finally:
        zyx.set_float32_matmul_precision("highest")


def test_hand_written_multi_launch_kernel_compiles(compiler):
    # the shape of program the work-group lowering emits: 2 entry points, __shared__
    # memory, barriers, a scratch buffer between the launches
    dl = CUDADialect()
    src = dl.prelude + f"""
{dl.kernel_prefix} part(const float* {dl.restrict} x, float* {dl.restrict} s) {{
  {dl.local_qualifier}float t[64];
  t[{dl.local_id()}] = x[{dl.group_id()} * {dl.local_size()} + {dl.local_id()}];
  {dl.barrier()};
  if ({dl.local_id()} == 0) {{ float a = 0; for (int i = 0; i < 64; i++) a += t[i]; s[{dl.group_id()}] = a; }}
}}
{dl.kernel_prefix} finish(const float* {dl.restrict} s, float* {dl.restrict} y) {{
  if ({dl.local_id()} == 0) {{ float a = 0; for (int i = 0; i < 4; i++) a += s[i]; y[0] = a; }}
}}
"""
    cubin = compiler.binary(src)
    assert b"part" in cubin and b"finish" in cubin


def test_compile_error_names_the_compiler_and_shows_the_source(compiler):
    bad = 'extern "C" __global__ void zyx_k(float* g0) { g0[0] = undefined_name; }'
    with pytest.raises(BackendError, match="NVRTC failed to compile") as e:
        compiler.binary(bad)
    assert "undefined_name" in str(e.value) and "--- source ---" in str(e.value)


# -- disk cache of binaries ---------------------------------------------------------------

SIMPLE = 'extern "C" __global__ void zyx_k(float* g0) { g0[threadIdx.x] = 2.0f; }'


def test_disk_cache_round_trip(compiler, tmp_path):
    first = compiler.binary(SIMPLE)
    assert compiler.compiled == 1
    files = sorted(os.listdir(tmp_path))
    assert len(files) == 2 and files[0].endswith(".cubin") and files[1].endswith(".sha256")
    assert all(os.stat(tmp_path / f).st_mode & 0o077 == 0 for f in files)   # ours alone
    # a second process (a fresh compiler on the same directory) compiles nothing
    from zyx.backends.cuda import nvrtc_compiler
    again = nvrtc_compiler((9, 0))
    again.disk = BinaryCache("cuda", "cubin", str(tmp_path))
    assert again.binary(SIMPLE) == first
    assert again.compiled == 0


def test_binaries_compile_the_missing_sources_in_parallel(compiler, tmp_path):
    """RuntimeCompiler.binaries: every source's binary in order (duplicates once), the
    ones in memory or on disk not compiled again, the rest compiled by parallel threads
    into the same cubins one compile gives; a bad source raises its own error."""
    from zyx.backends.cuda import nvrtc_compiler
    srcs = [SIMPLE.replace("2.0f", f"{v}.0f") for v in range(5)]
    first = compiler.binary(srcs[0])                     # in memory and on disk
    out = compiler.binaries(srcs + [srcs[3]])
    assert compiler.compiled == 5                        # 1 before, 4 now
    assert out[0] == first and out[3] == out[5] and len(set(out[:5])) == 5
    assert all(b[:4] == b"\x7fELF" for b in out)
    fresh = nvrtc_compiler((9, 0))                       # a second process: from disk
    fresh.disk = BinaryCache("cuda", "cubin", str(tmp_path))
    assert fresh.binaries(srcs) == out[:5] and fresh.compiled == 0
    alone = nvrtc_compiler((9, 0))
    alone.disk = BinaryCache("cuda", "cubin", str(tmp_path / "other"))
    assert [alone.compile(src) for src in srcs[1:3]] == out[1:3]
    bad = SIMPLE.replace("2.0f", "undefined_name")
    with pytest.raises(BackendError, match="undefined_name"):
        compiler.binaries([srcs[0], bad, SIMPLE.replace("2.0f", "7.0f")])


@pytest.mark.parametrize("damage", ["flip", "truncate", "no_digest", "empty"])
def test_damaged_cached_binary_is_rejected_and_rebuilt(compiler, tmp_path, damage):
    good = compiler.binary(SIMPLE)
    (cubin,) = [tmp_path / f for f in os.listdir(tmp_path) if f.endswith(".cubin")]
    digest = cubin.with_suffix(".sha256")
    if damage == "flip":
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        cubin.write_bytes(bytes(data))
    elif damage == "truncate":
        cubin.write_bytes(good[:100])
    elif damage == "no_digest":
        digest.unlink()
    else:
        cubin.write_bytes(b"")
    from zyx.backends.cuda import nvrtc_compiler
    fresh = nvrtc_compiler((9, 0))
    fresh.disk = BinaryCache("cuda", "cubin", str(tmp_path))
    assert fresh.binary(SIMPLE) == good        # rebuilt, not the damaged bytes
    assert fresh.compiled == 1
    assert cubin.read_bytes() == good and digest.exists()   # and the cache repaired


def test_unwritable_cache_warns_and_still_compiles(compiler, tmp_path):
    compiler.disk = BinaryCache("cuda", "cubin", str(tmp_path / "missing" / "dir"))
    with pytest.warns(RuntimeWarning, match="not usable"):
        assert compiler.binary(SIMPLE)[:4] == b"\x7fELF"
    assert compiler.disk.enabled is False
    assert compiler.binary(SIMPLE + " ")[:4] == b"\x7fELF"   # no second warning, no error


def test_cache_key_covers_target_and_options(compiler, tmp_path):
    from zyx.backends.cuda import nvrtc_compiler
    compiler.binary(SIMPLE)
    other = nvrtc_compiler((8, 0))
    other.disk = BinaryCache("cuda", "cubin", str(tmp_path))
    other.binary(SIMPLE)
    assert other.compiled == 1          # sm_80 is not served sm_90's cubin
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".cubin")]) == 2


# -- NVRTC target selection ---------------------------------------------------------------

class _FakeNVRTC:
    def __init__(self, archs):
        self.archs = archs

    def nvrtcGetSupportedArchs(self):
        return (0, self.archs)


@pytest.mark.parametrize("cc,archs,want", [
    ((9, 0), [75, 80, 86, 89, 90, 100], "sm_90a"),   # Hopper's own instructions (wgmma)
    ((10, 0), [75, 80, 86, 89, 90, 100], "sm_100"),
    ((8, 9), [75, 80, 86, 90], "sm_86"),          # a cubin runs on later minors
    ((12, 1), [75, 80, 86, 89, 90], "compute_90"),  # NVRTC older than the GPU: PTX
])
def test_nvrtc_target(cc, archs, want):
    from zyx.backends.cuda import nvrtc_target
    assert nvrtc_target(_FakeNVRTC(archs), cc) == want


def test_nvrtc_target_refuses_an_older_gpu_than_nvrtc_knows():
    from zyx.backends.cuda import nvrtc_target
    with pytest.raises(BackendError, match="none of the architectures"):
        nvrtc_target(_FakeNVRTC([75, 80, 90]), (6, 1))


def test_compute_estimate_uses_cores_per_sm():
    from zyx.backends.cuda import cores_per_sm
    assert cores_per_sm((9, 0)) == 128 and cores_per_sm((8, 0)) == 64
    assert cores_per_sm((8, 6)) == 128 and cores_per_sm((7, 5)) == 64


# -- the shared pool and launch path against a host-memory driver -------------------------

class HostMemoryDriver:
    """The gpudriver protocol with "device" memory in host buffers, copies done at once
    and launches recorded with the parameter values the driver would read: enough to
    check the pool's bookkeeping, chunked staging and the parameter arrays."""

    def __init__(self, capacity=1 << 20):
        self.capacity = capacity
        self.blocks = {}
        self.host = {}
        self.launched = []
        self.unloaded = []
        self.host_allocs = 0

    def make_current(self):
        pass

    def mem_info(self):
        return self.capacity - sum(len(b) for b in self.blocks.values()), self.capacity

    def _new(self, table, nbytes):
        buf = ctypes.create_string_buffer(nbytes)
        table[ctypes.addressof(buf)] = buf
        return ctypes.addressof(buf)

    def alloc(self, nbytes):
        if nbytes > self.mem_info()[0]:
            raise gpudriver.DeviceOutOfMemory("full")
        return self._new(self.blocks, nbytes)

    def free(self, ptr):
        del self.blocks[ptr]

    def host_alloc(self, nbytes):
        self.host_allocs += 1
        return self._new(self.host, nbytes)

    def host_free(self, ptr):
        del self.host[ptr]

    def copy_to_device(self, dst, src, nbytes):
        ctypes.memmove(dst, src, nbytes)

    copy_to_host = copy_to_device

    def event_create(self):
        return object()

    def event_record(self, ev):
        pass

    event_sync = event_destroy = event_record

    def stream_sync(self):
        pass

    def module_load(self, image):
        # the fake binary: "entry:nparams" pairs, so a launch knows how many to read
        return dict(item.split(":") for item in image.decode().split())

    def function(self, module, name):
        return name, int(module[name])

    def module_unload(self, module):
        self.unloaded.append(module)

    def launch(self, fn, groups, local_size, params):
        name, n = fn
        addrs = (ctypes.c_uint64 * n).from_address(params)
        values = [ctypes.c_uint64.from_address(a).value for a in addrs]
        self.launched.append((name, groups, local_size, values))


class SourceAsBinary:
    """A compiler whose binary is the source's bytes (HostMemoryDriver reads them)."""
    compiled = 0

    def binary(self, source):
        return source.encode()

    def binaries(self, sources):
        return [self.binary(src) for src in sources]


class HandLoweredDevice(gpudriver.DriverDevice):
    """A DriverDevice whose lowering returns a given GPUKernel."""
    backend = "test"

    def __init__(self, driver, pool, gpu_kernel):
        self.gpu_kernel = gpu_kernel
        super().__init__(driver, pool, CUDADialect(), SourceAsBinary())

    def _make_info(self):
        return DeviceInfo(name="host-memory test device")

    def render(self, kernel, name="zyx_k", schedule=None):
        return self.gpu_kernel


class _PerKernelDevice(gpudriver.DriverDevice):
    """A DriverDevice lowering kernel `n` (any hashable) to a source of its own, whose
    compiler records what `binaries` was asked for."""
    backend = "test"

    def __init__(self):
        class Recording(SourceAsBinary):
            batches = []

            def binaries(self, sources):
                self.batches.append(list(sources))
                return super().binaries(sources)
        drv = HostMemoryDriver()
        super().__init__(drv, gpudriver.DriverMemoryPool(drv, "test"), CUDADialect(),
                         Recording())

    def _make_info(self):
        return DeviceInfo(name="host-memory test device")

    def render(self, kernel, name="zyx_k", schedule=None):
        return GPUKernel(f"k{kernel}:1", [Launch(f"k{kernel}", 1, 64, [("arg", 0)])])


def test_compile_many_compiles_a_plans_new_sources_together():
    """DriverDevice.compile_many: one `binaries` call for the kernels not compiled yet
    (their sources compile in parallel there), programs in the kernels' order, a kernel
    twice gets one program, and kernels compiled before are not compiled again."""
    dev = _PerKernelDevice()
    progs = dev.compile_many([1, 2, 1, 3])
    assert dev.compiler.batches == [["k1:1", "k2:1", "k3:1"]]
    assert progs[0] is progs[2] and len({id(p) for p in progs}) == 3
    assert [p.gpu.launches[0].entry for p in progs] == ["k1", "k2", "k1", "k3"]
    again = dev.compile_many([2, 4])          # one new kernel: compiled alone
    assert again[0] is progs[1] and again[1].gpu.source == "k4:1"
    assert dev.compiler.batches == [["k1:1", "k2:1", "k3:1"]]


def test_pool_copies_round_trip_through_staging_chunks(monkeypatch):
    monkeypatch.setattr(gpudriver, "STAGING_MAX", 4096)
    monkeypatch.setattr(gpudriver, "STAGING_MIN", 1024)
    monkeypatch.setattr(gpudriver._UploadRing, "MAX_PIECE", 0)    # every copy staged
    drv = HostMemoryDriver()
    pool = gpudriver.DriverMemoryPool(drv, "test")
    for n in (1, 1000, 4096, 4097, 3 * 4096 + 5):
        a = np.random.randint(0, 256, n).astype(np.uint8)
        buf, _ = pool.allocate(n)
        assert pool.host_to_pool(a, buf, []) is None
        out = np.empty(n, np.uint8)
        pool.pool_to_host(buf, out, [])
        np.testing.assert_array_equal(out, a)
        pool.deallocate(buf)
    assert drv.host_allocs <= 4       # two slots, each grown at most once past 1 KiB
    pool.close()
    assert not drv.blocks and not drv.host


def test_small_uploads_go_through_the_ring_and_wait_only_a_lap_later(monkeypatch):
    monkeypatch.setattr(gpudriver._UploadRing, "SIZE", 8 * 1024)
    monkeypatch.setattr(gpudriver._UploadRing, "SEGMENTS", 4)      # 2 KiB segments
    drv = HostMemoryDriver()
    syncs = []
    drv.event_sync = lambda ev: syncs.append(ev)
    pool = gpudriver.DriverMemoryPool(drv, "test")
    bufs = []
    for i in range(32):                       # 32 x 512 B = 2 laps of the 8 KiB ring
        a = np.full(500, i, np.uint8)
        buf, _ = pool.allocate(500)
        pool.host_to_pool(a, buf, [])
        bufs.append((buf, a))
        if i < 16:
            assert not syncs, "no wait during the first lap"
    assert 0 < len(syncs) <= 4                # then one wait per segment entered
    for buf, a in bufs:
        out = np.empty(500, np.uint8)
        pool.pool_to_host(buf, out, [])
        np.testing.assert_array_equal(out, a)
        pool.deallocate(buf)
    pool.close()
    assert not drv.blocks and not drv.host


def test_pool_reuses_freed_blocks_and_counts_live_bytes():
    drv = HostMemoryDriver()
    pool = gpudriver.DriverMemoryPool(drv, "test")
    a, _ = pool.allocate(256)
    assert pool.used_bytes == 256
    addr = a.handle
    pool.deallocate(a)
    assert pool.used_bytes == 0 and pool.cached_bytes == 256
    assert pool.free_bytes == drv.capacity        # cached blocks count as free
    pool.allocate(1000)                           # a new block: the driver is asked again
    assert pool.free_bytes == drv.capacity - 1000
    b, _ = pool.allocate(256)
    assert b.handle == addr and b.ptr == addr     # the same block, no new allocation
    c, _ = pool.allocate(128)
    assert c.handle != addr and len(drv.blocks) == 3


def test_pool_releases_cached_blocks_when_the_device_is_full():
    drv = HostMemoryDriver(capacity=1000)
    pool = gpudriver.DriverMemoryPool(drv, "test")
    a, _ = pool.allocate(600)
    pool.deallocate(a)                 # cached: the device still holds 600 bytes
    b, _ = pool.allocate(700)          # fails once, trims the cache, succeeds
    assert pool.cached_bytes == 0 and list(drv.blocks) == [b.handle]
    with pytest.raises(AllocationError, match="cannot allocate 700 bytes"):
        pool.allocate(700)


def test_pool_keeps_at_most_its_cache_limit_of_freed_blocks():
    """Freed blocks of sizes a program stops using do not pile up: past `cache_limit`
    the blocks freed longest ago go back to the driver (down to 3/4 of the limit), the
    newest stay for reuse, and trim() gives back all of them."""
    drv = HostMemoryDriver(capacity=1 << 20)
    pool = gpudriver.DriverMemoryPool(drv, "test", cache_limit=1000)
    blocks = [pool.allocate(n)[0] for n in (300, 400, 500)]
    newest = blocks[2].handle
    for b in blocks:
        pool.deallocate(b)           # 300 + 400 + 500 > 1000: the 300 and 400 go
    assert pool.cached_bytes == 500 and list(drv.blocks) == [newest]
    again, _ = pool.allocate(500)    # the kept block is reused
    assert again.handle == newest and pool.cached_bytes == 0
    pool.deallocate(again)
    for n in range(1, 40):           # many sizes, each freed: at most the limit is kept
        pool.deallocate(pool.allocate(100 + n)[0])
        assert pool.cached_bytes <= 1000
        assert sum(len(b) for b in drv.blocks.values()) <= 1000
    pool.trim()
    assert pool.cached_bytes == 0 and not drv.blocks and pool.used_bytes == 0


def test_pool_cache_limit_comes_from_the_config():
    from zyx.backends import blocks
    assert blocks.configured_limit({}) is None
    assert blocks.configured_limit({"cache_limit_mb": 64}) == 64 << 20
    assert blocks.configured_limit({"cache_limit_mb": 0}) == 0
    for bad in (-1, "64", True):
        with pytest.raises(BackendError, match="cache_limit_mb"):
            blocks.configured_limit({"cache_limit_mb": bad})
    drv = HostMemoryDriver(capacity=1 << 20)
    assert gpudriver.DriverMemoryPool(drv, "test").cache_limit == (1 << 20) // 10


def test_cuda_pool_returns_freed_memory_to_the_driver(cuda_runtime, monkeypatch):
    """Allocations of many sizes, each freed, leave at most the pool's cache limit held
    (the rest goes back to the driver), and zyx.empty_cache / zyx.cuda.empty_cache give
    back the rest; memory_allocated counts live tensors only. What the pool holds is
    counted at the driver's alloc and free calls: the device's free memory is shared
    with every other process on the GPU (the suites of .ci/gpu_run.sh run at once), so
    it cannot tell this pool's blocks from theirs."""
    import zyx.cuda
    pool = zyx._RT.device().pool
    zyx.empty_cache()
    drv = pool.driver
    held = {}                                     # pointer -> bytes, this test's blocks
    alloc, free = drv.alloc, drv.free

    def counted_alloc(nbytes):
        ptr = alloc(nbytes)
        held[ptr] = nbytes
        return ptr

    def counted_free(ptr):
        held.pop(ptr, None)
        return free(ptr)
    monkeypatch.setattr(drv, "alloc", counted_alloc)
    monkeypatch.setattr(drv, "free", counted_free)
    allocated0 = zyx.cuda.memory_allocated()
    n = 1 << 26                                   # 256 MiB of float32, 40 sizes: 10 GiB
    for k in range(40):
        t = (zyx.ones(n + 1024 * k) * 2).realize()
        assert zyx.cuda.memory_allocated() >= allocated0 + 4 * n
        del t
    assert zyx.cuda.memory_allocated() == allocated0
    assert zyx.cuda.memory_reserved() == allocated0 + pool.cached_bytes
    assert pool.cached_bytes <= pool.cache_limit
    assert sum(held.values()) <= pool.cache_limit
    zyx.cuda.empty_cache()
    assert pool.cached_bytes == 0 and zyx.cuda.memory_reserved() == allocated0
    assert not held, f"{len(held)} blocks of this test still held after empty_cache"


def test_launch_writes_every_launch_its_buffers_and_scratch_in_order():
    gpu = GPUKernel("part:2 finish:2", [
        Launch("part", 40, 256, [("arg", 1), ("scratch", 0)]),
        Launch("finish", 1, 64, [("scratch", 0), ("arg", 0)]),
    ], scratch=[160])
    drv = HostMemoryDriver()
    pool = gpudriver.DriverMemoryPool(drv, "test")
    dev = HandLoweredDevice(drv, pool, gpu)
    prog = dev.compile("kernel-a")
    assert dev.compile("kernel-a") is prog
    out, _ = pool.allocate(4)
    inp, _ = pool.allocate(40 * 256 * 4)
    dev.launch(prog, pool, [out, inp], [])
    (scratch,) = prog.scratch
    assert drv.launched == [("part", 40, 256, [inp.handle, scratch]),
                            ("finish", 1, 64, [scratch, out.handle])]
    # a second realization with other buffers rewrites the values, keeps the scratch
    out2, _ = pool.allocate(4)
    dev.launch(prog, pool, [out2, inp], [])
    assert drv.launched[-1] == ("finish", 1, 64, [scratch, out2.handle])
    assert prog.scratch == [scratch]
    assert pool.used_bytes == 4 + 40 * 256 * 4 + 4   # scratch is the program's, not counted


class MapEncodingDriver(HostMemoryDriver):
    """HostMemoryDriver that encodes tensor maps: it records each encoding and writes the
    buffer's address as the map's first word (what a recorded launch then reads)."""

    def __init__(self):
        super().__init__()
        self.encoded = []

    def encode_tensor_map(self, out, spec, address):
        self.encoded.append((out, spec, address))
        ctypes.c_uint64.from_address(out).value = address


def _mapped_kernel(offset):
    """(map, GPUKernel "k" of 2 arguments whose launch maps argument 1 at `offset`)."""
    from zyx.codegen.gpu.nvidia.tma import TensorMap
    m = TensorMap(1, offset, "bfloat16", 2, [72, 200], [144], [64, 128])
    return m, GPUKernel("k:3", [Launch("k", 4, 384, [("arg", 0), ("arg", 1)], maps=[m])])


def _map_device(gpu, device=HandLoweredDevice):
    """(driver, pool, device, program, out, a): a `device` class on a MapEncodingDriver
    lowering every kernel to `gpu`, its program, a 64-byte output `out` and a 1000-byte
    buffer `a`."""
    drv = MapEncodingDriver()
    pool = gpudriver.DriverMemoryPool(drv, "test")
    dev = device(drv, pool, gpu)
    prog = dev.compile("kernel-a")
    out, _ = pool.allocate(64)
    a, _ = pool.allocate(1000)
    return drv, pool, dev, prog, out, a


def test_tensor_map_parameters_are_encoded_when_their_buffer_moves():
    """A launch with tensor maps (tma.py) passes each after the buffers, 64-byte aligned,
    encoded by the driver for its buffer's address: again only when the buffer moved."""
    m, gpu = _mapped_kernel(16)
    drv, pool, dev, prog, out, a = _map_device(gpu)
    dev.launch(prog, pool, [out, a], [])
    dev.launch(prog, pool, [out, a], [])
    (where, spec, address), = drv.encoded
    assert spec is m and address == a.handle and where % 64 == 0
    # the third parameter is the map's memory, read as the driver would copy it
    assert drv.launched[-1] == ("k", 4, 384, [out.handle, a.handle, a.handle])
    b, _ = pool.allocate(1000)
    dev.launch(prog, pool, [out, b], [])
    assert [e[2] for e in drv.encoded] == [a.handle, b.handle]
    assert drv.launched[-1][3] == [out.handle, b.handle, b.handle]
    # a driver that cannot encode maps refuses the program when it is made
    with pytest.raises(BackendError, match="tensor maps"):
        HandLoweredDevice(HostMemoryDriver(), pool, gpu).compile("kernel-b")


def test_tensor_maps_of_scratch_buffers_are_encoded_for_the_scratch():
    """A map of the program's scratch buffer (kcopy.py: a K-major copy made by a first
    launch) is encoded for that buffer, passed to the product's launch after its own
    buffers; the copy's launch runs first."""
    from zyx.codegen.gpu.nvidia.tma import TensorMap
    m = TensorMap(0, 0, "float32", 4, [96, 200], [384], [32, 128], scratch=True)
    gpu = GPUKernel("copy:2 k:4", [Launch("copy", 2, 256, [("scratch", 0), ("arg", 1)]),
                            Launch("k", 4, 384, [("arg", 0), ("arg", 1), ("scratch", 0)],
                                   maps=[m])], scratch=[96 * 200 * 4])
    drv, pool, dev, prog, out, a = _map_device(gpu)
    dev.launch(prog, pool, [out, a], [])
    dev.launch(prog, pool, [out, a], [])
    scratch = prog.scratch[0]
    (_, spec, address), = drv.encoded         # once: the scratch buffer stays
    assert spec is m and address == scratch
    assert [ln[0] for ln in drv.launched] == ["copy", "k", "copy", "k"]
    assert drv.launched[0][3] == [scratch, a.handle]
    assert drv.launched[1][3] == [out.handle, a.handle, scratch, scratch]


def test_misaligned_buffers_run_the_kernel_lowered_without_maps():
    """A buffer whose mapped element 0 is not 16-byte aligned (a DLPack view) cannot
    start a tensor map: that launch runs the kernel lowered with the gemm knob tma=0
    (compiled once, kept with the program and released with it); aligned buffers keep
    the mapped kernel."""
    from zyx.codegen.gpu.nvidia.tma import TensorMap
    m, mapped = _mapped_kernel(0)
    plain = GPUKernel("p:2", [Launch("p", 8, 256, [("arg", 0), ("arg", 1)])])

    class TwoLowerings(HandLoweredDevice):
        asked = []

        def render(self, kernel, name="zyx_k", schedule=None):
            self.asked.append(schedule)
            return plain if (schedule or {}).get("gemm_knobs") == {"tma": 0} else mapped
    drv, pool, dev, prog, out, a = _map_device(None, TwoLowerings)

    class View:                  # a borrowed buffer 2 bytes into a block
        ptr = a.ptr + 2
    dev.launch(prog, pool, [out, View], [])
    dev.launch(prog, pool, [out, View], [])
    assert [x[0] for x in drv.launched] == ["p", "p"]
    assert drv.launched[-1][3] == [out.handle, a.handle + 2]
    assert dev.asked.count({"gemm_knobs": {"tma": 0}}) == 1
    dev.launch(prog, pool, [out, a], [])
    assert drv.launched[-1][0] == "k"
    unmapped = prog.unmapped
    dev.release(prog)
    assert prog.unmapped is None and unmapped.module in drv.unloaded
    assert m.aligned(4096) and not m.aligned(4098)
    assert not TensorMap(1, 6, "bfloat16", 2, [72], [], [64]).aligned(4096)


# -- plan-level launches and graph replay against the host-memory driver ------------------

class GraphRecordingDriver(HostMemoryDriver):
    """HostMemoryDriver with the graph calls graphs.GraphReplay makes. As the real driver
    does, a node copies its launch's parameter values when the graph is built and when
    its parameters are rewritten, and an instantiated graph copies its graph's nodes; a
    replay records each node's launch from those copies (a node not rewritten after its
    buffer moved records the old address)."""

    def __init__(self):
        super().__init__()
        self.graph_api = self
        self.graph_calls = []

    def node_params(self, fn, groups, local_size, shared, address):
        return fn, groups, local_size, address

    def _read(self, params):
        (name, n), groups, local_size, address = params
        addrs = (ctypes.c_uint64 * n).from_address(address)
        return name, groups, local_size, [ctypes.c_uint64.from_address(a).value
                                          for a in addrs]

    def build(self, node_params):
        self.graph_calls.append("build")
        return [self._read(p) for p in node_params], list(range(len(node_params)))

    def instantiate(self, graph):
        self.graph_calls.append("instantiate")
        return list(graph)

    def set_params(self, exe, node, params):
        self.graph_calls.append("set")
        exe[node] = self._read(params)

    def launch_graph(self, exe):
        self.graph_calls.append("launch")
        self.launched.extend(exe)

    def destroy(self, graph, exe):
        self.graph_calls.append("destroy")


class _GraphApi:
    """The graph side of a GraphRecordingDriver under the names GraphReplay calls (the
    driver's own `launch` is the plain cuLaunchKernel stand-in)."""

    def __init__(self, drv):
        self.drv = drv
        for name in ("node_params", "build", "instantiate", "set_params", "destroy"):
            setattr(self, name, getattr(drv, name))
        self.launch = drv.launch_graph


def _plan_device(graphs):
    """(driver, pool, device) lowering every kernel to two launches sharing a scratch
    buffer; the driver has graphs when `graphs`."""
    gpu = GPUKernel("part:2 finish:2", [
        Launch("part", 40, 256, [("arg", 1), ("scratch", 0)]),
        Launch("finish", 1, 64, [("scratch", 0), ("arg", 0)]),
    ], scratch=[160])
    drv = GraphRecordingDriver() if graphs else HostMemoryDriver()
    if graphs:
        drv.graph_api = _GraphApi(drv)
    pool = gpudriver.DriverMemoryPool(drv, "test")
    return drv, pool, HandLoweredDevice(drv, pool, gpu)


@pytest.mark.parametrize("graphs", [False, True], ids=["launches", "graph"])
def test_plan_launches_rewrite_only_the_buffers_that_moved(graphs):
    """DriverPlanLaunches: kernel a reads a leaf (slot 1) into a temporary 128 bytes into
    the arena (slot 0), kernel b reads it into a target (slot 2). Every run launches
    the four launches with the current addresses, whichever buffers moved; with graphs,
    the first run launches plainly, later runs replay graphs: a new variant per new set
    of addresses up to graphs.VARIANTS, then the least recently used one rebound by
    rewriting only the nodes that read a moved buffer."""
    from zyx.backends import graphs as G
    drv, pool, dev = _plan_device(graphs)
    a, b = dev.compile("kernel-a"), dev.compile("kernel-b")
    launcher = dev.prepare_launches([(a, [("a", 128), ("t", 1)]),
                                     (b, [("t", 2), ("a", 128)])], 3)
    assert isinstance(launcher, gpudriver.DriverPlanLaunches)
    sa, sb = a.scratch[0], b.scratch[0]        # made when the plan was prepared
    arena, _ = pool.allocate(512)
    leaves = [pool.allocate(40 * 256 * 4)[0] for _ in range(2)]
    outs = [pool.allocate(4)[0] for _ in range(G.VARIANTS + 2)]

    def run(leaf, out):
        drv.launched.clear()
        dev.run_launches(launcher, [arena, leaf, out])
        t = arena.ptr + 128
        assert drv.launched == [("part", 40, 256, [leaf.ptr, sa]),
                                ("finish", 1, 64, [sa, t]),
                                ("part", 40, 256, [t, sb]),
                                ("finish", 1, 64, [sb, out.ptr])]
    run(leaves[0], outs[0])
    run(leaves[0], outs[0])
    run(leaves[1], outs[1])          # both moved
    run(leaves[0], outs[0])          # back to the first buffers
    for out in outs:                 # more sets of addresses than variants
        run(leaves[1], out)
    run(leaves[0], outs[0])
    if not graphs:
        assert launcher.graph is None
        return
    replay = launcher.graph
    assert replay.builds == G.VARIANTS and replay.replays == 3 + len(outs) + 1
    assert drv.graph_calls.count("instantiate") == G.VARIANTS
    # variants: (l0, o0) (l1, o1) (l1, o0) (l1, o2) built; then outs[3] takes (l0, o0)'s
    # (leaf and target moved: 2 nodes), outs[4] and outs[5] the (l1, o0) and (l1, o1)
    # ones (the target's node alone), the last run the (l1, o2) one (2 nodes)
    assert replay.rebinds == 2 + 1 + 1 + 2
    assert drv.graph_calls.count("set") == replay.rebinds
    launcher.close()
    assert drv.graph_calls.count("destroy") == G.VARIANTS


def test_graph_replay_falls_back_to_launches_when_the_driver_refuses():
    """A driver error from a graph call (an old driver, a kernel graphs cannot hold)
    turns graphs off for that plan: the run and the next ones launch plainly."""
    drv, pool, dev = _plan_device(True)

    def refuse(graph):
        raise BackendError("CUDA: cuGraphInstantiateWithFlags failed: not supported")
    drv.graph_api.instantiate = refuse
    a = dev.compile("kernel-a")
    launcher = dev.prepare_launches([(a, [("t", 1), ("t", 2)])], 3)
    out, _ = pool.allocate(4)
    leaf, _ = pool.allocate(4096)
    for _ in range(3):
        drv.launched.clear()
        dev.run_launches(launcher, [None, out, leaf])
        assert [x[0] for x in drv.launched] == ["part", "finish"]
        assert drv.launched[1][3] == [a.scratch[0], out.ptr]
    assert launcher.graph is None and "destroy" in drv.graph_calls


def test_plan_launches_are_off_when_switched_off(monkeypatch):
    """plan_launches False (config "plan_launches": false, ZYX_PLAN_LAUNCHES=0): the
    device declines, the scheduler keeps its kernel-by-kernel path; the switch reads
    the environment first, then the config section, and refuses a non-boolean."""
    from zyx.backends import switch
    drv, pool, dev = _plan_device(False)
    dev.plan_launches = False
    assert dev.prepare_launches([(dev.compile("k"), [("t", 1), ("t", 2)])], 3) is None
    monkeypatch.delenv("ZYX_CUDA_GRAPHS", raising=False)
    assert switch({}, "graphs", "ZYX_CUDA_GRAPHS") is True
    assert switch({"graphs": False}, "graphs", "ZYX_CUDA_GRAPHS") is False
    monkeypatch.setenv("ZYX_CUDA_GRAPHS", "0")
    assert switch({"graphs": True}, "graphs", "ZYX_CUDA_GRAPHS") is False
    monkeypatch.setenv("ZYX_CUDA_GRAPHS", "1")
    assert switch({"graphs": False}, "graphs", "ZYX_CUDA_GRAPHS") is True
    monkeypatch.delenv("ZYX_CUDA_GRAPHS")
    with pytest.raises(BackendError, match="graphs='no' is not true or false"):
        switch({"graphs": "no"}, "graphs", "ZYX_CUDA_GRAPHS")


def test_plan_launches_encode_tensor_maps_when_their_buffer_moves():
    """A plan's launch with a tensor map has a map of its own (the program's serves
    the kernel-by-kernel path), encoded when the mapped buffer moves; a buffer the map
    cannot start at (misaligned) runs that run kernel by kernel through the kernel
    lowered without maps, and the next aligned run is prepared again."""
    m, mapped = _mapped_kernel(0)
    plain = GPUKernel("p:2", [Launch("p", 8, 256, [("arg", 0), ("arg", 1)])])

    class TwoLowerings(HandLoweredDevice):
        def render(self, kernel, name="zyx_k", schedule=None):
            return plain if (schedule or {}).get("gemm_knobs") == {"tma": 0} else mapped
    drv, pool, dev, prog, out, a = _map_device(None, TwoLowerings)
    launcher = dev.prepare_launches([(prog, [("t", 1), ("t", 2)])], 3)
    b, _ = pool.allocate(1000)

    class View:                   # a borrowed buffer 2 bytes into a block
        ptr = a.ptr + 2
    for src in (a, a, b, View, View, a):
        drv.launched.clear()
        dev.run_launches(launcher, [None, out, src])
        if src is View:
            assert drv.launched == [("p", 8, 256, [out.ptr, a.ptr + 2])]
        else:
            assert drv.launched == [("k", 4, 384, [out.ptr, src.ptr, src.ptr])]
    assert [e[2] for e in drv.encoded] == [a.ptr, b.ptr, a.ptr]


def test_operand_maps_of_products():
    """tma.operand_map: the map of each operand layout of a product (contiguous
    dimension first, the batch's after the side's), and None where TMA cannot copy it:
    a row stride that is not a multiple of 16 bytes, a computed operand."""
    from zyx.codegen.gpu.nvidia import tma

    def t(*s):
        return zyx.Tensor(np.ones(s, np.float32)).cast("bfloat16").realize()

    def maps(expr):
        k = _untiled_kernel(expr)
        p = gemm.plan(k.ops)
        arg_of = {i: op[3] for i, op in enumerate(k.ops)
                  if op[0] == K.DEFINE and op[2] == K.SCOPE_GLOBAL}
        groups = tma.k_groups(k.ops, p)
        if groups is None:
            return p, [None, None]
        found = [tma.operand_map(k.ops, p, side, kfast, 128, arg_of, groups)
                 for side, kfast in (("a", p.a_kfast), ("b", p.b_kfast))]
        return p, [f[:2] if f else None for f in found]
    p, ((ma, at_a), (mb, at_b)) = maps(t(200, 72) @ t(72, 136))
    assert (ma.dims, ma.strides, ma.box, ma.offset) == ([72, 200], [144], [64, 128], 0)
    assert (mb.dims, mb.strides, mb.box) == ([136, 72], [272], [64, 64])
    assert at_a == ["zyx_kn", "zyx_r0"] and at_b == ["zyx_c0", "zyx_kn"]
    _, ((ma, _), (mb, _)) = maps(t(72, 200).T @ t(136, 72).T)
    assert (ma.dims, ma.strides, ma.box) == ([200, 72], [400], [64, 64])
    assert (mb.dims, mb.strides, mb.box) == ([72, 136], [144], [64, 128])
    p, ((ma, at_a), (mb, at_b)) = maps(t(3, 64, 40) @ t(3, 40, 96))
    assert (ma.dims, ma.strides, ma.box) == ([40, 64, 3], [80, 64 * 80], [64, 128, 1])
    assert at_a == ["zyx_kn", "zyx_r0", f"i{p.batch[0]}"]
    assert (mb.dims, mb.strides) == ([96, 40, 3], [192, 40 * 192])
    _, ((ma, _), (mb, _)) = maps(t(200, 80)[:, 8:80] @ t(72, 136))     # a view at byte 16
    assert (ma.dims, ma.strides, ma.offset) == ([72, 200], [160], 16)
    _, (found_a, found_b) = maps(t(200, 73)[:, 1:] @ t(72, 136))       # 146-byte rows
    assert found_a is None and found_b is not None
    _, (found_a, found_b) = maps(t(200, 80)[:, 1:73] @ t(72, 136))     # a view at byte 2
    assert found_a is None and found_b is not None
    _, (found_a, _) = maps((t(200, 72) * 2) @ t(72, 136))
    assert found_a is None
    # float32: a K-major box is 32 values by the side, an MN-major one 32 by 32 K
    f32 = [zyx.Tensor(np.ones(s, np.float32)).realize() for s in ((200, 72), (72, 136))]
    _, ((ma, _), (mb, _)) = maps(f32[0] @ f32[1])
    assert (ma.box, mb.box, mb.dims, mb.strides) == ([32, 128], [32, 32], [136, 72], [544])


def test_programs_of_one_source_share_a_module_until_the_last_is_released():
    gpu = GPUKernel("k:1", [Launch("k", 1, 64, [("arg", 0)])], scratch=[64])
    drv = HostMemoryDriver()
    pool = gpudriver.DriverMemoryPool(drv, "test")
    dev = HandLoweredDevice(drv, pool, gpu)
    p1, p2 = dev.compile("kernel-a"), dev.compile("kernel-b")
    assert p1.module is p2.module
    buf, _ = pool.allocate(4)
    dev.launch(p1, pool, [buf], [])
    blocks = len(drv.blocks)
    dev.release(p1)
    assert len(drv.blocks) == blocks - 1       # its scratch went back to the driver
    assert drv.unloaded == []
    dev.release(p2)
    assert drv.unloaded == [p1.module]
    assert dev.compile("kernel-a") is not p1   # compiled (loaded) again


def test_initialize_without_a_driver_raises_backend_error():
    from zyx.backends import cuda
    try:
        pools, devices = cuda.initialize({})
    except BackendError as e:
        assert str(e).startswith("CUDA: ")
        return
    assert devices and all(d.info().name.startswith("CUDA ") for d in devices)


def test_device_ids_config_is_checked():
    from zyx.backends import device_ids
    assert device_ids({}, 3, "cuda") == [0, 1, 2]
    assert device_ids({"device_ids": [2, 7, 0]}, 3, "cuda") == [2, 0]
    for bad in ("0", [0.0], [True]):
        with pytest.raises(BackendError, match=r"cuda\.device_ids=.* not a list of integers"):
            device_ids({"device_ids": bad}, 3, "cuda")


# -- on an NVIDIA GPU ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def cuda_runtime():
    """The runtime with the CUDA backend alone; skipped with the reason when it cannot
    start (no driver, no device)."""
    from zyx.backends import cuda
    try:
        cuda.initialize({})
    except BackendError as e:
        pytest.skip(f"no NVIDIA driver: {e}")
    yield from only_backend("cuda", "no CUDA device")


@pytest.fixture(autouse=True)
def _numerical_cases_run_on_cuda(request):
    """gpu_cases' tests (imported above) need the CUDA runtime; the codegen tests do not."""
    if request.function.__module__ == "gpu_cases":
        request.getfixturevalue("cuda_runtime")


def test_the_device_is_cuda(cuda_runtime):
    info = cuda_runtime.info()
    assert info.name.startswith("CUDA ")
    # one entry per GPU (a machine may have several of the same kind), numbered in the
    # driver's order
    assert {d.name for d in zyx.devices()} == {info.name}
    assert [str(d) for d in zyx.devices()] == [f"cuda:{i}" for i in range(len(zyx.devices()))]
    assert info.warp_size == 32 and info.max_local_threads >= 256
    assert info.num_cores > 0 and info.compute > 1e12
    major, minor = info.extra["cc"]
    assert major >= 3
    assert info.extra["arch"].startswith(("sm_", "compute_"))


def test_a_cached_realization_compiles_nothing(cuda_runtime):
    a = np.random.randn(32).astype(np.float32)
    x = zyx.Tensor(a)
    np.testing.assert_allclose(((x + 1) * 2).numpy(), (a + 1) * 2, rtol=1e-6)
    before = (zyx.stats()["kernels_compiled"], zyx.stats()["compiler_runs"])
    for _ in range(3):
        np.testing.assert_allclose(((x + 1) * 2).numpy(), (a + 1) * 2, rtol=1e-6)
    assert (zyx.stats()["kernels_compiled"], zyx.stats()["compiler_runs"]) == before


def test_multi_launch_program_with_scratch_runs(cuda_runtime, monkeypatch):
    # a whole-array sum lowered by hand into the two-launch shape of the work-group
    # lowering: the backend must run any GPUKernel, whatever gpu.lower makes today
    dl = cuda_runtime.dialect
    n, groups, local = 1 << 14, 64, 256
    src = dl.prelude + f"""
{dl.kernel_prefix} part(const float* {dl.restrict} x, float* {dl.restrict} s) {{
  {dl.local_qualifier}float t[{local}];
  float a = 0.0f;
  for (int i = {dl.group_id()} * {local} + {dl.local_id()}; i < {n}; i += {groups * local}) a += x[i];
  t[{dl.local_id()}] = a;
  {dl.barrier()};
  for (int w = {local // 2}; w > 0; w >>= 1) {{
    if ({dl.local_id()} < w) t[{dl.local_id()}] += t[{dl.local_id()} + w];
    {dl.barrier()};
  }}
  if ({dl.local_id()} == 0) s[{dl.group_id()}] = t[0];
}}
{dl.kernel_prefix} finish(float* {dl.restrict} y, const float* {dl.restrict} s) {{
  if ({dl.local_id()} == 0) {{ float a = 0.0f; for (int i = 0; i < {groups}; i++) a += s[i]; y[0] = a; }}
}}
"""
    hand = GPUKernel(src, [Launch("part", groups, local, [("arg", 1), ("scratch", 0)]),
                           Launch("finish", 1, 32, [("arg", 0), ("scratch", 0)])],
                     scratch=[groups * 4])
    monkeypatch.setattr(cuda_runtime, "render", lambda kernel, name="zyx_k": hand)
    monkeypatch.setattr(cuda_runtime, "_programs", {})
    zyx._RT.plans.clear()
    a = np.random.randn(n).astype(np.float32)
    try:
        out = zyx.Tensor(a).sum().numpy()
    finally:
        zyx._RT.plans.clear()
    np.testing.assert_allclose(out, a.astype(np.float64).sum(), rtol=1e-4, atol=1e-3)


def test_zyx_device_env_selects_cuda(cuda_runtime, monkeypatch):
    rt = zyx._RT
    monkeypatch.setenv("ZYX_DEVICE", "cuda")
    rt.init()
    try:
        assert rt.device().backend == "cuda"
        a = np.random.randn(4, 4).astype(np.float32)
        np.testing.assert_allclose((zyx.Tensor(a) * 2).numpy(), a * 2)
    finally:
        monkeypatch.delenv("ZYX_DEVICE")
        rt.init(only=["cuda"])


def _torch_cuda():
    torch = pytest.importorskip("torch", reason="PyTorch not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    return torch


def test_dlpack_with_torch_shares_cuda_memory(cuda_runtime):
    torch = _torch_cuda()
    # "cuda:0" by name: torch's bare "cuda" follows the current CUDA context, which is
    # whichever device zyx used last on a machine with several GPUs
    t = torch.arange(12, device="cuda:0", dtype=torch.float32).reshape(3, 4)
    z = zyx.from_dlpack(t)
    assert z.device == "cuda:0" and z.shape == (3, 4)
    assert zyx._RT.graph.get(z._id).buffer.ptr == t.data_ptr()       # no copy
    np.testing.assert_array_equal((z * 2).numpy(), t.cpu().numpy() * 2)
    out = (z + 1).realize()
    back = torch.from_dlpack(out)
    assert back.device.type == "cuda" and back.data_ptr() == zyx._RT.graph.get(out._id).buffer.ptr
    assert torch.equal(back, t + 1)
    for td, zd in [(torch.bfloat16, zyx.bfloat16), (torch.float16, zyx.float16),
                   (torch.int64, zyx.int64), (torch.bool, zyx.bool)]:
        src = (torch.arange(6, device="cuda:0") % 2).to(td)
        z = zyx.from_dlpack(src)
        assert z.dtype is zd
        assert torch.equal(torch.from_dlpack(z), src)


def test_products_of_misaligned_dlpack_views(cuda_runtime):
    """A bfloat16 matmul reading a PyTorch view that starts 2 bytes into its storage (a
    tensor map cannot start there: the launch runs the kernel lowered without maps)
    and then an aligned one, against PyTorch's product. Big enough for the warpgroup
    lowering on a Hopper GPU; any GPU runs it."""
    torch = _torch_cuda()
    g = torch.Generator(device="cuda").manual_seed(3)
    base = torch.randn(512 * 512 + 8, device="cuda", generator=g).to(torch.bfloat16)
    w = torch.randn(512, 384, device="cuda", generator=g).to(torch.bfloat16)
    zw = zyx.from_dlpack(w)
    for start in (1, 8, 1):
        view = base[start:start + 512 * 512].view(512, 512)     # contiguous, offset
        got = torch.from_dlpack((zyx.from_dlpack(view) @ zw).cast("float32").realize())
        want = view.float() @ w.float()
        torch.testing.assert_close(got, want, rtol=2e-2, atol=0.3)


def test_freed_cuda_tensors_return_memory_to_the_pool(cuda_runtime):
    pool = zyx._RT.device().pool       # (an earlier test may have re-initialized)
    # the first draw on a device caches a small index buffer (zyx.random, kept for later
    # draws): made before the count, so the test does not depend on what ran before it
    zyx.randn(1 << 20).realize()
    before = pool.used_bytes
    x = zyx.randn(1 << 20).realize()    # random numbers are lazy: store x too
    y = (x * 2 + 1).realize()
    assert pool.used_bytes >= before + 8 * (1 << 20)
    del x, y
    assert pool.used_bytes == before and pool.cached_bytes >= 8 * (1 << 20)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("want,spec", [((128, 128), ""), ((64, 32), "double=0"),
                                       ((32, 32), "vector=0,prefetch=0"),
                                       ((128, 128), "wn=256,stages=3"),
                                       ((128, 128), "stages=3"), ((128, 128), "wgmma=0"),
                                       ((128, 128), "wm=256,wn=128"),
                                       ((128, 128), "tma=0"),
                                       ((128, 128), "tma=0,wm=256,wn=128")])
def test_tensor_core_products_against_numpy(dtype, want, spec, cuda_runtime, monkeypatch):
    """16-bit products on tensor cores (codegen/gpu/nvidia/mma.py; on a Hopper GPU with 128 x 128
    tiles, plain loads take wgmma.py's warpgroup products) with tile `want` and the gemm
    knobs `spec` (ZYX_GPU_GEMM): both layouts of each operand, 16-byte copies aligned or
    not, a computed operand, an epilogue with a batch, ragged sizes over more K steps
    than stages, block totals over a long K and a padded convolution, against float64
    products of the same 16-bit values. (As if the GPU had 2 SMs: it would leave these
    small products to the other strategies.) Skipped without compute capability 8.0."""
    with _tensor_core_device(cuda_runtime, monkeypatch, want, spec) as found:
        _tensor_core_checks(dtype, found, want, spec)


@contextlib.contextmanager
def _tensor_core_device(cuda_runtime, monkeypatch, want, spec):
    """The CUDA device as the default, every kernel lowered afresh with gemm tile `want`
    and knobs `spec` (ZYX_GPU_GEMM), as if the GPU had 2 SMs (it would leave small
    products to the other strategies); yields the list of lowered GPUKernels. Skips
    without compute capability 8.0."""
    if tuple(cuda_runtime.info().extra["cc"]) < (8, 0):
        pytest.skip("tensor-core kernels need compute capability 8.0")
    found = []

    def spy(kernel, dl, info=None, name="zyx_k", schedule=None):
        g = lower(kernel, dl, info, name, {"gemm": want})
        found.append(g)
        return g
    monkeypatch.setattr(gpudriver, "lower", spy)
    monkeypatch.setenv(gemm.GEMM_ENV, spec)
    # the runtime's CUDA device now: another module's fixture may have re-initialized
    # the runtime since `cuda_runtime` was made, and its programs must be lowered afresh
    before = zyx.get_default_device()
    zyx.set_default_device("cuda")
    dev = zyx._RT.resolve("cuda")
    monkeypatch.setattr(dev, "_programs", {})
    monkeypatch.setattr(dev, "schedules", {})
    monkeypatch.setattr(dev.info(), "num_cores", 2)
    monkeypatch.setattr(zyx._RT, "plans", {})
    try:
        yield found
    finally:
        zyx.set_default_device(before)


def _tensor_core_checks(dtype, found, want, spec):
    from gpu_cases import _conv2d_ref
    import zyx.nn.functional as F
    rng = np.random.default_rng(8)
    np16 = np.float16 if dtype == "float16" else np.float32
    tol = 2e-3 if dtype == "float16" else 1.6e-2      # the output's rounding

    def t(*s):
        """A 16-bit tensor and its values in float64."""
        x = zyx.Tensor((rng.standard_normal(s) * 0.5).astype(np16)).cast(dtype).realize()
        return x, x.cast("float64").numpy()

    def check(got, ref, k):
        out = got.cast("float64").numpy()
        scale = np.sqrt(k) * 0.25 + 1
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)
    (a, ra), (b, rb), (at, rat), (bt, rbt) = t(200, 72), t(72, 136), t(72, 200), t(136, 72)
    check(a @ b, ra @ rb, 72)
    check(at.T @ b, rat.T @ rb, 72)
    check(a @ bt.T, ra @ rbt.T, 72)
    check(at.T @ bt.T, rat.T @ rbt.T, 72)
    (odd, rodd) = t(200, 73)           # rows starting at odd offsets: misaligned vectors
    check(odd[:, 1:] @ b, rodd[:, 1:] @ rb, 72)
    # aligned rows starting 2 bytes into the buffer (no tensor map) and 16 bytes into
    # it (a map with an offset; rows past the end of the tiles: its zero fill)
    (wide, rwide) = t(200, 80)
    check(wide[:, 1:73] @ b, rwide[:, 1:73] @ rb, 72)
    check(wide[:, 8:80] @ b, rwide[:, 8:80] @ rb, 72)
    (wider, rwider) = t(72, 160)
    check(at.T @ wider[:, 16:152], rat.T @ rwider[:, 16:152], 72)
    (c, rc), (d, rd), (dt_, rdt) = t(300, 520), t(520, 264), t(264, 520)
    check(c @ d, rc @ rd, 520)
    check(c @ dt_.T, rc @ rdt.T, 520)
    # a computed operand is rounded to the product's dtype before the product
    c2 = (a * 2 + 1).cast("float64").numpy()
    check((a * 2 + 1) @ b, c2 @ rb, 72)
    (x, rx), (y, ry), (z, rz) = t(3, 64, 40), t(3, 40, 96), t(96)
    check((x @ y + z).relu(), np.maximum(rx @ ry + rz, 0), 40)
    check(x @ y[1], rx @ ry[1], 40)             # one operand broadcast over the batch
    (s, rs), (vv, rvv) = t(2, 3, 200, 72), t(2, 3, 72, 64)
    check(s @ vv, rs @ rvv, 72)                 # 64 cols (attention's values)
    (u, ru), (v, rv) = t(33, 9000), t(9000, 65)
    check(u @ v, ru @ rv, 9000)
    (img, rimg), (w, rw) = t(2, 8, 12, 12), t(16, 8, 3, 3)
    check(F.conv2d(img, w, padding=1), _conv2d_ref(rimg, rw, 1), 72)
    # (plain loads on a Hopper GPU with 128 x 128 tiles: warpgroup products, wgmma.py)
    assert sum(g.strategy in ("mma", "wgmma") for g in found) >= 8, \
        [g.strategy for g in found]
    assert all(g.variant["rows"] == want[0] for g in found if g.strategy == "mma")
    hopper = zyx._RT.resolve("cuda").info().extra.get("arch") == "sm_90a"
    if hopper and want == (128, 128) and "wgmma=0" not in spec:
        assert sum(g.strategy == "wgmma" for g in found) >= 6, [g.strategy for g in found]
        mapped = sum(bool(g.launches[0].maps) for g in found)
        assert mapped == 0 if "tma=0" in spec else mapped >= 5, spec


@pytest.mark.parametrize("dtype,precision", [("float32", "highest"), ("float32", "high"),
                                             ("bfloat16", "highest")])
def test_channels_last_convolutions_against_numpy(dtype, precision, cuda_runtime,
                                                  monkeypatch):
    """Convolutions reading a channels-last copy of the image (F._channels_last_input,
    here for any size): the padded window copied 16 bytes at a time under one test, on
    the float32 tiles, TF32 and bfloat16 tensor cores, strided and padded, against
    float64 products of the same values. Skipped without compute capability 8.0."""
    from gpu_cases import _conv2d_ref
    import zyx.nn.functional as F
    monkeypatch.setattr(F, "GPU_IMAGE_MIN", 0)
    before = zyx.get_float32_matmul_precision()
    zyx.set_float32_matmul_precision(precision)
    rng = np.random.default_rng(10)
    tol = {"highest": 1e-4, "high": 3e-3}.get(precision) if dtype == "float32" else 2e-2
    try:
        with _tensor_core_device(cuda_runtime, monkeypatch, (64, 64), "") as found:
            for cin, pad in ((32, 1), (16, 2), (64, 0)):
                x = zyx.Tensor(rng.standard_normal((2, cin, 13, 13)).astype(np.float32))
                w = zyx.Tensor((rng.standard_normal((48, cin, 3, 3)) * 0.2)
                               .astype(np.float32))
                x, w = x.cast(dtype).realize(), w.cast(dtype).realize()
                ref = _conv2d_ref(x.cast("float64").numpy(), w.cast("float64").numpy(), pad)
                got = F.conv2d(x, w, padding=pad).cast("float64").numpy()
                np.testing.assert_allclose(got, ref, rtol=tol, atol=tol * 4)
            hopper = zyx._RT.resolve("cuda").info().extra.get("arch") == "sm_90a"
            if hopper:
                # windows through tensor maps (warpgroup products, or FMA tiles at
                # "highest") where the output keeps the image's size (pad 1), not where
                # a wider pad makes it larger or no test pads it
                assert sum(bool(g.launches[0].maps) for g in found) == 1
            else:
                assert sum(g.strategy in ("gemm", "mma") for g in found) >= 3
    finally:
        zyx.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "tf32", "fma"])
@pytest.mark.parametrize("spec", ["", "tma=0"])
def test_window_products_through_tensor_maps_against_numpy(dtype, spec, cuda_runtime,
                                                           monkeypatch):
    """16-bit (and, "tf32", float32 with precision "high") convolutions over a
    channels-last image on Hopper: the window copied through a tensor map whose pixel
    coordinate moves with the window's row and col, rows outside the image zeroed by the
    consumers (wgmma.window_plan): 3x3 and 5x5 windows, 24 channels (a 128-byte channel
    box past the end, the plan's K order ending in a window column), 16 and 48 output
    channels (a box past them), a bias and relu after, against float64 products of the
    same values; "fma": float32 at "highest" (FMA tiles, exact float32 products), plus a
    product in each operand layout. "tma=0" keeps the other lowerings. Skipped without
    compute capability 8.0; the window maps are checked on sm_90a only."""
    from gpu_cases import _conv2d_ref
    import zyx.nn.functional as F
    monkeypatch.setattr(F, "GPU_IMAGE_MIN", 0)
    rng = np.random.default_rng(11)
    before = zyx.get_float32_matmul_precision()
    if dtype == "tf32":
        zyx.set_float32_matmul_precision("high")

    tol = 1e-4 if dtype == "fma" else 2e-2

    def t(*shape, scale=1.0):
        v = zyx.Tensor((rng.standard_normal(shape) * scale).astype(np.float32))
        v = v.cast("float32" if dtype in ("tf32", "fma") else dtype).realize()
        return v, v.cast("float64").numpy()
    try:
        with _tensor_core_device(cuda_runtime, monkeypatch, (64, 64), spec) as found:
            for (n, cin, h, wd), (cout, k), pad in (((2, 32, 13, 11), (48, 3), 1),
                                                    ((3, 24, 9, 9), (16, 5), 2),
                                                    ((2, 16, 20, 6), (64, 3), 1)):
                (x, rx), (w, rw), (b, rb) = t(n, cin, h, wd), \
                    t(cout, cin, k, k, scale=0.2), t(cout)
                got = F.conv2d(x, w, b, padding=pad).relu().cast("float64").numpy()
                ref = np.maximum(_conv2d_ref(rx, rw, pad) + rb[:, None, None], 0)
                np.testing.assert_allclose(got, ref, rtol=tol, atol=2 * tol)
            hopper = zyx._RT.resolve("cuda").info().extra.get("arch") == "sm_90a"
            mapped = [g for g in found if g.launches[0].maps]
            # (the FMA tiles' 256 rows fill the 2 SMs with the first convolution only)
            want = 1 if dtype == "fma" else 3
            assert len(mapped) == (want if hopper and "tma=0" not in spec else 0), spec
        if dtype == "fma":      # plain products in each operand layout, 128 x 128
            with _tensor_core_device(cuda_runtime, monkeypatch, (128, 128), spec) as found:
                (a, ra), (b, rb) = t(300, 96), t(200, 96)
                (at, rat), (bt, rbt) = t(96, 300), t(96, 200)
                for got, want in ((a @ b.T, ra @ rb.T), (a @ bt, ra @ rbt),
                                  (at.T @ bt, rat.T @ rbt), (at.T @ b.T, rat.T @ rb.T)):
                    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-4)
                assert [g.strategy for g in found if g.strategy != "elementwise"] == \
                    ["tmafma" if hopper and "tma=0" not in spec else "gemm"] * 4
    finally:
        zyx.set_float32_matmul_precision(before)


def _tf32(x):
    """float32 values rounded to TF32 as cvt.rna does: to nearest, ties away from zero
    (no infinities or NaNs here)."""
    b = np.asarray(x, np.float32).view(np.uint32)
    return ((b + np.uint32(0x1000)) & np.uint32(0xFFFFE000)).view(np.float32)


def _tf32_truncated(x):
    """float32 values cut to TF32's 10 mantissa bits (what the tensor cores read of a
    float32 stored in shared memory)."""
    b = np.asarray(x, np.float32).view(np.uint32)
    return (b & np.uint32(0xFFFFE000)).view(np.float32)


def test_allow_tf32_puts_convolutions_alone_on_tf32(cuda_runtime):
    """zyx.backends.cudnn.allow_tf32 on (torch's default) at precision "highest", on the
    GPU: a float32 convolution and both its gradients within TF32's rounding of the
    float64 references and measurably off them (TF32 ran), a matrix product exact to
    float32. Skipped without compute capability 8.0 (no TF32)."""
    from gpu_cases import _conv2d_ref, _conv2d_grads_ref
    import zyx.nn.functional as F
    if tuple(cuda_runtime.info().extra["cc"]) < (8, 0):
        pytest.skip("TF32 needs compute capability 8.0")
    rng = np.random.default_rng(4)
    # (large enough to be tiled products: the H200 computes a batch of 8 16x16 images
    # with one thread per output, in float32)
    x = rng.standard_normal((32, 32, 32, 32)).astype(np.float32)
    w = (rng.standard_normal((64, 32, 3, 3)) * 0.2).astype(np.float32)
    g = rng.standard_normal((32, 64, 32, 32)).astype(np.float32)
    a = rng.standard_normal((256, 512)).astype(np.float32)
    b = rng.standard_normal((512, 128)).astype(np.float32)
    zyx.backends.cudnn.allow_tf32 = True
    try:
        X, W = zyx.Tensor(x, requires_grad=True), zyx.Tensor(w, requires_grad=True)
        y = F.conv2d(X, W, padding=1)
        (y * zyx.Tensor(g)).sum().backward()
        got = [y.numpy(), X.grad.numpy(), W.grad.numpy()]
        prod = (zyx.Tensor(a) @ zyx.Tensor(b)).numpy()
    finally:
        zyx.backends.cudnn.allow_tf32 = False
    refs = [_conv2d_ref(x, w, 1), *_conv2d_grads_ref(x, w, g, 1)]
    for name, out, ref in zip(("forward", "input gradient", "weight gradient"), got, refs):
        err = np.abs(out - ref).max() / np.abs(ref).max()
        assert 1e-5 < err < 5e-3, (name, err)     # TF32: 10 mantissa bits; float32: 23
    ref = a.astype(np.float64) @ b
    assert np.abs(prod - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("want,spec", [((128, 128), ""), ((64, 128), "double=1"),
                                       ((32, 32), "vector=0,prefetch=0")])
def test_tf32_products_against_numpy(want, spec, cuda_runtime, monkeypatch, tf32_precision):
    """float32 products with precision "high" on TF32 tensor cores: the results are the
    float64 products of the TF32-rounded operands (each product is exact in float32; only
    the float32 sums differ), which they must match far closer than the float32
    products' own distance from them. Both local layouts of each operand, a computed
    operand, an epilogue with a batch, block totals over a long K, a padded convolution.
    Skipped without compute capability 8.0."""
    from gpu_cases import _conv2d_ref
    import zyx.nn.functional as F
    rng = np.random.default_rng(9)
    far = []
    with _tensor_core_device(cuda_runtime, monkeypatch, want, spec) as found:
        def t(*s):
            x = (rng.standard_normal(s) * 0.5).astype(np.float32)
            return zyx.Tensor(x), x

        def check(got, a, b, k, product=np.matmul):
            # (mma.sync rounds operands to nearest; warpgroup products fed by tensor
            # maps on Hopper read their TF32 bits: the reference the result is closer to)
            out = got.numpy().astype(np.float64)
            refs = [product(r(a).astype(np.float64), r(b).astype(np.float64))
                    for r in (_tf32, _tf32_truncated)]
            ref = min(refs, key=lambda r: np.abs(out - r).max())
            exact = product(a.astype(np.float64), b.astype(np.float64))
            tol = 1e-5 * (np.sqrt(k) + 1)
            np.testing.assert_allclose(out, ref, rtol=1e-5, atol=tol)
            far.append(np.abs(exact - ref).max() > 10 * np.abs(out - ref).max())
        (a, ra), (b, rb), (at, rat), (bt, rbt) = t(200, 72), t(72, 136), t(72, 200), t(136, 72)
        check(a @ b, ra, rb, 72)
        check(at.T @ b, rat.T, rb, 72)
        check(a @ bt.T, ra, rbt.T, 72)
        check(at.T @ bt.T, rat.T, rbt.T, 72)
        (odd, rodd) = t(200, 73)          # rows at odd offsets: misaligned vectors
        check(odd[:, 1:] @ b, rodd[:, 1:], rb, 72)
        check((a * 2 + 1) @ b, ra * np.float32(2) + np.float32(1), rb, 72)
        (x, rx), (y, ry), (z, rz) = t(3, 64, 40), t(3, 40, 96), t(96)
        out = (x @ y + z).relu().numpy()
        ref = np.maximum(_tf32(rx).astype(np.float64) @ _tf32(ry) + rz, 0)
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-4)
        (u, ru), (v, rv) = t(33, 9000), t(9000, 65)
        check(u @ v, ru, rv, 9000)
        (img, rimg), (w, rw) = t(2, 8, 12, 12), t(16, 8, 3, 3)
        check(F.conv2d(img, w, padding=1), rimg, rw, 72, lambda i, k: _conv2d_ref(i, k, 1))
        # (on Hopper with 128 x 128 tiles: MN-major operands copied K-major first,
        # kcopy.py; both of them at 70 K, rows padded; a batch)
        (p, rp), (q, rq), (pt, rpt) = t(600, 72), t(72, 520), t(70, 600)
        check(p @ q, rp, rq, 72)
        check(pt.T @ q[:70], rpt.T, rq[:70], 70)
        (x3, rx3), (y3, ry3) = t(3, 520, 40), t(3, 40, 600)
        check(x3 @ y3, rx3, ry3, 40)
        hopper = zyx._RT.resolve("cuda").info().extra.get("arch") == "sm_90a"
    assert sum(g.strategy in ("mma", "wgmma") and g.variant["mma"] == "tf32"
               for g in found) >= 8, [(g.strategy, g.variant) for g in found]
    copied = [g.variant["kcopy"] for g in found if (g.variant or {}).get("kcopy")]
    assert copied == ([1, 2, 1] if hopper and want == (128, 128) else []), copied
    assert all(far), far        # TF32 was used: float32 products would not match this close


class _RecordingBinding:
    """A stand-in for cuda-bindings or hip-python: every call is recorded with its
    arguments and answers (0, 7); the allocation call answers out-of-memory."""
    OOM = "out-of-memory code"

    def __init__(self, alloc_name):
        self.calls, self.alloc_name = [], alloc_name

    def __getattr__(self, name):
        def call(*args):
            self.calls.append((name, args))
            return (self.OOM, 0) if name == self.alloc_name else (0, 7)
        return call


@pytest.mark.parametrize("backend", ["cuda", "hip"])
def test_driver_calls_take_each_api_s_names(backend):
    """The memory, copy, event and module calls the CUDA and HIP drivers share
    (gpudriver.ResultTupleDriver) reach each API under its own names with the stream, and
    an out-of-memory result is DeviceOutOfMemory: without a GPU, through a recording
    stand-in for the binding."""
    import importlib
    mod = importlib.import_module(f"zyx.backends.{backend}")
    cls = mod.CUDADriver if backend == "cuda" else mod.HIPDriver
    names = {"cuda": ("cuMemAlloc", "cuMemcpyHtoDAsync", "cuEventSynchronize",
                      "cuModuleGetFunction", "cuMemFreeHost", "cuStreamSynchronize"),
             "hip": ("hipMalloc", "hipMemcpyHtoDAsync", "hipEventSynchronize",
                     "hipModuleGetFunction", "hipHostFree", "hipStreamSynchronize")}[backend]
    api = _RecordingBinding(names[0])
    d = object.__new__(cls)
    d.api, d.label, d.ordinal, d.stream = api, backend.upper(), 0, "the stream"
    d.SUCCESS, d.OOM, d._error_name = 0, api.OOM, lambda err: f"error {err}"
    d.copy_to_device(100, 200, 64)
    d.event_sync("ev")
    assert d.function("module", "zyx_k") == 7
    d.host_free(300)
    d.stream_sync()
    assert api.calls == [(names[1], (100, 200, 64, "the stream")), (names[2], ("ev",)),
                         (names[3], ("module", b"zyx_k")), (names[4], (300,)),
                         (names[5], ("the stream",))]
    with pytest.raises(gpudriver.DeviceOutOfMemory, match="out-of-memory code"):
        d.alloc(1 << 40)


def test_cuda_graphs_give_the_same_training_as_plain_launches(cuda_runtime):
    """A training loop whose batches and weights move every step computes the same bits
    replayed as CUDA graphs (the default), launched from its launch record without
    graphs (ZYX_CUDA_GRAPHS=0's path) and launched kernel by kernel
    (ZYX_PLAN_LAUNCHES=0's path); the graphs were replayed, rebound where buffers
    moved."""
    import launch_loop
    dev = zyx._RT.device()
    api = dev.driver.graph_api
    if api is None or not dev.plan_launches:
        pytest.skip("CUDA graphs are off (ZYX_CUDA_GRAPHS=0 or ZYX_PLAN_LAUNCHES=0, or the "
                    "driver has no graph calls)")
    try:
        graphs = launch_loop.train_fresh(steps=40)
        replays = [ln.graph for ln in launch_loop.launchers() if ln.graph is not None]
        assert replays and max(r.replays for r in replays) >= 30
        assert all(r.builds <= 4 for r in replays)
        dev.driver.graph_api = None
        plain = launch_loop.train_fresh(steps=40)
        assert launch_loop.launchers() and not any(
            ln.graph is not None for ln in launch_loop.launchers())
        dev.plan_launches = False
        kernels = launch_loop.train_fresh(steps=40)
        assert not launch_loop.launchers()
    finally:
        dev.driver.graph_api = api
        dev.plan_launches = True
        zyx._RT._drop_plans()
    launch_loop.assert_same(graphs, plain)
    launch_loop.assert_same(graphs, kernels)
    assert graphs[0][-5:].mean() < graphs[0][:5].mean()


def test_cuda_graph_replays_rebind_buffers_that_change(cuda_runtime):
    """One plan of several kernels replayed over 7 inputs in turn (more than the graph
    variants kept), earlier outputs kept alive so that the targets move too: every run
    matches numpy; the plan's graphs were instantiated at most graphs.VARIANTS times and
    rebound (node parameters rewritten) for the other sets of buffers."""
    from zyx.backends import graphs as G
    dev = zyx._RT.device()
    if dev.driver.graph_api is None or not dev.plan_launches:
        pytest.skip("CUDA graphs are off (ZYX_CUDA_GRAPHS=0 or ZYX_PLAN_LAUNCHES=0, or the "
                    "driver has no graph calls)")
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((64, 96), dtype=np.float32) for _ in range(7)]
    w = rng.standard_normal((96, 32), dtype=np.float32)
    W = zyx.tensor(w)
    X = [zyx.tensor(x) for x in xs]
    kept = []
    for i in range(50):
        out = ((X[i % 7] @ W).softmax(-1) * 3 + X[i % 7].mean()).realize()
        kept = (kept + [out])[-3:]
        x = xs[i % 7].astype(np.float64)
        s = x @ w
        e = np.exp(s - s.max(-1, keepdims=True))
        np.testing.assert_allclose(out.numpy(), e / e.sum(-1, keepdims=True) * 3 + x.mean(),
                                   rtol=2e-3, atol=1e-4)
    replay = next(p.launcher.graph for p in zyx._RT.plans.values()
                  if p.launcher is not None and p.launcher.graph is not None)
    assert replay.replays >= 45 and replay.builds <= G.VARIANTS and replay.rebinds > 0


def test_ready_callbacks_fire_between_cuda_graph_pieces(cuda_runtime, monkeypatch):
    """RT.realize(ready=...) on a plan replayed as CUDA graphs: the plan is cut at each
    target whose callback is due, each piece replays on its own (a graph where it has
    several launches), and a callback comes after its own kernel was launched and before
    the next one is."""
    from zyx.runtime import RT
    dev = zyx._RT.device()
    if dev.driver.graph_api is None or not dev.plan_launches:
        pytest.skip("CUDA graphs are off (ZYX_CUDA_GRAPHS=0 or ZYX_PLAN_LAUNCHES=0, or the "
                    "driver has no graph calls)")
    a_np = np.linspace(0.1, 1, 1 << 16).astype(np.float32)
    a = zyx.tensor(a_np)
    x64 = np.exp(a_np.astype(np.float64) * 2).sum()
    want = [x64, (a_np * x64).sum()]
    want.append((a_np + want[1]).max())
    launched = [0]

    def counting(call):
        def counted(*args):
            launched[0] += 1
            return call(*args)
        return counted
    for run in range(4):
        x = (a * 2).exp().sum()
        y = (a * x).sum()
        z = (a + y).max()
        log = []
        launched[0] = 0

        def rec(name):
            def ready(buffer, fresh):
                log.append((name, fresh, launched[0]))
            return ready
        RT.realize([x._id, y._id, z._id], ready={x._id: rec("x"), y._id: rec("y"),
                                                 z._id: rec("z")})
        assert [n for n, _, _ in log] == ["x", "y", "z"] and all(f for _, f, _ in log)
        for got, w in zip((x, y, z), want):
            np.testing.assert_allclose(got.numpy(), w, rtol=1e-4)
        if run == 0:     # count the plan's launches from here on: plain calls and graphs
            plan = max(zyx._RT.plans.values(), key=lambda p: p.last_used)
            lau = plan.launcher
            lau.calls = [counting(c) for c in lau.calls]
            lau.GRAPH_MIN_LAUNCHES = 1     # every piece a graph, however short
            monkeypatch.setattr(dev.driver.graph_api, "launch",
                                counting(dev.driver.graph_api.launch))
            continue
        counts = [k for _, _, k in log]
        assert 0 < counts[0] < counts[1] < counts[2] == launched[0], counts
    assert plan.launcher.pieces, "the cut plan never replayed a piece as a graph"
