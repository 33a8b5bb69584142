"""The sliding-window ring buffer with attention sinks: what it holds, what it returns, and the real model on it."""

import random

import pytest
import torch

import kvcourse
from kvcourse.compression.window import SinkKVCache, ring_slot, simulate_window_logits, window_mask
from tests.tolerances import assert_logits_close


def test_ring_slot_by_hand():
    # 2 sinks and a window of 3: slots 0, 1 are the sinks, 2 3 4 the ring.
    assert [ring_slot(p, 2, 3) for p in range(9)] == [0, 1, 2, 3, 4, 2, 3, 4, 2]
    assert [ring_slot(p, 0, 4) for p in range(6)] == [0, 1, 2, 3, 0, 1]
    assert ring_slot(torch.arange(9), 2, 3).tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 2]


def test_window_mask_by_hand():
    # Query 5 with a window of 2 and 1 sink sees position 0 (the sink), 3, 4 and itself.
    pos = torch.arange(6)
    assert window_mask(pos, pos, window=2, num_sinks=1)[5].tolist() == [True, False, False, True, True, True]
    assert window_mask(pos, pos, window=2)[5].tolist() == [False, False, False, True, True, True]


def _tagged(b, h, t, d, start):
    """K whose every entry is its token's position: what comes back says which tokens were kept."""
    return torch.arange(start, start + t, dtype=torch.float32)[None, None, :, None].expand(b, h, t, d).clone()


@pytest.mark.parametrize("seed", range(6))
def test_holds_the_sinks_and_the_last_window_whatever_the_chunks(seed, device):
    rng = random.Random(seed)
    window, sinks = rng.randint(1, 6), rng.randint(0, 3)
    cache = SinkKVCache(
        num_layers=2, batch_size=2, num_kv_heads=3, head_dim=4, window=window, num_sinks=sinks, device=device
    )
    seen = 0
    for _ in range(8):
        t = rng.randint(1, 9)  # chunks shorter and longer than the window
        for layer in range(2):
            k = _tagged(2, 3, t, 4, seen).to(device)
            k_out, v_out = cache.update(layer, k, -k)
            pos = cache.key_positions(layer)
            assert k_out.device.type == pos.device.type == device.type
            held_before = sorted(set(range(min(sinks, seen))) | set(range(max(seen - window, 0), seen)))
            assert sorted(pos.tolist()) == held_before + list(range(seen, seen + t))
            assert torch.equal(k_out[0, 0, :, 0], pos.float()) and torch.equal(v_out, -k_out)
        seen += t
        assert cache.seq_len == seen
        held = sorted(set(range(min(sinks, seen))) | set(range(max(seen - window, 0), seen)))
        assert sorted(p for p in cache.held_positions() if p >= 0) == held
        assert cache.num_held == len(held) and cache.nbytes == 2 * 2 * 2 * 3 * 4 * 4 * len(held)


def test_memory_stops_growing_once_the_window_is_full():
    cache = SinkKVCache(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, window=4, num_sinks=2)
    sizes = []
    for p in range(12):
        cache.update(0, torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
        sizes.append(cache.nbytes)
    assert sizes[:6] == [16 * n for n in range(1, 7)] and set(sizes[6:]) == {96}


def test_bad_input():
    with pytest.raises(ValueError, match="window"):
        SinkKVCache(1, 1, 1, 2, window=0)
    with pytest.raises(ValueError, match="num_sinks"):
        SinkKVCache(1, 1, 1, 2, window=2, num_sinks=-1)
    cache = SinkKVCache(1, 1, 1, 2, window=2)
    with pytest.raises(ValueError, match=r"\[B, H_kv, T, D\]"):
        cache.update(0, torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2))
    with pytest.raises(ValueError, match="not been updated"):
        cache.key_positions(0)
    with pytest.raises(TypeError, match="model.config"):
        SinkKVCache.for_model(torch.nn.Linear(2, 2), window=4)


def test_decoding_through_the_ring_equals_the_window_simulation(model_on, device):
    # Token by token through the ring buffer, against one forward with the window mask (independent
    # code: scaled_dot_product_attention with a dense mask). Both with and without sinks.
    model = model_on
    ids = [1, 504, 3458, 282, 4649, 314, 17, 30, 2045, 1099, 28, 253, 1183, 314, 16, 4, 2116, 18, 900, 31, 365, 26]
    for window, sinks in ((5, 2), (6, 0)):
        cache = SinkKVCache.for_model(model.config, window=window, num_sinks=sinks, device=device)
        got = torch.cat([model(torch.tensor([[i]], device=device), cache=cache)[0] for i in ids])
        assert_logits_close(got, simulate_window_logits(model, ids, window, sinks))
        assert cache.num_held == window + sinks


def test_a_window_longer_than_the_text_is_the_full_cache(model):
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 17, 30, 2045, 1099, 28]])
    want = model(ids, cache=kvcourse.KVCache.for_model(model.config))
    cache = SinkKVCache.for_model(model.config, window=16, num_sinks=4)
    got = torch.cat([model(ids[:, :4], cache=cache), model(ids[:, 4:], cache=cache)], 1)
    assert_logits_close(got, want)


def test_generate_runs_on_a_sink_cache(model, tok):
    ids = tok.encode("The capital of France is")
    out = kvcourse.generate(model, ids, 6, cache=SinkKVCache.for_model(model.config, window=64, num_sinks=4))
    assert out == kvcourse.generate(model, ids, 6)  # the text fits the window: nothing was evicted
