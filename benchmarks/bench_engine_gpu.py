"""The engine on a GPU (issue 29): throughput against Hugging Face, CUDA graphs on and off, where a step goes.

    python benchmarks/bench_engine_gpu.py [--device cuda] [--dtype bf16] [--requests 128] [--max-len 512]
                                          [--budget SECONDS] [--quick] [--layers N] [--seed 0]
                                          [--out benchmarks/results] [--note TEXT]
    python benchmarks/bench_engine.py --device cuda ...      # the same benchmark, the issue's command

Everything runs in one process on one GPU, on one set of weights: SmolLM2-135M from the local GGUF, loaded
once by :func:`kvcourse.load_pretrained` and once by Hugging Face (``bench_serving.load_hf``), both moved to
the GPU in the same dtype. Every ratio divides two numbers measured minutes apart on the same GPU.

(a) **nano-vllm's benchmark, scaled down** (``nano_vllm``). nano-vllm's ``bench.py`` draws 256 sequences
    with Python's ``random.seed(0)``: prompts of ``randint(100, 1024)`` random token ids (each
    ``randint(0, 10000)``), outputs of ``randint(100, 1024)`` tokens with EOS ignored, and reports output
    tokens over wall time. Here the same draws with ``--requests`` (128) sequences and lengths up to
    ``--max-len`` (512), so the run fits a short GPU lease, decoded greedily (nano-vllm samples at
    temperature 0.6). Served by the engine (``"triton"`` backend, CUDA graphs on, then off), by the engine
    on ``"paged-torch"``, by Hugging Face's continuous batching with its CUDA graphs on (no
    ``torch.compile``), all sized alike, and by Hugging Face ``generate`` on left-padded batches of 32.
(b) **The issue's trace** (``issue_trace``): 96 requests, prompts uniform in 16-1024 tokens, outputs
    uniform in 16-256 (seed 0, no EOS), blocks of 16, 64 running sequences, 2048 tokens a step: the
    trace on which the first GPU run measured 991 output tok/s (H200, bf16, before CUDA graphs). The
    engine with graphs on and off, and ``"paged-torch"``.
(c) **One decode step** (``step_profile``): 64 sequences of 200-1000 tokens of context on a
    :class:`~kvcourse.serving.ModelRunner`, then batches of 1, 16 and 64 decode one token each, graphs on
    and off: the median wall time of a step (unprofiled, the device synchronised around each), and one
    profiled run (:func:`kvcourse.serving.step_profile.profile_step`: wall and device-busy time, kernel
    launches, framework calls, ops that wait for the device). ``kvcourse.generate`` at batch 1 beside it.
(d) **Agreement** (``agreement``): in fp32, a small workload through the engine with graphs on, off and on
    ``"paged-torch"`` (greedy tokens must be identical: mismatching requests are counted) and through
    Hugging Face's continuous batching (identical requests counted). In the benchmark's dtype, how many
    of (a)'s requests the ``"triton"`` and ``"paged-torch"`` engines decode alike: in bf16 two correct
    implementations that add in different orders part ways after a near-tie (a finding, not a failure).
(e) **Targets** (``targets``), each ``{"value", "target", "met"}`` from this run's own numbers: engine /
    Hugging Face continuous batching >= 1.5 on (a), the trace at >= 15 x 991 tok/s, a batch-64 decode step
    in <= 3 ms.

Setup (loading, allocating pools, capturing graphs, a short untimed pilot run that compiles the kernels;
for Hugging Face's continuous batching on a GPU, a whole untimed pass, see :func:`run_hf_cb`) is never
inside a timed window. ``--budget SECONDS`` bounds the whole run, setup included (``make gpu-check``
gives it 90 s): (c) runs first at its fixed size; what is left is shared between (b), (a) and (d), in
that order, and (a) and (b) take as many of their requests as their share fits (the JSON says how many);
the comparisons that no target needs (graphs off, ``"paged-torch"``, ``generate``) run last, each only if
its estimated time fits; a run that outlives its time stops and is recorded as timed out. Without
``--budget`` everything runs at full size. Every section is guarded: one that fails records its error and
the others still run.

Without a GPU, ``--device cpu --quick`` is a smoke test of the same code (``tests/test_bench_engine_gpu.py``):
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
import inspect
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from bench_serving import left_padded, load_hf, pool_blocks

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine, ModelRunner

try:  # issue 29's profiler of one step; a checkout without it still measures everything else
    from kvcourse.serving.step_profile import profile_step
except ImportError as exc:  # pragma: no cover - depends on the checkout
    profile_step = None
    PROFILE_MISSING = f"kvcourse.serving.step_profile is not importable here ({exc})"

ISSUE_TOK_S = 991.0  # the engine on the issue's trace, first H200 run (bf16, backend="triton", no graphs)
TARGETS = {"engine_over_hf_cb": 1.5, "trace_speedup": 15.0, "decode_step_batch_64_ms": 3.0}
VOCAB_DRAWN = 10_000  # nano-vllm draws token ids in [0, 10000]
BLOCK = 16
WARM_STEPS = 2  # untimed steps before a step is timed: Triton compiles a kernel on its first launch


@dataclass(frozen=True)
class Shape:
    """How a server is sized: both ours and Hugging Face's get the same numbers."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = BLOCK


