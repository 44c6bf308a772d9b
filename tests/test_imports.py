"""The package's import structure, read from the source (no import runs): no cycles between
zyx's modules, counting imports inside functions too (an import moved into a function to
dodge a cycle is still the cycle), no private name taken from another module, and the
layering the architecture promises (layers above the runtime never reach a backend or
the code generators; code generation never reaches a device runtime)."""
import ast
import os
import re

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "zyx")

# Cython files are not Python: their imports are read by pattern (`from a import b`,
# `from a cimport b`, `import a`, `cimport a`), at any indentation.
_PYX_FROM = re.compile(r"^([ \t]*)from\s+(\.*[\w.]*)\s+c?import\s+(\([^)]*\)|[^#\n]*)", re.M)
_PYX_IMPORT = re.compile(r"^([ \t]*)c?import\s+([\w., ]+)", re.M)


def _modules():
    """{dotted module name: path} of every .py and .pyx file under zyx/."""
    out = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith((".py", ".pyx")):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.dirname(ROOT))
            name = os.path.splitext(rel)[0].replace(os.sep, ".")
            if name.endswith(".__init__"):
                name = name[: -len(".__init__")]
            out[name] = path
    return out


MODULES = _modules()


def _absolute(module, is_package, level, target):
    """The absolute name of a `from <level dots><target> import` in `module`."""
    if not level:
        return target
    parts = module.split(".")
    if not is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


class Import:
    """One imported zyx name: the module it comes from, the name (None for a module
    import), the source line, whether it sits inside a function."""
    __slots__ = ("source", "name", "line", "in_function")

    def __init__(self, source, name, line, in_function):
        self.source, self.name, self.line, self.in_function = source, name, line, in_function


def _python_imports(module, path):
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_package = path.endswith("__init__.py")
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                       ast.Lambda))
            if isinstance(child, ast.ImportFrom):
                src = _absolute(module, is_package, child.level, child.module)
                for alias in child.names:
                    found.append(Import(src, alias.name, child.lineno, in_function))
            elif isinstance(child, ast.Import):
                for alias in child.names:
                    found.append(Import(alias.name, None, child.lineno, in_function))
            visit(child, inside)
    visit(tree, False)
    return found


def _cython_imports(module, path):
    text = open(path, encoding="utf-8").read()
    found = []
    for m in _PYX_FROM.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        target = m.group(2)
        level = len(target) - len(target.lstrip("."))
        src = _absolute(module, False, level, target.lstrip("."))
        for name in m.group(3).strip("()").split(","):
            name = name.strip().split(" as ")[0].strip()
            if name:
                found.append(Import(src, name, line, bool(m.group(1))))
    for m in _PYX_IMPORT.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        for name in m.group(2).split(","):
            name = name.strip().split(" as ")[0].strip()
            if name:
                found.append(Import(name, None, line, bool(m.group(1))))
    return found


def imports_of(module):
    path = MODULES[module]
    reader = _cython_imports if path.endswith(".pyx") else _python_imports
    return [i for i in reader(module, path) if i.source and i.source.split(".")[0] == "zyx"]


def _target(imp):
    """The zyx module an import depends on: `from zyx.a import b` names module zyx.a.b
    when b is a module, else zyx.a."""
    if imp.name is not None and f"{imp.source}.{imp.name}" in MODULES:
        return f"{imp.source}.{imp.name}"
    return imp.source


def import_graph():
    """{module: {module it imports: first line}}, imports inside functions included."""
    graph = {}
    for module in MODULES:
        edges = graph.setdefault(module, {})
        for imp in imports_of(module):
            target = _target(imp)
            if target in MODULES and target != module:
                edges.setdefault(target, imp.line)
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state = {}
    stack = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_the_reader_sees_the_package():
    assert "zyx.tensor" in MODULES and "zyx._core.kernelizer" in MODULES
    assert "zyx.runtime" in import_graph()["zyx.tensor"]


def test_cycle_finder_finds_a_planted_cycle():
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1}}) is None


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_private_name_imported_from_another_module():
    bad = []
    for module in MODULES:
        for imp in imports_of(module):
            if imp.name is None or not imp.name.startswith("_") or imp.name.startswith("__"):
                continue
            if f"{imp.source}.{imp.name}" in MODULES:
                continue            # a private module (zyx._core) is a package of zyx's own
            bad.append(f"{module}:{imp.line} takes {imp.name} from {imp.source}")
    assert not bad, "\n".join(bad)


def _is_under(module, package):
    return module == package or module.startswith(package + ".")


# (importing packages, packages they must never import, why)
LAYERS = [
    (("zyx.nn", "zyx.io", "zyx.optim", "zyx.utils"), ("zyx.backends", "zyx.codegen"),
     "layers above the runtime ask DeviceInfo, never a backend or a code generator"),
    (("zyx.codegen",), ("zyx.backends", "zyx.runtime", "zyx.tensor"),
     "code generation turns kernels into programs: no driver, no global state"),
    (("zyx._core",), ("zyx.backends", "zyx.runtime", "zyx.tensor"),
     "the core knows graphs and kernels, not devices or the user API"),
]


@pytest.mark.parametrize("importers,forbidden,why", LAYERS, ids=[l[0][0] for l in LAYERS])
def test_layers_import_downwards_only(importers, forbidden, why):
    graph = import_graph()
    bad = [f"{m} imports {t} (line {line})" for m, edges in graph.items()
           if any(_is_under(m, p) for p in importers)
           for t, line in edges.items() if any(_is_under(t, p) for p in forbidden)]
    assert not bad, why + ":\n" + "\n".join(bad)


def test_package_init_imports_no_backend_or_code_generator():
    edges = import_graph()["zyx"]
    bad = [t for t in edges if _is_under(t, "zyx.backends") or _is_under(t, "zyx.codegen")]
    assert not bad, bad


def test_shared_gpu_lowering_never_imports_vendor_code():
    """Hopper's warpgroup products and tensor maps are reached through DeviceInfo, so the
    lowering OpenCL and HIP go through does not depend on them."""
    graph = import_graph()
    bad = [f"{m} imports {t}" for m, edges in graph.items()
           if _is_under(m, "zyx.codegen") and not _is_under(m, "zyx.codegen.gpu.nvidia")
           for t in edges if _is_under(t, "zyx.codegen.gpu.nvidia")]
    assert not bad, "\n".join(bad)
