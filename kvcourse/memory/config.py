"""Reading a model's cache-relevant shape from a Hugging Face ``config.json``: :func:`kv_layout`.

Handles MHA, GQA (``num_key_value_heads``), MQA (``multi_query``), an explicit ``head_dim`` (Gemma),
GPT-2 keys (``n_layer``, ``n_head``, ``n_embd``), MLA (DeepSeek-V2/V3) and sliding windows
(``sliding_window``, ``layer_types``, Gemma-2's alternation, Qwen2's ``use_sliding_window``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..checks import check_int, is_int
from .catalog import CATALOG, catalog_names

__all__ = ["KVLayout", "check_tp", "kv_layout", "load_config"]


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
                cfg = json.loads(path.read_text(encoding="utf-8"))  # JSON is UTF-8 (RFC 8259), whatever the locale
            except UnicodeDecodeError as e:
                raise ValueError(f"config file {str(path)!r} is not UTF-8 text, as JSON must be: {e}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"config file {str(path)!r} is not valid JSON: {e}") from None
            except RecursionError:
                raise ValueError(f"config file {str(path)!r} nests its JSON too deeply to be a config.json") from None
            if not isinstance(cfg, dict):
                raise ValueError(f"config file {str(path)!r} must hold a JSON object, got {type(cfg).__name__}")
    else:
        raise TypeError(
            f"config must be a dict, a path to a config.json, or a catalog name; got {type(config).__name__}"
        )
    # Multimodal wrappers (Llava, Gemma 3, ...) keep the language model's shape in text_config.
    if not _has_any(cfg, _LAYER_KEYS) and isinstance(cfg.get("text_config"), Mapping):
        cfg = dict(cfg["text_config"])
    _check_int_fields(cfg)
    return cfg


_LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers")
MAX_LAYERS = 10_000  # the deepest published models have a few hundred; the layout holds one entry per layer
_HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads")
_HIDDEN_KEYS = ("hidden_size", "n_embd", "d_model")
_KV_HEAD_KEYS = ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num")
# Every integer field the memory tools read. Each is checked whenever it is present, not only on the path that
# uses it: ``max_window_layers: "a"`` in a config with no sliding window is a broken file, not an unused key.
INT_FIELDS = (
    *_LAYER_KEYS,
    *_HEAD_KEYS,
    *_HIDDEN_KEYS,
    *_KV_HEAD_KEYS,
    "head_dim",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "sliding_window",
    "max_window_layers",
    "sliding_window_pattern",
    "attention_chunk_size",
    "max_position_embeddings",
    "vocab_size",
    "intermediate_size",
)


def _check_int_fields(cfg: Mapping) -> None:
    """Every integer field present (and not null) is a JSON integer: a string, a float or a boolean is refused,
    naming the field. (Their ranges are checked where each is used.)"""
    for key in INT_FIELDS:
        value = cfg.get(key)
        if value is not None and not is_int(value):
            raise ValueError(f"config[{key!r}] must be an integer or null, got {value!r} ({type(value).__name__})")


def _has_any(cfg: Mapping, keys: tuple[str, ...]) -> bool:
    return any(cfg.get(k) is not None for k in keys)


def _positive_int(cfg: Mapping, keys: tuple[str, ...], what: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is None:
            continue
        if not is_int(value) or value < 1:
            raise ValueError(f"config[{key!r}] ({what}) must be a positive int, got {value!r}")
        return int(value)
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
        check_tp(self, tp_size)
        if self.attention == "MLA":
            return 1
        return max(1, self.num_kv_heads // tp_size)


def _flag(cfg: Mapping, key: str) -> bool | None:
    """A true/false key (``None`` if absent or null). JSON has booleans: the string ``"false"`` is a
    mistake in the file, not a true value."""
    value = cfg.get(key)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"config[{key!r}] must be true, false or null, got {value!r} ({type(value).__name__})")
    return value


def check_tp(layout: KVLayout, tp_size: int) -> None:
    check_int("tp_size", tp_size, min=1)
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
    use_sw = _flag(cfg, "use_sliding_window")
    if use_sw is None and model_type.startswith(("qwen2", "qwen3")):
        use_sw = False  # Qwen2's default: the sliding_window key is present but unused
    if use_sw is False:
        return (None,) * num_layers
    window = cfg.get("sliding_window")
    if window is not None and (not is_int(window) or window < 1):
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
        first = cfg.get("max_window_layers", 0)
        first = 0 if first is None else first
        if not is_int(first) or not 0 <= first <= num_layers:
            raise ValueError(
                f"config['max_window_layers'] (layers before the sliding ones) must be an int in "
                f"[0, {num_layers}], got {first!r}"
            )
        return tuple(window if i >= first else None for i in range(num_layers))
    pattern = cfg.get("sliding_window_pattern")
    if pattern is None and model_type == "gemma2":
        pattern = 2  # Gemma 2 alternates: even layers local (sliding), odd layers global
    if pattern is not None:
        if not is_int(pattern) or pattern < 1:
            raise ValueError(f"config['sliding_window_pattern'] must be a positive int, got {pattern!r}")
        return tuple(None if (i + 1) % pattern == 0 else window for i in range(num_layers))
    return (window,) * num_layers  # Mistral v0.1, Phi-3: every layer windowed


def kv_layout(config: Any) -> KVLayout:
    """Read the cache-relevant shape of a model from its config (dict, path or catalog name)."""
    cfg = load_config(config)
    num_layers = _positive_int(cfg, _LAYER_KEYS, "layer count")
    if num_layers > MAX_LAYERS:
        raise ValueError(f"config's layer count must be at most {MAX_LAYERS:,}, got {num_layers:,}")
    num_heads = _positive_int(cfg, _HEAD_KEYS, "attention head count")
    windows = _layer_windows(cfg, num_layers)

    if cfg.get("kv_lora_rank") is not None:  # DeepSeek-V2/V3 multi-head latent attention
        rank = _positive_int(cfg, ("kv_lora_rank",), "MLA latent rank")
        rope = _positive_int(cfg, ("qk_rope_head_dim",), "MLA RoPE key width")
        return KVLayout("MLA", num_layers, num_heads, 1, rank + rope, rank + rope, windows)

    if _flag(cfg, "new_decoder_architecture"):  # Falcon-40B/180B: grouped KV heads under their own key
        kv_heads = _positive_int(cfg, ("num_kv_heads", "n_head_kv", "num_key_value_heads"), "KV head count")
    elif _flag(cfg, "multi_query"):  # Falcon-7B, GPT-BigCode: one K and one V head for all queries
        kv_heads = 1
        named = [k for k in ("num_key_value_heads", "num_kv_heads", "n_head_kv") if cfg.get(k) not in (None, 1)]
        if named:
            raise ValueError(
                f"config sets multi_query: true (one KV head) and {named[0]}={cfg[named[0]]!r}: they disagree; keep one"
            )
    elif _has_any(cfg, _KV_HEAD_KEYS):
        kv_heads = _positive_int(cfg, _KV_HEAD_KEYS, "KV head count")
    else:
        kv_heads = num_heads  # plain multi-head attention
    if kv_heads > num_heads or num_heads % kv_heads:
        raise ValueError(f"KV head count ({kv_heads}) must divide the attention head count ({num_heads})")

    if cfg.get("head_dim") is not None:
        head_dim = _positive_int(cfg, ("head_dim",), "head dimension")
    else:
        hidden = _positive_int(cfg, _HIDDEN_KEYS, "hidden size (needed for head_dim)")
        if hidden % num_heads:
            raise ValueError(f"hidden size {hidden} is not divisible by {num_heads} heads; give head_dim explicitly")
        head_dim = hidden // num_heads

    kind = "MHA" if kv_heads == num_heads else "MQA" if kv_heads == 1 else "GQA"
    return KVLayout(kind, num_layers, num_heads, kv_heads, head_dim, 2 * kv_heads * head_dim, windows)
