"""A request as the engine sees it: its samples (sequences), how they are picked, and its timings.

A request is one prompt with its :class:`~kvcourse.SamplingParams`. It runs as one
:class:`~kvcourse.Sequence` until its prompt is prefilled; with ``n > 1`` samples it then forks into
``n`` sequences that share the prompt's blocks. Its :class:`RequestMetrics` record when it arrived,
first ran, produced its first token and finished, in seconds and in engine steps.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from ..sampling import Sampler
from ..sequence import SamplingParams, Sequence, SequenceStatus

if TYPE_CHECKING:
    import torch

__all__ = ["Request", "RequestMetrics", "TokenOutput"]


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
    """One prompt and its samples. ``seqs[i]`` is sample ``i`` (only ``seqs[0]`` until the first token),
    with id ``(request_id, i)``. It picks its samples' tokens and forks them (:meth:`samples_of`, :meth:`pick`)."""

    def __init__(self, request_id: Hashable, seq: Sequence, metrics: RequestMetrics) -> None:
        self.request_id = request_id
        self.params: SamplingParams = seq.params
        self.seqs: list[Sequence] = [seq]
        # Every sample's sampler now, so that nothing in a later step (the fork) can fail on them.
        self.samplers: list[Sampler] = [Sampler(seq.params, i) for i in range(seq.params.n)]
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
