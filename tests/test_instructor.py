"""The instructor tool: student copies keep nothing of a solution; grading runs notebooks and reports each exercise.

Grading executes small synthetic notebooks (a kernel start and a few checks each) and, once, the
real chapter 1 with its student copy, so these tests stay within a few minutes.
"""

from __future__ import annotations

import ast
import csv
import json
import re
from pathlib import Path

import nbformat
import pytest

from kvcourse.instructor import find_exercises, make_stub, student_copy
from kvcourse.instructor.__main__ import main
from kvcourse.instructor.notebook import cell_source, is_solution
from kvcourse.instructor.student import strip_solution_text

BOOK = Path(__file__).resolve().parents[1] / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))


def _strings(obj) -> str:
    """Every string in a JSON document, joined: what a search of the file would find."""
    if isinstance(obj, str):
        return obj + "\n"
    if isinstance(obj, dict):
        return "".join(_strings(k) + _strings(v) for k, v in obj.items())
    if isinstance(obj, list):
        return "".join(_strings(x) for x in obj)
    return ""


def _solution_only_lines(nb: dict) -> set[str]:
    """Lines of solution cells and solution directives that nothing else in the reference notebook contains."""
    public = []
    solution_lines = set()
    for cell in nb["cells"]:
        source = cell_source(cell)
        if is_solution(cell):
            label = next((e.label for e in find_exercises(nb) if nb["cells"].index(cell) in e.code_cells), "x")
            kept = make_stub(source, label, cell.get("metadata", {}).get("hint"))
            solution_lines |= {line.strip() for line in source.splitlines() if line.strip() not in kept}
        elif cell["cell_type"] == "markdown":
            stripped, _ = strip_solution_text(source, "{exercise}" in source)
            public.append(stripped)
            solution_lines |= {line.strip() for line in source.splitlines() if line.strip() not in stripped}
        else:
            public.append(source)
    text = "\n".join(public)
    return {line for line in solution_lines if len(line) >= 12 and line not in text and not line.startswith("#")}


# ---- student copies of the real chapters ---------------------------------------------------------
@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_every_chapter_has_three_exercises_with_solutions_that_call_checks(path):
    nb = json.loads(path.read_text())
    exercises = find_exercises(nb)
    assert len(exercises) >= 3, f"{path.name} has {len(exercises)} exercises"
    for exercise in exercises:
        solutions = exercise.solution_cells(nb)
        assert len(solutions) == 1, f"{exercise.label}: needs one solution cell, has {len(solutions)}"
        assert ".check_" in cell_source(nb["cells"][solutions[0]]), f"{exercise.label}: the solution must call its check"
    md = "\n".join(cell_source(c) for c in nb["cells"] if c["cell_type"] == "markdown")
    assert len(re.findall(r"\{solution\}", md)) >= len(exercises)
    for cell in nb["cells"]:  # one exercise per markdown cell, so code cells belong to exactly one
        assert cell_source(cell).count("{exercise}") <= 1


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_student_copy_keeps_nothing_of_a_solution(path):
    nb = json.loads(path.read_text())
    student = student_copy(nb)
    nbformat.validate(nbformat.from_dict(student))
    text = _strings(student)
    leaked = [line for line in _solution_only_lines(nb) if line in text]
    assert not leaked, f"solution text in the student copy of {path.name}: {leaked[:3]}"
    assert "{solution" not in text and '"solution"' not in json.dumps(student)
    for cell in student["cells"]:
        if cell["cell_type"] == "code":
            assert cell["outputs"] == [] and cell["execution_count"] is None
    stubs = [c for c in student["cells"] if "exercise-answer" in c.get("metadata", {}).get("tags", [])]
    assert len(stubs) == len(find_exercises(nb))
    for stub, exercise in zip(stubs, find_exercises(nb)):
        source = cell_source(stub)
        ast.parse(source)
        assert ("raise NotImplementedError" in source or "= NotImplemented" in source) and exercise.label in source
        solution = cell_source(nb["cells"][exercise.solution_cells(nb)[0]])
        for check in re.findall(r"ch\d\d\.check_\w+", solution):
            assert check in source, f"{exercise.label}: the stub lost the call of {check}"


