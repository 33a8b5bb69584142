"""Which submitted notebook is which chapter: one set of rows per chapter, whatever a student hands in.

A score is a share of the course's exercises, so it is always counted against the **reference list**:
every chapter of the course (or of ``--book``, or those ``--chapters`` names), every exercise of each.
What a student hands in only decides which notebook grades which chapter:

* a notebook belongs to chapter ``NN`` when its file name holds ``NN_`` (``03_memory.ipynb``, the
  browser's re-download ``03_memory (1).ipynb``, Colab's ``Copy of 03_memory.ipynb``);
* one notebook is graded per chapter: the one named as the book names it, else the shallowest, else
  the first by path; the others are reported as duplicates and graded nowhere, so handing in three
  copies of a solved chapter scores it once;
* a chapter with no notebook gets a failed row for each of its exercises (it counts as zero);
* a notebook that is no chapter of the list is reported, not graded.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from ..exercises.catalog import EXERCISES, NOTEBOOKS

__all__ = ["CHAPTER", "Chapter", "Assignment", "assign", "chapter_number", "reference_chapters"]

CHAPTER = re.compile(r"^\d\d_.*\.ipynb$")  # the book's chapter notebooks: 01_naive_generation.ipynb, ...
_NUMBER = re.compile(r"(?<!\d)(\d\d)_")


@dataclass(frozen=True)
class Chapter:
    """A chapter of the reference list: its number (``"03"``), notebook name and exercise labels, in order."""

    number: str
    notebook: str
    labels: tuple[str, ...]


@dataclass
class Assignment:
    """One submission folder, matched against the reference list."""

    graded: dict[str, Path] = field(default_factory=dict)  # chapter number -> the notebook that grades it
    duplicates: dict[str, list[Path]] = field(default_factory=dict)  # chapter number -> notebooks not graded
    missing: list[str] = field(default_factory=list)  # chapter numbers with no notebook
    strays: list[Path] = field(default_factory=list)  # notebooks that are no chapter of the list


def chapter_number(filename: str) -> str | None:
    """``"03"`` for ``03_memory.ipynb``, ``03_memory (1).ipynb`` or ``Copy of 03_memory.ipynb``; None if no ``NN_``."""
    match = _NUMBER.search(filename)
    return match.group(1) if match else None


def reference_chapters(book: Path | None = None, chapters: list[str] | None = None) -> dict[str, Chapter]:
    """The chapters every submission is graded against, by number.

    From ``book`` (its ``NN_name.ipynb`` notebooks that hold exercises), else from the catalog (the
    course's own chapters). ``chapters``: only these numbers (``["03"]`` for a chapter-3 assignment);
    ``ValueError`` naming any the list does not have.
    """
    found: dict[str, Chapter] = {}
    if book is not None:
        import nbformat

        from .notebook import find_exercises

        for path in sorted(book.glob("*.ipynb")):
            if not CHAPTER.match(path.name):
                continue
            labels = tuple(e.label for e in find_exercises(nbformat.read(path, as_version=4)))
            if labels:
                found[path.name[:2]] = Chapter(path.name[:2], path.name, labels)
    else:
        by_chapter: dict[str, list[str]] = defaultdict(list)
        for label in EXERCISES:
            by_chapter[label[2:4]].append(label)  # "ch03-ex-fit" -> "03"
        for number, labels in sorted(by_chapter.items()):
            found[number] = Chapter(number, NOTEBOOKS[f"ch{number}"], tuple(labels))
    if chapters is not None:
        unknown = [c for c in chapters if c not in found]
        if unknown:
            raise ValueError(f"chapters {unknown} are not in the reference list (it has {sorted(found)})")
        found = {c: found[c] for c in sorted(set(chapters))}
    return found


def assign(folder: Path, notebooks: list[Path], reference: dict[str, Chapter]) -> Assignment:
    """Match the ``notebooks`` of one submission ``folder`` to the chapters of ``reference``."""
    by_number: dict[str, list[Path]] = defaultdict(list)
    result = Assignment()
    for path in notebooks:
        number = chapter_number(path.name)
        if number in reference:
            by_number[number].append(path)
        else:
            result.strays.append(path)
    for number, chapter in reference.items():
        candidates = by_number.get(number)
        if not candidates:
            result.missing.append(number)
            continue
        ranked = sorted(candidates, key=lambda p: (p.name != chapter.notebook, len(p.relative_to(folder).parts),
                                                   p.relative_to(folder).as_posix()))  # fmt: skip
        result.graded[number] = ranked[0]
        if len(ranked) > 1:
            result.duplicates[number] = ranked[1:]
    return result
