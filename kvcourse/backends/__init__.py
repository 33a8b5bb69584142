"""Attention backends: where a layer's new K/V go, and which K/V its queries read.

The model computes ``q, k, v`` for its new tokens (RoPE applied) and hands them to one callable:

    out = attn(layer_idx, q, k, v)      # q [B, T, Hq, D], k, v [B, T, Hkv, D] -> [B, T, Hq, D]

Everything about caches lives behind that call, so the same model runs on every cache of the course:

==================  ===================================  ==========================================
backend             store                                 what it is
==================  ===================================  ==========================================
(none)              --                                    :class:`NoCache`, chapter 1's naive loop
(a KVCache)         chapter 2's contiguous cache          :class:`ContiguousBackend`
``paged-torch``     :class:`~kvcourse.paged.PagedKVStore`  a ragged batch on the paged pool (SDPA)
``paged-reference`` :class:`~kvcourse.paged.PagedKVStore`  the same through the plain torch reference
``triton``          :class:`~kvcourse.paged.PagedKVStore`  chapter 5's kernels for the write and decode
``triton-ragged``   :class:`~kvcourse.paged.PagedKVStore`  one ragged kernel for every row (CUDA graphs)
``paged-int8-torch`` an int8 pool                         chapter 8: quantize on write
``triton-int8``     an int8 pool                          chapter 8's pool through chapter 5's kernels
==================  ===================================  ==========================================

The paged ones are looked up by name (``model.forward_batch(batch, pool, backend="triton")``,
``Engine(..., backend=...)``) in one registry. A backend registers itself with :func:`register`, and
the modules that need Triton are imported only when their name is first asked for. Each paged backend
says which store it needs (``store_type``) and builds it (``make_store``), so a runner makes the right
pool for the backend it was given, and a mismatched pool is refused at once, naming both.

Imports go one way: :mod:`kvcourse.model` -> backends -> :mod:`kvcourse.kernels` and the stores.
"""

from __future__ import annotations

import importlib
from typing import Protocol

import torch

from .contiguous import ContiguousBackend, KVCacheLike, NoCache

__all__ = [
    "AttentionBackend",
    "ContiguousBackend",
    "KVCacheLike",
    "NoCache",
    "backend_class",
    "backend_names",
    "register",
]


class AttentionBackend(Protocol):
    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


# name -> the module that registers it, imported on first use (Triton is heavy, and optional).
_MODULES = {
    "paged-torch": ".paged",
    "paged-reference": ".paged",
    "triton": ".triton",
    "triton-ragged": ".ragged",
    "paged-int8-torch": ".int8",
    "triton-int8": ".triton_int8",
}
_REGISTRY: dict[str, type] = {}


def register(name: str):
    """Class decorator: make a paged backend available as ``backend=name``."""

    def add(cls: type) -> type:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"a backend named {name!r} is already registered ({_REGISTRY[name].__name__})")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return add


def backend_names() -> list[str]:
    """Every paged backend name, registered or importable."""
    return sorted({*_MODULES, *_REGISTRY})


def backend_class(name: str) -> type:
    """The paged backend class called ``name`` (imports its module the first time)."""
    if not isinstance(name, str) or name not in _REGISTRY and name not in _MODULES:
        raise ValueError(f"backend must be one of {backend_names()}, got {name!r}")
    if name not in _REGISTRY:
        importlib.import_module(_MODULES[name], __name__)
    return _REGISTRY[name]
