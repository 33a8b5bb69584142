"""Where Triton comes from, where its kernels run, and what happens when one cannot compile.

Every ``triton_*`` module of :mod:`kvcourse.kernels` imports Triton through this module, so one place
decides how kernels run:

* **On a CUDA GPU** Triton compiles each kernel to machine code the first time it is launched.
  (They compile for sm_75, sm_80 and sm_90 on a CPU, see :mod:`~kvcourse.bench.compile_check`; they
  have run and been timed on one GPU, an NVIDIA H200 (sm_90), see :mod:`~kvcourse.bench.measured`. On
  sm_75 (a T4) and sm_80 they have only been compiled, never run.)
* **Without a CUDA device** (a laptop, CI) ``import kvcourse`` has set ``TRITON_INTERPRET=1`` before
  anything imported Triton (:mod:`kvcourse.kernels` explains why it happens there). Triton then
  decorates every ``@triton.jit`` function as an *interpreted* function: each program of the grid
  runs one after another in Python, each ``tl.`` operation on NumPy arrays. Same kernel source, same
  results (bf16 arithmetic aside, see :func:`upcast`), thousands of times slower.

A kernel that cannot compile on the reader's GPU (too much shared memory on a T4, an instruction an
old architecture lacks) must not end the chapter: :func:`launch_or_fallback` catches *compilation*
failures, warns once in one line saying why, and runs the torch reference instead. Any other error
(a bug, bad input) propagates. A fallback must never pass for the kernel: every launch is counted by
how it ran (:func:`kernel_runs`: ``"compiled"``, ``"interpreter"`` or ``"fallback"``), and the
chapter, the ``triton`` backends and ``python -m kvcourse.bench kernels`` read those counts.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "kvcourse's Triton kernels need the triton package: pip install 'kvcourse[triton]' "
        "(chapters 1-4 run without it)"
    ) from exc

from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError
from triton.runtime.interpreter import InterpretedFunction

__all__ = [
    "KernelFallbackWarning",
    "check_kernel_device",
    "compute_capability",
    "counting_runs",
    "fallbacks",
    "interpreting",
    "kernel_device",
    "kernel_runs",
    "launch_or_fallback",
    "reset_fallbacks",
    "reset_kernel_runs",
    "tl",
    "triton",
]

T = TypeVar("T")


def interpreting() -> bool:
    """True when kernels run in Triton's CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)  # Triton >= 3.4; older versions read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


if interpreting() != isinstance(tl.cdiv, InterpretedFunction):
    # Triton's own library was decorated under the other mode: kernels would fail at their first call.
    raise ImportError(
        "Triton was imported before TRITON_INTERPRET was settled: import kvcourse before anything that "
        "imports Triton (torch.compile does), or set TRITON_INTERPRET=1 (CPU) or 0 (GPU) in the environment"
    )


def _index_loaded_scalars_in_the_interpreter() -> bool:
    """Let a loaded scalar bound a ``range`` in Triton's interpreter, as it does compiled code.

    ``for start in range(0, tl.load(Seq_lens + b), BLOCK_N)`` is how our kernels (and chapter 5's exercises)
    walk a sequence. Triton's interpreter up to 3.6 (what Colab and the course's first GPU machine ship) holds
    that scalar as a one-element array and converts it with ``int()``, which NumPy 2 refuses ("only
    0-dimensional arrays can be converted to Python scalars"); later versions squeeze it first. This applies
    the same fix to the older interpreter: it wraps the private ``_patch_lang_tensor``, so it is skipped, and
    returns False, wherever that function is missing. Returns True when the patch is in place.
    """
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - depends on the Triton version
        return False
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "squeezes_scalars", False):
        return original is not None

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.squeezes_scalars = True
    interpreter._patch_lang_tensor = patched
    return True


if interpreting():
    _index_loaded_scalars_in_the_interpreter()


def kernel_device() -> torch.device:
    """Where this process's kernels take their tensors: the CPU in Triton's interpreter, else the GPU."""
    return torch.device("cpu" if interpreting() else "cuda")


def upcast(dtype: torch.dtype) -> bool:
    """Whether a kernel must convert its loads to float32 before computing on them.

    Triton's interpreter stores bfloat16 as raw 16-bit integers and its arithmetic on them gives
    wrong numbers (triton issue 11584). Kernels load bf16 and compute in fp32 there; compiled, they
    keep bf16 operands with fp32 accumulation, as they do for fp16. Those dots become tensor-core
    ``mma`` instructions on sm_80 and newer; on sm_75 (a T4, which has no bf16 arithmetic) Triton
    compiles them to fp32 FMA instructions (:mod:`~kvcourse.bench.compile_check` reads the PTX).
    """
    return dtype == torch.bfloat16 and interpreting()


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s ``input_precision``: exact fp32 products for fp32 inputs.

    On NVIDIA GPUs ``tl.dot`` rounds fp32 inputs to TF32 (10-bit mantissa) by default, 1e-3 relative
    error: too coarse for the 1e-5 the fp32 tests ask. fp16/bf16 inputs are multiplied exactly.
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def compute_capability(device: torch.device) -> int | None:
    """The CUDA compute capability kernels compile for on ``device`` as one int (75 for sm_75, a T4);
    ``None`` when they run in Triton's interpreter.

    Launch parameters depend on it (:func:`~kvcourse.kernels.triton_decode.tile_config`): a T4 has
    64 KiB of shared memory per block and no tensor-core path for these dots in Triton.
    """
    if interpreting() or device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def check_kernel_device(name: str, t: torch.Tensor) -> None:
    """Raise ``ValueError`` unless ``t`` lives where this process runs kernels (CPU if interpreting, else CUDA)."""
    if interpreting():
        if t.device.type != "cpu":
            raise ValueError(f"{name} is on {t.device}, but Triton runs in its CPU interpreter here: use CPU tensors")
    elif t.device.type != "cuda":
        raise ValueError(
            f"{name} is on {t.device}, but Triton compiles for the GPU here: move the tensors to 'cuda' "
            "(or set TRITON_INTERPRET=1 before importing kvcourse.kernels to run kernels on the CPU)"
        )


