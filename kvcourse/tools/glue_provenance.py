"""Where each glued figure of a chapter comes from, and the paragraphs that compare figures from two runs.

The measurements appendix's rule: no chapter compares a figure taken in one run with a figure taken in another
without saying so in the sentence. A chapter's figures come from two kinds of run:

* **live**: measured by this page's own execution. CONTRIBUTING's rule 5 marks every timing cell with
  ``NBVAL_IGNORE_OUTPUT`` (the tag ``nbval-ignore-output`` or the comment on its first line), so a value assigned in
  such a cell, not from a committed file, is a measurement of this run;
* **committed**: read from a result file committed with the package (``kvcourse.results.load``/``newest``/``find``,
  ``load_kernel_bench``, ``kvcourse.compression.results.load_results``), made on another machine at another time.

Values computed from neither (a formula, a catalog, a constant) carry no run. :func:`glue_kinds` follows names
through a notebook's code cells in order (an assignment's targets take the kinds of the names and loader calls in
its value; ``x.append(v)`` and the like give ``x`` the kinds of ``v``) and gives every ``glue(name, value)`` the kinds of its
value. :func:`mixed_paragraphs` then lists the markdown paragraphs that quote glued figures of both kinds without a
phrase that says so (:data:`ACKNOWLEDGED`: "this page's run", "another run", "the committed run", "from
``x.json``"...). Static analysis, so it is deliberately simple: it reads names, not values, and a cell it cannot
parse (IPython magics aside) is an error naming the cell.
"""

from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass
from pathlib import Path

from ..instructor.notebook import cell_source

LIVE, COMMITTED = "live", "committed"
LOADERS = frozenset({"load", "newest", "find"})  # kvcourse.results' calls that read a committed result file
# Functions that read one too: the kernel benchmark's and the compression sweep's loaders.
NAMED_LOADERS = frozenset({"load_kernel_bench", "load_results"})
IGNORE_TAG, IGNORE_COMMENT = "nbval-ignore-output", "# NBVAL_IGNORE_OUTPUT"
MUTATORS = frozenset({"append", "extend", "insert", "add", "update", "setdefault"})  # x.m(v) puts v into x
GLUE_ROLE = re.compile(r"\{glue(?::text)?\}`([^`]+)`")
# A paragraph that says where its figures come from: the phrase names the other run, the committed result, or the file.
ACKNOWLEDGED = re.compile(
    r"this page's (own )?run|this page's own|"
    r"\b(another|other|earlier|later|separate|first|committed|recorded)\b[^.;:]{0,40}\b(runs?|results?|benchmarks?|fit|lease)\b|"
    r"\bfrom\s+`?[\w./{}:-]*\.json|kvcourse/results/",
    re.IGNORECASE,
)


def is_timing_cell(cell: dict) -> bool:
    """A cell whose outputs nbval ignores: by CONTRIBUTING's rule 5, a timing cell (its values are this run's)."""
    tags = cell.get("metadata", {}).get("tags", [])
    return IGNORE_TAG in tags or cell_source(cell).lstrip().startswith(IGNORE_COMMENT)


def _loader_call(node: ast.AST) -> bool:
    """``kvcourse.results.load(...)``, ``results.newest(...)``, ``load_kernel_bench(...)`` and the like."""
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Name):
        return func.id in NAMED_LOADERS
    if isinstance(func, ast.Attribute) and func.attr in LOADERS:
        # results.load / kvcourse.results.load: the attribute chain must pass through "results"
        base = func.value
        while isinstance(base, ast.Attribute):
            if base.attr == "results":
                return True
            base = base.value
        return isinstance(base, ast.Name) and base.id == "results"
    return False


def _kinds(node: ast.AST | None, names: dict[str, frozenset]) -> frozenset:
    """The kinds of everything an expression reads: names already known, and loader calls inside it.

    A loader call counts as ``"committed:<file>"``, the file being the string it names (``newest("cpu-load-*.json")``
    names a pattern: one file, the newest), or ``"committed:?"`` when no call of the expression names one.
    """
    if node is None:
        return frozenset()
    found: set[str] = set()
    files: set[str] = set()
    loads = False
    for sub in ast.walk(node):
        if _loader_call(sub):
            loads = True
            first = sub.args[0] if sub.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                files.add(first.value)
        elif isinstance(sub, ast.Name) and isinstance(sub.ctx, ast.Load):
            found |= names.get(sub.id, frozenset())
    if loads:
        found |= {f"{COMMITTED}:{f}" for f in files} or {f"{COMMITTED}:?"}
    return frozenset(found)


def committed(kinds: frozenset) -> bool:
    """Whether any of ``kinds`` is a committed result file."""
    return any(k.startswith(COMMITTED) for k in kinds)


def _targets(node: ast.AST) -> list[str]:
    """The plain names an assignment target binds (``a``, ``a, b``, ``a[k]`` and ``a.x`` bind ``a``)."""
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, (ast.Tuple, ast.List)):
        return [n for elt in node.elts for n in _targets(elt)]
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    if isinstance(node, (ast.Subscript, ast.Attribute)):
        return _targets(node.value)
    return []


