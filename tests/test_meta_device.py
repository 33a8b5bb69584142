"""Every tensor the package creates lands on its inputs' device: checked on a CPU, the package's strays on "meta".

Each test builds its inputs on the CPU, then runs the package inside :func:`~tests.meta_device.package_on_meta`:
a tensor kvcourse creates without its inputs' device lands on ``meta`` and the test fails (see
:mod:`tests.meta_device`). Code that works on the host on purpose says so with ``device="cpu"``. The results
are then compared with the same call made normally, so a path that quietly produced meta tensors, or
different numbers, fails too.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvcourse
from kvcourse.backends import backend_names
from kvcourse.batch import ForwardBatch, SeqSlice
from kvcourse.compression import (
    FORMATS,
    DroppingKVCache,
    Int8PagedKVStore,
    QuantizedKVCache,
    SinkKVCache,
    compressed_continuation_logits,
    fake_quantize,
    generate_compressed,
    prefill_prompt,
    quantize,
    dequantize,
    ring_slot,
    select_tokens,
    simulate_window_logits,
    window_mask,
)
from kvcourse.exercises.catalog import EXERCISES, MODEL
from kvcourse.instructor import find_exercises
from kvcourse.instructor.grade import exercise_cells
from kvcourse.instructor.sandbox import _run_cells
from kvcourse.kernels import reference as ref
from kvcourse.kernels.int8 import (
    dequantize_int8,
    empty_int8_pool,
    paged_decode_attention_int8_ref,
    quantize_int8,
    reshape_and_cache_int8_ref,
)
from kvcourse.kernels.online_softmax import merge_partials, online_softmax_attention
from kvcourse.kernels.testing import paged_from_contiguous, random_paged_case
from kvcourse.mla import LatentCache, MLAConfig, MultiHeadLatentAttention
from kvcourse.paged import HostBlockPool, PagedKVCache, PagedKVStore, apply_transfers
from kvcourse.paged.offload import BlockTransfer
from kvcourse.probe import model_decode_case, record_forward
from kvcourse.quality import perplexity, stream_logits, top1_agreement
from kvcourse.serving import Engine
from kvcourse.sequence import SamplingParams

from .conftest import tiny_llama
from .meta_device import PACKAGE_DIR, package_on_meta

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"


def same(got, want) -> None:
    """``got`` equals ``want`` exactly, tensor by tensor (nested in tuples and lists), all of it on the CPU."""
    if isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.device == want.device == CPU, (got.device, want.device)
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    elif isinstance(want, (tuple, list)):
        assert type(got) is type(want) and len(got) == len(want)
        for g, w in zip(got, want):
            same(g, w)
    else:
        assert got == want


def on_meta_and_normally(fn):
    """``fn()`` with the package's device-less tensors on meta, and again normally: the results must be equal."""
    with package_on_meta():
        got = fn()
    same(got, fn())
    return got


@pytest.fixture(scope="module")
def tiny() -> kvcourse.LlamaModel:
    return tiny_llama(7, vocab_size=64, max_position_embeddings=256)


def _g(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_g(seed), device="cpu", dtype=dtype)


_BUGGY = """
import torch

def bad(x):
    return x + torch.arange(3)  # the bug: arange lands on the default device

def bad_index(x):
    return x[torch.tensor([2, 0])]  # torch alone would index a CPU tensor with meta indices: garbage

def bad_write(x):
    x = x.clone()
    x[x > 0] = torch.zeros(int((x > 0).sum()))  # torch alone would write nothing, silently
    return x

def good(x):
    return x + torch.arange(3, device=x.device)
"""


def test_the_harness_catches_a_tensor_the_package_makes_without_a_device():
    """The instrument itself, on code compiled as if it were a kvcourse module."""
    functions: dict = {}
    exec(compile(_BUGGY, PACKAGE_DIR + "_harness_probe.py", "exec"), functions)  # noqa: S102
    x = randn(3)
    assert torch.equal(functions["bad"](x), functions["good"](x))  # without meta, the bug is invisible on a CPU
    with package_on_meta():
        for wrong in ("bad", "bad_index", "bad_write"):
            with pytest.raises((RuntimeError, NotImplementedError)):
                functions[wrong](x)
        assert functions["good"](x).device == CPU
        assert torch.zeros(1).device == CPU  # made here, outside the package: torch's default, as in a notebook
        assert kvcourse.KVCache(1, 1, 1, 2).keys(0).device == CPU  # the package's own default is the CPU


