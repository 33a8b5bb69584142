"""Token dropping: which tokens H2O, SnapKV and the streaming baseline keep, and the real model on what is left."""

import pytest
import torch

import kvcourse
from kvcourse.compression.dropping import DroppingKVCache, select_tokens
from tests.conftest import tiny_llama
from tests.tolerances import assert_logits_close


def test_selection_by_hand():
    pos = torch.arange(8)[None, None]
    acc = torch.tensor([[[9.0, 1.0, 5.0, 0.0, 7.0, 0.1, 0.2, 0.3]]])
    window = torch.tensor([[[0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0, 0.0]]])
    # H2O, budget 4: the 2 most recent (6, 7), then the 2 heaviest of the rest (0 and 4).
    assert select_tokens("h2o", 4, acc, window, pos).tolist() == [[[0, 4, 6, 7]]]
    # SnapKV, budget 4, observation window 2: tokens 6, 7; then token 3's score, max-pooled over 3
    # neighbours, ties 2, 3, 4 -- topk keeps two of them.
    kept = select_tokens("snapkv", 4, acc, window, pos, observation_window=2, pool_kernel=3)[0, 0].tolist()
    assert kept[2:] == [6, 7] and set(kept[:2]) <= {2, 3, 4}
    # Without pooling, only token 3 stands out.
    assert select_tokens("snapkv", 3, acc, window, pos, observation_window=2, pool_kernel=1).tolist() == [[[3, 6, 7]]]
    # Streaming: the first num_sinks and the most recent.
    assert select_tokens("streaming", 4, acc, window, pos, num_sinks=1).tolist() == [[[0, 5, 6, 7]]]


def test_selection_is_per_head_and_by_position_not_by_index():
    pos = torch.tensor([[[3, 0, 2, 1], [0, 1, 2, 3]]])  # head 0 holds its tokens out of order
    acc = torch.tensor([[[0.0, 5.0, 0.0, 1.0], [0.0, 5.0, 0.0, 1.0]]])
    kept = select_tokens("h2o", 2, acc, acc, pos)  # 1 recent + 1 heavy hitter
    assert kept.tolist() == [[[0, 1], [1, 3]]]  # head 0: position 3 (index 0) and index 1; head 1: 3 and 1


def test_bad_input():
    pos = torch.arange(4)[None, None]
    with pytest.raises(ValueError, match="method must be one of"):
        select_tokens("lru", 2, pos.float(), pos.float(), pos)
    with pytest.raises(ValueError, match=r"budget must be an int in \[1, 4\]"):
        select_tokens("h2o", 5, pos.float(), pos.float(), pos)
    with pytest.raises(ValueError, match="prefilled"):
        DroppingKVCache(1, 1, 1, 2).compress(1)
    with pytest.raises(TypeError, match="model.config"):
        DroppingKVCache.for_model(torch.nn.Linear(2, 2))


def test_attention_is_observed_and_accumulated(model):
    cache = DroppingKVCache.for_model(model.config, observation_window=3)
    model(torch.tensor([[1, 504, 3458, 282, 4649, 314, 17]]), cache=cache)
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer in cache._layers:
        # Each query's weights sum to 1 over the keys, for each of the `group` query heads of a KV head.
        torch.testing.assert_close(layer.accumulated.sum(-1), torch.full((1, 3), 7.0 * group))
        torch.testing.assert_close(layer.window_scores.sum(-1), torch.full((1, 3), 3.0 * group))
        assert bool((layer.window_scores[..., :4] > 0).all())  # the last 3 queries see every earlier key


def test_a_budget_of_everything_changes_nothing_and_a_smaller_one_runs(model_on, device):
    model = model_on
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 17, 30, 2045, 1099, 28, 253]], device=device)
    full = kvcourse.KVCache.for_model(model.config, device=device)
    model(ids[:, :9], cache=full)
    want = model(ids[:, 9:], cache=full)
    for method in ("h2o", "snapkv", "streaming"):
        cache = DroppingKVCache.for_model(model.config, observation_window=2)
        model(ids[:, :9], cache=cache)
        cache.compress(9, method)
        assert_logits_close(model(ids[:, 9:], cache=cache), want)
        small = DroppingKVCache.for_model(model.config, observation_window=2)
        model(ids[:, :9], cache=small)
        small.compress(4, method)
        assert small.num_held == 4 and small.seq_len == 9
        logits = model(ids[:, 9:], cache=small)
        assert small.num_held == 7 and logits.shape == want.shape
        pos = small.key_positions(5)
        assert pos.shape == (1, 3, 7) and pos[..., 4:].tolist() == [[[9, 10, 11]] * 3]
        assert pos.device.type == device.type
        assert small.nbytes == 30 * 2 * 3 * 7 * 64 * 4


def test_generate_compressed_takes_its_first_token_from_the_full_prompt(model, tok):
    """SnapKV's protocol: the prefill sees every prompt token, so the first answer token is the full
    cache's whatever the budget; with no budget, every token is plain greedy generation's."""
    from kvcourse.compression import generate_compressed, prefill_prompt

    prompt = tok.encode_chat("Name three primary colours.")
    want = kvcourse.generate(model, prompt, 6)
    prefilled = prefill_prompt(model, prompt)
    assert prefilled[1] == want[0] and prefilled[0].num_held == len(prompt)
    assert generate_compressed(model, prompt, None, max_new_tokens=6, prefilled=prefilled) == want
    for budget in (4, len(prompt) // 2):
        out = generate_compressed(model, prompt, budget, "snapkv", 6, prefilled)
        assert out[0] == want[0] and len(out) <= 6
    assert prefilled[0].num_held == len(prompt)  # the prefilled cache was copied, not compressed
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_compressed(model, prompt, 4, max_new_tokens=0)


def test_the_cache_built_for_a_model_follows_its_dtype_and_device():
    """prefill and prefill_prompt build their DroppingKVCache without a dtype or device: it allocates from the first
    K/V a layer writes, so it holds them where the model made them, in the model's dtype (float64 here, not the
    float32 a cache defaults to); the logits come back in float32 as documented."""
    from kvcourse.compression import compressed_continuation_logits, generate_compressed, prefill, prefill_prompt

    model = tiny_llama(5).to(torch.float64)
    context, continuation = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [5, 8, 9]
    for cache in (prefill(model, context, observation_window=3), prefill_prompt(model, context)[0]):
        for layer in cache._layers:
            assert layer.k.dtype == layer.v.dtype == torch.float64
            for t in (layer.k, layer.v, layer.pos, layer.accumulated, layer.window_scores):
                assert t.device == model.device
    logits = compressed_continuation_logits(model, context, continuation, 6, "h2o")
    assert logits.dtype == torch.float32 and logits.shape == (3, model.config.vocab_size)
    assert len(generate_compressed(model, context, 6, "snapkv", max_new_tokens=3)) <= 3
