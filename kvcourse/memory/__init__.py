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
0.5 bytes per value. Scales are not free; pass ``quant_group_size=g`` to add an
fp16 scale and an fp16 zero point (4 bytes) per ``g`` consecutive values of every
cached vector (asymmetric per-group quantization, as KIVI does; KIVI also keeps
its most recent tokens unquantized, which this formula does not model). fp8 in
vLLM uses one scale per tensor per layer, a few bytes in total, which the default
(no scales) models well.

Tensor parallelism splits KV heads across ranks (each rank holds
``H_kv / tp_size``); when ``tp_size`` exceeds ``H_kv`` every rank holds one
replicated head, as vLLM does. An MLA latent is shared by all heads, so every
rank holds all of it. :func:`kv_cache_bytes` returns bytes **per rank**.

Units: ``GB`` is 10**9 bytes and ``GiB`` is 2**30 bytes; :func:`format_bytes` prints both.

One job per module: :mod:`.config` reads a config, :mod:`.formula` is the formula, :mod:`.budget`
weighs it against a GPU, :mod:`.units` holds dtypes and units, :mod:`.catalog` the models.
"""

from ..lazy import lazy_exports

_EXPORTS = {  # name -> the submodule that defines it, imported when the name is first read
    "crossover_tokens": ".budget",
    "kv_budget_bytes": ".budget",
    "max_concurrent_sequences": ".budget",
    "prefill_flops": ".budget",
    "weight_bytes": ".budget",
    "CATALOG": ".catalog",
    "CatalogEntry": ".catalog",
    "catalog_names": ".catalog",
    "get_entry": ".catalog",
    "KVLayout": ".config",
    "kv_layout": ".config",
    "load_config": ".config",
    "kv_bytes_per_token": ".formula",
    "kv_cache_bytes": ".formula",
    "DTYPE_BYTES": ".units",
    "GB": ".units",
    "GiB": ".units",
    "dtype_bytes": ".units",
    "format_bytes": ".units",
}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)
