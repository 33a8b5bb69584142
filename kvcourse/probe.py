"""Look inside one forward pass: the Q, K and V every attention layer computes.

Chapter 1 uses this to show, with numbers, which tensors the naive loop
recomputes unchanged at every step. :func:`record_forward` runs the model once
(no cache) and returns, per layer, the queries, keys and values exactly as the
attention sees them (after RoPE), plus the final hidden states and the logits.

It runs the model with a recording attention backend: the layers hand their Q, K and V to
it exactly as they hand them to any backend, and it copies them before attending as the
no-cache backend does. Nothing in the model changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .attention import NoCache
from .checks import is_int
from .model import LlamaModel

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
        if not ids or not all(is_int(i) for i in ids):
            raise ValueError("input_ids must be a non-empty list of ints or an integer tensor [B, T]")
        input_ids = torch.tensor([ids], device=model.device)
    model.check_context(input_ids.shape[1])
    recorder = _Recorder()
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    with torch.inference_mode():
        hidden = model.hidden_states(input_ids, positions, recorder)
        logits = model.lm_head(hidden)
    return Recording(q=recorder.q, k=recorder.k, v=recorder.v, hidden=hidden, logits=logits)


class _Recorder(NoCache):
    """The no-cache backend, keeping a copy of every layer's Q, K, V as ``[B, H, T, D]``."""

    def __init__(self) -> None:
        self.q: list[torch.Tensor] = []
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        for store, x in ((self.q, q), (self.k, k), (self.v, v)):
            store.append(x.transpose(1, 2).clone())
        return super().__call__(layer_idx, q, k, v)
