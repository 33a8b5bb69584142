"""Hugging Face's side of the serving benchmarks: the same weights, the same workloads, served by transformers.

Every benchmark that compares the engine with Hugging Face imports its runs from here, so both servers
are sized and timed by one set of rules:

* :func:`load_hf` -- Hugging Face's copy of the weights, read from the same GGUF as ``kvcourse.load_pretrained``;
* :func:`run_hf_padded` -- ``generate`` on left-padded batches on the CPU, with per-token times from a
  streamer (``bench_serving.py``'s ``hf_padded`` mode);
* :func:`run_hf_generate` -- the same batches timed as a whole, on any device (``bench_engine_gpu.py``);
* :func:`run_hf_cb` -- Hugging Face's continuous batching, warmed up and piloted untimed, sized by a
  :class:`Shape` like the engine it is compared with, in one of the configurations its documentation offers
  (:data:`HF_CB_CONFIGS`; ``bench_engine_gpu.py`` tries each one this machine can run and compares the engine
  with the fastest);
* :func:`pool_blocks`, :func:`pilot_workload`, :func:`timed_result` -- how a workload sizes a server's
  pool, what warms it up, and what one timed run records, for the engine's runs too.
"""

from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kvcourse
from kvcourse.serving import RequestMetrics, latency_summary

BLOCK = 16


@dataclass(frozen=True)
class Shape:
    """How a server is sized: both ours and Hugging Face's get the same numbers."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = BLOCK


def load_hf():
    """Hugging Face's copy of the same weights (read from the same GGUF, offline), in fp32."""
    import transformers

    path = kvcourse.gguf_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return hf.eval()


