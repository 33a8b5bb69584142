"""Scores that cannot be inflated (issue 36, item 7): one set of rows per chapter of the reference list,
whatever a student hands in. Duplicates are graded once and reported; a missing chapter counts as zero;
a browser's re-download name is still its chapter; a label written twice is graded once."""

from __future__ import annotations

import base64
import copy
import csv
import json
import shutil
from pathlib import Path

import nbformat
import pytest

from kvcourse.exercises.catalog import EXERCISES, NOTEBOOKS
from kvcourse.instructor.__main__ import main
from kvcourse.instructor.chapters import assign, chapter_number, reference_chapters

from .test_instructor import LABELS, _book, _exercise, _synthetic

BOOK = Path(__file__).resolve().parents[1] / "book"


@pytest.mark.parametrize(("name", "number"), [
    ("03_memory.ipynb", "03"), ("03_memory (1).ipynb", "03"), ("Copy of 03_memory.ipynb", "03"),
    ("03_memory-Copy1.ipynb", "03"), ("memory.ipynb", None), ("3_memory.ipynb", None), ("notes.ipynb", None),
])  # fmt: skip
def test_a_notebook_is_its_chapter_by_the_number_in_its_name(name, number):
    assert chapter_number(name) == number


def test_the_reference_list_is_the_course_unless_a_book_or_chapters_narrow_it():
    course = reference_chapters()
    assert sorted(course) == [f"{n:02d}" for n in range(1, 10)]
    assert [label for c in course.values() for label in c.labels] == list(EXERCISES)  # all 34, in order
    assert {f"ch{n}": c.notebook for n, c in course.items()} == NOTEBOOKS
    assert all((BOOK / c.notebook).is_file() for c in course.values())
    book = reference_chapters(BOOK)
    assert {n: (c.notebook, c.labels) for n, c in book.items()} == {
        n: (c.notebook, c.labels) for n, c in course.items()
    }
    assert list(reference_chapters(chapters=["04", "03", "03"])) == ["03", "04"]
    with pytest.raises(ValueError, match=r"\['10'\] are not in the reference list"):
        reference_chapters(chapters=["03", "10"])


def test_one_notebook_grades_each_chapter_and_the_rest_are_reported(tmp_path):
    names = ["sub/a/03_memory.ipynb", "03_memory (1).ipynb", "sub/03_memory.ipynb", "01_naive_generation (2).ipynb",
             "scratch.ipynb", "09_extra.ipynb"]  # fmt: skip
    paths = [tmp_path / n for n in names]
    found = assign(tmp_path, paths, reference_chapters(chapters=["01", "02", "03"]))
    # the book's name first, then the shallowest: the re-download at the top is a duplicate here
    assert found.graded == {"01": tmp_path / "01_naive_generation (2).ipynb", "03": tmp_path / "sub/03_memory.ipynb"}
    assert found.duplicates == {"03": [tmp_path / "sub/a/03_memory.ipynb", tmp_path / "03_memory (1).ipynb"]}
    assert found.missing == ["02"]
    assert found.strays == [tmp_path / "scratch.ipynb", tmp_path / "09_extra.ipynb"]
    exact = assign(tmp_path, [tmp_path / "03_memory (1).ipynb", tmp_path / "x/03_memory.ipynb"], reference_chapters())
    assert exact.graded["03"] == tmp_path / "x/03_memory.ipynb"


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def _score(rows: list[dict[str, str]], student: str) -> tuple[int, int]:
    mine = [r for r in rows if r["notebook"].startswith(f"{student}/")]
    return sum(r["passed"] == "1" for r in mine), len(mine)


