"""The bill against a GPU: weight bytes, how many sequences fit, when the cache outweighs the weights, prefill FLOPs."""

from __future__ import annotations

import math
from typing import Any, Mapping

from ..checks import check_float, check_int
from ..costs import transformer_flops
from .catalog import CATALOG, catalog_names, get_entry
from .config import kv_layout
from .formula import kv_cache_bytes
from .units import dtype_bytes

__all__ = ["crossover_tokens", "kv_budget_bytes", "max_concurrent_sequences", "prefill_flops", "weight_bytes"]


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
    check_int("tp_size", tp_size, min=1)
    return math.ceil(params * dtype_bytes(dtype) / tp_size)


def kv_budget_bytes(
    model: Any, gpu_bytes: int | float, weight_dtype: Any = "bf16", gpu_memory_utilization: float = 1.0
) -> int:
    """Bytes one GPU has left for the KV cache once the weights are loaded (0 if the weights do not fit).

    budget = ``gpu_memory_utilization x gpu_bytes - weight bytes``; vLLM's default utilization is 0.9.
    Activations and CUDA graphs also take a share in a real engine; this budget leaves them out.
    """
    check_float("gpu_bytes", gpu_bytes, min=0, min_open=True)
    check_float("gpu_memory_utilization", gpu_memory_utilization, min=0, max=1, min_open=True)
    return max(0, int(gpu_memory_utilization * gpu_bytes) - weight_bytes(model, weight_dtype))


def max_concurrent_sequences(
    model: str,
    gpu_bytes: int,
    seq_len: int,
    dtype: Any = "bf16",
    weight_dtype: Any | None = None,
    gpu_memory_utilization: float = 1.0,
    quant_group_size: int | None = None,
) -> int:
    """How many ``seq_len``-token sequences fit in one GPU's KV budget after the weights (0 if none).

    The budget is :func:`kv_budget_bytes`; the weights are stored at ``dtype`` unless ``weight_dtype`` is given.
    ``quant_group_size`` counts a quantized cache's scales and zero points, as in :func:`kv_cache_bytes`.
    """
    check_int("seq_len", seq_len, min=1)
    budget = kv_budget_bytes(model, gpu_bytes, dtype if weight_dtype is None else weight_dtype, gpu_memory_utilization)
    return budget // kv_cache_bytes(model, seq_len, dtype=dtype, quant_group_size=quant_group_size)


def crossover_tokens(model: str, dtype: Any = "bf16", weight_dtype: Any = "bf16") -> int | None:
    """Fewest cached tokens (one sequence) whose K/V outweigh the model's weights; ``None`` if never.

    A model whose every layer is windowed stops growing at its window and may never get there.
    For full-attention models, the same count of tokens spread over a batch weighs the same.
    """
    weights = weight_bytes(model, weight_dtype)
    layout = kv_layout(model)
    if (
        all(w is not None for w in layout.layer_windows)
        and kv_cache_bytes(model, max(layout.layer_windows), dtype=dtype) < weights
    ):
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

    :func:`kvcourse.costs.transformer_flops` with the model's real parameter count: every weight but
    an untied input embedding (a lookup) is multiplied once per token; norm weights stay in (under
    0.01%). For SmolLM2 it equals :func:`kvcourse.costs.forward_flops` to 0.03%.
    """
    entry = get_entry(model)
    check_int("num_tokens", num_tokens, min=0)
    layout = kv_layout(model)
    if layout.attention == "MLA":
        raise ValueError(f"model must be a dense catalog model; {model!r} is a mixture of experts with MLA")
    if num_tokens == 0:
        return 0
    cfg = entry.config
    matmul_params = entry.num_parameters - (
        0 if cfg.get("tie_word_embeddings") else cfg["vocab_size"] * cfg["hidden_size"]
    )
    return transformer_flops(matmul_params, layout.num_layers, layout.num_attention_heads * layout.head_dim, num_tokens)
