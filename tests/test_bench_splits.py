"""The split-count sweep (issue 30): its plumbing on a CPU; its timings need a GPU (``make gpu-check`` runs it)."""

from __future__ import annotations

import itertools

import torch

from kvcourse import results
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


def test_choose_num_splits_is_fitted_to_the_committed_h200_sweep():
    """The rule against every count the H200 timed: within 10% of the fastest at most shapes, and never far behind
    the first heuristic (each row's ``chosen``) where that one was better."""
    from kvcourse.bench.kernels import NUM_KV_HEADS
    from kvcourse.kernels.triton_paged import choose_num_splits

    sweep = results.load("splits-nvidia-h200-2026-11-28.json")
    sms = sweep["provenance"]["sms"]
    new, old = [], []
    for row in sweep["rows"]:
        fastest = min(row["ms"].values())
        picked = str(choose_num_splits(row["batch"], NUM_KV_HEADS, row["context"], sms))
        assert picked in row["ms"], f"{row['batch']} x {row['context']}: {picked} splits were not timed"
        new.append(row["ms"][picked] / fastest)
        old.append(row["ms"][str(row["chosen"])] / fastest)
    near = sum(r < 1.1 for r in new)
    assert near > len(new) / 2 and near > sum(r < 1.1 for r in old)  # 11 of 13 shapes; the first heuristic: 3
    assert max(n / o for n, o in zip(new, old)) < 1.5  # worst: 32 x 2,048 unsplit, 1.43x the old 2 splits
    assert max(new) < min(2.0, max(old))  # worst shape 1.43x the fastest; the old rule's 2.63x
