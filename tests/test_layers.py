"""The layer rule, read from the imports themselves (module level and inside functions alike).

``uvaple.dtypes`` < ``uvaple.uva`` and ``uvaple.kernels`` (siblings: neither imports the other) <
``uvaple.integration`` < ``uvaple.perf`` and the command line (``uvaple.commands``: ``cli``, ``doctor``,
``shm``); inside ``uvaple.integration``, the model adapters (``uvaple.integration.models``: transformers,
vLLM) sit above the library (lookups, placements, layers), which never imports them. And no import circle
anywhere in the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject.toml's package-dir)
FOLDERS = {"uvaple": "uvaple", "uva": "uvaple.uva", "kernels": "uvaple.kernels",
           "integration": "uvaple.integration", "perf": "uvaple.perf"}
ALLOWED = {
    "uvaple.uva": ("uvaple.uva", "uvaple.dtypes"),
    "uvaple.kernels": ("uvaple.kernels", "uvaple.dtypes"),
    "uvaple.integration": ("uvaple.integration", "uvaple.uva", "uvaple.kernels", "uvaple.dtypes"),
}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports_of(name: str, path: Path, known: dict) -> set[str]:
    """Every uvaple module ``name`` imports (absolute or relative, anywhere in the file). ``from pkg import
    sub`` of a submodule ``sub`` is an edge to ``pkg.sub`` only; of a name defined in ``pkg``, to ``pkg``."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("uvaple"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                mod = ".".join(anchor + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("uvaple"):
                continue
            for a in node.names:
                sub = f"{mod}.{a.name}"
                out.add(sub if sub in known else mod)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: {m for m in imports_of(name, path, mods) if m in mods and m != name} for name, path in mods.items()}


def layer(name: str) -> str:
    for pkg in ("uvaple.uva", "uvaple.kernels", "uvaple.integration", "uvaple.perf"):
        if name == pkg or name.startswith(pkg + "."):
            return pkg
    return name


def test_the_source_folders_are_read():
    g = graph()
    assert "uvaple.kernels.gather" in g and "uvaple.uva.host_table" in g \
        and "uvaple.integration.placements.copy.backend" in g
    assert "uvaple.uva" in g["uvaple.integration.lookup"]  # the parser sees real edges
    assert "uvaple.integration.placements.host_gather" in g["uvaple.integration.placements.copy.backend"]


def test_each_layer_imports_only_below_itself():
    bad = []
    for name, deps in graph().items():
        allowed = ALLOWED.get(layer(name))
        if allowed is None:
            continue
        for dep in deps:
            if not any(dep == a or dep.startswith(a + ".") for a in allowed):
                bad.append(f"{name} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_no_import_circles():
    g = graph()
    # a package importing its own submodules (its __init__) is not a circle back into it
    edges = {n: {d for d in deps if not (n.startswith(d + ".") and d == layer(d))} for n, deps in g.items()}
    cycles, state = [], {}

    def visit(n, stack):
        state[n] = 1
        for d in edges.get(n, ()):
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
            elif d not in state:
                visit(d, stack + [d])
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n, [n])
    assert not cycles, "\n".join(cycles)


def test_the_library_never_imports_the_model_adapters():
    adapters = "uvaple.integration.models"
    bad = [f"{name} imports {dep}" for name, deps in graph().items()
           if layer(name) == "uvaple.integration" and not (name == adapters or name.startswith(adapters + "."))
           for dep in deps if dep == adapters or dep.startswith(adapters + ".")]
    assert not bad, "\n".join(sorted(bad))
    assert "uvaple.integration.embedding" in graph()["uvaple.integration.models.hf"]  # the edges upward are seen
