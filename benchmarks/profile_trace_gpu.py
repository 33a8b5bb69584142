"""Where issue 29's 96-request trace spends its time on a GPU: every step timed, by part and by kind.

    python benchmarks/profile_trace_gpu.py [--device cuda] [--requests 96] [--out benchmarks/results]
                                           [--variants graphs,graphs-again,no-cudnn,profiled,eager]
    python benchmarks/profile_trace_gpu.py --device cpu --quick      # a smoke run (numbers mean nothing)

``bench_engine_gpu.py`` times the trace as a whole (1,842 output tok/s on an H100 against a target of
14,865). Charging each of its 338 decode-only steps a graphed batch-64 step and each of its 47 other steps
an eager 2,048-token prefill accounts for 3.7 s of its 7.7 s. This script finds the rest. It serves the
same trace (``uniform_trace``: 96 requests, prompts of 16-1,024 tokens, outputs of 16-256, seed 0, no EOS;
blocks of 16, 64 running sequences, 2,048 tokens a step, chunked prefill), each run on a fresh engine
after an untimed pilot (kernels compiled, graphs captured), and records for every step:

* its kind: ``decode`` (every sequence feeds one token: a graph replays it), ``mixed`` (decodes beside
  prefill chunks) or ``prefill``; its sequences and tokens;
* its host time by part: ``schedule`` (the scheduler, with the step's snapshot), ``batch`` (packing the
  :class:`~kvcourse.batch.ForwardBatch`, or loading a graph's static buffers), ``forward`` (launching the
  model: eager ops or a graph replay, and the logits), ``sample`` (argmax and reading the tokens back,
  which waits for the GPU to finish the step), ``other`` (the rest of ``Engine.step``);
* its device time from CUDA events around the forward (``forward_gpu_ms``).

Variants (``--variants``), each a fresh engine: ``graphs`` (the benchmark's configuration: every step
from a graph, decode-only and mixed), ``decode-graphs`` (only decode-only steps from graphs, mixed steps
eager: the engine before mixed-step graphs, :mod:`kvcourse.serving.step_graphs`), ``graphs-again`` (a second pass of the
trace on the same engine: what a first pass pays once, such as kernels compiled or attention plans
built for new shapes, it no longer pays), ``no-cudnn`` (``decode-graphs`` with SDPA's cuDNN backend
off: prefill attention takes torch's next choice), ``profiled`` (the ``graphs`` run under
torch's profiler: the ops with the most host time and the kernels with the most device time, device-busy
time in all) and ``eager`` (no graphs). A last section times SDPA with the prefill's mask on shapes it
has not seen, first call against second, cuDNN on and off.

The JSON lands in ``--out`` as ``gpu-trace-profile-<gpu>-<date>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_gpu import load_ours, log, slug, uniform_trace  # noqa: E402
from hf_serving import BLOCK, Shape, pilot_workload, pool_blocks, sync  # noqa: E402

from kvcourse import SamplingParams  # noqa: E402
from kvcourse.batch import ForwardBatch  # noqa: E402
from kvcourse.serving import Engine  # noqa: E402

PARTS = ("schedule", "batch", "forward", "sample", "other")
VARIANTS = ("graphs", "no-overlap", "decode-graphs", "graphs-again", "no-cudnn", "profiled", "eager")


class StepClock:
    """Wraps an engine's methods (on the instance only) and records each step's parts."""

    def __init__(self, eng: Engine, cuda: bool) -> None:
        self.eng, self.cuda, self.steps, self.current = eng, cuda, [], None
        self._events = []
        sched, runner = eng.scheduler, eng.runner
        self._wrap(sched, "schedule", "schedule")
        self._wrap(sched, "snapshot", "schedule")
        self._wrap(runner, "launch", None, around=True)
        self._wrap(eng, "_pick", "sample")
        if runner.graphs is not None:
            self._wrap(runner.graphs, "load_inputs", "batch")
        build = ForwardBatch.build

        def timed_build(*args, **kwargs):
            start = time.perf_counter()
            try:
                return build(*args, **kwargs)
            finally:
                if self.current is not None:
                    self.current["batch"] += time.perf_counter() - start

        self._build, self._timed_build = build, timed_build

    def _wrap(self, obj, name: str, part: str | None, around: bool = False) -> None:
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            if around and self.cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            try:
                result = fn(*args, **kwargs)
            finally:
                spent = time.perf_counter() - start
                if self.current is not None:
                    if around:  # the forward (packing is counted apart: ForwardBatch.build, load_inputs)
                        self.current["execute"] += spent
                    else:
                        self.current[part] += spent
            if around and self.cuda:
                end.record()
                self._events.append((self.current, begin, end))
            return result

        setattr(obj, name, timed)

    def _note_step(self, event) -> None:
        """The step's shape, from its event (with overlap, the scheduling a call does is the next step's)."""
        lens = [n for *_, n, _ in event.scheduled]
        prefills = [n for n in lens if n > 1]
        self.current.update(
            seqs=len(lens),
            tokens=sum(lens),
            prefill_seqs=len(prefills),
            kind="decode" if not prefills else "prefill" if len(prefills) == len(lens) else "mixed",
        )

    def step(self) -> None:
        self.current = collections.defaultdict(float)
        replays = self.eng.runner.graph_steps
        ForwardBatch.build = self._timed_build
        start = time.perf_counter()
        try:
            self.eng.step()
        finally:
            wall = time.perf_counter() - start
            ForwardBatch.build = self._build
        row = self.current
        row["forward"] = row.pop("execute", 0.0)
        self._note_step(self.eng.events[-1])
        row["other"] = wall - sum(row[p] for p in ("schedule", "batch", "forward", "sample"))
        row["wall"] = wall
        row["graph"] = self.eng.runner.graph_steps > replays
        self.steps.append(dict(row))
        self.current = None

    def finish(self) -> None:
        """Read the CUDA events (after a synchronise): each step's forward on the device, in ms."""
        if self.cuda:
            torch.cuda.synchronize()
            for row, begin, end in self._events:
                row["forward_gpu_ms"] = begin.elapsed_time(end)
            for row, (src, _, _) in zip(self.steps, self._events):
                if "forward_gpu_ms" in src:
                    row["forward_gpu_ms"] = src["forward_gpu_ms"]


