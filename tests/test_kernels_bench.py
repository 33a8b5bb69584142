"""The kernel benchmark's plumbing (shapes, bytes, targets, the results file), run on CPU with a stand-in timer.

No speed is asserted here: the benchmark itself only runs on a GPU (``python -m kvcourse.bench kernels``).
"""

from __future__ import annotations

import json

import pytest
import torch

from kvcourse.bench import __main__ as bench_main
from kvcourse.bench import kernels as bench
from kvcourse.kernels.roofline import GPU_PEAKS, peak_for


def test_shapes_cover_the_issue_grid():
    full = bench.shapes()
    assert len(full) == 5 * 4 + 1 and (1, 65536) in full and (128, 32768) in full
    assert set(bench.shapes(quick=True)) <= set(full)


def test_run_on_cpu_with_a_stand_in_timer(tmp_path):
    from kvcourse.kernels.triton_runtime import interpreting

    if not interpreting():  # pragma: no cover - a GPU machine
        pytest.skip("Triton compiles here: gpu_check's first job runs the benchmark for real")
    calls = []

    def timer(fn):  # runs the function once (as do_bench would), reports a fixed 2 ms
        fn()
        calls.append(fn)
        return 2.0

    variants = ("paged", "paged-unsplit", "paged-int8", "contiguous", "sdpa")
    rows = bench.run([(2, 48)], torch.device("cpu"), timer, variants, log=lambda line: None)
    assert [r["variant"] for r in rows] == list(variants) and len(calls) == len(variants)
    assert [r["ran"] for r in rows] == ["interpreter"] * 4 + ["torch"]
    paged = rows[0]
    # K and V: 2 x 96 tokens x 8 heads x 128 x 2 bytes; q and out: 2 x 2 x 32 x 128 x 2; tables: 2 x 3 x 4.
    assert paged["bytes"] == 2 * 96 * 8 * 128 * 2 + 2 * 2 * 32 * 128 * 2 + 2 * 3 * 4
    assert paged["gbps"] == pytest.approx(paged["bytes"] / 2e-3 / 1e9)
    assert paged["pct_peak"] is None  # no vendor peak for a CPU
    int8 = rows[2]
    assert int8["bytes"] == 2 * 96 * 8 * (128 + 4) + 2 * 2 * 32 * 128 * 2 + 2 * 3 * 4
    result = dict(
        benchmark="kernels", provenance=bench.provenance(torch.device("cpu")), rows=rows, targets=bench.targets(rows)
    )
    path = bench.write_results(result, tmp_path)
    saved = json.loads(path.read_text())
    assert path.name.startswith("kernels-cpu-") and saved["provenance"]["torch"] == torch.__version__
    assert {"triton", "date", "commit"} <= set(saved["provenance"])
    # No vendor peak for a CPU, no 64k or 16k shape here: only the paged / contiguous ratio (2 ms / 2 ms) is read.
    assert {t["name"]: t["met"] for t in saved["targets"]} == dict(
        paged_peak=None,
        paged_vs_contiguous=True,
        split_peak=None,
        split_speedup=None,
        int8_speedup=None,
        fp8_speedup=None,
    )


def test_a_fallback_is_never_timed_as_the_kernel(monkeypatch):
    """A kernel that cannot compile falls back to torch in the wrappers: the benchmark refuses to time it."""
    from kvcourse.kernels import triton_decode, triton_paged
    from kvcourse.kernels.triton_runtime import OutOfResources, kernel_device, reset_fallbacks

    class Uncompilable:  # a kernel whose compilation fails, as one over a T4's shared memory would
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise OutOfResources(98304, 65536, "shared memory")

            return launch

    monkeypatch.setattr(triton_decode, "_decode_kernel", Uncompilable())
    monkeypatch.setattr(triton_paged, "_paged_decode_kernel", Uncompilable())
    timed = []

    def timer(fn):
        timed.append(fn)
        return 2.0

    reset_fallbacks()
    try:
        with pytest.warns(RuntimeWarning, match="could not compile"):  # the wrapper's one-line warning
            rows = bench.run([(2, 48)], kernel_device(), timer, ("paged", "contiguous", "sdpa"), log=lambda _: None)
    finally:
        reset_fallbacks()
    by = {r["variant"]: r for r in rows}
    assert "ms" not in by["contiguous"] and "fell back to the torch reference" in by["contiguous"]["skipped"]
    assert "ms" not in by["paged"] and "did not compile" in by["paged"]["skipped"]
    assert by["sdpa"]["ms"] == 2.0 and by["sdpa"]["ran"] == "torch" and len(timed) == 1  # only SDPA was timed


def test_targets_read_the_rows():
    def row(b, c, v, ms, pct):
        return dict(batch=b, context=c, tokens=b * c, variant=v, ms=ms, pct_peak=pct)

    rows = [row(1, 65536, "paged", 1.0, 75.0), row(1, 65536, "paged-unsplit", 2.0, 37.5),
            row(1, 65536, "contiguous", 0.95, 79.0), row(1, 65536, "paged-int8", 0.6, 65.0),
            row(8, 8192, "paged", 1.0, 85.0), row(8, 8192, "contiguous", 1.0, 85.0)]  # fmt: skip
    got = {t["name"]: (t["value"], t["met"]) for t in bench.targets(rows)}
    assert got["paged_peak"] == (75.0, False)  # the worst shape with batch x context >= 64k
    assert got["paged_vs_contiguous"] == (0.95, True)  # worst of 0.95 / 1.0 and 1.0 / 1.0
    assert got["split_peak"] == (75.0, True)
    assert got["split_speedup"] == (2.0, True)
    assert got["int8_speedup"] == (pytest.approx(1 / 0.6), True)


