"""Pin the K/V a quantized cache is given to those a reference run computed, so two paths quantize the same floats.

Why this exists: a CPU's matmul kernels round the last bit differently for different shapes (a whole prompt against
the same prompt in chunks, a contiguous batch against a packed one) and differently on AMD and Intel. Before a
quantizer that is harmless; after it, a value within one ulp of a step boundary lands in the neighbouring bucket on
one path and not the other, and the logits then differ by what a whole quantization step does, not by fp32 noise.
Comparing two quantized paths is only meaningful when both quantize the *same* K/V.

``KVPins`` records the K/V of the first run, position by position, and hands exactly those back to every later run
(after checking that what the later run computed agrees to fp32 precision, so a wrong position, mask or slot still
fails). Everything after the quantizer is then a comparison of continuous fp32 computations, checked with
``tests.tolerances`` like any other.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tests.tolerances import LOGIT_REL_TOL


class KVPins:
    """Per (layer, position) K/V: recorded on a position's first visit, returned unchanged on every later one."""

    def __init__(self) -> None:
        self._kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, layer_idx: int, positions: Sequence[int], k: torch.Tensor, v: torch.Tensor):
        """``k, v [T, H_kv, D]`` at ``positions [T]`` -> the pinned ``k, v`` for those positions."""
        keys = [(layer_idx, int(p)) for p in positions]
        seen = [key in self._kv for key in keys]
        if not any(seen):  # the reference run: remember what it computed
            for i, key in enumerate(keys):
                self._kv[key] = (k[i].detach().clone(), v[i].detach().clone())
            return k, v
        assert all(seen), f"layer {layer_idx}: positions {list(positions)} were only partly recorded"
        pinned_k = torch.stack([self._kv[key][0] for key in keys]).to(k.dtype)
        pinned_v = torch.stack([self._kv[key][1] for key in keys]).to(v.dtype)
        for name, got, want in (("k", k, pinned_k), ("v", v, pinned_v)):
            # What this run computed must be the reference's K/V up to fp32 rounding through the layers below.
            scale = max(float(want.abs().max()), 1.0)
            torch.testing.assert_close(
                got,
                want,
                rtol=0,
                atol=LOGIT_REL_TOL * scale,
                msg=lambda m, n=name: f"layer {layer_idx} {n} differs from the reference: {m}",
            )
        return pinned_k, pinned_v


class PinnedUpdates:
    """Mixin for a contiguous cache whose ``update(layer_idx, k, v)`` (``[1, H_kv, T, D]``) stores pinned K/V.

    ``cache = Cls.for_model(config, ...).pin(pins)``; list it before the cache class so its ``update`` runs first.
    """

    def pin(self, pins: KVPins):
        self.pins, self.fed = pins, [0] * self.num_layers
        return self

    def update(self, layer_idx, k, v):
        start, t = self.fed[layer_idx], k.shape[2]
        self.fed[layer_idx] += t
        k, v = self.pins(layer_idx, range(start, start + t), k[0].transpose(0, 1), v[0].transpose(0, 1))
        return super().update(layer_idx, k.transpose(0, 1)[None], v.transpose(0, 1)[None])
