"""A layer's small ops as Triton kernels (kernels/triton_fused.py) against their torch versions (kernels/fused.py).

Cases are drawn on the CPU from seeds made of the test's parameters, then moved to where the kernels take
their tensors (:func:`kernel_device`): the CPU in Triton's interpreter, the GPU under ``make gpu-check``,
which compiles them. Every output is compared with the torch version run on the same device, within the
dtype's tolerance; in fp16/bf16 almost every element must also be bit-identical (rounding as torch rounds).
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvcourse.kernels import fused
from kvcourse.kernels import triton_fused as tf
from kvcourse.kernels.testing import tolerance
from kvcourse.kernels.triton_runtime import (
    KernelFallbackWarning,
    counting_runs,
    fallbacks,
    kernel_device,
    reset_fallbacks,
)
from triton.runtime.errors import OutOfResources

ROOT = Path(__file__).resolve().parents[1]
DEVICE = kernel_device()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
EPS = 1e-5
OPS = ("rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")  # the kernels, as kernel_runs names them
# SmolLM2-135M: hidden 576, intermediate 1536, 9 query + 3 KV heads of 64 (Q and K rotated together: 12).
HIDDEN, INTERMEDIATE, HEADS, HEAD_DIM = 576, 1536, 12, 64
# In fp16/bf16 a kernel that rounds where torch rounds differs from it only where fp32 values a few ulp
# apart (another rsqrt, exp or summation order) straddle a 16-bit rounding boundary: a handful of elements.
# Skipping one rounding step (the normalised value before the weight, say) changes a third of them, yet
# stays inside the dtype's tolerance, which alone could not tell.
MIN_BIT_EQUAL = 0.99


@pytest.fixture(autouse=True)
def no_fallback():
    reset_fallbacks()
    yield
    assert fallbacks() == {}, f"a kernel fell back to torch: {fallbacks()}"


def _seed(*params) -> int:
    """A seed from the test's parameters: the same case on any machine, in any test order."""
    return zlib.crc32(repr(params).encode())


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _weight(g: torch.Generator, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    return (1.0 + 0.3 * torch.randn(hidden, generator=g)).to(DEVICE, dtype)  # a trained norm's weights: near 1


def _tables(n: int, head_dim: int, dtype: torch.dtype, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, signed_sin [n, 1, D]`` for positions ``0..n-1`` (+100, so that the angles are not all small)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = (torch.arange(n, dtype=torch.float32) + 100)[:, None] * inv_freq
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    cos, sin = fused.rope_tables_signed(angles.cos(), angles.sin())
    return cos.to(DEVICE, dtype), sin.to(DEVICE, dtype)


def _outputs(result) -> tuple[torch.Tensor, ...]:
    """An op's result as a tuple (fused_add_rms_norm returns two tensors, the others one)."""
    return result if isinstance(result, tuple) else (result,)


def assert_matches(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` is ``want`` within its dtype's tolerance, in its dtype and shape; in 16 bits, nearly bit for bit."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    assert got.device == want.device
    torch.testing.assert_close(got, want, **tolerance(want.dtype))
    if want.dtype != torch.float32 and want.numel():
        equal = (got == want).float().mean().item()
        assert equal >= MIN_BIT_EQUAL, f"only {equal:.1%} of the elements are bit-identical to the torch version"


# ---------------------------------------------------------------------------------------------
# Each kernel against its torch version
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n, hidden", [(1, HIDDEN), (37, HIDDEN), (8, 256)], ids=["decode", "prefill", "pow2"])
def test_rms_norm(dtype, n, hidden):
    g = torch.Generator().manual_seed(_seed("rms_norm", dtype, n, hidden))
    x, weight = _randn(g, n, hidden, dtype=dtype, scale=3.0), _weight(g, hidden, dtype)
    assert_matches(tf.rms_norm(x, weight, EPS), fused.rms_norm_torch(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [1, 29])
def test_fused_add_rms_norm(dtype, n):
    g = torch.Generator().manual_seed(_seed("fused_add_rms_norm", dtype, n))
    x, residual = _randn(g, n, HIDDEN, dtype=dtype), _randn(g, n, HIDDEN, dtype=dtype, scale=4.0)
    weight = _weight(g, HIDDEN, dtype)
    out, h = tf.fused_add_rms_norm(x, residual, weight, EPS)
    want_out, want_h = fused.add_rms_norm_torch(x, residual, weight, EPS)
    assert torch.equal(h, want_h)  # one rounding of one sum: the same bits on any device
    assert_matches(out, want_out)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1,), (2, 7)], ids=["decode", "batch"])
def test_embed_rms_norm(dtype, shape):
    """The embedding lookup and the first norm in one kernel (issue 49): the rows bit for bit, the norm as rms_norm."""
    g = torch.Generator().manual_seed(_seed("embed_rms_norm", dtype, shape))
    table, weight = _randn(g, 50, HIDDEN, dtype=dtype), _weight(g, HIDDEN, dtype)
    ids = torch.randint(0, 50, shape, generator=g).to(DEVICE)
    ids.view(-1)[-1] = ids.view(-1)[0]  # a token twice
    out, rows = tf.embed_rms_norm(ids, table, weight, EPS)
    want_out, want_rows = fused.embed_rms_norm_torch(ids, table, weight, EPS)
    assert torch.equal(rows, want_rows) and rows.shape == (*shape, HIDDEN)
    assert_matches(out, want_out)
    assert torch.equal(out, tf.rms_norm(rows, weight, EPS))  # what the first layer's norm computed before


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "n, heads, head_dim", [(1, HEADS, HEAD_DIM), (19, HEADS, HEAD_DIM), (5, 2, 128)], ids=["decode", "prefill", "D128"]
)
def test_rotary_embedding(dtype, n, heads, head_dim):
    g = torch.Generator().manual_seed(_seed("rotary_embedding", dtype, n, heads, head_dim))
    x = _randn(g, n, heads, head_dim, dtype=dtype)
    cos, sin = _tables(n, head_dim, dtype)
    assert_matches(tf.rotary_embedding(x, cos, sin), fused.rope_torch(x, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "n, intermediate", [(1, INTERMEDIATE), (23, INTERMEDIATE), (3, 100)], ids=["decode", "prefill", "small"]
)
def test_silu_and_mul(dtype, n, intermediate):
    g = torch.Generator().manual_seed(_seed("silu_and_mul", dtype, n, intermediate))
    gate_up = _randn(g, n, 2 * intermediate, dtype=dtype, scale=3.0)
    assert_matches(tf.silu_and_mul(gate_up), fused.silu_and_mul_torch(gate_up))


# ---------------------------------------------------------------------------------------------
# Layouts: slices of packed projections, batch dimensions, broadcast tables, no tokens
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_strided_slices_of_packed_outputs(dtype):
    """What the model hands over: views into a wider buffer, read in place (row strides are not the width)."""
    g = torch.Generator().manual_seed(_seed("strided", dtype))
    n = 6
    # Q and K of the packed QKV projection, rotated together: [N, 12, 64] out of [N, 15, 64] (V left out).
    qkv = _randn(g, n, (HEADS + 3) * HEAD_DIM, dtype=dtype).view(n, HEADS + 3, HEAD_DIM)
    qk = qkv[:, :HEADS]
    cos, sin = _tables(n, HEAD_DIM, dtype)
    assert qk.stride() == ((HEADS + 3) * HEAD_DIM, HEAD_DIM, 1)
    assert_matches(tf.rotary_embedding(qk, cos, sin), fused.rope_torch(qk, cos, sin))
    # Heads strided too: every other head; and one table row for every token (expanded with stride 0, not copied).
    assert_matches(tf.rotary_embedding(qkv[:, ::2], cos, sin), fused.rope_torch(qkv[:, ::2], cos, sin))
    assert_matches(tf.rotary_embedding(qk, cos[:1], sin[:1]), fused.rope_torch(qk, cos[:1], sin[:1]))
    # [gate | up] as columns of a wider buffer.
    wide = _randn(g, n, 2 * INTERMEDIATE + 64, dtype=dtype, scale=3.0)
    gate_up = wide[:, 32 : 32 + 2 * INTERMEDIATE]
    assert_matches(tf.silu_and_mul(gate_up), fused.silu_and_mul_torch(gate_up))
    # Norms over row slices, x and residual with different row strides (x's rows start unaligned, too).
    x, residual = _randn(g, n, 1000, dtype=dtype)[:, 3 : 3 + HIDDEN], _randn(g, 2 * n, HIDDEN, dtype=dtype)[::2]
    weight = _weight(g, HIDDEN, dtype)
    assert_matches(tf.rms_norm(x, weight, EPS), fused.rms_norm_torch(x, weight, EPS))
    out, h = tf.fused_add_rms_norm(x, residual, weight, EPS)
    want_out, want_h = fused.add_rms_norm_torch(x, residual, weight, EPS)
    assert torch.equal(h, want_h)
    assert_matches(out, want_out)


def test_batch_dimensions_broadcast_tables_and_transposed_inputs():
    """Other layouts go through reshape/contiguous (the wrappers' docs say so) and give torch's result."""
    g = torch.Generator().manual_seed(_seed("layouts"))
    dtype = torch.float16
    x, weight = _randn(g, 2, 5, HIDDEN, dtype=dtype), _weight(g, HIDDEN, dtype)  # [B, T, hidden]
    assert_matches(tf.rms_norm(x, weight, EPS), fused.rms_norm_torch(x, weight, EPS))
    transposed = _randn(g, HIDDEN, 3, dtype=dtype).t()  # last dimension not contiguous: copied
    assert_matches(tf.rms_norm(transposed, weight, EPS), fused.rms_norm_torch(transposed, weight, EPS))
    gate_up = _randn(g, 2, 3, 200, dtype=dtype)
    assert_matches(tf.silu_and_mul(gate_up), fused.silu_and_mul_torch(gate_up))
    q = _randn(g, 2, 4, 3, 32, dtype=dtype)  # [B, N, H, D] with tables [N, 1, D], and one table for all
    cos, sin = _tables(4, 32, dtype)
    assert_matches(tf.rotary_embedding(q, cos, sin), fused.rope_torch(q, cos, sin))
    assert_matches(tf.rotary_embedding(q, cos[:1], sin[:1]), fused.rope_torch(q, cos[:1], sin[:1]))
    # The plain forward's other layout: x [B, H, T, D] with tables [T, D] (they vary along x's "head" axis).
    q = q.transpose(1, 2)
    assert_matches(tf.rotary_embedding(q, cos[:, 0], sin[:, 0]), fused.rope_torch(q, cos[:, 0], sin[:, 0]))


def test_mixed_dtypes_promote_as_torch_does():
    """A bf16 x with fp32 weights (or tables) gives fp32, rounded where torch rounds."""
    g = torch.Generator().manual_seed(_seed("mixed"))
    x, weight = _randn(g, 3, HIDDEN, dtype=torch.bfloat16), _weight(g, HIDDEN, torch.float32)
    got = tf.rms_norm(x, weight, EPS)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, fused.rms_norm_torch(x, weight, EPS), **tolerance(torch.float32))
    residual = _randn(g, 3, HIDDEN, dtype=torch.float16)
    wants = fused.add_rms_norm_torch(x, residual, weight, EPS)
    for got, want in zip(tf.fused_add_rms_norm(x, residual, weight, EPS), wants, strict=True):
        assert got.dtype == want.dtype == torch.float32
        torch.testing.assert_close(got, want, **tolerance(torch.float32))
    q = _randn(g, 3, 2, 16, dtype=torch.float16)
    cos, sin = _tables(3, 16, torch.float32)
    got = tf.rotary_embedding(q, cos, sin)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, fused.rope_torch(q, cos, sin), **tolerance(torch.float32))


def test_no_tokens():
    empty = torch.empty(0, HIDDEN, device=DEVICE)
    weight = torch.ones(HIDDEN, device=DEVICE)
    assert tf.rms_norm(empty, weight, EPS).shape == (0, HIDDEN)
    out, h = tf.fused_add_rms_norm(empty, empty, weight, EPS)
    assert out.shape == h.shape == (0, HIDDEN)
    cos, sin = _tables(0, HEAD_DIM, torch.float32)
    assert tf.rotary_embedding(torch.empty(0, HEADS, HEAD_DIM, device=DEVICE), cos, sin).shape == (0, HEADS, HEAD_DIM)
    assert tf.silu_and_mul(torch.empty(0, 2 * INTERMEDIATE, device=DEVICE)).shape == (0, INTERMEDIATE)


def test_bad_input_names_the_argument():
    x, weight = torch.ones(2, 8, device=DEVICE), torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="weight must have shape"):
        tf.rms_norm(x, weight[:4], EPS)
    with pytest.raises(TypeError, match="x must be float32, float16 or bfloat16"):
        tf.rms_norm(x.double(), weight, EPS)
    with pytest.raises(ValueError, match="eps must be"):
        tf.rms_norm(x, weight, -1.0)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        tf.fused_add_rms_norm(x, x[:1], weight, EPS)
    with pytest.raises(ValueError, match="gate_up must be"):
        tf.silu_and_mul(torch.ones(2, 7, device=DEVICE))
    q = torch.ones(2, 3, 8, device=DEVICE)
    cos, sin = _tables(2, 8, torch.float32)
    with pytest.raises(TypeError, match="cos has dtype torch.float16 but signed_sin has torch.float32"):
        tf.rotary_embedding(q, cos.half(), sin)
    with pytest.raises(ValueError, match=r"cos must broadcast to x's shape \[2, 3, 8\]"):
        tf.rotary_embedding(q, cos[:, :, :4], sin)
    with pytest.raises(ValueError, match="x must be"):
        tf.rotary_embedding(q[0, 0], cos, sin)
    with pytest.raises(ValueError, match="with an even D"):
        tf.rotary_embedding(q[..., :7], cos[..., :7], sin[..., :7])


# ---------------------------------------------------------------------------------------------
# A kernel that cannot compile falls back to the torch version, counted and warned about
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("op", OPS)
def test_a_kernel_that_cannot_compile_falls_back_to_torch(monkeypatch, op):
    def cannot_compile(*args):
        raise OutOfResources(1 << 20, 1 << 16, "shared memory")

    monkeypatch.setattr(tf, f"_launch_{op}", cannot_compile)
    g = torch.Generator().manual_seed(_seed("fallback", op))
    x, weight = _randn(g, 3, 64, dtype=torch.float16), _weight(g, 64, torch.float16)
    q, (cos, sin) = _randn(g, 3, 2, 16, dtype=torch.float16), _tables(3, 16, torch.float16)
    calls = {
        "rms_norm": (lambda: tf.rms_norm(x, weight, EPS), lambda: fused.rms_norm_torch(x, weight, EPS)),
        "fused_add_rms_norm": (
            lambda: tf.fused_add_rms_norm(x, x, weight, EPS),
            lambda: fused.add_rms_norm_torch(x, x, weight, EPS),
        ),
        "rotary_embedding": (lambda: tf.rotary_embedding(q, cos, sin), lambda: fused.rope_torch(q, cos, sin)),
        "silu_and_mul": (lambda: tf.silu_and_mul(x), lambda: fused.silu_and_mul_torch(x)),
    }
    kernel, torch_version = calls[op]
    with counting_runs(Counter()) as runs, pytest.warns(KernelFallbackWarning, match=f"{op} could not compile"):
        got = kernel()
    assert runs == Counter({(op, "fallback"): 1})
    for a, b in zip(_outputs(got), _outputs(torch_version()), strict=True):
        assert torch.equal(a, b)
    assert list(fallbacks()) and all(key[0] == op for key in fallbacks())
    reset_fallbacks()  # expected here: the autouse fixture checks that nothing else fell back


# ---------------------------------------------------------------------------------------------
# fused.py's dispatch: the kernels on CUDA, the torch versions everywhere else
# ---------------------------------------------------------------------------------------------
def _layer_ops(g: torch.Generator, device: torch.device, dtype: torch.dtype) -> list:
    """The four ops of fused.py on one small problem, ``(name, call of fused.x, call of its torch version)``."""
    x = torch.randn(4, 64, generator=g).to(device, dtype)
    residual = torch.randn(4, 64, generator=g).to(device, dtype)
    weight = (1 + 0.3 * torch.randn(64, generator=g)).to(device, dtype)
    q = torch.randn(4, 3, 16, generator=g).to(device, dtype)
    cos, sin = (t.to(device) for t in _tables(4, 16, dtype))
    return [
        ("rms_norm", lambda: fused.rms_norm(x, weight, EPS), lambda: fused.rms_norm_torch(x, weight, EPS)),
        (
            "fused_add_rms_norm",
            lambda: fused.add_rms_norm(x, residual, weight, EPS),
            lambda: fused.add_rms_norm_torch(x, residual, weight, EPS),
        ),
        ("rotary_embedding", lambda: fused.rope(q, cos, sin), lambda: fused.rope_torch(q, cos, sin)),
        ("silu_and_mul", lambda: fused.silu_and_mul(x), lambda: fused.silu_and_mul_torch(x)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_runs_torch_on_the_cpu_and_the_kernels_on_cuda(monkeypatch, dtype):
    g = torch.Generator().manual_seed(_seed("dispatch", dtype))
    # On the CPU: the torch versions, bit for bit, and no kernel runs (even in Triton's interpreter).
    for name in OPS:
        monkeypatch.setattr(tf, name, lambda *a, name=name: pytest.fail(f"fused called the {name} kernel on the CPU"))
    with counting_runs(Counter()) as runs:
        for _, call, torch_version in _layer_ops(g, torch.device("cpu"), dtype):
            for got, want in zip(_outputs(call()), _outputs(torch_version()), strict=True):
                assert torch.equal(got, want)
    assert runs == Counter()
    monkeypatch.undo()
    if DEVICE.type != "cuda":
        return
    # On a GPU (make gpu-check): one compiled launch per op, equal to the torch version there; none when switched off.
    with counting_runs(Counter()) as runs:
        for name, call, torch_version in _layer_ops(g, DEVICE, dtype):
            for got, want in zip(_outputs(call()), _outputs(torch_version()), strict=True):
                assert_matches(got, want)
    assert runs == Counter({(name, "compiled"): 1 for name in OPS})
    monkeypatch.setattr(fused, "USE_TRITON", False)
    with counting_runs(Counter()) as runs:
        for _, call, torch_version in _layer_ops(g, DEVICE, dtype):
            for got, want in zip(_outputs(call()), _outputs(torch_version()), strict=True):
                assert torch.equal(got, want)
    assert runs == Counter()


def test_the_torch_versions_are_the_textbook_formulas():
    """fused.py's functions on the CPU: the layer written op by op (Hugging Face's Llama), in one call each."""
    g = torch.Generator().manual_seed(_seed("textbook"))
    for dtype in DTYPES:
        x, residual = torch.randn(5, 64, generator=g).to(dtype), torch.randn(5, 64, generator=g).to(dtype)
        weight = (1 + 0.3 * torch.randn(64, generator=g)).to(dtype)
        variance = x.float().pow(2).mean(-1, keepdim=True)
        want = weight * (x.float() * torch.rsqrt(variance + EPS)).to(dtype)
        torch.testing.assert_close(fused.rms_norm(x, weight, EPS), want, **tolerance(dtype))
        normed, h = fused.add_rms_norm(x, residual, weight, EPS)
        assert torch.equal(h, x + residual) and torch.equal(normed, fused.rms_norm(x + residual, weight, EPS))
        q = torch.randn(5, 3, 16, generator=g).to(dtype)
        angles = torch.rand(5, 1, 8, generator=g) * 6
        cos, sin = torch.cat([angles, angles], -1).cos().to(dtype), torch.cat([angles, angles], -1).sin().to(dtype)
        rotate_half = torch.cat([-q[..., 8:], q[..., :8]], dim=-1)
        torch.testing.assert_close(
            fused.rope(q, *fused.rope_tables_signed(cos, sin)), q * cos + rotate_half * sin, **tolerance(dtype)
        )
        gate_up = torch.randn(5, 2, 32, generator=g).to(dtype).flatten(1)
        assert torch.equal(fused.silu_and_mul(gate_up), F.silu(gate_up[:, :32]) * gate_up[:, 32:])


def test_fused_needs_no_triton_off_the_gpu():
    code = """
import sys
sys.modules["triton"] = None  # as if triton were not installed
import torch
import kvcourse.kernels.fused as fused
x, w = torch.randn(2, 8), torch.ones(8)
fused.rms_norm(x, w, 1e-5); fused.add_rms_norm(x, x, w, 1e-5); fused.silu_and_mul(x)
fused.rope(torch.randn(2, 3, 8), torch.ones(2, 1, 8), torch.zeros(2, 1, 8))
assert "kvcourse.kernels.triton_fused" not in sys.modules
print("ok")
"""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no GPU: the CPU path, whatever this machine has
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
