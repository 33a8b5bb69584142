"""The formula: bytes of K/V per token and for a whole batch, per tensor-parallel rank.

    bytes = 2 (K and V) x layers x KV heads x head dim x tokens x bytes per value x batch

with MLA caching one latent per layer instead of K and V per head, windowed layers capped at their
window, and each quantization group's scale and zero point counted when ``quant_group_size`` is given.
"""

from __future__ import annotations

import math
from typing import Any

from ..checks import check_int

from .config import KVLayout, check_tp, kv_layout
from .units import DTYPE_BYTES, dtype_key

__all__ = ["kv_bytes_per_token", "kv_cache_bytes"]

# Asymmetric per-group quantization (KIVI): x ~ scale * q + zero_point, an fp16 scale and an fp16 zero point
# per group of quant_group_size values.
_GROUP_PARAM_BYTES = 4


def _bytes_for_values(values_per_vector: int, vectors: int, dtype: str, quant_group_size: int | None) -> float:
    """Bytes for ``vectors`` cached vectors of ``values_per_vector`` numbers each, group parameters included."""
    payload = values_per_vector * vectors * DTYPE_BYTES[dtype]
    if quant_group_size is None:
        return payload
    return payload + math.ceil(values_per_vector / quant_group_size) * _GROUP_PARAM_BYTES * vectors


def _check_quant(dtype: str, quant_group_size: int | None) -> None:
    if check_int("quant_group_size", quant_group_size, min=1, none_ok=True) is None:
        return
    if dtype not in ("fp8", "int8", "int4"):
        raise ValueError(f"quant_group_size only applies to quantized dtypes (fp8, int8, int4), not {dtype!r}")


def _vectors_per_token_per_layer(layout: KVLayout, tp_size: int) -> tuple[int, int]:
    """(cached vectors per token per layer on one rank, values per vector)."""
    if layout.attention == "MLA":
        check_tp(layout, tp_size)
        return 1, layout.head_dim
    return 2 * layout.kv_heads_per_rank(tp_size), layout.head_dim


def kv_bytes_per_token(config: Any, dtype: Any = "bf16", tp_size: int = 1, quant_group_size: int | None = None) -> int:
    """Bytes one more token of context adds to one sequence's cache (per rank), summed over layers.

    This is the cost while the context is shorter than every sliding window; past a
    window, that layer stops growing (see :func:`kv_cache_bytes`).
    """
    layout = kv_layout(config)
    dt = dtype_key(dtype)
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
    check_int("seq_len", seq_len, min=0)
    check_int("batch_size", batch_size, min=1)
    layout = kv_layout(config)
    dt = dtype_key(dtype)
    _check_quant(dt, quant_group_size)
    vectors, width = _vectors_per_token_per_layer(layout, tp_size)
    token_layers = sum(seq_len if w is None else min(seq_len, w) for w in layout.layer_windows)
    return math.ceil(_bytes_for_values(width, vectors * token_layers * batch_size, dt, quant_group_size))
