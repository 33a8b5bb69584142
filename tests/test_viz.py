"""The cache grid: which cells each scene lights, and that it agrees with kvcourse.costs."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcourse.costs import kv_projections_total
from kvcourse.viz import (
    CACHED,
    COMPUTED,
    EMPTY,
    MODES,
    READ,
    cache_grid_animation,
    cache_grid_frames,
    memory_bill_frames,
)

sizes = st.tuples(st.integers(1, 6), st.integers(1, 12), st.integers(2, 12))


def _columns(state: np.ndarray, value: int) -> list[int]:
    """Token positions whose whole column (every layer) is in ``value``; checks columns are uniform."""
    assert (state == state[:1]).all(), "every layer of a column must be in the same state"
    return [int(t) for t in np.flatnonzero(state[0] == value)]


@settings(max_examples=60, deadline=None)
@given(sizes)
def test_computed_cells_add_up_to_the_cost_model(size):
    layers, prompt, new = size
    for mode, use_cache in (("naive", False), ("cached", True)):
        frames = cache_grid_frames(layers, prompt, new, mode)
        assert len(frames) == new
        assert sum(f.computed for f in frames) == kv_projections_total(prompt, new, use_cache, num_layers=layers)


@settings(max_examples=60, deadline=None)
@given(sizes)
def test_naive_relights_the_whole_sequence_every_step(size):
    layers, prompt, new = size
    for i, frame in enumerate(cache_grid_frames(layers, prompt, new, "naive")):
        assert frame.state.shape == (layers, prompt + new - 1)
        assert _columns(frame.state, COMPUTED) == list(range(prompt + i))
        assert not (frame.state == CACHED).any() and not (frame.state == READ).any()


@settings(max_examples=60, deadline=None)
@given(sizes)
def test_cached_prefills_then_computes_one_column_per_step(size):
    layers, prompt, new = size
    frames = cache_grid_frames(layers, prompt, new, "cached")
    assert _columns(frames[0].state, COMPUTED) == list(range(prompt))
    for i, frame in enumerate(frames[1:], start=1):
        assert _columns(frame.state, COMPUTED) == [prompt + i - 1]
        assert _columns(frame.state, CACHED) == list(range(prompt + i - 1))


@settings(max_examples=60, deadline=None)
@given(sizes)
def test_prefill_fills_the_prompt_in_one_frame_and_decode_reads_everything(size):
    layers, prompt, new = size
    empty, filled, done = (f.state for f in cache_grid_frames(layers, prompt, new, "prefill"))
    assert (empty == EMPTY).all()
    assert _columns(filled, COMPUTED) == list(range(prompt))
    assert _columns(done, CACHED) == list(range(prompt))
    decode = cache_grid_frames(layers, prompt, new, "decode")
    assert len(decode) == new - 1
    for i, frame in enumerate(decode, start=1):
        assert _columns(frame.state, READ) == list(range(prompt + i - 1))
        assert _columns(frame.state, COMPUTED) == [prompt + i - 1]
        assert frame.computed == layers  # constant work per decode step


def test_all_plays_the_four_scenes_in_order():
    frames = cache_grid_frames(4, 3, 5, "all")
    scenes = [f.scene for f in frames]
    assert scenes == ["naive"] * 5 + ["cached"] * 5 + ["prefill"] * 3 + ["decode"] * 4
    assert set(scenes) == set(MODES)


@pytest.mark.parametrize(
    "args, exc, match",
    [
        ((0, 3, 4, "naive"), ValueError, "num_layers"),
        ((2, 0, 4, "naive"), ValueError, "prompt_len"),
        ((2, 3, 0, "cached"), ValueError, "new_tokens"),
        ((2, 3, 4, "paged"), ValueError, "mode"),
        ((2, 3, 1, "decode"), ValueError, "new_tokens >= 2"),
        ((2.0, 3, 4, "naive"), TypeError, "num_layers must be an int >= 1, got float"),
    ],
)
def test_bad_arguments_are_named(args, exc, match):
    with pytest.raises(exc, match=match):
        cache_grid_frames(*args)


def test_animation_has_one_frame_per_grid_frame_and_renders_deterministically():
    pytest.importorskip("matplotlib")
    anim = cache_grid_animation(num_layers=3, prompt_len=2, new_tokens=3, mode="all", dpi=20)
    html = anim.to_jshtml()
    assert html.count("data:image/png") == len(cache_grid_frames(3, 2, 3, "all"))
    again = cache_grid_animation(num_layers=3, prompt_len=2, new_tokens=3, mode="all", dpi=20).to_jshtml()

    def strip_ids(s: str) -> str:  # the same patterns as book/nbval-sanitize.cfg
        return re.sub(r"anim[0-9a-f]{32}", "animID", re.sub(r"_anim_[0-9a-zA-Z_]+", "_anim_ID", s))

    assert strip_ids(html) == strip_ids(again)


@settings(max_examples=40, deadline=None)
@given(sizes)
def test_cached_tokens_are_the_columns_the_cache_holds(size):
    layers, prompt, new = size
    assert all(f.cached_tokens == 0 for f in cache_grid_frames(layers, prompt, new, "naive"))
    for i, frame in enumerate(cache_grid_frames(layers, prompt, new, "cached")):
        assert frame.cached_tokens == prompt + i  # the prompt, then one more column per step


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10**6), st.integers(1, 10**10), st.integers(1, 2**17))
def test_memory_bill_grows_until_the_cache_outweighs_the_weights(per_token, weights, context):
    frames = memory_bill_frames(per_token, weights, context, until=2.0)
    caches = [f.cache_bytes for f in frames]
    assert caches == sorted(caches) and len(set(caches)) == len(caches)  # strictly growing
    assert caches[-1] >= 2 * weights and (len(caches) == 1 or caches[-2] < 2 * weights)
    for f in frames:
        assert f.cache_bytes == f.seq_len * f.batch_size * per_token and f.seq_len <= context
        assert f.batch_size == 1 or f.seq_len == context  # a batch only of full-context sequences
        assert ("outweighs the model" in f.caption) == (f.cache_bytes > weights)


def test_memory_bill_for_smollm2_needs_two_full_contexts():
    frames = memory_bill_frames(46_080, 4 * 134_515_008, 8192)
    first_over = next(f for f in frames if f.cache_bytes >= f.weight_bytes)
    assert (first_over.seq_len, first_over.batch_size) == (8192, 2)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        memory_bill_frames(0, 10, 10)


def test_animation_is_readable_and_ends_with_the_bill():
    pytest.importorskip("matplotlib")
    anim = cache_grid_animation(
        num_layers=4,
        prompt_len=3,
        new_tokens=3,
        kv_bytes_per_token=46_080,
        weight_bytes=4 * 134_515_008,
        context_len=8192,
    )
    fig = anim._fig
    width, height = fig.get_size_inches() * fig.dpi
    assert width >= 780 and height >= 450  # pixels
    texts = [
        t for t in fig.findobj(lambda a: hasattr(a, "get_fontsize") and hasattr(a, "get_text")) if t.get_text().strip()
    ]
    assert texts and min(t.get_fontsize() for t in texts) >= 11
    frames = len(cache_grid_frames(4, 3, 3, "all")) + len(memory_bill_frames(46_080, 4 * 134_515_008, 8192))
    assert anim.to_jshtml().count("data:image/png") == frames
    with pytest.raises(ValueError, match="or none of them"):
        cache_grid_animation(kv_bytes_per_token=10)


def test_the_sanitizer_hides_exactly_the_digits_approx_marks():
    """kvcourse.utils.approx marks CPU-dependent numbers; book/nbval-sanitize.cfg must hide each of them whole."""
    from pathlib import Path

    from nbval.plugin import get_sanitize_patterns

    from kvcourse.utils import approx

    text = (Path(__file__).parents[1] / "book" / "nbval-sanitize.cfg").read_text(encoding="utf-8")
    patterns = get_sanitize_patterns(text)  # as nbval does, whatever the locale

    def sanitize(s: str) -> str:
        for regex, replace in patterns:
            s = re.sub(regex, replace, s)
        return s

    for value, spec in ((13.97, ".2f"), (-0.0014, "+.2%"), (0.988, ".1%"), (12073.9, ",.1f"), (5e-4, ".1e"), (1, "d")):
        line = f"perplexity {approx(value, spec)} (of 1024 tokens)"
        assert sanitize(line) == "perplexity APPROX_NUM (of 1024 tokens)", line
    assert sanitize("13.97 vs 13.99 (-0.1%)") == "13.97 vs 13.99 (-0.1%)"  # unmarked digits stay


def test_the_animation_html_describes_its_frames():
    import matplotlib

    matplotlib.use("Agg")
    import pytest

    from kvcourse.viz import animation_html, cache_grid_animation

    anim = cache_grid_animation(num_layers=2, prompt_len=2, new_tokens=1, mode="naive")
    html = animation_html(anim, "Cells light up <as> computed")
    assert html.count("<img") == 1 and '<img alt="Cells light up &lt;as&gt; computed" ' in html
    with pytest.raises(ValueError, match="alt"):
        animation_html(anim, "  ")


def test_shrunk_frames_keep_the_picture_at_a_fraction_of_the_bytes():
    import base64
    import io
    import re

    import matplotlib

    matplotlib.use("Agg")
    import numpy as np
    import pytest
    from PIL import Image

    from kvcourse.viz import cache_grid_animation, shrink_frames

    html = cache_grid_animation(num_layers=4, prompt_len=3, new_tokens=3, mode="cached").to_jshtml()
    out = shrink_frames(html)
    pattern = r'data:image/png;base64,(.*?)"'

    def frames(text):
        return [
            Image.open(io.BytesIO(base64.b64decode(re.sub(r"\\\n|\s", "", f)))) for f in re.findall(pattern, text, re.S)
        ]

    before, after = frames(html), frames(out)
    assert len(after) == len(before) >= 3 and len(out) < 0.6 * len(html)
    for a, b in zip(before, after):
        assert b.mode == "P" and b.size == a.size
        diff = np.abs(np.asarray(a.convert("RGB"), dtype=int) - np.asarray(b.convert("RGB"), dtype=int))
        assert np.mean(diff.max(axis=2) > 24) < 0.01  # under 1% of pixels visibly changed
    assert out.count("<img") == html.count("<img")  # the player is untouched
    with pytest.raises(ValueError, match="colors"):
        shrink_frames(html, colors=1)
