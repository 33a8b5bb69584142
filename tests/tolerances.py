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


def top1_margins(logits: torch.Tensor) -> torch.Tensor:
    """The gap between the largest and the second-largest logit, per row of ``logits [..., vocab]``."""
    top2 = logits.topk(2, dim=-1).values
    return top2[..., 0] - top2[..., 1]


def decided_steps(margins: torch.Tensor, shift: float) -> torch.Tensor:
    """Which greedy decisions no perturbation of at most ``shift`` per logit can flip.

    Moving every logit by at most ``shift`` changes the gap between any two by at most ``2 * shift``, so an argmax
    whose margin exceeds that is the same on any CPU and through any quantizer that stays within ``shift``; a closer
    call may go either way and proves nothing about the code under test.
    """
    return margins > 2 * shift
