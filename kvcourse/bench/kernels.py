"""``python -m kvcourse.bench kernels``: chapter 5's decode kernels on a GPU, as a fraction of peak bandwidth.

    python -m kvcourse.bench kernels [--quick] [--out benchmarks/results] [--smoke]

Decode attention reads every cached byte once and does little with it (:mod:`kvcourse.kernels.roofline`),
so its figure of merit is the **effective bandwidth**: bytes it must move (K and V, the query and the
output, the block tables) divided by its time. We report it in GB/s, as a % of the vendor's peak for
the GPU, and as a % of a device-to-device copy measured on the same GPU (what memory really delivers).

Shapes (as in the chapter's issue): 32 query / 8 KV heads, head dim 128, fp16, blocks of 16 tokens,
batch {1, 8, 32, 64, 128} x context {512, 2k, 8k, 32k}, and batch 1 at 64k. Each shape runs:

* ``paged``: :func:`~kvcourse.kernels.paged_decode_attention`, splits chosen by the heuristic;
* ``paged-unsplit``: the same, ``num_splits=1``;
* ``paged-workspace``: ``paged`` with its output and split scratch kept between calls (nothing allocated per call);
* ``paged-int8``: the int8 pool (half the bytes), splits by the heuristic;
* ``paged-fp8``: an fp8 (e4m3) pool with int8's scales, where the GPU converts fp8 (compute capability 8.9+);
* ``paged-int8-cvt``: the same with the first version's int8 conversion (``int8_conversion="cvt"``, the
  conversion unit's ``I2F``), to time what :func:`~kvcourse.kernels.triton_paged.int8_to_float` changed;
* ``contiguous``: :func:`~kvcourse.kernels.decode_attention` on a ``[B, Hkv, S, D]`` cache;
* ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` on the contiguous cache;
* ``flex``: FlexAttention (compiled) on the contiguous cache, where torch provides it.

**The engine's shape** (issue 50): the serving engine's model has 9 query / 3 KV heads, head dim 64, bf16, blocks of
16, contexts of a few hundred tokens, and there decode attention runs inside every CUDA-graph step. Its rows
(``"shape": "engine"``, under the JSON's ``engine`` key, batch {1, 8, 32, 64, 128} x context {128, ..., 2048}) run:

* ``paged``, ``paged-unsplit``: as above, on this shape;
* ``paged-captured``: the split count a recorded graph uses today, chosen from the captured context
  (:data:`ENGINE_CAPTURED_CONTEXT`), not the real one;
* ``paged-planned``: :func:`~kvcourse.kernels.triton_paged.paged_decode_planned`, its work planned on the host from
  the real lengths (:mod:`kvcourse.kernels.split_plan`), into kept buffers as a graph keeps them;
* ``paged-planned-n32``, ``paged-planned-n128``: the planned kernel with other tiles (:data:`ENGINE_TILES`), to
  choose the engine shape's tiles from;
* ``sdpa``: torch's SDPA on the same shape.

``--dry-run`` lists every shape and variant a run would time (no GPU needed; :func:`plan`).

Times are ``triton.testing.do_bench`` medians. Every kernel's output is first checked against SDPA on
the same shape (the int8 kernel against its own reference, on a small shape). A kernel that did not
compile, or that fell back to the torch reference, is refused: its row says so and carries no time
(a fallback timed under the kernel's name would be torch's speed). Each row says how it ran. Without a GPU this
benchmark refuses: the interpreter measures Python, not memory. ``--smoke`` then runs one tiny shape
through the same code for correctness only and prints no speed.

Runs committed so far (:mod:`kvcourse.bench.measured` reads and plots them; chapter 5 quotes them): an
NVIDIA H200, ``kvcourse/results/kernels-nvidia-h200-2026-11-26.json`` (FlexAttention not timed; the file
records which targets were met). No T4 or A100 has run it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels.roofline import decode_attention_bytes, peak_for
from .measured import ONE_BYTE_KV

NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BATCHES = (1, 8, 32, 64, 128)
CONTEXTS = (512, 2048, 8192, 32768)
EXTRA = ((1, 65536),)
QUICK = ((1, 8192), (8, 8192), (64, 2048), (1, 65536))
VARIANTS = (
    "paged",
    "paged-unsplit",
    "paged-workspace",
    "paged-int8",
    "paged-int8-cvt",
    "paged-fp8",
    "contiguous",
    "sdpa",
    "flex",
)

# The serving engine's attention (SmolLM2-135M: 9 query / 3 KV heads, D = 64, bf16 on a GPU), issue 50.
ENGINE_HEADS = (9, 3, 64)
ENGINE_DTYPE = torch.bfloat16
ENGINE_BATCHES = (1, 8, 32, 64, 128)
ENGINE_CONTEXTS = (128, 256, 512, 1024, 2048)
ENGINE_QUICK = ((1, 512), (32, 512), (64, 1024))
# Tile alternatives for D = 64 (BLOCK_N, num_warps, num_stages), timed on the planned kernel beside tile_config's
# (64, 4, 2): narrower tiles with a deeper pipeline, and wider ones (each compiles without spills on sm_80 and sm_90).
ENGINE_TILES = {"paged-planned-n32": (32, 4, 3), "paged-planned-n128": (128, 8, 2)}
ENGINE_VARIANTS = ("paged", "paged-captured", "paged-planned", *ENGINE_TILES, "paged-unsplit", "sdpa")
ENGINE_CAPTURED_CONTEXT = 8192  # SmolLM2's max_position_embeddings: the context a recorded graph's host copies state

Timer = Callable[[Callable[[], object]], float]  # fn -> milliseconds


def shapes(quick: bool = False) -> list[tuple[int, int]]:
    """``(batch, context)`` pairs to run."""
    return list(QUICK) if quick else [(b, c) for b in BATCHES for c in CONTEXTS] + list(EXTRA)


def engine_shapes(quick: bool = False) -> list[tuple[int, int]]:
    """``(batch, context)`` pairs of the engine's shape."""
    return list(ENGINE_QUICK) if quick else [(b, c) for b in ENGINE_BATCHES for c in ENGINE_CONTEXTS]


