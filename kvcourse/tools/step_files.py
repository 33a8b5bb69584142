"""Which files and lines of kvcourse one engine step goes through (issue 51: a newcomer follows a step in at most 8).

:func:`trace_step` runs :meth:`~kvcourse.serving.Engine.step` under ``sys.settrace`` and records every kvcourse
function that runs. A function counts with all its lines (from its first decorator to its last line): that is what a
reader of the step reads. Module bodies run by a first import do not count, and the step traced is a warm one: the
engine has already run a step, so first-use work (lazy imports, tokenizer caches) stays out.

The step traced is a mixed one, as a serving engine runs most: a prompt's prefill beside another sequence's decode.
``backend="paged-torch"`` is the default CPU path; ``backend="triton"`` with ``cuda_graphs="eager"`` is the CUDA
path (the static forward a CUDA graph records, its kernels in Triton's interpreter on a CPU).

    python -m kvcourse.tools.step_files [--backend triton]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import kvcourse

__all__ = ["StepTrace", "trace_step", "step_engine"]

PACKAGE_DIR = Path(kvcourse.__file__).resolve().parent


@dataclass
class StepTrace:
    """What a traced call ran: ``functions[file]`` names the kvcourse functions run in ``file`` (a path relative
    to the package), ``lines[file]`` the line numbers of those functions' source."""

    functions: dict[str, set[str]]
    lines: dict[str, set[int]]

    @property
    def files(self) -> list[str]:
        return sorted(self.lines)

    @property
    def num_lines(self) -> int:
        return sum(len(lines) for lines in self.lines.values())

    @property
    def file_lines(self) -> int:
        """The lines of the whole files the step goes through (what the issue's count of 13 files counted)."""
        return sum(len((PACKAGE_DIR / f).read_text().splitlines()) for f in self.files)

    def table(self) -> str:
        """One row per file (the lines of the functions run, how many ran), then the totals."""
        rows = [f"{f:<34} {len(self.lines[f]):>5} lines  {len(self.functions[f]):>3} functions" for f in self.files]
        total = f"{len(self.files)} files: {self.num_lines} lines of functions run, {self.file_lines} lines in all"
        return "\n".join([*rows, total])


def _span(code) -> range:
    """The lines of a function's source, from ``def`` (or its first decorator) to its last line."""
    last = max((line for *_, line in code.co_lines() if line is not None), default=code.co_firstlineno)
    return range(code.co_firstlineno, last + 1)


def trace(fn: Callable[[], object]) -> StepTrace:
    """Run ``fn()`` and record the kvcourse functions it runs (any thread but this one is not traced)."""
    seen: set = set()

    def on_call(frame, event, arg):
        seen.add(frame.f_code)
        return None  # no per-line tracing: the call events are all we need

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        fn()
    finally:
        sys.settrace(previous)
    functions: dict[str, set[str]] = {}
    lines: dict[str, set[int]] = {}
    for code in seen:
        path = Path(code.co_filename).resolve()
        if code.co_name == "<module>" or not path.is_relative_to(PACKAGE_DIR):
            continue
        name = path.relative_to(PACKAGE_DIR).as_posix()
        functions.setdefault(name, set()).add(code.co_qualname)
        lines.setdefault(name, set()).update(_span(code))
    return StepTrace(functions, lines)


def step_engine(backend: str = "paged-torch", model=None):
    """An engine on the real model (SmolLM2-135M, loaded offline), one request already prefilled and a second
    one queued: its next step is a mixed step, prefill and decode. ``backend="triton"`` runs the CUDA path's
    static forward (``cuda_graphs="eager"``)."""
    from ..sequence import SamplingParams
    from ..serving import Engine

    if model is None:
        model, _ = kvcourse.load_pretrained()
    graphs = "eager" if backend == "triton" else "off"
    engine = Engine(model, num_blocks=16, block_size=16, max_num_seqs=4, backend=backend, cuda_graphs=graphs)
    params = SamplingParams(max_new_tokens=8)
    engine.add_request(list(range(1, 20)), params)
    engine.step()  # warm: the prefill of the first request
    engine.add_request(list(range(30, 41)), params)
    return engine


def trace_step(backend: str = "paged-torch", model=None) -> StepTrace:
    """The files and lines of one warm mixed :meth:`~kvcourse.serving.Engine.step` (see :func:`step_engine`)."""
    engine = step_engine(backend, model)
    return trace(engine.step)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="paged-torch", choices=["paged-torch", "triton"])
    args = parser.parse_args(argv)
    print(trace_step(args.backend).table())


if __name__ == "__main__":
    main()
