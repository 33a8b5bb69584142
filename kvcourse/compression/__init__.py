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

from ..lazy import lazy_exports

_EXPORTS = {  # name -> the submodule that defines it, imported when the name is first read
    "DroppingKVCache": ".dropping",
    "compressed_continuation_logits": ".dropping",
    "generate_compressed": ".dropping",
    "prefill": ".dropping",
    "prefill_prompt": ".dropping",
    "select_tokens": ".dropping",
    "Int8PagedKVStore": ".paged_int8",
    "FORMATS": ".quantization",
    "QuantizedTensor": ".quantization",
    "dequantize": ".quantization",
    "fake_quantize": ".quantization",
    "quantize": ".quantization",
    "SCHEMES": ".quantized_cache",
    "QuantizedKVCache": ".quantized_cache",
    "SinkKVCache": ".window",
    "ring_slot": ".window",
    "simulate_window_logits": ".window",
    "window_mask": ".window",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
