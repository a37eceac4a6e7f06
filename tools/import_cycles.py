"""Find import cycles among the modules of a package, from their import statements.

Usage: ``python tools/import_cycles.py [ROOT_DIR]`` (default ``atom``). Prints every cycle
(one strongly connected component of two or more modules, or a module importing itself) and
exits 1 if there is any, 0 if there is none.

Every ``import`` and ``from ... import`` counts, at module level or inside a function, under
``TYPE_CHECKING`` or not: a lazy import only hides a cycle from the interpreter, not from the
reader. ``from pkg import name`` is an edge to ``pkg.name`` when that is a module, else to
``pkg``. A package's ``__init__`` is the module named by the package.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def module_name(path: Path, root: Path) -> str:
    """The dotted name of the module at ``path`` (``root``'s parent is the import root)."""
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve_relative(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that the file at ``path`` imports (itself excluded)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _resolve_relative(module, is_package, node.level, node.module)
            else:
                base = node.module or ""
            for alias in node.names:
                child = f"{base}.{alias.name}"
                found.add(child if child in known else base)
    edges = set()
    for name in found:
        # "import a.b.c" also runs a and a.b; the edge that matters is the deepest known module
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            edges.add(name)
    return edges


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package tree it imports."""
    files = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    known = set(files)
    return {m: imports_of(p, m, known) for m, p in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str]) -> int:
    root = Path(argv[1] if len(argv) > 1 else "atom").resolve()
    graph = import_graph(root)
    found = cycles(graph)
    for comp in found:
        members = set(comp)
        edges = [f"{a} -> {b}" for a in comp for b in sorted(graph[a] & members)]
        print(f"cycle of {len(comp)}: " + "; ".join(edges))
    print(f"{len(found)} import cycles among {len(graph)} modules under {root.name}/")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
