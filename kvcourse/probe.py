"""Look inside one forward pass: the Q, K and V every attention layer computes.

(Also :func:`model_decode_case`: one layer's real decode step, the inputs chapter 5's kernels are
tried on.)

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

from .backends import ContiguousBackend, NoCache
from .cache import KVCache
from .checks import is_int
from .model import LlamaModel

__all__ = ["ModelDecodeCase", "Recording", "model_decode_case", "record_forward"]


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


@dataclass
class ModelDecodeCase:
    """One layer's real decode step for ``B`` prompts: what the model's attention saw, and what it returned."""

    q: torch.Tensor  # [B, Hq, D]: each prompt's last token's query (RoPE applied)
    k: torch.Tensor  # [B, Hkv, max(seq_lens), D]: the K of every prompt token, NaN past each prompt's length
    v: torch.Tensor
    seq_lens: torch.Tensor  # int32 [B]: prompt lengths
    out: torch.Tensor  # [B, Hq, D]: the model's own attention output for the last token


class _RecordLastToken:
    """An attention backend around chapter 2's contiguous one that keeps one layer's query and output."""

    def __init__(self, cache, start: int, layer: int) -> None:
        self.inner, self.layer = ContiguousBackend(cache, start), layer
        self.q = self.out = None

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = self.inner(layer_idx, q, k, v)
        if layer_idx == self.layer:
            self.q, self.out = q[0, -1].clone(), out[0, -1].clone()  # [Hq, D]
        return out


@torch.inference_mode()
def model_decode_case(model, prompts: Sequence[Sequence[int]], layer: int) -> ModelDecodeCase:
    """Run each prompt through ``model`` (prefill, then its last token as a decode step) and keep ``layer``'s inputs.

    Real keys, values and queries for the kernels, with the model's own attention output as the answer.
    """
    if not 0 <= layer < model.config.num_hidden_layers:
        raise ValueError(f"layer must lie in [0, {model.config.num_hidden_layers}), got {layer}")
    if not prompts or any(len(p) < 2 for p in prompts):
        raise ValueError("prompts must be a non-empty list of token lists, each of 2 tokens or more")
    qs, ks, vs, outs = [], [], [], []
    for ids in prompts:
        cache = KVCache.for_model(model.config, batch_size=1, dtype=model.dtype, device=model.device)
        model(torch.tensor([list(ids[:-1])], device=model.device), cache=cache)
        record = _RecordLastToken(cache, cache.seq_len, layer)
        last = torch.tensor([[ids[-1]]], device=model.device)
        model.hidden_states(last, torch.tensor([len(ids) - 1], device=model.device), record)
        qs.append(record.q)
        outs.append(record.out)
        ks.append(cache.keys(layer)[0])
        vs.append(cache.values(layer)[0])
    s_max = max(len(p) for p in prompts)
    k = torch.full(
        (len(prompts), *ks[0].shape[:1], s_max, ks[0].shape[-1]), float("nan"), dtype=model.dtype, device=model.device
    )
    v = torch.full_like(k, float("nan"))
    for b, (kb, vb) in enumerate(zip(ks, vs)):
        k[b, :, : kb.shape[1]], v[b, :, : vb.shape[1]] = kb, vb
    lens = torch.tensor([len(p) for p in prompts], dtype=torch.int32, device=model.device)
    return ModelDecodeCase(torch.stack(qs), k, v, lens, torch.stack(outs))
