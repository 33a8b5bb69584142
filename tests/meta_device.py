"""Device bugs caught on a CPU: run the package with ``"meta"`` as torch's default device.

On a GPU, a tensor the package creates without ``device=`` lands on the CPU beside CUDA inputs, and the
first operation that mixes them fails (issue 28's crash). Without a GPU the same bug is invisible: every
tensor is on the CPU anyway. Inside :func:`meta_default`, the inputs are CPU tensors (made with
``device="cpu"``) but a tensor created without a device lands on ``meta``, which holds no data, so the
bug fails loudly here too: a device mismatch, or ``.item()`` / ``.tolist()`` of a meta tensor.

Meta tensors do not catch everything: indexing a CPU tensor with a meta index tensor returns garbage
instead of failing. A bug then still shows as a wrong answer or as a meta tensor read later.

A learner's answer runs as it would in a notebook (:func:`learner`): with the CPU as default device,
whatever default the check under test runs with.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["learner", "meta_default", "on_meta"]


@contextmanager
def meta_default() -> Iterator[None]:
    """Within the block, a tensor created without ``device=`` lands on ``meta`` (the previous default after)."""
    with torch.device("meta"):
        yield


def on_meta(t: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "meta"


def _on_cpu(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch.device("cpu"):  # a notebook's default device, whatever the check runs with
            return fn(*args, **kwargs)

    return run


class _LearnerKernel:
    """A learner's ``@triton.jit`` kernel: ``kernel[grid](...)`` launches it with the CPU as default device."""

    def __init__(self, kernel: Any) -> None:
        self.kernel, self.fn = kernel, kernel.fn

    def __getitem__(self, grid: Any) -> Callable:
        return _on_cpu(self.kernel[grid])


def learner(answer: Any) -> Any:
    """``answer`` (a learner's function, class or Triton kernel) running with the CPU as default device.

    A class comes back as a subclass whose methods (properties included) are wrapped; data comes back as is.
    """
    if hasattr(answer, "fn") and callable(getattr(answer, "__getitem__", None)):
        return _LearnerKernel(answer)
    if isinstance(answer, type):
        wrapped: dict[str, Any] = {}
        for klass in reversed(answer.__mro__[:-1]):  # every class but object, the most derived last
            for name, value in vars(klass).items():
                if isinstance(value, property):
                    wrapped[name] = property(_on_cpu(value.fget) if value.fget else None,
                                             _on_cpu(value.fset) if value.fset else None)  # fmt: skip
                elif inspect.isfunction(value):
                    wrapped[name] = _on_cpu(value)
        return type(answer.__name__, (answer,), wrapped)
    if callable(answer):
        return _on_cpu(answer)
    return answer
