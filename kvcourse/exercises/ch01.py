"""Checks for chapter 1, *Naive generation and the work that repeats*.

1. :func:`check_causal_mask` -- the causal mask for queries that are the last of the keys.
2. :func:`check_attention` -- causal attention with grouped-query heads, in plain torch.
3. :func:`check_naive_attention_pairs` -- (query, key) pairs the naive loop scores in total.
4. :func:`check_frozen_positions` -- which recorded tensors a naive step leaves unchanged at past positions.
5. :func:`check_predicted_naive_step` -- predict a long naive step's time from a short one and the FLOPs.

Each check runs the learner's code on hidden random cases (seeded from the check's
``seed`` argument), prints a confirmation when every case is right, and raises
:class:`~kvcourse.exercises.ExerciseError` with the case, the expected and returned
values and a hint on the first wrong one.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable

import torch

import kvcourse
import kvcourse.costs
import kvcourse.probe

from ._core import (
    CheckResult,
    ExerciseError,
    a_number,
    an_int,
    check,
    diagnose,
    diff_below,
    expect_tensor,
    passed,
    same,
)
from ._core import hidden_generator, hidden_rng

__all__ = [
    "check_causal_mask",
    "check_attention",
    "check_naive_attention_pairs",
    "check_frozen_positions",
    "check_predicted_naive_step",
]


# --- Exercise 1: the causal mask -----------------------------------------------------------------


def _mask(num_queries: int, num_keys: int, offset: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``tril(offset)`` of a ``[num_queries, num_keys]`` block: query i may read keys 0 .. i + offset."""
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(offset)


_MASK_MISTAKES = [
    (
        lambda t, s: ~_mask(t, s, s - t),
        "It is inverted: True must mark the keys a query MAY read (its own position "
        "and the earlier ones), False the ones it must not.",
    ),
    (
        lambda t, s: _mask(t, s, s - t + 1),
        "Each query sees one key from its future. Query i sits at position "
        "num_keys - num_queries + i and may read keys up to that position, never after it.",
    ),
    (
        lambda t, s: torch.ones(t, s, dtype=torch.bool, device="cpu"),
        "Every query sees every key, its future included. "
        "Only a single query at the end (a decode step) "
        "may read all keys.",
    ),
    (lambda t, s: _mask(t, s, s - t - 1), "The diagonal is missing: each query may attend to its own position too."),
    (
        lambda t, s: _mask(t, s, 0),
        "The queries are the LAST num_queries positions: query i sits at position "
        "num_keys - num_queries + i, not at i. (torch's scaled_dot_product_attention with "
        "is_causal=True makes the same top-left alignment.)",
    ),
    (
        lambda t, s: _mask(t, s, 0).T if t == s else None,
        "It is transposed: rows are queries, columns keys, and a "
        "query looks back (columns <= its own position), not ahead.",
    ),
]


@check("ch01.check_causal_mask", takes="fn(num_queries, num_keys)")
def check_causal_mask(fn: Callable[[int, int], torch.Tensor], seed: int = 0) -> CheckResult:
    """``fn(num_queries, num_keys)`` -> bool ``[num_queries, num_keys]``, True where the query may attend.

    The queries are the *last* ``num_queries`` of the ``num_keys`` positions (a whole sequence when
    they are equal, a chunk appended to a cache otherwise).
    """
    rng = hidden_rng()
    cases = [(4, 4), (1, 6), (3, 7), (1, 1)]
    for _ in range(12):
        s = rng.randint(1, 10)
        cases.append((rng.randint(1, s), s))
    diagnose(
        fn,  # called on torch's default device, wherever that is
        cases,
        label=lambda t, s: f"causal_mask({t}, {s})",
        reference=lambda t, s: _mask(t, s, s - t),
        mistakes=[(h, m) for m, h in _MASK_MISTAKES],
        hint="Query i sits at position num_keys - num_queries + i and may attend to keys 0 up to and including that "
        "position.",
        returns=lambda case, got, t, s: expect_tensor(
            case, got, (t, s), torch.bool, "(num_queries, num_keys), True = may attend"
        ),
    )
    return passed(
        "a query at position p reads keys 0..p; for a chunk at the end of a cache that is "
        "tril(num_keys - num_queries), and a single decode query reads everything."
    )