TRACE_SHAPE = Shape(max_num_seqs=64, max_num_batched_tokens=2048)  # the issue's


def nano_shape(requests: int) -> Shape:
    # Every sequence can run at once (nano-vllm allows 512), and a step may prefill several prompts.
    return Shape(max_num_seqs=min(requests, 128), max_num_batched_tokens=4096)


@dataclass
class Sizes:
    """How big each section is. ``--quick`` shrinks them all; ``--budget`` shrinks (a) and (b) at run time."""

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


def sizes_for(args: argparse.Namespace) -> Sizes:
    if args.quick:
        return Sizes(args.requests or 3, 4, args.max_len or 10, 3, (16, 32), (4, 6), (1, 4), (8, 24), 2, 1, 4,
                     2, (8, 16), 4, 2, 1)  # fmt: skip
    return Sizes(args.requests or 128, 100, args.max_len or 512, 96, (16, 1024), (16, 256), (1, 16, 64), (200, 1000),
                 20, 5, 64, 16, (16, 256), 64, 32, 8)  # fmt: skip


# ---- workloads ---------------------------------------------------------------------------------------


def nano_vllm_workload(n: int, lo: int, hi: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's ``bench.py`` draws, in its order: every prompt (its length, then its ids), then every
    output length. Output lengths come after all prompts, so ``n`` requests are not a prefix of ``2n``:
    a budget that serves fewer requests takes the first ones of the full draw instead."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, VOCAB_DRAWN) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    return prompts, [rng.randint(lo, hi) for _ in range(n)]


def uniform_trace(n: int, prompt: tuple[int, int], output: tuple[int, int],
                  seed: int) -> tuple[list[list[int]], list[int]]:
    """``n`` requests, prompt and output lengths uniform in the given ranges (both ends included), random ids."""
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt[0], prompt[1] + 1, n)
    output_lens = rng.integers(output[0], output[1] + 1, n)
    prompts = [rng.integers(0, VOCAB_DRAWN, int(k)).tolist() for k in prompt_lens]
    return prompts, [int(k) for k in output_lens]


def pilot_workload(prompts: Sequence[Sequence[int]], k: int) -> tuple[list[list[int]], list[int]]:
    """``k`` short requests whose prompts span the workload's lengths (shortest to longest), 4 new tokens
    each: run untimed first, so the timed run pays for no kernel compilation and no first allocation."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    picks = [order[round(j * (len(order) - 1) / max(k - 1, 1))] for j in range(min(k, len(order)))]
    return [list(prompts[i]) for i in picks], [4] * len(picks)


# ---- the time budget ------------------------------------------------------------------------------------

# What a run of each server is guessed to cost before this process has measured it: output tok/s on an
# H200 in bf16 (the eager engine and paged-torch as the first GPU run measured them; the others guessed
# low on purpose, so a first estimate overshoots rather than a run overrunning), and seconds of setup.
GUESS_TOK_S = {"engine-graphs": 3000.0, "engine-eager": 900.0, "engine-paged-torch": 800.0, "hf-cb": 800.0,
               "hf-generate": 600.0}  # fmt: skip
GUESS_SETUP_S = {"engine-graphs": 6.0, "engine-eager": 3.0, "engine-paged-torch": 3.0, "hf-cb": 15.0,
                 "hf-generate": 3.0}  # fmt: skip


class Budget:
    """Seconds left for the whole run, and what each server has been seen to cost (to size what follows).

    Without ``--budget`` nothing is ever skipped or cut short. With it, an estimate is a server's setup
    plus the output tokens at its rate (measured in this run once it has run, else guessed, with 30%
    margin), and :meth:`deadline` gives a run the time left minus what is reserved for later runs.
    """

    def __init__(self, seconds: float | None, device: torch.device) -> None:
        self.seconds, self.start = seconds, time.perf_counter()
        self.cuda = device.type == "cuda"
        scale = 1.0 if self.cuda else 0.01  # a CPU smoke run: nothing is sized from these
        self.tok_s = {k: v * scale for k, v in GUESS_TOK_S.items()}
        self.setup_s = dict(GUESS_SETUP_S)
        self.measured: set[str] = set()
        self.notes: list[str] = []

    @property
    def limited(self) -> bool:
        return self.seconds is not None

    def spent(self) -> float:
        return time.perf_counter() - self.start

    def left(self) -> float:
        return math.inf if self.seconds is None else self.seconds - self.spent()

    def estimate(self, server: str, tokens: int) -> float:
        margin = 1.0 if server in self.measured else 1.3
        passes = 2 if server == "hf-cb" and self.cuda else 1  # its warm pass (see run_hf_cb)
        return self.setup_s[server] + margin * passes * tokens / self.tok_s[server]

    def observe(self, server: str, result: dict) -> None:
        """Learn a server's rate and setup time from a finished run."""
        if result.get("tok_s") and not result.get("timed_out"):
            self.tok_s[server] = result["tok_s"]
            self.setup_s[server] = result.get("setup_s", self.setup_s[server])
            self.measured.add(server)

    def deadline(self, reserve: float = 0.0) -> float | None:
        """When a run must stop (``time.perf_counter`` seconds), leaving ``reserve`` seconds for later runs."""
        if self.seconds is None:
            return None
        return time.perf_counter() + max(self.left() - reserve, 5.0)


