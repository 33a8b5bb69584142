"""Real model configs, as they appear in each model's ``config.json`` on the Hugging Face Hub.

Each entry keeps only the fields the memory bill needs (layers, heads, KV heads,
head_dim, hidden size, windows, MLA ranks, context length and the RoPE scaling that
sets it, vocabulary, MLP width) with their Hub names, the repository id they come
from, and the parameter count with its source. Parameter counts of the dense models equal the sum of their
tensor shapes from these same fields (``tests/test_memory.py`` recomputes them).

The configs were transcribed by hand from the named repositories (this course
builds offline); a reader can check any field against ``huggingface.co/<repo>/blob/main/config.json``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

__all__ = ["CATALOG", "CatalogEntry", "catalog_names", "get_entry"]


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    hf_repo: str  # where config.json comes from
    config: Mapping  # the config.json fields used here, Hub names
    num_parameters: int  # total parameters (all experts for a mixture-of-experts model)
    parameters_source: str
    note: str = ""
    fields: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))
        object.__setattr__(self, "fields", tuple(self.config))


_SHAPES = "sum of tensor shapes from these config fields (equals the Hub's safetensors parameter count)"

_ENTRIES = [
    CatalogEntry(
        "smollm2-135m",
        "HuggingFaceTB/SmolLM2-135M-Instruct",
        {
            "model_type": "llama",
            "num_hidden_layers": 30,
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
        },
        134_515_008,
        _SHAPES + "; equals sum(p.numel()) of kvcourse.load_pretrained()",
        "the course's own model",
    ),
    CatalogEntry(
        "llama-2-7b",
        "meta-llama/Llama-2-7b-hf",
        {
            "model_type": "llama",
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        6_738_415_616,
        _SHAPES,
        "multi-head attention (every query head has its own K/V head)",
    ),
    CatalogEntry(
        "llama-2-70b",
        "meta-llama/Llama-2-70b-hf",
        {
            "model_type": "llama",
            "num_hidden_layers": 80,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 4096,
            "tie_word_embeddings": False,
        },
        68_976_648_192,
        _SHAPES,
        "GQA, 8 KV heads: the 70B Llamas were never multi-head",
    ),
    CatalogEntry(
        "llama-3-8b",
        "meta-llama/Meta-Llama-3-8B",
        {
            "model_type": "llama",
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        },
        8_030_261_248,
        _SHAPES,
    ),
    CatalogEntry(
        "llama-3-70b",
        "meta-llama/Meta-Llama-3-70B",
        {
            "model_type": "llama",
            "num_hidden_layers": 80,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": False,
        },
        70_553_706_496,
        _SHAPES,
        "an 8k-context model (max_position_embeddings 8192); Llama-3.1-70B has the same shapes and a 128k context",
    ),
    CatalogEntry(
        "llama-3.1-70b",
        "meta-llama/Llama-3.1-70B",
        {
            "model_type": "llama",
            "num_hidden_layers": 80,
            "hidden_size": 8192,
            "intermediate_size": 28672,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
            "tie_word_embeddings": False,
        },
        70_553_706_496,
        _SHAPES + "; the same tensors as Llama-3-70B",
        "Llama-3-70B's shapes with a 131072-token context: RoPE frequencies rescaled (rope_type llama3, factor 8 "
        "over the original 8192 positions)",
    ),
    CatalogEntry(
        "mistral-7b",
        "mistralai/Mistral-7B-v0.1",
        {
            "model_type": "mistral",
            "num_hidden_layers": 32,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "max_position_embeddings": 32768,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
        },
        7_241_732_096,
        _SHAPES,
        "v0.1, every layer windowed at 4096 tokens (v0.2 and v0.3 set sliding_window to null)",
    ),
    CatalogEntry(
        "qwen2.5-7b",
        "Qwen/Qwen2.5-7B",
        {
            "model_type": "qwen2",
            "num_hidden_layers": 28,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "vocab_size": 152064,
            "max_position_embeddings": 131072,
            "sliding_window": 131072,
            "max_window_layers": 28,
            "use_sliding_window": False,
            "tie_word_embeddings": False,
        },
        7_615_616_512,
        "the Hub's safetensors parameter count (model card: 7.61B); q/k/v carry biases",
        "sliding_window is present but use_sliding_window is false: every layer is full attention",
    ),
    CatalogEntry(
        "gemma-2-9b",
        "google/gemma-2-9b",
        {
            "model_type": "gemma2",
            "num_hidden_layers": 42,
            "hidden_size": 3584,
            "intermediate_size": 14336,
            "num_attention_heads": 16,
            "num_key_value_heads": 8,
            "head_dim": 256,
            "vocab_size": 256000,
            "max_position_embeddings": 8192,
            "sliding_window": 4096,
            "tie_word_embeddings": True,
            "layer_types": ["sliding_attention", "full_attention"] * 21,
        },
        9_241_705_984,
        _SHAPES,
        "head_dim 256 with 16 heads (16 x 256 = 4096 != hidden 3584); layers alternate local (window 4096) "
        "and global; layer_types as transformers >= 4.53 writes it (the original file has only sliding_window)",
    ),
    CatalogEntry(
        "falcon-7b",
        "tiiuae/falcon-7b",
        {
            "model_type": "falcon",
            "num_hidden_layers": 32,
            "hidden_size": 4544,
            "num_attention_heads": 71,
            "multi_query": True,
            "new_decoder_architecture": False,
            "vocab_size": 65024,
            "max_position_embeddings": 2048,
            "tie_word_embeddings": True,
        },
        6_921_720_704,
        _SHAPES + "; the model card rounds it to 7B",
        "multi-query attention: one K/V head shared by 71 query heads of dim 64",
    ),
    CatalogEntry(
        "deepseek-v3",
        "deepseek-ai/DeepSeek-V3",
        {
            "model_type": "deepseek_v3",
            "num_hidden_layers": 61,
            "hidden_size": 7168,
            "intermediate_size": 18432,
            "moe_intermediate_size": 2048,
            "num_attention_heads": 128,
            "num_key_value_heads": 128,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "n_routed_experts": 256,
            "n_shared_experts": 1,
            "num_experts_per_tok": 8,
            "first_k_dense_replace": 3,
            "vocab_size": 129280,
            "max_position_embeddings": 163840,
        },
        671_000_000_000,
        "DeepSeek-V3 technical report (arXiv:2412.19437): 671B total, 37B activated per token; the Hub's 685B "
        "adds the 14B multi-token-prediction module",
        "multi-head latent attention: caches a 512-wide latent plus a 64-wide RoPE key per token per layer",
    ),
]

CATALOG: Mapping[str, CatalogEntry] = MappingProxyType({e.name: e for e in _ENTRIES})


def catalog_names() -> list[str]:
    """The catalog's model names, in catalog order."""
    return list(CATALOG)


def get_entry(name: str) -> CatalogEntry:
    """The catalog entry for ``name``; a ValueError lists the valid names."""
    if not isinstance(name, str) or name not in CATALOG:
        raise ValueError(f"model must be one of {', '.join(CATALOG)}; got {name!r}")
    return CATALOG[name]
