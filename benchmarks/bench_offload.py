"""Offloading on the CPU: swap vs recompute, and a host tier for evicted prefix blocks.

    python benchmarks/bench_offload.py [--tokens 512] [--repeats 3] [--requests 12] [--threads N]
                                       [--json benchmarks/results/cpu-offload-DATE.json] [--note TEXT]

Three measurements on SmolLM2-135M:

* ``micro`` -- the vLLM paper's micro-benchmark (section 7.3) at our scale: for block sizes 1 to 256,
  the seconds to swap a ``--tokens``-token sequence out and back in (one batched copy per layer, and
  one copy per block) against recomputing it (one prefill); :func:`kvcourse.bench.swap.time_swap_vs_recompute`.
* ``engine`` -- ``--requests`` requests at once on a pool too small for all of them, so the
  scheduler preempts: ``preemption_mode="recompute"`` vs ``"swap"``. Wall time, output tokens/s,
  preemptions, tokens fed again, blocks copied and the time the copies took; outputs checked equal.
* ``cold_tier`` -- a chat request whose system prompt was cached, then evicted by other traffic,
  comes back: time to first token with the prompt still on the device, evicted to the host tier
  (``num_cpu_blocks``), and evicted with no host tier (recomputed). Outputs checked equal.

On a CPU-only machine the "device" pool and the host pool are the same DRAM: a swap is a memory
copy, not a PCIe transfer, so these numbers say nothing about a GPU (see the chapter).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch
from bench_prefix import QUESTIONS, SYSTEM_PROMPT, TEXT
from machine import finish, machine_info

import kvcourse
from kvcourse import SamplingParams
from kvcourse.bench.swap import time_swap_vs_recompute
from kvcourse.serving import Engine

BLOCK_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def run_engine(model, prompts, params, mode: str, num_blocks: int) -> tuple[dict, list]:
    eng = Engine(model, num_blocks=num_blocks, block_size=16, max_num_seqs=len(prompts), max_num_batched_tokens=256,
                 num_cpu_blocks=4 * num_blocks if mode == "swap" else 0, preemption_mode=mode)  # fmt: skip
    t0 = eng.clock()
    outs = eng.generate(prompts, params)
    span = eng.clock() - t0
    s = eng.stats
    tokens = sum(len(o) for o in outs)
    return {
        "duration_s": round(span, 3), "output_tokens_per_s": round(tokens / span, 2),
        "preemptions": s["preemptions"], "swapped_out": s["swapped_out"], "recomputed_tokens": s["recomputed_tokens"],
        "batched_tokens": s["batched_tokens"], "blocks_to_host": s["blocks_to_host"],
        "blocks_to_device": s["blocks_to_device"], "transfer_s": round(s["transfer_seconds"], 4),
        "bytes_moved": (s["blocks_to_host"] + s["blocks_to_device"]) * eng.runner.kv_store.block_nbytes,
    }, outs  # fmt: skip


def cold_tier_ttft(model, tok, case: str) -> tuple[float, list[int], dict]:
    """TTFT of a request whose system prompt another request cached; ``case``: ``"device"`` (nothing
    evicted it), ``"host"`` (evicted to the host tier) or ``"recompute"`` (evicted, no host tier)."""
    first, later = (tok.encode_chat(q, system_prompt=SYSTEM_PROMPT) for q in QUESTIONS[:2])
    ids = tok.encode(TEXT * 8)
    flood = [ids[i * 200 : i * 200 + 180] for i in range(3)]
    num_blocks = 96 if case == "device" else 48  # 48: the flood needs every block, so the prompt's go
    eng = Engine(model, num_blocks=num_blocks, block_size=16, max_num_batched_tokens=512, enable_prefix_caching=True,
                 num_cpu_blocks=64 if case == "host" else 0)  # fmt: skip
    eng.generate([first], max_new_tokens=1)
    eng.generate(flood, SamplingParams(max_new_tokens=64, stop_token_ids=()))
    rid = eng.add_request(later, SamplingParams(max_new_tokens=8))
    while eng.has_unfinished_requests():
        eng.step()
    s = eng.stats
    info = {k: s[k] for k in ("prefix_cache_hit_tokens", "prefix_cache_host_hit_tokens", "prefix_cache_evictions",
                              "prefix_cache_offloaded_blocks", "transfer_seconds")}  # fmt: skip
    return eng.requests[rid].metrics.ttft, eng.output(rid), info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the swapped sequence (micro)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=12, help="requests at once (engine)")
    parser.add_argument("--new-tokens", type=int, default=160, help="tokens each request generates (engine)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--note", default="", help="recorded with the results, e.g. whether the machine was shared")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/cpu-offload-DATE.json)")
    args = parser.parse_args()
    if not 2 <= args.requests <= len(QUESTIONS):
        raise SystemExit(f"--requests must be in [2, {len(QUESTIONS)}], got {args.requests}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvcourse.load_pretrained()
    res = {**machine_info(), "cores": os.cpu_count(), "python": platform.python_version(), "note": args.note,
           "load_average_start": [round(x, 2) for x in os.getloadavg()], "dtype": str(model.dtype)}  # fmt: skip

    rows = time_swap_vs_recompute(model, args.tokens, BLOCK_SIZES, repeats=args.repeats)
    res["micro"] = {"tokens": args.tokens, "rows": rows}
    print(f"swap vs recompute, {args.tokens} tokens ({rows[0]['bytes'] / 2**20:.1f} MiB of K/V):")
    for r in rows:
        print(
            f"  block {r['block_size']:3d}: recompute {r['recompute_s'] * 1e3:7.1f} ms, swap out+in batched "
            f"{(r['swap_out_s'] + r['swap_in_s']) * 1e3:6.2f} ms, one copy per block "
            f"{(r['swap_out_per_block_s'] + r['swap_in_per_block_s']) * 1e3:7.2f} ms",
            flush=True,
        )

    # Short chat prompts, long answers: admission sees small prompts and takes everyone in, then the
    # pool, with room for about half the requests at full length, runs out as the answers grow.
    prompts = [tok.encode_chat(q) for q in QUESTIONS[: args.requests]]
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_token_ids=())  # no early stop: equal work
    per_request = -(-(max(len(p) for p in prompts) + args.new_tokens) // 16)
    num_blocks = per_request * args.requests // 2
    engine_res, outs = {}, {}
    for mode in ("recompute", "swap"):
        engine_res[mode], outs[mode] = run_engine(model, prompts, params, mode, num_blocks)
        print(f"engine, {mode:9s}: {engine_res[mode]}", flush=True)
    res["engine"] = {"requests": args.requests, "new_tokens": args.new_tokens, "num_blocks": num_blocks,
                     "block_size": 16, "prompt_tokens_mean": round(statistics.mean(map(len, prompts)), 1),
                     **engine_res, "outputs_equal": outs["recompute"] == outs["swap"]}  # fmt: skip

    cold, outs_cold = {}, {}
    for case in ("device", "host", "recompute"):
        ttfts = []
        for _ in range(args.repeats):
            ttft, outs_cold[case], info = cold_tier_ttft(model, tok, case)
            ttfts.append(ttft)
        cold[case] = {"ttft_s": round(statistics.median(ttfts), 4), "ttfts_s": [round(t, 4) for t in ttfts], **info}
        print(f"cold tier, prompt {case:9s}: TTFT {cold[case]['ttft_s'] * 1e3:.0f} ms {info}", flush=True)
    res["cold_tier"] = {**cold, "outputs_equal": outs_cold["device"] == outs_cold["host"] == outs_cold["recompute"]}

    mid = next(r for r in rows if r["block_size"] == 16)
    res["targets"] = {
        "outputs_equal": res["engine"]["outputs_equal"] and res["cold_tier"]["outputs_equal"],
        "swap_vs_recompute_at_block_16": round((mid["swap_out_s"] + mid["swap_in_s"]) / mid["recompute_s"], 4),
        "engine_swap_speedup": round(
            engine_res["swap"]["output_tokens_per_s"] / engine_res["recompute"]["output_tokens_per_s"], 3
        ),
        "cold_tier_ttft_speedup": round(cold["recompute"]["ttft_s"] / cold["host"]["ttft_s"], 2),
    }
    finish(res, args.json, "offload")


if __name__ == "__main__":
    main()
