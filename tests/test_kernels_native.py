"""Chapter 5's kernels and a layer's fused small ops compiled for real NVIDIA GPUs (sm_75, sm_80, sm_90) on this CPU.

Triton compiles to PTX and ``ptxas`` (shipped in the triton wheel) to machine code without a GPU
(:mod:`kvcourse.bench.compile_check`). Each check runs in a subprocess with ``TRITON_INTERPRET=0``
and a fresh ``TRITON_CACHE_DIR``: ``import kvcourse`` settles interpret mode for its whole process,
and a cold cache proves the compiles happen here. The quick sweep (the course model's and a
Llama-3-8B-like head's launches) runs in ``make test``; the full sweep (GQA groups 1/3/4/8, head
dims 64/128, blocks of 1/16/32, every split count) is marked ``native_full``: ``make test-kernels-native``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 1800


def _env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path / "triton-cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, stated (it warns when unset)
    return env


def _sweep(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "kvcourse.bench.compile_check", "--json", str(out), *args],
        env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, f"compile check failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


def _check_report(report: dict) -> None:
    assert [t["capability"] for t in report["targets"]] == [75, 80, 90]
    assert "compiled on a CPU, no GPU" in report["note"]
    for t in report["targets"]:
        assert t["errors"] == 0, t
        assert t["max_shared_bytes_used"] <= t["max_shared_bytes"], t
        assert t["spilling_named"] == [], t
    rows = [r for r in report["rows"] if "kernel" in r]
    assert not [r for r in report["rows"] if "error" in r]
    assert all(r["stack_bytes"] == 0 for r in rows if r["model"]), "a named model's launch spills"

    def row(capability, config, kernel="_paged_decode_kernel"):
        found = [r for r in rows if r["capability"] == capability and r["config"] == config and r["kernel"] == kernel]
        assert len(found) == 1, f"sm_{capability} {config}: {found}"
        return found[0]

    # The launches that used to spill: SmolLM2 on a T4 with one split, fp32 queries on int8 K/V at D = 128.
    for dtype in ("fp16", "bf16"):
        t4 = row(75, f"paged q={dtype} kv={dtype} heads=9/3 D=64 block=16 splits=1")
        assert t4["stack_bytes"] == 0 and t4["registers"] < 255
    for capability in (80, 90):
        r = row(capability, "paged q=fp32 kv=int8 heads=32/8 D=128 block=16 splits=1")
        assert r["stack_bytes"] == 0 and r["registers"] < 255
    # What the chapter shows: a T4 gets FMA only, an A100 and an H100 get tensor-core mma for fp16.
    config = "paged q=fp16 kv=fp16 heads=32/8 D=128 block=16 splits=1"
    assert not row(75, config)["mma"] and row(75, config)["fma"] > 0
    assert row(80, config)["mma"] and row(90, config)["mma"]
    # A layer's fused small ops (kernels/triton_fused.py) at SmolLM2's shapes: fp32/fp16/bf16, 1, 64 and 2048
    # tokens, the launch parameters their wrappers pick; no spills, no tensor cores (they have no dots).
    fused = {"_rms_norm_kernel", "_fused_add_rms_norm_kernel", "_rotary_embedding_kernel", "_silu_and_mul_kernel"}
    for capability in (75, 80, 90):
        mine = [r for r in rows if r["capability"] == capability and r["kernel"] in fused]
        assert {r["kernel"] for r in mine} == fused and len(mine) == 5 * 3 * 3, mine  # rms_norm: with an embedding too
        assert all(r["model"] == "SmolLM2-135M" and r["stack_bytes"] == 0 and not r["mma"] for r in mine), mine
    assert row(90, "rms_norm dtype=bf16 hidden=576 tokens=2048", "_rms_norm_kernel")["BLOCK"] == 1024
    # A decode step's attention in one kernel (kernels/triton_fused_decode.py): RoPE, cache write, paged read and
    # merge; every dtype, no spills, tensor cores where the paged kernel has them.
    for capability in (75, 80, 90):
        for dtype in ("fp16", "bf16", "fp32"):
            config = f"rope_cache_decode q={dtype} kv={dtype} heads=9/3 D=64 block=16"
            assert row(capability, config, "_rope_cache_decode_kernel")["stack_bytes"] == 0
    config = "rope_cache_decode q=fp16 kv=fp16 heads=32/8 D=128 block=16"
    assert row(90, config, "_rope_cache_decode_kernel")["mma"] and row(80, config, "_rope_cache_decode_kernel")["mma"]
    assert row(75, "silu_and_mul dtype=fp16 intermediate=1536 tokens=1", "_silu_and_mul_kernel")["num_warps"] == 4


def test_kernels_compile_for_t4_a100_h100_without_spills(tmp_path):
    """The quick sweep (``make test``): every launch of the named models' heads, on all three GPUs."""
    report = _sweep(tmp_path, "--quick")
    assert report["sweep"] == "quick" and report["distinct_compiles"] >= 90
    _check_report(report)