# ---------------------------------------------------------------------------------------------
# Falling back to the torch reference when a kernel cannot compile
# ---------------------------------------------------------------------------------------------
class KernelFallbackWarning(RuntimeWarning):
    """A Triton kernel could not compile here; the torch reference computed the result instead."""


_FALLBACKS: dict[tuple, str] = {}  # (kernel, device, config...) -> why it fell back


def fallbacks() -> dict[tuple, str]:
    """Kernels that fell back to torch in this process, each with the reason (empty when all compiled)."""
    return dict(_FALLBACKS)


def reset_fallbacks() -> None:
    """Forget earlier fallbacks, so the next launch tries to compile again (tests, or after a driver fix)."""
    _FALLBACKS.clear()


RUN_KINDS = ("compiled", "interpreter", "fallback")
_RUNS: Counter = Counter()  # (kernel, how it ran) -> launches in this process


def kernel_runs() -> dict[str, dict[str, int]]:
    """How each kernel launched in this process ran: ``{kernel: {"compiled" | "interpreter" | "fallback": count}}``.

    ``"compiled"``: Triton machine code on the GPU; ``"interpreter"``: the same kernel in Triton's CPU
    interpreter; ``"fallback"``: the kernel could not compile and the torch reference computed the result.
    """
    out: dict[str, dict[str, int]] = {}
    for (kernel, how), n in sorted(_RUNS.items()):
        out.setdefault(kernel, {})[how] = n
    return out


def reset_kernel_runs() -> None:
    """Start counting :func:`kernel_runs` afresh."""
    _RUNS.clear()


_COLLECTORS: list[Counter] = []


@contextmanager
def counting_runs(runs: Counter) -> Iterator[Counter]:
    """Inside the block, also count every launch in ``runs`` (``(kernel, how) -> launches``): one step's record."""
    _COLLECTORS.append(runs)
    try:
        yield runs
    finally:
        _COLLECTORS.remove(runs)


def how_kernels_run() -> str:
    """``"compiled"`` on a GPU, ``"interpreter"`` in Triton's CPU interpreter."""
    return "interpreter" if interpreting() else "compiled"


_COMPILE_ERRORS = (CompilationError, OutOfResources, PTXASError)
_COMPILER_DIRS = (f"{os.sep}triton{os.sep}compiler{os.sep}", f"{os.sep}triton{os.sep}backends{os.sep}")


def is_compile_failure(exc: BaseException) -> bool:
    """True if ``exc`` came out of Triton's compiler (not out of the kernel's inputs or our own code)."""
    if isinstance(exc, _COMPILE_ERRORS):
        return True
    # Backends raise plain RuntimeErrors too ("PassManager::run failed" on an unsupported GPU):
    # recognise them by where they were raised.
    frames = traceback.extract_tb(exc.__traceback__)
    return any(any(d in f.filename for d in _COMPILER_DIRS) for f in frames)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} (sm_{props.major}{props.minor})"
    return str(device)


def launch_or_fallback(
    kernel: str,
    device: torch.device,
    config: tuple,
    launch: Callable[[], T],
    reference: Callable[[], T],
) -> T:
    """Run ``launch()``; if the kernel cannot compile, warn once and return ``reference()`` instead.

    ``config`` names what the compiled code depends on (dtype, head dim, tile sizes...), so a kernel
    that fails for one configuration still runs natively for the others. Each call is counted in
    :func:`kernel_runs` (and in every ``Counter`` a :func:`counting_runs` block has open).
    """
    key = (kernel, str(device), *config)

    def count(how: str) -> None:
        for counter in (_RUNS, *_COLLECTORS):
            counter[(kernel, how)] += 1

    if key in _FALLBACKS:
        count("fallback")
        return reference()
    try:
        out = launch()
        count(how_kernels_run())
        return out
    except Exception as exc:
        if not is_compile_failure(exc):
            raise
        last_line = (str(exc).strip().splitlines() or [""])[-1][:200]  # compiler messages end with the cause
        reason = f"{type(exc).__name__}: {last_line}"
        _FALLBACKS[key] = reason
        warnings.warn(
            f"{kernel} could not compile on {_device_name(device)} ({reason}); using the torch reference instead",
            KernelFallbackWarning,
            stacklevel=3,
        )
        count("fallback")
        return reference()
