"""The engine: requests in, tokens out, one batched forward per step.

:meth:`Engine.step` is the whole loop body of a serving engine (vLLM's ``LLMEngine.step``,
nano-vllm's ``LLMEngine.step``):

1. the :class:`~kvcourse.serving.Scheduler` picks the step's sequences and reserves their slots;
2. the :class:`~kvcourse.serving.ModelRunner` packs their inputs, does the copy-on-write copies and runs one
   forward over all of them;
3. every sequence that reached the end of its tokens samples its next one, picked by its
   :class:`~kvcourse.sequence.Request` (a request with ``n`` samples forks into ``n`` sequences at its
   first token); finished sequences free their blocks;
4. a :class:`StepRecorder` (at the end of this file) counts what the step did.

With ``overlap`` (on a GPU, by default), steps 1-2 of the next step run while the device computes this one, before
step 3 reads its tokens back: the GPU no longer waits for the host to schedule and pack (:meth:`Engine._plan_ahead`).

:meth:`Engine.generate` runs the loop until a list of prompts is done; :meth:`Engine.add_request`,
:meth:`Engine.step` and :meth:`Engine.abort` drive it live, and :meth:`Engine.stream` yields tokens
as they come. :attr:`Engine.stats` counts what happened; :attr:`Engine.events` logs every step.
"""

from __future__ import annotations

import itertools
import math
import sys
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence as SequenceABC
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..checks import check_bool, check_callable, check_float, check_hashable, check_int, check_token_ids
from ..sampling import Sampler
from ..sequence import Request, RequestMetrics, SamplingParams, Sequence, TokenOutput
from .model_runner import UNKNOWN_TOKEN, ModelRunner, PackedStep
from .scheduler import PreemptionPolicy, Scheduler, SchedulerOutput
from .stats import StepEvent, engine_stats

__all__ = ["Engine", "StepRecorder"]


@dataclass
class _Planned:
    """A step scheduled and packed, not yet run: ``state`` is the scheduler's snapshot from before it was
    scheduled (where a failure rolls back to), ``start`` the clock then."""

    out: SchedulerOutput
    packed: PackedStep
    state: dict | None
    start: float


