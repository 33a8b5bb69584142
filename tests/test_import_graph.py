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


def test_results_imports_nothing_of_the_package():
    # The committed results are data: the tools that read and check them (kvcourse.bench.measured) import
    # kvcourse.results, never the other way (it imported kernels/measured to check a kernel run).
    assert import_graph()["kvcourse.results"] == set()


# ---------------------------------------------------------------------------------------------
# No tricks in the packages' __init__: one lazy-export helper, names written once, none a submodule's
# ---------------------------------------------------------------------------------------------
def _packages() -> list[Path]:
    return sorted(PACKAGE_DIR.rglob("__init__.py"))


def _lazy_dicts(tree: ast.Module) -> list[ast.expr]:
    """The dicts a package hands to ``lazy_exports`` (by name, or unpacked into one: ``{**a, **b}``)."""
    assigned = {t.id: node.value for node in tree.body if isinstance(node, ast.Assign)
                for t in node.targets if isinstance(t, ast.Name)}  # fmt: skip
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "lazy_exports" and len(node.args) > 1:
            arg = node.args[1]
            parts = [v for k, v in zip(arg.keys, arg.values) if k is None] if isinstance(arg, ast.Dict) else [arg]
            found += [assigned.get(p.id) if isinstance(p, ast.Name) else p for p in parts]
    return [d for d in found if d is not None]


def _exported_names(init: Path) -> set[str]:
    """What a package's ``__init__`` binds for its users: names it defines, assigns or imports from a module
    (``from . import sub`` binds the submodule itself, so it is not counted), and the names it hands to
    ``lazy_exports``."""
    tree = ast.parse(init.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {a.asname or a.name for a in node.names}
    for d in _lazy_dicts(tree):
        if isinstance(d, ast.Dict):
            names |= {k.value for k in d.keys if isinstance(k, ast.Constant)}
        elif isinstance(d, ast.Call) and d.args and isinstance(d.args[0], (ast.List, ast.Tuple)):  # dict.fromkeys
            names |= {e.value for e in d.args[0].elts if isinstance(e, ast.Constant)}
    return {n for n in names if not n.startswith("__")}


def test_no_package_exports_a_name_that_is_also_its_submodule():
    # Importing the submodule would set the package's attribute to the module, hiding the export
    # (kvcourse.generate, the function, beside kvcourse/generate.py, needed a module class swapped to hide it).
    clashes = []
    for init in _packages():
        submodules = {p.stem for p in init.parent.glob("*.py")} | {
            p.parent.name for p in init.parent.glob("*/__init__.py")
        }
        clashes += [f"{_module_name(init, PACKAGE_DIR)}.{n}" for n in sorted(_exported_names(init) & submodules)]
    assert not clashes, f"exported names that are also submodules: {clashes}"


def test_one_lazy_export_helper():
    # A module's __getattr__ (PEP 562) is written once, inside kvcourse.lazy.lazy_exports; every package
    # gets its own from there, none writes one by hand (kvcourse.kernels kept a copy).
    by_hand = [
        str(path.relative_to(PACKAGE_DIR.parent))
        for path in sorted(PACKAGE_DIR.rglob("*.py"))
        if any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.parse(path.read_text()).body)
    ]
    assert by_hand == []
    helper = next(
        n for n in ast.parse((PACKAGE_DIR / "lazy.py").read_text()).body if getattr(n, "name", "") == "lazy_exports"
    )
    assert any(isinstance(n, ast.FunctionDef) and n.name == "__getattr__" for n in ast.walk(helper))
    source = (PACKAGE_DIR / "lazy.py").read_text()
    assert "__class__" not in source, "lazy_exports must not swap a module's class"


def test_lazy_packages_write_their_exported_names_once():
    # A package that exports on first use derives `__all__` from what it hands lazy_exports, never a second
    # list typed by hand.
    typed_twice = []
    for init in _packages():
        tree = ast.parse(init.read_text(encoding="utf-8"))
        if not _lazy_dicts(tree):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__all__" for t in node.targets)
                and isinstance(node.value, (ast.List, ast.Tuple))
            ):
                typed_twice.append(_module_name(init, PACKAGE_DIR))
    assert not typed_twice, f"packages whose __all__ repeats their lazy exports by hand: {typed_twice}"


def test_lazy_packages_export_what_they_list():
    import kvcourse
    import kvcourse.kernels
    import kvcourse.paged
    import kvcourse.serving

    for package in (kvcourse, kvcourse.paged, kvcourse.serving):
        assert package.__all__ == sorted(package._EXPORTS) and set(package.__all__) <= set(dir(package))
    assert set(kvcourse.kernels.__all__) == set(kvcourse.kernels._REFERENCES)
    assert callable(kvcourse.generate) and not hasattr(kvcourse, "_exports")
