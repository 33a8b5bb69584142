"""Swap or recompute (chapter 7): what it costs to bring a preempted sequence's K/V back.

The vLLM paper (Kwon et al., *Efficient Memory Management for Large Language Model Serving with
PagedAttention*, section 7.3) times both ways against the block size: swapping moves every block
to host memory and back, so its cost is bytes over bandwidth plus a fixed cost per copy; recompute
runs one prefill over the tokens and does not care how they are blocked. This module measures the
same three numbers on our engine's pools: the time to swap a sequence out, to swap it in, and to
recompute it, for each block size -- and swapping one block per copy as well as all of a layer's
blocks in one batched copy, to show where small blocks lose.

Used by ``benchmarks/bench_offload.py`` and chapter 7; measures, asserts no speed.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from ..checks import check_int
from ..paged import BlockTransfer, apply_transfers
from ..serving import ModelRunner

__all__ = ["time_swap_vs_recompute"]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _one_by_one(runner: ModelRunner, transfers: Sequence[BlockTransfer]) -> None:
    for t in transfers:  # one copy per block and layer: vLLM v0 issued one cudaMemcpyAsync per block
        apply_transfers(runner.kv_store, runner.host_kv_store, [t])


def time_swap_vs_recompute(
    model, num_tokens: int, block_sizes: Sequence[int], repeats: int = 3, seed: int = 0
) -> list[dict]:
    """For each block size, median seconds (of ``repeats``) to swap a ``num_tokens``-token sequence
    out and in (``batched`` and ``per_block`` copies) and to ``recompute`` it (one prefill forward).

    Each row also checks the round trip: the K/V after swapping out and in equal the K/V before.
    """
    check_int("num_tokens", num_tokens, min=1)
    check_int("repeats", repeats, min=1)
    if not block_sizes:
        raise ValueError(f"block_sizes must be a non-empty list of ints >= 1, got {block_sizes!r}")
    for i, b in enumerate(block_sizes):
        check_int(f"block_sizes[{i}]", b, min=1)
    g = torch.Generator(device="cpu").manual_seed(seed)  # token ids, drawn on the host: the same on every machine
    tokens = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=g, device="cpu").tolist()
    rows = []
    for bs in block_sizes:
        blocks = -(-num_tokens // bs)
        runner = ModelRunner(model, num_blocks=2 * blocks, block_size=bs, num_cpu_blocks=blocks)
        bm = runner.block_manager
        recompute, times = [], {k: [] for k in ("out", "in", "out_per_block", "in_per_block")}
        with torch.inference_mode():
            for r in range(repeats):
                recompute.append(_timed(lambda: runner.step([(("recompute", r), tokens)])))
                bm.free(("recompute", r))
            runner.step([("seq", tokens)])
            before = [t[bm.block_table("seq")].clone() for t in runner.kv_store.k_cache]
            for _ in range(repeats):  # both kinds of copy in every repeat: a load change hits both
                for suffix, move in (("", runner.move_blocks), ("_per_block", lambda ts: _one_by_one(runner, ts))):
                    for direction, op in (("out", bm.swap_out), ("in", bm.swap_in)):
                        op("seq")
                        moves = bm.take_transfers()
                        times[direction + suffix].append(_timed(lambda: move(moves)))  # noqa: B023
            after = [t[bm.block_table("seq")] for t in runner.kv_store.k_cache]
        if not all(torch.equal(a, b) for a, b in zip(before, after)):
            raise RuntimeError(f"block_size={bs}: K/V changed on the way to the host and back")
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({
            "block_size": bs, "num_blocks": blocks, "bytes": blocks * runner.kv_store.block_nbytes,
            "recompute_s": statistics.median(recompute),
            "swap_out_s": med["out"], "swap_in_s": med["in"],
            "swap_out_per_block_s": med["out_per_block"], "swap_in_per_block_s": med["in_per_block"],
        })  # fmt: skip
    return rows
