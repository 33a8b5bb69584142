"""The generation loop, naive and cached.

* ``use_cache=False`` -- chapter 1's naive loop: every step feeds the *whole*
  sequence through the model again, recomputing every earlier token's K and V.
* ``use_cache=True`` -- chapter 2: one **prefill** pass over the prompt fills the
  KV cache, then each **decode** step feeds only the newest token.

Both pick tokens the same way (greedy, or temperature sampling with a seeded
generator), so for the same inputs they must produce the same tokens.
:func:`stream_generate` yields tokens as they come; :func:`timed_generate`
also measures time to first token (TTFT) and time per output token (TPOT).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from .cache import KVCache

__all__ = [
    "generate",
    "stream_generate",
    "timed_generate",
    "GenerationResult",
    "check_generation_args",
    "pick_next_token",
]


def check_generation_args(model, ids, max_new_tokens: int, temperature: float) -> list[int]:
    """Validate the arguments every generation loop shares; return ``ids`` as a list of ints."""
    if isinstance(ids, torch.Tensor):
        if ids.ndim != 1:
            raise ValueError(f"ids must be a 1-D sequence of token ids, got a tensor of shape {tuple(ids.shape)}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"ids must be a list of token ids (use tok.encode(text)), got {type(ids).__name__}")
    ids = list(ids)
    if not ids:
        raise ValueError("ids must contain at least one token")
    vocab = model.config.vocab_size
    bad = [i for i in ids if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab]
    if bad:
        raise ValueError(f"ids must be ints in [0, {vocab}), got {bad[:5]}")
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be a non-negative int, got {max_new_tokens!r}")
    if not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if len(ids) + max_new_tokens > model.config.max_position_embeddings:
        raise ValueError(
            f"len(ids) + max_new_tokens = {len(ids) + max_new_tokens} exceeds the model's context length "
            f"({model.config.max_position_embeddings})"
        )
    return ids


def pick_next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Next token from the last position's logits: argmax, or a sample at ``temperature``."""
    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def stream_generate(
    model,
    ids: Sequence[int],
    max_new_tokens: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> Iterator[int]:
    """Yield new token ids one at a time, stopping after an EOS token or ``max_new_tokens``.

    ``eos_token_ids`` defaults to the model's; pass ``()`` to always generate ``max_new_tokens``.
    """
    ids = check_generation_args(model, ids, max_new_tokens, temperature)
    stop = set(model.config.eos_token_id if eos_token_ids is None else eos_token_ids)
    generator = None
    if temperature > 0:
        generator = torch.Generator(device="cpu")
        generator.manual_seed(0 if seed is None else seed)
    device = model.device
    seq = list(ids)
    cache = KVCache.for_model(model.config, batch_size=1, dtype=model.dtype, device=device) if use_cache else None
    next_input = seq  # prefill: the whole prompt; afterwards, only what the cache has not seen
    for _ in range(max_new_tokens):
        if not use_cache:
            next_input = seq  # naive: recompute everything, every step
        logits = model(torch.tensor([next_input], device=device), cache=cache)
        token = pick_next_token(logits[0, -1].cpu(), temperature, generator)
        seq.append(token)
        yield token
        if token in stop:
            return
        next_input = [token]


def generate(
    model,
    ids: Sequence[int],
    max_new_tokens: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> list[int]:
    """The new token ids (greedy by default), EOS included if it was generated."""
    return list(stream_generate(model, ids, max_new_tokens, use_cache, temperature, seed, eos_token_ids))


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


def timed_generate(
    model,
    ids: Sequence[int],
    max_new_tokens: int,
    use_cache: bool = True,
    temperature: float = 0.0,
    seed: int | None = None,
    eos_token_ids: Iterable[int] | None = None,
) -> GenerationResult:
    """:func:`generate`, timing each step with a wall clock (synchronising CUDA when used)."""
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    tokens, times = [], []
    stream = stream_generate(model, ids, max_new_tokens, use_cache, temperature, seed, eos_token_ids)
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
