"""What the book's playground needs on the site: Pyodide and the control plane's wheel, under ``_static/playground``.

The book build (:mod:`kvcourse.tools.sphinx_book`, at ``build-finished``) calls :func:`install`:

* **Pyodide**'s core files (the interpreter in WebAssembly and the standard library, no extra packages), from
  the npm package ``pyodide`` that ``make book`` installs into ``.venv/pyodide`` (``KVCOURSE_PYODIDE``: another
  folder). Nothing is fetched from a CDN, at build time or in the reader's browser.
* **The control plane's wheel**, ``kvcourse_control-<version>-py3-none-any.whl``: exactly the modules that
  ``import kvcourse.control.playground`` loads when torch, Triton and numpy cannot be imported (found by doing
  that in a subprocess), so the browser gets the same files the tests run.
* ``manifest.json``: the wheel's name, the Pyodide version and the bytes a reader downloads on the first click.

What the first click costs is stated beside the widget's button (:func:`first_click_cost`): this build's bytes,
and the time to the first step on a throttled connection, quoted from the newest committed measurement
(``kvcourse/results/playground-first-click-*.json``, written by ``tests/test_browser.py`` as
``_build/playground-cost.json``). The files are served as they are: GitHub Pages gzips text types (the ``.mjs``
and ``.json`` files, 1.4 MB of the total) on its own, ``python_stdlib.zip`` and the wheel are zip archives
already, and whether it gzips ``application/wasm`` is undocumented, so the stated size is the uncompressed one
(an upper bound) and ``gzip_bytes`` says what a host that compresses everything would send.

``python -m kvcourse.tools.playground_site OUT`` writes the same into ``OUT``.
"""

from __future__ import annotations

import base64
import functools
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYODIDE_VERSION = "314.0.7"  # the npm package `make book` installs
PYODIDE_FILES = ("pyodide.mjs", "pyodide.asm.mjs", "pyodide.asm.wasm", "python_stdlib.zip", "pyodide-lock.json")
ENTRY = "kvcourse.control.playground"

# Python that makes ``import torch`` (and Triton, numpy) fail, as in a browser: the wheel's contents and the
# control plane's tests run after it.
REFUSE_DATA_PLANE = """
import sys
class _Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton", "numpy"):
            raise ImportError(f"{name} is refused here, as in a browser (kvcourse.tools.playground_site)")
sys.meta_path.insert(0, _Refuse())
"""


def pyodide_dir() -> Path:
    """Where Pyodide's npm package is: ``KVCOURSE_PYODIDE``, else ``.venv/pyodide/node_modules/pyodide``."""
    return Path(os.environ.get("KVCOURSE_PYODIDE") or ROOT / ".venv" / "pyodide" / "node_modules" / "pyodide")


def control_plane_files() -> list[str]:
    """Package-relative paths (``kvcourse/...``) of the modules the playground imports, the data plane refused."""
    code = (
        REFUSE_DATA_PLANE
        + f"import {ENTRY}\n"
        + ("print('\\n'.join(sorted(m.__file__ for n, m in sys.modules.items() if n.split('.')[0] == 'kvcourse')))")
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"the control plane does not import without torch:\n{proc.stderr[-2000:]}")
    return [Path(f).resolve().relative_to(ROOT).as_posix() for f in proc.stdout.split()]


def build_wheel(out_dir: Path) -> Path:
    """The control plane as a wheel in ``out_dir`` (byte-for-byte the same for the same sources)."""
    from kvcourse import __version__

    name = f"kvcourse_control-{__version__}"
    wheel = Path(out_dir) / f"{name}-py3-none-any.whl"
    entries = [(f, (ROOT / f).read_bytes()) for f in control_plane_files()]
    info = f"{name}.dist-info"
    entries.append(
        (
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: kvcourse-control\nVersion: {__version__}\n"
            "Summary: kvcourse's control plane (scheduler, block managers), torch-free\n".encode(),
        )
    )
    entries.append(
        (
            f"{info}/WHEEL",
            b"Wheel-Version: 1.0\nGenerator: kvcourse.tools.playground_site\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n",
        )
    )
    record = "".join(f"{path},sha256={_digest(data)},{len(data)}\n" for path, data in entries) + f"{info}/RECORD,,\n"
    entries.append((f"{info}/RECORD", record.encode()))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in entries:
            zf.writestr(zipfile.ZipInfo(path, date_time=(2026, 1, 1, 0, 0, 0)), data, zipfile.ZIP_DEFLATED)
    return wheel


def _digest(data: bytes) -> str:
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def install(static_dir: Path) -> dict | None:
    """Write the playground's files under ``static_dir/playground``; None (and nothing written) without Pyodide."""
    source = pyodide_dir()
    missing = [f for f in PYODIDE_FILES if not (source / f).is_file()]
    if missing:
        return None
    out = Path(static_dir) / "playground"
    shutil.rmtree(out, ignore_errors=True)
    (out / "pyodide").mkdir(parents=True)
    for f in PYODIDE_FILES:
        shutil.copyfile(source / f, out / "pyodide" / f)
    version = json.loads((source / "package.json").read_text())["version"]
    wheel = build_wheel(out)
    files = [out / "pyodide" / f for f in PYODIDE_FILES] + [wheel]
    manifest = {
        "wheel": wheel.name,
        "pyodide": version,
        "bytes": sum(f.stat().st_size for f in files),
        "files": {f.relative_to(out).as_posix(): f.stat().st_size for f in files},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


MEASUREMENTS = "playground-first-click-*.json"  # in kvcourse/results: the throttled first click, measured


def measured_first_click() -> dict | None:
    """The newest committed measurement of the first click on a throttled connection, or None."""
    from kvcourse import results

    name = results.newest(MEASUREMENTS)
    if name is None:
        return None
    data = results.load(name)
    keys = ("ready_after_click_s", "throttle", "machine", "date", "on_click_bytes")
    return {"file": name, **{k: data[k] for k in keys}}


@functools.lru_cache(maxsize=1)
def first_click_cost() -> dict | None:
    """What opening the playground downloads on this build, and the committed throttled measurement; None without
    Pyodide. ``bytes`` counts every file of :func:`install` (the manifest's sum), ``wasm_bytes`` the interpreter,
    ``gzip_bytes`` the same files gzipped (what a host that compresses them all would send)."""
    import tempfile

    source = pyodide_dir()
    if any(not (source / f).is_file() for f in PYODIDE_FILES):
        return None
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(Path(tmp)).read_bytes()
    blobs = [(source / f).read_bytes() for f in PYODIDE_FILES] + [wheel]
    return {
        "bytes": sum(len(b) for b in blobs),
        "wasm_bytes": (source / "pyodide.asm.wasm").stat().st_size,
        "gzip_bytes": sum(len(gzip.compress(b, compresslevel=6, mtime=0)) for b in blobs),
        "measured": measured_first_click(),
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="a site's _static folder: the files go into OUT/playground")
    args = parser.parse_args(argv)
    manifest = install(args.out)
    if manifest is None:
        print(
            f"Pyodide is not installed at {pyodide_dir()}: npm install --prefix .venv/pyodide pyodide@{PYODIDE_VERSION}"
        )
        return 1
    print(json.dumps(manifest, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
