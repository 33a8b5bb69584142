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
    calls = [
        node
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr.startswith("check_")
        and isinstance(node.func.value, ast.Name)
    ]
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

    assert references_of(ch01.check_attention) == [
        ["kvcourse.kernels.reference", "causal_attention"],
        ["kvcourse.kernels.reference", "decode_attention_ref"],
    ]
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
        assert not verdict.passed and (
            "NotImplementedError" in verdict.message or "not written yet" in verdict.message
        ), (exercise.label, verdict.message)


# ---- answers written the natural way: reusing the chapter's earlier answers and data (issue 36, item 8) ----
_NATURAL = {
    "ch03-ex-per-rank": (
        "def bytes_per_rank(config, seq_len, tp_size, bytes_per_value):\n"
        "    if 'kv_lora_rank' in config:\n"
        "        latent = config['kv_lora_rank'] + config['qk_rope_head_dim']\n"
        "        return config['num_hidden_layers'] * latent * seq_len * bytes_per_value\n"
        "    kv_heads = config['num_key_value_heads']\n"
        "    per_head = bytes_per_token(config, bytes_per_value) // kv_heads  # the earlier answer, per head\n"
        "    return per_head * max(1, kv_heads // tp_size) * seq_len\n\n"
        "ch03.check_bytes_per_rank(bytes_per_rank)\n"
    ),
    "ch03-ex-fit": (
        "def max_sequences(config, num_parameters, seq_len, gpu_bytes, weight_bytes_per_value, kv_bytes_per_value,\n"
        "                  utilization=0.9):\n"
        "    budget = utilization * gpu_bytes - weight_bytes_per_value * num_parameters\n"
        "    per_seq = bytes_per_token(config, kv_bytes_per_value) * seq_len  # the earlier answer\n"
        "    return max(0, int(budget // per_seq))\n\n"
        "ch03.check_max_sequences(max_sequences)\n"
        "qwen = CATALOG['qwen2.5-7b']\n"
        "print(max_sequences(qwen.config, qwen.num_parameters, 32768, gpus['80 GB (A100, H100)'], 2, 1))  # the card\n"
    ),
    "ch07-ex-lookup": (
        "def find_longest_cache_hit(token_ids, block_size, cache_salt, hash_fn, get_cached_block):\n"
        "    hits = []\n"
        "    for h in block_hashes(token_ids[:-1], block_size, cache_salt, hash_fn):  # the earlier answer\n"
        "        block = get_cached_block(h)\n"
        "        if block is None:\n"
        "            break\n"
        "        hits.append(block)\n"
        "    return hits\n\n"
        "ch07.check_prefix_lookup(find_longest_cache_hit, model)\n"
    ),
}


def _with_solution(label: str, source: str) -> tuple[str, dict]:
    chapter = next(name for name, lab in _LABELS if lab == label)
    nb = json.loads(json.dumps(_NOTEBOOKS[chapter]))
    exercise = next(e for e in find_exercises(nb) if e.label == label)
    (solution,) = [i for i in exercise.code_cells if is_solution(nb["cells"][i])]
    nb["cells"][solution]["source"] = source
    return chapter, nb


@pytest.mark.parametrize("label", list(_NATURAL))
def test_an_answer_reusing_the_chapters_earlier_answers_and_data_passes(label):
    import dataclasses

    _, nb = _with_solution(label, _NATURAL[label])
    verdict = _graded(nb, label)
    assert verdict.passed, verdict.message
    # what made it pass: the catalog's uses / setup (without them the answer meets a NameError, as it once did)
    bare = dataclasses.replace(EXERCISES[label], uses=(), setup="")
    cells = [c for c in exercise_cells(nb, label) if c[0] != "uses" and c[1] != "catalog setup"]
    verdict = grade_exercise(bare, cells, timeout=600)
    assert not verdict.passed and "NameError" in verdict.message, verdict.message


def test_a_catalog_setup_line_is_the_chapters_own():
    # setup recreates what a solution reads from the chapter: each line is in the chapter, word for word
    for label, spec in EXERCISES.items():
        if not spec.setup or label.startswith("ch01"):  # chapter 1's prompt is rebuilt from its text, not a cell
            continue
        chapter = next(name for name, lab in _LABELS if lab == label)
        code = "\n".join(cell_source(c) for c in _NOTEBOOKS[chapter]["cells"] if c["cell_type"] == "code")
        for line in spec.setup.strip().splitlines():
            assert line in code, (label, line)
