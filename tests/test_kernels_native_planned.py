"""Issue 50's new kernel paths compiled for a T4, an A100 and an H100 (sm_75, sm_80, sm_90) on this CPU: no spills.

The planned paged decode (``_paged_decode_kernel`` with ``PLANNED``) and its merge (``_merge_planned_kernel``), and the
fp8 cache write (``_reshape_and_cache_kernel`` on an e4m3 pool), at the named models' heads (SmolLM2's 9/3/64, Llama-3-8B's
32/8/128), in every query dtype, on float and int8 pools, with the launch parameters the wrappers pick on each GPU.
:mod:`kvcourse.bench.compile_check` records and compiles the launches (``compile_launch``); its sweep does not
know these kernels yet, so they are recorded here (the same way: each kernel's ``run`` replaced by a recorder).
"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.test_kernels_native import ROOT, TIMEOUT, _env

SCRIPT = r"""
import functools, json, torch
from kvcourse.bench import compile_check as cc
from kvcourse.kernels import triton_cache, triton_paged
from kvcourse.kernels.split_plan import SplitPlan

kernels = (triton_paged._paged_decode_kernel, triton_paged._merge_planned_kernel,
           triton_cache._reshape_and_cache_kernel)
launches = []
for k in kernels:
    k.run = functools.partial(lambda kernel, *a, grid, warmup, **kw: launches.append((cfg, cc.Launch(kernel, a, kw))), k)
rows = []
for target in cc.TARGETS:
    launches.clear()
    for (hq, hkv, d), dtype, kv in [(h, dt, kv) for h in cc.NAMED_HEADS.values()
                                    for dt in (torch.float16, torch.bfloat16, torch.float32) for kv in ("float", "int8")]:
        cfg = f"planned q={dtype} kv={kv} heads={hq}/{hkv} D={d}"
        q = torch.empty(2, hq, d, dtype=dtype)
        pool = torch.empty(4, 16, hkv, d, dtype=torch.int8 if kv == "int8" else dtype)
        scales = (torch.empty(pool.shape[:3]), torch.empty(pool.shape[:3])) if kv == "int8" else (None, None)
        triton_paged.paged_decode_planned(q, pool, pool.clone(), torch.zeros(2, 2, dtype=torch.int32),
                                          SplitPlan(8, 2, "cpu"), d**-0.5, *scales, capability=target.capability)
    if target.capability >= 80:  # the engine shape's tile alternatives the benchmark times (on an A100 or later)
        for tiles, dtype in [(t, dt) for t in ((32, 4, 3), (128, 8, 2)) for dt in (torch.float16, torch.bfloat16)]:
            cfg = f"planned q={dtype} kv=float heads=9/3 D=64 tiles={tiles}"
            q = torch.empty(2, 9, 64, dtype=dtype)
            pool = torch.empty(4, 16, 3, 64, dtype=dtype)
            triton_paged.paged_decode_planned(q, pool, pool.clone(), torch.zeros(2, 2, dtype=torch.int32),
                                              SplitPlan(8, 2, "cpu"), 0.125, capability=target.capability, tiles=tiles)
    for (hq, hkv, d), dtype in [(h, dt) for h in cc.NAMED_HEADS.values()
                                for dt in (torch.float16, torch.bfloat16, torch.float32)]:
        for n in (1, 37):
            cfg = f"cache-fp8 dtype={dtype} heads={hkv} D={d} tokens={n}"
            new = torch.empty(n, hkv, d, dtype=dtype)
            pool = torch.empty(4, 16, hkv, d, dtype=torch.float8_e4m3fn)
            triton_cache._launch(new, new.clone(), pool, pool.clone(), torch.zeros(n, dtype=torch.int64),
                                 torch.empty(pool.shape[:3]), torch.empty(pool.shape[:3]))
    seen = {}
    for cfg, launch in launches:
        key = (launch.kernel.__name__, cc._launch_key(launch))
        if key not in seen:
            seen[key] = cc.compile_launch(launch, target)
        c = seen[key]
        rows.append(dict(capability=target.capability, config=cfg, kernel=c.kernel, registers=c.registers,
                         stack=c.stack, shared=c.shared, max_shared=target.max_shared, dots=c.dots))
print(json.dumps(rows))
"""


def test_issue_50_kernels_compile_for_t4_a100_h100_without_spills(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout.strip().splitlines()[-1])
    kernels = {"_paged_decode_kernel", "_merge_planned_kernel", "_reshape_and_cache_kernel"}
    for capability in (75, 80, 90):
        mine = [r for r in rows if r["capability"] == capability]
        assert {r["kernel"] for r in mine} == kernels
        tiles = 2 * 2 * 2 if capability >= 80 else 0  # the benchmark's tile alternatives: decode and merge
        assert len(mine) == 2 * 3 * 2 * 2 + 2 * 3 * 2 + tiles  # planned: a decode and a merge per launch; fp8: a write
    problems = [r for r in rows if r["stack"] or r["registers"] >= 255 or r["shared"] > r["max_shared"]]
    assert problems == [], problems
    # The planned decode keeps tensor cores where the unplanned one has them (fp16 on sm_80 and sm_90).
    dots = {(r["capability"], r["config"]): r["dots"] for r in rows if r["kernel"] == "_paged_decode_kernel"}
    assert dots[(90, "planned q=torch.float16 kv=float heads=9/3 D=64")] in ("wgmma", "mma.sync")
    assert dots[(75, "planned q=torch.float16 kv=float heads=9/3 D=64")] == "fma"
