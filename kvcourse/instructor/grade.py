"""Grade submitted notebooks: every exercise by its own check, out of the student's reach.

For each submitted notebook:

1. The notebook runs headless, top to bottom, in a fresh kernel (nbclient), with its folder as
   working directory and errors allowed, within ``timeout`` seconds. This is the student's notebook
   as they handed it in; what it prints or raises goes into their report as notes. No verdict is read
   from this kernel: nothing the notebook does there (patching kvcourse, a check, a log) counts.
2. Every exercise the chapter has is graded on its own (:mod:`.checker`): the catalog
   (:mod:`kvcourse.exercises.catalog`) names its check and the names the solution defines; the
   chapter's ``import`` lines, the cells of the exercises it builds on and the exercise's own cells
   (the solution cell last) run in a fresh sandbox process where the checks and the exercise's
   references are out of reach, and the check runs in the grader's process on what they defined.

One :class:`Row` per notebook and exercise: passed, and a message (the check's case, expected, got
and hint; what the solution cell raised; or why the notebook could not be graded). A notebook that
cannot be read or is missing gets rows saying so; grading never stops at a bad notebook.
"""

from __future__ import annotations

import ast
import copy
import csv
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..exercises.catalog import EXERCISES
from .notebook import Exercise, cell_source, find_exercises

__all__ = [
    "Row",
    "NotebookResult",
    "grade_notebook",
    "grade_directory",
    "write_csv",
    "exercise_cells",
    "rows_of",
    "submissions",
    "notebooks_under",
    "chapter_names",
    "default_jobs",
    "thread_budget",
    "budget_threads",
    "finite_seconds",
]

_WORKER_BYTES = 4 * 2**30  # a grading worker: its notebook's kernel, the checker, a sandbox server (model in each)


@dataclass
class Row:
    notebook: str
    exercise: str
    passed: bool
    message: str
    case: str = ""
    expected: str = ""
    got: str = ""
    hint: str = ""
    seconds: float = 0.0  # the check's time, its sandbox included


@dataclass
class NotebookResult:
    """One submitted notebook: its rows, notes from running it top to bottom, and how long that took."""

    notebook: str
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    run_seconds: float = 0.0  # running the notebook top to bottom (0: not run)


def _one_line(text: str, limit: int = 600) -> str:
    text = " / ".join(line.strip() for line in text.strip().splitlines() if line.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _cell_error(cell: dict) -> str | None:
    for output in cell.get("outputs", []):
        if output.get("output_type") == "error":
            return f"{output.get('ename')}: {output.get('evalue')}"
    return None


def thread_budget(jobs: int) -> int:
    """Threads for each notebook's kernel and each worker's checks: the cores shared among the ``jobs``."""
    return max(1, (os.cpu_count() or 1) // max(1, jobs))


def budget_threads(threads: int) -> None:
    """Hold this process's torch, and the kernels it starts, to ``threads`` threads that wait passively.

    Two notebooks side by side, each with OpenMP's default busy-waiting threads on every core, starve
    each other: chapters 6 and 7 graded together did not finish in 25 minutes, and took 202 s with
    one passive thread each. A value the instructor set in the environment is kept.
    """
    import torch

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(name, str(threads))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]) if os.environ["OMP_NUM_THREADS"].isdigit() else threads)


def _isolated_kernels(private: str, readable: list[str]):
    """A kernel manager whose kernels run under bwrap (:mod:`.isolation`): ``private`` is all they may write."""
    from jupyter_client import AsyncKernelManager

    from .isolation import command, private_env

    home = os.path.join(private, "home")
    os.mkdir(home)
    # Matplotlib builds its font list in a config folder it has not seen (about a second per kernel): the
    # kernel's starts from a copy of the grader's.
    import glob
    import shutil

    fonts = os.environ.get("MPLCONFIGDIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser(os.path.join("~", ".cache")), "matplotlib"
    )
    for found in glob.glob(os.path.join(fonts, "fontlist-*.json")):
        shutil.copy(found, home)

    class IsolatedKernelManager(AsyncKernelManager):
        def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
            return command(super().format_kernel_cmd(extra_arguments), [private], private_env(home), readable)

    return IsolatedKernelManager


