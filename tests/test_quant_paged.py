"""The int8 paged pool: symmetric per-token scales, its bytes, and the model on it against a contiguous reference."""

import pytest
import torch

import kvcourse
from kvcourse.compression.paged_int8 import Int8PagedKVStore, dequantize_int8, quantize_int8
from kvcourse.paged import BlockManager, PagedKVCache, PagedKVStore
from tests.pinned_kv import KVPins, PinnedUpdates
from tests.tolerances import assert_logits_close


def test_symmetric_int8_error_is_half_a_step():
    x = torch.randn(5, 3, 64, generator=torch.Generator().manual_seed(0)) * 4
    codes, scale = quantize_int8(x)
    assert codes.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (5, 3)
    step = x.abs().amax(-1, keepdim=True) / 127
    assert bool(((dequantize_int8(codes, scale) - x).abs() <= 0.5001 * step).all())  # half a step (+ fp32 rounding)
    assert int(codes.abs().max()) == 127 and torch.equal(
        quantize_int8(torch.zeros(2, 8))[0], torch.zeros(2, 8, dtype=torch.int8)
    )


def test_store_layout_bytes_and_copy_on_write(device):
    store = Int8PagedKVStore(num_layers=2, num_blocks=4, block_size=2, num_kv_heads=3, head_dim=8, device=device)
    assert store.k_cache[0].shape == (4, 2, 3, 8) and store.k_scale[1].shape == (4, 2, 3)
    assert store.block_nbytes == 2 * 2 * 2 * 3 * (8 + 4) and store.nbytes == 4 * store.block_nbytes
    k = torch.randn(3, 3, 8, generator=torch.Generator().manual_seed(1)).to(device)
    store.write(1, [5, 0, 2], k, -k)
    k_pool, v_pool = store.dequantized(1)
    assert k_pool.device.type == store.k_scale[1].device.type == device.type
    got = k_pool.view(-1, 3, 8)[[5, 0, 2]]
    assert bool(((got - k).abs() <= 0.57 * k.abs().amax(-1, keepdim=True) / 127).all())
    torch.testing.assert_close(v_pool.view(-1, 3, 8)[[5, 0, 2]], -got)
    store.copy_block(1, 3)  # slot 2 is block 1, offset 0
    assert torch.equal(store.k_cache[1][3], store.k_cache[1][1]) and torch.equal(
        store.k_scale[1][3], store.k_scale[1][1]
    )
    with pytest.raises(ValueError, match=r"\[T, H_kv, D\]"):
        store.write(0, [1], k, k)
    with pytest.raises(ValueError, match="slots must lie"):
        store.write(0, [0, 1, 8], k, k)


class _Int8RoundTrip(kvcourse.KVCache):
    """A contiguous cache that stores every vector through the pool's int8 format."""

    def update(self, layer_idx, k, v):
        return super().update(layer_idx, *(dequantize_int8(*quantize_int8(x)) for x in (k, v)))


class _Int8Reference(PinnedUpdates, _Int8RoundTrip):
    """The contiguous reference: the int8 round trip of pinned K/V."""


class _PinnedInt8Store(Int8PagedKVStore):
    """The int8 pool, written from pinned K/V: ``positions`` says which positions the next step writes."""

    def pin(self, pins: KVPins) -> "_PinnedInt8Store":
        self.pins, self.positions = pins, []
        return self

    def write_unchecked(self, layer_idx, slots, k, v):
        super().write_unchecked(layer_idx, slots, *self.pins(layer_idx, self.positions, k, v))


