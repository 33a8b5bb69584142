"""The chapter header's time on a GPU: from a committed gpu-check JSON, else book/chapters.yml's gpu_runs, else none."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from kvcourse.tools import sync_notebooks
from kvcourse.tools.book_config import load

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = ROOT / "book" / "05_triton_kernels.ipynb"

# A small gpu-check result with per-chapter times listed in one step ("notebooks").
FIXTURE = {
    "check": "gpu",
    "provenance": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "triton": "3.6.0", "date": "2026-11-27T10:00:00+00:00"},
    "steps": [
        {"step": "kernel tests, compiled on the GPU", "passed": True, "seconds": 95.0},
        {"step": "chapters 5-8 on the GPU", "passed": False, "seconds": 400.0, "notebooks": [
            {"notebook": "05_triton_kernels.ipynb", "passed": True, "seconds": 171.0},
            {"notebook": "06_serving.ipynb", "passed": False, "seconds": 12.0},
        ]},
    ],
}  # fmt: skip


def _repo(tmp_path: Path, gpu_runs: list[dict] | None = None) -> Path:
    """A copy of the repository's publishing inputs with chapter 5, optionally with gpu_runs in chapters.yml."""
    root = tmp_path / "repo"
    (root / "book").mkdir(parents=True)
    (root / "kvcourse" / "results").mkdir(parents=True)
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "results").symlink_to(Path("..") / "kvcourse" / "results")  # as in the repository
    for name in ("_config.yml", "pyproject.toml"):
        shutil.copy(ROOT / name, root / name)
    chapters = yaml.safe_load((ROOT / "book" / "chapters.yml").read_text())
    if gpu_runs is not None:
        chapters["chapters"]["05"]["gpu_runs"] = gpu_runs
    (root / "book" / "chapters.yml").write_text(yaml.safe_dump(chapters))
    shutil.copy(CHAPTER, root / "book" / CHAPTER.name)
    return root


def _header(root: Path) -> str:
    assert sync_notebooks.main(["--root", str(root), str(root / "book" / CHAPTER.name)]) == 0
    nb = json.loads((root / "book" / CHAPTER.name).read_text())
    return "".join(nb["cells"][1]["source"])


def _write(root: Path, name: str, data: dict) -> None:
    (root / "kvcourse" / "results" / name).write_text(json.dumps(data))


def test_without_any_gpu_run_the_header_says_not_timed(tmp_path):
    root = _repo(tmp_path)
    assert sync_notebooks.gpu_check_runs(root, CHAPTER.name) == []
    assert "on a GPU: not timed yet." in _header(root)


def test_chapters_yml_gpu_runs_are_the_fallback(tmp_path):
    root = _repo(tmp_path, gpu_runs=[{"device": "NVIDIA A100", "minutes": 2.5, "torch": "2.9.0", "date": "2026-10-01"}])
    assert "on a GPU: about 2.5 min on NVIDIA A100 (torch 2.9.0, 2026-10-01)." in _header(root)


def test_a_gpu_check_json_times_the_chapter(tmp_path):
    root = _repo(tmp_path, gpu_runs=[{"device": "NVIDIA A100", "minutes": 2.5, "torch": "2.9.0", "date": "2026-10-01"}])
    _write(root, "gpu-check-nvidia-h200-2026-11-27.json", FIXTURE)
    # Read once, though benchmarks/results is the same folder under another name.
    assert [p.name for p in sync_notebooks.gpu_check_files(root)] == ["gpu-check-nvidia-h200-2026-11-27.json"]
    runs = sync_notebooks.gpu_check_runs(root, CHAPTER.name)
    assert runs == [
        dict(device="NVIDIA H200", torch="2.11.0+cu130", date="2026-11-27", seconds=171.0, passed=True, timed_out=False)
    ]
    header = _header(root)
    assert "on a GPU: about 3 min on NVIDIA H200 (torch 2.11.0+cu130, 2026-11-27)." in header  # not chapters.yml's
    # A chapter that failed on the GPU says so, with no time to run claimed.
    assert sync_notebooks.gpu_check_runs(root, "06_serving.ipynb")[0]["passed"] is False
    cfg = load(root)
    chapter06 = cfg.chapter(root / "book" / "06_serving.ipynb")
    assert (
        sync_notebooks.gpu_time(cfg, chapter06)
        == "failed on NVIDIA H200 (torch 2.11.0+cu130, 2026-11-27) after under a minute"
    )
    # A chapter the file does not time falls back to chapters.yml (here: nothing).
    chapter07 = cfg.chapter(root / "book" / "07_reusing_the_cache.ipynb")
    assert sync_notebooks.gpu_time(cfg, chapter07) == "not timed yet"


def test_the_newest_run_on_each_gpu_is_quoted(tmp_path):
    root = _repo(tmp_path)
    older = json.loads(json.dumps(FIXTURE))
    older["provenance"]["date"] = "2026-11-20T09:00:00+00:00"
    older["steps"][1]["notebooks"][0]["seconds"] = 600.0
    t4 = json.loads(json.dumps(FIXTURE))
    t4["provenance"].update(gpu="Tesla T4", date="2026-11-21T09:00:00+00:00")
    t4["steps"][1]["notebooks"][0].update(passed=False, seconds=30.0)
    _write(root, "gpu-check-nvidia-h200-2026-11-20.json", older)
    _write(root, "gpu-check-nvidia-h200-2026-11-27.json", FIXTURE)
    _write(root, "gpu-check-tesla-t4-2026-11-21.json", t4)
    header = _header(root)
    assert (
        "on a GPU: about 3 min on NVIDIA H200 (torch 2.11.0+cu130, 2026-11-27); failed on Tesla T4 (torch "
        "2.11.0+cu130, 2026-11-21) after under a minute."
    ) in header