# --- Exercise 2: causal attention with GQA -------------------------------------------------------


def _attention(q, k, v, *, scale=None, offset_shift=0, anchored=False, heads="grouped", softmax_dim=-1, mask=True):
    """Causal GQA attention with switches that reproduce the usual mistakes (the defaults are right)."""
    t, s, d = q.shape[2], k.shape[2], q.shape[-1]
    hq, hkv = q.shape[1], k.shape[1]
    heads_q = torch.arange(hq, device=q.device)
    index = heads_q // (hq // hkv) if heads == "grouped" else heads_q % hkv
    k, v = k[:, index], v[:, index]
    scores = q @ k.transpose(-1, -2) * (1 / math.sqrt(d) if scale is None else scale)
    if mask:
        allowed = _mask(t, s, (0 if anchored else s - t) + offset_shift, q.device)
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=softmax_dim).nan_to_num(0.0) @ v


_ATTENTION_MISTAKES = [
    (
        dict(scale=1.0),
        "The scores are not scaled: divide q . k by sqrt(head_dim) before the softmax, or the softmax "
        "saturates on one key as head_dim grows.",
    ),
    (
        dict(mask=False),
        "No causal mask: each query also reads keys from its future. Set the scores of keys after the "
        "query's position to -inf before the softmax.",
    ),
    (
        dict(offset_shift=1),
        "The mask lets each query see one key from its future: query i may read keys up to "
        "position S - T + i, not S - T + i + 1.",
    ),
    (
        dict(anchored=True),
        "The queries are the last T of the S positions: query i sits at position S - T + i. Your mask "
        "puts it at position i (scaled_dot_product_attention's is_causal=True does the same).",
    ),
    (dict(offset_shift=-1), "The mask hides the diagonal: a query may attend to its own position."),
    (
        dict(heads="interleaved"),
        "Query head h reads KV head h // (Hq // Hkv): consecutive query heads share a KV "
        "head. Yours pairs them as h % Hkv.",
    ),
    (
        dict(softmax_dim=-2),
        "The softmax runs over the queries. Each query's weights must sum to 1 over the keys "
        "(the last axis of the scores).",
    ),
]


@check(
    "ch01.check_attention",
    takes="fn(q, k, v)",
    references={"causal_attention": kvcourse.causal_attention, "decode_attention_ref": kvcourse.decode_attention_ref},
    task="write the attention yourself in plain torch (matmul, masked_fill, softmax).",
)
def check_attention(
    fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    seed: int = 0,
    *,
    device: torch.device | str | None = None,
) -> CheckResult:
    """``fn(q [B, Hq, T, D], k [B, Hkv, S, D], v [B, Hkv, S, D])`` -> ``[B, Hq, T, D]``.

    Causal softmax attention where the ``T`` queries are the last ``T`` of the ``S`` positions, and
    query head ``h`` reads KV head ``h // (Hq // Hkv)`` (grouped-query attention). Compared with
    :func:`kvcourse.causal_attention` on hidden random inputs, handed to ``fn`` on ``device`` (the chapter's device, default_device(), by default).
    """
    rng, gen = hidden_rng(), hidden_generator()
    shapes = [(1, 9, 3, 6, 6, 64), (1, 4, 4, 3, 7, 8), (2, 6, 2, 1, 5, 16)]  # (B, Hq, Hkv, T, S, D)
    for _ in range(8):
        hkv, group, s = rng.randint(1, 3), rng.randint(1, 3), rng.randint(2, 9)
        shapes.append((rng.randint(1, 2), hkv * group, hkv, rng.randint(2, s), s, rng.choice([8, 16, 32])))
    cases = []
    for b, hq, hkv, t, s, d in shapes:
        q = torch.randn(b, hq, t, d, generator=gen, device="cpu")
        k = torch.randn(b, hkv, s, d, generator=gen, device="cpu") * 2.0  # large enough that a missing scale shows
        cases.append((q, k, torch.randn(b, hkv, s, d, generator=gen, device="cpu")))
    diagnose(
        fn,
        cases,
        label=lambda q, k, v: f"attention(q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)})",
        reference=kvcourse.causal_attention,
        mistakes=[(h, lambda q, k, v, kw=kw: _attention(q, k, v, **kw)) for kw, h in _ATTENTION_MISTAKES],
        hint="Scores q . k / sqrt(D) for every key, -inf where the key is after the query's position (S - T + i), "
        "softmax over the keys, then the weighted sum of the values.",
        returns=lambda case, got, q, k, v: expect_tensor(case, got, tuple(q.shape), what="[B, Hq, T, D]"),
        device=device,
        extra=diff_below,
    )
    return passed(
        "scores, scale, causal mask, softmax over the keys, weighted values: with queries at the end of "
        "the keys, the same code serves a whole sequence, a prefill chunk and a decode step."
    )


