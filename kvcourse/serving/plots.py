"""Drawing an engine's event log: which request ran how many tokens of what kind, step by step."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from .stats import StepEvent

__all__ = ["KIND_COLORS", "plot_timeline"]

KIND_COLORS = {
    "prefill": "tab:blue",
    "chunk": "lightskyblue",
    "decode": "tab:green",
    "recompute": "tab:orange",
    "pad": "lightgrey",
}


def plot_timeline(events: Sequence[StepEvent], ax=None, requests: Sequence[Hashable] | None = None, title: str = ""):
    """One row per request (its samples share the row), one column per step, coloured by what the
    request fed that step; a red cross where it was preempted. Returns ``ax``."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 3.5))
    if requests is None:
        requests = list(dict.fromkeys(rid for e in events for rid, *_ in e.scheduled))
    row = {rid: i for i, rid in enumerate(requests)}
    bars: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for e in events:
        for rid, _, _, kind in e.scheduled:
            if rid in row:
                bars.setdefault((row[rid], kind), []).append((e.step, 1))
    order = list(KIND_COLORS)[::-1]  # padding first, so a step that also did real work shows the work
    for (y, kind), spans in sorted(bars.items(), key=lambda item: order.index(item[0][1])):
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=KIND_COLORS[kind])
    preempted = [(e.step, row[rid]) for e in events for rid, _ in e.preempted if rid in row]
    if preempted:
        ax.scatter([s + 0.5 for s, _ in preempted], [r for _, r in preempted], marker="x", color="red", zorder=3)
    ax.set_yticks(range(len(requests)), [str(r) for r in requests])
    ax.set_ylim(len(requests) - 0.5, -0.5)
    ax.set_xlim(0, max((e.step for e in events), default=0) + 1)
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    kinds = [k for k in KIND_COLORS if any(kind == k for _, kind in bars)]
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in kinds]
    if preempted:
        handles.append(ax.scatter([], [], marker="x", color="red", label="preempted"))
    ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    if title:
        ax.set_title(title)
    return ax
