"""The student's side of grading one exercise: its cells run alone, with the answers out of reach.

:mod:`.checker` starts one such process per exercise (forked from a server that has already
imported torch and kvcourse and loaded the model, so a start takes a fraction of a second) and
sends it a job: the chapter's ``import`` lines, the catalog's setup, the cells of the exercises this
one uses, the exercise's own cells, the solution cell last. The process runs them in a fresh
namespace, then lends the names the check needs over :mod:`.wire` and answers requests until the
checker is done. The check itself never runs here.

Before any student line runs (or, for an exercise whose solution cell compares its answer with
the reference, as chapter 4's bug hunt does with ``BlockManager``, once the cells have run and before
the check starts), the process makes the references unusable:

* ``kvcourse.exercises`` cannot be imported: ``from kvcourse.exercises import ch01`` gives a stand-in
  whose ``check_*`` do nothing (the cell's own check call is harmless), and the files of the
  checks cannot be opened, compiled or executed;
* every kvcourse object the exercise's check refuses as an answer (``kvcourse.causal_attention`` for
  the attention exercise, ``BlockManager`` for the allocator...) is neutered in place: its code is
  replaced by a ``raise``, so every path to it -- an alias, ``getattr`` with a computed name,
  ``functools.partial``, a lambda, a subclass, ``gc`` -- reaches the ``raise``; its code cannot be
  swapped back and its module cannot be reloaded (an audit hook refuses both, and Python offers no
  way to remove an audit hook).
"""

from __future__ import annotations

import builtins
import importlib
import importlib.abc
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

from .wire import Endpoint, PeerGone, Shared

__all__ = ["NOBODY", "SHARED", "main", "nobody_can_run", "preload"]


def _load_model():
    import kvcourse

    model, tok = kvcourse.load_pretrained()
    SHARED["tok"].loaded = tok
    return model


def _load_tok():
    return SHARED["model"].get() and SHARED["tok"].loaded


SHARED: dict[str, Shared] = {"model": Shared(_load_model), "tok": Shared(_load_tok)}


def preload() -> None:
    """Run once in the fork server: one thread per process (many run side by side), the model loaded.

    A student's Triton kernel runs in Triton's CPU interpreter here, on a GPU machine too: the wire hands the
    student's code host tensors whatever device the check works on (and writes back what the kernel wrote),
    and a process forked from this server could not use CUDA anyway once anything here has asked for it.
    Set before anything imports Triton, which reads it once.
    """
    os.environ["TRITON_INTERPRET"] = "1"
    import torch

    torch.set_num_threads(1)
    import kvcourse  # noqa: F401

    try:
        SHARED["model"].get()
    except Exception:  # no weights here: an exercise that needs the model says so when it asks
        pass


# ---- the checks, out of reach -------------------------------------------------------------------
class _StandInError(AssertionError):
    pass


def _no_check(*args: Any, **kwargs: Any) -> bool:
    return True  # the grader runs the exercise's own check, in another process