def plan(quick: bool = False, variants: Sequence[str] = VARIANTS) -> list[dict]:
    """What a run times, without running it: one entry per shape, ``{shape, batch, context, heads, dtype, variants}``
    (``"benchmark"`` shapes, then ``"engine"`` ones)."""
    out = []
    for name, pairs, heads, dtype, names in (
        ("benchmark", shapes(quick), (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM), "float16", list(variants)),
        ("engine", engine_shapes(quick), ENGINE_HEADS, str(ENGINE_DTYPE).removeprefix("torch."), list(ENGINE_VARIANTS)),
    ):
        out += [dict(shape=name, batch=b, context=c, heads=heads, dtype=dtype, variants=names) for b, c in pairs]
    return out


def bytes_needed(batch: int, context: int, heads: tuple[int, int, int] = (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM)) -> int:
    """GPU memory one shape needs: fp16 paged pool, contiguous copy, int8 pool with scales."""
    values = batch * context * heads[1] * heads[2]
    return 2 * values * 2 * 2 + 2 * values + 2 * batch * context * heads[1] * 4


class Problem:
    """One shape's inputs: the same K/V in a shuffled paged pool, contiguously, and as int8."""

    def __init__(
        self,
        batch: int,
        context: int,
        device: torch.device,
        seed: int = 0,
        dtype: torch.dtype = torch.float16,
        heads: tuple[int, int, int] = (NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM),
    ) -> None:
        g = torch.Generator(device=device).manual_seed(seed)
        self.batch, self.context = batch, context
        self.num_q_heads, self.num_kv_heads, self.head_dim = hq, hkv, d = heads
        blocks_per_seq = -(-context // BLOCK_SIZE)
        num_blocks = batch * blocks_per_seq
        shape = (batch, hkv, context, d)
        self.q = torch.randn(batch, hq, d, generator=g, device=device, dtype=dtype)
        self.k = torch.randn(shape, generator=g, device=device, dtype=dtype)
        self.v = torch.randn(shape, generator=g, device=device, dtype=dtype)
        self.seq_lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        perm = torch.randperm(num_blocks, generator=g, device=device)
        self.block_tables = perm.view(batch, blocks_per_seq).to(torch.int32)
        self.k_cache = torch.empty(num_blocks, BLOCK_SIZE, hkv, d, dtype=dtype, device=device)
        self.v_cache = torch.empty_like(self.k_cache)
        for b in range(batch):  # pad the context to whole blocks, then scatter it block by block
            blocks = self.block_tables[b].long()
            for cache, x in ((self.k_cache, self.k[b]), (self.v_cache, self.v[b])):
                padded = F.pad(x, (0, 0, 0, blocks_per_seq * BLOCK_SIZE - context))  # [Hkv, blocks * BS, D]
                cache[blocks] = padded.view(hkv, blocks_per_seq, BLOCK_SIZE, d).permute(1, 2, 0, 3)
        # int8 pool: random values and scales (speed does not depend on them; correctness is tested elsewhere)
        self.k8 = torch.randint(-127, 128, self.k_cache.shape, generator=g, device=device, dtype=torch.int8)
        self.v8 = torch.randint(-127, 128, self.k_cache.shape, generator=g, device=device, dtype=torch.int8)
        self.k_scale = torch.rand(self.k_cache.shape[:3], generator=g, device=device) / 127
        self.v_scale = torch.rand(self.k_cache.shape[:3], generator=g, device=device) / 127

    def bytes(self, int8: bool = False, paged: bool = True) -> int:
        """Bytes the step must move (:func:`~kvcourse.kernels.roofline.decode_attention_bytes`)."""
        return decode_attention_bytes(
            [self.context] * self.batch, self.num_q_heads, self.num_kv_heads, self.head_dim,
            kv_bytes=1 if int8 else self.q.element_size(), q_bytes=self.q.element_size(),
            scale_bytes=4 if int8 else 0, block_size=BLOCK_SIZE if paged else None,
        )  # fmt: skip


def variant_fns(p: Problem, variants: Sequence[str]) -> dict[str, tuple[Callable[[], torch.Tensor] | None, str]]:
    """``name -> (fn, note)``; ``fn`` is None (and ``note`` says why) where a variant cannot run here."""
    from ..kernels import decode_attention
    from ..kernels.split_plan import SplitPlan, plan_capacity
    from ..kernels.testing import tolerance
    from ..kernels.triton_paged import (choose_num_splits, decode_workspace, num_sms, paged_decode, paged_decode_planned,
                                        planned_workspace)  # fmt: skip

    scale = 1 / math.sqrt(p.head_dim)
    sms = num_sms(p.q.device)
    splits = choose_num_splits(p.batch, p.num_kv_heads, p.context, sms)
    captured = choose_num_splits(p.batch, p.num_kv_heads, ENGINE_CAPTURED_CONTEXT, sms)
    # The planned kernel as a graph runs it: one plan buffer, made for the batch, filled from the real lengths.
    split_plan = SplitPlan(plan_capacity(p.batch, p.num_kv_heads, sms), p.batch, p.q.device)
    chunk = split_plan.fill([p.context] * p.batch, p.num_kv_heads, sms)
    items = p.batch * -(-p.context // chunk)
    planned_kept = torch.empty_like(p.q), planned_workspace(split_plan.capacity, p.num_q_heads, p.head_dim, p.q.device)
    kept = torch.empty_like(p.q), decode_workspace(p.batch, p.num_q_heads, p.head_dim, splits, p.q.device)
    # The kernels are timed without their input checks (which read the block tables on the host).
    fns: dict[str, tuple[Callable[[], torch.Tensor] | None, str]] = {
        "paged": (lambda: paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale, splits),
                  f"num_splits={splits}"),
        "paged-unsplit": (lambda: paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale, 1),
                          "num_splits=1"),
        "paged-captured": (lambda: paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale, captured),
                           f"num_splits={captured}, chosen from a graph's captured context {ENGINE_CAPTURED_CONTEXT}"),
        "paged-planned": (lambda: paged_decode_planned(p.q, p.k_cache, p.v_cache, p.block_tables, split_plan, scale,
                                                       out=planned_kept[0], workspace=planned_kept[1]),
                          f"planned: chunks of {chunk} tokens, {items} work items, kept buffers"),
        **{name: (lambda t=t: paged_decode_planned(p.q, p.k_cache, p.v_cache, p.block_tables, split_plan, scale,
                                                   out=planned_kept[0], workspace=planned_kept[1], tiles=t),
                  f"planned: chunks of {chunk} tokens, {items} work items, kept buffers, tiles {t}")
           for name, t in ENGINE_TILES.items()},
        "paged-workspace": (lambda: paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale, splits,
                                                 out=kept[0], workspace=kept[1]), f"num_splits={splits}, kept buffers"),
        "paged-int8": (lambda: paged_decode(p.q, p.k8, p.v8, p.block_tables, p.seq_lens, scale, splits, p.k_scale,
                                            p.v_scale), f"num_splits={splits}"),
        "paged-int8-cvt": (lambda: paged_decode(p.q, p.k8, p.v8, p.block_tables, p.seq_lens, scale, splits, p.k_scale,
                                                p.v_scale, int8_conversion="cvt"), f"num_splits={splits}, I2F"),
        "paged-fp8": _fp8_variant(p, scale, splits),
        "contiguous": (lambda: decode_attention(p.q, p.k, p.v, p.seq_lens, scale), ""),
        "sdpa": (lambda: F.scaled_dot_product_attention(p.q[:, :, None], p.k, p.v, scale=scale, enable_gqa=True)[:, :, 0],
                 "torch SDPA, contiguous cache"),
    }  # fmt: skip
    if "flex" in variants:
        try:
            from torch.nn.attention.flex_attention import flex_attention

            compiled = torch.compile(flex_attention)
            fn = lambda: compiled(p.q[:, :, None], p.k, p.v, scale=scale, enable_gqa=True)[:, :, 0]  # noqa: E731
            fn()  # compile now, so a failure is reported here and not timed
            fns["flex"] = (fn, "FlexAttention, torch.compile")
        except Exception as exc:  # an unsupported GPU or torch build: report, do not crash the benchmark
            fns["flex"] = (
                None,
                f"unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}",
            )
    # A fallback is not a kernel timing: each kernel runs once first, and a variant whose kernel did
    # not compile, or was computed by the torch reference instead, is refused (reported, never timed).
    ours = (
        "paged",
        "paged-unsplit",
        "paged-captured",
        "paged-planned",
        *ENGINE_TILES,
        "paged-workspace",
        "paged-int8",
        "paged-int8-cvt",
        "paged-fp8",
        "contiguous",
    )
    for name in [n for n in ours if n in variants and fns[n][0] is not None]:  # only what is timed runs
        fns[name] = _first_run(name, *fns[name])
    # Correctness before speed: every float variant that ran equals SDPA on this very shape.
    want = fns["sdpa"][0]()
    for name in ("paged", "paged-unsplit", "paged-captured", "paged-planned", *ENGINE_TILES, "paged-workspace",
                 "contiguous"):  # fmt: skip
        if name in variants and fns[name][0] is not None:
            torch.testing.assert_close(fns[name][0](), want, **tolerance(p.q.dtype), msg=lambda m, n=name: f"{n}: {m}")
    int8_pair = [fns[n][0] for n in ("paged-int8", "paged-int8-cvt") if n in variants]
    if len(int8_pair) == 2 and None not in int8_pair:  # two conversions, one answer
        torch.testing.assert_close(fns["paged-int8-cvt"][0](), fns["paged-int8"][0](), rtol=2e-3, atol=2e-3)
    return {name: fns[name] for name in variants if name in fns}