# ---------------------------------------------------------------------------------------------
# References and the online softmax
# ---------------------------------------------------------------------------------------------
def test_contiguous_references():
    q, k, v = randn(2, 6, 5, 8, seed=1), randn(2, 2, 9, 8, seed=2), randn(2, 2, 9, 8, seed=3)
    on_meta_and_normally(lambda: ref.causal_attention(q, k, v))
    on_meta_and_normally(lambda: ref.causal_attention(q[:, :, -1:], k, v))  # a lone query: no mask
    on_meta_and_normally(lambda: ref.repeat_kv(k, 3))
    q1 = q[:, :, -1]
    on_meta_and_normally(lambda: ref.decode_attention_ref(q1, k, v))
    on_meta_and_normally(lambda: ref.decode_attention_ref(q1, k, v, [9, 4]))
    on_meta_and_normally(lambda: ref.decode_attention_ref(q1, k, v, torch.tensor([3, 9], device="cpu")))
    pos = torch.arange(4, 9, device="cpu")
    k_pos = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8], device="cpu").flip(0)  # any order
    on_meta_and_normally(lambda: ref.position_masked_attention(q, k.flip(2), v.flip(2), pos, k_pos, return_probs=True))


def test_paged_references():
    case = random_paged_case(
        3, [5, 17, 1], query_lens=[2, 17, 1], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4, device="cpu"
    )
    on_meta_and_normally(
        lambda: ref.paged_prefill_attention_ref(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc, case.positions
        )
    )
    decode = random_paged_case(4, [5, 17, 1], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4, device="cpu")
    on_meta_and_normally(
        lambda: ref.paged_decode_attention_ref(
            decode.q, decode.k_cache, decode.v_cache, decode.block_tables, decode.seq_lens
        )
    )
    assert on_meta_and_normally(lambda: ref.slot_mapping([7, 2], range(3, 6), 4)) == [31, 8, 9]

    def write():
        k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
        slots = case.slot_mapping.clone()
        slots[0] = -1  # padding: written nowhere
        ref.reshape_and_cache_ref(
            randn(len(slots), 2, 8, seed=5), randn(len(slots), 2, 8, seed=6), k_cache, v_cache, slots
        )
        return k_cache, v_cache

    on_meta_and_normally(write)


def test_paged_cases_are_built_on_the_host_then_moved():
    """The test harness of the kernels (chapter 5's checks use it): drawn on the CPU, whatever the default."""

    def case():
        return random_paged_case(5, [3, 9], num_q_heads=2, num_kv_heads=1, head_dim=4, block_size=2, device="cpu")

    on_meta_and_normally(lambda: tuple(vars(case()).values()))
    case = case()
    on_meta_and_normally(case.expected)
    on_meta_and_normally(lambda: paged_from_contiguous(case.q, case.k, case.v, [3, 9], 4, seed=1).block_tables)


def test_int8_references():
    x = randn(6, 2, 8, seed=7)
    codes, scales = on_meta_and_normally(lambda: quantize_int8(x))
    on_meta_and_normally(lambda: dequantize_int8(codes, scales))
    decode = random_paged_case(8, [5, 9], num_q_heads=4, num_kv_heads=2, head_dim=8, block_size=4, device="cpu")

    def int8_step():
        k8, v8, ks, vs = empty_int8_pool(*decode.k_cache.shape, device="cpu")
        slots = torch.arange(decode.k_cache.shape[0] * 4, device="cpu")
        flat_k, flat_v = decode.k_cache.view(-1, 2, 8).nan_to_num(), decode.v_cache.view(-1, 2, 8).nan_to_num()
        reshape_and_cache_int8_ref(flat_k, flat_v, k8, v8, ks, vs, slots)
        return paged_decode_attention_int8_ref(decode.q, k8, v8, ks, vs, decode.block_tables, decode.seq_lens)

    on_meta_and_normally(int8_step)


