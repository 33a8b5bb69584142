"""One student's code cannot change another's grade (issue 36, item 4): the checks in effect are those
installed when grading started, a change to the installation stops the run, and each sandbox runs in a
folder of its own, deleted afterwards, as ``nobody`` when the grader is root."""

from __future__ import annotations

import ast
import os
import shutil
import tempfile
from pathlib import Path

import nbformat
import pytest

import kvcourse
from kvcourse.instructor import integrity
from kvcourse.instructor.grade import grade_directory
from kvcourse.instructor.sandbox import nobody_can_run

from .test_instructor import MASK, _book, _cheat, _code, _synthetic

PACKAGE = Path(kvcourse.__file__).resolve().parent
ROOT = os.geteuid() == 0
DROPS_ROOT = ROOT and nobody_can_run()  # not where Python lives in root's home (pyenv in /root)


def test_every_module_a_check_imports_is_imported_before_grading():
    # a check that imports inside its function would otherwise read the file when it first runs, after
    # student code had its chance to change it
    lazily = set()
    for path in sorted((PACKAGE / "exercises").glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(fn):
                if isinstance(node, ast.ImportFrom) and node.level == 2:  # from ..serving import Engine
                    lazily.add(f"kvcourse.{node.module}")
                elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvcourse"):
                    lazily.add(node.module)
                elif isinstance(node, ast.Import):
                    lazily |= {a.name for a in node.names if a.name.startswith("kvcourse")}
    loaded = set(integrity.load_checks())
    assert {f"kvcourse.exercises.ch0{n}" for n in range(1, 9)} <= loaded
    assert lazily - loaded - {"kvcourse", "kvcourse.exercises"} == set()


def test_a_change_to_any_file_of_the_package_is_found(tmp_path):
    root = tmp_path / "pkg"
    shutil.copytree(PACKAGE / "exercises", root / "exercises")
    (root / "model.py").write_text("x = 1\n")
    before = integrity.snapshot(root)
    assert "exercises/ch03.py" in before and integrity.changed(before, root) == []
    with (root / "exercises" / "ch03.py").open("a") as f:
        f.write("\ndef check_max_sequences(*a, **k):\n    return True\n")
    (root / "model.py").unlink()
    (root / "evil.py").write_text("")
    assert integrity.changed(before, root) == ["evil.py", "exercises/ch03.py", "model.py"]


def test_a_notebook_that_writes_into_the_installation_stops_the_run(tmp_path, monkeypatch):
    # The attack of the issue: a graded cell appends a passing check to chapter 3's checks. Here the
    # "installation" is a copy (the cell runs as the grader in the notebook's kernel and could write the real one).
    copy = tmp_path / "installed"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "results", "*.json", "*.png"))
    monkeypatch.setattr(integrity, "package_dir", lambda: copy)
    target = copy / "exercises" / "ch03.py"
    nb = _synthetic()
    nb.cells.insert(
        2, _code(f"open({str(target)!r}, 'a').write('\\ndef check_max_sequences(*a, **k):\\n    return True\\n')")
    )
    subs = tmp_path / "subs"
    for student in ("mallory", "zed"):
        (subs / student).mkdir(parents=True)
        nbformat.write(nb if student == "mallory" else _synthetic(), subs / student / "99_synthetic.ipynb")
    # Without isolation (--no-isolation), the hashes are what stands guard; isolated, the write fails
    # (tests/test_isolation.py).
    with pytest.warns(RuntimeWarning, match="could write"), pytest.raises(integrity.InstallationChanged) as exc:
        grade_directory(subs, _book(tmp_path), timeout=120, jobs=1, check_timeout=60, isolation=False)
    message = str(exc.value)
    assert "exercises/ch03.py" in message and "mallory/99_synthetic.ipynb" in message and "zed" not in message


def test_no_warning_where_the_installation_is_read_only(tmp_path, monkeypatch):
    import warnings

    monkeypatch.setattr(integrity, "writable_installation", lambda root=None: [])
    (tmp_path / "sub").mkdir()
    nbformat.write(_synthetic(), tmp_path / "sub" / "99_synthetic.ipynb")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        (result,) = grade_directory(tmp_path / "sub", _book(tmp_path), run=False, jobs=1, check_timeout=60)
    assert all(r.passed for r in result.rows)


