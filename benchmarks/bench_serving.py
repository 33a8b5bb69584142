"""Serving a crowd on the CPU: throughput and latency of five ways to serve one trace of requests.

    python benchmarks/bench_serving.py [--requests 64] [--batch-size 16] [--threads N] [--skip-hf]
                                       [--json benchmarks/results/cpu-serving-DATE.json] [--note TEXT]

A seeded trace of ``--requests`` prompts (slices of one English text, log-normal lengths 8-384
tokens) and output lengths (log-normal, 4-128 tokens; no early stop, so every mode does the same
work), all arriving at time 0, served on SmolLM2-135M:

* ``one_at_a_time``   -- each request alone, in order (static batching with batch size 1);
* ``static``          -- static batches of ``--batch-size``: prompts padded to the batch's longest,
  every row decoded until the batch's longest output is done (:mod:`kvcourse.serving.baselines`);
* ``continuous``      -- the engine, ``max_num_seqs = --batch-size``, whole prompts only;
* ``continuous_chunked`` -- the same with chunked prefill under a budget of 256 tokens per step;
* ``hf_padded``       -- Hugging Face ``generate`` on left-padded batches of ``--batch-size``, greedy
  (``hf_serving.py``, which the GPU engine benchmark's Hugging Face runs share).

Reported per mode: output tokens/s (all output tokens over the time to serve the whole trace) and
p50/p99 of TTFT (arrival to first token, queueing included) and TPOT. Then the same on the first 16
requests for ``one_at_a_time`` and ``continuous_chunked``. The course's targets are checked and
printed (a benchmark, not a test): continuous >= 4x one-at-a-time throughput on 16 requests, ahead
of static batching and of HF on the trace, and a lower p99 TTFT than static batching.
"""

from __future__ import annotations

import argparse
import math
import os
import platform

import numpy as np
import torch
from hf_serving import pool_blocks, run_hf_padded, summary
from machine import finish, machine_info

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine
from kvcourse.serving.baselines import serve_static

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from winemaking. Within fifty years presses "
    "were running in more than two hundred cities across Europe, and the price of books fell so far that "
    "ordinary merchants could own them. Scholars argue about how quickly the change spread, but nobody "
    "disputes that it reshaped religion, science and politics. Letters, pamphlets and newspapers followed, "
    "and with them a new public that read, argued and wrote back. "
)


def make_workload(tok, num: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    ids = tok.encode(TEXT * 12)
    prompt_lens = np.clip(np.rint(rng.lognormal(math.log(64), 0.8, num)), 8, 384).astype(int)
    output_lens = np.clip(np.rint(rng.lognormal(math.log(32), 0.7, num)), 4, 128).astype(int)
    starts = rng.integers(0, len(ids) - 384, num)
    return [ids[s : s + n] for s, n in zip(starts, prompt_lens)], [int(n) for n in output_lens]


def run_engine(model, prompts, params, batch_size, chunked: bool) -> dict:
    blocks = pool_blocks(prompts, [sp.max_new_tokens for sp in params])
    eng = Engine(model, num_blocks=blocks, block_size=16, max_num_seqs=batch_size,
                 max_num_batched_tokens=256 if chunked else None, enable_chunked_prefill=chunked)  # fmt: skip
    eng.generate(prompts, params, use_tqdm=False)
    out = summary([r.metrics for r in eng.requests.values()])
    out.update(steps=eng.stats["steps"], preemptions=eng.stats["preemptions"])
    return out


def run_static(model, prompts, params, batch_size) -> dict:
    run = serve_static(model, prompts, params, batch_size)
    out = summary(run.metrics)
    out.update(
        steps=len(run.events), padded_tokens=sum(n for e in run.events for *_, n, k in e.scheduled if k == "pad")
    )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--skip-hf", action="store_true", help="leave out Hugging Face generate")
    parser.add_argument("--note", default="", help="recorded with the results, e.g. whether the machine was shared")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/cpu-serving-DATE.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvcourse.load_pretrained()
    prompts, output_lens = make_workload(tok, args.requests, args.seed)
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in output_lens]
    res = {
        **machine_info(), "cores": os.cpu_count(), "python": platform.python_version(), "note": args.note,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "requests": args.requests, "batch_size": args.batch_size, "seed": args.seed,
        "prompt_tokens": {"mean": float(np.mean([len(p) for p in prompts])), "max": max(len(p) for p in prompts)},
        "output_tokens": {"mean": float(np.mean(output_lens)), "max": max(output_lens), "total": sum(output_lens)},
        "modes": {},
    }  # fmt: skip
    modes = {
        "one_at_a_time": lambda p, sp: run_static(model, p, sp, 1),
        "static": lambda p, sp: run_static(model, p, sp, args.batch_size),
        "continuous": lambda p, sp: run_engine(model, p, sp, args.batch_size, chunked=False),
        "continuous_chunked": lambda p, sp: run_engine(model, p, sp, args.batch_size, chunked=True),
    }
    if not args.skip_hf:
        modes["hf_padded"] = lambda p, sp: run_hf_padded(p, [s.max_new_tokens for s in sp], args.batch_size)
    header = (
        f"{'mode':20s} {'tok/s':>7s} {'TTFT p50':>9s} {'TTFT p99':>9s} {'TPOT p50':>9s} {'TPOT p99':>9s} {'time':>7s}"
    )
    print(f"{args.requests} requests, {sum(output_lens)} output tokens, {res['threads']} threads, {res['processor']}")
    print(header)
    for name, run in modes.items():
        r = run(prompts, params)
        res["modes"][name] = r
        print(
            f"{name:20s} {r['output_tokens_per_s']:7.1f} {r['ttft_p50']:8.2f}s {r['ttft_p99']:8.2f}s "
            f"{r['tpot_p50'] * 1e3:7.0f}ms {r['tpot_p99'] * 1e3:7.0f}ms {r['duration']:6.1f}s",
            flush=True,
        )
    res["first_16"] = {name: modes[name](prompts[:16], params[:16]) for name in ("one_at_a_time", "continuous_chunked")}
    m, f16 = res["modes"], res["first_16"]
    speedup16 = f16["continuous_chunked"]["output_tokens_per_s"] / f16["one_at_a_time"]["output_tokens_per_s"]
    best = max(m["continuous"]["output_tokens_per_s"], m["continuous_chunked"]["output_tokens_per_s"])
    res["targets"] = {
        "continuous_over_one_at_a_time_16": round(speedup16, 2),
        "continuous_4x_one_at_a_time_16": speedup16 >= 4,
        "continuous_ahead_of_static": best > m["static"]["output_tokens_per_s"],
        "continuous_ahead_of_hf": None if args.skip_hf else best > m["hf_padded"]["output_tokens_per_s"],
        "lower_p99_ttft_than_static": m["continuous_chunked"]["ttft_p99"] < m["static"]["ttft_p99"],
    }
    print(f"first 16 requests: continuous (chunked) {speedup16:.1f}x one-at-a-time throughput")
    finish(res, args.json, "serving")


if __name__ == "__main__":
    main()