def _fp8_variant(p: Problem, scale: float, splits: int) -> tuple[Callable[[], torch.Tensor] | None, str]:
    """The fp8 pool from the int8 one's bytes (speed does not depend on the values): sign and lowest exponent bit
    cleared, so no byte is e4m3's NaN. Only where the GPU converts fp8 (compute capability 8.9 and later)."""
    from ..kernels.triton_paged import paged_decode
    from ..kernels.triton_runtime import compute_capability

    capability = compute_capability(p.q.device)
    if capability is None or capability < 89:
        return None, f"skipped: fp8 needs compute capability 8.9 or later, this is {capability}"
    kf8, vf8 = ((x & 0x77).view(torch.float8_e4m3fn) for x in (p.k8, p.v8))
    return (
        lambda: paged_decode(p.q, kf8, vf8, p.block_tables, p.seq_lens, scale, splits, p.k_scale, p.v_scale),
        f"num_splits={splits}",
    )


def _first_run(name: str, fn: Callable[[], torch.Tensor], note: str) -> tuple[Callable[[], torch.Tensor] | None, str]:
    """``(fn, note)`` if ``fn``'s kernel ran as Triton code; ``(None, why)`` if it could not compile or fell back."""
    from collections import Counter

    from ..kernels.triton_runtime import counting_runs, is_compile_failure

    runs: Counter = Counter()
    try:
        with counting_runs(runs):
            fn()
    except Exception as exc:
        if not is_compile_failure(exc):
            raise
        return None, f"refused: {name} did not compile ({type(exc).__name__}), so there is no kernel to time"
    fell_back = sorted(kernel for kernel, how in runs if how == "fallback")
    if fell_back:
        return None, (
            f"refused: {', '.join(fell_back)} fell back to the torch reference here; "
            "timing it would label torch as the kernel"
        )
    return fn, note