def _glue_name(node: ast.AST) -> str | None:
    """A glue call's first argument as a regex: a string literal exactly, an f-string with ``.+`` for its fields."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return re.escape(node.value)
    if isinstance(node, ast.JoinedStr):
        parts = [re.escape(v.value) if isinstance(v, ast.Constant) else ".+" for v in node.values]
        return "".join(parts)
    return None


def _is_glue(call: ast.Call) -> bool:
    func = call.func
    return (isinstance(func, ast.Name) and func.id == "glue") or (
        isinstance(func, ast.Attribute) and func.attr == "glue"
    )


@dataclass(frozen=True)
class Glued:
    """One ``glue`` call: its name (a regex), the kinds of run its value comes from, and the cell's index."""

    pattern: str
    kinds: frozenset
    cell: int


def glue_kinds(nb: dict) -> list[Glued]:
    """Every glue call of a notebook with the kinds of run (``live``, ``committed``) its value comes from."""
    names: dict[str, frozenset] = {}
    glued: list[Glued] = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        # IPython lines (!pip, %magic) are not Python; the setup cell's are the usual ones.
        code = "\n".join(
            line[: len(line) - len(line.lstrip())] + "pass" if line.lstrip().startswith(("!", "%")) else line
            for line in cell_source(cell).splitlines()
        )
        try:
            tree = ast.parse(code)
        except SyntaxError as exc:
            raise ValueError(f"cell {index}: cannot parse its source ({exc.msg}, line {exc.lineno})") from exc
        timing = is_timing_cell(cell)

        def kinds_of(value: ast.AST | None) -> frozenset:
            found = _kinds(value, names)
            # In a timing cell, anything not read from a committed file is this run's measurement.
            return found | {LIVE} if timing and not committed(found) else found

        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    for name in _targets(target):
                        names[name] = kinds_of(node.value)
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                for name in _targets(node.target):
                    extra = names.get(name, frozenset()) if isinstance(node, ast.AugAssign) else frozenset()
                    names[name] = kinds_of(node.value) | extra
            elif isinstance(node, ast.For):  # (a comprehension's variables stay inside it)
                for name in _targets(node.target):
                    names[name] = kinds_of(node.iter)
            elif isinstance(node, ast.NamedExpr):
                names[node.target.id] = kinds_of(node.value)
            elif isinstance(node, ast.Call) and _is_glue(node) and len(node.args) >= 2:
                pattern = _glue_name(node.args[0])
                if pattern is not None:
                    glued.append(Glued(pattern, kinds_of(node.args[1]), index))
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in MUTATORS and isinstance(node.func.value, ast.Name) and node.args):  # fmt: skip
                # x.append(v), x.update(...): x now holds what v holds
                owner = node.func.value.id
                added = frozenset().union(*(kinds_of(a) for a in node.args))
                names[owner] = names.get(owner, frozenset()) | added
    return glued


def name_kinds(glued: list[Glued], name: str) -> frozenset:
    """The kinds of one glued name: the union over every glue call whose name matches it (empty if none)."""
    return frozenset().union(*(g.kinds for g in glued if re.fullmatch(g.pattern, name)))


def paragraphs(markdown: str) -> list[str]:
    """A markdown cell's paragraphs: blocks separated by blank lines."""
    return [p for p in re.split(r"\n\s*\n", markdown) if p.strip()]


@dataclass(frozen=True)
class Mixed:
    """A paragraph that quotes live and committed figures without saying they come from different runs."""

    cell: int
    live: tuple[str, ...]
    committed: tuple[str, ...]
    text: str

    def __str__(self) -> str:
        return (
            f"cell {self.cell}: live {', '.join(self.live)} beside committed {', '.join(self.committed)}, "
            f"with no phrase naming the other run: {self.text[:160]!r}..."
        )


def mixed_paragraphs(nb: dict) -> list[Mixed]:
    """The markdown paragraphs of ``nb`` that compare this page's measurements with committed ones, unannounced."""
    glued = glue_kinds(nb)
    found = []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "markdown":
            continue
        for text in paragraphs(cell_source(cell)):
            quoted = {name: name_kinds(glued, name) for name in GLUE_ROLE.findall(text)}
            # A figure made from both (a committed fit applied to this page's trace) is left out: only a figure
            # purely of this run beside one purely of a committed run is a comparison across runs for certain.
            live = tuple(n for n, k in quoted.items() if k == {LIVE})
            files = {
                n: sorted(f.split(":", 1)[1] for f in k if f != f"{COMMITTED}:?") or ["?"]
                for n, k in quoted.items()
                if k and all(f.startswith(COMMITTED) for f in k)
            }
            if live and files and not ACKNOWLEDGED.search(text):
                found.append(Mixed(index, live, tuple(f"{n} ({', '.join(f)})" for n, f in files.items()), text))
    return found


def check_notebook(path: Path) -> list[Mixed]:
    """:func:`mixed_paragraphs` of one notebook file."""
    return mixed_paragraphs(json.loads(Path(path).read_text()))
