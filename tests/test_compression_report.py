"""Chapter 8's chart and table of the committed sweep (kvcourse.compression.report): the page calls one function."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

from kvcourse.compression.guide import CLAIMS
from kvcourse.compression.report import comparison_table, plot_tradeoff, smallest_within, tradeoff_points
from kvcourse.compression.results import load_results

FP16 = 2 * 30 * 3 * 64 * 2  # SmolLM2-135M's fp16 bytes per token


@pytest.fixture(scope="module")
def bench():
    return load_results()


def test_every_cache_of_the_sweep_is_a_point(bench):
    points = tradeoff_points(bench, FP16)
    n = len(bench["quantization"]) + len(bench["window"]["results"]) + len(bench["dropping"]["results"]) + 1
    assert len(points) == n
    byname = {p[1]: p for p in points}
    assert byname["int8 per-token"][2] == pytest.approx(2 * 30 * 3 * (64 + 4) / FP16)
    assert byname["snapkv 25%"][0] == "dropping: snapkv" and byname["snapkv 25%"][2] == 0.25
    assert byname["MQA (pooled)"][2] == pytest.approx(1 / 3)


def test_the_title_names_the_smallest_cache_within_one_percent(bench):
    points = tradeoff_points(bench, FP16)
    cheap = smallest_within(points)
    assert cheap[3] < 0.01 and all(p[2] >= cheap[2] for p in points if p[3] < 0.01)
    fig = plot_tradeoff(bench, FP16)
    ax = fig.axes[0]
    assert cheap[1] in ax.get_title() and ax.get_yscale() == "log"
    assert "% of the fp16 cache" in ax.get_xlabel() and "perplexity increase" in ax.get_ylabel()
    assert {t.get_text() for t in ax.texts} >= {"int4 KIVI", "MQA (pooled)", cheap[1]}
    plt.close(fig)
    with pytest.raises(ValueError, match="below"):
        smallest_within(points, ppl_change=-1)


def test_the_table_has_a_row_per_claim_and_the_numbers_of_the_sweep(bench):
    table = comparison_table(bench, FP16)
    lines = table.splitlines()
    assert lines[0].startswith("| technique |") and len(lines) == 2 + len(CLAIMS) + 1  # + MQA, + int2 per-token
    int8 = next(line for line in lines if line.startswith("| int8 per-token |"))
    assert "| 53% |" in int8 and "| 100% |" in int8 and "agrees" in int8
    assert "| n/a |" in next(line for line in lines if line.startswith("| int4 KIVI |"))


@pytest.mark.parametrize("fn", [tradeoff_points, comparison_table])
def test_bad_input_names_the_argument(fn, bench):
    with pytest.raises(ValueError, match="fp16_bytes"):
        fn(bench, 0)
    with pytest.raises(TypeError, match="bench"):
        fn([1, 2], FP16)
    with pytest.raises(ValueError, match="bench lacks"):
        fn({"quantization": []}, FP16)