def run(
    shape_list: Sequence[tuple[int, int]],
    device: torch.device,
    timer: Timer,
    variants: Sequence[str] = VARIANTS,
    log: Callable[[str], None] = print,
    shape: str = "benchmark",
) -> list[dict]:
    """Time every variant on every shape; one row per (shape, variant). ``shape``: ``"benchmark"`` (32/8 heads,
    D = 128, fp16) or ``"engine"`` (:data:`ENGINE_HEADS`, bf16); each row records which."""
    from ..kernels.triton_runtime import how_kernels_run

    if shape not in ("benchmark", "engine"):
        raise ValueError(f"shape must be 'benchmark' or 'engine', got {shape!r}")
    heads, dtype = (
        (ENGINE_HEADS, ENGINE_DTYPE) if shape == "engine" else ((NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM), torch.float16)
    )
    peak = peak_for(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    rows = []
    for batch, context in shape_list:
        need = bytes_needed(batch, context, heads)
        if device.type == "cuda":
            free = torch.cuda.mem_get_info(device)[0]
            if need > 0.9 * free:
                log(
                    f"batch {batch:4d} x context {context:6d}: skipped, needs {need / 1e9:.1f} GB, {free / 1e9:.1f} GB free"
                )
                rows.append(dict(shape=shape, batch=batch, context=context, variant="all",
                                 skipped=f"needs {need} bytes, {free} free"))  # fmt: skip
                continue
        with torch.inference_mode():
            p = Problem(batch, context, device, dtype=dtype, heads=heads)
            for name, (fn, note) in variant_fns(p, variants).items():
                ran = "torch" if name in ("sdpa", "flex") else how_kernels_run()
                row = dict(
                    shape=shape, batch=batch, context=context, tokens=batch * context, variant=name, note=note, ran=ran
                )
                if fn is None:
                    rows.append({**row, "skipped": note})
                    log(f"batch {batch:4d} x context {context:6d} {name:14s} {note}")
                    continue
                ms = timer(fn)
                nbytes = p.bytes(int8=name in ONE_BYTE_KV, paged=name.startswith("paged"))
                gbps = nbytes / (ms * 1e-3) / 1e9
                row.update(ms=ms, bytes=nbytes, gbps=gbps, pct_peak=100 * gbps * 1e9 / peak.bandwidth if peak else None)
                rows.append(row)
                log(
                    f"batch {batch:4d} x context {context:6d} {name:14s} {ms:8.3f} ms {gbps:8.1f} GB/s"
                    + (f" {row['pct_peak']:5.1f}% of peak" if peak else "")
                    + (f"  ({note})" if note else "")
                )
            del p
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def copy_bandwidth(device: torch.device, timer: Timer, nbytes: int = 1 << 30) -> float:
    """Bytes/s of a device-to-device copy of ``nbytes`` (each byte read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3)


def targets(rows: list[dict]) -> list[dict]:
    """The chapter's targets, each with the measured value and whether it was met (``None``: not measured)."""
    ok = [r for r in rows if "ms" in r]
    by = {(r["batch"], r["context"], r["variant"]): r for r in ok}

    def pct(r):
        return r.get("pct_peak")

    out = []
    big = [r for r in ok if r["variant"] == "paged" and r["tokens"] >= 65536 and pct(r) is not None]
    worst = min(big, key=pct, default=None)
    out.append(dict(name="paged_peak", target="paged >= 80% of peak bandwidth when batch x context >= 64k",
                    value=pct(worst) if worst else None, met=pct(worst) >= 80 if worst else None))  # fmt: skip
    ratios = [
        by[(b, c, "contiguous")]["ms"] / r["ms"]
        for (b, c, v), r in by.items()
        if v == "paged" and (b, c, "contiguous") in by
    ]
    out.append(dict(name="paged_vs_contiguous", target="paged >= 0.9x the contiguous kernel's speed (worst shape)",
                    value=min(ratios, default=None), met=min(ratios) >= 0.9 if ratios else None))  # fmt: skip
    s, u = by.get((1, 65536, "paged")), by.get((1, 65536, "paged-unsplit"))
    out.append(dict(name="split_peak", target="split-KV at batch 1, 64k: >= 70% of peak", value=pct(s) if s else None,
                    met=pct(s) >= 70 if s and pct(s) is not None else None))  # fmt: skip
    speedup = u["ms"] / s["ms"] if s and u else None
    out.append(dict(name="split_speedup", target="split-KV at batch 1, 64k: >= 1.8x the unsplit kernel",
                    value=speedup, met=speedup >= 1.8 if speedup else None))  # fmt: skip
    gains = [
        by[(b, c, "paged")]["ms"] / r["ms"]
        for (b, c, v), r in by.items()
        if v == "paged-int8" and c >= 16384 and (b, c, "paged") in by
    ]
    out.append(dict(name="int8_speedup", target="int8 >= 1.5x fp16 at context >= 16k (worst shape)",
                    value=min(gains, default=None), met=min(gains) >= 1.5 if gains else None))  # fmt: skip
    fp8 = [
        by[(b, c, "paged")]["ms"] / r["ms"]
        for (b, c, v), r in by.items()
        if v == "paged-fp8" and c >= 8192 and (b, c, "paged") in by
    ]
    out.append(dict(name="fp8_speedup", target="fp8 >= 1.6x fp16 at context >= 8k (worst shape; issue 30)",
                    value=min(fp8, default=None), met=min(fp8) >= 1.6 if fp8 else None))  # fmt: skip
    return out


ENGINE_TARGET_PCT = 60  # issue 50: the engine's shape at >= 60% of peak bandwidth at batch >= 32, 512-1,024 tokens


def engine_targets(rows: list[dict]) -> list[dict]:
    """The engine shape's targets (issue 50): the worst ``pct_peak`` at batch >= 32 and 512-1,024 tokens of the
    planned kernel (what a CUDA-graph step runs once the plan is wired) and of the heuristic's split, and the planned
    kernel against today's graph split (``paged-captured``) there (``None``: not measured)."""
    ok = [
        r for r in rows if "ms" in r and r.get("shape") == "engine" and r["batch"] >= 32 and 512 <= r["context"] <= 1024
    ]
    by = {(r["batch"], r["context"], r["variant"]): r for r in ok}
    out = []
    for variant in ("paged-planned", "paged"):
        mine = [r for r in ok if r["variant"] == variant and r.get("pct_peak") is not None]
        worst = min(mine, key=lambda r: r["pct_peak"], default=None)
        value = worst["pct_peak"] if worst else None
        out.append(dict(name=f"engine_peak_{variant.replace('-', '_')}",
                        target=f"engine shape (9/3 heads, D 64, bf16): {variant} >= {ENGINE_TARGET_PCT}% of peak "
                               "at batch >= 32 and 512-1,024 tokens (worst shape; issue 50)",
                        value=value, met=value >= ENGINE_TARGET_PCT if value is not None else None))  # fmt: skip
    gains = [
        by[(b, c, "paged-captured")]["ms"] / r["ms"]
        for (b, c, v), r in by.items()
        if v == "paged-planned" and (b, c, "paged-captured") in by
    ]
    out.append(dict(name="engine_planned_vs_captured",
                    target="engine shape: planned splits >= 1.0x the speed of a graph's captured split count (worst)",
                    value=min(gains, default=None), met=min(gains) >= 1.0 if gains else None))  # fmt: skip
    return out


def _git_commit(command: Callable[[list[str]], str]) -> str:
    """HEAD, marked when the tree differs from it. A copy of the tree handed to a GPU machine may carry an
    old ``.git`` (the first GPU runs recorded a commit their files had moved past): whoever hands the tree
    over says which commit it is with ``KVCOURSE_COMMIT``, which wins."""
    head = command(["git", "rev-parse", "HEAD"])
    changed = command(["git", "status", "--porcelain", "--untracked-files=no"])  # "unknown": no output, a clean tree
    return head + " (with uncommitted changes)" if head != "unknown" and changed != "unknown" else head


def provenance(device: torch.device) -> dict:
    """Where the numbers come from: GPU, driver, CUDA, torch, triton, the commit, the date."""
    import triton

    def command(args: list[str]) -> str:
        try:
            return subprocess.run(args, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            return "unknown"

    info = dict(
        date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        commit=os.environ.get("KVCOURSE_COMMIT") or _git_commit(command),
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            memory_bytes=props.total_memory,
            cuda=torch.version.cuda,
            driver=command(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]),
        )
    return info


def write_results(result: dict, out_dir: Path) -> Path:
    """``out_dir/kernels-<gpu>-<date>.json``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    gpu = "".join(c if c.isalnum() else "-" for c in result["provenance"].get("gpu", "cpu")).strip("-").lower()
    path = out_dir / f"kernels-{gpu}-{result['provenance']['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def smoke() -> int:
    """No GPU: one tiny shape through the same code, for correctness only (the interpreter's time means nothing)."""
    with torch.inference_mode():
        p = Problem(2, 100, torch.device("cpu"), dtype=torch.float32, heads=(4, 2, 64))
        fns = variant_fns(
            p, ("paged", "paged-unsplit", "paged-workspace", "paged-int8", "paged-int8-cvt", "contiguous", "sdpa")
        )
    ran = [name for name, (fn, _) in fns.items() if fn is not None]
    print(
        f"smoke run in Triton's interpreter: {', '.join(ran)} ran on batch 2 x context 100; the float ones agree "
        "with SDPA, the two int8 conversions with each other (correctness only; no speed without a GPU)"
    )
    for name, (fn, note) in fns.items():
        if fn is None:
            print(f"  {name}: {note}")
    return 0 if len(ran) == len(fns) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.bench kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} shapes: {list(QUICK)}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="without a GPU: check one tiny shape, time nothing")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS), help="what to time")
    parser.add_argument(
        "--shapes",
        choices=("all", "benchmark", "engine"),
        default="all",
        help="the benchmark's 32/8/128 fp16 shapes, the engine's 9/3/64 bf16 ones, or both",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="list the shapes and variants a run would time, and stop"
    )
    args = parser.parse_args(argv)
    planned = [e for e in plan(args.quick, args.variants) if args.shapes in ("all", e["shape"])]
    if args.dry_run:
        for e in planned:
            print(
                f"{e['shape']:9s} batch {e['batch']:4d} x context {e['context']:6d} heads {e['heads']} {e['dtype']}: "
                + ", ".join(e["variants"])
            )
        print(f"{len(planned)} shapes")
        return 0
    if not torch.cuda.is_available():
        print(
            "kvcourse.bench kernels: no CUDA GPU here. This benchmark measures memory bandwidth on a GPU; "
            "Triton's CPU interpreter would time Python, not the kernels, so no figure is produced."
        )
        return smoke() if args.smoke else 0
    import triton.testing

    from ..kernels.triton_runtime import kernel_runs

    device = torch.device("cuda")

    def timer(fn):
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    prov = provenance(device)
    copy_bps = copy_bandwidth(device, timer)
    peak = peak_for(prov["gpu"])
    print(
        f"{prov['gpu']} (sm_{prov['compute_capability'].replace('.', '')}, {prov['sms']} SMs), driver {prov['driver']}, "
        f"CUDA {prov['cuda']}, torch {prov['torch']}, triton {prov['triton']}"
    )
    vendor = f"vendor peak {peak.bandwidth / 1e9:.0f} GB/s ({peak.source})" if peak else "no vendor peak listed"
    print(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s; {vendor}")
    rows = run(shapes(args.quick), device, timer, args.variants) if args.shapes != "engine" else []
    engine_rows = (
        run(engine_shapes(args.quick), device, timer, ENGINE_VARIANTS, shape="engine")
        if args.shapes != "benchmark"
        else []
    )
    for r in rows + engine_rows:
        if "gbps" in r:
            r["pct_copy"] = 100 * r["gbps"] * 1e9 / copy_bps
    result = dict(
        benchmark="kernels",
        provenance=prov,
        peak=None if peak is None else dict(name=peak.name, bandwidth=peak.bandwidth, source=peak.source),
        copy_bandwidth=copy_bps,
        shape=dict(
            num_q_heads=NUM_Q_HEADS,
            num_kv_heads=NUM_KV_HEADS,
            head_dim=HEAD_DIM,
            block_size=BLOCK_SIZE,
            dtype="float16",
        ),
        rows=rows,
        # The engine's shape apart from the benchmark's rows (another dtype and heads: other bytes per token).
        engine=dict(
            shape=dict(
                num_q_heads=ENGINE_HEADS[0],
                num_kv_heads=ENGINE_HEADS[1],
                head_dim=ENGINE_HEADS[2],
                block_size=BLOCK_SIZE,
                dtype=str(ENGINE_DTYPE).removeprefix("torch."),
            ),
            rows=engine_rows,
        ),
        targets=targets(rows) + engine_targets(engine_rows),
        kernel_runs=kernel_runs(),  # how every kernel launch ran: "compiled" only, or a fallback shows here
    )
    for t in result["targets"]:
        value = "not measured" if t["value"] is None else f"{t['value']:.2f}"
        print(f"{'MET ' if t['met'] else 'MISS' if t['met'] is False else '  - '} {t['target']}: {value}")
    print(f"wrote {write_results(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
