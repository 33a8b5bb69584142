"""Argument checks shared by the whole package: one place that says what "an int >= 1" means.

Every public function checks what it is given and raises an error that names the argument, so a
mistake fails where it was made, not three calls later with ``'str' object is not callable``. The
rules, once:

* an **int** is a Python ``int`` or a NumPy integer (``np.int64`` from an array is a fine token id),
  never a ``bool`` (``True`` is an ``int`` to Python, but ``layer_idx=True`` is a mistake);
* a **float** is any real number, ints included, never a ``bool``; NaN is never accepted, and
  infinity only where ``finite=False`` says so;
* a **bool** is ``True`` or ``False`` (or ``np.bool_``), never a string: ``"no"`` is truthy;
* a wrong *type* raises ``TypeError``, a value out of range ``ValueError``; both messages name the
  argument, say what was expected and show what came instead.

Each ``check_*`` returns the value converted to the plain Python type (``np.int64(5)`` -> ``5``), so
callers keep what it returns.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, TypeVar

try:
    import numpy as np
except ImportError:  # the control plane (kvcourse.control) runs without numpy too: in a browser, under Pyodide
    np = None

if TYPE_CHECKING:
    import torch

__all__ = [
    "check_bool",
    "check_callable",
    "check_choice",
    "check_fits_in_memory",
    "check_finite",
    "check_float",
    "check_hashable",
    "check_float_dtype",
    "check_int",
    "check_ints",
    "check_token_ids",
    "is_int",
]

T = TypeVar("T")
_INTS = (int,) if np is None else (int, np.integer)
_BOOLS = (bool,) if np is None else (bool, np.bool_)


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def is_int(value: object) -> bool:
    """An ``int`` or a NumPy integer, and not a ``bool``."""
    return isinstance(value, _INTS) and not isinstance(value, _BOOLS)


def _range_text(kind: str, min: float | None, max: float | None, min_open: bool = False, max_open: bool = False) -> str:
    if min is not None and max is not None:
        return f"{kind} in {'(' if min_open else '['}{min}, {max}{')' if max_open else ']'}"
    if min is not None:
        return f"{kind} {'>' if min_open else '>='} {min}"
    if max is not None:
        return f"{kind} {'<' if max_open else '<='} {max}"
    return kind


def check_int(
    name: str, value: object, *, min: int | None = None, max: int | None = None, none_ok: bool = False
) -> int | None:
    """``value`` as an ``int`` in ``[min, max]`` (either bound may be ``None``: unbounded).

    ``none_ok``: ``None`` is accepted too and returned as is (an optional limit).
    """
    if none_ok and value is None:
        return None
    if is_int(value) and (min is None or value >= min) and (max is None or value <= max):
        return int(value)  # the common case, on every step's hot path: no message built
    expected = _range_text("an int", min, max) + (" or None" if none_ok else "")
    if not is_int(value):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {_shown(value)}")
    raise ValueError(f"{name} must be {expected}, got {int(value)}")


def check_ints(*, min: int = 1, **values: object) -> None:
    """:func:`check_int` of every ``name=value`` given, each at least ``min`` (a shape's sizes, checked at once)."""
    for name, value in values.items():
        check_int(name, value, min=min)


def check_float_dtype(name: str, dtype: object) -> None:
    """Raise ``TypeError`` unless ``dtype`` is a floating-point ``torch.dtype`` (what a K/V store may hold)."""
    import torch

    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point torch.dtype, got {dtype!r}")


def check_float(name: str, value: object, *, min: float | None = None, max: float | None = None,
                min_open: bool = False, max_open: bool = False, finite: bool = True) -> float:  # fmt: skip
    """``value`` as a ``float`` between ``min`` and ``max`` (inclusive unless ``min_open`` / ``max_open``).

    NaN is always refused; ``inf`` only passes with ``finite=False`` (and the bounds allowing it).
    """
    expected = _range_text("a finite number" if finite else "a number", min, max, min_open, max_open)
    if isinstance(value, _BOOLS) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {_shown(value)}")
    value = float(value)
    if math.isnan(value) or (finite and math.isinf(value)):
        raise ValueError(f"{name} must be {expected}, got {value}" + ("" if math.isnan(value) else " (not finite)"))
    low = min is not None and (value <= min if min_open else value < min)
    high = max is not None and (value >= max if max_open else value > max)
    if low or high:
        raise ValueError(f"{name} must be {expected}, got {value}")
    return value


def check_finite(name: str, t: torch.Tensor, why: str) -> None:
    """Raise ``ValueError`` if tensor ``t`` holds an inf or a NaN (``why``: what they would break)."""
    import torch

    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        raise ValueError(f"{name} has {int(bad.sum())} non-finite values (inf or NaN): {why}")


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False``; a string such as ``"no"`` or a number is refused."""
    if not isinstance(value, _BOOLS):
        raise TypeError(f"{name} must be a bool (True or False), got {type(value).__name__} {_shown(value)}")
    return bool(value)


def check_choice(name: str, value: T, choices: Collection[T]) -> T:
    """``value`` if it is one of ``choices``."""
    try:
        ok = value in choices
    except TypeError:  # an unhashable value asked of a set
        ok = False
    if not ok:
        raise ValueError(f"{name} must be one of {sorted(choices, key=repr)}, got {_shown(value)}")
    return value


def check_callable(name: str, value: object, what: str = "a function") -> Callable:
    if not callable(value):
        raise TypeError(f"{name} must be {what} (callable), got {type(value).__name__} {_shown(value)}")
    return value


def check_hashable(name: str, value: T) -> T:
    """``value`` if it can be a dict key: ``hash`` is tried, so ``(1, [2])`` is refused too."""
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{name} must be hashable (usable as a dict key), got {type(value).__name__} {_shown(value)}"
        ) from None
    return value


def check_token_ids(name: str, ids: object, vocab_size: int, *, hint: str = " (use tok.encode(text))") -> list[int]:
    """``ids`` (a list, tuple, 1-D tensor or array of token ids) as a non-empty list of ints in
    ``[0, vocab_size)``."""
    import numpy as np  # here, not at the top: the block manager uses this module and needs neither
    import torch

    if isinstance(ids, (torch.Tensor, np.ndarray)):
        if ids.ndim != 1:
            raise ValueError(f"{name} must be a 1-D list of token ids, got an array of shape {tuple(ids.shape)}")
        if ids.dtype in (torch.bool, np.bool_) or not (
            (isinstance(ids, torch.Tensor) and not ids.is_floating_point() and not ids.is_complex())
            or (isinstance(ids, np.ndarray) and np.issubdtype(ids.dtype, np.integer))
        ):
            raise TypeError(f"{name} must hold integer token ids, got an array of {ids.dtype}")
        ids = ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise TypeError(f"{name} must be a list of token ids{hint}, got {type(ids).__name__}")
    ids = list(ids)
    if not ids:
        raise ValueError(f"{name} is empty: it needs at least one token id")
    not_ints = [t for t in ids if not is_int(t)]
    if not_ints:
        raise TypeError(f"{name} must hold int token ids, got {type(not_ints[0]).__name__} {_shown(not_ints[0])}")
    ids = [int(t) for t in ids]
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{name} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
    return ids


def available_memory(device: torch.device | str) -> int | None:
    """Bytes that can still be allocated on ``device`` (free GPU memory; available RAM), or ``None``
    where the system does not say."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:  # Linux: what the kernel can hand out without swapping (free + reclaimable caches)
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # other Unix: physical memory, an upper bound
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def check_fits_in_memory(name: str, nbytes: int, device: torch.device | str, what: str) -> None:
    """Raise ``ValueError`` if allocating ``nbytes`` on ``device`` cannot succeed, before trying:
    a pool too big for memory would otherwise be killed by the OS, not refused."""
    import torch

    free = available_memory(device)
    if free is not None and nbytes > free:
        raise ValueError(
            f"{name}: {what} needs {nbytes / 2**30:,.2f} GiB but only {free / 2**30:,.2f} GiB is available on "
            f"{torch.device(device)}"
        )