def _run(nb, path: Path, timeout: float, isolation: bool) -> list[str]:
    """Execute ``nb`` in place, cell by cell (none added, none overwritten); notes on what went wrong.

    ``isolation``: the kernel sees the file system read-only but for a private folder (:mod:`.isolation`)."""
    import tempfile
    import time

    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from traitlets.config import Config

    # The kernel talks over Unix sockets in a private folder, not TCP on localhost: nothing else on the
    # machine can connect, the kernel prints no warning about unencrypted TCP into the grader's terminal,
    # and an isolated kernel, which has no network, can still answer.
    sockets = tempfile.TemporaryDirectory(prefix="kvcourse-kernel-")
    config = Config()
    config.KernelManager.transport = "ipc"
    config.KernelManager.ip = os.path.join(sockets.name, "kernel")
    config.KernelManager.connection_file = os.path.join(sockets.name, "kernel.json")  # readable inside
    folder = str(path.parent.resolve())
    kernels = {"kernel_manager_class": _isolated_kernels(sockets.name, [folder])} if isolation else {}
    client = NotebookClient(
        nb,
        timeout=int(timeout),
        kernel_name="python3",
        allow_errors=True,
        config=config,
        resources={"metadata": {"path": folder}},
        **kernels,
    )
    deadline = time.monotonic() + timeout
    index = -1
    notes: list[str] = []
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise CellTimeoutError(f"no time left before cell {index}")
                client.timeout = max(1, int(remaining))
                client.execute_cell(cell, index)
    except CellTimeoutError:
        notes.append(f"the notebook ran longer than {timeout:g} s and was stopped in cell {index}")
    except DeadKernelError:
        notes.append(f"the kernel died in cell {index}")
    except Exception as exc:  # the kernel did not start, or nbclient failed: say so, grade the exercises anyway
        notes.append(f"the notebook could not run: {type(exc).__name__}: {_one_line(str(exc), 200)}")
    finally:
        sockets.cleanup()
    errors = [(i, e) for i, c in enumerate(nb.cells) if c.cell_type == "code" and (e := _cell_error(c))]
    for i, error in errors[:5]:
        notes.append(f"cell {i} raised {_one_line(error, 300)}")
    if len(errors) > 5:
        notes.append(f"... and {len(errors) - 5} more cells raised errors")
    return notes


def _imports(nb: dict, skip: set[int]) -> str:
    """The notebook's top-level ``import`` statements, outside the cells in ``skip``, in order."""
    from .sandbox import _python

    lines = []
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code" or index in skip:
            continue
        try:
            tree = ast.parse(_python(cell_source(cell)))
        except SyntaxError:
            continue
        lines += [ast.unparse(node) for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]
    return "\n".join(dict.fromkeys(lines)) + "\n"


def _is_answer(cell: dict) -> bool:
    tags = cell.get("metadata", {}).get("tags", [])
    return cell.get("cell_type") == "code" and ("solution" in tags or "exercise-answer" in tags)


def exercise_cells(nb: dict, label: str, exercises: list[Exercise] | None = None) -> list[list[str]]:
    """What the sandbox runs for exercise ``label`` of ``nb``: ``[kind, name, source]``, the solution last.

    Kinds: ``context`` (the chapter's imports, the catalog's setup), ``uses`` (cells of the exercises
    this one builds on), ``given`` (the exercise's other cells) and ``solution`` (the cell tagged
    ``solution`` or, in a student copy, ``exercise-answer``; else the exercise's last code cell).
    Only a failure of the solution cell fails the exercise.
    """
    spec = EXERCISES[label]
    exercises = find_exercises(nb) if exercises is None else exercises
    by_label = _first_of_each(exercises)
    in_exercises = {i for e in exercises for i in e.code_cells}
    cells = [["context", "chapter imports", _imports(nb, in_exercises)]]
    if spec.setup:
        cells.append(["context", "catalog setup", spec.setup])
    for used in spec.uses:
        if used in by_label:
            cells += [["uses", f"{used} cell {i}", cell_source(nb["cells"][i])] for i in by_label[used].code_cells]
    own = by_label[label].code_cells
    answers = [i for i in own if _is_answer(nb["cells"][i])] or own[-1:]
    for i in own:
        kind = "solution" if i == answers[-1] else "given"
        cells.append([kind, f"{label} cell {i}", cell_source(nb["cells"][i])])
    return cells


