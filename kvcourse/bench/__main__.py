"""``python -m kvcourse.bench NAME [options]``: run one benchmark (``python -m kvcourse.bench --help`` lists them)."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = {
    "kernels": "chapter 5's decode attention kernels on a GPU (bandwidth, % of peak)",
    "splits": "every KV split count at the shapes where choose_num_splits decides, on a GPU (issue 30)",
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHMARKS:
        print("usage: python -m kvcourse.bench NAME [options]   (NAME --help for a benchmark's options)\n")
        for name, doc in BENCHMARKS.items():
            print(f"  {name:10s} {doc}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(f".{argv[0]}", __package__)
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
