"""Chapter 8's compression sweep: every compressed cache's memory and quality on SmolLM2-135M.

    python benchmarks/bench_compression.py [--tokens 1024] [--new-tokens 32] [--json out.json]

All measured on held-out text that ships with Python (``kvcourse.quality.heldout_ids``: CPython's
pydoc topics), against the full fp32 cache on the same tokens:

* quantization (``QuantizedKVCache``): fp16, bf16, fp8, int8 / int4 / int2 per token, KIVI-style
  int4 / int2 (and its ablations: no fp16 window, per-token keys with the window). The text is fed
  32 tokens per forward, as a chunked prefill would (per-token schemes give the same numbers for any
  chunk size). Greedy agreement on the chat prompts ``kvcourse.quality.CHAT_PROMPTS``.
* sliding windows with and without attention sinks, 64 to 256 tokens held (exact decode-time
  attention in one pass, ``simulate_window_logits``, checked against the real ring buffer);
* token dropping (``DroppingKVCache``): H2O, SnapKV and the streaming baseline, keeping 50% and 25%
  of a context (the first 768 tokens), scored on the tokens that follow; a needle-in-a-haystack probe;
* fewer KV heads: SmolLM2's 3 KV heads mean-pooled into 1 (MQA, no retraining).

Chapter 8 plots the JSON this writes and recomputes a few of its points live. It took about 15
minutes on a 2-core CPU; nothing here is timed.
"""

from __future__ import annotations

import argparse
import json
import math

import kvcourse
from kvcourse import quality as Q
from kvcourse.compression import (
    QuantizedKVCache,
    SinkKVCache,
    compressed_continuation_logits,
    generate_compressed,
    prefill,
    prefill_prompt,
    simulate_window_logits,
)
from kvcourse.mla import pooled_kv_heads
from machine import machine_info

QUANT_CHUNK = 32  # tokens per forward when reading the text through a quantized cache

# name -> QuantizedKVCache arguments
QUANT_CONFIGS = {
    "fp16": dict(bits=16, scheme="fp16"),
    "bf16": dict(bits=16, scheme="bf16"),
    "fp8 e4m3": dict(bits=8, scheme="fp8"),
    "int8 per-token": dict(bits=8),
    "int4 per-token": dict(bits=4),
    "int2 per-token": dict(bits=2),
    "int4 KIVI": dict(bits=4, scheme="kivi"),
    "int2 KIVI": dict(bits=2, scheme="kivi"),
    "int4 KIVI, no window": dict(bits=4, scheme="kivi", residual_length=0),
    "int4 per-token, window 128": dict(bits=4, residual_length=128),
    "int2 KIVI, no window": dict(bits=2, scheme="kivi", residual_length=0),
}
GREEDY_QUANT = ["fp8 e4m3", "int8 per-token", "int4 per-token", "int4 KIVI", "int2 KIVI"]
WINDOWS = [(64, 0), (60, 4), (128, 0), (124, 4), (127, 1), (256, 0), (252, 4)]
CONTEXT_SHARE = 0.75  # of the scored tokens: the context a dropping policy compresses; the rest is read after
DROP_METHODS = ("h2o", "snapkv", "streaming")
DROP_FRACTIONS = (0.5, 0.25)
NEEDLE_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
NEEDLE_SECRETS = ("4817", "7093")
NEEDLE_HAYSTACK = (1100, 600)  # offset and length, in tokens of the held-out text
RING_CHECK = (96, 28, 4)  # tokens decoded one by one through a ring of 28 + 4 sinks, against the simulation


PARTS = ("quantization", "window", "dropping", "heads")


def _quality(q: Q.Quality) -> dict:
    return {"ppl": q.ppl, "ref_ppl": q.ref_ppl, "ppl_change": q.ppl_change, "top1": q.top1, "kl": q.kl,
            "num_tokens": q.num_tokens}  # fmt: skip


def _greedy(g: Q.GreedyAgreement) -> dict:
    return {"agreement": g.agreement, "identical": g.identical, "prompts": len(g.reference), "matched": g.matched}