def test_the_model_on_the_int8_pool_equals_the_contiguous_reference(model, tok):
    # Both paths quantize the same K/V (tests.pinned_kv): the packed step's matmuls round differently from the
    # contiguous forward's, on some CPUs enough to move a value at a step boundary by a whole int8 step. With the
    # inputs pinned, what is compared is the pool (layout, slots, scales, the paged attention), to fp32 precision.
    ids = tok.encode("The capital of France is")
    pins = KVPins()
    store = _PinnedInt8Store.for_model(model.config, num_blocks=4, block_size=4).pin(pins)
    cache = PagedKVCache(
        model.config.num_hidden_layers,
        model.config.num_key_value_heads,
        model.config.head_dim,
        block_manager=BlockManager(4, 4),
        kv_store=store,
    )
    ref = _Int8Reference.for_model(model.config).pin(pins)
    feed = ids
    for _ in range(4):  # prefill, then three decode steps
        want = model(torch.tensor([feed]), cache=ref)[0, -1]  # first: it records the K/V both paths quantize
        batch = cache.prepare(feed)
        store.positions = batch.positions.tolist()
        got = model.forward_batch(batch, store, backend="paged-int8-torch")[0]
        assert_logits_close(got, want)
        feed = [int(want.argmax())]
    assert store.nbytes < PagedKVStore.for_model(model.config, 4, 4).nbytes * 0.27


def test_the_int8_backend_needs_an_int8_pool(model):
    cache = PagedKVCache.for_model(model.config, num_blocks=2, block_size=4)
    with pytest.raises(TypeError, match="Int8PagedKVStore"):
        model.forward_batch(cache.prepare([1, 2]), cache.kv_store, backend="paged-int8-torch")


def test_triton_int8_backend_computes_what_the_torch_int8_backend_does(model, tok, monkeypatch):
    """Chapter 5's int8 kernels (Triton's interpreter on a CPU) behind the same int8 pool: the same codes and scales
    in every layer, bit for bit, and the same logits to fp32 precision.

    The two backends' attention sums in different orders, so from layer 1 on their K/V differ in the last bits and a
    value at an int8 step boundary could land in the neighbouring bucket; both backends therefore write the K/V the
    torch run computed (pinned, checked to agree to fp32 precision first)."""
    from kvcourse.backends.int8 import Int8PagedTorchBackend
    from kvcourse.backends.triton_int8 import TritonInt8Backend
    from kvcourse.kernels.triton_runtime import fallbacks, reset_fallbacks

    pins = KVPins()
    for backend_class in (Int8PagedTorchBackend, TritonInt8Backend):

        def pinned_write(self, layer_idx, k, v, write=backend_class.write_kv):
            write(self, layer_idx, *pins(layer_idx, self.batch.positions.tolist(), k, v))

        monkeypatch.setattr(backend_class, "write_kv", pinned_write)
    ids = tok.encode("The capital of France is")
    cfg = model.config
    runs, tokens = {}, []  # tokens: the torch run's greedy ones, fed to both runs
    reset_fallbacks()
    for backend in ("paged-int8-torch", "triton-int8"):  # the torch run first: it records the K/V
        store = Int8PagedKVStore.for_model(cfg, num_blocks=4, block_size=4)
        cache = PagedKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim,
                             block_manager=BlockManager(4, 4), kv_store=store)  # fmt: skip
        feed, logits = ids, []
        for step in range(3):  # prefill, then two decode steps through the kernels
            logits.append(model.forward_batch(cache.prepare(feed), store, backend=backend)[0])
            if len(tokens) == step:
                tokens.append(int(logits[-1].argmax()))
            feed = [tokens[step]]
        runs[backend] = (logits, store)
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"
    (want, ref_store), (got, kern_store) = runs["paged-int8-torch"], runs["triton-int8"]
    for g, w in zip(got, want):
        assert_logits_close(g, w)
    used = slice(0, 2)  # the blocks the 8 written tokens' slots fill
    for name in ("k_cache", "v_cache", "k_scale", "v_scale"):  # the kernel's quantizer is the torch one, bit for bit
        for layer in range(cfg.num_hidden_layers):
            assert torch.equal(getattr(kern_store, name)[layer][used], getattr(ref_store, name)[layer][used]), name
