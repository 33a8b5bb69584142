"""What a Colab learner gets from "Run all": reader copies and a student copy, executed as published.

The copies are made the way `make published` makes them and run top to bottom in a fresh kernel, offline
(their setup cell installs nothing outside Colab; kvcourse and its committed results come from this checkout's
package). Two reader copies (chapters 1 and 3, the quickest) and one student copy (chapter 3: value and function
stubs) keep this under a few minutes.
"""

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from kvcourse.instructor.__main__ import main as instructor
from kvcourse.tools.reader_copies import main as reader_copies

ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
READERS = ["01_naive_generation.ipynb", "03_memory.ipynb"]
STUDENT = "03_memory.ipynb"
# What "Out:" shows for a glued value or a check's verdict: a bare quoted string, a number, True/False.
BARE = re.compile(r"""^(True|False|None|-?[\d.,]+%?|'[^'\n]*'|"[^"\n]*")$""")


def _run(path: Path) -> nbformat.NotebookNode:
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=600, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    return nb


def _bare_values(nb) -> list[str]:
    return [o["data"]["text/plain"] for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "execute_result" and BARE.match(o["data"].get("text/plain", "").strip())]  # fmt: skip


def _errors(nb) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for c in nb.cells if c.cell_type == "code" for o in c.outputs
            if o.output_type == "error"]  # fmt: skip


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    out = tmp_path_factory.mktemp("published")
    reader_copies([str(BOOK / name) for name in READERS] + ["--out", str(out / "book"), "--ref", "test"])
    assert instructor(["student", str(BOOK), "--out", str(out / "student-src")]) == 0
    reader_copies(
        [str(out / "student-src" / STUDENT), "--out", str(out / "exercises"), "--glue-from", str(BOOK), "--ref", "test"]
    )
    return out


@pytest.mark.parametrize("name", READERS)
def test_a_reader_copy_runs_clean_with_no_bare_values(published, name):
    nb = _run(published / "book" / name)
    assert _errors(nb) == []
    assert _bare_values(nb) == [], "cells that echo a bare value (a glue call's or a check's return?)"
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")


def test_a_student_copy_runs_to_its_last_cell_reporting_every_exercise(published):
    nb = _run(published / "exercises" / STUDENT)
    assert _errors(nb) == [] and _bare_values(nb) == []
    assert all(c.execution_count is not None for c in nb.cells if c.cell_type == "code")  # "Run all" got to the end
    stubs = [c for c in nb.cells if c.cell_type == "code" and "exercise-answer" in c.metadata.get("tags", [])]
    assert len(stubs) >= 4
    for stub in stubs:
        said = "".join(o.get("text", "") for o in stub.outputs if o.output_type == "stream")
        assert said.startswith("Not done yet:"), (stub.source[:200], said)
