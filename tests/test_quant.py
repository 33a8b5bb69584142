"""KV quantization: the formats' error bounds, bytes counted with their scales, and QuantizedKVCache on the real model."""

import pytest
import torch

import kvcourse
from kvcourse import QuantizedKVCache
from kvcourse.compression.quantization import dequantize, fake_quantize, pack_codes, quantize, unpack_codes
from tests.pinned_kv import KVPins, PinnedUpdates
from tests.tolerances import assert_logits_close, decided_steps, top1_margins


def _x(seed, *shape, outliers=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 3
    if outliers:  # a few channels much larger than the rest, as keys have
        x[..., :2] *= 20
    return x


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_then_unpack_is_the_identity(bits):
    codes = torch.randint(0, 2**bits, (3, 5, 16), generator=torch.Generator().manual_seed(bits), dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert packed.shape == (3, 5, 16 * bits // 8) and packed.dtype == torch.uint8
    assert torch.equal(unpack_codes(packed, bits), codes)


def test_quantize_by_hand():
    qt = quantize(torch.tensor([[0.0, 0.4, 0.6, 3.0]]), "int2")  # range 3 over 3 steps: scale 1, zero 0
    assert qt.scale.item() == 1 and qt.zero.item() == 0
    assert unpack_codes(qt.data, 2).tolist() == [[0, 0, 1, 3]]
    assert dequantize(qt).tolist() == [[0.0, 0.0, 1.0, 3.0]]
    assert qt.nbytes == 1 + 2 + 2  # four 2-bit codes in one byte, an fp16 scale and an fp16 zero point
    constant = quantize(torch.full((1, 4), 2.5), "int4")  # a constant group comes back exactly
    assert dequantize(constant).tolist() == [[2.5] * 4]


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
@pytest.mark.parametrize("dim", [-1, -2])
def test_integer_error_is_half_a_step_of_each_group(fmt, dim):
    x = _x(len(fmt) + dim, 2, 3, 16, 8, outliers=True)
    x_hat = fake_quantize(x, fmt, dim)
    levels = 2 ** int(fmt[3:]) - 1
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    step = (hi - lo) / levels
    # half a step, plus what storing the scale and the zero point in fp16 costs (2^-11 relative)
    bound = step / 2 + (hi.abs() + lo.abs()) * 2**-10
    assert bool(((x_hat - x).abs() <= bound).all())
    assert bool(((x_hat - x).abs() > step / 8).any())  # it did quantize


def test_per_channel_groups_are_better_for_outlier_channels():
    # The reason KIVI quantizes keys per channel: an outlier channel stretches every per-token range.
    x = _x(0, 1, 1, 64, 64, outliers=True)
    per_token = (fake_quantize(x, "int4", -1) - x).pow(2)
    per_channel = (fake_quantize(x, "int4", -2) - x).pow(2)
    assert per_channel.mean() < per_token.mean() / 2
    assert per_channel[..., 2:].mean() < per_token[..., 2:].mean() / 10  # the ordinary channels, above all


def test_fp8_error_is_relative():
    x = _x(5, 4, 64)
    qt = quantize(x, "fp8")
    assert qt.data.dtype == torch.float8_e4m3fn and qt.nbytes == 4 * 64 + 4 * 2
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value; below 2^-6 the steps are fixed (2^-9).
    bound = x.abs() * 2**-4 + qt.scale.float() * 2**-10
    assert bool(((dequantize(qt) - x).abs() <= bound * 1.001).all())


def test_bad_input_to_quantize():
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize(torch.zeros(2, 4), "int3")
    with pytest.raises(TypeError, match="floating-point"):
        quantize(torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize(torch.zeros(2, 6), "int2")


# ---- QuantizedKVCache -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "bytes_per_value_and_vector"),
    [
        (dict(bits=8), (1, 4)),  # int8 codes, fp16 scale + zero per vector
        (dict(bits=4), (0.5, 4)),
        (dict(bits=2), (0.25, 4)),
        (dict(bits=8, scheme="fp8"), (1, 2)),  # one fp16 scale, no zero point
        (dict(bits=16, scheme="fp16"), (2, 0)),
        (dict(bits=16, scheme="bf16"), (2, 0)),
    ],
)
def test_bytes_per_token_counts_the_scales(kwargs, bytes_per_value_and_vector):
    per_value, per_vector = bytes_per_value_and_vector
    cache = QuantizedKVCache(num_layers=2, batch_size=2, num_kv_heads=3, head_dim=16, **kwargs)
    for t in (5, 1, 1, 7):
        for layer in range(2):
            k, v = cache.update(layer, _x(t, 2, 3, t, 16), _x(t + 1, 2, 3, t, 16))
    assert cache.seq_len == 14 and k.shape == v.shape == (2, 3, 14, 16)
    assert cache.nbytes == 2 * 2 * 2 * 3 * 14 * (16 * per_value + per_vector)  # K and V, layers, B, H, tokens
    assert cache.bytes_per_token == cache.nbytes / 28


@pytest.mark.parametrize("bits", [8, 4])
def test_per_token_history_is_within_half_a_step_of_what_was_stored(bits, device):
    cache = QuantizedKVCache(num_layers=1, batch_size=1, num_kv_heads=2, head_dim=8, bits=bits)
    ks = [_x(s, 1, 2, t, 8, outliers=True) for s, t in enumerate((6, 1, 3))]
    for k in ks:
        k_hist, v_hist = cache.update(0, k.to(device), k.to(device))
    assert k_hist.device.type == device.type
    k_hist, v_hist = k_hist.cpu(), v_hist.cpu()
    k_all = torch.cat(ks, 2)
    step = (k_all.amax(-1, keepdim=True) - k_all.amin(-1, keepdim=True)) / (2**bits - 1)
    bound = step / 2 + k_all.abs().amax(-1, keepdim=True) * 2**-9  # fp16 storage along the way
    assert bool(((k_hist - k_all).abs() <= bound).all()) and torch.equal(k_hist, v_hist)


@pytest.mark.parametrize("seed", range(3))
def test_kivi_window_and_key_groups(seed):
    g = torch.Generator().manual_seed(seed)
    group, residual = 4, 3
    cache = QuantizedKVCache(1, 1, 2, 8, bits=2, scheme="kivi", group_size=group, residual_length=residual)
    chunks = [torch.randn(1, 2, int(t), 8, generator=g) for t in torch.randint(1, 7, (8,), generator=g)]
    seen = []
    for k in chunks:
        k_hist, v_hist = cache.update(0, k, 2 * k)
        seen.append(k)
        k_all = torch.cat(seen, 2)
        n = k_all.shape[2]
        # The newest tokens wait in the fp16 window: between R and R + G - 1 of them (fewer at the start).
        n_quantized = max(n - residual, 0) // group * group
        window = slice(n_quantized, n)
        torch.testing.assert_close(k_hist[:, :, window], k_all[:, :, window].half().float(), rtol=0, atol=0)
        assert residual <= n - n_quantized < residual + group or n_quantized == 0
        # Older keys: each channel of each group of G tokens is its own quantization group.
        old = k_all[:, :, :n_quantized].reshape(1, 2, -1, group, 8)
        step = (old.amax(3, keepdim=True) - old.amin(3, keepdim=True)) / 3
        err = (k_hist[:, :, :n_quantized].reshape(old.shape) - old).abs()
        assert bool((err <= step / 2 + old.abs().amax(3, keepdim=True) * 2**-9).all())
        # Values are quantized per token.
        v_old = 2 * k_all[:, :, :n_quantized]
        v_step = (v_old.amax(-1, keepdim=True) - v_old.amin(-1, keepdim=True)) / 3
        assert bool(
            (
                (v_hist[:, :, :n_quantized] - v_old).abs() <= v_step / 2 + v_old.abs().amax(-1, keepdim=True) * 2**-9
            ).all()
        )
    codes = 2 * n_quantized * 2 * 8 // 4  # K and V, tokens, 2 heads, 8 channels, four 2-bit codes per byte
    scales = (n_quantized // group) * 8 * 2 * 2 * 2 + n_quantized * 2 * 2 * 2  # K per channel; V per token
    assert cache.nbytes == codes + scales + (n - n_quantized) * 2 * 8 * 2 * 2


def test_bad_input_to_the_cache():
    with pytest.raises(ValueError, match="scheme must be one of"):
        QuantizedKVCache(1, 1, 1, 8, scheme="per-head")
    with pytest.raises(ValueError, match=r"bits must be one of \(8,\) for scheme 'fp8'"):
        QuantizedKVCache(1, 1, 1, 8, bits=4, scheme="fp8")
    with pytest.raises(ValueError, match="head_dim"):
        QuantizedKVCache(1, 1, 1, 6, bits=2)
    with pytest.raises(ValueError, match="residual_length"):
        QuantizedKVCache(1, 1, 1, 8, residual_length=-1)
    cache = QuantizedKVCache(1, 1, 1, 8, max_seq_len=4)
    with pytest.raises(ValueError, match=r"\[B, H_kv, T, D\]"):
        cache.update(0, torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4))
    with pytest.raises(kvcourse.CacheOverflowError):
        cache.update(0, torch.zeros(1, 1, 5, 8), torch.zeros(1, 1, 5, 8))
    with pytest.raises(TypeError, match="model.config"):
        QuantizedKVCache.for_model(torch.nn.Linear(2, 2))


# ---- on the real model -------------------------------------------------------------------------------
PROMPT = "The capital of France is"


# How far an int8 or fp16 cache may move a logit of this model: int8 rounds each value by at most 1/254 of its
# vector's largest magnitude; through 30 layers that moved no logit by more than 0.38 on the greedy path below
# (fp16's 2^-11 relative error: 0.03). The bounds leave room for another CPU's rounding of the same steps.
CACHE_LOGIT_SHIFT = {8: 0.5, 16: 0.1}


@pytest.mark.parametrize(("scheme", "bits"), [("per-token", 8), ("fp16", 16)])
def test_the_model_runs_on_it_and_keeps_every_clear_greedy_token(model, tok, scheme, bits):
    ids = tok.encode(PROMPT)
    want = kvcourse.generate(model, ids, 8)
    cache = QuantizedKVCache.for_model(model.config, bits=bits, scheme=scheme)
    got = kvcourse.generate(model, ids, 8, cache=cache)
    assert cache.seq_len == len(ids) + 7
    # Teacher-forced on the fp32 greedy path, the quantized cache moves the logits by less than its bound...
    path = torch.tensor([ids + want])
    full = model(path, cache=kvcourse.KVCache.for_model(model.config))[0, len(ids) - 1 : -1]
    quant = model(path, cache=QuantizedKVCache.for_model(model.config, bits=bits, scheme=scheme))[0, len(ids) - 1 : -1]
    shift = CACHE_LOGIT_SHIFT[bits]
    assert float((quant - full).abs().max()) < shift
    # ...so every greedy token decided by more than twice that is kept, on any CPU; a closer call may flip.
    decided = decided_steps(top1_margins(full), shift)
    assert int(decided.sum()) >= 4, "the prompt should have clear greedy tokens to test"
    assert torch.equal(quant.argmax(-1)[decided], full.argmax(-1)[decided])
    n = int(decided.int().cumprod(0).sum())  # generation agrees up to the first close call
    assert got[:n] == want[:n]


class _PinnedQuantizedCache(PinnedUpdates, QuantizedKVCache):
    """A quantized cache whose inputs are pinned (``tests.pinned_kv``): each position quantizes the same floats in
    every run, whatever shape of batch the CPU computed them in."""


def test_per_token_quantization_does_not_depend_on_the_chunks(model):
    # Each token is quantized on its own, so feeding the text in any chunks stores the same codes and gives the same
    # logits. Both runs quantize the same K/V (pinned): on another CPU the chunked matmuls may round differently,
    # and a value at a 4-bit step boundary would then move by a whole step (issue: red on an AMD EPYC).
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 17, 30, 2045, 1099, 28, 253, 1183, 314]])
    pins = KVPins()
    whole = _PinnedQuantizedCache.for_model(model.config, bits=4).pin(pins)
    one = model(ids, cache=whole)
    cache = _PinnedQuantizedCache.for_model(model.config, bits=4).pin(pins)
    chunked = torch.cat([model(ids[:, a:b], cache=cache) for a, b in ((0, 5), (5, 6), (6, 13), (13, 14))], 1)
    for layer in range(model.config.num_hidden_layers):  # the very same codes, scales and zero points, bit for bit
        assert torch.equal(cache.keys(layer), whole.keys(layer)) and torch.equal(
            cache.values(layer), whole.values(layer)
        )
    assert_logits_close(chunked, one)
    full = model(ids, cache=kvcourse.KVCache.for_model(model.config))
    assert (one - full).abs().max() > 1e-3 * full.abs().max()  # int4 does change them


