"""What graded code may write: its own private folder, and nothing else that outlives it.

A graded cell runs with the grader's permissions: without this, it could write a ``.pth`` into
``site-packages`` (run by every later Python process, the next grading run included), a file into the
installed ``kvcourse`` package or into the instructor's home, and the file would stay. So each notebook
kernel (:mod:`.grade`) and each sandbox server (:mod:`.checker`) runs under Debian's ``bubblewrap``
(``bwrap``) with

* a read-only view of the whole file system (``--ro-bind / /``): the installation, the home, the
  submissions;
* a fresh, empty ``/tmp`` and ``/dev`` of its own (the GPU's device nodes bound in, when there is one),
  gone when it ends;
* read-write, only the private folders the grader made for it (:func:`command`'s ``writable``), which
  the grader deletes afterwards;
* no network (``--unshare-net``: the kernel talks to the grader over Unix sockets in its private folder,
  which need none), no capabilities beyond switching to ``nobody`` (a root inside cannot remount the
  view writable), and no life beyond the grader's (``--die-with-parent``).

Where bwrap is missing or cannot start a sandbox (:func:`unavailable` says why), the grader refuses to
grade unless the instructor passes ``--no-isolation`` (:func:`require`).
"""

from __future__ import annotations

import functools
import glob
import os
import shlex
import shutil
import subprocess
import sys
import tempfile

__all__ = ["DEFAULT", "IsolationUnavailable", "command", "private_env", "require", "server_executable", "unavailable"]


class IsolationUnavailable(RuntimeError):
    """bwrap cannot isolate graded code on this machine, and the instructor did not pass ``--no-isolation``."""


def private_env(folder: str) -> dict[str, str]:
    """Where the tools graded code runs write their caches and settings: all inside ``folder``.

    ``KVCOURSE_CACHE`` keeps pointing at the grader's cache (read-only inside): the tokenizer is read from
    there rather than rebuilt in every kernel."""
    from ..loader import _cache_dir

    env = {
        name: folder
        for name in (
            "HOME",
            "TMPDIR",
            "XDG_CACHE_HOME",
            "XDG_CONFIG_HOME",
            "XDG_DATA_HOME",
            "MPLCONFIGDIR",
            "TRITON_CACHE_DIR",
            "IPYTHONDIR",
            "JUPYTER_RUNTIME_DIR",
        )
    }
    env["KVCOURSE_CACHE"] = str(_cache_dir())
    return env


def command(
    argv: list[str], writable: list[str], env: dict[str, str] | None = None, readable: list[str] = ()
) -> list[str]:
    """``argv`` as run under bwrap: a read-only view of everything but the folders in ``writable``.

    ``readable``: files and folders under ``/tmp`` it must still see (read-only), e.g. the notebook's folder."""
    if not argv:
        raise ValueError("argv must name a program to run")
    for place in readable:
        if not os.path.isabs(place) or not os.path.exists(place):
            raise ValueError(f"readable must hold existing absolute paths, got {place!r}")
    for folder in writable:
        if not os.path.isabs(folder) or not os.path.isdir(folder):
            raise ValueError(f"writable must hold existing absolute folders, got {folder!r}")
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise IsolationUnavailable("bubblewrap (bwrap) is not installed")
    args = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for device in sorted(glob.glob("/dev/nvidia*")):  # a kernel on a GPU machine uses CUDA
        args += ["--dev-bind", device, device]
    # After --tmpfs /tmp: a path under /tmp is bound into the new, empty one: what the caller names, and the
    # installation itself when it lives there (a checkout cloned into /tmp, its .venv and editable package).
    for place in [*_installation_under_tmp(), *readable]:
        args += ["--ro-bind", place, place]
    for folder in writable:
        args += ["--bind", folder, folder]
    args += ["--unshare-net", "--unshare-ipc", "--die-with-parent"]
    if os.geteuid() == 0:
        # bwrap keeps a root's capabilities: without this, the code inside could remount the view writable.
        # Switching users stays, for the sandbox's step down to ``nobody``.
        args += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    for name, value in (env or {}).items():
        args += ["--setenv", name, value]
    return [*args, "--", *argv]


def _installation_under_tmp() -> list[str]:
    """The folders directly under /tmp that hold the running Python, its environment, the kvcourse package or an
    import path: hidden by ``--tmpfs /tmp``, they are bound back read-only, or nothing could start."""
    import kvcourse

    tmp = os.path.realpath("/tmp") + os.sep
    places = [sys.prefix, sys.executable, os.path.dirname(os.path.dirname(kvcourse.__file__)), *sys.path]
    tops = set()
    for place in places:
        real = os.path.realpath(place) if place else ""
        if real.startswith(tmp):
            tops.add(tmp + real[len(tmp) :].split(os.sep)[0])
    return sorted(t for t in tops if os.path.exists(t))


@functools.lru_cache(maxsize=1)
def unavailable() -> str | None:
    """Why graded code cannot be isolated here, in one line; None when it can (bwrap ran a test sandbox)."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (bwrap) is not installed (Debian: apt-get install bubblewrap)"
    folder = tempfile.mkdtemp(prefix="kvcourse-isolation-")
    try:
        probe = command(
            [
                sys.executable,
                "-c",
                "import os, sys; open(sys.argv[1], 'w').write('ok');"
                "sys.exit(0 if not os.access('/usr', os.W_OK) else 3)",
                os.path.join(folder, "probe"),
            ],
            [folder],
        )
        done = subprocess.run(probe, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        if done.returncode != 0 or not os.path.exists(os.path.join(folder, "probe")):
            reason = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            return f"bwrap cannot start a sandbox here: {reason}"
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap cannot start a sandbox here: {type(exc).__name__}: {exc}"
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return None


DEFAULT = True  # what grading does when not told; only a test run on a machine without bwrap turns it off


def require(isolation: bool | None) -> bool:
    """Whether to isolate (``None``: :data:`DEFAULT`); :class:`IsolationUnavailable` when asked for and this
    machine cannot give it."""
    isolation = DEFAULT if isolation is None else isolation
    if not isinstance(isolation, bool):
        raise TypeError(f"isolation must be True, False or None, got {isolation!r}")
    reason = unavailable() if isolation else None
    if reason:
        raise IsolationUnavailable(
            f"graded code cannot be isolated: {reason}; graded cells could write into the "
            "Python installation and your home. Install bubblewrap, or pass --no-isolation "
            "to grade anyway (in a throwaway container)"
        )
    return isolation


def server_executable(writable: list[str], env: dict[str, str]) -> str:
    """A program that runs this Python under bwrap, for multiprocessing's fork server to start as its interpreter.

    It lives in a folder of its own, outside every ``writable`` one: graded code cannot rewrite what the
    grader runs when it starts the server again."""
    folder = tempfile.mkdtemp(prefix="kvcourse-server-")
    path = os.path.join(folder, "python-isolated")
    # Each forked process re-imports the grader's main script, when it is one (``python grade_all.py``): one in
    # /tmp must stay visible there.
    main = getattr(sys.modules["__main__"], "__file__", None)
    main = os.path.abspath(main) if main and os.path.isfile(main) else ""
    readable = [main] if main.startswith("/tmp/") else []
    inside = command([sys.executable], writable, env, readable)
    with open(path, "w", encoding="utf-8") as f:
        f.write("#!/bin/sh\nexec " + " ".join(shlex.quote(a) for a in inside) + ' "$@"\n')
    os.chmod(path, 0o700)
    return path
