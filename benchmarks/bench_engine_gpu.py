"""The engine on a GPU (issue 29): throughput against Hugging Face, CUDA graphs on and off, where a step goes.

    python benchmarks/bench_engine_gpu.py [--preset full|lease|smoke] [--device cuda] [--dtype bf16]
                                          [--layers N] [--seed 0] [--out benchmarks/results] [--note TEXT]
    python benchmarks/bench_engine.py --device cuda ...      # the same benchmark, the issue's command

Everything runs in one process on one GPU, on one set of weights: SmolLM2-135M from the local GGUF, loaded
once by :func:`kvcourse.load_pretrained` and once by Hugging Face (``hf_serving.load_hf``), both moved to
the GPU in the same dtype. Every ratio divides two numbers measured minutes apart on the same GPU.

(a) **nano-vllm's benchmark** (``nano_vllm``). nano-vllm's ``bench.py`` draws 256 sequences with Python's
    ``random.seed(0)``: prompts of ``randint(100, 1024)`` random token ids (each ``randint(0, 10000)``),
    outputs of ``randint(100, 1024)`` tokens with EOS ignored, and reports output tokens over wall time. First
    the engine alone (``"triton"``, CUDA graphs on) serves that whole protocol (``whole_protocol``), decoded
    greedily (nano-vllm samples at temperature 0.6). Then the same draws with the preset's number of sequences
    (128 in ``full``) and lengths up to 512 are served by the engine and by Hugging Face's continuous batching
    in each of the preset's configurations this machine can run (``hf_serving.HF_CB_CONFIGS``: attention
    implementations, async batching, torch.compile levels; flash attention is not on the GPU image), sized
    alike, and the engine is compared with the fastest (``engine_over_hf_best``); with the preset's
    comparisons, also by the engine with graphs off, on ``"paged-torch"``, and by Hugging Face ``generate`` on
    left-padded batches of 32.
(b) **The issue's trace** (``issue_trace``): 96 requests, prompts uniform in 16-1024 tokens, outputs
    uniform in 16-256 (seed 0, no EOS), blocks of 16, 64 running sequences, 2048 tokens a step: the
    trace on which the first GPU run measured 991 output tok/s (H200, bf16, before CUDA graphs). The
    engine with graphs on; with the comparisons, graphs off and ``"paged-torch"`` too.
(c) **One decode step** (``step_profile``): 64 sequences of 200-1000 tokens of context on a
    :class:`~kvcourse.serving.ModelRunner`, then batches of 1, 16 and 64 decode one token each, graphs on
    and off: the wall time of a step (unprofiled, the device synchronised around each; the least of
    ``profile_repeats`` rounds' medians), and one profiled run (:func:`kvcourse.serving.step_profile.profile_step`:
    wall time, device-busy time from the kernels' intervals, the GPU's idle fraction, kernel launches,
    framework calls, ops that wait for the device). ``kvcourse.generate`` at batch 1 beside it.
(d) **Agreement** (``agreement``): in fp32, a small workload through the engine with graphs on, off and on
    ``"paged-torch"`` (greedy tokens must be identical: mismatching requests are counted) and through
    Hugging Face's continuous batching (identical requests counted). In the benchmark's dtype, how many
    of (a)'s requests the ``"triton"`` and ``"paged-torch"`` engines decode alike: in bf16 two correct
    implementations that add in different orders part ways after a near-tie (a finding, not a failure).
(e) **Targets** (``targets``, issue 49's), each ``{"value", "target", "met"}`` from this run's own numbers: a
    batch-64 decode step in <= 1.5 ms, >= 25,000 tok/s on the trace, the engine >= 2x Hugging Face's fastest
    configuration with >= 3 tried, the GPU idle <= 15% of a batch-64 step, and nano-vllm's 256 requests served.

Setup (loading, allocating pools, capturing graphs, a short untimed pilot run that compiles the kernels;
for Hugging Face's continuous batching on a GPU, a whole untimed pass, see ``hf_serving.run_hf_cb``) is never
inside a timed window. The sizes are fixed by a **preset** (:data:`PRESETS`), so two runs of one preset
measure the same work: ``full`` (the default on a GPU) runs everything at the sizes above; ``lease``
(``make gpu-check``, about 90 s on an H100 or H200) serves 32 of (a)'s requests and leaves out the
comparisons no target needs (graphs off, ``"paged-torch"``, ``generate``), and stops a run that passes 60 s
(recorded as timed out: a guard, not a size); ``smoke`` is a smoke test of the same code. Every section
and run is guarded: one that fails records its error and the others still run.

Without a GPU, ``--device cpu`` runs the ``smoke`` preset (``tests/test_bench_engine_gpu.py``):
tiny sizes, the first 2 of the model's 30 layers (``--layers``; the kernels run in Triton's interpreter),
fp32, Hugging Face's continuous batching without graphs, and in place of captured graphs the same static
forward run eagerly (``capture=False``); the step profile's graph runs are skipped, saying why. Its
numbers measure nothing. The JSON lands in ``--out`` as ``gpu-engine-<gpu>-<date>.json``; the exit status is 1
when any section or run recorded an error (``errors`` in the JSON lists where), 0 otherwise, targets met or not.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from hf_serving import (BLOCK, HF_CB_CONFIGS, Shape, best_hf_run, load_hf, pilot_workload, pool_blocks, run_hf_cb,
                        run_hf_generate, runnable_configs, sync, timed_result)  # fmt: skip

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine, ModelRunner

try:  # issue 29's profiler of one step; a checkout without it still measures everything else
    from kvcourse.serving.step_profile import profile_step
except ImportError as exc:  # pragma: no cover - depends on the checkout
    profile_step = None
    PROFILE_MISSING = f"kvcourse.serving.step_profile is not importable here ({exc})"

ISSUE_TOK_S = 991.0  # the engine on the issue's trace, first H200 run (bf16, backend="triton", no graphs)
# Issue 49's targets (on an H100 or H200, bf16): name -> (goal, at most?)
TARGETS = {"decode_step_batch_64_ms": (1.5, True), "trace_tok_s": (25_000.0, False),
           "engine_over_hf_best": (2.0, False), "hf_configs_tried": (3, False),
           "gpu_idle_fraction_batch_64": (0.15, True), "nano_vllm_requests": (256, False)}  # fmt: skip
NANO_VLLM_PROTOCOL = (256, 100, 1024)  # nano-vllm's bench.py: requests, and lengths from .. to, each way
VOCAB_DRAWN = 10_000  # nano-vllm draws token ids in [0, 10000]
WARM_STEPS = 2  # untimed steps before a step is timed: Triton compiles a kernel on its first launch

TRACE_SHAPE = Shape(max_num_seqs=64, max_num_batched_tokens=2048)  # the issue's


def nano_shape(requests: int) -> Shape:
    # Every sequence can run at once (nano-vllm allows 512), and a step may prefill several prompts.
    return Shape(max_num_seqs=min(requests, 128), max_num_batched_tokens=4096)


@dataclass(frozen=True)
class Preset:
    """How big each section is and which runs it makes: fixed, so two runs of one preset measure the same work."""

    requests: int  # (a) sequences
    min_len: int  # (a) prompt and output lengths, uniform in [min_len, max_len] (nano-vllm: 100)
    max_len: int
    trace_requests: int  # (b)
    trace_prompt: tuple[int, int]  # (b) prompt lengths, uniform in this range
    trace_output: tuple[int, int]  # (b) output lengths
    batches: tuple[int, ...]  # (c) decode batch sizes
    context: tuple[int, int]  # (c) each sequence's context before it decodes
    timed_steps: int  # (c) unprofiled steps timed one by one
    profiled_steps: int  # (c) steps run under the profiler
    generate_tokens: int  # (c) kvcourse.generate at batch 1
    agree_requests: int  # (d)
    agree_prompt: tuple[int, int]
    agree_new: int
    hf_batch: int  # (a) Hugging Face generate's batch
    pilot: int  # requests in each untimed pilot run
    comparisons: bool  # (a), (b): also the runs no target needs (graphs off, paged-torch, HF generate)
    run_timeout_s: float | None  # a run still going after this long stops, recorded as timed out
    hf_configs: tuple[str, ...] = ("sdpa",)  # (a): Hugging Face's configurations tried (hf_serving.HF_CB_CONFIGS)
    protocol: tuple[int, int, int] = NANO_VLLM_PROTOCOL  # (a): the engine alone on the whole protocol, first
    profile_repeats: int = 3  # (c): rounds of timed_steps; the minimum of their medians is quoted


_FULL = Preset(requests=128, min_len=100, max_len=512, trace_requests=96, trace_prompt=(16, 1024),
               trace_output=(16, 256), batches=(1, 16, 64), context=(200, 1000), timed_steps=20, profiled_steps=5,
               generate_tokens=64, agree_requests=16, agree_prompt=(16, 256), agree_new=64, hf_batch=32, pilot=8,
               comparisons=True, run_timeout_s=None, hf_configs=tuple(HF_CB_CONFIGS))  # fmt: skip
PRESETS = {
    "full": _FULL,
    # make gpu-check's: the H100 runs of 2026-11-26 took 10-20 s for (c), 1-8 s for (b) with graphs, about
    # 8 s a pass of Hugging Face over 32 of (a)'s requests (two passes) and 26 s for (d): about 90 s with loading.
    # The lease tries the three configurations that warm up in seconds (torch.compile's take minutes).
    "lease": dataclasses.replace(
        _FULL, requests=32, comparisons=False, run_timeout_s=60.0, hf_configs=("sdpa", "eager", "sdpa+async")
    ),
    "smoke": Preset(
        requests=3,
        min_len=4,
        max_len=10,
        trace_requests=3,
        trace_prompt=(16, 32),
        trace_output=(4, 6),
        batches=(1, 4),
        context=(8, 24),
        timed_steps=2,
        profiled_steps=1,
        generate_tokens=4,
        agree_requests=2,
        agree_prompt=(8, 16),
        agree_new=4,
        hf_batch=2,
        pilot=1,
        comparisons=True,
        run_timeout_s=None,
        hf_configs=("sdpa", "eager", "sdpa+async"),
        protocol=(4, 4, 10),
        profile_repeats=2,
    ),
}


@dataclass
class Run:
    """What every section reads: the preset, both models (on the device, in the benchmark's dtype), the seed."""

    preset_name: str
    preset: Preset
    model: kvcourse.LlamaModel
    hf: object
    dtype: torch.dtype
    layers: int | None
    seed: int

    @property
    def device(self) -> torch.device:
        return self.model.device

    def deadline(self) -> float | None:
        """When a run starting now must stop (``time.perf_counter`` seconds), or None: never."""
        timeout = self.preset.run_timeout_s
        return None if timeout is None else time.perf_counter() + timeout


# ---- workloads ---------------------------------------------------------------------------------------


def nano_vllm_workload(n: int, lo: int, hi: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's ``bench.py`` draws, in its order: every prompt (its length, then its ids), then every
    output length. Output lengths come after all prompts, so ``n`` requests are not a prefix of ``2n``."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, VOCAB_DRAWN) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def uniform_trace(
    n: int, prompt: tuple[int, int], output: tuple[int, int], seed: int
) -> tuple[list[list[int]], list[int]]:
    """``n`` requests, prompt and output lengths uniform in the given ranges (both ends included), random ids."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt[0], prompt[1] + 1, n)
    output_lens = rng.integers(output[0], output[1] + 1, n)
    prompts = [rng.integers(0, VOCAB_DRAWN, int(k)).tolist() for k in prompt_lens]
    return prompts, [int(k) for k in output_lens]


# ---- running one measurement, guarded ---------------------------------------------------------------------


def attempt(name: str, run: Callable[[float | None], dict], deadline: float | None) -> dict:
    """Run one measurement (``run(deadline)``): an error is recorded (not raised), so one failing server
    leaves the rest of the section standing."""
    log(name)
    try:
        return run(deadline)
    except Exception as exc:  # noqa: BLE001 - the benchmark goes on; the JSON says what broke
        return error_record(exc)
    finally:
        free_memory()


def error_record(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"[:2000], "traceback": traceback.format_exc()[-3000:]}


def free_memory() -> None:
    """Drop what the last run left (an engine's pool and graphs) before the next one allocates its own."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- the engine's runs -----------------------------------------------------------------------------------


def make_engine(model, shape: Shape, num_blocks: int, backend: str, graphs: bool) -> tuple[Engine, str]:
    """The engine, and how its steps run: ``"captured"`` CUDA graphs (recorded when the engine starts), their
    ``"eager twin"`` (no CUDA: the same static-buffer forward run eagerly, ``cuda_graphs="eager"``) or ``"off"``."""
    on_cuda = model.device.type == "cuda"
    mode = "off" if not graphs else "capture" if on_cuda else "eager"
    eng = Engine(model, num_blocks=num_blocks, block_size=shape.block_size, max_num_seqs=shape.max_num_seqs,
                 max_num_batched_tokens=shape.max_num_batched_tokens, enable_chunked_prefill=True, backend=backend,
                 cuda_graphs=mode)  # fmt: skip
    return eng, {"off": "off", "capture": "captured", "eager": "eager twin"}[mode]


def run_engine(
    model, prompts, lens, shape: Shape, backend: str, graphs: bool, pilot: int, deadline: float | None
) -> dict:
    """Our engine: set up and piloted untimed, then the whole workload from the first ``add_request`` to
    the last token (each step reads its tokens back to the host, so the end is synchronised)."""
    t0 = time.perf_counter()
    num_blocks = pool_blocks(prompts, lens, shape.block_size)  # the whole workload fits: nobody waits for memory
    eng, mode = make_engine(model, shape, num_blocks, backend, graphs)
    pilot_prompts, pilot_lens = pilot_workload(prompts, pilot)
    pilot_params = [SamplingParams(max_new_tokens=n, stop_token_ids=()) for n in pilot_lens]
    eng.generate(pilot_prompts, pilot_params, use_tqdm=False)
    replays, steps = eng.runner.graph_steps, len(eng.events)
    mixed = eng.runner.graphs.replays["mixed"] if eng.runner.graphs is not None else 0
    sync(model.device)
    setup_s = time.perf_counter() - t0
    start = time.perf_counter()
    ids = [eng.add_request(p, SamplingParams(max_new_tokens=n, stop_token_ids=())) for p, n in zip(prompts, lens)]
    timed_out = False
    while eng.has_unfinished_requests():
        eng.step()
        if deadline is not None and time.perf_counter() > deadline:
            timed_out = True
            break
    sync(model.device)
    seconds = time.perf_counter() - start
    out = timed_result([eng.output(i) for i in ids], lens, seconds, setup_s, timed_out)
    out.update(
        backend=backend,
        graphs=mode,
        steps=len(eng.events) - steps,
        graph_steps=eng.runner.graph_steps - replays,  # steps served from a graph, of either kind
        mixed_graph_steps=(eng.runner.graphs.replays["mixed"] - mixed) if eng.runner.graphs else 0,
    )
    return out


# ---- comparing outputs ----------------------------------------------------------------------------------


def agreement(a: dict, b: dict) -> dict | None:
    """How many requests two runs decoded identically (both must have finished them all), and where the
    others first part ways (the token index, a sign of where a near-tie flipped)."""
    if not (a.get("outputs") and b.get("outputs")) or a.get("timed_out") or b.get("timed_out"):
        return None
    first = []
    for x, y in zip(a["outputs"], b["outputs"], strict=True):
        if x != y:
            first.append(next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y))))
    n = len(a["outputs"])
    return {"requests": n, "identical": n - len(first), "mismatching": len(first),
            "first_difference_median": statistics.median(first) if first else None}  # fmt: skip