def chapter_names(nb: dict, label: str, exercises: list[Exercise] | None = None) -> dict[str, str]:
    """Where the chapter defines each top-level name that grading exercise ``label`` does not run.

    name -> "a variable of the chapter's cell N (`its first line`), which the grader does not run ...": the
    sandbox stops the solution cell at a follow-up line that needs one (:func:`.sandbox._run_cells`), and the
    checker names the cell when the answer itself needs one. The exercise's own cells are left out (they run).
    """
    from .sandbox import _python

    exercises = find_exercises(nb) if exercises is None else exercises
    by_label = _first_of_each(exercises)
    spec = EXERCISES.get(label)
    ran = set(by_label[label].code_cells) if label in by_label else set()
    for used in spec.uses if spec else ():
        if used in by_label:
            ran |= set(by_label[used].code_cells)
    owner = {i: e.label for e in exercises for i in e.code_cells}
    found: dict[str, str] = {}
    for index, cell in enumerate(nb["cells"]):
        if cell.get("cell_type") != "code" or index in ran:
            continue
        try:
            tree = ast.parse(_python(cell_source(cell)))
        except (SyntaxError, ValueError):
            continue
        where = f"cell {index}" + (f", the answer of {owner[index]}" if index in owner else "")
        for statement in tree.body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                continue  # the chapter's imports run with every exercise
            first = ast.get_source_segment(_python(cell_source(cell)), statement) or ""
            first = first.splitlines()[0] if first else ""
            first = first if len(first) <= 80 else first[:77] + "..."
            for name in _bound_names(statement):
                found.setdefault(
                    name,
                    f"a variable of the chapter's {where} (`{first}`), which the grader does not "
                    "run with this exercise.",
                )
    return found


def _bound_names(statement: ast.stmt) -> list[str]:
    """The names a top-level statement binds (not those bound inside the functions and classes it defines)."""
    if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [statement.name]
    names: list[str] = []
    stack: list[ast.AST] = [statement]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            continue
        if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.append(node.id)
        stack.extend(ast.iter_child_nodes(node))
    return names


def _first_of_each(exercises: list[Exercise]) -> dict[str, Exercise]:
    """Each label's first exercise (a label written twice is graded once, the first time, and reported)."""
    by_label: dict[str, Exercise] = {}
    for e in exercises:
        by_label.setdefault(e.label, e)
    return by_label


