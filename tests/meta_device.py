"""Device bugs caught on a CPU: the package's tensors made without a device land on ``meta``.

On a GPU, a tensor the package creates without ``device=`` lands on the CPU beside CUDA inputs, and the
first operation that mixes them fails (issue 28's crash). Without a GPU the same bug is invisible: every
tensor is on the CPU anyway. Inside :func:`package_on_meta`, a tensor that kvcourse's own code creates
without a device lands on ``meta``, which holds no data, so the bug fails loudly here too: a device
mismatch, or ``.item()`` / ``.tolist()`` of a meta tensor.

Only the package's tensors go to meta: one made by anyone else (a test, a learner's answer, a notebook
cell) lands on the CPU, torch's default, as it would in a notebook. The code that creates a tensor is the
first caller outside torch itself (so ``nn.Linear(...)`` built by the package counts as the package's).

Torch alone does not refuse every mix: indexing a CPU tensor with a meta index, or writing meta values
into it (``cpu[mask] = meta``), runs and reads or writes garbage. So any torch call that mixes meta
tensors with others raises here: a meta tensor only ever comes from a bug.

``KVCOURSE_PACKAGE_ON_META=1 pytest tests/...`` runs any test file this way (see ``tests/conftest.py``).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._pytree import tree_leaves

import kvcourse

__all__ = ["PACKAGE_DIR", "PackageOnMeta", "package_on_meta"]

PACKAGE_DIR = os.path.dirname(os.path.abspath(kvcourse.__file__)) + os.sep
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def _made_by_the_package() -> bool:
    """Whether the code creating a tensor now is kvcourse's: the first caller outside torch's own files."""
    frame = sys._getframe(2)  # the caller of __torch_function__
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    return frame is not None and frame.f_code.co_filename.startswith(PACKAGE_DIR)


class PackageOnMeta(TorchFunctionMode):
    """Tensors kvcourse creates without a device go to ``meta``; a torch call mixing meta with others raises."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _device_constructors() and kwargs.get("device") is None:
            kwargs["device"] = "meta" if _made_by_the_package() else "cpu"
        devices = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        if "meta" in devices and len(devices) > 1:
            name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
            raise RuntimeError(
                f"{name} mixes meta tensors (made without a device) with {sorted(devices - {'meta'})} ones"
            )
        return func(*args, **kwargs)


@contextmanager
def package_on_meta() -> Iterator[None]:
    """Within the block, the package's tensors made without ``device=`` land on meta (see the module doc)."""
    with PackageOnMeta():
        yield
