"""The committed benchmark results that the book plots, shipped inside the package.

``make bench`` (and ``make gpu-check`` on a GPU) write JSON files here; ``benchmarks/results`` in the
repository is a link to this folder. Because they are package data, every chapter reads them offline
with :mod:`importlib.resources`, in a clone, on a laptop and on Colab alike (pip installs them with
the package), and a result committed later reaches learners with the next install: nothing is ever
fetched over the network.

:func:`gpu_check_notebook_runs` reads what the chapter headers quote as the time on a GPU. The files are
data: this package imports nothing of the package's own; the tools that check a kind of file import it
(:func:`kvcourse.bench.measured.check_result`, which ``tests/test_results.py`` runs on every committed file).
"""

from __future__ import annotations

import fnmatch
import json
from importlib import resources

__all__ = ["find", "gpu_check_notebook_runs", "load", "newest"]


def _folder():
    return resources.files(__name__)


def find(pattern: str = "*.json") -> list[str]:
    """Names of the committed result files matching ``pattern`` (a glob), sorted (dates sort in order)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty glob string, got {pattern!r}")
    return sorted(p.name for p in _folder().iterdir() if p.name.endswith(".json") and fnmatch.fnmatch(p.name, pattern))


def load(name: str) -> dict:
    """The JSON of one committed result file, by name (``find`` lists them)."""
    if not isinstance(name, str) or "/" in name or "\\" in name or not name.endswith(".json"):
        raise ValueError(f"name must be a result file's name ending in .json, got {name!r}")
    path = _folder() / name
    if not path.is_file():
        raise FileNotFoundError(f"no committed result {name!r} in kvcourse.results; there are: {', '.join(find())}")
    return json.loads(path.read_text(encoding="utf-8"))


def newest(pattern: str) -> str | None:
    """The last file name matching ``pattern`` (``cpu-serving-*.json``: the newest date), or None."""
    names = find(pattern)
    return names[-1] if names else None


def gpu_check_notebook_runs(data: dict, name: str) -> list[dict]:
    """Every notebook a gpu-check result ran: ``[{notebook, device, torch, date, seconds, passed, timed_out}]``.

    ``python -m kvcourse.gpu_check`` writes a top-level ``steps`` list, and the file's ``provenance`` names
    the GPU, torch and the date. A step that executed one chapter names it, ``"notebook":
    "05_triton_kernels.ipynb"``, with ``passed``, ``seconds`` (the job's), ``notebook_seconds`` (the
    notebook's own execution, preferred when present) and ``timed_out``; a step may instead list several,
    ``"notebooks": [{"notebook": ..., "passed": bool, "seconds": float}]``. Steps without either (the
    benchmark, the tests, a job the budget skipped) time no chapter. Anything malformed raises
    ``ValueError`` naming the file (``name``).
    """
    steps = data.get("steps") if isinstance(data, dict) else None
    if not isinstance(steps, list):
        raise ValueError(f"{name}: a gpu-check result needs a top-level list 'steps'")
    runs = []
    for i, step in enumerate(steps):
        if not isinstance(step, dict):
            raise ValueError(f"{name}: steps[{i}] must be a JSON object")
        if isinstance(step.get("notebook"), str):  # one chapter per step
            seconds = step.get("notebook_seconds", step.get("seconds"))
            entries = [dict(notebook=step["notebook"], passed=step.get("passed"), seconds=seconds,
                            timed_out=step.get("timed_out", False))]  # fmt: skip
        elif "notebooks" in step:
            if not isinstance(step["notebooks"], list):
                raise ValueError(f"{name}: steps[{i}]['notebooks'] must be a list of {{notebook, passed, seconds}}")
            entries = step["notebooks"]
        else:
            continue
        for run in entries:
            run = run if isinstance(run, dict) else {}
            notebook, seconds, passed = run.get("notebook"), run.get("seconds"), run.get("passed")
            timed_out = run.get("timed_out", False)
            if (not isinstance(notebook, str) or not notebook.endswith(".ipynb") or isinstance(seconds, bool)
                    or not isinstance(seconds, (int, float)) or seconds < 0 or not isinstance(passed, bool)
                    or not isinstance(timed_out, bool)):  # fmt: skip
                raise ValueError(
                    f"{name}: steps[{i}]: a notebook's run needs 'notebook' (a .ipynb name), "
                    f"'passed' (true/false) and 'seconds' (>= 0), got {run!r}"
                )
            prov = data.get("provenance")
            missing = [k for k in ("gpu", "torch", "date") if not isinstance(prov, dict) or not prov.get(k)]
            if missing:
                raise ValueError(f"{name}: times {notebook} but its provenance lacks {missing}")
            runs.append(dict(notebook=notebook, device=prov["gpu"], torch=prov["torch"], date=str(prov["date"])[:10],
                             seconds=float(seconds), passed=passed, timed_out=timed_out))  # fmt: skip
    return runs