def quantization(model, ids, ref, chat, chat_ref, new_tokens, names=None) -> list[dict]:
    rows = []
    for name, kwargs in QUANT_CONFIGS.items():
        if names is not None and name not in names:
            continue
        cache = QuantizedKVCache.for_model(model.config, **kwargs)
        logits = Q.stream_logits(model, ids, cache, chunk_size=QUANT_CHUNK)
        row = {"name": name, **kwargs, "chunk_size": QUANT_CHUNK, "bytes_per_token": cache.bytes_per_token,
               **_quality(Q.compare(logits[:-1], ref[:-1], ids[1:]))}  # fmt: skip
        if name in GREEDY_QUANT:
            make = lambda kw=kwargs: QuantizedKVCache.for_model(model.config, **kw)  # noqa: E731
            row["greedy"] = _greedy(Q.greedy_agreement(model, chat, make, new_tokens, reference=chat_ref))
        rows.append(row)
        print(
            f"{name:28s} {row['bytes_per_token']:8.0f} B/token  ppl {row['ppl']:8.3f}  top-1 {row['top1']:.3f}  "
            f"KL {row['kl']:.4f}",
            flush=True,
        )
    return rows


def windows(model, ids, ref, bytes_per_token_fp16) -> dict:
    rows = []
    for window, sinks in WINDOWS:
        logits = simulate_window_logits(model, ids, window, sinks)
        held = window + sinks
        rows.append({"name": f"{sinks} sinks + window {window}" if sinks else f"window {window}", "window": window,
                     "num_sinks": sinks, "held_tokens": held,
                     "bytes_per_token": held * bytes_per_token_fp16 / len(ids),  # memory at the end, per token read
                     **_quality(Q.compare(logits[:-1], ref[:-1], ids[1:]))})  # fmt: skip
        print(f"{rows[-1]['name']:28s} ppl {rows[-1]['ppl']:8.3f}  top-1 {rows[-1]['top1']:.3f}", flush=True)
    # The one-pass simulation equals decoding token by token through the ring buffer.
    n, window, sinks = RING_CHECK
    check = ids[:n]
    cache = SinkKVCache.for_model(model.config, window=window, num_sinks=sinks)
    ring = Q.stream_logits(model, check, cache, chunk_size=1)
    sim = simulate_window_logits(model, check, window, sinks)
    return {"results": rows, "ring_check": {"tokens": n, "window": window, "num_sinks": sinks,
                                            "max_abs_diff": float((ring - sim).abs().max()),
                                            "logit_scale": float(sim.abs().max())}}  # fmt: skip


def dropping(model, tok, ids, chat, chat_ref, new_tokens) -> dict:
    n_context = int(len(ids) * CONTEXT_SHARE)
    context, continuation = ids[:n_context], ids[n_context:]
    prefilled = prefill(model, context)
    ref = compressed_continuation_logits(model, context, continuation, None, prefilled=prefilled)
    chat_prefilled = [prefill_prompt(model, p) for p in chat]
    rows = []
    for frac in DROP_FRACTIONS:
        for method in DROP_METHODS:
            budget = int(n_context * frac)
            logits = compressed_continuation_logits(model, context, continuation, budget, method, prefilled)
            greedy = Q.GreedyAgreement(
                [list(r) for r in chat_ref],
                [
                    generate_compressed(model, p, max(1, int(len(p) * frac)), method, new_tokens, c)
                    for p, c in zip(chat, chat_prefilled)
                ],
            )
            rows.append({"method": method, "budget_frac": frac, "budget": budget, "greedy": _greedy(greedy),
                         **_quality(Q.compare(logits[:-1], ref[:-1], continuation[1:]))})  # fmt: skip
            print(
                f"{method:10s} {frac:.0%}  ppl {rows[-1]['ppl']:8.3f}  top-1 {rows[-1]['top1']:.3f}  "
                f"greedy {rows[-1]['greedy']['agreement']:.2f}",
                flush=True,
            )
    hay = Q.heldout_ids(tok, NEEDLE_HAYSTACK[1], offset=NEEDLE_HAYSTACK[0])
    found = {"full": 0, **{f"{m} {f:.0%}": 0 for f in DROP_FRACTIONS for m in DROP_METHODS}}
    for secret in NEEDLE_SECRETS:
        want = tok.encode(" " + secret)
        for depth in NEEDLE_DEPTHS:
            prompt = Q.needle_prompt(tok, hay, depth, secret)
            prefilled = prefill_prompt(model, prompt)
            found["full"] += (
                generate_compressed(model, prompt, None, max_new_tokens=len(want), prefilled=prefilled) == want
            )
            for frac in DROP_FRACTIONS:
                for method in DROP_METHODS:
                    out = generate_compressed(model, prompt, int(len(prompt) * frac), method, len(want), prefilled)
                    found[f"{method} {frac:.0%}"] += out == want
    trials = len(NEEDLE_SECRETS) * len(NEEDLE_DEPTHS)
    print("needle found:", found, "of", trials, flush=True)
    return {"context": n_context, "continuation": len(continuation), "results": rows,
            "needle": {"depths": list(NEEDLE_DEPTHS), "secrets": list(NEEDLE_SECRETS), "trials": trials,
                       "haystack_tokens": NEEDLE_HAYSTACK[1], "found": found}}  # fmt: skip


