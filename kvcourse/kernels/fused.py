"""The small ops of a decoder layer, each one call: RMSNorm (with the residual add), RoPE, SiLU-and-mul.

A decode step of a 135M model is a few hundred tiny operations; on a GPU each is a kernel launch and
on any machine each is a trip through the framework. A layer written op by op, as
:mod:`kvcourse.model` teaches it, spends more on those trips than on arithmetic. Engines fuse:
vLLM's ``fused_add_rms_norm``, ``rotary_embedding`` and ``silu_and_mul`` each do in one kernel what
a textbook layer does in five to ten ops. These are the torch versions, written with as few ops as
torch allows, and the definitions the Triton kernels of :mod:`.triton_fused` must equal.

Layouts are the serving step's: tokens packed in rows, ``x [N, hidden]``, heads ``[N, H, D]``.
Every function also takes leading batch dimensions (``[..., hidden]``), so the plain forward
(``[B, T, hidden]``) runs the same code.

On a CPU, what costs is the number of framework calls, not the arithmetic, and a Python number in
tensor arithmetic (``x * 0.5``) costs four of them (it becomes a tensor each time). So the norm keeps
its two constants as tensors, made once per device, and RoPE swaps halves with a flip.

**Where each runs.** On a CUDA device each function launches its Triton kernel (:mod:`.triton_fused`,
imported on first use there, so ``import kvcourse`` never needs Triton); anywhere else (the CPU, the
``meta`` device, MPS) it runs its torch version, ``*_torch`` below, which is also what a kernel that
cannot compile falls back to and what the kernel tests compare against (they live in :mod:`.fused_torch`). ``USE_TRITON`` switches the
kernels off::

    import kvcourse.kernels.fused as fused
    fused.USE_TRITON = False  # the torch versions on a GPU too: to time one against the other

It is read at every call (a CUDA graph keeps whichever path ran while it was captured). On a GPU
machine without Triton installed, the torch versions run, with one warning.
"""

from __future__ import annotations

import warnings
from types import ModuleType

import torch

# the torch versions live in their own module, which the Triton kernels fall back to without importing this one
from .fused_torch import add_rms_norm_torch, embed_rms_norm_torch, rms_norm_torch, rope_torch, silu_and_mul_torch

__all__ = [
    "add_rms_norm",
    "add_rms_norm_torch",
    "embed_rms_norm",
    "embed_rms_norm_torch",
    "rms_norm",
    "rms_norm_torch",
    "rope",
    "rope_tables_signed",
    "rope_torch",
    "silu_and_mul",
    "silu_and_mul_torch",
]

USE_TRITON = True  # False: the torch versions on a CUDA device too (see the module doc)
KERNEL_DEVICES = ("cuda",)  # where the kernels run; kvcourse.bench.launch_count adds the CPU (Triton's interpreter)
_TRITON_MISSING = False  # set when Triton failed to import, so that the warning is given once


def _triton_kernels(x: torch.Tensor) -> ModuleType | None:
    """:mod:`.triton_fused` when ``x``'s op should run as a Triton kernel (on CUDA), else None (the torch version)."""
    global _TRITON_MISSING
    if not USE_TRITON or x.device.type not in KERNEL_DEVICES or _TRITON_MISSING:
        return None
    try:
        from . import triton_fused  # imports Triton: only ever here, on a GPU
    except ImportError as exc:
        _TRITON_MISSING = True
        warnings.warn(f"{exc}; the layer's small ops run as torch ops instead", RuntimeWarning, stacklevel=3)
        return None
    return triton_fused


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, the statistics in fp32.

    In fp16/bf16 the normalised value is rounded to ``x.dtype`` before the weight multiplies it, as
    Hugging Face's ``LlamaRMSNorm`` does. (``F.rms_norm`` computes the same in one call, but on a CPU
    that call is 24 framework calls inside; these six ops are 7.)
    """
    kernels = _triton_kernels(x)
    if kernels is not None:
        return kernels.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def embed_rms_norm(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The embedding lookup and the first layer's norm in one step: ``rows = table[ids]``; returns
    ``(rms_norm(rows), rows)`` (the rows are the first residual)."""
    kernels = _triton_kernels(table)
    if kernels is not None:
        return kernels.embed_rms_norm(ids, table, weight, eps)
    return embed_rms_norm_torch(ids, table, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one step: ``h = x + residual``; returns ``(rms_norm(h), h)``.

    Every layer but the first starts this way; fusing them reads ``h`` once instead of three times.
    """
    kernels = _triton_kernels(x)
    if kernels is not None:
        return kernels.fused_add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def rope_tables_signed(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(cos, sin)`` of :func:`kvcourse.model.rope_cos_sin` with the sign of rotate-half folded into
    ``sin``'s first half, so that :func:`rope` needs no negation: computed once per step, not per layer."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout: ``x * cos + rotate_half(x) * sin`` in three ops.

    ``x [N, H, D]`` (or ``[..., N, H, D]``, last dimension contiguous); ``cos, signed_sin [N, 1, D]`` from
    :func:`rope_tables_signed`, in ``x.dtype``. ``rotate_half(x) = cat(-x2, x1)``: viewing the last
    dimension as two halves and flipping them swaps the halves, and the minus sign lives in
    ``signed_sin``. Q and K can be rotated together when they sit side by side in the packed QKV
    projection (``[N, Hq + Hkv, D]``).
    """
    kernels = _triton_kernels(x)
    if kernels is not None:
        return kernels.rotary_embedding(x, cos, signed_sin)
    return rope_torch(x, cos, signed_sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle: ``silu(gate) * up`` for ``gate_up = [gate | up]`` (the packed projection's output)."""
    kernels = _triton_kernels(gate_up)
    if kernels is not None:
        return kernels.silu_and_mul(gate_up)
    return silu_and_mul_torch(gate_up)
