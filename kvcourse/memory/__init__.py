"""The memory bill: how many bytes the KV cache of any model takes.

For every layer, every cached token stores its key and its value for each KV head:

    bytes = 2 (K and V) x layers x KV heads x head dim x tokens x bytes per value x batch

Real configs bend that formula in five ways, and :func:`kv_layout` reads all of
them from a Hugging Face ``config.json``:

* **GQA / MQA**: ``num_key_value_heads`` (or Falcon's ``multi_query: true``, one KV head)
  is what counts, not the number of query heads.
* **explicit head_dim** (Gemma): ``head_dim`` need not be ``hidden_size / num_attention_heads``.
* **legacy keys** (GPT-2, GPT-BigCode, old Falcon): ``n_layer``, ``n_head``, ``n_embd``.
* **MLA** (DeepSeek-V2/V3): a layer caches one latent vector of ``kv_lora_rank`` values
  plus one shared RoPE key of ``qk_rope_head_dim`` values per token, not K and V per head.
* **sliding windows**: a windowed layer keeps at most ``window`` tokens, so
  :func:`kv_cache_bytes` caps those layers at the window (``sliding_window`` for
  every layer, per-layer ``layer_types``, Gemma-2's alternation, and Qwen2's
  ``use_sliding_window: false`` honoured).

Quantized dtypes (fp8, int8, int4) are counted as their payload only: 1, 1 and
0.5 bytes per value. Scales are not free; pass ``quant_group_size=g`` to add
one fp16 scale (2 bytes) per ``g`` consecutive values of every cached vector
(KIVI-style per-group quantization). fp8 in vLLM uses one scale per tensor per
layer, a few bytes in total, which the default (no scales) models well.

Tensor parallelism splits KV heads across ranks (each rank holds
``H_kv / tp_size``); when ``tp_size`` exceeds ``H_kv`` every rank holds one
replicated head, as vLLM does. An MLA latent is shared by all heads, so every
rank holds all of it. :func:`kv_cache_bytes` returns bytes **per rank**.

Units: ``GB`` is 10**9 bytes and ``GiB`` is 2**30 bytes; :func:`format_bytes` prints both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .catalog import CATALOG, CatalogEntry, catalog_names, get_entry

__all__ = [
    "CATALOG",
    "CatalogEntry",
    "DTYPE_BYTES",
    "GB",
    "GiB",
    "KVLayout",
    "catalog_names",
    "crossover_tokens",
    "dtype_bytes",
    "format_bytes",
    "generate_with_cache",
    "get_entry",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "kv_layout",
    "load_config",
    "max_concurrent_sequences",
    "prefill_flops",
    "weight_bytes",
]

GB = 10**9
GiB = 2**30

# Bytes per cached value. int4 is half a byte: two values share one byte.
DTYPE_BYTES: dict[str, float] = {"fp32": 4, "bf16": 2, "fp16": 2, "fp8": 1, "int8": 1, "int4": 0.5}
_DTYPE_ALIASES = {
    "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
    "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "float16": "fp16", "half": "fp16", "torch.float16": "fp16",
    "fp8_e4m3": "fp8", "fp8_e5m2": "fp8", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8",
    "torch.float8_e4m3fn": "fp8", "torch.float8_e5m2": "fp8",
}
_SCALE_BYTES = 2  # one fp16 scale per quantization group


def _dtype_key(dtype: Any) -> str:
    name = str(dtype).lower() if dtype is not None else ""
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or a torch dtype of those), got {dtype!r}")
    return name


def dtype_bytes(dtype: Any) -> float:
    """Bytes per stored value: 4 (fp32), 2 (bf16/fp16), 1 (fp8/int8), 0.5 (int4)."""
    return DTYPE_BYTES[_dtype_key(dtype)]


# ---------------------------------------------------------------------------------------------
# Reading a config
# ---------------------------------------------------------------------------------------------
def load_config(config: Any) -> dict:
    """A config dict from a dict, a ``config.json`` path, a catalog name, or an object with ``to_dict()``."""
    if isinstance(config, Mapping):
        cfg = dict(config)
    elif hasattr(config, "to_dict") and callable(config.to_dict):
        cfg = dict(config.to_dict())
    elif isinstance(config, (str, Path)):
        if isinstance(config, str) and config in CATALOG:
            cfg = dict(CATALOG[config].config)
        else:
            path = Path(config)
            if not path.is_file():
                raise ValueError(
                    f"config must be a config dict, a path to a config.json, or a catalog name "
                    f"(one of {', '.join(catalog_names())}); got {str(config)!r}, which is neither"
                )
            try:
                cfg = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"config file {str(path)!r} is not valid JSON: {e}") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"config file {str(path)!r} must hold a JSON object, got {type(cfg).__name__}")
    else:
        raise TypeError(
            f"config must be a dict, a path to a config.json, or a catalog name; got {type(config).__name__}"
        )
    # Multimodal wrappers (Llava, Gemma 3, ...) keep the language model's shape in text_config.
    if not _has_any(cfg, _LAYER_KEYS) and isinstance(cfg.get("text_config"), Mapping):
        cfg = dict(cfg["text_config"])
    return cfg


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")


def _has_any(cfg: Mapping, keys: tuple[str, ...]) -> bool:
    return any(cfg.get(k) is not None for k in keys)


def _positive_int(cfg: Mapping, keys: tuple[str, ...], what: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"config[{key!r}] ({what}) must be a positive int, got {value!r}")
        return value
    raise ValueError(f"config has no {what}: expected one of the keys {', '.join(map(repr, keys))}")


@dataclass(frozen=True)
class KVLayout:
    """What one token leaves in the cache, read from a config.

    ``values_per_layer`` is the count of cached numbers per token per layer with
    ``tp_size=1``: ``2 * num_kv_heads * head_dim`` for MHA/GQA/MQA, or
    ``kv_lora_rank + qk_rope_head_dim`` for MLA. ``layer_windows[i]`` is layer
    ``i``'s sliding window in tokens, or ``None`` for full attention.
    """

    attention: str  # "MHA", "GQA", "MQA" or "MLA"
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int  # 1 for MLA: one latent shared by every head
    head_dim: int  # for MLA, the latent width kv_lora_rank + qk_rope_head_dim
    values_per_layer: int
    layer_windows: tuple[int | None, ...]

    @property
    def num_windowed_layers(self) -> int:
        return sum(w is not None for w in self.layer_windows)

    def kv_heads_per_rank(self, tp_size: int = 1) -> int:
        """KV heads each tensor-parallel rank stores (replicated when ``tp_size > num_kv_heads``)."""
        _check_tp(self, tp_size)
        if self.attention == "MLA":
            return 1
        return max(1, self.num_kv_heads // tp_size)

    def values_per_layer_per_rank(self, tp_size: int = 1) -> int:
        if self.attention == "MLA":
            _check_tp(self, tp_size)
            return self.values_per_layer
        return 2 * self.kv_heads_per_rank(tp_size) * self.head_dim


def _check_tp(layout: KVLayout, tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    if layout.num_attention_heads % tp_size:
        raise ValueError(
            f"tp_size={tp_size} must divide num_attention_heads={layout.num_attention_heads}: "
            "tensor parallelism gives each rank a whole number of query heads"
        )
    h = layout.num_kv_heads
    if layout.attention != "MLA" and (h % tp_size if tp_size <= h else tp_size % h):
        raise ValueError(
            f"tp_size={tp_size} and num_key_value_heads={h} must divide one another: KV heads are split "
            "evenly across ranks, or each head is replicated on tp_size / num_key_value_heads ranks"
        )


def _layer_windows(cfg: Mapping, num_layers: int) -> tuple[int | None, ...]:
    model_type = str(cfg.get("model_type", "")).lower()
    use_sw = cfg.get("use_sliding_window")
    if use_sw is None and model_type.startswith(("qwen2", "qwen3")):
        use_sw = False  # Qwen2's default: the sliding_window key is present but unused
    if use_sw is False:
        return (None,) * num_layers
    window = cfg.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"config['sliding_window'] must be a positive int or null, got {window!r}")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers:
            raise ValueError(
                f"config['layer_types'] must be a list with one entry per layer ({num_layers}), got {layer_types!r}"
            )
        windows: list[int | None] = []
        for i, kind in enumerate(layer_types):
            if kind == "full_attention":
                windows.append(None)
            elif kind == "sliding_attention":
                if window is None:
                    raise ValueError(f"config['layer_types'][{i}] is 'sliding_attention' but sliding_window is null")
                windows.append(window)
            elif kind == "chunked_attention":  # Llama 4: attends within fixed chunks, keeps at most one chunk
                windows.append(_positive_int(cfg, ("attention_chunk_size",), "attention chunk size"))
            else:
                raise ValueError(
                    f"config['layer_types'][{i}] = {kind!r} is not supported; expected 'full_attention', "
                    "'sliding_attention' or 'chunked_attention'"
                )
        return tuple(windows)
    if window is None:
        return (None,) * num_layers
    if model_type.startswith(("qwen2", "qwen3")):
        first = cfg.get("max_window_layers", 0) or 0
        return tuple(window if i >= first else None for i in range(num_layers))
    pattern = cfg.get("sliding_window_pattern")
    if pattern is None and model_type == "gemma2":
        pattern = 2  # Gemma 2 alternates: even layers local (sliding), odd layers global
    if pattern is not None:
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ValueError(f"config['sliding_window_pattern'] must be a positive int, got {pattern!r}")
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    return (window,) * num_layers  # Mistral v0.1, Phi-3: every layer windowed


def kv_layout(config: Any) -> KVLayout:
    """Read the cache-relevant shape of a model from its config (dict, path or catalog name)."""
    cfg = load_config(config)
    num_layers = _positive_int(cfg, _LAYER_KEYS, "layer count")
    num_heads = _positive_int(cfg, _HEAD_KEYS, "attention head count")
    windows = _layer_windows(cfg, num_layers)

    if cfg.get("kv_lora_rank") is not None:  # DeepSeek-V2/V3 multi-head latent attention
        rank = _positive_int(cfg, ("kv_lora_rank",), "MLA latent rank")
        rope = _positive_int(cfg, ("qk_rope_head_dim",), "MLA RoPE key width")
        return KVLayout("MLA", num_layers, num_heads, 1, rank + rope, rank + rope, windows)

    if cfg.get("new_decoder_architecture"):  # Falcon-40B/180B: grouped KV heads under their own key
        kv_heads = _positive_int(cfg, ("num_kv_heads", "n_head_kv", "num_key_value_heads"), "KV head count")
    elif cfg.get("multi_query"):  # Falcon-7B, GPT-BigCode: one K and one V head for all queries
        kv_heads = 1
    elif _has_any(cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")):
        kv_heads = _positive_int(
            cfg, ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"), "KV head count"
        )
    else:
        kv_heads = num_heads  # plain multi-head attention
    if kv_heads > num_heads or num_heads % kv_heads:
        raise ValueError(
            f"KV head count ({kv_heads}) must divide the attention head count ({num_heads})"
        )

    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, ("head_dim",), "head dimension")
    else:
        hidden = _positive_int(cfg, _HIDDEN_KEYS, "hidden size (needed for head_dim)")
        if hidden % num_heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {num_heads} heads; give head_dim explicitly")
        head_dim = hidden // num_heads

    kind = "MHA" if kv_heads == num_heads else "MQA" if kv_heads == 1 else "GQA"
    return KVLayout(kind, num_layers, num_heads, kv_heads, head_dim, 2 * kv_heads * head_dim, windows)


# ---------------------------------------------------------------------------------------------
# The formula
# ---------------------------------------------------------------------------------------------
def _bytes_for_values(values_per_vector: int, vectors: int, dtype: str, quant_group_size: int | None) -> float:
    """Bytes for ``vectors`` cached vectors of ``values_per_vector`` numbers each, scales included."""
    payload = values_per_vector * vectors * DTYPE_BYTES[dtype]
    if quant_group_size is None:
        return payload
    return payload + math.ceil(values_per_vector / quant_group_size) * _SCALE_BYTES * vectors


def _check_quant(dtype: str, quant_group_size: int | None) -> None:
    if quant_group_size is None:
        return
    if isinstance(quant_group_size, bool) or not isinstance(quant_group_size, int) or quant_group_size < 1:
        raise ValueError(f"quant_group_size must be a positive int or None, got {quant_group_size!r}")
    if dtype not in ("fp8", "int8", "int4"):
        raise ValueError(f"quant_group_size only applies to quantized dtypes (fp8, int8, int4), not {dtype!r}")


def _vectors_per_token_per_layer(layout: KVLayout, tp_size: int) -> tuple[int, int]:
    """(cached vectors per token per layer on one rank, values per vector)."""
    if layout.attention == "MLA":
        _check_tp(layout, tp_size)
        return 1, layout.head_dim
    return 2 * layout.kv_heads_per_rank(tp_size), layout.head_dim


def kv_bytes_per_token(
    config: Any, dtype: Any = "bf16", tp_size: int = 1, quant_group_size: int | None = None
) -> int:
    """Bytes one more token of context adds to one sequence's cache (per rank), summed over layers.

    This is the cost while the context is shorter than every sliding window; past a
    window, that layer stops growing (see :func:`kv_cache_bytes`).
    """
    layout = kv_layout(config)
    dt = _dtype_key(dtype)
    _check_quant(dt, quant_group_size)
    vectors, width = _vectors_per_token_per_layer(layout, tp_size)
    return math.ceil(_bytes_for_values(width, vectors * layout.num_layers, dt, quant_group_size))


def kv_cache_bytes(
    config: Any,
    seq_len: int,
    batch_size: int = 1,
    dtype: Any = "bf16",
    tp_size: int = 1,
    quant_group_size: int | None = None,
) -> int:
    """Bytes of K/V one tensor-parallel rank holds for ``batch_size`` sequences of ``seq_len`` tokens.

    Windowed layers hold ``min(seq_len, window)`` tokens; full-attention layers hold ``seq_len``.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0:
        raise ValueError(f"seq_len must be a non-negative int, got {seq_len!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    layout = kv_layout(config)
    dt = _dtype_key(dtype)
    _check_quant(dt, quant_group_size)
    vectors, width = _vectors_per_token_per_layer(layout, tp_size)
    token_layers = sum(seq_len if w is None else min(seq_len, w) for w in layout.layer_windows)
    return math.ceil(_bytes_for_values(width, vectors * token_layers * batch_size, dt, quant_group_size))


# ---------------------------------------------------------------------------------------------
# Weights, GPUs, and printing
# ---------------------------------------------------------------------------------------------
def weight_bytes(model: Any, dtype: Any = "bf16", tp_size: int = 1) -> int:
    """Bytes of a catalog model's weights at ``dtype``, per rank (weights split evenly across ``tp_size``).

    ``model`` is a catalog name, or a config dict carrying ``num_parameters``.
    """
    if isinstance(model, str) and model in CATALOG:
        params = CATALOG[model].num_parameters
    elif isinstance(model, Mapping) and model.get("num_parameters") is not None:
        params = model["num_parameters"]
    else:
        raise ValueError(
            f"model must be a catalog name (one of {', '.join(catalog_names())}) or a dict with num_parameters, "
            f"got {model!r}"
        )
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise ValueError(f"tp_size must be a positive int, got {tp_size!r}")
    return math.ceil(params * dtype_bytes(dtype) / tp_size)


def max_concurrent_sequences(
    model: str,
    gpu_bytes: int,
    seq_len: int,
    dtype: Any = "bf16",
    weight_dtype: Any | None = None,
    gpu_memory_utilization: float = 1.0,
) -> int:
    """How many ``seq_len``-token sequences fit in one GPU's KV budget after the weights (0 if none).

    budget = ``gpu_memory_utilization x gpu_bytes - weight bytes``; vLLM's default utilization is 0.9.
    """
    if not isinstance(gpu_bytes, (int, float)) or isinstance(gpu_bytes, bool) or gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be a positive number, got {gpu_bytes!r}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization!r}")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    budget = gpu_memory_utilization * gpu_bytes - weight_bytes(model, dtype if weight_dtype is None else weight_dtype)
    per_seq = kv_cache_bytes(model, seq_len, dtype=dtype)
    return max(0, int(budget // per_seq))


def format_bytes(n: float) -> str:
    """``n`` bytes in both decimal and binary units, e.g. ``'68.72 GB (64.00 GiB)'``."""
    if isinstance(n, bool) or not isinstance(n, (int, float)) or n < 0:
        raise ValueError(f"n must be a non-negative number of bytes, got {n!r}")
    for dec, bin_, p in (("TB", "TiB", 4), ("GB", "GiB", 3), ("MB", "MiB", 2), ("kB", "KiB", 1)):
        if n >= 1000**p:
            return f"{n / 1000**p:.2f} {dec} ({n / 1024**p:.2f} {bin_})"
    return f"{int(n)} B"


def generate_with_cache(model, ids: list[int], max_new_tokens: int, dtype=None):
    """Greedy cached generation that hands back the cache, to weigh it: ``(new_tokens, cache)``.

    The same loop as :func:`kvcourse.generate` (prefill, then one token per decode step).
    After ``max_new_tokens`` tokens the cache holds ``len(ids) + max_new_tokens - 1``
    positions: the last token generated has not been fed back yet.
    """
    import torch

    from ..cache import KVCache

    if not isinstance(ids, (list, tuple)) or not ids or not all(isinstance(t, int) for t in ids):
        raise ValueError(f"ids must be a non-empty list of token ids, got {ids!r}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    device = next(model.parameters()).device
    cache = KVCache.for_model(model.config, batch_size=1, dtype=dtype or next(model.parameters()).dtype, device=device)
    new: list[int] = []
    feed = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([feed], device=device), cache=cache)
            token = int(logits[0, -1].argmax())
            new.append(token)
            feed = [token]
    return new, cache


def crossover_tokens(model: str, dtype: Any = "bf16", weight_dtype: Any = "bf16") -> int | None:
    """Fewest cached tokens (one sequence) whose K/V outweigh the model's weights; ``None`` if never.

    A model whose every layer is windowed stops growing at its window and may never get there.
    For full-attention models, the same count of tokens spread over a batch weighs the same.
    """
    weights = weight_bytes(model, weight_dtype)
    layout = kv_layout(model)
    if all(w is not None for w in layout.layer_windows) and kv_cache_bytes(model, max(layout.layer_windows), dtype=dtype) < weights:
        return None
    lo, hi = 1, 1
    while kv_cache_bytes(model, hi, dtype=dtype) < weights:
        lo, hi = hi, hi * 2
    while lo < hi:  # smallest n with cache(n) >= weights
        mid = (lo + hi) // 2
        if kv_cache_bytes(model, mid, dtype=dtype) >= weights:
            hi = mid
        else:
            lo = mid + 1
    return lo


def prefill_flops(model: str, num_tokens: int) -> int:
    """FLOPs to prefill ``num_tokens`` of one sequence of a dense catalog model.

    ``2 x parameters x tokens`` for the matrix products against the weights (the input
    embedding is a lookup, so an untied embedding table is left out; norm weights stay in,
    under 0.01%) plus ``4 x layers x (query heads x head_dim) x T(T+1)/2`` for causal
    attention scores and mixing. Equals :func:`kvcourse.costs.forward_flops` for SmolLM2 to 0.03%.
    """
    entry = get_entry(model)
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"num_tokens must be a non-negative int, got {num_tokens!r}")
    layout = kv_layout(model)
    if layout.attention == "MLA":
        raise ValueError(f"model must be a dense catalog model; {model!r} is a mixture of experts with MLA")
    q_width = layout.num_attention_heads * layout.head_dim
    cfg = entry.config
    matmul_params = entry.num_parameters - (0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"])
    return 2 * matmul_params * num_tokens + 4 * layout.num_layers * q_width * num_tokens * (num_tokens + 1) // 2