def test_online_softmax_and_merge():
    q, k, v = randn(3, 8, seed=9), randn(21, 8, seed=10), randn(21, 8, seed=11)
    out, lse = on_meta_and_normally(lambda: online_softmax_attention(q, k, v, tile=4, trace=[]))
    on_meta_and_normally(lambda: online_softmax_attention(q, k[:0], v[:0], tile=4))  # an empty split
    parts = [online_softmax_attention(q, k[lo:hi], v[lo:hi], tile=4) for lo, hi in ((0, 8), (8, 8), (8, 21))]
    outs, lses = torch.stack([o for o, _ in parts]), torch.stack([l for _, l in parts])
    merged = on_meta_and_normally(lambda: merge_partials(outs, lses))
    torch.testing.assert_close(merged, out)


def test_fused_layer_ops():
    """kernels/fused.py on the CPU: the torch versions (the Triton kernels run only on CUDA)."""
    from kvcourse.kernels import fused

    x, residual, weight = randn(3, 8, seed=20), randn(3, 8, seed=21), randn(8, seed=22)
    q, angles = randn(3, 2, 8, seed=23), randn(3, 1, 8, seed=24)
    cos, sin = fused.rope_tables_signed(angles.cos(), angles.sin())
    for dtype in (torch.float32, torch.bfloat16):
        on_meta_and_normally(lambda: fused.rms_norm(x.to(dtype), weight.to(dtype), 1e-5))
        on_meta_and_normally(lambda: fused.add_rms_norm(x.to(dtype), residual.to(dtype), weight.to(dtype), 1e-5))
        on_meta_and_normally(lambda: fused.rope(q.to(dtype), cos.to(dtype), sin.to(dtype)))
        on_meta_and_normally(lambda: fused.silu_and_mul(x.to(dtype)))


def test_triton_kernels_in_the_interpreter():
    from kvcourse.kernels import decode_attention, paged_decode_attention, paged_decode_attention_int8
    from kvcourse.kernels import fused_add_rms_norm, reshape_and_cache, reshape_and_cache_int8, rms_norm
    from kvcourse.kernels import rotary_embedding, silu_and_mul
    from kvcourse.kernels.triton_runtime import interpreting

    if not interpreting():
        pytest.skip("Triton compiles for the GPU here: its kernels cannot take CPU tensors")
    case = random_paged_case(12, [5, 40], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device="cpu")
    on_meta_and_normally(lambda: decode_attention(case.q, case.k, case.v, case.seq_lens))
    for splits in (1, 3):
        on_meta_and_normally(
            lambda: paged_decode_attention(
                case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, num_splits=splits
            )
        )
    new_k, new_v = randn(2, 2, 16, seed=13), randn(2, 2, 16, seed=14)
    slots = torch.tensor([3, -1], device="cpu")

    def writes():
        k_cache, v_cache = case.k_cache.nan_to_num(), case.v_cache.nan_to_num()
        reshape_and_cache(new_k, new_v, k_cache, v_cache, slots)
        pool = empty_int8_pool(*case.k_cache.shape, device="cpu")
        reshape_and_cache_int8(
            k_cache.view(-1, 2, 16), v_cache.view(-1, 2, 16), *pool, torch.arange(k_cache.shape[0] * 4, device="cpu")
        )
        return (
            k_cache,
            v_cache,
            paged_decode_attention_int8(case.q, *pool, case.block_tables, case.seq_lens, num_splits=2),
        )

    on_meta_and_normally(writes)
    x, weight = randn(3, 40, seed=15), randn(40, seed=16)
    on_meta_and_normally(lambda: rms_norm(x, weight, 1e-5))
    on_meta_and_normally(lambda: fused_add_rms_norm(x, x, weight, 1e-5))
    on_meta_and_normally(lambda: rotary_embedding(x.view(3, 5, 8), randn(3, 1, 8, seed=17), randn(3, 1, 8, seed=18)))
    on_meta_and_normally(lambda: silu_and_mul(x))


