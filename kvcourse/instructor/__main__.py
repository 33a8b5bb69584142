"""``python -m kvcourse.instructor {student,grade} ...``: see :mod:`kvcourse.instructor`."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .grade import CHAPTER, grade_directory, write_csv
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
        copy = nbformat.from_dict(student_copy(nb))
        nbformat.validate(copy)
        nbformat.write(copy, args.out / path.name)
        stubs = sum("exercise-answer" in c.metadata.get("tags", []) for c in copy.cells)
        print(f"{path} -> {args.out / path.name} ({stubs} solution cells replaced by stubs)")
    return 0


def _grade(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if not args.dir.is_dir():
        parser.error(f"DIR is not a folder: {args.dir}")
    if args.book is not None and not args.book.is_dir():
        parser.error(f"--book is not a folder: {args.book}")
    if args.timeout <= 0:
        parser.error(f"--timeout must be a positive number of seconds, got {args.timeout}")
    rows = grade_directory(args.dir, args.book, args.timeout)
    write_csv(rows, args.out)
    notebooks: dict[str, list[bool]] = {}
    for row in rows:
        notebooks.setdefault(row.notebook, []).append(row.passed)
    for name, results in notebooks.items():
        print(f"{name}: {sum(results)} of {len(results)} exercises passed")
    print(f"{len(rows)} rows -> {args.out}")
    return 0  # students failing is a result, not an error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.instructor",
                                     description="Hand out the chapters without solutions, and grade them.")
    commands = parser.add_subparsers(dest="command", required=True)
    student = commands.add_parser("student", help="write student copies of the chapter notebooks")
    student.add_argument("book_dir", type=Path, metavar="BOOK_DIR", help="folder with the chapter notebooks")
    student.add_argument("--out", type=Path, required=True, help="folder for the student copies")
    grade = commands.add_parser("grade", help="run submitted notebooks and write one CSV row per exercise")
    grade.add_argument("dir", type=Path, metavar="DIR",
                       help="the submitted notebooks, or one subfolder of them per student")
    grade.add_argument("--out", type=Path, required=True, help="the CSV file to write")
    grade.add_argument("--book", type=Path, default=None,
                       help="the reference chapters: lists every exercise and reports missing notebooks")
    grade.add_argument("--timeout", type=float, default=1800, help="seconds allowed per notebook (default 1800)")
    args = parser.parse_args(argv)
    return _student(args, parser) if args.command == "student" else _grade(args, parser)


if __name__ == "__main__":
    sys.exit(main())
