"""kvcourse.kernels.provenance: the report of where kernels ran, and the GPU-measurement plot, say what happened."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from kvcourse.kernels import provenance, reshape_and_cache
from kvcourse.kernels import triton_runtime


@pytest.fixture
def fresh_counts():
    saved = triton_runtime._RUNS.copy()
    triton_runtime.reset_kernel_runs()
    yield
    triton_runtime._RUNS.clear()
    triton_runtime._RUNS.update(saved)


def _one_write():
    key = torch.randn(2, 1, 4)
    pool_k, pool_v = torch.zeros(2, 4, 1, 4), torch.zeros(2, 4, 1, 4)
    reshape_and_cache(key, key.clone(), pool_k, pool_v, torch.tensor([1, 6]))


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


def test_measurement_plot_reads_committed_results(monkeypatch):
    run = {"rows": [{"variant": "paged", "gbps": 900.0, "batch": 8, "tokens": 4096},
                    {"variant": "paged", "gbps": 1500.0, "batch": 8, "tokens": 65536}],
           "peak": {"name": "H100 SXM", "bandwidth": 3.35e12},
           "provenance": {"gpu": "NVIDIA H100", "torch": "2.x", "triton": "3.x"},
           "targets": [{"target": "paged at 80% of peak", "value": 0.45, "met": False},
                       {"target": "int8 1.5x fp16", "value": None, "met": None}]}  # fmt: skip
    monkeypatch.setattr(provenance.committed, "find", lambda pattern: ["kernels-h100-2026-01-01.json"])
    monkeypatch.setattr(provenance.committed, "load", lambda name: run)
    fig, status = provenance.plot_kernel_measurements()
    assert status == ("Measured on NVIDIA H100 with python -m kvcourse.bench kernels (the files above): "
                      "0 of 1 speed targets met.")  # fmt: skip
    assert fig.axes[0].get_ylabel() == "effective bandwidth (GB/s)"


def test_measurement_plot_refuses_what_is_not_an_axes():
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes"):
        provenance.plot_kernel_measurements(ax="left")