class Engine:
    """A continuous-batching engine on a paged KV pool.

    Args:
        model: a :class:`~kvcourse.LlamaModel`.
        num_blocks, block_size: the KV pool (``num_blocks * block_size`` token slots).
        max_num_seqs: most sequences in one step.
        max_num_batched_tokens: most new tokens in one step (``None``: no cap); at least one block.
        enable_chunked_prefill: split long prompts across steps, mixed with other requests' decodes.
        watermark: fraction of the blocks admission keeps free for running requests to grow into.
        enable_prefix_caching: reuse the K/V of full blocks whose prefix an earlier request computed
            (chapter 7, :mod:`kvcourse.paged.prefix_cache`).
        num_cpu_blocks: blocks of host memory (chapter 7, :mod:`kvcourse.paged.offload`) for swapped
            requests and, with prefix caching, a cold tier for evicted cached blocks. 0: none.
        preemption_mode: ``"recompute"`` (vLLM's default) or ``"swap"`` (needs ``num_cpu_blocks``).
        preemption_policy: ``policy(candidates) -> victim``, which running sequence to preempt when
            the pool is out of blocks (:data:`~kvcourse.serving.scheduler.PreemptionPolicy`); ``None``:
            the newest, vLLM's choice (:func:`~kvcourse.serving.scheduler.preempt_newest`).
        backend: the paged attention backend (``"paged-torch"``; chapter 5 adds ``"triton"``).
        cuda_graphs: ``"capture"``, ``"eager"`` or ``"off"`` (``True``/``False``: capture/off): steps replayed from CUDA
            graphs recorded when the engine starts (:mod:`kvcourse.serving.step_graphs`), the same static forward
            run eagerly, or none; ``None``: capture when the model is on a CUDA GPU and the backend is ``"triton"``.
        overlap: schedule and pack the next step while the device runs this one, the sampled tokens fed to it
            on the device and read by the host one step late (SGLang's overlap scheduler, vLLM's async
            scheduling); the outputs and the scheduler's decisions are the same as without. ``None``: on when the
            model is on a CUDA GPU (on a CPU nothing runs ahead of the host, so it only costs a little).
        clock: seconds, for the latency metrics (``time.perf_counter``).
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 32,
        max_num_batched_tokens: int | None = 512,
        *,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
        preemption_mode: str = "recompute",
        preemption_policy: PreemptionPolicy | None = None,
        backend: str = "paged-torch",
        cuda_graphs: str | bool | None = None,
        overlap: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        # The cheap checks first, before the pool is allocated; the scheduler checks its own limits.
        check_int("num_blocks", num_blocks, min=1)
        check_int("block_size", block_size, min=1)
        if preemption_policy is not None:
            check_callable("preemption_policy", preemption_policy, "a function candidates -> victim")
        check_callable("clock", clock, "a function returning seconds, such as time.perf_counter")
        start = check_float("clock()", clock())  # seconds
        if max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", max_num_batched_tokens, min=1)
            if max_num_batched_tokens < block_size:
                raise ValueError(
                    f"max_num_batched_tokens must be at least one block (block_size={block_size}), "
                    f"got {max_num_batched_tokens}"
                )
        self.model = model
        # Graphs for decode steps of up to max_num_seqs sequences (at most 512, as nano-vllm; larger ones run eagerly).
        check_int("max_num_seqs", max_num_seqs, min=1, none_ok=True)
        graph_seqs = 512 if max_num_seqs is None else min(max_num_seqs, 512)
        self.runner = ModelRunner(model, num_blocks, block_size, backend, enable_prefix_caching, num_cpu_blocks,
                                  cuda_graphs=cuda_graphs, max_num_seqs=graph_seqs,
                                  max_num_batched_tokens=max_num_batched_tokens or 2048)  # fmt: skip
        self.scheduler = Scheduler(
            self.runner.block_manager,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_chunked_prefill=enable_chunked_prefill,
            watermark=watermark,
            preemption_mode=preemption_mode,
            preemption_policy=preemption_policy,
        )
        self.clock = clock
        self.overlap = model.device.type == "cuda" if overlap is None else check_bool("overlap", overlap)
        self._next: _Planned | None = None  # with overlap: the next step, scheduled and packed while this one ran
        self._next_error: BaseException | None = None  # or the error scheduling it raised
        eos = model.config.eos_token_id
        self.eos_token_ids = (eos,) if isinstance(eos, int) else tuple(eos or ())
        self.requests: dict[Hashable, Request] = {}  # every request ever added, in order
        self._unfinished: dict[Hashable, Request] = {}
        self._request_of: dict[Hashable, Request] = {}  # seq_id -> its request, while the sequence runs
        self._next_id = 0  # where the search for a free request id starts
        self.recorder = StepRecorder(self.scheduler, self._request_of, t0=start)

    @property
    def block_manager(self):
        return self.runner.block_manager

    # ---- requests -----------------------------------------------------------------------------
    def add_request(
        self,
        prompt: SequenceABC[int] | torch.Tensor,
        sampling_params: SamplingParams | None = None,
        request_id: Hashable | None = None,
        *,
        cache_salt: str | None = None,
    ) -> Hashable:
        """Queue a prompt (token ids); return its request id (by default the next free int).

        ``cache_salt``: with prefix caching, the request shares cached blocks only with requests of the
        same salt (one per tenant), so nobody can time a hit on someone else's prompt.
        """
        auto = request_id is None
        request = self._new_request(prompt, sampling_params, request_id, "prompt", cache_salt)
        self._enqueue(request, cache_salt, auto)
        return request.request_id

    def _new_request(self, prompt, sampling_params, request_id, name: str, cache_salt: str | None) -> Request:
        """A request, every argument checked (once: the scheduler's checks included); nothing is queued yet."""
        prompt = check_token_ids(name, prompt, self.model.config.vocab_size)
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:  # the next free int; taken only when the request is queued
            request_id = next(i for i in itertools.count(self._next_id) if i not in self.requests)
        elif check_hashable("request_id", request_id) in self.requests:
            raise ValueError(f"request_id={request_id!r} is already used")
        context = self.model.config.max_position_embeddings
        if len(prompt) + params.max_new_tokens > context:
            raise ValueError(
                f"{len(prompt)} prompt tokens + max_new_tokens={params.max_new_tokens} exceed the model's "
                f"context length ({context})"
            )
        seq = Sequence((request_id, 0), prompt, params, eos_token_ids=self.eos_token_ids)
        # It fits the pool alone, n fits max_num_seqs, the salt is valid, and without chunked prefill
        # its longest prefill fits the budget.
        self.scheduler.check(seq, cache_salt=cache_salt, name=f"request {request_id!r}")
        metrics = self.recorder.new_metrics(seq.num_prompt_tokens)  # arrival: at _enqueue
        samplers = [Sampler(params, i) for i in range(params.n)]  # all now: nothing left that can fail
        return Request(request_id, seq, metrics, samplers)

    def _enqueue(self, request: Request, cache_salt: str | None, auto_id: bool) -> None:
        """Queue a checked request (nothing here raises, so nothing is left half-queued)."""
        seq = request.seqs[0]
        self._discard_next()  # the step scheduled ahead did not see this request
        if auto_id:
            self._next_id = request.request_id + 1
        self.recorder.arrived(request, self.clock())
        self.scheduler.enqueue(seq, cache_salt=cache_salt)
        self.requests[request.request_id] = self._unfinished[request.request_id] = request
        self._request_of[seq.seq_id] = request

    def abort(self, request_id: Hashable) -> None:
        """Cancel an unfinished request: it leaves the queue or the batch; its blocks are freed."""
        request = self._unfinished.pop(check_hashable("request_id", request_id), None)
        if request is None:
            raise ValueError(f"request_id={request_id!r} is not an unfinished request")
        self._discard_next()
        for seq in request.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)
            self._request_of.pop(seq.seq_id, None)
        request.cancelled = True
        self.recorder.cancelled(request, self.clock())

    def has_unfinished_requests(self) -> bool:
        return bool(self._unfinished)

    def output(self, request_id: Hashable) -> list[int] | list[list[int]]:
        """A request's generated tokens (so far): one list, or ``n`` lists when it has ``n > 1`` samples."""
        if check_hashable("request_id", request_id) not in self.requests:
            raise ValueError(f"request_id={request_id!r} is unknown")
        request = self.requests[request_id]
        return request.outputs if request.params.n > 1 else request.outputs[0]

    # ---- one step -----------------------------------------------------------------------------
    def step(self) -> list[TokenOutput]:
        """Run one step of every scheduled request; return the tokens it produced.

        With ``overlap``, the previous call scheduled and packed this step while the device ran its own, and this
        call does the same for the next one (:meth:`_plan_ahead`): between two calls, its slots are reserved."""
        if not self.scheduler.has_unfinished():
            return []
        planned = self._take_next() or self._plan()  # with overlap, the previous call scheduled this step
        try:
            logits = self.runner.launch(planned.packed)
        except BaseException:  # a step is a transaction: back to where the scheduler and the pool were
            self.scheduler.rollback(planned.state, failed=planned.out)
            raise
        out = planned.out
        self.scheduler.advance(out)
        targets = self._fork(out)
        if self.overlap:
            sampled, finished, observed = self._plan_ahead(targets, logits)
        else:
            sampled = self._pick(targets, logits, logits.argmax(dim=-1))
            finished, observed = self.scheduler.append_tokens(sampled), None
        self.recorder.record(out, sampled, finished, planned.start, self.clock(), observed)
        self._retire(finished)
        done = {seq.seq_id for seq in finished}
        return [TokenOutput(*seq_id, token, seq_id in done) for seq_id, token in sampled.items()]

    def _take_next(self) -> _Planned | None:
        """The step the previous call scheduled ahead (overlap), or ``None``; the error scheduling it raised, if
        it did (the scheduler was rolled back then): this call raises it, as it would without overlap."""
        planned, error, self._next, self._next_error = self._next, self._next_error, None, None
        if error is not None:
            raise error
        return planned

    def _plan(self) -> _Planned:
        """Schedule a step and pack its inputs. If scheduling (a preemption policy, a prefix lookup) or packing
        fails, the scheduler and the pool go back to where they were, and the error propagates."""
        start, state = self.clock(), self.scheduler.snapshot()
        try:
            out = self.scheduler.schedule()
            if not out.scheduled:  # add_request guarantees the oldest request fits alone
                raise RuntimeError("the scheduler found nothing to run although requests are waiting")
            return _Planned(out, self.runner.prepare(out), state, start)
        except BaseException:
            self.scheduler.rollback(state)
            raise

    def _plan_ahead(self, targets: list[tuple[int, Request, list[Sequence]]], logits: torch.Tensor):
        """Overlap: schedule and pack the next step while this one runs on the device, then read its tokens.

        The sampled tokens stay on the device, where the next step's input ids are gathered from them. The next
        step is scheduled as if no sequence stopped on a token: each sequence that samples gets an
        :data:`UNKNOWN_TOKEN`, so every length (and every stop at ``max_new_tokens``) is already right. If a
        sequence did stop on a token, the guess and the next step are rolled back and the tokens appended as
        without overlap (the next call schedules again): either way the scheduler decides exactly as without
        overlap. Returns the tokens (``seq_id -> token``), the finished sequences and the queues and pool after
        them (:meth:`StepRecorder.observe`).
        """
        argmax = logits.argmax(dim=-1)  # on the device; nothing waits for it yet
        before = self.scheduler.snapshot()
        seqs = [seq for _, _, samples in targets for seq in samples]
        finished = self.scheduler.append_tokens(dict.fromkeys((seq.seq_id for seq in seqs), UNKNOWN_TOKEN))
        observed = self.recorder.observe()
        if self.scheduler.has_unfinished():
            try:
                self._next = self._plan()
                self._feed(argmax, {seq.seq_id: row for row, _, samples in targets for seq in samples})
            except BaseException as error:  # the next call raises it, as it would schedule without overlap
                self._discard_next()
                self._next_error = error
        sampled = self._pick(targets, logits, argmax)  # the next step packed, the host waits for this one
        if any(not seq.is_finished and sampled[seq.seq_id] in seq.stop_token_ids for seq in seqs):
            self.scheduler.rollback(before)  # undoes the unknown tokens and the next step's schedule
            self._next = self._next_error = None
            self.recorder.counters["overlap_rollbacks"] += 1
            return sampled, self.scheduler.append_tokens(sampled), None
        for seq in seqs:
            seq.token_ids[-1] = sampled[seq.seq_id]
        redraw = [seq.seq_id for seq in seqs if not self._request_of[seq.seq_id].params.greedy]
        if self._next is not None and redraw:  # sampled, not the argmax: written from the host
            tokens = torch.tensor([sampled[i] for i in redraw], device=argmax.device)
            self._feed(tokens, {seq_id: i for i, seq_id in enumerate(redraw)})
        self.recorder.counters["overlapped_steps"] += self._next is not None
        return sampled, finished, observed

    def _feed(self, tokens: torch.Tensor, index_of: dict[Hashable, int]) -> None:
        """Write ``tokens[index_of[seq_id]]`` into the next step's input ids, on the device, for each sequence it
        feeds the unknown token of (its one new token: it sampled in this step)."""
        rows, picks, row = [], [], 0
        for s in self._next.out.scheduled:
            row += s.num_new_tokens
            if s.seq.seq_id in index_of:
                rows.append(row - 1)
                picks.append(index_of[s.seq.seq_id])
        if rows:
            self.runner.feed_tokens(self._next.packed, rows, tokens, picks)

    def _discard_next(self) -> None:
        """Forget the step scheduled ahead (a request came or went since): its reservations go back."""
        self._next_error = None
        if self._next is not None:
            self.scheduler.rollback(self._next.state)
            self._next = None

    def _fork(self, out: SchedulerOutput) -> list[tuple[int, Request, list[Sequence]]]:
        """``(row, request, samples)`` for each sequence whose step reached the end of its tokens: the logits row
        that gives their next token, and the samples it gives it to (a request with ``n > 1`` samples forks
        them at its first token: they start on the parent's blocks)."""
        targets = []
        for row, s in enumerate(out.scheduled):
            if not s.samples:
                continue  # a prefill chunk short of the prompt's end: its logits are not needed
            request = self._request_of[s.seq.seq_id]
            samples = request.samples_of(s.seq)
            for seq in samples[:-1]:
                self.scheduler.fork(s.seq, seq)
                self._request_of[seq.seq_id] = request
            targets.append((row, request, samples))
        return targets

    def _pick(self, targets, logits: torch.Tensor, argmax: torch.Tensor) -> dict[Hashable, int]:
        """The next token of every sample in ``targets`` (``seq_id -> token``), in order (each draws from its own
        generator). ``argmax``: the logits' argmax on the device, read here in one call (most requests are greedy):
        the host waits for the step."""
        argmax = argmax.tolist()
        return {
            seq.seq_id: request.pick(seq, logits[row], argmax[row])
            for row, request, samples in targets
            for seq in samples
        }

    def _retire(self, finished: list[Sequence]) -> None:
        """Forget the finished sequences; a request leaves the unfinished ones with its last sample."""
        for seq in finished:
            request = self._request_of.pop(seq.seq_id)
            if request.is_finished:
                self._unfinished.pop(request.request_id, None)

    # ---- whole runs ---------------------------------------------------------------------------
    def generate(
        self,
        prompts: SequenceABC[SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        max_new_tokens: int | None = None,
        use_tqdm: bool | None = None,
        cache_salt: str | None = None,
    ) -> list[list[int]] | list[list[list[int]]]:
        """Serve ``prompts`` (lists of token ids) to completion; their new tokens, in prompt order.

        ``sampling_params`` is one :class:`~kvcourse.SamplingParams` for all prompts or one per
        prompt; or give ``max_new_tokens`` alone for greedy decoding (default 16). With ``n > 1``
        samples, a prompt's entry is the list of its ``n`` samples. ``use_tqdm``: a progress bar of
        finished requests (by default for 32 prompts or more). ``cache_salt``: every prompt's (see
        :meth:`add_request`).
        """
        ids = self._add_all(prompts, sampling_params, max_new_tokens, cache_salt)
        show = len(ids) >= 32 if use_tqdm is None else bool(use_tqdm)
        with tqdm(total=len(ids), desc="requests", unit="req", disable=not show, file=sys.stderr) as bar:
            while any(i in self._unfinished for i in ids):
                before = sum(i not in self._unfinished for i in ids)
                self.step()
                bar.update(sum(i not in self._unfinished for i in ids) - before)
        return [self.output(i) for i in ids]

    def stream(
        self,
        prompts: SequenceABC[SequenceABC[int]],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        *,
        max_new_tokens: int | None = None,
        cache_salt: str | None = None,
    ) -> Iterator[tuple[int, TokenOutput]]:
        """Like :meth:`generate`, but yield ``(prompt_position, token_output)`` as each token is made."""
        ids = self._add_all(prompts, sampling_params, max_new_tokens, cache_salt)
        position = {rid: i for i, rid in enumerate(ids)}
        while any(i in self._unfinished for i in ids):
            for tok in self.step():
                if tok.request_id in position:
                    yield position[tok.request_id], tok

    def _add_all(self, prompts, sampling_params, max_new_tokens, cache_salt=None) -> list[Hashable]:
        if isinstance(prompts, (str, bytes, torch.Tensor)) or not isinstance(prompts, SequenceABC) or not prompts:
            raise TypeError("prompts must be a non-empty list of prompts, each a list of token ids")
        if sampling_params is not None and max_new_tokens is not None:
            raise ValueError("give either sampling_params or max_new_tokens, not both")
        if sampling_params is None:
            sampling_params = SamplingParams(max_new_tokens=16 if max_new_tokens is None else max_new_tokens)
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, SequenceABC) or len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {len(prompts)} (one per prompt)")
        requests = []
        try:  # check them all before queueing any
            for i, (p, sp) in enumerate(zip(prompts, sampling_params)):
                requests.append(self._new_request(p, sp, None, f"prompts[{i}]", cache_salt))
                self.requests[requests[-1].request_id] = None  # hold the id while the others are checked
        finally:
            for request in requests:
                del self.requests[request.request_id]
        for request in requests:
            self._enqueue(request, cache_salt, auto_id=True)
        return [request.request_id for request in requests]

    # ---- what happened ------------------------------------------------------------------------
    @property
    def stats(self) -> dict:
        """Counters, latency percentiles of the finished requests, and per-request metrics.

        ``prompt_tokens`` counts the prompts prefilled (once per request); ``recomputed_tokens`` the
        tokens fed again because a preemption threw their K/V away; ``max_blocks_saved_by_sharing`` the most blocks that
        parallel samples shared at once (``max_bytes_saved_by_sharing`` the same in bytes).
        With prefix caching, ``prefix_cache_hit_tokens`` of the ``prefix_cache_queried_tokens`` that
        admissions looked up were found cached (``prefix_cache_hit_rate``, NaN if none was looked up),
        and ``prefix_cache_evictions`` cached blocks were given to new tokens (``prefix_cache_offloaded_blocks``
        of them kept in the host tier, from which ``prefix_cache_host_hit_tokens`` hits were copied back).
        ``swapped_out``/``swapped_in`` count swap-mode preemptions and returns; ``blocks_to_host``,
        ``blocks_to_device`` and ``transfer_seconds`` the block copies between the pools. With ``overlap``,
        ``overlapped_steps`` steps had the next one scheduled while they ran; ``overlap_rollbacks`` times a stop
        token undid that guess.
        """
        return engine_stats(self.recorder.counters, self.requests, self.runner)

    @property
    def events(self) -> list[StepEvent]:
        """One :class:`~kvcourse.serving.StepEvent` per step, in order."""
        return self.recorder.events

    def __repr__(self) -> str:
        return (
            f"Engine(num_blocks={self.block_manager.num_blocks}, block_size={self.block_manager.block_size}, "
            f"max_num_seqs={self.scheduler.max_num_seqs}, backend={self.runner.backend!r}, "
            f"unfinished={len(self._unfinished)})"
        )


