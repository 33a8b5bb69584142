"""Points for GitHub Classroom: a grades CSV as the result its autograding reporter reads.

``.github/workflows/classroom.yml`` grades a student's repository, then runs
``python -m kvcourse.instructor points grades.csv >> "$GITHUB_OUTPUT"``: one line ``result=...``, the
base64 of a JSON document in the format of GitHub Classroom's runners (``version``, ``status``,
``max_score``, one entry per test), which ``classroom-resources/autograding-grading-reporter`` turns
into points: one per exercise, scored as the share of exercises passed.
"""

from __future__ import annotations

import base64
import csv
import json
from pathlib import Path

__all__ = ["read_grades", "autograding_result", "output_line"]


def read_grades(path: Path) -> list[dict[str, str]]:
    """The rows of a grades CSV written by ``grade``; ``ValueError`` naming the file if it is not one."""
    with path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    if not rows or not {"notebook", "exercise", "passed", "message"} <= set(rows[0]):
        raise ValueError(f"{path} is not a grades CSV (notebook, exercise, passed, message) with at least one row")
    return rows


def autograding_result(rows: list[dict[str, str]]) -> dict:
    """The runner result GitHub Classroom's reporter reads: one test per exercise, one point each."""
    tests = []
    for row in rows:
        passed = row["passed"] == "1"
        tests.append(
            {
                "name": f"{row['notebook']}: {row['exercise']}",
                "status": "pass" if passed else "fail",
                "message": "" if passed else row["message"],
                "line_no": 0,
                "filename": row["notebook"],
                "test_code": f"python -m kvcourse.instructor grade ({row['exercise']})",
                "score": int(passed),
            }
        )
    status = "pass" if all(t["status"] == "pass" for t in tests) else "fail"
    return {"version": 1, "status": status, "max_score": len(tests), "tests": tests}


def output_line(rows: list[dict[str, str]]) -> str:
    """``result=<base64 JSON>``, a line for ``$GITHUB_OUTPUT``."""
    payload = json.dumps(autograding_result(rows), separators=(",", ":")).encode()
    return "result=" + base64.b64encode(payload).decode()