def pooled_heads(model, ids, ref, chat, chat_ref, new_tokens) -> dict:
    with pooled_kv_heads(model, 1):
        logits = Q.stream_logits(model, ids)
        greedy = Q.greedy_agreement(
            model, chat, lambda: kvcourse.KVCache.for_model(model.config), new_tokens, reference=chat_ref
        )
    row = {"name": "MQA (3 KV heads mean-pooled into 1)", "num_kv_heads": 1, **_quality(Q.compare(logits[:-1], ref[:-1], ids[1:])),
           "greedy": _greedy(greedy)}  # fmt: skip
    print(f"MQA pooled: ppl {row['ppl']:.3f}  top-1 {row['top1']:.3f}", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024, help="held-out tokens to score (default 1024)")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per chat prompt (default 32)")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--note", default="", help="what to record about the machine (shared? loaded?)")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated parts to run (default all: {','.join(PARTS)}), to split the sweep over processes",
    )
    parser.add_argument("--quant", help="semicolon-separated names from QUANT_CONFIGS to run (default all)")
    args = parser.parse_args()
    parts = args.parts.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"--parts: unknown {unknown}, choose from {list(PARTS)}")
    names = args.quant.split(";") if args.quant else None
    if names and [n for n in names if n not in QUANT_CONFIGS]:
        parser.error(
            f"--quant: unknown {[n for n in names if n not in QUANT_CONFIGS]}, choose from {list(QUANT_CONFIGS)}"
        )
    kvcourse.utils.seed_everything(0)
    model, tok = kvcourse.load_pretrained()
    ids = Q.heldout_ids(tok, args.tokens)
    ref = Q.stream_logits(model, ids)
    cfg = model.config
    values_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim
    chat = [tok.encode_chat(p) for p in Q.CHAT_PROMPTS]
    chat_ref = [kvcourse.generate(model, p, args.new_tokens) for p in chat]
    result = {
        "benchmark": "bench_compression",
        "machine": {**machine_info(), **({"note": args.note} if args.note else {})},
        "model": "SmolLM2-135M-Instruct (fp32 on CPU)",
        "text": {
            "source": "pydoc_data.topics (kvcourse.quality.HELDOUT_TOPICS)",
            "tokens": len(ids),
            "digest": Q.ids_digest(ids),
        },
        "full": {
            "ppl": Q.perplexity(ref[:-1], ids[1:]),
            "bytes_per_token_fp32": 4 * values_per_token,
            "bytes_per_token_fp16": 2 * values_per_token,
        },
        "chat": {
            "prompts": list(Q.CHAT_PROMPTS),
            "new_tokens": args.new_tokens,
            "reference": [tok.decode(r) for r in chat_ref],
        },
    }
    if "quantization" in parts:
        result["quantization"] = quantization(model, ids, ref, chat, chat_ref, args.new_tokens, names)
    if "window" in parts:
        result["window"] = windows(model, ids, ref, 2 * values_per_token)
    if "dropping" in parts:
        result["dropping"] = dropping(model, tok, ids, chat, chat_ref, args.new_tokens)
    if "heads" in parts:
        result["heads"] = pooled_heads(model, ids, ref, chat, chat_ref, args.new_tokens)
    assert math.isfinite(result["full"]["ppl"])
    text = json.dumps(result, indent=1)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
