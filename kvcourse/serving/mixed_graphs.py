"""Mixed steps (prefill chunks beside decodes) replayed from CUDA graphs, one per token-count bucket.

:mod:`.cuda_graphs` records decode-only steps. A step that also feeds a prompt ran eagerly: its
attention padded the prompts to a ``[B, T, S]`` box whose shape changed every step. Profiled on an
H100 (issue 29's 96-request trace, ``benchmarks/profile_trace_gpu.py``), its 46 mixed steps took 5.2 s of
the trace's 6.1 s: about 45 ms each of Python launching some 2,000 small operations and 300 Triton
kernels for a forward the GPU runs in a few milliseconds, and on top of that about 65 ms each time
cuDNN met an attention shape it had not planned for.

Here a mixed step runs like a decode step: its tokens are copied into static buffers sized for a
**bucket of tokens** (64, 128, ..., up to the step budget ``max_num_batched_tokens``) and a graph
recorded for that bucket replays the whole forward. What makes the forward recordable is the
attention: :func:`~kvcourse.kernels.triton_ragged.ragged_paged` reads every sequence's rows where the
model packed them, with a grid fixed by the bucket, so nothing about the step's split into sequences is
decided on the host.

* **padding.** A step of 1,500 tokens runs in the bucket of 2,048: the 548 spare token rows write to
  slot ``-1`` (nowhere) and belong to no sequence, so no attention program writes them; their rows
  compute garbage nobody reads. Spare sequence lanes (a graph has room for ``max_num_seqs``) hold no
  rows and a length of 0.
* **logits** are computed outside the graph, for each sequence's last row only.

``capture=False`` runs the same static forward eagerly: how the bookkeeping is tested on a CPU, in
Triton's interpreter (``tests/test_mixed_graphs.py``); ``make gpu-check`` tests the capture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..batch import ForwardBatch, SeqSlice
from ..checks import check_int
from .cuda_graphs import GraphBuckets, bucket_for

__all__ = ["MixedGraphs", "RaggedAttention", "token_buckets"]

SMALLEST_BUCKET = 64  # tokens: below it, padding costs less than another graph


def token_buckets(max_num_batched_tokens: int) -> list[int]:
    """Token counts a graph is recorded for: 64, 128, 256, ... doubling up to the first one holding
    ``max_num_batched_tokens`` (the scheduler never feeds more in one step)."""
    check_int("max_num_batched_tokens", max_num_batched_tokens, min=1)
    sizes = [SMALLEST_BUCKET]
    while sizes[-1] < max_num_batched_tokens:
        sizes.append(2 * sizes[-1])
    return sizes


class RaggedAttention:
    """The attention backend of a recorded mixed step: each layer writes the step's K/V to their slots,
    then one ragged kernel attends for every sequence (:mod:`kvcourse.kernels.triton_ragged`)."""

    def __init__(self, kv_pool, batch: ForwardBatch) -> None:
        self.pool, self.batch = kv_pool, batch
        self.scale = 1.0 / math.sqrt(kv_pool.head_dim)

    def __call__(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        from ..kernels.triton_cache import reshape_and_cache
        from ..kernels.triton_ragged import ragged_paged, ragged_paged_attention_ref
        from ..kernels.triton_runtime import launch_or_fallback

        k_cache, v_cache, batch = self.pool.k_cache[layer_idx], self.pool.v_cache[layer_idx], self.batch
        reshape_and_cache(k.to(k_cache.dtype), v.to(v_cache.dtype), k_cache, v_cache, batch.slot_mapping,
                          check=False)  # fmt: skip
        config = (q.dtype, q.shape[-1], q.shape[1] // k_cache.shape[2], k_cache.shape[1])
        return launch_or_fallback(  # counted, so a recording sees a kernel that fell back (GraphBuckets)
            "ragged_paged_attention", q.device, config,
            lambda: ragged_paged(q, k_cache, v_cache, batch.block_tables, batch.seq_lens, batch.query_start_loc,
                                 self.scale),
            lambda: ragged_paged_attention_ref(q, k_cache, v_cache, batch.block_tables, batch.seq_lens,
                                               batch.query_start_loc, self.scale),
        )  # fmt: skip


class MixedGraphs(GraphBuckets):
    """One recorded forward per token bucket, over static buffers, for a model and its paged pool.

    Args:
        model: a :class:`~kvcourse.LlamaModel`.
        kv_store: the pool the steps read and write (a float pool: the ``"triton"`` backend's).
        max_num_seqs: the most sequences a step holds (the graph's sequence lanes).
        max_num_batched_tokens: the most tokens a step feeds; the last bucket holds it.
        capture: record CUDA graphs (a CUDA device is needed), or run the same static forward eagerly.
    """

    kind = "mixed steps"

    def __init__(self, model, kv_store, max_num_seqs: int, max_num_batched_tokens: int, capture: bool = True) -> None:
        check_int("max_num_seqs", max_num_seqs, min=1)
        device = kv_store.device
        if capture and device.type != "cuda":
            raise ValueError(f"capture=True needs the pool on a CUDA device, got {device}; capture=False runs "
                             f"the same static forward eagerly")  # fmt: skip
        self.model, self.kv_store, self.capture = model, kv_store, capture
        self.sizes = token_buckets(max_num_batched_tokens)
        n, lanes, config = self.sizes[-1], max_num_seqs, model.config
        self.num_lanes, self.block_size = lanes, kv_store.block_size
        self.max_blocks = -(-config.max_position_embeddings // self.block_size)
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.tokens = torch.zeros(3, n, **i64)  # rows: input ids, positions, slots
        self.input_ids, self.positions, self.slot_mapping = self.tokens
        self.slot_mapping.fill_(-1)
        self.lanes = torch.zeros(2 * lanes + 1, **i32)  # seq_lens [lanes], then query_start_loc [lanes + 1]
        self.seq_lens, self.query_start_loc = self.lanes[:lanes], self.lanes[lanes:]
        self.block_tables = torch.zeros(lanes, self.max_blocks, **i32)
        self.hidden = torch.zeros(n, config.hidden_size, dtype=model.dtype, device=device)
        self.pinned = device.type == "cuda"
        model.rope_rows(self.positions[:1], num_positions=config.max_position_embeddings)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.memory_pool = None
        self.replays = 0
        self.fell_back = False

    # ---- one step ---------------------------------------------------------------------------------
    def can_run(self, seqs: Sequence[SeqSlice]) -> bool:
        """Whether the step fits: at most ``max_num_seqs`` sequences and the largest bucket's tokens."""
        return 0 < len(seqs) <= self.num_lanes and sum(len(s.token_ids) for s in seqs) <= self.sizes[-1]

    def ready(self, seqs: Sequence[SeqSlice]) -> bool:
        """:meth:`can_run`, and its bucket's graph exists (recorded now if need be); ``False`` for good
        once a kernel fell back to torch (the torch stand-in reads host copies, which describe the graph)."""
        if self.fell_back or not self.can_run(seqs):
            return False
        size = bucket_for(sum(len(s.token_ids) for s in seqs), self.sizes)
        if self.capture and size not in self.graphs:
            self.capture_graph(size)
        return not self.fell_back

    def run(self, seqs: Sequence[SeqSlice]) -> torch.Tensor:
        """Logits ``[B, vocab]`` at each sequence's last new token (slots reserved, as for ``ModelRunner.forward``)."""
        if not self.ready(seqs):
            raise ValueError(f"a mixed graph runs steps of at most {self.num_lanes} sequences and {self.sizes[-1]} "
                             f"tokens, and only while every kernel compiles (fell back: {self.fell_back})")  # fmt: skip
        size = bucket_for(sum(len(s.token_ids) for s in seqs), self.sizes)
        last = self.load_inputs(seqs, size)
        if self.capture:
            self.graphs[size].replay()
        else:
            self.forward(size)
        self.replays += 1
        return self.model.lm_head(self.hidden[last])

    def load_inputs(self, seqs: Sequence[SeqSlice], size: int) -> torch.Tensor:
        """Write the step into the static buffers (padding after the real rows and lanes); return the
        device indices of each sequence's last row."""
        bs, lanes = self.block_size, self.num_lanes
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
        width = max(len(t) for t in tables)
        host = dict(dtype=torch.int64, device="cpu")  # host-side on purpose: copied into the static buffers
        tokens = torch.tensor([ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad], **host)
        spare = lanes - len(seqs)  # lanes without rows: length 0, and query_start_loc stays at the end
        lane_rows = torch.tensor(lens + [0] * spare + qsl + [qsl[-1]] * spare, dtype=torch.int32, device="cpu")
        table_rows = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device="cpu")
        last = torch.tensor(qsl[1:], dtype=torch.int64, device="cpu") - 1
        if self.pinned:
            tokens, lane_rows, table_rows, last = (t.pin_memory() for t in (tokens, lane_rows, table_rows, last))
        nb = self.pinned
        self.tokens[:, :size].copy_(tokens, non_blocking=nb)
        self.lanes.copy_(lane_rows, non_blocking=nb)
        self.block_tables[: len(seqs), :width].copy_(table_rows, non_blocking=nb)
        return last.to(self.hidden.device, non_blocking=nb)

    # ---- the forward a graph records --------------------------------------------------------------
    def static_batch(self, size: int) -> ForwardBatch:
        """The first ``size`` token rows and every lane as a batch; its host copies describe the graph."""
        capacity = self.model.config.max_position_embeddings
        return ForwardBatch(
            input_ids=self.input_ids[:size], positions=self.positions[:size], slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc, seq_lens=self.seq_lens, block_tables=self.block_tables,
            block_size=self.block_size, query_start_loc_host=(0,) + (size,) * self.num_lanes,
            seq_lens_host=(capacity,) * self.num_lanes, max_block_host=self.kv_store.num_blocks - 1,
            token_range_host=(0, 0), checked=True,
        )  # fmt: skip

    def forward(self, size: int) -> None:
        """The decoder stack over the first ``size`` token rows, into ``self.hidden``: what a graph records."""
        batch = self.static_batch(size)
        attn = RaggedAttention(self.kv_store, batch)
        hidden = self.model.step_hidden_states(batch, attn)
        self.hidden[:size].copy_(hidden)

    def load_padding(self, size: int) -> None:
        """Every row and lane padding: nothing is written, nothing is read."""
        self.slot_mapping[:size].fill_(-1)
        self.lanes.zero_()
