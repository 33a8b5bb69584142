"""A request's state: how it generates (:class:`SamplingParams`), each of its samples (:class:`Sequence`),
and the request that groups them with its timings (:class:`Request`, :class:`RequestMetrics`), as vLLM's
``sequence.py`` held ``Sequence``, ``SequenceGroup`` and ``RequestMetrics`` side by side. A request runs as one
sequence until its prompt is prefilled; with ``n > 1`` samples it then forks into ``n`` sequences that share the
prompt's blocks.

Bookkeeping only: this module imports no torch (see :mod:`kvcourse.control`). The sampler, which
draws tokens from logits with torch, is :class:`kvcourse.sampling.Sampler`; the engine hands each
request its samplers.

A sequence is its token ids (prompt, then the tokens generated so far), how many of them already have
K/V in the cache (``num_computed_tokens``), and where it is in its life (``status``). Its block table
is not stored here: the :class:`~kvcourse.paged.BlockManager` owns it, keyed by ``seq_id``, so there
is one copy of it that cannot drift.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable, Iterable, Sequence as SequenceABC
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from .checks import check_float, check_int, is_int

if TYPE_CHECKING:
    import torch

__all__ = ["Request", "RequestMetrics", "SamplingParams", "Sequence", "SequenceStatus", "TokenOutput"]


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


class TokenOutput(NamedTuple):
    """One token streamed out of a step: sample ``index`` of request ``request_id``."""

    request_id: Hashable
    index: int
    token_id: int
    finished: bool  # this sample is done (stop token or max_new_tokens)


@dataclass
class RequestMetrics:
    """Timestamps (seconds on the engine's clock) and step numbers of one request's life.

    ``ttft`` (time to first token) = first token - arrival, so it includes ``queue_time`` (arrival to
    the first step that ran it). ``tpot`` (time per output token) is the mean gap between a sample's
    tokens after the first: (finish - first token) / (tokens of the longest sample - 1).
    """

    arrival_time: float
    arrival_step: int
    num_prompt_tokens: int
    first_scheduled_time: float | None = None
    first_scheduled_step: int | None = None
    first_token_time: float | None = None
    first_token_step: int | None = None
    finish_time: float | None = None
    finish_step: int | None = None
    num_output_tokens: int = 0  # over all samples
    max_sample_tokens: int = 0  # the longest sample's output length
    num_preemptions: int = 0

    @property
    def queue_time(self) -> float:
        return math.nan if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float:
        return math.nan if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float:
        if self.finish_time is None or self.first_token_time is None or self.max_sample_tokens < 2:
            return math.nan
        return (self.finish_time - self.first_token_time) / (self.max_sample_tokens - 1)

    @property
    def e2e_latency(self) -> float:
        return math.nan if self.finish_time is None else self.finish_time - self.arrival_time


class Request:
    """One prompt and its samples (vLLM's ``SequenceGroup``). ``seqs[i]`` is sample ``i`` (only ``seqs[0]`` until
    the first token), with id ``(request_id, i)``. It picks its samples' tokens and forks them (:meth:`samples_of`,
    :meth:`pick`). ``samplers[i]`` draws sample ``i``'s tokens (a :class:`~kvcourse.sampling.Sampler` each, all
    made before the request is queued, so that nothing in a later step, the fork, can fail on them)."""

    def __init__(
        self,
        request_id: Hashable,
        seq: Sequence,
        metrics: RequestMetrics,
        samplers: SequenceABC[Callable[[torch.Tensor], int]],
    ) -> None:
        if len(samplers) != seq.params.n:
            raise ValueError(f"samplers must hold one sampler per sample (n={seq.params.n}), got {len(samplers)}")
        self.request_id = request_id
        self.params: SamplingParams = seq.params
        self.seqs: list[Sequence] = [seq]
        self.samplers = list(samplers)
        self.metrics = metrics
        self.cancelled = False

    @property
    def needs_fork(self) -> bool:
        """Its first token is being sampled and it wants more than one sample."""
        return self.params.n > 1 and len(self.seqs) == 1

    def samples_of(self, seq: Sequence) -> list[Sequence]:
        """The sequences whose next token ``seq``'s logits give: ``seq`` alone, or, at the first token of a
        request with ``n > 1`` samples, the ``n - 1`` forked from it (new sequences for the caller to start on
        ``seq``'s blocks) and then ``seq``."""
        return [*(self.fork() if self.needs_fork else []), seq]

    def pick(self, seq: Sequence, logits: torch.Tensor, argmax: int) -> int:
        """Sample ``seq``'s next token from its ``logits`` row; ``argmax`` is that row's argmax (taken for the
        whole batch at once: most requests are greedy). A sampled token draws from ``seq``'s own generator."""
        return argmax if self.params.greedy else self.samplers[seq.seq_id[1]](logits)

    def fork(self) -> list[Sequence]:
        """Samples ``1 .. n-1``, copies of sample 0 with their own seeds (call before sample 0's first token)."""
        parent = self.seqs[0]
        children = [parent.fork((self.request_id, i)) for i in range(1, self.params.n)]
        self.seqs += children
        return children

    @property
    def is_finished(self) -> bool:
        return self.cancelled or (len(self.seqs) == self.params.n and all(s.is_finished for s in self.seqs))

    @property
    def outputs(self) -> list[list[int]]:
        """Each sample's generated tokens so far."""
        return [s.output_token_ids for s in self.seqs]

    @property
    def status(self) -> str:
        if self.cancelled:
            return SequenceStatus.CANCELLED.value
        if self.is_finished:
            return SequenceStatus.FINISHED.value
        return "running" if any(s.status is SequenceStatus.RUNNING for s in self.seqs) else "waiting"

    def __repr__(self) -> str:
        m = self.metrics
        return f"Request({self.request_id!r}, {self.status}, prompt={m.num_prompt_tokens}, n={self.params.n})"
