"""The cache grid: one column per token, one row per layer, animated step by step.

Each cell is one (layer, token) pair, i.e. that token's K and V vectors in that
layer. At every generation step a cell is in one of four states:

* ``EMPTY``    -- the token does not exist yet, or (naive loop) nothing is kept;
* ``CACHED``   -- its K/V sit in the cache, untouched this step;
* ``READ``     -- its K/V are read from the cache by the new token's attention;
* ``COMPUTED`` -- its K/V are (re)computed by this step's forward pass.

:func:`cache_grid_frames` is the pure logic (which cells are lit at each frame,
following :func:`kvcourse.costs.tokens_fed` exactly, so the lit cells add up to
:func:`kvcourse.costs.kv_projections_total`). :func:`cache_grid_animation` draws
it with matplotlib. Four scenes (``mode``):

* ``"naive"``   -- every step recomputes the whole sequence: the grid relights;
* ``"cached"``  -- one prefill pass, then one new column per step;
* ``"prefill"`` -- the prompt's columns are filled in a single parallel pass;
* ``"decode"``  -- with the prompt cached, each step appends one column and
  reads all the others (compute is constant, memory traffic grows);
* ``"all"``     -- the four scenes above, one after the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .costs import tokens_fed

__all__ = [
    "EMPTY",
    "CACHED",
    "READ",
    "COMPUTED",
    "MODES",
    "GridFrame",
    "cache_grid_frames",
    "cache_grid_animation",
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


def _check(num_layers: int, prompt_len: int, new_tokens: int, mode: str) -> None:
    for name, value in (("num_layers", num_layers), ("prompt_len", prompt_len), ("new_tokens", new_tokens)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
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


def cache_grid_animation(
    num_layers: int = 8,
    prompt_len: int = 6,
    new_tokens: int = 8,
    mode: str = "all",
    interval_ms: int = 600,
    dpi: int = 60,
):
    """A :class:`matplotlib.animation.FuncAnimation` of :func:`cache_grid_frames`.

    Show it in a notebook with ``IPython.display.HTML(anim.to_jshtml())``. The
    figure is closed so that no static copy is displayed as well.
    """
    import matplotlib.pyplot as plt
    from matplotlib import animation
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    frames = cache_grid_frames(num_layers, prompt_len, new_tokens, mode)
    width = frames[0].state.shape[1]
    fig, ax = plt.subplots(figsize=(6.4, 0.9 + 0.28 * num_layers), dpi=dpi)
    image = ax.imshow(
        frames[0].state,
        cmap=ListedColormap(_COLORS),
        vmin=EMPTY,
        vmax=COMPUTED,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
    )
    ax.set_xticks(np.arange(-0.5, width, 1), minor=True)
    ax.set_yticks(np.arange(-0.5, num_layers, 1), minor=True)
    ax.grid(which="minor", color="white", linewidth=1.0)
    ax.tick_params(which="minor", length=0)
    ax.set_xticks(range(width))
    ax.set_xticklabels([("p" if t < prompt_len else "g") + str(t) for t in range(width)], fontsize=7)
    ax.set_yticks(range(num_layers))
    ax.set_xlabel("token position (p = prompt, g = generated)")
    ax.set_ylabel("layer")
    ax.axvline(prompt_len - 0.5, color="black", linewidth=1.0)
    ax.legend(
        handles=[Patch(color=c, label=lab) for c, lab in zip(_COLORS, _LABELS)],
        loc="upper center",
        bbox_to_anchor=(0.5, -0.32),
        ncol=4,
        fontsize=7,
        frameon=False,
    )
    title = ax.set_title(frames[0].caption, fontsize=10)
    fig.tight_layout()

    def draw(index: int):
        frame = frames[index]
        image.set_data(frame.state)
        title.set_text(f"{frame.caption}   [{frame.computed} K/V computed]")
        return image, title

    anim = animation.FuncAnimation(fig, draw, frames=len(frames), interval=interval_ms, blit=False)
    plt.close(fig)
    return anim
