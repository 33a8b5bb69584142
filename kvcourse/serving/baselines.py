"""What continuous batching is measured against: one request at a time, and static batching.

**Static batching** is how a server without a scheduler batches (and what Hugging Face ``generate``
does on a padded batch): take the next ``batch_size`` requests, pad their prompts to the longest,
and decode all of them until the longest output is done; only then start the next batch. A request
that finishes early keeps its row and computes padding. Here the padding is real work: each
request's prompt is padded to the batch's longest with pad tokens, and a finished request keeps
feeding a pad token every step. The pad tokens go to a throwaway sequence of their own, so the real
tokens are exactly those of a request run alone. **One at a time** is static batching with
``batch_size=1``: no padding, no sharing.

Both run on the same :class:`~kvcourse.serving.ModelRunner` as the engine and leave the same
:class:`~kvcourse.serving.StepEvent` log (kind ``"pad"`` for the padding), so their timelines
and latencies compare one to one.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence as SequenceABC
from dataclasses import dataclass

from ..checks import check_int
from ..sampling import Sampler
from ..sequence import RequestMetrics, SamplingParams, Sequence
from .model_runner import ModelRunner
from .stats import StepEvent

__all__ = ["StaticRun", "serve_static"]


@dataclass
class StaticRun:
    """The outputs (in prompt order), per-request metrics and the step log of a static-batching run."""

    outputs: list[list[int]]
    metrics: list[RequestMetrics]
    events: list[StepEvent]


def serve_static(
    model,
    prompts: SequenceABC[SequenceABC[int]],
    sampling_params: SamplingParams | SequenceABC[SamplingParams],
    batch_size: int,
    *,
    block_size: int = 16,
    backend: str = "paged-torch",
    pad_token_id: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> StaticRun:
    """Serve ``prompts`` in static batches of ``batch_size`` (all requests arrive at time 0).

    A request's metrics are its own: its first token comes after its batch's prefill, it finishes
    with its own last token (a streaming server could return it then).
    """
    check_int("batch_size", batch_size, min=1)
    if not prompts:
        raise ValueError("prompts must not be empty")
    if isinstance(sampling_params, SamplingParams):
        sampling_params = [sampling_params] * len(prompts)
    if len(sampling_params) != len(prompts):
        raise ValueError(f"sampling_params must be one SamplingParams or one per prompt ({len(prompts)})")
    if any(sp.n != 1 for sp in sampling_params):
        raise ValueError("static batching here makes one sample per prompt (n=1)")
    eos = tuple(model.config.eos_token_id or ())
    t0 = clock()
    outputs: list[list[int]] = [[] for _ in prompts]
    metrics = [RequestMetrics(0.0, 0, len(p)) for p in prompts]
    events: list[StepEvent] = []
    for first in range(0, len(prompts), batch_size):
        batch = list(range(first, min(first + batch_size, len(prompts))))
        seqs = {i: Sequence(i, prompts[i], sampling_params[i], eos_token_ids=eos) for i in batch}
        samplers = {i: Sampler(sampling_params[i]) for i in batch}
        longest_prompt = max(len(prompts[i]) for i in batch)
        longest_output = max(sampling_params[i].max_new_tokens for i in batch)
        per_row = -(-(longest_prompt + longest_output) // block_size)
        runner = ModelRunner(model, 2 * len(batch) * per_row, block_size, backend)
        # prefill: every prompt, padded to the longest
        work = [(i, prompts[i]) for i in batch]
        work += [
            (("pad", i), [pad_token_id] * (longest_prompt - len(prompts[i])))
            for i in batch
            if len(prompts[i]) < longest_prompt
        ]
        for step_in_batch in range(longest_output):
            start = clock()
            logits = runner.step(work)
            scheduled, finished = [], []
            for row, (seq_id, tokens) in enumerate(work):
                if isinstance(seq_id, tuple):  # padding
                    scheduled.append((seq_id[1], 0, len(tokens), "pad"))
                    continue
                seq = seqs[seq_id]
                if seq.is_finished:  # a finished request keeps its row: it pads
                    scheduled.append((seq_id, 0, len(tokens), "pad"))
                    continue
                scheduled.append((seq_id, 0, len(tokens), "prefill" if step_in_batch == 0 else "decode"))
                seq.append_token(samplers[seq_id](logits[row]))
                m = metrics[seq_id]
                now = clock() - t0
                if step_in_batch == 0:
                    m.first_scheduled_time, m.first_scheduled_step = start - t0, len(events)
                    m.first_token_time, m.first_token_step = now, len(events)
                m.num_output_tokens += 1
                if seq.is_finished:
                    m.finish_time, m.finish_step = now, len(events)
                    m.max_sample_tokens = m.num_output_tokens
                    finished.append((seq_id, 0))
            end = clock()
            events.append(StepEvent(
                step=len(events), start=start - t0, duration=end - start, scheduled=tuple(scheduled),
                admitted=tuple((i, 0) for i in batch) if step_in_batch == 0 else (), preempted=(),
                finished=tuple(finished), num_free_blocks=runner.block_manager.num_free_blocks,
                num_waiting=len(prompts) - batch[-1] - 1, num_running=len(batch), num_copies=0,
            ))  # fmt: skip
            if all(seqs[i].is_finished for i in batch):
                break
            work = [(i, [pad_token_id] if seqs[i].is_finished else seqs[i].token_ids[-1:]) for i in batch]
        for i in batch:
            outputs[i] = seqs[i].output_token_ids
    return StaticRun(outputs, metrics, events)
