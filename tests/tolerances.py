"""Tolerances for comparing logits computed along two paths, from fp32's precision rather than one machine's output."""

from __future__ import annotations

import torch

# Two correct fp32 paths through 30 layers (different chunking, batching or summation order) round
# differently: about 1e-6 to 1e-5 of the largest logit here. A bug (a wrong mask, position or slot)
# moves logits by whole units. 1e-4 of the logits' scale separates the two with room on any CPU.
LOGIT_REL_TOL = 1e-4


def assert_logits_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """``got`` equals ``want`` to ``LOGIT_REL_TOL`` of ``want``'s largest magnitude."""
    scale = float(want.abs().max())
    torch.testing.assert_close(got, want, rtol=0, atol=LOGIT_REL_TOL * max(scale, 1.0))
