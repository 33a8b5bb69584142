"""Tools for instructors: hand out the chapters without solutions, then grade what comes back.

    python -m kvcourse.instructor student BOOK_DIR --out DIR          # solution-free copies
    python -m kvcourse.instructor grade DIR --out grades.csv [--book BOOK_DIR] [--reports DIR] [--jobs N]

* :mod:`.notebook` reads a chapter's exercises: each ``{exercise}`` directive with its label, the
  code cells that belong to it, and which of them are solutions.
* :mod:`.student` writes the student copy: every solution cell becomes a stub that raises
  ``NotImplementedError`` with a hint, solutions and dropdowns leave the text, outputs are cleared.
* :mod:`.grade` runs each submitted notebook headless, then grades every exercise on its own:
  :mod:`.checker` runs the exercise's check (named by :mod:`kvcourse.exercises.catalog`) in the
  grader's process on what the student's cells define in a fresh :mod:`.sandbox` process, the two
  talking through :mod:`.wire` (data and proxies, never code); one CSV row per notebook and exercise.
* :mod:`.isolation` runs the notebook's kernel and the sandboxes under bubblewrap: a read-only view of the file
  system but for their private folders, no network; the grader refuses to grade without it unless told
  ``--no-isolation``.
* :mod:`.report` writes a feedback page per student, a class summary and a plot of pass rates.
"""

from .grade import NotebookResult, Row, grade_directory, grade_notebook
from .notebook import Exercise, find_exercises
from .student import make_stub, student_copy

__all__ = [
    "Exercise",
    "NotebookResult",
    "Row",
    "find_exercises",
    "grade_directory",
    "grade_notebook",
    "make_stub",
    "student_copy",
]
