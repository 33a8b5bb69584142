"""The cache grid: one column per token, one row per layer, animated step by step.

Each cell is one (layer, token) pair, i.e. that token's K and V vectors in that
layer. At every generation step a cell is in one of four states:

* ``EMPTY``    -- the token does not exist yet, or (naive loop) nothing is kept;
* ``CACHED``   -- its K/V sit in the cache, untouched this step;
* ``READ``     -- its K/V are read from the cache by the new token's attention;
* ``COMPUTED`` -- its K/V are (re)computed by this step's forward pass.

:func:`cache_grid_frames` is the pure logic (which cells are lit at each frame,
following :func:`kvcourse.costs.tokens_fed` exactly, so the lit cells add up to
:func:`kvcourse.costs.kv_projections_total`). Four scenes (``mode``):

* ``"naive"``   -- every step recomputes the whole sequence: the grid relights;
* ``"cached"``  -- one prefill pass, then one new column per step;
* ``"prefill"`` -- the prompt's columns are filled in a single parallel pass;
* ``"decode"``  -- with the prompt cached, each step computes one new column and
  reads all the others (the K/V work per step stays one column; the reads grow
  with the context);
* ``"all"``     -- the four scenes above, one after the other.

:func:`memory_bill_frames` adds the last scene: the bytes the cache holds, for a
growing context and then a growing batch, until they outgrow the model's weights.
:func:`cache_grid_animation` draws the scenes with matplotlib, with a bar chart of
cache bytes against weight bytes under the grid when the byte sizes are given.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .checks import check_ints
from .costs import tokens_fed

__all__ = [
    "EMPTY",
    "CACHED",
    "READ",
    "COMPUTED",
    "MODES",
    "GridFrame",
    "BillFrame",
    "cache_grid_frames",
    "memory_bill_frames",
    "cache_grid_animation",
    "animation_html",
]

EMPTY, CACHED, READ, COMPUTED = 0, 1, 2, 3
MODES = ("naive", "cached", "prefill", "decode")
_COLORS = ("#f2f2f2", "#9ecae1", "#fdae6b", "#d62728")
_LABELS = ("empty / not kept", "cached", "read from cache", "K/V computed")


@dataclass(frozen=True)
class GridFrame:
    """One frame: ``state[layer, token]`` (int8, one of the four states) and a caption."""

    state: np.ndarray
    caption: str
    scene: str

    @property
    def computed(self) -> int:
        """Cells whose K/V this frame computes (K/V projections, counted per layer)."""
        return int((self.state == COMPUTED).sum())

    @property
    def cached_tokens(self) -> int:
        """Tokens whose K/V the cache holds after this step (none in the naive loop, which keeps nothing)."""
        if self.scene == "naive":
            return 0
        return int((self.state[0] != EMPTY).sum())


@dataclass(frozen=True)
class BillFrame:
    """One frame of the memory bill: ``batch_size`` sequences of ``seq_len`` tokens each."""

    seq_len: int
    batch_size: int
    cache_bytes: int
    weight_bytes: int
    caption: str


def _check(num_layers: int, prompt_len: int, new_tokens: int, mode: str) -> None:
    check_ints(num_layers=num_layers, prompt_len=prompt_len, new_tokens=new_tokens)
    if mode not in MODES + ("all",):
        raise ValueError(f"mode must be one of {MODES + ('all',)}, got {mode!r}")
    if mode in ("decode", "all") and new_tokens < 2:
        raise ValueError(f"mode {mode!r} needs new_tokens >= 2 (the first token comes from prefill), got {new_tokens}")


def cache_grid_frames(num_layers: int, prompt_len: int, new_tokens: int, mode: str) -> list[GridFrame]:
    """The frames of one scene (or of all four, ``mode="all"``).

    The grid has ``prompt_len + new_tokens - 1`` columns: every token that is ever
    fed to the model (the last generated token is never fed back). Step ``i``
    produces generated token ``i``; see :func:`kvcourse.costs.tokens_fed`.
    """
    _check(num_layers, prompt_len, new_tokens, mode)
    if mode == "all":
        return [f for m in MODES for f in cache_grid_frames(num_layers, prompt_len, new_tokens, m)]
    width = prompt_len + new_tokens - 1
    frames: list[GridFrame] = []

    def add(state: np.ndarray, caption: str) -> None:
        frames.append(GridFrame(state, caption, mode))

    def blank() -> np.ndarray:
        return np.full((num_layers, width), EMPTY, dtype=np.int8)

    if mode == "naive":
        for i in range(new_tokens):
            n, _ = tokens_fed(prompt_len, i, use_cache=False)
            state = blank()
            state[:, :n] = COMPUTED
            add(state, f"naive, step {i}: recompute K/V of all {n} tokens")
    elif mode == "cached":
        for i in range(new_tokens):
            n, start = tokens_fed(prompt_len, i, use_cache=True)
            state = blank()
            state[:, :start] = CACHED
            state[:, start : start + n] = COMPUTED
            what = f"prefill {n} tokens" if i == 0 else f"compute 1 column, reuse {start}"
            add(state, f"cached, step {i}: {what}")
    elif mode == "prefill":
        add(blank(), f"prefill: {prompt_len}-token prompt, cache empty")
        state = blank()
        state[:, :prompt_len] = COMPUTED
        add(state, f"prefill: all {prompt_len} columns in one pass")
        state = blank()
        state[:, :prompt_len] = CACHED
        add(state, f"prefill done: {prompt_len} columns cached")
    else:  # decode
        for i in range(1, new_tokens):
            n, start = tokens_fed(prompt_len, i, use_cache=True)
            state = blank()
            state[:, :start] = READ
            state[:, start : start + n] = COMPUTED
            add(state, f"decode, step {i}: append 1 column, read {start}")
    return frames


def memory_bill_frames(
    kv_bytes_per_token: int, weight_bytes: int, context_len: int, start_tokens: int = 1024, until: float = 2.0
) -> list[BillFrame]:
    """The memory bill scene: cache bytes as one sequence grows to ``context_len`` tokens (doubling from
    ``start_tokens``), then as the batch of full-context sequences doubles, until the cache holds at
    least ``until`` times the weight bytes."""
    check_ints(kv_bytes_per_token=kv_bytes_per_token, weight_bytes=weight_bytes, context_len=context_len,
               start_tokens=start_tokens)  # fmt: skip
    if not until > 0:
        raise ValueError(f"until must be > 0, got {until!r}")
    shapes, seq_len, batch = [], min(start_tokens, context_len), 1
    while True:
        shapes.append((seq_len, batch))
        if seq_len * batch * kv_bytes_per_token >= until * weight_bytes:
            break
        if seq_len < context_len:
            seq_len = min(2 * seq_len, context_len)
        else:
            batch *= 2
    frames = []
    for seq_len, batch in shapes:
        cache = seq_len * batch * kv_bytes_per_token
        who = f"{seq_len:,} tokens" if batch == 1 else f"{batch} sequences x {seq_len:,} tokens"
        verdict = ": it outweighs the model" if cache > weight_bytes else ""
        frames.append(
            BillFrame(
                seq_len,
                batch,
                cache,
                weight_bytes,
                f"memory bill, {who}: the cache is {cache / weight_bytes:.2g}x the weights{verdict}",
            )
        )
    return frames


def cache_grid_animation(
    num_layers: int = 8,
    prompt_len: int = 6,
    new_tokens: int = 8,
    mode: str = "all",
    interval_ms: int = 700,
    dpi: int = 80,
    kv_bytes_per_token: int | None = None,
    weight_bytes: int | None = None,
    context_len: int | None = None,
):
    """A :class:`matplotlib.animation.FuncAnimation` of :func:`cache_grid_frames`.

    With ``kv_bytes_per_token``, ``weight_bytes`` and ``context_len`` (of the whole model, not only the
    ``num_layers`` drawn), a bar chart under the grid compares the bytes the cache holds with the weights
    at every frame, and the animation ends with :func:`memory_bill_frames`. Show it in a notebook with
    ``IPython.display.HTML(anim.to_jshtml())``; the figure is closed so no static copy is displayed.
    """
    import matplotlib.pyplot as plt
    from matplotlib import animation
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    sizes = (kv_bytes_per_token, weight_bytes, context_len)
    if any(s is not None for s in sizes) and any(s is None for s in sizes):
        raise ValueError("give all of kv_bytes_per_token, weight_bytes and context_len, or none of them")
    frames = cache_grid_frames(num_layers, prompt_len, new_tokens, mode)
    bill = memory_bill_frames(kv_bytes_per_token, weight_bytes, context_len) if weight_bytes else []
    width = frames[0].state.shape[1]
    if bill:
        fig, (ax, bars_ax) = plt.subplots(2, 1, figsize=(10, 6.6), dpi=dpi, height_ratios=[3.2, 1])
        fig.subplots_adjust(left=0.1, right=0.97, top=0.83, bottom=0.09, hspace=0.42)
    else:
        fig, ax = plt.subplots(figsize=(10, 4.8), dpi=dpi)
        fig.subplots_adjust(left=0.1, right=0.97, top=0.78, bottom=0.14)
    cells = dict(
        cmap=ListedColormap(_COLORS), vmin=EMPTY, vmax=COMPUTED, aspect="auto", origin="lower", interpolation="nearest"
    )
    image = ax.imshow(frames[0].state, **cells)
    ax.set_xticks(np.arange(-0.5, width, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, num_layers, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.5)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks(range(width))
    ax.set_xticklabels([("p" if t < prompt_len else "g") + str(t) for t in range(width)], fontsize=11)
    ax.set_yticks(range(num_layers))
    ax.tick_params(axis="y", labelsize=11)
    token_label = "token position (p = prompt, g = generated)"
    xlabel = ax.set_xlabel(token_label, fontsize=12)
    ax.set_ylabel("layer", fontsize=12)
    ax.axvline(prompt_len - 0.5, color="black", linewidth=1.5)
    handles = [Patch(color=c, label=lab) for c, lab in zip(_COLORS, _LABELS)]
    ax.legend(handles=handles, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=4, fontsize=11, frameon=False)
    title = fig.suptitle(frames[0].caption, fontsize=13, x=0.535, y=0.975)
    artists = [image, title, xlabel]
    if bill:
        total = bill[-1].cache_bytes
        bars = bars_ax.barh([1, 0], [weight_bytes, 0], color=["#7f7f7f", "#3182bd"], height=0.6)
        bars_ax.set_yticks([1, 0], ["weights", "KV cache"], fontsize=11)
        bars_ax.set_xlim(0, total * 1.02)
        bars_ax.set_xlabel("memory (MB, 10^6 bytes)", fontsize=12)
        bars_ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{x / 1e6:,.0f}"))
        bars_ax.tick_params(axis="x", labelsize=11)
        value = bars_ax.text(0, 0, "", va="center", fontsize=11)
        bars_ax.text(weight_bytes, 1, f"  {weight_bytes / 1e6:,.0f} MB", va="center", fontsize=11)
        artists += [bars[1], value]

    def draw(index: int):
        if index < len(frames):
            frame = frames[index]
            image.set_data(frame.state)
            title.set_text(f"{frame.caption}   [{frame.computed} K/V computed]")
            xlabel.set_text(token_label)
            cache = frame.cached_tokens * (kv_bytes_per_token or 0)
        else:
            frame = bill[index - len(frames)]
            image.set_data(np.full_like(frames[0].state, CACHED))
            title.set_text(frame.caption)
            per_column = frame.seq_len * frame.batch_size / width
            xlabel.set_text(f"not to scale any more: each column now stands for {per_column:,.0f} tokens")
            cache = frame.cache_bytes
        if bill:
            bars[1].set_width(cache)
            text = f"{cache / 1e6:,.2f} MB" if cache < 1e7 else f"{cache / 1e6:,.0f} MB"
            inside = cache > 0.8 * bars_ax.get_xlim()[1]  # a long bar carries its label inside
            value.set_x(cache * 0.99 if inside else cache)
            value.set_text(text + "  " if inside else "  " + text)
            value.set_ha("right" if inside else "left")
            value.set_color("white" if inside else "black")
        return artists

    anim = animation.FuncAnimation(fig, draw, frames=len(frames) + len(bill), interval=interval_ms, blit=False)
    plt.close(fig)
    return anim


def animation_html(anim, alt: str) -> str:
    """``anim.to_jshtml()`` with ``alt`` on the frame image, for readers who cannot see it (matplotlib's player
    writes an ``<img>`` with no alt text). Show it with ``IPython.display.HTML``."""
    if not isinstance(alt, str) or not alt.strip():
        raise ValueError("alt must be a non-empty description of the animation")
    from html import escape

    html = shrink_frames(anim.to_jshtml())
    return html.replace("<img ", f'<img alt="{escape(alt.strip())}" ', 1)


def shrink_frames(html: str, colors: int = 48) -> str:
    """``html`` (matplotlib's ``to_jshtml``) with every embedded PNG frame reduced to a ``colors``-colour palette.

    The frames are flat colour fields and text: a palette keeps them looking the same at about a third of the
    bytes, which is most of the weight of the page that shows them (chapter 2's cache grid)."""
    import base64
    import io
    import re

    from PIL import Image

    if not isinstance(colors, int) or not 2 <= colors <= 256:
        raise ValueError(f"colors must be an int from 2 to 256, got {colors!r}")

    def shrink(match: re.Match) -> str:
        raw = base64.b64decode(re.sub(r"\\\n|\s", "", match.group(1)))  # to_jshtml wraps lines with a backslash
        image = Image.open(io.BytesIO(raw)).convert("RGB").quantize(colors=colors, method=Image.Quantize.MEDIANCUT)
        out = io.BytesIO()
        image.save(out, "PNG", optimize=True)
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode("ascii") + '"'

    return re.sub(r'data:image/png;base64,(.*?)"', shrink, html, flags=re.S)
