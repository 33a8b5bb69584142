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
        assert ".check_" in cell_source(nb["cells"][solutions[0]]), (
            f"{exercise.label}: the solution must call its check"
        )
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
    md = (
        "```{exercise} T\n:label: a\nDo it.\n```\n\n````{solution} a\n:class: dropdown\nThe answer:\n```python\n42\n```\n"
        "````\n\n:::{admonition} Hint\n:class: dropdown\nthink of 42\n:::\n"
    )
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


# A MyST role (``{term}`KV cache` ``) or directive fence (```` ```{exercise} ````) that Jupyter would show raw.
_ROLE_LEFT = re.compile(r"\{[a-z][a-z0-9:_-]*\}`")
_DIRECTIVE_LEFT = re.compile(r"^(`{3,}|:{3,})\{", re.M)


def _markdown(cell: dict) -> str:
    return re.sub(r"\n{3,}", "\n\n", cell_source(cell)).strip()


@pytest.fixture(scope="module")
def student_copies(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("student")
    assert main(["student", str(BOOK), "--out", str(out)]) == 0
    return out


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_a_student_copy_reads_as_the_reader_copy_numbers_filled_in_no_myst_left(student_copies, path):
    """Issue 47, item 2: what the student CLI writes is rendered as the reader copies are (one rendering)."""
    from kvcourse.tools.reader_copies import reader_copy

    nb = json.loads(path.read_text())
    student = json.loads((student_copies / path.name).read_text())
    text = "\n".join(cell_source(c) for c in student["cells"] if c["cell_type"] == "markdown")
    assert _ROLE_LEFT.findall(text) == [] and _DIRECTIVE_LEFT.findall(text) == []
    assert "hidden below" not in text  # no promise of solutions the copy does not have
    assert "{glue" in path.read_text()  # the chapter quotes glued numbers: they must be filled in
    reader = {c["id"]: c for c in reader_copy(nb, path.name)["cells"]}
    exercises = 0
    for cell in (c for c in student["cells"] if c["cell_type"] == "markdown"):
        rendered = _markdown(reader[cell["id"]])
        if "exercise" in cell.get("metadata", {}):  # the exercise as the reader copy states it, solution left out
            exercises += 1
            assert rendered.startswith(_markdown(cell)) and "Solution to" not in cell_source(cell), cell["id"]
        else:
            assert _markdown(cell) == rendered, cell["id"]
    assert exercises == len(find_exercises(nb)) >= 3
    assert [e.label for e in find_exercises(student)] == [e.label for e in find_exercises(nb)]  # the grader finds them
    number = path.name[:2].lstrip("0")
    assert f"**Exercise {number}.1" in text
    stubs = [cell_source(c) for c in student["cells"] if "exercise-answer" in c.get("metadata", {}).get("tags", [])]
    assert stubs and all("# Graded: what this cell defines" in stub for stub in stubs)  # where grading stops


def test_student_copy_wants_the_chapters_file_name_as_a_str():
    with pytest.raises(TypeError, match="name must be the chapter's file name"):
        student_copy(json.loads(CHAPTERS[0].read_text()), CHAPTERS[0])


# ---- grading synthetic notebooks -----------------------------------------------------------------
# Real exercise labels (the grader grades each by the check the catalog names), in a small notebook.
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
        f"Explained.\n```\n"
    )


MASK = (
    "def causal_mask(num_queries, num_keys):\n"
    "    return torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries)\n\n"
    "ch01.check_causal_mask(causal_mask)"
)
OUTWEIGH = (
    "import math\n\ndef tokens_to_outweigh(config, batch_size):\n"
    "    per_token = 2 * config['num_hidden_layers'] * config['num_key_value_heads'] * config['head_dim']\n"
    "    return math.ceil(config['num_parameters'] / (per_token * batch_size))\n\n"
    "ch02.check_tokens_to_outweigh(tokens_to_outweigh)"
)
FROZEN = (
    "def frozen_positions(step_a, step_b, past):\n"
    "    return {n for n, a in step_a.items() if torch.allclose(a[:past].float(), step_b[n][:past].float(), "
    "rtol=1e-2, atol=1e-3)}\n\n"
    "ch01.check_frozen_positions(frozen_positions)"
)
LABELS = ["ch01-ex-mask", "ch02-ex-outweigh", "ch01-ex-frozen"]


