"""kvcourse: the package behind *The KV Cache, from Zero to Serving*.

Every chapter of the book imports from here; every function here is tested.
"""

from .batch import ForwardBatch, SeqSlice
from .cache import CacheOverflowError, KVCache
from .compression import QuantizedKVCache
from .generate import GenerationResult, generate, generate_paged, stream_generate, timed_generate
from .kernels.reference import causal_attention, decode_attention_ref
from .loader import gguf_path, load_pretrained
from .model import LlamaConfig, LlamaModel
from .sequence import SamplingParams, Sequence, SequenceStatus
from . import results  # the committed benchmark results, shipped as package data

__version__ = "0.1.0"

__all__ = [
    "CacheOverflowError",
    "ForwardBatch",
    "GenerationResult",
    "KVCache",
    "LlamaConfig",
    "LlamaModel",
    "QuantizedKVCache",
    "SamplingParams",
    "SeqSlice",
    "Sequence",
    "SequenceStatus",
    "causal_attention",
    "decode_attention_ref",
    "generate",
    "generate_paged",
    "gguf_path",
    "load_pretrained",
    "stream_generate",
    "timed_generate",
]
