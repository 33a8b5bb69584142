"""Packages whose names are imported on first use (PEP 562), so that importing one part of kvcourse
does not import the rest.

``import kvcourse.paged.block_manager`` runs ``kvcourse/__init__.py`` and ``kvcourse/paged/__init__.py``
first. If those imported the model and the K/V store, the block manager could never be used without
torch. Instead each package lists which submodule holds each of its public names, and a name is
imported when it is first read: ``kvcourse.load_pretrained`` imports the loader (and torch) then.
Every package of kvcourse that exports names on first use does it with :func:`lazy_exports`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping

__all__ = ["lazy_exports"]


def lazy_exports(package: str, exports: Mapping[str, str]) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package``: ``exports`` maps a public name to the submodule
    that defines it (relative, ``".engine"``); any other name is tried as a submodule.

    A package lists its names once, in ``exports``, and its ``__all__`` is ``sorted(exports)`` (or the part
    of it that ``from package import *`` may import). No exported name may be a submodule's name too:
    importing that submodule would set the package's attribute to the module (``tests/test_import_graph.py``
    checks).
    """
    namespace = vars(sys.modules[package])

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
