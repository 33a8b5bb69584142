"""A decoder layer's small ops in Triton, one kernel each: RMSNorm, residual add + RMSNorm, RoPE, SiLU-and-mul.

Each kernel does in one launch what :mod:`.fused`'s torch version does in up to five ops, and equals it
(same signature, same result, same rounding). :mod:`.fused` calls these on a CUDA device; names as vLLM's:

* :func:`rms_norm` -- ``weight * x / sqrt(mean(x^2) + eps)`` over each row;
* :func:`fused_add_rms_norm` -- ``h = x + residual`` and ``rms_norm(h)``, both written in one pass;
* :func:`rotary_embedding` -- ``x * cos + swap_halves(x) * signed_sin`` for every head of a token;
* :func:`silu_and_mul` -- ``silu(gate) * up`` for ``gate_up = [gate | up]``.

**One program per token.** A row (``hidden`` values, or ``H x D`` for RoPE), padded to a power of two,
fits in one tile (up to :data:`MAX_TILE` values), so each program loads its row once, reduces it in
registers and writes it once: the whole op costs one read and one write of the activations.
SiLU-and-mul has no reduction and splits long rows into tiles of 1024.

**Rounding as torch rounds.** Everything is computed in fp32 (statistics included). Where the torch
version stores an intermediate in a 16-bit dtype (the sum ``h``, the normalised value before the weight,
``x * cos``, ``silu(gate)``), the kernel rounds to that dtype at the same point, so fp16/bf16 results
agree with :mod:`.fused` to the last bit or one (the GPU's ``rsqrt`` and ``exp`` are not torch's).
Outputs take torch's promoted dtype (a bf16 ``x`` with an fp32 ``weight`` gives fp32, as in torch).

**Layouts.** The kernels read rows with any row stride (a slice of a packed projection's output is not
copied) but need the last dimension contiguous. 2-D inputs ``[N, hidden]`` (RoPE: 3-D ``[N, H, D]``,
any token and head strides) go straight to the kernel; leading batch dimensions are flattened with
``reshape`` (a copy only where no view exists), a last dimension with a stride other than 1 is made
contiguous, and RoPE's tables are broadcast to one row per token (a copy when ``x`` has batch dimensions;
see :func:`rotary_embedding` for tables that vary per head).
Outputs are new contiguous tensors in ``x``'s shape.

**CUDA graphs.** The wrappers read shapes, strides and dtypes, never tensor values (no ``.item()``), and
allocate outputs on the input's device: a step that calls them can be captured in a CUDA graph
(after one launch outside it: Triton compiles a kernel on its first launch).

**The interpreter.** Triton's CPU interpreter converts fp32 to bf16 by truncation, not to nearest
(compiled code rounds to nearest, ties to even, as torch does), and gets bf16 arithmetic wrong (see
:func:`~.triton_runtime.upcast`). So every load is converted to fp32 at once, and under the interpreter
the kernels round to bf16 by hand (:func:`_rounded`): they round where and as compiled code does.
"""

from __future__ import annotations

import torch

from . import fused_torch
from .triton_runtime import check_kernel_device, interpreting, launch_or_fallback, tl, triton

__all__ = ["embed_rms_norm", "fused_add_rms_norm", "rms_norm", "rotary_embedding", "silu_and_mul"]

MAX_TILE = 32768  # values one program holds (a row, or RoPE's H x D padded): 16 warps, 64 per thread at most
SILU_BLOCK = 1024  # SiLU-and-mul's tile: rows longer than this take several programs
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------------------------------------
# The kernels
# ---------------------------------------------------------------------------------------------
@triton.jit
def _rounded(x, DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr):
    """``x`` (fp32) rounded to ``DTYPE`` and back: the value torch holds after storing ``x`` in ``DTYPE``.

    ``BF16_BY_HAND`` (the interpreter, which truncates): round to the nearest bf16, ties to even, on the
    bits. A bf16 is the top 16 bits of an fp32; adding ``0x7FFF`` plus the lowest kept bit carries into
    the kept bits exactly when the dropped half is over one half (or one half with an odd kept bit).
    """
    if BF16_BY_HAND and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)  # a no-op for fp32


