"""No import cycles inside the `specpipe` package (issue 82), imports inside functions and under
`if TYPE_CHECKING:` included: a module that needs another's code lazily still depends on it.

A static scan (ast, no module is imported): every `import`/`from ... import` of a specpipe module is an edge,
and any strongly connected component of two modules or more is a cycle. `from pkg import name` is an edge to
the submodule `pkg.name` where there is one (Python imports that submodule), else to `pkg` itself: so
`from specpipe import Pipeline` inside the package depends on the package's __init__ (which imports the
pipeline and all it needs), while `from specpipe import distributed` depends only on specpipe.distributed.

import-linter's `acyclic_siblings` contract was not used: it squashes each subpackage to one node, so it also
rejects cycles between packages (specpipe.pipelines <-> specpipe.serving, ...) that are no module cycle, and
it does not see a cycle through a package's own __init__.
"""
from __future__ import annotations

import ast
import sys
from collections.abc import Iterable
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "specpipe"

# Cycles still being cut, each the exact set of modules of its component, with a comment saying who cuts it. A
# component that grows beyond its entry fails the test; an entry whose cycle is gone fails too (remove it then).
KNOWN_CYCLES: set[frozenset[str]] = set()

Edge = tuple[str, str, str]  # (importer, imported, "path:line" of the import)


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under `package` (a package is its __init__)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def import_edges(package: Path) -> list[Edge]:
    """Every import of one of the package's modules by another, wherever in the file it is."""
    modules = module_files(package)
    edges = []
    for name, path in modules.items():
        home = name if path.name == "__init__.py" else name.rpartition(".")[0]  # what `from . import` means
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = home.split(".")[: len(home.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            else:
                continue
            where = f"{path.relative_to(package.parent)}:{node.lineno}"
            edges += [(name, target, where) for target in dict.fromkeys(targets) if target in modules and target != name]
    return edges


def cycles(edges: Iterable[Edge]) -> list[list[str]]:
    """The strongly connected components of two modules or more (Tarjan), each sorted, in sorted order."""
    graph: dict[str, set[str]] = {}
    for importer, imported, _ in edges:
        graph.setdefault(importer, set()).add(imported)
        graph.setdefault(imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    try:
        for node in sorted(graph):
            if node not in index:
                visit(node)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def describe(component: list[str], edges: Iterable[Edge]) -> str:
    """One cycle through the component's first module, each import with its file and line, then the component."""
    members = set(component)
    imports: dict[str, dict[str, str]] = {}
    for importer, imported, where in edges:
        if importer in members and imported in members:
            imports.setdefault(importer, {}).setdefault(imported, where)
    start = component[0]
    paths = {start: [start]}  # breadth first: the shortest way back to `start`
    queue = [start]
    while queue:
        node = queue.pop(0)
        for successor in sorted(imports.get(node, {})):
            if successor == start:
                cycle = paths[node] + [start]
                steps = " -> ".join(f"{a} ({imports[a][b]})" for a, b in zip(cycle, cycle[1:]))
                return f"{steps} -> {start}  [component: {', '.join(component)}]"
            if successor not in paths:
                paths[successor] = paths[node] + [successor]
                queue.append(successor)
    return ", ".join(component)


def test_specpipe_has_no_import_cycles():
    edges = import_edges(PACKAGE)
    components = cycles(edges)
    new = [describe(component, edges) for component in components if frozenset(component) not in KNOWN_CYCLES]
    assert not new, "import cycles in specpipe (cut each one; imports inside functions count):\n" + "\n".join(new)
    gone = KNOWN_CYCLES - {frozenset(component) for component in components}
    assert not gone, (f"these known cycles are cut: remove them from KNOWN_CYCLES in {Path(__file__).name}: "
                      f"{[sorted(cycle) for cycle in gone]}")


def test_the_scan_finds_a_cycle_through_a_lazy_import_and_names_it(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("from pkg.a import A\n")
    (package / "a.py").write_text("from pkg import util\n\nclass A:\n    def b(self):\n"
                                  "        from pkg.sub.b import B\n        return B\n")
    (package / "util.py").write_text("")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "b.py").write_text("from ..a import A\n")
    (package / "c.py").write_text("from pkg import A\n")  # the package's __init__, which imports pkg.a: no cycle
    edges = import_edges(package)
    assert cycles(edges) == [["pkg.a", "pkg.sub.b"]]
    assert describe(["pkg.a", "pkg.sub.b"], edges) == (
        "pkg.a (pkg/a.py:5) -> pkg.sub.b (pkg/sub/b.py:1) -> pkg.a  [component: pkg.a, pkg.sub.b]")
    (package / "util.py").write_text("import pkg\n")  # `import pkg` runs pkg/__init__, which imports pkg.a
    assert cycles(import_edges(package)) == [["pkg", "pkg.a", "pkg.sub.b", "pkg.util"]]
