"""MLA: both forms equal plain attention over the expanded K and V; the memory math; pooling KV heads."""

import math

import pytest
import torch

import kvcourse
from kvcourse.memory import kv_bytes_per_token
from kvcourse.mla import LatentCache, MLAConfig, MultiHeadLatentAttention, kv_values_per_token, pooled_kv_heads


def _x(seed, t, hidden=256):
    return torch.randn(2, t, hidden, generator=torch.Generator().manual_seed(seed))


def test_expanded_and_absorbed_equal_plain_attention_over_the_expanded_cache(device):
    mla = MultiHeadLatentAttention(MLAConfig(), seed=1, device=device)
    c = mla.config
    x = _x(0, 7).to(device)
    cache = LatentCache()
    got = mla(x, cache)
    # Plain causal multi-head attention over the K and V the latents stand for (independent of both forms).
    k, v = mla.expanded_kv(cache)  # [B, H, S, nope + rope], [B, H, S, v]
    q = mla.q_proj(x).view(2, 7, c.num_heads, -1)
    q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], -1)
    q = torch.cat([q_nope, mla._rope(q_rope, torch.arange(7, device=device))], -1).transpose(1, 2)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    want = mla.o_proj(plain.transpose(1, 2).reshape(2, 7, -1)).detach()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mla(x, LatentCache(), absorb=True), want, rtol=1e-5, atol=1e-5)
    assert got.device.type == device.type and cache.latent.device.type == device.type
    if device.type != "cpu":  # the same seeded weights on every device
        torch.testing.assert_close(
            got.cpu(), MultiHeadLatentAttention(MLAConfig(), seed=1)(x.cpu(), LatentCache()), rtol=1e-4, atol=1e-4
        )


def test_decoding_from_the_latent_cache_equals_the_whole_sequence():
    mla = MultiHeadLatentAttention(MLAConfig(num_heads=2, kv_lora_rank=32), seed=2)
    x = _x(3, 9)
    whole = mla(x, LatentCache())
    cache = LatentCache()
    steps = [mla(x[:, :5], cache, absorb=True)] + [mla(x[:, i : i + 1], cache, absorb=i % 2 == 0) for i in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), whole, rtol=1e-5, atol=1e-5)
    # The cache holds kv_lora_rank + rope values per token: 32 + 16, at 4 bytes, for 2 sequences of 9 tokens.
    assert cache.seq_len == 9 and cache.nbytes == 2 * 9 * (32 + 16) * 4


def test_memory_math_for_deepseek_v3():
    # DeepSeek-V3 (config.json): 128 heads, kv_lora_rank 512, qk_rope_head_dim 64, 61 layers.
    assert kv_values_per_token("MLA", 128, 128, kv_lora_rank=512, rope_dim=64) == 576
    assert kv_values_per_token("MHA", 128, 128) == 32_768
    assert kv_values_per_token("GQA", 128, 128, num_groups=8) == 2_048
    assert kv_values_per_token("MQA", 128, 128) == 256
    assert kv_bytes_per_token("deepseek-v3", "bf16") == 61 * 576 * 2  # the chapter 3 calculator agrees
    with pytest.raises(ValueError, match="kind"):
        kv_values_per_token("MLQ", 1, 1)


def test_pooling_kv_heads(model):
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314]])
    before = model(ids)
    k0 = model.layers[0].self_attn.k_proj.weight.clone()  # a view of the packed QKV weight
    packed0 = model.layers[0].self_attn.qkv_proj.weight
    with pooled_kv_heads(model, 1):
        assert model.config.num_key_value_heads == 1
        cache = kvcourse.KVCache.for_model(model.config)
        pooled = model(ids, cache=cache)
        assert cache.keys(0).shape == (1, 1, 6, 64)  # a third of the cache
        w = model.layers[0].self_attn.k_proj.weight
        torch.testing.assert_close(w, k0.view(3, 64, -1).mean(0))
        assert (pooled - before).abs().max() > 0.1  # averaging heads changes what the model computes
    assert model.config.num_key_value_heads == 3 and model.layers[0].self_attn.qkv_proj.weight is packed0
    assert torch.equal(model.layers[0].self_attn.k_proj.weight, k0)
    torch.testing.assert_close(model(ids), before, rtol=0, atol=0)
    with pooled_kv_heads(model, 3):  # groups of one head: nothing changes
        torch.testing.assert_close(model(ids), before, rtol=0, atol=1e-5 * float(before.abs().max()))
    with pytest.raises(ValueError, match="must divide"):
        with pooled_kv_heads(model, 2):
            pass


def test_pooled_heads_keep_the_weights_dtype_and_device():
    """The pooled projections are made from the model's own weights: a float64 model stays float64, on its device."""
    from tests.conftest import tiny_llama

    model = tiny_llama(5).to(torch.float64)
    ids = torch.tensor([[3, 1, 4, 1, 5]])
    with pooled_kv_heads(model, 1):
        for layer in model.layers:
            for w in (layer.self_attn.k_proj.weight, layer.self_attn.v_proj.weight):
                assert w.dtype == torch.float64 and w.device == model.device and not w.requires_grad
        cache = kvcourse.KVCache.for_model(model.config, dtype=model.dtype, device=model.device)
        assert model(ids, cache=cache).dtype == torch.float64 and cache.keys(0).shape == (1, 1, 5, 8)


def test_mla_scale_is_over_the_whole_query_key_width():
    mla = MultiHeadLatentAttention(MLAConfig())
    assert mla.scale == pytest.approx(1 / math.sqrt(32 + 16))
