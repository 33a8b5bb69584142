"""Where one engine step goes: wall time, device busy time, framework calls, kernel launches, waits.

:func:`profile_step` runs a step (any callable) under torch's profiler and counts:

* ``wall_ms`` -- the step's wall time (the device synchronised before and after);
* ``aten_calls`` -- every framework op the step ran, nested ones included (``aten::linear`` counts,
  and so do the ``aten::mm`` and ``aten::t`` inside it): the host's work, op by op; ``aten_calls_top``,
  only the ones Python called (not inside another aten op);
* ``sync_ops`` -- ops that read a value back from the device (``item``, ``nonzero``, ...): on a GPU
  each one makes the host wait for everything queued before it; ``forward_sync_ops``, those inside the
  model's forward (the ``ModelRunner.forward`` scope): on a CPU the others are the host reading its own
  tensors while it builds the batch, which costs no wait;
* on a GPU, ``kernel_launches`` and ``device_busy_ms`` (the summed time of the kernels the step ran).

A GPU step is **host-bound** when ``wall_ms`` is far above ``device_busy_ms``: the GPU idles between
kernels while Python prepares the next one. A CUDA graph replays all the step's kernels from one call,
so its ``aten_calls`` and launches shrink to a handful and the wall time falls toward the busy time.
Chapter 9 ("where a step goes") reads these numbers.
"""

from __future__ import annotations

import collections
import os
import time
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

# torch's profiler (Kineto) prints a timestamped line to stderr each time it starts and stops, which a notebook
# would show under every profiled cell. Level 6 keeps only its errors; read when the profiler first starts.
os.environ.setdefault("KINETO_LOG_LEVEL", "6")

__all__ = ["FORWARD_SCOPE", "SYNC_OPS", "profile_step"]

FORWARD_SCOPE = "ModelRunner.forward"  # the profiler label around the model's forward (model_runner.py)

SYNC_OPS = frozenset({"aten::item", "aten::_local_scalar_dense", "aten::nonzero", "aten::is_nonzero", "aten::equal"})


def profile_step(step: Callable[[], object], device: torch.device | str = "cpu", repeats: int = 1) -> dict:
    """Run ``step()`` ``repeats`` times under the profiler; per-step averages as a dict (see the module doc).

    The counts come from one profiled run per repeat; ``wall_ms`` from the same runs (the profiler adds
    a little overhead per op, so it is an upper bound: time unprofiled runs for absolute figures).
    """
    device = torch.device(device)
    if not callable(step):
        raise TypeError(f"step must be a callable running one step, got {type(step).__name__}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize(device)
            walls.append(time.perf_counter() - start)
    events = prof.events()
    names = collections.Counter(e.name for e in events if e.device_type.name == "CPU")
    result = {
        "wall_ms": 1e3 * sum(walls) / repeats,
        "aten_calls": sum(n for name, n in names.items() if name.startswith("aten::")) / repeats,
        "aten_calls_top": sum(e.name.startswith("aten::") and not _under(e, "aten::") for e in events) / repeats,
        "sync_ops": sum(names[name] for name in SYNC_OPS) / repeats,
        "forward_sync_ops": sum(e.name in SYNC_OPS and _under(e, FORWARD_SCOPE, exact=True) for e in events) / repeats,
    }
    if cuda:
        # Device-side events are kernels and memory copies, and also the GPU spans of record_function labels
        # (FORWARD_SCOPE); those spans overlap the kernels inside them and are not counted.
        kernels = [e for e in events if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False)
                   and e.name != FORWARD_SCOPE]  # fmt: skip
        result["kernel_launches"] = len(kernels) / repeats
        result["device_busy_ms"] = sum(e.device_time for e in kernels) / 1e3 / repeats  # device_time: microseconds
        result["host_bound"] = result["wall_ms"] > 2 * result["device_busy_ms"]
    return result



def _under(event, name: str, exact: bool = False) -> bool:
    """Whether ``event`` ran inside an event called ``name`` (``exact``) or whose name starts with it
    (``"aten::"``: called by another aten op rather than by Python)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name if exact else parent.name.startswith(name):
            return True
        parent = parent.cpu_parent
    return False