def test_planned_decode_and_the_fp8_write_in_the_interpreter():
    """Issue 50's host plan, planned decode and fp8 cache write make every tensor on their inputs' device."""
    from kvcourse.kernels import paged_decode_planned, reshape_and_cache_fp8
    from kvcourse.kernels.fp8 import FP8, reshape_and_cache_fp8_ref
    from kvcourse.kernels.split_plan import SplitPlan, plan_rows
    from kvcourse.kernels.triton_runtime import interpreting

    if not interpreting():
        pytest.skip("Triton compiles for the GPU here: its kernels cannot take CPU tensors")
    case = random_paged_case(19, [5, 40], num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, device="cpu")
    on_meta_and_normally(lambda: plan_rows([5, 40, 0], 16, capacity=5))

    def planned():
        plan = SplitPlan(6, 3, "cpu")
        plan.fill([5, 40], 2, 4, min_chunk=16)
        return plan.buffer, paged_decode_planned(case.q, case.k_cache, case.v_cache, case.block_tables, plan, 0.25)

    on_meta_and_normally(planned)

    def writes():
        out = []
        for write in (reshape_and_cache_fp8, reshape_and_cache_fp8_ref):
            pool = [torch.zeros(3, 4, 2, 16, dtype=FP8, device="cpu") for _ in range(2)]
            scales = [torch.zeros(3, 4, 2, device="cpu") for _ in range(2)]
            write(
                randn(2, 2, 16, seed=20), randn(2, 2, 16, seed=21), *pool, *scales, torch.tensor([3, -1], device="cpu")
            )
            out += [pool[0].view(torch.uint8), pool[1].view(torch.uint8), *scales]
        return out

    on_meta_and_normally(writes)


# ---------------------------------------------------------------------------------------------
# The model, its backends, generation and the engine
# ---------------------------------------------------------------------------------------------
def _mixed_step(tiny, store) -> ForwardBatch:
    """A ragged step on ``store``: a 6-token prompt, a chunk after 3 cached tokens, and two decodes."""
    seqs = [SeqSlice([1, 2, 3, 4, 5, 6], 0, [0, 1]), SeqSlice([7, 8], 3, [2, 3]), SeqSlice([9], 4, [4, 5]),
            SeqSlice([10], 8, [6, 7, 8])]  # fmt: skip
    return ForwardBatch.build(seqs, store.block_size, device="cpu")


@pytest.mark.parametrize("backend", backend_names())
def test_every_backend_on_a_mixed_step(tiny, backend):
    from kvcourse.backends import backend_class

    if backend.startswith("triton"):
        from kvcourse.kernels.triton_runtime import interpreting

        if not interpreting():
            pytest.skip("Triton compiles for the GPU here: its kernels cannot take CPU tensors")

    def run():
        store = backend_class(backend).make_store(tiny.config, 10, 4, torch.float32, "cpu")
        batch = _mixed_step(tiny, store)
        return tiny.forward_batch(batch, store, backend=backend, all_logits=True)

    on_meta_and_normally(run)
    with package_on_meta():
        batch = ForwardBatch.build([SeqSlice([1, 2, 3], 0, [0])], 4)  # build's default device is the CPU
    assert batch.positions.device == CPU


def test_model_forward_with_and_without_a_cache(tiny):
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]], device="cpu")
    on_meta_and_normally(lambda: tiny(ids))

    def cached():
        cache = kvcourse.KVCache.for_model(tiny.config, batch_size=2, device="cpu")
        return tiny(ids, cache=cache), tiny(ids[:, :1], cache=cache), cache.keys(1), len(cache)

    on_meta_and_normally(cached)


