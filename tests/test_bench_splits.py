"""The split-count sweep (issue 30): its plumbing on a CPU; its timings need a GPU (``make gpu-check`` runs it)."""

from __future__ import annotations

import itertools

import torch

from kvcourse.bench import splits


def test_split_counts_leave_every_split_a_tile_and_include_the_heuristics():
    assert splits.split_counts(512, 2) == [1, 2, 4, 8, 16, 32]  # 64 splits of 8 positions are left out
    assert splits.split_counts(65536, 33) == [1, 2, 4, 8, 16, 32, 33, 64]
    assert splits.split_counts(20, 1) == [1]


def test_the_sweep_times_every_count_and_finds_the_fastest():
    scripted = itertools.cycle([3.0, 1.0, 2.0, 4.0, 5.0])  # ms for counts 1, 2, 4, ... in the order timed
    calls = []

    def timer(fn):
        calls.append(fn())  # the kernel runs (in the interpreter here), then a scripted time
        return next(scripted)

    rows = splits.sweep([(1, 64)], torch.device("cpu"), timer, num_sms=132)
    (row,) = rows
    assert row["chosen"] == 1 and list(row["ms"]) == ["1", "2", "4"] and row["best"] == 2
    assert row["chosen_over_best"] == 3.0 and len(calls) == 3
    assert all(torch.allclose(c, calls[0], atol=1e-2) for c in calls)  # fp16: every split count, one answer
    summary = splits.summarize(rows)
    assert summary["heuristic_off_by_10pct"] == [
        {"batch": 1, "context": 64, "chosen": 1, "best": 2, "chosen_over_best": 3.0}
    ]
    assert summary["worst"]["context"] == 64


def test_without_a_gpu_it_refuses_and_the_smoke_run_checks_agreement(capsys):
    if torch.cuda.is_available():
        return
    assert splits.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "no CUDA GPU" in out and "agree" in out
