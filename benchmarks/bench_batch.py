"""Batched decode on the paged pool: step time and throughput at batch 1, 4, 16, 64 on this CPU.

    python benchmarks/bench_batch.py [--batch-sizes 1 4 16 64] [--prompt-len 64] [--steps 16] [--repeats 3]
                                     [--json out.json]

Every sequence gets its own 64-token prompt (slices of one text), all prefilled, then ``steps``
decode steps run with every sequence in one ``ForwardBatch`` through ``ModelRunner`` (the
``paged-torch`` backend). Reported per batch size: the median decode step time over all steps of
all repeats, and throughput = batch / step time.

Also measured: the contiguous ``KVCache`` decode step at batch 1 on the same prompt, so the paged
backend's overhead at batch 1 is one ratio. The targets in the course's issue: throughput at batch
16 >= 4x batch 1, and paged-torch at batch 1 within 1.2x of the contiguous cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kvcourse
from kvcourse.serving import ModelRunner
from machine import machine_info

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from winemaking. Within fifty years presses "
    "were running in more than two hundred cities across Europe, and the price of books fell so far that "
    "ordinary merchants could own them. "
)


def prompts(tok, batch: int, prompt_len: int) -> list[list[int]]:
    ids = tok.encode(TEXT * 8)
    return [ids[i : i + prompt_len] for i in range(batch)]  # distinct prompts of equal length


@torch.inference_mode()
def paged_decode_step_times(model, tok, batch: int, prompt_len: int, steps: int) -> list[float]:
    per_seq = -(-(prompt_len + steps + 1) // 16)
    runner = ModelRunner(model, num_blocks=batch * per_seq, block_size=16)
    logits = runner.step([(i, p) for i, p in enumerate(prompts(tok, batch, prompt_len))])  # prefill all
    times = []
    for _ in range(steps):
        work = [(i, [int(t)]) for i, t in enumerate(logits.argmax(-1).tolist())]
        start = time.perf_counter()
        logits = runner.step(work)
        times.append(time.perf_counter() - start)
    return times


@torch.inference_mode()
def contiguous_decode_step_times(model, tok, prompt_len: int, steps: int) -> list[float]:
    cache = kvcourse.KVCache.for_model(model.config)
    logits = model(torch.tensor(prompts(tok, 1, prompt_len)), cache=cache)
    times = []
    for _ in range(steps):
        x = torch.tensor([[int(logits[0, -1].argmax())]])
        start = time.perf_counter()
        logits = model(x, cache=cache)
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    model, tok = kvcourse.load_pretrained()
    paged_decode_step_times(model, tok, 2, args.prompt_len, 2)  # warm-up

    result = {
        "benchmark": "batched decode, paged-torch backend, real model",
        **machine_info(),
        "prompt_len": args.prompt_len,
        "steps": args.steps,
        "repeats": args.repeats,
        "batches": [],
    }
    contiguous = [
        t for _ in range(args.repeats) for t in contiguous_decode_step_times(model, tok, args.prompt_len, args.steps)
    ]
    result["contiguous_batch1_step_ms"] = 1e3 * statistics.median(contiguous)
    print(f"{'batch':>5} {'step ms':>9} {'tokens/s':>9} {'x batch 1':>9}")
    for b in args.batch_sizes:
        times = [
            t for _ in range(args.repeats) for t in paged_decode_step_times(model, tok, b, args.prompt_len, args.steps)
        ]
        step = statistics.median(times)
        row = {"batch": b, "step_ms": 1e3 * step, "tokens_per_s": b / step}
        result["batches"].append(row)
        base = result["batches"][0]["tokens_per_s"]
        print(f"{b:5d} {row['step_ms']:9.1f} {row['tokens_per_s']:9.1f} {row['tokens_per_s'] / base:9.2f}")
    by_batch = {r["batch"]: r for r in result["batches"]}
    if 1 in by_batch:
        result["paged_over_contiguous_batch1"] = by_batch[1]["step_ms"] / result["contiguous_batch1_step_ms"]
        print(
            f"contiguous KVCache at batch 1: {result['contiguous_batch1_step_ms']:.1f} ms per step; "
            f"paged-torch / contiguous = {result['paged_over_contiguous_batch1']:.2f} (target <= 1.2)"
        )
    if 1 in by_batch and 16 in by_batch:
        result["throughput_16_over_1"] = by_batch[16]["tokens_per_s"] / by_batch[1]["tokens_per_s"]
        print(f"throughput at batch 16 / batch 1 = {result['throughput_16_over_1']:.2f} (target >= 4)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return result


if __name__ == "__main__":
    main()
