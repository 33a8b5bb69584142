"""The budget of one decode step at GPU speed: the bytes it must read, the kernels it must run, and the host work
around them; what CUDA graphs take off it, and what overlapping the host with the GPU could.

Chapter 9 (*A step at GPU speed*) reads the committed GPU runs through this module on any machine, and measures
the same step live when it runs on a GPU:

* :func:`step_bytes` and :func:`bytes_floor_ms` -- what a decode step must read (every weight once, every running
  sequence's K and V) and the time that takes at the GPU's peak bandwidth: the roofline's floor;
* :func:`kernel_floor_ms` -- the floor the step's kernel count sets, whatever their bytes: a kernel takes a few
  microseconds even when it has nothing to do, and a graph replays kernels, it does not merge them;
* :func:`overlap_bound` -- the best a step can do when the host prepares step *n + 1* while the GPU runs step *n*
  (not built in the engine yet: the bound is what it would gain);
* :func:`engine_run_lines`, :func:`step_figures`, :func:`trace_split` and :func:`plot_trace_split` -- the committed
  ``gpu-engine-*.json`` and ``gpu-trace-profile-*.json`` walked once here, so the page calls one function;
* :func:`measure_decode_step` -- a batch of one-token decode steps timed live on the device, eagerly or replayed
  from CUDA graphs, as ``benchmarks/bench_engine_gpu.py`` times it for the committed runs.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "bytes_floor_ms",
    "engine_run_lines",
    "kernel_floor_ms",
    "measure_decode_step",
    "overlap_bound",
    "plot_trace_split",
    "step_bytes",
    "step_figures",
    "trace_split",
]

_CONFIG_KEYS = ("num_hidden_layers", "num_key_value_heads", "head_dim")


def _positive(name: str, value: Any, integer: bool = False) -> None:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or not value > 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a positive {'int' if integer else 'number'}, got {value!r}")


def _non_negative(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or not math.isfinite(value):
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def step_bytes(num_parameters: int, config: Any, seq_lens: Sequence[int], dtype_bytes: int = 2) -> int:
    """The bytes one decode step must read: every weight once, whatever the batch, plus the K and V of every
    cached token of every sequence in the batch (``seq_lens``: each sequence's context, the new token included),
    in every layer and KV head. ``config`` has ``num_hidden_layers``, ``num_key_value_heads`` and ``head_dim``
    (a model's ``config`` or a dict). Activations are left out: at decode they are a few KiB per sequence."""
    _positive("num_parameters", num_parameters, integer=True)
    _positive("dtype_bytes", dtype_bytes, integer=True)
    get = config.get if isinstance(config, Mapping) else lambda k: getattr(config, k, None)
    dims = {k: get(k) for k in _CONFIG_KEYS}
    for k, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"config must give {k} as a positive int, got {v!r}")
    if isinstance(seq_lens, (str, bytes)) or not isinstance(seq_lens, Sequence) or not seq_lens:
        raise ValueError(f"seq_lens must be a non-empty list of context lengths, got {seq_lens!r}")
    for n in seq_lens:
        _positive("every entry of seq_lens", n, integer=True)
    kv_per_token = 2 * dims["num_hidden_layers"] * dims["num_key_value_heads"] * dims["head_dim"] * dtype_bytes
    return num_parameters * dtype_bytes + kv_per_token * sum(seq_lens)


def bytes_floor_ms(num_bytes: float, bandwidth: float) -> float:
    """Milliseconds to move ``num_bytes`` at ``bandwidth`` bytes per second: no step that reads them is faster."""
    _non_negative("num_bytes", num_bytes)
    _positive("bandwidth", bandwidth)
    return 1e3 * num_bytes / bandwidth


def kernel_floor_ms(kernels: int, kernel_us: float) -> float:
    """Milliseconds that ``kernels`` kernels take on the GPU at ``kernel_us`` microseconds each, at least: the
    floor a step's kernel count sets, graph or not (a graph removes the host's launches, not the kernels)."""
    _non_negative("kernels", kernels)
    _non_negative("kernel_us", kernel_us)
    return kernels * kernel_us / 1e3


def overlap_bound(step_ms: float, host_ms: float, gpu_ms: float) -> dict[str, float]:
    """What overlapping the host with the GPU can gain on a step of ``step_ms``, of which the host works
    ``host_ms`` and the GPU is busy ``gpu_ms``. With the host preparing step *n + 1* while the GPU runs step *n*,
    a step still takes the longer of the two: ``best_ms = max(host_ms, gpu_ms)``, never more than ``step_ms``.
    Returns ``best_ms``, ``saving_ms`` (``step_ms - best_ms``) and ``speedup`` (``step_ms / best_ms``)."""
    for name, value in (("step_ms", step_ms), ("host_ms", host_ms), ("gpu_ms", gpu_ms)):
        _positive(name, value)
    if max(host_ms, gpu_ms) > step_ms:
        raise ValueError(
            f"host_ms ({host_ms}) and gpu_ms ({gpu_ms}) are parts of the step: neither can exceed step_ms ({step_ms})"
        )
    best = max(host_ms, gpu_ms)
    return {"best_ms": best, "saving_ms": step_ms - best, "speedup": step_ms / best}


def _need(data: Any, name: str, *keys: str) -> Any:
    """``data[keys[0]][keys[1]]...``, or a ValueError naming the argument and the missing key."""
    for i, key in enumerate(keys):
        if not isinstance(data, Mapping) or key not in data:
            raise ValueError(f"{name} has no {'.'.join(keys[: i + 1])}: is it the committed result it should be?")
        data = data[key]
    return data


def engine_run_lines(run: dict, name: str = "") -> list[str]:
    """A committed ``gpu-engine-*.json`` (``benchmarks/bench_engine_gpu.py``) as the lines the page prints: a
    decode step before and after CUDA graphs at each batch size, the engines' throughputs on nano-vllm's protocol
    and on the 96-request trace, how many outputs agree in fp32 and bf16, and the targets."""
    profile = _need(run, "run", "step_profile")
    nv = _need(run, "run", "nano_vllm")
    trace = _need(run, "run", "issue_trace", "runs", "engine_triton_graphs")
    lines = [f"{name + ': ' if name else ''}{run.get('provenance', {}).get('gpu')}, {run.get('dtype')}"]
    for graphs in ("graphs_off", "graphs_on"):
        for batch, entry in (profile.get(graphs, {}).get("batches") or {}).items():
            p = entry.get("profile", {})
            # The profile's device-busy time is left out: these runs counted the forward's GPU span in it too.
            lines.append(
                f"  batch {batch:>3}, {graphs.replace('_', ' '):10s}: wall {entry['step_ms_median']:6.2f} ms,"
                f" {p.get('aten_calls', 0):5.0f} framework calls, {p.get('sync_ops', 0):3.0f} syncs"
            )
    runs = ", ".join(f"{k} {r['tok_s']:,.0f}" for k, r in nv.get("runs", {}).items() if "tok_s" in r)
    lines.append(f"  nano-vllm's protocol, {nv.get('requests')} requests: {runs} output tok/s")
    lines.append(
        f"  the 96-request trace: {trace['tok_s']:,.0f} output tok/s, {trace['graph_steps']} of "
        f"{trace['steps']} steps from a graph"
    )
    for dtype, agree in (("fp32", run.get("agreement", {}).get("fp32", {})), ("bf16", nv.get("agreement", {}))):
        counts = ", ".join(
            f"{k.replace('_', ' ')} {v['identical']} of {v['requests']}"
            for k, v in agree.items()
            if isinstance(v, dict) and "identical" in v
        )
        lines.append(f"  {dtype}, identical outputs: {counts}")
    for target, t in run.get("targets", {}).items():
        lines.append(f"  target {target}: {t['value']} against {t['target']} ({'met' if t['met'] else 'not met'})")
    return lines


def _prompt_kinds(by_kind: Mapping) -> list[str]:
    return [k for k in ("mixed", "prefill") if k in by_kind]


def trace_split(by_kind: Mapping) -> dict[str, float]:
    """A trace profile's ``by_kind`` (``gpu-trace-profile-*.json``, one run) as seconds of host work and of waiting
    for the GPU, for decode steps and for steps that feed prompts. The wait is the ``sample`` part: the host
    reading the sampled tokens back, which waits for the step's kernels to finish."""
    out = {}
    for kind, keys in (("decode", ["decode"]), ("prompt", _prompt_kinds(by_kind))):
        for k in keys:
            _need(by_kind, "by_kind", k, "parts_s", "sample")
        waited = sum(by_kind[k]["parts_s"]["sample"] for k in keys)
        out[f"{kind}_host_s"] = sum(by_kind[k]["seconds"] for k in keys) - waited
        out[f"{kind}_wait_s"] = waited
    return out


def plot_trace_split(before: Mapping, after: Mapping, ax: Any, gpu: str = "H100, bf16") -> None:
    """Two bars on ``ax``: the trace's seconds with decode graphs only (``before``) and with every step from a
    graph (``after``), each split by :func:`trace_split` into host work and waiting, decode and prompt steps."""
    rows = [("decode steps from graphs", before), ("every step from a graph", after)]
    parts = [
        ("decode steps: host work", "decode_host_s"),
        ("decode steps: waiting for the GPU", "decode_wait_s"),
        ("steps with prompts: host work", "prompt_host_s"),
        ("steps with prompts: waiting for the GPU", "prompt_wait_s"),
    ]
    colors = ["#4c72b0", "#a6bddb", "#dd8452", "#fdd0a2"]
    for y, (_, kinds) in enumerate(rows):
        split, left = trace_split(kinds), 0.0
        for (name, key), color in zip(parts, colors):
            ax.barh(y, split[key], left=left, color=color, label=name if y == 0 else None)
            left += split[key]
        ax.text(left + 0.05, y, f"{left:.2f} s", va="center")
    ax.set_yticks(range(len(rows)), [label for label, _ in rows])
    ax.set_xlabel(f"seconds to serve the 96-request trace ({gpu})")
    ax.set_xlim(0, 1.15 * before["all"]["seconds"])
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2, fontsize=8, frameon=False)
    ax.set_title(
        f"Steps with prompts from graphs too: the trace in {after['all']['seconds']:.2f} s, "
        f"not {before['all']['seconds']:.1f} s"
    )


