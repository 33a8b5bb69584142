"""Packages whose names are imported on first use (PEP 562), so that importing one part of kvcourse
does not import the rest.

``import kvcourse.paged.block_manager`` runs ``kvcourse/__init__.py`` and ``kvcourse/paged/__init__.py``
first. If those imported the model and the K/V store, the block manager could never be used without
torch. Instead each package lists which submodule holds each of its public names, and a name is
imported when it is first read: ``kvcourse.load_pretrained`` imports the loader (and torch) then.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


class _Package(types.ModuleType):
    """A package whose exported names win over its submodules of the same name.

    ``kvcourse.generate`` is a function defined in the submodule ``kvcourse/generate.py``. Importing that
    submodule makes Python set the package's attribute ``generate`` to the module; an eager ``__init__``
    then put the function back with ``from .generate import generate``. Here the attribute is set to the
    export instead, whenever the import system sets it.
    """

    _exports: Mapping[str, str] = {}

    def __setattr__(self, name: str, value) -> None:
        if (name in self._exports and isinstance(value, types.ModuleType)
                and value.__name__ == f"{self.__name__}.{name}"):  # fmt: skip
            value = getattr(value, name)
        super().__setattr__(name, value)


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps a public name to the submodule
    that defines it (relative, ``".engine"``); any other name is tried as a submodule."""
    module = sys.modules[package]
    module.__class__ = _Package
    module._exports = dict(exports)
    namespace = vars(module)

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name], package), name)
            namespace[name] = value  # found once: later reads do not come here
            return value
        try:
            return importlib.import_module(f".{name}", package)
        except ModuleNotFoundError as exc:
            if exc.name != f"{package}.{name}":
                raise  # the submodule exists but something it imports does not
            raise AttributeError(f"module {package!r} has no attribute {name!r}") from None

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