@triton.jit
def _rms_normalize(
    x, w, eps, HIDDEN: tl.constexpr, X_DTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, BF16_BY_HAND: tl.constexpr
):
    """``w * x / sqrt(mean(x^2) + eps)`` for one row (fp32, padding lanes 0), rounded as :func:`.fused.rms_norm`."""
    # Padding lanes hold 0: they add nothing to the sum, and 1/HIDDEN (a constant) makes it the mean.
    mean_square = tl.sum(x * x, axis=0) * (1.0 / HIDDEN)
    normed = _rounded(x * tl.rsqrt(mean_square + eps), X_DTYPE, BF16_BY_HAND)  # in x's dtype, as HF rounds it
    return _rounded(normed * w, OUT_DTYPE, BF16_BY_HAND)


@triton.jit
def _rms_norm_kernel(
    X, Weight, Out, Ids, Rows, stride_xn, stride_on, stride_rn, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, BF16_BY_HAND: tl.constexpr,
    GATHER: tl.constexpr,  # X is an embedding table: row n reads row Ids[n], and writes it to Rows (the residual)
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride passes 2**31 in a long prefill of a wide model
    cols = tl.arange(0, BLOCK)  # the whole row in one tile (BLOCK = HIDDEN rounded up to a power of two)
    mask = cols < HIDDEN
    if GATHER:
        x = tl.load(X + tl.load(Ids + row).to(tl.int64) * stride_xn + cols, mask=mask, other=0.0)
        tl.store(Rows + row * stride_rn + cols, x, mask=mask)
    else:
        x = tl.load(X + row * stride_xn + cols, mask=mask, other=0.0)
    x = x.to(tl.float32)
    w = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
    out = _rms_normalize(x, w, eps, HIDDEN, X.dtype.element_ty, Out.dtype.element_ty, BF16_BY_HAND)
    tl.store(Out + row * stride_on + cols, out.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    X, Residual, Weight, Out, H, stride_xn, stride_rn, stride_on, stride_hn, eps,
    HIDDEN: tl.constexpr, BLOCK: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(X + row * stride_xn + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(Residual + row * stride_rn + cols, mask=mask, other=0.0).to(tl.float32)
    # The sum as torch stores it (in h's dtype): the next layer's residual, and what the norm reads.
    h = _rounded(x + r, H.dtype.element_ty, BF16_BY_HAND)
    tl.store(H + row * stride_hn + cols, h.to(H.dtype.element_ty), mask=mask)
    w = tl.load(Weight + cols, mask=mask, other=0.0).to(tl.float32)
    out = _rms_normalize(h, w, eps, HIDDEN, H.dtype.element_ty, Out.dtype.element_ty, BF16_BY_HAND)
    tl.store(Out + row * stride_on + cols, out.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_embedding_kernel(
    X, Cos, Sin, Out, stride_xn, stride_xh, stride_cn, stride_sn, stride_on, stride_oh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    BF16_BY_HAND: tl.constexpr,
):  # fmt: skip
    n = tl.program_id(0).to(tl.int64)  # one token, every head: the token's cos/sin row is loaded once
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    d_ok = d < HEAD_DIM
    mask = (h < NUM_HEADS) & d_ok
    # rotate_half's halves swapped: element d reads d + D/2 (mod D); the minus sign is folded into sin.
    d_swapped = (d + HEAD_DIM // 2) % HEAD_DIM
    row = X + n * stride_xn + h * stride_xh
    x = tl.load(row + d, mask=mask, other=0.0).to(tl.float32)
    x_swapped = tl.load(row + d_swapped, mask=mask, other=0.0).to(tl.float32)  # same bytes: from cache, not DRAM
    cos = tl.load(Cos + n * stride_cn + d, mask=d_ok, other=0.0).to(tl.float32)  # [1, BLOCK_D]: every head
    sin = tl.load(Sin + n * stride_sn + d, mask=d_ok, other=0.0).to(tl.float32)
    # torch.addcmul(x * cos, x_swapped, sin): x * cos is stored in the output's dtype first.
    x_cos = _rounded(x * cos, Out.dtype.element_ty, BF16_BY_HAND)
    out = _rounded(x_cos + x_swapped * sin, Out.dtype.element_ty, BF16_BY_HAND)
    tl.store(Out + n * stride_on + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(
    GateUp, Out, stride_gn, stride_on,
    INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr, BF16_BY_HAND: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # this program's tile of the row
    mask = cols < INTERMEDIATE
    gate = tl.load(GateUp + row * stride_gn + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(GateUp + row * stride_gn + INTERMEDIATE + cols, mask=mask, other=0.0).to(tl.float32)
    # F.silu(gate) is stored in gate_up's dtype before the multiply: round there too.
    act = _rounded(gate / (1.0 + tl.exp(-gate)), Out.dtype.element_ty, BF16_BY_HAND)
    out = _rounded(act * up, Out.dtype.element_ty, BF16_BY_HAND)
    tl.store(Out + row * stride_on + cols, out.to(Out.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launch parameters and launches (no validation: compile_check calls these with CPU tensors)
# ---------------------------------------------------------------------------------------------
def num_warps(tile: int) -> int:
    """Warps for a program holding ``tile`` values: 4 up to 2048 (8 or fewer per thread), then up to 16.

    One warp is 32 threads; each thread holds ``tile / (32 * warps)`` values of each loaded tensor. A row
    of SmolLM2 (576, padded to 1024) gets 4 warps, 8 values a thread; a Llama-3-8B row (4096) gets 8.
    """
    return max(4, min(16, tile // 512))


def _launch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, ids: torch.Tensor | None = None):
    """``x [N, hidden]`` (last dim contiguous), ``weight [hidden]`` contiguous -> a new ``[N, hidden]``.

    With ``ids [N]``: ``x`` is an embedding table, row ``n`` is its row ``ids[n]``; returns ``(normed, rows)``."""
    n, hidden = x.shape if ids is None else (ids.numel(), x.shape[1])
    out = torch.empty((n, hidden), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rows = out if ids is None else torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    if n:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(n,)](
            x, weight, out, x if ids is None else ids, rows, x.stride(0), out.stride(0), rows.stride(0), eps,
            HIDDEN=hidden, BLOCK=block, BF16_BY_HAND=interpreting(), GATHER=ids is not None,
            num_warps=num_warps(block),
        )  # fmt: skip
    return out if ids is None else (out, rows)


def _launch_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x, residual [N, hidden]`` (last dim contiguous), ``weight [hidden]`` -> new ``(normed, h)``."""
    n, hidden = x.shape
    h = torch.empty((n, hidden), dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty((n, hidden), dtype=torch.promote_types(h.dtype, weight.dtype), device=x.device)
    if n == 0:
        return out, h
    block = triton.next_power_of_2(hidden)
    _fused_add_rms_norm_kernel[(n,)](
        x, residual, weight, out, h, x.stride(0), residual.stride(0), out.stride(0), h.stride(0), eps,
        HIDDEN=hidden, BLOCK=block, BF16_BY_HAND=interpreting(), num_warps=num_warps(block),
    )  # fmt: skip
    return out, h


def _launch_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x [N, H, D]``, ``cos, signed_sin [N, 1, D]`` (last dims contiguous, any other strides) -> new ``[N, H, D]``."""
    n, heads, head_dim = x.shape
    out = torch.empty((n, heads, head_dim), dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if n == 0:
        return out
    block_h, block_d = triton.next_power_of_2(heads), triton.next_power_of_2(head_dim)
    _rotary_embedding_kernel[(n,)](
        x, cos, signed_sin, out, x.stride(0), x.stride(1), cos.stride(0), signed_sin.stride(0),
        out.stride(0), out.stride(1),
        NUM_HEADS=heads, HEAD_DIM=head_dim, BLOCK_H=block_h, BLOCK_D=block_d, BF16_BY_HAND=interpreting(),
        num_warps=num_warps(block_h * block_d),
    )  # fmt: skip
    return out


def _launch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [N, 2I]`` (last dim contiguous) -> a new ``[N, I]``."""
    n, intermediate = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((n, intermediate), dtype=gate_up.dtype, device=gate_up.device)
    if n == 0 or intermediate == 0:
        return out
    block = min(SILU_BLOCK, triton.next_power_of_2(intermediate))
    _silu_and_mul_kernel[(n, triton.cdiv(intermediate, block))](
        gate_up, out, gate_up.stride(0), out.stride(0),
        INTERMEDIATE=intermediate, BLOCK=block, BF16_BY_HAND=interpreting(), num_warps=num_warps(block),
    )  # fmt: skip
    return out


# ---------------------------------------------------------------------------------------------
# The wrappers: fused.py's signatures, checked, reshaped to what the kernels read
# ---------------------------------------------------------------------------------------------
def _check_float(name: str, t: torch.Tensor, device: torch.device | None = None) -> None:
    """``t`` is a tensor of a dtype the kernels take, on ``device`` (x's) when given."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(
            f"{name} must be float32, float16 or bfloat16 for the Triton kernels, got {t.dtype} "
            "(kvcourse.kernels.fused.USE_TRITON = False runs the torch versions)"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; they must be on one device")


def _check_tile(name: str, values: int) -> None:
    if values > MAX_TILE:
        raise ValueError(f"{name} spans {values} values padded, more than one program holds ({MAX_TILE})")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x [..., width]`` as ``[rows, width]`` with a contiguous last dimension (a view where possible)."""
    return _last_dim_contiguous(x.reshape(-1, x.shape[-1]))


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    _check_float("x", x)
    check_kernel_device("x", x)
    _check_float("weight", weight, x.device)
    if x.dim() < 1 or weight.shape != (x.shape[-1],):
        hidden = x.shape[-1] if x.dim() else "?"
        raise ValueError(f"weight must have shape [hidden] = [{hidden}], got {tuple(weight.shape)}")
    _check_tile("hidden", triton.next_power_of_2(x.shape[-1]))
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`.fused.rms_norm` in one kernel: ``x [..., hidden]``, ``weight [hidden]`` -> ``x``'s shape."""
    _check_norm_args(x, weight, eps)
    rows, weight = _rows(x), weight.contiguous()
    config = (x.dtype, weight.dtype, x.shape[-1])
    out = launch_or_fallback(
        "rms_norm",
        x.device,
        config,
        lambda: _launch_rms_norm(rows, weight, float(eps)),
        lambda: fused_torch.rms_norm_torch(rows, weight, eps),
    )
    return out.view(x.shape)


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.fused.embed_rms_norm` in one kernel: ``ids [...]`` -> ``(rms_norm(table[ids]), table[ids])``."""
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int32, torch.int64) or ids.device != table.device:
        raise TypeError(f"ids must be an int32/int64 tensor on the table's device ({table.device}), got {ids!r}")
    if table.dim() != 2:
        raise ValueError(f"table must be [vocab, hidden], got shape {tuple(table.shape)}")
    _check_norm_args(table, weight, eps)
    flat, table, weight = ids.reshape(-1), _last_dim_contiguous(table), weight.contiguous()
    out, rows = launch_or_fallback(
        "embed_rms_norm",
        table.device,
        (table.dtype, weight.dtype, table.shape[1]),
        lambda: _launch_rms_norm(table, weight, float(eps), flat),
        lambda: fused_torch.embed_rms_norm_torch(flat, table, weight, eps),
    )
    return out.view(*ids.shape, -1), rows.view(*ids.shape, -1)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.fused.add_rms_norm` in one kernel: ``h = x + residual``; returns ``(rms_norm(h), h)``.

    ``x`` and ``residual`` must have one shape (torch would broadcast; a layer never needs it).
    Unlike vLLM's kernel, which overwrites its inputs, this one writes two new tensors, as the torch version does.
    """
    _check_norm_args(x, weight, eps)
    _check_float("residual", residual, x.device)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    rows_x, rows_r, weight = _rows(x), _rows(residual), weight.contiguous()
    config = (x.dtype, residual.dtype, weight.dtype, x.shape[-1])
    out, h = launch_or_fallback(
        "fused_add_rms_norm",
        x.device,
        config,
        lambda: _launch_fused_add_rms_norm(rows_x, rows_r, weight, float(eps)),
        lambda: fused_torch.add_rms_norm_torch(rows_x, rows_r, weight, eps),
    )
    return out.view(x.shape), h.view(x.shape)


def _broadcasts_to(t: torch.Tensor, shape: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(t.shape, shape) == shape
    except RuntimeError:
        return False


def rotary_embedding(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`.fused.rope` in one kernel: ``x [N, H, D]`` (or ``[..., N, H, D]``), ``cos, signed_sin [N, 1, D]``.

    The tables may have any shape that broadcasts to ``x``'s, and must share one dtype (the output's is
    ``x``'s promoted with theirs). One row per token shared by its heads (``[N, 1, D]``, ``[1, 1, D]``,
    ``[B, N, 1, D]``) is the kernel's layout; tables that differ per head too (``x [B, H, T, D]`` with
    ``cos [T, D]``) are expanded to ``x``'s shape (a copy), and each ``D``-row of ``x`` is then a "token".
    """
    _check_float("x", x)
    check_kernel_device("x", x)
    _check_float("cos", cos, x.device)
    _check_float("signed_sin", signed_sin, x.device)
    if x.dim() < 2 or x.shape[-1] % 2:
        raise ValueError(f"x must be [N, H, D] (or [..., N, H, D]) with an even D, got shape {tuple(x.shape)}")
    if cos.dtype != signed_sin.dtype:
        raise TypeError(f"cos has dtype {cos.dtype} but signed_sin has {signed_sin.dtype}; they must match")
    for name, t in (("cos", cos), ("signed_sin", signed_sin)):
        if not _broadcasts_to(t, x.shape):
            raise ValueError(
                f"{name} must broadcast to x's shape {list(x.shape)} ([N, 1, D] for x [N, H, D]), "
                f"got shape {tuple(t.shape)}"
            )
    *lead, heads, head_dim = x.shape
    if all(_broadcasts_to(t, (*lead, 1, head_dim)) for t in (cos, signed_sin)):
        table_shape, row_heads = (*lead, 1, head_dim), heads  # x as [tokens, H, D], one table row per token
    else:
        table_shape, row_heads = tuple(x.shape), 1  # x as [rows, 1, D], one table row per row
    _check_tile("x's heads x head_dim", triton.next_power_of_2(row_heads) * triton.next_power_of_2(head_dim))
    # Any token and head strides go to the kernel as they are. Expanding a table is free (stride 0: [1, 1, D]
    # serves every token); reshape copies only where x has batch dimensions or the tables vary per head.
    tokens = _last_dim_contiguous(x.reshape(-1, row_heads, head_dim))
    cos_rows, sin_rows = (
        _last_dim_contiguous(t.expand(table_shape).reshape(-1, 1, head_dim)) for t in (cos, signed_sin)
    )
    config = (x.dtype, cos.dtype, row_heads, head_dim)
    out = launch_or_fallback(
        "rotary_embedding",
        x.device,
        config,
        lambda: _launch_rotary_embedding(tokens, cos_rows, sin_rows),
        lambda: fused_torch.rope_torch(tokens, cos_rows, sin_rows),
    )
    return out.view(x.shape)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`.fused.silu_and_mul` in one kernel: ``gate_up [..., 2I]`` -> ``silu(gate) * up``, ``[..., I]``."""
    _check_float("gate_up", gate_up)
    check_kernel_device("gate_up", gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [..., 2 * intermediate] (even last dim), got {tuple(gate_up.shape)}")
    rows = _rows(gate_up)
    config = (gate_up.dtype, gate_up.shape[-1])
    out = launch_or_fallback(
        "silu_and_mul",
        gate_up.device,
        config,
        lambda: _launch_silu_and_mul(rows),
        lambda: fused_torch.silu_and_mul_torch(rows),
    )
    return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)
