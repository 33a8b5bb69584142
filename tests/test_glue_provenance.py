"""The measurements appendix's rule: no chapter compares a figure of this page's run with one of a committed run
without saying so (kvcourse.tools.glue_provenance)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvcourse.tools.glue_provenance import LIVE, check_notebook, glue_kinds, mixed_paragraphs, name_kinds

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = sorted((ROOT / "book").glob("0*.ipynb"))


def _code(source: str, tags: list[str] | None = None) -> dict:
    return {"cell_type": "code", "metadata": {"tags": tags or []}, "source": source, "outputs": []}


def _md(source: str) -> dict:
    return {"cell_type": "markdown", "metadata": {}, "source": source}


# Chapter 6's batching paragraph before issue 46 (item 8), reduced: a gain measured by the page, a bound from the
# committed CPU fit of another machine, compared in one paragraph.
TIMED = _code("sweep = {s: run(s) for s in (1, 16)}\ngain = sweep[16] / sweep[1]", ["nbval-ignore-output"])
GLUE = _code(
    'glue("load_gain", f"{gain:.1f}")\n'
    'step_fit = kvcourse.results.load(kvcourse.results.newest("cpu-load-*.json"))["step_cost"]\n'
    "bound = 16 * step_fit['fixed_s']\n"
    'for key in ("a", "b"):\n'
    '    glue(f"bound_{key}", f"{bound:.0f}")\n'
    '_ = glue("formula", 2 * 3)',
    ["remove-cell", "nbval-ignore-output"],
)
BEFORE = (
    "Batching gives {glue:text}`load_gain` times the throughput; the step-cost model bounds it by {glue:text}`bound_a`."
)


def test_glued_names_get_the_kind_of_run_their_values_come_from():
    glued = glue_kinds({"cells": [TIMED, GLUE]})
    assert name_kinds(glued, "load_gain") == {LIVE}
    assert name_kinds(glued, "bound_b") == {"committed:cpu-load-*.json"}  # an f-string name, through a loop
    assert name_kinds(glued, "formula") == {LIVE}  # computed in a timing cell: counted as this run's
    assert name_kinds(glued, "nowhere") == frozenset()


def test_a_paragraph_comparing_this_run_with_a_committed_run_is_flagged_unless_it_says_so():
    mixed = mixed_paragraphs({"cells": [TIMED, GLUE, _md("# Title\n\n" + BEFORE)]})
    assert [(m.live, m.committed) for m in mixed] == [(("load_gain",), ("bound_a (cpu-load-*.json)",))]
    said = BEFORE.replace("the step-cost model", "the step-cost model of another run (a committed fit)")
    assert mixed_paragraphs({"cells": [TIMED, GLUE, _md(said)]}) == []
    # Figures of one kind only: nothing to say.
    assert (
        mixed_paragraphs({"cells": [TIMED, GLUE, _md("Bounded by {glue:text}`bound_a` and {glue:text}`bound_b`.")]})
        == []
    )


def test_a_cell_that_is_not_python_is_named():
    with pytest.raises(ValueError, match="cell 0: cannot parse"):
        glue_kinds({"cells": [_code("x = (")]})


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_no_chapter_compares_figures_of_two_runs_without_saying_so(path):
    mixed = check_notebook(path)
    assert not mixed, "\n".join(map(str, mixed))
