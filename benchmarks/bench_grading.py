"""How long grading takes: one student's whole book, the reference solutions, with the grader's defaults.

    python benchmarks/bench_grading.py [--jobs N] [--json PATH]

Copies the book's chapter notebooks (the reference solutions) into a submissions folder of one student and
runs ``python -m kvcourse.instructor grade`` on it, as an instructor would: every notebook top to bottom in
its own kernel, then every exercise in its clean process. Records the wall time, each notebook's run time
and each check's (from the CSV), whether every exercise passed, the thread budget each kernel got, and
how many cores other processes kept busy meanwhile.

Issue 36's target: the whole reference book in at most 10 minutes on 2 cores. A class of 30 is estimated as
30 such runs one after another (the grader works through the notebooks of all students with the same
``--jobs``, so the time grows with the number of notebooks).
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from kvcourse.exercises.catalog import EXERCISES  # the catalog imports no check
from machine import OtherCPU, finish, machine_info

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--book", type=Path, default=ROOT / "book", help="the reference chapters (default book/)")
    parser.add_argument("--jobs", type=int, default=None, help="passed to grade --jobs (default: the grader's own)")
    parser.add_argument("--note", default="", help="recorded with the results, e.g. whether the machine was shared")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/cpu-grading-DATE.json)")
    args = parser.parse_args()
    chapters = sorted(args.book.glob("[0-9][0-9]_*.ipynb"))
    if not chapters:
        parser.error(f"no chapter notebooks in {args.book}")
    res = {**machine_info(), "cores": os.cpu_count(), "note": args.note, "jobs": args.jobs,
           "load_average_start": [round(x, 2) for x in os.getloadavg()]}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="kvcourse-bench-grading-") as tmp:
        student = Path(tmp) / "submissions" / "reference"
        student.mkdir(parents=True)
        for path in chapters:
            shutil.copy(path, student / path.name)
        out = Path(tmp) / "grades.csv"
        command = [
            sys.executable,
            "-m",
            "kvcourse.instructor",
            "grade",
            str(student.parent),
            "--out",
            str(out),
            "--book",
            str(args.book),
            "--quiet",
        ] + ([] if args.jobs is None else ["--jobs", str(args.jobs)])
        print("$", " ".join(command), file=sys.stderr)
        with OtherCPU() as load:
            start = time.perf_counter()
            done = subprocess.run(command, cwd=tmp, capture_output=True, text=True)
            wall = time.perf_counter() - start
        if done.returncode != 0:
            sys.exit(f"grade failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        with out.open() as f:
            rows = list(csv.DictReader(f))
    notebooks: dict[str, dict] = defaultdict(lambda: {"run_s": 0.0, "checks_s": 0.0, "passed": 0, "exercises": 0})
    for r in rows:
        nb = notebooks[r["notebook"].split("/")[-1]]
        nb["run_s"] = float(r["notebook_s"])
        nb["checks_s"] += float(r["check_s"])
        nb["passed"] += r["passed"] == "1"
        nb["exercises"] += 1
    res.update({
        "wall_s": round(wall, 1),
        "other_cores": round(load.cores, 2),
        "stderr_lines": [line for line in done.stderr.splitlines() if line.strip()][:20],
        "notebooks": {k: {kk: round(vv, 1) if isinstance(vv, float) else vv for kk, vv in v.items()}
                      for k, v in sorted(notebooks.items())},
        "exercises": len(rows),
        "passed": sum(r["passed"] == "1" for r in rows),
        "class_of_30_h_estimate": round(30 * wall / 3600, 2),
    })  # fmt: skip
    res["targets"] = {
        "reference_book_s": res["wall_s"],
        "reference_book_at_most_600_s": wall <= 600,
        "all_reference_exercises_pass": res["passed"] == res["exercises"] == len(EXERCISES),
    }
    for name, nb in res["notebooks"].items():
        print(
            f"  {name:34s} run {nb['run_s']:7.1f} s   checks {nb['checks_s']:6.1f} s   {nb['passed']}/{nb['exercises']}"
        )
    print(f"  whole book: {wall:.0f} s ({wall / 60:.1f} min); other processes kept {load.cores:.2f} cores busy")
    finish(res, args.json, "grading")


if __name__ == "__main__":
    main()
