"""Packaging checks: what a wheel would contain, the single-sourced version, the compiled
core, the wheel smoke test, and that README, .ci/run and the cibuildwheel config agree.

A real wheel build compiles the whole Cython core (~1.5 min of gcc on two cores), too slow
for the suite; instead `setup.py build_py` shows exactly which Python-side files setuptools
puts into a wheel (the rest of a wheel is build_ext's compiled modules).
"""
from __future__ import annotations

import ast
import importlib
import importlib.machinery
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import zyx

try:
    import tomllib
except ImportError:  # Python 3.10: pytest depends on tomli there
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
CORE_DIR = ROOT / "zyx" / "_core"
PYX_MODULES = sorted(p.stem for p in CORE_DIR.glob("*.pyx"))


def compiled_py():
    """setup.py's COMPILED_PY: plain Python modules that are also built as extensions."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    return next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "COMPILED_PY")


COMPILED_PY = compiled_py()
SOURCE_SUFFIXES = (".c", ".pyx", ".pxd", ".html")


def pyproject():
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def run_python(args, cwd, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_core_has_modules():
    assert PYX_MODULES, f"no .pyx files found in {CORE_DIR}"


# -- version -------------------------------------------------------------------------------

def literal_version():
    """The literal `__version__ = "..."` in zyx/__init__.py, as setuptools reads it without
    importing zyx (the build environment has no compiled core yet)."""
    tree = ast.parse((ROOT / "zyx" / "__init__.py").read_text())
    found = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
             and [getattr(t, "id", None) for t in node.targets] == ["__version__"]
             and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)]
    assert len(found) == 1, "zyx/__init__.py needs exactly one literal __version__ = '...'"
    return found[0]


def test_version_single_source():
    project = pyproject()
    assert "version" not in project["project"], "version must only be in zyx/__init__.py"
    assert "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "zyx.__version__"}
    assert zyx.__version__ == literal_version()
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc|\.dev|\.post)?\d*", zyx.__version__)


def test_installed_metadata_matches_version():
    try:
        installed = importlib.metadata.version("zyx")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("zyx is not installed (tests run from PYTHONPATH)")
    assert installed == zyx.__version__, (
        f"installed metadata says {installed}, zyx.__version__ is {zyx.__version__}: "
        "reinstall with `python -m pip install -e .`")


# -- compiled core ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", PYX_MODULES)
def test_core_module_is_compiled_and_fresh(name):
    mod = importlib.import_module(f"zyx._core.{name}")
    path = Path(mod.__file__)
    assert path.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), (
        f"zyx._core.{name} was imported from {path}, not from a compiled extension")
    if ROOT in path.parents:  # in-place build (editable install): is it older than its source?
        sources = [CORE_DIR / f"{name}.pyx", *CORE_DIR.glob("*.pxd")]
        newest = max(sources, key=lambda p: p.stat().st_mtime)
        assert path.stat().st_mtime >= newest.stat().st_mtime, (
            f"{path.name} is older than {newest.name}: rebuild with "
            "`python setup.py build_ext --inplace`")


@pytest.mark.parametrize("path", COMPILED_PY)
def test_compiled_python_module_is_compiled_and_fresh(path):
    name = path[:-len(".py")].replace("/", ".")
    importlib.import_module(name)
    mod = sys.modules[name]   # zyx.tensor the attribute is the tensor() function
    so = Path(mod.__file__)
    assert so.name.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), (
        f"{name} was imported from {so}, not from its compiled extension")
    if ROOT in so.parents:
        assert so.stat().st_mtime >= (ROOT / path).stat().st_mtime, (
            f"{so.name} is older than {path}: rebuild with `python setup.py build_ext --inplace`")


# runs setup.py with setuptools.setup replaced: its keyword arguments end up in `kw`
_SETUP_KWARGS = ("import runpy, setuptools\n"
                 "kw = {}\n"
                 "setuptools.setup = kw.update\n"
                 "runpy.run_path('setup.py')\n")


def test_setup_builds_one_extension_per_pyx():
    code = _SETUP_KWARGS + "for e in kw['ext_modules']: print(e.name, *e.sources)\n"
    r = run_python(["-c", code], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    exts = dict(line.split(maxsplit=1) for line in r.stdout.splitlines())
    want = {f"zyx._core.{m}": f"zyx/_core/{m}.pyx" for m in PYX_MODULES}
    want.update({p[:-len(".py")].replace("/", "."): p for p in COMPILED_PY})
    assert exts == want


# -- wheel contents ------------------------------------------------------------------------

def build_requirements():
    """{name: minimum major version} of pyproject's build-system.requires."""
    out = {}
    for req in pyproject()["build-system"]["requires"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=(\d+)(?:\.\d+)*", req.replace(" ", ""))
        assert m, f"build requirement {req!r}: expected 'name>=version'"
        out[m.group(1).lower()] = int(m.group(2))
    return out


def test_test_extra_brings_the_build_requirements():
    """The tests below run setup.py with the environment's setuptools, so the test extra
    must bring what a build uses: a fresh venv's stock setuptools (65 with Python 3.11)
    rejects pyproject's SPDX license string."""
    extra = {}
    for req in pyproject()["project"]["optional-dependencies"]["test"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)>=(\d+)(?:\.\d+)*", req.replace(" ", ""))
        if m:
            extra[m.group(1).lower()] = int(m.group(2))
    for name, minimum in build_requirements().items():
        assert extra.get(name, -1) >= minimum, (
            f"the [test] extra needs {name}>={minimum} (pyproject build-system.requires)")


def test_wheel_python_files_and_no_sources(tmp_path):
    """build_py is the step that copies Python-side files into a wheel: it must copy every
    module of the zyx package and none of the Cython sources or generated C."""
    import setuptools
    need = build_requirements()["setuptools"]
    assert int(setuptools.__version__.split(".")[0]) >= need, (
        f"setuptools {setuptools.__version__} is older than the build requires "
        f"(>={need}); install the test extra: python -m pip install -e \".[test]\"")
    r = run_python(["setup.py", "-q", "build_py", "--build-lib", str(tmp_path / "lib")],
                   cwd=ROOT)
    assert r.returncode == 0, r.stderr
    built = {p.relative_to(tmp_path / "lib").as_posix()
             for p in (tmp_path / "lib").rglob("*") if p.is_file()}
    leaked = sorted(f for f in built if f.endswith(SOURCE_SUFFIXES + (".so", ".pyd")))
    assert not leaked, f"build_py would put these into the wheel: {leaked}"
    expected = {p.relative_to(ROOT).as_posix() for p in (ROOT / "zyx").rglob("*.py")
                if "__pycache__" not in p.parts}
    assert built == expected, (f"missing from the wheel: {sorted(expected - built)}; "
                               f"unexpected: {sorted(built - expected)}")


def test_setuptools_config_keeps_sources_out():
    st = pyproject()["tool"]["setuptools"]
    assert st["include-package-data"] is False
    assert set(SOURCE_SUFFIXES) <= {s.lstrip("*") for s in st["exclude-package-data"]["*"]}


# -- smoke test, README, CI ------------------------------------------------------------------

def test_wheel_smoke_script(tmp_path):
    """The script cibuildwheel runs against every wheel passes here, and it checks every
    compiled core module."""
    smoke = ROOT / ".ci" / "wheel_smoke.py"
    assert pyproject()["tool"]["cibuildwheel"]["test-command"] == \
        "python {project}/.ci/wheel_smoke.py"
    tree = ast.parse(smoke.read_text())
    core = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and getattr(n.targets[0], "id", None) == "CORE")
    assert sorted(core) == PYX_MODULES
    compiled = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and getattr(n.targets[0], "id", None) == "COMPILED")
    assert sorted(compiled) == sorted(p[:-len(".py")].replace("/", ".") for p in COMPILED_PY)
    r = run_python([str(smoke)], cwd=tmp_path, env_extra={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "zyx smoke ok" in r.stdout


def readme_setup_commands():
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Set-up\n(.*?)^## ", text, re.S | re.M)
    assert section, "README.md needs a '## Set-up' section"
    blocks = re.findall(r"```bash\n(.*?)```", section.group(1), re.S)
    return [b.strip() for b in blocks]


def test_readme_has_exactly_two_setup_commands():
    cmds = readme_setup_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds), cmds
    main, tests = cmds
    assert 'install -e ".[examples]"' in main and "python -m zyx.examples.train" in main
    assert 'install -e ".[test]"' in tests and "pytest" in tests


def test_ci_run_runs_the_readme_test_command():
    run = ROOT / ".ci" / "run"
    assert os.access(run, os.X_OK), ".ci/run must be executable"
    lines = [ln.strip() for ln in run.read_text().splitlines()]
    assert "set -euo pipefail" in lines
    test_cmd = readme_setup_commands()[1]
    assert lines[-1] == test_cmd, "the README's test command must be the last line of .ci/run"


def test_ci_run_uses_a_fresh_stock_venv():
    """CI runs the README's command where a new user does: a fresh `python -m venv` with
    the pip and setuptools it comes with (nothing upgraded before the command)."""
    code = [ln.split("#")[0].strip() for ln in (ROOT / ".ci" / "run").read_text().splitlines()]
    code = [ln for ln in code if ln]
    venv = [i for i, ln in enumerate(code) if re.search(r"\bpython3? -m venv\b", ln)]
    assert len(venv) == 1, "make exactly one venv with python -m venv"
    assert not any("--upgrade" in ln or " -U " in ln or "ensurepip" in ln for ln in code)
    assert not any(re.search(r"pip install[^&]*\b(pip|setuptools)\b", ln) for ln in code)
    assert any("/bin" in ln and "PATH" in ln for ln in code[venv[0]:]), \
        "the commands after the venv must run its python"


def test_readme_tour_runs(tmp_path):
    """Every python block of the README, in order, in one fresh process."""
    text = (ROOT / "README.md").read_text()
    code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
    assert "zyx.Tape()" in code and "zyx.save(" in code
    script = tmp_path / "tour.py"
    script.write_text(code)
    r = run_python([str(script)], cwd=tmp_path, env_extra={"PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stdout + r.stderr


def test_build_ext_survives_reinitialization():
    """pip's editable install finalizes build_ext twice; the second time the extensions are
    already cythonized (.c sources) and must still all be built."""
    pytest.importorskip("Cython")
    code = (_SETUP_KWARGS + "from setuptools.dist import Distribution\n"
            "dist = Distribution({'ext_modules': kw['ext_modules'], 'cmdclass': kw['cmdclass']})\n"
            "for _ in range(2):\n"
            "    cmd = dist.reinitialize_command('build_ext')\n"
            "    cmd.ensure_finalized()\n"
            "    print(len(cmd.extensions))\n")
    r = run_python(["-c", code], cwd=ROOT)
    assert r.returncode == 0, r.stderr
    counts = [int(x) for x in r.stdout.split()]
    assert counts == [len(PYX_MODULES) + len(COMPILED_PY)] * 2, counts
