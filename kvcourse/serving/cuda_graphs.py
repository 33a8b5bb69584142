"""Decode steps replayed from CUDA graphs: a step's hundreds of kernel launches become one.

A decode step of a 135M model does little arithmetic and launches a few hundred kernels, each costing
the host a few microseconds: the GPU waits on Python. A CUDA graph records a sequence of launches once
and replays it with one call. nano-vllm and vLLM capture one graph per **batch-size bucket** (1, 2, 4,
8, then every multiple of 16) for steps in which every sequence decodes one token; prefills, whose
shapes change every step, run eagerly. This module does the same for :class:`~kvcourse.serving.ModelRunner`:

* **static buffers.** A graph replays on the memory it was captured with. The step's inputs (token
  ids, positions, slot mapping, sequence lengths, block tables) live in device tensors sized for the
  largest bucket; each step copies its values into them and replays. The output (final hidden states)
  is a static tensor too; the logits are computed outside the graph, for the real rows only.
* **padding lanes.** A batch of 13 runs in the bucket of 16. The three spare lanes decode nothing: slot
  ``-1`` (the cache write skips it) and context length 0 (attention reads no key). Their rows compute
  garbage that nobody reads; every op of a layer is row by row, so it never reaches a real row.
* **what a captured forward may not do**: read a value back from the device (a ``.item()`` would be
  frozen into the graph, or fail), or choose shapes from device values. The model's
  :meth:`~kvcourse.LlamaModel.step_hidden_states` and the ``"triton"`` backend are written that way:
  every decision is made on the host, from the batch's host copies. Those copies describe the
  *graph*, not the step: context length "up to the most a sequence can hold", which only the KV split
  count depends on.

``capture=False`` runs the very same padded, static-buffer forward eagerly: how the bookkeeping is
tested on a machine without a GPU (``tests/test_cuda_graphs.py``); ``make gpu-check`` tests the capture.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence

import torch

from ..backends import backend_class
from ..batch import ForwardBatch, SeqSlice
from ..checks import check_int

__all__ = ["DecodeGraphs", "GraphBuckets", "bucket_for", "graph_batch_sizes"]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The buckets: 1, 2, 4, 8, then multiples of 16 up to the first one holding ``max_num_seqs`` (nano-vllm's)."""
    check_int("max_num_seqs", max_num_seqs, min=1)
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs + 16, 16)]
    return [s for s in sizes if s < max_num_seqs] + [bucket_for(max_num_seqs, sizes)]


