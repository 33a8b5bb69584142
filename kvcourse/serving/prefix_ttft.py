"""Chapter 7's model of the time to first token with a prefix-cache hit, before the engine measures it.

A prefix cache reuses whole blocks, and never the block that holds a prompt's last token: that token is fed
anyway, because its logits give the first output token. So a prompt of ``prompt_len`` tokens whose first
``cached_tokens`` are cached finds :func:`prefix_hit_tokens` of them, and its prefill feeds the rest. With one
request at a time and the whole prompt in one step, the time to first token is that one step's cost under chapter
6's step-cost model (:class:`~kvcourse.serving.load.StepCost`): :func:`predicted_ttft_s`.
"""

from __future__ import annotations

from ..checks import check_int
from .load import StepCost

__all__ = ["predicted_ttft_s", "prefix_hit_tokens"]


def prefix_hit_tokens(prompt_len: int, cached_tokens: int, block_size: int) -> int:
    """Prompt tokens found in the cache: whole blocks of the cached prefix, the last prompt token's block excluded."""
    check_int("prompt_len", prompt_len, min=1)
    check_int("cached_tokens", cached_tokens, min=0)
    check_int("block_size", block_size, min=1)
    return min(cached_tokens, prompt_len - 1) // block_size * block_size


def predicted_ttft_s(step_cost: StepCost, prompt_len: int, cached_tokens: int, block_size: int) -> float:
    """The time to first token of one request alone, its prompt in one step: the step feeds what the cache lacks."""
    if not isinstance(step_cost, StepCost):
        raise TypeError(f"step_cost must be a StepCost, got {type(step_cost).__name__}")
    fed = prompt_len - prefix_hit_tokens(prompt_len, cached_tokens, block_size)
    return step_cost.seconds(fed, 1)
