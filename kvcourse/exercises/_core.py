"""What every chapter's checks share: one error type and one success message."""

from __future__ import annotations

import math


class ExerciseError(AssertionError):
    """A wrong answer. The message says what was expected and gives a hint, never the answer itself."""


def passed(message: str) -> bool:
    print(f"Correct: {message}")
    return True


def expect_close(name: str, got: object, want: float, rel: float = 1e-6, hint: str = "") -> None:
    """Raise :class:`ExerciseError` unless ``got`` is a number within ``rel`` of ``want``."""
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        raise ExerciseError(f"{name} should be a number, got {type(got).__name__}. {hint}".strip())
    if not math.isclose(float(got), float(want), rel_tol=rel, abs_tol=0.0 if want else 1e-12):
        raise ExerciseError(f"{name} = {got!r} is not right. {hint}".strip())


def expect_equal(name: str, got: object, want: object, hint: str = "") -> None:
    """Raise :class:`ExerciseError` unless ``got == want``."""
    if got != want:
        raise ExerciseError(f"{name} = {got!r} is not right. {hint}".strip())


def call_learner(name: str, fn, *args):
    """Call the learner's function; turn a crash into an :class:`ExerciseError` that says where."""
    if not callable(fn):
        raise ExerciseError(f"pass a function to check, got {type(fn).__name__}")
    try:
        return fn(*args)
    except ExerciseError:
        raise
    except Exception as exc:  # the learner's code failed: say where, not the answer
        raise ExerciseError(f"{name}{args} raised {type(exc).__name__}: {exc}") from exc
