"""The backends package: the SDPA paged backend against independent references, the registry, the
stores each backend builds, cached RoPE tables, and the direction of imports."""

from __future__ import annotations

import ast
import itertools
import random
from pathlib import Path

import pytest
import torch

import kvcourse
from kvcourse.backends import backend_class, backend_names, register
from kvcourse.backends.paged import PagedReferenceBackend, PagedTorchBackend
from kvcourse.batch import ForwardBatch, SeqSlice, slot_mapping
from kvcourse.compression import Int8PagedKVStore
from kvcourse.kernels.testing import random_paged_case, tolerance
from kvcourse.model import rope_cos_sin
from kvcourse.paged import PagedKVStore
from kvcourse.serving import ModelRunner

from .conftest import on_device, tiny_llama

PACKAGE = Path(kvcourse.__file__).parent


# ---- the paged backends equal the contiguous reference on random ragged steps ---------------------
def _case_step(seed: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
    """A random ragged step (decodes, whole prompts, chunks after a cached prefix), its pool full of
    NaN where no sequence has K/V, as a one-layer store, a batch, and the step's q, k, v, on ``device``."""
    rnd = random.Random(seed)
    seq_lens, query_lens = [], []
    for _ in range(rnd.randint(1, 6)):
        kind = rnd.choice(["decode", "decode", "prompt", "chunk"])
        n = rnd.randint(1, 70)
        q = 1 if kind == "decode" else n if kind == "prompt" else rnd.randint(1, n)
        seq_lens.append(n), query_lens.append(q)
    case = random_paged_case(seed, seq_lens, query_lens=query_lens, num_q_heads=6, num_kv_heads=2, head_dim=16,
                             block_size=block_size, dtype=dtype, device=device)  # fmt: skip
    store = PagedKVStore(1, case.k_cache.shape[0], block_size, 2, 16, dtype=dtype, device=device)
    store.k_cache[0].copy_(case.k_cache), store.v_cache[0].copy_(case.v_cache)
    batch = ForwardBatch(
        input_ids=torch.zeros(case.q.shape[0], dtype=torch.int64, device=device), positions=case.positions,
        slot_mapping=case.slot_mapping, query_start_loc=case.query_start_loc, seq_lens=case.seq_lens,
        block_tables=case.block_tables, block_size=block_size,
    ).check()  # fmt: skip
    # This step's own K/V: what the pool holds at its slots (the write puts back the same values).
    k_new = case.k_cache.view(-1, 2, 16)[case.slot_mapping]
    v_new = case.v_cache.view(-1, 2, 16)[case.slot_mapping]
    return case, store, batch, (case.q, k_new, v_new)  # packed: [N, H, D], no batch dimension


@pytest.mark.parametrize("backend", [PagedTorchBackend, PagedReferenceBackend], ids=["paged-torch", "paged-reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seed", range(6))
def test_paged_backends_equal_the_contiguous_reference(backend, dtype, block_size, seed, device):
    case, store, batch, (q, k, v) = _case_step(seed * 31 + block_size, block_size, dtype, device)
    got = backend(store, batch)(0, q, k, v)
    assert got.device.type == device.type
    want = case.expected()
    assert not got.isnan().any(), "a NaN from an unused slot leaked into the output"
    # bf16 inputs: the reference multiplies in bf16 then softmaxes in fp32; SDPA keeps its own
    # fp32 accumulators. Both are within bf16's precision of the fp32 answer.
    torch.testing.assert_close(got, want, **tolerance(dtype))


@pytest.mark.filterwarnings("ignore:invalid value encountered in divide:RuntimeWarning")
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("seed", range(3))
def test_the_ragged_backend_equals_the_contiguous_reference(block_size, seed):
    """``triton-ragged`` (what a mixed step's graph records) serves any ragged step eagerly too: one kernel for
    decodes, whole prompts and chunks after a cached prefix alike (kernels in Triton's interpreter on a CPU)."""
    from kvcourse.kernels.triton_runtime import kernel_device

    if kernel_device().type != "cpu":
        pytest.skip("Triton kernels take cuda tensors in this process, not cpu ones")
    case, store, batch, (q, k, v) = _case_step(seed * 31 + block_size, block_size, torch.float32)
    got = backend_class("triton-ragged")(store, batch)(0, q, k, v)
    torch.testing.assert_close(got, case.expected(), **tolerance(torch.float32))


def test_the_step_is_split_once_into_decodes_and_prefills():
    """Which rows decode is decided when the backend is built (once per step), from the host lengths."""
    case, store, batch, (q, k, v) = _case_step(3, 4, torch.float32)
    lens = case.seq_lens.tolist()
    decode_rows = [b for b, (lo, hi) in enumerate(itertools.pairwise(case.query_start_loc.tolist())) if hi - lo == 1]
    mixed = PagedTorchBackend(store, batch)
    assert mixed.decode_seqs == decode_rows and len(mixed.prefill_seqs) == batch.num_seqs - len(decode_rows)
    assert mixed.decode_max_len == max((lens[b] for b in decode_rows), default=0)


def test_the_sdpa_backend_reads_whole_blocks_once_per_layer():
    _, store, batch, (q, k, v) = _case_step(2, 4, torch.float32)
    backend = PagedTorchBackend(store, batch)
    calls = []
    real = backend.read_kv
    backend.read_kv = lambda layer, blocks, dtype: (calls.append(blocks.numel()), real(layer, blocks, dtype))[1]
    backend(0, q, k, v)
    groups = bool(backend.decode_seqs) + bool(backend.prefill_seqs)
    assert len(calls) == groups  # one gather for the decodes, one for every prefill row together


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("seed", range(3))
def test_the_additive_mask_attends_exactly_as_the_boolean_one(dtype, seed):
    # The backend hands SDPA its mask as a 0 / -inf bias, made once per step (SDPA would convert a boolean
    # mask on every layer): the outputs are the same bits, and a masked-out NaN key still needs zeroing.
    from kvcourse.backends.paged import additive_mask

    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(3, 4, t, 16, generator=g).to(dtype) for t in (5, 9, 9))
    keep = torch.rand(3, 1, 5, 9, generator=g) > 0.4
    keep[..., 0] = True  # every query sees a key (a fully masked row is NaN either way)
    bias = additive_mask(keep, dtype)
    assert bias.dtype == dtype and bias.shape == keep.shape
    assert torch.equal(bias == 0, keep) and torch.isneginf(bias[~keep]).all()
    F = torch.nn.functional
    assert torch.equal(
        F.scaled_dot_product_attention(q, k, v, attn_mask=keep), F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    )


SEED_WITH_BOTH = 5  # _case_step(5, ...) mixes three decodes and two prefills


def test_the_step_hands_sdpa_float_masks(monkeypatch):
    # What each group of the step gives SDPA: head-major queries ([Bd, Hq, 1, D] for the decodes) and
    # additive masks, so that SDPA converts nothing itself.
    case, store, batch, (q, k, v) = _case_step(SEED_WITH_BOTH, 4, torch.float32)
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, **kw):
        seen.append((query.shape, None if attn_mask is None else attn_mask.dtype))
        return real(query, key, value, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    backend = PagedTorchBackend(store, batch)
    out = backend(0, q, k, v)
    assert backend.decode_seqs and backend.prefill_seqs, "the case should mix decodes and prefills"
    assert out.shape == q.shape and len(seen) == 2  # one call for the decodes, one for the prefills
    assert seen[0][0] == (len(backend.decode_seqs), 6, 1, 16)  # decodes first: [Bd, Hq, 1, D]
    assert all(mask_dtype in (None, torch.float32) for _, mask_dtype in seen)


# ---- the registry and the stores ---------------------------------------------------------------------
def test_every_backend_is_named_and_knows_its_store():
    assert backend_names() == [
        "paged-int8-torch",
        "paged-reference",
        "paged-torch",
        "triton",
        "triton-int8",
        "triton-ragged",
    ]
    for name in backend_names():
        cls = backend_class(name)
        assert cls.name == name
        assert cls.store_type is (Int8PagedKVStore if "int8" in name else PagedKVStore)
    with pytest.raises(ValueError, match=r"backend must be one of .* got 'paged'"):
        backend_class("paged")
    with pytest.raises(ValueError, match="already registered"):
        register("paged-torch")(type("Other", (PagedTorchBackend,), {}))


def test_a_backend_refuses_another_kind_of_store():
    _, store, batch, _ = _case_step(0, 4, torch.float32)
    int8 = Int8PagedKVStore(1, store.num_blocks, 4, 2, 16)
    with pytest.raises(TypeError, match="backend 'paged-torch' needs a PagedKVStore, got Int8PagedKVStore"):
        backend_class("paged-torch")(int8, batch)
    with pytest.raises(TypeError, match="backend 'paged-int8-torch' needs a Int8PagedKVStore, got PagedKVStore"):
        backend_class("paged-int8-torch")(store, batch)


def test_the_runner_builds_the_store_its_backend_needs(tiny_model, device):
    tiny_model = on_device(tiny_model, device)
    runner = ModelRunner(tiny_model, num_blocks=8, block_size=4, backend="paged-int8-torch")
    assert type(runner.kv_store) is Int8PagedKVStore and runner.kv_store.k_cache[0].device.type == device.type
    logits = runner.step([(0, [5, 6, 7, 8, 9])])
    float_logits = ModelRunner(tiny_model, num_blocks=8, block_size=4).step([(0, [5, 6, 7, 8, 9])])
    assert logits.shape == float_logits.shape and logits.isfinite().all()
    # int8 codes were written where the prompt's K/V live (the float run would hold floats there).
    slots = slot_mapping(runner.block_manager.block_table(0), range(5), 4)
    assert runner.kv_store.k_cache[0].view(-1, 2, 8)[slots].abs().amax() == 127
    with pytest.raises(ValueError, match="num_cpu_blocks needs a float pool"):
        ModelRunner(tiny_model, num_blocks=8, block_size=4, backend="paged-int8-torch", num_cpu_blocks=4)
    with pytest.raises(ValueError, match="backend must be one of"):
        ModelRunner(tiny_model, num_blocks=8, block_size=4, backend="cuda")


@pytest.fixture(scope="module")
def tiny_model():
    return tiny_llama(99, vocab_size=50, max_position_embeddings=600)


# ---- one step object: the batch built with tensor ops equals the formula, token by token -------------
@pytest.mark.parametrize("seed", range(20))
def test_build_equals_the_slot_formula_token_by_token(seed):
    rnd = random.Random(seed)
    bs = rnd.choice([1, 2, 4, 16])
    pool = list(range(1000))
    rnd.shuffle(pool)
    seqs = []
    for _ in range(rnd.randint(1, 7)):
        start, n = rnd.randint(0, 40), rnd.randint(1, 20)
        table = [pool.pop() for _ in range(-(-(start + n) // bs) + rnd.randint(0, 2))]
        seqs.append(SeqSlice([rnd.randrange(50) for _ in range(n)], start, table))
    batch = ForwardBatch.build(seqs, bs)
    want_pos = [p for s in seqs for p in range(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids))]
    want_slots = [
        x
        for s in seqs
        for x in slot_mapping(s.block_table, range(s.num_computed_tokens, s.num_computed_tokens + len(s.token_ids)), bs)
    ]
    assert batch.positions.tolist() == want_pos
    assert batch.slot_mapping.tolist() == want_slots
    # What build checked per sequence, check() confirms field by field.
    copy = ForwardBatch(batch.input_ids, batch.positions, batch.slot_mapping, batch.query_start_loc, batch.seq_lens,
                        batch.block_tables, bs)  # fmt: skip
    assert not copy.checked and copy.check().checked and copy.seq_lens_host == batch.seq_lens_host


def test_forward_batch_checks_a_hand_made_batch(tiny_model):
    runner = ModelRunner(tiny_model, num_blocks=8, block_size=4)
    bad = ForwardBatch(input_ids=torch.tensor([1, 2]), positions=torch.tensor([0, 2]), slot_mapping=torch.tensor([0, 2]),
                       query_start_loc=torch.tensor([0, 2], dtype=torch.int32),
                       seq_lens=torch.tensor([3], dtype=torch.int32),
                       block_tables=torch.tensor([[0]], dtype=torch.int32), block_size=4)  # fmt: skip
    with pytest.raises(ValueError, match="positions of sequence 0 must be consecutive"):
        tiny_model.forward_batch(bad, runner.kv_store)


def test_forward_batch_takes_a_backend_by_name_or_by_class(tiny_model):
    # The runner passes the class it looked up once; a chapter passes the name. Same step, same logits.
    runs = []
    for backend in ("paged-torch", PagedTorchBackend):
        runner = ModelRunner(tiny_model, num_blocks=8, block_size=4)
        runs.append(
            tiny_model.forward_batch(ForwardBatch.build([SeqSlice([1, 2, 3], 0, [0])], 4), runner.kv_store, backend)
        )
    assert torch.equal(*runs)
    with pytest.raises(ValueError, match="backend must be one of"):
        tiny_model.forward_batch(ForwardBatch.build([SeqSlice([1], 0, [0])], 4), runner.kv_store, "cuda")


# ---- RoPE tables, computed once ------------------------------------------------------------------
def test_cached_rope_rows_equal_the_formula_bit_for_bit(tiny_model):
    tiny_model._rope_tables.clear()
    positions = torch.tensor([0, 5, 17, 299])
    cos, sin = tiny_model.rope_tables(positions)
    assert cos.shape[0] >= 300
    want_cos, want_sin = rope_cos_sin(positions, 8, 10000.0)
    assert torch.equal(cos[positions], want_cos) and torch.equal(sin[positions], want_sin)
    same, _ = tiny_model.rope_tables(torch.tensor([3]))
    assert same is cos  # kept, not recomputed
    longer, _ = tiny_model.rope_tables(torch.tensor([599]))
    assert longer.shape[0] == 600  # grown, never past the context


# ---- imports go one way: serving -> runner -> model -> backends -> kernels / stores -----------------
def _imports(path: Path) -> set[str]:
    """Absolute kvcourse modules ``path`` imports (relative imports resolved)."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            # "from .. import results" imports kvcourse.results, not kvcourse itself
            found.update([name] if node.module else [f"{name}.{a.name}" for a in node.names])
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {n for n in found if n == "kvcourse" or n.startswith("kvcourse.")}


@pytest.mark.parametrize("layer, forbidden", [
    ("kernels", ("kvcourse.backends", "kvcourse.model", "kvcourse.serving", "kvcourse.batch", "kvcourse.paged",
                 "kvcourse.attention", "kvcourse.cache", "kvcourse.compression")),
    ("paged", ("kvcourse.backends", "kvcourse.model", "kvcourse.serving")),
    ("compression", ("kvcourse.backends", "kvcourse.serving")),
    ("backends", ("kvcourse.model", "kvcourse.serving")),
])  # fmt: skip
def test_imports_go_one_way(layer, forbidden):
    bad = {}
    for path in sorted((PACKAGE / layer).glob("*.py")):
        wrong = sorted(m for m in _imports(path) if m.startswith(forbidden) or m == "kvcourse")
        if wrong:
            bad[path.name] = wrong
    assert not bad, f"kvcourse.{layer} imports upward: {bad}"
    assert not (PACKAGE / "attention.py").exists()
