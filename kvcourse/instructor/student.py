"""Student copies: every solution replaced by a stub, everything else kept, no outputs.

What changes in a chapter notebook:

* A code cell tagged ``solution`` becomes a stub. Functions and classes keep their signature and
  docstring, and their body becomes ``raise NotImplementedError(hint)``; the calls of the chapter's
  checks (``chNN.check_...``) and the imports stay; every other statement goes. A solution that
  defines no function (a value to compute) becomes a ``raise`` followed by its checks. The hint is
  the cell's ``"hint"`` metadata, or a pointer to the exercise.
* An untagged code cell right before a solution cell that names the same check only in a comment
  (an old-style "your answer here" cell) is dropped: the stub takes its place.
* In markdown, every ``{solution}`` directive (also the gated ``{solution-start}`` ... ``{solution-end}``
  form) is removed, and in exercise cells every dropdown (``{dropdown}``, or ``:class: dropdown``).
* All outputs and execution counts are cleared (outputs can print answers), and cell metadata is
  reduced to its tags, minus ``solution`` and the tags that hide cells in the book.
* The markdown is then rendered as the reader copies render it (:func:`kvcourse.tools.reader_copies.reader_copy`,
  the one rendering both use): each glued number quoted in the text is filled in from the source notebook's
  outputs, roles become plain Markdown, exercises bold numbered paragraphs (their label kept in the cell's
  ``"exercise"`` metadata, where the grader finds it). A copy opened in Jupyter or Colab reads as the book does.
"""

from __future__ import annotations

import ast
import copy
import re

from .notebook import DIRECTIVE, checks_called, cell_source, find_exercises, is_solution

__all__ = ["make_stub", "student_copy", "strip_solution_text"]

_HIDING_TAGS = {"solution", "hide-cell", "hide-input", "hide-output", "remove-cell", "remove-input"}
_GATED = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{solution-start\}.*?^(?P=fence)[ \t]*$.*?"
    r"^(?P<fence2>`{3,}|:{3,})\{solution-end\}.*?^(?P=fence2)[ \t]*$\n?",
    re.M | re.S,
)


def _is_dropdown(match: re.Match) -> bool:
    options = re.findall(r"^:class:\s*(.*)$", match["body"], re.M)
    return match["name"] == "dropdown" or any("dropdown" in o.split() for o in options)


