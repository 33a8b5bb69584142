"""The committed results of ``benchmarks/bench_compression.py``, which chapter 8 plots.

The sweep takes minutes, so the chapter reads its JSON (and recomputes a few points live to show
they still hold). The file ships with the package (:mod:`kvcourse.results`), so it is read offline
everywhere, Colab included.
"""

from __future__ import annotations

from .. import results

__all__ = ["RESULTS_FILE", "load_results"]

RESULTS_FILE = "cpu-compression-2026-11-22.json"


def load_results(name: str = RESULTS_FILE) -> dict:
    """A committed benchmark's JSON (default: the compression sweep), from the installed package."""
    return results.load(name)
