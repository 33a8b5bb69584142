"""Write student copies of notebooks: solutions removed, everything else kept.

Usage: ``python -m kvcourse.exercises.student book/*.ipynb --out student/``

Removed: code cells tagged ``solution`` (their outputs go with them; an empty
answer cell naming the check to run takes their place) and, in markdown cells,
every ```` ```{solution} ```` directive block. The exercise text
and the ``check_*`` calls stay, so a student fills in the blanks and runs the
checks; an instructor grades by running the same checks.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

# A MyST solution directive: ```{solution} label ... ``` (any fence of 3+ backticks or colons).
_SOLUTION = re.compile(r"^(?P<fence>`{3,}|:{3,})\{solution(?:-start)?\}.*?^(?P=fence)\s*$\n?", re.M | re.S)


_CHECK_CALL = re.compile(r"\b(ch\d\d\.check_\w+)\(")


def _answer_cell(solution: dict) -> dict:
    """An empty code cell for the student's answer, naming the check(s) the solution called."""
    source = "".join(solution["source"]) if isinstance(solution["source"], list) else solution["source"]
    checks = list(dict.fromkeys(_CHECK_CALL.findall(source)))
    lines = ["# Your answer here."] + [f"# Then run: {name}(...)" for name in checks]
    cell = {"cell_type": "code", "execution_count": None, "metadata": {}, "outputs": [], "source": "\n".join(lines) + "\n"}
    if "id" in solution:  # nbformat >= 4.5 notebooks need a unique id per cell
        cell["id"] = f"{solution['id']}-answer"[:64]
    return cell


def strip_solutions(nb: dict) -> tuple[dict, int]:
    """Return ``(student_notebook, number_of_things_removed)``."""
    removed, cells = 0, []
    for cell in nb["cells"]:
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] == "code" and "solution" in tags:
            removed += 1
            cells.append(_answer_cell(cell))
            continue
        if cell["cell_type"] == "markdown":
            source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
            new, n = _SOLUTION.subn("", source)
            if n:
                removed += n
                cell = {**cell, "source": new}
        cells.append(cell)
    return {**nb, "cells": cells}, removed


def main(argv: list[str] | None = None) -> int:
    import nbformat

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True, help="folder for the student copies")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for path in args.notebooks:
        if not path.is_file():
            parser.error(f"no such notebook: {path}")
        nb = nbformat.read(path, as_version=4)
        student, removed = strip_solutions(nb)
        nbformat.write(nbformat.from_dict(student), args.out / path.name)
        print(f"{path} -> {args.out / path.name} ({removed} solution parts removed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
