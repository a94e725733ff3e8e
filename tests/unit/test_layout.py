"""The package's layout (docs/architecture.md#code-layout): no module imports another that
imports it back, counting imports inside functions too, through the folders' package-dir mapping
(pyproject.toml); the pure cores import no Ray."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def modules() -> dict[str, str]:
    """Module name -> file, from pyproject's package-dir mapping."""
    text = open(os.path.join(ROOT, "pyproject.toml")).read()   # (no tomllib on Python 3.10)
    section = text.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    package_dir = dict(re.findall(r'^"?([\w.]+)"?\s*=\s*"([^"]+)"', section, re.M))
    out = {}
    for package, folder in package_dir.items():
        for name in os.listdir(os.path.join(ROOT, folder)):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                out[module] = os.path.join(ROOT, folder, name)
    return out


def imported(module: str, path: str, known: dict) -> set[str]:
    """The package's modules that ``module`` imports anywhere in its file."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return {m for m in found if m in known and m != module}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_module_imports_one_that_imports_it_back():
    known = modules()
    assert "islands.orchestrator.fleet" in known and "islands.link.client" in known
    graph = {m: imported(m, p, known) for m, p in known.items()}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_pure_cores_import_no_ray():
    for path in ("learners/core.py", "syncer/core.py", "orchestrator/fleet.py",
                 "orchestrator/seam.py", "syncer/timing.py", "orchestrator/groups_api.py",
                 "orchestrator/owner_role.py", "orchestrator/virtual_groups.py",
                 "orchestrator/owner.py", "orchestrator/virtual_fleet.py"):
        tree = ast.parse(open(os.path.join(ROOT, path)).read())
        names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                 for a in n.names}
        names |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) and not n.level}
        assert "ray" not in names, path
