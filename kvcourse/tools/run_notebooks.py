"""Re-execute notebooks in place, the way nbval will re-run them (``make notebooks``).

Usage: ``python -m kvcourse.tools.run_notebooks book/*.ipynb [--timeout 1800]``

Each notebook runs in a fresh kernel with the notebook's folder as working
directory and ``PYTHONHASHSEED=0``, and is written back with
its outputs so GitHub, Colab and the book show them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def run(path: Path, timeout: int) -> float:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    start = time.perf_counter()
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path, help="notebooks to execute in place")
    parser.add_argument("--timeout", type=int, default=1800, help="seconds allowed per cell (default 1800)")
    args = parser.parse_args(argv)
    for path in args.notebooks:
        if not path.is_file() or path.suffix != ".ipynb":
            parser.error(f"not a notebook: {path}")
    for path in args.notebooks:
        print(f"executing {path} ...", flush=True)
        print(f"  done in {run(path, args.timeout):.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
