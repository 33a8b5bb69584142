"""Where a page's kernel numbers came from: how each launch ran, and which GPU measurements exist.

Chapter 5 ends by saying what ran where, and that report is bookkeeping a reader need not read as code:

* :func:`launch_report` prints :func:`~kvcourse.kernels.triton_runtime.kernel_runs` as a table (compiled for a GPU, in
  Triton's CPU interpreter, or replaced by the torch reference) and returns one sentence that says so,
  naming every kernel that fell back. A fallback must never pass for the kernel.
* :func:`plot_kernel_measurements` plots the newest committed ``kernels-*.json`` of ``python -m kvcourse.bench
  kernels`` (:func:`~.measured.plot_bandwidth`, with the GPU, driver, CUDA, torch and Triton versions and
  the benchmark's targets printed), or, where none exists, the floor that vendor peak bandwidth sets,
  labelled as such. It returns one sentence on which speed figures are measured and which are not.
"""

from __future__ import annotations

import torch

from .. import results as committed
from ..kernels.roofline import GPU_PEAKS, decode_attention_bytes
from ..kernels.triton_runtime import interpreting, kernel_runs

__all__ = ["launch_report", "plot_kernel_measurements"]

# The speed targets of the course's kernel issue, which only a GPU run of the benchmark can check.
_TARGETS = (
    "paged decode at 80% or more of peak bandwidth on an H100, split-KV 1.8x the unsplit kernel at batch 1 "
    "and 64k, int8 1.5x fp16"
)


def _device() -> str:
    return "Triton's CPU interpreter" if interpreting() else f"code compiled for {torch.cuda.get_device_name()}"


def launch_report() -> str:
    """Print how every kernel launch of this process ran; return it as one sentence for the page's text."""
    runs = kernel_runs()
    print(f"{'kernel':32s} {'compiled':>9s} {'interpreter':>12s} {'torch fallback':>15s}")
    for kernel, hows in runs.items():
        counts = [hows.get(how, 0) for how in ("compiled", "interpreter", "fallback")]
        print(f"{kernel:32s} {counts[0]:9d} {counts[1]:12d} {counts[2]:15d}")
    fell_back = [kernel for kernel, hows in runs.items() if hows.get("fallback")]
    where = f"{_device()}, " + (
        f"except {', '.join(fell_back)}: torch fallback" if fell_back else "with no torch fallback"
    )
    print(f"every kernel launch on this page ran as {where}")
    return where


def plot_kernel_measurements(ax=None) -> tuple[object, str]:
    """Plot the committed GPU measurements of the kernels, or the bandwidth floor where there are none.

    Returns ``(figure, status)``: ``status`` says which GPUs measured the kernels and how many speed
    targets were met, or that none has and the figures are vendor peaks.
    """
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.2))
    elif not isinstance(ax, plt.Axes):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    names = committed.find("kernels-*.json")
    if names:
        from .measured import load_kernel_bench, plot_bandwidth

        bench = load_kernel_bench(names[-1])
        plot_bandwidth(bench, ax=ax)
        prov = bench.provenance
        print(
            f"{bench.name}: {prov['gpu']}, driver {prov['driver']}, CUDA {prov['cuda']}, torch {prov['torch']}, "
            f"triton {prov['triton']}"
        )
        for t in bench.targets:
            value = "not measured" if t["value"] is None else round(t["value"], 2)
            print(f"  {t['target']}: {value} ({'met' if t['met'] else 'not met' if t['met'] is False else '-'})")
        met = [t for t in bench.targets if t["met"] is not None]
        status = (
            f"Measured on {prov['gpu']} with python -m kvcourse.bench kernels ({bench.name}): "
            f"{sum(t['met'] for t in met)} of {len(met)} speed targets met."
        )
        return ax.figure, status
    tokens = np.array([512, 2048, 8192, 32768, 65536, 131072, 524288, 1048576, 4194304])
    for gpu in GPU_PEAKS.values():
        best = [
            decode_attention_bytes([int(t)], 32, 8, 128, kv_bytes=2, q_bytes=2) / gpu.bandwidth * 1e6 for t in tokens
        ]
        ax.loglog(tokens, best, label=f"{gpu.name}: bytes / vendor peak")
    ax.set_ylabel("best possible time per layer (µs)")
    ax.set_title("No GPU measurement yet: the floor set by vendor peak bandwidth")
    here = "No GPU was available where this page was computed"
    if not interpreting():
        here = f"This page ran on {torch.cuda.get_device_name()}"
    status = (
        f"{here}, and no GPU measurement of these kernels has been committed yet: the speed figures above "
        "are vendor peak figures, and the kernel tests (tests/test_kernels*.py) have run in Triton's "
        f"interpreter only. The chapter's speed targets ({_TARGETS}) stay unverified until "
        "python -m kvcourse.bench kernels runs on such a GPU."
    )
    print(status)
    ax.set_xlabel("cached tokens read per step (batch x context), Llama-3-8B layer shape, fp16")
    ax.legend(fontsize=8)
    return ax.figure, status