def test_the_format_gpu_check_writes_one_chapter_per_step(tmp_path):
    # python -m kvcourse.gpu_check: each chapter is its own job; notebook_seconds is the notebook's own execution.
    root = _repo(tmp_path)
    prov = {**FIXTURE["provenance"], "versions": {"python": "3.12.3"}, "cpu_cores": 16}
    steps = [
        {"step": "kernel benchmark", "passed": True, "seconds": 80.0, "returncode": 0, "timed_out": False},
        {"step": "chapter 05 on the GPU", "passed": True, "seconds": 75.2, "returncode": 0, "timed_out": False,
         "notebook": "05_triton_kernels.ipynb", "notebook_seconds": 61.0, "failing_cells": []},
        {"step": "chapter 06 on the GPU", "passed": False, "seconds": 300.0, "returncode": -9, "timed_out": True,
         "notebook": "06_serving.ipynb"},
        {"step": "chapter 07 on the GPU", "passed": False, "seconds": 0.0, "skipped": "the budget ran out before it started"},
    ]  # fmt: skip
    _write(
        root, "gpu-check-nvidia-h200-2026-11-27.json", {"check": "gpu", "provenance": prov, "run": {}, "steps": steps}
    )
    assert "on a GPU: about 1 min on NVIDIA H200 (torch 2.11.0+cu130, 2026-11-27)." in _header(root)
    cfg = load(root)
    chapter06 = cfg.chapter(root / "book" / "06_serving.ipynb")
    assert sync_notebooks.gpu_time(cfg, chapter06) == (
        "stopped by the time limit on NVIDIA H200 (torch 2.11.0+cu130, 2026-11-27) after about 5 min"
    )
    chapter07 = cfg.chapter(root / "book" / "07_reusing_the_cache.ipynb")  # skipped by the budget: never ran
    assert sync_notebooks.gpu_time(cfg, chapter07) == "not timed yet"


def test_an_old_format_gpu_check_times_no_chapter(tmp_path):
    # The first gpu-check format had one step for chapters 5-8 together, no per-notebook times.
    root = _repo(tmp_path)
    old = {
        "check": "gpu",
        "provenance": FIXTURE["provenance"],
        "steps": [{"step": "chapters 5-8 on the GPU", "passed": True, "seconds": 400.0, "returncode": 0}],
    }
    _write(root, "gpu-check-nvidia-h200-2026-11-27.json", old)
    assert "on a GPU: not timed yet." in _header(root)


@pytest.mark.parametrize(
    "broken, match",
    [
        ({"steps": "all of them"}, "top-level list 'steps'"),
        ({"provenance": {"gpu": "NVIDIA H200"}}, r"provenance lacks \['torch', 'date'\]"),
        (
            {"steps": [{"step": "x", "notebooks": [{"notebook": "05_triton_kernels.ipynb", "passed": True}]}]},
            "needs .notebook.* .passed.* .seconds.",
        ),
        ({"steps": [{"step": "chapter 05", "notebook": "05_triton_kernels.ipynb", "seconds": 3.0}]}, "needs .notebook"),
        ({"steps": ["chapter 05"]}, r"steps\[0\] must be a JSON object"),
        ({"steps": [{"step": "x", "notebooks": {"05_triton_kernels.ipynb": 3}}]}, "must be a list"),
    ],
)
def test_a_malformed_gpu_check_is_refused_by_name(tmp_path, broken, match):
    root = _repo(tmp_path)
    _write(root, "gpu-check-broken-2026-11-27.json", {**FIXTURE, **broken})
    with pytest.raises(ValueError, match=f"gpu-check-broken-2026-11-27.json: .*{match}"):
        sync_notebooks.gpu_check_runs(root, CHAPTER.name)


def test_of_two_runs_on_one_day_the_later_wins_whatever_the_file_names(tmp_path):
    # Issue 46, item 12: a "-mixed-b" file sorts before the plain name; the day alone made the earlier run win.
    root = _repo(tmp_path)
    morning = json.loads(json.dumps(FIXTURE))
    morning["provenance"]["date"] = "2026-11-27T08:00:00+00:00"
    morning["steps"][1]["notebooks"][0].update(passed=False, seconds=30.0)
    evening = json.loads(json.dumps(FIXTURE))
    evening["provenance"]["date"] = "2026-11-27T20:00:00+00:00"
    _write(root, "gpu-check-nvidia-h200-2026-11-27.json", morning)
    _write(root, "gpu-check-nvidia-h200-2026-11-27-mixed-b.json", evening)
    assert [r["passed"] for r in sync_notebooks.gpu_check_runs(root, CHAPTER.name)] == [True]
    assert "on a GPU: about 3 min on NVIDIA H200 (torch 2.11.0+cu130, 2026-11-27)." in _header(root)
    # A date without a time counts as midnight UTC, so it compares with a timestamp; a malformed one is refused.
    morning["provenance"]["date"] = "2026-11-28"
    _write(root, "gpu-check-nvidia-h200-2026-11-27.json", morning)
    assert [r["passed"] for r in sync_notebooks.gpu_check_runs(root, CHAPTER.name)] == [False]
    morning["provenance"]["date"] = "yesterday"
    _write(root, "gpu-check-nvidia-h200-2026-11-27.json", morning)
    with pytest.raises(ValueError, match="gpu-check-nvidia-h200-2026-11-27.json: provenance 'date'"):
        sync_notebooks.gpu_check_runs(root, CHAPTER.name)
