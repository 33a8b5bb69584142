"""The contiguous KV cache: appends, growth, limits, byte counts."""

import pytest
import torch

from kvcourse import CacheOverflowError, KVCache, LlamaConfig


def _kv(t, seed, b=2, h=3, d=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def test_update_appends_and_returns_history():
    cache = KVCache(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=4, initial_capacity=2)
    chunks = [_kv(t, seed) for seed, t in enumerate([3, 1, 1, 5])]  # forces several doublings
    for k, v in chunks:
        for layer in range(2):
            k_all, v_all = cache.update(layer, k, v)
    torch.testing.assert_close(k_all, torch.cat([k for k, _ in chunks], dim=2))
    torch.testing.assert_close(v_all, torch.cat([v for _, v in chunks], dim=2))
    assert cache.seq_len == 10 and len(cache) == 10
    assert cache.keys(0).shape == (2, 3, 10, 4)
    assert cache.nbytes == 2 * 2 * (2 * 3 * 10 * 4) * 4  # K and V, 2 layers, fp32
    assert cache.allocated_nbytes >= cache.nbytes


def test_overflow_is_a_clear_error_and_changes_nothing():
    cache = KVCache(1, 1, 1, 4, max_seq_len=5)
    cache.update(0, *_kv(4, 0, b=1, h=1))
    with pytest.raises(CacheOverflowError, match="max_seq_len=5"):
        cache.update(0, *_kv(2, 1, b=1, h=1))
    assert cache.seq_len == 4
    cache.update(0, *_kv(1, 2, b=1, h=1))
    assert cache.seq_len == 5


def test_for_model_uses_config_shapes():
    cfg = LlamaConfig()
    cache = KVCache.for_model(cfg, batch_size=3)
    assert (cache.num_layers, cache.batch_size, cache.num_kv_heads, cache.head_dim) == (30, 3, 3, 64)
    assert cache.max_seq_len == cfg.max_position_embeddings
    assert cache.seq_len == 0 and cache.nbytes == 0


def test_crop_forgets_tokens():
    cache = KVCache(1, 1, 1, 2)
    k, v = _kv(6, 0, b=1, h=1, d=2)
    cache.update(0, k, v)
    cache.crop(2)
    k2, _ = cache.update(0, *_kv(1, 1, b=1, h=1, d=2))
    assert k2.shape[2] == 3
    torch.testing.assert_close(k2[:, :, :2], k[:, :, :2])
    with pytest.raises(ValueError, match="seq_len"):
        cache.crop(9)


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        (dict(num_layers=0), ValueError, "num_layers"),
        (dict(batch_size=-1), ValueError, "batch_size"),
        (dict(num_kv_heads=1.5), TypeError, "num_kv_heads must be an int >= 1, got float 1.5"),
        (dict(max_seq_len=0), ValueError, "max_seq_len"),
        (dict(max_seq_len=True), TypeError, "max_seq_len must be an int >= 1 or None, got bool"),
    ],
)
def test_bad_constructor_arguments(kwargs, exc, word):
    args = dict(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=4) | kwargs
    with pytest.raises(exc, match=word):
        KVCache(**args)


def test_bad_update_arguments():
    cache = KVCache(2, 1, 2, 4)
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(2, *_kv(1, 0, b=1, h=2))
    with pytest.raises(ValueError, match="shape"):
        cache.update(0, *_kv(1, 0, b=1, h=3))
    with pytest.raises(TypeError, match="dtype"):
        KVCache(1, 1, 1, 4, dtype=torch.int8)


def test_capacity_doubles_and_stops_at_max_seq_len():
    cache = KVCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, max_seq_len=20, initial_capacity=3)
    capacities = []
    for t in range(20):
        cache.update(0, *_kv(1, t, b=1, h=1, d=2))
        capacities.append(cache.allocated_nbytes // (2 * 2 * 4))  # K and V, head_dim 2, fp32: bytes per slot
    # 3 slots, then doubling as the tokens arrive (6, 12), then capped at max_seq_len = 20 instead of 24.
    assert capacities == [3] * 3 + [6] * 3 + [12] * 6 + [20] * 8
    k_all = cache.keys(0)
    assert torch.equal(k_all[0, 0, 7], _kv(1, 7, b=1, h=1, d=2)[0][0, 0, 0])  # copies kept every token


def test_a_chunk_larger_than_double_grows_in_one_step():
    cache = KVCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, initial_capacity=2)
    cache.update(0, *_kv(9, 0, b=1, h=1, d=2))  # 2 -> 4 -> 8 -> 16 in one growth
    assert cache.allocated_nbytes == 2 * 16 * 2 * 4 and cache.seq_len == 9