def test_generate_every_way(tiny):
    prompt = [5, 9, 2, 7]
    want = kvcourse.generate(tiny, prompt, 6, eos_token_ids=())
    with package_on_meta():
        assert kvcourse.generate(tiny, prompt, 6, use_cache=False, eos_token_ids=()) == want
        assert kvcourse.generate(tiny, prompt, 6, eos_token_ids=()) == want
        assert kvcourse.generate_paged(tiny, prompt, 6, eos_token_ids=()) == want
        sampled = kvcourse.generate(tiny, prompt, 6, temperature=0.8, top_k=20, top_p=0.9, seed=3, eos_token_ids=())
        assert kvcourse.timed_generate(tiny, prompt, 3, eos_token_ids=()).tokens == want[:3]
    assert sampled == kvcourse.generate(tiny, prompt, 6, temperature=0.8, top_k=20, top_p=0.9, seed=3, eos_token_ids=())


@pytest.mark.parametrize("options", [
    dict(),
    dict(enable_prefix_caching=True, num_cpu_blocks=8, preemption_mode="swap", max_num_batched_tokens=8),
    dict(overlap=True, enable_prefix_caching=True),
], ids=["default", "prefix-cache-swap-chunked", "overlap"])  # fmt: skip
def test_one_engine_run(tiny, options):
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [4, 4]]
    params = [
        SamplingParams(max_new_tokens=5),
        SamplingParams(max_new_tokens=4, n=2, temperature=1.0, seed=1),
        SamplingParams(max_new_tokens=6),
    ]

    def run():
        engine = Engine(tiny, num_blocks=9, block_size=4, **options)  # small: preemptions under swap
        return engine.generate(prompts, params, use_tqdm=False)

    on_meta_and_normally(run)


def test_probes_and_quality_measures(tiny):
    ids = [3, 1, 4, 1, 5, 9, 2, 6]
    on_meta_and_normally(lambda: record_forward(tiny, ids).k)
    case = on_meta_and_normally(lambda: model_decode_case(tiny, [ids, ids[:4]], layer=1).out)
    logits = on_meta_and_normally(lambda: stream_logits(tiny, ids, chunk_size=3))
    assert on_meta_and_normally(lambda: perplexity(logits[:-1], ids[1:])) > 1
    assert on_meta_and_normally(lambda: top1_agreement(logits, logits)) == 1
    assert case.shape == (2, 6, 8)


# ---------------------------------------------------------------------------------------------
# Paged and compressed caches
# ---------------------------------------------------------------------------------------------
def test_paged_cache_store_and_offload(tiny):
    def run():
        cache = PagedKVCache.for_model(tiny.config, num_blocks=8, block_size=4, device="cpu")
        first = tiny.forward_batch(cache.prepare([1, 2, 3, 4, 5]), cache.kv_store)
        child = cache.fork()
        second = tiny.forward_batch(child.prepare([6]), child.kv_store)  # copy-on-write of the shared block
        store = cache.kv_store
        store.write(0, [30, 31], randn(2, 2, 8, seed=15), randn(2, 2, 8, seed=16))
        store.copy_block(7, 6)
        host = PagedKVStore.for_model(tiny.config, 4, 4, device="cpu")
        apply_transfers(
            store,
            host,
            [BlockTransfer("to_host", 0, 1), BlockTransfer("to_host", 1, 0), BlockTransfer("to_device", 1, 5)],
        )
        return first, second, store.k_cache, host.v_cache

    on_meta_and_normally(run)
    pool = HostBlockPool(4)
    with package_on_meta():
        assert pool.take() in range(4)


def test_int8_paged_store():
    def run():
        store = Int8PagedKVStore(2, 4, 4, 2, 8, device="cpu")
        store.write(1, [0, 5, 9], randn(3, 2, 8, seed=17), randn(3, 2, 8, seed=18))
        store.copy_block(2, 3)
        return store.dequantized(1)

    on_meta_and_normally(run)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_quantizers(fmt):
    x = randn(2, 3, 5, 8, seed=19)
    qt = on_meta_and_normally(lambda: tuple(vars(quantize(x, fmt)).values()))
    on_meta_and_normally(lambda: dequantize(quantize(x, fmt)))
    on_meta_and_normally(lambda: fake_quantize(x, fmt, dim=-2))