def strip(run: dict) -> dict:
    """A run as the JSON keeps it: no token lists, times rounded."""
    out = {k: v for k, v in run.items() if k != "outputs"}
    for k in ("seconds", "tok_s"):
        if isinstance(out.get(k), float):
            out[k] = round(out[k], 4)
    return out


def ratio(a: dict, b: dict) -> float | None:
    if a.get("tok_s") and b.get("tok_s") and not (a.get("timed_out") or b.get("timed_out")):
        return a["tok_s"] / b["tok_s"]
    return None


# ---- (a), (b) and (d): one workload, several servers ------------------------------------------------------------


class Throughput:
    """One workload served by several servers, one run at a time."""

    def __init__(self, prompts, lens, shape: Shape, info: dict) -> None:
        self.prompts, self.lens, self.shape = prompts, lens, shape
        self.info = info | {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                            "output_tokens": sum(lens), "shape": asdict(shape)}  # fmt: skip
        self.runs: dict[str, dict] = {}

    def add(self, name: str, run: Callable[[float | None], dict], deadline: float | None) -> dict:
        """Run one server on the workload (see :func:`attempt`)."""
        result = self.runs[name] = attempt(name, run, deadline)
        if result.get("tok_s"):
            log(
                f"  {name}: {result['tok_s']:.0f} tok/s over {result['seconds']:.1f} s (setup {result['setup_s']} s)"
                + (" TIMED OUT" if result.get("timed_out") else "")
            )
        else:
            log(f"  {name}: {result.get('error')}")
        return result

    def add_engine(self, name: str, run: Run) -> dict:
        backend, graphs = ENGINE_RUNS[name]
        serve = lambda dl: run_engine(run.model, self.prompts, self.lens, self.shape, backend, graphs,  # noqa: E731
                                      run.preset.pilot, dl)  # fmt: skip
        return self.add(name, serve, run.deadline())

    def summary(self, comparisons: dict[str, tuple[str, str]]) -> dict:
        sec = dict(self.info)
        sec["runs"] = {name: strip(r) for name, r in self.runs.items()}
        sec["ratios"] = {key: ratio(self.runs.get(a, {}), self.runs.get(b, {})) for key, (a, b) in comparisons.items()}
        return sec


