"""Where a chapter's exercises are: the ``{exercise}`` directives and the code cells that follow each.

A chapter notebook states each exercise in a markdown cell (a MyST ``{exercise}`` directive with a
``:label:``), followed by its code cells, up to the next exercise or the end of the notebook. In a
reader copy (:mod:`kvcourse.tools.reader_copies`, what Colab and a GitHub Classroom repository hold)
the directive is plain markdown and the cell's ``"exercise"`` metadata keeps the label. The
cell tagged ``solution`` among them holds the reference answer and ends by calling the check.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

__all__ = ["Exercise", "find_exercises", "cell_source", "checks_called", "is_solution", "CHECK_CALL", "DIRECTIVE"]

# A fenced MyST directive: ```{name} argument ... ``` or :::{name} ... ::: (longer fences nest shorter ones).
DIRECTIVE = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{(?P<name>[\w-]+)\}(?P<arg>[^\n]*)\n(?P<body>.*?)^(?P=fence)[ \t]*$\n?", re.M | re.S
)
LABEL = re.compile(r"^:label:\s*(\S+)", re.M)
# A call of a chapter check, e.g. ``ch02.check_cache_update(`` (comments are stripped before matching).
CHECK_CALL = re.compile(r"\b(ch\d\d)\.(check_\w+)\s*\(")


def cell_source(cell: dict) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def is_solution(cell: dict) -> bool:
    return cell.get("cell_type") == "code" and "solution" in cell.get("metadata", {}).get("tags", [])


@dataclass
class Exercise:
    """One exercise: its label, title, the index of its markdown cell and of the code cells after it."""

    label: str
    title: str
    markdown_index: int
    code_cells: list[int] = field(default_factory=list)

    def solution_cells(self, nb: dict) -> list[int]:
        return [i for i in self.code_cells if is_solution(nb["cells"][i])]


def find_exercises(nb: dict) -> list[Exercise]:
    """The exercises of ``nb`` in order. Code cells belong to the last exercise stated before them, until a
    section heading (``#`` or ``##``) that states no exercise: an appendix after the exercises is not one."""
    exercises: list[Exercise] = []
    closed = False  # a heading after the last exercise ended it
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") == "markdown":
            found = len(exercises)
            for match in DIRECTIVE.finditer(cell_source(cell)):
                if match["name"] == "exercise":
                    label = LABEL.search(match["body"])
                    name = label.group(1) if label else f"exercise-{len(exercises) + 1}"
                    exercises.append(Exercise(name, match["arg"].strip(), index))
            stated = cell.get("metadata", {}).get("exercise")
            if len(exercises) == found and isinstance(stated, str) and stated:  # a reader copy: plain markdown
                exercises.append(Exercise(stated, "", index))
            if len(exercises) > found:
                closed = False
            elif re.match(r"#{1,2} ", cell_source(cell).lstrip()):
                closed = True
        elif cell.get("cell_type") == "code" and exercises and not closed:
            exercises[-1].code_cells.append(index)
    return exercises


def checks_called(source: str) -> list[str]:
    """``chNN.check_name`` for every check the code calls (commented-out calls do not count)."""
    code = "\n".join(line.split("#", 1)[0] for line in source.splitlines())
    return list(dict.fromkeys(f"{m[1]}.{m[2]}" for m in CHECK_CALL.finditer(code)))
