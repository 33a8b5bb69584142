"""The checks in effect are the ones installed: kvcourse's files, hashed before any student code runs.

Graded code runs with a read-only view of the installation (:mod:`.isolation`); with ``--no-isolation`` it
runs with the grader's permissions unless the grader drops them (:mod:`.sandbox` does, when it runs as
root), and these hashes are what stands guard. A cell that appends
``def check_max_sequences(...): return passed(...)`` to
``kvcourse/exercises/ch03.py`` would, in an earlier grader, have passed that exercise for every
student graded after it. So the grader:

1. imports every check module, and what the checks import, before the first notebook runs
   (:func:`load_checks`): later edits to the files cannot change the code in effect;
2. hashes every ``.py`` file of the installed package at the same moment (:func:`snapshot`);
3. compares after each notebook (:func:`changed`) and stops the run, naming the files and the
   notebook, if anything changed: reinstall kvcourse before grading again;
4. warns when the package folder is writable by the user grading (:func:`writable_installation`).

Before the first notebook, the files are also compared with what the installer recorded
(:func:`unrecorded_changes`): a wheel's ``RECORD`` holds every file's SHA-256, so a kvcourse installed with
``pip install`` that an earlier run changed is refused. An editable install (``make setup``, a clone)
records no hashes: there, only changes during the run are caught, so grade from a fresh installation, in
a container, as GitHub Classroom does.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import importlib.metadata
import os
from pathlib import Path

__all__ = [
    "InstallationChanged",
    "changed",
    "load_checks",
    "package_dir",
    "recorded_hashes",
    "snapshot",
    "unrecorded_changes",
    "writable_installation",
]


class InstallationChanged(RuntimeError):
    """kvcourse's files changed while grading: graded code wrote into the installation."""


def package_dir() -> Path:
    import kvcourse

    return Path(kvcourse.__file__).resolve().parent


# What checks import inside their functions, not at the top of their module (tests/test_integrity.py lists them).
_IMPORTED_BY_CHECKS = ("kvcourse.generation", "kvcourse.serving", "kvcourse.serving.engine", "kvcourse.utils")


def load_checks() -> list[str]:
    """Import every module that holds a check, from the catalog; their names."""
    from ..exercises.catalog import EXERCISES

    names = sorted({f"kvcourse.exercises.{spec.chapter}" for spec in EXERCISES.values()})
    names += list(_IMPORTED_BY_CHECKS)
    for name in names:
        importlib.import_module(name)
    return names


def snapshot(root: Path | None = None) -> dict[str, str]:
    """SHA-256 of every ``.py`` file under ``root`` (the installed package), by relative path."""
    root = package_dir() if root is None else root
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*.py"))
        if "__pycache__" not in p.parts
    }


def changed(before: dict[str, str], root: Path | None = None) -> list[str]:
    """The files added, removed or modified since ``before`` was taken."""
    now = snapshot(root)
    return sorted(name for name in before.keys() | now.keys() if before.get(name) != now.get(name))


def writable_installation(root: Path | None = None) -> list[str]:
    """The package's folders and check files this process could write, relative to the package."""
    root = package_dir() if root is None else root
    places = [root, root / "exercises", root / "instructor", *sorted((root / "exercises").glob("*.py"))]
    return [("." if p == root else p.relative_to(root).as_posix()) for p in places if os.access(p, os.W_OK)]


def recorded_hashes(
    dist: importlib.metadata.Distribution | None = None, package: str = "kvcourse"
) -> dict[str, str] | None:
    """The SHA-256 (hex) the installer recorded for each ``.py`` file of the package, by path relative to it;
    None when it recorded none (an editable install or a source checkout)."""
    dist = importlib.metadata.distribution(package) if dist is None else dist
    recorded = {}
    for f in dist.files or []:
        name = f.as_posix()
        if f.hash is not None and f.hash.mode == "sha256" and name.startswith(f"{package}/") and name.endswith(".py"):
            digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            recorded[name[len(package) + 1 :]] = digest.hex()
    return recorded or None


def unrecorded_changes(installed: dict[str, str], recorded: dict[str, str] | None) -> list[str]:
    """Files whose hash differs from the installer's record, and files it never installed; [] with no record."""
    if recorded is None:
        return []
    return sorted(name for name in installed.keys() | recorded.keys() if installed.get(name) != recorded.get(name))