def test_stub_keeps_signatures_docstrings_imports_and_checks():
    source = '''import math
def area(r: float) -> float:
    """Area of a circle of radius r."""
    return math.pi * r ** 2  # the secret

class Shape:
    """A shape."""
    sides = 4
    def corners(self):
        return self.sides

x = area(2.0)
assert abs(x - 12.566) < 1e-3
ch09.check_area(area)
'''
    stub = make_stub(source, "ch09-ex-area", "use pi r^2")
    assert "def area(r: float) -> float:" in stub and "Area of a circle of radius r." in stub
    assert "import math" in stub and "ch09.check_area(area)" in stub and "class Shape:" in stub
    assert "def corners(self):" in stub
    assert "math.pi * r" not in stub and "secret" not in stub and "sides = 4" not in stub and "12.566" not in stub
    assert stub.count("raise NotImplementedError('ch09-ex-area: use pi r^2')") == 2
    namespace = {}
    exec(stub.replace("ch09.check_area(area)", ""), namespace)
    with pytest.raises(NotImplementedError, match="use pi"):
        namespace["area"](1.0)


def test_stub_of_a_value_answer_starts_as_not_implemented():
    stub = make_stub("m = 6\nn = m * 7\nch09.check_answer(n)\n", "ch09-ex-n")
    lines = [line for line in stub.splitlines() if not line.startswith("#")]
    assert lines[0].startswith("n = NotImplemented  # ch09-ex-n") and lines[1] == "ch09.check_answer(n)"
    assert "m = 6" not in stub
    assert "6 * 7" not in stub


def test_markdown_loses_solutions_and_exercise_dropdowns_only():
    md = ("```{exercise} T\n:label: a\nDo it.\n```\n\n````{solution} a\n:class: dropdown\nThe answer:\n```python\n42\n```\n"
          "````\n\n:::{admonition} Hint\n:class: dropdown\nthink of 42\n:::\n")
    text, removed = strip_solution_text(md, in_exercise=True)
    assert removed == 2 and "{exercise}" in text and "Do it." in text and "42" not in text
    body = ":::{admonition} More\n:class: dropdown\nextra reading\n:::\n"
    assert strip_solution_text(body, in_exercise=False) == (body, 0)
    gated = "```{solution-start} a\n```\nsecret\n```{solution-end}\n```\nafter\n"
    assert strip_solution_text(gated, in_exercise=True)[0] == "after\n"


def test_student_cli_writes_every_chapter(tmp_path, capsys):
    assert main(["student", str(BOOK), "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.glob("*.ipynb")) == [p.name for p in CHAPTERS]
    assert "replaced by stubs" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["student", str(BOOK), "--out", str(BOOK)])


# ---- grading synthetic notebooks -----------------------------------------------------------------
def _code(source, tags=(), hint=None):
    cell = nbformat.v4.new_code_cell(source)
    if tags:
        cell.metadata["tags"] = list(tags)
    if hint:
        cell.metadata["hint"] = hint
    return cell


def _exercise(label, title):
    return nbformat.v4.new_markdown_cell(
        f"```{{exercise}} {title}\n:label: {label}\nDo it.\n```\n\n```{{solution}} {label}\n:class: dropdown\n"
        f"Explained.\n```\n")


def _synthetic() -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 99. A synthetic chapter"),
        _code("import torch\nfrom kvcourse.exercises import ch01, ch02"),
        _exercise("t-ex-mask", "A mask"),
        _code("def causal_mask(num_queries, num_keys):\n"
              "    return torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries)\n\n"
              "ch01.check_causal_mask(causal_mask)", tags=["solution", "hide-cell"], hint="True where a query may look"),
        _exercise("t-ex-outweigh", "Cache against weights"),
        _code("import math\n\ndef tokens_to_outweigh(config, batch_size):\n"
              "    per_token = 2 * config['num_hidden_layers'] * config['num_key_value_heads'] * config['head_dim']\n"
              "    return math.ceil(config['num_parameters'] / (per_token * batch_size))\n\n"
              "ch02.check_tokens_to_outweigh(tokens_to_outweigh)", tags=["solution", "hide-cell"]),
        _exercise("t-ex-frozen", "Frozen"),
        _code("frozen = {'past_k', 'past_v', 'past_q', 'past_attn_out'}\nch01.check_frozen_tensors(frozen)",
              tags=["solution", "hide-cell"]),
    ]
    return nb


