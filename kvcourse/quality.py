"""What a compressed cache costs in quality, measured on the real model against the full-precision cache.

Four measures, from the most sensitive to the one a user sees:

* **KL divergence** ``KL(P_ref || P)`` of the next-token distributions, in nats per token, averaged;
* **top-1 agreement**: how often the most likely next token is the same;
* **perplexity** ``exp(mean negative log-likelihood)`` of held-out text (lower is better);
* **greedy agreement**: generate from chat prompts with both caches; how many tokens match before
  the first difference.

The held-out text ships with Python: CPython's ``pydoc_data.topics`` (the language reference's
help pages). :data:`HELDOUT_TOPICS` lists pages whose text is identical in Pythons 3.10 to 3.13,
so every machine and CI measures the same tokens; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .cache import KVCache
from .checks import check_int, is_int

__all__ = [
    "CHAT_PROMPTS",
    "GreedyAgreement",
    "HELDOUT_TOPICS",
    "Quality",
    "compare",
    "greedy_agreement",
    "heldout_ids",
    "heldout_text",
    "ids_digest",
    "kl_divergence",
    "needle_prompt",
    "perplexity",
    "stream_logits",
    "top1_agreement",
]

# pydoc topics whose text is the same in CPython 3.10, 3.11, 3.12 and 3.13 (checked byte for byte).
HELDOUT_TOPICS = (
    "comparisons", "import", "with", "exceptions", "context-managers", "id-classes", "in", "slicings",
    "global", "booleans", "integers", "assert", "typesmodules", "return", "del", "unary", "bitwise",
    "yield", "while", "bltin-code-objects", "dynamic-features", "if", "break", "lambda", "continue",
    "typesfunctions", "pass", "bltin-type-objects", "bltin-ellipsis-object", "bltin-null-object",
    "callable-types",
)  # fmt: skip

CHAT_PROMPTS = (
    "What is the capital of France?",
    "Give me three tips for staying healthy.",
    "Explain what a hash table is in two sentences.",
    "Write a haiku about the sea.",
)


def heldout_text() -> str:
    """The held-out text: the :data:`HELDOUT_TOPICS` pages of ``pydoc_data.topics``, in that order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name].strip() for name in HELDOUT_TOPICS)


def heldout_ids(tok, num_tokens: int, offset: int = 0) -> list[int]:
    """``num_tokens`` token ids of the held-out text, starting at token ``offset``."""
    check_int("num_tokens", num_tokens, min=2)
    ids = tok.encode(heldout_text())
    if not is_int(offset) or offset < 0 or offset + num_tokens > len(ids):
        raise ValueError(
            f"offset + num_tokens must fit in the {len(ids)} tokens of the held-out text, "
            f"got offset={offset!r}, num_tokens={num_tokens}"
        )
    return ids[offset : offset + num_tokens]


