"""Grade submitted notebooks: run each one headless, read every check's verdict, write a CSV.

Each notebook runs in a fresh kernel (nbclient), cell by cell, with the notebook's folder as working
directory, errors allowed (a failed exercise must not stop the others) and one time limit for the
whole notebook. Before the first cell the grader installs :mod:`.recorder`, so every call of a
chapter check is logged with its verdict; a verdict belongs to the exercise whose cells made it.

One row per notebook and exercise: ``notebook, exercise, passed, message``. An exercise passes when
the last check called in its cells passed. Otherwise the message is the check's (expected, got,
hint), or the error its cells raised (an untouched stub says ``NotImplementedError`` with its hint),
or that no check ran. A notebook that cannot be read, is missing, times out or kills its kernel
gets rows saying so; grading never stops at a bad notebook.
"""

from __future__ import annotations

import csv
import json
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .notebook import find_exercises

__all__ = ["Row", "grade_notebook", "grade_directory", "write_csv", "CHAPTER"]

CHAPTER = re.compile(r"^\d\d_.*\.ipynb$")  # the book's chapter notebooks: 01_naive_generation.ipynb, ...


@dataclass
class Row:
    notebook: str
    exercise: str
    passed: bool
    message: str


def _one_line(text: str, limit: int = 600) -> str:
    text = " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell_error(cell: dict) -> str | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            return f"{output.get('ename')}: {output.get('evalue')}"
    return None


def _run(nb, path: Path, log: Path, timeout: float) -> tuple[dict[int, list[dict]], str | None]:
    """Execute ``nb`` in place; return the check verdicts per cell index and a notebook-level problem."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    client = NotebookClient(nb, timeout=int(timeout), kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(path.parent.resolve())}})
    verdicts: dict[int, list[dict]] = {}
    deadline = time.monotonic() + timeout
    seen = 0
    index = -1
    try:
        with client.setup_kernel():
            setup = nbformat.v4.new_code_cell(
                f"from kvcourse.instructor.recorder import install as _kvcourse_install\n"
                f"_kvcourse_install({str(log)!r})\ndel _kvcourse_install")
            client.execute_cell(setup, 0, store_history=False)
            problem = _cell_error(setup)
            if problem:
                return verdicts, f"could not set up grading in the kernel ({problem})"
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CellTimeoutError(f"no time left before cell {index}")
                client.timeout = max(1, int(remaining))
                client.execute_cell(cell, index)
                lines = log.read_text(encoding="utf-8").splitlines() if log.exists() else []
                if len(lines) > seen:
                    verdicts[index] = [json.loads(line) for line in lines[seen:]]
                    seen = len(lines)
    except CellTimeoutError:
        return verdicts, f"timed out: the notebook ran longer than {timeout:g} s (stopped in cell {index})"
    except DeadKernelError:
        return verdicts, f"the kernel died in cell {index}"
    except Exception as exc:  # the kernel did not start, or nbclient failed: report it, keep grading
        return verdicts, f"could not run the notebook: {type(exc).__name__}: {exc}"
    return verdicts, None


def grade_notebook(path: Path, name: str | None = None, timeout: float = 1800,
                   expected: list[str] | None = None) -> list[Row]:
    """Rows for one submitted notebook. ``expected``: the exercise labels the reference chapter has."""
    import nbformat

    name = name or path.name
    try:
        nb = nbformat.read(path, as_version=4)
        exercises = find_exercises(nb)
    except Exception as exc:
        reason = f"could not read the notebook: {type(exc).__name__}: {_one_line(str(exc), 200)}"
        return [Row(name, label, False, reason) for label in expected or ["(notebook)"]]
    labels = expected if expected is not None else [e.label for e in exercises]
    if not labels:
        return [Row(name, "(notebook)", False, "no exercises found in the notebook")]
    with tempfile.TemporaryDirectory(prefix="kvcourse-grade-") as tmp:
        verdicts, problem = _run(nb, path, Path(tmp) / "checks.jsonl", timeout)
    by_label = {e.label: e for e in exercises}
    rows = []
    for label in labels:
        exercise = by_label.get(label)
        if exercise is None:
            rows.append(Row(name, label, False, "this exercise is missing from the notebook"))
            continue
        results = [v for i in exercise.code_cells for v in verdicts.get(i, [])]
        if results:
            last = results[-1]
            rows.append(Row(name, label, bool(last["passed"]), "ok" if last["passed"] else _one_line(last["message"])))
            continue
        errors = [e for i in exercise.code_cells if (e := _cell_error(nb.cells[i]))]
        if problem:
            message = problem
        elif errors:
            message = "no check ran; the cell raised " + _one_line(errors[0])
        else:
            message = "no check ran: call the exercise's check in its cell"
        rows.append(Row(name, label, False, message))
    return rows


def _submissions(directory: Path) -> list[Path]:
    """The folders that hold one submission each: ``directory`` itself, or each of its subfolders."""
    if any(p.suffix == ".ipynb" for p in directory.iterdir() if p.is_file()):
        return [directory]
    return sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def grade_directory(directory: Path, book: Path | None = None, timeout: float = 1800) -> list[Row]:
    """Grade every notebook under ``directory``; with ``book``, also report the chapters a submission lacks."""
    reference: dict[str, list[str]] = {}
    if book is not None:
        import nbformat

        for chapter in sorted(book.glob("*.ipynb")):
            labels = [e.label for e in find_exercises(nbformat.read(chapter, as_version=4))]
            if CHAPTER.match(chapter.name) and labels:
                reference[chapter.name] = labels
    rows: list[Row] = []
    for folder in _submissions(directory):
        notebooks = sorted(p for p in folder.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts)
        for path in notebooks:
            name = path.relative_to(directory).as_posix()
            print(f"grading {name} ...", flush=True)
            rows += grade_notebook(path, name, timeout, reference.get(path.name))
        present = {p.name for p in notebooks}
        for chapter, labels in reference.items():
            if chapter not in present:
                name = (folder / chapter).relative_to(directory).as_posix()
                rows += [Row(name, label, False, "notebook missing from the submission") for label in labels]
    return rows


def write_csv(rows: list[Row], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "exercise", "passed", "message"])
        for row in rows:
            writer.writerow([row.notebook, row.exercise, int(row.passed), row.message])