ENGINE_RUNS = {  # name -> (backend, graphs)
    "engine_triton_graphs": ("triton", True),
    "engine_triton_eager": ("triton", False),
    "engine_paged_torch": ("paged-torch", False),
}
COMPARED = {
    "graphs_on_over_off": ("engine_triton_graphs", "engine_triton_eager"),
    "triton_over_paged_torch": ("engine_triton_graphs", "engine_paged_torch"),
}


# ---- (c): one decode step --------------------------------------------------------------------------------


def profile_runner(model, sizes: Preset, graphs: bool, seed: int) -> dict:
    """Prefill ``max(batches)`` sequences on a ModelRunner (``"triton"``), then time decode steps of the
    first ``b`` of them for each batch size: ``runner.step`` plus the argmax read back to the host, which
    is what the engine pays per step besides scheduling and sampling."""
    device = model.device
    rng = np.random.default_rng(seed)
    most = max(sizes.batches)
    contexts = rng.integers(sizes.context[0], sizes.context[1] + 1, most)
    prompts = [rng.integers(0, VOCAB_DRAWN, int(c)).tolist() for c in contexts]
    per_batch = WARM_STEPS + sizes.profile_repeats * sizes.timed_steps + sizes.profiled_steps
    growth = len(sizes.batches) * per_batch + 1  # the most tokens any sequence adds
    num_blocks = sum(-(-(int(c) + growth) // BLOCK) for c in contexts)
    t0 = time.perf_counter()
    runner = ModelRunner(model, num_blocks, BLOCK, "triton", cuda_graphs=graphs, max_num_seqs=most)
    tokens: list[int] = []
    chunk: list[int] = []
    for i in range(most + 1):  # prefill a few prompts per step (up to 8192 tokens), as the engine would
        if chunk and (i == most or sum(len(prompts[j]) for j in chunk) + len(prompts[i]) > 8192):
            tokens += runner.step([(j, prompts[j]) for j in chunk]).argmax(-1).tolist()
            chunk = []
        if i < most:
            chunk.append(i)
    sync(device)  # with graphs, every one was recorded when the runner was made
    out = {
        "setup_s": round(time.perf_counter() - t0, 2),
        "context_tokens": [int(contexts.min()), int(contexts.max())],
        "batches": {},
    }
    for b in sizes.batches:

        def step(b: int = b) -> None:
            logits = runner.step([(i, [tokens[i]]) for i in range(b)])
            tokens[:b] = logits.argmax(-1).tolist()

        for _ in range(WARM_STEPS):
            step()
        replays = runner.graph_steps
        medians, fastest = [], float("inf")
        for _ in range(sizes.profile_repeats):  # a step's time moved 30% between runs: the least-disturbed round
            times = []
            for _ in range(sizes.timed_steps):
                sync(device)
                start = time.perf_counter()
                step()
                sync(device)
                times.append(1e3 * (time.perf_counter() - start))
            medians.append(statistics.median(times))
            fastest = min(fastest, *times)
        entry = {"step_ms_median": min(medians), "step_ms_medians": medians, "step_ms_min": fastest,
                 "steps_timed": sizes.profile_repeats * sizes.timed_steps,
                 "graph_steps": runner.graph_steps - replays}  # fmt: skip
        if profile_step is None:
            entry["profile"] = {"skipped": PROFILE_MISSING}
        else:
            try:
                entry["profile"] = profile_step(step, device, sizes.profiled_steps)
            except Exception as exc:  # noqa: BLE001
                entry["profile"] = error_record(exc)
        out["batches"][str(b)] = entry
        log(f"  batch {b}, graphs {'on' if graphs else 'off'}: {entry['step_ms_median']:.2f} ms a step")
    return out


def run_generate(model, sizes: Preset, seed: int) -> dict:
    """Chapter 2's loop at batch 1 (the issue's other baseline: 18.1 ms per output token on the H200)."""
    prompt = np.random.default_rng(seed).integers(0, VOCAB_DRAWN, 200).tolist()
    kvcourse.generate(model, prompt[:8], 2, eos_token_ids=())  # first calls are setup
    sync(model.device)
    start = time.perf_counter()
    out = kvcourse.generate(model, prompt, sizes.generate_tokens, eos_token_ids=())
    sync(model.device)
    seconds = time.perf_counter() - start
    return {"prompt_tokens": len(prompt), "new_tokens": len(out), "ms_per_token": 1e3 * seconds / len(out),
            "note": "prefill included, as a request's time"}  # fmt: skip


# ---- the sections, in the order they run: (c), (b), (a), (d) ------------------------------------------------


def step_profile_section(run: Run) -> dict:
    """(c): a decode step at each batch size, graphs on and off, and ``kvcourse.generate`` at batch 1."""
    p = run.preset
    sec = {"backend": "triton", "batches": list(p.batches), "context": list(p.context),
           "step": "ModelRunner.step of B one-token sequences plus the argmax read back to the host",
           "timed_steps": p.timed_steps, "profiled_steps": p.profiled_steps}  # fmt: skip
    for graphs in (True, False):
        key = "graphs_on" if graphs else "graphs_off"
        if graphs and run.device.type != "cuda":
            sec[key] = {"skipped": "CUDA graphs need a CUDA device"}
            continue
        sec[key] = attempt(
            f"(c) step profile, {key}", lambda dl, g=graphs: profile_runner(run.model, p, g, run.seed), None
        )
    sec["generate_batch_1"] = attempt("(c) generate", lambda dl: run_generate(run.model, p, run.seed), None)
    on, off = sec["graphs_on"].get("batches", {}), sec["graphs_off"].get("batches", {})
    sec["graphs_speedup"] = {b: off[b]["step_ms_median"] / on[b]["step_ms_median"] for b in on if b in off}
    return sec


def trace_section(run: Run) -> dict:
    """(b): the issue's trace through the engine with graphs (and, with the comparisons, without, and on paged-torch)."""
    p = run.preset
    prompts, lens = uniform_trace(p.trace_requests, p.trace_prompt, p.trace_output, run.seed)
    t = Throughput(prompts, lens, TRACE_SHAPE, {
        "trace": "prompt and output lengths uniform (numpy default_rng(seed).integers), random ids in [0, 10000]",
        "trace_prompt": list(p.trace_prompt), "trace_output": list(p.trace_output),
        "full_trace": {"requests": p.trace_requests, "prompt_tokens": sum(map(len, prompts)),
                       "output_tokens": sum(lens)}})  # fmt: skip
    for name in ENGINE_RUNS if p.comparisons else ["engine_triton_graphs"]:
        t.add_engine(name, run)
    return t.summary(COMPARED)


def nano_section(run: Run) -> dict:
    """(a): first the engine alone on nano-vllm's whole protocol; then the preset's draws through the engine and
    each Hugging Face continuous-batching configuration this machine can run (and, with the comparisons, the
    engine's other ways and Hugging Face ``generate``); (d)'s agreement in this dtype."""
    p = run.preset
    n, lo, hi = p.protocol
    full_prompts, full_lens = nano_vllm_workload(n, lo, hi, run.seed)
    full_shape = nano_shape(n)
    log(f"  the whole protocol: {n} requests of {lo}-{hi} tokens each way")
    whole = attempt(
        "(a) the whole protocol",
        lambda dl: run_engine(run.model, full_prompts, full_lens, full_shape, "triton", True, p.pilot, dl),
        run.deadline(),
    )
    prompts, lens = nano_vllm_workload(p.requests, p.min_len, p.max_len, run.seed)
    t = Throughput(prompts, lens, nano_shape(len(prompts)), {
        "protocol": "nano-vllm bench.py: random.seed, prompt lengths randint(min_len, max_len) of "
                    "randint(0, 10000) ids, output lengths randint(min_len, max_len), EOS ignored; "
                    "greedy here (nano-vllm: temperature 0.6)",
        "min_len": p.min_len, "max_len": p.max_len})  # fmt: skip
    t.add_engine("engine_triton_graphs", run)
    tried, skipped = runnable_configs(p.hf_configs, run.device.type == "cuda")
    for name in tried:  # "hf_cb": the first runs' configuration, under its old name
        t.add(
            hf_run_name(name),
            lambda dl, name=name: run_hf_cb(run.hf, prompts, lens, t.shape, p.pilot, dl, name),
            run.deadline(),
        )
    if p.comparisons:
        t.add_engine("engine_triton_eager", run)
        t.add_engine("engine_paged_torch", run)
        t.add("hf_generate", lambda dl: run_hf_generate(run.hf, prompts, lens, p.hf_batch, dl), run.deadline())
    best_name, best = best_hf_run({name: t.runs[hf_run_name(name)] for name in tried})
    sec = t.summary({"engine_over_hf_cb": ("engine_triton_graphs", "hf_cb"),
                     "engine_over_hf_generate": ("engine_triton_graphs", "hf_generate")} | COMPARED)  # fmt: skip
    sec["ratios"]["engine_over_hf_best"] = ratio(t.runs.get("engine_triton_graphs", {}), best or {})
    sec["hf_configs"] = {"tried": tried, "skipped": skipped, "best": best_name,
                         "described": {name: HF_CB_CONFIGS[name].note for name in p.hf_configs}}  # fmt: skip
    sec["whole_protocol"] = {"requests": n, "min_len": lo, "max_len": hi, "prompt_tokens": sum(map(len, full_prompts)),
                             "output_tokens": sum(full_lens), "shape": asdict(full_shape)} | strip(whole)  # fmt: skip
    r = t.runs
    sec["agreement"] = {
        "dtype": str(run.dtype).removeprefix("torch."),
        "triton_vs_paged_torch": agreement(r.get("engine_triton_graphs", {}), r.get("engine_paged_torch", {})),
        "graphs_on_vs_off": agreement(r.get("engine_triton_graphs", {}), r.get("engine_triton_eager", {})),
        "engine_vs_hf_cb": agreement(r.get("engine_triton_graphs", {}), r.get("hf_cb", {})),
    }
    return sec


def hf_run_name(config: str) -> str:
    return "hf_cb" if config == "sdpa" else f"hf_cb_{config}"


def agreement_section(run: Run) -> dict:
    """(d), fp32: the engine's three ways to decode must give the same tokens (graphs change no arithmetic, and
    in fp32 the two attention backends' different summation orders stay far from any argmax tie);
    Hugging Face's continuous batching should agree too, up to fp32's own rounding differences. The
    benchmark's own models serve when they already are fp32 (a CPU smoke run); else fp32 copies are loaded."""
    if run.dtype == torch.float32:
        model, hf = run.model, run.hf
    else:
        model = load_ours(run.device, torch.float32, run.layers)[0]
        hf = load_theirs(run.device, torch.float32, run.layers)
    fp32 = dataclasses.replace(run, model=model, hf=hf, dtype=torch.float32)
    p = run.preset
    prompts, lens = uniform_trace(p.agree_requests, p.agree_prompt, (p.agree_new, p.agree_new), run.seed + 1)
    t = Throughput(prompts, lens, Shape(max_num_seqs=len(prompts), max_num_batched_tokens=2048),
                   {"dtype": "float32", "new_tokens": p.agree_new, "prompt_range": list(p.agree_prompt)})  # fmt: skip
    for name in ENGINE_RUNS:
        t.add_engine(name, fp32)
    t.add("hf_cb", lambda dl: run_hf_cb(hf, prompts, lens, t.shape, p.pilot, dl), run.deadline())
    r = t.runs
    return {"fp32": t.info | {
        "runs": {name: strip(x) for name, x in r.items()},
        "graphs_on_vs_off": agreement(r["engine_triton_graphs"], r["engine_triton_eager"]),  # must be all identical
        "triton_vs_paged_torch": agreement(r["engine_triton_eager"], r["engine_paged_torch"]),  # must be all identical
        "engine_vs_hf_cb": agreement(r["engine_triton_graphs"], r["hf_cb"]),
    }}  # fmt: skip


SECTIONS = {  # key -> (title, section), in the order they run
    "step_profile": ("(c) step profile", step_profile_section),
    "issue_trace": ("(b) the issue's trace", trace_section),
    "nano_vllm": ("(a) nano-vllm protocol", nano_section),
    "agreement": ("(d) agreement in fp32", agreement_section),
}


def run_section(res: dict, key: str, run: Run) -> None:
    """Run one section into ``res[key]``, guarded: one section failing leaves the others standing."""
    title, section = SECTIONS[key]
    log(title)
    start = time.perf_counter()
    try:
        res[key] = section(run)
    except Exception as exc:  # noqa: BLE001
        res[key] = error_record(exc)
        log(f"{title} FAILED: {exc}")
    res.setdefault("section_seconds", {})[key] = round(time.perf_counter() - start, 1)
    free_memory()


# ---- loading ------------------------------------------------------------------------------------------------


# Both models come from the same GGUF, on ``device`` in ``dtype``, cut to their first ``layers`` decoder
# layers when asked (a smoke run's shortcut: the model is then no longer SmolLM2, and the JSON says so).


def load_ours(device: torch.device, dtype: torch.dtype, layers: int | None) -> tuple[kvcourse.LlamaModel, int]:
    """kvcourse's model, and how many layers it had before any cut."""
    model, _ = kvcourse.load_pretrained(dtype=dtype, device=device)
    total = model.config.num_hidden_layers
    if layers is not None and layers < total:
        model.layers = model.layers[:layers]
        model.config = dataclasses.replace(model.config, num_hidden_layers=layers)  # KV pools are sized by it
    return model, total


def load_theirs(device: torch.device, dtype: torch.dtype, layers: int | None):
    """Hugging Face's model (read from the GGUF in fp32 by ``bench_serving.load_hf``, then moved)."""
    hf = load_hf().to(device=device, dtype=dtype)
    if layers is not None and layers < hf.config.num_hidden_layers:
        hf.model.layers = hf.model.layers[:layers]
        hf.config.num_hidden_layers = layers  # its caches are sized by it too
        if getattr(hf.config, "layer_types", None):
            hf.config.layer_types = hf.config.layer_types[:layers]
    return hf


# ---- the report ------------------------------------------------------------------------------------------------


def target(value: float | None, goal: float, at_most: bool, as_issue: bool, note: str) -> dict:
    met = None if value is None else (value <= goal if at_most else value >= goal)
    return {"value": None if value is None else round(value, 4), "target": goal, "met": met,
            "issue_conditions": as_issue, "note": note}  # fmt: skip


def targets(res: dict, full_model: bool, cuda: bool) -> dict:
    """(e): issue 49's targets from this run's sections. A target whose number was not measured (a section
    failed, a run timed out) has ``value`` and ``met`` None; ``issue_conditions`` says whether it was measured as
    the issue means it (a GPU, the whole model, bf16, not the smoke preset; the full trace)."""
    nano, trace, prof = res.get("nano_vllm", {}), res.get("issue_trace", {}), res.get("step_profile", {})
    graphs = (trace.get("runs") or {}).get("engine_triton_graphs", {})
    tok_s = graphs.get("tok_s") if not graphs.get("timed_out") else None
    full_trace = (
        trace.get("requests") == 96
        and trace.get("trace_prompt") == [16, 1024]
        and trace.get("trace_output") == [16, 256]
    )
    step64 = ((prof.get("graphs_on") or {}).get("batches") or {}).get("64", {})
    idle64 = (step64.get("profile") or {}).get("gpu_idle_fraction")
    whole = nano.get("whole_protocol") or {}
    served = whole.get("finished") if whole.get("tok_s") and not whole.get("timed_out") else None
    configs = nano.get("hf_configs") or {}
    tried = len(configs["tried"]) if "tried" in configs else None
    base = cuda and full_model and res.get("dtype") == "bfloat16" and res.get("preset") != "smoke"
    whole_protocol = (whole.get("min_len"), whole.get("max_len")) == NANO_VLLM_PROTOCOL[1:]

    def entry(name: str, value, as_issue: bool, note: str) -> dict:
        goal, at_most = TARGETS[name]
        return target(value, goal, at_most, as_issue, note)

    return {
        "decode_step_batch_64_ms": entry(
            "decode_step_batch_64_ms", step64.get("step_ms_median"), base,
            "(c): a batch-64 decode step with CUDA graphs, unprofiled: the least of the rounds' median wall times"),
        "trace_tok_s": entry(
            "trace_tok_s", tok_s, base and full_trace, "(b): output tok/s on the issue's 96-request trace"
            + ("" if full_trace else f" (this run served {trace.get('requests')} of its requests)")),
        "engine_over_hf_best": entry(
            "engine_over_hf_best", (nano.get("ratios") or {}).get("engine_over_hf_best"), base,
            f"(a): engine (triton, CUDA graphs) over the fastest Hugging Face configuration tried "
            f"({configs.get('best')}), output tok/s" + (f" ({nano['requests']} requests)" if "requests" in nano else "")),
        "hf_configs_tried": entry("hf_configs_tried", tried, base,
                                  f"(a): Hugging Face configurations run; skipped: {configs.get('skipped')}"),
        "gpu_idle_fraction_batch_64": entry(
            "gpu_idle_fraction_batch_64", idle64, base,
            "(c): the share of a profiled batch-64 decode step's wall time in which no kernel ran (CUDA graphs on)"),
        "nano_vllm_requests": entry(
            "nano_vllm_requests", served, base and whole_protocol,
            f"(a): requests of nano-vllm's protocol ({whole.get('min_len')}-{whole.get('max_len')} tokens each way) "
            f"the engine served in one run"),
    }  # fmt: skip


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else f"{x:{spec}}"


def print_report(res: dict) -> None:
    rows: list[tuple[str, str]] = []
    for key, title in (("nano_vllm", "(a) nano-vllm protocol"), ("issue_trace", "(b) the issue's trace")):
        sec = res.get(key, {})
        if "error" in sec:
            rows.append((title, sec["error"][:80]))
            continue
        for name, r in (sec.get("runs") or {}).items():
            if r.get("tok_s"):
                value = f"{r['tok_s']:.0f} tok/s" + (" (timed out)" if r.get("timed_out") else "")
            else:
                value = r.get("skipped") or r.get("error", "")[:80]
            rows.append((f"{title}: {name}", value))
    prof = res.get("step_profile", {})
    for key in ("graphs_on", "graphs_off"):
        for b, e in ((prof.get(key) or {}).get("batches") or {}).items():
            p = e.get("profile", {})
            rows.append((f"(c) decode step, batch {b}, {key.replace('_', ' ')}",
                         f"{e['step_ms_median']:.2f} ms (busy {fmt(p.get('device_busy_ms'), '.2f')} ms, "
                         f"{fmt(p.get('kernel_launches'))} launches, "
                         f"{fmt(p.get('aten_calls'))} aten calls)"))  # fmt: skip
    gen = prof.get("generate_batch_1", {})
    if "ms_per_token" in gen:
        rows.append(("(c) kvcourse.generate, batch 1", f"{gen['ms_per_token']:.2f} ms per token"))
    fp32 = (res.get("agreement") or {}).get("fp32", {})
    for key in ("graphs_on_vs_off", "triton_vs_paged_torch", "engine_vs_hf_cb"):
        a = fp32.get(key)
        if a:
            rows.append((f"(d) fp32 {key}", f"{a['identical']} of {a['requests']} identical"))
    for key, a in ((res.get("nano_vllm") or {}).get("agreement") or {}).items():
        if isinstance(a, dict):
            rows.append((f"(d) {res['dtype']} {key} on (a)", f"{a['identical']} of {a['requests']} identical"))
    for name, t in (res.get("targets") or {}).items():
        met = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        rows.append((f"(e) {name}", f"{fmt(t['value'], '.3g')} vs {t['target']:g}: {met}"
                     + ("" if t["issue_conditions"] else " (not the issue's conditions)")))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    print(
        f"{res['provenance'].get('gpu', 'CPU')}, {res['dtype']}, {res['model']['layers']} layers"
        f"{' (smoke run: numbers mean nothing)' if res['smoke'] else ''}"
    )
    for name, value in rows:
        print(f"  {name:{width}s}  {value}")


def errors_in(node, path: str = "") -> list[str]:
    """Where the results recorded an error (a section, a run, a profile), as paths like ``nano_vllm.runs.hf_cb``."""
    if not isinstance(node, dict):
        return []
    found = [path or "(top)"] if "error" in node else []
    for key, value in node.items():
        found += errors_in(value, f"{path}.{key}" if path else key)
    return found


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


# ---- main ------------------------------------------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "fp32": torch.float32, "float32": torch.float32}  # fmt: skip


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_engine_gpu.py", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="full (default on a GPU), lease (make gpu-check's, about 90 s), smoke (tiny; on a CPU)",
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for the smoke preset")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on a GPU, fp32 on a CPU")
    parser.add_argument(
        "--layers", type=int, help="keep only the first N decoder layers (default: all; 2 for a CPU smoke run)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON goes")
    parser.add_argument("--note", default="", help="recorded with the results")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error(
            "--device cuda: no CUDA GPU here (torch.cuda.is_available() is False); "
            "--device cpu --preset smoke is the smoke run"
        )
    args.preset = args.preset or ("full" if args.device.type == "cuda" else "smoke")
    if args.device.type == "cpu" and args.preset != "smoke":
        parser.error(
            f"--preset {args.preset}: on a CPU only the smoke preset is meant to run "
            "(the CPU benchmark is bench_engine.py)"
        )
    if args.layers is None and args.preset == "smoke" and args.device.type == "cpu":
        args.layers = 2  # Triton's interpreter runs every kernel program in Python: 30 layers take minutes
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    args.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.type == "cuda" else torch.float32)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.perf_counter()
    device, dtype, preset = args.device, args.dtype, PRESETS[args.preset]
    from kvcourse.bench.kernels import provenance
    from kvcourse.kernels import fused

    import transformers

    prov = provenance(device) | {"cpu_cores": os.cpu_count(), "transformers": transformers.__version__}
    log(
        f"{prov.get('gpu', 'CPU')}, torch {prov['torch']}, triton {prov['triton']}, "
        f"transformers {prov['transformers']}; preset {args.preset}"
    )
    res: dict = {
        "benchmark": "bench_engine_gpu", "provenance": prov, "device": device.type,
        "dtype": str(dtype).removeprefix("torch."), "preset": args.preset,
        "smoke": args.preset == "smoke" or device.type != "cuda", "seed": args.seed,
        "note": args.note, "sizes": asdict(preset), "issue_baseline_tok_s": ISSUE_TOK_S,
        "fused_triton": fused.USE_TRITON,  # whether the layer's small ops ran as Triton kernels
        "step_profile_available": profile_step is not None,
    }  # fmt: skip

    if device.type == "cpu":
        # A graph's padding lanes attend to no key: 0 / 0 in a row nobody reads, which Triton's interpreter
        # computes with NumPy, and NumPy warns about (tests/test_cuda_graphs.py says the same).
        warnings.filterwarnings("ignore", "invalid value encountered in divide", RuntimeWarning)
    log(f"loading both models on {device} in {res['dtype']}")
    model, total_layers = load_ours(device, dtype, args.layers)
    hf = load_theirs(device, dtype, args.layers)
    res["model"] = {"name": "SmolLM2-135M-Instruct (GGUF)", "layers": model.config.num_hidden_layers,
                    "of_layers": total_layers, "truncated": model.config.num_hidden_layers < total_layers}  # fmt: skip
    run = Run(args.preset, preset, model, hf, dtype, args.layers, args.seed)
    for key in SECTIONS:
        run_section(res, key, run)

    res["targets"] = targets(res, not res["model"]["truncated"], device.type == "cuda")
    res["wall_s"] = round(time.perf_counter() - start, 1)
    # A target missed is a finding; an error is a failure (make gpu-check marks the job failed), JSON written anyway.
    res["errors"] = errors_in({k: v for k, v in res.items() if k != "targets"})
    order = ("nano_vllm", "issue_trace", "step_profile", "agreement", "targets")
    res = {k: v for k, v in res.items() if k not in order} | {k: res[k] for k in order if k in res}
    print_report(res)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"gpu-engine-{slug(prov.get('gpu', 'cpu'))}-{prov['date'][:10]}.json"
    path.write_text(json.dumps(res, indent=1, default=str) + "\n")
    log(f"wrote {path}")
    if res["errors"]:
        log(f"errors in: {', '.join(res['errors'])}")
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
