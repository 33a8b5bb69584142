"""kvcourse: the package behind *The KV Cache, from Zero to Serving*.

Every chapter of the book imports from here; every function here is tested.
"""

from .attention import causal_attention, decode_attention_ref
from .cache import CacheOverflowError, KVCache
from .generate import GenerationResult, generate, stream_generate, timed_generate
from .loader import gguf_path, load_pretrained
from .model import LlamaConfig, LlamaModel

__version__ = "0.1.0"

__all__ = [
    "CacheOverflowError",
    "GenerationResult",
    "KVCache",
    "LlamaConfig",
    "LlamaModel",
    "causal_attention",
    "decode_attention_ref",
    "generate",
    "gguf_path",
    "load_pretrained",
    "stream_generate",
    "timed_generate",
]
