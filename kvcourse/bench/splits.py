"""How many KV splits a decode step should use, measured: every split count where the heuristic decides (issue 30).

    python -m kvcourse.bench splits [--out benchmarks/results] [--smoke]

:func:`~kvcourse.kernels.triton_paged.choose_num_splits` first aimed for two programs per streaming multiprocessor,
with at most one split per started 256 positions. The first GPU run (an H200, ``kernels-nvidia-h200-2026-11-26.json``)
questioned it from both sides: at 512 tokens the heuristic's split ran slower than one split at every batch it
split (20 GB/s against 34 at batch 1), and at batch 1 the 8k and 32k contexts reached a third of the 64k
bandwidth with about the same number of splits. Its alternatives were never timed. This benchmark times
:func:`~kvcourse.kernels.triton_paged.paged_decode` (fp16, chapter 5's heads: 32 query / 8 KV heads, D = 128,
blocks of 16) at every split count 1, 2, 4, ..., 64 that leaves each split 16 or more positions, on batches of 1,
8 and 32 at contexts of 512 to 32k tokens and on 1 x 64k. Each row keeps every count's median time, the
heuristic's count, the fastest count and the heuristic's time over the fastest; ``summary`` names the shapes where
the heuristic is 10% or more off. The heuristic now in place was fitted to the first such file,
``kvcourse/results/splits-nvidia-h200-2026-11-28.json`` (``tests/test_bench_splits.py`` checks it against the file).

Without a GPU it refuses (the interpreter times Python); ``--smoke`` then checks on a tiny shape that every split
count computes the same attention as one split (correctness only).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from .kernels import BLOCK_SIZE, NUM_KV_HEADS, Problem, provenance

__all__ = ["SHAPES", "SPLITS", "split_counts", "summarize", "sweep"]

SPLITS = (1, 2, 4, 8, 16, 32, 64)
SHAPES = tuple((b, c) for b in (1, 8, 32) for c in (512, 2048, 8192, 32768)) + ((1, 65536),)
MIN_POSITIONS = 16  # a split shorter than one tile of positions only adds a partial result to merge


def split_counts(context: int, chosen: int) -> list[int]:
    """The counts timed at ``context``: :data:`SPLITS` that leave each split ``MIN_POSITIONS`` or more, and ``chosen``."""
    return sorted({s for s in SPLITS if s == 1 or context // s >= MIN_POSITIONS} | {chosen})


def sweep(shapes, device: torch.device, timer, num_sms: int | None) -> list[dict]:
    """One row per shape: ``{batch, context, chosen, best, ms: {count: median ms}, chosen_over_best, best_gbps}``."""
    from ..kernels.triton_paged import choose_num_splits, paged_decode

    rows = []
    for batch, context in shapes:
        p = Problem(batch, context, device)
        scale = p.head_dim**-0.5
        chosen = choose_num_splits(batch, NUM_KV_HEADS, context, num_sms)
        ms = {}
        for s in split_counts(context, chosen):
            ms[s] = timer(lambda s=s: paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, scale, s))
        best = min(ms, key=ms.get)
        rows.append({"batch": batch, "context": context, "chosen": chosen, "best": best,
                     "ms": {str(s): t for s, t in ms.items()}, "chosen_over_best": ms[chosen] / ms[best],
                     "best_gbps": p.bytes() / (ms[best] * 1e-3) / 1e9})  # fmt: skip
        print(
            f"batch {batch:3d} x context {context:6d}: heuristic {chosen:2d} splits, fastest {best:2d} "
            f"({ms[chosen] / ms[best]:.2f}x its time); " + ", ".join(f"{s}: {t:.3f} ms" for s, t in ms.items())
        )
        del p
    return rows


def summarize(rows: list[dict]) -> dict:
    """Where the heuristic is off by 10% or more, and its worst shape."""
    off = [
        {k: r[k] for k in ("batch", "context", "chosen", "best", "chosen_over_best")}
        for r in rows
        if r["chosen_over_best"] >= 1.1
    ]
    worst = max(rows, key=lambda r: r["chosen_over_best"]) if rows else None
    return {"shapes": len(rows), "heuristic_off_by_10pct": off,
            "worst": None if worst is None else {k: worst[k] for k in ("batch", "context", "chosen", "best",
                                                                       "chosen_over_best")}}  # fmt: skip


def smoke() -> int:
    """No GPU: every split count gives one split's answer on a tiny shape, in Triton's interpreter."""
    from ..kernels.triton_paged import paged_decode

    with torch.inference_mode():
        p = Problem(2, 100, torch.device("cpu"), dtype=torch.float32, heads=(4, 2, 64))
        outs = {
            s: paged_decode(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 0.125, s)
            for s in split_counts(100, 1)
        }
    for s, out in outs.items():
        torch.testing.assert_close(out, outs[1], rtol=1e-5, atol=1e-5, msg=lambda m, s=s: f"{s} splits: {m}")
    print(
        f"smoke run in Triton's interpreter: split counts {sorted(outs)} agree on batch 2 x context 100 "
        "(correctness only; no speed is reported without a GPU)"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.bench splits", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="where the JSON goes")
    parser.add_argument("--smoke", action="store_true", help="without a GPU: check split counts agree, time nothing")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "kvcourse.bench splits: no CUDA GPU here. Split counts matter for the time of a GPU's programs; the "
            "interpreter runs them one after another, so no figure is produced."
        )
        return smoke() if args.smoke else 0
    import triton.testing

    from ..kernels.triton_paged import num_sms

    device = torch.device("cuda")
    prov = provenance(device)
    rows = sweep(SHAPES, device, lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"),
                 num_sms(device))  # fmt: skip
    result = {"benchmark": "splits", "provenance": prov, "block_size": BLOCK_SIZE, "rows": rows,
              "summary": summarize(rows)}  # fmt: skip
    gpu = "".join(c if c.isalnum() else "-" for c in prov.get("gpu", "cpu")).strip("-").lower()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"splits-{gpu}-{prov['date'][:10]}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
