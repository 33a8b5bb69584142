"""The control plane (issue 32): the scheduler, the block managers, the radix tree and a request's state
import and run without torch, Triton or numpy (as they must in a browser), and decide exactly as beside them.

A subprocess installs an import hook that refuses ``torch``, ``triton`` and ``numpy``, imports :mod:`kvcourse.control`
and drives the real :class:`~kvcourse.serving.Scheduler` through a trace with chunked prefill, preemption,
copy-on-write forks and prefix-cache hits, printing every decision. The same driver in a process where torch
imports must print the same decisions.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcourse.tools.playground_site import PYODIDE_VERSION, REFUSE_DATA_PLANE, control_plane_files, pyodide_dir

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kvcourse"

BLOCK_TORCH = REFUSE_DATA_PLANE  # import torch, triton or numpy fails after it

DRIVER = """
import json, random, sys
from kvcourse.control import (PrefixCachingBlockManager, RadixCache, SamplingParams, Scheduler, Sequence,
                              hash_block_tokens)

rng = random.Random(0)
shared = [rng.randrange(1000) for _ in range(12)]  # a system prompt: prefix-cache hits from the second request
prompts = [shared + [rng.randrange(1000) for _ in range(rng.randint(1, 20))] for _ in range(10)]
bm = PrefixCachingBlockManager(14, 4)
sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, enable_chunked_prefill=True, watermark=0)
for i, p in enumerate(prompts):
    sched.add(Sequence((i, 0), p, SamplingParams(max_new_tokens=rng.randint(4, 20), stop_token_ids=())))
steps = []
while sched.has_unfinished():
    out = sched.schedule()
    steps.append({
        "run": [[s.seq.seq_id[0], s.num_computed_tokens, s.num_new_tokens, s.kind] for s in out.scheduled],
        "admitted": [s.seq_id[0] for s in out.admitted], "preempted": [s.seq_id[0] for s in out.preempted],
        "hits": out.num_prefix_cache_hit_tokens, "copies": len(out.copies), "free": bm.num_free_blocks,
    })
    sched.advance_without_model(out)
    if len(steps) > 500:
        raise SystemExit("the trace did not finish")
tree = RadixCache()
tree.insert(prompts[0])
match = tree.match_prefix(prompts[1])[0]
print(json.dumps({"steps": steps, "radix_match": match, "hash": str(hash_block_tokens(None, shared[:4])),
                  "torch_loaded": "torch" in sys.modules}))
"""


def _run(blocked: bool) -> dict:
    code = (BLOCK_TORCH if blocked else "") + DRIVER
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_the_control_plane_runs_without_torch_and_decides_as_with_it():
    without, beside = _run(blocked=True), _run(blocked=False)
    assert without["torch_loaded"] is False  # nor numpy: the hook refuses both
    assert without == {**beside, "torch_loaded": False}
    steps = without["steps"]
    # The trace is not trivial: prompts chunked, requests preempted, prefix-cache hits, the pool drained.
    assert any(kind == "prefill" and n < 16 for s in steps for _, _, n, kind in s["run"])
    assert sum(len(s["preempted"]) for s in steps) > 0
    assert sum(s["hits"] for s in steps) > 0
    assert without["radix_match"] >= 12


PYODIDE = pyodide_dir()  # `make pyodide` (a step of `make test`) installs it where npm exists


def test_the_control_plane_runs_in_pyodide_as_in_cpython(tmp_path):
    """What a reader's browser will run: the same driver under Pyodide (CPython compiled to WebAssembly, here in
    node), on nothing but the control plane's own files, makes the same decisions as CPython."""
    node = shutil.which("node")
    if node is None or not PYODIDE.is_dir():
        pytest.skip(
            f"Pyodide (npm package, run with node) is not installed at {PYODIDE}: `make pyodide` installs "
            f"it where npm exists (npm install --prefix .venv/pyodide pyodide@{PYODIDE_VERSION})"
        )
    files = control_plane_files()  # what the book's wheel holds (kvcourse.tools.playground_site)
    assert "kvcourse/control/__init__.py" in files and not any("model" in f or "kernels" in f for f in files)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    proc = subprocess.run([node, str(ROOT / "tests" / "pyodide_run.mjs"), str(PYODIDE), str(ROOT), str(script), *files],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    in_browser = json.loads(proc.stdout.strip().splitlines()[-1])
    assert in_browser == _run(blocked=True)


def test_the_guard_is_not_blind():
    """The hook does refuse torch: a data-plane import fails under it."""
    code = BLOCK_TORCH + "import kvcourse.paged.kv_store"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and "is refused here" in proc.stderr


CONTROL_MODULES = ["kvcourse/control/__init__.py", "kvcourse/control/playground.py", "kvcourse/sequence.py", "kvcourse/checks.py",
                   "kvcourse/lazy.py", "kvcourse/paged/block_manager.py", "kvcourse/paged/block_hash.py",
                   "kvcourse/paged/prefix_cache.py", "kvcourse/paged/radix.py", "kvcourse/paged/offload.py",
                   "kvcourse/paged/pool.py", "kvcourse/serving/scheduler.py"]  # fmt: skip
DATA_PLANE = ("torch", "triton", "numpy", "kvcourse.model", "kvcourse.batch", "kvcourse.backends", "kvcourse.kernels",
              "kvcourse.paged.kv_store", "kvcourse.paged.cache", "kvcourse.serving.engine",
              "kvcourse.serving.model_runner", "kvcourse.sampling", "kvcourse.generation")  # fmt: skip


@pytest.mark.parametrize("path", CONTROL_MODULES)
def test_control_plane_modules_import_nothing_of_the_data_plane_at_module_level(path):
    """The import-direction rule for the control plane: at module level (a function may import torch
    for the one data-plane job it has, as ``apply_transfers`` does), no torch, no Triton, no model."""
    tree = ast.parse((ROOT / path).read_text())
    module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    found = []
    for node in tree.body:  # module level only
        if isinstance(node, ast.If):  # ``if TYPE_CHECKING:`` imports are for annotations only
            continue
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            parts = package.split(".")
            base = parts[: len(parts) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            found += [name] if node.module else [f"{name}.{a.name}" for a in node.names]
    bad = [m for m in found if m.startswith(DATA_PLANE)]
    assert not bad, f"{path} imports the data plane at module level: {bad}"


def test_lazy_packages_import_names_on_first_use_and_keep_exports_over_submodules():
    """``import kvcourse`` imports no torch until a name that needs it is read; ``kvcourse.generate`` stays the
    function after the submodule that defines it, ``kvcourse/generation.py``, is imported (no submodule
    shares an exported name, so the import system never sets the package's attribute to a module)."""
    code = (
        BLOCK_TORCH
        + """
import kvcourse, kvcourse.paged, kvcourse.serving
print(set(kvcourse.paged.__all__) <= set(dir(kvcourse.paged)))
print(kvcourse.paged.BlockManager.__name__, kvcourse.serving.Scheduler.__name__)
"""
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["True", "BlockManager", "Scheduler"]
    code = "import kvcourse.generation, kvcourse, inspect; print(inspect.isfunction(kvcourse.generate))"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]
