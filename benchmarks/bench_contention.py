"""Why a neighbour's threads slow the engine down so much: the OpenMP wait policy, measured.

    python benchmarks/bench_contention.py [--requests 16] [--max-new-tokens 24] [--repeats 2] [--json PATH]

``bench_engine.py`` found the engine several times slower while another process ran a 2-thread torch
job on the same 2 cores, where Hugging Face's continuous batching slowed down 1.5x. An engine step is
hundreds of short parallel regions (each linear layer, each SDPA call). With OpenMP's default
*active* wait, a worker thread spins between regions instead of sleeping; on an oversubscribed
machine it spins on a core the main thread or the neighbour needs, and a region cannot end until a
descheduled thread gets its core back. ``OMP_WAIT_POLICY=PASSIVE`` makes idle workers sleep instead;
one torch thread has no worker to wait for.

Each setting runs in its own process (the policy is read when OpenMP starts, before torch is
imported): the engine serves the first ``--requests`` requests of bench_serving's trace, quiet and then
beside bench_engine's neighbour. Reported: output tokens/s quiet and loaded, and the slowdown.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

SETTINGS = [  # (torch threads, OMP_WAIT_POLICY)
    (2, None),
    (2, "PASSIVE"),
    (1, None),
]


def worker(threads: int, requests: int, max_new_tokens: int, repeats: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    import kvcourse
    from bench_engine import neighbour
    from bench_serving import make_workload
    from machine import OtherCPU

    from kvcourse import SamplingParams
    from kvcourse.serving import Engine

    model, tok = kvcourse.load_pretrained()
    prompts, outs = make_workload(tok, requests, 0)
    params = [SamplingParams(max_new_tokens=min(n, max_new_tokens), stop_token_ids=()) for n in outs]
    total = sum(p.max_new_tokens for p in params)

    def run(pids=()) -> dict:
        eng = Engine(model, num_blocks=sum(-(-(len(p) + max_new_tokens) // 16) for p in prompts), block_size=16,
                     max_num_seqs=16, max_num_batched_tokens=256)  # fmt: skip
        with OtherCPU(exclude_pids=pids) as load:
            eng.generate(prompts, params, use_tqdm=False)
        return {"tok_s": total / load.wall, "other_cores": load.cores}

    run()  # warm-up, untimed
    quiet = [run() for _ in range(repeats)]
    with neighbour() as proc:
        loaded = [run([proc.pid]) for _ in range(repeats)]
    best = lambda runs: max(r["tok_s"] for r in runs)  # noqa: E731  (the least disturbed repeat)
    return {"quiet": quiet, "loaded": loaded, "quiet_tok_s": best(quiet), "loaded_tok_s": best(loaded),
            "slowdown": best(quiet) / best(loaded)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", help="default benchmarks/results/cpu-contention-DATE.json")
    parser.add_argument("--worker", nargs=2, metavar=("THREADS", "POLICY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker[0]), args.requests, args.max_new_tokens, args.repeats)))
        return
    from machine import finish, machine_info

    res = {**machine_info(), "load_average_start": [round(x, 2) for x in os.getloadavg()], "requests": args.requests,
           "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "settings": []}  # fmt: skip
    here = os.path.dirname(os.path.abspath(__file__))
    for threads, policy in SETTINGS:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
        if policy:
            env["OMP_WAIT_POLICY"] = policy
        start = time.perf_counter()
        out = subprocess.run([sys.executable, os.path.join(here, "bench_contention.py"), "--worker", str(threads),
                              policy or "default", "--requests", str(args.requests), "--max-new-tokens",
                              str(args.max_new_tokens), "--repeats", str(args.repeats)],
                             env=env, capture_output=True, text=True, check=True, cwd=here)  # fmt: skip
        r = json.loads(out.stdout.strip().splitlines()[-1])
        r.update(threads=threads, omp_wait_policy=policy or "default")
        res["settings"].append(r)
        print(
            f"threads={threads} OMP_WAIT_POLICY={policy or 'default':8s} quiet {r['quiet_tok_s']:6.1f} tok/s  "
            f"loaded {r['loaded_tok_s']:6.1f} tok/s  slowdown {r['slowdown']:.2f}x  "
            f"({time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    finish(res, args.json, "contention")


if __name__ == "__main__":
    main()