def attempt(name: str, run: Callable[[float | None], dict], budget: Budget, estimate: float, *, required: bool,
            reserve: float = 0.0) -> dict:
    """Run one measurement: skipped if it is optional and its estimate does not fit the time left; an
    error recorded (not raised), so one failing server leaves the rest of the section standing."""
    left = budget.left() - reserve
    if budget.limited and not required and estimate > left:
        budget.notes.append(f"{name}: skipped (about {estimate:.0f} s needed, {max(left, 0):.0f} s left)")
        return {"skipped": f"budget: about {estimate:.0f} s needed, {max(left, 0):.0f} s left"}
    log(f"{name} (estimate {estimate:.0f} s, {budget.left():.0f} s left)")
    try:
        return run(budget.deadline(reserve))
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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- one timed run per server: a dict with the time, the tokens, and the outputs (kept out of the JSON) --


def timed_result(outputs: list[list[int]], lens: Sequence[int], seconds: float, setup_s: float,
                 timed_out: bool) -> dict:
    n = sum(len(o) for o in outputs)
    return {"seconds": seconds, "output_tokens": n, "tok_s": n / seconds if seconds > 0 else None,
            "setup_s": round(setup_s, 2), "requests": len(lens),
            "finished": sum(len(o) >= k for o, k in zip(outputs, lens)), "timed_out": timed_out,
            "outputs": outputs}  # fmt: skip


def make_engine(model, shape: Shape, num_blocks: int, backend: str, graphs: bool) -> tuple[Engine, str]:
    """The engine, and how its steps run: ``"captured"`` CUDA graphs (recorded when the engine starts), their
    ``"eager twin"`` (no CUDA: the same static-buffer forward run eagerly, ``cuda_graphs="eager"``) or ``"off"``."""
    on_cuda = model.device.type == "cuda"
    mode = "off" if not graphs else "capture" if on_cuda else "eager"
    eng = Engine(model, num_blocks=num_blocks, block_size=shape.block_size, max_num_seqs=shape.max_num_seqs,
                 max_num_batched_tokens=shape.max_num_batched_tokens, enable_chunked_prefill=True, backend=backend,
                 cuda_graphs=mode)  # fmt: skip
    return eng, {"off": "off", "capture": "captured", "eager": "eager twin"}[mode]


def run_engine(model, prompts, lens, shape: Shape, backend: str, graphs: bool, pilot: int,
               deadline: float | None) -> dict:
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
    out.update(backend=backend, graphs=mode, steps=len(eng.events) - steps,
               graph_steps=eng.runner.graph_steps - replays,  # steps served from a graph, of either kind
               mixed_graph_steps=(eng.runner.graphs.replays["mixed"] - mixed) if eng.runner.graphs else 0)
    return out


def hf_cb_config(shape: Shape, num_blocks: int, cuda_graphs: bool) -> tuple[object, dict]:
    """Hugging Face's ``ContinuousBatchingConfig`` sized like the engine, with only the fields this
    transformers version has (the GPU machine's may be older than ``constraints.txt``'s)."""
    from transformers import ContinuousBatchingConfig

    wanted = dict(page_size=shape.block_size, num_blocks=num_blocks, max_batch_tokens=shape.max_num_batched_tokens,
                  max_requests_per_batch=shape.max_num_seqs, use_cuda_graph=cuda_graphs,
                  # No torch.compile (minutes of compiling), no prefix sharing (the engine runs without its cache).
                  default_compile_level=0, allow_block_sharing=False)  # fmt: skip
    if not cuda_graphs:  # on a CPU: no double buffering, no decode fast path (it needs flash attention on a GPU)
        wanted.update(use_async_batching=False, max_blocks_per_request=0)
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if "page_size" not in fields and "block_size" in fields:  # before transformers 5.17 a page was a block
        wanted["block_size"] = wanted.pop("page_size")
    kept = {k: v for k, v in wanted.items() if k in fields}
    return ContinuousBatchingConfig(**kept), {"asked": kept, "not_in_this_version": sorted(set(wanted) - set(kept))}


