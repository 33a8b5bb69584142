"""The step-cost model behind chapter 6's arrival-rate sweep, fitted here and checked against the wall clock.

    python benchmarks/bench_load.py [--requests 24] [--rates 2 6 12] [--repeats 2] [--noise-threshold 0.15]
                                    [--json benchmarks/results/cpu-load-DATE.json]

Chapter 6 sweeps Poisson arrival rates with :func:`kvcourse.serving.load.serve_open_loop` on a
:class:`~kvcourse.serving.load.ModelledClock`: each step costs ``fixed + per_token * tokens + per_seq * seqs``
seconds. This script measures that model on this machine:

1. **Real time.** The same seeded requests (SmolLM2-135M, prompts of 8-64 tokens, 12 new tokens each,
   greedy, no early stop) arrive in real time at each rate; the engine runs on ``time.perf_counter``
   and sleeps through idle gaps. Every step's duration is logged.
2. **Fit.** :func:`~kvcourse.serving.load.fit_step_cost` on all steps of the quiet repeats: the three
   coefficients and R^2.
3. **Check.** The same arrivals on the modelled clock: TTFT and TPOT p50/p99 against the real run's,
   rate by rate. The chapter quotes the model only as far as this check supports it.

Other processes' CPU use is recorded for every real-time repeat (:class:`machine.OtherCPU`); a repeat
where they kept more than ``--noise-threshold`` cores busy is left out of the fit and of the medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np
from bench_serving import TEXT
from machine import OtherCPU, finish, machine_info

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine, latency_summary
from kvcourse.serving.load import fit_step_cost, poisson_arrivals, serve_open_loop

KEYS = ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")


def workload(tok, num_requests: int, seed: int) -> tuple[list[list[int]], SamplingParams]:
    ids = tok.encode(TEXT)
    lengths = np.random.default_rng(seed).integers(8, 64, num_requests)
    prompts = [ids[(37 * i) % (len(ids) - 64) :][: int(n)] for i, n in enumerate(lengths)]
    return prompts, SamplingParams(max_new_tokens=12, stop_token_ids=())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--rates", type=float, nargs="+", default=[2.0, 6.0, 12.0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--noise-threshold", type=float, default=0.15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args()

    kvcourse.utils.seed_everything(args.seed)
    model, tok = kvcourse.load_pretrained()
    prompts, params = workload(tok, args.requests, args.seed)

    def make(clock):
        return Engine(model, num_blocks=64, block_size=16, max_num_seqs=16, max_num_batched_tokens=256, clock=clock)

    serve_open_loop(make, prompts[:4], params, [0.0] * 4)  # warm-up: first calls allocate and pick kernels
    real: dict[float, list[dict]] = {}
    events = []
    for rate in args.rates:
        arrivals = poisson_arrivals(rate, args.requests, seed=args.seed + 1)
        for r in range(args.repeats):
            with OtherCPU() as noise:
                engine = serve_open_loop(make, prompts, params, arrivals)
            quiet = noise.cores <= args.noise_threshold
            summary = latency_summary(engine.stats["requests"].values())
            real.setdefault(rate, []).append({**{k: summary[k] for k in KEYS}, "other_cores": round(noise.cores, 3),
                                              "steps": len(engine.events), "quiet": quiet})  # fmt: skip
            if quiet:
                events += engine.events
            print(
                f"rate {rate:5.1f}/s repeat {r}: {len(engine.events)} steps, TTFT p50 {summary['ttft_p50']:.3f} s, "
                f"other processes {noise.cores:.2f} cores",
                file=sys.stderr,
            )
    if not events:
        sys.exit("every repeat was noisy: nothing to fit; run again on a quieter machine")
    cost, r2 = fit_step_cost(events)
    print(f"fit on {len(events)} steps: {cost}, R^2 {r2:.3f}", file=sys.stderr)

    check = {}
    for rate in args.rates:
        engine = serve_open_loop(make, prompts, params, poisson_arrivals(rate, args.requests, seed=args.seed + 1), cost)
        modelled = latency_summary(engine.stats["requests"].values())
        quiet = [r for r in real[rate] if r["quiet"]]
        measured = {k: statistics.median(r[k] for r in quiet or real[rate]) for k in KEYS}
        check[str(rate)] = {"real": measured, "noisy": not quiet, "modelled": {k: modelled[k] for k in KEYS},
                            "modelled_over_real": {k: modelled[k] / measured[k] for k in KEYS}}  # fmt: skip

    res = {
        **machine_info(),
        "workload": {
            "requests": args.requests,
            "prompt_tokens": "8-63",
            "max_new_tokens": 12,
            "seed": args.seed,
            "engine": {"num_blocks": 64, "block_size": 16, "max_num_seqs": 16, "max_num_batched_tokens": 256},
        },
        "step_cost": {
            "fixed_s": cost.fixed_s,
            "per_token_s": cost.per_token_s,
            "per_seq_s": cost.per_seq_s,
            "r2": r2,
            "steps": len(events),
        },
        "real_time": {str(k): v for k, v in real.items()},
        "check": check,
        "targets": {
            f"modelled/real {k} at {rate}/s": round(c["modelled_over_real"][k], 2)
            for rate, c in check.items()
            for k in ("ttft_p50", "tpot_p50")
        },
    }
    finish(res, args.json, "load")


if __name__ == "__main__":
    main()