def test_cpu_refuses_clearly(capsys):
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is present: the benchmark would run for real")
    assert bench.main([]) == 0
    assert "no CUDA GPU here" in capsys.readouterr().out
    assert bench_main.main(["nope"]) == 2


def test_peak_for_known_gpu_names():
    assert peak_for("Tesla T4") is GPU_PEAKS["T4"]
    assert peak_for("NVIDIA A100-SXM4-80GB") is GPU_PEAKS["A100-80GB"]
    assert peak_for("NVIDIA A100-PCIE-40GB") is GPU_PEAKS["A100-40GB"]
    assert peak_for("NVIDIA H100 80GB HBM3") is GPU_PEAKS["H100-SXM"]
    assert peak_for("NVIDIA H100 PCIe") is None  # a different memory system: not in the table
    assert peak_for("NVIDIA H200") is GPU_PEAKS["H200"]


def test_provenance_names_the_commit_the_caller_handed_over(monkeypatch):
    import subprocess

    monkeypatch.setenv("KVCOURSE_COMMIT", "1f0129e")  # a tree copied to a GPU machine, with a stale .git there
    assert bench.provenance(torch.device("cpu"))["commit"] == "1f0129e"
    monkeypatch.delenv("KVCOURSE_COMMIT")
    commit = bench.provenance(torch.device("cpu"))["commit"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True)
    assert commit == head + (" (with uncommitted changes)" if dirty.stdout.strip() else "")


# ---------------------------------------------------------------------------------------------
# The engine's shape (issue 50): planned on the CPU, timed by the next GPU run
# ---------------------------------------------------------------------------------------------
def test_the_engine_shape_is_planned(capsys):
    entries = bench.plan()
    engine = [e for e in entries if e["shape"] == "engine"]
    assert [e for e in entries if e["shape"] == "benchmark"] == [
        dict(shape="benchmark", batch=b, context=c, heads=(32, 8, 128), dtype="float16", variants=list(bench.VARIANTS))
        for b, c in bench.shapes()
    ]
    assert {(e["batch"], e["context"]) for e in engine} == {
        (b, c) for b in (1, 8, 32, 64, 128) for c in (128, 256, 512, 1024, 2048)
    }
    assert all(e["heads"] == (9, 3, 64) and e["dtype"] == "bfloat16" for e in engine)
    assert all({"sdpa", "paged", "paged-planned", "paged-captured"} <= set(e["variants"]) for e in engine)
    # The target's shapes (batch >= 32, 512-1,024 tokens) are in the quick run too.
    quick = [(e["batch"], e["context"]) for e in bench.plan(quick=True) if e["shape"] == "engine"]
    assert any(b >= 32 and 512 <= c <= 1024 for b, c in quick) and set(quick) <= {
        (e["batch"], e["context"]) for e in engine
    }
    assert bench.main(["--dry-run", "--shapes", "engine"]) == 0  # no GPU needed to list them
    out = capsys.readouterr().out
    assert "engine    batch  128 x context   2048 heads (9, 3, 64) bfloat16" in out and out.endswith("25 shapes\n")


def test_the_engine_shape_runs_on_cpu_with_a_stand_in_timer():
    from kvcourse.kernels.triton_runtime import interpreting

    if not interpreting():  # pragma: no cover - a GPU machine
        pytest.skip("Triton compiles here: gpu_check's first job runs the benchmark for real")
    rows = bench.run([(2, 40)], torch.device("cpu"), lambda fn: (fn(), 2.0)[1], bench.ENGINE_VARIANTS, log=lambda _: None,
                     shape="engine")  # fmt: skip
    assert [r["variant"] for r in rows] == list(bench.ENGINE_VARIANTS) and {r["shape"] for r in rows} == {"engine"}
    # bf16 K and V: 2 x 2 sequences x 40 tokens x 3 heads x 64 x 2 bytes; q and out: 2 x 2 x 9 x 64 x 2; tables.
    assert rows[0]["bytes"] == 2 * 2 * 40 * 3 * 64 * 2 + 2 * 2 * 9 * 64 * 2 + 2 * 3 * 4
    by = {r["variant"]: r for r in rows}
    assert by["paged-planned"]["note"].startswith("planned: chunks of 48 tokens, 2 work items")  # no SMs: no split
    assert "captured context 8192" in by["paged-captured"]["note"]
    with pytest.raises(ValueError, match="shape must be"):
        bench.run([(2, 40)], torch.device("cpu"), lambda fn: 2.0, shape="engines")


def test_engine_targets_read_the_engine_rows():
    def row(b, c, v, ms, pct, shape="engine"):
        return dict(shape=shape, batch=b, context=c, tokens=b * c, variant=v, ms=ms, pct_peak=pct)

    rows = [row(32, 512, "paged-planned", 1.0, 65.0), row(64, 1024, "paged-planned", 1.0, 61.0),
            row(32, 512, "paged-captured", 1.5, 43.0), row(64, 1024, "paged-captured", 1.2, 51.0),
            row(32, 512, "paged", 1.1, 59.0), row(8, 512, "paged-planned", 1.0, 20.0),  # batch 8: outside the target
            row(128, 2048, "paged-planned", 1.0, 10.0), row(32, 512, "paged", 1.0, 1.0, shape="benchmark")]  # fmt: skip
    got = {t["name"]: (t["value"], t["met"]) for t in bench.engine_targets(rows)}
    assert got == dict(
        engine_peak_paged_planned=(61.0, True),
        engine_peak_paged=(59.0, False),
        engine_planned_vs_captured=(pytest.approx(1.2), True),
    )
    assert all(t["met"] is None for t in bench.engine_targets([]))
