"""Attention kernels and the torch references they must equal.

* :mod:`.reference` -- plain torch, obviously right: contiguous causal and decode attention, paged
  decode and ragged (varlen) prefill attention read through block tables, and the K/V cache write.
* :mod:`.testing` -- random ragged, paged problems with known answers (NaN in every unused slot).

Chapter 5's Triton kernels sit next to these, each tested against its reference.
"""

from .reference import (
    causal_attention,
    decode_attention_ref,
    paged_attention,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    position_masked_attention,
    repeat_kv,
    reshape_and_cache_ref,
)

__all__ = [
    "causal_attention",
    "decode_attention_ref",
    "paged_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
    "position_masked_attention",
    "repeat_kv",
    "reshape_and_cache_ref",
]
