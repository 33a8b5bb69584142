"""``python -m kvcourse.gpu_check``: what it would run, how it runs a job, and that without a GPU it runs nothing."""

from __future__ import annotations

import json
import sys

import nbformat
import pytest
import torch

from kvcourse import gpu_check


def test_jobs_cover_every_chapter_and_name_files_that_exist(tmp_path):
    todo = gpu_check.jobs(gpu_check.ROOT, tmp_path)
    names = [j.name for j in todo]
    # The benchmarks first, each with the GPU to itself.
    assert names[:3] == ["kernel benchmark", "engine benchmark", "split-count benchmark"]
    assert all(j.alone for j in todo[:3]) and not any(j.alone for j in todo[3:])
    assert "kernel tests, compiled on the GPU" in names and "tests that take a device, on cuda" in names
    chapters = sorted(p.name for p in (gpu_check.ROOT / "book").glob("[0-9][0-9]_*.ipynb"))
    assert sorted(j.notebook for j in todo if j.notebook) == chapters and len(chapters) == 9
    assert [j.notebook[:2] for j in todo if j.notebook] == list(gpu_check.CHAPTER_ORDER)  # longest first
    for job in todo:
        for arg in job.command:
            if arg.startswith(("tests/", "benchmarks/")):
                assert (gpu_check.ROOT / arg).is_file(), arg
    assert str(tmp_path) in todo[0].command  # the benchmark writes beside the check's JSON
    engine = todo[1].command
    assert engine[1:4] == ["benchmarks/bench_engine_gpu.py", "--device", "cuda"] and str(tmp_path) in engine
    assert engine[engine.index("--preset") + 1] == "lease"  # fixed sizes, made to fit the run
    assert todo[1].timeout_s == gpu_check.ENGINE_BENCH_TIMEOUT_S  # a hang cannot eat the run
    quick = gpu_check.jobs(gpu_check.ROOT, tmp_path, quick_bench=True)[1].command
    assert quick[quick.index("--preset") + 1] == "smoke"
    kernels = gpu_check.kernel_test_files(gpu_check.ROOT)
    assert {"tests/test_kernels.py", "tests/test_kernels_native.py", "tests/test_exercises_ch05.py"} <= set(kernels)
    files = gpu_check.device_test_files(gpu_check.ROOT)
    assert {"tests/test_model.py", "tests/test_serving_real.py", "tests/test_cuda_graphs.py"} <= set(files)
    assert "tests/test_browser.py" not in files and "tests/test_loader.py" not in files


def test_job_env_compiles_triton_and_limits_threads(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = gpu_check.job_env(gpu_check.ROOT, threads=8)
    assert "TRITON_INTERPRET" not in env
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "8" and env["OMP_WAIT_POLICY"] == "PASSIVE"
    assert env["PYTHONPATH"].split(":")[0] == str(gpu_check.ROOT)


def test_a_job_past_its_time_is_killed_and_recorded(tmp_path):
    job = gpu_check.Job("sleeper", [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"])
    result = gpu_check.run_job(job, tmp_path, gpu_check.job_env(tmp_path, 1), timeout=2)
    assert result["timed_out"] and not result["passed"] and result["seconds"] < 30
    assert "started" in result["output_tail"]
    job = gpu_check.Job("fails", [sys.executable, "-c", "raise SystemExit(4)"])
    result = gpu_check.run_job(job, tmp_path, gpu_check.job_env(tmp_path, 1), timeout=30)
    assert result["returncode"] == 4 and not result["passed"] and not result["timed_out"]


def test_a_chapter_job_lists_every_failing_cell_and_goes_on(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("raise RuntimeError('on cuda:0 and cpu')"),
                nbformat.v4.new_code_cell("y = x + 1\nprint('after', y)"), nbformat.v4.new_code_cell("1 / 0")]  # fmt: skip
    path = tmp_path / "01_demo.ipynb"
    nbformat.write(nb, path)
    job = gpu_check.Job("chapter 01", [sys.executable, "-m", "kvcourse.gpu_check", "--execute-notebook", str(path),
                                       "--save-notebooks", str(tmp_path / "ran")], notebook=path.name)  # fmt: skip
    result = gpu_check.run_job(job, gpu_check.ROOT, gpu_check.job_env(gpu_check.ROOT, 1), timeout=120)
    assert not result["passed"] and result["notebook"] == "01_demo.ipynb"
    assert [c["cell"] for c in result["failing_cells"]] == [1, 3]
    assert result["failing_cells"][0]["error"] == "RuntimeError: on cuda:0 and cpu"
    assert result["failing_cells"][1]["error"].startswith("ZeroDivisionError")
    assert gpu_check.NOTEBOOK_MARK not in result["output_tail"] and "2 failing cells" in result["output_tail"]
    assert json.dumps(result)  # what the check writes
    ran = nbformat.read(tmp_path / "ran" / "01_demo.ipynb", as_version=4)  # the outputs, kept to read
    assert ran.cells[2].outputs[0]["text"] == "after 2\n" and ran.cells[1].outputs[0]["output_type"] == "error"
    assert not any(c.get("outputs") for c in nbformat.read(path, as_version=4).cells)  # the file itself: untouched


def test_without_a_gpu_it_says_so_runs_nothing_and_fails(tmp_path, capsys):
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is present: the check would run for real")
    assert gpu_check.main(["--out", str(tmp_path)]) == gpu_check.NO_GPU == 3
    out = capsys.readouterr().out
    assert "no CUDA GPU here" in out and "nothing was run" in out
    assert list(tmp_path.iterdir()) == []  # no results file pretends a GPU run happened
    assert gpu_check.main(["--out", str(tmp_path), "--allow-no-gpu"]) == 0
    assert list(tmp_path.iterdir()) == []


def test_versions_name_what_the_jobs_use():
    v = gpu_check.versions()
    assert (
        v["torch"] == torch.__version__
        and v["python"] == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    )
    assert set(gpu_check.VERSIONED) <= set(v) and v["nbclient"] != "missing"
    assert gpu_check.missing_requirements() == []  # this environment has everything


def test_only_selects_jobs_by_pattern():
    names = [j.name for j in gpu_check.jobs(gpu_check.ROOT, gpu_check.ROOT / "out")]
    keep = lambda only: [n for n in names if gpu_check.selected(n, only)]  # noqa: E731
    assert keep(None) == names
    # What the second GPU run asked for, unquoted: the dots must match the spaces.
    picked = keep(["chapter", "kernel.tests", "graded", "tests.that"])
    assert "kernel benchmark" not in picked and "engine benchmark" not in picked and len(picked) == len(names) - 3
    assert keep(["benchmark"]) == ["kernel benchmark", "engine benchmark", "split-count benchmark"]
    assert keep(["CHAPTER 05"]) == ["chapter 05 on the GPU"]


def test_bad_parallel_is_refused():
    with pytest.raises(ValueError, match="--parallel"):
        gpu_check.main(["--parallel", "0"])