# --- Exercise 3: the naive loop's attention work -------------------------------------------------


def _pairs(prompt_len: int, new_tokens: int, per_step: Callable[[int], int], first: int = 0) -> int:
    return sum(per_step(prompt_len + i) for i in range(first, new_tokens + first))


@check("ch01.check_naive_attention_pairs", takes="fn(prompt_len, new_tokens)")
def check_naive_attention_pairs(fn: Callable[[int, int], int], seed: int = 0) -> CheckResult:
    """``fn(prompt_len, new_tokens)`` -> the (query, key) pairs the causal mask allows, summed over
    every step of the naive loop (for one head in one layer)."""
    rng = hidden_rng()
    cases = [(1, 1), (5, 1), (5, 2), (1, 0), (5, 1000)]
    cases += [(rng.randint(1, 60), rng.randint(1, 80)) for _ in range(10)]
    diagnose(
        fn,
        cases,
        label=lambda p, n: f"naive_attention_pairs({p}, {n})",
        reference=lambda p, n: _pairs(p, n, lambda t: t * (t + 1) // 2),
        mistakes=[
            (
                "You counted all T x T pairs of a step. The causal mask allows only T(T+1)/2 of them: query i reads keys "
                "0..i. (A kernel that fills the whole square and then masks does T x T multiply-adds; the course counts the "
                "pairs the mask allows.)",
                lambda p, n: _pairs(p, n, lambda t: t * t),
            ),
            (
                "Off by one: each token also attends to itself, so a step over T tokens has T(T+1)/2 pairs, diagonal "
                "included.",
                lambda p, n: _pairs(p, n, lambda t: t * (t - 1) // 2),
            ),
            (
                "Off by one step: step 0 feeds the prompt alone (prompt_len tokens) and the last step feeds "
                "prompt_len + new_tokens - 1.",
                lambda p, n: _pairs(p, n, lambda t: t * (t + 1) // 2, first=1),
            ),
            (
                "That is one triangle over the final sequence: the naive loop's last step alone, or everything the "
                "cached loop scores (each pair once). The naive loop redoes the triangle at every one of the new_tokens "
                "steps.",
                lambda p, n: (p + n - 1) * (p + n) // 2 if n else 0,
            ),
        ],
        hint="Step i (i = 0 .. new_tokens-1) feeds T = prompt_len + i tokens, and the causal mask allows T(T+1)/2 "
        "(query, key) pairs in it.",
        compare=operator.eq,
        returns=an_int(),
    )
    return passed(
        "the naive loop scores sum over steps of T(T+1)/2 pairs, about n^3/6 for a long reply; "
        "a cache needs about n^2/2."
    )


# --- Exercise 4: what a naive step leaves unchanged ----------------------------------------------


def _same_past(a: torch.Tensor, b: torch.Tensor, past: int) -> bool:
    """Positions ``0 .. past-1`` (dim 0) of ``a`` and ``b`` agree up to float rounding: assert_close's tolerance
    for their dtype, which absorbs the last bits a matrix product over more rows may change."""
    x, y = a[:past], b[:past]
    if x.shape != y.shape:
        return False
    try:
        torch.testing.assert_close(x, y)
    except AssertionError:
        return False
    return True


def _frozen_names(step_a: dict, step_b: dict, past: int, same=_same_past) -> set[str]:
    return {name for name in step_a if same(step_a[name], step_b[name], past)}


def _exactly(a, b, past):  # the typical mistakes, as the learner's code would compute them
    return torch.equal(a[:past], b[:past])


def _allclose_defaults(a, b, past):
    return a[:past].shape == b[:past].shape and torch.allclose(a[:past], b[:past])


# The remedy both tolerance hints give, and it passes: a tolerance that follows the dtype, or one wide enough for
# bf16. torch.allclose's defaults are not (rtol=1e-5 is far below one bf16 step), so no hint may send a learner there.
_TOLERANCE_REMEDY = (
    "Compare with a tolerance that follows the dtype: torch.testing.assert_close(x, y) raises "
    "AssertionError when they differ by more than the dtype's rounding; or torch.allclose with "
    "rtol=1e-2 (its defaults, rtol=1e-5 and atol=1e-8, are tighter than one bf16 or fp16 step)."
)

_FROZEN_MISTAKES = [
    # before exact equality: on bf16 and fp16 cases the two agree, and this hint's remedy fits both
    (
        "torch.allclose's default tolerance (rtol=1e-5, atol=1e-8) is tighter than one step of bf16 (8 bits: about "
        "0.4% of a value) or fp16 (about 0.05%), so a tensor recomputed with a different last bit comes back changed. "
        + _TOLERANCE_REMEDY,
        lambda a, b, p: _frozen_names(a, b, p, _allclose_defaults),
    ),
    (
        "Two steps that recompute the same number can differ in its last bits (a matrix product over more rows is "
        "summed in a different order), so exact equality (torch.equal, ==) calls frozen tensors changed. "
        + _TOLERANCE_REMEDY,
        lambda a, b, p: _frozen_names(a, b, p, _exactly),
    ),
    (
        "Compare positions 0 .. past-1 only. The positions from `past` on may differ, even those step_a already has "
        "(step_a can hold more than `past` tokens).",
        lambda a, b, p: _frozen_names(a, b, p, lambda x, y, q: _same_past(x, y, len(x))),
    ),
    (
        "Off by one: positions 0 .. past-1 are `past` positions, x[:past]; x[:past - 1] leaves the last one out.",
        lambda a, b, p: _frozen_names(a, b, p, lambda x, y, q: _same_past(x, y, q - 1)),
    ),
    (
        "Positions run along dim 0 from the start of the sequence: the past is x[:past], not the last rows x[-past:].",
        lambda a, b, p: _frozen_names(a, b, p, lambda x, y, q: _same_past(x[-q:], y[-q:], q)),
    ),
]


def _model_steps(gen: torch.Generator, rng) -> tuple[dict, dict, int]:
    """A small random Llama's tensors at two naive steps: the prompt alone, then with 1-3 more tokens."""
    config = kvcourse.LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                                  max_position_embeddings=64)  # fmt: skip
    with torch.device("cpu"):  # host-side on purpose: the hidden cases are made before the learner's code runs
        model = kvcourse.LlamaModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen, device="cpu") * 0.3)
    past, extra = rng.randint(3, 20), rng.randint(1, 3)
    ids = torch.randint(0, config.vocab_size, (past + extra,), generator=gen, device="cpu").tolist()
    steps = []
    for n in (past, past + extra):
        r = kvcourse.probe.record_forward(model, ids[:n])
        q, k = r.q[1][0].transpose(0, 1), r.k[1][0].transpose(0, 1)  # layer 1, positions first: [T, H, D]
        # The newest token's attention weights over the keys (head 0): a softmax over more keys each step.
        scores = (q[-1, 0] @ k[:, 0].T) / math.sqrt(config.head_dim)
        steps.append({"q": q, "k": k, "v": r.v[1][0].transpose(0, 1), "hidden": r.hidden[0],
                      "newest_weights": torch.softmax(scores, dim=-1)})  # fmt: skip
    return steps[0], steps[1], past


