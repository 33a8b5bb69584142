"""Tools for instructors: hand out the chapters without solutions, then grade what comes back.

    python -m kvcourse.instructor student BOOK_DIR --out DIR          # solution-free copies
    python -m kvcourse.instructor grade DIR --out grades.csv [--book BOOK_DIR] [--timeout 1800]

* :mod:`.notebook` reads a chapter's exercises: each ``{exercise}`` directive with its label, the
  code cells that belong to it, and which of them are solutions.
* :mod:`.student` writes the student copy: every solution cell becomes a stub that raises
  ``NotImplementedError`` with a hint, solutions and dropdowns leave the text, outputs are cleared.
* :mod:`.grade` runs each submitted notebook headless and writes one CSV row per notebook and
  exercise; :mod:`.recorder` is what it installs in the kernel to see every check's verdict.
"""

from .grade import Row, grade_directory, grade_notebook
from .notebook import Exercise, find_exercises
from .student import make_stub, student_copy

__all__ = ["Exercise", "Row", "find_exercises", "grade_directory", "grade_notebook", "make_stub", "student_copy"]
