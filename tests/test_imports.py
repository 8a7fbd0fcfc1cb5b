"""No import circle between cellstream's modules at run time.

The graph is grimp's (import-linter's library) over the five root packages. It records the imports inside
functions too, so an import moved into a function to dodge a circle still closes it here; imports under
``if TYPE_CHECKING:`` are left out, since they never run. The lint-imports contract "no cycles between
siblings" (pyproject.toml) also forbids tangles between packages; this test is exact about modules, a
package's ``__init__`` included.
"""

from __future__ import annotations

import itertools

import grimp

ROOTS = ("cellstream", "connectors", "indexer", "tailer", "logstore")


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """The groups of two or more modules that import each other, directly or not (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in on_stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == module:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return groups


def describe(graph: grimp.ImportGraph, group: list[str]) -> str:
    """One circle of ``group``, each step with the line that imports: ``a -> b (a:12 from b import x) -> a``."""
    members = set(group)
    first = group[0]
    following = sorted(graph.find_modules_directly_imported_by(first) & members)[0]
    back = graph.find_shortest_chain(importer=following, imported=first)  # one exists: both are in the group
    assert back is not None
    chain = (first, *back)
    steps = []
    for importer, imported in itertools.pairwise(chain):
        detail = graph.get_import_details(importer=importer, imported=imported)[0]
        steps.append(f"  {importer} -> {imported}  ({importer}:{detail['line_number']} {detail['line_contents']})")
    return "\n".join(steps)


def test_no_import_circle_at_run_time() -> None:
    graph = grimp.build_graph(*ROOTS, exclude_type_checking_imports=True, cache_dir=None)
    circles = [describe(graph, group) for group in strongly_connected(graph)]
    assert not circles, "import circles at run time:\n" + "\n\n".join(circles)


def test_a_circle_is_found_and_printed() -> None:
    graph = grimp.ImportGraph()
    for module in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(module)
    graph.add_import(importer="pkg.a", imported="pkg.b", line_number=3, line_contents="from pkg.b import x")
    graph.add_import(importer="pkg.b", imported="pkg.c", line_number=4, line_contents="from pkg.c import y")
    graph.add_import(importer="pkg.c", imported="pkg.a", line_number=9, line_contents="from pkg.a import z")
    graph.add_import(importer="pkg", imported="pkg.a", line_number=1, line_contents="from pkg.a import z")

    assert strongly_connected(graph) == [["pkg.a", "pkg.b", "pkg.c"]]
    assert describe(graph, ["pkg.a", "pkg.b", "pkg.c"]) == (
        "  pkg.a -> pkg.b  (pkg.a:3 from pkg.b import x)\n"
        "  pkg.b -> pkg.c  (pkg.b:4 from pkg.c import y)\n"
        "  pkg.c -> pkg.a  (pkg.c:9 from pkg.a import z)")
