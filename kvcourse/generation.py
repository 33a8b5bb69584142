"""The generation loop: one loop, three ways to run a step.

* no cache (``use_cache=False``) -- chapter 1's naive loop: every step feeds the *whole* sequence
  through the model again, recomputing every earlier token's K and V;
* a contiguous :class:`~kvcourse.KVCache` -- chapter 2: one **prefill** over the prompt fills the
  cache, then each **decode** step feeds only the newest token;
* a :class:`~kvcourse.paged.PagedKVCache` -- chapter 4: the same, on blocks of a shared pool; before
  each step the cache allocates slots for the new tokens, then ``model.forward_batch`` runs it.

All three pick tokens with the same :class:`~kvcourse.sampling.Sampler` (greedy, or seeded sampling
with temperature, top-k and top-p), so for the same inputs they produce the same tokens.
:func:`stream_generate` yields tokens as they come; :func:`timed_generate` also measures time to
first token (TTFT) and time per output token (TPOT).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .cache import KVCache
from .checks import check_bool, check_token_ids
from .paged.cache import PagedKVCache
from .sampling import Sampler
from .sequence import SamplingParams
from .sequence import Sequence as Seq

__all__ = ["GenerationResult", "generate", "generate_paged", "stream_generate", "timed_generate"]


def _check_ids(model, ids) -> list[int]:
    return check_token_ids("ids", ids, model.config.vocab_size)


def _sampling_params(
    max_new_tokens: int | None, sampling_params: SamplingParams | None, sampling: dict
) -> SamplingParams:
    """One :class:`SamplingParams` from either ``max_new_tokens`` and the ``sampling`` keywords (its
    fields; ``eos_token_ids`` is its ``stop_token_ids``) or ``sampling_params`` (not both)."""
    if sampling_params is None:
        eos = sampling.pop("eos_token_ids", None)
        if eos is not None and (isinstance(eos, (str, bytes)) or not isinstance(eos, Iterable)):
            raise TypeError(
                f"eos_token_ids must be a list of token ids, e.g. [{eos!r}], or None (the model's), "
                f"got {type(eos).__name__} {eos!r}"
            )
        params = SamplingParams(
            max_new_tokens=16 if max_new_tokens is None else max_new_tokens,
            stop_token_ids=None if eos is None else tuple(eos),
            **sampling,
        )
    elif not isinstance(sampling_params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(sampling_params).__name__}")
    elif max_new_tokens is not None or sampling:
        given = ["max_new_tokens"] * (max_new_tokens is not None) + list(sampling)
        raise ValueError(f"give either sampling_params or {', '.join(given)}, not both")
    else:
        params = sampling_params
    if params.n != 1:
        raise ValueError(
            f"sampling_params.n = {params.n}: this loop makes one sample; kvcourse.serving.Engine "
            "serves n > 1 (parallel sampling)"
        )
    return params


def _step_function(model, use_cache: bool, cache) -> tuple[Callable[[list[int]], torch.Tensor], int]:
    """How to run one step: ``step(new_token_ids) -> logits of the last position``; and the tokens cached already."""
    device = model.device
    if cache is None and not use_cache:
        return (lambda feed: model(torch.tensor([feed], device=device))[0, -1]), 0
    if cache is None:
        cache = KVCache.for_model(model.config, batch_size=1, dtype=model.dtype, device=device)
    elif not use_cache:
        raise ValueError("cache was given but use_cache=False: pass one or the other")
    if isinstance(cache, PagedKVCache):
        # Allocate the step's slots first (copy-on-write included), then run the ragged forward.
        return (lambda feed: model.forward_batch(cache.prepare(feed), cache.kv_store)[0]), cache.seq_len
    if isinstance(cache, KVCache) or (hasattr(cache, "update") and hasattr(cache, "seq_len")):
        if getattr(cache, "batch_size", 1) != 1:
            raise ValueError(f"cache must hold one sequence to generate, it has batch_size={cache.batch_size}")
        return (lambda feed: model(torch.tensor([feed], device=device), cache=cache)[0, -1]), cache.seq_len
    raise TypeError(f"cache must be a KVCache, a PagedKVCache or None, got {type(cache).__name__}")


def stream_generate(
    model,
    ids: Sequence[int],
    max_new_tokens: int | None = None,
    *,
    use_cache: bool = True,
    cache: KVCache | PagedKVCache | None = None,
    sampling_params: SamplingParams | None = None,
    **sampling,
) -> Iterator[int]:
    """Yield new token ids one at a time, stopping after a stop token (EOS) or ``max_new_tokens`` (16).

    Args:
        ids: the tokens to feed first: the prompt, or, with a ``cache`` that already holds a context,
            what comes after it.
        use_cache: ``False`` for the naive loop that recomputes everything.
        cache: a cache to fill (and keep using afterwards); by default a fresh contiguous one.
        sampling_params: how to pick tokens, as one :class:`~kvcourse.sequence.SamplingParams`; or give
            ``max_new_tokens`` and its fields as keywords (``temperature``, ``top_k``, ``top_p``, ``seed``),
            with ``eos_token_ids`` for its stop tokens (the model's by default, ``()`` never stops early).
    """
    params = _sampling_params(max_new_tokens, sampling_params, sampling)
    check_bool("use_cache", use_cache)
    ids = _check_ids(model, ids)
    step, cached = _step_function(model, use_cache, cache)
    if cached + len(ids) + params.max_new_tokens > model.config.max_position_embeddings:
        raise ValueError(
            f"{cached} cached + {len(ids)} ids + {params.max_new_tokens} max_new_tokens exceeds the model's "
            f"context length ({model.config.max_position_embeddings})"
        )
    seq = Seq(0, ids, params, eos_token_ids=model.config.eos_token_id)
    sample = Sampler(params)
    feed = ids  # prefill: everything the cache has not seen; then the newest token only
    while not seq.is_finished:
        if use_cache:
            logits = step(feed)
            seq.num_computed_tokens += len(feed)
        else:
            logits = step(seq.token_ids)  # naive: recompute everything, every step
        token = sample(logits)
        seq.append_token(token)
        yield token
        feed = [token]


def generate(model, ids: Sequence[int], max_new_tokens: int | None = None, **options) -> list[int]:
    """The new token ids (greedy by default), the stop token included if one was generated.
    ``options``: those of :func:`stream_generate` (``use_cache``, ``cache``, ``temperature``, ...)."""
    return list(stream_generate(model, ids, max_new_tokens, **options))


def generate_paged(
    model, ids: Sequence[int], max_new_tokens: int, cache: PagedKVCache | None = None, **sampling
) -> list[int]:
    """:func:`generate` through a :class:`~kvcourse.paged.PagedKVCache` (by default a pool just big enough).

    ``ids`` are the tokens ``cache`` has not seen yet: the prompt for an empty cache, a continuation
    for a forked one. ``sampling``: ``temperature``, ``seed``, ``eos_token_ids``... (see :func:`stream_generate`).
    """
    if cache is None:
        ids = _check_ids(model, ids)
        num_blocks = -(-(len(ids) + max(max_new_tokens, 1)) // 16)
        cache = PagedKVCache.for_model(model.config, num_blocks, 16, dtype=model.dtype, device=model.device)
    elif not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache or None, got {type(cache).__name__}")
    return generate(model, ids, max_new_tokens, cache=cache, **sampling)


@dataclass
class GenerationResult:
    """Tokens plus timings. ``step_times[0]`` is the first step (prefill when cached)."""

    tokens: list[int]
    step_times: list[float] = field(repr=False)

    @property
    def ttft(self) -> float:
        """Time to first token, in seconds."""
        return self.step_times[0]

    @property
    def tpot(self) -> float:
        """Mean time per output token after the first, in seconds (NaN with fewer than 2 tokens)."""
        rest = self.step_times[1:]
        return sum(rest) / len(rest) if rest else float("nan")

    @property
    def total(self) -> float:
        return sum(self.step_times)


def timed_generate(model, ids: Sequence[int], max_new_tokens: int | None = None, **options) -> GenerationResult:
    """:func:`generate`, timing each step with a wall clock (synchronising CUDA when used).
    ``options``: those of :func:`stream_generate`."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    tokens, times = [], []
    stream = stream_generate(model, ids, max_new_tokens, **options)
    while True:
        sync()
        start = time.perf_counter()
        token = next(stream, None)
        sync()
        if token is None:
            break
        times.append(time.perf_counter() - start)
        tokens.append(token)
    return GenerationResult(tokens, times)
