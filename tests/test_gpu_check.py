"""``python -m kvcourse.gpu_check``: what it would run, and that without a GPU it says so and runs nothing."""

from __future__ import annotations

import pytest
import torch

from kvcourse import gpu_check


def test_steps_name_files_that_exist():
    steps = gpu_check.steps(gpu_check.ROOT)
    assert [name for name, _ in steps] == [
        "kernel tests, compiled on the GPU", "model and engine tests on cuda", "kernel benchmark",
        "chapters 5-8 on the GPU",
    ]  # fmt: skip
    for name, command in steps:
        for arg in command:
            if arg.startswith("tests/"):
                assert (gpu_check.ROOT / arg).is_file(), arg
    notebooks = steps[-1][1][steps[-1][1].index("--execute-notebooks") + 1 :]
    assert [n.rsplit("/", 1)[-1][:3] for n in notebooks] == ["05_", "06_", "07_", "08_"]


def test_without_a_gpu_it_says_so_runs_nothing_and_fails(tmp_path, capsys):
    if torch.cuda.is_available():  # pragma: no cover
        pytest.skip("a GPU is present: the check would run for real")
    assert gpu_check.main(["--out", str(tmp_path)]) == gpu_check.NO_GPU == 3
    out = capsys.readouterr().out
    assert "no CUDA GPU here" in out and "nothing was run" in out
    assert list(tmp_path.iterdir()) == []  # no results file pretends a GPU run happened
    assert gpu_check.main(["--out", str(tmp_path), "--allow-no-gpu"]) == 0
    assert list(tmp_path.iterdir()) == []
