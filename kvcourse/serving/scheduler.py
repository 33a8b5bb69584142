"""The scheduler: at every step, which sequences run and how many tokens each one feeds.

**Continuous batching** (Orca's iteration-level scheduling): the batch is rebuilt at every step, so a
request that finishes leaves at once and a waiting one takes its place at the next step, instead of
the whole batch waiting for its longest member. One step, in vLLM v1's shape:

1. **Running sequences first, oldest first.** Each gets ``min(tokens it has not computed, budget
   left)`` new tokens: 1 for a decode, a chunk for a prompt admitted earlier and not yet finished.
   Its slots are reserved now, in the :class:`~kvcourse.paged.BlockManager`, before the forward.
   If the pool is out of blocks, a running sequence is **preempted**: its blocks go back to the
   pool, its K/V are forgotten, and it returns to the head of the queue to be recomputed later
   (recompute mode). The **preemption policy** picks it among the sequence that needs the block
   and the running sequences after it (those before it already hold this step's slots); vLLM's
   choice, the default, is the **newest** (:func:`preempt_newest`), so the sequence that needs
   the block preempts itself only when it is the newest. In **swap mode** (chapter 7) its K/V are
   copied to host memory first and it waits in the swapped queue instead (recompute when the host
   pool is full).
2. **Then swapped sequences**, oldest first, in a step that preempted nobody: swapped back into
   fresh blocks, they carry on where they stopped.
3. **Then waiting sequences, first come first served** (no overtaking), once nobody is swapped out, while the token budget
   (``max_num_batched_tokens``), the sequence cap (``max_num_seqs``) and the free blocks last.
   With **chunked prefill**, a prompt longer than the budget left is admitted with a chunk of it;
   without, it waits for a step with room for the whole prompt. Admission leaves a **watermark**
   of free blocks for the running sequences to grow into, and takes nobody in a step that had to
   preempt (the pool is too tight).

**Prefix caching** (chapter 7, on a :class:`~kvcourse.paged.PrefixCachingBlockManager`): at
admission a sequence looks up its full blocks in the cache and starts with the hits as computed
tokens, so only the rest is fed. Its last token is always fed, because its logits give the next
token; so the lookup stops one token short, and a fully cached prompt recomputes its last block.
After every forward, the blocks that filled up go into the cache (:meth:`Scheduler.advance`).

The scheduler only does bookkeeping: the runner turns :class:`SchedulerOutput` into one forward
pass (chapter 6's :class:`~kvcourse.serving.Engine`), or a trace drives it with no model at all
(chapter 4's simulator, :func:`kvcourse.fragmentation.simulate`): one policy for both.

**Memory.** The scheduler talks to its pool through the calls of the
:class:`~kvcourse.paged.KVPool` protocol: one call admits a sequence or says it does not fit
(``admit``, which also answers how many of its tokens are cached), ``append_slots`` grows a running
one, ``free`` takes its blocks back; a :class:`~kvcourse.paged.PagedKVPool` (a
:class:`~kvcourse.paged.BlockManager`) adds ``fork`` and, with a host pool, ``swap_out`` and
``swap_in``. Its block moves (swaps, prefix blocks moved to the host tier and back) are handed to
the runner in :attr:`SchedulerOutput.transfers`. After a step, a sequence holds slots for every
token it has computed; the token it just sampled gets its slot when it is fed (chapter 4's
simulator, which counts a token's slot from the step that makes it, reserves one more in its pools).
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field

from ..checks import check_bool, check_callable, check_choice, check_float, check_int
from ..paged import BlockTransfer, CopyOnWrite, KVPool, NoFreeBlocksError, PagedKVPool
from ..sequence import Sequence, SequenceStatus

__all__ = ["PreemptionPolicy", "ScheduledSeq", "Scheduler", "SchedulerOutput", "preempt_newest"]

_NO_LIMIT = sys.maxsize

PreemptionPolicy = Callable[[list[Sequence]], Sequence]
"""``policy(candidates) -> victim``: ``candidates`` are running sequences, oldest first; ``candidates[0]``
needs a block the pool does not have, the others run after it in this step. It returns one of them."""


def preempt_newest(candidates: list[Sequence]) -> Sequence:
    """vLLM's victim: the newest running sequence. The requests keep their first-come-first-served
    order: the oldest one is never preempted while a newer one runs, so it always finishes."""
    return candidates[-1]


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's part of a step: ``num_new_tokens`` tokens from position ``num_computed_tokens``.

    ``samples``: the step reaches the end of the sequence's tokens, so its last logits give its next
    token (a prefill chunk that stops mid-prompt samples nothing). ``kind``: ``"prefill"`` (a whole
    prompt, or all of it after its prefix-cache hits), ``"chunk"`` (part of one), ``"decode"`` (the
    token sampled last step) or ``"recompute"``
    (tokens whose K/V a preemption threw away; ``num_recomputed_tokens`` of them).
    """

    seq: Sequence
    num_computed_tokens: int
    num_new_tokens: int
    samples: bool
    kind: str
    num_recomputed_tokens: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits this admission started with (not fed)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step feeds (read before the step's sampled tokens are appended)."""
        return self.seq.token_ids[self.num_computed_tokens : self.num_computed_tokens + self.num_new_tokens]


@dataclass
class SchedulerOutput:
    """What one step runs, and what the scheduler did to get there."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)  # in batch order: running, then admitted
    admitted: list[Sequence] = field(default_factory=list)  # left the queue this step
    preempted: list[Sequence] = field(default_factory=list)  # lost their blocks this step, in the order preempted
    swapped_out: list[Sequence] = field(default_factory=list)  # of those, the ones swapped to host memory
    swapped_in: list[Sequence] = field(default_factory=list)  # came back from host memory this step
    transfers: list[BlockTransfer] = field(default_factory=list)  # block moves, in order, before the copies
    copies: list[CopyOnWrite] = field(default_factory=list)  # copy-on-write block copies, before the forward
    num_prefix_cache_queried_tokens: int = 0  # tokens of the admitted sequences (prefix caching on)

    @property
    def num_prefix_cache_hit_tokens(self) -> int:
        """Tokens the admitted sequences found in the prefix cache: K/V reused, not computed."""
        return sum(s.num_cached_tokens for s in self.scheduled)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


def _limit(name: str, value: int | None, minimum: int) -> int:
    value = check_int(name, value, min=minimum, none_ok=True)
    return _NO_LIMIT if value is None else value


class Scheduler:
    """Continuous batching with a token budget, chunked prefill and preemption by recompute or swap.

    Args:
        block_manager: the pool: a :class:`~kvcourse.paged.KVPool`, such as a :class:`~kvcourse.paged.BlockManager`.
        max_num_seqs: most sequences running at once (``None``: no cap). A request with ``n``
            samples counts ``n`` from admission.
        max_num_batched_tokens: most new tokens in one step, all sequences together (``None``: no cap).
        enable_chunked_prefill: split a prompt across steps to fit the budget.
        watermark: fraction of the pool's blocks that admission leaves free (vLLM's default 0.01).
        preemption_mode: ``"recompute"`` (free the blocks, compute them again later) or ``"swap"``
            (copy them to the block manager's host pool and back; needs ``num_host_blocks > 0``).
        preemption_policy: which running sequence to preempt when the pool is out of blocks, a
            :data:`PreemptionPolicy` (``None``: :func:`preempt_newest`, vLLM's choice).
    """

    def __init__(
        self,
        block_manager: KVPool,
        *,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_chunked_prefill: bool = True,
        watermark: float = 0.01,
        preemption_mode: str = "recompute",
        preemption_policy: PreemptionPolicy | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = _limit("max_num_seqs", max_num_seqs, 1)
        self.max_num_batched_tokens = _limit("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.enable_chunked_prefill = check_bool("enable_chunked_prefill", enable_chunked_prefill)
        self.watermark_blocks = int(
            check_float("watermark", watermark, min=0, max=1, max_open=True) * block_manager.num_blocks
        )
        check_choice("preemption_mode", preemption_mode, ("recompute", "swap"))
        if preemption_mode == "swap" and not block_manager.num_host_blocks:
            raise ValueError("preemption_mode='swap' needs a block manager with num_host_blocks > 0")
        self.preemption_mode = preemption_mode
        self.preemption_policy = (
            preempt_newest
            if preemption_policy is None
            else check_callable(
                "preemption_policy", preemption_policy, "a function candidates -> victim, such as preempt_newest"
            )
        )
        self.waiting: deque[Sequence] = deque()  # head first; preempted sequences go back to the head
        self.swapped: deque[Sequence] = deque()  # K/V in host memory, oldest first
        self.running: list[Sequence] = []  # in admission order: the last one is the newest
        self._seqs: dict[Hashable, Sequence] = {}
        self._lost: dict[Hashable, int] = {}  # seq_id -> most tokens it had computed when preempted
        self.enable_prefix_caching = block_manager.enable_prefix_caching
        self._cache_salts: dict[Hashable, str | None] = {}

    # ---- requests come and go -------------------------------------------------------------------
    def max_slots(self, seq: Sequence) -> int:
        """The most slots ``seq`` can ever hold: prompt + outputs, less the last output (never fed)."""
        return seq.num_prompt_tokens + seq.params.max_new_tokens - 1

    def add(self, seq: Sequence, *, cache_salt: str | None = None) -> None:
        """Queue a new sequence: :meth:`check`, then :meth:`enqueue`. ``cache_salt``: it shares cached
        blocks only with sequences of the same salt (a tenant); nothing is shared without prefix caching anyway."""
        self.check(seq, cache_salt=cache_salt)
        self.enqueue(seq, cache_salt=cache_salt)

    def enqueue(self, seq: Sequence, *, cache_salt: str | None = None) -> None:
        """Queue a sequence that passed :meth:`check` (the engine checks a whole batch of requests
        before it queues any of them, so each is checked once)."""
        self._seqs[seq.seq_id] = seq
        self._cache_salts[seq.seq_id] = cache_salt
        self.waiting.append(seq)

    def check(self, seq: Sequence, *, cache_salt: str | None = None, name: str | None = None) -> None:
        """Raise ``ValueError`` if ``seq`` could never run, rather than let it wait forever or preempt
        itself forever: it alone must fit the pool, its samples the sequence cap and, without chunked
        prefill, its longest prefill the token budget. Changes nothing. ``name``: what the errors
        call it (``"sequence <seq_id>"``; the engine says ``"request <request_id>"``)."""
        if not isinstance(seq, Sequence):
            raise TypeError(f"seq must be a kvcourse.Sequence, got {type(seq).__name__}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty str or None, got {cache_salt!r}")
        if seq.seq_id in self._seqs:
            raise ValueError(f"seq_id={seq.seq_id!r} is already scheduled")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens:
            raise ValueError(f"seq must be new (WAITING, nothing computed), got {seq!r}")
        bm = self.block_manager
        need = bm.blocks_needed(self.max_slots(seq))
        if need > bm.num_blocks:
            raise ValueError(
                f"{name or f'sequence {seq.seq_id!r}'} alone needs {need} blocks of {bm.block_size} "
                f"({seq.num_prompt_tokens} prompt + max_new_tokens={seq.params.max_new_tokens} - 1 tokens) but "
                f"num_blocks={bm.num_blocks}: it could never run"
            )
        if seq.params.n > self.max_num_seqs:
            raise ValueError(f"n={seq.params.n} samples exceed max_num_seqs={self.max_num_seqs}")
        longest_prefill = self.max_slots(seq)
        if not self.enable_chunked_prefill and longest_prefill > self.max_num_batched_tokens:
            raise ValueError(
                f"without chunked prefill a sequence of up to {longest_prefill} tokens "
                f"(prompt + max_new_tokens - 1, recomputed after a preemption) must fit max_num_batched_tokens="
                f"{self.max_num_batched_tokens}"
            )

    def abort(self, seq_id: Hashable) -> Sequence:
        """Cancel a waiting or running sequence: it leaves its queue and its blocks go back."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"seq_id={seq_id!r} is not waiting or running (unknown, finished or aborted)")
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
            self.block_manager.free_swapped(seq.seq_id)
        else:
            self.waiting.remove(seq)
        if seq.seq_id in self.block_manager:
            self.block_manager.free(seq.seq_id)
        self._lost.pop(seq_id, None)
        self._cache_salts.pop(seq_id, None)
        seq.status = SequenceStatus.CANCELLED
        return seq

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start ``child`` (``parent.fork(...)``) running on ``parent``'s blocks (copy-on-write later)."""
        if not isinstance(self.block_manager, PagedKVPool):
            raise TypeError(f"fork needs a pool that shares blocks (a PagedKVPool), got {self.block_manager!r}")
        if self._seqs.get(parent.seq_id) is not parent or parent.status is not SequenceStatus.RUNNING:
            raise ValueError(f"parent {parent.seq_id!r} is not running")
        if child.seq_id in self._seqs:
            raise ValueError(f"child seq_id={child.seq_id!r} is already scheduled")
        self.block_manager.fork(parent.seq_id, child.seq_id)
        self._cache_salts[child.seq_id] = self._cache_salts[parent.seq_id]
        child.status = SequenceStatus.RUNNING
        self._seqs[child.seq_id] = child
        self.running.append(child)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    # ---- a step as a transaction ----------------------------------------------------------------
    def snapshot(self) -> dict:
        """The queues, every sequence's progress and the pool's state (its ``snapshot()``), copied.

        :meth:`rollback` puts them back: a step whose scheduling or forward fails leaves nothing reserved
        and no sequence moved. (A pool without ``snapshot``, such as chapter 4's simulators', gives None.)
        """
        snap = getattr(self.block_manager, "snapshot", None)
        if snap is None:
            return None
        seqs = {id(s): s for s in (*self.waiting, *self.swapped, *self.running, *self._seqs.values())}
        return {"waiting": self.waiting.copy(), "swapped": self.swapped.copy(), "running": list(self.running),
                "_seqs": dict(self._seqs), "_lost": dict(self._lost), "_cache_salts": dict(self._cache_salts),
                "progress": [(s, s.status, s.num_computed_tokens, s.num_tokens) for s in seqs.values()],
                "pool": snap()}  # fmt: skip

    def rollback(self, state: dict | None, failed: SchedulerOutput | None = None) -> None:
        """Undo everything since :meth:`snapshot` returned ``state``.

        ``failed``: the step's output, when its forward failed after scheduling. Its victims are then
        preempted for real (recompute): the forward may already have written into the blocks they gave up,
        which the step had handed to others, so their K/V cannot be trusted.
        """
        if state is None:
            return
        self.block_manager.restore(state["pool"])
        for s, status, computed, num_tokens in state["progress"]:
            s.status, s.num_computed_tokens = status, computed
            del s.token_ids[num_tokens:]
        for name in ("waiting", "swapped", "running", "_seqs", "_lost", "_cache_salts"):
            setattr(self, name, state[name])
        for victim in [] if failed is None else reversed(failed.preempted):
            if victim in self.running:  # swapped-out victims are back on the host, untouched
                self.running.remove(victim)
                self._recompute(victim)

    # ---- one step -------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Choose the next step; reserve its slots (preempting if needed). See the module doc."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted:  # a step that had to preempt takes nobody in: the pool is too tight
            budget = self._schedule_swapped(out, budget)
            if not self.swapped:  # the swapped-out sequences came first
                self._schedule_waiting(out, budget)
        if self.block_manager.num_host_blocks:  # only a host pool moves blocks
            out.transfers = self.block_manager.take_transfers()
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """1. Running sequences, oldest first; victims are preempted while the pool is short."""
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if self._reserve(seq, n, out):
                budget -= n
                i += 1
            # else seq preempted itself and left the list: running[i] is the next one, if any
        return budget

    def _schedule_swapped(self, out: SchedulerOutput, budget: int) -> int:
        """2. Swapped sequences, oldest first, back into fresh blocks."""
        bm = self.block_manager
        while self.swapped and budget > 0 and self._seats_used() + 1 <= self.max_num_seqs:
            seq = self.swapped[0]
            n = min(seq.num_uncomputed_tokens, budget)
            if bm.blocks_to_swap_in(seq.seq_id, n) > bm.num_free_blocks - self._keep_free():
                break
            bm.swap_in(seq.seq_id)
            self._start(self.swapped.popleft(), out.swapped_in)
            self._reserve(seq, n, out)  # cannot preempt: the blocks were counted above
            budget -= n
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """3. Waiting sequences, first come first served (no overtaking), while the pool says they fit."""
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if self._seats_used() + self._seats(seq) > self.max_num_seqs:
                break
            salt = self._cache_salts.get(seq.seq_id)  # None for a sequence queued by hand (chapter 6's exercise)
            admission = self.block_manager.admit(
                seq, budget, chunked=self.enable_chunked_prefill, keep_free=self._keep_free(), cache_salt=salt
            )
            if admission is None:
                break
            num_cached, n = admission
            seq.num_computed_tokens = num_cached
            self._start(self.waiting.popleft(), out.admitted)
            out.scheduled.append(self._scheduled(seq, n, num_cached))
            out.num_prefix_cache_queried_tokens += seq.num_tokens if self.enable_prefix_caching else 0
            budget -= n

    def advance(self, out: SchedulerOutput) -> None:
        """After the forward: the scheduled tokens now have K/V in the cache (and their full blocks
        in the prefix cache)."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed_tokens += s.num_new_tokens
            if self.enable_prefix_caching:
                salt = self._cache_salts[seq.seq_id]
                self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens, salt)

    def append_tokens(self, sampled: Mapping[Hashable, int]) -> list[Sequence]:
        """Append each sequence's sampled token; free and return the sequences that finished."""
        finished = []
        for seq_id, token in sampled.items():
            seq = self._seqs[seq_id]
            seq.append_token(token)
            if seq.is_finished:
                self.block_manager.free(seq_id)
                self.running.remove(seq)
                del self._seqs[seq_id]
                self._lost.pop(seq_id, None)
                self._cache_salts.pop(seq_id, None)
                finished.append(seq)
        return finished

    def advance_without_model(self, out: SchedulerOutput) -> list[Sequence]:
        """Finish step ``out`` without a model, as the simulations and the exercise checks do: its K/V count as
        computed (:meth:`advance`) and each sequence that samples gets a placeholder token, 0. The decisions do not
        depend on the tokens. Returns the sequences that finished."""
        self.advance(out)
        return self.append_tokens({s.seq.seq_id: 0 for s in out.scheduled if s.samples})

    # ---- internals ------------------------------------------------------------------------------
    def _reserve(self, seq: Sequence, n: int, out: SchedulerOutput) -> bool:
        """Reserve the slots of ``seq``'s next ``n`` tokens, preempting the policy's victims while the
        pool is short. False if ``seq`` itself had to go."""
        while True:
            try:
                cow = self.block_manager.append_slots(seq.seq_id, n)
                break
            except NoFreeBlocksError:  # nothing changed: free a victim's blocks and retry
                victim = self._pick_victim(seq)
                self.running.remove(victim)
                if self._preempt(victim):
                    out.swapped_out.append(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return False
        if cow is not None:
            out.copies.append(cow)
        out.scheduled.append(self._scheduled(seq, n))
        return True

    def _pick_victim(self, seq: Sequence) -> Sequence:
        """The policy's victim among ``seq`` and the running sequences after it (the ones before it
        already hold their slots for this step). Checked before anything changes."""
        candidates = self.running[self.running.index(seq) :]
        victim = self.preemption_policy(list(candidates))  # a copy: the policy cannot reorder the queue
        if not any(victim is c for c in candidates):
            raise ValueError(
                f"preemption_policy returned {victim!r}, which is not one of its candidates (the running sequences "
                f"{[c.seq_id for c in candidates]}: the one that needs a block, then those after it)"
            )
        return victim

    def _preempt(self, seq: Sequence) -> bool:
        """Swap mode, if the host pool has room: the K/V go to host memory, the sequence to the head
        of the swapped queue (True). Otherwise recompute: free the blocks, forget the K/V, back to
        the head of the waiting queue (False)."""
        if self.preemption_mode == "swap" and self.block_manager.can_swap_out(seq.seq_id):
            self.block_manager.swap_out(seq.seq_id)
            seq.status = SequenceStatus.SWAPPED
            self.swapped.appendleft(seq)
            return True
        self._recompute(seq)
        return False

    def _recompute(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks, forget the K/V, back to the head of the waiting queue."""
        self._lost[seq.seq_id] = max(self._lost.get(seq.seq_id, 0), seq.num_computed_tokens)
        self.block_manager.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        self.waiting.appendleft(seq)

    def _start(self, seq: Sequence, into: list[Sequence]) -> None:
        """``seq`` runs from this step on (admitted or swapped in; ``into`` says which)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        into.append(seq)

    def _keep_free(self) -> int:
        # The watermark leaves room for the running sequences to grow; alone, a sequence may use every block.
        return self.watermark_blocks if self.running else 0

    def _scheduled(self, seq: Sequence, n: int, num_cached: int = 0) -> ScheduledSeq:
        start, total = seq.num_computed_tokens, seq.num_tokens
        # Recomputed: fed again after a preemption threw their K/V away (cache hits are not fed at all).
        again = max(0, min(start + n, self._lost.get(seq.seq_id, 0)) - start)
        if again:
            kind = "recompute"
        elif start == total - 1 and total > seq.num_prompt_tokens:
            kind = "decode"
        else:
            kind = "prefill" if start == num_cached and start + n == total else "chunk"
        return ScheduledSeq(seq, start, n, start + n == total, kind, again, num_cached)

    @staticmethod
    def _seats(seq: Sequence) -> int:
        # A request with n samples runs as one sequence until its first token, then as n: keep n seats.
        return seq.params.n if seq.num_tokens == seq.num_prompt_tokens else 1

    def _seats_used(self) -> int:
        if self.max_num_seqs == _NO_LIMIT:
            return 0
        return sum(self._seats(s) for s in self.running)

    def __repr__(self) -> str:
        return (
            f"Scheduler(waiting={len(self.waiting)}, running={len(self.running)}, swapped={len(self.swapped)}, "
            f"{self.block_manager!r})"
        )
