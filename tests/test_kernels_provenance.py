"""kvcourse.bench.provenance: the report of where kernels ran, and the GPU-measurement plot, say what happened."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from kvcourse.bench import provenance
from kvcourse.kernels import reshape_and_cache, triton_runtime


@pytest.fixture
def fresh_counts():
    saved = triton_runtime._RUNS.copy()
    triton_runtime.reset_kernel_runs()
    yield
    triton_runtime._RUNS.clear()
    triton_runtime._RUNS.update(saved)


def _one_write():
    device = triton_runtime.kernel_device()  # the CPU in the interpreter, the GPU when Triton compiles
    key = torch.randn(2, 1, 4, device=device)
    pool_k, pool_v = torch.zeros(2, 4, 1, 4, device=device), torch.zeros(2, 4, 1, 4, device=device)
    reshape_and_cache(key, key.clone(), pool_k, pool_v, torch.tensor([1, 6], device=device))


def test_launch_report_counts_every_launch_and_names_fallbacks(fresh_counts, capsys, monkeypatch):
    _one_write()
    where = provenance.launch_report()
    table = capsys.readouterr().out
    how = triton_runtime.how_kernels_run()
    assert "reshape_and_cache" in table and "no torch fallback" in where
    assert ("interpreter" in where) == (how == "interpreter")
    # A kernel that fell back is named in the sentence, never passed off as the kernel.
    triton_runtime._RUNS[("reshape_and_cache", "fallback")] += 1
    assert "except reshape_and_cache: torch fallback" in provenance.launch_report()


def test_measurement_plot_says_when_nothing_was_measured(monkeypatch, capsys):
    monkeypatch.setattr(provenance.committed, "find", lambda pattern: [])
    fig, status = provenance.plot_kernel_measurements()
    assert "no GPU measurement of these kernels has been committed yet" in status
    assert fig.axes[0].get_title().startswith("No GPU measurement yet")
    assert status in capsys.readouterr().out


def test_measurement_plot_reads_committed_results(capsys):
    # The committed H200 run of 2026-11-28 (kvcourse/results/kernels-nvidia-h200-2026-11-28.json) is the newest.
    fig, status = provenance.plot_kernel_measurements()
    assert status == (
        "Measured on NVIDIA H200 with python -m kvcourse.bench kernels "
        "(kernels-nvidia-h200-2026-11-28.json): 2 of 6 speed targets met."
    )
    assert fig.axes[0].get_ylabel() == "effective bandwidth (GB/s), log scale"
    printed = capsys.readouterr().out
    assert "driver 580.159.04, CUDA 13.0, torch 2.11.0+cu130, triton 3.6.0" in printed
    assert "int8 >= 1.5x fp16 at context >= 16k (worst shape): 0.32 (not met)" in printed


def test_measurement_plot_refuses_what_is_not_an_axes():
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes"):
        provenance.plot_kernel_measurements(ax="left")
