"""Runs inside the kernel of a notebook being graded: records the verdict of every check call.

:func:`install` wraps each ``check_*`` function of every chapter module in ``kvcourse.exercises``
(chapters added later included) so that each call appends one JSON line to a log file:
``{"check": "ch02.check_cache_update", "passed": false, "message": "..."}``. The learner's
notebook runs unchanged; the grader reads the log after each cell. A check that is replaced or
never called leaves no line, and the exercise is not counted as passed.
"""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
import re

__all__ = ["install"]


def _recording(name: str, check, log_path: str):
    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        try:
            result = check(*args, **kwargs)
        except Exception as exc:
            message = str(exc) if type(exc).__name__ == "ExerciseError" else f"{type(exc).__name__}: {exc}"
            _write(log_path, name, False, message)
            raise
        ok = bool(result)  # a NotDone (an exercise not written yet) is false, like False
        _write(log_path, name, ok, "" if ok else getattr(result, "message", "the check returned False"))
        return result

    return wrapper


def _write(log_path: str, check: str, passed: bool, message: str) -> None:
    with open(log_path, "a", encoding="utf-8") as log:
        log.write(json.dumps({"check": check, "passed": passed, "message": message}) + "\n")


def install(log_path: str) -> list[str]:
    """Wrap every chapter check so that it logs to ``log_path``; return the wrapped names."""
    import kvcourse.exercises as exercises

    wrapped = []
    for info in pkgutil.iter_modules(exercises.__path__):
        if not re.fullmatch(r"ch\d\d", info.name):
            continue
        try:
            module = importlib.import_module(f"kvcourse.exercises.{info.name}")
        except Exception:  # a chapter whose optional dependencies are missing: its checks cannot run anyway
            continue
        for name, check in list(vars(module).items()):
            if name.startswith("check_") and callable(check):
                setattr(module, name, _recording(f"{info.name}.{name}", check, log_path))
                wrapped.append(f"{info.name}.{name}")
    return wrapped
