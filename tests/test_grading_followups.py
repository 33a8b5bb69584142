"""Honest work is credited (issue 47, item 1): an answer cell that also does the exercise's follow-up.

Several exercises ask for a function, then a follow-up with the chapter's own numbers ("Then: with this
machine's fit..."). The grader runs the answer cell alone, with the chapter's imports, so those numbers
(``fixed_ms``, ``H100``...) are not there. The boundary: the answer cell runs one statement at a time and
stops, without failing, at the first line that needs a variable of a chapter cell the grader does not run;
what the cell defined before is graded. When the answer itself needs such a variable, the feedback names
the chapter cell it comes from and says what to move.
"""

from __future__ import annotations

import json
from pathlib import Path

import nbformat
import pytest

from kvcourse.instructor import find_exercises, grade_notebook
from kvcourse.instructor.notebook import is_solution

BOOK = Path(__file__).resolve().parents[1] / "book"

# Each answer as a learner writes it: the function, the check, then the follow-up in the same cell.
_KV_BYTES = (
    "def kv_bytes(seq_lens, num_kv_heads, head_dim, bytes_per_value):\n"
    "    return 2 * sum(seq_lens) * num_kv_heads * head_dim * bytes_per_value\n\n"
    "ch05.check_kv_bytes(kv_bytes)\n"
)
_KV_BYTES_FOLLOW_UP = (
    "step_bytes = 32 * kv_bytes([4096] * 32, 8, 128, 2)\n"
    "print(f'{step_bytes / 1e9:.1f} GB, at least {step_bytes / H100.bandwidth * 1e3:.2f} ms')\n"
)
_CHUNK = (
    "def chunk_size(fixed_ms, per_token_ms, num_decodes, tpot_ms):\n"
    "    return max(0, int((tpot_ms - fixed_ms) // per_token_ms) - num_decodes)\n\n"
    "ch06.check_chunk_size(chunk_size)\n"
)
_CHUNK_FOLLOW_UP = (
    "chunk = chunk_size(fixed_ms, per_token_ms, 8, 3 * fixed_ms)\nprint(chunk, math.ceil(1024 / chunk), 'steps')\n"
)
_PREDICT = (
    "def predict_ttft(prompt_len, num_decodes, budget, fixed_ms, per_token_ms):\n"
    "    chunk = budget - num_decodes\n"
    "    steps = math.ceil(prompt_len / chunk)\n"
    "    return steps, steps * fixed_ms + per_token_ms * (prompt_len + steps * num_decodes)\n\n"
    "ch06.check_predicted_ttft(predict_ttft)\n"
)
_PREDICT_FOLLOW_UP = (
    "steps, ms = predict_ttft(1024, 4, 128, fixed_ms, per_token_ms)\n"
    "print(steps, ms / 1e3, 'predicted s, measured', ttft_long_c)\n"
)
LEARNER = {
    "ch05-ex-bytes": ("05_triton_kernels.ipynb", _KV_BYTES + _KV_BYTES_FOLLOW_UP),
    "ch06-ex-chunk": ("06_serving.ipynb", _CHUNK + _CHUNK_FOLLOW_UP),
    "ch06-ex-predict": ("06_serving.ipynb", _PREDICT + _PREDICT_FOLLOW_UP),
}


def _chapter(name: str) -> dict:
    return json.loads((BOOK / name).read_text())


def _answer(nb: dict, label: str, source: str) -> None:
    """Put ``source`` in exercise ``label``'s answer cell, as a learner's notebook has it."""
    exercise = next(e for e in find_exercises(nb) if e.label == label)
    (index,) = [i for i in exercise.code_cells if is_solution(nb["cells"][i])]
    nb["cells"][index]["source"] = source


def _grade(tmp_path: Path, nb: dict, name: str, labels: list[str]):
    path = tmp_path / name
    nbformat.write(nbformat.from_dict(nb), path)
    return grade_notebook(path, expected=labels, run=False)


@pytest.mark.parametrize("label", list(LEARNER))
def test_an_answer_with_its_follow_up_in_the_answer_cell_scores_full_marks(tmp_path, label):
    name, source = LEARNER[label]
    nb = _chapter(name)
    _answer(nb, label, source)
    (row,) = _grade(tmp_path, nb, name, [label]).rows
    assert row.passed, row.message


def test_an_answer_written_after_its_follow_up_is_told_which_line_and_what_to_move(tmp_path):
    nb = _chapter("06_serving.ipynb")
    _answer(nb, "ch06-ex-chunk", "tpot_ms = 3 * fixed_ms\n" + _CHUNK)
    (row,) = _grade(tmp_path, nb, "06_serving.ipynb", ["ch06-ex-chunk"]).rows
    assert not row.passed
    message = row.message
    assert "does not define `chunk_size`" in message, message
    assert "stopped your solution cell at line 1, which uses `fixed_ms`" in message, message
    assert "per_token_ms, fixed_ms = np.polyfit(tokens, times, 1)" in message, message  # the chapter's line
    assert "define `chunk_size` above it" in message, message


def test_an_answer_that_needs_a_chapter_variable_is_told_where_it_comes_from(tmp_path):
    nb = _chapter("05_triton_kernels.ipynb")
    _answer(nb, "ch05-ex-bytes", (
        "def kv_bytes(seq_lens, num_kv_heads, head_dim, bytes_per_value):\n"
        "    scale = H100.bandwidth / H100.bandwidth  # a chapter variable inside the answer\n"
        "    return int(2 * sum(seq_lens) * num_kv_heads * head_dim * bytes_per_value * scale)\n\n"
        "ch05.check_kv_bytes(kv_bytes)\n"))  # fmt: skip
    (row,) = _grade(tmp_path, nb, "05_triton_kernels.ipynb", ["ch05-ex-bytes"]).rows
    assert not row.passed
    assert "name 'H100' is not defined" in row.message, row.message
    assert "`H100` is a variable of the chapter's cell" in row.message, row.message
    assert 'H100 = GPU_PEAKS["H100-SXM"]' in row.message, row.message
    assert "inside the answer cell" in row.message and "inside the answer cell" in row.hint


def test_a_name_no_chapter_cell_defines_still_fails_as_before(tmp_path):
    nb = _chapter("06_serving.ipynb")
    _answer(nb, "ch06-ex-chunk", _CHUNK + "print(no_such_name)\n")
    (row,) = _grade(tmp_path, nb, "06_serving.ipynb", ["ch06-ex-chunk"]).rows
    assert not row.passed and "raised NameError at line 5: name 'no_such_name' is not defined" in row.message


# ---- the "done when": a learner's honest run through a whole chapter scores full marks -----------
@pytest.mark.parametrize("name", ["05_triton_kernels.ipynb", "06_serving.ipynb"])
def test_a_learners_honest_chapter_with_its_follow_ups_scores_full_marks(tmp_path, name):
    nb = _chapter(name)
    labels = [e.label for e in find_exercises(nb)]
    for label, (chapter, source) in LEARNER.items():
        if chapter == name:
            _answer(nb, label, source)
    result = _grade(tmp_path, nb, name, labels)
    assert [(r.exercise, r.passed, r.message) for r in result.rows] == [(label, True, "ok") for label in labels]
