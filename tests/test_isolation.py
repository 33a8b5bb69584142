"""What a submission leaves behind (issue 47, item 7): nothing. Graded code, in the notebook's kernel and in
the sandboxes, sees the file system read-only but for its private folders, and has no network; where that
isolation cannot be had, the grader refuses to grade unless told ``--no-isolation``.

Without bubblewrap these tests skip and say why, unless ``KVCOURSE_REQUIRE_ISOLATION=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import nbformat
import pytest

import kvcourse
from kvcourse.instructor import isolation
from kvcourse.instructor.__main__ import main

from .conftest import ISOLATION_REQUIRED, isolation_missing
from .test_instructor import MASK, _book, _code, _read_csv, _synthetic

needs_isolation = pytest.mark.skipif(
    bool(isolation_missing()) and not ISOLATION_REQUIRED, reason=f"no isolation here: {isolation_missing()}"
)


@pytest.fixture
def home(monkeypatch):
    """The instructor's home, outside /tmp (the isolated processes get a /tmp of their own, and would not see
    a home there at all): what they must see, and not be able to write."""
    base = "/var/tmp" if os.access("/var/tmp", os.W_OK) else None
    folder = Path(tempfile.mkdtemp(prefix="kvcourse-home-", dir=base))
    monkeypatch.setenv("HOME", str(folder))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _targets(home: Path) -> list[Path]:
    """Where an attack writes: a ``.pth`` run by every later Python, a module in the package, a file at home."""
    token = secrets.token_hex(4)
    return [
        Path(sysconfig.get_paths()["purelib"]) / f"kvcourse_graded_{token}.pth",
        Path(kvcourse.__file__).resolve().parent / f"graded_{token}.py",
        home / f"graded_{token}.txt",
    ]


def _attack(targets: list[Path]) -> str:
    """A cell that writes every target and then raises what each write did: the grader reports that."""
    return (
        f"import os\nresults = []\nfor target in {[str(t) for t in targets]!r}:\n"
        "    try:\n"
        "        with open(target, 'w') as f:\n"
        "            f.write('# written by a graded cell\\n')\n"
        "        results.append('wrote ' + target)\n"
        "    except OSError as exc:\n"
        "        results.append(type(exc).__name__ + ': ' + exc.strerror)\n"
        "raise RuntimeError(' | '.join(results))\n"
    )


@needs_isolation
@pytest.mark.parametrize("mode", ["--no-run", "run top to bottom"])
def test_a_submission_leaves_nothing_behind(tmp_path, home, mode):
    targets = _targets(home)
    nb = _synthetic()
    nb.cells.insert(2, _code(_attack(targets)))  # in the notebook's kernel, when it runs
    nb.cells[4].source = _attack(targets) + MASK  # the mask's solution cell: in its sandbox
    (tmp_path / "sub").mkdir()
    nbformat.write(nb, tmp_path / "sub" / "99_synthetic.ipynb")
    out, reports = tmp_path / "grades.csv", tmp_path / "reports"
    try:
        args = [
            "grade",
            str(tmp_path / "sub"),
            "--out",
            str(out),
            "--book",
            str(_book(tmp_path)),
            "--quiet",
            "--reports",
            str(reports),
            "--timeout",
            "300",
            "--check-timeout",
            "120",
        ]
        assert main(args + (["--no-run"] if mode == "--no-run" else [])) == 0
        left = [str(t) for t in targets if t.exists()]
        assert left == [], f"graded code left {left}"
        passed, message = _read_csv(out)[("99_synthetic.ipynb", "ch01-ex-mask")]
        # every write was tried, and refused by the read-only view
        assert passed == "0" and message.count("OSError: Read-only file system") == 3, message
        page = (reports / "sub.md").read_text()
        if mode == "run top to bottom":
            assert page.count("OSError: Read-only file system") >= 6, page  # the kernel's cell, then the sandbox's
        assert _read_csv(out)[("99_synthetic.ipynb", "ch02-ex-outweigh")] == ("1", "ok")
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@needs_isolation
def test_isolated_code_has_no_network_and_cannot_make_the_view_writable(tmp_path):
    probe = (
        "import os, socket, subprocess\n"
        "try:\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=2)\n"
        "    print('connected')\n"
        "except OSError as exc:\n"
        "    print('no network' if exc.errno in (101, 99, 111) else repr(exc))\n"
        "print(sorted(os.listdir('/sys/class/net')) if os.path.isdir('/sys/class/net') else ['lo'])\n"
        "try:\n"
        "    subprocess.run(['mount', '-o', 'remount,bind,rw', '/usr'], capture_output=True)\n"
        "except OSError:\n"
        "    pass\n"
        "print('remounted' if os.access('/usr', os.W_OK) else 'stays read-only')\n"
    )
    folder = tempfile.mkdtemp(prefix="kvcourse-probe-")
    try:
        done = subprocess.run(
            isolation.command([sys.executable, "-c", probe], [folder]), capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines[0] == "no network" and lines[2] == "stays read-only", (
        done.stdout,
        done.stderr,
    )


def test_grading_is_refused_without_isolation_unless_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(isolation, "unavailable", lambda: "bubblewrap (bwrap) is not installed")
    (tmp_path / "sub").mkdir()
    nbformat.write(_synthetic(), tmp_path / "sub" / "99_synthetic.ipynb")
    out = tmp_path / "grades.csv"
    args = ["grade", str(tmp_path / "sub"), "--out", str(out), "--book", str(_book(tmp_path)), "--quiet", "--no-run"]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bwrap) is not installed" in err and "--no-isolation" in err, err
    assert not out.exists()
    from kvcourse.instructor import grade_notebook

    with pytest.raises(isolation.IsolationUnavailable, match="--no-isolation"):
        grade_notebook(tmp_path / "sub" / "99_synthetic.ipynb", isolation=True)
    assert main(args + ["--no-isolation"]) == 0  # the instructor's explicit choice
    assert all(passed == "1" for passed, _ in _read_csv(out).values())


def test_isolation_must_be_a_bool():
    with pytest.raises(TypeError, match="isolation"):
        isolation.require("yes")
    with pytest.raises(ValueError, match="writable"):
        isolation.command(["true"], ["relative/folder"])


def test_every_test_the_instructors_page_names_exists():
    # "What the grader guarantees": a line is backed by the test its source names (<!-- test: FILE::NAME -->).
    import ast
    import re

    root = Path(__file__).resolve().parents[1]
    named = re.findall(r"<!-- test: (tests/\w+\.py)::(\w+) -->", (root / "book" / "instructors.md").read_text())
    assert ("tests/test_isolation.py", "test_a_submission_leaves_nothing_behind") in named
    for path, name in named:
        tree = ast.parse((root / path).read_text())
        assert name in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, f"{path}::{name} is no test"