class StepRecorder:
    """The engine's bookkeeping, in one place, so that its loop only runs steps: the counters behind
    ``Engine.stats``, each request's :class:`~kvcourse.sequence.RequestMetrics` (times in seconds since ``t0``, and step
    numbers), and one :class:`~kvcourse.serving.StepEvent` per step (``Engine.events``). What they add up to is
    reported by :mod:`kvcourse.serving.stats`.

    Args:
        scheduler: the engine's scheduler (its queues and pool are read after each step).
        request_of: ``seq_id -> Request`` of the unfinished sequences, kept by the engine.
        t0: the clock's reading when the engine started.
    """

    COUNTERS = ("steps", "preemptions", "prompt_tokens", "recomputed_tokens", "generated_tokens",
                "batched_tokens", "finished", "cancelled", "copy_on_write_copies", "max_blocks_saved_by_sharing",
                "prefix_cache_queried_tokens", "prefix_cache_hit_tokens", "swapped_out", "swapped_in",
                "overlapped_steps", "overlap_rollbacks")  # fmt: skip

    def __init__(self, scheduler: Scheduler, request_of: Mapping[Hashable, Request], t0: float) -> None:
        self.scheduler, self.request_of, self.t0 = scheduler, request_of, t0
        self.counters = dict.fromkeys(self.COUNTERS, 0)
        self.events: list[StepEvent] = []

    @property
    def num_steps(self) -> int:
        return self.counters["steps"]

    def new_metrics(self, num_prompt_tokens: int) -> RequestMetrics:
        """A request's metrics at its creation (its arrival time is stamped when it is queued)."""
        return RequestMetrics(math.nan, self.num_steps, num_prompt_tokens)

    def arrived(self, request: Request, now: float) -> None:
        request.metrics.arrival_time = now - self.t0

    def cancelled(self, request: Request, now: float) -> None:
        request.metrics.finish_time, request.metrics.finish_step = now - self.t0, self.num_steps
        self.counters["cancelled"] += 1

    def observe(self) -> dict:
        """The scheduler's queues and pool as a step leaves them (its tokens appended, before the next step is
        scheduled): what :meth:`record` logs. The overlapped engine reads them before it schedules ahead."""
        sched = self.scheduler
        bm = sched.block_manager  # blocks held by the running samples, less those they hold once
        held = sum(len(bm.block_table(seq.seq_id)) for seq in sched.running)
        return {"num_free_blocks": bm.num_free_blocks, "num_waiting": len(sched.waiting),
                "num_running": len(sched.running), "blocks_saved_by_sharing": held - bm.num_used_blocks}  # fmt: skip

    def record(
        self,
        out: SchedulerOutput,
        sampled: Mapping[Hashable, int],
        finished: list,
        start: float,
        end: float,
        observed: dict | None = None,
    ) -> None:
        """Count one step: what the scheduler did (``out``), the tokens ``sampled`` (``seq_id -> token``),
        the sequences that ``finished``; ``start`` and ``end`` on the engine's clock; ``observed``: the queues
        and pool after the step (:meth:`observe`; ``None``: as they are now)."""
        step = self.num_steps
        observed = dict(self.observe() if observed is None else observed)
        self._count(out, sampled, observed.pop("blocks_saved_by_sharing"))
        self._time_requests(out, sampled, finished, step, start, end)
        ids = lambda seqs: tuple(seq.seq_id for seq in seqs)  # noqa: E731  (request_id, sample index)
        self.events.append(StepEvent(
            step=step, start=start - self.t0, duration=end - start,
            scheduled=tuple((s.seq.seq_id[0], s.seq.seq_id[1], s.num_new_tokens, s.kind) for s in out.scheduled),
            admitted=ids(out.admitted), preempted=ids(out.preempted), finished=ids(finished),
            num_copies=len(out.copies), **observed,
        ))  # fmt: skip

    def _count(self, out: SchedulerOutput, sampled: Mapping[Hashable, int], saved: int) -> None:
        c = self.counters
        c["steps"] += 1
        c["preemptions"] += len(out.preempted)
        c["swapped_out"] += len(out.swapped_out)
        c["swapped_in"] += len(out.swapped_in)
        c["copy_on_write_copies"] += len(out.copies)
        c["prefix_cache_queried_tokens"] += out.num_prefix_cache_queried_tokens
        c["prefix_cache_hit_tokens"] += out.num_prefix_cache_hit_tokens
        c["generated_tokens"] += len(sampled)
        c["batched_tokens"] += out.num_batched_tokens
        c["recomputed_tokens"] += sum(s.num_recomputed_tokens for s in out.scheduled)
        c["max_blocks_saved_by_sharing"] = max(c["max_blocks_saved_by_sharing"], saved)

    def _time_requests(self, out, sampled, finished, step: int, start: float, end: float) -> None:
        for seq in out.admitted:
            m = self.request_of[seq.seq_id].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time, m.first_scheduled_step = start - self.t0, step
        for seq in out.preempted:
            self.request_of[seq.seq_id].metrics.num_preemptions += 1
        for seq_id in sampled:
            m = self.request_of[seq_id].metrics
            m.num_output_tokens += 1
            if m.first_token_time is None:
                m.first_token_time, m.first_token_step = end - self.t0, step
                self.counters["prompt_tokens"] += m.num_prompt_tokens
        for seq in finished:
            request = self.request_of[seq.seq_id]
            m = request.metrics
            m.max_sample_tokens = max(m.max_sample_tokens, len(seq.output_token_ids))
            if request.is_finished and m.finish_time is None:  # its last sample: once per request
                m.finish_time, m.finish_step = end - self.t0, step
                self.counters["finished"] += 1
