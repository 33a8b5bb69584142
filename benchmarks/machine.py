"""What the benchmarks record about the machine they ran on, so a result file says where it came from."""

from __future__ import annotations

import datetime
import platform

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