def _shared_folder() -> Path:
    """A folder any user may write (a sandbox may run as nobody, who cannot enter pytest's tmp_path)."""
    folder = Path(tempfile.mkdtemp(prefix="kvcourse-test-"))
    folder.chmod(0o777)
    return folder


def test_each_sandbox_has_a_folder_of_its_own_that_the_next_never_sees():
    # The folder's name comes back in the answer's own error: an isolated sandbox can write no file out here.
    first = "import os\nopen('note.txt', 'w').write('for the next student')\nraise RuntimeError(os.getcwd() + '|')\n"
    verdict = _cheat("ch01-ex-mask", first)
    where = Path(verdict.message.split("RuntimeError at line 3: ")[1].split("|")[0])
    assert where.name.startswith("kvcourse-sandbox-"), verdict.message
    assert not where.exists(), "the sandbox's folder outlived it"
    second = "note = open('note.txt').read()\n" + MASK
    verdict = _cheat("ch01-ex-mask", second)
    assert not verdict.passed and "FileNotFoundError" in verdict.message, verdict.message


@pytest.mark.skipif(
    not DROPS_ROOT,
    reason="the sandbox drops root only when the grader has it and nobody can read Python, torch and kvcourse",
)
def test_a_sandbox_started_by_root_runs_as_nobody_and_cannot_write_the_graders_files():
    # The layer under the isolation, tested without it: the uid comes back through a shared folder.
    shared = _shared_folder()
    owned = shared / "graders_file.py"  # stands for the installation: root's, readable by all
    owned.write_text("# the grader's\n")
    owned.chmod(0o644)
    try:
        who = f"import os\nopen({str(shared / 'uid')!r}, 'w').write(str(os.getuid()))\n" + MASK
        assert _cheat("ch01-ex-mask", who, isolation=False).passed
        assert (shared / "uid").read_text() == "65534"
        attack = f"open({str(owned)!r}, 'a').write('def check_causal_mask(fn):\\n    return True\\n')\n" + MASK
        verdict = _cheat("ch01-ex-mask", attack, isolation=False)
        assert not verdict.passed and "PermissionError" in verdict.message, verdict.message
        assert owned.read_text() == "# the grader's\n"
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_nobody_can_run_sees_a_closed_folder_on_the_way(tmp_path, monkeypatch):
    import kvcourse.instructor.sandbox as sandbox

    private = tmp_path / "home"
    (private / "lib").mkdir(parents=True)
    private.chmod(0o700)  # pyenv's home: root may enter, others may not
    monkeypatch.setattr(os, "__file__", str(private / "lib" / "os.py"))
    assert not sandbox.nobody_can_run()


def test_files_are_checked_against_the_installers_record(tmp_path):
    # A wheel's RECORD holds each file's SHA-256: an installation an earlier run changed is refused before grading.
    import base64
    import hashlib
    import importlib.metadata

    package = tmp_path / "kvcourse"
    (package / "exercises").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "exercises" / "ch03.py").write_text("def check_max_sequences(n):\n    ...\n")
    info = tmp_path / "kvcourse-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvcourse\nVersion: 0.1.0\n")
    lines = []
    for path in sorted(package.rglob("*.py")):
        digest = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
        lines.append(f"{path.relative_to(tmp_path).as_posix()},sha256={digest},{path.stat().st_size}")
    (info / "RECORD").write_text("\n".join(lines + ["kvcourse-0.1.0.dist-info/RECORD,,"]) + "\n")
    dist = importlib.metadata.PathDistribution(info)
    recorded = integrity.recorded_hashes(dist)
    assert recorded == integrity.snapshot(package) and set(recorded) == {"__init__.py", "exercises/ch03.py"}
    assert integrity.unrecorded_changes(integrity.snapshot(package), recorded) == []
    with (package / "exercises" / "ch03.py").open("a") as f:
        f.write("    return True\n")
    (package / "helper.py").write_text("")
    assert integrity.unrecorded_changes(integrity.snapshot(package), recorded) == ["exercises/ch03.py", "helper.py"]
    assert integrity.unrecorded_changes(integrity.snapshot(package), None) == []  # an editable install records none