def left_padded(prompts) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` of one batch, prompts padded on the left with token 0."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[0] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return input_ids, mask


def pool_blocks(prompts, output_lens, block_size: int = BLOCK) -> int:
    """Blocks for every request of the workload at once: no request ever waits for memory."""
    return sum(-(-(len(p) + n) // block_size) for p, n in zip(prompts, output_lens))


def pilot_workload(prompts: Sequence[Sequence[int]], k: int) -> tuple[list[list[int]], list[int]]:
    """``k`` short requests whose prompts span the workload's lengths (shortest to longest), 4 new tokens
    each: run untimed first, so the timed run pays for no kernel compilation and no first allocation."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    picks = [order[round(j * (len(order) - 1) / max(k - 1, 1))] for j in range(min(k, len(order)))]
    return [list(prompts[i]) for i in picks], [4] * len(picks)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_result(
    outputs: list[list[int]], lens: Sequence[int], seconds: float, setup_s: float, timed_out: bool
) -> dict:
    """One timed run: the time, the tokens, and the outputs (which the JSON leaves out)."""
    n = sum(len(o) for o in outputs)
    return {"seconds": seconds, "output_tokens": n, "tok_s": n / seconds if seconds > 0 else None,
            "setup_s": round(setup_s, 2), "requests": len(lens),
            "finished": sum(len(o) >= k for o, k in zip(outputs, lens)), "timed_out": timed_out,
            "outputs": outputs}  # fmt: skip


def summary(metrics: list[RequestMetrics]) -> dict:
    """Throughput and latency percentiles of a served trace, rounded for the JSON."""
    s = latency_summary(metrics)
    return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in s.items()}


# ---- generate on padded batches ------------------------------------------------------------------------


def run_hf_padded(prompts, output_lens, batch_size) -> dict:
    """Hugging Face ``generate`` on left-padded batches on the CPU; per-token times from a streamer."""
    import transformers
    from transformers.generation.streamers import BaseStreamer

    hf = load_hf()

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    metrics = []
    t0 = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        batch = range(first, min(first + batch_size, len(prompts)))
        input_ids, mask = left_padded([prompts[i] for i in batch])
        longest = max(output_lens[i] for i in batch)
        clock = Clock()
        config = transformers.GenerationConfig(
            max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0, eos_token_id=None
        )
        start = time.perf_counter()
        with torch.inference_mode():
            hf.generate(input_ids=input_ids, attention_mask=mask, generation_config=config, streamer=clock)
        steps = clock.times[1:]  # the first put is the prompt
        for i in batch:
            n = output_lens[i]
            m = RequestMetrics(0.0, 0, len(prompts[i]), first_scheduled_time=start - t0,
                               first_token_time=steps[0] - t0, finish_time=steps[n - 1] - t0)  # fmt: skip
            m.num_output_tokens = m.max_sample_tokens = n
            metrics.append(m)
    out = summary(metrics)
    out["transformers"] = transformers.__version__
    return out


def run_hf_generate(hf, prompts, lens, batch: int, deadline: float | None) -> dict:
    """Hugging Face ``generate`` on left-padded batches of ``batch`` prompts, greedy: each batch decodes
    until its longest output is done (the padding and the wasted rows are this baseline's cost)."""
    import transformers

    device = hf.device
    t0 = time.perf_counter()
    with torch.inference_mode():  # one tiny call first: CUDA's and cuBLAS's first-call costs are setup
        warm = torch.tensor([[1, 2, 3, 4]], device=device)
        hf.generate(
            input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False, pad_token_id=0
        )
    sync(device)
    setup_s = time.perf_counter() - t0
    outputs: list[list[int]] = [[] for _ in prompts]
    start, timed_out = time.perf_counter(), False
    for first in range(0, len(prompts), batch):
        rows = range(first, min(first + batch, len(prompts)))
        input_ids, mask = left_padded([prompts[i] for i in rows])
        longest = max(lens[i] for i in rows)
        config = transformers.GenerationConfig(
            max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0, eos_token_id=None
        )
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


# ---- continuous batching ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HfConfig:
    """One way to run Hugging Face's continuous batching, as its documentation offers them."""

    attn: str  # the model's attention implementation ("sdpa", "eager": continuous batching runs it as paged|eager)
    overrides: dict  # ContinuousBatchingConfig fields beyond the sizing
    gpu_only: bool = True  # CUDA graphs, async double buffering and torch.compile are for a GPU
    needs: str | None = None  # a module the configuration imports
    note: str = ""


# The configurations ``ContinuousBatchingConfig``'s documentation (transformers 5.x) offers, each one knob away from
# the first GPU runs' (``sdpa``: graphs on, Hugging Face deciding async batching, no torch.compile). Flash attention
# (its ``flash_attn_with_kvcache`` decode fast path, ``max_blocks_per_request``) needs the ``flash_attn`` package, or
# the ``kernels`` package fetching it from the Hub at run time: neither is on the GPU image, a compiled CUDA extension
# cannot be carried there, and the machine has no network.
HF_CB_CONFIGS = {
    "sdpa": HfConfig("sdpa", {}, gpu_only=False, note="the first GPU runs' configuration"),
    "eager": HfConfig("eager", {}, gpu_only=False, note="paged|eager attention"),
    "sdpa+async": HfConfig("sdpa", {"use_async_batching": True}, note="double-buffered batches: the host prepares "
                                                                       "the next while the GPU runs one"),
    "sdpa+compile1": HfConfig("sdpa", {"default_compile_level": 1}, note="torch.compile, the lightest level"),
    "sdpa+async+compile3": HfConfig("sdpa", {"use_async_batching": True, "default_compile_level": 3},
                                    note="the most its documentation offers without flash attention (long warm-up)"),
    "flash": HfConfig("flash_attention_2", {"max_blocks_per_request": 64}, needs="flash_attn",
                      note="flash attention and its decode fast path"),
}  # fmt: skip


def runnable_configs(names: Sequence[str], cuda: bool) -> tuple[list[str], dict[str, str]]:
    """Which of ``names`` this machine can run, and why each other one is skipped."""
    import importlib.util

    run, skipped = [], {}
    for name in names:
        config = HF_CB_CONFIGS[name]
        if config.gpu_only and not cuda:
            skipped[name] = "needs a CUDA GPU"
        elif config.needs and importlib.util.find_spec(config.needs) is None:
            skipped[name] = (
                f"needs the {config.needs} package, which is not installed here (on the GPU image it "
                f"cannot be carried: a compiled CUDA extension; nothing can be fetched)"
            )
        else:
            run.append(name)
    return run, skipped


def hf_cb_config(
    shape: Shape, num_blocks: int, cuda_graphs: bool, overrides: dict | None = None
) -> tuple[object, dict]:
    """Hugging Face's ``ContinuousBatchingConfig`` sized like the engine (plus a configuration's ``overrides``), with
    only the fields this transformers version has (the GPU machine's may be older than ``constraints.txt``'s)."""
    from transformers import ContinuousBatchingConfig

    wanted = dict(page_size=shape.block_size, num_blocks=num_blocks, max_batch_tokens=shape.max_num_batched_tokens,
                  max_requests_per_batch=shape.max_num_seqs, use_cuda_graph=cuda_graphs,
                  # No torch.compile unless asked (minutes of compiling), no prefix sharing (the engine runs
                  # without its cache), no silent switch to another attention than the configuration's.
                  default_compile_level=0, allow_block_sharing=False, auto_switch_to_flash=False)  # fmt: skip
    if not cuda_graphs:  # on a CPU: no double buffering, no decode fast path (it needs flash attention on a GPU)
        wanted.update(use_async_batching=False, max_blocks_per_request=0)
    wanted.update(overrides or {})
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


def run_hf_cb(hf, prompts, lens, shape: Shape, pilot: int, deadline: float | None, config: str = "sdpa") -> dict:
    """Hugging Face continuous batching in configuration ``config`` (:data:`HF_CB_CONFIGS`): started, warmed up and
    piloted untimed, then timed from the first ``add_request`` to the last result.

    With CUDA graphs, Hugging Face captures a graph for each padded batch shape the first time it meets
    one, so its first pass over a workload pays for captures our engine made at start-up
    (``capture_all``). It therefore serves the whole workload once untimed (``warm_pass_s``), and the
    timed pass replays the same shapes: both servers are timed warm.
    """
    from transformers import GenerationConfig

    t0 = time.perf_counter()
    cuda = hf.device.type == "cuda"
    chosen = HF_CB_CONFIGS[config]
    cb, asked = hf_cb_config(
        shape, pool_blocks(prompts, lens, shape.block_size), cuda_graphs=cuda, overrides=chosen.overrides
    )
    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(lens))  # greedy, no EOS
    loaded_attn = hf.config._attn_implementation
    if hasattr(hf, "destroy_cached_continuous_batching_manager"):  # a cached manager would keep the last config
        hf.destroy_cached_continuous_batching_manager()
    hf.set_attn_implementation(chosen.attn)
    manager = None
    try:
        manager = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
        # The generation config already says "no EOS"; versions whose add_request takes it are told again.
        no_eos = {"eos_token_id": -1} if "eos_token_id" in inspect.signature(manager.add_request).parameters else {}

        def serve(ps, ns, until: float | None) -> tuple[list[str], dict]:
            ids = [manager.add_request(p, max_new_tokens=n, **no_eos) for p, n in zip(ps, ns)]
            return ids, collect(manager, ids, until)

        warm_pass_s, timed_out = None, False
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
        if manager is not None and manager.is_running():  # stop() on a manager never started raises, hiding the error
            manager.stop(block=True)
        if manager is not None and hasattr(manager, "destroy"):
            manager.destroy()
        if hasattr(hf, "destroy_cached_continuous_batching_manager"):
            hf.destroy_cached_continuous_batching_manager()
        hf.set_attn_implementation(loaded_attn)  # the next configuration starts from the model as loaded
    outputs = [list(results[i].generated_tokens) if i in results else [] for i in ids] or [[] for _ in prompts]
    out = timed_result(outputs, lens, seconds, setup_s, timed_out)
    out["warm_pass_s"] = warm_pass_s
    out["errors"] = sum(i not in results or getattr(results[i], "error", None) is not None for i in ids)
    out["config"] = asked | {"resolved": {k: repr(getattr(resolved, k)) for k in (
        "page_size", "num_blocks", "max_batch_tokens", "max_requests_per_batch", "use_cuda_graph", "use_async_batching",
        "max_blocks_per_request") if hasattr(resolved, k)}}  # fmt: skip
    out["attn_implementation"] = attn
    out["hf_config"] = config
    return out


def best_hf_run(runs: dict[str, dict]) -> tuple[str | None, dict | None]:
    """The fastest of Hugging Face's runs that served the whole workload (name and run), or ``(None, None)``."""
    done = {
        name: r
        for name, r in runs.items()
        if r.get("tok_s") and not r.get("timed_out") and not r.get("errors") and "error" not in r
    }
    if not done:
        return None, None
    name = max(done, key=lambda n: done[n]["tok_s"])
    return name, done[name]
