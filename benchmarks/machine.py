"""What the benchmarks record about the machine they ran on, so a result file says where it came from,
and how busy the rest of the machine was while they measured (:class:`OtherCPU`, :func:`quiet_median`)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), e.g. ``Intel(R) Xeon(R) Processor``."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict:
    """Machine, CPU, torch threads and version, and today's date."""
    return {
        "machine": platform.machine(),
        "processor": cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
    }


def finish(res: dict, json_path: str | None, name: str) -> Path:
    """Record the load at the end, print the targets, write ``res`` to ``json_path`` (default
    ``benchmarks/results/cpu-NAME-DATE.json``) and return the path."""
    res["load_average_end"] = [round(x, 2) for x in os.getloadavg()]
    for target, value in res.get("targets", {}).items():
        print(f"  {target}: {value}")
    out = Path(json_path or f"benchmarks/results/cpu-{name}-{res['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return out


# ---- noise: how busy the rest of the machine was during a measurement ----------------------------
# On a shared machine a slow repeat is usually someone else's work, not ours. /proc/stat counts every
# core's busy time; take away our own (and any process we started on purpose, such as a neighbour)
# and what is left is the others'. Divided by the wall time: how many cores they kept busy, on average.

_TICK = os.sysconf("SC_CLK_TCK")  # jiffies per second


def _busy_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot (user+nice+system+irq+softirq+steal)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / _TICK


def _own_seconds() -> float:
    """CPU seconds this process has used, all its threads and its waited-for children included."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def process_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used (utime + stime from ``/proc/PID/stat``); 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the name, in parentheses, may hold spaces
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _TICK  # fields 14 and 15 of proc(5)


class OtherCPU:
    """Context manager: how much CPU other processes used while the block ran.

        with OtherCPU(exclude_pids=[neighbour.pid]) as load:
            run()
        load.cores   # other processes' cores busy on average during the block

    ``exclude_pids``: processes whose CPU time is expected (a neighbour started on purpose) and is not
    counted as noise. After the block: ``wall`` (s), ``other_seconds`` (CPU s), ``cores``.
    """

    def __init__(self, exclude_pids=()) -> None:
        self.exclude_pids = list(exclude_pids)

    def _ours(self) -> float:
        return _own_seconds() + sum(process_seconds(pid) for pid in self.exclude_pids)

    def __enter__(self) -> "OtherCPU":
        self._busy, self._ours0, self._t0 = _busy_seconds(), self._ours(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self._t0
        busy, ours = _busy_seconds() - self._busy, self._ours() - self._ours0
        # Jiffies are coarse (10 ms): a short block can come out slightly negative.
        self.other_seconds = max(0.0, busy - ours)
        self.cores = self.other_seconds / self.wall if self.wall > 0 else 0.0


def quiet_median(repeats: list[dict], key: str, threshold: float) -> dict:
    """The median of ``key`` over the repeats whose ``other_cores`` stayed at or under ``threshold``.

    Each repeat is a dict with ``key`` and ``other_cores``. If every repeat was noisy, the median of all
    of them, flagged ``noisy``: a number with a warning beats no number.
    """
    quiet = [r[key] for r in repeats if r["other_cores"] <= threshold]
    values = quiet or [r[key] for r in repeats]
    return {"median": statistics.median(values), "quiet": len(quiet), "dropped": len(repeats) - len(quiet),
            "noisy": not quiet}  # fmt: skip
