"""Small helpers every chapter notebook uses: seeding, device choice, gluing numbers into prose."""

from __future__ import annotations

import os
import random
import re

import numpy as np
import torch

__all__ = ["approx", "check_config", "cpu_model", "seed_everything", "default_device", "describe_device", "glue",
           "show_source", "synchronize"]  # fmt: skip


def seed_everything(seed: int = 0) -> None:
    """Seed Python, NumPy and torch so re-executed notebooks print the same numbers."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    os.environ.setdefault("PYTHONHASHSEED", str(seed))


def default_device() -> torch.device:
    """CUDA when a GPU is present (Colab), else CPU (a laptop, CI)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def synchronize(device: torch.device | str) -> None:
    """Wait for the work queued on ``device``: a GPU runs kernels asynchronously, so a timer read right
    after a call measures only the launch. Nothing to wait for on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def describe_device(device: torch.device | str) -> str:
    """What a timing ran on, to print beside it: the GPU's name, or the CPU and its torch threads."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, e.g. ``AMD EPYC 7B13``), else what ``platform`` knows."""
    import platform

    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def glue(name: str, value, display: bool = False) -> None:
    """Make ``value`` quotable in the notebook's markdown as ``{glue:text}`name```.

    Uses myst-nb's ``glue`` when it is installed (building the book); elsewhere (Colab) it does
    nothing, so notebooks run unchanged. It returns nothing: a cell that ends with it shows no
    ``Out:`` value outside the book.
    """
    try:
        from myst_nb import glue as _glue
    except ImportError:
        return
    _glue(name, value, display=display)


# Marks a number whose last digits depend on the CPU: see approx(). book/nbval-sanitize.cfg's
# [cpu-dependent-digits] rule replaces what follows it, so nbval compares the rest of the line.
APPROX_MARK = "≈"


def approx(value: float, spec: str = ".3g") -> str:
    """``value`` formatted with ``spec`` behind a ``≈``: its last digits may differ on another CPU.

    Use it for numbers measured *through a discontinuity*: a quantizer, an argmax, a top-k or a threshold.
    Two CPUs (AMD and Intel; or one CPU given another batch shape) round a matmul's last bit differently;
    that is invisible in fp32 logits, but a value one ulp from a quantization step then lands in the next
    bucket, and a perplexity, a top-1 agreement or a greedy continuation moves in its last printed digit.
    The notebook asserts such numbers with a tolerance for that, and nbval skips the digits behind the mark.
    """
    return APPROX_MARK + format(value, spec)


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


def show_source(*functions) -> object:
    """The package's own source of ``functions``, as a Markdown code block a notebook displays.

    A chapter quotes the engine this way rather than copying it, so the page shows the code that runs;
    ``tests/test_book.py`` checks that the committed output still matches the package.
    """
    import inspect

    from IPython.display import Markdown

    return Markdown("\n\n".join(f"```python\n{strip_pragmas(inspect.getsource(f))}```" for f in functions))


# Comments for the project's tools (formatter, linters), not for a reader: a quoted function is shown without them.
_PRAGMA = re.compile(r"[ \t]*#[ \t]*(?:fmt:[ \t]*(?:skip|off|on)|noqa\b|type:[ \t]*ignore\b)[^\n]*$", re.M)


def strip_pragmas(source: str) -> str:
    """``source`` without trailing ``# fmt: skip``, ``# noqa ...`` and ``# type: ignore`` comments (the code is unchanged)."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a str, got {type(source).__name__}")
    return _PRAGMA.sub("", source)