def ids_digest(ids: Sequence[int]) -> str:
    """A short fingerprint of a token sequence (to check that two runs measured the same text)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


@torch.inference_mode()
def stream_logits(model, ids: Sequence[int], cache=None, chunk_size: int | None = None) -> torch.Tensor:
    """Feed ``ids`` into ``cache`` (default: a fresh ``KVCache``), ``chunk_size`` tokens per forward pass.

    Returns the logits ``[len(ids), vocab]`` (float32): row ``i`` predicts ``ids[i + 1]``. One chunk
    (the default) is a prefill; ``chunk_size=1`` is token-by-token decoding; in between, chunked prefill.
    """
    if cache is None:
        cache = KVCache.for_model(model.config, dtype=model.dtype, device=model.device)
    if chunk_size is None:
        chunk_size = len(ids)
    check_int("chunk_size", chunk_size, min=1)
    x = torch.tensor([list(ids)], device=model.device)
    chunks = [model(x[:, i : i + chunk_size], cache=cache)[0] for i in range(0, x.shape[1], chunk_size)]
    return torch.cat(chunks).float()


def _check_logits(logits: torch.Tensor, ref_logits: torch.Tensor) -> None:
    if logits.shape != ref_logits.shape or logits.ndim != 2:
        raise ValueError(
            f"logits and ref_logits must both be [N, vocab], got {tuple(logits.shape)} and {tuple(ref_logits.shape)}"
        )


def perplexity(logits: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> float:
    """``exp`` of the mean negative log-likelihood of ``targets [N]`` under ``logits [N, vocab]``."""
    targets = torch.as_tensor(targets, device=logits.device)
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"logits must be [N, vocab] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    return math.exp(F.cross_entropy(logits.float(), targets).item())


def top1_agreement(logits: torch.Tensor, ref_logits: torch.Tensor) -> float:
    """Fraction of rows whose most likely token is the same in both."""
    _check_logits(logits, ref_logits)
    return (logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()


def kl_divergence(ref_logits: torch.Tensor, logits: torch.Tensor) -> float:
    """Mean over rows of ``KL(P_ref || P)`` in nats: the information lost by using ``logits``."""
    _check_logits(logits, ref_logits)
    ref_logp, logp = F.log_softmax(ref_logits.float(), -1), F.log_softmax(logits.float(), -1)
    return (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()


@dataclass(frozen=True)
class Quality:
    """One compressed cache against the reference on the same tokens."""

    ppl: float
    ref_ppl: float
    top1: float
    kl: float
    num_tokens: int

    @property
    def ppl_change(self) -> float:
        """Relative perplexity increase: 0.01 means 1% worse than the reference."""
        return self.ppl / self.ref_ppl - 1


def compare(logits: torch.Tensor, ref_logits: torch.Tensor, targets: Sequence[int] | torch.Tensor) -> Quality:
    """All three next-token measures of ``logits`` against ``ref_logits``, both predicting ``targets``."""
    _check_logits(logits, ref_logits)
    return Quality(perplexity(logits, targets), perplexity(ref_logits, targets), top1_agreement(logits, ref_logits),
                   kl_divergence(ref_logits, logits), len(targets))  # fmt: skip


@dataclass(frozen=True)
class GreedyAgreement:
    """Greedy generations with a compressed cache against the reference, prompt by prompt."""

    reference: list[list[int]]
    outputs: list[list[int]]

    @property
    def matched(self) -> list[int]:
        """Tokens equal to the reference before the first difference, per prompt."""
        out = []
        for ref, got in zip(self.reference, self.outputs):
            n = 0
            while n < min(len(ref), len(got)) and ref[n] == got[n]:
                n += 1
            out.append(n)
        return out

    @property
    def agreement(self) -> float:
        """Matched tokens over generated tokens (the longer of the two outputs), over all prompts."""
        return sum(self.matched) / sum(max(len(r), len(g)) for r, g in zip(self.reference, self.outputs))

    @property
    def identical(self) -> int:
        """Prompts whose whole output equals the reference."""
        return sum(r == g for r, g in zip(self.reference, self.outputs))


def greedy_agreement(
    model,
    prompts: Sequence[Sequence[int]],
    make_cache: Callable[[], object],
    max_new_tokens: int = 32,
    reference: Sequence[Sequence[int]] | None = None,
) -> GreedyAgreement:
    """Greedy outputs for ``prompts`` with caches from ``make_cache()`` against the full cache's.

    Pass ``reference`` (the full cache's outputs) to reuse it across several caches.
    """
    from .generation import generate

    if reference is None:
        reference = [generate(model, p, max_new_tokens) for p in prompts]
    outputs = [generate(model, p, max_new_tokens, cache=make_cache()) for p in prompts]
    return GreedyAgreement([list(r) for r in reference], outputs)


def needle_prompt(tok, haystack: Sequence[int], depth: float, secret: str) -> list[int]:
    """A needle-in-a-haystack prompt: ``haystack`` token ids with a sentence holding ``secret`` inserted at
    ``depth`` (0 = start, 1 = end), then a sentence start that only the needle completes.

    The model passes if it continues the prompt with ``secret``.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    at = round(depth * len(haystack))
    needle = tok.encode(f"\n\nThe secret code of the blue door is {secret}.\n\n")
    question = tok.encode(
        "\n\nQuestion: what is the secret code of the blue door?\nAnswer: the secret code of the blue door is"
    )
    return list(haystack[:at]) + needle + list(haystack[at:]) + question
