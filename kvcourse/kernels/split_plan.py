"""A decode step's split-KV work, planned on the host from the step's real lengths, for a kernel to read from a buffer.

:func:`~.triton_paged.choose_num_splits` gives every sequence of a step the same number of splits, and the paged
kernel's grid is ``(batch, Hkv, num_splits)``. Inside a CUDA graph that grid is frozen when the graph is recorded,
and the recording sees the graph's lengths (the model's whole context), not the step's: a replayed step splits ~600
real tokens as if they were 8,192. FlashInfer solves this by *planning*: before each step the host computes the
work list from the real lengths into a device buffer of fixed size, and the kernel reads its work from it. The grid
is the buffer's capacity, fixed at recording; programs past the plan exit at once.

**The plan.** The context of every sequence is cut into chunks of one size, ``chunk``, the smallest multiple of
``align`` (at least ``min_chunk``) for which the chunks of the whole step number no more than the GPU wants
(``2 * num_sms / Hkv`` programs per KV head, what :func:`~.triton_paged.choose_num_splits` first aimed for) and fit the
buffer. A long sequence gets many chunks, a short one a single one, so the work is balanced across sequences of
different lengths, which one split count for all could not do. Each chunk is one *work item*, one row of ``work``:

    work[i] = (b, start, end, chunks_of_b)        i < num_items; rows past them: b = -1 (nothing to do)
    seqs[b] = (first_item_of_b, chunks_of_b)      lanes without tokens: chunks 0

A sequence in one chunk is written straight to the output by its one program; the chunks of a split sequence
write partial outputs and their log-sum-exps, which a second kernel merges (``seqs`` tells it where they are).
Pure host code, no Triton: a serving loop plans on the host, then copies the rows into the device buffer
(:class:`SplitPlan`), which is what a recorded graph reads.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..checks import check_int

__all__ = ["MIN_CHUNK_TOKENS", "SplitPlan", "plan_capacity", "plan_rows", "plan_splits"]

MIN_CHUNK_TOKENS = 256  # as triton_paged.MIN_SPLIT_TOKENS: a chunk shorter than this costs more to merge than it saves
CHUNK_ALIGN = 16  # chunk lengths are multiples of this: whole 16-token blocks, whole tiles of 16, 32 or 64 positions
NO_WORK = -1  # work[i, 0] of a row past the plan


def _wanted_items(num_kv_heads: int, num_sms: int | None) -> int:
    """Work items per KV head that fill the GPU: two programs per streaming multiprocessor (0: no GPU, no split)."""
    return 0 if num_sms is None else math.ceil(2 * num_sms / num_kv_heads)


def plan_capacity(lanes: int, num_kv_heads: int, num_sms: int | None) -> int:
    """Work rows a plan for up to ``lanes`` sequences needs: at least one per sequence, and the most
    :func:`plan_splits` ever asks (``2 * num_sms / num_kv_heads``). A graph's buffer is sized by this."""
    check_int("lanes", lanes, min=1)
    check_int("num_kv_heads", num_kv_heads, min=1)
    if num_sms is not None:
        check_int("num_sms", num_sms, min=1)
    return max(lanes, _wanted_items(num_kv_heads, num_sms))


def _check_lens(seq_lens_host: Sequence[int]) -> list[int]:
    if (
        isinstance(seq_lens_host, torch.Tensor)
        or isinstance(seq_lens_host, (str, bytes))
        or not isinstance(seq_lens_host, Sequence)
    ):  # a device tensor would need a read-back: the plan is made from host copies only
        raise TypeError(
            f"seq_lens_host must be a list or tuple of ints (host copies), got {type(seq_lens_host).__name__}"
        )
    lens = list(seq_lens_host)
    bad = [n for n in lens if isinstance(n, bool) or not isinstance(n, int) or n < 0]
    if not lens or bad:
        raise ValueError(f"seq_lens_host must be a non-empty list of ints >= 0, got {lens!r}")
    return lens


