"""What chapter 5's kernels did on a GPU: the committed results of ``python -m kvcourse.bench kernels``.

The benchmark writes ``kernels-<gpu>-<date>.json`` (its GPU, driver, CUDA, torch and Triton versions, the
vendor's peak bandwidth, a measured device-to-device copy, and one row per shape and variant). The file is
committed to :mod:`kvcourse.results`, so the chapter reads it offline, on a laptop and on Colab alike:

* :func:`load_kernel_bench` reads one such file (the newest by default), checks that it is what the
  benchmark writes (every row timed as compiled code, its GB/s equal to its bytes over its time, its bytes
  equal to :func:`~kvcourse.kernels.roofline.decode_attention_bytes` for the shape), and returns a :class:`KernelBench`
  whose accessors (:meth:`KernelBench.gbps`, :meth:`KernelBench.ms`, :meth:`KernelBench.splits`) the page
  computes its prose from;
* :func:`plot_bandwidth` draws the effective bandwidth of the paged kernel (split-KV as chosen, and one
  split), the int8 kernel and torch's SDPA against the tokens a batch holds, with the vendor's peak and the
  measured copy as horizontal lines.
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from .. import results as committed
from ..kernels.roofline import decode_attention_bytes

__all__ = [
    "ONE_BYTE_KV",
    "KernelBench",
    "check_kernel_bench",
    "check_result",
    "compare_runs",
    "load_kernel_bench",
    "plot_bandwidth",
    "reproducible_from",
]

PATTERN = "kernels-*.json"
OUR_KERNELS = ("paged", "paged-unsplit", "paged-workspace", "paged-int8", "paged-int8-cvt", "paged-fp8", "contiguous")
# OUR_KERNELS are timed as compiled Triton code; of them, these store a byte per K/V value and an fp32 scale per vector.
ONE_BYTE_KV = ("paged-int8", "paged-int8-cvt", "paged-fp8")
TORCH_BASELINES = ("sdpa", "flex")  # timed as torch
_PROVENANCE = ("date", "torch", "triton", "python", "commit", "gpu", "compute_capability", "sms", "cuda", "driver")
_SHAPE = ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "dtype")
_SPLITS = re.compile(r"num_splits=(\d+)(?:, [^=]*)?")  # "num_splits=2" or "num_splits=2, kept buffers"

# What the plot draws, in this order: variant -> (label, colour, marker).
PLOTTED = {
    "paged": ("paged, ours (splits by heuristic)", "tab:blue", "o"),
    "paged-unsplit": ("paged, ours, 1 split", "tab:cyan", "v"),
    "paged-int8": ("paged int8 K/V, ours", "tab:red", "s"),
    "sdpa": ("torch SDPA (contiguous cache)", "black", "x"),
}


@dataclass(frozen=True)
class KernelBench:
    """One GPU run of ``python -m kvcourse.bench kernels``, checked (:func:`check_kernel_bench`)."""

    name: str  # the committed file's name
    provenance: Mapping  # gpu, compute_capability, sms, driver, cuda, torch, triton, python, commit, date
    peak_bandwidth: float | None  # bytes/s, the vendor's figure (None for a GPU the package does not list)
    peak_source: str | None
    copy_bandwidth: float  # bytes/s of a device-to-device copy, measured in the same run
    shape: Mapping  # num_q_heads, num_kv_heads, head_dim, block_size, dtype
    rows: tuple[Mapping, ...]
    targets: tuple[Mapping, ...]

    @property
    def gpu(self) -> str:
        return self.provenance["gpu"]

    @property
    def date(self) -> str:
        """The day it ran, ``YYYY-MM-DD``."""
        return self.provenance["date"][:10]

    def shapes(self) -> list[tuple[int, int]]:
        """Every ``(batch, context)`` with at least one timed row, by tokens, then batch."""
        return sorted({(r["batch"], r["context"]) for r in self.rows if "ms" in r}, key=lambda s: (s[0] * s[1], s[0]))

    def variants(self) -> list[str]:
        return sorted({r["variant"] for r in self.rows if "ms" in r})

    def row(self, batch: int, context: int, variant: str) -> Mapping:
        """The timed row of one shape and variant; ``KeyError`` saying what was measured if there is none."""
        for r in self.rows:
            if (r["batch"], r["context"], r["variant"]) == (batch, context, variant) and "ms" in r:
                return r
        raise KeyError(
            f"{self.name} has no timed row for batch {batch} x context {context}, variant {variant!r}; "
            f"shapes: {self.shapes()}, variants: {self.variants()}"
        )

    def gbps(self, batch: int, context: int, variant: str) -> float:
        """Effective bandwidth in GB/s: the bytes the step must move over its median time."""
        return self.row(batch, context, variant)["gbps"]

    def ms(self, batch: int, context: int, variant: str) -> float:
        """Median time of one call, in milliseconds."""
        return self.row(batch, context, variant)["ms"]

    def splits(self, batch: int, context: int, variant: str = "paged") -> int:
        """The KV splits a paged variant ran with (the benchmark writes ``num_splits=N`` in its note)."""
        m = _SPLITS.fullmatch(self.row(batch, context, variant).get("note", ""))
        if m is None:
            raise ValueError(f"variant {variant!r} records no num_splits (only the paged variants do)")
        return int(m[1])

    def timed(self, variant: str) -> list[Mapping]:
        """Every timed row of ``variant``, by tokens, then batch."""
        return sorted(
            (r for r in self.rows if r["variant"] == variant and "ms" in r), key=lambda r: (r["tokens"], r["batch"])
        )


def _need(mapping: object, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(mapping, Mapping):
        raise ValueError(f"{where} must be a JSON object, got {type(mapping).__name__}")
    missing = [k for k in keys if k not in mapping]
    if missing:
        raise ValueError(f"{where} lacks {missing}")


def check_kernel_bench(data: Mapping, name: str = "the result") -> None:
    """Raise ``ValueError`` naming what is wrong unless ``data`` is what ``python -m kvcourse.bench kernels`` writes.

    Beyond the keys: a row of our kernels ran as compiled code (never the interpreter, never a torch
    fallback), its ``gbps`` is its ``bytes`` over its ``ms``, and its ``bytes`` are
    :func:`~kvcourse.kernels.roofline.decode_attention_bytes` of its shape, so every figure the chapter quotes is
    recomputable from the file.
    """
    _need(data, ("benchmark", "provenance", "peak", "copy_bandwidth", "shape", "rows", "targets"), name)
    if data["benchmark"] != "kernels":
        raise ValueError(f"{name}: benchmark is {data['benchmark']!r}, not 'kernels'")
    _need(data["provenance"], _PROVENANCE, f"{name}: provenance")
    _need(data["shape"], _SHAPE, f"{name}: shape")
    if data["peak"] is not None:
        _need(data["peak"], ("name", "bandwidth", "source"), f"{name}: peak")
    copy = data["copy_bandwidth"]
    if isinstance(copy, bool) or not isinstance(copy, (int, float)) or not copy > 0:
        raise ValueError(f"{name}: copy_bandwidth must be a positive number of bytes/s, got {copy!r}")
    shape = data["shape"]
    if shape["dtype"] != "float16":
        raise ValueError(f"{name}: shape dtype {shape['dtype']!r}; the byte counts below assume float16")
    rows = data["rows"]
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{name}: rows must be a non-empty list")
    for i, r in enumerate(rows):
        where = f"{name}: rows[{i}]"
        _need(r, ("batch", "context", "variant"), where)
        if "skipped" in r:
            continue
        _need(r, ("tokens", "note", "ran", "ms", "bytes", "gbps"), where)
        batch, context, variant = r["batch"], r["context"], r["variant"]
        where = f"{where} (batch {batch} x context {context}, {variant})"
        if variant not in OUR_KERNELS + TORCH_BASELINES:
            raise ValueError(f"{where}: unknown variant")
        if r["tokens"] != batch * context:
            raise ValueError(f"{where}: tokens {r['tokens']} != batch x context")
        want_ran = "compiled" if variant in OUR_KERNELS else "torch"
        if r["ran"] != want_ran:
            raise ValueError(f"{where}: ran as {r['ran']!r}, not {want_ran!r}: not a timing of the kernel")
        if not r["ms"] > 0:
            raise ValueError(f"{where}: ms must be positive, got {r['ms']!r}")
        int8 = variant in ONE_BYTE_KV
        want_bytes = decode_attention_bytes(
            [context] * batch, shape["num_q_heads"], shape["num_kv_heads"], shape["head_dim"], kv_bytes=1 if int8 else 2,
            q_bytes=2, scale_bytes=4 if int8 else 0, block_size=shape["block_size"] if variant.startswith("paged") else None,
        )  # fmt: skip
        if r["bytes"] != want_bytes:
            raise ValueError(f"{where}: bytes {r['bytes']} != {want_bytes} (decode_attention_bytes of the shape)")
        if not math.isclose(r["gbps"], r["bytes"] / (r["ms"] * 1e-3) / 1e9, rel_tol=1e-9):
            raise ValueError(f"{where}: gbps {r['gbps']} is not bytes / ms")
        if variant.startswith("paged") and not _SPLITS.fullmatch(r["note"]):
            raise ValueError(f"{where}: note {r['note']!r} does not record num_splits")


def check_result(name: str) -> str:
    """Validate one committed result file of :mod:`kvcourse.results`; return its kind (``"kernels"``,
    ``"gpu-check"`` or ``"other"``).

    Raises ``ValueError`` naming the file and what is wrong when a file of a kind the package reads is
    not what its writer writes: a kernel run (:func:`check_kernel_bench`), or a gpu-check run
    (:func:`kvcourse.results.gpu_check_notebook_runs`). Other kinds are only parsed as JSON.
    """
    data = committed.load(name)
    if fnmatch.fnmatch(name, PATTERN):
        check_kernel_bench(data, name)
        return "kernels"
    if fnmatch.fnmatch(name, "gpu-check-*.json"):
        committed.gpu_check_notebook_runs(data, name)
        return "gpu-check"
    return "other"


def load_kernel_bench(name: str | None = None) -> KernelBench:
    """A committed ``kernels-*.json`` (default: the newest), checked, from the installed package.

    ``FileNotFoundError`` if none is committed (no GPU has run the benchmark), ``ValueError`` if the
    file is not what the benchmark writes (:func:`check_kernel_bench`).
    """
    if name is None:
        name = committed.newest(PATTERN)
        if name is None:
            raise FileNotFoundError(
                "no kernels-*.json committed in kvcourse.results: python -m kvcourse.bench kernels "
                "has not been run on a GPU and committed"
            )
    elif not isinstance(name, str) or not re.fullmatch(r"kernels-[A-Za-z0-9-]+\.json", name):
        raise ValueError(f"name must be a kernels-<gpu>-<date>.json file name, got {name!r}")
    data = committed.load(name)
    check_kernel_bench(data, name)
    peak = data["peak"]
    return KernelBench(
        name=name,
        provenance=dict(data["provenance"]),
        peak_bandwidth=None if peak is None else float(peak["bandwidth"]),
        peak_source=None if peak is None else peak["source"],
        copy_bandwidth=float(data["copy_bandwidth"]),
        shape=dict(data["shape"]),
        rows=tuple(data["rows"]),
        targets=tuple(data["targets"]),
    )


def compare_runs(first: KernelBench, second: KernelBench, variants: Iterable[str] | None = None) -> list[dict]:
    """``second``'s GB/s over ``first``'s for every shape and variant both runs timed (or only ``variants``),
    by tokens a batch.

    Two runs of the same kernels say how far one run's figure can be trusted: each row is
    ``{batch, context, tokens, variant, first, second, ratio}``.
    """
    if not isinstance(first, KernelBench) or not isinstance(second, KernelBench):
        raise TypeError(
            f"first and second must be KernelBench (load_kernel_bench), got "
            f"{type(first).__name__}, {type(second).__name__}"
        )
    wanted = first.variants() if variants is None else list(variants)
    rows = []
    for batch, context in first.shapes():
        for variant in wanted:
            try:
                a, b = first.gbps(batch, context, variant), second.gbps(batch, context, variant)
            except KeyError:  # timed in one run only
                continue
            rows.append(dict(batch=batch, context=context, tokens=batch * context, variant=variant,
                             first=a, second=b, ratio=b / a))  # fmt: skip
    if not rows:
        raise ValueError(f"{first.name} and {second.name} have no shape and variant in common")
    return rows


def reproducible_from(rows: list[dict], tolerance: float = 0.05) -> int | None:
    """The fewest tokens a batch from which every figure of two runs (:func:`compare_runs`) agrees within
    ``tolerance`` (0.05: 5%); None if even the largest shape moved more."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must lie in (0, 1), got {tolerance!r}")
    for tokens in sorted({r["tokens"] for r in rows}):
        if all(abs(r["ratio"] - 1) <= tolerance for r in rows if r["tokens"] >= tokens):
            return tokens
    return None


