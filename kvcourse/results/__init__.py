"""The committed benchmark results that the book plots, shipped inside the package.

``make bench`` (and ``make gpu-check`` on a GPU) write JSON files here; ``benchmarks/results`` in the
repository is a link to this folder. Because they are package data, every chapter reads them offline
with :mod:`importlib.resources`, in a clone, on a laptop and on Colab alike (pip installs them with
the package), and a result committed later reaches learners with the next install: nothing is ever
fetched over the network.
"""

from __future__ import annotations

import fnmatch
import json
from importlib import resources

__all__ = ["find", "load", "newest"]


def _folder():
    return resources.files(__name__)


def find(pattern: str = "*.json") -> list[str]:
    """Names of the committed result files matching ``pattern`` (a glob), sorted (dates sort in order)."""
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty glob string, got {pattern!r}")
    return sorted(p.name for p in _folder().iterdir() if p.name.endswith(".json") and fnmatch.fnmatch(p.name, pattern))


def load(name: str) -> dict:
    """The JSON of one committed result file, by name (``find`` lists them)."""
    if not isinstance(name, str) or "/" in name or "\\" in name or not name.endswith(".json"):
        raise ValueError(f"name must be a result file's name ending in .json, got {name!r}")
    path = _folder() / name
    if not path.is_file():
        raise FileNotFoundError(f"no committed result {name!r} in kvcourse.results; there are: {', '.join(find())}")
    return json.loads(path.read_text(encoding="utf-8"))


def newest(pattern: str) -> str | None:
    """The last file name matching ``pattern`` (``cpu-serving-*.json``: the newest date), or None."""
    names = find(pattern)
    return names[-1] if names else None