def collect(manager, ids: list[str], deadline: float | None) -> dict:
    """Wait for every request's final result, the manager's thread dying, or the deadline."""
    results = {}
    while len(results) < len(ids):
        r = manager.get_result(timeout=0.5)
        if r is not None and r.is_finished():
            results[r.request_id] = r
        elif r is None and not manager.is_running():
            break
        if deadline is not None and time.perf_counter() > deadline:
            break
    return results


def run_hf_cb(hf, prompts, lens, shape: Shape, pilot: int, deadline: float | None) -> dict:
    """Hugging Face continuous batching: started, warmed up and piloted untimed, then timed from the first
    ``add_request`` to the last result.

    With CUDA graphs, Hugging Face captures a graph for each padded batch shape the first time it meets
    one, so its first pass over a workload pays for captures our engine made at start-up
    (``capture_all``). It therefore serves the whole workload once untimed (``warm_pass_s``), and the
    timed pass replays the same shapes: both servers are timed warm.
    """
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    cuda = hf.device.type == "cuda"
    cb, asked = hf_cb_config(shape, pool_blocks(prompts, lens, shape.block_size), cuda_graphs=cuda)
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(lens))  # greedy, no EOS
    manager = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    # The generation config already says "no EOS"; versions whose add_request takes it are told again.
    no_eos = {"eos_token_id": -1} if "eos_token_id" in inspect.signature(manager.add_request).parameters else {}

    def serve(ps, ns, until: float | None) -> tuple[list[str], dict]:
        ids = [manager.add_request(p, max_new_tokens=n, **no_eos) for p, n in zip(ps, ns)]
        return ids, collect(manager, ids, until)

    warm_pass_s, timed_out = None, False
    try:
        if hasattr(manager, "warmup"):
            manager.warmup()
        manager.start()
        serve(*pilot_workload(prompts, pilot), None)
        attn = getattr(hf.config, "_attn_implementation", None)  # as it ran (stop() may switch it back)
        if cuda:
            warm = time.perf_counter()
            _, results = serve(prompts, lens, deadline)
            warm_pass_s = round(time.perf_counter() - warm, 2)
            timed_out = len(results) < len(prompts)
        sync(hf.device)
        setup_s = time.perf_counter() - t0 - (warm_pass_s or 0.0)
        start = time.perf_counter()
        ids, results = serve(prompts, lens, deadline) if not timed_out else ([], {})
        seconds = time.perf_counter() - start
        timed_out = timed_out or len(results) < len(prompts)
    finally:
        resolved = getattr(manager, "continuous_batching_config", None)
        if manager.is_running():  # stop() on a manager whose thread never started raises, hiding the real error
            manager.stop(block=True)
        if hasattr(manager, "destroy"):
            manager.destroy()
    outputs = [list(results[i].generated_tokens) if i in results else [] for i in ids] or [[] for _ in prompts]
    out = timed_result(outputs, lens, seconds, setup_s, timed_out)
    out["warm_pass_s"] = warm_pass_s
    out["errors"] = sum(i not in results or getattr(results[i], "error", None) is not None for i in ids)
    out["config"] = asked | {"resolved": {k: repr(getattr(resolved, k)) for k in (
        "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "use_cuda_graph", "use_async_batching",
        "max_blocks_per_request") if hasattr(resolved, k)}}  # fmt: skip
    out["attn_implementation"] = attn
    return out


def run_hf_generate(hf, prompts, lens, batch: int, deadline: float | None) -> dict:
    """Hugging Face ``generate`` on left-padded batches of ``batch`` prompts, greedy: each batch decodes
    until its longest output is done (the padding and the wasted rows are this baseline's cost)."""
    import transformers

    device = hf.device
    t0 = time.perf_counter()
    with torch.inference_mode():  # one tiny call first: CUDA's and cuBLAS's first-call costs are setup
        warm = torch.tensor([[1, 2, 3, 4]], device=device)
        hf.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                    pad_token_id=0)
    sync(device)
    setup_s = time.perf_counter() - t0
    outputs: list[list[int]] = [[] for _ in prompts]
    start, timed_out = time.perf_counter(), False
    for first in range(0, len(prompts), batch):
        rows = range(first, min(first + batch, len(prompts)))
        input_ids, mask = left_padded([prompts[i] for i in rows])
        longest = max(lens[i] for i in rows)
        config = transformers.GenerationConfig(max_new_tokens=longest, min_new_tokens=longest, do_sample=False,
                                               pad_token_id=0, eos_token_id=None)  # fmt: skip
        with torch.inference_mode():
            seqs = hf.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), generation_config=config)
        new = seqs[:, input_ids.shape[1] :].tolist()  # to the host: the batch is done
        for row, i in enumerate(rows):
            outputs[i] = new[row][: lens[i]]
        if deadline is not None and time.perf_counter() > deadline and rows[-1] + 1 < len(prompts):
            timed_out = True
            break
    seconds = time.perf_counter() - start
    out = timed_result(outputs, lens, seconds, setup_s, timed_out)
    out["batch"] = batch
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


# ---- (a) and (b): throughput ----------------------------------------------------------------------------