def step_figures(
    run: dict, profile: dict, first: dict, engine_runs: Sequence[dict], num_parameters: int, bandwidth: float
) -> dict[str, str]:
    """The figures chapter 9 quotes from the committed GPU runs, by the glue name the page gives each, formatted
    as the page prints them. ``run``: the newest ``gpu-engine-*.json``; ``profile``: the newest
    ``gpu-trace-profile-*.json``; ``first``: the first trace profile, taken under torch's profiler;
    ``engine_runs``: every committed ``gpu-engine-*.json`` (the ratio against Hugging Face by requests);
    ``num_parameters`` and ``bandwidth`` (bytes/s, the profiled GPU's peak): the weights' floor.
    Raises ValueError if the runs do not say what the chapter's prose says of them."""
    _positive("num_parameters", num_parameters, integer=True)
    _positive("bandwidth", bandwidth)
    nv = _need(run, "run", "nano_vllm")
    trace = _need(run, "run", "issue_trace", "runs", "engine_triton_graphs")
    off = _need(run, "run", "step_profile", "graphs_off", "batches", "64")
    on = _need(run, "run", "step_profile", "graphs_on", "batches", "64")
    before = _need(profile, "profile", "runs", "decode-graphs", "by_kind")
    after = _need(profile, "profile", "runs", "graphs", "by_kind")
    checks = {
        "a replayed step never waits for the device": on["profile"]["sync_ops"] == 0,
        "the same kernels with and without graphs": off["profile"]["kernel_launches"]
        == on["profile"]["kernel_launches"],
        "every step of the engine's trace replayed a graph": trace["graph_steps"] == trace["steps"],
        "the profile's last run replayed every step": after["all"]["graph_steps"] == after["all"]["steps"],
        "no step with prompts replayed before mixed graphs": before["mixed"]["graph_steps"] == 0,
        "graphs for every step cut the trace's time by 3x": after["all"]["seconds"] < before["all"]["seconds"] / 3,
    }
    wrong = [what for what, ok in checks.items() if not ok]
    if wrong:
        raise ValueError(f"the committed runs no longer show: {'; '.join(wrong)}")
    f: dict[str, str] = {}
    f["gpu_name"] = run["provenance"]["gpu"].removeprefix("NVIDIA ")
    f["gpu_off_ms"] = f"{off['step_ms_median']:.0f}"
    f["gpu_on_ms"] = f"{on['step_ms_median']:.1f}"
    f["gpu_launches"] = f"{on['profile']['kernel_launches']:.0f}"
    f["gpu_off_calls"] = f"{off['profile']['aten_calls']:,.0f}"
    f["gpu_off_syncs"] = f"{off['profile']['sync_ops']:.0f}"
    f["gpu_on_calls"] = f"{on['profile']['aten_calls']:.0f}"
    f["gpu_nv_requests"] = str(nv["requests"])
    f["gpu_engine_toks"] = f"{nv['runs']['engine_triton_graphs']['tok_s']:,.0f}"
    f["gpu_hf_toks"] = f"{nv['runs']['hf_cb']['tok_s']:,.0f}"
    f["gpu_over_hf"] = f"{nv['ratios']['engine_over_hf_cb']:.1f}"
    f["gpu_trace_toks"] = f"{trace['tok_s']:,.0f}"
    f["gpu_trace_x"] = f"{trace['tok_s'] / run['issue_baseline_tok_s']:.1f}"
    f["gpu_trace_target"] = f"{trace['tok_s'] / run['targets']['trace_tok_s']['target']:.2f}"
    f["gpu_baseline_toks"] = f"{run['issue_baseline_tok_s']:,.0f}"
    # Triton launches happen only in eager steps (a replay launches none): the first profile, under the profiler.
    profiled = _need(first, "first", "runs", "profiled")
    launches = dict((k, n) for k, n, _ in profiled["profile"]["top_host"])["cuLaunchKernelEx"]
    eager_steps = profiled["by_kind"]["all"]["steps"] - profiled["by_kind"]["all"]["graph_steps"]
    f["trace_triton_launches"] = f"{launches / eager_steps:.0f}"
    prompt_kinds = _prompt_kinds(before)
    f["trace_prompt_steps"] = str(sum(before[k]["steps"] for k in prompt_kinds))
    f["trace_steps"] = str(before["all"]["steps"])
    f["trace_before_s"] = f"{before['all']['seconds']:.1f}"
    f["trace_before_prompt_s"] = f"{sum(before[k]['seconds'] for k in prompt_kinds):.1f}"
    f["trace_before_mixed_ms"] = f"{before['mixed']['median_ms']:.0f}"
    f["trace_before_mixed_max_ms"] = f"{before['mixed']['max_ms']:.0f}"
    cudnn = [r for r in profile["sdpa_new_shapes"]["rows"] if r["cudnn"]]
    f["cudnn_first_ms"] = f"{np.median([r['first_ms'] for r in cudnn]):.0f}"
    f["cudnn_second_ms"] = f"{np.median([r['second_ms'] for r in cudnn]):.2f}"
    f["no_cudnn_mixed_ms"] = f"{profile['runs']['no-cudnn']['by_kind']['mixed']['median_ms']:.0f}"
    f["trace_after_s"] = f"{after['all']['seconds']:.2f}"
    f["trace_after_mixed_ms"] = f"{after['mixed']['median_ms']:.1f}"
    f["trace_after_decode_ms"] = f"{after['decode']['median_ms']:.1f}"
    dec = after["decode"]
    host_s = dec["seconds"] - dec["parts_s"]["sample"]
    f["trace_decode_host_ms"] = f"{1e3 * host_s / dec['steps']:.1f}"
    f["trace_decode_wait_ms"] = f"{1e3 * dec['parts_s']['sample'] / dec['steps']:.1f}"
    # The same trace without CUDA graphs: what a GPU runtime runs by default.
    eager = profile["runs"]["eager"]["by_kind"]
    f["gpu_eager_mixed_ms"] = f"{eager['mixed']['median_ms']:.0f}"
    f["gpu_eager_decode_ms"] = f"{eager['decode']['median_ms']:.0f}"
    # Which configuration of Hugging Face's continuous batching ran, as the result file recorded it.
    hf_cb = nv["runs"]["hf_cb"]
    f["gpu_hf_attn"] = str(hf_cb["attn_implementation"])
    f["gpu_hf_compile"] = str(hf_cb["config"]["asked"]["default_compile_level"])
    f["gpu_hf_async"] = str(hf_cb["config"]["resolved"]["use_async_batching"])
    f["gpu_hf_max_blocks"] = str(hf_cb["config"]["resolved"]["max_blocks_per_request"])
    f["gpu_eager_toks"] = f"{nv['runs']['engine_triton_eager']['tok_s']:,.0f}"
    by_requests = sorted(
        (r["nano_vllm"]["requests"], r["nano_vllm"]["ratios"]["engine_over_hf_cb"]) for r in engine_runs
    )
    f["gpu_over_hf_by_requests"] = ", ".join(f"{x:.1f}× at {n}" for n, x in by_requests)
    # The whole budget of a decode step, every step from a graph.
    step_ms, gpu_ms = 1e3 * dec["seconds"] / dec["steps"], 1e3 * dec["forward_gpu_s"] / dec["steps"]
    weights_ms = bytes_floor_ms(num_parameters * 2, bandwidth)  # bf16 weights read once: a floor the cache raises
    if not weights_ms < gpu_ms < step_ms:
        raise ValueError(
            f"the decode step's budget is out of order: weights {weights_ms:.2f} ms, GPU span "
            f"{gpu_ms:.2f} ms, step {step_ms:.2f} ms"
        )
    profiled_run = profile["runs"]["profiled"]
    device_ops = {n: (calls, ms) for n, calls, ms in profiled_run["profile"]["top_device"]}
    paged_calls, paged_ms = device_ops["_paged_decode_kernel"]
    f["dec_step_ms"] = f"{step_ms:.2f}"
    f["dec_gpu_ms"] = f"{gpu_ms:.2f}"
    f["dec_weights_ms"] = f"{weights_ms:.2f}"
    f["dec_overlap_ms"] = f"{step_ms - gpu_ms:.2f}"
    f["dec_kernels"] = f"{profiled_run['profile']['kernels'] / profiled_run['by_kind']['all']['steps']:.0f}"
    f["dec_paged_us"] = f"{1e3 * paged_ms / paged_calls:.1f}"
    return f