def _synthetic_steps(gen: torch.Generator, rng) -> tuple[dict, dict, int]:
    """Random tensors, each changed between the steps in one of the ways that do or do not unfreeze the past."""
    dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16])
    past = rng.randint(2, 12)
    t_a = past + rng.randint(0, 3)  # step_a may already hold positions past `past`
    t_b = t_a + rng.randint(1, 3)
    kinds = ["same", "rounded", "past_changed", "last_past_changed", "first_changed", "after_past_changed"]
    step_a, step_b = {}, {}
    for i, kind in enumerate(rng.sample(kinds, len(kinds))):
        shape = (t_b, *rng.choice([(), (3,), (2, 4)]))
        full = (
            torch.randn(shape, generator=gen, device="cpu").to(dtype) + 2.0
        )  # away from 0: a relative rounding is one
        b = full.clone()
        if kind == "rounded":  # one ulp apart: what a recomputation does to the last bit
            b = torch.nextafter(full, full + 1)
        elif kind in ("past_changed", "last_past_changed", "first_changed"):
            row = {"past_changed": rng.randrange(past), "last_past_changed": past - 1, "first_changed": 0}[kind]
            b[row] += 2.0  # far beyond any rounding
        elif kind == "after_past_changed" and t_a > past:
            b[past:t_a] += 2.0  # positions step_a has but the question is not about
        step_a[f"x{i}"], step_b[f"x{i}"] = full[:t_a], b
    return step_a, step_b, past