class Throughput:
    """One workload served by several servers; runs are added one at a time (the budget decides which)."""

    def __init__(self, prompts, lens, shape: Shape, info: dict) -> None:
        self.prompts, self.lens, self.shape = prompts, lens, shape
        self.info = info | {"requests": len(prompts), "prompt_tokens": sum(map(len, prompts)),
                            "output_tokens": sum(lens), "shape": asdict(shape)}  # fmt: skip
        self.runs: dict[str, dict] = {}

    def tokens(self) -> int:
        return sum(self.lens)

    def add(self, name: str, server: str, run: Callable[[float | None], dict], budget: Budget, *, required: bool,
            reserve: float = 0.0, learn: bool = True) -> dict:
        """Run one server on the workload (see :func:`attempt`); ``learn``: its rate sizes later runs."""
        result = attempt(name, run, budget, budget.estimate(server, self.tokens()), required=required, reserve=reserve)
        result["server"] = server
        if learn:
            budget.observe(server, result)
        self.runs[name] = result
        if result.get("tok_s"):
            log(f"  {name}: {result['tok_s']:.0f} tok/s over {result['seconds']:.1f} s (setup {result['setup_s']} s)"
                + (" TIMED OUT" if result.get("timed_out") else ""))  # fmt: skip
        else:
            log(f"  {name}: {result.get('error') or result.get('skipped')}")
        return result

    def summary(self, comparisons: dict[str, tuple[str, str]]) -> dict:
        sec = dict(self.info)
        sec["runs"] = {name: strip(r) for name, r in self.runs.items()}
        sec["ratios"] = {key: ratio(self.runs.get(a, {}), self.runs.get(b, {})) for key, (a, b) in comparisons.items()}
        return sec


ENGINE_RUNS = {  # name -> (backend, graphs, budget key)
    "engine_triton_graphs": ("triton", True, "engine-graphs"),
    "engine_triton_eager": ("triton", False, "engine-eager"),
    "engine_paged_torch": ("paged-torch", False, "engine-paged-torch"),
}


def add_engine(t: Throughput, name: str, model, sizes: Sizes, budget: Budget, *, required: bool, reserve: float = 0.0,
               learn: bool = True) -> dict:
    backend, graphs, server = ENGINE_RUNS[name]
    run = lambda dl: run_engine(model, t.prompts, t.lens, t.shape, backend, graphs, sizes.pilot, dl)  # noqa: E731
    return t.add(name, server, run, budget, required=required, reserve=reserve, learn=learn)


