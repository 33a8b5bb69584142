"""``benchmarks/bench_engine_gpu.py`` (issue 29): its smoke run on the CPU, and the bookkeeping a GPU run relies on.

Only a GPU run measures anything (``make gpu-check`` runs its ``lease`` preset, about 90 s). Here: the whole
script runs end to end in its ``smoke`` preset on the CPU (tiny sizes, two layers, the kernels in Triton's
interpreter) and writes every section, target and agreement count; and its pieces (nano-vllm's draws, the
presets, the targets, the comparison of outputs) are checked in-process, where they cost nothing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def bench(request):
    """The benchmark as a module (its neighbours, hf_serving and machine, importable as it expects)."""
    sys.path.insert(0, str(BENCH))
    request.addfinalizer(lambda: sys.path.remove(str(BENCH)))
    import bench_engine_gpu

    return bench_engine_gpu


def run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
               PYTHONHASHSEED="0", OMP_WAIT_POLICY="PASSIVE")  # fmt: skip
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: make gpu-check runs the real thing")
def test_the_cpu_smoke_run_writes_every_section(tmp_path):
    start = time.perf_counter()
    proc = run_script(
        ["benchmarks/bench_engine_gpu.py", "--device", "cpu", "--preset", "smoke", "--out", str(tmp_path)], 600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.glob("gpu-engine-cpu-*.json")
    res = json.loads(path.read_text())
    assert res["errors"] == []
    assert res["smoke"] and res["device"] == "cpu" and res["dtype"] == "float32" and res["preset"] == "smoke"
    assert res["model"] == {"name": "SmolLM2-135M-Instruct (GGUF)", "layers": 2, "of_layers": 30, "truncated": True}
    assert res["provenance"]["commit"] and res["provenance"]["torch"] == torch.__version__
    for key in ("nano_vllm", "issue_trace", "step_profile", "agreement"):
        assert "error" not in res[key], (key, res[key].get("error"), res[key].get("traceback"))

    # (a) every server ran the whole workload; the eager twin stood in for the graphs and served the decodes.
    nano = res["nano_vllm"]
    engines = {"engine_triton_graphs", "engine_triton_eager", "engine_paged_torch"}
    assert set(nano["runs"]) == engines | {"hf_cb", "hf_cb_eager", "hf_generate"}  # two HF configurations
    assert nano["hf_configs"]["tried"] == ["sdpa", "eager"] and "CUDA" in nano["hf_configs"]["skipped"]["sdpa+async"]
    assert nano["hf_configs"]["best"] in ("sdpa", "eager") and nano["runs"]["hf_cb_eager"]["hf_config"] == "eager"
    whole = nano["whole_protocol"]  # the engine alone, on the preset's whole protocol, first
    assert whole["finished"] == whole["requests"] == 4 and whole["tok_s"] > 0 and whole["graphs"] == "eager twin"
    for name, run in nano["runs"].items():
        assert run["tok_s"] > 0 and not run["timed_out"], name
        assert run["finished"] == run["requests"] == nano["requests"], name
    graphs = nano["runs"]["engine_triton_graphs"]
    # Every step from a graph's eager twin: the decodes from decode graphs, prompts from mixed-step graphs.
    assert graphs["graphs"] == "eager twin" and graphs["graph_steps"] == graphs["steps"]
    assert 0 < graphs["mixed_graph_steps"] < graphs["steps"]
    assert nano["runs"]["engine_triton_eager"]["graph_steps"] == 0
    assert nano["runs"]["hf_cb"]["config"]["resolved"]["use_cuda_graph"] == "(False, False)"  # no graphs on a CPU
    assert all(v is not None for v in nano["ratios"].values())
    # (b) the trace's totals are recorded, with those of the trace it stands for.
    trace = res["issue_trace"]
    assert set(trace["runs"]) == engines
    assert trace["output_tokens"] == trace["runs"]["engine_triton_graphs"]["output_tokens"] > 0
    assert set(trace["full_trace"]) == {"requests", "prompt_tokens", "output_tokens"}
    # (c) graphs need CUDA: skipped, saying so; the eager step was timed and profiled at every batch size.
    prof = res["step_profile"]
    assert "CUDA" in prof["graphs_on"]["skipped"]
    for b, entry in prof["graphs_off"]["batches"].items():
        assert entry["step_ms_median"] > 0 and entry["graph_steps"] == 0, b
        if res["step_profile_available"]:
            assert entry["profile"]["aten_calls"] > 0 and "kernel_launches" not in entry["profile"]  # a CPU has none
    assert prof["generate_batch_1"]["ms_per_token"] > 0
    # (d) in fp32 the engine's three ways to decode agree token for token; every count is there.
    fp32 = res["agreement"]["fp32"]
    assert fp32["graphs_on_vs_off"]["mismatching"] == 0 and fp32["triton_vs_paged_torch"]["mismatching"] == 0
    assert fp32["engine_vs_hf_cb"]["requests"] == fp32["requests"] and "identical" in fp32["engine_vs_hf_cb"]
    assert set(nano["agreement"]) == {"dtype", "triton_vs_paged_torch", "graphs_on_vs_off", "engine_vs_hf_cb"}
    assert nano["agreement"]["triton_vs_paged_torch"]["identical"] >= 0
    # (e) the targets: computed where measured, never claimed as the conditions on a CPU.
    t = res["targets"]
    assert set(t) == {
        "decode_step_batch_64_ms",
        "trace_tok_s",
        "engine_over_hf_best",
        "hf_configs_tried",
        "gpu_idle_fraction_batch_64",
        "nano_vllm_requests",
    }
    for entry in t.values():
        assert set(entry) == {"value", "target", "met", "issue_conditions", "note"}
        assert entry["issue_conditions"] is False
    assert t["engine_over_hf_best"]["value"] == pytest.approx(nano["ratios"]["engine_over_hf_best"], rel=1e-3)
    assert t["hf_configs_tried"]["value"] == 2 and t["hf_configs_tried"]["met"] is False  # the GPU-only ones skipped
    assert isinstance(t["trace_tok_s"]["met"], bool) and t["trace_tok_s"]["target"] == 25_000
    assert t["nano_vllm_requests"]["value"] == 4 and t["nano_vllm_requests"]["met"] is False
    assert t["decode_step_batch_64_ms"]["met"] is None and t["gpu_idle_fraction_batch_64"]["met"] is None
    assert "(e) engine_over_hf_best" in proc.stdout  # the printed table
    print(f"smoke run: {time.perf_counter() - start:.0f} s")


def test_bench_engine_dispatches_device_cuda():
    # The command goes to the GPU benchmark, which refuses plainly without a GPU.
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is present")
    proc = run_script(["benchmarks/bench_engine.py", "--device", "cuda", "--preset", "full"], 120)
    assert proc.returncode == 2 and "no CUDA GPU here" in proc.stderr and "bench_engine_gpu.py" in proc.stderr


def test_nano_vllm_draws_as_its_bench_py(bench):
    # nano-vllm's bench.py: random.seed(0); prompts first (each: its length, then its ids), then output lengths.
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(100, 512))] for _ in range(5)]
    lens = [random.randint(100, 512) for _ in range(5)]
    assert bench.nano_vllm_workload(5, 100, 512, 0) == (prompts, lens)
    prompts, lens = bench.uniform_trace(96, (16, 1024), (16, 256), 0)
    assert len(prompts) == 96 and all(16 <= len(p) <= 1024 for p in prompts) and all(16 <= n <= 256 for n in lens)
    assert bench.uniform_trace(96, (16, 1024), (16, 256), 0) == (prompts, lens)  # seeded
    pilot, pilot_lens = bench.pilot_workload(prompts, 4)
    assert len(pilot) == 4 and len(pilot[0]) == min(map(len, prompts)) and len(pilot[-1]) == max(map(len, prompts))


def test_agreement_counts_and_refuses_unfinished_runs(bench):
    a = {"outputs": [[1, 2, 3], [4, 5, 6], [7, 8]]}
    b = {"outputs": [[1, 2, 3], [4, 9, 6], [7]]}
    assert bench.agreement(a, b) == {"requests": 3, "identical": 1, "mismatching": 2, "first_difference_median": 1.0}
    assert bench.agreement(a, b | {"timed_out": True}) is None
    assert bench.agreement(a, {"error": "boom"}) is None
    res = {
        "nano_vllm": {"runs": {"hf_cb": {"error": "TypeError: x"}, "engine": {"tok_s": 1.0}}},
        "agreement": {"error": "y"},
    }
    assert bench.errors_in(res) == ["nano_vllm.runs.hf_cb", "agreement"]


def test_targets_read_this_runs_numbers(bench):
    res = {
        "dtype": "bfloat16",
        "nano_vllm": {"ratios": {"engine_over_hf_best": 2.4},
                      "hf_configs": {"tried": ["sdpa", "eager", "sdpa+async"], "skipped": {}, "best": "sdpa+async"},
                      "whole_protocol": {"min_len": 100, "max_len": 1024, "finished": 256, "tok_s": 9e3}},
        "issue_trace": {"requests": 96, "trace_prompt": [16, 1024], "trace_output": [16, 256],
                        "runs": {"engine_triton_graphs": {"tok_s": 12000.0}}},
        "step_profile": {"graphs_on": {"batches": {"64": {"step_ms_median": 1.4,
                                                          "profile": {"gpu_idle_fraction": 0.3}}}}},
    }  # fmt: skip
    t = bench.targets(res, full_model=True, cuda=True)
    met = {name: x["met"] for name, x in t.items()}
    assert met == {
        "decode_step_batch_64_ms": True,
        "trace_tok_s": False,
        "engine_over_hf_best": True,
        "hf_configs_tried": True,
        "gpu_idle_fraction_batch_64": False,
        "nano_vllm_requests": True,
    }
    assert t["trace_tok_s"]["target"] == 25_000 and all(x["issue_conditions"] for x in t.values())
    assert "sdpa+async" in t["engine_over_hf_best"]["note"]
    res["issue_trace"]["requests"] = 40  # a budget cut the trace short: measured, but not the trace
    res["issue_trace"]["runs"]["engine_triton_graphs"]["timed_out"] = True
    t = bench.targets(res, full_model=True, cuda=True)
    assert {k: t["trace_tok_s"][k] for k in ("value", "met", "issue_conditions")} == {
        "value": None,
        "met": None,
        "issue_conditions": False,
    }
    assert "40 of its requests" in t["trace_tok_s"]["note"]
    t = bench.targets({"dtype": "bfloat16", "nano_vllm": {"error": "x"}}, full_model=True, cuda=True)
    assert all(x["value"] is None and x["met"] is None for x in t.values())


def test_presets_are_fixed_and_runs_are_guarded(bench):
    # The sizes come from a preset, never from the time left: lease is full with fewer of (a)'s requests
    # and no comparisons, and its runs stop at a fixed timeout.
    full, lease, smoke = (bench.PRESETS[k] for k in ("full", "lease", "smoke"))
    assert (full.requests, full.trace_requests, full.batches, full.comparisons, full.run_timeout_s) == (
        128, 96, (1, 16, 64), True, None)  # fmt: skip
    assert lease == bench.dataclasses.replace(
        full, requests=32, comparisons=False, run_timeout_s=60.0, hf_configs=("sdpa", "eager", "sdpa+async")
    )
    assert full.protocol == lease.protocol == (256, 100, 1024)  # nano-vllm's whole protocol, in both
    assert set(full.hf_configs) == set(bench.HF_CB_CONFIGS) and full.profile_repeats == lease.profile_repeats == 3
    assert smoke.comparisons and max(smoke.batches) < 64 and smoke.requests < lease.requests
    out = bench.attempt("broken", lambda dl: 1 / 0, None)
    assert out["error"].startswith("ZeroDivisionError")
    ran = []
    assert bench.attempt("ok", lambda dl: ran.append(dl) or {"tok_s": 1.0}, 5.0) == {"tok_s": 1.0} and ran == [5.0]


def test_the_preset_follows_the_device(bench):
    assert bench.parse(["--device", "cpu"]).preset == "smoke" and bench.parse(["--device", "cpu"]).layers == 2
    with pytest.raises(SystemExit):
        bench.parse(["--device", "cpu", "--preset", "lease"])  # a CPU runs the smoke preset only
    with pytest.raises(SystemExit):
        bench.parse(["--device", "cpu", "--layers", "0"])


def test_hf_cb_config_asks_only_for_fields_this_transformers_has(bench):
    from transformers import ContinuousBatchingConfig

    import hf_serving  # the Hugging Face runs beside bench_serving's (the bench fixture put benchmarks/ on the path)

    cb, asked = hf_serving.hf_cb_config(
        hf_serving.Shape(max_num_seqs=64, max_num_batched_tokens=2048), 100, cuda_graphs=True
    )
    assert isinstance(cb, ContinuousBatchingConfig) and cb.page_size == 16 and cb.num_blocks == 100
    assert cb.max_batch_tokens == 2048 and cb.max_requests_per_batch == 64 and cb.use_cuda_graph is True
    assert asked["not_in_this_version"] == [] and "use_async_batching" not in asked["asked"]  # the GPU: HF decides


def test_hf_configurations_this_machine_cannot_run_are_skipped_saying_why(bench):
    import hf_serving

    run, skipped = hf_serving.runnable_configs(list(hf_serving.HF_CB_CONFIGS), cuda=False)
    assert run == ["sdpa", "eager"]  # graphs, async batching and compile levels are for a GPU
    assert all("CUDA" in why for name, why in skipped.items() if name != "flash")
    run, skipped = hf_serving.runnable_configs(["sdpa", "flash"], cuda=True)
    if "flash" in skipped:  # flash attention is not on this machine (nor on the GPU image)
        assert run == ["sdpa"] and "flash_attn" in skipped["flash"]
    cb, asked = hf_serving.hf_cb_config(
        hf_serving.Shape(64, 2048),
        100,
        cuda_graphs=True,
        overrides=hf_serving.HF_CB_CONFIGS["sdpa+async+compile3"].overrides,
    )
    assert cb.use_async_batching is True and cb.default_compile_level == 3 and cb.auto_switch_to_flash is False
    runs = {"a": {"tok_s": 5.0}, "b": {"tok_s": 9.0, "timed_out": True}, "c": {"tok_s": 7.0}, "d": {"error": "x"}}
    assert hf_serving.best_hf_run(runs) == ("c", {"tok_s": 7.0})  # the fastest that served everything
    assert hf_serving.best_hf_run({"d": {"error": "x"}}) == (None, None)
