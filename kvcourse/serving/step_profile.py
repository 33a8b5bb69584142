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
* on a GPU, ``kernel_launches``; ``device_busy_ms``, the time at least one kernel (or copy) was running: the
  union of the kernels' intervals, so that two that overlap count once and a ``record_function`` label's
  device span (which covers the kernels inside it) counts not at all; ``kernel_sum_ms``, their summed
  durations (above the busy time when kernels overlap); and ``gpu_idle_fraction``, the share of the step's
  wall time in which no kernel ran (:func:`idle_fraction`).

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

__all__ = ["FORWARD_SCOPE", "SYNC_OPS", "busy_time", "device_figures", "idle_fraction", "profile_step"]

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
        kernels = [
            e
            for e in events
            if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False) and e.name != FORWARD_SCOPE
        ]
        result.update(device_figures([(e.time_range.start, e.time_range.end) for e in kernels], walls))
        result["host_bound"] = result["wall_ms"] > 2 * result["device_busy_ms"]
    return result


def device_figures(intervals_us: list[tuple[float, float]], walls_s: list[float]) -> dict:
    """Per step, from the kernels' intervals (profiler microseconds) over ``len(walls_s)`` steps (wall seconds):
    ``kernel_launches``, ``device_busy_ms`` (their union), ``kernel_sum_ms`` and ``gpu_idle_fraction``."""
    steps = len(walls_s)
    return {
        "kernel_launches": len(intervals_us) / steps,
        "device_busy_ms": busy_time(intervals_us) / 1e3 / steps,
        "kernel_sum_ms": sum(end - start for start, end in intervals_us) / 1e3 / steps,
        "gpu_idle_fraction": idle_fraction(intervals_us, 1e6 * sum(walls_s)),  # both in microseconds
    }


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """How long at least one of ``intervals`` (``(start, end)`` pairs, any unit) was running: the length of
    their union. Kernels on two streams, or a kernel inside a labelled span, overlap: summing their durations
    would count that time twice (and could exceed the wall time)."""
    busy, reach = 0.0, float("-inf")  # reach: the end of the union so far
    for start, end in sorted(intervals):
        if end < start:
            raise ValueError(f"an interval ends before it starts: ({start}, {end})")
        if start > reach:
            busy += end - start
        elif end > reach:
            busy += end - reach
        reach = max(reach, end)
    return busy


def idle_fraction(intervals: list[tuple[float, float]], wall: float) -> float:
    """The share of ``wall`` (the steps' wall time, in the intervals' unit) in which no interval ran: what the
    GPU spent waiting for the host. 0 when a kernel always ran; 1 when none did."""
    if wall <= 0:
        raise ValueError(f"wall must be positive, got {wall}")
    return max(0.0, 1.0 - busy_time(intervals) / wall)


def _under(event, name: str, exact: bool = False) -> bool:
    """Whether ``event`` ran inside an event called ``name`` (``exact``) or whose name starts with it
    (``"aten::"``: called by another aten op rather than by Python)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name == name if exact else parent.name.startswith(name):
            return True
        parent = parent.cpu_parent
    return False