def bucket_for(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``num_seqs`` sequences (``None``: more than the largest)."""
    return next((s for s in sizes if s >= num_seqs), None)


class GraphBuckets:
    """What decode-step and mixed-step graphs share: recording one bucket after a warm-up run, and all of them.

    A subclass has ``sizes`` (its buckets), ``graphs`` (bucket -> graph), ``memory_pool``, ``fell_back``,
    ``capture``, ``kv_store``, and the two methods a recording needs: ``load_padding(size)`` (every lane
    padding) and ``forward(size)`` (the static forward). ``kind`` names its steps in a warning.
    """

    kind = "steps"

    def capture_graph(self, size: int) -> None:
        """Record bucket ``size``'s forward (after one eager run, which compiles the kernels).

        Before the first step the static buffers hold padding only (slot -1, length 0): the warm-up
        run writes no K/V and reads none.
        """
        from ..kernels.triton_runtime import KernelFallbackWarning, counting_runs  # Triton: only where graphs run

        self.load_padding(size)
        stream = torch.cuda.Stream(self.kv_store.device)
        stream.wait_stream(torch.cuda.current_stream(self.kv_store.device))
        runs: Counter = Counter()
        with torch.cuda.stream(stream), counting_runs(runs):
            self.forward(size)  # warm-up: Triton compiles, the allocator sizes its blocks
        torch.cuda.current_stream(self.kv_store.device).wait_stream(stream)
        fell_back = sorted({kernel for kernel, how in runs if how == "fallback"})
        if fell_back:  # the torch stand-in reads the host copies (which describe the graph): eager steps only
            warnings.warn(f"{', '.join(fell_back)} could not compile here: {self.kind} run eagerly, without "
                          f"CUDA graphs", KernelFallbackWarning, stacklevel=3)  # fmt: skip
            self.fell_back = True
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self.forward(size)
        self.memory_pool = graph.pool()
        self.graphs[size] = graph

    def capture_all(self) -> None:
        """Capture every bucket now, largest first (they share one memory pool), as engines do at start-up."""
        for size in sorted(self.sizes, reverse=True):
            if self.capture and not self.fell_back and size not in self.graphs:
                self.capture_graph(size)


class DecodeGraphs(GraphBuckets):
    """One captured decode forward per bucket, over static buffers, for a model and its paged pool.

    Args:
        model: a :class:`~kvcourse.LlamaModel`.
        kv_store: the pool the steps read and write.
        backend: a backend whose class says it can be captured (``capturable = True``: ``"triton"``).
        max_num_seqs: the largest decode batch; the last bucket is the first multiple of 16 holding it.
        capture: record CUDA graphs (a CUDA device is needed), or run the same static forward eagerly.
    """

    kind = "decode steps"

    def __init__(self, model, kv_store, backend: str, max_num_seqs: int, capture: bool = True) -> None:
        self.backend_cls = backend_class(backend)
        if not getattr(self.backend_cls, "capturable", False):
            raise ValueError(f"backend {backend!r} cannot be captured in a CUDA graph (it decides shapes from the "
                             f"step's lengths); use backend='triton'")  # fmt: skip
        device = kv_store.device
        if capture and device.type != "cuda":
            raise ValueError(f"capture=True needs the pool on a CUDA device, got {device}; capture=False runs "
                             f"the same static forward eagerly")  # fmt: skip
        self.model, self.kv_store, self.capture = model, kv_store, capture
        self.sizes = graph_batch_sizes(max_num_seqs)
        n, config = self.sizes[-1], model.config
        self.block_size = kv_store.block_size
        self.max_blocks = -(-config.max_position_embeddings // self.block_size)  # a table's most entries
        # The static inputs: a step's values are copied in, then the graph replays on them.
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(3, n, **i64)  # rows: input ids, positions, slots (one copy fills all three)
        self.input_ids, self.positions, self.slot_mapping = self.tokens
        self.slot_mapping.fill_(-1)
        self.seq_lens = torch.zeros(n, **i32)
        self.block_tables = torch.zeros(n, self.max_blocks, **i32)
        self.query_start_loc = torch.arange(n + 1, **i32)  # one token per sequence, always
        self.hidden = torch.zeros(n, config.hidden_size, dtype=model.dtype, device=device)  # the graph's output
        self.pinned = device.type == "cuda"  # host buffers pinned: copies to the GPU that do not wait
        # RoPE's tables, made now for every position: nothing may grow them inside a capture.
        model.rope_rows(self.positions[:1], num_positions=config.max_position_embeddings)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_pool = None  # shared by every bucket's graph (captured largest first)
        self.replays = 0  # decode steps served from this object
        self.fell_back = False  # a kernel could not compile: every step runs the ordinary eager path

    # ---- one step ---------------------------------------------------------------------------------
    def can_run(self, seqs: Sequence[SeqSlice]) -> bool:
        """Whether the step is a decode-only step that fits the largest bucket."""
        return len(seqs) <= self.sizes[-1] and all(len(s.token_ids) == 1 for s in seqs)

    def ready(self, seqs: Sequence[SeqSlice]) -> bool:
        """Whether :meth:`run` serves this step: :meth:`can_run`, and its bucket's graph exists (captured
        now if need be). ``False`` for good once a kernel has fallen back to torch: the static forward's
        host copies describe the graph, not the step, and only the compiled kernels ignore them."""
        if self.fell_back or not self.can_run(seqs):
            return False
        size = bucket_for(len(seqs), self.sizes)
        if self.capture and size not in self.graphs:
            self.capture_graph(size)
        return not self.fell_back

    def run(self, seqs: Sequence[SeqSlice]) -> torch.Tensor:
        """Logits ``[B, vocab]`` of a decode-only step (its slots reserved, as for ``ModelRunner.forward``)."""
        if not self.ready(seqs):
            raise ValueError(f"a graph runs decode-only steps of at most {self.sizes[-1]} sequences, "
                             f"and only while every kernel compiles (fell back: {self.fell_back})")  # fmt: skip
        size = bucket_for(len(seqs), self.sizes)
        self.load_inputs(seqs, size)
        if self.capture:
            self.graphs[size].replay()
        else:
            self.forward(size)
        self.replays += 1
        return self.model.lm_head(self.hidden[: len(seqs)])  # outside the graph: only the real rows

    def load_inputs(self, seqs: Sequence[SeqSlice], size: int) -> None:
        """Write the step into the static buffers: real lanes first, then ``size - B`` padding lanes."""
        b, bs = len(seqs), self.block_size
        ids, positions, slots = [], [], []
        width = max(len(s.block_table) for s in seqs)
        tables = []
        for s in seqs:
            pos = s.num_computed_tokens  # the one new token's position
            table = list(s.block_table)
            if pos // bs >= len(table):
                raise ValueError(f"a block table of {len(table)} blocks does not cover position {pos}")
            ids.append(int(s.token_ids[0]))
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
            tables.append(table + [0] * (width - len(table)))
        pad = size - b
        host = dict(dtype=torch.int64, device="cpu")  # host-side on purpose: copied into the static buffers
        tokens = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], **host)
        lens = torch.tensor([p + 1 for p in positions] + [0] * pad, dtype=torch.int32, device="cpu")
        table_rows = torch.tensor(tables, dtype=torch.int32, device="cpu")
        if self.pinned:  # torch's caching host allocator reuses a pinned buffer only once its copy is done
            tokens, lens, table_rows = tokens.pin_memory(), lens.pin_memory(), table_rows.pin_memory()
        nb = self.pinned
        self.tokens[:, :size].copy_(tokens, non_blocking=nb)
        self.seq_lens[:size].copy_(lens, non_blocking=nb)
        # Columns past ``width`` keep older steps' entries: a kernel reads only the blocks under seq_lens.
        self.block_tables[:b, :width].copy_(table_rows, non_blocking=nb)

    # ---- the forward a graph records --------------------------------------------------------------
    def static_batch(self, size: int) -> ForwardBatch:
        """The ``size`` first lanes of the static buffers as a batch. Its host copies describe the graph:
        one token per sequence, contexts of up to the model's context length."""
        capacity = self.model.config.max_position_embeddings
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], block_size=self.block_size,
            query_start_loc_host=tuple(range(size + 1)), seq_lens_host=(capacity,) * size,
            max_block_host=self.kv_store.num_blocks - 1, token_range_host=(0, 0), checked=True,
        )  # fmt: skip

    def forward(self, size: int) -> None:
        """The decoder stack over the first ``size`` lanes, into ``self.hidden``: what a graph records."""
        batch = self.static_batch(size)
        hidden = self.model.step_hidden_states(batch, self.backend_cls(self.kv_store, batch))
        self.hidden[:size].copy_(hidden)

    def load_padding(self, size: int) -> None:
        """Every lane a padding lane: nothing is written, nothing is read."""
        self.slot_mapping[:size].fill_(-1)
        self.seq_lens[:size].zero_()
