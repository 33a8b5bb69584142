"""Decode speed on this CPU: our cached decode vs Hugging Face's, and naive vs cached.

    python benchmarks/bench_decode.py [--prompt-len 256] [--new-tokens 64] [--repeats 3] [--json out.json]

Same weights (SmolLM2-135M-Instruct from the GGUF, fp32), same prompt, same
machine, one process. For each implementation we run prefill then ``new_tokens``
greedy decode steps with no EOS stop and take the median over ``repeats`` runs of:

* TTFT: the prefill step (time to the first token);
* TPOT: mean time per output token over the decode steps.

Hugging Face is timed with the same hand-written loop (``past_key_values`` with
a ``DynamicCache``) and, for reference, through ``model.generate``. The target in
the course's issue: ours / Hugging Face TPOT <= 1.0 at a 256-token prompt and 64 new tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings

import torch

import kvcourse
from machine import cpu_name


def _median(xs):
    return statistics.median(xs)


def time_ours(model, ids, n, use_cache=True):
    result = kvcourse.timed_generate(model, ids, n, use_cache=use_cache, eos_token_ids=())
    return result.ttft, result.tpot, result.tokens


@torch.inference_mode()
def time_hf_loop(hf, ids, n):
    from transformers import DynamicCache

    cache = DynamicCache()
    times, tokens = [], []
    x = torch.tensor([ids])
    for _ in range(n):
        start = time.perf_counter()
        out = hf(input_ids=x, past_key_values=cache, use_cache=True)
        token = int(out.logits[0, -1].argmax())
        times.append(time.perf_counter() - start)
        tokens.append(token)
        x = torch.tensor([[token]])
    return times[0], sum(times[1:]) / (n - 1), tokens


@torch.inference_mode()
def time_hf_generate(hf, ids, n):
    x = torch.tensor([ids])
    start = time.perf_counter()
    out = hf.generate(x, max_new_tokens=n, min_new_tokens=n, do_sample=False)
    total = time.perf_counter() - start
    return total / n, out[0, len(ids) :].tolist()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--naive-new-tokens", type=int, default=32, help="the naive loop is slow: fewer tokens")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.new_tokens < 2 or args.repeats < 1:
        parser.error("need --prompt-len >= 1, --new-tokens >= 2, --repeats >= 1")

    from transformers import AutoModelForCausalLM

    model, tok = kvcourse.load_pretrained()
    path = kvcourse.gguf_path()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()

    text = "The KV cache keeps every earlier token's keys and values so decode reads them instead of recomputing. "
    ids = (tok.encode(text) * args.prompt_len)[: args.prompt_len]
    n = args.new_tokens

    time_ours(model, ids, 4)  # warm-up: first calls allocate and page in weights
    time_hf_loop(hf, ids, 4)

    ours, theirs, theirs_gen = [], [], []
    for _ in range(args.repeats):  # interleave so drift in machine load hits both alike
        ttft, tpot, our_tokens = time_ours(model, ids, n)
        ours.append((ttft, tpot))
        ttft, tpot, hf_tokens = time_hf_loop(hf, ids, n)
        theirs.append((ttft, tpot))
        per_token, gen_tokens = time_hf_generate(hf, ids, n)
        theirs_gen.append(per_token)
    assert our_tokens == hf_tokens == gen_tokens, "the two implementations generated different tokens"

    nn = args.naive_new_tokens
    naive = [time_ours(model, ids, nn, use_cache=False) for _ in range(args.repeats)]
    cached = [time_ours(model, ids, nn, use_cache=True) for _ in range(args.repeats)]
    naive_total = _median([t + p * (nn - 1) for t, p, _ in naive])
    cached_total = _median([t + p * (nn - 1) for t, p, _ in cached])

    res = {
        "machine": platform.machine(),
        "processor": cpu_name(),
        "transformers": __import__("transformers").__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "prompt_len": args.prompt_len,
        "new_tokens": n,
        "repeats": args.repeats,
        "ours_ttft_ms": 1e3 * _median([t for t, _ in ours]),
        "ours_tpot_ms": 1e3 * _median([p for _, p in ours]),
        "hf_ttft_ms": 1e3 * _median([t for t, _ in theirs]),
        "hf_tpot_ms": 1e3 * _median([p for _, p in theirs]),
        "hf_generate_ms_per_token": 1e3 * _median(theirs_gen),
        "naive_new_tokens": nn,
        "naive_total_s": naive_total,
        "cached_total_s": cached_total,
    }
    res["ratio_ours_over_hf_tpot"] = res["ours_tpot_ms"] / res["hf_tpot_ms"]
    res["ratio_naive_over_cached"] = naive_total / cached_total

    print(f"machine: {res['machine']} ({res['processor']}), torch {res['torch']}, {res['threads']} threads")
    print(f"prompt {args.prompt_len} tokens, {n} new tokens, median of {args.repeats} runs")
    print(f"{'':28}{'TTFT (ms)':>12}{'TPOT (ms/token)':>18}")
    print(f"{'kvcourse (KVCache)':28}{res['ours_ttft_ms']:12.1f}{res['ours_tpot_ms']:18.2f}")
    print(f"{'Hugging Face (DynamicCache)':28}{res['hf_ttft_ms']:12.1f}{res['hf_tpot_ms']:18.2f}")
    print(f"{'Hugging Face generate()':28}{'':>12}{res['hf_generate_ms_per_token']:18.2f}  (prefill included)")
    print(f"ratio ours / Hugging Face, TPOT: {res['ratio_ours_over_hf_tpot']:.3f}  (target <= 1.0)")
    print(
        f"naive / cached, whole generation of {nn} tokens: {res['ratio_naive_over_cached']:.2f}x "
        f"({naive_total:.2f} s vs {cached_total:.2f} s)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
