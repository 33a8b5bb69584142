"""Checks for chapter 8, *Compressing the cache*.

1. :func:`check_quantizer` -- asymmetric integer quantization of each row, and back.
2. :func:`check_ring_slot` -- where a sliding-window cache with attention sinks writes each token
   (optionally driving the real model through a ring buffer built on the learner's answer).
3. :func:`check_snapkv_keep` -- SnapKV's choice of tokens from a prefill's attention, against what
   :class:`~kvcourse.compression.DroppingKVCache` keeps.
4. :func:`check_absorbed_decode` -- an MLA decode step computed on the cached latents (``W_uk`` absorbed
   into the query, ``W_uv`` into the output), against attention over the per-head K and V that
   :mod:`kvcourse.mla` expands.
5. :func:`check_rounding_mse` -- the error a quantizer should give, predicted from its groups' ranges, against
   :func:`kvcourse.compression.quantization.rounding_mse`.

Each check runs the learner's code on hidden random cases (seeded from the check's ``seed``
argument) and raises :class:`~kvcourse.exercises.ExerciseError` with the case, the expected and
returned values and a hint on the first wrong one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ..compression import window as _window
from ..compression.dropping import DroppingKVCache, select_tokens
from ..compression.quantization import fake_quantize, rounding_mse
from ..mla import LatentCache, MLAConfig, MultiHeadLatentAttention
from ._core import CheckResult, Diagnosis, ExerciseError, call_learner, check, describe, diagnose, expect_tensor
from ._core import fail, handed, hidden_generator, hidden_rng, learner_device, learner_runs, on_host, passed, same
from ._core import tensor_diff

__all__ = ["check_absorbed_decode", "check_quantizer", "check_ring_slot", "check_rounding_mse", "check_snapkv_keep"]


# --- Exercise 1: a quantizer ---------------------------------------------------------------------


def _fake_quant(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The right answer: per-row min-max quantization to ``bits``-bit codes, then back (fp32 scale)."""
    levels = 2**bits - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    scale = (hi - lo) / levels
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(torch.round((x - lo) / safe), 0, levels) * scale + lo


def _with_levels(x: torch.Tensor, bits: int, steps: int, round_fn=torch.round, per_row: bool = True) -> torch.Tensor:
    lo = x.amin(-1, keepdim=True) if per_row else x.min().expand(*x.shape[:-1], 1)
    hi = x.amax(-1, keepdim=True) if per_row else x.max().expand(*x.shape[:-1], 1)
    scale = (hi - lo) / steps
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    return torch.clamp(round_fn((x - lo) / safe), 0, 2**bits - 1) * scale + lo


def _no_zero_point(x: torch.Tensor, bits: int) -> torch.Tensor:
    levels = 2**bits - 1
    scale = (x.amax(-1, keepdim=True) - x.amin(-1, keepdim=True)) / levels
    return torch.clamp(torch.round(x / scale), 0, levels) * scale


def _symmetric(x: torch.Tensor, bits: int) -> torch.Tensor:
    top = 2 ** (bits - 1) - 1
    scale = x.abs().amax(-1, keepdim=True) / top
    return torch.clamp(torch.round(x / scale), -top, top) * scale


def _codes_only(x: torch.Tensor, bits: int) -> torch.Tensor:
    levels = 2**bits - 1
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    return torch.round((x - lo) / ((hi - lo) / levels))


_QUANT_MISTAKES = [
    (
        "With b bits the codes run from 0 to 2**b - 1: that is 2**b - 1 steps from the row's minimum to its maximum, "
        "so scale = (max - min) / (2**b - 1). Dividing by 2**b leaves the largest value short.",
        lambda x, bits: _with_levels(x, bits, 2**bits),
    ),
    (
        "Round to the nearest code (torch.round) instead of truncating: truncation doubles the worst error and pulls "
        "every value down.",
        lambda x, bits: _with_levels(x, bits, 2**bits - 1, torch.floor),
    ),
    (
        "One scale and zero point per row: take the minimum and maximum along the last axis (keepdim=True), not over "
        "the whole tensor.",
        lambda x, bits: _with_levels(x, bits, 2**bits - 1, per_row=False),
    ),
    (
        "Subtract the zero point (the row's minimum) before dividing by the scale, and add it back after: otherwise "
        "the negative values fall below code 0.",
        _no_zero_point,
    ),
    (
        "That is symmetric quantization (codes around 0, scale from the largest |x|). Here the codes are unsigned, "
        "0 .. 2**b - 1, with the row's minimum as zero point.",
        _symmetric,
    ),
    ("Return the values the codes stand for (code * scale + zero point), not the codes.", _codes_only),
]


