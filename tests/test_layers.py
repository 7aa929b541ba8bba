"""The package's layers, as docs/architecture.md draws them, checked on the source.

Every ``import`` in every module of tinytf (at the top or inside a function) is parsed; a
module may import only modules of its own layer or of layers below it, and no set of
modules may import each other in a cycle. No module reads a private attribute that
another module defines.
"""
import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tinytf")

LAYERS = [
    ("foundation", ["engine", "utils", "text"]),
    ("ops", ["ops"]),
    ("nn", ["nn"]),
    ("optim", ["optim"]),
    ("fast", ["fast"]),
    ("distributed", ["distributed"]),
    ("models", ["models"]),
    ("data", ["data"]),
    ("decoding", ["decoding"]),
    ("training", ["training"]),
    ("commands", ["commands"]),
]
"""Lowest first: (layer, top-level modules or packages of tinytf in it)."""

LAYER_OF = {top: i for i, (_, tops) in enumerate(LAYERS) for top in tops}


def _modules() -> dict:
    """{dotted module name: path} for every module of tinytf except its __init__."""
    found = {}
    for root, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
                if name != "tinytf":
                    found[name] = path
    return found


MODULES = _modules()


def _imports(name: str, path: str) -> set:
    """The tinytf modules that module ``name`` imports, anywhere in its source."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets = [mod] + [f"{mod}.{a.name}" for a in node.names]
        for t in targets:
            while t and t not in MODULES and t != "tinytf":
                t = t.rpartition(".")[0]
            if t and t != name and t in MODULES:
                out.add(t)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _top(name: str) -> str:
    return name.split(".")[1]


def test_the_package_root_holds_only_its_public_face():
    """The folders are the layers: no module sits at tinytf/'s root but ``__init__.py``."""
    root = sorted(f for f in os.listdir(ROOT) if f.endswith(".py") and f != "__init__.py")
    assert not root, f"modules at tinytf/'s root (move each into its layer's folder): {root}"


def test_every_folder_says_what_it_holds():
    """Each package's ``__init__.py`` opens with a docstring: the layer's one idea."""
    silent = [name for name, path in MODULES.items() if path.endswith("__init__.py")
              and not ast.get_docstring(ast.parse(open(path).read()))]
    assert not silent, f"packages without a docstring: {silent}"


def test_every_module_has_a_layer():
    missing = sorted({_top(n) for n in MODULES} - set(LAYER_OF))
    assert not missing, f"modules without a layer in LAYERS: {missing}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_imports_only_go_down(name):
    mine = LAYER_OF[_top(name)]
    up = sorted(d for d in GRAPH[name] if LAYER_OF[_top(d)] > mine)
    assert not up, (f"{name} ({LAYERS[mine][0]}) imports from layers above it: "
                    + ", ".join(f"{d} ({LAYERS[LAYER_OF[_top(d)]][0]})" for d in up))


def test_no_import_cycles():
    # A package imports its own submodules (tinytf/ops/__init__.py gathers tinytf.ops.*), so
    # the edges from a package to its own children are not cycles in the design.
    def edges(n):
        return {d for d in GRAPH[n] if not d.startswith(n + ".")}
    state, stack_path = {}, []

    def visit(n):
        state[n] = "open"
        stack_path.append(n)
        for d in sorted(edges(n)):
            if state.get(d) == "open":
                cycle = stack_path[stack_path.index(d):] + [d]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack_path.pop()
        state[n] = "done"

    for n in sorted(GRAPH):
        if n not in state:
            visit(n)


def _private_reads(path: str) -> list:
    """``obj._name`` reads where obj is not self, cls, super() or a private module, and
    ``_name`` is not assigned or defined anywhere in this file."""
    tree = ast.parse(open(path).read())
    owned = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            owned.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            owned.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            owned.add(node.id)
    reads = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")) or node.attr in owned:
            continue
        v = node.value
        if isinstance(v, ast.Name) and (v.id in ("self", "cls") or v.id.startswith("_")):
            continue
        if isinstance(v, ast.Call) and getattr(v.func, "id", None) == "super":
            continue
        reads.append(f"{os.path.relpath(path, ROOT)}:{node.lineno}: {ast.unparse(node)}")
    return reads


def test_no_module_reads_another_modules_private_attributes():
    reads = [r for path in MODULES.values() for r in _private_reads(path)]
    assert not reads, "\n".join(reads)
