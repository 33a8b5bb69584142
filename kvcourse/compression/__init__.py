"""Chapter 8's compressed caches: fewer bytes per token, each at a measured cost in quality.

* :mod:`.quantization` -- integer (per token, per channel), fp8 and 16-bit formats, scales counted;
* :mod:`.quantized_cache` -- :class:`QuantizedKVCache`: per-token and KIVI-style quantized K/V;
* :mod:`.window` -- :class:`SinkKVCache`: a sliding window as a ring buffer, with attention sinks;
* :mod:`.dropping` -- :class:`DroppingKVCache`: keep the tokens attention uses (H2O, SnapKV);
* :mod:`.paged_int8` -- :class:`Int8PagedKVStore`: chapter 4's pool in int8 with per-token scales (the
  ``"paged-int8-torch"`` and ``"triton-int8"`` backends of :mod:`kvcourse.backends` run on it);
* :mod:`.report` -- the committed sweep as chapter 8 shows it: every cache on one chart, the table against the claims.

Every cache here speaks the contiguous-cache protocol (``seq_len``, ``update``), so
``model(ids, cache=...)`` and ``kvcourse.generate(..., cache=...)`` run on it unchanged. The window
and dropping caches also report ``key_positions``: they hold only some of the past.
"""

from .dropping import (
    DroppingKVCache,
    compressed_continuation_logits,
    generate_compressed,
    prefill,
    prefill_prompt,
    select_tokens,
)
from .paged_int8 import Int8PagedKVStore
from .quantization import FORMATS, QuantizedTensor, dequantize, fake_quantize, quantize
from .quantized_cache import SCHEMES, QuantizedKVCache
from .window import SinkKVCache, ring_slot, simulate_window_logits, window_mask

__all__ = [
    "DroppingKVCache",
    "FORMATS",
    "Int8PagedKVStore",
    "QuantizedKVCache",
    "QuantizedTensor",
    "SCHEMES",
    "SinkKVCache",
    "compressed_continuation_logits",
    "dequantize",
    "fake_quantize",
    "generate_compressed",
    "prefill",
    "prefill_prompt",
    "quantize",
    "ring_slot",
    "select_tokens",
    "simulate_window_logits",
    "window_mask",
]
