"""Steps replayed from CUDA graphs: a step's hundreds of kernel launches become one.

A step of a 135M model does little arithmetic and launches a few hundred kernels, each costing the host a few
microseconds: the GPU waits on Python. A CUDA graph records a sequence of launches once and replays it with one
call. One :class:`StepGraphs` records two kinds of step, as nano-vllm and vLLM do, when the engine starts:

* **decode steps** (every sequence feeds one token), one graph per **batch-size bucket** (1, 2, 4, 8, then every
  multiple of 16, nano-vllm's), through the backend the engine runs (``"triton"``: the paged decode kernel);
* **mixed steps** (prompt chunks beside decodes), one graph per **token-count bucket** (64, 128, ..., up to the
  step budget), through ``"triton-ragged"``: one kernel reads every sequence's rows where the model packed them,
  so nothing about the step's split into sequences is decided on the host (:mod:`kvcourse.backends.ragged`).

How a step runs from a graph:

* **static buffers.** A graph replays on the memory it was recorded with. The step's inputs (token ids,
  positions, slot mapping, sequence lengths, query start locations, block tables) live in device tensors
  sized for the largest bucket of either kind; each step copies its values into them and replays. The output
  (final hidden states) is a static tensor too; the logits are computed outside the graph, for the rows whose
  next token is wanted.
* **padding.** A batch of 13 decodes runs in the bucket of 16, a step of 1,500 tokens in the bucket of 2,048.
  Spare rows write to slot ``-1`` (nowhere) and spare sequence lanes have length 0 (no key to read). Their rows
  compute garbage nobody reads; every op of a layer is row by row, so it never reaches a real row.
* **what a recorded forward may not do**: read a value back from the device (a ``.item()`` would be frozen
  into the graph, or fail), or choose shapes from device values. The model's
  :meth:`~kvcourse.LlamaModel.step_hidden_states` and both backends are written that way: every decision is
  made on the host, from the batch's host copies. Those copies describe the *graph*, not the step: context
  length "up to the most a sequence can hold". The decode kernel's split-KV work is the one thing that depends
  on the real lengths: it is planned on the host every step into a static buffer the graph reads
  (:mod:`kvcourse.kernels.split_plan`), so a replayed step splits as its own lengths need.

``capture=False`` runs the very same padded, static-buffer forward eagerly (``ModelRunner(cuda_graphs="eager")``):
how the bookkeeping is tested on a machine without a GPU (``tests/test_step_graphs.py``, kernels in Triton's
interpreter); ``make gpu-check`` tests the capture.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Sequence

import torch

from ..backends import backend_class
from ..batch import ForwardBatch, SeqSlice
from ..checks import check_int
from ..kernels.split_plan import SplitPlan, plan_capacity

__all__ = ["GraphKey", "StepGraphs", "bucket_for", "graph_batch_sizes", "token_buckets"]

SMALLEST_TOKEN_BUCKET = 64  # tokens: below it, padding a mixed step costs less than another graph
GraphKey = tuple[str, int]  # ("decode", sequences) or ("mixed", tokens): which graph serves a step


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode buckets: 1, 2, 4, 8, then multiples of 16 up to the first one holding ``max_num_seqs`` (nano-vllm's)."""
    check_int("max_num_seqs", max_num_seqs, min=1)
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs + 16, 16)]
    return [s for s in sizes if s < max_num_seqs] + [bucket_for(max_num_seqs, sizes)]


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Mixed-step buckets: 64, 128, 256, ... doubling up to the first one holding ``max_num_batched_tokens``
    (the scheduler never feeds more in one step)."""
    check_int("max_num_batched_tokens", max_num_batched_tokens, min=1)
    sizes = [SMALLEST_TOKEN_BUCKET]
    while sizes[-1] < max_num_batched_tokens:
        sizes.append(2 * sizes[-1])
    return sizes


def bucket_for(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket holding ``n`` (``None``: more than the largest)."""
    return next((s for s in sizes if s >= n), None)


