"""record_forward sees exactly what the attention layers compute, and leaves no hooks behind."""

from __future__ import annotations

import pytest
import torch

import kvcourse
from kvcourse.probe import record_forward


def test_recorded_kv_equals_what_a_cache_stores(model, tok):
    ids = tok.encode("The capital of France is")
    rec = record_forward(model, ids)
    cache = kvcourse.KVCache.for_model(model.config)
    logits = model(torch.tensor([ids]), cache=cache)
    assert rec.num_layers == model.config.num_hidden_layers
    for layer in range(rec.num_layers):
        assert torch.equal(rec.k[layer], cache.keys(layer))
        assert torch.equal(rec.v[layer], cache.values(layer))
    assert torch.equal(rec.logits, logits)


def test_shapes_and_the_hidden_state_equal_hugging_face(model, tok, hf_model):
    ids = tok.encode("def fibonacci(n):")
    rec = record_forward(model, torch.tensor([ids]))
    cfg, t = model.config, len(ids)
    assert rec.q[0].shape == (1, cfg.num_attention_heads, t, cfg.head_dim)
    assert rec.k[5].shape == (1, cfg.num_key_value_heads, t, cfg.head_dim)
    assert rec.hidden.shape == (1, t, cfg.hidden_size)
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1]  # after the final norm
    assert (rec.hidden - theirs).abs().max().item() < 1e-4


def test_queries_differ_from_keys_and_by_layer(model, tok):
    rec = record_forward(model, tok.encode("Once upon a time"))
    # GQA: query head 0 reads KV head 0, but Q and K are different projections.
    assert not torch.allclose(rec.q[3][:, 0], rec.k[3][:, 0])
    assert not torch.allclose(rec.k[0], rec.k[1])


def test_recording_changes_nothing(model, tok):
    ids = tok.encode("Hello there")
    before = model(torch.tensor([ids]))
    rec = record_forward(model, ids)
    assert torch.equal(rec.logits, before) and torch.equal(model(torch.tensor([ids])), before)


def test_more_tokens_than_the_context_is_refused(model):
    too_long = torch.zeros(1, model.config.max_position_embeddings + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="context length"):
        record_forward(model, too_long)


def test_bad_input(model):
    with pytest.raises(TypeError, match="model"):
        record_forward(torch.nn.Linear(2, 2), [1, 2])
    with pytest.raises(ValueError, match="input_ids"):
        record_forward(model, [])
    with pytest.raises(ValueError, match="input_ids"):
        record_forward(model, [1.5, 2])
