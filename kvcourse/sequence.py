"""One request's state (:class:`Sequence`) and how its next tokens are picked (:class:`SamplingParams`).

Bookkeeping only: this module imports no torch (see :mod:`kvcourse.control`). The sampler, which
draws tokens from logits with torch, is :class:`kvcourse.sampling.Sampler`.

A sequence is its token ids (prompt, then the tokens generated so far), how many of them already have
K/V in the cache (``num_computed_tokens``), and where it is in its life (``status``). Its block table
is not stored here: the :class:`~kvcourse.paged.BlockManager` owns it, keyed by ``seq_id``, so there
is one copy of it that cannot drift.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Sequence as SequenceABC
from dataclasses import dataclass

from .checks import check_float, check_int, is_int

__all__ = ["SamplingParams", "Sequence", "SequenceStatus"]


SEED_MAX = 2**64 - 1  # the largest seed torch.Generator.manual_seed takes


@dataclass(frozen=True)
class SamplingParams:
    """How one request generates.

    Args:
        max_new_tokens: the most tokens to generate (>= 1).
        temperature: 0 means greedy (argmax); above 0, sample from ``softmax(logits / temperature)``.
        top_k: keep only the ``top_k`` most likely tokens before sampling (0: all of them).
        top_p: keep the smallest set of most likely tokens whose probability reaches ``top_p`` (1: all).
        seed: seeds this request's sampler, so a sampled run is reproducible; ``None`` means seed 0.
        stop_token_ids: generation stops after any of these; ``None`` means the model's EOS tokens,
            ``()`` means never stop early.
        n: how many samples of the same prompt to generate (parallel sampling, served by
            :class:`kvcourse.serving.Engine`: the samples share the prompt's blocks). Sample ``i``
            draws with seed ``seed + i``.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] | None = None
    n: int = 1

    def __post_init__(self) -> None:
        check_int("max_new_tokens", self.max_new_tokens, min=1)
        check_float("temperature", self.temperature, min=0)  # finite: inf would divide every logit to 0
        check_int("top_k", self.top_k, min=0)
        check_float("top_p", self.top_p, min=0, max=1, min_open=True)
        n = check_int("n", self.n, min=1)
        if self.seed is not None:
            # torch seeds are 64-bit, and sample i draws with seed + i: every one of them must fit.
            seed = check_int("seed", self.seed, min=0, max=SEED_MAX - (n - 1))
            object.__setattr__(self, "seed", seed)
        if self.stop_token_ids is not None:
            stops = self.stop_token_ids
            if isinstance(stops, (str, bytes)) or not isinstance(stops, Iterable):
                raise TypeError(f"stop_token_ids must be a list of token ids or None, got {stops!r}")
            stops = tuple(stops)
            if not all(is_int(t) and t >= 0 for t in stops):
                raise ValueError(f"stop_token_ids must be non-negative ints, got {list(stops)}")
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # arrived, no K/V yet
    RUNNING = "running"  # scheduled: its K/V are in the cache
    PREEMPTED = "preempted"  # its blocks were taken back; it will be recomputed
    SWAPPED = "swapped"  # preempted, its K/V copied to host memory; it will be swapped back in
    FINISHED = "finished"  # hit a stop token or max_new_tokens
    CANCELLED = "cancelled"  # aborted by the caller


class Sequence:
    """One request: ``token_ids`` = prompt + generated, ``num_computed_tokens`` of them cached.

    Args:
        seq_id: any hashable id (the block manager's key).
        prompt_token_ids: the prompt, at least one token.
        params: how it generates.
        eos_token_ids: the model's EOS tokens, used when ``params.stop_token_ids`` is ``None``.
    """

    def __init__(
        self,
        seq_id: Hashable,
        prompt_token_ids: SequenceABC[int],
        params: SamplingParams | None = None,
        eos_token_ids: Iterable[int] = (),
    ) -> None:
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must contain at least one token")
        self.seq_id = seq_id
        self.params = SamplingParams() if params is None else params
        self.token_ids: list[int] = prompt
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.status = SequenceStatus.WAITING
        # The chained hashes of its first full blocks, filled in by the prefix cache's lookups (vLLM's
        # Request.block_hashes), for the one pool and cache salt it is scheduled with. Tokens are only
        # ever appended, so a hash once computed stays right.
        self.block_hashes: list = []
        stops = self.params.stop_token_ids
        self.stop_token_ids = frozenset(eos_token_ids if stops is None else stops)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status in (SequenceStatus.FINISHED, SequenceStatus.CANCELLED)

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens without K/V yet: the rest of the prompt, or the one token generated last step."""
        return len(self.token_ids) - self.num_computed_tokens

    def fork(self, seq_id: Hashable) -> Sequence:
        """A copy under a new id (same tokens, computed count and status): one more sample of the prompt."""
        child = Sequence(seq_id, self.prompt_token_ids, self.params)
        child.token_ids = list(self.token_ids)
        child.num_computed_tokens = self.num_computed_tokens
        child.status = self.status
        child.block_hashes = list(self.block_hashes)
        child.stop_token_ids = self.stop_token_ids
        return child

    def append_token(self, token: int) -> None:
        """Add a generated token; the sequence finishes on a stop token or at ``max_new_tokens``."""
        self.token_ids.append(token)
        if token in self.stop_token_ids or len(self.token_ids) - self.num_prompt_tokens >= self.params.max_new_tokens:
            self.status = SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (
            f"Sequence(seq_id={self.seq_id!r}, status={self.status.value}, prompt={self.num_prompt_tokens}, "
            f"generated={self.num_tokens - self.num_prompt_tokens}, computed={self.num_computed_tokens})"
        )
