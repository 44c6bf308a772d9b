"""Smoke test of an installed zyx wheel (cibuildwheel's test-command; also run by
tests/test_packaging.py against the working tree).

Checks that zyx imports, that every core module (and every Python module setup.py
compiles) is a compiled extension, and that a fused
elementwise+reduce kernel and a matmul realized through the C backend match numpy.

Realizing a kernel needs a C compiler at run time. The manylinux images have gcc and macOS
has clang (without OpenMP; the C backend probes -fopenmp and falls back to serial loops).
On Windows the C backend only looks for cc/gcc/clang and emits GCC-style flags (no MSVC
`cl` support yet), so there may be no device, or a MinGW gcc whose compile fails: on Windows
only, the script then stops after the import checks and says why. Everywhere else a missing
backend or a failed compile is a failure, and a wrong result is a failure everywhere.
"""
import importlib
import importlib.machinery
import os
import sys

os.environ.setdefault("ZYX_DEBUG", "1")   # print which devices were found (or why none)

import numpy as np  # noqa: E402

import zyx  # noqa: E402

CORE = ("graph", "kernel", "kernelizer", "passes", "replay", "scheduler", "slab", "symbolic",
        "tensorbase", "valuecheck")
# plain Python modules that wheels also carry compiled (setup.py COMPILED_PY)
COMPILED = ("zyx.tensor", "zyx.autograd", "zyx.runtime", "zyx.nn.functional",
            "zyx.nn.modules.module", "zyx.nn.modules.container", "zyx.nn.modules.linear",
            "zyx.nn.modules.activation",
            "zyx.optim.optimizer", "zyx.optim.sgd", "zyx.optim.adam",
            "zyx.codegen.heuristics")


def main():
    print(f"zyx {zyx.__version__} from {os.path.dirname(zyx.__file__)}")
    for name in CORE:
        mod = importlib.import_module(f"zyx._core.{name}")
        if not mod.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            sys.exit(f"zyx._core.{name} is not a compiled extension: {mod.__file__}")
    for name in COMPILED:
        importlib.import_module(name)
        path = sys.modules[name].__file__
        if not path.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)):
            sys.exit(f"{name} is not compiled: {path}")
    try:
        print("devices:", zyx.devices())
        realize_and_compare()
    except zyx.BackendError as e:   # NoBackendAvailable included
        if sys.platform != "win32":
            raise
        print(f"zyx smoke: import checks passed; no usable C backend on Windows ({e})")
        return
    print("zyx smoke ok:", zyx.stats())


def realize_and_compare():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    x = zyx.Tensor(a)
    got = ((x * 2 + 1).exp2().sum(axis=1)).numpy()
    np.testing.assert_allclose(got, (2.0 ** (a * 2 + 1)).sum(axis=1), rtol=1e-5)
    w = np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5)
    np.testing.assert_allclose((x @ zyx.Tensor(w)).numpy(), a @ w, rtol=1e-5, atol=1e-5)


if __name__ == "__main__":
    main()
