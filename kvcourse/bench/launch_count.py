"""How many kernels one decode step launches, counted on a CPU.

On a GPU the profiler counts a step's kernels (``kernel_launches`` in ``gpu-engine-*.json``: 342-343 for SmolLM2's
30 layers before RoPE was fused with the cache write). Without one, the same step runs here with every Triton
kernel in Triton's interpreter, and two counters stand in for the profiler:

* every Triton launch (``kernel[grid](...)``), one kernel each;
* every aten op that would launch a kernel (or a copy) on a GPU, seen by a ``TorchDispatchMode`` below autograd:
  views and allocations launch nothing (``view``, ``split``, ``empty``), anything else is one kernel
  (``mm`` is one cuBLAS call, ``index`` one gather, ``copy_`` one copy). Ops inside a Triton launch (the
  interpreter's own copies) are not counted.

The layer's small ops run as their Triton kernels here too (:data:`kvcourse.kernels.fused.KERNEL_DEVICES` takes
the CPU while counting), as they do on a GPU. The step counted is the engine's decode step with CUDA graphs
(``ModelRunner(cuda_graphs="eager")`` runs, eagerly, the forward a graph records): the copies into the static
buffers, the recorded forward, the head on the wanted rows, the greedy argmax and its read back to the host.
``python -m kvcourse.bench.launch_count [--unfused]`` prints the count for SmolLM2-135M (``--unfused``: with RoPE,
the cache write, the paged kernel and its merge launched apart, as before issue 49).
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LaunchCounter", "count_launches", "counting_launches", "decode_step_launches"]

# aten ops that are not views yet launch nothing: allocations, metadata, the profiler's marks.
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "_unsafe_view", "detach", "lift_fresh", "resize_", "set_",
              "promote_types", "_record_function_enter_new", "_record_function_exit"}  # fmt: skip


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


class LaunchCounter(TorchDispatchMode):
    """Counts, by name, the kernels the ops run under it would launch on a GPU (see the module doc).

    Everything is on the CPU here, so which tensors would live on the GPU is tracked: those passed to
    :meth:`on_device` (weights, the pool, static buffers), those a Triton kernel takes, and every result of an op
    that reads one. An op on host tensors only (a split plan being built, the rows of a copy) launches nothing.
    """

    def __init__(self) -> None:
        super().__init__()
        self.launches: Counter = Counter()  # "aten.mm" / "triton._paged_decode_kernel" -> launches
        self._in_triton = 0
        self._device: set[int] = set()  # storages that would live on the GPU (their data pointers)

    def on_device(self, *tensors: torch.Tensor) -> None:
        """Say that these tensors live on the GPU in the step being counted."""
        self._device.update(t.untyped_storage().data_ptr() for t in tensors)

    def _touches_device(self, tensors: list[torch.Tensor]) -> bool:
        return any(t.untyped_storage().data_ptr() in self._device for t in tensors)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._in_triton or not self._touches_device(_tensors((args, kwargs))):
            return out  # inside a launch (the interpreter's own work), or host work
        name = func.overloadpacket.__name__
        if not func.is_view and name not in _NO_KERNEL:
            self.launches[f"aten.{name}"] += 1
        self.on_device(*_tensors(out))
        return out

    @contextlib.contextmanager
    def triton_launches(self) -> Iterator[None]:
        """Count each interpreted Triton launch as one kernel (and none of the ops inside it)."""
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        counter = self

        def run(fn, *args, **kwargs):
            counter.launches[f"triton.{fn.fn.__name__}"] += 1
            counter.on_device(*_tensors((args, kwargs)))
            counter._in_triton += 1
            try:
                return original(fn, *args, **kwargs)
            finally:
                counter._in_triton -= 1

        InterpretedFunction.run = run
        try:
            yield
        finally:
            InterpretedFunction.run = original


@contextlib.contextmanager
def counting_launches() -> Iterator[LaunchCounter]:
    """A block whose kernels are counted (CPU tensors, Triton interpreting): yields the :class:`LaunchCounter`."""
    from ..kernels import fused
    from ..kernels.triton_runtime import interpreting

    if not interpreting():
        raise RuntimeError("counting launches needs Triton's interpreter (TRITON_INTERPRET=1, a machine without GPU)")
    counter = LaunchCounter()
    devices = fused.KERNEL_DEVICES
    fused.KERNEL_DEVICES = (*devices, "cpu")  # the layer's small ops as their Triton kernels, as on a GPU
    try:
        with counter.triton_launches(), counter:
            yield counter
    finally:
        fused.KERNEL_DEVICES = devices


def count_launches(fn: Callable[[], object], device_tensors=()) -> Counter:
    """Run ``fn()`` and return the kernels it would launch on a GPU, by name (see :func:`counting_launches`):
    ``device_tensors`` are those that live on the GPU before it runs (every other input is host data)."""
    if not callable(fn):
        raise TypeError(f"fn must be a callable, got {type(fn).__name__}")
    with counting_launches() as counter:
        counter.on_device(*device_tensors)
        fn()
    return counter.launches


def decode_step_launches(model, batch_size: int = 2, context: int = 20, backend: str = "triton") -> dict:
    """The kernels of one engine decode step of ``batch_size`` sequences with ``context`` cached tokens each.

    Returns ``{"total", "per_layer" (a list), "outside_layers", "by_kernel"}``. The prompts are prefilled first
    (not counted); the decode step runs the static forward a CUDA graph records (see the module doc).
    """
    from ..checks import check_int
    from ..serving.model_runner import ModelRunner

    check_int("batch_size", batch_size, min=1)
    check_int("context", context, min=1)
    bs = 16
    blocks = batch_size * -(-(context + 1) // bs) + 1
    runner = ModelRunner(model, blocks, bs, backend=backend, cuda_graphs="eager", max_num_seqs=batch_size)
    vocab = model.config.vocab_size
    runner.step([(b, [(7 * b + i) % vocab for i in range(context)]) for b in range(batch_size)])  # the prompts
    marks: list[int] = []  # launches so far when each layer (then the final norm) starts
    graphs, store = runner.graphs, runner.kv_store
    on_gpu = [*model.parameters(), *store.k_cache, *store.v_cache, graphs.tokens, graphs.lanes, graphs.block_tables,
              graphs.hidden, graphs.split_plan.buffer, *_tensors((model._rope_signed, model._rope_tables))]  # fmt: skip
    with counting_launches() as counter:
        counter.on_device(*on_gpu)
        hooks = [m.register_forward_pre_hook(lambda *_: marks.append(sum(counter.launches.values())))
                 for m in (*model.layers, model.norm)]  # fmt: skip
        try:
            runner.step([(b, [b + 1]) for b in range(batch_size)]).argmax(dim=-1).tolist()
        finally:
            for hook in hooks:
                hook.remove()
    counter.launches["readback of the sampled tokens (.tolist())"] += 1  # a copy the dispatcher does not see
    per_layer = [b - a for a, b in itertools.pairwise(marks)]
    total = sum(counter.launches.values())
    return {"total": total, "per_layer": per_layer, "outside_layers": total - sum(per_layer),
            "by_kernel": dict(sorted(counter.launches.items()))}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    import argparse

    from ..backends.triton import TritonBackend
    from ..loader import load_pretrained

    parser = argparse.ArgumentParser(description="Kernels one engine decode step launches (counted on a CPU).")
    parser.add_argument("--batch", type=int, default=2, help="sequences in the step")
    parser.add_argument("--unfused", action="store_true", help="RoPE, cache write, paged kernel and merge apart")
    parser.add_argument("--json", help="write both counts (fused and unfused), with provenance, to this file")
    args = parser.parse_args(argv)
    model = load_pretrained()[0]  # SmolLM2-135M, offline (the count does not depend on the weights)
    if args.json:
        from ..utils import cpu_model
        from .kernels import provenance

        report = {"what": "kernels one engine decode step launches (python -m kvcourse.bench.launch_count)"}
        for fused in (True, False):
            TritonBackend.fuse_attention = fused
            report["fused" if fused else "unfused"] = decode_step_launches(model, batch_size=args.batch)
        TritonBackend.fuse_attention = True
        report |= {
            "batch": args.batch,
            "provenance": provenance(torch.device("cpu")) | {"machine": cpu_model()},
        }
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"kernels a decode step: {report['unfused']['total']} unfused, {report['fused']['total']} fused")
        return
    TritonBackend.fuse_attention = not args.unfused
    counts = decode_step_launches(model, batch_size=args.batch)
    layers = Counter(counts["per_layer"])
    print(f"kernels a decode step: {counts['total']} ({', '.join(f'{n} x {k}' for k, n in layers.items())} a layer, "
          f"{counts['outside_layers']} outside the layers)")  # fmt: skip
    for name, n in counts["by_kernel"].items():
        print(f"  {n:4d}  {name}")


if __name__ == "__main__":
    main()
