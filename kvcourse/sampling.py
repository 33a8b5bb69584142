"""Drawing a request's next token from its logits: :class:`Sampler` (greedy, temperature, top-k, top-p).

The data-plane half of a request's sampling: :class:`~kvcourse.sequence.SamplingParams` says how a
request samples and needs no torch; the sampler holds a seeded ``torch.Generator`` and reads logits.
"""

from __future__ import annotations

import torch

from .checks import check_int
from .sequence import SamplingParams

__all__ = ["Sampler"]


class Sampler:
    """Picks one request's tokens from its logits, with its own seeded random generator.

    ``index`` is the sample's number among the ``params.n`` samples of one prompt: it draws with
    seed ``params.seed + index`` (``params.seed`` ``None`` counts as 0).
    """

    def __init__(self, params: SamplingParams, index: int = 0) -> None:
        check_int("index", index, min=0, max=params.n - 1)
        self.params = params
        self.generator = None
        if not params.greedy:
            seed = (0 if params.seed is None else params.seed) + index
            self.generator = torch.Generator(device="cpu").manual_seed(seed)

    def __call__(self, logits: torch.Tensor) -> int:
        """The next token from one position's logits ``[vocab]``."""
        p = self.params
        if p.greedy:
            return int(torch.argmax(logits))
        logits = logits.detach().float().cpu() / p.temperature
        if p.top_k and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if p.top_p < 1:
            sorted_logits, order = torch.sort(logits, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            before = torch.cumsum(probs, dim=-1) - probs  # probability of the tokens ranked above
            drop = order[before >= p.top_p]  # the most likely token always has before = 0: kept
            logits = logits.index_fill(0, drop, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))