def _synthetic(first_markdown: bool = True) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_markdown_cell("# 99. A synthetic chapter"),
        _code("import torch\nfrom kvcourse.exercises import ch01, ch02"),
        _exercise("ch01-ex-mask", "A mask"),
        _code(MASK, tags=["solution", "hide-cell"], hint="True where a query may look"),
        _exercise("ch02-ex-outweigh", "Cache against weights"),
        _code(OUTWEIGH, tags=["solution", "hide-cell"]),
        _exercise("ch01-ex-frozen", "Frozen"),
        _code(FROZEN, tags=["solution", "hide-cell"]),
    ]
    if not first_markdown:
        nb.cells = nb.cells[1:]  # the notebook starts with its import cell
    return nb


def _book(tmp_path: Path) -> Path:
    """A reference book of one chapter, the synthetic one: what the grader counts every submission against."""
    book = tmp_path / "book"
    book.mkdir(exist_ok=True)
    nbformat.write(_synthetic(), book / "99_synthetic.ipynb")
    return book


def _read_csv(path: Path) -> dict[tuple[str, str], tuple[str, str]]:
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert all(set(r) == {"notebook", "exercise", "passed", "message", "check_s", "notebook_s"} for r in rows)
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
    # a mask that lets each token see one key of its future; the frozen answer compares exactly
    wrong.cells[3].source = (
        "def causal_mask(num_queries, num_keys):\n"
        "    return torch.ones(num_queries, num_keys, dtype=torch.bool).tril(num_keys - num_queries + 1)\n"
        "ch01.check_causal_mask(causal_mask)"
    )
    wrong.cells[7].source = (
        "def frozen_positions(step_a, step_b, past):\n"
        "    return {n for n, a in step_a.items() if torch.equal(a[:past], step_b[n][:past])}\n"
        "ch01.check_frozen_positions(frozen_positions)"
    )
    nbformat.write(wrong, subs / "wrong" / "99_synthetic.ipynb")
    (subs / "broken" / "99_synthetic.ipynb").write_text('{"cells": [')  # not JSON

    out, reports = tmp_path / "grades.csv", tmp_path / "reports"
    assert (
        main(
            [
                "grade",
                str(subs),
                "--out",
                str(out),
                "--book",
                str(book),
                "--timeout",
                "300",
                "--reports",
                str(reports),
                "--quiet",
            ]
        )
        == 0
    )
    rows = _read_csv(out)
    for label in LABELS:
        assert rows[("ref/99_synthetic.ipynb", label)] == ("1", "ok")
        passed, message = rows[("untouched/99_synthetic.ipynb", label)]
        assert passed == "0" and ("NotImplementedError" in message or "not written yet" in message), message
        assert rows[("broken/99_synthetic.ipynb", label)][1].startswith("could not read the notebook")
        for who in ("ref", "untouched", "wrong", "broken"):
            assert rows[(f"{who}/98_other.ipynb", label)] == ("0", "notebook missing from the submission")
    assert "True where a query may look" in rows[("untouched/99_synthetic.ipynb", "ch01-ex-mask")][1]
    assert rows[("wrong/99_synthetic.ipynb", "ch01-ex-mask")][0] == "0"
    assert "one key from its future" in rows[("wrong/99_synthetic.ipynb", "ch01-ex-mask")][1]
    assert "expected:" in rows[("wrong/99_synthetic.ipynb", "ch01-ex-mask")][1]
    assert "exact equality" in rows[("wrong/99_synthetic.ipynb", "ch01-ex-frozen")][1]
    assert rows[("wrong/99_synthetic.ipynb", "ch02-ex-outweigh")][0] == "0"  # still the stub
    assert "ref/99_synthetic.ipynb: 3 of 3 exercises passed" in capsys.readouterr().out
    # the feedback: a page per student with the check's expected / got / hint, a class summary and plot
    assert sorted(p.name for p in reports.iterdir()) == sorted(
        [f"{s}.{x}" for s in ("ref", "untouched", "wrong", "broken") for x in ("md", "html")]
        + ["summary.md", "pass_rates.png"]
    )
    page = (reports / "wrong.md").read_text()
    assert (
        "| `ch01-ex-mask` | no | **Case:** causal_mask(4, 4)" in page
        and "<br>**Expected:**" in page
        and "**Hint:** Each query sees one key" in page
    )
    assert "| `ch02-ex-outweigh` | no | **Problem:** tokens_to_outweigh is not written yet" in page
    assert "<b>Hint:</b>" in (reports / "wrong.html").read_text()
    summary = (reports / "summary.md").read_text()
    assert "| `ch02-ex-outweigh` | 1 | 8 | 12% |" in summary and "| wrong | 0 | 6 |" in summary
    assert (reports / "pass_rates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_notebook_that_starts_with_a_code_cell_runs_as_handed_in(tmp_path):
    from kvcourse.instructor import grade_notebook

    nb = _synthetic(first_markdown=False)
    nb.cells.append(
        _code(
            "assert causal_mask(2, 3).tolist() == [[True, True, False], [True, True, True]]\nprint('first cell kept')"
        )
    )
    path = tmp_path / "99_synthetic.ipynb"
    nbformat.write(nb, path)
    result = grade_notebook(path, timeout=300)
    assert result.notes == []  # no cell raised: the imports of the first cell were not overwritten
    assert [(r.exercise, r.passed) for r in result.rows] == [(label, True) for label in LABELS]


def test_each_kernel_gets_its_share_of_the_cores_waiting_passively(tmp_path, monkeypatch):
    from kvcourse.instructor import grade_notebook
    from kvcourse.instructor.grade import thread_budget

    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert [thread_budget(j) for j in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_NUM_THREADS", "3")  # what the instructor set is kept
    nb = _synthetic()
    nb.cells.append(
        _code(
            "import os, torch\n"
            "assert os.environ['OMP_WAIT_POLICY'] == 'PASSIVE' and os.environ['OMP_NUM_THREADS'] == '1'\n"
            "assert os.environ['MKL_NUM_THREADS'] == '3'"
        )
    )
    path = tmp_path / "99_synthetic.ipynb"
    nbformat.write(nb, path)
    import torch

    before = torch.get_num_threads()
    try:
        result = grade_notebook(path, timeout=300, threads=1)
        assert result.notes == [] and all(r.passed for r in result.rows), (result.notes, result.rows)
        assert torch.get_num_threads() == 1 and result.run_seconds > 0
    finally:
        torch.set_num_threads(before)


def test_a_slow_notebook_is_stopped_and_its_exercises_are_still_graded(tmp_path):
    slow = _synthetic()
    slow.cells.insert(2, _code("import time\ntime.sleep(120)"))
    slow.cells[6].source = "import time\ntime.sleep(120)\n" + OUTWEIGH  # a solution cell that never ends
    (tmp_path / "sub").mkdir()
    nbformat.write(slow, tmp_path / "sub" / "99_synthetic.ipynb")
    out, reports = tmp_path / "grades.csv", tmp_path / "reports"
    assert (
        main(
            [
                "grade",
                str(tmp_path / "sub"),
                "--out",
                str(out),
                "--timeout",
                "10",
                "--check-timeout",
                "20",
                "--reports",
                str(reports),
                "--quiet",
                "--book",
                str(_book(tmp_path)),
            ]
        )
        == 0
    )
    rows = _read_csv(out)
    assert rows[("99_synthetic.ipynb", "ch01-ex-mask")] == ("1", "ok")
    assert rows[("99_synthetic.ipynb", "ch01-ex-frozen")] == ("1", "ok")
    passed, message = rows[("99_synthetic.ipynb", "ch02-ex-outweigh")]
    assert passed == "0" and message.startswith("timed out"), message
    assert "ran longer than 10 s and was stopped in cell 2" in (reports / "sub.md").read_text()
    # the time of each: the notebook's run (stopped at 10 s) on every row of it, and each check's own
    with out.open() as f:
        timed = {r["exercise"]: (float(r["notebook_s"]), float(r["check_s"])) for r in csv.DictReader(f)}
    # The check's time is a lower bound (killed at its 20 s limit, on the clock that times it). The notebook's is
    # the same on every row; the stop message above says where it was stopped. Its value is not bounded below: the
    # stop comes from the kernel's cell timeout, on another clock than the one timing the notebook (9.8 s was seen
    # on a loaded machine).
    assert len({run for run, _ in timed.values()}) == 1 and all(run > 0 for run, _ in timed.values())
    assert timed["ch02-ex-outweigh"][1] >= 20 and timed["ch01-ex-mask"][1] > 0
    assert "| Notebooks run (s) | Checks (s) |" in (reports / "summary.md").read_text()


def test_a_replaced_check_does_not_pass(tmp_path):
    nb = _synthetic()
    nb.cells[3].source = "ch01.check_causal_mask = lambda fn: True\nch01.check_causal_mask(None)"
    (tmp_path / "sub").mkdir()
    nbformat.write(nb, tmp_path / "sub" / "99_synthetic.ipynb")
    out = tmp_path / "grades.csv"
    main(
        [
            "grade",
            str(tmp_path / "sub"),
            "--out",
            str(out),
            "--timeout",
            "60",
            "--quiet",
            "--no-run",
            "--book",
            str(_book(tmp_path)),
        ]
    )
    passed, message = _read_csv(out)[("99_synthetic.ipynb", "ch01-ex-mask")]
    assert passed == "0" and "does not define `causal_mask`" in message


def test_an_exercise_the_catalog_does_not_know_is_reported(tmp_path):
    nb = _synthetic()
    nb.cells[2] = _exercise("ch99-ex-new", "Not in the catalog")
    for folder in ("book", "sub"):  # an instructor's book with an exercise the installed catalog lacks
        (tmp_path / folder).mkdir()
        nbformat.write(nb, tmp_path / folder / "99_synthetic.ipynb")
    out = tmp_path / "grades.csv"
    main(["grade", str(tmp_path / "sub"), "--out", str(out), "--quiet", "--no-run", "--book", str(tmp_path / "book")])
    passed, message = _read_csv(out)[("99_synthetic.ipynb", "ch99-ex-new")]
    assert passed == "0" and "no check is registered" in message


# ---- bad input to the grade command: refused before any grading ----------------------------------
def test_a_folder_without_notebooks_is_an_error(tmp_path, capsys):
    out = tmp_path / "grades.csv"
    (tmp_path / "empty").mkdir()
    (tmp_path / "texts" / "alice").mkdir(parents=True)
    (tmp_path / "texts" / "alice" / "answers.txt").write_text("42")
    for folder in ("empty", "texts"):
        with pytest.raises(SystemExit) as exc:
            main(["grade", str(tmp_path / folder), "--out", str(out)])
        assert exc.value.code == 2 and "has no notebooks" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-5", "soon"])
def test_timeouts_must_be_finite_positive_seconds(tmp_path, capsys, value):
    nbformat.write(_synthetic(), tmp_path / "99_synthetic.ipynb")
    for option in ("--timeout", "--check-timeout"):
        with pytest.raises(SystemExit) as exc:
            main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), f"{option}={value}"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and option in err and "seconds" in err and "Traceback" not in err


def test_out_that_cannot_be_written_is_refused_before_grading(tmp_path, capsys):
    nbformat.write(_synthetic(), tmp_path / "99_synthetic.ipynb")
    (tmp_path / "a_folder").mkdir()
    (tmp_path / "a_file").write_text("")
    for out, reason in ((tmp_path / "a_folder", "is a folder"), (tmp_path / "a_file" / "g.csv", "is not a folder")):
        with pytest.raises(SystemExit) as exc:
            main(["grade", str(tmp_path), "--out", str(out), "--quiet"])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and "--out" in err and reason in err
    with pytest.raises(SystemExit):
        main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--jobs", "0"])
    assert not (tmp_path / "g.csv").exists()


# ---- the cheats an earlier grader passed: every one fails now -----------------------------------
def _cheat(label: str, source: str, uses: tuple[str, ...] = (), isolation: bool | None = None):
    """Grade ``source`` as the solution cell of ``label`` (the chapter's imports before it)."""
    from kvcourse.exercises.catalog import EXERCISES
    from kvcourse.instructor.checker import grade_exercise

    imports = (
        "import functools\nimport math\nimport torch\nimport kvcourse\n"
        "from kvcourse.exercises import ch01, ch02, ch07\n"
    )
    cells = [["context", "chapter imports", imports]]
    cells += [["uses", u, MASK] for u in uses]
    cells.append(["solution", label, source])
    return grade_exercise(EXERCISES[label], cells, timeout=120, isolation=isolation)


_ATTENTION_CHEATS = {
    "another exercise's check": "ch01.check_naive_attention_pairs(lambda p, n: sum((p + i) * (p + i + 1) // 2 "
    "for i in range(n)))\ndef attention(q, k, v):\n    return q\n",
    "only another exercise's check": "ch01.check_naive_attention_pairs(lambda p, n: sum((p + i) * (p + i + 1) // 2 "
    "for i in range(n)))\n",
    "patching what the check compares with": (
        "import kvcourse.kernels.reference as reference\n"
        "kvcourse.causal_attention = reference.causal_attention = lambda q, k, v: q * 0\n"
        "torch.allclose = torch.equal = lambda *a, **k: True\n"
        "def attention(q, k, v):\n    return q * 0\n"
    ),
    "getattr with a computed name": "attention = getattr(kvcourse, 'causal_' + 'attention')\n",
    "functools.partial": "attention = functools.partial(kvcourse.causal_attention)\n",
    "a lambda around it": "attention = lambda q, k, v: kvcourse.causal_attention(q, k, v)\n",
    "a reload of its module": (
        "import importlib, kvcourse.kernels.reference as r\nattention = importlib.reload(r).causal_attention\n"
    ),
    "its source, executed": (
        "import kvcourse.kernels.reference as r\nnamespace = {}\n"
        "exec(open(r.__file__).read(), namespace)\nattention = namespace['causal_attention']\n"
    ),
    "found through gc": (
        "import gc, types\nattention = next(f for f in gc.get_objects()\n"
        "    if isinstance(f, types.FunctionType) and f.__name__ == 'causal_attention')\n"
    ),
    "the check's private reference": "from kvcourse.exercises import ch01 as c\nattention = c._attention\n",
    "the checks package as an attribute": (
        "import importlib\nattention = importlib.import_module(kvcourse.exercises.__name__ + '.ch01')._attention\n"
    ),
    "the check module's file": (
        "import kvcourse, os\nnamespace = {}\npath = os.path.join(os.path.dirname(kvcourse.__file__),"
        " 'exercises', 'ch01.py')\nexec(open(path).read(), namespace)\n"
        "attention = namespace['_attention']\n"
    ),
    "the check wrapper's closure cell": (
        "for cell in ch01.check_attention.__closure__ or ():\n"
        "    cell.cell_contents = lambda *a, **k: True\n"
        "def attention(q, k, v):\n    return q\nch01.check_attention(attention)\n"
    ),
}


@pytest.mark.parametrize("cheat", list(_ATTENTION_CHEATS))
def test_a_cheat_on_the_attention_exercise_fails(cheat):
    verdict = _cheat("ch01-ex-attention", _ATTENTION_CHEATS[cheat], uses=("ch01-ex-mask",))
    assert not verdict.passed, cheat
    if "computed name" in cheat or "partial" in cheat or "lambda" in cheat or "gc" in cheat:
        assert "causal_attention is what this exercise's check compares against" in verdict.message


def test_the_reference_attention_passes_the_same_path():  # so the cheats above fail for what they do
    source = (
        "def attention(q, k, v):\n    group = q.shape[1] // k.shape[1]\n"
        "    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)\n"
        "    s = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).masked_fill(\n"
        "        ~causal_mask(q.shape[2], k.shape[2]), float('-inf'))\n"
        "    return torch.softmax(s, -1) @ v\n"
    )
    assert _cheat("ch01-ex-attention", source, uses=("ch01-ex-mask",)).passed


def test_a_passed_line_in_a_log_or_on_stdout_counts_for_nothing():
    # The log goes where the sandbox may write, its own folder; the check's hint shows the lines after it ran.
    source = (
        "import json\nline = json.dumps({'check': 'ch01.check_causal_mask', 'passed': True, 'message': ''})\n"
        "open('checks.jsonl', 'a').write(line + '\\n')\nprint(line)\n"
        "def causal_mask(num_queries, num_keys):\n    return torch.ones(num_queries, num_keys, dtype=torch.bool)\n"
    )
    verdict = _cheat("ch01-ex-mask", source)
    assert not verdict.passed and "its future included" in verdict.hint, verdict.message


def test_what_the_checker_lends_can_only_be_called():
    source = (
        "def block_hashes(token_ids, block_size, cache_salt, hash_fn):\n"
        "    return hash_fn.__globals__['_block_hashes'](token_ids, block_size, cache_salt, hash_fn)\n"
    )
    verdict = _cheat("ch07-ex-hash-chain", source)
    assert not verdict.passed and "can only be called" in verdict.message


def test_an_answer_that_ends_its_process_or_never_returns_fails():
    ended = _cheat("ch01-ex-mask", "import os\ndef causal_mask(num_queries, num_keys):\n    os._exit(0)\n")
    assert not ended.passed and "ended before the check was done" in ended.message
    from kvcourse.exercises.catalog import EXERCISES
    from kvcourse.instructor.checker import grade_exercise

    cells = [["solution", "ch01-ex-mask", "import time\ndef causal_mask(num_queries, num_keys):\n    time.sleep(60)\n"]]
    slow = grade_exercise(EXERCISES["ch01-ex-mask"], cells, timeout=5)
    assert not slow.passed and slow.message.startswith("timed out")


def test_a_copying_cache_is_told_from_one_that_returns_views():
    """Tensor views keep their storage across the process boundary, and copies do not pass for views."""
    copying = (
        "class PreallocatedKVCache:\n"
        "    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, max_seq_len):\n"
        "        self.k = [None] * num_layers\n        self.v = [None] * num_layers\n"
        "        self.lengths = [0] * num_layers\n        self.max_seq_len = max_seq_len\n"
        "    @property\n    def seq_len(self):\n        return self.lengths[0]\n"
        "    def update(self, layer, k, v):\n"
        "        if self.lengths[layer] + k.shape[2] > self.max_seq_len:\n            raise ValueError('full')\n"
        "        self.k[layer] = k if self.k[layer] is None else torch.cat([self.k[layer], k], 2)\n"
        "        self.v[layer] = v if self.v[layer] is None else torch.cat([self.v[layer], v], 2)\n"
        "        self.lengths[layer] += k.shape[2]\n        return self.k[layer], self.v[layer]\n"
    )
    verdict = _cheat("ch02-ex-update", copying)
    assert not verdict.passed and verdict.expected == "a view of the buffer allocated in __init__", verdict.message


def test_a_students_kernel_runs_in_the_interpreter_even_where_triton_would_compile():
    """On a GPU machine Triton compiles in the grader's process (TRITON_INTERPRET unset or 0), but the sandbox
    hands the student's code host tensors: its kernels must run in the interpreter there. Simulated on any
    machine with TRITON_INTERPRET=0 in the grader's environment."""
    import os
    import subprocess
    import sys

    solution = (
        "from kvcourse.kernels import interpreting\n"
        "assert interpreting(), 'the sandbox would compile the kernels for a GPU'\n"
        "def kv_bytes(seq_lens, num_kv_heads, head_dim, bytes_per_value):\n"
        "    return 2 * sum(seq_lens) * num_kv_heads * head_dim * bytes_per_value\n"
    )
    script = (
        "from kvcourse.exercises.catalog import EXERCISES\n"
        "from kvcourse.instructor.checker import grade_exercise\n"
        f"verdict = grade_exercise(EXERCISES['ch05-ex-bytes'], [['solution', 'ch05-ex-bytes', {solution!r}]])\n"
        "print(verdict.passed, verdict.message)\n"
    )
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.startswith("True "), done.stdout + done.stderr


def test_an_appendix_after_the_exercises_is_not_part_of_the_last_one():
    md = lambda s: {"cell_type": "markdown", "metadata": {}, "source": s}  # noqa: E731
    code = lambda s: {"cell_type": "code", "metadata": {}, "source": s, "outputs": [], "execution_count": None}  # noqa: E731
    ex = lambda label: md(f"```{{exercise}} T\n:label: {label}\nDo it.\n```")  # noqa: E731
    nb = {"cells": [md("# 1. Title"), code("import x"), md("## Exercises"), ex("a"), code("a = 1"),
                    md("### A note within the exercise"), code("a += 1"), ex("b"), code("b = 2"),
                    md("## Appendix: provenance"), code("print('plumbing')"), ex("c"), code("c = 3")]}  # fmt: skip
    found = {e.label: e.code_cells for e in find_exercises(nb)}
    assert found == {"a": [4, 6], "b": [8], "c": [12]}  # cell 10 is the appendix's


def _alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed orphan may wait to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_processes_an_answer_starts_end_with_its_grading():
    # The child's pid comes back in the answer's own error: an isolated sandbox can write no file out here.
    source = (
        "import subprocess, sys, os\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        "raise RuntimeError(f'child pid {child.pid}.')\n"
    )
    verdict = _cheat("ch01-ex-mask", source)
    assert "child pid " in verdict.message, verdict.message
    pid = int(verdict.message.split("child pid ")[1].split(".")[0])
    import time

    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "a process started by the answer outlived its grading"


def test_a_bughunt_answer_that_ignores_the_chunks_fails_in_the_grader():
    # issue 36, item 2: one forward pass over the whole prompt fills the same cache with the same logits
    one_pass = (
        "def prefill_in_chunks_fixed(model, ids, chunk_size):\n"
        "    cache = kvcourse.KVCache.for_model(model.config, device=model.device)\n"
        "    return model(torch.tensor([ids]), cache=cache)[0, -1], cache\n"
    )
    verdict = _cheat("ch02-ex-bughunt", one_pass)
    assert not verdict.passed and "at most chunk_size tokens" in verdict.hint, verdict.message
    chunked = (
        "def prefill_in_chunks_fixed(model, ids, chunk_size):\n"
        "    cache = kvcourse.KVCache.for_model(model.config, device=model.device)\n"
        "    for start in range(0, len(ids), chunk_size):\n"
        "        logits = model(torch.tensor([ids[start : start + chunk_size]]), cache=cache)\n"
        "    return logits[0, -1], cache\n"
    )
    assert _cheat("ch02-ex-bughunt", chunked).passed


def test_a_public_equivalent_of_the_reference_passes_as_instructors_md_says():
    # Issue 36, item 3: the promise that "the package's own answer" is refused is dropped. Only what a check names
    # in refuse_references is refused; kvcourse's other public functions that compute the same answer pass (the
    # course is open source). instructors.md says so, naming this very case.
    source = (
        "from kvcourse.kernels.reference import position_masked_attention\n"
        "def attention(q, k, v):\n"
        "    t, s = q.shape[2], k.shape[2]\n"
        "    return position_masked_attention(q, k, v, torch.arange(s - t, s), torch.arange(s))\n"
    )
    assert _cheat("ch01-ex-attention", source, uses=("ch01-ex-mask",)).passed
    page = (BOOK / "instructors.md").read_text()
    assert "position_masked_attention" in page and "no similarity check" in page