def _finding(bench: KernelBench) -> str:
    """The plot's default title: the finding, computed from the run."""
    ratios = [bench.gbps(b, c, "paged") / bench.gbps(b, c, "sdpa") for b, c in bench.shapes()]
    best = {v: max(r["gbps"] for r in bench.timed(v)) for v in ("paged", "paged-int8")}
    return (
        f"Correct is not fast: on an {bench.gpu} our paged kernel reaches {min(ratios):.2f} to {max(ratios):.2f} of "
        f"SDPA's bandwidth,\nand int8 K/V, half the bytes, tops out at {best['paged-int8']:,.0f} GB/s "
        f"against fp16's {best['paged']:,.0f}"
    )


def plot_bandwidth(bench: KernelBench, ax=None, title: str | None = None):
    """Effective bandwidth against tokens a batch (batch x context, log axis), one line per variant and batch.

    Colour is the variant (:data:`PLOTTED`), the marker's fill the batch size (a batch of 1 hollow); the
    vendor's peak and the measured copy are horizontal lines. ``title`` defaults to the finding, computed
    from the run: the range of paged / SDPA over the shapes, and the best int8 and fp16 bandwidths.
    Returns the figure.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    if not isinstance(bench, KernelBench):
        raise TypeError(f"bench must be a KernelBench (load_kernel_bench()), got {type(bench).__name__}")
    if ax is None:
        _, ax = plt.subplots(figsize=(8.5, 5))
    elif not isinstance(ax, plt.Axes):
        raise TypeError(f"ax must be a matplotlib Axes or None, got {type(ax).__name__}")
    batches = sorted({b for b, _ in bench.shapes()})
    for variant, (label, colour, marker) in PLOTTED.items():
        rows = bench.timed(variant)
        for batch in batches:
            line = sorted((r for r in rows if r["batch"] == batch), key=lambda r: r["tokens"])
            if not line:
                continue
            ax.plot([r["tokens"] for r in line], [r["gbps"] for r in line], marker=marker, color=colour,
                    mfc="white" if batch == 1 else colour, ls="-" if batch > 1 else "--", lw=1.2 if batch > 1 else 1,
                    ms=6, alpha=0.9)  # fmt: skip
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    lines = [(bench.copy_bandwidth / 1e9, f"device-to-device copy, measured ({bench.copy_bandwidth / 1e9:,.0f} GB/s)",
              "grey", ":")]  # fmt: skip
    if bench.peak_bandwidth:
        lines.insert(
            0, (bench.peak_bandwidth / 1e9, f"vendor peak ({bench.peak_bandwidth / 1e9:,.0f} GB/s)", "grey", "--")
        )
    for y, _, colour, style in lines:
        ax.axhline(y, color=colour, ls=style, lw=1.2)
    handles = [Line2D([], [], color=c, marker=m, label=label) for label, c, m in PLOTTED.values()]
    handles += [Line2D([], [], color=c, ls=s, label=label) for _, label, c, s in lines]
    handles += [Line2D([], [], color="tab:blue", marker="o", mfc="white", ls="--", label="batch 1 (dashed, hollow)")]
    ax.legend(handles=handles, fontsize=8, loc="lower right")
    ticks = sorted({r["tokens"] for r in bench.rows if "tokens" in r})
    ax.set_xticks(ticks, [f"{t // 1024}k" if t >= 1024 else str(t) for t in ticks], fontsize=8)
    shape = bench.shape
    ax.set_xlabel(
        f"tokens in the batch (batch x context), log scale\n{shape['num_q_heads']} query / "
        f"{shape['num_kv_heads']} KV heads, head dim {shape['head_dim']}, fp16, blocks of "
        f"{shape['block_size']}; {bench.gpu}, {bench.date}"
    )
    ax.set_ylabel("effective bandwidth (GB/s), log scale")
    ax.set_title(title or _finding(bench), fontsize=10)
    ax.grid(True, which="major", alpha=0.3)
    return ax.figure
