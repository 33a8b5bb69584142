"""kvcourse: the package behind *The KV Cache, from Zero to Serving*.

Every chapter of the book imports from here; every function here is tested.
"""

from .lazy import lazy_exports

_EXPORTS = {  # name -> the submodule that defines it, imported when the name is first read
    "ForwardBatch": ".batch",
    "SeqSlice": ".batch",
    "CacheOverflowError": ".cache",
    "KVCache": ".cache",
    "QuantizedKVCache": ".compression",
    "GenerationResult": ".generation",
    "generate": ".generation",
    "generate_paged": ".generation",
    "stream_generate": ".generation",
    "timed_generate": ".generation",
    "causal_attention": ".kernels.reference",
    "decode_attention_ref": ".kernels.reference",
    "gguf_path": ".loader",
    "load_pretrained": ".loader",
    "LlamaConfig": ".model",
    "LlamaModel": ".model",
    "SamplingParams": ".sequence",
    "Sequence": ".sequence",
    "SequenceStatus": ".sequence",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

try:
    import torch as _torch
except ImportError:  # the control plane alone (kvcourse.control), where there is no torch: no kernels to run
    _torch = None
if _torch is not None:
    # Where Triton kernels run (the GPU, or Triton's CPU interpreter) must be settled before anything imports
    # Triton, and ``import kvcourse`` is where the chapters settle it: kvcourse.kernels does, on import.
    from . import kernels  # noqa: F401

from . import results  # the committed benchmark results, shipped as package data

__version__ = "0.1.0"
