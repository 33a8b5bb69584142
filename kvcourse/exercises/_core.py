"""What every chapter's checks share: the error type, hidden random cases, and how a failure is reported.

A check runs the learner's code on cases the learner has not seen, compares the
result with the right answer, and on a mismatch raises :class:`ExerciseError`
whose message has three parts: the case, what was expected and what came back,
and a hint. The hint names the mistake when the wrong results match a typical
wrong answer in every failing case (:class:`Diagnosis`), so each common slip gets
its own advice.

Hidden cases are drawn from a generator seeded by the check's own name and
``seed`` argument (:func:`case_rng`, :func:`case_generator`), never from global
random state: a check gives the same cases on every machine and in every order.

Where the cases live: they are drawn on the CPU (so they are the same everywhere), the
expected answers are computed there, before the learner's code runs, and the learner gets
copies on *the learner's device* (:func:`handed`): the model's device for a check that takes
the model, the device kernels run on for chapter 5's kernels, else :func:`learner_device`.
What comes back is compared on the CPU (:func:`on_host`), where the typical mistakes are
computed too.

The skeleton every check shares is at the end: :func:`check` (the seed key, the answer's validation and refused
references, an unwritten answer reported) and :func:`diagnose` (the loop over the cases, with a hint per mistake).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import inspect
import math
import os
import random
import sys
import sysconfig
import threading
import traceback
import types
from collections.abc import Callable
from typing import Any, NoReturn

__all__ = [
    "ExerciseError",
    "CheckResult",
    "NotDone",
    "Passed",
    "Unfinished",
    "passed",
    "reports_unfinished",
    "check",
    "hidden_rng",
    "hidden_generator",
    "diagnose",
    "mistaken",
    "diff_below",
    "same",
    "an_int",
    "a_number",
    "fail",
    "describe",
    "tensor_diff",
    "Diagnosis",
    "case_rng",
    "case_generator",
    "call_learner",
    "handed",
    "learner_device",
    "on_host",
    "expect_tensor",
    "refuse_references",
    "lend",
    "learner_runs",
]


_CHECKS_DIR = os.path.dirname(os.path.abspath(__file__))  # frames here are the check's, not the learner's


class ExerciseError(AssertionError):
    """A wrong answer: the message says what was expected, what came back, and gives a hint.

    ``case``, ``expected``, ``got`` and ``hint`` are kept as attributes, so a grading script can
    report them separately.
    """

    def __init__(self, message: str, *, case: str = "", expected: str = "", got: str = "", hint: str = "") -> None:
        super().__init__(message)
        self.case, self.expected, self.got, self.hint = case, expected, got, hint

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the message alone for a wrong answer or an unwritten stub; for a crash in
        the learner's code, that code's own frames first (never the check's, which would bury the
        one sentence that matters under a screen of traceback)."""
        lines = []
        cause = self.__cause__
        if cause is not None and not isinstance(cause, NotImplementedError):
            frames = [f for f in traceback.extract_tb(cause.__traceback__) if _CHECKS_DIR not in f.filename]
            if frames:
                lines.append("Traceback of your code (most recent call last):")
                lines += "".join(traceback.format_list(frames)).rstrip("\n").split("\n")
        lines.append(f"{type(self).__name__}: {self}")
        return lines


