"""The int8 paged pool: symmetric per-token scales, its bytes, and the model on it against a contiguous reference."""

import pytest
import torch

import kvcourse
from kvcourse.compression.paged_int8 import Int8PagedKVStore, dequantize_int8, quantize_int8
from kvcourse.paged import BlockManager, PagedKVCache, PagedKVStore


def test_symmetric_int8_error_is_half_a_step():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 3)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((dequantize_int8(codes, scale) - x).abs() <= 0.5001 * step).all())  # half a step (+ fp32 rounding)
    assert int(codes.abs().max()) == 127 and torch.equal(quantize_int8(torch.zeros(2, 8))[0], torch.zeros(2, 8, dtype=torch.int8))


def test_store_layout_bytes_and_copy_on_write():
    store = Int8PagedKVStore(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=3, head_dim=8)
    assert store.k_cache[0].shape == (4, 2, 3, 8) and store.k_scale[1].shape == (4, 2, 3)
    assert store.block_nbytes == 2 * 2 * 2 * 3 * (8 + 4) and store.nbytes == 4 * store.block_nbytes
    k = torch.randn(3, 3, 8, generator=torch.Generator().manual_seed(1))
    store.write(1, [5, 0, 2], k, -k)
    k_pool, v_pool = store.dequantized(1)
    got = k_pool.view(-1, 3, 8)[[5, 0, 2]]
    assert bool(((got - k).abs() <= 0.57 * k.abs().amax(-1, keepdim=True) / 127).all())
    torch.testing.assert_close(v_pool.view(-1, 3, 8)[[5, 0, 2]], -got)
    store.copy_block(1, 3)  # slot 2 is block 1, offset 0
    assert torch.equal(store.k_cache[1][3], store.k_cache[1][1]) and torch.equal(store.k_scale[1][3], store.k_scale[1][1])
    with pytest.raises(ValueError, match=r"\[T, H_kv, D\]"):
        store.write(0, [1], k, k)
    with pytest.raises(ValueError, match="slots must lie"):
        store.write(0, [0, 1, 8], k, k)


class _SymmetricInt8Cache(kvcourse.KVCache):
    """The contiguous reference: every stored vector rounded to 127 levels of its largest |value|."""

    def update(self, layer_idx, k, v):
        def roundtrip(x):
            scale = x.abs().amax(-1, keepdim=True) / 127
            return torch.clamp(torch.round(x / scale), -127, 127) * scale

        return super().update(layer_idx, roundtrip(k), roundtrip(v))


def test_the_model_on_the_int8_pool_equals_the_contiguous_reference(model, tok):
    ids = tok.encode("The capital of France is")
    store = Int8PagedKVStore.for_model(model.config, num_blocks=4, block_size=4)
    cache = PagedKVCache(model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim,
                         block_manager=BlockManager(4, 4), kv_store=store)
    ref = _SymmetricInt8Cache.for_model(model.config)
    feed = ids
    for _ in range(4):  # prefill, then three decode steps
        got = model.forward_batch(cache.prepare(feed), store, backend="paged-int8-torch")[0]
        want = model(torch.tensor([feed]), cache=ref)[0, -1]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-3 * float(want.abs().max()))
        feed = [int(want.argmax())]
    assert store.nbytes < PagedKVStore.for_model(model.config, 4, 4).nbytes * 0.27


def test_the_int8_backend_needs_an_int8_pool(model):
    cache = PagedKVCache.for_model(model.config, num_blocks=2, block_size=4)
    with pytest.raises(TypeError, match="Int8PagedKVStore"):
        model.forward_batch(cache.prepare([1, 2]), cache.kv_store, backend="paged-int8-torch")


def test_triton_int8_backend_generates_what_the_torch_int8_backend_does(model, tok):
    """Chapter 5's int8 kernels (Triton's interpreter on a CPU) behind the same int8 pool: same tokens,
    logits within the int8 reference's tolerance, codes and scales written bit for bit alike."""
    from kvcourse.kernels.triton_runtime import fallbacks, reset_fallbacks

    ids = tok.encode("The capital of France is")
    cfg = model.config
    runs = {}
    reset_fallbacks()
    for backend in ("paged-int8-torch", "triton-int8"):
        store = Int8PagedKVStore.for_model(cfg, num_blocks=4, block_size=4)
        cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                             block_manager=BlockManager(4, 4), kv_store=store)  # fmt: skip
        feed, logits = ids, []
        for _ in range(3):  # prefill, then two decode steps through the kernels
            logits.append(model.forward_batch(cache.prepare(feed), store, backend=backend)[0])
            feed = [int(logits[-1].argmax())]
        runs[backend] = (logits, store)
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"
    (want, ref_store), (got, kern_store) = runs["paged-int8-torch"], runs["triton-int8"]
    assert [int(x.argmax()) for x in got] == [int(x.argmax()) for x in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-3 * float(w.abs().max()))
    used = slice(0, 2)  # the blocks the 8 written tokens' slots fill
    # Layer 0's K/V depend on the tokens alone: the kernel's quantizer writes them bit for bit alike.
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):
        assert torch.equal(getattr(kern_store, name)[0][used], getattr(ref_store, name)[0][used]), name
    # Deeper layers see attention outputs that differ in the last bits: equal after dequantizing, nearly.
    last = cfg.num_hidden_layers - 1
    for got_pool, want_pool in zip(kern_store.dequantized(last), ref_store.dequantized(last)):
        torch.testing.assert_close(got_pool[used], want_pool[used], rtol=0, atol=0.02 * float(want_pool.abs().max()))
