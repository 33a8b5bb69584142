"""``python -m kvcourse.instructor {student,grade,points} ...``: see :mod:`kvcourse.instructor`."""

from __future__ import annotations

import argparse
import csv
import os
import sys
from pathlib import Path

from .chapters import CHAPTER
from .grade import finite_seconds, grade_directory, notebooks_under, rows_of, write_csv
from .student import student_copy


def _student(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    import nbformat

    if not args.book_dir.is_dir():
        parser.error(f"BOOK_DIR is not a folder: {args.book_dir}")
    chapters = sorted(p for p in args.book_dir.glob("*.ipynb") if CHAPTER.match(p.name))
    if not chapters:
        parser.error(f"no chapter notebooks (NN_name.ipynb) in {args.book_dir}")
    if args.out.resolve() == args.book_dir.resolve():
        parser.error("--out must not be BOOK_DIR: the copies would overwrite the chapters")
    args.out.mkdir(parents=True, exist_ok=True)
    for path in chapters:
        nb = nbformat.read(path, as_version=4)
        copy = nbformat.from_dict(student_copy(nb, path.name))
        nbformat.validate(copy)
        nbformat.write(copy, args.out / path.name)
        stubs = sum("exercise-answer" in c.metadata.get("tags", []) for c in copy.cells)
        print(f"{path} -> {args.out / path.name} ({stubs} solution cells replaced by stubs)")
    return 0


def _writable_file(path: Path) -> str | None:
    """Why ``path`` cannot be written as a file, or None: checked before hours of grading, not after."""
    if path.is_dir():
        return f"is a folder, not a file: {path}"
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is not a folder"
    if not os.access(parent, os.W_OK):
        return f"cannot be written: {parent} is not writable"
    if path.exists() and not os.access(path, os.W_OK):
        return f"cannot be written: {path} is read-only"
    return None


def _chapter_list(text: str) -> list[str]:
    """argparse type: ``"3,4"`` -> ``["03", "04"]``."""
    try:
        numbers = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected chapter numbers such as 3 or 3,4, got {text!r}") from None
    if not numbers or any(not 0 <= n <= 99 for n in numbers):
        raise argparse.ArgumentTypeError(f"expected chapter numbers from 1 to 99, such as 3 or 3,4, got {text!r}")
    return [f"{n:02d}" for n in numbers]


def _grade(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.dir.is_dir():
        parser.error(f"DIR is not a folder: {args.dir}")
    if args.book is not None and not args.book.is_dir():
        parser.error(f"--book is not a folder: {args.book}")
    if not notebooks_under(args.dir):
        parser.error(f"DIR has no notebooks (*.ipynb), nor its subfolders: {args.dir}")
    problem = _writable_file(args.out)
    if problem:
        parser.error(f"--out {problem}")
    if args.reports is not None and (args.reports.exists() and not args.reports.is_dir()):
        parser.error(f"--reports is not a folder: {args.reports}")
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    from .chapters import reference_chapters

    try:
        reference_chapters(args.book, args.chapters)  # a chapter the list lacks is named before any grading
    except ValueError as exc:
        parser.error(f"--chapters: {exc}")
    from .isolation import IsolationUnavailable, require

    try:
        require(not args.no_isolation)
    except IsolationUnavailable as exc:
        print(f"error: {exc}", file=sys.stderr)  # one line, before any notebook runs
        return 2
    import warnings

    with warnings.catch_warnings(record=True) as caught:  # one line each on stderr, not warnings' two
        warnings.simplefilter("always", RuntimeWarning)
        results = grade_directory(args.dir, args.book, args.timeout, jobs=args.jobs, run=not args.no_run,
                                  check_timeout=args.check_timeout, progress=not args.quiet, chapters=args.chapters,
                                  isolation=not args.no_isolation)  # fmt: skip
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)
    rows = rows_of(results)
    write_csv(rows, args.out, {r.notebook: r.run_seconds for r in results})
    for result in results:
        if result.rows:
            print(f"{result.notebook}: {sum(r.passed for r in result.rows)} of {len(result.rows)} exercises passed")
        for note in result.notes if not result.rows else [n for n in result.notes if "more than once" in n]:
            print(f"{result.notebook}: {note}")
    print(f"{len(rows)} rows -> {args.out}")
    if args.reports is not None:
        from .report import write_class_summary, write_student_reports

        flat = args.dir.resolve().name
        pages = write_student_reports(results, args.reports, flat)
        summary, plot = write_class_summary(results, args.reports, flat)
        print(f"{len(pages) // 2} student reports, {summary.name} and {plot.name} -> {args.reports}")
    return 0  # students failing is a result, not an error


def _points(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from .classroom import output_line, read_grades

    if not args.grades.is_file():
        parser.error(f"GRADES is not a file: {args.grades}")
    try:
        rows = read_grades(args.grades)
    except (ValueError, UnicodeDecodeError, csv.Error) as exc:
        parser.error(str(exc))
    print(output_line(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.instructor", description="Hand out the chapters without solutions, and grade them."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    student = commands.add_parser("student", help="write student copies of the chapter notebooks")
    student.add_argument("book_dir", type=Path, metavar="BOOK_DIR", help="folder with the chapter notebooks")
    student.add_argument("--out", type=Path, required=True, help="folder for the student copies")
    grade = commands.add_parser("grade", help="run submitted notebooks and write one CSV row per exercise")
    arg = grade.add_argument
    arg("dir", type=Path, metavar="DIR", help="the submitted notebooks, or one subfolder of them per student")
    arg("--out", type=Path, required=True, help="the CSV file to write")
    arg("--book", type=Path, help="the reference chapters: lists every exercise and reports missing notebooks")
    arg("--chapters", type=_chapter_list, help="grade only these chapters, e.g. 3 or 3,4 (default: every chapter; "
        "a chapter a submission lacks counts as zero)")  # fmt: skip
    arg("--timeout", type=finite_seconds, default=1800,
        help="seconds allowed to run each notebook top to bottom (default 1800)")  # fmt: skip
    arg("--check-timeout", type=finite_seconds, default=300,
        help="seconds allowed to grade one exercise in its clean process (default 300)")  # fmt: skip
    arg("--jobs", type=int, help="notebooks graded side by side (default: one per CPU core, as memory allows)")
    arg("--reports", type=Path, help="folder for one feedback page per student, a class summary and a pass-rate plot")
    arg("--no-run", action="store_true", help="grade the exercises without first running each notebook top to bottom")
    arg("--no-isolation", action="store_true", help="grade where bubblewrap (bwrap) cannot isolate the graded code: "
        "it then runs with your permissions and could write into the Python installation and your home")  # fmt: skip
    arg("--quiet", action="store_true", help="no progress bar")
    points = commands.add_parser("points", help="a grades CSV as GitHub Classroom's autograding result")
    points.add_argument("grades", type=Path, metavar="GRADES", help="the CSV written by grade")
    args = parser.parse_args(argv)
    run = {"student": _student, "grade": _grade, "points": _points}[args.command]
    return run(args, parser)


if __name__ == "__main__":
    sys.exit(main())
