"""Chapter 8's summary of its committed sweep: every cache on one chart, and the table against the claims.

The page calls one function for each (issue 45: plumbing leaves the pages):

* :func:`tradeoff_points` -- every cache the sweep measured as (family, label, memory share, perplexity change);
* :func:`plot_tradeoff` -- those points as memory held against perplexity increase, the smallest cache within
  +1% perplexity named in the title;
* :func:`comparison_table` -- the Markdown table of each technique against the earlier run and the published
  claims of :mod:`.guide`.

``bench`` is the sweep's JSON as :func:`.results.load_results` returns it; ``fp16_bytes`` is the fp16 cache's
bytes per token for the model the sweep ran (SmolLM2-135M: 23,040), the denominator of every memory share.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..checks import check_float
from .guide import CLAIMS, guide_change

__all__ = ["TRADEOFF_LABELLED", "comparison_table", "plot_tradeoff", "smallest_within", "tradeoff_points"]

# one marker per family, in the legend's order
_MARKERS = {
    "quantization": "o",
    "sliding window": "v",
    "sinks + window": "^",
    "dropping: h2o": "s",
    "dropping: snapkv": "D",
    "dropping: streaming": "P",
    "fewer KV heads": "X",
}
# the points the chart names (the others are left to the legend, so that labels do not overlap)
TRADEOFF_LABELLED = frozenset({
    "fp8 e4m3", "int8 per-token", "int4 per-token", "int2 per-token", "int4 KIVI", "int2 KIVI", "window 128",
    "4 sinks + window 124", "snapkv 25%", "h2o 25%", "MQA (pooled)",
})  # fmt: skip
# labels whose points sit close together go below their point instead of above it
_BELOW = frozenset({"int4 per-token", "snapkv 25%"})
# a perplexity change below this (int8 and fp16 sit there) is drawn on the chart's floor
_FLOOR = 1e-4


def _check_inputs(bench: Mapping, fp16_bytes: float) -> None:
    if not isinstance(bench, Mapping):
        raise TypeError(f"bench must be the sweep's JSON (a mapping), got {type(bench).__name__}")
    missing = [k for k in ("quantization", "window", "dropping", "heads") if k not in bench]
    if missing:
        raise ValueError(f"bench lacks {missing}: pass the compression sweep's JSON (load_results())")
    check_float("fp16_bytes", fp16_bytes, min=0, min_open=True)


def tradeoff_points(bench: Mapping, fp16_bytes: float) -> list[tuple[str, str, float, float]]:
    """(family, label, memory held as a share of the fp16 cache, perplexity change) for every cache of the sweep.

    Memory is bytes per token over fp16's; for dropping, the share of the context kept; pooled MQA keeps one KV
    head of SmolLM2's three.
    """
    _check_inputs(bench, fp16_bytes)
    points = [
        ("quantization", r["name"], r["bytes_per_token"] / fp16_bytes, r["ppl_change"]) for r in bench["quantization"]
    ]
    points += [("sliding window" if r["num_sinks"] == 0 else "sinks + window", r["name"],
                r["bytes_per_token"] / fp16_bytes, r["ppl_change"]) for r in bench["window"]["results"]]  # fmt: skip
    points += [
        (f"dropping: {r['method']}", f"{r['method']} {r['budget_frac']:.0%}", r["budget_frac"], r["ppl_change"])
        for r in bench["dropping"]["results"]
    ]
    points.append(("fewer KV heads", "MQA (pooled)", 1 / 3, bench["heads"]["ppl_change"]))
    return points


def smallest_within(points: list[tuple[str, str, float, float]], ppl_change: float = 0.01) -> tuple:
    """The point holding the least memory among those whose perplexity change is below ``ppl_change``."""
    within = [p for p in points if p[3] < ppl_change]
    if not within:
        raise ValueError(f"no point has a perplexity change below {ppl_change}")
    return min(within, key=lambda p: p[2])


def plot_tradeoff(bench: Mapping, fp16_bytes: float, ax=None):
    """Memory held against perplexity increase for every cache of the sweep; returns the figure.

    The title names the smallest cache within +1% perplexity. Changes below 0.01% are drawn on the floor of the
    log axis.
    """
    import matplotlib.pyplot as plt  # only the chart needs it

    points = tradeoff_points(bench, fp16_bytes)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 6))
    for family, marker in _MARKERS.items():
        fam = [p for p in points if p[0] == family]
        ax.scatter([p[2] * 100 for p in fam], [max(p[3], _FLOOR) * 100 for p in fam], marker=marker, s=60, label=family)
    cheap = smallest_within(points)
    labelled, below = TRADEOFF_LABELLED | {cheap[1]}, _BELOW | {cheap[1]}  # the point the title names
    for _, label, mem, change in points:
        if label in labelled:
            ax.annotate(label, (mem * 100, max(change, _FLOOR) * 100), textcoords="offset points",
                        xytext=(7, -11) if label in below else (6, 4), fontsize=8)  # fmt: skip
    ax.set_yscale("log")
    ax.set(
        xlabel="KV memory held, % of the fp16 cache",
        ylabel="perplexity increase, % (log scale)\neach against its own full-cache run",
        title=f"Within +1% perplexity the smallest cache is {cheap[1]}, {cheap[2]:.0%} of fp16",
    )
    ax.legend(fontsize=8, loc="upper right")
    return ax.figure


def comparison_table(bench: Mapping, fp16_bytes: float) -> str:
    """The Markdown table of every technique with a claim or an earlier run: memory, quality, the claim, our verdict.

    KIVI's greedy entries are ``n/a``: the sweep's chat prompts never left its fp16 window.
    """
    _check_inputs(bench, fp16_bytes)
    rows = [
        (r["name"], r["bytes_per_token"], r)
        for r in bench["quantization"]
        if r["name"] in CLAIMS or guide_change(r["name"]) is not None
    ]
    rows += [(r["name"], r["bytes_per_token"], r) for r in bench["window"]["results"] if r["name"] in CLAIMS]
    rows += [
        (f"{r['method']} {r['budget_frac']:.0%}", r["budget_frac"] * fp16_bytes, r)
        for r in bench["dropping"]["results"]
        if f"{r['method']} {r['budget_frac']:.0%}" in CLAIMS
    ]
    rows.append(("MQA (pooled)", fp16_bytes / 3, bench["heads"]))
    lines = [
        "| technique | of fp16 | PPL change | top-1 | KL | greedy | earlier run | claim (source) | on SmolLM2-135M |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for name, bpt, r in rows:
        greedy = "n/a" if "KIVI" in name else f"{r['greedy']['agreement']:.0%}" if "greedy" in r else "-"
        guide = f"{guide_change(name):+.0%}" if guide_change(name) is not None else "-"
        source, claim, verdict = CLAIMS.get(name, ("", "-", "-"))
        lines.append(
            f"| {name} | {bpt / fp16_bytes:.0%} | {r['ppl_change']:+.1%} | {r['top1']:.1%} | {r['kl']:.3f} | {greedy}"
            f" | {guide} | {claim}{f' ({source})' if source else ''} | {verdict} |"
        )
    return "\n".join(lines)
