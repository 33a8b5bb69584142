"""Grade one exercise: its own check runs here, the student's answer in a fresh sandbox process.

:func:`grade_exercise` takes the exercise's catalog entry (:mod:`kvcourse.exercises.catalog`) and the
cells to run, starts a :mod:`.sandbox` process, receives what the student's cells defined (data, or
proxies for functions and classes, :mod:`.wire`) and calls the catalog's check on it. This process
imports the checks and holds their references; the sandbox never does. Whatever the student's code
does, it does in its own process: the verdict is what the check returns here.

The references a check refuses as answers (its ``@check(references=...)``) are read from the check, not listed
by hand, and sent to the sandbox to be neutered there.

Devices: the check runs here on whatever device it chooses (chapter 5's on the GPU when there is one);
its tensors reach the student's code as host tensors and what that code writes into them comes back
(:mod:`.wire`), and the sandbox runs a student's Triton kernel in Triton's CPU interpreter.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import io
import multiprocessing
import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass
from ..exercises.catalog import MODEL, ExerciseSpec
from .wire import Endpoint, GradingTimeout, PeerGone, Shared, WireError

__all__ = ["Verdict", "grade_exercise", "load_check", "references_of"]


@dataclass
class Verdict:
    """What the check said: passed or not, a one-paragraph message, and its parts (case, expected, got, hint)."""

    passed: bool
    message: str
    case: str = ""
    expected: str = ""
    got: str = ""
    hint: str = ""


_MODEL = Shared(lambda: importlib.import_module("kvcourse").load_pretrained()[0])
_context = None
_isolated: bool | None = None  # how the running fork server was started: under bwrap or not
_folders: dict[str, str] = {}  # the isolated server's folder for the sandboxes' own, and its home


def _sandboxes(isolation: bool):
    """Sandboxes fork from a server that imported torch, kvcourse and the model once (not the checks).

    With ``isolation`` the server runs under bwrap (:mod:`.isolation`), so every sandbox forked from it
    sees the file system read-only except its own folder under :func:`_sandbox_root`. Multiprocessing
    keeps one fork server per process: asked for the other mode, it is stopped and started again.
    """
    global _context, _isolated
    from multiprocessing import forkserver, spawn

    context = multiprocessing.get_context("forkserver")
    if _context is None:
        context.set_forkserver_preload(["kvcourse.instructor._zygote"])
        _context = context
    server = forkserver._forkserver
    if _isolated is not None and _isolated != isolation:
        server._stop()
    started = server._forkserver_pid
    interpreter = spawn.get_executable()
    if isolation:
        # The server is started with this interpreter (here, and again by ``Process.start`` if it died): bwrap's.
        spawn.set_executable(_server_executable())
    try:
        server.ensure_running()
    finally:
        spawn.set_executable(interpreter)
    _isolated = isolation
    if server._forkserver_pid != started:
        warm = context.Process(target=_ready)  # the server loads the model before it forks the first child:
        warm.start()  # wait for that here, so it does not count against an exercise's time limit
        warm.join()
    return context


def _sandbox_root() -> str:
    """The one folder the isolated server may write: each sandbox gets its own inside (root's, ``0o711``:
    a sandbox that runs as ``nobody`` cannot make files beside its folder)."""
    if "root" not in _folders:
        root = tempfile.mkdtemp(prefix="kvcourse-sandboxes-")
        os.chmod(root, 0o711)
        home = os.path.join(root, "server")
        os.mkdir(home, 0o700)
        _folders.update(root=root, home=home)
        atexit.register(shutil.rmtree, root, True)
    return _folders["root"]


def _server_executable() -> str:
    from .isolation import private_env, server_executable

    if "executable" not in _folders:
        root = _sandbox_root()
        _folders["executable"] = server_executable([root], private_env(_folders["home"]))
        atexit.register(shutil.rmtree, os.path.dirname(_folders["executable"]), True)
    return _folders["executable"]


def _ready() -> None:
    return None


def load_check(spec: ExerciseSpec):
    """The check function the catalog names for ``spec``."""
    module = importlib.import_module(f"kvcourse.exercises.{spec.chapter}")
    return getattr(module, spec.check.split(".", 1)[1])


def references_of(check) -> list[list[str]]:
    """``[module, qualname]`` of every object ``check`` refuses as an answer (its ``@check(references=...)``)."""
    found: list[list[str]] = []
    for obj in getattr(check, "references", {}).values():
        entry = [obj.__module__, obj.__qualname__]
        if entry not in found:
            found.append(entry)
    return found


def grade_exercise(
    spec: ExerciseSpec,
    cells: list[list[str]],
    timeout: float = 300,
    chapter_names: dict[str, str] | None = None,
    isolation: bool | None = None,
) -> Verdict:
    """Run ``cells`` (``[kind, name, source]``, the solution last) in a sandbox and ``spec``'s check on them.

    ``chapter_names`` (:func:`.grade.chapter_names`): where the chapter defines the names the sandbox does not
    have; a follow-up line that needs one is not graded, and a failure for want of one says where it comes from.
    ``isolation``: the sandbox sees the file system read-only but for its own folder (:mod:`.isolation`);
    None: its ``DEFAULT``, on. Where that cannot be had, :class:`.isolation.IsolationUnavailable` is raised.
    """
    from .isolation import require

    isolation = require(isolation)
    verdict = _grade(spec, cells, timeout, chapter_names or {}, isolation)
    return verdict if verdict.passed else _explain_missing_name(verdict, chapter_names or {})


_NOT_DEFINED = re.compile(r"name '(\w+)' is not defined")


def _explain_missing_name(verdict: Verdict, chapter_names: dict[str, str]) -> Verdict:
    """A NameError for a variable of a chapter cell the grader does not run: say so, and what to move."""
    found = _NOT_DEFINED.search(verdict.message)
    if not found or found[1] not in chapter_names:
        return verdict
    name = found[1]
    advice = (
        f"`{name}` is {chapter_names[name]} The answer cell is graded alone, with the chapter's imports: "
        f"define what your answer needs from `{name}` inside the answer cell, or take it as an argument."
    )
    return Verdict(
        False,
        f"{verdict.message} {advice}",
        verdict.case,
        verdict.expected,
        verdict.got,
        f"{verdict.hint} {advice}".strip(),
    )


def _grade(
    spec: ExerciseSpec, cells: list[list[str]], timeout: float, chapter_names: dict[str, str], isolation: bool
) -> Verdict:
    check = load_check(spec)
    # The names the cell's check call passes, the model among them when the check takes it.
    given = list(dict.fromkeys([*spec.given, *(["model"] if MODEL in spec.args else [])]))
    context = _sandboxes(isolation)
    workdir = _workdir(_sandbox_root() if isolation else None)
    job = {
        "label": spec.label,
        "answers": list(spec.answers),
        "given": given,
        "cells": cells,
        "forbidden": references_of(check),
        "references_in_cells": spec.references_in_cells,
        "workdir": workdir,
        "chapter_names": chapter_names,
    }
    ours, theirs = context.Pipe()
    process = context.Process(target=_sandbox_main, args=(theirs, job), daemon=True)
    deadline = time.monotonic() + timeout
    endpoint = Endpoint(ours, lends_calls_only=True, shared={"model": _MODEL})
    endpoint.deadline = deadline
    try:
        process.start()
        theirs.close()
        header, buffers = endpoint.receive()
        if header.get("kind") == "failed":
            return Verdict(False, str(header.get("message", "the solution could not run"))[:2000])
        if header.get("kind") != "ready" or type(header.get("answers")) is not dict:
            return Verdict(False, "the grading sandbox sent something unexpected")
        answers = {
            name: endpoint.decode(tree, buffers) for name, tree in header["answers"].items() if name in spec.answers
        }
        args = [_MODEL.get() if a == MODEL else answers[a] for a in spec.args]
        shown = io.StringIO()
        from ..exercises import ExerciseError

        try:
            with contextlib.redirect_stdout(shown):
                result = check(*args)
        except ExerciseError as exc:
            return Verdict(False, str(exc), exc.case, exc.expected, exc.got, exc.hint)
        if not result:  # False, or NotDone: the answer is not written yet (the check printed why)
            return Verdict(False, getattr(result, "message", "the check returned False"))
        return Verdict(True, shown.getvalue().strip().removeprefix("Correct: ") or "ok")
    except GradingTimeout:
        return Verdict(False, f"timed out: the answer took longer than {timeout:g} s to check")
    except PeerGone:
        return Verdict(
            False,
            "the process running your answer ended before the check was done (os._exit, a crash, or too much memory)",
        )
    except WireError as exc:
        return Verdict(False, f"your answer could not be checked: {exc}")
    except Exception as exc:  # the check choked on what came back: a wrong answer, reported as such
        return Verdict(False, f"the check could not use your answer: {type(exc).__name__}: {exc}"[:2000])
    finally:
        with contextlib.suppress(Exception):
            endpoint.send({"kind": "bye"})
        if process.pid is not None:
            process.join(timeout=2)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
            _end_group(process.pid)
        ours.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _workdir(parent: str | None) -> str:
    """A fresh folder for one sandbox, its own (``nobody``'s, when the grader is root: see ``sandbox._confine``),
    in ``parent`` (the isolated server's writable folder) or the temporary folder."""
    from .sandbox import NOBODY, nobody_can_run

    path = tempfile.mkdtemp(prefix="kvcourse-sandbox-", dir=parent)
    # Only for a sandbox that will be nobody: one that stays root, isolated, has no capability to enter
    # a folder another user owns.
    if os.geteuid() == 0 and nobody_can_run():
        os.chown(path, NOBODY, NOBODY)
    return path


def _end_group(pid: int) -> None:
    """Kill what is left of the sandbox's process group: processes the student's code started
    (``subprocess.Popen``, ``os.fork``) would otherwise outlive grading. (A process that leaves the
    group on purpose, with ``setsid``, escapes this; the threat model in ``instructors.md`` says so.)"""
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _sandbox_main(conn, job: dict) -> None:
    from .sandbox import main

    main(conn, job)