class Passed:
    """What a check returns when the answer is right: true, and silent in a notebook.

    The check has already printed what it verified; IPython would echo a plain ``True`` after it
    as ``Out: True``, which says nothing. ``_ipython_display_`` shows nothing instead.
    """

    def __init__(self, message: str) -> None:
        self.message = message

    def __bool__(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"Passed({self.message!r})"

    def _ipython_display_(self) -> None:
        pass


def passed(message: str) -> Passed:
    print(f"Correct: {message}")
    return Passed(message)


class Unfinished(ExerciseError):
    """The learner has not written the answer yet: a stub raised ``NotImplementedError``."""


class NotDone:
    """What a check returns for an exercise not done yet: false, so a grader counts it as failed, and
    silent in a notebook (the check printed its message), so "Run all" goes on to the next cell."""

    def __init__(self, message: str) -> None:
        self.message = message

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"NotDone({self.message!r})"

    def _ipython_display_(self) -> None:
        pass


def reports_unfinished(check: Callable) -> Callable:
    """Wrap ``check`` so that an unwritten answer is reported, not raised.

    A student copy's stubs raise ``NotImplementedError`` (functions) or leave the answer
    ``NotImplemented`` (values). Raising would stop a notebook's "Run all" at the first exercise
    not done; instead the check prints "Not done yet" with the stub's hint and returns a false
    :class:`NotDone`. A wrong answer still raises :class:`ExerciseError`.
    """
    if getattr(check, "reports_unfinished", False):
        return check

    @functools.wraps(check)
    def wrapper(*args, **kwargs):
        if any(arg is NotImplemented for arg in (*args, *kwargs.values())):
            return _not_done(
                f"{check.__name__}: your answer is not written yet (it is still NotImplemented): see the exercise"
            )
        try:
            with _Watch():  # what the check's refuse_references(...) refuses is watched until it returns
                return check(*args, **kwargs)
        except Unfinished as exc:
            return _not_done(str(exc))
        except NotImplementedError as exc:  # a stub called outside call_learner
            return _not_done(f"{check.__name__}: {exc}")

    wrapper.reports_unfinished = True
    return wrapper


# What a chapter's check returns (it raises ExerciseError for a wrong answer).
CheckResult = Passed | NotDone


def _not_done(message: str) -> NotDone:
    print(f"Not done yet: {message}")
    return NotDone(message)


def describe(value: Any, limit: int = 12) -> str:
    """A short, readable rendering of ``value`` for a failure message.

    Small tensors are printed in full (bool masks as rows of 0/1); large ones as shape, dtype and
    a few entries, so a message never floods the notebook.
    """
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a dependency
        torch = None
    if torch is not None and isinstance(value, torch.Tensor):
        head = f"tensor {list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
        if value.dtype == torch.bool and value.ndim == 2 and max(value.shape, default=0) <= limit:
            rows = ["".join("1" if x else "." for x in row.tolist()) for row in value]
            return head + " (1 = True)\n    " + "\n    ".join(rows)
        if value.numel() <= limit:
            flat = value.detach().flatten().tolist()
            shown = [f"{x:.4g}" if isinstance(x, float) else str(x) for x in flat]
            return f"{head}: [{', '.join(shown)}]"
        flat = value.detach().flatten()[:4].tolist()
        shown = [f"{x:.4g}" if isinstance(x, float) else str(x) for x in flat]
        return f"{head}, starting [{', '.join(shown)}, ...]"
    if isinstance(value, float):
        return f"{value:.10g}"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def tensor_diff(got, want) -> str:
    """Where two same-shaped tensors differ most, e.g. ``largest difference at [0, 3, 2, 17]: 0.51 vs 1.2``."""
    diff = (got.float() - want.float()).abs()
    flat = int(diff.argmax())
    index = []
    for size in reversed(want.shape):
        index.append(flat % size)
        flat //= size
    index = tuple(reversed(index))
    return f"largest difference at {list(index)}: expected {want[index].item():.4g}, got {got[index].item():.4g}"


def fail(case: str, *, expected: Any, got: Any, hint: str) -> NoReturn:
    """Raise :class:`ExerciseError` for ``case`` with the expected and returned values and a hint."""
    expected_text = expected if isinstance(expected, str) else describe(expected)
    got_text = got if isinstance(got, str) else describe(got)
    message = f"{case} is not right.\n  expected: {expected_text}\n  got:      {got_text}\nHint: {hint}"
    raise ExerciseError(message, case=case, expected=expected_text, got=got_text, hint=hint)


class Diagnosis:
    """Collects a learner's wrong results over all cases, then names the mistake that explains them all.

    ``mistakes`` pairs a hint with a function computing what that typical wrong answer returns for a
    case's inputs. A hint is given only if its mistake reproduces the learner's result in *every*
    failing case, so two mistakes that agree on one case are told apart by the others. The first
    failing case is the one reported.
    """

    def __init__(
        self, mistakes: list[tuple[str, Callable[..., Any]]], default: str, same: Callable[[Any, Any], bool]
    ) -> None:
        self.mistakes, self.default, self.same = mistakes, default, same
        self.consistent = [True] * len(mistakes)
        self.failures: list[tuple[str, Any, Any]] = []

    def record(self, case: str, args: tuple, got: Any, want: Any, extra: str = "") -> None:
        """Note that ``got`` (for inputs ``args``) differs from ``want``."""
        self.failures.append((case, want, describe(got) + extra if extra else got))
        for i, (_, compute) in enumerate(self.mistakes):
            if not self.consistent[i]:
                continue
            try:
                wrong = compute(*args)
                self.consistent[i] = wrong is not None and bool(self.same(got, wrong))
            except Exception:  # the mistake cannot be computed for this case: it does not explain it
                self.consistent[i] = False

    def raise_if_wrong(self) -> None:
        """Raise :class:`ExerciseError` for the first failing case, with the best hint, if any case failed."""
        if not self.failures:
            return
        hint = next((h for (h, _), ok in zip(self.mistakes, self.consistent) if ok), self.default)
        case, want, got = self.failures[0]
        others = len(self.failures) - 1
        fail(
            case + (f" (and {others} more case{'s' if others > 1 else ''})" if others else ""),
            expected=want,
            got=got,
            hint=hint,
        )


def _seed_from(*key: object) -> int:
    digest = hashlib.sha256(repr(key).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def case_rng(*key: object) -> random.Random:
    """A :class:`random.Random` seeded from ``key`` (the check's name and its ``seed`` argument)."""
    return random.Random(_seed_from(*key))


def case_generator(*key: object):
    """A CPU :class:`torch.Generator` seeded from ``key``; independent of torch's global generator.

    Draw with it on the CPU (``device="cpu"``): the same cases on every machine, then :func:`handed` to the learner.
    """
    import torch

    return torch.Generator(device="cpu").manual_seed(_seed_from(*key))


def learner_device(device=None):
    """The device a check hands the learner's code its tensors on: ``device`` if given, else
    :func:`~kvcourse.utils.default_device` (the GPU on Colab), where every chapter now runs.

    So on a GPU the learner's code must be device-neutral, as the package's is: a tensor it makes goes on its
    inputs' device (``torch.arange(n, device=x.device)``); :func:`call_learner` says so when it is not. (Checks
    that take the model use the model's device; chapter 5's kernel checks, the device kernels run on.)
    """
    import torch

    if device is None:
        from ..utils import default_device

        return default_device()
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a name such as 'cpu' or 'cuda', got {device!r}") from None


def handed(t, device):
    """A copy of hidden case ``t`` on ``device``: what the learner's code is given (it may write into it)."""
    return t.to(device, copy=True)


def on_host(value):
    """``value`` on the CPU if it is a tensor, where a check compares it (anything else unchanged)."""
    import torch

    return value.detach().cpu() if isinstance(value, torch.Tensor) else value


def call_learner(name: str, fn, *args, **kwargs):
    """Call the learner's function; turn a crash into an :class:`ExerciseError` that says where."""
    if not callable(fn):
        raise ExerciseError(f"pass a function to check, got {type(fn).__name__}")
    try:
        with learner_runs():
            return fn(*args, **kwargs)
    except ExerciseError:
        raise
    except NotImplementedError as exc:
        raise Unfinished(f"{name} is not written yet (it raised NotImplementedError: {exc})") from exc
    except Exception as exc:  # the learner's code failed: say where, not the answer
        shown = ", ".join(
            [describe(a, limit=4) for a in args] + [f"{k}={describe(v, limit=4)}" for k, v in kwargs.items()]
        )
        hint = f" {DEVICE_HINT}" if _is_device_mismatch(exc) else ""
        raise ExerciseError(f"{name}({shown}) raised {type(exc).__name__}: {exc}{hint}") from exc


# What a device mismatch says (torch's messages, and Triton's for a CPU tensor handed to a compiled kernel).
_DEVICE_MISMATCH = ("same device", "cpu tensor?", "found at least two devices")
DEVICE_HINT = (
    "Hint: your code made a tensor on the CPU while its inputs are on the GPU. Make new tensors on "
    "the inputs' device, e.g. torch.arange(n, device=x.device), or move one there with .to(x.device)."
)


def _is_device_mismatch(exc: BaseException) -> bool:
    return isinstance(exc, (RuntimeError, ValueError)) and any(m in str(exc) for m in _DEVICE_MISMATCH)


def expect_tensor(case: str, got: Any, shape: tuple[int, ...], dtype=None, what: str = "") -> Any:
    """``got``, or :class:`ExerciseError` unless it is a tensor of ``shape`` (and ``dtype``, if given)."""
    import torch

    if not isinstance(got, torch.Tensor):
        raise ExerciseError(
            f"{case} should return a torch.Tensor{' ' + what if what else ''}, got {type(got).__name__}.", case=case
        )
    if tuple(got.shape) != tuple(shape):
        fail(
            case,
            expected=f"shape {list(shape)} {what}".strip(),
            got=f"shape {list(got.shape)}",
            hint="Check which axis is which: the docstring gives the order of the dimensions.",
        )
    if dtype is not None and got.dtype != dtype:
        fail(case, expected=f"dtype {dtype}", got=f"dtype {got.dtype}", hint=f"Return a {dtype} tensor.")
    return got


# ---- the references a check refuses, watched while the learner's code runs --------------------------
#
# A check compares the learner's answer with kvcourse's own version of it; handing that version in, under any
# name or wrapper, would pass without teaching anything. Matching names in the learner's code misses an alias,
# functools.partial, getattr, importlib, a subclass or a bound method, so the check watches code objects
# instead: while the learner's code runs (call_learner, or the check's own learner_runs()), a profile function
# (sys.setprofile) notes every time the code of a refused reference starts, and asks who started it by walking
# the stack up to the check:
#   - a frame of the learner's code (a notebook cell, a test file): the learner's code called it, directly or
#     through any kvcourse function that calls it;
#   - call_learner's own frame: the learner's callable is the reference itself, reached without a Python frame of
#     the learner's (a partial, a bound method, a class inherited whole);
#   - any other frame of the checks (kvcourse/exercises): the check's own work (running a Scheduler around the
#     learner's phase, a callable it lends with :func:`lend`): allowed.
# The walk runs only when a refused code object starts. The profile function itself costs about a microsecond
# per call and return (C calls included), so it is on only while the learner's code runs: the check's own work,
# often most of its time (an allocator simulated for the expected answers), runs unwatched and at full speed.

_PACKAGE_DIR = os.path.dirname(_CHECKS_DIR) + os.sep
_LIBRARY_DIRS = tuple(
    sorted(
        {
            os.path.realpath(p) + os.sep
            for key in ("stdlib", "platstdlib", "purelib", "platlib")
            if (p := sysconfig.get_paths().get(key))
        }
    )
)


@functools.lru_cache(maxsize=4096)
def _learners_file(filename: str) -> bool:
    """Whether code in ``filename`` is the learner's: neither kvcourse's, nor Python's or an installed library's,
    nor generated (``<string>``, ``<frozen ...>``)."""
    if not filename or filename.startswith("<"):
        return False
    path = os.path.realpath(filename)
    return not path.startswith(_PACKAGE_DIR) and not path.startswith(_LIBRARY_DIRS)


def _code_objects(obj: Any) -> list[types.CodeType]:
    """The code objects that run when ``obj`` does: a function's own (under any decorator that wraps it), or
    every method, property and static/class method a class defines, and those of kvcourse's subclasses of it
    (the checks' own subclasses excepted: they are the check's machinery). Code from Python's library (a
    decorator's generic wrapper) is left out: other code shares it."""
    found: list[types.CodeType] = []

    def add(func: Any) -> None:
        func = getattr(func, "__func__", func)  # a bound method, staticmethod or classmethod
        try:
            func = inspect.unwrap(func)
        except ValueError:
            pass
        code = getattr(func, "__code__", None)
        if isinstance(code, types.CodeType) and not _is_library_code(code):
            found.append(code)

    if isinstance(obj, type):
        seen: set[type] = set()
        todo = [obj]
        while todo:
            cls = todo.pop()
            if cls in seen:
                continue
            seen.add(cls)
            for value in vars(cls).values():
                if isinstance(value, property):
                    for f in (value.fget, value.fset, value.fdel):
                        if f is not None:
                            add(f)
                elif isinstance(value, functools.cached_property):
                    add(value.func)
                elif isinstance(value, (types.FunctionType, staticmethod, classmethod)):
                    add(value)
            todo += [
                sub
                for sub in cls.__subclasses__()
                if sub.__module__.startswith("kvcourse.") and not sub.__module__.startswith("kvcourse.exercises")
            ]
    elif isinstance(obj, functools.partial):
        found += _code_objects(obj.func)
    else:
        add(obj)
    return found


def _is_library_code(code: types.CodeType) -> bool:
    path = os.path.realpath(code.co_filename) if not code.co_filename.startswith("<") else ""
    return bool(path) and path.startswith(_LIBRARY_DIRS) and not path.startswith(_PACKAGE_DIR)


def _called_by_learner(frame: types.FrameType) -> str | None:
    """Where the learner's code started ``frame`` (``"file:line"``, or ``""`` when through call_learner with no
    frame of the learner's), or ``None`` when the check's own work did."""
    f = frame.f_back
    while f is not None:
        code = f.f_code
        if code is _CALL_LEARNER_CODE:
            return ""
        if code.co_filename.startswith(_CHECKS_DIR):
            return None
        if _learners_file(code.co_filename):
            return f"{code.co_filename}, line {f.f_lineno}"
        f = f.f_back
    return None


class _Watch:
    """One check's watch: the refused references' code objects (and C functions), and the first that the
    learner's code ran. Entered by :func:`reports_unfinished` around every check; :func:`refuse_references`
    fills it, :func:`call_learner` raises as soon as a call it made ran a reference, and the check raises at the
    end if anything else of the learner's did (a property the check read, say)."""

    current: _Watch | None = None

    def __init__(self) -> None:
        self.codes: dict[types.CodeType, tuple[str, str]] = {}  # code -> (the reference's name, the task)
        self.builtins: dict[int, tuple[str, str, Any]] = {}  # id of a C function -> (name, task, the function)
        self.tripped: tuple[str, str, str, str] | None = None  # (name, what ran, where, task)
        self.depth = 0  # learner runs under way (nested: a lent callable may call the learner back)

    def __enter__(self) -> _Watch:
        self.outer = _Watch.current
        if self.outer is not None:  # a check run inside another: the outer refusals hold too
            self.codes.update(self.outer.codes)
            self.builtins.update(self.outer.builtins)
        _Watch.current = self
        return self

    def __exit__(self, kind, exc, tb) -> None:
        _Watch.current = self.outer
        if self.tripped is not None and not (isinstance(exc, ExerciseError) and getattr(exc, "refused", False)):
            raise self.refusal() from exc  # the learner's code ran a reference outside call_learner

    def refuse(self, name: str, ref: Any, task: str) -> None:
        for code in _code_objects(ref):
            self.codes.setdefault(code, (name, task))
        if isinstance(ref, types.BuiltinFunctionType):
            self.builtins[id(ref)] = (name, task, ref)

    @contextlib.contextmanager
    def learner_runs(self):
        """Watch while the learner's code runs. Only then: a profile function costs about a microsecond per call
        and return, which the check's own work (simulating an allocator for the expected answers, say) need not
        pay."""
        if not (self.codes or self.builtins):
            yield
            return
        if self.depth == 0:
            self.previous, self.previous_threads = sys.getprofile(), threading.getprofile()
            self.profile = self._make_profile()
            sys.setprofile(self.profile)
            threading.setprofile(self.profile)  # threads the learner's code starts are watched too
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1
            if self.depth == 0:
                replaced = sys.getprofile() is not self.profile
                sys.setprofile(self.previous)
                threading.setprofile(self.previous_threads)
                if replaced and self.tripped is None:
                    raise ExerciseError(
                        "your code replaced the profile function (sys.setprofile) with which this "
                        "check watches for kvcourse's references: leave it in place."
                    )

    def _make_profile(self) -> Callable:
        codes, builtins, previous = self.codes, self.builtins, self.previous
        chained = previous if isinstance(previous, (types.FunctionType, types.MethodType)) else None

        def profile(frame, event, arg):
            if event == "call":
                if frame.f_code in codes:
                    self._hit(frame, *codes[frame.f_code], frame.f_code.co_qualname)
            elif event == "c_call" and builtins and id(arg) in builtins:
                name, task, ref = builtins[id(arg)]
                if arg is ref:
                    self._hit(frame, name, task, getattr(ref, "__qualname__", name), c_frame=True)
            if chained is not None:
                chained(frame, event, arg)

        return profile

    def _hit(self, frame: types.FrameType, name: str, task: str, what: str, c_frame: bool = False) -> None:
        if self.tripped is not None:
            return
        if c_frame:  # a C function has no frame of its own: the frame given is its caller's
            code = frame.f_code
            where = (
                ""
                if code is _CALL_LEARNER_CODE
                else None
                if code.co_filename.startswith(_CHECKS_DIR)
                else f"{code.co_filename}, line {frame.f_lineno}"
                if _learners_file(code.co_filename)
                else _called_by_learner(frame)
            )
        else:
            where = _called_by_learner(frame)
        if where is not None:
            self.tripped = (name, what, where, task)

    def refusal(self) -> ExerciseError:
        name, what, where, task = self.tripped
        ran = "" if what in (name, name.split(".")[-1]) else f" ({what} ran)"
        at = f", from {where}" if where else ""
        error = ExerciseError(
            f"your code calls kvcourse's {name}{ran}{at}: that is what this check compares your "
            f"answer with, and the exercise is to write it: {task}",
            hint=task,
        )
        error.refused = True
        return error

    def raise_if_tripped(self) -> None:
        if self.tripped is not None:
            raise self.refusal()


_CALL_LEARNER_CODE = call_learner.__code__


def refuse_references(fn: Any, references: dict[str, Any], task: str) -> None:
    """Refuse ``references`` (kvcourse's own versions of what the exercise asks for) as the answer, whatever the
    route: handing one in, or code that runs one while the check runs it (under another name, through
    ``functools.partial``, ``getattr``, ``importlib``, a subclass, a bound method, or a kvcourse function that
    calls it).

    :func:`check` calls it first thing with the references it is given (inside :func:`reports_unfinished`): from then until the check returns, each time the code of a reference starts, the stack says who
    started it, and the learner's code doing so fails the check with a message that names the reference (see the
    comment above). The check's own calls of the references, and callables it hands the learner through
    :func:`lend`, are not the learner's. A class refuses every method it defines, and those of kvcourse's
    subclasses of it; a C function (no code object) is matched when it is called, by identity.
    """
    watch = _Watch.current
    if watch is None:
        raise RuntimeError(
            "refuse_references watches the learner's calls until the check returns: call it inside a "
            "check made with @check (or wrapped by reports_unfinished)"
        )
    if not isinstance(references, dict) or not references:
        raise TypeError(f"references must be a non-empty dict of name -> object, got {references!r}")
    handed = fn
    while isinstance(handed, functools.partial):  # a C function partially applied runs with no Python call to see
        handed = handed.func
    for name, ref in references.items():
        if fn is ref or handed is ref:
            raise ExerciseError(f"that is kvcourse's own {name}; {task}", hint=task)
    for name, ref in references.items():
        watch.refuse(name, ref, task)


@contextlib.contextmanager
def learner_runs():
    """Around code of the check's that runs the learner's code other than through :func:`call_learner` (a property
    it reads, a model forward pass through the learner's cache): the references are watched meanwhile, and one
    that the learner's code ran fails the check here."""
    watch = _Watch.current
    if watch is None:
        yield
        return
    try:
        with watch.learner_runs():
            yield
    finally:  # a reference that ran is the verdict, whatever the learner's code returned or raised
        watch.raise_if_tripped()


def lend(fn: Callable) -> Callable:
    """``fn`` (a callable of kvcourse's the check hands the learner's code, such as the engine's hash function)
    wrapped so that what it runs is the check's own work, not the learner's, even when it runs a reference."""

    def lent(*args, **kwargs):
        return fn(*args, **kwargs)

    return lent


# ---- the skeleton every check shares -----------------------------------------------------------------
#
# A check is its hidden cases, the right answer (the reference) and the typical wrong ones (the mistakes): @check
# gives it a seed key, validates and refuses the answer and reports an unwritten one; diagnose() runs the cases.


class _Seeded:
    """The running check's seed key and ``seed`` (nested: a check may run another), for :func:`hidden_rng`."""

    current: list[tuple[str, Any]] = []


def hidden_rng(part: str = "") -> random.Random:
    """The running check's :func:`case_rng`: seeded from its key (``key.part`` for a second stream) and ``seed``."""
    key, seed = _Seeded.current[-1]
    return case_rng(f"{key}.{part}" if part else key, seed)


def hidden_generator(part: str = ""):
    """The running check's :func:`case_generator`, as :func:`hidden_rng`."""
    key, seed = _Seeded.current[-1]
    return case_generator(f"{key}.{part}" if part else key, seed)


def check(key: str, takes: str | None = None, *, references: dict[str, Any] | None = None, task: str = ""):
    """Make a function a chapter's check: ``@check("ch01.check_causal_mask", takes="fn(num_queries, num_keys)")``.

    ``key`` seeds the hidden cases (:func:`hidden_rng`, :func:`hidden_generator`; never change it: the cases would
    change). The check's first argument is the learner's answer: ``takes`` says what it must be (a function's call,
    shown in the error, or ``"... class"`` for a class itself), ``references`` are kvcourse's own versions of it,
    refused as the answer (:func:`refuse_references`, with ``task`` saying what to do instead), and an unwritten
    answer is reported, not raised (:func:`reports_unfinished`).
    """

    def decorate(body: Callable) -> Callable:
        signature = inspect.signature(body)
        answer = next(iter(signature.parameters))

        @functools.wraps(body)
        def run(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            given = bound.arguments[answer]
            if takes is not None and takes.endswith("class") and not isinstance(given, type):
                raise ExerciseError(f"pass your {takes} itself (not an instance), got {type(given).__name__}")
            if takes is not None and not callable(given):
                raise ExerciseError(f"pass your function {takes}, got {type(given).__name__}")
            if references:
                refuse_references(given, references, task)
            _Seeded.current.append((key, bound.arguments.get("seed", 0)))
            try:
                return body(*args, **kwargs)
            finally:
                _Seeded.current.pop()

        run.key, run.references = key, dict(references or {})
        return reports_unfinished(run)

    return decorate


def same(
    got: Any, want: Any, *, rel: float = 1e-9, abs_tol: float = 1e-9, atol: float = 1e-5, rtol: float = 1e-4
) -> bool:
    """Whether ``got`` matches ``want`` (or a typical mistake's answer): numbers within ``rel`` (or ``abs_tol``),
    tensors of one shape within ``atol`` and ``rtol`` (compared as float), tuples item by item, anything else equal
    (a bool only to a bool)."""
    import torch

    if isinstance(want, torch.Tensor):
        return (
            isinstance(got, torch.Tensor)
            and got.shape == want.shape
            and torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol)
        )
    if isinstance(want, tuple):
        return (
            isinstance(got, (tuple, list))
            and len(got) == len(want)
            and all(same(g, w, rel=rel, abs_tol=abs_tol, atol=atol, rtol=rtol) for g, w in zip(got, want))
        )
    if isinstance(got, bool) != isinstance(want, bool):
        return False
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (got, want))
    return math.isclose(got, want, rel_tol=rel, abs_tol=abs_tol) if numbers else got == want


def mistaken(mirror: Callable[..., Any], **hints: str) -> list[tuple[str, Callable[..., Any]]]:
    """Typical mistakes that are flags of ``mirror`` (the reference, which computes the wrong answer when told):
    ``mistaken(_quantized, no_window="hint", ...)`` computes ``mirror(*case, no_window=True)`` where ``mirror`` has
    that keyword, else ``mirror(*case, mistake="no_window")``; a :class:`Diagnosis`'s ``mistakes``, in order."""
    keywords = inspect.signature(mirror).parameters
    flags = {flag: {flag: True} if flag in keywords else {"mistake": flag} for flag in hints}
    return [(hint, lambda *case, kw=flags[flag]: mirror(*case, **kw)) for flag, hint in hints.items()]


def an_int(what: str = "", strict: bool = False) -> Callable[..., int]:
    """A ``returns`` for :func:`diagnose`: the answer must be an int (``what``: "number of tokens", say; a float with
    no fraction is taken, unless ``strict``)."""

    def returns(case: str, got: Any, *args) -> int:
        if not strict and isinstance(got, float) and got.is_integer():
            got = int(got)
        if isinstance(got, bool) or not isinstance(got, int):
            raise ExerciseError(
                f"{case} should return an int{f' {what}' if what else ''}, got {type(got).__name__}: {describe(got)}",
                case=case,
            )
        return got

    return returns


def a_number(what: str = "a number", finite: bool = False) -> Callable[..., float]:
    """A ``returns`` for :func:`diagnose`: the answer must be a number (``what``, e.g. "a number of bytes", says
    what the failure asks for), ``finite`` if asked."""

    def returns(case: str, got: Any, *args) -> float:
        if isinstance(got, bool) or not isinstance(got, (int, float)) or (finite and not math.isfinite(got)):
            raise ExerciseError(f"{case} should return {what}, got {type(got).__name__}: {describe(got)}", case=case)
        return got

    return returns


def _copy_for_learner(value: Any, device: Any) -> Any:
    """What the learner's code is given for a case's input: tensors copied to ``device``, lists, tuples, sets and
    dicts copied (the learner may write into them), anything else (numbers, a callable the check lends) as it is."""
    import torch

    if isinstance(value, torch.Tensor):
        return handed(value, learner_device(device))
    if type(value) is dict:
        return {k: _copy_for_learner(v, device) for k, v in value.items()}
    if type(value) in (list, tuple, set):
        return type(value)(_copy_for_learner(v, device) for v in value)
    return value


def diagnose(
    fn: Callable,
    cases: list[tuple],
    *,
    label: Callable[..., str],
    reference: Callable[..., Any],
    mistakes: list[tuple[str, Callable[..., Any]]],
    hint: str,
    compare: Callable[[Any, Any], bool] = same,
    right: Callable[..., bool] | None = None,
    returns: Callable[..., Any] | None = None,
    device: Any = None,
    extra: Callable[[Any, Any], str] | None = None,
    call: Callable[..., Any] | None = None,
) -> None:
    """Run the learner's ``fn`` on every case and raise :class:`ExerciseError` if any is wrong, with the hint of
    the mistake that explains them all (:class:`Diagnosis`), else ``hint``.

    Each case is the tuple of inputs ``reference(*case)`` takes (so do the ``mistakes``); the expected answers are
    all computed before the learner's code runs. ``fn`` gets copies (tensors on ``device``, :func:`learner_device`).
    ``label(*case)`` names the call in a failure (``"causal_mask(4, 4)"``: ``causal_mask`` names ``fn`` in a crash);
    ``returns(label, got, *case)`` checks what came back and returns it (:func:`an_int`, :func:`a_number`,
    :func:`expect_tensor`). ``compare(got, want)`` says whether ``got`` is right, and whether a mistake's answer
    explains it; ``right(got, want, *case)``, if given, says the former. ``extra(got, want)`` adds to what a failure
    shows (:func:`diff_below`); ``call(label, fn, *inputs)``, in place of :func:`call_learner`, runs ``fn``
    another way (inside a simulation, say) or explains a crash.
    """
    cases = list(cases)
    wants = [reference(*case) for case in cases]
    diagnosis = Diagnosis(mistakes, hint, compare)
    for case, want in zip(cases, wants):
        name = label(*case)
        given = (_copy_for_learner(x, device) for x in case)
        got = call(name, fn, *given) if call is not None else call_learner(name.split("(")[0], fn, *given)
        got = on_host(returns(name, got, *case) if returns is not None else got)
        if not (right(got, want, *case) if right is not None else compare(got, want)):
            diagnosis.record(name, case, got, want, extra=extra(got, want) if extra is not None else "")
    diagnosis.raise_if_wrong()


def diff_below(got: Any, want: Any) -> str:
    """An ``extra`` for :func:`diagnose`: where two tensors differ most, on a line of its own."""
    return f"\n            ({tensor_diff(got, want)})"