def test_copies_of_a_solved_chapter_score_once_and_a_missing_one_counts_zero(tmp_path, capsys):
    book = _book(tmp_path)
    other = _synthetic()
    other.cells[2] = _exercise("ch01-ex-pairs", "Another chapter's exercise")  # a second chapter: 98
    nbformat.write(other, book / "98_other.ipynb")
    subs = tmp_path / "subs"
    solved = _synthetic()
    for place in ("honest/99_synthetic.ipynb", "copier/99_synthetic.ipynb", "copier/a/99_synthetic.ipynb",
                  "copier/b/99_synthetic.ipynb", "redownload/99_synthetic (1).ipynb"):  # fmt: skip
        (subs / place).parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(solved, subs / place)
    out = tmp_path / "grades.csv"
    assert main(["grade", str(subs), "--out", str(out), "--book", str(book), "--no-run", "--quiet"]) == 0
    rows = _rows(out)
    # each student: 3 of 6 (chapter 99 solved, chapter 98 missing), however many copies they handed in
    assert _score(rows, "honest") == _score(rows, "copier") == _score(rows, "redownload") == (3, 6)
    assert {r["notebook"] for r in rows if r["notebook"].startswith("copier/")} == {
        "copier/99_synthetic.ipynb",
        "copier/98_other.ipynb",
    }
    assert [r["message"] for r in rows if r["notebook"] == "redownload/98_other.ipynb"] == [
        "notebook missing from the submission"
    ] * 3
    assert not any("redownload/99_synthetic.ipynb" == r["notebook"] for r in rows)  # not also counted missing
    printed = capsys.readouterr().out
    assert (
        "copier/99_synthetic.ipynb: chapter 99 was handed in more than once: graded copier/99_synthetic.ipynb; "
        "not graded: copier/a/99_synthetic.ipynb, copier/b/99_synthetic.ipynb"
    ) in printed


def test_a_label_written_twice_is_graded_once_and_reported(tmp_path):
    from kvcourse.instructor import grade_notebook

    nb = _synthetic()
    again = [nbformat.from_dict({k: v for k, v in copy.deepcopy(c).items() if k != "id"}) for c in nb.cells[2:4]]
    nb.cells += again  # the mask exercise again, at the end
    nb.cells[-1].source = "def causal_mask(num_queries, num_keys):\n    return None\n"  # a wrong second answer
    path = tmp_path / "99_synthetic.ipynb"
    nbformat.write(nb, path)
    result = grade_notebook(path, expected=LABELS, run=False)
    assert [(r.exercise, r.passed) for r in result.rows] == [(label, True) for label in LABELS]
    assert result.notes == ["exercise ch01-ex-mask appears 2 times in the notebook: the first one was graded"]


def test_classroom_points_are_a_share_of_the_course_or_of_the_chapters_named(tmp_path, capsys):
    # A repository holding only a solved chapter 3 is its exercises' points of the course's, not 100%.
    (tmp_path / "exercises").mkdir()
    shutil.copy(BOOK / "03_memory.ipynb", tmp_path / "exercises" / "03_memory.ipynb")
    results = {}
    for name, extra in (("course", []), ("chapter3", ["--chapters", "3"])):
        out = tmp_path / f"{name}.csv"
        assert main(["grade", str(tmp_path / "exercises"), "--out", str(out), "--no-run", "--quiet", *extra]) == 0
        capsys.readouterr()
        assert main(["points", str(out)]) == 0
        line = capsys.readouterr().out.strip()
        result = json.loads(base64.b64decode(line.removeprefix("result=")))
        results[name] = (sum(t["score"] for t in result["tests"]), result["max_score"])
    ch3 = sum(label.startswith("ch03-") for label in EXERCISES)
    assert ch3 == 5 and results == {"course": (ch3, len(EXERCISES)), "chapter3": (ch3, ch3)}


@pytest.mark.parametrize("value", ["3,x", "", "100", "-1"])
def test_chapters_must_be_chapter_numbers(tmp_path, capsys, value):
    nbformat.write(_synthetic(), tmp_path / "99_synthetic.ipynb")
    with pytest.raises(SystemExit) as exc:
        main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--chapters", value])
    assert exc.value.code == 2 and "--chapters" in capsys.readouterr().err


def test_chapter_6_keeps_its_exercises_when_its_gpu_half_became_chapter_9():
    """Issue 45: a student's chapter 6 notebook from before the split still grades: every exercise it had is still
    chapter 6's, under the same label, and chapter 9's are new labels of its own."""
    course = reference_chapters()
    assert course["06"].labels == ("ch06-ex-running", "ch06-ex-admission", "ch06-ex-victims", "ch06-ex-chunk",
                                   "ch06-ex-predict")  # fmt: skip
    assert course["09"].notebook == "09_gpu_step.ipynb" and all(l.startswith("ch09-") for l in course["09"].labels)


def test_a_chapter_the_list_lacks_is_refused_before_grading(tmp_path, capsys):
    nbformat.write(_synthetic(), tmp_path / "99_synthetic.ipynb")
    with pytest.raises(SystemExit) as exc:
        main(["grade", str(tmp_path), "--out", str(tmp_path / "g.csv"), "--chapters", "10"])
    assert exc.value.code == 2 and "['10'] are not in the reference list" in capsys.readouterr().err
    assert not (tmp_path / "g.csv").exists()
