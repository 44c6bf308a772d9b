"""Build the Cython core (zyx/_core/*.pyx) and the hot Python modules into extensions.

`pip install .` needs only a C compiler: Cython comes from the build requirements
(pyproject.toml). Wheels ship the compiled modules only (no generated .c, .pyx or .pxd);
the sdist ships the .pyx/.pxd sources and no generated .c.

Cythonization happens inside build_ext, not when this file is read, so commands that
compile nothing (sdist, egg_info, build_py, the packaging tests) neither need Cython nor
write .c files into the tree.
"""
import glob
import os

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

CYTHON_DIRECTIVES = {"language_level": 3, "binding": False, "embedsignature": True}

# Plain Python modules on the per-step path of a training loop (op construction, autograd
# rules, nn.functional composites, optimizer updates). Cython compiles them unchanged;
# the interpreter overhead they lose was ~25% of an MLP training step. The .py files stay
# the source of truth and ship too; Python imports the compiled module when both exist
# (zyx/__init__.py warns in a source checkout when a .py is newer than its build).
COMPILED_PY = ("zyx/tensor.py", "zyx/autograd.py", "zyx/runtime.py", "zyx/nn/functional.py",
               "zyx/nn/modules/module.py", "zyx/nn/modules/container.py",
               "zyx/nn/modules/linear.py", "zyx/nn/modules/activation.py",
               "zyx/optim/optimizer.py", "zyx/optim/sgd.py", "zyx/optim/adam.py",
               # (planning, once per kernel: compiled as the kernelizer it came from was)
               "zyx/codegen/heuristics.py")
# binding: module functions attached to classes (Tensor.sum = _sum) must bind as methods;
# annotation_typing off: `x: float` annotations must not become C doubles.
PY_DIRECTIVES = {"language_level": 3, "binding": True, "annotation_typing": False}


def _ext(path):
    return Extension(os.path.splitext(path)[0].replace("/", ".").replace(os.sep, "."), [path])


def core_extensions():
    """One extension per zyx/_core/*.pyx, named after its module (zyx._core.graph ...),
    and one per COMPILED_PY module."""
    sources = sorted(glob.glob(os.path.join("zyx", "_core", "*.pyx")))
    return [_ext(p) for p in sources] + [_ext(p) for p in COMPILED_PY]


class build_ext(_build_ext):
    """Cythonize lazily, compile the modules in parallel (kernelizer.c alone takes ~20 s of
    gcc; two cores halve the wall time of a fresh install) and without debug info."""

    def finalize_options(self):
        from Cython.Build import cythonize

        # Runs again when a command re-initializes build_ext (pip's editable install does):
        # extensions cythonized the first time (sources now .c) must stay in the list.
        exts = self.distribution.ext_modules
        core = [e for e in exts if e.sources[0].endswith(".pyx")]
        py = [e for e in exts if e.sources[0].endswith(".py")]
        done = [e for e in exts if e not in core and e not in py]
        exts[:] = (done + cythonize(core, quiet=True, compiler_directives=CYTHON_DIRECTIVES) +
                   cythonize(py, quiet=True, compiler_directives=PY_DIRECTIVES))
        self._compiled_py = {_ext(p).name for p in COMPILED_PY}
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        # Python's own CFLAGS carry -g, which makes the compiled core ~6x larger (7.3 MB
        # instead of 1.3 MB on x86_64). -g0 comes after them on the command line; export
        # CFLAGS=-g to keep debug info for gdb.
        wants_debug = "-g" in os.environ.get("CFLAGS", "").split()
        if self.compiler.compiler_type != "msvc":
            for ext in self.extensions:
                if not wants_debug:
                    ext.extra_compile_args.append("-g0")
                if ext.name in self._compiled_py:
                    # generated from plain Python: the gain is the interpreter overhead, not
                    # gcc's optimizer; -O1 compiles the 5 MB tensor.c 8x faster than -O3
                    ext.extra_compile_args.append("-O1")
        super().build_extensions()


setup(ext_modules=core_extensions(), cmdclass={"build_ext": build_ext})
