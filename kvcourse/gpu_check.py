"""``python -m kvcourse.gpu_check`` (``make gpu-check``): what to run first on a machine with an NVIDIA GPU.

Everything this course says about GPUs was, until such a run, verified without one: chapter 5's
kernels ran in Triton's CPU interpreter and were *compiled* for sm_75/80/90 on a CPU
(:mod:`kvcourse.kernels.compile_check`), but never run or timed on a GPU. On a CUDA machine this
command runs, in order, each step in its own process:

1. **kernel tests, compiled**: ``tests/test_kernels.py`` (its cases built on ``cuda``; the bad-input
   tests are left out) and the native-compile check, with Triton compiling for the GPU (no
   ``TRITON_INTERPRET``);
2. **model and engine tests on the GPU**: the tests that take a ``device`` (``-k cuda``);
3. **the kernel benchmark**: ``python -m kvcourse.bench kernels`` (bandwidth vs vendor peak, vs a
   measured copy, vs SDPA and FlexAttention), which writes its own results file;
4. **chapters 5 to 8 top to bottom** on the GPU, executed in memory (the committed notebooks keep the
   outputs CI compares).

It writes ``benchmarks/results/gpu-check-<gpu>-<date>.json``: the provenance (GPU, compute capability,
driver, CUDA, torch, triton, commit, date) and each step's exit status, duration and last lines of output,
ready to commit. Exit status: 0 when every step passed, 1 when one failed.

**Without a CUDA GPU** it says so, runs nothing, writes nothing, and exits with status 3
(``NO_GPU``), so a job that expected a GPU cannot pass by accident. ``--allow-no-gpu`` exits 0 instead.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

NO_GPU = 3
ROOT = Path(__file__).resolve().parents[1]  # the repository (tests/, book/, benchmarks/ live here)
CHAPTERS = ("05_*.ipynb", "06_*.ipynb", "07_*.ipynb", "08_*.ipynb")


def steps(root: Path, quick_bench: bool = False) -> list[tuple[str, list[str]]]:
    """``(name, command)`` of every step, in order."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    notebooks = [str(p) for pattern in CHAPTERS for p in sorted((root / "book").glob(pattern))]
    bench = [py, "-m", "kvcourse.bench", "kernels", "--out", str(root / "benchmarks" / "results")]
    return [
        ("kernel tests, compiled on the GPU", pytest + ["tests/test_kernels.py", "tests/test_kernels_native.py",
                                                        "-k", "not bad_input"]),
        ("model and engine tests on cuda", pytest + ["tests/test_model.py", "tests/test_serving_real.py", "-k", "cuda"]),
        ("kernel benchmark", bench + (["--quick"] if quick_bench else [])),
        ("chapters 5-8 on the GPU", [py, "-m", "kvcourse.gpu_check", "--execute-notebooks", *notebooks]),
    ]  # fmt: skip


def run_step(name: str, command: list[str], root: Path) -> dict:
    """Run one step in its own process; its status, duration and the tail of its output."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    env.pop("TRITON_INTERPRET", None)  # Triton compiles for the GPU
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
    output = (proc.stdout + proc.stderr).strip()
    return dict(step=name, command=" ".join(command), returncode=proc.returncode, passed=proc.returncode == 0,
                seconds=round(time.perf_counter() - start, 1), output_tail=output[-4000:])  # fmt: skip


def execute_notebooks(paths: list[str]) -> int:
    """Run each notebook top to bottom in a temporary copy; 1 if any cell raised."""
    import nbformat
    from nbclient import NotebookClient

    failed = 0
    for path in map(Path, paths):
        nb = nbformat.read(path, as_version=4)
        start = time.perf_counter()
        try:  # executed in memory: the file on disk keeps its committed outputs
            NotebookClient(nb, timeout=1800, kernel_name="python3",
                           resources={"metadata": {"path": str(path.parent)}}).execute()  # fmt: skip
            print(f"{path.name}: ran top to bottom in {time.perf_counter() - start:.0f} s")
        except Exception as exc:  # a cell raised: report which, keep going with the next chapter
            failed = 1
            print(f"{path.name}: FAILED after {time.perf_counter() - start:.0f} s: {type(exc).__name__}: "
                  f"{str(exc)[-1500:]}")  # fmt: skip
    return failed


def no_gpu_message() -> str:
    return ("kvcourse.gpu_check: no CUDA GPU here (torch.cuda.is_available() is False), so nothing was run. "
            "Without a GPU, chapter 5's kernels are tested in Triton's interpreter (make test) and compiled for "
            "sm_75/80/90 without running (make test-kernels-native); no GPU run or timing exists until this "
            "command runs on one.")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where the JSON goes")
    parser.add_argument("--quick-bench", action="store_true", help="the kernel benchmark's quick shapes only")
    parser.add_argument("--allow-no-gpu", action="store_true", help=f"exit 0, not {NO_GPU}, when there is no GPU")
    parser.add_argument("--execute-notebooks", nargs="+", metavar="NOTEBOOK", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.execute_notebooks:  # step 4, in its own process
        return execute_notebooks(args.execute_notebooks)
    if not torch.cuda.is_available():
        print(no_gpu_message())
        return 0 if args.allow_no_gpu else NO_GPU
    from .bench.kernels import provenance

    prov = provenance(torch.device("cuda"))
    print(f"{prov['gpu']} (sm_{prov['compute_capability'].replace('.', '')}), driver {prov['driver']}, "
          f"CUDA {prov['cuda']}, torch {prov['torch']}, triton {prov['triton']}")  # fmt: skip
    results = []
    for name, command in steps(ROOT, args.quick_bench):
        print(f"== {name}: {' '.join(command)}", flush=True)
        result = run_step(name, command, ROOT)
        print(f"   {'passed' if result['passed'] else 'FAILED'} in {result['seconds']} s")
        results.append(result)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = "".join(c if c.isalnum() else "-" for c in prov["gpu"]).strip("-").lower()
    path = args.out / f"gpu-check-{gpu}-{prov['date'][:10]}.json"
    path.write_text(json.dumps(dict(check="gpu", provenance=prov, steps=results), indent=1) + "\n")
    print(f"wrote {path}")
    return 0 if all(r["passed"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
