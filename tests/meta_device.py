"""Device bugs caught on a CPU: run the package with ``"meta"`` as torch's default device.

On a GPU, a tensor the package creates without ``device=`` lands on the CPU beside CUDA inputs, and the
first operation that mixes them fails (issue 28's crash). Without a GPU the same bug is invisible: every
tensor is on the CPU anyway. Inside :func:`meta_default`, the inputs are CPU tensors (made with
``device="cpu"``) but a tensor created without a device lands on ``meta``, which holds no data, so the
bug fails loudly here too: a device mismatch, or ``.item()`` / ``.tolist()`` of a meta tensor.

Torch alone does not refuse every mix: indexing a CPU tensor with a meta index, or writing meta values into
it (``cpu[mask] = meta``), runs and reads or writes garbage. So :func:`meta_default` also refuses any torch
call that mixes meta tensors with others (:class:`NoMixing`): a meta tensor only ever comes from a bug here.

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
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

__all__ = ["NoMixing", "learner", "meta_default", "on_meta"]


class NoMixing(TorchFunctionMode):
    """Raise ``RuntimeError`` at any torch call whose tensors are partly on ``meta``, partly elsewhere."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if "meta" in devices and len(devices) > 1:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise RuntimeError(f"{name} mixes meta tensors (made without a device) with {sorted(devices - {'meta'})} ones")
        return func(*args, **kwargs)


@contextmanager
def meta_default() -> Iterator[None]:
    """Within the block, a tensor created without ``device=`` lands on ``meta`` (the previous default after),
    and a torch call that mixes it with tensors of another device raises."""
    with torch.device("meta"), NoMixing():
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