class StepGraphs:
    """One recorded forward per bucket of decode steps and of mixed steps, over static buffers.

    Args:
        model: a :class:`~kvcourse.LlamaModel`.
        kv_store: the pool the steps read and write (a float pool).
        backend: the decode steps' backend; it must say it can be recorded (``capturable = True``: ``"triton"``).
        max_num_seqs: the most sequences a step holds; the last decode bucket is the first multiple of 16 holding it.
        max_num_batched_tokens: the most tokens a step feeds; the last mixed bucket holds it.
        capture: record CUDA graphs (a CUDA device is needed; :meth:`capture_all` records them), or run the same
            static forward eagerly.
    """

    def __init__(
        self, model, kv_store, backend: str, max_num_seqs: int, max_num_batched_tokens: int, capture: bool = True
    ) -> None:
        # Both backends looked up once, now: a step only calls them.
        self.backend_cls, self.ragged_cls = backend_class(backend), backend_class("triton-ragged")
        if not getattr(self.backend_cls, "capturable", False):
            raise ValueError(
                f"backend {backend!r} cannot be captured in a CUDA graph (it decides shapes from the "
                f"step's lengths); use backend='triton'"
            )
        self.decode_sizes = graph_batch_sizes(max_num_seqs)
        self.token_sizes = token_buckets(max_num_batched_tokens)
        device = kv_store.device
        if capture and device.type != "cuda":
            raise ValueError(
                f"capture=True needs the pool on a CUDA device, got {device}; capture=False runs "
                f"the same static forward eagerly"
            )
        self.model, self.kv_store, self.capture = model, kv_store, capture
        self.num_lanes = max_num_seqs  # a mixed step's sequence lanes
        lanes, config = max(self.decode_sizes[-1], max_num_seqs), model.config
        rows = max(self.token_sizes[-1], self.decode_sizes[-1])
        self.block_size = kv_store.block_size
        self.max_blocks = -(-config.max_position_embeddings // self.block_size)  # a table's most entries
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(3, rows, **i64)  # rows: input ids, positions, slots (one copy fills all three)
        self.input_ids, self.positions, self.slot_mapping = self.tokens
        self.slot_mapping.fill_(-1)
        self.lanes = torch.zeros(2 * lanes + 1, **i32)  # seq_lens [lanes], then query_start_loc [lanes + 1]
        self.seq_lens, self.query_start_loc = self.lanes[:lanes], self.lanes[lanes:]
        self.block_tables = torch.zeros(lanes, self.max_blocks, **i32)
        # A decode step's split-KV work, planned from its real lengths into a buffer the graph reads (the lengths
        # the graph was recorded with say "up to the context length", which would split every step alike).
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None
        self.split_plan = SplitPlan(plan_capacity(lanes, kv_store.num_kv_heads, self.num_sms), lanes, device)
        self.hidden = torch.zeros(rows, config.hidden_size, dtype=model.dtype, device=device)  # the graphs' output
        self.pinned = device.type == "cuda"  # host buffers pinned: copies to the GPU that do not wait
        # RoPE's tables, made now for every position: nothing may grow them inside a capture.
        model.rope_rows(self.positions[:1], num_positions=config.max_position_embeddings)
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.memory_pool = None  # shared by every graph (recorded largest first)
        self.replays: Counter = Counter()  # steps served, by kind ("decode", "mixed")
        self.fell_back = False  # a kernel could not compile: every step runs the ordinary eager path

    # ---- which graph serves a step ----------------------------------------------------------------
    def lookup(self, seqs: Sequence[SeqSlice]) -> GraphKey | None:
        """The graph that serves this step, or ``None`` (it runs eagerly). Changes nothing.

        A decode step that fits a decode bucket takes that bucket; any other step that fits the lanes and a
        token bucket takes the mixed graph. ``None`` for good once a kernel has fallen back to torch: the
        static forward's host copies describe the graph, not the step, and only the compiled kernels ignore them.
        """
        if self.fell_back or not seqs:
            return None
        if len(seqs) <= self.decode_sizes[-1] and all(len(s.token_ids) == 1 for s in seqs):
            return "decode", bucket_for(len(seqs), self.decode_sizes)
        tokens = bucket_for(sum(len(s.token_ids) for s in seqs), self.token_sizes)
        return ("mixed", tokens) if len(seqs) <= self.num_lanes and tokens is not None else None

    def run(self, seqs: Sequence[SeqSlice]) -> torch.Tensor:
        """Logits ``[B, vocab]`` at each sequence's last new token (slots reserved, as for ``ModelRunner.forward``)."""
        key = self.lookup(seqs)
        if key is None:
            raise ValueError(
                f"no graph serves this step: graphs hold decode steps of at most {self.decode_sizes[-1]} "
                f"sequences and mixed steps of at most {self.num_lanes} sequences and "
                f"{self.token_sizes[-1]} tokens, and only while every kernel compiles "
                f"(fell back: {self.fell_back})"
            )
        return self.replay(key, self.load_inputs(seqs, key))

    def replay(self, key: GraphKey, last: torch.Tensor | slice) -> torch.Tensor:
        """Run graph ``key`` on the inputs :meth:`load_inputs` wrote (it returned ``last``); logits as :meth:`run`.
        Loading and replaying are two calls so that an engine can pack the next step while this one runs."""
        if self.capture and key not in self.graphs:
            raise RuntimeError(f"the {key[0]} graph for {key[1]} was not recorded: call capture_all() first")
        if self.capture:
            self.graphs[key].replay()
        else:
            self.forward(key)
        self.replays[key[0]] += 1
        return self.model.lm_head(self.hidden[last])  # outside the graph: only the rows whose token is wanted

    # ---- the static buffers -----------------------------------------------------------------------
    def load_inputs(self, seqs: Sequence[SeqSlice], key: GraphKey) -> torch.Tensor | slice:
        """Write the step into the static buffers (real rows and lanes first, then padding); return where each
        sequence's last row is (a slice for a decode step, whose row ``b`` is sequence ``b``)."""
        kind, size = key
        bs = self.block_size
        ids, positions, slots, lens, qsl, tables = [], [], [], [], [0], []
        for s in seqs:
            start, n, table = s.num_computed_tokens, len(s.token_ids), list(s.block_table)
            if -(-(start + n) // bs) > len(table):
                raise ValueError(f"a block table of {len(table)} blocks does not cover position {start + n - 1}")
            ids += s.token_ids
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            lens.append(start + n)
            qsl.append(qsl[-1] + n)
            tables.append(table)
        pad = size - qsl[-1]
        lanes = len(self.seq_lens)
        spare = lanes - len(seqs)
        if kind == "decode":  # one token a lane: padding lanes own one row each, writing and reading nothing
            qsl += range(qsl[-1] + 1, qsl[-1] + 1 + spare)
        else:  # lanes without rows: length 0, and query_start_loc stays at the end
            qsl += [qsl[-1]] * spare
        width = max(len(t) for t in tables)
        host = dict(dtype=torch.int64, device="cpu")  # host-side on purpose: copied into the static buffers
        tokens = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], **host)
        lane_rows = torch.tensor(lens + [0] * spare + qsl, dtype=torch.int32, device="cpu")
        table_rows = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cpu")
        if self.pinned:  # torch's caching host allocator reuses a pinned buffer only once its copy is done
            tokens, lane_rows, table_rows = tokens.pin_memory(), lane_rows.pin_memory(), table_rows.pin_memory()
        nb = self.pinned
        self.tokens[:, :size].copy_(tokens, non_blocking=nb)
        self.lanes.copy_(lane_rows, non_blocking=nb)
        # Columns past ``width`` keep older steps' entries: a kernel reads only the blocks under seq_lens.
        self.block_tables[: len(seqs), :width].copy_(table_rows, non_blocking=nb)
        if kind == "decode":
            self.split_plan.fill(lens + [0] * spare, self.kv_store.num_kv_heads, self.num_sms)
            return slice(0, len(seqs))
        last = torch.tensor(qsl[1 : len(seqs) + 1], dtype=torch.int64, device="cpu") - 1
        return last.pin_memory().to(self.hidden.device, non_blocking=True) if self.pinned else last

    def load_padding(self, key: GraphKey) -> None:
        """Every row and lane padding: nothing is written, nothing is read (before a recording)."""
        self.slot_mapping[: key[1]].fill_(-1)
        self.seq_lens.zero_()
        self.split_plan.clear()
        if key[0] == "decode":  # one row a lane, as every decode step has
            self.query_start_loc.copy_(torch.arange(len(self.query_start_loc), dtype=torch.int32, device="cpu"))
        else:  # no lane owns a row
            self.query_start_loc.zero_()

    # ---- the forward a graph records --------------------------------------------------------------
    def static_batch(self, key: GraphKey) -> ForwardBatch:
        """The static buffers as the batch a graph records. Its host copies describe the graph: one token per lane
        (decode) or every row in one sequence (mixed), contexts of up to the model's context length."""
        kind, size = key
        lanes = size if kind == "decode" else self.num_lanes
        qsl_host = tuple(range(size + 1)) if kind == "decode" else (0,) + (size,) * lanes
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: lanes + 1], seq_lens=self.seq_lens[:lanes],
            block_tables=self.block_tables[:lanes], block_size=self.block_size, query_start_loc_host=qsl_host,
            seq_lens_host=(self.model.config.max_position_embeddings,) * lanes,
            max_block_host=self.kv_store.num_blocks - 1, token_range_host=(0, 0), checked=True,
            split_plan=self.split_plan if kind == "decode" else None,
        )  # fmt: skip

    def forward(self, key: GraphKey) -> None:
        """The decoder stack over the bucket's rows, into ``self.hidden``: what a graph records."""
        batch = self.static_batch(key)
        backend = self.backend_cls if key[0] == "decode" else self.ragged_cls
        hidden = self.model.step_hidden_states(batch, backend(self.kv_store, batch))
        self.hidden[: key[1]].copy_(hidden)

    # ---- recording ----------------------------------------------------------------------------------
    def keys(self) -> list[GraphKey]:
        """Every graph, largest first (they share one memory pool, which the largest sizes)."""
        keys = [("mixed", n) for n in self.token_sizes] + [("decode", n) for n in self.decode_sizes]
        return sorted(keys, key=lambda k: k[1], reverse=True)

    def capture_all(self) -> None:
        """Record every graph now, as engines do at start-up. A kernel that cannot compile here stops the
        recording, with a warning, and every step then runs eagerly (:attr:`fell_back`)."""
        for key in self.keys():
            if self.fell_back:
                return
            if self.capture and key not in self.graphs:
                self.capture_graph(key)

    def capture_graph(self, key: GraphKey) -> None:
        """Record one graph (after one eager run, which compiles the kernels).

        Before the first step the static buffers hold padding only (slot -1, length 0): the warm-up run writes
        no K/V and reads none.
        """
        from ..kernels.triton_runtime import KernelFallbackWarning, counting_runs  # Triton: only where graphs run

        self.load_padding(key)
        device = self.kv_store.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        runs: Counter = Counter()
        with torch.cuda.stream(stream), counting_runs(runs):
            self.forward(key)  # warm-up: Triton compiles, the allocator sizes its blocks
        torch.cuda.current_stream(device).wait_stream(stream)
        fell_back = sorted({kernel for kernel, how in runs if how == "fallback"})
        if fell_back:  # the torch stand-in reads the host copies (which describe the graph): eager steps only
            warnings.warn(
                f"{', '.join(fell_back)} could not compile here: steps run eagerly, without CUDA graphs",
                KernelFallbackWarning,
                stacklevel=3,
            )
            self.fell_back = True
            return
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            self.forward(key)
        self.memory_pool = graph.pool()
        self.graphs[key] = graph
