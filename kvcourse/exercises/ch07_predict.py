"""Chapter 7's prediction exercise: the time to first token of a prompt whose prefix is cached.

:func:`check_predicted_prefix_ttft` runs the learner's ``predict_ttft_ms(prompt_len, cached_tokens, block_size,
fixed_ms, per_token_ms)`` on hidden cases and compares it with the course's model,
:func:`kvcourse.serving.prefix_ttft.predicted_ttft_s`: whole cached blocks are reused, never the block that holds
the prompt's last token, and the one prefill step costs ``fixed_ms`` plus ``per_token_ms`` per token it feeds.
"""

from __future__ import annotations

from collections.abc import Callable

from ..serving.load import StepCost
from ..serving.prefix_ttft import predicted_ttft_s, prefix_hit_tokens
from ._core import CheckResult, check, diagnose, fail, hidden_rng, passed

__all__ = ["check_predicted_prefix_ttft"]

Case = tuple[int, int, int, float, float]  # prompt_len, cached_tokens, block_size, fixed_ms, per_token_ms


def _ttft_ms(prompt_len: int, cached_tokens: int, block_size: int, fixed_ms: float, per_token_ms: float) -> float:
    return 1e3 * predicted_ttft_s(StepCost(fixed_ms / 1e3, per_token_ms / 1e3), prompt_len, cached_tokens, block_size)


def _fed_wrong(c: Case, hit: int) -> float:
    prompt_len, _, _, fixed_ms, per_token_ms = c
    return fixed_ms + per_token_ms * (prompt_len - hit)


_MISTAKES: list[tuple[str, Callable[..., float]]] = [
    (
        "The last prompt token is always fed, even when every block is cached: its logits give the first output "
        "token. A prompt that ends exactly on a cached block boundary reuses one block fewer.",
        lambda *c: _fed_wrong(c, min(c[1], c[0]) // c[2] * c[2]),
    ),
    (
        "The cache reuses whole blocks: a cached prefix that ends inside a block saves only the full blocks before "
        "it (round down to a multiple of block_size).",
        lambda *c: _fed_wrong(c, min(c[1], c[0] - 1)),
    ),
    (
        "The cache reuses whole blocks, and never the last prompt token's: round the cached prefix down to whole "
        "blocks, and keep at least the last token to feed.",
        lambda *c: _fed_wrong(c, min(c[1], c[0])),
    ),
    (
        "A hit skips the cached tokens' work: charge per_token_ms only for the tokens the step still feeds.",
        lambda *c: _fed_wrong(c, 0),
    ),
    ("The step's fixed cost is paid whatever it feeds: add fixed_ms once.", lambda *c: _ttft_ms(*c) - c[3]),
]


def _cases(rng) -> list[Case]:
    # the chapter's help desk, a prompt ending on a cached block boundary, a partial block, a cold cache, blocks of 1
    cases: list[Case] = [(107, 94, 16, 50.0, 1.0), (64, 64, 16, 30.0, 2.0), (64, 200, 16, 30.0, 2.0),
                         (50, 37, 8, 12.5, 0.5), (300, 0, 16, 40.0, 1.5), (20, 20, 1, 5.0, 1.0)]  # fmt: skip
    for _ in range(8):
        block = rng.choice([1, 4, 8, 16, 32])
        prompt_len = rng.randint(1, 40) * block if rng.random() < 0.4 else rng.randint(1, 900)
        cached = rng.choice([prompt_len, rng.randint(0, prompt_len), prompt_len + rng.randint(1, 50)])
        cases.append((prompt_len, cached, block, round(rng.uniform(5, 80), 1), round(rng.uniform(0.1, 3), 2)))
    return cases


def _milliseconds(case: str, got, *_) -> float:
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        fail(case, expected="a time in milliseconds (a number)", got=type(got).__name__, hint="Return a float.")
    return got


@check(
    "ch07.check_predicted_prefix_ttft",
    takes="predict_ttft_ms",
    references={"predicted_ttft_s": predicted_ttft_s, "prefix_hit_tokens": prefix_hit_tokens},
    task="predict from the rules of the cache, without the course's model.",
)
def check_predicted_prefix_ttft(
    predict_ttft_ms: Callable[[int, int, int, float, float], float], seed: int = 0
) -> CheckResult:
    """``predict_ttft_ms(prompt_len, cached_tokens, block_size, fixed_ms, per_token_ms)``: the time to first token,
    in ms, of one request alone whose first ``cached_tokens`` prompt tokens are in the prefix cache (stored in blocks
    of ``block_size``), its prompt prefilled in one step costing ``fixed_ms + per_token_ms * tokens fed``."""
    diagnose(
        predict_ttft_ms,
        _cases(hidden_rng()),
        label=lambda *case: f"predict_ttft_ms{case}",
        reference=_ttft_ms,
        mistakes=_MISTAKES,
        hint="Count the hit tokens (whole cached blocks, never the block of the last prompt token), then charge "
        "fixed_ms plus per_token_ms for each token the step still feeds.",
        returns=_milliseconds,
    )
    hit = prefix_hit_tokens(107, 94, 16)
    return passed(
        f"a 107-token prompt with 94 tokens cached in blocks of 16 reuses {hit} and feeds {107 - hit}: "
        f"{_ttft_ms(107, 94, 16, 50.0, 1.0):.0f} ms at 50 ms + 1 ms per token, against "
        f"{_ttft_ms(107, 0, 16, 50.0, 1.0):.0f} ms cold."
    )
