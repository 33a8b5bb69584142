"""Checks for chapter 2, *The KV cache: prefill and decode*.

1. :func:`check_new_positions` -- the RoPE positions of new tokens in a batch with different cache lengths.
2. :func:`check_cache_update` -- ``update`` for a cache that preallocates its memory (optionally on the real model).
3. :func:`check_chunked_prefill` -- the bug hunt: prefill a prompt a chunk at a time, on the real model.
4. :func:`check_decode_attention` -- one decode step of attention over a padded batch of caches, with GQA.
5. :func:`check_tokens_to_outweigh` -- when the cache of a batch holds more bytes than the model's weights.
6. :func:`check_predicted_generation` -- a whole generation's time, naive or cached, from a step-cost model.

Each check runs the learner's code on hidden random cases (seeded from the check's
``seed`` argument) and raises :class:`~kvcourse.exercises.ExerciseError` with the case,
the expected and returned values and a hint on the first wrong one.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

import torch

import kvcourse
import kvcourse.costs
from kvcourse.serving.load import StepCost

from ._core import CheckResult, ExerciseError, a_number, an_int, call_learner, check, describe, diagnose, diff_below
from ._core import expect_tensor, fail, handed, hidden_generator, hidden_rng, learner_device, learner_runs, on_host
from ._core import passed, same

__all__ = [
    "check_new_positions",
    "check_cache_update",
    "check_chunked_prefill",
    "check_decode_attention",
    "check_tokens_to_outweigh",
    "check_predicted_generation",
]


# --- Exercise 1: positions of the new tokens -----------------------------------------------------


def _new(seq_lens: torch.Tensor, n: int, start_shift: int = 0) -> torch.Tensor:
    """[B, n]: seq_lens[b] + shift + j, the right positions (shift 0) and the typical off-by-one answers."""
    return seq_lens[:, None] + torch.arange(n, device="cpu") + start_shift


@check("ch02.check_new_positions", takes="fn(seq_lens, num_new)")
def check_new_positions(
    fn: Callable[[torch.Tensor, int], torch.Tensor], seed: int = 0, *, device: torch.device | str | None = None
) -> CheckResult:
    """``fn(seq_lens [B], num_new)`` -> integer ``[B, num_new]``: the positions RoPE gives the new tokens.

    Sequence ``b`` already has ``seq_lens[b]`` tokens in its cache (positions ``0 .. seq_lens[b]-1``);
    ``seq_lens`` is handed to ``fn`` on ``device`` (the chapter's device, default_device(), by default).
    """
    rng = hidden_rng()
    cases = [([5], 1), ([0], 4), ([3, 7], 1), ([6, 2, 9], 3)]
    for _ in range(10):
        cases.append(([rng.randint(0, 40) for _ in range(rng.randint(1, 4))], rng.randint(1, 6)))

    def integers(case: str, got, seq_lens: torch.Tensor, n: int):
        expect_tensor(case, got, (len(seq_lens), n), what="[B, num_new]")
        if got.is_floating_point() or got.dtype == torch.bool:
            fail(case, expected="an integer tensor", got=f"dtype {got.dtype}", hint="Positions are integers (int64).")
        return got

    diagnose(
        fn,
        [(torch.tensor(lens, device="cpu"), n) for lens, n in cases],
        label=lambda seq_lens, n: f"positions(seq_lens={seq_lens.tolist()}, num_new={n})",
        reference=_new,
        mistakes=[
            (
                "No RoPE offset: every sequence's new tokens start at position 0, as if nothing were cached. They continue "
                "after the cached ones, at seq_lens[b].",
                lambda lens, n: _new(lens * 0, n),
            ),
            (
                "Off by one: with s tokens cached (positions 0 .. s-1), the next token is at position s, not s + 1.",
                lambda lens, n: _new(lens, n, 1),
            ),
            (
                "Off by one: with s tokens cached (positions 0 .. s-1), the next token is at position s, not s - 1.",
                lambda lens, n: _new(lens, n, -1),
            ),
            (
                "Each sequence continues from its own length. The longest one's length is where the padded tensor ends, "
                "not where a shorter sequence does.",
                lambda lens, n: _new(torch.full_like(lens, int(lens.max())), n),
            ),
        ],
        hint="New token j of sequence b sits at position seq_lens[b] + j.",
        compare=lambda a, w: torch.equal(a.long(), w.long()),
        returns=integers,
        device=device,
    )
    return passed("new token j of sequence b is at position seq_lens[b] + j: RoPE and the causal mask both use it.")


# --- Exercise 2: update for a preallocated cache -------------------------------------------------


def _history_hint(
    got: torch.Tensor,
    want: torch.Tensor,
    new: torch.Tensor,
    start: int,
    others: list[torch.Tensor],
    other_name: str,
    want_other: torch.Tensor,
) -> str:
    t = new.shape[2]
    if start and torch.equal(got[:, :, :t], new):
        return (
            "The new tokens were written at position 0. Write them after the cached ones, at positions "
            "seq_len .. seq_len + T - 1 of this layer (keep one offset per layer, or one for all layers)."
        )
    if torch.equal(got, want_other):
        return f"This is the {other_name} history: K and V are swapped."
    if start and any(o.shape[2] >= start and torch.equal(got[:, :, :start], o[:, :, :start]) for o in others):
        return "The earlier positions hold another layer's tokens: each layer needs its own K and V buffers."
    if torch.equal(got[:, :, start:], new):
        return "The new tokens are right but the earlier ones are not: never overwrite positions 0 .. seq_len - 1."
    return "Positions 0 .. seq_len-1 must hold the earlier tokens unchanged and seq_len .. seq_len+T-1 the new ones."


def _read_seq_len(cache: Any) -> Any:
    with learner_runs():  # the learner's property
        value = getattr(cache, "seq_len", None)
    if callable(value):
        raise ExerciseError(
            "cache.seq_len is a method; make it a property (@property) or an attribute: the model "
            "reads cache.seq_len, it does not call it."
        )
    return value


@check(
    "ch02.check_cache_update",
    takes="cache class",
    references={"KVCache": kvcourse.KVCache},
    task="write update yourself.",
)
def check_cache_update(
    cache_cls: type, model=None, seed: int = 0, *, device: torch.device | str | None = None
) -> CheckResult:
    """``cache_cls(num_layers, batch_size, num_kv_heads, head_dim, max_seq_len)``: a cache that allocates
    ``max_seq_len`` positions per layer up front and writes into them.

    ``seq_len`` is the number of tokens cached; ``update(layer_idx, k, v)`` with ``k, v [B, H_kv, T, D]``
    stores them after that layer's earlier tokens and returns the layer's whole history
    ``[B, H_kv, seq_len + T, D]`` as views of the buffers (no copy); writing past ``max_seq_len`` raises
    ``ValueError``. With ``model`` the cache also runs a greedy generation on the real model.

    The cache is built with ``device`` as torch's default device and handed ``k, v`` there: the model's
    device when ``model`` is given (then leave ``device`` out), else ``device`` (default_device() if left out).
    """
    if model is not None and device is not None:
        raise ValueError(f"give model or device, not both: the cases go to the model's device, got device={device!r}")
    device = model.device if model is not None else learner_device(device)
    if issubclass(cache_cls, kvcourse.KVCache):
        raise ExerciseError("your class inherits from kvcourse.KVCache; write update yourself.")
    rng, gen = hidden_rng(), hidden_generator()
    for trial in range(4):
        layers, batch, heads, dim = rng.randint(1, 3), rng.randint(1, 2), rng.randint(1, 3), rng.choice([2, 4, 8])
        max_len = rng.randint(8, 20)
        shape = dict(num_layers=layers, batch_size=batch, num_kv_heads=heads, head_dim=dim, max_seq_len=max_len)
        made = "YourCache(" + ", ".join(f"{k}={v}" for k, v in shape.items()) + ")"
        with torch.device(device):  # a buffer allocated without device= lands where the tensors it stores live
            cache = call_learner("YourCache", cache_cls, **shape)
        chunks: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(layers)]
        first_storage: dict[int, torch.Tensor] = {}
        cached = 0
        steps = [rng.randint(2, max_len // 2)] + [1, 1] + [rng.randint(2, 3)]
        steps.append(max_len - sum(steps))  # the last pass fills the cache exactly
        for step, t in enumerate(steps):
            seq_len = _read_seq_len(cache)
            if seq_len != cached:
                hint = (
                    "seq_len moved once per layer call: it counts tokens, so it must grow by T once per forward "
                    "pass (keep a length per layer and report layer 0's, for example)."
                    if cached and seq_len == cached * layers
                    else "seq_len must be the number of tokens cached before this forward pass."
                )
                fail(f"{made}.seq_len before forward pass {step}", expected=cached, got=seq_len, hint=hint)
            start, end = cached, cached + t
            for layer in range(layers):
                k = torch.randn(batch, heads, t, dim, generator=gen, device="cpu")
                v = torch.randn(batch, heads, t, dim, generator=gen, device="cpu")
                chunks[layer].append((k, v))
                case = f"{made}: update({layer}, k, v) with T={t} new tokens after seq_len={start}"
                if not callable(getattr(cache, "update", None)):
                    raise ExerciseError(f"{made} has no update method.")
                want_k = torch.cat([c[0] for c in chunks[layer]], dim=2)
                want_v = torch.cat([c[1] for c in chunks[layer]], dim=2)
                others_k = [
                    torch.cat([c[0] for c in chunks[o]], dim=2) for o in range(layers) if o != layer and chunks[o]
                ]
                others_v = [
                    torch.cat([c[1] for c in chunks[o]], dim=2) for o in range(layers) if o != layer and chunks[o]
                ]
                result = call_learner(
                    f"update({layer}, k, v)", cache.update, layer, handed(k, device), handed(v, device)
                )
                if not (isinstance(result, tuple) and len(result) == 2):
                    fail(
                        case,
                        expected="a tuple (keys, values)",
                        got=describe(result),
                        hint="update returns the layer's keys and values so far, as two tensors.",
                    )
                for name, got, want, new, others, other_name, want_other in (
                    ("keys", result[0], want_k, k, others_k, "values", want_v),
                    ("values", result[1], want_v, v, others_v, "keys", want_k),
                ):
                    if not isinstance(got, torch.Tensor):
                        fail(
                            case,
                            expected=f"{name} as a torch.Tensor",
                            got=describe(got),
                            hint="Return views of your buffers, e.g. buffer[:, :, :seq_len + T].",
                        )
                    if got.ndim == 4 and got.shape[2] != end and got.shape[:2] == want.shape[:2]:
                        n = got.shape[2]
                        hint = (
                            "Only the new tokens came back; the model attends over the whole history, so return "
                            "positions 0 .. seq_len + T - 1."
                            if n == t and start
                            else "That is the whole buffer, empty slots included: return the first seq_len + T "
                            "positions only."
                            if n == max_len
                            else f"Off by one: after this update the layer holds seq_len + T = {end} tokens."
                            if abs(n - end) == 1
                            else "Return positions 0 .. seq_len + T - 1 of this layer."
                        )
                        fail(
                            case,
                            expected=f"{name} of shape {list(want.shape)}",
                            got=f"shape {list(got.shape)}",
                            hint=hint,
                        )
                    expect_tensor(case, got, tuple(want.shape), what=f"{name} [B, H_kv, seq_len + T, D]")
                    got = on_host(got)
                    if not torch.equal(got, want):
                        fail(
                            case + f" ({name})",
                            expected=want,
                            got=got,
                            hint=_history_hint(got, want, new, start, others, other_name, want_other),
                        )
                keys = result[0]
                if layer not in first_storage:
                    first_storage[layer] = keys
                elif keys.untyped_storage().data_ptr() != first_storage[layer].untyped_storage().data_ptr():
                    fail(
                        case,
                        expected="a view of the buffer allocated in __init__",
                        got="a new tensor",
                        hint="update must write into the preallocated buffer and return a slice of it. Building a "
                        "new tensor (torch.cat) copies the whole history at every step, which is what "
                        "preallocating avoids.",
                    )
            cached = end
        k1 = torch.randn(batch, heads, 1, dim, generator=gen, device="cpu")
        case = f"{made}: update(0, k, v) with the cache full ({max_len} tokens)"
        try:
            cache.update(0, handed(k1, device), handed(k1, device))
        except ValueError:
            pass
        except Exception as exc:
            fail(
                case,
                expected="ValueError",
                got=f"{type(exc).__name__}: {exc}",
                hint="Check for room before writing and raise a ValueError that says the cache is full.",
            )
        else:
            fail(
                case,
                expected="ValueError",
                got="no error",
                hint="A cache of max_seq_len positions must refuse a write past the end rather than grow or "
                "drop tokens silently.",
            )
    if model is not None:
        _generate_with(cache_cls, model)
    on_model = " and generates the same tokens as kvcourse.generate on the real model" if model is not None else ""
    return passed(
        f"update writes at the layer's offset into memory allocated once and returns views of the history{on_model}."
    )


def _generate_with(cache_cls: type, model, steps: int = 6) -> None:
    cfg = model.config
    rng = hidden_rng("model")
    ids = [rng.randrange(cfg.vocab_size) for _ in range(6)]
    want = kvcourse.generate(model, ids, steps, eos_token_ids=())
    shape = dict(
        num_layers=cfg.num_hidden_layers,
        batch_size=1,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        max_seq_len=len(ids) + steps,
    )
    with torch.device(model.device):
        cache = call_learner("YourCache", cache_cls, **shape)
    got, step_input = [], ids
    for step in range(steps):
        logits = call_learner(
            "model(ids, cache=your_cache)", model, torch.tensor([step_input], device=model.device), cache=cache
        )
        got.append(int(logits[0, -1].argmax()))
        if got[-1] != want[step]:
            fail(
                f"greedy generation on the real model with your cache, step {step}",
                expected=want[: step + 1],
                got=got,
                hint="The random cases passed, so compare what the model sees: cache.seq_len before each "
                "forward pass and the history update returns for every layer.",
            )
        step_input = [got[-1]]


# --- Exercise 3 (bug hunt): prefill a chunk at a time --------------------------------------------


@check("ch02.check_chunked_prefill", takes="fn(model, ids, chunk_size)")
def check_chunked_prefill(fn: Callable, model=None, seed: int = 0) -> CheckResult:
    """``fn(model, ids, chunk_size)`` -> ``(logits, cache)``: prefill ``ids`` into a new cache with forward
    passes of at most ``chunk_size`` tokens; ``logits`` are the last prompt token's ``[vocab]`` scores.

    Compared with a single forward pass over the whole prompt, on the real model (loaded if not given).
    """
    if model is None:
        model, _ = kvcourse.load_pretrained()
    rng = hidden_rng()
    cases = [(5, 3), (9, 4), (1, 4), (6, 6), (3, 8), (7, 1), (13, 4), (12, 4)]
    cases += [(rng.randint(2, 16), rng.randint(2, 6)) for _ in range(3)]
    for n, chunk in cases:
        ids = [rng.randrange(model.config.vocab_size) for _ in range(n)]
        case = f"prefill(model, ids of {n} tokens, chunk_size={chunk})"
        ref_cache = kvcourse.KVCache.for_model(model.config, dtype=model.dtype, device=model.device)
        want = on_host(model(torch.tensor([ids], device=model.device), cache=ref_cache)[0, -1]).float()
        result = call_learner("prefill", fn, model, list(ids), chunk)
        if not (isinstance(result, tuple) and len(result) == 2):
            fail(
                case,
                expected="a tuple (logits, cache)",
                got=describe(result),
                hint="Return the last prompt token's logits and the cache the chunks were written to.",
            )
        logits, cache = result
        held = getattr(cache, "seq_len", None)
        if held != n:
            last = n - (math.ceil(n / chunk) - 1) * chunk
            if not isinstance(held, int):
                hint = "Return the cache the chunks were written to (it has a seq_len)."
            elif held == last and held != n - 1:
                hint = (
                    "The cache holds only the last chunk: every chunk must extend the same cache. A fresh cache "
                    "per chunk restarts the positions at 0 (no RoPE offset) and hides the earlier tokens."
                )
            elif held < n:
                hint = (
                    f"The cache holds {held} of the {n} prompt tokens: some tokens never reached the model. "
                    "Which ones, and for which prompt lengths and chunk sizes?"
                )
            else:
                hint = "Some tokens were fed twice: the chunks must not overlap."
            fail(case + ": cache.seq_len afterwards", expected=n, got=held, hint=hint)
        # The chunks themselves: one forward pass over the whole prompt fills the same cache, with the same
        # logits, and ignores chunk_size. The cache lists the tokens each forward pass wrote.
        writes = getattr(cache, "writes", None)
        if not isinstance(writes, list):
            fail(
                case + ": the cache returned",
                expected="the kvcourse.KVCache the chunks were written to",
                got=describe(cache),
                hint="Create the cache with KVCache.for_model(model.config, ...) and return it.",
            )
        if not writes or max(writes) > chunk or sum(writes) != n:
            fail(
                case + ": tokens per forward pass",
                expected=f"at most {chunk} per pass, {n} in all",
                got=list(writes),
                hint="Feed the prompt chunk_size tokens at a time: each call of the model "
                "takes at most chunk_size tokens, and together they cover the prompt once.",
            )
        expect_tensor(case, logits, (model.config.vocab_size,), what="[vocab]: the last prompt token's logits")
        logits = on_host(logits)
        if (logits.float() - want).abs().max().item() > 1e-3:
            fail(
                case,
                expected=want,
                got=logits,
                hint="The cache is full but the logits differ: return the scores of the LAST prompt token "
                "(the last position of the last chunk).",
            )
    return passed(
        "chunks of any size give the one-pass prefill's logits (to float rounding) and the same cache, "
        "because positions and the mask come from cache.seq_len."
    )


# --- Exercise 4: a decode step over a padded batch of caches -------------------------------------


def _decode(q, k, v, lens, *, scale=None, heads="grouped", softmax=True):
    b, hq, d = q.shape
    hkv, s = k.shape[1], k.shape[2]
    heads_q = torch.arange(hq, device=q.device)
    index = heads_q // (hq // hkv) if heads == "grouped" else heads_q % hkv
    k, v = k[:, index], v[:, index]
    scores = torch.einsum("bhd,bhsd->bhs", q, k) * (1 / math.sqrt(d) if scale is None else scale)
    valid = torch.arange(s, device=q.device)[None, :] < torch.as_tensor(lens, device=q.device)[:, None]
    if softmax:
        weights = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")), dim=-1)
    else:
        weights = scores * valid[:, None]
    return torch.einsum("bhs,bhsd->bhd", weights, v)


@check(
    "ch02.check_decode_attention",
    takes="attend(q, k, v, seq_lens)",
    references={"decode_attention_ref": kvcourse.decode_attention_ref, "causal_attention": kvcourse.causal_attention},
    task="write the decode step yourself in plain torch.",
)
def check_decode_attention(attend: Callable, seed: int = 0, *, device: torch.device | str | None = None) -> CheckResult:
    """``attend(q [B, Hq, D], k [B, Hkv, S, D], v [B, Hkv, S, D], seq_lens [B])`` -> ``[B, Hq, D]``.

    One decode step for a batch whose caches are padded to ``S`` positions: sequence ``b`` has only
    ``seq_lens[b]`` real tokens; query head ``h`` reads KV head ``h // (Hq // Hkv)``. Compared with
    :func:`kvcourse.decode_attention_ref` on hidden random inputs, handed to ``attend`` on ``device`` (the CPU by
    default).
    """
    rng, gen = hidden_rng(), hidden_generator()
    shapes = [(2, 9, 3, 6, 64), (3, 4, 4, 5, 8), (2, 6, 2, 9, 16)]  # (B, Hq, Hkv, S, D)
    for _ in range(6):
        hkv, group = rng.randint(1, 3), rng.randint(1, 3)
        shapes.append((rng.randint(2, 4), hkv * group, hkv, rng.randint(3, 12), rng.choice([8, 16, 32])))
    cases = []
    for b, hq, hkv, s, d in shapes:
        lens = [s] + [rng.randint(1, s - 1) for _ in range(b - 1)]
        rng.shuffle(lens)
        seq_lens = torch.tensor(lens, device="cpu")
        q = torch.randn(b, hq, d, generator=gen, device="cpu")
        k = torch.randn(b, hkv, s, d, generator=gen, device="cpu") * 2.0
        v = torch.randn(b, hkv, s, d, generator=gen, device="cpu")
        pad = torch.arange(s, device="cpu")[None, :] >= seq_lens[:, None]  # [B, S]: slots past a sequence's end
        k[pad[:, None].expand_as(k[..., 0])] *= 3.0  # padding holds stale data, not zeros
        v[pad[:, None].expand_as(v[..., 0])] += 5.0
        cases.append((q, k, v, seq_lens))
    mistakes = [
        (
            "The scores are not scaled: divide q . k by sqrt(head_dim) before the softmax.",
            lambda q, k, v, lens: _decode(q, k, v, lens, scale=1.0),
        ),
        (
            "The padding is not masked: sequence b may only read its first seq_lens[b] keys; the slots after them "
            "hold leftovers, not its tokens.",
            lambda q, k, v, lens: _decode(q, k, v, [k.shape[2]] * len(lens)),
        ),
        (
            "Off by one: the valid keys are positions 0 .. seq_lens[b] - 1, i.e. arange(S) < seq_lens[b]; you dropped "
            "the last one.",
            lambda q, k, v, lens: _decode(q, k, v, [max(n - 1, 1) for n in lens]),
        ),
        (
            "Off by one: the valid keys are positions 0 .. seq_lens[b] - 1, i.e. arange(S) < seq_lens[b]; you read "
            "one slot of padding.",
            lambda q, k, v, lens: _decode(q, k, v, [min(n + 1, k.shape[2]) for n in lens]),
        ),
        (
            "Query head h reads KV head h // (Hq // Hkv) (consecutive query heads share a KV head), not h % Hkv.",
            lambda q, k, v, lens: _decode(q, k, v, lens, heads="interleaved"),
        ),
        (
            "The scores need a softmax over the valid keys before they weight the values.",
            lambda q, k, v, lens: _decode(q, k, v, lens, softmax=False),
        ),
    ]
    diagnose(
        attend,
        cases,
        label=lambda q, k, v, lens: f"attend(q {list(q.shape)}, k/v {list(k.shape)}, seq_lens={lens.tolist()})",
        reference=kvcourse.decode_attention_ref,
        mistakes=[(h, lambda q, k, v, lens, m=m: m(q, k, v, lens.tolist())) for h, m in mistakes],
        hint="Scale q . k by 1/sqrt(D), set padded keys to -inf, softmax over the keys, weight the values; query head "
        "h reads KV head h // (Hq // Hkv).",
        returns=lambda case, got, q, *_: expect_tensor(case, got, tuple(q.shape), what="[B, Hq, D]"),
        device=device,
        extra=diff_below,
    )
    return passed("one query per head against its sequence's valid cached keys: no causal mask, only a length mask.")


# --- Exercise 5: when the cache outweighs the weights --------------------------------------------


@check("ch02.check_tokens_to_outweigh", takes="fn(config, batch_size)")
def check_tokens_to_outweigh(fn: Callable[[dict, int], int], seed: int = 0) -> CheckResult:
    """``fn(config, batch_size)`` -> the fewest tokens per sequence at which the KV cache of ``batch_size``
    sequences holds at least as many bytes as the weights, both stored in the same dtype.

    ``config`` has ``num_parameters``, ``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads`` and ``head_dim``.
    """
    rng = hidden_rng()
    configs = [
        dict(
            num_parameters=134_515_008, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64
        ),
        dict(
            num_parameters=8_030_261_248,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
        ),
        dict(
            num_parameters=6_738_415_616,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            head_dim=128,
        ),
    ]
    cases = [(configs[0], 1), (configs[0], 4), (configs[1], 1), (configs[2], 16)]
    for _ in range(8):
        kv = rng.choice([1, 2, 4, 8])
        cfg = dict(
            num_parameters=rng.randint(10**7, 10**10),
            num_hidden_layers=rng.randint(8, 80),
            num_attention_heads=kv * rng.choice([1, 2, 4, 8]),
            num_key_value_heads=kv,
            head_dim=rng.choice([64, 96, 128, 256]),
        )
        cases.append((cfg, rng.randint(1, 64)))
    exact = dict(
        num_parameters=2 * 4 * 2 * 64 * 1000,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
    )
    cases.append((exact, 1))  # the cache equals the weights at exactly 1000 tokens

    def per_token(cfg: dict, batch: int, heads: str = "num_key_value_heads", kv: int = 2) -> int:
        return kv * cfg["num_hidden_layers"] * cfg[heads] * cfg["head_dim"] * batch

    diagnose(
        fn,
        cases,
        label=lambda cfg, batch: f"tokens_to_outweigh({cfg}, batch_size={batch})",
        reference=lambda cfg, batch: -(-cfg["num_parameters"] // per_token(cfg, batch)),
        mistakes=[
            (
                "Each token stores two vectors per KV head and layer, K and V: you left out the factor 2.",
                lambda cfg, batch: -(-cfg["num_parameters"] // per_token(cfg, batch, kv=1)),
            ),
            (
                "Only the num_key_value_heads KV heads are cached; the query heads are not (grouped-query attention).",
                lambda cfg, batch: -(-cfg["num_parameters"] // per_token(cfg, batch, heads="num_attention_heads")),
            ),
            (
                "Every one of the batch_size sequences holds its own cache.",
                lambda cfg, batch: -(-cfg["num_parameters"] // per_token(cfg, 1)),
            ),
            (
                "Off by one: round up. At the rounded-down count the cache is still smaller than the weights.",
                lambda cfg, batch: cfg["num_parameters"] // per_token(cfg, batch),
            ),
            (
                "Off by one: when the weights divide exactly, the cache already equals them at num_parameters / "
                "(bytes per token) tokens: at least as many bytes, not more.",
                lambda cfg, batch: cfg["num_parameters"] // per_token(cfg, batch) + 1,
            ),
        ],
        hint="Bytes per token of the batch: 2 x layers x KV heads x head_dim x batch_size (x bytes per value, which "
        "cancels). Divide the parameters by that and round up.",
        compare=operator.eq,
        returns=an_int("number of tokens"),
    )
    smol = -(-configs[0]["num_parameters"] // (2 * 30 * 3 * 64))
    return passed(
        f"SmolLM2-135M's cache outweighs its weights at {smol:,} tokens, more than its 8,192-token "
        "context: one sequence never gets there, two long ones do."
    )


# --- Exercise 6: predict a generation's time from a step-cost model ---------------------------------


def _generation_ms(
    prompt_len: int,
    new_tokens: int,
    fixed_ms: float,
    per_token_ms: float,
    use_cache: bool,
    *,
    fed=None,
    steps: int | None = None,
    fixed_steps: int | None = None,
) -> float:
    """The package's model: step i feeds costs.tokens_fed(prompt_len, i, use_cache) tokens, and a step costs
    StepCost(fixed, per_token) (keywords: the typical mistakes)."""
    cost = StepCost(fixed_s=fixed_ms, per_token_s=per_token_ms)  # in ms here: the model is linear in its units
    steps = new_tokens if steps is None else steps
    fed = fed or (lambda i: kvcourse.costs.tokens_fed(prompt_len, i, use_cache)[0])
    tokens = sum(fed(i) for i in range(steps))
    return cost.seconds(tokens, 0) + fixed_ms * ((steps if fixed_steps is None else fixed_steps) - 1)


_GENERATION_MISTAKES = [
    (
        "Off by one token: step i of the naive loop feeds the prompt_len + i tokens there are, not the token it is "
        "about to produce.",
        lambda p, n, f, t, c: _generation_ms(p, n, f, t, c, fed=lambda i: (p + i + 1) if not c or i == 0 else 1),
    ),
    (
        "The prefill is one step over the whole prompt: the cached loop's step 0 feeds prompt_len tokens, then one "
        "token a step.",
        lambda p, n, f, t, c: _generation_ms(p, n, f, t, c, fed=lambda i: 1),
    ),
    (
        "use_cache decides what a step feeds: everything again (naive) or only the new token (cached).",
        lambda p, n, f, t, c: _generation_ms(p, n, f, t, not c),
    ),
    (
        "Every step pays the fixed cost (it reads all the weights), not just the first: new_tokens x fixed_ms.",
        lambda p, n, f, t, c: _generation_ms(p, n, f, t, c, fixed_steps=1),
    ),
    (
        "One step per new token: new_tokens steps, the last one producing the last token (the newest token is never "
        "fed back).",
        lambda p, n, f, t, c: _generation_ms(p, n + 1, f, t, c),
    ),
]


@check(
    "ch02.check_predicted_generation",
    takes="predict_generation_ms",
    references={"StepCost": StepCost, "kvcourse.costs.tokens_fed": kvcourse.costs.tokens_fed},
    task="count the steps and the tokens each feeds yourself.",
)
def check_predicted_generation(fn: Callable[[int, int, float, float, bool], float], seed: int = 0) -> CheckResult:
    """``fn(prompt_len, new_tokens, fixed_ms, per_token_ms, use_cache)`` -> the predicted time (ms) of generating
    ``new_tokens`` tokens after a ``prompt_len``-token prompt, naive or cached, when a forward pass over ``t`` tokens
    costs ``fixed_ms + per_token_ms * t``. Compared with kvcourse's StepCost and costs.tokens_fed."""
    rng = hidden_rng()
    cases = [(5, 128, 37.0, 1.5, False), (5, 128, 37.0, 1.5, True), (1, 1, 10.0, 1.0, False), (7, 1, 10.0, 1.0, True)]
    while len(cases) < 16:
        cases.append((rng.randint(1, 300), rng.randint(2, 400), round(rng.uniform(1, 100), 2),
                      round(rng.uniform(0.01, 5), 3), len(cases) % 2 == 0))  # fmt: skip
    diagnose(
        fn,
        cases,
        label="predict_generation_ms({}, {}, {}, {}, use_cache={})".format,
        reference=_generation_ms,
        mistakes=_GENERATION_MISTAKES,
        hint="Step i (0 .. new_tokens-1) feeds prompt_len + i tokens naively; cached, the prompt at step 0 and one "
        "token after. Each step costs fixed_ms + per_token_ms x the tokens it feeds.",
        compare=lambda got, want: same(got, want, rel=1e-6),
        returns=a_number("a finite number of milliseconds", finite=True),
    )
    naive, cached = _generation_ms(5, 128, 37.0, 1.5, False), _generation_ms(5, 128, 37.0, 1.5, True)
    return passed(
        f"at 37 ms + 1.5 ms a token, 128 tokens after a 5-token prompt take {naive / 1e3:.1f} s naively "
        f"and {cached / 1e3:.1f} s cached, x{naive / cached:.1f}: the fixed part, paid by every step, "
        "keeps the cache's gain far below the FLOP ratio."
    )
