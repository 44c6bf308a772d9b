"""Build the Cython core (zyx/_core/*.pyx) into extension modules.

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


def core_extensions():
    """One extension per zyx/_core/*.pyx, named after its module (zyx._core.graph ...)."""
    sources = sorted(glob.glob(os.path.join("zyx", "_core", "*.pyx")))
    return [Extension(p[:-len(".pyx")].replace(os.sep, "."), [p]) for p in sources]


class build_ext(_build_ext):
    """Cythonize lazily, compile the modules in parallel (kernelizer.c alone takes ~20 s of
    gcc; two cores halve the wall time of a fresh install) and without debug info."""

    def finalize_options(self):
        from Cython.Build import cythonize

        self.distribution.ext_modules[:] = cythonize(
            self.distribution.ext_modules, quiet=True, compiler_directives=CYTHON_DIRECTIVES)
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        # Python's own CFLAGS carry -g, which makes the compiled core ~6x larger (7.3 MB
        # instead of 1.3 MB on x86_64). -g0 comes after them on the command line; export
        # CFLAGS=-g to keep debug info for gdb.
        wants_debug = "-g" in os.environ.get("CFLAGS", "").split()
        if self.compiler.compiler_type != "msvc" and not wants_debug:
            for ext in self.extensions:
                ext.extra_compile_args.append("-g0")
        super().build_extensions()


setup(ext_modules=core_extensions(), cmdclass={"build_ext": build_ext})
