"""Small helpers every chapter notebook uses: seeding, device choice, gluing numbers into prose."""

from __future__ import annotations

import os
import random

import numpy as np
import torch

__all__ = ["check_config", "seed_everything", "default_device", "glue", "in_colab"]


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch so re-executed notebooks print the same numbers."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))


def default_device() -> torch.device:
    """CUDA when a GPU is present (Colab), else CPU (a laptop, CI)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def in_colab() -> bool:
    import sys

    return "COLAB_RELEASE_TAG" in os.environ or "google.colab" in sys.modules


def glue(name: str, value, display: bool = False):
    """Make ``value`` quotable in the notebook's markdown as ``{glue:text}`name```.

    Uses myst-nb's ``glue`` when it is installed (building the book); elsewhere
    (Colab) it just returns the value, so notebooks run unchanged.
    """
    try:
        from myst_nb import glue as _glue
    except ImportError:
        return value
    _glue(name, value, display=display)
    return value


_CONFIG_FIELDS = ("num_hidden_layers", "num_key_value_heads", "head_dim", "max_position_embeddings")


def check_config(config: object, name: str = "config") -> None:
    """Raise a clear ``TypeError`` unless ``config`` is a model config (``model.config``), not the model."""
    if isinstance(config, torch.nn.Module):
        raise TypeError(f"{name} must be the model's config (model.config), got the model itself")
    missing = [f for f in _CONFIG_FIELDS if not hasattr(config, f)]
    if missing:
        raise TypeError(
            f"{name} must be a kvcourse.LlamaConfig (model.config), got {type(config).__name__} without {missing}"
        )
