"""kvcourse.bench.measured: the committed GPU runs of the kernel benchmark, read, checked and plotted."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import pytest

from kvcourse.bench import measured
from kvcourse.bench.measured import KernelBench, check_kernel_bench, load_kernel_bench, plot_bandwidth

ROOT = Path(__file__).resolve().parents[1]
H200 = "kernels-nvidia-h200-2026-11-26.json"  # the first H200 run: the figures and rows these tests name
RAW = json.loads((ROOT / "kvcourse" / "results" / H200).read_text())
NEWEST = "kernels-nvidia-h200-2026-11-28.json"


def test_the_newest_run_is_loaded_with_what_the_file_says():
    assert load_kernel_bench() == load_kernel_bench(NEWEST) and load_kernel_bench().name == NEWEST
    bench = load_kernel_bench(H200)
    assert (bench.gpu, bench.date, bench.provenance["sms"]) == ("NVIDIA H200", "2026-11-26", 132)
    assert bench.peak_bandwidth == RAW["peak"]["bandwidth"] and bench.copy_bandwidth == RAW["copy_bandwidth"]
    # The accessors return the file's own figures, row by row.
    for r in RAW["rows"]:
        assert bench.gbps(r["batch"], r["context"], r["variant"]) == r["gbps"]
        assert bench.ms(r["batch"], r["context"], r["variant"]) == r["ms"]
    assert round(bench.gbps(1, 512, "paged")) == 20 and round(bench.gbps(32, 32768, "sdpa")) == 4593
    assert bench.splits(1, 65536) == 33 and bench.splits(1, 8192, "paged-int8") == 32 and bench.splits(128, 2048) == 1
    assert bench.shapes()[0] == (1, 512) and bench.shapes()[-1] == (128, 32768)
    assert [r["tokens"] for r in bench.timed("sdpa")] == sorted(r["tokens"] for r in bench.timed("sdpa"))


def test_missing_rows_and_bad_names_are_refused_clearly(monkeypatch):
    bench = load_kernel_bench()
    with pytest.raises(KeyError, match="no timed row for batch 2 x context 512, variant 'paged'"):
        bench.gbps(2, 512, "paged")
    with pytest.raises(ValueError, match="records no num_splits"):
        bench.splits(1, 512, "sdpa")
    for bad in ("cpu-serving-2026-11-22.json", "../kernels-x.json", 3):
        with pytest.raises(ValueError, match="name must be a kernels-<gpu>-<date>.json"):
            load_kernel_bench(bad)
    monkeypatch.setattr(measured.committed, "newest", lambda pattern: None)
    with pytest.raises(FileNotFoundError, match="no kernels-\\*.json committed"):
        load_kernel_bench()


def _broken(edit) -> dict:
    data = copy.deepcopy(RAW)
    edit(data)
    return data


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(benchmark="decode"), "benchmark is 'decode'"),
        (lambda d: d["provenance"].pop("driver"), r"provenance lacks \['driver'\]"),
        (lambda d: d.update(copy_bandwidth=-1), "copy_bandwidth must be a positive"),
        (lambda d: d["rows"][0].update(ran="fallback"), "ran as 'fallback', not 'compiled'"),
        (lambda d: d["rows"][2].update(ran="interpreter"), "ran as 'interpreter'"),
        (lambda d: d["rows"][4].update(ran="compiled"), r"sdpa\): ran as 'compiled', not 'torch'"),
        (lambda d: d["rows"][0].update(bytes=1000), "bytes 1000 != 2113664"),
        (lambda d: d["rows"][0].update(gbps=999.0), "is not bytes / ms"),
        (lambda d: d["rows"][0].update(tokens=1), "tokens 1 != batch x context"),
        (lambda d: d["rows"][0].update(note=""), "does not record num_splits"),
        (lambda d: d["rows"][0].update(variant="mystery"), "unknown variant"),
        (lambda d: d["rows"][0].pop("ms"), r"lacks \['ms'\]"),
    ],
)
def test_a_file_that_is_not_what_the_benchmark_writes_is_refused(edit, match):
    check_kernel_bench(RAW, H200)  # the committed one passes
    with pytest.raises(ValueError, match=match):
        check_kernel_bench(_broken(edit), H200)


def test_a_skipped_shape_is_allowed():
    data = _broken(lambda d: d["rows"].append(dict(batch=256, context=65536, variant="all", skipped="needs 1 bytes")))
    check_kernel_bench(data, H200)


def test_the_plot_shows_the_four_variants_against_tokens_with_peak_and_copy():
    bench = load_kernel_bench(H200)
    fig = plot_bandwidth(bench)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert "tokens in the batch" in ax.get_xlabel() and "(GB/s)" in ax.get_ylabel()
    assert ax.get_title().startswith("Correct is not fast")
    horizontal = sorted(
        round(line.get_ydata()[0])
        for line in ax.lines
        if len(set(line.get_ydata())) == 1 and len(line.get_xdata()) == 2 and tuple(line.get_xdata()) == (0, 1)
    )
    assert horizontal == [round(bench.copy_bandwidth / 1e9), round(bench.peak_bandwidth / 1e9)]
    # One line per variant and batch size, with every timed point of that variant.
    data = [line for line in ax.lines if tuple(line.get_xdata()) != (0, 1)]
    assert len(data) == len(measured.PLOTTED) * 5
    for variant in measured.PLOTTED:
        points = {(x, y) for line in data if line.get_color() == measured.PLOTTED[variant][1]
                  for x, y in zip(line.get_xdata(), line.get_ydata())}  # fmt: skip
        assert points == {(r["tokens"], r["gbps"]) for r in bench.timed(variant)}
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "vendor peak (4,800 GB/s)" in labels and "device-to-device copy, measured (4,225 GB/s)" in labels


def test_the_plot_refuses_what_it_cannot_draw():
    with pytest.raises(TypeError, match="bench must be a KernelBench"):
        plot_bandwidth(RAW)
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes"):
        plot_bandwidth(load_kernel_bench(), ax="left")
    assert isinstance(load_kernel_bench(), KernelBench)


def test_two_runs_compared_shape_by_shape():
    first, repeat = load_kernel_bench(H200), load_kernel_bench("kernels-nvidia-h200-2026-11-26-repeat.json")
    rows = measured.compare_runs(first, repeat)
    raw_repeat = json.loads((ROOT / "kvcourse" / "results" / "kernels-nvidia-h200-2026-11-26-repeat.json").read_text())
    by = {(r["batch"], r["context"], r["variant"]): r["gbps"] for r in raw_repeat["rows"] if "ms" in r}
    for r in rows:  # each ratio is the files' own figures, divided
        assert r["ratio"] == by[(r["batch"], r["context"], r["variant"])] / first.gbps(
            r["batch"], r["context"], r["variant"]
        )
    assert len(rows) == len({(r["batch"], r["context"], r["variant"]) for r in rows}) >= 80
    assert [r["tokens"] for r in rows] == sorted(r["tokens"] for r in rows)
    assert measured.compare_runs(first, first) and all(r["ratio"] == 1 for r in measured.compare_runs(first, first))
    sdpa = measured.compare_runs(first, repeat, variants=["sdpa"])
    assert {r["variant"] for r in sdpa} == {"sdpa"} and len(sdpa) == len(first.timed("sdpa"))
    # From some size up the two runs agree; below it they need not (a hand-made pair says where the line falls).
    fake = [dict(tokens=t, ratio=x) for t, x in ((512, 3.0), (2048, 1.01), (4096, 1.2), (8192, 0.99), (16384, 1.02))]
    assert measured.reproducible_from(fake) == 8192 and measured.reproducible_from(fake, tolerance=0.25) == 2048
    assert measured.reproducible_from([dict(tokens=1, ratio=2.0)]) is None
    with pytest.raises(ValueError, match="tolerance"):
        measured.reproducible_from(fake, tolerance=0)
    with pytest.raises(TypeError, match="KernelBench"):
        measured.compare_runs(first, RAW)


def test_the_h200_run_of_2026_11_28_loads_with_its_kept_buffer_rows():
    """Its paged-workspace rows note ``num_splits=N, kept buffers``: still a split count (the check refused it once)."""
    from kvcourse.bench.measured import load_kernel_bench

    bench = load_kernel_bench("kernels-nvidia-h200-2026-11-28.json")
    assert bench.splits(1, 512, "paged-workspace") == bench.splits(1, 512, "paged")
