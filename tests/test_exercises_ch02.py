"""Chapter 2's checks accept right answers and reject each typical wrong answer with its own hint.

The wrong answers are written the way a learner would write them, independently of the checks.
"""

from __future__ import annotations

import math

import pytest
import torch

import kvcourse
from kvcourse.exercises import ExerciseError, ch02


# ---- 1. positions of new tokens ----------------------------------------------------------------
def test_positions_accept_right_answers(device):
    assert ch02.check_new_positions(lambda lens, n: lens[:, None] + torch.arange(n, device=lens.device), device=device)
    assert ch02.check_new_positions(
        lambda lens, n: torch.stack([torch.arange(s, s + n) for s in lens.tolist()]), device=device
    )  # a result on the CPU is compared there


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda lens, n: torch.arange(n).repeat(len(lens), 1), "No RoPE offset"),
        (lambda lens, n: lens[:, None] + torch.arange(1, n + 1), "not s \\+ 1"),
        (lambda lens, n: lens[:, None] + torch.arange(n) - 1, "not s - 1"),
        (lambda lens, n: lens.max() + torch.arange(n).repeat(len(lens), 1), "its own length"),
        (lambda lens, n: (lens[:, None] + torch.arange(n)).float(), "integers"),
        (lambda lens, n: (lens[:, None] + torch.arange(n)).T, "shape"),
        (lambda lens, n: lens[:, None] * torch.arange(n), "seq_lens\\[b\\] \\+ j"),
    ],
)
def test_positions_reject_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_new_positions(wrong)


# ---- 2. update for a preallocated cache ---------------------------------------------------------
class RightCache:
    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, max_seq_len):
        shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.k = [torch.zeros(shape) for _ in range(num_layers)]
        self.v = [torch.zeros(shape) for _ in range(num_layers)]
        self.lengths = [0] * num_layers

    @property
    def seq_len(self):
        return self.lengths[0]

    def update(self, layer_idx, k, v):
        start = self.lengths[layer_idx]
        end = start + k.shape[2]
        if end > self.k[layer_idx].shape[2]:
            raise ValueError("cache full")
        self.k[layer_idx][:, :, start:end] = k
        self.v[layer_idx][:, :, start:end] = v
        self.lengths[layer_idx] = end
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]


class NoOffset(RightCache):
    def update(self, layer_idx, k, v):
        end = self.lengths[layer_idx] + k.shape[2]
        self.k[layer_idx][:, :, : k.shape[2]] = k  # always at the start
        self.v[layer_idx][:, :, : k.shape[2]] = v
        self.lengths[layer_idx] = end
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]


class OnlyNew(RightCache):
    def update(self, layer_idx, k, v):
        super().update(layer_idx, k, v)
        return k, v


class WholeBuffer(RightCache):
    def update(self, layer_idx, k, v):
        super().update(layer_idx, k, v)
        return self.k[layer_idx], self.v[layer_idx]


class OffByOne(RightCache):
    def update(self, layer_idx, k, v):
        keys, values = super().update(layer_idx, k, v)
        end = keys.shape[2]
        return self.k[layer_idx][:, :, : end + 1], self.v[layer_idx][:, :, : end + 1]


