"""Prefix caching on the CPU: hit rate and time to first token with and without it, and its cost at 0% hits.

    python benchmarks/bench_prefix.py [--requests 12] [--new-tokens 16] [--repeats 3] [--threads N]
                                      [--json benchmarks/results/cpu-prefix-DATE.json] [--note TEXT]

On SmolLM2-135M, ``--requests`` chat requests share one real system prompt (about 300 tokens) through
the chat template and differ in the user's question. Each is served by the engine (blocks of 16, a
budget of 256 tokens per step, chunked prefill) with ``enable_prefix_caching`` off and on:

* ``sequential`` -- one request after another on one engine: the per-request TTFT a returning user
  sees, and the hit rate (the first request finds nothing; the others find the system prompt);
* ``burst`` -- the first request alone, then all the others at once: throughput and TTFT p50/p99.

Then the **overhead** at a 0% hit rate: ``--requests`` prompts (slices of an English text), each
with its own ``cache_salt``, so nothing can be shared while every block is still hashed, looked up
and registered. Output tokens/s with caching on and off, alternated ``--repeats`` times (the median
of each); the target is < 2% throughput lost. On a loaded machine that difference is noise, so the
time spent inside the prefix cache's own calls is also timed, as a fraction of the run. Each output
is also checked equal with and without.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np
import torch
from machine import finish, machine_info

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine

SYSTEM_PROMPT = (
    "You are the help desk assistant of the Riverside Public Library. The library opens from nine in the "
    "morning to eight in the evening on weekdays, from ten to six on Saturdays, and from noon to five on "
    "Sundays. It is closed on public holidays. Members may borrow up to twelve items at once: books for three "
    "weeks, films and music for one week. Items can be renewed twice, online or at the desk, unless another "
    "member has reserved them. A library card is free for anyone who lives, works or studies in the county; "
    "bring a photo ID and a proof of address. Lost cards are replaced for two dollars. Late fees were abolished "
    "last year, but lost or damaged items must be paid for. The second floor has a quiet study room, six group "
    "rooms that can be booked for two hours a day, and twenty computers with free printing of up to ten pages. "
    "Children's story time is on Tuesday and Thursday mornings. Answer the member's question in one or two "
    "short, friendly sentences, using only these facts. If the answer is not in them, say that you do not "
    "know and suggest asking a librarian at the front desk."
)
QUESTIONS = [
    "When are you open on Sunday?", "How many books can I take home?", "Can I renew a film online?",
    "I lost my card, what now?", "Do I pay a fine for a late book?", "Is there somewhere quiet to study?",
    "Can I print my boarding pass?", "When is story time for kids?", "Who can get a library card?",
    "How long can I keep a book?", "Can my study group book a room?", "Are you open on New Year's Day?",
    "Do you have a copy of Moby Dick?", "What do I need to sign up?", "Can I renew a book three times?",
    "Is printing free?",
]  # fmt: skip
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from winemaking. Within fifty years presses "
    "were running in more than two hundred cities across Europe, and the price of books fell so far that "
    "ordinary merchants could own them. Scholars argue about how quickly the change spread, but nobody "
    "disputes that it reshaped religion, science and politics. Letters, pamphlets and newspapers followed, "
    "and with them a new public that read, argued and wrote back. "
)


def engine(model, caching: bool, num_blocks: int) -> Engine:
    return Engine(model, num_blocks=num_blocks, block_size=16, max_num_seqs=16, max_num_batched_tokens=256,
                  enable_prefix_caching=caching)  # fmt: skip


def stat(eng: Engine, rids) -> dict:
    m = [eng.requests[r].metrics for r in rids]
    ttft = [x.ttft for x in m]
    s = eng.stats
    return {
        "ttft_mean_s": round(float(np.mean(ttft)), 4),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 4),
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 4),
        "prefix_cache_hit_tokens": s["prefix_cache_hit_tokens"],
        "prefix_cache_queried_tokens": s["prefix_cache_queried_tokens"],
        "prefix_cache_hit_rate": None
        if s["prefix_cache_queried_tokens"] == 0
        else round(s["prefix_cache_hit_rate"], 4),
    }


def run_sequential(model, prompts, params, caching) -> tuple[dict, list]:
    eng = engine(model, caching, num_blocks=64)
    outs, rids = [], []
    for p in prompts:
        rid = eng.add_request(p, params)
        while eng.has_unfinished_requests():
            eng.step()
        outs.append(eng.output(rid))
        rids.append(rid)
    out = stat(eng, rids)
    out["ttft_first_s"] = round(eng.requests[rids[0]].metrics.ttft, 4)
    out["ttft_rest_mean_s"] = round(float(np.mean([eng.requests[r].metrics.ttft for r in rids[1:]])), 4)
    return out, outs


def run_burst(model, prompts, params, caching) -> tuple[dict, list]:
    eng = engine(model, caching, num_blocks=16 * len(prompts))
    outs = eng.generate(prompts[:1], params)
    t0 = eng.clock()
    rids = [eng.add_request(p, params) for p in prompts[1:]]
    while eng.has_unfinished_requests():
        eng.step()
    span = eng.clock() - t0
    outs += [eng.output(r) for r in rids]
    out = stat(eng, rids)
    tokens = sum(len(eng.output(r)) for r in rids)
    out.update(duration_s=round(span, 3), output_tokens_per_s=round(tokens / span, 2))
    return out, outs


def timed(obj, name: str, spent: list[float]) -> None:
    """Wrap ``obj.name`` so that the seconds spent in it add up in ``spent[0]``."""
    fn = getattr(obj, name)

    def wrapper(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - t

    setattr(obj, name, wrapper)


def run_no_hits(model, prompts, params, caching) -> tuple[float, list, dict, float]:
    """Output tokens/s, the outputs, the stats, and the fraction of the time spent in the prefix cache's
    own calls (lookup and registration: the whole cost of caching when nothing hits)."""
    eng = engine(model, caching, num_blocks=16 * len(prompts))
    spent = [0.0]
    if caching:
        for name in ("find_cached_blocks", "cache_full_blocks"):
            timed(eng.block_manager, name, spent)
    rids = [eng.add_request(p, params, cache_salt=f"tenant-{i}") for i, p in enumerate(prompts)]
    t0 = eng.clock()
    while eng.has_unfinished_requests():
        eng.step()
    span = eng.clock() - t0
    return sum(len(eng.output(r)) for r in rids) / span, [eng.output(r) for r in rids], eng.stats, spent[0] / span


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own choice)")
    parser.add_argument("--note", default="", help="recorded with the results, e.g. whether the machine was shared")
    parser.add_argument("--json", help="where to write the results (default benchmarks/results/cpu-prefix-DATE.json)")
    args = parser.parse_args()
    if not 2 <= args.requests <= len(QUESTIONS):
        raise SystemExit(f"--requests must be in [2, {len(QUESTIONS)}], got {args.requests}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = kvcourse.load_pretrained()
    params = SamplingParams(max_new_tokens=args.new_tokens, stop_token_ids=())  # no early stop: equal work
    prompts = [tok.encode_chat(q, system_prompt=SYSTEM_PROMPT) for q in QUESTIONS[: args.requests]]
    shared = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)
    res = {
        **machine_info(), "cores": os.cpu_count(), "python": platform.python_version(), "note": args.note,
        "load_average_start": [round(x, 2) for x in os.getloadavg()],
        "requests": args.requests, "new_tokens": args.new_tokens, "block_size": 16, "max_num_batched_tokens": 256,
        "prompt_tokens_mean": float(np.mean([len(p) for p in prompts])), "shared_prefix_tokens": shared,
    }  # fmt: skip
    print(
        f"{args.requests} chat requests, {res['prompt_tokens_mean']:.0f} prompt tokens on average, {shared} shared "
        f"(system prompt + template); {res['threads']} threads, {res['processor']}"
    )
    for name, run in (("sequential", run_sequential), ("burst", run_burst)):
        off, outs_off = run(model, prompts, params, False)
        on, outs_on = run(model, prompts, params, True)
        res[name] = {"off": off, "on": on, "outputs_equal": outs_off == outs_on}
        print(
            f"{name:10s} TTFT p50 off {off['ttft_p50_s']:.3f}s on {on['ttft_p50_s']:.3f}s; "
            f"hit rate {on['prefix_cache_hit_rate']:.0%}; outputs equal: {outs_off == outs_on}",
            flush=True,
        )
    # 0% hit rate: distinct prompts, one salt each.
    rng = np.random.default_rng(args.seed)
    ids = tok.encode(TEXT * 8)
    starts = rng.integers(0, len(ids) - 300, args.requests)
    plain = [ids[s : s + 250] for s in starts]
    rates: dict[bool, list[float]] = {False: [], True: []}
    fractions = []
    equal = True
    for _ in range(args.repeats):
        outs = {}
        for caching in (False, True):  # alternated: a load change on a shared machine hits both
            rate, outs[caching], stats, fraction = run_no_hits(model, plain, params, caching)
            rates[caching].append(rate)
            fractions += [fraction] if caching else []
            assert stats["prefix_cache_hit_tokens"] == 0
        equal &= outs[False] == outs[True]
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    loss = 1 - on / off
    res["no_hits"] = {
        "prompt_tokens": 250, "tokens_per_s_off": [round(r, 2) for r in rates[False]],
        "tokens_per_s_on": [round(r, 2) for r in rates[True]], "median_off": round(off, 2), "median_on": round(on, 2),
        "throughput_loss": round(loss, 4), "outputs_equal": equal,
        "bookkeeping_fraction_of_time": [round(f, 5) for f in fractions],
    }  # fmt: skip
    seq = res["sequential"]
    res["targets"] = {
        "overhead_below_2_percent_at_0_hits": loss < 0.02,
        "bookkeeping_below_2_percent_at_0_hits": max(fractions) < 0.02,
        "sequential_ttft_speedup": round(seq["off"]["ttft_rest_mean_s"] / seq["on"]["ttft_rest_mean_s"], 2),
        "outputs_equal": seq["outputs_equal"] and res["burst"]["outputs_equal"] and equal,
    }
    print(
        f"0% hits: {off:.1f} tok/s off, {on:.1f} on: {loss:+.1%} throughput lost (medians of {args.repeats}); "
        f"lookup + registration took {max(fractions):.2%} of the time at most"
    )
    finish(res, args.json, "prefix")


if __name__ == "__main__":
    main()
