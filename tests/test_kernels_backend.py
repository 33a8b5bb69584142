"""The ``"triton"`` backend on the real model, the torch fallback, and Triton as an optional import."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

from kvcourse.backends.paged import PagedTorchBackend
from kvcourse.backends.triton import TritonBackend
from kvcourse.batch import ForwardBatch, SeqSlice
from kvcourse.kernels import triton_cache, triton_decode, triton_paged
from kvcourse.kernels.reference import decode_attention_ref
from kvcourse.kernels.testing import paged_from_contiguous, random_paged_case, tolerance
from kvcourse.probe import model_decode_case
from kvcourse.kernels.triton_runtime import (
    KernelFallbackWarning,
    OutOfResources,
    fallbacks,
    interpreting,
    kernel_device,
    kernel_runs,
    reset_fallbacks,
    reset_kernel_runs,
)
from kvcourse.paged import PagedKVStore
from kvcourse.serving import ModelRunner

# Where the kernels take their tensors in this process: the CPU in Triton's interpreter, else the GPU
# (``python -m kvcourse.gpu_check`` runs these tests there, compiled).
DEVICE = kernel_device()
HOW = "interpreter" if interpreting() else "compiled"


@pytest.fixture
def no_fallback():
    reset_fallbacks()
    yield
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"


@pytest.fixture
def clean_fallbacks():
    reset_fallbacks()
    reset_kernel_runs()
    yield
    reset_fallbacks()
    reset_kernel_runs()


# ---------------------------------------------------------------------------------------------
# The real model through the kernels
# ---------------------------------------------------------------------------------------------
def _greedy(model, first, second, backend, steps=3):
    """Greedy decoding: ``first`` alone at step 0; ``second`` joins at step 1 (its prefill beside a decode)."""
    runner = ModelRunner(model, num_blocks=8, block_size=16, backend=backend)
    work = [(0, first)]
    tokens: dict[int, list[int]] = {0: []}
    all_logits = []
    for step in range(steps):
        logits = runner.step(work)
        all_logits.append(logits)
        for (seq, _), t in zip(work, logits.argmax(-1).tolist()):
            tokens[seq].append(t)
        work = [(seq, [toks[-1]]) for seq, toks in tokens.items()]
        if step == 0:
            tokens[1] = []
            work.append((1, second))
    return tokens, all_logits


def test_real_model_generates_the_same_tokens_through_triton(kernel_model, tok, no_fallback):
    first, second = tok.encode("The capital of France is"), tok.encode("def fibonacci(n):")
    want, want_logits = _greedy(kernel_model, first, second, "paged-torch")
    got, got_logits = _greedy(kernel_model, first, second, "triton")
    assert got == want and len(got[0]) == 3 and len(got[1]) == 2
    for g, w in zip(got_logits, want_logits):
        torch.testing.assert_close(g, w, rtol=1e-3, atol=1e-3)


def test_kernels_reproduce_the_models_attention_on_real_keys_and_values(kernel_model, tok, no_fallback):
    model = kernel_model
    ids = tok.encode("A block table maps each sequence's logical blocks to physical blocks of one shared pool.")
    case = model_decode_case(model, [ids, ids[:9], ids[:2]], layer=7)
    assert case.q.shape == (3, 9, 64) and case.k.shape == (3, 3, len(ids), 64) and torch.isnan(case.k[2, :, 2:]).all()
    # The model's own attention (chapter 2's causal path) is the answer; the references agree with it...
    torch.testing.assert_close(
        decode_attention_ref(case.q, case.k, case.v, case.seq_lens), case.out, rtol=1e-5, atol=1e-5
    )
    # ...and so do the kernels, contiguous and paged (NaN in every unused slot of both).
    torch.testing.assert_close(
        triton_decode.decode_attention(case.q, case.k, case.v, case.seq_lens), case.out, rtol=1e-5, atol=1e-5
    )
    paged = paged_from_contiguous(case.q, case.k, case.v, case.seq_lens.tolist(), block_size=4, seed=3)
    got = triton_paged.paged_decode_attention(
        paged.q, paged.k_cache, paged.v_cache, paged.block_tables, paged.seq_lens, num_splits=3
    )
    torch.testing.assert_close(got, case.out, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="layer must lie in"):
        model_decode_case(model, [ids], layer=30)
    with pytest.raises(ValueError, match="2 tokens or more"):
        model_decode_case(model, [ids[:1]], layer=0)
    with pytest.raises(ValueError, match="one seq_len in"):
        paged_from_contiguous(case.q, case.k, case.v, [0, 9, 2], block_size=4, seed=0)


def _synthetic_step(seed: int, dtype=torch.float32):
    """A ragged step on a one-layer pool: two decodes and a 5-token chunk continuing a prefill."""
    g = torch.Generator().manual_seed(seed)
    store = PagedKVStore(1, 16, 4, 2, 64, dtype=dtype, device=DEVICE)
    store.k_cache[0].copy_(torch.randn(store.k_cache[0].shape, generator=g))  # drawn on the CPU, copied across
    store.v_cache[0].copy_(torch.randn(store.v_cache[0].shape, generator=g))
    seqs = [SeqSlice([1], 9, [3, 7, 1]), SeqSlice([2, 3, 4, 5, 6], 6, [0, 5, 9]), SeqSlice([7], 12, [2, 4, 6, 8])]
    batch = ForwardBatch.build(seqs, block_size=4, device=DEVICE)
    n = batch.num_tokens
    q = torch.randn(n, 6, 64, generator=g).to(DEVICE, dtype)  # packed: [N, H, D]
    k, v = (torch.randn(n, 2, 64, generator=g).to(DEVICE, dtype) for _ in range(2))
    return store, batch, (q, k, v)


def _copy(store: PagedKVStore) -> PagedKVStore:
    twin = PagedKVStore(
        1, store.num_blocks, store.block_size, store.num_kv_heads, store.head_dim, store.dtype, store.device
    )
    twin.k_cache[0].copy_(store.k_cache[0])
    twin.v_cache[0].copy_(store.v_cache[0])
    return twin


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_triton_backend_equals_torch_backend_on_a_mixed_step(dtype, no_fallback):
    store, batch, (q, k, v) = _synthetic_step(1, dtype)
    twin = _copy(store)
    backend = TritonBackend(store, batch)
    got = backend(0, q, k, v)
    want = PagedTorchBackend(twin, batch)(0, q, k, v)
    torch.testing.assert_close(got, want, **tolerance(dtype))
    # The step says how its kernels ran (in the interpreter on a CPU): one write and one decode, no fallback.
    assert dict(backend.runs) == {("reshape_and_cache", HOW): 1, ("paged_decode_attention", HOW): 1}
    assert backend.fell_back == []
    assert torch.equal(store.k_cache[0], twin.k_cache[0]) and torch.equal(store.v_cache[0], twin.v_cache[0])


# ---------------------------------------------------------------------------------------------
# Falling back to torch when a kernel cannot compile
# ---------------------------------------------------------------------------------------------
class _Uncompilable:
    """Stands in for a kernel whose compilation fails, as a T4 without enough shared memory would."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise self.exc

        return launch