class OneCounter(RightCache):
    """seq_len advanced by every layer's update."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.count = 0

    @property
    def seq_len(self):
        return self.count

    def update(self, layer_idx, k, v):
        out = super().update(layer_idx, k, v)
        self.count += k.shape[2]
        return out


class SharedBuffer(RightCache):
    """One buffer for all layers."""

    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, max_seq_len):
        super().__init__(num_layers, batch_size, num_kv_heads, head_dim, max_seq_len * num_layers)
        self.k = [self.k[0]] * num_layers
        self.v = [self.v[0]] * num_layers
        self.max_seq_len = max_seq_len

    def update(self, layer_idx, k, v):
        if self.lengths[layer_idx] + k.shape[2] > self.max_seq_len:
            raise ValueError("full")
        return super().update(layer_idx, k, v)


class Concat:
    def __init__(self, num_layers, batch_size, num_kv_heads, head_dim, max_seq_len):
        self.k, self.v, self.max_seq_len = [None] * num_layers, [None] * num_layers, max_seq_len

    @property
    def seq_len(self):
        return 0 if self.k[0] is None else self.k[0].shape[2]

    def update(self, layer_idx, k, v):
        if self.k[layer_idx] is not None and self.k[layer_idx].shape[2] + k.shape[2] > self.max_seq_len:
            raise ValueError("full")
        self.k[layer_idx] = k if self.k[layer_idx] is None else torch.cat([self.k[layer_idx], k], dim=2)
        self.v[layer_idx] = v if self.v[layer_idx] is None else torch.cat([self.v[layer_idx], v], dim=2)
        return self.k[layer_idx], self.v[layer_idx]


class NoOverflowCheck(RightCache):
    def update(self, layer_idx, k, v):
        start = self.lengths[layer_idx]
        end = start + k.shape[2]
        self.k[layer_idx][:, :, start:end] = k  # past the end the slice is empty and k broadcasts into it
        self.v[layer_idx][:, :, start:end] = v
        self.lengths[layer_idx] = end
        return self.k[layer_idx][:, :, :end], self.v[layer_idx][:, :, :end]


class WrongError(RightCache):
    def update(self, layer_idx, k, v):
        if self.lengths[layer_idx] + k.shape[2] > self.k[layer_idx].shape[2]:
            raise IndexError("no room")
        return super().update(layer_idx, k, v)


class SilentlyDrops(RightCache):
    def update(self, layer_idx, k, v):
        if self.lengths[layer_idx] + k.shape[2] > self.k[layer_idx].shape[2]:
            return self.k[layer_idx], self.v[layer_idx]
        return super().update(layer_idx, k, v)


class Swapped(RightCache):
    def update(self, layer_idx, k, v):
        keys, values = super().update(layer_idx, k, v)
        return values, keys


class SeqLenMethod(RightCache):
    def seq_len(self):  # forgot @property
        return self.lengths[0]


def test_update_accepts_a_right_cache(capsys, device):
    assert ch02.check_cache_update(RightCache, device=device)
    assert ch02.check_cache_update(RightCache, seed=5, device=device)


def test_update_runs_the_real_model(model_on, device):
    assert ch02.check_cache_update(RightCache, model_on)
    with pytest.raises(ValueError, match="give model or device, not both"):
        ch02.check_cache_update(RightCache, model_on, device=device)


@pytest.mark.parametrize(
    ("cls", "hint"),
    [
        (NoOffset, "written at position 0"),
        (OnlyNew, "Only the new tokens came back"),
        (WholeBuffer, "whole buffer"),
        (OffByOne, "Off by one"),
        (OneCounter, "once per layer call"),
        (SharedBuffer, "another layer's tokens"),
        (Concat, "preallocated buffer"),
        (NoOverflowCheck, "refuse a write past the end"),
        (WrongError, "raise a ValueError"),
        (SilentlyDrops, "refuse a write past the end"),
        (Swapped, "swapped"),
        (SeqLenMethod, "@property"),
    ],
)
def test_update_rejects_wrong_caches_with_their_hint(cls, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_cache_update(cls)


def test_update_refuses_the_package_cache():
    class Mine(kvcourse.KVCache):
        pass

    with pytest.raises(ExerciseError, match="inherits from kvcourse.KVCache"):
        ch02.check_cache_update(Mine)
    with pytest.raises(ExerciseError, match="class itself"):
        ch02.check_cache_update(RightCache(1, 1, 1, 2, 4))


# ---- 3. chunked prefill (the bug hunt) ----------------------------------------------------------
def right_prefill(model, ids, chunk_size):
    cache = kvcourse.KVCache.for_model(model.config, device=model.device)
    for start in range(0, len(ids), chunk_size):
        logits = model(torch.tensor([ids[start : start + chunk_size]], device=model.device), cache=cache)
    return logits[0, -1], cache


def buggy_prefill(model, ids, chunk_size):  # the chapter's bug: the range stops one token early
    cache = kvcourse.KVCache.for_model(model.config)
    for start in range(0, len(ids) - 1, chunk_size):
        logits = model(torch.tensor([ids[start : start + chunk_size]]), cache=cache)
    return logits[0, -1], cache


def fresh_cache_per_chunk(model, ids, chunk_size):
    for start in range(0, len(ids), chunk_size):
        cache = kvcourse.KVCache.for_model(model.config)
        logits = model(torch.tensor([ids[start : start + chunk_size]]), cache=cache)
    return logits[0, -1], cache


def overlapping_chunks(model, ids, chunk_size):
    cache = kvcourse.KVCache.for_model(model.config)
    for start in range(0, len(ids), chunk_size):
        logits = model(torch.tensor([ids[max(start - 1, 0) : start + chunk_size]]), cache=cache)
    return logits[0, -1], cache


def first_logits_of_last_chunk(model, ids, chunk_size):
    cache = kvcourse.KVCache.for_model(model.config)
    for start in range(0, len(ids), chunk_size):
        logits = model(torch.tensor([ids[start : start + chunk_size]]), cache=cache)
    return logits[0, 0], cache


def one_pass_ignoring_chunks(model, ids, chunk_size):  # issue 36: the same cache and logits, no chunks at all
    cache = kvcourse.KVCache.for_model(model.config)
    logits = model(torch.tensor([ids]), cache=cache)
    return logits[0, -1], cache


def token_at_a_time(model, ids, chunk_size):  # at most chunk_size per pass: smaller chunks are chunks too
    cache = kvcourse.KVCache.for_model(model.config, device=model.device)
    for t in ids:
        logits = model(torch.tensor([[t]], device=model.device), cache=cache)
    return logits[0, -1], cache


def test_the_cache_lists_what_each_forward_pass_wrote(model):
    cache = kvcourse.KVCache.for_model(model.config)
    assert cache.writes == []
    model(torch.tensor([[1, 2, 3, 4, 5]]), cache=cache)
    model(torch.tensor([[6]]), cache=cache)
    assert cache.writes == [5, 1]
    assert right_prefill(model, list(range(8)), 3)[1].writes == [3, 3, 2]


def test_chunked_prefill_accepts_the_fix(model_on):
    assert ch02.check_chunked_prefill(right_prefill, model_on)
    assert ch02.check_chunked_prefill(token_at_a_time, model_on)


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (buggy_prefill, "never reached the model"),
        (fresh_cache_per_chunk, "only the last chunk"),
        (overlapping_chunks, "fed twice"),
        (first_logits_of_last_chunk, "LAST prompt token"),
        (one_pass_ignoring_chunks, "each call of the model takes at most chunk_size tokens"),
        (lambda model, ids, chunk_size: None, "tuple \\(logits, cache\\)"),
    ],
)
def test_chunked_prefill_rejects_wrong_answers_with_their_hint(model, fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_chunked_prefill(fn, model)


# ---- 4. decode attention over a padded batch ----------------------------------------------------
def attend_with(q, k, v, seq_lens, *, scale=True, lens_shift=0, interleave=False, softmax=True, mask=True):
    hq, hkv, s = q.shape[1], k.shape[1], k.shape[2]
    if interleave:
        k, v = k.repeat(1, hq // hkv, 1, 1), v.repeat(1, hq // hkv, 1, 1)
    else:
        k, v = k.repeat_interleave(hq // hkv, dim=1), v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q, k)
    if scale:
        scores = scores / math.sqrt(q.shape[-1])
    lens = (seq_lens + lens_shift).clamp(1, s)
    valid = torch.arange(s, device=q.device)[None, :] < lens[:, None]
    if not mask:
        valid = torch.ones_like(valid)
    if softmax:
        weights = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1)
    else:
        weights = scores * valid[:, None]
    return torch.einsum("bhs,bhsd->bhd", weights, v)


def test_decode_attention_accepts_right_answers(device):
    assert ch02.check_decode_attention(attend_with, device=device)
    assert ch02.check_decode_attention(attend_with, seed=2, device=device)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda q, k, v, lens: attend_with(q, k, v, lens, scale=False), "sqrt\\(head_dim\\)"),
        (lambda q, k, v, lens: attend_with(q, k, v, lens, mask=False), "padding is not masked"),
        (lambda q, k, v, lens: attend_with(q, k, v, lens, lens_shift=-1), "dropped the last one"),
        (lambda q, k, v, lens: attend_with(q, k, v, lens, lens_shift=1), "one slot of padding"),
        (lambda q, k, v, lens: attend_with(q, k, v, lens, interleave=True), "not h % Hkv"),
        (lambda q, k, v, lens: attend_with(q, k, v, lens, softmax=False), "need a softmax"),
        (lambda q, k, v, lens: q, "set padded keys to -inf"),
        (lambda q, k, v, lens: q[:, :1], "shape"),
    ],
)
def test_decode_attention_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_decode_attention(wrong)


def test_decode_attention_refuses_the_reference():
    with pytest.raises(ExerciseError, match="kvcourse's own decode_attention_ref"):
        ch02.check_decode_attention(kvcourse.decode_attention_ref)


# ---- 5. when the cache outweighs the weights ----------------------------------------------------
def right_tokens(cfg, batch):
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * batch
    return math.ceil(cfg["num_parameters"] / per_token)


def test_outweigh_accepts_right_answers(model):
    assert ch02.check_tokens_to_outweigh(right_tokens)
    # the formula against a real cache: at that many tokens, a real KVCache holds >= the fp32 weights
    cfg = model.config
    smol = dict(
        num_parameters=model.num_parameters(),
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
    )
    n = right_tokens(smol, 1)
    cache = kvcourse.KVCache(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cfg.head_dim)
    for layer in range(cfg.num_hidden_layers):
        cache.update(
            layer,
            torch.zeros(1, cfg.num_key_value_heads, n - 1, cfg.head_dim),
            torch.zeros(1, cfg.num_key_value_heads, n - 1, cfg.head_dim),
        )
    assert cache.nbytes < model.num_parameters() * 4 <= cache.nbytes + cache.nbytes // (n - 1)


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (
            lambda c, b: math.ceil(
                c["num_parameters"] / (c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * b)
            ),
            "factor 2",
        ),
        (
            lambda c, b: math.ceil(
                c["num_parameters"] / (2 * c["num_hidden_layers"] * c["num_attention_heads"] * c["head_dim"] * b)
            ),
            "query heads are not",
        ),
        (lambda c, b: right_tokens(c, 1), "its own cache"),
        (
            lambda c, b: (
                c["num_parameters"] // (2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * b)
            ),
            "round up",
        ),
        (
            lambda c, b: (
                c["num_parameters"] // (2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * b) + 1
            ),
            "divide exactly",
        ),
        (lambda c, b: str(right_tokens(c, b)), "should return an int"),
        (lambda c, b: right_tokens(c, b) * 4, "Divide the parameters"),
    ],
)
def test_outweigh_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_tokens_to_outweigh(wrong)


def test_no_reference_answers_are_public():
    for name in dir(ch02):
        obj = getattr(ch02, name)
        if callable(obj) and getattr(obj, "__module__", "") == ch02.__name__ and not name.startswith("_"):
            assert name.startswith("check_"), f"ch02.{name} is public but not a check"


# --- exercise 6: a generation's time from a step-cost model ---------------------------------------
def right_generation_ms(prompt_len, new_tokens, fixed_ms, per_token_ms, use_cache):
    total = 0.0
    for i in range(new_tokens):
        fed = (prompt_len if i == 0 else 1) if use_cache else prompt_len + i
        total += fixed_ms + per_token_ms * fed
    return total


def test_predicted_generation_accepts_the_step_model(capsys):
    assert ch02.check_predicted_generation(right_generation_ms)
    assert "x3.6" in capsys.readouterr().out


def test_predicted_generation_is_the_packages_model():
    # StepCost and costs.tokens_fed, as chapter 2's prediction cell and chapter 6's engine use them
    from kvcourse.costs import tokens_fed
    from kvcourse.serving.load import StepCost

    cost = StepCost(fixed_s=0.037, per_token_s=0.0015)
    for use_cache in (False, True):
        package = sum(cost.seconds(tokens_fed(5, i, use_cache)[0], 1) for i in range(128))
        assert math.isclose(package * 1e3, right_generation_ms(5, 128, 37.0, 1.5, use_cache), rel_tol=1e-9)


def _fed_sum(fed, n, fixed, per_token):
    return sum(fixed + per_token * fed(i) for i in range(n))


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (
            lambda p, n, f, t, c: _fed_sum(lambda i: (p if i == 0 else 1) if c else p + i + 1, n, f, t),
            "Off by one token",
        ),
        (lambda p, n, f, t, c: _fed_sum(lambda i: 1 if c else p + i, n, f, t), "prefill is one step"),
        (lambda p, n, f, t, c: right_generation_ms(p, n, f, t, not c), "use_cache decides"),
        (lambda p, n, f, t, c: right_generation_ms(p, n, f, t, c) - (n - 1) * f, "Every step pays the fixed cost"),
        (lambda p, n, f, t, c: right_generation_ms(p, n + 1, f, t, c), "One step per new token"),
        (lambda p, n, f, t, c: 2 * right_generation_ms(p, n, f, t, c), "fixed_ms \\+ per_token_ms x"),
    ],
)
def test_predicted_generation_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch02.check_predicted_generation(wrong)


def test_predicted_generation_refuses_the_package_model():
    from kvcourse.serving.load import StepCost

    def through_step_cost(p, n, f, t, c):
        return sum(StepCost(f, t).seconds(p + i, 0) for i in range(n))

    with pytest.raises(ExerciseError, match="StepCost"):
        ch02.check_predicted_generation(through_step_cost)
