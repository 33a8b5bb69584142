"""Checks for the end-of-chapter exercises, one module per chapter.

Each ``check_*`` function takes the learner's answer (a number, a function, a
tensor...), prints a short confirmation when it is right, and raises
:class:`ExerciseError` with a hint when it is wrong, so the same call works in a
notebook and in an instructor's grading script::

    from kvcourse.exercises import ch01
    ch01.check_total_kv_projections(my_function)

Instructors: ``python -m kvcourse.instructor student book --out student/`` writes
copies of the chapters with every solution replaced by a stub, and
``python -m kvcourse.instructor grade DIR --out grades.csv`` grades the students'
notebooks, every exercise by the check :mod:`.catalog` names for it, outside the
students' reach (see :mod:`kvcourse.instructor`).
"""

from ._core import ExerciseError, passed

__all__ = ["ExerciseError", "passed"]