def _names(case: str, got, step_a: dict, *_) -> list[str]:
    """The names the learner's frozen_positions returned, sorted, or an ExerciseError if that is not what came back."""
    if isinstance(got, str) or not isinstance(got, (set, frozenset, list, tuple)):
        raise ExerciseError(f"{case} should return a set of names, got {type(got).__name__}", case=case)
    if set(got) - step_a.keys():
        raise ExerciseError(
            f"{case} returned names that are not in step_a: {sorted(set(got) - step_a.keys())}", case=case
        )
    return sorted(set(got))


@check("ch01.check_frozen_positions", takes="fn(step_a, step_b, past)")
def check_frozen_positions(fn: Callable[[dict, dict, int], set], seed: int = 0) -> CheckResult:
    """``fn(step_a, step_b, past)`` -> the names whose positions ``0 .. past-1`` are the same at both steps.

    ``step_a`` and ``step_b`` map names to tensors recorded at two steps of the naive loop, positions on dim 0
    (``[T_a, ...]`` and ``[T_b, ...]``, ``T_b > T_a >= past``). "The same" means up to float rounding.
    """
    gen, rng = hidden_generator(), hidden_rng()
    diagnose(
        fn,
        [_model_steps(gen, rng) for _ in range(2)] + [_synthetic_steps(gen, rng) for _ in range(8)],
        label=lambda a, b, past: (
            f"frozen_positions(step_a, step_b, past={past}) with "
            + ", ".join(f"{n} {list(a[n].shape)}->{list(b[n].shape)}" for n in a)
        ),
        reference=lambda a, b, past: sorted(_frozen_names(a, b, past)),
        mistakes=_FROZEN_MISTAKES,
        hint="For each name, compare the first `past` positions of the two steps up to float rounding.",
        compare=lambda got, wrong: set(got) == set(wrong),
        returns=_names,
    )
    return passed(
        "a naive step recomputes every past position's Q, K, V and hidden state, and gets the same numbers "
        "up to rounding; what belongs to the newest token (its weights over the keys) changes."
    )


# --- Exercise 5: predict a naive step from the FLOPs ----------------------------------------------


def _pass_flops(tokens: int, per_token: float, per_pair: float) -> float:
    """FLOPs of a pass over ``tokens`` tokens: linear work per token, attention per allowed pair."""
    return per_token * tokens + per_pair * tokens * (tokens + 1) / 2


def _predicted_naive_step_ms(
    ms_short: float, short_len: int, long_len: int, per_token: float, per_pair: float
) -> float:
    return ms_short * _pass_flops(long_len, per_token, per_pair) / _pass_flops(short_len, per_token, per_pair)


