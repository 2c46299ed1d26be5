"""Print flowrl's import graph between its top-level modules and packages (the layers of
DESIGN.md), one ``importer -> imported: how many imports`` line each, and any cycle between
modules. TYPE_CHECKING-only imports are left out, as in the import contract (pyproject.toml).

Run: python scripts/import_graph.py            (grimp comes with import-linter: pip install -e .[test])
     python scripts/import_graph.py --mermaid  (a Mermaid flowchart of the same edges)
"""
from __future__ import annotations

import sys
from collections import Counter

import grimp
import networkx as nx


def top(module: str) -> str:
    return ".".join(module.split(".")[:2])


def main(argv: list[str]) -> int:
    g = grimp.build_graph("flowrl", include_external_packages=False,
                          exclude_type_checking_imports=True, cache_dir=None)
    edges: Counter[tuple[str, str]] = Counter()
    modules = nx.DiGraph()
    for m in g.modules:
        for i in g.find_modules_directly_imported_by(m):
            modules.add_edge(m, i)
            if top(m) != top(i):
                edges[top(m), top(i)] += 1
    if "--mermaid" in argv:
        print("flowchart TD")
        for (a, b), n in sorted(edges.items()):
            print(f"  {a.split('.')[-1]} -->|{n}| {b.split('.')[-1]}")
        return 0
    for (a, b), n in sorted(edges.items()):
        print(f"{a} -> {b}: {n}")
    cycles = [sorted(c) for c in nx.strongly_connected_components(modules) if len(c) > 1]
    print("module cycles:", cycles or "none")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