def summarize(steps: list[dict]) -> dict:
    """Totals and medians by step kind: how many, seconds by part, tokens."""
    out = {}
    for kind in ("decode", "mixed", "prefill", "all"):
        rows = [s for s in steps if kind == "all" or s.get("kind") == kind]
        if not rows:
            continue
        walls = [s["wall"] * 1e3 for s in rows]
        out[kind] = {
            "steps": len(rows),
            "graph_steps": sum(bool(s["graph"]) for s in rows),
            "tokens": int(sum(s.get("tokens", 0) for s in rows)),
            "seconds": round(sum(s["wall"] for s in rows), 4),
            "parts_s": {p: round(sum(s[p] for s in rows), 4) for p in PARTS},
            "median_ms": round(statistics.median(walls), 3),
            "max_ms": round(max(walls), 2),
            "forward_gpu_s": round(sum(s.get("forward_gpu_ms", 0.0) for s in rows) / 1e3, 4),
        }
    slow = sorted(steps, key=lambda s: s["wall"], reverse=True)[:12]
    out["slowest"] = [{k: (round(v * 1e3, 2) if k in PARTS + ("wall",) else v) for k, v in s.items()} for s in slow]
    return out


def serve(
    model,
    prompts,
    lens,
    shape: Shape,
    *,
    graphs: bool,
    passes: int,
    profiler=None,
    mixed: bool = True,
    overlap: bool | None = None,
) -> list[dict]:
    """A fresh engine, piloted untimed, then ``passes`` timed passes of the trace, every step clocked.
    ``mixed=False``: only decode-only steps replay graphs (the engine before mixed-step graphs). ``overlap``: the
    engine's (``None``: its default, on for a GPU)."""
    cuda = model.device.type == "cuda"
    num_blocks = pool_blocks(prompts, lens, shape.block_size)
    eng = Engine(
        model,
        num_blocks=num_blocks,
        block_size=shape.block_size,
        max_num_seqs=shape.max_num_seqs,
        max_num_batched_tokens=shape.max_num_batched_tokens,
        enable_chunked_prefill=True,
        backend="triton",
        cuda_graphs=graphs and cuda,
        overlap=overlap,
    )  # graphs recorded at start-up
    if not mixed and eng.runner.graphs is not None:  # mixed steps eager: the lookup finds decode graphs only
        lookup = eng.runner.graphs.lookup
        eng.runner.graphs.lookup = lambda seqs: key if (key := lookup(seqs)) and key[0] == "decode" else None
    pp, pl = pilot_workload(prompts, 8)
    eng.generate(pp, [SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in pl], use_tqdm=False)
    sync(model.device)
    results = []
    for _ in range(passes):
        clock = StepClock(eng, cuda)
        start = time.perf_counter()
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, stop_token_ids=())) for p, n in zip(prompts, lens)]
        context = profiler if profiler is not None else _Nothing()
        with context:
            while eng.has_unfinished_requests():
                clock.step()
            sync(model.device)
        seconds = time.perf_counter() - start
        clock.finish()
        tokens = sum(len(eng.output(i)) for i in ids)
        results.append({"seconds": round(seconds, 4), "output_tokens": tokens, "tok_s": round(tokens / seconds, 1),
                        "by_kind": summarize(clock.steps)})  # fmt: skip
        for s in clock.steps:
            s.pop("graph", None)
        results[-1]["steps"] = [
            {k: (round(v * 1e3, 3) if k in PARTS + ("wall",) else v) for k, v in s.items()} for s in clock.steps
        ]
    return results


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def profiler_summary(prof, cuda: bool) -> dict:
    """The ops with the most host time, the kernels with the most device time, device-busy time in all."""
    ka = prof.key_averages()
    host = sorted(ka, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    out = {"top_host": [(e.key, e.count, round(e.self_cpu_time_total / 1e3, 2)) for e in host]}
    if cuda:
        dev = sorted(ka, key=lambda e: getattr(e, "self_device_time_total", 0), reverse=True)[:25]
        out["top_device"] = [(e.key, e.count, round(getattr(e, "self_device_time_total", 0) / 1e3, 2)) for e in dev]
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        out["kernels"] = len(kernels)
        out["device_busy_s"] = round(sum(e.device_time for e in kernels) / 1e6, 4)
    return out


def sdpa_new_shapes(device: torch.device, dtype: torch.dtype, seed: int) -> dict:
    """SDPA with an additive mask on shapes it has not seen: first call vs second, ms, cuDNN on and off."""
    from torch.nn import functional as F

    g = torch.Generator().manual_seed(seed)
    rows = []
    for cudnn in (True, False):
        if device.type == "cuda":
            torch.backends.cuda.enable_cudnn_sdp(cudnn)
        for _ in range(4):
            b = int(torch.randint(1, 5, (1,), generator=g))
            t = int(torch.randint(100, 1025, (1,), generator=g))
            s = -(-(t + int(torch.randint(0, 512, (1,), generator=g))) // BLOCK) * BLOCK
            q = torch.randn(b, 9, t, 64, device=device, dtype=dtype)
            k = torch.randn(b, 3, s, 64, device=device, dtype=dtype)
            mask = torch.zeros(b, 1, t, s, device=device, dtype=dtype)
            times = []
            for _ in range(2):
                sync(device)
                start = time.perf_counter()
                F.scaled_dot_product_attention(q, k, k, attn_mask=mask, enable_gqa=True)
                sync(device)
                times.append(round((time.perf_counter() - start) * 1e3, 2))
            rows.append({"cudnn": cudnn, "shape": [b, t, s], "first_ms": times[0], "second_ms": times[1]})
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(True)
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--quick", action="store_true", help="a smoke run: 4 short requests, 2 layers, fp32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--note", default="")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda and not args.quick else torch.float32
    model, total = load_ours(device, dtype, 2 if args.quick else None)
    if args.quick:
        prompts, lens = uniform_trace(4, (4, 24), (2, 6), args.seed)
        shape = Shape(max_num_seqs=4, max_num_batched_tokens=32, block_size=BLOCK)
    else:
        prompts, lens = uniform_trace(args.requests, (16, 1024), (16, 256), args.seed)
        shape = Shape(max_num_seqs=64, max_num_batched_tokens=2048, block_size=BLOCK)
    from kvcourse.bench.kernels import provenance

    res = {"benchmark": "profile_trace_gpu", "provenance": provenance(device) | {"cpu_cores": os.cpu_count()},
           "dtype": str(dtype).removeprefix("torch."), "smoke": args.quick or not cuda, "note": args.note,
           "trace": {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(lens)},
           "shape": vars(shape) if hasattr(shape, "__dict__") else shape._asdict(), "runs": {}}  # fmt: skip
    for v in variants:
        log(f"variant {v}")
        start = time.perf_counter()
        try:
            if v == "graphs":
                res["runs"][v] = serve(model, prompts, lens, shape, graphs=True, passes=1)[0]
            elif v == "no-overlap":  # the host schedules and packs each step after the one before ended
                res["runs"][v] = serve(model, prompts, lens, shape, graphs=True, passes=1, overlap=False)[0]
            elif v == "decode-graphs":
                res["runs"][v] = serve(model, prompts, lens, shape, graphs=True, passes=1, mixed=False)[0]
            elif v == "graphs-again":
                first, again = serve(model, prompts, lens, shape, graphs=True, passes=2)
                res["runs"][v] = again | {"first_pass_tok_s": first["tok_s"]}
            elif v == "no-cudnn":
                if cuda:
                    torch.backends.cuda.enable_cudnn_sdp(False)
                try:
                    res["runs"][v] = serve(model, prompts, lens, shape, graphs=True, passes=1, mixed=False)[0]
                finally:
                    if cuda:
                        torch.backends.cuda.enable_cudnn_sdp(True)
            elif v == "profiled":
                from torch.profiler import ProfilerActivity, profile

                prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
                run = serve(model, prompts, lens, shape, graphs=True, passes=1, profiler=prof)[0]
                run.pop("steps")
                res["runs"][v] = run | {"profile": profiler_summary(prof, cuda)}
            elif v == "eager":
                res["runs"][v] = serve(model, prompts, lens, shape, graphs=False, passes=1)[0]
        except Exception as exc:  # noqa: BLE001 - the others still run; the JSON says what broke
            import traceback

            res["runs"][v] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
        res["runs"][v]["wall_s"] = round(time.perf_counter() - start, 1)
        r = res["runs"][v]
        kinds = {
            k: {kk: vv for kk, vv in s.items() if kk != "parts_s"} | s["parts_s"]
            for k, s in r.get("by_kind", {}).items()
            if k != "slowest"
        }
        log(f"  {r.get('tok_s')} tok/s; " + json.dumps(kinds))
    try:
        res["sdpa_new_shapes"] = sdpa_new_shapes(device, dtype, args.seed)
        log(json.dumps(res["sdpa_new_shapes"]))
    except Exception as exc:  # noqa: BLE001
        res["sdpa_new_shapes"] = {"error": f"{type(exc).__name__}: {exc}"}
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = res["provenance"].get("gpu", "cpu")
    path = args.out / f"gpu-trace-profile-{slug(gpu)}-{time.strftime('%Y-%m-%d')}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    log(f"wrote {path}")
    return 1 if any("error" in r for r in res["runs"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