def strip_solution_text(markdown: str, in_exercise: bool) -> tuple[str, int]:
    """``markdown`` without solution directives (and, in an exercise cell, dropdowns); the number removed."""
    text, removed = _GATED.subn("", markdown)

    def drop(match: re.Match) -> str:
        nonlocal removed
        if match["name"] in ("solution", "solution-start", "solution-end") or (in_exercise and _is_dropdown(match)):
            removed += 1
            return ""
        return match[0]

    text = DIRECTIVE.sub(drop, text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n", removed


class _Stubber(ast.NodeTransformer):
    """Replace every function body by ``raise NotImplementedError(hint)``, keeping the docstring."""

    def __init__(self, hint: str) -> None:
        self.hint = hint

    def _raise(self) -> ast.stmt:
        return ast.parse(f"raise NotImplementedError({self.hint!r})").body[0]

    def _stub_function(self, node):
        body = [node.body[0]] if ast.get_docstring(node) is not None else []
        node.body = body + [self._raise()]
        return node

    visit_FunctionDef = _stub_function
    visit_AsyncFunctionDef = _stub_function

    def visit_ClassDef(self, node: ast.ClassDef) -> ast.ClassDef:
        kept = [node.body[0]] if ast.get_docstring(node) is not None else []
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kept.append(self._stub_function(item))
        node.body = kept or [ast.Pass()]
        return node


def _answer_names(node: ast.stmt, assigned: set[str]) -> list[str]:
    """The computed names a check call passes as arguments (``ch03.check_x(n)`` -> ``["n"]``)."""
    names = []
    for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            if isinstance(arg, ast.Name) and arg.id in assigned and arg.id not in names:
                names.append(arg.id)
    return names


def make_stub(source: str, label: str, hint: str | None = None) -> str:
    """The student's starting point for a solution cell ``source`` of exercise ``label``."""
    hint = f"{label}: {hint}" if hint else f"{label}: write your answer here (see the exercise above)"
    header = (
        f"# Exercise {label}: replace each NotImplementedError (or NotImplemented) with your code, then run this cell.\n"
        # where the graded part ends (kvcourse.instructor.sandbox._run_cells), said where the learner writes
        "# Graded: what this cell defines, run on its own with the chapter's imports. A follow-up line that\n"
        "# uses this page's other variables runs here, but grading stops at it: put it after your answer.\n"
    )
    try:
        tree = ast.parse(source)
    except SyntaxError:  # IPython magics or the like: keep only the checks
        checks = [line for line in source.splitlines() if checks_called(line)]
        return header + "\n".join([f"raise NotImplementedError({hint!r})", *checks]) + "\n"
    stubber = _Stubber(hint)
    blocks: list[str] = []
    defines = False
    assigned: set[str] = set()  # names the solution computes at the top level
    for node in tree.body:
        segment = ast.get_source_segment(source, node) or ""
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            blocks.append(segment)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            blocks.append(ast.unparse(stubber.visit(node)))
            defines = True
        elif checks_called(segment):
            if not defines:  # a value to compute: its name starts as NotImplemented, which the check reports
                for name in _answer_names(node, assigned):
                    if not any(b.startswith(f"{name} = NotImplemented") for b in blocks):
                        blocks.append(f"{name} = NotImplemented  # {hint}")
            blocks.append(segment)
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            assigned |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if not any("NotImplemented" in b for b in blocks):
        blocks.append(f"raise NotImplementedError({hint!r})")
    out: list[str] = []
    for block in blocks:  # a blank line around definitions, as in the chapters
        if out and (block.startswith(("def ", "class ", "async def ", "@")) or out[-1].startswith(("def ", "class "))):
            out.append("")
        out.append(block)
    return header + "\n".join(out) + "\n"


def _is_old_answer_cell(cell: dict, solution: dict) -> bool:
    """An untagged cell that names the solution's check only in a comment ("your answer here" cells)."""
    if cell.get("cell_type") != "code" or cell.get("metadata", {}).get("tags"):
        return False
    source = cell_source(cell)
    named = {c for c in checks_called(cell_source(solution))}
    mentioned = {m for m in named if m in source}
    return bool(mentioned) and not checks_called(source)


def student_copy(nb: dict, name: str = "") -> dict:
    """A copy of notebook ``nb`` (nbformat 4, as a dict) for students: see the module docstring.

    ``name``: the chapter's file name (``06_serving.ipynb``), which numbers its exercises as the book does
    (6.1, 6.2...); without one they are numbered 1, 2... ``nb`` must be the executed chapter: its outputs hold
    the glued numbers the text quotes (a quoted number it never glued raises ``ReaderCopyError``).
    """
    from kvcourse.tools.reader_copies import glue_values, reader_copy

    if not isinstance(name, str):
        raise TypeError(f"name must be the chapter's file name as a str, got {type(name).__name__}")
    glue = glue_values(nb)
    nb = copy.deepcopy(nb)
    exercises = find_exercises(nb)
    label_of = {i: e.label for e in exercises for i in e.code_cells}
    exercise_cells = {e.markdown_index for e in exercises}
    cells = nb["cells"]
    drop = {
        i for i in range(len(cells) - 1) if is_solution(cells[i + 1]) and _is_old_answer_cell(cells[i], cells[i + 1])
    }
    out = []
    for index, cell in enumerate(cells):
        if index in drop:
            continue
        metadata = cell.get("metadata", {})
        tags = [t for t in metadata.get("tags", []) if t not in _HIDING_TAGS]
        new = {"cell_type": cell["cell_type"], "metadata": {"tags": tags} if tags else {}, "source": cell_source(cell)}
        if "id" in cell:
            new["id"] = cell["id"]
        if cell["cell_type"] == "markdown":
            new["source"], _ = strip_solution_text(new["source"], index in exercise_cells)
        elif cell["cell_type"] == "code":
            if is_solution(cell):
                label = label_of.get(index, "exercise")
                new["source"] = make_stub(new["source"], label, metadata.get("hint"))
                new["metadata"] = {"tags": ["exercise-answer"]}
            new["outputs"], new["execution_count"] = [], None
        out.append(new)
    meta = {k: v for k, v in nb.get("metadata", {}).items() if k in ("kernelspec", "language_info")}
    stripped = {
        "cells": out,
        "metadata": meta,
        "nbformat": nb.get("nbformat", 4),
        "nbformat_minor": nb.get("nbformat_minor", 5),
    }
    return reader_copy(stripped, name, glue=glue)
