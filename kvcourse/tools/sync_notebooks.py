"""Write what every chapter notebook must say about itself, from ``book/chapters.yml`` and ``_config.yml``.

Usage: ``python -m kvcourse.tools.sync_notebooks [book/NN_x.ipynb ...] [--check] [--ref REF]``

For each chapter notebook (all of ``book/NN_*.ipynb`` when none is named) it writes

* the **Colab setup cell** (the first code cell): installs kvcourse from the repository at a fixed
  ref (the release tag ``v{version}``, or ``--ref``) with the chapter's extras, and the weights
  package ``--no-deps``; it does nothing outside Colab;
* the **chapter header** (a markdown cell tagged ``chapter-header`` right after the title cell):
  learning objectives, prerequisites, the measured time to run, and links to this chapter and to its
  exercises (solutions removed) on Colab;
* the notebook **metadata** that asks Colab for a GPU (``accelerator``), where the chapter wants one.

The time to run is measured, not typed: it is the span of the notebook's own execution timestamps
(``make notebooks`` records them), so re-run this tool after re-executing a notebook. The time on a GPU
comes from the newest ``gpu-check-*.json`` per GPU (``python -m kvcourse.gpu_check`` writes them into
``kvcourse/results/``, which ``benchmarks/results/`` links to) that timed this chapter's notebook
(:func:`gpu_check_runs`); failing that from ``gpu_runs`` in ``book/chapters.yml``; failing both, the
header says it was not timed.
Only source cells and metadata change; outputs are untouched, so nbval is unaffected.
The tool is idempotent: a second run changes nothing. ``--check`` writes nothing and exits 1 if a
notebook is out of date.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from kvcourse.instructor.notebook import cell_source
from kvcourse.results import gpu_check_notebook_runs
from kvcourse.tools.book_config import ROOT, BookConfig, Chapter, chapter_notebooks, load

HEADER_TAG = "chapter-header"
SETUP_MARKER = "COLAB_RELEASE_TAG"
SETUP_TAG = "remove-cell"  # the setup cell is not on the rendered page
GPU_CHECK_DIRS = ("kvcourse/results", "benchmarks/results")  # one folder under two names; both are read
GPU_CHECK_GLOB = "gpu-check-*.json"


def setup_source(cfg: BookConfig, chapter: Chapter, ref: str) -> str:
    extras = f"[{','.join(chapter.extras)}]" if chapter.extras else ""
    return (
        f"# On Colab: install kvcourse (at {ref}) with what this chapter needs, and the SmolLM2 weights.\n"
        "# Elsewhere (a laptop, CI, Binder) this cell does nothing.\n"
        "import os, sys\n"
        f'if "{SETUP_MARKER}" in os.environ or "google.colab" in sys.modules:\n'
        f'    !pip install -q "kvcourse{extras} @ {cfg.git_url()}@{ref}"\n'
        f"    !pip install -q --no-deps {cfg.model_package}"
    )


def _timestamps(nb: dict) -> list[datetime]:
    stamps = []
    for cell in nb["cells"]:
        for key in ("iopub.execute_input", "shell.execute_reply"):
            value = cell.get("metadata", {}).get("execution", {}).get(key)
            if value:
                stamps.append(datetime.fromisoformat(value.replace("Z", "+00:00")))
    return stamps


def run_seconds(nb: dict) -> float | None:
    """Wall time of the notebook's last full execution, from its cells' timestamps (None if absent)."""
    stamps = _timestamps(nb)
    return (max(stamps) - min(stamps)).total_seconds() if stamps else None


def format_duration(seconds: float) -> str:
    # Coarse on purpose: a re-execution on the same machine should not change the sentence.
    if seconds < 60:
        return "under a minute"
    return f"about {round(seconds / 30) / 2:g} min"


def gpu_check_files(root: Path) -> list[Path]:
    """Every committed ``gpu-check-*.json`` under ``root`` (each file once, though the folder has two names)."""
    found: dict[Path, Path] = {}
    for folder in GPU_CHECK_DIRS:
        for path in sorted((Path(root) / folder).glob(GPU_CHECK_GLOB)):
            found.setdefault(path.resolve(), path)
    return sorted(found.values(), key=lambda p: p.name)


def gpu_check_runs(root: Path, notebook: str) -> list[dict]:
    """The newest run of ``notebook`` on each GPU in the committed gpu-check JSONs, by device name.

    Newest by the provenance's full timestamp (:func:`_run_time`), so of two runs on one day the later wins.

    Each is ``{device, torch, date, seconds, passed, timed_out}``, read by :func:`kvcourse.results.gpu_check_notebook_runs`
    (which refuses a malformed file, naming it).
    """
    newest: dict[str, tuple[datetime, dict]] = {}
    for path in gpu_check_files(root):
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path.name}: not JSON ({exc})") from exc
        for run in gpu_check_notebook_runs(data, path.name):
            if run.pop("notebook") != notebook:
                continue
            # The run's full timestamp, not its day: several runs a day on one GPU are common, and the files
            # come sorted by name, where "-mixed-a" sorts before the plain name whatever the hour.
            when = _run_time(data, path.name)
            if run["device"] not in newest or when >= newest[run["device"]][0]:
                newest[run["device"]] = (when, run)
    return [newest[device][1] for device in sorted(newest)]


def _run_time(data: dict, name: str) -> datetime:
    """When a gpu-check run was made, from its provenance's ISO date (a date alone counts as midnight UTC)."""
    text = str(data["provenance"]["date"])
    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"{name}: provenance 'date' must be an ISO date or timestamp, got {text!r}") from exc
    return when if when.tzinfo else when.replace(tzinfo=timezone.utc)