@pytest.mark.parametrize("scheme, bits", [("per-token", 4), ("kivi", 2), ("fp8", 8), ("bf16", 16)])
def test_quantized_cache(tiny, scheme, bits):
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6, 5, 3]], device="cpu")

    def run():
        cache = QuantizedKVCache.for_model(tiny.config, bits=bits, scheme=scheme, group_size=4, residual_length=2)
        return tiny(ids[:, :7], cache=cache), tiny(ids[:, 7:], cache=cache), cache.keys(0), cache.nbytes

    on_meta_and_normally(run)
    with package_on_meta():  # an empty cache reads as empty tensors
        empty = QuantizedKVCache.for_model(tiny.config, bits=bits, scheme=scheme, group_size=4)
        assert empty.keys(0).shape[2] == 0 and empty.keys(0).device == CPU


def test_window_cache_and_its_simulation(tiny):
    ids = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]

    def run():
        cache = SinkKVCache.for_model(tiny.config, window=4, num_sinks=2, device="cpu")
        logits = [tiny(torch.tensor([ids[:5]], device="cpu"), cache=cache)]
        logits += [tiny(torch.tensor([[i]], device="cpu"), cache=cache) for i in ids[5:]]
        return torch.cat([x[0] for x in logits]), cache.held_positions(1), cache.num_held

    streamed = on_meta_and_normally(run)[0]
    simulated = on_meta_and_normally(lambda: simulate_window_logits(tiny, ids, window=4, num_sinks=2))
    torch.testing.assert_close(simulated, streamed, rtol=1e-5, atol=1e-5)
    pos = torch.arange(6, device="cpu")
    on_meta_and_normally(lambda: window_mask(pos, pos, 2, 1))
    on_meta_and_normally(lambda: ring_slot(pos, 2, 3))


@pytest.mark.parametrize("method", ["h2o", "snapkv", "streaming"])
def test_dropping_cache(tiny, method):
    context, continuation = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [5, 8, 9]
    on_meta_and_normally(lambda: compressed_continuation_logits(tiny, context, continuation, budget=6, method=method))
    on_meta_and_normally(lambda: generate_compressed(tiny, context, budget=6, method=method, max_new_tokens=4))

    def run():
        cache, _ = prefill_prompt(tiny, context, observation_window=3)
        cache.compress(5, method, pool_kernel=3, num_sinks=2)
        return cache.key_positions(0), cache.num_held

    on_meta_and_normally(run)
    s = torch.rand(1, 2, 9, generator=_g(20), device="cpu")
    positions = torch.arange(9, device="cpu").expand(1, 2, 9)
    on_meta_and_normally(lambda: select_tokens(method, 4, s, s.flip(-1), positions, 3, 3, 1))
    assert isinstance(DroppingKVCache.for_model(tiny.config), DroppingKVCache)


def test_mla():
    layer = MultiHeadLatentAttention(
        MLAConfig(hidden_size=32, num_heads=2, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, kv_lora_rank=16)
    )
    x = randn(1, 7, 32, seed=21)

    def run(absorb):
        cache = LatentCache()
        out = torch.cat([layer(x[:, :5], cache, absorb=absorb), layer(x[:, 5:], cache, absorb=absorb)], 1)
        return out, layer.expanded_kv(cache)

    for absorb in (False, True):
        on_meta_and_normally(lambda: run(absorb))


# ---------------------------------------------------------------------------------------------
# Every exercise check, run with the book's reference solution
# ---------------------------------------------------------------------------------------------
_NOTEBOOKS = {path.name: json.loads(path.read_text()) for path in sorted(BOOK.glob("[0-9][0-9]_*.ipynb"))}
_LABELS = [(name, e.label) for name, nb in _NOTEBOOKS.items() for e in find_exercises(nb)]