def test_spills_are_detected(tmp_path):
    """The check can fail: the T4 launch used before tile_config knew the GPU (64-wide tiles, 4 warps) spills."""
    script = (
        "from kvcourse.bench import compile_check as cc\n"
        "import dataclasses, torch, json\n"
        "cfg = cc.Config('paged', torch.float16, (9, 3), 64, tiles=(64, 4, 2))\n"
        "r = cc.check(cfg, cc.TARGETS[0])\n"
        "c = r.compiled[0]\n"
        "print(json.dumps(dict(problems=r.problems(), registers=c.registers, stack=c.stack, mma=c.mma)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["registers"] == 255 and got["stack"] > 0 and not got["mma"]
    assert len(got["problems"]) == 1 and "spills" in got["problems"][0] and "SmolLM2-135M" in got["problems"][0]


def test_compile_check_refuses_the_interpreter(tmp_path):
    env = dict(_env(tmp_path), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "kvcourse.bench.compile_check", "--quick"], env=env,
                          capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 2 and "TRITON_INTERPRET=0" in proc.stderr


@pytest.mark.native_full
def test_full_native_sweep(tmp_path):
    """``make test-kernels-native``: GQA groups 1/3/4/8, head dims 64/128, blocks 1/16/32, every split count."""
    report = _sweep(tmp_path)
    assert report["sweep"] == "full" and report["distinct_compiles"] > 1000
    _check_report(report)


def test_the_int8_kernel_needs_no_conversion_unit_and_loads_16_bytes_at_a_time(tmp_path):
    """Issue 30's compile-side evidence, kept true: on sm_80 and sm_90 the int8 paged kernel's K/V loads are 16-byte
    vectors like fp16's (unvectorised loads were a suspect; they are not the cause), the first version's plain
    conversion became ``I2F`` instructions, and :func:`~kvcourse.kernels.triton_paged.int8_to_float` needs none."""
    out = tmp_path / "instructions.json"
    proc = subprocess.run([sys.executable, "-m", "kvcourse.bench.instructions", "--json", str(out)],
                          env=_env(tmp_path), capture_output=True, text=True, timeout=TIMEOUT, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["capability"], r["dtype"]) for r in rows} == {(c, d) for c in (80, 90) for d in ("fp16", "bf16")}
    for r in rows:
        assert r["global_load_128"] >= 1 and r["stack_bytes"] == 0, r
        assert r["tensor_core"] > 0, r  # the dots stay on tensor cores
        if r["variant"] == "int8, bits":
            assert r["conversion_unit"] == 0, r
    first = {(r["capability"], r["dtype"]): r for r in rows if r["variant"].startswith("int8, cvt")}
    assert first[(90, "fp16")]["conversion_unit"] > 0 and first[(80, "fp16")]["conversion_unit"] > 0