@pytest.mark.parametrize("scheme", ["per-token", "kivi"])
def test_an_unquantized_prefill_reads_its_own_kv_unrounded_and_stores_the_same_codes(scheme):
    # KIVI's reference code and Hugging Face's QuantizedCache prefill on full-precision K/V; later steps read the
    # quantized history. Layer 0's K/V come from the embeddings alone, so its stored codes are the same either way.
    from tests.conftest import tiny_llama

    model = tiny_llama(3, num_hidden_layers=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (1, 40), generator=g)
    caches = {q: QuantizedKVCache.for_model(model.config, bits=4, scheme=scheme, residual_length=0 if scheme ==
                                            "per-token" else 4, group_size=8, quantize_prefill=q) for q in (True, False)}  # fmt: skip
    with torch.no_grad():
        full = model(ids)[0, -1]
        prefill = {q: model(ids, cache=c)[0, -1] for q, c in caches.items()}
        torch.testing.assert_close(prefill[False], full, rtol=0, atol=0)  # nothing rounded in the prompt's forward
        assert not torch.allclose(prefill[True], full)  # the default: the prompt already reads its rounded K/V
        torch.testing.assert_close(caches[False].keys(0), caches[True].keys(0), rtol=0, atol=0)
        reference = kvcourse.KVCache.for_model(model.config)
        model(ids, cache=reference)
        nxt = torch.tensor([[int(full.argmax())]])
        want, got = model(nxt, cache=reference)[0, -1], model(nxt, cache=caches[False])[0, -1]
    assert not torch.allclose(got, want)  # the decode step reads the quantized history


def test_quantize_prefill_must_be_a_bool():
    with pytest.raises(TypeError, match="quantize_prefill"):
        QuantizedKVCache(2, 1, 2, 8, bits=4, quantize_prefill="no")
