"""Ranking of one physical device reached through several APIs (CUDA, OpenCL, Vulkan,
wgpu: `DeviceInfo.hardware`) and the generic refusal of dtypes a device lacks
(`DeviceInfo.dtypes`), with fake device objects: no driver needed."""
from __future__ import annotations

import pytest

import zyx
from zyx.codegen.target import DeviceInfo
from zyx.errors import DTypeError
from zyx.runtime import check_dtype, distinct_hardware


class FakeDevice:
    def __init__(self, backend, compute, hardware=None, dtypes=()):
        self.backend = backend
        self._info = DeviceInfo(name=f"fake {backend}", compute=compute, hardware=hardware,
                                dtypes=dtypes)

    def info(self):
        return self._info


def test_one_physical_device_is_ranked_once():
    cpu = FakeDevice("c", 5e10)
    cuda = FakeDevice("cuda", 6e13, "gpu-0")
    ocl = FakeDevice("opencl", 6e13, None)          # no key: never merged
    vk = FakeDevice("vulkan", 3e13, "gpu-0")
    vk1 = FakeDevice("vulkan", 3e13, "gpu-1")       # another GPU: stays
    wgpu = FakeDevice("wgpu", 3e13, "gpu-0")
    kept = distinct_hardware([cpu, ocl, cuda, vk, vk1, wgpu])
    assert kept == [cpu, ocl, cuda, vk1]
    # equal compute: the first listed (BACKENDS order) wins
    a, b = FakeDevice("vulkan", 1e12, "x"), FakeDevice("wgpu", 1e12, "x")
    assert distinct_hardware([a, b]) == [a]


def test_unsupported_dtype_is_refused_naming_the_device():
    dev = FakeDevice("vulkan", 1e9, dtypes=("float32", "int32"))
    def name_of(d):
        return "vulkan:0"
    check_dtype(dev, zyx.float32, name_of)
    with pytest.raises(DTypeError,
                       match=r"float64 is not supported by device vulkan:0 \(fake vulkan\)"):
        check_dtype(dev, zyx.float64, name_of)
    check_dtype(FakeDevice("c", 1e9), zyx.float64, name_of)   # empty list: every dtype