def _gpu_run_text(run: dict) -> str:
    where = f"{run['device']} (torch {run['torch']}, {run['date']})"
    if run["passed"]:
        return f"{format_duration(run['seconds'])} on {where}"
    if run["timed_out"]:
        return f"stopped by the time limit on {where} after {format_duration(run['seconds'])}"
    return f"failed on {where} after {format_duration(run['seconds'])}"


def gpu_time(cfg: BookConfig, chapter: Chapter) -> str:
    """What the header says after "on a GPU:": a gpu-check JSON's time, else chapters.yml's gpu_runs, else none."""
    runs = gpu_check_runs(cfg.root, chapter.path.name)
    if runs:
        return "; ".join(_gpu_run_text(run) for run in runs)
    return (
        "; ".join(
            f"{format_duration(60 * run['minutes'])} on {run['device']} (torch {run['torch']}, {run['date']})"
            for run in chapter.gpu_runs
        )
        or "not timed yet"
    )


def header_source(cfg: BookConfig, chapter: Chapter, nb: dict) -> str:
    seconds = run_seconds(nb)
    if seconds is None:
        raise ValueError(f"{chapter.path.name} has no execution timestamps: execute it first (make notebooks)")
    gpu = gpu_time(cfg, chapter)
    name = chapter.path.name
    lines = ["**In this chapter you will**", ""]
    lines += [f"- {x}" for x in chapter.objectives]
    lines += ["", "**Before you start**", ""]
    lines += [f"- {x}" for x in chapter.prerequisites]
    lines += [
        "",
        f"**Time to run** (top to bottom): {format_duration(seconds)} on {cfg.executed_on}, measured from this "
        f"notebook's last execution; on a GPU: {gpu}. On Colab the setup cell's installs come on top. "
        f"[How the numbers in this book were measured]({cfg.pages_url}book/measurements.html).",
        "",
        f"**Run it yourself:** [this chapter on Colab]({cfg.colab_url(f'book/{name}')})"
        + (" (asks for a GPU)" if chapter.gpu else " (a CPU runtime is enough)")
        + f" · [the exercises on Colab]({cfg.colab_url(f'exercises/{name}')}), solutions removed"
        " · on a laptop: `make setup`, then `.venv/bin/jupyter lab book/`.",
    ]
    return "\n".join(lines)


def sync(nb: dict, cfg: BookConfig, chapter: Chapter, ref: str) -> dict:
    """Return a copy of ``nb`` with its setup cell, header and GPU metadata written; ``nb`` is unchanged."""
    nb = copy.deepcopy(nb)
    cells = nb["cells"]
    if not cells or cells[0]["cell_type"] != "markdown" or not cell_source(cells[0]).startswith("# "):
        raise ValueError(f"{chapter.path.name}: the first cell must be the markdown title '# N. Title'")
    code = [c for c in cells if c["cell_type"] == "code"]
    if not code or SETUP_MARKER not in cell_source(code[0]):
        raise ValueError(
            f"{chapter.path.name}: the first code cell must be the Colab setup cell (it tests {SETUP_MARKER})"
        )
    code[0]["source"] = setup_source(cfg, chapter, ref)
    # The book's page leaves it out (it does nothing there); Colab and the student copies run it.
    tags = code[0].setdefault("metadata", {}).setdefault("tags", [])
    if SETUP_TAG not in tags:
        tags.append(SETUP_TAG)

    headers = [i for i, c in enumerate(cells) if HEADER_TAG in c.get("metadata", {}).get("tags", [])]
    for i in reversed(headers):
        del cells[i]
    header = {"cell_type": "markdown", "metadata": {"tags": [HEADER_TAG]}, "source": header_source(cfg, chapter, nb)}
    if nb.get("nbformat", 4) > 4 or nb.get("nbformat_minor", 0) >= 5:
        header["id"] = HEADER_TAG
    cells.insert(1, header)

    meta = nb.setdefault("metadata", {})
    if chapter.gpu:  # what Colab reads when it opens the notebook: Runtime > GPU, a T4 on the free tier
        meta["accelerator"] = "GPU"
        meta.setdefault("colab", {})["gpuType"] = "T4"
    else:
        meta.pop("accelerator", None)
        meta.get("colab", {}).pop("gpuType", None)
        if meta.get("colab") == {}:
            del meta["colab"]
    return nb


def dumps(nb: dict) -> str:
    """The notebook as ``nbformat.write`` writes it, so an unchanged notebook stays byte-identical."""
    import nbformat

    return nbformat.writes(nbformat.from_dict(nb)) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="chapter notebooks (default: every book/NN_*.ipynb)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a notebook is out of date")
    parser.add_argument("--ref", help="git ref the setup cells install (default: the release tag v{version})")
    parser.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    args = parser.parse_args(argv)
    cfg = load(args.root)
    paths = args.notebooks or chapter_notebooks(args.root / "book")
    if not paths:
        parser.error(f"no chapter notebooks under {args.root / 'book'}")
    stale = []
    for path in paths:
        if not path.is_file():
            parser.error(f"no such notebook: {path}")
        text = path.read_text()
        new = dumps(sync(json.loads(text), cfg, cfg.chapter(path), args.ref or cfg.release_ref))
        if new == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(new)
            print(f"updated {path}")
    if args.check and stale:
        print("out of date (run `python -m kvcourse.tools.sync_notebooks`): " + ", ".join(map(str, stale)))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
