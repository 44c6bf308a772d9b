"""Build the Cython core (zyx/_core/*.pyx) into extension modules.

`pip install .` needs only a C compiler: Cython and numpy come from the build requirements.
Wheels ship the compiled modules only (no generated .c, .pyx or .pxd)."""
import glob
import os

from setuptools import setup, Extension
from Cython.Build import cythonize

sources = sorted(glob.glob(os.path.join("zyx", "_core", "*.pyx")))
extensions = [Extension(p[:-4].replace(os.sep, "."), [p]) for p in sources]

setup(ext_modules=cythonize(extensions, language_level=3, quiet=True,
                            compiler_directives={"binding": False, "embedsignature": True}))
