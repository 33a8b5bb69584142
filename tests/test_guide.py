"""Chapter 8's comparison data: every technique it names is one the committed sweep measured."""

from __future__ import annotations

import pytest

from kvcourse.compression.guide import CLAIMS, GUIDE, guide_change
from kvcourse.compression.results import load_results


def _sweep_names() -> set[str]:
    bench = load_results()
    names = {r["name"] for r in bench["quantization"]} | {r["name"] for r in bench["window"]["results"]}
    names |= {f"{r['method']} {r['budget_frac']:.0%}" for r in bench["dropping"]["results"]}
    return names | {"MQA (pooled)"}


def test_every_technique_compared_was_measured():
    names = _sweep_names()
    assert set(GUIDE) <= names and set(CLAIMS) <= names


def test_guide_change_is_relative():
    assert guide_change("window 128") == pytest.approx(29.3 / 11.50 - 1)
    assert guide_change("int8 per-token") == pytest.approx(12.748 / 12.742 - 1)
    assert guide_change("snapkv 25%") is None
    assert all(len(claim) == 3 and all(claim) for claim in CLAIMS.values())
