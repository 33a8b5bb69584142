"""Chapter 7's compressed caches: fewer bytes per token, each at a measured cost in quality.

* :mod:`.quantize` -- integer (per token, per channel), fp8 and 16-bit formats, scales counted;
* :mod:`.quantized_cache` -- :class:`QuantizedKVCache`: per-token and KIVI-style quantized K/V;

Every cache here speaks the contiguous-cache protocol (``seq_len``, ``update``), so
``model(ids, cache=...)`` and ``kvcourse.generate(..., cache=...)`` run on it unchanged.
"""

from .quantize import FORMATS, QuantizedTensor, dequantize, fake_quantize, quantize
from .quantized_cache import SCHEMES, QuantizedKVCache

__all__ = [
    "FORMATS",
    "QuantizedKVCache",
    "QuantizedTensor",
    "SCHEMES",
    "dequantize",
    "fake_quantize",
    "quantize",
]
