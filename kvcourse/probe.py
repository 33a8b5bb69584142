"""Look inside one forward pass: the Q, K and V every attention layer computes.

Chapter 1 uses this to show, with numbers, which tensors the naive loop
recomputes unchanged at every step. :func:`record_forward` runs the model once
(no cache) and returns, per layer, the queries, keys and values exactly as the
attention sees them (after RoPE), plus the final hidden states and the logits.

It works with forward pre-hooks on each layer's ``self_attn`` module, so the
model code stays untouched; the hooks are removed before the function returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .model import LlamaModel, apply_rope

__all__ = ["Recording", "record_forward"]


@dataclass
class Recording:
    """What one forward pass over ``T`` tokens computed.

    ``q[l]`` is ``[B, Hq, T, D]``; ``k[l]`` and ``v[l]`` are ``[B, Hkv, T, D]`` (K and Q
    after RoPE, i.e. the K a cache would store); ``hidden`` is ``[B, T, hidden_size]``,
    the final-norm output fed to the output head; ``logits`` is ``[B, T, vocab]``.
    """

    q: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    hidden: torch.Tensor
    logits: torch.Tensor

    @property
    def num_layers(self) -> int:
        return len(self.k)


def record_forward(model: LlamaModel, input_ids: torch.Tensor | Sequence[int]) -> Recording:
    """Run ``model`` over ``input_ids`` (a ``[B, T]`` tensor or a list of ids) and record Q, K, V per layer."""
    if not isinstance(model, LlamaModel):
        raise TypeError(f"model must be a kvcourse.LlamaModel, got {type(model).__name__}")
    if not isinstance(input_ids, torch.Tensor):
        ids = list(input_ids)
        if not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
            raise ValueError("input_ids must be a non-empty list of ints or an integer tensor [B, T]")
        input_ids = torch.tensor([ids], device=model.device)
    qs: list[torch.Tensor] = []
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    hidden: list[torch.Tensor] = []

    def on_attention(module, args):
        x, cos, sin = args[0], args[1], args[2]
        b, t, _ = x.shape
        with torch.inference_mode():
            q = module.q_proj(x).view(b, t, module.n_heads, module.head_dim).transpose(1, 2)
            k = module.k_proj(x).view(b, t, module.n_kv_heads, module.head_dim).transpose(1, 2)
            v = module.v_proj(x).view(b, t, module.n_kv_heads, module.head_dim).transpose(1, 2)
            qs.append(apply_rope(q, cos, sin).clone())
            ks.append(apply_rope(k, cos, sin).clone())
            vs.append(v.clone())

    def on_norm(module, args, output):
        hidden.append(output.clone())

    handles = [layer.self_attn.register_forward_pre_hook(on_attention) for layer in model.layers]
    handles.append(model.norm.register_forward_hook(on_norm))
    try:
        logits = model(input_ids)
    finally:
        for handle in handles:
            handle.remove()
    return Recording(q=qs, k=ks, v=vs, hidden=hidden[0], logits=logits)
