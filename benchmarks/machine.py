"""What the benchmarks record about the machine they ran on, so a result file says where it came from."""

from __future__ import annotations

import datetime
import json
import os
import platform
import sys
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