def _solution(nb: dict, label: str, given: dict, monkeypatch) -> dict:
    """The names the exercise's cells define, run here as the grader's sandbox runs them (the checks they call off)."""
    for chapter in {spec.chapter for spec in EXERCISES.values()}:
        module = importlib.import_module(f"kvcourse.exercises.{chapter}")
        for name in [n for n in vars(module) if n.startswith("check_")]:
            monkeypatch.setattr(module, name, lambda *args, **kwargs: True)
    namespace = dict(given)
    problem = _run_cells(exercise_cells(nb, label), namespace)  # as the sandbox: only the solution cell must run
    monkeypatch.undo()
    assert problem is None, problem
    return namespace


@pytest.fixture(scope="module")
def tiny_smollm_vocab(model) -> kvcourse.LlamaModel:
    """A tiny random Llama that reads SmolLM2's token ids (checks draw ids from its vocabulary, some fixed ones)."""
    return tiny_llama(11, vocab_size=model.config.vocab_size, max_position_embeddings=2048)


@pytest.mark.parametrize("chapter, label", _LABELS, ids=[label for _, label in _LABELS])
def test_every_check_with_its_reference_solution(chapter, label, model, tok, tiny_smollm_vocab, monkeypatch, capsys):
    """The cells run with the real model (their text needs it); a check that takes a model gets a tiny one with
    the same vocabulary: the checks work with any Llama, and a device bug does not depend on the model's size."""
    from kvcourse.instructor.checker import load_check

    spec = EXERCISES[label]
    namespace = _solution(_NOTEBOOKS[chapter], label, {"model": model, "tok": tok}, monkeypatch)
    args = [tiny_smollm_vocab if a == MODEL else namespace[a] for a in spec.args]
    check = load_check(spec)
    assert inspect.unwrap(check).__module__.startswith("kvcourse.exercises.")  # the check, not _solution's stand-in
    capsys.readouterr()
    with package_on_meta():
        result = check(*args)
    shown = capsys.readouterr().out
    assert result and shown.startswith("Correct: "), shown


def test_the_checks_diagnose_wrong_answers_with_the_package_on_meta():
    """The wrong-answer tests of the chapters whose checks hand out tensors, rerun in this mode: the hint a check
    gives (its typical mistakes are computed from the hidden cases, on the CPU) works wherever the cases live."""
    files = [f"tests/test_exercises_{chapter}.py" for chapter in ("ch01", "ch02", "ch05", "ch07_offload", "ch08")]
    env = dict(os.environ, KVCOURSE_PACKAGE_ON_META="1")
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "reject", *files],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


def test_fused_decode_attention_in_the_interpreter():
    """Issue 49's one-kernel-a-layer decode attention (RoPE, cache write, planned read, in-kernel merge) makes every
    tensor (its output, partials and arrival counters) on its inputs' device."""
    from kvcourse.kernels.fused import rope_tables_signed
    from kvcourse.kernels.split_plan import SplitPlan, plan_capacity
    from kvcourse.kernels.triton_fused_decode import rope_cache_decode
    from kvcourse.kernels.triton_runtime import interpreting
    from kvcourse.model import rope_cos_sin

    if not interpreting():
        pytest.skip("Triton compiles for the GPU here: its kernels cannot take CPU tensors")
    seq_lens, hq, hkv, d = [9, 40], 4, 2, 16
    case = random_paged_case(23, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=16, device="cpu")
    qkv = torch.randn(len(seq_lens), hq + 2 * hkv, d, generator=_g(24))
    cos, sin = rope_tables_signed(*rope_cos_sin(torch.arange(64, device="cpu"), d, 10000.0))

    def decode():
        plan = SplitPlan(plan_capacity(len(seq_lens), hkv, 4), len(seq_lens), "cpu")
        plan.fill(seq_lens, hkv, 4, min_chunk=16)  # 4 SMs: the 40-token context splits, merged in the kernel
        k_pool, v_pool = case.k_cache.clone(), case.v_cache.clone()
        out = rope_cache_decode(qkv, cos, sin, case.positions, case.slot_mapping, k_pool, v_pool,
                                case.block_tables, plan, d**-0.5)  # fmt: skip
        return out, k_pool, v_pool

    on_meta_and_normally(decode)
