"""The committed results of ``benchmarks/bench_compression.py``, which chapter 7 plots.

The sweep takes minutes, so the chapter reads its JSON (and recomputes a few points live to show
they still hold). In a clone of the repository the file is read from ``benchmarks/results/``.
Installed from git without the repository (Colab), it is read from the repository at the commit pip
installed, as recorded in the package's ``direct_url.json``.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

__all__ = ["RESULTS_FILE", "load_results"]

RESULTS_FILE = "cpu-compression-2026-11-22.json"


def _installed_source() -> tuple[str, str] | None:
    """(repository URL, commit) that pip installed this package from, if it came from git."""
    try:
        info = json.loads(metadata.distribution("kvcourse").read_text("direct_url.json") or "null")
    except metadata.PackageNotFoundError:
        return None
    if not info or "vcs_info" not in info:
        return None
    return info["url"].removesuffix(".git"), info["vcs_info"]["commit_id"]


def load_results(name: str = RESULTS_FILE) -> dict:
    """The benchmark's JSON: from this checkout, or from the repository at the installed commit."""
    local = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / name
    if local.exists():
        return json.loads(local.read_text(encoding="utf-8"))
    source = _installed_source()
    if source is None:
        raise FileNotFoundError(f"{local} not found, and kvcourse was not installed from a git repository")
    from urllib.request import urlopen

    repo, commit = source
    with urlopen(f"{repo}/raw/{commit}/benchmarks/results/{name}", timeout=30) as response:
        return json.loads(response.read())