def fit_requests(budget: Budget, seconds: float, per_request_s: float, lo: int, hi: int) -> int:
    """How many requests (between ``lo`` and ``hi``) fit ``seconds`` at ``per_request_s`` each."""
    if not budget.limited:
        return hi
    return int(max(lo, min(hi, seconds // max(per_request_s, 1e-9))))


# ---- (c): one decode step --------------------------------------------------------------------------------


def profile_runner(model, sizes: Sizes, graphs: bool, seed: int) -> dict:
    """Prefill ``max(batches)`` sequences on a ModelRunner (``"triton"``), then time decode steps of the
    first ``b`` of them for each batch size: ``runner.step`` plus the argmax read back to the host, which
    is what the engine pays per step besides scheduling and sampling."""
    device = model.device
    rng = np.random.default_rng(seed)
    most = max(sizes.batches)
    contexts = rng.integers(sizes.context[0], sizes.context[1] + 1, most)
    prompts = [rng.integers(0, VOCAB_DRAWN, int(c)).tolist() for c in contexts]
    per_batch = WARM_STEPS + sizes.timed_steps + sizes.profiled_steps
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
    out = {"setup_s": round(time.perf_counter() - t0, 2), "context_tokens": [int(contexts.min()), int(contexts.max())],
           "batches": {}}  # fmt: skip
    for b in sizes.batches:

        def step(b: int = b) -> None:
            logits = runner.step([(i, [tokens[i]]) for i in range(b)])
            tokens[:b] = logits.argmax(-1).tolist()

        for _ in range(WARM_STEPS):
            step()
        replays = runner.graph_steps
        times = []
        for _ in range(sizes.timed_steps):
            sync(device)
            start = time.perf_counter()
            step()
            sync(device)
            times.append(1e3 * (time.perf_counter() - start))
        entry = {"step_ms_median": statistics.median(times), "step_ms_min": min(times), "steps_timed": len(times),
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


def run_generate(model, sizes: Sizes, seed: int) -> dict:
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


def step_profile_section(model, sizes: Sizes, budget: Budget, seed: int) -> dict:
    cuda = model.device.type == "cuda"
    sec = {"backend": "triton", "batches": list(sizes.batches), "context": list(sizes.context),
           "step": "ModelRunner.step of B one-token sequences plus the argmax read back to the host",
           "timed_steps": sizes.timed_steps, "profiled_steps": sizes.profiled_steps}  # fmt: skip
    for graphs in (True, False):
        key = "graphs_on" if graphs else "graphs_off"
        if graphs and not cuda:
            sec[key] = {"skipped": "CUDA graphs need a CUDA device"}
            continue
        log(f"(c) step profile, graphs {'on' if graphs else 'off'}")
        sec[key] = attempt(key, lambda dl, g=graphs: profile_runner(model, sizes, g, seed), budget, 0.0, required=True)
    sec["generate_batch_1"] = attempt("generate", lambda dl: run_generate(model, sizes, seed), budget, 0.0,
                                      required=True)
    on, off = sec["graphs_on"].get("batches", {}), sec["graphs_off"].get("batches", {})
    sec["graphs_speedup"] = {b: off[b]["step_ms_median"] / on[b]["step_ms_median"] for b in on if b in off}
    return sec


# ---- (d): agreement ---------------------------------------------------------------------------------------


def agreement_section(device: torch.device, args: argparse.Namespace, sizes: Sizes, budget: Budget,
                      loaded: tuple | None = None) -> dict:
    """fp32: the engine's three ways to decode must give the same tokens (graphs change no arithmetic, and
    in fp32 the two attention backends' different summation orders stay far from any argmax tie);
    Hugging Face's continuous batching should agree too, up to fp32's own rounding differences.
    ``loaded``: the benchmark's own ``(model, hf)`` when they already are fp32 (a CPU smoke run)."""
    if loaded is None:
        loaded = load_ours(device, torch.float32, args.layers)[0], load_theirs(device, torch.float32, args.layers)
    model, hf = loaded
    new = (sizes.agree_new, sizes.agree_new)
    prompts, lens = uniform_trace(sizes.agree_requests, sizes.agree_prompt, new, args.seed + 1)
    shape = Shape(max_num_seqs=len(prompts), max_num_batched_tokens=2048)
    t = Throughput(prompts, lens, shape, {"dtype": "float32", "new_tokens": sizes.agree_new,
                                          "prompt_range": list(sizes.agree_prompt)})  # fmt: skip
    # learn=False: rates of a tiny fp32 workload would misjudge (a) and (b).
    for name in ENGINE_RUNS:
        add_engine(t, name, model, sizes, budget, required=True, learn=False)
    t.add("hf_cb", "hf-cb", lambda dl: run_hf_cb(hf, prompts, lens, shape, sizes.pilot, dl), budget, required=True,
          learn=False)  # fmt: skip
    r = t.runs
    return {"fp32": t.info | {
        "runs": {name: strip(run) for name, run in r.items()},
        "graphs_on_vs_off": agreement(r["engine_triton_graphs"], r["engine_triton_eager"]),  # must be all identical
        "triton_vs_paged_torch": agreement(r["engine_triton_eager"], r["engine_paged_torch"]),  # must be all identical
        "engine_vs_hf_cb": agreement(r["engine_triton_graphs"], r["hf_cb"]),
    }}  # fmt: skip


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
    """(e): issue 29's three targets from this run's sections. A target whose number was not measured (a
    section failed, a run timed out) has ``value`` and ``met`` None; ``issue_conditions`` says whether it
    was measured as the issue means it (a GPU, the whole model, bf16, full sizes; the full trace)."""
    nano, trace, prof = res.get("nano_vllm", {}), res.get("issue_trace", {}), res.get("step_profile", {})
    ratio_hf = (nano.get("ratios") or {}).get("engine_over_hf_cb")
    graphs = (trace.get("runs") or {}).get("engine_triton_graphs", {})
    tok_s = graphs.get("tok_s") if not graphs.get("timed_out") else None
    full_trace = (trace.get("requests") == 96 and trace.get("trace_prompt") == [16, 1024]
                  and trace.get("trace_output") == [16, 256])  # fmt: skip
    step64 = ((prof.get("graphs_on") or {}).get("batches") or {}).get("64", {}).get("step_ms_median")
    base = cuda and full_model and res.get("dtype") == "bfloat16" and not res.get("quick")
    shrunk = nano.get("requests") != nano.get("requested")
    return {
        "engine_over_hf_cb": target(
            ratio_hf, TARGETS["engine_over_hf_cb"], False, base,
            "(a): engine (triton, CUDA graphs) over Hugging Face continuous batching (CUDA graphs), output tok/s"
            + (f" ({nano.get('requests')} of {nano.get('requested')} requests: the budget's)" if shrunk else "")),
        "trace_tok_s": target(
            tok_s, TARGETS["trace_speedup"] * ISSUE_TOK_S, False, base and full_trace,
            f"(b): output tok/s on the issue's trace, against {TARGETS['trace_speedup']:g} x {ISSUE_TOK_S:g}"
            + ("" if full_trace else f" (this run served {trace.get('requests')} of its requests)")),
        "decode_step_batch_64_ms": target(
            step64, TARGETS["decode_step_batch_64_ms"], True, base,
            "(c): median wall time of a batch-64 decode step with CUDA graphs, unprofiled"),
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
    print(f"{res['provenance'].get('gpu', 'CPU')}, {res['dtype']}, {res['model']['layers']} layers"
          f"{' (smoke run: numbers mean nothing)' if res['smoke'] else ''}")  # fmt: skip
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
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke run with --quick")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default bf16 on a GPU, fp32 on a CPU")
    parser.add_argument("--requests", type=int, help="(a) sequences (default 128; 4 with --quick)")
    parser.add_argument("--max-len", type=int, help="(a) longest prompt and output (default 512; 16 with --quick)")
    parser.add_argument("--budget", type=float, help="seconds for the whole run, setup included (default: none)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run")
    parser.add_argument("--layers", type=int,
                        help="keep only the first N decoder layers (default: all; 2 for a CPU smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON goes")
    parser.add_argument("--note", default="", help="recorded with the results")
    args = parser.parse_args(argv)
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False); "
                     "--device cpu --quick is the smoke run")
    if args.device.type == "cpu" and not args.quick:
        parser.error("on a CPU only the smoke run (--quick) is meant to run: the CPU benchmark is bench_engine.py")
    if args.layers is None and args.quick and args.device.type == "cpu":
        args.layers = 2  # Triton's interpreter runs every kernel program in Python: 30 layers take minutes
    args.dtype = DTYPES[args.dtype] if args.dtype else (torch.bfloat16 if args.device.type == "cuda" else torch.float32)
    for name in ("requests", "max_len", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {value}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    device, dtype = args.device, args.dtype
    budget = Budget(args.budget, device)
    sizes = sizes_for(args)
    if sizes.max_len < sizes.min_len:
        sizes.min_len = sizes.max_len
    from kvcourse.bench.kernels import provenance
    from kvcourse.kernels import fused

    import transformers

    prov = provenance(device) | {"cpu_cores": os.cpu_count(), "transformers": transformers.__version__}
    log(f"{prov.get('gpu', 'CPU')}, torch {prov['torch']}, triton {prov['triton']}, "
        f"transformers {prov['transformers']}")
    res: dict = {
        "benchmark": "bench_engine_gpu", "provenance": prov, "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "quick": args.quick, "smoke": args.quick or device.type != "cuda", "budget_s": args.budget, "seed": args.seed,
        "note": args.note, "sizes": asdict(sizes), "issue_baseline_tok_s": ISSUE_TOK_S,
        # Whether the fused layer kernels ran as Triton (another branch adds the switch; None: not in this checkout).
        "fused_triton": getattr(fused, "USE_TRITON", None),
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
    full_model = not res["model"]["truncated"]

    def section(key: str, title: str, run: Callable[[], dict], more: bool = False) -> None:
        """Run one section, guarded; ``more``: a second pass over a section that already has results
        (its optional runs): a failure then is recorded beside them, not over them."""
        log(f"{title}: {budget.left():.0f} s left" if budget.limited else title)
        start = time.perf_counter()
        try:
            res[key] = run()
        except Exception as exc:  # noqa: BLE001 - one section failing leaves the others standing
            if more and isinstance(res.get(key), dict):
                res[key]["optional_runs_error"] = error_record(exc)
            else:
                res[key] = error_record(exc)
            log(f"{title} FAILED: {exc}")
        seconds = res.setdefault("section_seconds", {})
        seconds[key] = round(seconds.get(key, 0.0) + time.perf_counter() - start, 1)
        free_memory()

    # The order serves the budget: (c), then the runs the targets need ((b), then (a)), then (d), then the
    # comparisons no target needs. What is left after (c) is shared out: 30% to (b), 40% to (a), 30% to (d);
    # a run may overrun its share into what later sections were promised, up to half of it.
    section("step_profile", "(c) step profile", lambda: step_profile_section(model, sizes, budget, args.seed))
    after_c = budget.left()

    def share(fraction: float) -> float:
        return fraction * after_c if budget.limited else 0.0  # without a budget nothing is reserved

    nano_prompts, nano_lens = nano_vllm_workload(sizes.requests, sizes.min_len, sizes.max_len, args.seed)
    trace_prompts, trace_lens = uniform_trace(sizes.trace_requests, sizes.trace_prompt, sizes.trace_output, args.seed)
    state: dict[str, Throughput] = {}

    def trace_required() -> dict:
        per_request = 1.3 * sum(trace_lens) / len(trace_lens) / budget.tok_s["engine-graphs"]
        n = fit_requests(budget, share(0.3) - budget.setup_s["engine-graphs"], per_request,
                         min(8, sizes.trace_requests), sizes.trace_requests)  # fmt: skip
        t = state["trace"] = Throughput(trace_prompts[:n], trace_lens[:n], TRACE_SHAPE, {
            "trace": "prompt and output lengths uniform (numpy default_rng(seed).integers), random ids in [0, 10000]",
            "trace_prompt": list(sizes.trace_prompt), "trace_output": list(sizes.trace_output),
            "full_trace": {"requests": sizes.trace_requests, "prompt_tokens": sum(map(len, trace_prompts)),
                           "output_tokens": sum(trace_lens)}})  # fmt: skip
        add_engine(t, "engine_triton_graphs", model, sizes, budget, required=True, reserve=share(0.35))
        return trace_summary()

    def trace_summary() -> dict:
        return state["trace"].summary({
            "graphs_on_over_off": ("engine_triton_graphs", "engine_triton_eager"),
            "triton_over_paged_torch": ("engine_triton_graphs", "engine_paged_torch"),
        })  # fmt: skip

    def nano_required() -> dict:
        # Hugging Face serves the workload twice on a GPU (a warm pass, then the timed one).
        passes = 2 if device.type == "cuda" else 1
        seconds_per_token = 1 / budget.tok_s["engine-graphs"] + passes / budget.tok_s["hf-cb"]
        per_request = 1.3 * (sizes.min_len + sizes.max_len) / 2 * seconds_per_token
        spare = budget.left() - share(0.3) - budget.setup_s["engine-graphs"] - budget.setup_s["hf-cb"]
        n = fit_requests(budget, spare, per_request, min(8, sizes.requests), sizes.requests)
        prompts, lens = nano_prompts[:n], nano_lens[:n]
        t = state["nano"] = Throughput(prompts, lens, nano_shape(n), {
            "protocol": "nano-vllm bench.py: random.seed, prompt lengths randint(min_len, max_len) of "
                        "randint(0, 10000) ids, output lengths randint(min_len, max_len), EOS ignored; "
                        "greedy here (nano-vllm: temperature 0.6)",
            "min_len": sizes.min_len, "max_len": sizes.max_len, "requested": sizes.requests,
            "shrunk_by_budget": n < sizes.requests})  # fmt: skip
        add_engine(t, "engine_triton_graphs", model, sizes, budget, required=True, reserve=share(0.15))
        hf_run = lambda dl: run_hf_cb(hf, prompts, lens, t.shape, sizes.pilot, dl)  # noqa: E731
        t.add("hf_cb", "hf-cb", hf_run, budget, required=True, reserve=share(0.15))
        return nano_summary()

    def nano_summary() -> dict:
        t = state["nano"]
        sec = t.summary({"engine_over_hf_cb": ("engine_triton_graphs", "hf_cb"),
                         "engine_over_hf_generate": ("engine_triton_graphs", "hf_generate"),
                         "graphs_on_over_off": ("engine_triton_graphs", "engine_triton_eager"),
                         "triton_over_paged_torch": ("engine_triton_graphs", "engine_paged_torch")})  # fmt: skip
        # (d)'s second half: the same comparisons in the benchmark's dtype, on (a)'s requests.
        r = t.runs
        sec["agreement"] = {
            "dtype": res["dtype"],
            "triton_vs_paged_torch": agreement(r.get("engine_triton_graphs", {}), r.get("engine_paged_torch", {})),
            "graphs_on_vs_off": agreement(r.get("engine_triton_graphs", {}), r.get("engine_triton_eager", {})),
            "engine_vs_hf_cb": agreement(r.get("engine_triton_graphs", {}), r.get("hf_cb", {})),
        }  # fmt: skip
        return sec

    def nano_optional() -> dict:
        t = state["nano"]
        add_engine(t, "engine_triton_eager", model, sizes, budget, required=False)
        add_engine(t, "engine_paged_torch", model, sizes, budget, required=False)
        t.add("hf_generate", "hf-generate", lambda dl: run_hf_generate(hf, t.prompts, t.lens, sizes.hf_batch, dl),
              budget, required=False)  # fmt: skip
        return nano_summary()

    def trace_optional() -> dict:
        t = state["trace"]
        add_engine(t, "engine_triton_eager", model, sizes, budget, required=False)
        add_engine(t, "engine_paged_torch", model, sizes, budget, required=False)
        return trace_summary()

    section("issue_trace", "(b) the issue's trace", trace_required)
    section("nano_vllm", "(a) nano-vllm protocol", nano_required)
    fp32 = (model, hf) if dtype == torch.float32 else None  # a CPU smoke run: the models already are fp32
    section("agreement", "(d) agreement in fp32", lambda: agreement_section(device, args, sizes, budget, fp32))
    if "nano" in state:
        section("nano_vllm", "(a) the other servers", nano_optional, more=True)
    if "trace" in state:
        section("issue_trace", "(b) graphs off and paged-torch", trace_optional, more=True)

    res["targets"] = targets(res, full_model, device.type == "cuda")
    res["budget"] = {"seconds": args.budget, "spent_s": round(budget.spent(), 1), "notes": budget.notes,
                     "rates_used_tok_s": {k: round(v, 1) for k, v in budget.tok_s.items()}}  # fmt: skip
    res["wall_s"] = round(budget.spent(), 1)
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
