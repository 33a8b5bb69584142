"""`make other-cpu` really runs other kernels: torch's own (ATen), MKL's and oneDNN's.

CI runs on an AMD EPYC and on an Intel Xeon. Their fp32 matmuls go through MKL and torch's vectorised ops, their bf16
matmuls through oneDNN, and each library picks its kernels from the CPU. A cell that glues a digit which one kernel
set rounds differently (issue 44: chapter 6's bf16 agreement count) passes on one machine and fails on the other.
`make other-cpu` reruns those cells with all three libraries held to AVX2; this test keeps the three variables in the
Makefile and checks that each one takes effect, so the rerun cannot silently test the default kernels again.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

_PROBE = r"""
import hashlib, json, torch
g = torch.Generator().manual_seed(0)
a, b = torch.randn(64, 576, generator=g), torch.randn(576, 1536, generator=g)
def digest(t): return hashlib.sha1(t.float().numpy().tobytes()).hexdigest()
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "bf16": digest(a.bfloat16() @ b.bfloat16()),
}))
"""


def other_cpu_env() -> dict[str, str]:
    """The variables the Makefile's OTHER_CPU sets, as a dict."""
    text = (ROOT / "Makefile").read_text()
    line = re.search(r"^OTHER_CPU := (.+)$", text, re.M)
    assert line, "the Makefile defines OTHER_CPU"
    return dict(pair.split("=", 1) for pair in line.group(1).split())


def _probe(extra: dict[str, str]) -> tuple[dict, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")
    }
    env.update(extra, ONEDNN_VERBOSE="1", OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True)
    lines = run.stdout.strip().splitlines()
    return json.loads(lines[-1]), run.stdout


def test_other_cpu_holds_all_three_libraries_to_avx2():
    env = other_cpu_env()
    assert env == {"MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


@pytest.mark.skipif(sys.platform != "linux" or os.uname().machine != "x86_64", reason="x86 kernels only")
def test_other_cpu_changes_the_kernels_it_names():
    default, default_log = _probe({})
    other, other_log = _probe(other_cpu_env())
    assert other["capability"] == "AVX2"
    # oneDNN says which ISA its bf16 matmul ran. Held to AVX2 it has no bf16 instructions, so torch multiplies
    # bf16 with its own kernel (no oneDNN line) or oneDNN runs an AVX2 one: never the CPU's AVX-512 or AMX path.
    isa = re.findall(r"matmul,([\w:]+),", other_log)
    assert all("avx2" in i for i in isa), isa
    default_isa = re.findall(r"matmul,([\w:]+),", default_log)
    if default_isa and not all("avx2" in i for i in default_isa):
        # On an AVX-512 machine (both CI machines) the bf16 product rounds differently under the other kernels:
        # that difference is what the rerun is for.
        assert other["bf16"] != default["bf16"]