class _StandIn(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("check_"):
            return _no_check
        if name == "ExerciseError":
            return _StandInError
        raise AttributeError(f"{self.__name__}.{name} is not available while grading (the checks run elsewhere)")


class _ChecksOutOfReach(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves stand-ins for ``kvcourse.exercises`` and its modules."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname == "kvcourse.exercises" or fullname.startswith("kvcourse.exercises."):
            return importlib.util.spec_from_loader(fullname, self, is_package=fullname == "kvcourse.exercises")
        return None

    def create_module(self, spec):
        module = _StandIn(spec.name)
        if spec.name == "kvcourse.exercises":
            module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


def _blocked_code(name: str, message: str) -> types.CodeType:
    namespace: dict = {}
    exec(f"def {name}(*args, **kwargs):\n    raise RuntimeError({message!r})\n", namespace)
    return namespace[name].__code__


def _neuter(obj: Any, label: str, shown: str, done: set[int], files: set[str]) -> None:
    """Replace the code of function ``obj``, or of every method of class ``obj`` and its subclasses."""
    if id(obj) in done:
        return
    done.add(id(obj))
    message = (
        f"{label}: kvcourse's {shown} is what this exercise's check compares against, so it is not available "
        f"while the exercise is graded: write your own."
    )
    if isinstance(obj, types.FunctionType):
        module = sys.modules.get(obj.__module__)
        if getattr(module, "__file__", None):
            files.add(os.path.realpath(module.__file__))
        if obj.__code__.co_freevars:  # a closure: its code cannot be swapped, so take it out of every module
            stand_in = types.FunctionType(_blocked_code(obj.__name__, message), {"__builtins__": builtins})
            for mod in list(sys.modules.values()):
                for key, value in list(getattr(mod, "__dict__", {}).items()):
                    if value is obj:
                        setattr(mod, key, stand_in)
        else:
            obj.__code__ = _blocked_code(obj.__name__, message)
    elif isinstance(obj, type):
        module = sys.modules.get(obj.__module__)
        if getattr(module, "__file__", None):
            files.add(os.path.realpath(module.__file__))
        for value in list(vars(obj).values()):
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if isinstance(value, property):
                for f in (value.fget, value.fset, value.fdel):
                    if isinstance(f, types.FunctionType):
                        _neuter(f, label, shown, done, files)
            elif isinstance(value, types.FunctionType):
                _neuter(value, label, shown, done, files)
        for sub in obj.__subclasses__():
            _neuter(sub, label, shown, done, files)


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Guard:
    """Takes the checks and the exercise's references out of reach (see the module docstring)."""

    def __init__(self, label: str) -> None:
        import kvcourse

        for name in [m for m in sys.modules if m == "kvcourse.exercises" or m.startswith("kvcourse.exercises.")]:
            del sys.modules[name]  # never imported in the fork server; a safeguard only
        sys.meta_path.insert(0, _ChecksOutOfReach())
        if "exercises" in vars(kvcourse):  # the package object itself, loaded with the grader's catalog
            delattr(kvcourse, "exercises")
        self.label = label
        self.exercises_dir = os.path.realpath(Path(kvcourse.__file__).parent / "exercises") + os.sep
        self.done: set[int] = set()  # ids of the neutered functions and classes
        self.files: set[str] = set()  # the source files that define them
        self.cached: tuple[str, ...] = ()
        sys.addaudithook(self._hook)

    def neuter(self, forbidden: list[list[str]]) -> None:
        done = set(self.done)  # the hook guards an object once its code is replaced, not while
        for module, qualname in forbidden:
            _neuter(_resolve(module, qualname), self.label, qualname, done, self.files)
        self.done |= done
        self.cached = tuple(os.path.join(os.path.dirname(f), "__pycache__", Path(f).stem + ".") for f in self.files)

    def _closed(self, path: str) -> bool:
        return path.startswith(self.exercises_dir) or path in self.files or path.startswith(self.cached)

    def _hook(self, event: str, args: tuple) -> None:
        if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if self._closed(path):
                raise PermissionError(f"{self.label}: {path} is not readable while grading")
        elif event == "exec" and self._closed(getattr(args[0], "co_filename", "")):
            raise PermissionError(f"{self.label}: kvcourse's checks and references cannot be re-run while grading")
        elif event == "compile" and len(args) > 1 and isinstance(args[1], str) and self._closed(args[1]):
            raise PermissionError(f"{self.label}: kvcourse's checks and references cannot be re-run while grading")
        elif event == "object.__setattr__" and id(args[0]) in self.done:
            raise PermissionError(f"{self.label}: this kvcourse object is not available while grading")


# ---- running the cells --------------------------------------------------------------------------
class _Shell:
    """Enough of ``get_ipython()`` for cells with magics: cell magics run their body, the rest do nothing."""

    def __init__(self, namespace: dict) -> None:
        self.namespace = namespace

    def run_line_magic(self, *args: Any, **kwargs: Any) -> None:
        return None

    def run_cell_magic(self, magic: str, line: str, cell: str) -> None:
        if magic in ("time", "timeit", "capture"):
            exec(compile(_python(cell), "<cell magic>", "exec"), self.namespace)

    def system(self, *args: Any, **kwargs: Any) -> None:
        return None

    getoutput = system


def _python(source: str) -> str:
    """Cell source as plain Python (IPython's own translation of magics and ``!`` lines)."""
    try:
        from IPython.core.inputtransformer2 import TransformerManager
    except ImportError:
        return source
    return TransformerManager().transform_cell(source)


def _run_cells(
    cells: list[list[str]],
    namespace: dict,
    chapter_names: dict[str, str] | None = None,
    stopped: list[str] | None = None,
) -> str | None:
    """Run ``[kind, name, source]`` cells in order; the message of the solution cell's failure, if any.

    The solution cell runs one top-level statement at a time. A statement that needs a variable of one of the
    chapter's cells the sandbox does not run (``chapter_names``: name -> where the chapter defines it) is the
    exercise's follow-up ("Then call it with this page's fit..."): the cell stops there without failing, what it
    defined before is graded, and the reason is appended to ``stopped`` for the message of a missing answer.
    """
    for kind, name, source in cells:
        if kind == "solution":
            problem = _run_solution(name, source, namespace, chapter_names or {}, stopped)
            if problem:
                return problem
            continue
        try:
            exec(compile(_python(source), f"<{name}>", "exec"), namespace)
        except BaseException:  # noqa: BLE001 - a context line that fails (an import, a quick test) does not stop it
            continue
    return None


def _run_solution(
    name: str, source: str, namespace: dict, chapter_names: dict[str, str], stopped: list[str] | None
) -> str | None:
    import ast
    import traceback

    filename = f"<{name}>"
    try:
        statements = ast.parse(_python(source), filename).body
    except BaseException as exc:  # noqa: BLE001 - a syntax error, or a cell too deep to parse
        return f"your solution cell raised {type(exc).__name__}: {exc}"
    for statement in statements:
        try:
            exec(compile(ast.Module([statement], type_ignores=[]), filename, "exec"), namespace)
        except BaseException as exc:  # noqa: BLE001 - the student's code may raise anything
            frames = traceback.extract_tb(exc.__traceback__)
            line = next((f.lineno for f in reversed(frames) if f.filename == filename), statement.lineno)
            missing = getattr(exc, "name", None) if type(exc) is NameError else None
            if missing in chapter_names and missing not in namespace:
                if stopped is not None:
                    stopped.append(
                        f"the grader stopped your solution cell at line {line}, which uses `{missing}`: "
                        f"{chapter_names[missing]}"
                    )
                return None
            return f"your solution cell raised {type(exc).__name__} at line {line}: {exc}"
    return None


NOBODY = 65534  # the unprivileged user (and group) a sandbox started by root runs as


def _confine(workdir: str | None) -> None:
    """A fresh, private working folder (the checker deletes it afterwards, so no later sandbox reads what this
    one wrote), as home and caches too; and, when the grader runs as root, no root: the student's code runs as
    ``nobody``, who cannot write into the installation. (The model and tokenizer were loaded before the fork.)"""
    if workdir is None:
        return
    os.chdir(workdir)
    for name in ("HOME", "TMPDIR", "TRITON_CACHE_DIR", "MPLCONFIGDIR", "XDG_CACHE_HOME"):
        os.environ[name] = workdir
    # Nothing imports from the grader's working folder, or from the folder a previous sandbox wrote into.
    sys.path[:] = [p for p in sys.path if p not in ("", ".") and os.path.isabs(p)]
    if os.geteuid() == 0 and nobody_can_run():
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)


def nobody_can_run() -> bool:
    """Whether ``nobody`` can read Python's standard library, torch, Triton and kvcourse (a student's ``import``
    loads modules after the switch). Not where Python lives under root's own home (pyenv in ``/root``, mode 700):
    there the sandbox keeps root, and the grader's check of the installed files is what stands guard."""
    import stat

    import kvcourse
    import torch

    places = [os.path.dirname(os.__file__), os.path.dirname(torch.__file__), os.path.dirname(kvcourse.__file__)]
    try:
        import triton

        places.append(os.path.dirname(triton.__file__))
    except ImportError:
        pass
    for place in places:
        path = os.path.realpath(place)
        if not os.stat(path).st_mode & stat.S_IROTH:
            return False
        while True:  # every folder on the way must let others through
            if not os.stat(path).st_mode & stat.S_IXOTH:
                return False
            parent = os.path.dirname(path)
            if parent == path:
                break
            path = parent
    return True


def main(conn, job: dict) -> None:
    """The process's entry point: run the job's cells, lend the answers, serve the checker, exit."""
    os.setsid()  # its own process group: the checker ends it and everything the student's code started with it
    _confine(job.get("workdir"))
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)  # the student's prints do not reach the grader's terminal
    endpoint = Endpoint(conn, lends_calls_only=False, shared=SHARED)
    try:
        guard = _Guard(job["label"])
        if not job["references_in_cells"]:
            guard.neuter(job["forbidden"])
        namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
        namespace["get_ipython"] = lambda: shell
        shell = _Shell(namespace)
        for name in job["given"]:
            namespace[name] = SHARED[name].get()
        stopped: list[str] = []
        problem = _run_cells(job["cells"], namespace, job.get("chapter_names"), stopped)
        missing = [n for n in job["answers"] if n not in namespace]
        if problem is None and missing:
            names = ", ".join(f"`{n}`" for n in missing)
            problem = f"your solution cell does not define {names}"
            if stopped:  # the answer came after the follow-up: say what to move
                problem += (
                    f": {stopped[0]} The grader runs the answer cell alone, with the chapter's imports, and "
                    f"grades what it defines before such a line: define {names} above it, using only what "
                    "the cell itself defines."
                )
        if job["references_in_cells"]:
            guard.neuter(job["forbidden"])  # the cells may compare with the reference; the answer may not use it
        if problem:
            endpoint.send({"kind": "failed", "message": problem})
        else:
            buffers: list[bytes] = []
            answers = {n: endpoint.encode(namespace[n], buffers) for n in job["answers"]}
            endpoint.send({"kind": "ready", "answers": answers}, buffers)
        while True:
            header, buffers = endpoint.receive()
            if header.get("kind") != "req":
                break
            endpoint.serve_one(header, buffers)
    except PeerGone:
        pass
    except BaseException as exc:  # noqa: BLE001 - tell the checker, then end
        try:
            endpoint.send({"kind": "failed", "message": f"grading could not start: {type(exc).__name__}: {exc}"})
        except Exception:
            pass
    finally:
        os._exit(0)
