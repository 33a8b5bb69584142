"""The committed benchmark results travel with the package: read offline, never from the network."""

import json
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvcourse import results
from kvcourse.bench.measured import check_result
from kvcourse.compression.results import RESULTS_FILE, load_results

ROOT = Path(__file__).resolve().parents[1]


def test_find_load_and_newest():
    names = results.find()
    assert RESULTS_FILE in names and names == sorted(names)
    assert results.newest("cpu-decode-*.json") == "cpu-decode-2026-11-22.json"  # the later of two dates
    assert results.newest("no-such-*.json") is None
    bench = load_results()
    assert bench["benchmark"] == "bench_compression" and bench["text"]["tokens"] == 1024
    assert results.load("cpu-serving-2026-11-22.json") == json.loads(
        (ROOT / "kvcourse" / "results" / "cpu-serving-2026-11-22.json").read_text()
    )


def test_bad_names_are_refused_clearly():
    with pytest.raises(FileNotFoundError, match="no committed result 'no-such-file.json'.*cpu-compression"):
        results.load("no-such-file.json")
    for bad in ("../pyproject.toml", "x.txt", 3, ""):
        with pytest.raises(ValueError, match="name must be"):
            results.load(bad)
    with pytest.raises(ValueError, match="pattern"):
        results.find("")


def test_benchmarks_results_is_the_package_folder():
    # Benchmarks write to benchmarks/results/; the book reads kvcourse/results/: one folder, two names.
    assert (ROOT / "benchmarks" / "results").resolve() == (ROOT / "kvcourse" / "results").resolve()


def test_the_wheel_ships_every_result(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path),
                    str(ROOT)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = tmp_path.glob("kvcourse-*.whl")
    shipped = {Path(n).name for n in zipfile.ZipFile(wheel).namelist() if n.startswith("kvcourse/results/")}
    assert set(results.find()) <= shipped and "__init__.py" in shipped


def test_no_chapter_reads_results_from_the_network_or_the_checkout():
    for nb_path in sorted((ROOT / "book").glob("[0-9][0-9]_*.ipynb")):
        for cell in json.loads(nb_path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            code = "".join(cell["source"])
            assert not re.search(r"urlopen|requests\.get|/raw/|Path\([\"']\.\./benchmarks", code), (
                nb_path.name,
                code[:200],
            )


def test_every_committed_result_of_a_known_kind_is_valid():
    kinds = {name: check_result(name) for name in results.find()}
    assert kinds["kernels-nvidia-h200-2026-11-26.json"] == "kernels"
    assert kinds["cpu-serving-2026-11-22.json"] == "other"


def test_the_h200_kernel_run_is_committed_with_its_provenance():
    # The course's first GPU run (python -m kvcourse.bench kernels), kept as the benchmark wrote it.
    name = "kernels-nvidia-h200-2026-11-26.json"
    assert name in results.find("kernels-*.json")
    assert results.newest("kernels-*.json") == "kernels-nvidia-h200-2026-11-28.json"  # the H200's later run
    data = results.load(name)
    prov = data["provenance"]
    assert (prov["gpu"], prov["torch"], prov["triton"], prov["python"]) == (
        "NVIDIA H200",
        "2.11.0+cu130",
        "3.6.0",
        "3.12.3",
    )
    assert prov["compute_capability"] == "9.0" and prov["sms"] == 132 and prov["date"].startswith("2026-11-26")
    assert data["peak"]["bandwidth"] == 4.8e12 and round(data["copy_bandwidth"] / 1e9) == 4225
    # Every shape of the benchmark, every variant it times, timed as compiled code (SDPA as torch).
    shapes = {(r["batch"], r["context"]) for r in data["rows"]}
    assert shapes == {(b, c) for b in (1, 8, 32, 64, 128) for c in (512, 2048, 8192, 32768)} | {(1, 65536)}
    assert all("ms" in r for r in data["rows"]) and len(data["rows"]) == 5 * len(shapes)


def test_a_tampered_result_is_refused(monkeypatch):
    data = results.load("kernels-nvidia-h200-2026-11-26.json")
    data["rows"][0]["gbps"] *= 2
    monkeypatch.setattr(results, "load", lambda name: data)
    with pytest.raises(ValueError, match=r"rows\[0\] .*gbps .* is not bytes / ms"):
        check_result("kernels-nvidia-h200-2026-11-26.json")
    monkeypatch.setattr(results, "load", lambda name: {"check": "gpu", "steps": [{"step": "x", "notebooks": [{}]}]})
    with pytest.raises(ValueError, match="gpu-check-x.json: .*needs 'notebook'"):
        check_result("gpu-check-x.json")