def grade_notebook(
    path: Path,
    name: str | None = None,
    timeout: float = 1800,
    expected: list[str] | None = None,
    run: bool = True,
    check_timeout: float = 300,
    threads: int | None = None,
    isolation: bool | None = None,
) -> NotebookResult:
    """Run and grade one submitted notebook. ``expected``: the exercise labels the reference chapter has.

    ``threads``: this worker's share of the cores (:func:`thread_budget`), for the notebook's kernel and the checks.
    ``isolation``: the kernel and the sandboxes see the file system read-only but for private folders
    (:mod:`.isolation`; None: its ``DEFAULT``, on); where that cannot be had, :class:`.isolation.IsolationUnavailable`.
    """
    import time

    import nbformat

    from .checker import grade_exercise
    from .isolation import require

    isolation = require(isolation)

    if threads is not None:
        budget_threads(threads)
    from .integrity import load_checks

    load_checks()  # the checks in effect are those imported now, before this notebook's code runs
    name = name or path.name
    try:
        nb = nbformat.read(path, as_version=4)
        exercises = find_exercises(nb)
    except Exception as exc:
        reason = f"could not read the notebook: {type(exc).__name__}: {_one_line(str(exc), 200)}"
        return NotebookResult(name, [Row(name, label, False, reason) for label in expected or ["(notebook)"]])
    labels = expected if expected is not None else [e.label for e in exercises]
    if not labels:
        return NotebookResult(name, [Row(name, "(notebook)", False, "no exercises found in the notebook")])
    submitted = copy.deepcopy(nb)  # what the clean processes run: the cells as handed in
    start = time.perf_counter()
    notes = _run(nb, path, timeout, isolation) if run else []
    run_seconds = time.perf_counter() - start if run else 0.0
    by_label = _first_of_each(exercises)
    counts = Counter(e.label for e in exercises)
    notes += [
        f"exercise {label} appears {n} times in the notebook: the first one was graded"
        for label, n in counts.items()
        if n > 1
    ]
    rows = []
    for label in labels:
        if label not in by_label:
            rows.append(Row(name, label, False, "this exercise is missing from the notebook"))
        elif label not in EXERCISES:
            rows.append(
                Row(
                    name,
                    label,
                    False,
                    "no check is registered for this exercise in kvcourse.exercises.catalog: tell your instructor",
                )
            )
        else:
            start = time.perf_counter()
            verdict = grade_exercise(
                EXERCISES[label],
                exercise_cells(submitted, label, exercises),
                check_timeout,
                chapter_names(submitted, label, exercises),
                isolation=isolation,
            )
            message = "ok" if verdict.passed else _one_line(verdict.message)
            rows.append(
                Row(
                    name,
                    label,
                    verdict.passed,
                    message,
                    verdict.case,
                    verdict.expected,
                    verdict.got,
                    verdict.hint,
                    time.perf_counter() - start,
                )
            )
    return NotebookResult(name, rows, notes, run_seconds)


def submissions(directory: Path) -> list[Path]:
    """The folders that hold one submission each: ``directory`` itself, or each of its subfolders."""
    if any(p.suffix == ".ipynb" for p in directory.iterdir() if p.is_file()):
        return [directory]
    return sorted(p for p in directory.iterdir() if p.is_dir() and not p.name.startswith("."))


def notebooks_under(directory: Path) -> list[Path]:
    return sorted(
        p
        for p in directory.rglob("*.ipynb")
        if ".ipynb_checkpoints" not in p.parts
        and not any(part.startswith(".") for part in p.relative_to(directory).parts)
    )