def _chunks(lens: list[int], chunk: int) -> int:
    return sum(-(-n // chunk) for n in lens)


def plan_splits(
    seq_lens_host: Sequence[int],
    num_kv_heads: int,
    num_sms: int | None,
    capacity: int,
    min_chunk: int = MIN_CHUNK_TOKENS,
    align: int = CHUNK_ALIGN,
) -> int:
    """The chunk length that splits a step with these real lengths: see the module doc.

    Args:
        seq_lens_host: each lane's cached tokens (this step's included); 0 for a padding lane.
        num_kv_heads: the model's KV heads (each work item runs one program per KV head).
        num_sms: the GPU's streaming multiprocessors; ``None`` (the interpreter) splits nothing.
        capacity: the buffer's work rows; the plan never needs more.
        min_chunk: no sequence is cut into chunks shorter than this (the last chunk of a sequence may be).
        align: chunk lengths are multiples of this.

    Returns the chunk length (the longest sequence's length, rounded up to ``align``, when nothing is split).
    """
    lens = _check_lens(seq_lens_host)
    check_int("num_kv_heads", num_kv_heads, min=1)
    check_int("capacity", capacity, min=1)
    check_int("min_chunk", min_chunk, min=1)
    check_int("align", align, min=1)
    if num_sms is not None:
        check_int("num_sms", num_sms, min=1)
    nonempty = sum(n > 0 for n in lens)
    if nonempty > capacity:
        raise ValueError(
            f"capacity={capacity} work rows cannot hold {nonempty} sequences with tokens: "
            "size the buffer with plan_capacity()"
        )
    longest = -(-max(lens) // align) * align if max(lens) else align
    limit = min(capacity, max(_wanted_items(num_kv_heads, num_sms), nonempty))
    lo = min(-(-min_chunk // align) * align, longest)
    if _chunks(lens, lo) <= limit:
        return lo
    hi = longest  # one chunk a sequence: nonempty <= limit items
    while hi - lo > align:  # the smallest multiple of align in (lo, hi] whose chunks fit the limit
        mid = (lo + hi) // (2 * align) * align
        if _chunks(lens, mid) <= limit:
            hi = mid
        else:
            lo = mid
    return hi


def plan_rows(seq_lens_host: Sequence[int], chunk: int, capacity: int, lanes: int | None = None) -> torch.Tensor:
    """The plan as host rows, int32 ``[capacity + lanes, 4]``: ``work`` (``capacity`` rows), then ``seqs``
    (``lanes`` rows, default one per length given), as the module doc lays them out."""
    lens = _check_lens(seq_lens_host)
    check_int("chunk", chunk, min=1)
    check_int("capacity", capacity, min=1)
    lanes = len(lens) if lanes is None else lanes
    check_int("lanes", lanes, min=len(lens))
    rows = torch.zeros(capacity + lanes, 4, dtype=torch.int32, device="cpu")  # host-side: copied to the device
    work, seqs = rows[:capacity], rows[capacity:]
    work[:, 0] = NO_WORK
    items = [
        (b, start, min(start + chunk, n), -(-n // chunk)) for b, n in enumerate(lens) for start in range(0, n, chunk)
    ]
    if len(items) > capacity:
        raise ValueError(f"chunks of {chunk} tokens make {len(items)} work items, more than capacity={capacity}")
    if items:
        work[: len(items)] = torch.tensor(items, dtype=torch.int32, device="cpu")
    first = 0
    for b, n in enumerate(lens):
        count = -(-n // chunk)
        seqs[b, 0], seqs[b, 1] = first, count
        first += count
    return rows


class SplitPlan:
    """A plan's device buffer, made once and refilled every step (what a recorded graph reads).

    ``SplitPlan(capacity, lanes, device)``; :meth:`fill` plans a step from its host lengths and copies the rows in;
    :attr:`work` and :attr:`seqs` are the two views the kernels take. A fresh buffer holds no work (:meth:`clear`).
    :attr:`chunk` is the last plan's chunk length (0: no plan).
    """

    def __init__(self, capacity: int, lanes: int, device: torch.device | str) -> None:
        check_int("capacity", capacity, min=1)
        check_int("lanes", lanes, min=1)
        self.capacity, self.lanes = capacity, lanes
        self.buffer = torch.empty(capacity + lanes, 4, dtype=torch.int32, device=device)
        self.clear()

    @property
    def work(self) -> torch.Tensor:
        return self.buffer[: self.capacity]

    @property
    def seqs(self) -> torch.Tensor:
        return self.buffer[self.capacity :]

    def clear(self) -> None:
        """No work at all (every program exits, no lane is merged): what a graph should be recorded on, as the
        static buffers' padding is (length 0, slot -1)."""
        self.buffer.zero_()
        self.buffer[: self.capacity, 0] = NO_WORK
        self.chunk = 0

    def fill(
        self, seq_lens_host: Sequence[int], num_kv_heads: int, num_sms: int | None, min_chunk: int = MIN_CHUNK_TOKENS
    ) -> int:
        """Plan the step (:func:`plan_splits`), write its rows into the buffer in place; return the chunk length.

        The copy is in place, so a graph recorded on this buffer reads the new plan; from pinned memory it does
        not wait for the device."""
        if len(seq_lens_host) > self.lanes:
            raise ValueError(f"seq_lens_host has {len(seq_lens_host)} lanes, this plan holds {self.lanes}")
        self.chunk = plan_splits(seq_lens_host, num_kv_heads, num_sms, self.capacity, min_chunk)
        rows = plan_rows(seq_lens_host, self.chunk, self.capacity, self.lanes)
        pinned = self.buffer.device.type == "cuda"
        self.buffer.copy_(rows.pin_memory() if pinned else rows, non_blocking=pinned)
        return self.chunk