def measure_decode_step(
    model: Any, batch: int, context: tuple[int, int] = (200, 1000), graphs: bool = True, steps: int = 20, seed: int = 0
) -> dict[str, float]:
    """Time one-token decode steps of ``batch`` sequences live on ``model``'s device, each with a context drawn
    from ``context`` (inclusive), on a ModelRunner with the ``"triton"`` backend, replayed from CUDA graphs or
    not (``graphs``): ``step_ms`` (the median of ``steps`` steps, the argmax read back included, as the committed
    runs time it) and ``context_tokens`` (their sum, for :func:`step_bytes`). A CUDA device only: graphs and the
    Triton kernels need one (on a CPU the chapter reads the committed runs instead)."""
    import torch

    from .model_runner import ModelRunner

    device = model.device
    if device.type != "cuda":
        raise ValueError(f"model must be on a CUDA device to time a GPU step live, got {device}")
    _positive("batch", batch, integer=True)
    _positive("steps", steps, integer=True)
    lo, hi = context
    _positive("context[0]", lo, integer=True)
    if not (isinstance(hi, int) and hi >= lo):
        raise ValueError(f"context must be (low, high) with high >= low, got {context!r}")
    rng = np.random.default_rng(seed)
    lens = [int(n) for n in rng.integers(lo, hi + 1, batch)]
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, n).tolist() for n in lens]
    block = 16
    num_blocks = sum(-(-(n + steps + 8) // block) for n in lens)
    runner = ModelRunner(model, num_blocks, block, "triton", cuda_graphs=graphs, max_num_seqs=batch)
    tokens = [int(t) for i, p in enumerate(prompts) for t in runner.step([(i, p)]).argmax(-1).tolist()]
    if graphs:
        runner.graphs.capture_all()

    def step() -> None:
        logits = runner.step([(i, [tokens[i]]) for i in range(batch)])
        tokens[:] = logits.argmax(-1).tolist()

    for _ in range(3):  # warm-up: the first calls compile and plan
        step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        step()
        torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - start))
    return {"step_ms": statistics.median(times), "context_tokens": float(sum(lens)), "batch": float(batch)}
