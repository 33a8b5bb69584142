"""The package's modules import one another without circles (issue 51).

The graph is built from the source, not by importing: every ``import`` and ``from ... import`` in a
module, at module level or inside a function (a deferred import still says the two modules need each
other), is an arrow to the module it names. Importing a submodule also runs its package's
``__init__``, but that arrow is not counted: every package's ``__init__`` lists its own submodules,
so counting it would make every package a circle. A circle is a strongly connected component with
more than one module, or a module importing itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent.parent / "kvcourse"


def _module_name(path: Path, package_dir: Path) -> str:
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Module name -> the package's modules it imports, read from the source with ``ast``."""
    files = {_module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        # the package a relative import starts from: a package's own name, a module's parent
        here = name.split(".") if is_package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = here[: len(here) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                # `from pkg import sub` imports the submodule; `from mod import name` imports mod
                targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in files else module for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import kvcourse.a.b as x` names kvcourse.a.b
                    target = target.rpartition(".")[0]
                if target:
                    graph[name].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components with more than one module, or a module importing
    itself (Tarjan's algorithm, iterative, so a deep package cannot exhaust the recursion limit)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    found.append(sorted(component))
    return found


def test_the_graph_sees_imports_at_module_level_and_inside_functions(tmp_path):
    pkg = tmp_path / "kvcourse"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import thing\n    import kvcourse.sub.c as c\n")
    (pkg / "sub" / "c.py").write_text("from kvcourse import a\n")
    graph = import_graph(pkg)
    assert graph == {
        "kvcourse": {"kvcourse.a"},
        "kvcourse.a": {"kvcourse.sub.b"},
        "kvcourse.sub": set(),
        "kvcourse.sub.b": {"kvcourse.a", "kvcourse.sub.c"},
        "kvcourse.sub.c": {"kvcourse.a"},
    }
    assert circles(graph) == [["kvcourse.a", "kvcourse.sub.b", "kvcourse.sub.c"]]


def test_the_package_imports_without_circles():
    found = circles(import_graph())
    assert not found, "modules that import one another (directly or round a circle): " + "; ".join(
        " <-> ".join(c) for c in found
    )


def test_results_does_not_import_the_kernels():
    # the committed results are data: the tools that read them import results, never the other way
    assert not any(m.startswith("kvcourse.kernels") for m in import_graph()["kvcourse.results"])