def _same_codes(got: torch.Tensor, want: torch.Tensor, x: torch.Tensor, bits: int) -> bool:
    """Equal up to float noise; a value halfway between two codes may round either way."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    step = (hi - lo) / (2**bits - 1)
    diff = (got - want).abs()
    close = diff <= 1e-4 * step + 1e-6
    t = (x - lo) / torch.where(step > 0, step, torch.ones_like(step))
    tie = ((t - t.floor()) - 0.5).abs() < 1e-3
    return bool((close | (tie & (diff <= step * 1.001))).all())


@check(
    "ch08.check_quantizer",
    takes="fn(x, bits)",
    references={"fake_quantize": fake_quantize},
    task="write the quantizer yourself.",
)
def check_quantizer(
    fn: Callable[[torch.Tensor, int], torch.Tensor], seed: int = 0, *, device: torch.device | str | None = None
) -> CheckResult:
    """``fn(x, bits)`` -> the values ``x`` comes back as after ``bits``-bit asymmetric quantization of each row.

    Every row (the last axis) is one group: zero point = the row's minimum, scale = its range over
    ``2**bits - 1`` steps, codes rounded to the nearest integer in ``0 .. 2**bits - 1``. ``x`` is handed to
    ``fn`` on ``device`` (the chapter's device, default_device(), by default).
    """
    device = learner_device(device)
    rng, gen = hidden_rng(), hidden_generator()
    cases = []
    for bits in (8, 4, 2, 3, 8, 4):
        shape = rng.choice([(4, 16), (3, 8), (2, 3, 32)])
        x = torch.randn(*shape, generator=gen, device="cpu") * rng.uniform(0.5, 4) + rng.uniform(-1, 1)
        if rng.random() < 0.5:
            x[..., rng.randrange(shape[-1])] *= 8  # an outlier in some rows
        cases.append((x, bits))
    diagnose(
        fn,
        cases,
        label=lambda x, bits: f"quantize-dequantize({describe(x)}, bits={bits})",
        reference=_fake_quant,
        mistakes=_QUANT_MISTAKES,
        hint="Per row: scale = (max - min) / (2**bits - 1), code = round((x - min) / scale), value = code * scale + "
        "min.",
        compare=lambda got, wrong: same(got, wrong, rtol=1e-4, atol=1e-4),
        right=lambda got, want, x, bits: _same_codes(got.float(), want, x, bits),
        returns=lambda case, got, x, bits: expect_tensor(case, got, tuple(x.shape), what="(the shape of x)"),
        device=device,
        extra=lambda got, want: f" ({tensor_diff(got, want)})",
        call=lambda label, fn, x, bits: call_learner("your quantizer", fn, x, bits),
    )
    # A row whose values are all equal has no range: every code is 0 and the row comes back exactly.
    flat = torch.full((2, 8), 1.5, device="cpu")
    got = on_host(call_learner("your quantizer", fn, handed(flat, device), 4))
    if not isinstance(got, torch.Tensor) or not torch.equal(got.float(), flat):
        fail("quantize-dequantize of a constant row [1.5, 1.5, ...], bits=4", expected=flat, got=got,
             hint="max - min is 0 for a constant row: guard the division (any nonzero scale works there, "
                  "every code is 0 and the row comes back as its minimum).")  # fmt: skip
    return passed(
        "every value comes back within half a step (scale / 2) of itself, and the step is the row's "
        "range over 2**bits - 1."
    )


# --- Exercise 2: the ring buffer with attention sinks ---------------------------------------------


def _held(slot_for: Callable[[int, int, int], int], num_tokens: int, num_sinks: int, window: int) -> list[int]:
    slots = [-1] * (num_sinks + window)
    for pos in range(num_tokens):
        slots[slot_for(pos, num_sinks, window)] = pos
    return slots


def _expected_held(num_tokens: int, num_sinks: int, window: int) -> list[int]:
    return sorted(set(range(min(num_sinks, num_tokens))) | set(range(max(num_tokens - window, 0), num_tokens)))


_RING_MISTAKES = [
    (
        "The sinks were overwritten: the ring turns over the window's slots only. Positions below num_sinks keep "
        "their slots for good.",
        lambda p, s, w: p % (s + w),
    ),
    (
        "The ring ignores the sinks: slot p % window lands on a sink's slot. The ring's slots come after the sinks.",
        lambda p, s, w: p % w if p >= s else p,
    ),
    (
        "Once the cache is full, a ring buffer overwrites its *oldest* token (the one window positions back), not "
        "its newest.",
        lambda p, s, w: min(p, s + w - 1),
    ),
]


@check(
    "ch08.check_ring_slot",
    takes="slot_for(pos, num_sinks, window)",
    references={"ring_slot": _window.ring_slot, "SinkKVCache": _window.SinkKVCache},
    task="write the slot formula yourself.",
)
def check_ring_slot(slot_for: Callable[[int, int, int], int], model=None, seed: int = 0) -> CheckResult:
    """``slot_for(pos, num_sinks, window)`` -> the slot, in ``0 .. num_sinks + window - 1``, where the token at
    position ``pos`` is written, so that after tokens ``0 .. n-1`` are written in order the cache holds the first
    ``num_sinks`` and the last ``window`` of them. With ``model``, the check also decodes text through a ring
    buffer that uses your slots, and compares the logits with the exact sliding-window attention.
    """
    rng = hidden_rng()
    pairs = [(4, 4), (0, 3), (1, 1), (2, 5)] + [(rng.randint(0, 4), rng.randint(1, 6)) for _ in range(6)]
    diagnosis = Diagnosis([(hint, (lambda m: lambda n, s, w: sorted(p for p in _held(m, n, s, w) if p >= 0))(m))
                           for hint, m in _RING_MISTAKES],
                          "After writing tokens 0 .. n-1 in order, the slots must hold positions 0 .. num_sinks-1 and "
                          "the last `window` positions.", lambda got, wrong: got == wrong)  # fmt: skip
    for num_sinks, window in pairs:
        size = num_sinks + window
        slots = [-1] * size
        for pos in range(num_sinks + 3 * window + 1):
            slot = call_learner("slot_for", slot_for, pos, num_sinks, window)
            case = f"slot_for({pos}, num_sinks={num_sinks}, window={window})"
            if isinstance(slot, bool) or not isinstance(slot, int):
                raise ExerciseError(f"{case} should return an int, got {type(slot).__name__}", case=case)
            if not 0 <= slot < size:
                fail(case, expected=f"a slot in 0 .. {size - 1}", got=slot,
                     hint="The cache has num_sinks + window slots; a ring wraps around with % window.")  # fmt: skip
            slots[slot] = pos
            got = sorted(p for p in slots if p >= 0)
            want = _expected_held(pos + 1, num_sinks, window)
            if got != want:
                diagnosis.record(f"after writing positions 0 .. {pos} with num_sinks={num_sinks}, window={window}, "
                                 f"the positions held", (pos + 1, num_sinks, window), got, want)  # fmt: skip
                break
    diagnosis.raise_if_wrong()
    if model is not None:
        _ring_on_the_model(slot_for, model)
    return passed(
        "each token overwrites the one that came window positions earlier, and the sinks stay: memory is "
        "bounded at num_sinks + window tokens."
    )


def _ring_on_the_model(slot_for: Callable[[int, int, int], int], model) -> None:
    class LearnerRing(_window.SinkKVCache):
        def slots(self, positions: torch.Tensor) -> torch.Tensor:
            with learner_runs():
                slots = [slot_for(int(p), self.num_sinks, self.window) for p in positions.tolist()]
            return torch.tensor(slots, dtype=torch.int64, device=positions.device)

    ids = [1, 504, 3458, 282, 4649, 314, 17, 30, 2045, 1099, 28, 253, 1183, 314, 16, 4, 2116, 18]
    num_sinks, window = 2, 5
    want = on_host(_window.simulate_window_logits(model, ids, window, num_sinks))
    cache = LearnerRing.for_model(
        model.config, window=window, num_sinks=num_sinks, dtype=model.dtype, device=model.device
    )
    got = on_host(torch.cat([model(torch.tensor([[i]], device=model.device), cache=cache)[0] for i in ids]).float())
    scale = float(want.abs().max())
    if not torch.allclose(got, want, rtol=0, atol=1e-4 * scale):
        fail(
            f"decoding {len(ids)} tokens on the real model through your ring (num_sinks={num_sinks}, window={window})",
            expected="the logits of exact sliding-window attention with sinks",
            got=tensor_diff(got, want),
            hint="The positions held look right; check the slot is an int for every "
            "position and that nothing else writes into the sinks.",
        )


# --- Exercise 3: SnapKV's scores ------------------------------------------------------------------


def _attention_probs(gen: torch.Generator, num_heads: int, seq_len: int) -> torch.Tensor:
    """Causal attention weights ``[num_heads, seq_len, seq_len]`` that look like a prefill's: a sink at
    position 0, a few keys every head's queries favour, and noise."""
    logits = torch.randn(num_heads, seq_len, seq_len, generator=gen, device="cpu")
    hot = torch.randint(0, seq_len, (num_heads, 4), generator=gen, device="cpu")
    logits.scatter_add_(
        -1, hot[:, None].expand(num_heads, seq_len, 4), torch.full((num_heads, seq_len, 4), 3.0, device="cpu")
    )
    logits[..., 0] += 2.0  # an attention sink
    future = torch.ones(seq_len, seq_len, dtype=torch.bool, device="cpu").triu(1)
    return torch.softmax(logits.masked_fill(future, float("-inf")), -1)


def _snapkv_votes(
    probs: torch.Tensor, num_kv_heads: int, window: int, *, all_queries: bool = False, interleaved: bool = False
) -> torch.Tensor:
    """``[num_kv_heads, S]``: the attention each prompt token gets from the observation window's queries,
    summed over the query heads that share a KV head (or, as mistakes, from every query / the wrong heads)."""
    h, s, _ = probs.shape
    votes = probs.sum(1) if all_queries else probs[:, -window:].sum(1)  # [H, S]
    if interleaved:
        return votes.view(h // num_kv_heads, num_kv_heads, s).sum(0)
    return votes.view(num_kv_heads, h // num_kv_heads, s).sum(1)


def _snapkv_scores(probs, num_kv_heads, window, kernel, *, pool=True, prefix_pool=False, **mistake) -> torch.Tensor:
    votes = _snapkv_votes(probs, num_kv_heads, window, **mistake)
    if prefix_pool:  # SnapKV's own code: the prefix's votes pooled on their own (the window is kept anyway)
        pooled = F.max_pool1d(votes[:, None, :-window], kernel, stride=1, padding=kernel // 2)[:, 0]
        return torch.cat([pooled, votes[:, -window:]], -1)
    if pool:  # a token next to a hit counts as a hit: phrases survive whole
        votes = F.max_pool1d(votes[:, None], kernel, stride=1, padding=kernel // 2)[:, 0]
    return votes


def _snapkv_keep(probs, num_kv_heads, budget, window, kernel, *, keep_window=True, ranked=False, **mistake):
    """A typical answer's kept positions ``[num_kv_heads, budget]``, ascending (every flag default: right).

    ``ranked``: also the scores it chose by, ``(positions, scores)``, so that an answer breaking ties otherwise is
    still recognised as this mistake (:func:`_like_mistake`)."""
    scores = _snapkv_scores(probs, num_kv_heads, window, kernel, **mistake)
    if keep_window:
        scores = scores.clone()
        scores[:, -window:] = float("inf")
    kept = scores.topk(budget, -1).indices.sort(-1).values
    return (kept, scores) if ranked else kept


def _package_keep(probs, num_kv_heads, budget, window, kernel) -> torch.Tensor:
    """What :class:`~kvcourse.compression.DroppingKVCache` keeps: the attention is handed to a one-layer cache
    exactly as the model's attention hands it over, then the cache compresses itself with SnapKV."""
    h, s, _ = probs.shape
    cache = DroppingKVCache(1, 1, num_kv_heads, 2, observation_window=window)
    # Only the positions matter here, not the keys and values.
    cache.update(0, probs.new_zeros(1, num_kv_heads, s, 2), probs.new_zeros(1, num_kv_heads, s, 2))
    cache.observe_attention(0, probs[None])
    cache.compress(budget, "snapkv", pool_kernel=kernel)
    return cache.key_positions(0)[0]


def _same_keep(got: torch.Tensor, want: torch.Tensor, scores: torch.Tensor) -> bool:
    """The same tokens kept, or tokens whose scores tie with them (max-pooling makes plateaus of equal
    scores; which of a tied group a top-k returns is arbitrary)."""
    if torch.equal(got, want):
        return True
    if got.shape != want.shape or not bool((got[:, 1:] > got[:, :-1]).all()):
        return False
    if got.min() < 0 or got.max() >= scores.shape[-1]:
        return False
    return torch.allclose(
        scores.gather(-1, got).sort(-1).values, scores.gather(-1, want).sort(-1).values, rtol=1e-5, atol=1e-7
    )


def _mostly_same(got: torch.Tensor, wrong: torch.Tensor) -> bool:
    """A typical mistake explains an answer that keeps (almost) the same tokens: ties may be broken otherwise."""
    if got.shape != wrong.shape:
        return False
    shared = sum(len(set(g.tolist()) & set(w.tolist())) for g, w in zip(got, wrong))
    return shared >= 0.95 * got.numel()


def _like_mistake(got: torch.Tensor, mistake: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """``got`` is what a typical mistake keeps: the same tokens up to ties in its scores, or nearly the same."""
    kept, scores = mistake
    return _same_keep(got, kept, scores) or _mostly_same(got, kept)


def _snapkv_ranked(probs, num_kv_heads, window, kernel) -> torch.Tensor:
    scores = _snapkv_scores(probs, num_kv_heads, window, kernel).clone()
    scores[:, -window:] = float("inf")
    return scores


_SNAPKV_MISTAKES = [
    (
        "Score with the observation window's queries only, the last `window` rows of probs: summing every query's "
        "attention is H2O's heavy-hitter score, not SnapKV's.",
        lambda probs, g, b, w, k: _snapkv_keep(probs, g, b, w, k, all_queries=True, ranked=True),
    ),
    (
        "Max-pool the scores along the tokens (kernel `kernel`, stride 1, padding kernel // 2) before choosing: a "
        "token next to a hit is kept with it, so phrases survive whole.",
        lambda probs, g, b, w, k: _snapkv_keep(probs, g, b, w, k, pool=False, ranked=True),
    ),
    (
        "Keep the observation window's own `window` tokens whatever their score, and give the rest of the budget to "
        "the best pooled scores.",
        lambda probs, g, b, w, k: _snapkv_keep(probs, g, b, w, k, keep_window=False, ranked=True),
    ),
    (
        "KV head j serves query heads j * group ... (j + 1) * group - 1 (group = num_heads // num_kv_heads), "
        "consecutive heads as `repeat_interleave` lays them out, not heads j, j + num_kv_heads, ...",
        lambda probs, g, b, w, k: _snapkv_keep(probs, g, b, w, k, interleaved=True, ranked=True),
    ),
    # issue 47: the paper's code, which the exercise text now rules out in so many words
    (
        "Pool all S scores, the observation window's own tokens included, as DroppingKVCache does: a prefix token "
        "within kernel // 2 of the window takes the pooled maximum over window tokens too. SnapKV's own code pools "
        "the prefix alone (probs[:, -window:, :-window]); this exercise does not.",
        lambda probs, g, b, w, k: _snapkv_keep(probs, g, b, w, k, prefix_pool=True, ranked=True),
    ),
]


def _first_difference(got: torch.Tensor, want: torch.Tensor) -> str:
    """Where two ``[num_kv_heads, budget]`` position lists first part: their first few entries are often the
    same (the sink, the hot tokens), so the message shows the first index where they are not."""
    for head, (g, w) in enumerate(zip(got.tolist(), want.tolist())):
        for i, (a, b) in enumerate(zip(g, w)):
            if a != b:
                return (
                    f"; first difference at [{head}, {i}]: expected position {b}, got {a} "
                    f"(KV head {head} keeps {sorted(set(g) - set(w))} instead of {sorted(set(w) - set(g))})"
                )
    return ""


def _kept_positions(label: str, got, probs, g, b, *_) -> torch.Tensor:
    """The learner's kept positions as int64 on the host, or a failure if they are not ``[g, b]`` ascending."""
    got = on_host(expect_tensor(label, got, (g, b), what="(per KV head, the kept positions)")).long()
    if not bool((got[:, 1:] > got[:, :-1]).all()):
        fail(
            label,
            expected="positions in ascending order, each once",
            got=got,
            hint="Sort each KV head's kept positions (topk returns them by score), e.g. .sort(-1).values.",
        )
    return got


@check(
    "ch08.check_snapkv_keep",
    takes="snapkv_keep(probs, num_kv_heads, budget, window, kernel)",
    references={"select_tokens": select_tokens, "DroppingKVCache": DroppingKVCache},
    task="score and choose the tokens yourself.",
)
def check_snapkv_keep(snapkv_keep: Callable, seed: int = 0, *, device: torch.device | str | None = None) -> CheckResult:
    """``snapkv_keep(probs, num_kv_heads, budget, window, kernel)`` -> the positions ``[num_kv_heads, budget]``
    (ascending) of the prompt tokens SnapKV keeps for each KV head, from one layer's prefill attention
    ``probs [num_heads, S, S]`` (handed to it on ``device``, default_device() by default); compared with what
    :class:`~kvcourse.compression.DroppingKVCache` keeps."""
    rng, gen = hidden_rng(), hidden_generator()
    cases = []
    for num_heads, num_kv_heads in [(4, 2), (6, 3), (9, 3), (6, 2), (4, 1), (8, 4)]:
        s = rng.randint(40, 96)
        window, kernel = rng.choice([4, 8, 16]), rng.choice([3, 5, 7])
        budget = rng.randint(window + 4, s - 8)
        cases.append((_attention_probs(gen, num_heads, s), num_kv_heads, budget, window, kernel))
    diagnose(
        snapkv_keep,
        cases,
        label=lambda probs, g, b, w, k: (
            f"snapkv_keep(probs {list(probs.shape)}, num_kv_heads={g}, budget={b}, window={w}, kernel={k})"
        ),
        reference=_package_keep,
        mistakes=_SNAPKV_MISTAKES,
        hint="Per query head: sum probs over the last `window` queries; add up the heads of each KV head's group; "
        "max-pool along the tokens; force the last `window` tokens in; keep the top `budget`; sort the positions.",
        compare=_like_mistake,
        right=lambda got, want, probs, g, b, w, k: _same_keep(got, want, _snapkv_ranked(probs, g, w, k)),
        returns=_kept_positions,
        device=device,
        extra=_first_difference,
    )
    return passed("the observation window's votes, pooled, choose the same tokens as DroppingKVCache.compress.")


# --- Exercise 4: MLA's weight absorption ----------------------------------------------------------


def _absorbed(
    q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale, *, rope=True, scaled=True, softmax_dim=-1, swap=False
) -> torch.Tensor:
    """One decode step in latent space (every flag default: right; one flag changed: a typical mistake)."""
    w_k, w_v = (w_uv, w_uk) if swap else (w_uk, w_uv)
    q_latent = torch.einsum("hn,hnc->hc", q_nope, w_k)  # W_uk absorbed into the query
    scores = q_latent @ latent.T + (q_rope @ k_rope.T if rope else 0)
    probs = torch.softmax(scores * (scale if scaled else 1.0), dim=softmax_dim)
    return torch.einsum("hc,hvc->hv", probs @ latent, w_v)  # W_uv absorbed into the output


_MLA_MISTAKES = [
    (
        "Add the RoPE part of the score, q_rope @ k_rope.T: RoPE depends on the key's position, so it cannot be "
        "absorbed into the latent and MLA caches that small key beside it.",
        lambda *case: _absorbed(*case, rope=False),
    ),
    (
        "Multiply the scores by `scale` (1 / sqrt of the whole query head, nope + rope) before the softmax.",
        lambda *case: _absorbed(*case, scaled=False),
    ),
    (
        "Take the softmax over the cached tokens (the last axis of the [heads, tokens] scores), not over the heads.",
        lambda *case: _absorbed(*case, softmax_dim=0),
    ),
    (
        "The keys come from W_uk (absorb it into the query) and the values from W_uv (absorb it into the output); "
        "they are swapped.",
        lambda *case: _absorbed(*case, swap=True),
    ),
]


class _ShapeRecorder(TorchDispatchMode):
    """Records the shape of every tensor an aten op returns while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.shapes.append(tuple(t.shape))
        return out


def _mla_case(rng, gen, seed: int):
    """A random MLA layer, a prompt prefilled into its latent cache, and one decode step: the learner's
    arguments, and the per-head output of the expanded form (:meth:`MultiHeadLatentAttention.expanded_kv`)."""
    heads, head_dim, rope_dim = rng.choice([2, 3, 4]), rng.choice([8, 16]), rng.choice([4, 6])
    config = MLAConfig(
        hidden_size=rng.choice([48, 64]),
        num_heads=heads,
        qk_nope_head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=head_dim,
        kv_lora_rank=rng.choice([20, 24, 40]),
    )
    mla = MultiHeadLatentAttention(config, seed=seed, device="cpu")
    # Every size distinct, so that a tensor's shape says what it holds (the check looks for per-head K or V).
    sizes = {heads, head_dim, rope_dim, config.kv_lora_rank, config.hidden_size, heads * head_dim}
    prompt = rng.choice([n for n in range(5, 60) if n + 1 not in sizes])
    x = torch.randn(1, prompt + 1, config.hidden_size, generator=gen, device="cpu")
    cache = LatentCache()
    mla(x[:, :prompt], cache)
    layer_out = mla(x[:, prompt:], cache)  # the expanded form's output for the new token; appends its latent
    q = mla.q_proj(x[:, prompt:]).view(heads, head_dim + rope_dim)
    q_nope, q_rope = q.split([head_dim, rope_dim], -1)
    q_rope = mla._rope(q_rope[None, None], torch.tensor([prompt], device=x.device))[0, 0]  # at the new token's position
    k, v = mla.expanded_kv(cache)  # [1, H, S, nope + rope], [1, H, S, v]: what an MHA cache would hold
    probs = torch.softmax(torch.einsum("hd,hsd->hs", torch.cat([q_nope, q_rope], -1), k[0]) * mla.scale, -1)
    want = torch.einsum("hs,hsv->hv", probs, v[0])
    w_uk = mla.k_up.weight.view(heads, head_dim, config.kv_lora_rank)
    w_uv = mla.v_up.weight.view(heads, head_dim, config.kv_lora_rank)
    args = (q_nope, q_rope, cache.latent[0], cache.k_rope[0], w_uk, w_uv, mla.scale)
    return mla, args, want, layer_out


@check(
    "ch08.check_absorbed_decode",
    takes="absorbed_decode(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale)",
    references={"MultiHeadLatentAttention": MultiHeadLatentAttention},
    task="compute the step in latent space yourself.",
)
def check_absorbed_decode(
    absorbed_decode: Callable, seed: int = 0, *, device: torch.device | str | None = None
) -> CheckResult:
    """``absorbed_decode(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale)`` -> the new token's attention
    output per head ``[heads, v_head_dim]``, computed on the cached latents (``W_uk`` absorbed into the query,
    ``W_uv`` into the output) and compared with attention over the per-head K and V that
    :meth:`kvcourse.mla.MultiHeadLatentAttention.expanded_kv` rebuilds. The tensors are handed to it on
    ``device`` (the chapter's device, default_device(), by default)."""
    device = learner_device(device)
    rng, gen = hidden_rng(), hidden_generator()
    diagnosis = Diagnosis(
        _MLA_MISTAKES,
        same=lambda got, wrong: torch.allclose(got, wrong, rtol=1e-4, atol=1e-5),
        default="q_latent = q_nope through W_uk (per head: q_nope[h] @ w_uk[h]); scores = "
        "(q_latent @ latent.T + q_rope @ k_rope.T) * scale; softmax over the tokens; "
        "context = probs @ latent; output = context through W_uv (per head: "
        "w_uv[h] @ context[h]).",
    )
    for i in range(6):
        mla, args, want, layer_out = _mla_case(rng, gen, seed * 100 + i)
        q_nope, _, latent, _, w_uk, _, _ = args
        label = (
            f"absorbed_decode(heads={q_nope.shape[0]}, head_dim={q_nope.shape[1]}, kv_lora_rank="
            f"{latent.shape[1]}, {latent.shape[0]} cached tokens)"
        )
        recorder = _ShapeRecorder()
        with recorder:
            got = call_learner(
                "absorbed_decode",
                absorbed_decode,
                *(handed(a, device) if isinstance(a, torch.Tensor) else a for a in args),
            )
        expect_tensor(label, got, tuple(want.shape), what="(heads, v_head_dim)")
        got = on_host(got)
        if not torch.allclose(got.float(), want, rtol=1e-4, atol=1e-5):
            diagnosis.record(label, args, got.float(), want, extra=f" ({tensor_diff(got, want)})")
            continue
        s, n = latent.shape[0], q_nope.shape[1]
        built = [shape for shape in recorder.shapes if s in shape and n in shape and len(shape) >= 2]
        if built:
            fail(label, expected="nothing per head built for the cached tokens: tensors of [heads, tokens] and "
                                 "[heads, kv_lora_rank] only", got=f"a tensor of shape {list(built[0])}",
                 hint="That is the expanded form: it rebuilt every head's keys or values for all cached tokens. "
                      "Absorb instead: move the query into latent space through W_uk, attend over the latents, "
                      "and apply W_uv to the latent context.")  # fmt: skip
    diagnosis.raise_if_wrong()
    return passed(
        "attention over the latents, W_uk in the query and W_uv in the output, equals attention over "
        "the expanded per-head K and V, and never builds them."
    )


# --- Exercise 5: the error a quantizer should give, before it runs ---------------------------------------------------


def _mse_wrong(
    x: torch.Tensor,
    bits: int,
    dim: int,
    *,
    levels: int | None = None,
    per: float = 12,
    whole: bool = False,
    squared: bool = True,
    mean_step: bool = False,
) -> float:
    """The rounding-noise model with one typical slip."""
    xf = x.float()
    lo = xf.amin() if whole else xf.amin(dim, keepdim=True)
    hi = xf.amax() if whole else xf.amax(dim, keepdim=True)
    step = (hi - lo) / (2**bits - 1 if levels is None else levels)
    if mean_step:
        return float(step.mean() ** 2 / per)
    return float(((step**2 if squared else step) / per).mean())


def _other_axis(x: torch.Tensor, dim: int) -> int:
    return -2 if dim % x.dim() == x.dim() - 1 else -1


_MSE_MISTAKES = [
    (
        "b bits give 2**b codes, so 2**b - 1 steps between the group's min and max.",
        lambda x, b, d: _mse_wrong(x, b, d, levels=2**b),
    ),
    (
        "Half a step is the largest error, not the typical one: an error spread evenly over [-step/2, step/2] has a "
        "mean square of step**2 / 12, not step**2 / 4.",
        lambda x, b, d: _mse_wrong(x, b, d, per=4),
    ),
    (
        "Each group has its own range: min and max along dim, one step per group, not one for the whole tensor.",
        lambda x, b, d: _mse_wrong(x, b, d, whole=True),
    ),
    (
        "The groups run along dim: reduce min and max over dim (keepdim), not over the other axis.",
        lambda x, b, d: _mse_wrong(x, b, _other_axis(x, d)),
    ),
    (
        "Square the step: a mean squared error is in squared units, step**2 / 12.",
        lambda x, b, d: _mse_wrong(x, b, d, squared=False),
    ),
    (
        "Average the squared steps, not the steps: groups with a wide range weigh in squared.",
        lambda x, b, d: _mse_wrong(x, b, d, mean_step=True),
    ),
]


def _an_mse(case: str, got, *_) -> float:
    if isinstance(got, torch.Tensor) and got.numel() == 1:
        got = float(on_host(got))
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        fail(case, expected="a mean squared error (a number)", got=describe(got), hint="Return a float.")
    return got


@check(
    "ch08.check_rounding_mse",
    takes="fn(x, bits, dim)",
    references={"rounding_mse": rounding_mse, "fake_quantize": fake_quantize},
    task="predict from the ranges, without quantizing.",
)
def check_rounding_mse(
    fn: Callable[[torch.Tensor, int, int], float], seed: int = 0, *, device: torch.device | str | None = None
) -> CheckResult:
    """``fn(x, bits, dim)`` -> the mean squared error ``bits``-bit asymmetric quantization of ``x`` in groups along
    ``dim`` should give, from the groups' ranges (the rounding-noise model,
    :func:`kvcourse.compression.quantization.rounding_mse`). ``x`` is handed to ``fn`` on ``device``."""
    rng, gen = hidden_rng(), hidden_generator()
    cases = []
    for bits, dim in ((4, -1), (8, -1), (4, -2), (2, 0), (3, -1), (4, 1)):
        shape = rng.choice([(16, 64), (32, 8), (4, 12, 16)])
        x = torch.randn(*shape, generator=gen, device="cpu") * rng.uniform(0.5, 3)
        x[..., rng.randrange(shape[-1])] *= 10  # an outlier channel, as keys have
        cases.append((x, bits, dim))
    diagnose(
        fn,
        cases,
        label=lambda x, bits, dim: f"rounding_mse({describe(x)}, bits={bits}, dim={dim})",
        reference=rounding_mse,
        mistakes=_MSE_MISTAKES,
        hint="Per group (along dim): step = (max - min) / (2**bits - 1); predict step**2 / 12 for each value and "
        "average.",
        compare=lambda got, wrong: abs(got - wrong) <= 1e-5 * abs(wrong) + 1e-12,
        returns=_an_mse,
        device=device,
        call=lambda label, fn, *args: call_learner("your prediction", fn, *args),
    )
    x, _, _ = cases[0]
    measured = float((fake_quantize(x, "int4") - x).pow(2).mean())
    return passed(
        f"the ranges predict {rounding_mse(x, 4):.4f} for int4 on the first case, and quantizing it "
        f"measures {measured:.4f}: rounding noise, step**2 / 12."
    )
