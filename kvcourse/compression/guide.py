"""What chapter 8 compares its measurements with: the course plan's earlier numbers and the published claims.

Data only, kept out of the chapter's cells so that the page shows the comparison, not the bookkeeping.

* :data:`GUIDE` -- the course plan's own earlier measurements, on another text than ours: perplexity with the
  compressed cache, perplexity with the full cache, and top-1 agreement (``None`` where not measured). Only
  the relative change ``ppl / full_ppl - 1`` is comparable with ours.
* :data:`CLAIMS` -- for each technique, what a paper or one of the course's sources claims, and whether our
  measurement on SmolLM2-135M agrees.
"""

from __future__ import annotations

__all__ = ["CLAIMS", "GUIDE", "guide_change"]

# technique -> (perplexity, full-cache perplexity, top-1 agreement or None)
GUIDE: dict[str, tuple[float, float, float | None]] = {
    "int8 per-token": (12.748, 12.742, 0.983),
    "int4 per-token": (14.76, 12.742, 0.815),
    "int4 KIVI": (13.00, 12.742, 0.920),
    "int2 per-token": (458.0, 12.742, None),
    "int2 KIVI": (26.8, 12.742, None),
    "window 128": (29.3, 11.50, None),
    "4 sinks + window 124": (13.7, 11.50, None),
}

# technique -> (source, its claim, what we measured of it)
CLAIMS: dict[str, tuple[str, str, str]] = {
    "int8 per-token": ("What is KV Cache?", "halves the cache, minimal quality impact", "agrees"),
    "int4 per-token": (
        "What is KV Cache?",
        "quarters the cache, impact usually minimal",
        "more than a quarter with the scales, and not minimal",
    ),
    "int4 KIVI": ("KIVI", "4-bit close to fp16", "agrees"),
    "int2 KIVI": ("KIVI", "2-bit 'almost the same quality' on 7B+ models", "not at 135M"),
    "fp8 e4m3": ("vLLM docs", "E4M3 'only minimally degrades' accuracy", "small here, but int8 does better"),
    "window 128": ("StreamingLLM", "a window alone collapses once the first tokens leave", "agrees"),
    "4 sinks + window 124": ("StreamingLLM", "4 sinks restore perplexity near the full cache", "agrees"),
    "h2o 25%": ("H2O", "20% heavy hitters keep quality", "on text yes, on the needle no"),
    "snapkv 25%": ("SnapKV", "finds needles at high compression", "agrees"),
    "MQA (pooled)": ("GQA paper", "mean-pooling needs ~5% retraining", "agrees: unusable without it"),
}


def guide_change(name: str) -> float | None:
    """The guide's perplexity change for technique ``name`` (``None`` if the guide did not measure it)."""
    if name not in GUIDE:
        return None
    ppl, full_ppl, _ = GUIDE[name]
    return ppl / full_ppl - 1
