"""The torch versions of :mod:`.fused`'s ops: RMSNorm (with the residual add), RoPE, SiLU-and-mul.

What :mod:`.fused` runs off a CUDA device, what a Triton kernel of :mod:`.triton_fused` that cannot
compile falls back to, and what the kernel tests compare the kernels against. They sit apart from
:mod:`.fused` (which imports the kernels) so that the kernels can fall back to them without importing it.
Written with as few framework calls as torch allows (see :mod:`.fused`'s doc).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = ["add_rms_norm_torch", "embed_rms_norm_torch", "rms_norm_torch", "rope_torch", "silu_and_mul_torch"]


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`.fused.rms_norm`'s torch version, on any device."""
    x32 = x if x.dtype == torch.float32 else x.float()
    inv_n, eps_t = _norm_constants(x.device, x.shape[-1], eps)
    mean_sq_eps = torch.addcmul(eps_t, torch.mul(x32, x32).sum(-1, keepdim=True), inv_n)  # mean(x^2) + eps
    normed = x32 * torch.rsqrt(mean_sq_eps)
    return weight * (normed if x.dtype == torch.float32 else normed.to(x.dtype))


@functools.cache
def _norm_constants(device: torch.device, hidden: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``1 / hidden`` and ``eps`` as fp32 tensors on ``device``, made once (as ordinary tensors, even when
    first asked for under ``torch.inference_mode``, so that code tracked by autograd may use them too)."""
    with torch.inference_mode(False):
        return (
            torch.tensor([1.0 / hidden], dtype=torch.float32, device=device),
            torch.tensor([eps], dtype=torch.float32, device=device),
        )


def add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.fused.add_rms_norm`'s torch version, on any device."""
    h = x + residual
    return rms_norm_torch(h, weight, eps), h


def rope_torch(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """:func:`.fused.rope`'s torch version, on any device."""
    halves = x.view(*x.shape[:-1], 2, x.shape[-1] // 2)
    return torch.addcmul(x * cos, halves.flip(-2).view(x.shape), signed_sin)


def silu_and_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """:func:`.fused.silu_and_mul`'s torch version, on any device."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :half]) * gate_up[..., half:]


def embed_rms_norm_torch(
    ids: torch.Tensor, table: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`.fused.embed_rms_norm`'s torch version, on any device."""
    rows = torch.nn.functional.embedding(ids, table)
    return rms_norm_torch(rows, weight, eps), rows
