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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["add_rms_norm", "rms_norm", "rope", "rope_tables_signed", "silu_and_mul"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension, the statistics in fp32.

    In fp32 it is one call. In fp16/bf16 the normalised value is rounded to ``x.dtype`` before the
    weight multiplies it, as Hugging Face's ``LlamaRMSNorm`` does, so the two agree bit for bit.
    """
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next norm in one step: ``h = x + residual``; returns ``(rms_norm(h), h)``.

    Every layer but the first starts this way; fusing them reads ``h`` once instead of three times.
    """
    h = x + residual
    return rms_norm(h, weight, eps), h


def rope_tables_signed(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(cos, sin)`` of :func:`kvcourse.model.rope_cos_sin` with the sign of rotate-half folded into
    ``sin``'s first half, so that :func:`rope` needs no negation: computed once per step, not per layer."""
    half = sin.shape[-1] // 2
    return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half layout: ``x * cos + rotate_half(x) * sin`` in three ops.

    ``x [N, H, D]`` (or ``[..., N, H, D]``); ``cos, signed_sin [N, 1, D]`` from :func:`rope_tables_signed`,
    in ``x.dtype``. ``rotate_half(x) = cat(-x2, x1)``: a roll by ``D/2`` swaps the halves, and the
    minus sign lives in ``signed_sin``. Q and K can be rotated together when they sit side by side in
    the packed QKV projection (``[N, Hq + Hkv, D]``).
    """
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's middle: ``silu(gate) * up`` for ``gate_up = [gate | up]`` (the packed projection's output)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
