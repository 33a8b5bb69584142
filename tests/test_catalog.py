"""The grader's catalog matches the book, and every reference solution passes through the grader's clean path.

``kvcourse.exercises.catalog`` says which check grades which exercise and which names the solution
defines. Here it is compared with the reference solution cell of every exercise of every chapter (the
check it calls, with which names), and each reference solution is graded as a submission would be:
its cells in a sandbox process, the catalog's check in this one. The untouched student copy of every
chapter fails every exercise the same way.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from kvcourse.exercises.catalog import EXERCISES, MODEL, spec_for
from kvcourse.instructor import find_exercises, student_copy
from kvcourse.instructor.checker import grade_exercise, load_check, references_of
from kvcourse.instructor.grade import exercise_cells
from kvcourse.instructor.notebook import cell_source, is_solution

BOOK = Path(__file__).resolve().parents[1] / "book"
CHAPTERS = sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))
_NOTEBOOKS = {path.name: json.loads(path.read_text()) for path in CHAPTERS}
_LABELS = [(name, e.label) for name, nb in _NOTEBOOKS.items() for e in find_exercises(nb)]


def _check_call(source: str) -> tuple[str, tuple[str, ...]]:
    """The check a solution cell calls (``chNN.check_x``) and the names it passes, ``model`` as MODEL."""
    calls = [node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr.startswith("check_")
             and isinstance(node.func.value, ast.Name)]
    assert len(calls) == 1, f"expected one check call, found {len(calls)}"
    call = calls[0]
    names = tuple(MODEL if a.id == "model" else a.id for a in call.args if isinstance(a, ast.Name))
    assert len(names) == len(call.args) and not call.keywords, "the check is called with names only"
    return f"{call.func.value.id}.{call.func.attr}", names


def test_every_exercise_of_every_chapter_has_an_entry_and_every_entry_an_exercise():
    in_book = {label for _, label in _LABELS}
    assert len(in_book) == len(_LABELS), "exercise labels are unique across the book"
    assert in_book - EXERCISES.keys() == set(), "exercises the grader cannot grade"
    assert EXERCISES.keys() - in_book == set(), "catalog entries for exercises the book no longer has"
    with pytest.raises(KeyError, match="ch99-ex-none"):
        spec_for("ch99-ex-none")


@pytest.mark.parametrize("chapter,label", _LABELS, ids=[label for _, label in _LABELS])
def test_the_entry_is_the_check_and_names_the_reference_solution_uses(chapter, label):
    nb = _NOTEBOOKS[chapter]
    exercise = next(e for e in find_exercises(nb) if e.label == label)
    (solution,) = [i for i in exercise.code_cells if is_solution(nb["cells"][i])]
    check, names = _check_call(cell_source(nb["cells"][solution]))
    spec = EXERCISES[label]
    assert (spec.check, spec.args) == (check, names)
    assert callable(load_check(spec))
    for used in spec.uses:
        assert EXERCISES[used].chapter == spec.chapter


def test_references_are_read_from_the_checks_source():
    import kvcourse
    from kvcourse.exercises import ch01, ch04

    assert references_of(ch01.check_attention) == [["kvcourse.kernels.reference", "causal_attention"],
                                                   ["kvcourse.kernels.reference", "decode_attention_ref"]]
    assert references_of(ch04.check_block_manager) == [["kvcourse.paged.block_manager", "BlockManager"]]
    assert references_of(ch01.check_causal_mask) == []
    assert kvcourse.causal_attention.__module__ == "kvcourse.kernels.reference"


def _graded(nb: dict, label: str):
    return grade_exercise(EXERCISES[label], exercise_cells(nb, label), timeout=600)


@pytest.mark.parametrize("chapter,label", _LABELS, ids=[label for _, label in _LABELS])
def test_reference_solution_passes_through_the_clean_process(chapter, label):
    verdict = _graded(_NOTEBOOKS[chapter], label)
    assert verdict.passed, verdict.message


@pytest.mark.parametrize("chapter", list(_NOTEBOOKS))
def test_untouched_student_copy_fails_every_exercise(chapter):
    student = student_copy(_NOTEBOOKS[chapter])
    for exercise in find_exercises(student):
        verdict = _graded(student, exercise.label)
        assert not verdict.passed and ("NotImplementedError" in verdict.message or "not written yet" in verdict.message), \
            (exercise.label, verdict.message)
