"""Student copies: solutions gone, exercises and checks kept; every chapter has at least 3 exercises."""

import json
import re
from pathlib import Path

import pytest

from kvcourse.exercises.student import main, strip_solutions

BOOK = Path(__file__).resolve().parents[1] / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))


def _nb(cells):
    return {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}


def test_strip_removes_solution_cells_and_directives():
    md = (
        "```{exercise} Title\n:label: ex1\nDo it.\n```\n\n"
        "```{solution} ex1\n:class: dropdown\nThe answer is 42.\n```\n"
        "Text after."
    )
    nb = _nb(
        [
            {"cell_type": "markdown", "metadata": {}, "source": md},
            {
                "cell_type": "code",
                "metadata": {"tags": ["solution", "hide-cell"]},
                "source": "x = 42\nassert ch01.check_answer(x)",
                "outputs": [],
            },
            {"cell_type": "code", "metadata": {}, "source": "check(x)", "outputs": []},
        ]
    )
    student, removed = strip_solutions(nb)
    assert removed == 2
    assert len(student["cells"]) == 3
    text = student["cells"][0]["source"]
    assert "{exercise}" in text and "Text after." in text
    assert "42" not in text and "{solution}" not in text
    answer = student["cells"][1]
    assert "42" not in answer["source"] and "ch01.check_answer(...)" in answer["source"]
    assert answer["metadata"] == {} and answer["outputs"] == []
    assert student["cells"][2]["source"] == "check(x)"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_chapter_has_three_exercises_with_solutions_and_checks(path):
    nb = json.loads(path.read_text())
    md = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    exercises = re.findall(r"\{exercise\}", md)
    solutions = [c for c in nb["cells"] if "solution" in c.get("metadata", {}).get("tags", [])]
    assert len(exercises) >= 3, f"{path.name} has {len(exercises)} exercises"
    assert len(re.findall(r"\{solution\}", md)) >= len(exercises)
    assert solutions, f"{path.name} has no solution code cells tagged 'solution'"
    assert all(".check_" in "".join(c["source"]) for c in solutions), "every solution cell must call its check"
    student, removed = strip_solutions(nb)
    assert removed >= len(exercises)
    assert not any("solution" in c.get("metadata", {}).get("tags", []) for c in student["cells"])


def test_cli_writes_copies(tmp_path, capsys):
    assert CHAPTERS, "no chapter notebooks found"
    main([str(CHAPTERS[0]), "--out", str(tmp_path)])
    out = json.loads((tmp_path / CHAPTERS[0].name).read_text())
    original = json.loads(CHAPTERS[0].read_text())
    assert len(out["cells"]) == len(original["cells"])  # each solution cell became an answer cell
    assert not any("solution" in c.get("metadata", {}).get("tags", []) for c in out["cells"])
    assert "solution parts removed" in capsys.readouterr().out