def default_jobs(tasks: int) -> int:
    """Notebooks graded side by side: one per CPU core, as many as memory holds (about 4 GiB each)."""
    available = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = dict(line.split(":", 1) for line in f)
        available = int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        pass
    by_memory = max(1, available // _WORKER_BYTES) if available else 1
    return max(1, min(os.cpu_count() or 1, by_memory, tasks))


def grade_directory(
    directory: Path,
    book: Path | None = None,
    timeout: float = 1800,
    jobs: int | None = None,
    run: bool = True,
    check_timeout: float = 300,
    progress: bool = False,
    chapters: list[str] | None = None,
    isolation: bool | None = None,
) -> list[NotebookResult]:
    """Grade every submission under ``directory`` against the reference list, ``jobs`` notebooks at a time.

    The list is every chapter of ``book`` (else of the course), or the ``chapters`` named (``["03"]``):
    each submission gets one row per exercise of it, whatever it handed in (:mod:`.chapters`).
    ``isolation``: see :func:`grade_notebook`; refused before any notebook runs where it cannot be had.
    """
    import warnings

    from tqdm import tqdm

    from . import integrity
    from .chapters import assign, reference_chapters
    from .isolation import require

    isolation = require(isolation)
    reference = reference_chapters(book, chapters)
    integrity.load_checks()
    installed = integrity.snapshot()  # before any student code runs: compared after every notebook
    tampered = integrity.unrecorded_changes(installed, integrity.recorded_hashes())
    if tampered:
        raise integrity.InstallationChanged(
            f"kvcourse's files differ from what its installer recorded: {', '.join(tampered)}. "
            "Reinstall kvcourse before grading."
        )
    writable = [] if isolation else integrity.writable_installation()  # isolated, graded code cannot write there
    if writable:
        shown = ", ".join(writable[:3]) + (f" and {len(writable) - 3} more" if len(writable) > 3 else "")
        warnings.warn(
            f"kvcourse is installed where the graded code could write ({shown} in {integrity.package_dir()}): "
            "grade as a user who cannot write there, or in a throwaway container; the grader stops if "
            "the files change",
            RuntimeWarning,
            stacklevel=2,
        )
    tasks: list[tuple[Path, str, list[str] | None]] = []
    extra: dict[str, list[str]] = {}  # notes for a graded notebook: the copies of its chapter that were not
    untouched: list[NotebookResult] = []  # chapters nobody handed in, notebooks that are no chapter
    for folder in submissions(directory):
        found = assign(folder, notebooks_under(folder), reference)
        rel = lambda p: p.relative_to(directory).as_posix()  # noqa: E731
        for number, path in found.graded.items():
            tasks.append((path, rel(path), list(reference[number].labels)))
            if number in found.duplicates:
                copies = ", ".join(rel(p) for p in found.duplicates[number])
                extra[rel(path)] = [
                    f"chapter {number} was handed in more than once: graded {rel(path)}; not graded: {copies}"
                ]
        for number in found.missing:
            name = rel(folder / reference[number].notebook)
            missing = "notebook missing from the submission"
            untouched.append(
                NotebookResult(name, [Row(name, label, False, missing) for label in reference[number].labels])
            )
        for path in found.strays:
            note = f"not graded: {path.name} is no chapter of the course (chapters {', '.join(reference)})"
            untouched.append(NotebookResult(rel(path), [], [note]))
    jobs = default_jobs(len(tasks)) if jobs is None else max(1, min(jobs, len(tasks) or 1))
    threads = thread_budget(jobs)
    results: dict[str, NotebookResult] = {}
    settings = (run, check_timeout, threads, isolation)  # grade_notebook's last arguments, the same for every notebook
    bar = tqdm(
        total=len(tasks), unit="notebook", desc="grading", file=sys.stderr, dynamic_ncols=True, disable=not progress
    )

    def verify(name: str) -> None:
        touched = integrity.changed(installed)
        if touched:
            raise integrity.InstallationChanged(
                f"kvcourse's files changed while {name} was graded{'' if jobs == 1 else ' (with others side by side)'}: "
                f"{', '.join(touched)}. Graded code wrote into the installation; reinstall kvcourse before grading "
                "again, as a user who cannot write there."
            )

    if jobs == 1:
        for path, name, expected in tasks:
            results[name] = grade_notebook(path, name, timeout, expected, *settings)
            verify(name)
            bar.update(1)
    else:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {
                pool.submit(grade_notebook, path, name, timeout, expected, *settings): (name, expected)
                for path, name, expected in tasks
            }
            for future in as_completed(futures):
                name, expected = futures[future]
                try:
                    results[name] = future.result()
                except Exception as exc:  # a worker died: its notebook gets rows saying so
                    reason = f"grading failed: {type(exc).__name__}: {exc}"
                    results[name] = NotebookResult(
                        name, [Row(name, label, False, reason) for label in expected or ["(notebook)"]]
                    )
                try:
                    verify(name)
                except Exception:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
                bar.update(1)
    bar.close()
    for name, notes in extra.items():
        results[name].notes += notes
    ordered = [results[name] for _, name, _ in tasks] + untouched
    return sorted(ordered, key=lambda r: r.notebook)


def rows_of(results: list[NotebookResult]) -> list[Row]:
    return [row for result in results for row in result.rows]


def write_csv(rows: list[Row], out: Path, run_seconds: dict[str, float] | None = None) -> None:
    """One line per row; ``check_s``: the exercise's check, ``notebook_s``: running its notebook (``run_seconds``)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    run_seconds = run_seconds or {}
    with out.open("w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["notebook", "exercise", "passed", "message", "check_s", "notebook_s"])
        for row in rows:
            notebook_s = run_seconds.get(row.notebook, 0.0)
            writer.writerow(
                [row.notebook, row.exercise, int(row.passed), row.message, f"{row.seconds:.1f}", f"{notebook_s:.1f}"]
            )


def finite_seconds(text: str) -> float:
    """argparse type: a finite, positive number of seconds."""
    import argparse

    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite, positive number of seconds, got {text!r}")
    return value
