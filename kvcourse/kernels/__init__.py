"""Attention kernels and the torch references they must equal.

* :mod:`.reference` -- plain torch, obviously right: contiguous causal and decode attention, paged
  decode and ragged (varlen) prefill attention read through block tables, and the K/V cache write.
* :mod:`.testing` -- random ragged, paged problems with known answers (NaN in every unused slot).
* :mod:`.int8` -- int8 K/V with a scale per token and head: quantize, dequantize, the references.
* :mod:`.online_softmax` -- the online softmax and the split-KV merge, step by step in torch.
* :mod:`.roofline` -- bytes moved by decode attention, and the GPUs' published peaks.
* :mod:`.fused` -- a decoder layer's small ops in one call each (RMSNorm with its residual add, RoPE,
  SiLU-and-mul): the functions the model calls, which run the Triton kernels of :mod:`.triton_fused`
  on a CUDA device (``fused.USE_TRITON = False`` turns them off) and their torch versions
  (:mod:`.fused_torch`) anywhere else.

The Triton kernels (chapter 5's, and the layer's fused ops), each beside the reference it must equal:

* :mod:`.triton_decode` -- :func:`decode_attention`, one query per sequence on a contiguous cache;
* :mod:`.triton_paged` -- :func:`paged_decode_attention` through block tables, split-KV, int8 reads;
* :mod:`.triton_cache` -- :func:`reshape_and_cache`, the K/V write (float, int8 and fp8 (e4m3) pools);
* :mod:`.split_plan` -- a decode step's split-KV work planned on the host from its real lengths, into a buffer
  :func:`~.triton_paged.paged_decode_planned` reads (what a CUDA graph can replay);
* :mod:`.triton_fused_decode` -- :func:`rope_cache_decode`, a decode step's attention in one launch a layer: RoPE
  of q and k, the cache write, the planned paged read and the merge of split sequences;
* :mod:`.triton_fused` -- a layer's small ops, one kernel each, equal to :mod:`.fused_torch`'s versions:
  :func:`rms_norm`, :func:`fused_add_rms_norm`, :func:`rotary_embedding`, :func:`silu_and_mul` (vLLM's
  names; these names of this package are the kernels themselves, on the GPU or in the interpreter);
* :mod:`.triton_runtime` -- where Triton runs (GPU, or its CPU interpreter), the torch fallback, and
  :func:`kernel_runs`: how every launch ran (compiled, interpreted, or fell back to torch).

The tools that measure these kernels (compiled without a GPU, timed on one, and where a page's
numbers came from) are in :mod:`kvcourse.bench`; no kernel imports them.

The Triton names are loaded on first use, so ``import kvcourse`` works without Triton installed
(chapters 1-4).

**Where kernels run.** Without a CUDA device, Triton kernels run in Triton's CPU interpreter, which
Triton enables when ``TRITON_INTERPRET=1`` is set *before Triton is imported* (Triton decorates its
own library functions at import). Torch imports Triton by itself (``torch._dynamo`` does, when it
finds the package), so this is the one place that decides, as ``import kvcourse`` runs: no CUDA
device and no ``TRITON_INTERPRET`` of your own -> ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before anything imports Triton (see the module doc)

from ..lazy import lazy_exports

# name -> the module that defines it, imported when the name is first read: the references need only torch
_REFERENCES = dict.fromkeys(
    [
        "causal_attention",
        "decode_attention_ref",
        "paged_attention",
        "paged_decode_attention_ref",
        "paged_prefill_attention_ref",
        "position_masked_attention",
        "repeat_kv",
        "reshape_and_cache_ref",
    ],
    ".reference",
)
# the Triton kernels import Triton with their module
_TRITON_NAMES = {
    "decode_attention": ".triton_decode",
    "paged_decode_attention": ".triton_paged",
    "paged_decode_attention_int8": ".triton_paged",
    "paged_decode_attention_fp8": ".triton_paged",
    "choose_num_splits": ".triton_paged",
    "reshape_and_cache": ".triton_cache",
    "reshape_and_cache_int8": ".triton_cache",
    "reshape_and_cache_fp8": ".triton_cache",
    "paged_decode_planned": ".triton_paged",
    "rope_cache_decode": ".triton_fused_decode",
    "rms_norm": ".triton_fused",
    "fused_add_rms_norm": ".triton_fused",
    "rotary_embedding": ".triton_fused",
    "silu_and_mul": ".triton_fused",
    "fallbacks": ".triton_runtime",
    "interpreting": ".triton_runtime",
    "kernel_runs": ".triton_runtime",
}
__getattr__, __dir__ = lazy_exports(__name__, {**_REFERENCES, **_TRITON_NAMES})
__all__ = sorted(_REFERENCES)  # the Triton names are left out, so `from kvcourse.kernels import *` works without Triton