def _read_csv(path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert all(set(r) == {"notebook", "exercise", "passed", "message"} for r in rows)
    return {(r["notebook"], r["exercise"]): (r["passed"], r["message"]) for r in rows}


def test_grading_reference_untouched_wrong_broken_and_missing_notebooks(tmp_path, capsys):
    ref = _synthetic()
    book = tmp_path / "book"
    book.mkdir()
    nbformat.write(ref, book / "99_synthetic.ipynb")
    nbformat.write(ref, book / "98_other.ipynb")  # a chapter nobody submitted
    subs = tmp_path / "submissions"
    for student in ("ref", "untouched", "wrong", "broken"):
        (subs / student).mkdir(parents=True)
    nbformat.write(ref, subs / "ref" / "99_synthetic.ipynb")
    student = nbformat.from_dict(student_copy(ref))
    nbformat.write(student, subs / "untouched" / "99_synthetic.ipynb")
    wrong = nbformat.from_dict(student_copy(ref))
    # a mask that lets each token see one key of its future; the frozen answer left out Q
    wrong.cells[3].source = ("def causal_mask(num_queries, num_keys):\n"
                             "    return torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries + 1)\n"
                             "ch01.check_causal_mask(causal_mask)")
    wrong.cells[7].source = "ch01.check_frozen_tensors({'past_k', 'past_v', 'past_attn_out'})"
    nbformat.write(wrong, subs / "wrong" / "99_synthetic.ipynb")
    (subs / "broken" / "99_synthetic.ipynb").write_text('{"cells": [')  # not JSON

    out = tmp_path / "grades.csv"
    assert main(["grade", str(subs), "--out", str(out), "--book", str(book), "--timeout", "300"]) == 0
    rows = _read_csv(out)
    labels = ["t-ex-mask", "t-ex-outweigh", "t-ex-frozen"]
    for label in labels:
        assert rows[("ref/99_synthetic.ipynb", label)] == ("1", "ok")
        passed, message = rows[("untouched/99_synthetic.ipynb", label)]
        assert passed == "0" and ("NotImplementedError" in message or "not written yet" in message), message
        assert rows[("broken/99_synthetic.ipynb", label)][1].startswith("could not read the notebook")
        for who in ("ref", "untouched", "wrong", "broken"):
            assert rows[(f"{who}/98_other.ipynb", label)] == ("0", "notebook missing from the submission")
    assert "True where a query may look" in rows[("untouched/99_synthetic.ipynb", "t-ex-mask")][1]
    assert rows[("wrong/99_synthetic.ipynb", "t-ex-mask")][0] == "0"
    assert "one key from its future" in rows[("wrong/99_synthetic.ipynb", "t-ex-mask")][1]
    assert "expected:" in rows[("wrong/99_synthetic.ipynb", "t-ex-mask")][1]
    assert "'past_q' is frozen too" in rows[("wrong/99_synthetic.ipynb", "t-ex-frozen")][1]
    assert "ref/99_synthetic.ipynb: 3 of 3 exercises passed" in capsys.readouterr().out


def test_a_slow_notebook_times_out_and_grading_goes_on(tmp_path):
    slow = _synthetic()
    slow.cells.insert(2, _code("import time\ntime.sleep(120)"))
    nbformat.write(slow, tmp_path / "99_synthetic.ipynb")
    out = tmp_path / "grades.csv"
    assert main(["grade", str(tmp_path), "--out", str(out), "--timeout", "10"]) == 0
    rows = _read_csv(out)
    assert len(rows) == 3 and all(p == "0" and "timed out" in m for p, m in rows.values())


def test_a_replaced_check_does_not_pass(tmp_path):
    nb = _synthetic()
    nb.cells[3].source = "ch01.check_causal_mask = lambda fn: True\nch01.check_causal_mask(None)"
    nbformat.write(nb, tmp_path / "99_synthetic.ipynb")
    out = tmp_path / "grades.csv"
    main(["grade", str(tmp_path), "--out", str(out), "--timeout", "60"])
    passed, message = _read_csv(out)[("99_synthetic.ipynb", "t-ex-mask")]
    assert passed == "0" and "no check ran" in message


# ---- grading the real chapter 1 ------------------------------------------------------------------
def test_real_chapter_reference_passes_and_student_copy_fails(tmp_path):
    chapter = BOOK / "01_naive_generation.ipynb"
    nb = nbformat.read(chapter, as_version=4)
    (tmp_path / "reference").mkdir()
    (tmp_path / "student").mkdir()
    nbformat.write(nb, tmp_path / "reference" / chapter.name)
    nbformat.write(nbformat.from_dict(student_copy(nb)), tmp_path / "student" / chapter.name)
    out = tmp_path / "grades.csv"
    main(["grade", str(tmp_path), "--out", str(out), "--book", str(BOOK), "--timeout", "900"])
    rows = _read_csv(out)
    labels = [e.label for e in find_exercises(nb)]
    assert {label for (_, label) in rows} >= set(labels)
    for label in labels:
        assert rows[(f"reference/{chapter.name}", label)] == ("1", "ok"), rows[(f"reference/{chapter.name}", label)]
        passed, message = rows[(f"student/{chapter.name}", label)]
        assert passed == "0" and ("NotImplementedError" in message or "not written yet" in message), message
