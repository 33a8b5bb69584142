"""Attention kernels and the torch references they must equal.

* :mod:`.reference` -- plain torch, obviously right: contiguous causal and decode attention, paged
  decode and ragged (varlen) prefill attention read through block tables, and the K/V cache write.
* :mod:`.testing` -- random ragged, paged problems with known answers (NaN in every unused slot).
* :mod:`.int8` -- int8 K/V with a scale per token and head: quantize, dequantize, the references.
* :mod:`.online_softmax` -- the online softmax and the split-KV merge, step by step in torch.
* :mod:`.roofline` -- bytes moved by decode attention, and the GPUs' published peaks.
* :mod:`.fused` -- a decoder layer's small ops in one call each (RMSNorm with its residual add, RoPE,
  SiLU-and-mul): the torch versions, and the functions the model calls, which run the Triton kernels
  of :mod:`.triton_fused` on a CUDA device (``fused.USE_TRITON = False`` turns them off).

The Triton kernels (chapter 5's, and the layer's fused ops), each beside the reference it must equal:

* :mod:`.triton_decode` -- :func:`decode_attention`, one query per sequence on a contiguous cache;
* :mod:`.triton_paged` -- :func:`paged_decode_attention` through block tables, split-KV, int8 reads;
* :mod:`.triton_cache` -- :func:`reshape_and_cache`, the K/V write (float and int8);
* :mod:`.triton_cache_fp8` -- :func:`reshape_and_cache_fp8`, the K/V write into an fp8 (e4m3) pool;
* :mod:`.split_plan` -- a decode step's split-KV work planned on the host from its real lengths, into a buffer
  :func:`~.triton_paged.paged_decode_planned` reads (what a CUDA graph can replay);
* :mod:`.triton_fused` -- a layer's small ops, one kernel each, equal to :mod:`.fused`'s torch versions:
  :func:`rms_norm`, :func:`fused_add_rms_norm`, :func:`rotary_embedding`, :func:`silu_and_mul` (vLLM's
  names; these names of this package are the kernels themselves, on the GPU or in the interpreter);
* :mod:`.triton_runtime` -- where Triton runs (GPU, or its CPU interpreter), the torch fallback, and
  :func:`kernel_runs`: how every launch ran (compiled, interpreted, or fell back to torch);
* :mod:`.compile_check` -- the kernels compiled for a T4, an A100 and an H100 without a GPU: registers,
  spills, shared memory, tensor-core instructions or not.
* :mod:`.provenance` -- where a page's kernel numbers came from: how every launch ran, and the committed
  GPU measurements (or, where there are none, the floor that vendor peak bandwidth sets);
* :mod:`.measured` -- the committed GPU runs of ``python -m kvcourse.bench kernels`` (the first: an
  NVIDIA H200), read, checked and plotted against torch's SDPA, the vendor peak and a measured copy.

The Triton names are loaded on first use, so ``import kvcourse`` works without Triton installed
(chapters 1-4).

**Where kernels run.** Without a CUDA device, Triton kernels run in Triton's CPU interpreter, which
Triton enables when ``TRITON_INTERPRET=1`` is set *before Triton is imported* (Triton decorates its
own library functions at import). Torch imports Triton by itself (``torch._dynamo`` does, when it
finds the package), so this is the one place that decides, as ``import kvcourse`` runs: no CUDA
device and no ``TRITON_INTERPRET`` of your own -> ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib
import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton (see the module doc)

from .reference import (
    causal_attention,
    decode_attention_ref,
    paged_attention,
    paged_decode_attention_ref,
    paged_prefill_attention_ref,
    position_masked_attention,
    repeat_kv,
    reshape_and_cache_ref,
)

# name -> the module that defines it; imported (with Triton) only when the name is first used
_TRITON_NAMES = {
    "decode_attention": ".triton_decode",
    "paged_decode_attention": ".triton_paged",
    "paged_decode_attention_int8": ".triton_paged",
    "paged_decode_attention_fp8": ".triton_paged",
    "choose_num_splits": ".triton_paged",
    "reshape_and_cache": ".triton_cache",
    "reshape_and_cache_int8": ".triton_cache",
    "reshape_and_cache_fp8": ".triton_cache_fp8",
    "paged_decode_planned": ".triton_paged",
    "rms_norm": ".triton_fused",
    "fused_add_rms_norm": ".triton_fused",
    "rotary_embedding": ".triton_fused",
    "silu_and_mul": ".triton_fused",
    "fallbacks": ".triton_runtime",
    "interpreting": ".triton_runtime",
    "kernel_runs": ".triton_runtime",
}

__all__ = [
    "causal_attention",
    "decode_attention_ref",
    "paged_attention",
    "paged_decode_attention_ref",
    "paged_prefill_attention_ref",
    "position_masked_attention",
    "repeat_kv",
    "reshape_and_cache_ref",
]  # the Triton names are left out, so `from kvcourse.kernels import *` works without Triton


def __getattr__(name: str):
    if name in _TRITON_NAMES:
        value = getattr(importlib.import_module(_TRITON_NAMES[name], __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_TRITON_NAMES))