_PREDICT_STEP_MISTAKES = [
    (
        "You scaled by the tokens alone: that is the linear work, but every query of the longer pass also reads more "
        "keys. Add per_pair_flops x T(T+1)/2 to each pass's FLOPs.",
        lambda ms, s, l, t, p: ms * l / s,
    ),
    (
        "You scaled by the square of the tokens: only attention grows as T^2, and at these lengths it is the smaller "
        "part. A pass costs per_token_flops x T plus per_pair_flops x T(T+1)/2.",
        lambda ms, s, l, t, p: ms * (l / s) ** 2,
    ),
    (
        "You counted all T x T (query, key) pairs. The causal mask allows T(T+1)/2 of them: query i reads keys 0..i.",
        lambda ms, s, l, t, p: ms * (t * l + p * l * l) / (t * s + p * s * s),
    ),
    (
        "Off by one: each query also reads its own key, so a pass over T tokens has T(T+1)/2 pairs, diagonal included.",
        lambda ms, s, l, t, p: ms * (t * l + p * l * (l - 1) / 2) / (t * s + p * s * (s - 1) / 2),
    ),
    (
        "Upside down: the longer pass does more work, so the time is ms_short x FLOPs(long_len) / FLOPs(short_len).",
        lambda ms, s, l, t, p: ms * _pass_flops(s, t, p) / _pass_flops(l, t, p),
    ),
    (
        "You added the FLOPs' difference as milliseconds: scale the measured time by the ratio of the two passes' "
        "FLOPs instead.",
        lambda ms, s, l, t, p: ms + _pass_flops(l, t, p) - _pass_flops(s, t, p),
    ),
]


@check(
    "ch01.check_predicted_naive_step",
    takes="predict_naive_step_ms",
    references={
        "kvcourse.costs.flop_scaled_ms": kvcourse.costs.flop_scaled_ms,
        "kvcourse.costs.forward_flops": kvcourse.costs.forward_flops,
    },
    task="count a pass's FLOPs from per_token_flops and per_pair_flops yourself.",
)
def check_predicted_naive_step(fn: Callable[[float, int, int, float, float], float], seed: int = 0) -> CheckResult:
    """``fn(ms_short, short_len, long_len, per_token_flops, per_pair_flops)`` -> the predicted time (ms) of a
    naive step over ``long_len`` tokens, from one measured over ``short_len`` tokens, in proportion to the FLOPs
    of each pass (``per_token_flops`` per token fed, ``per_pair_flops`` per (query, key) pair the mask allows)."""
    rng = hidden_rng()
    # SmolLM2's own figures first (chapter 1's 16 -> 384 tokens), then random models and lengths, some long
    # enough for attention to be most of a pass
    cases = [(40.0, 16, 384, 269_000_000.0, 69_120.0), (10.0, 1, 2, 1000.0, 10.0)]
    for _ in range(10):
        short = rng.randint(1, 64)
        cases.append((round(rng.uniform(1, 200), 3), short, short + rng.randint(1, 4000),
                       float(rng.randint(10**6, 10**9)), float(rng.randint(10**3, 10**6))))  # fmt: skip
    diagnose(
        fn,
        cases,
        label=lambda ms, s, l, t, p: f"predict_naive_step_ms({ms}, {s}, {l}, {t:.0f}, {p:.0f})",
        reference=_predicted_naive_step_ms,
        mistakes=_PREDICT_STEP_MISTAKES,
        hint="A pass over T tokens costs per_token_flops x T + per_pair_flops x T(T+1)/2 FLOPs; the prediction is "
        "ms_short times the long pass's FLOPs over the short pass's.",
        compare=lambda got, want: same(got, want, rel=1e-6, abs_tol=0.0),
        returns=a_number("a finite number of milliseconds", finite=True),
    )
    return passed(
        "time in proportion to the FLOPs, attention's T(T+1)/2 pairs included; it leaves out the "
        "fixed read of every weight, which a short pass pays as much as a long one."
    )


# an unwritten answer is reported ("Not done yet"), not raised: see _core.reports_unfinished
