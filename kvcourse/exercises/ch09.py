"""Checks for chapter 9, *A step at GPU speed*: the learner writes the three bounds of a decode step's budget.

1. :func:`check_step_bytes` -- the bytes a decode step must read (every weight once, every sequence's K and V in
   every layer and KV head), from a model's config and the batch's context lengths.
2. :func:`check_gpu_floor` -- the floor of a step on the GPU: the longer of its bytes at peak bandwidth and its
   kernels at their shortest, which is what a CUDA graph cannot remove.
3. :func:`check_overlap_gain` -- the best a step can do when the host prepares the next step while the GPU runs
   this one, and what that saves.

Each check runs the learner's function on hidden cases seeded from the check's ``seed`` argument, compares it with
a private reference that ``tests/test_exercises_ch09.py`` tests, and names the typical mistake
(:class:`~kvcourse.exercises._core.Diagnosis`) its wrong answers match. The package's own versions
(:mod:`kvcourse.serving.step_budget`) are refused as answers.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ..serving import step_budget
from ._core import CheckResult, ExerciseError, a_number, check, describe, diagnose, mistaken, hidden_rng, passed, same

__all__ = ["check_gpu_floor", "check_overlap_gain", "check_step_bytes"]


def _close(got, want) -> bool:
    return same(got, want, rel=1e-6)


# --- Exercise 1: the bytes of a decode step ------------------------------------------------------
# A case: (num_parameters, config, seq_lens, dtype_bytes).
def _step_bytes(num_parameters: int, config: dict, seq_lens: list[int], dtype_bytes: int) -> int:
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * dtype_bytes
    return num_parameters * dtype_bytes + per_token * sum(seq_lens)


def _bytes_wrong(
    p, cfg, lens, b, *, no_v=False, q_heads=False, per_seq=False, no_weights=False, no_layers=False, no_dtype=False
):
    heads = cfg["num_attention_heads"] if q_heads else cfg["num_key_value_heads"]
    per_token = (1 if no_v else 2) * (1 if no_layers else cfg["num_hidden_layers"]) * heads * cfg["head_dim"]
    per_token *= 1 if no_dtype else b
    weights = 0 if no_weights else p * b * (len(lens) if per_seq else 1)
    return weights + per_token * sum(lens)


_BYTES_MISTAKES = mistaken(
    _bytes_wrong,
    no_v="The cache holds K and V: two tensors per layer and KV head, so 2 * layers * kv_heads * head_dim * bytes per "
    "token.",
    q_heads="With grouped-query attention the cache has num_key_value_heads heads, not num_attention_heads: the query "
    "heads share them.",
    per_seq="A step reads every weight once, whatever the batch: the sequences share the read (that is why batching "
    "pays), so the weights count once, not once per sequence.",
    no_weights="The weights are read every step too: num_parameters * dtype_bytes, on top of the cache.",
    no_layers="Every layer has its own K and V: multiply by num_hidden_layers.",
    no_dtype="Count bytes, not elements: multiply the cache's elements by dtype_bytes.",
)

_SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64}


def _bytes_cases(rng) -> list[tuple]:
    cases = [(134_515_008, dict(_SMOLLM2), [600] * 64, 2),
             (8_030_261_248, {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                              "head_dim": 128}, [4096, 100, 2000], 2)]  # fmt: skip
    while len(cases) < 20:
        kv = rng.choice([1, 2, 4, 8])
        cfg = {"num_hidden_layers": rng.randint(2, 80), "num_attention_heads": kv * rng.randint(2, 8),
               "num_key_value_heads": kv, "head_dim": rng.choice([64, 96, 128])}  # fmt: skip
        lens = [rng.randint(1, 4000) for _ in range(rng.randint(2, 64))]
        cases.append((rng.randint(10**7, 10**10), cfg, lens, rng.choice([1, 2, 4])))
    return cases


@check(
    "check_step_bytes",
    takes="step_bytes(num_parameters, config, seq_lens, dtype_bytes)",
    references={"step_budget.step_bytes": step_budget.step_bytes},
    task="count the bytes yourself, from the config.",
)
def check_step_bytes(step_bytes: Callable[[int, dict, list, int], int], seed: int = 0) -> CheckResult:
    """``step_bytes(num_parameters, config, seq_lens, dtype_bytes)`` -> the bytes one decode step reads."""
    diagnose(
        step_bytes,
        _bytes_cases(hidden_rng()),
        label=lambda p, cfg, lens, b: f"step_bytes({p:,}, {cfg}, <{len(lens)} sequences, {sum(lens):,} tokens>, {b})",
        reference=_step_bytes,
        mistakes=_BYTES_MISTAKES,
        hint="A decode step reads num_parameters * dtype_bytes of weights once, and for every token of every sequence "
        "2 * num_hidden_layers * num_key_value_heads * head_dim * dtype_bytes of K and V.",
        compare=_close,
        returns=a_number("a number of bytes"),
    )
    smol = _step_bytes(*_bytes_cases(hidden_rng())[0])
    return passed(
        f"a SmolLM2-135M step of 64 sequences of 600 tokens in bf16 reads {smol / 1e9:.2f} GB: "
        f"{smol / 3.35e12 * 1e3:.2f} ms at an H100's 3.35 TB/s."
    )


# --- Exercise 2: what a graph cannot remove ------------------------------------------------------
# A case: (step_bytes, bandwidth in bytes/s, kernels, kernel_us).
def _gpu_floor(num_bytes: float, bandwidth: float, kernels: int, kernel_us: float) -> float:
    return max(1e3 * num_bytes / bandwidth, kernels * kernel_us / 1e3)


# The first mistake that explains every failing case names it. A kernel floor left out (or made 1,000 times too
# small) fails only where the kernels dominate, where "the smaller of the two" gives the same numbers: it goes first.
_FLOOR_MISTAKES = [
    (
        "The two floors overlap: the kernels move the bytes. The step takes at least the longer of the two, not their "
        "sum.",
        lambda n, bw, k, us: 1e3 * n / bw + k * us / 1e3,
    ),
    (
        "The kernels set a floor too, whatever bytes they move: kernels * kernel_us microseconds, which is "
        "kernels * kernel_us / 1e3 milliseconds.",
        lambda n, bw, k, us: 1e3 * n / bw,
    ),
    (
        "Milliseconds: bytes / bandwidth is in seconds (times 1e3), kernels * kernel_us in microseconds (divided by "
        "1e3).",
        lambda n, bw, k, us: max(n / bw, k * us),
    ),
    (
        "Both floors hold at once: take the larger (max), not the smaller.",
        lambda n, bw, k, us: min(1e3 * n / bw, k * us / 1e3),
    ),
]


def _floor_cases(rng) -> list[tuple]:
    cases = [(1_153_766_016, 3.35e12, 343, 1.4), (1_153_766_016, 3.35e12, 100, 1.4), (5e10, 3.35e12, 343, 1.4)]
    while len(cases) < 24:  # half of them small steps, where the kernels dominate
        cases.append((float(rng.randint(10**7, 10**9 if len(cases) % 2 else 10**11)), rng.choice([0.3e12, 0.9e12, 2.0e12, 3.35e12, 4.8e12]),
                      rng.randint(10, 2000), round(rng.uniform(0.5, 8.0), 2)))  # fmt: skip
    return cases


@check(
    "check_gpu_floor",
    takes="gpu_floor_ms(step_bytes, bandwidth, kernels, kernel_us)",
    references={
        "step_budget.bytes_floor_ms": step_budget.bytes_floor_ms,
        "step_budget.kernel_floor_ms": step_budget.kernel_floor_ms,
    },
    task="write the two floors yourself.",
)
def check_gpu_floor(gpu_floor_ms: Callable[[float, float, int, float], float], seed: int = 0) -> CheckResult:
    """``gpu_floor_ms(step_bytes, bandwidth, kernels, kernel_us)`` -> the least milliseconds the GPU can take."""
    diagnose(
        gpu_floor_ms,
        _floor_cases(hidden_rng()),
        label=lambda *case: f"gpu_floor_ms{case}",
        reference=_gpu_floor,
        mistakes=_FLOOR_MISTAKES,
        hint="The GPU needs step_bytes / bandwidth seconds to read the bytes, and at least kernel_us per kernel: the "
        "floor is the larger of the two, in milliseconds.",
        compare=_close,
        returns=a_number("milliseconds, a number"),
    )
    floor = _gpu_floor(1_153_766_016, 3.35e12, 343, 1.4)
    return passed(
        f"343 kernels of at least 1.4 µs bound a step at {floor:.2f} ms, above its bytes' floor: kernels, "
        "not bytes, set this small model's step."
    )


# --- Exercise 3: the gain bound of overlap -------------------------------------------------------
# A case: (step_ms, host_ms, gpu_ms), host and GPU each a part of the step.
def _overlap(step_ms: float, host_ms: float, gpu_ms: float) -> tuple[float, float]:
    best = max(host_ms, gpu_ms)
    return best, step_ms / best


_OVERLAP_MISTAKES = [
    (
        "Overlapped, the host and the GPU still each do their own work: a step takes the longer of the two, max(host, "
        "gpu), not the shorter.",
        lambda s, h, g: (min(h, g), s / min(h, g)),
    ),
    (
        "Overlap hides the shorter part inside the longer one; the step does not shrink to their difference.",
        lambda s, h, g: (abs(h - g), s / abs(h - g) if h != g else math.inf),
    ),
    (
        "The speed-up is the old step over the new one, step_ms / best_ms (above 1).",
        lambda s, h, g: (max(h, g), max(h, g) / s),
    ),
    (
        "Overlap cannot remove the GPU's own work: the best step is max(host_ms, gpu_ms), not step_ms - host_ms.",
        lambda s, h, g: (s - h, s / (s - h)) if s > h else None,
    ),
]


def _overlap_cases(rng) -> list[tuple]:
    cases = [(2.42, 1.11, 1.79), (25.0, 22.0, 1.8), (5.0, 2.0, 2.0)]
    while len(cases) < 24:
        step = round(rng.uniform(0.5, 40.0), 3)
        host, gpu = round(rng.uniform(0.05, 1.0) * step, 3), round(rng.uniform(0.05, 1.0) * step, 3)
        if abs(host - gpu) > 1e-3:
            cases.append((step, host, gpu))
    return cases


def _a_pair(case: str, got, *_) -> tuple:
    if not (isinstance(got, (tuple, list)) and len(got) == 2):
        raise ExerciseError(f"{case} should return (best_ms, speedup), got {describe(got)}", case=case)
    return tuple(got)


@check(
    "check_overlap_gain",
    takes="overlap_gain(step_ms, host_ms, gpu_ms)",
    references={"step_budget.overlap_bound": step_budget.overlap_bound},
    task="bound the gain yourself.",
)
def check_overlap_gain(
    overlap_gain: Callable[[float, float, float], tuple[float, float]], seed: int = 0
) -> CheckResult:
    """``overlap_gain(step_ms, host_ms, gpu_ms)`` -> ``(best_ms, speedup)``: the step with the host's work
    overlapped with the GPU's, and the old step over it."""
    diagnose(
        overlap_gain,
        _overlap_cases(hidden_rng()),
        label=lambda *case: f"overlap_gain{case}",
        reference=_overlap,
        mistakes=_OVERLAP_MISTAKES,
        hint="With the host preparing the next step while the GPU runs this one, a step takes max(host_ms, gpu_ms); "
        "the speed-up is step_ms over that.",
        compare=_close,
        returns=_a_pair,
    )
    best, speedup = _overlap(2.42, 1.11, 1.79)
    return passed(
        f"a 2.42 ms step with 1.11 ms of host work and a 1.79 ms GPU span could take {best:.2f} ms "
        f"overlapped: {speedup:.2f}x, and no more."
    )