def _compiler_error() -> RuntimeError:
    """A plain RuntimeError raised from a frame inside triton/compiler/, as backend passes raise them."""
    path = os.path.join(os.sep, "site-packages", "triton", "compiler", "compiler.py")
    scope: dict = {}
    exec(compile("def run():\n    raise RuntimeError('PassManager::run failed')\n", path, "exec"), scope)
    try:
        scope["run"]()
    except RuntimeError as exc:
        return exc
    raise AssertionError("unreachable")


def _paged_call():
    c = random_paged_case(2, [5, 40], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device=DEVICE)
    return c, lambda: triton_paged.paged_decode_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.seq_lens)


@pytest.mark.parametrize(
    "exc", [OutOfResources(98304, 65536, "shared memory"), _compiler_error()], ids=["out-of-resources", "compiler"]
)
def test_paged_kernel_falls_back_once_with_a_one_line_warning(monkeypatch, clean_fallbacks, exc):
    monkeypatch.setattr(triton_paged, "_paged_decode_kernel", _Uncompilable(exc))
    case, call = _paged_call()
    with pytest.warns(KernelFallbackWarning) as record:
        out = call()
    assert len(record) == 1
    message = str(record[0].message)
    where = "cpu" if DEVICE.type == "cpu" else torch.cuda.get_device_name(DEVICE)
    assert "\n" not in message and f"paged_decode_attention could not compile on {where}" in message
    assert type(exc).__name__ in message and "using the torch reference" in message
    torch.testing.assert_close(out, case.expected(), **tolerance(torch.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second call falls back silently: no new warning
        torch.testing.assert_close(call(), out, rtol=0, atol=0)
    (reason,) = fallbacks().values()  # one kernel fell back, for the reason the warning gives
    assert f"({reason}); using" in message


def test_other_errors_are_not_hidden_by_the_fallback(monkeypatch, clean_fallbacks):
    monkeypatch.setattr(triton_paged, "_paged_decode_kernel", _Uncompilable(IndexError("a bug in the kernel")))
    _, call = _paged_call()
    with pytest.raises(IndexError, match="a bug in the kernel"):
        call()
    assert fallbacks() == {}


def test_every_kernel_falls_back(monkeypatch, clean_fallbacks):
    oom = _Uncompilable(OutOfResources(98304, 65536, "shared memory"))
    for module, name in (
        (triton_decode, "_decode_kernel"),
        (triton_cache, "_reshape_and_cache_kernel"),
        (triton_paged, "_paged_decode_kernel"),
    ):
        monkeypatch.setattr(module, name, oom)
    c = random_paged_case(4, [9, 30], num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=8, device=DEVICE)
    with pytest.warns(KernelFallbackWarning):
        torch.testing.assert_close(triton_decode.decode_attention(c.q, c.k, c.v, c.seq_lens), c.expected())
    k_cache, v_cache = c.k_cache.clone(), c.v_cache.clone()
    new = torch.ones(2, 2, 64, device=DEVICE)
    with pytest.warns(KernelFallbackWarning):
        triton_cache.reshape_and_cache(new, new, k_cache, v_cache, torch.tensor([3, -1], device=DEVICE))
    assert torch.equal(k_cache.view(-1, 2, 64)[3], new[0])
    store, batch, (q, k, v) = _synthetic_step(5)
    twin = _copy(store)
    backend = TritonBackend(store, batch)
    with pytest.warns(KernelFallbackWarning):
        got = backend(0, q, k, v)
    torch.testing.assert_close(got, PagedTorchBackend(twin, batch)(0, q, k, v), rtol=0, atol=0)
    assert {key[0] for key in fallbacks()} == {"decode_attention", "reshape_and_cache", "paged_decode_attention"}
    # Nothing hides it: the step names both kernels, and the process-wide count has only fallbacks.
    assert backend.fell_back == ["paged_decode_attention", "reshape_and_cache"]
    runs = kernel_runs()
    assert set(runs) == {"decode_attention", "reshape_and_cache", "paged_decode_attention"}
    assert all(set(hows) == {"fallback"} for hows in runs.values()), runs


# ---------------------------------------------------------------------------------------------
# Triton is optional, and the interpreter is chosen before Triton is imported
# ---------------------------------------------------------------------------------------------
def _python(code: str, env_changes: dict[str, str | None]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in env_changes}
    env.update({k: v for k, v in env_changes.items() if v is not None})
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_import_kvcourse_needs_no_triton_and_chooses_the_interpreter():
    code = """
import os, sys
sys.modules["triton"] = None  # as if triton were not installed
import kvcourse, kvcourse.kernels
assert "triton" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
print(os.environ.get("TRITON_INTERPRET"))
try:
    kvcourse.kernels.paged_decode_attention
except ImportError as e:
    print("ImportError:", e)
"""
    out = _python(code, {"TRITON_INTERPRET": None})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == ("1" if not torch.cuda.is_available() else "None")
    assert "pip install 'kvcourse[triton]'" in lines[1]


def test_triton_imported_before_kvcourse_gets_a_clear_error():
    code = "import triton, kvcourse\nfrom kvcourse.kernels import decode_attention\n"
    out = _python(code, {"TRITON_INTERPRET": None})
    if torch.cuda.is_available():  # pragma: no cover - a GPU machine compiles: nothing to mismatch
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode != 0 and "Triton was imported before TRITON_INTERPRET was settled" in out.stderr


def test_unknown_backend_lists_triton():
    store, batch, _ = _synthetic_step(0)
    from kvcourse.backends import backend_class

    with pytest.raises(
        ValueError,
        match=r"backend must be one of \['paged-int8-torch', 'paged-reference', 'paged-torch', 'triton', 'triton-int8', 'triton-ragged'\], got 'tirton'",
    ):
        backend_class("tirton")
