"""The model runner: one step of many sequences on a paged pool.

The engine hands it the scheduler's decision for the step, a
:class:`~kvcourse.serving.SchedulerOutput` whose slots are already reserved;

1. :meth:`ModelRunner.prepare` packs every scheduled sequence's new tokens into one
   :class:`~kvcourse.batch.ForwardBatch` on the device (or a graph's static buffers), a :class:`PackedStep`;
2. :meth:`ModelRunner.launch` moves blocks between the device and host pools, does the copy-on-write copies,
   then runs the model once: ``model.forward_batch(batch, kv_store, backend_cls)``, the backend's class looked up
   once, when the runner is made.

Two calls, so that an engine can pack step n+1 while the device runs step n (the engine's ``overlap``): a token
sampled in step n that the host has not read yet is written into step n+1's inputs on the device
(:meth:`ModelRunner.feed_tokens`).

It decides nothing: which sequences run and how many tokens each feeds is the scheduler's job
(chapter 6). A sequence's share may be its whole prompt, the next chunk of a long prompt, or the one
token it just generated, all mixed in one step. Without a scheduler (chapters 4-5),
:meth:`ModelRunner.step` takes ``(seq_id, new_token_ids)`` pairs, reserves their slots itself (all or
nothing), packs them and runs them.

The backend names the pool it needs (:mod:`kvcourse.backends`): ``backend="paged-int8-torch"`` gets
an int8 pool.

On a CUDA GPU with the ``"triton"`` backend every step replays a CUDA graph, all of them recorded when the runner
is made (:mod:`kvcourse.serving.step_graphs`): decode-only steps one per batch size, steps that feed prompts one
per token count. A step larger than the largest graph, or one that asks for every token's logits, runs eagerly.
``graph_steps`` counts the steps served from a graph.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..backends import backend_class
from .step_graphs import GraphKey, StepGraphs
from .step_profile import FORWARD_SCOPE
from ..batch import ForwardBatch, SeqSlice
from ..checks import check_bool, check_hashable, check_int, check_token_ids
from ..paged import (BlockManager, BlockTransfer, NoFreeBlocksError, PagedKVStore, PrefixCachingBlockManager,
                     allocate_slots, apply_transfers)  # fmt: skip

if TYPE_CHECKING:
    from .scheduler import SchedulerOutput

__all__ = ["GRAPH_MODES", "UNKNOWN_TOKEN", "ModelRunner", "PackedStep", "graph_mode"]

GRAPH_MODES = ("capture", "eager", "off")
UNKNOWN_TOKEN = -1  # a sampled token the host has not read yet (the engine's overlap): its value is on the device


@dataclass
class PackedStep:
    """One step's inputs, packed on the device and not yet run (:meth:`ModelRunner.prepare`).

    ``input_ids``: the device rows of its token ids (what :meth:`ModelRunner.feed_tokens` writes); ``graph`` and
    ``last``: the graph that runs it and its rows whose logits are wanted, or ``batch``: the batch run eagerly.
    """

    out: SchedulerOutput | None  # its block moves and copies run at launch (None: ModelRunner.step's, none)
    input_ids: torch.Tensor
    graph: GraphKey | None = None
    last: torch.Tensor | slice | None = None
    batch: ForwardBatch | None = None
    all_logits: bool = False


def graph_mode(cuda_graphs: str | bool | None) -> str | None:
    """``cuda_graphs`` as one of :data:`GRAPH_MODES` (``True`` is ``"capture"``, ``False`` is ``"off"``), or ``None``
    (decided from the device and the backend)."""
    if cuda_graphs is None or cuda_graphs in GRAPH_MODES:
        return cuda_graphs
    if isinstance(cuda_graphs, bool):
        return "capture" if cuda_graphs else "off"
    if isinstance(cuda_graphs, str):
        raise ValueError(f"cuda_graphs must be one of {GRAPH_MODES}, True, False or None, got {cuda_graphs!r}")
    raise TypeError(f"cuda_graphs must be one of {GRAPH_MODES}, True, False or None, got {type(cuda_graphs).__name__}")


class ModelRunner:
    """A model and its paged KV pool.

    Args:
        model: a :class:`~kvcourse.LlamaModel`.
        num_blocks, block_size: the pool.
        backend: the paged attention backend (``"paged-torch"``; chapter 5 adds ``"triton"``; see
            :mod:`kvcourse.backends`), which also decides the kind of pool.
        enable_prefix_caching: the pool is a :class:`~kvcourse.paged.PrefixCachingBlockManager` (chapter 7).
        num_cpu_blocks: a second pool of blocks in host memory, for swapped sequences and (with prefix
            caching) evicted cached blocks (chapter 7). 0: none.
        cuda_graphs: how steps run. ``"capture"`` (or ``True``): from CUDA graphs, every one recorded now (a
            CUDA device and a backend that can be captured, ``"triton"``, are needed); ``"eager"``: the same
            padded static-buffer forward a graph records, run eagerly (any device; how a CPU tests the graphs'
            bookkeeping); ``"off"`` (or ``False``): every step built and run eagerly. ``None`` (default):
            ``"capture"`` when the model is on a CUDA device and the backend can be captured, else ``"off"``.
        max_num_seqs: the most sequences a step recorded in a graph holds (the engine passes its own limit).
        max_num_batched_tokens: the most tokens a step recorded in a graph feeds (the engine passes its
            own limit; default 2,048). Larger steps run eagerly.
    """

    def __init__(
        self,
        model,
        num_blocks: int,
        block_size: int = 16,
        backend: str = "paged-torch",
        enable_prefix_caching: bool = False,
        num_cpu_blocks: int = 0,
        cuda_graphs: bool | None = None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
    ) -> None:
        if not hasattr(model, "forward_batch") or not hasattr(model, "config"):
            raise TypeError(f"model must be a kvcourse.LlamaModel, got {type(model).__name__}")
        backend_cls = backend_class(backend)
        check_bool("enable_prefix_caching", enable_prefix_caching)
        check_int("num_cpu_blocks", num_cpu_blocks, min=0)
        mode = graph_mode(cuda_graphs)
        check_int("max_num_seqs", max_num_seqs, min=1)
        check_int("max_num_batched_tokens", max_num_batched_tokens, min=1)
        on_cuda = model.device.type == "cuda"
        capturable = getattr(backend_cls, "capturable", False)
        if mode == "capture" and not (on_cuda and capturable):
            raise ValueError(
                f"cuda_graphs={cuda_graphs!r} needs a model on a CUDA device and a backend that can be captured "
                f"('triton'); got a model on {model.device} and backend {backend!r}"
            )
        if mode == "eager" and not capturable:
            raise ValueError(
                f"cuda_graphs='eager' runs a graph's static forward, which backend {backend!r} cannot "
                f"(it decides shapes from the step's lengths); use backend='triton'"
            )
        if num_cpu_blocks and backend_cls.store_type is not PagedKVStore:
            raise ValueError(
                f"num_cpu_blocks needs a float pool (block moves copy K and V only); backend {backend!r} "
                f"stores a {backend_cls.store_type.__name__}"
            )
        self.model, self.backend, self.backend_cls = model, backend, backend_cls
        # The pools first: they check that they fit in memory before anything big is built.
        self.kv_store = backend_cls.make_store(model.config, num_blocks, block_size, model.dtype, model.device)
        # The host pool: same layout, in CPU memory (on a CPU-only machine both pools share the same DRAM).
        self.host_kv_store = (
            PagedKVStore.for_model(model.config, num_cpu_blocks, block_size, model.dtype, "cpu")
            if num_cpu_blocks
            else None
        )
        if enable_prefix_caching:
            self.block_manager = PrefixCachingBlockManager(num_blocks, block_size, num_host_blocks=num_cpu_blocks)
        else:
            self.block_manager = BlockManager(num_blocks, block_size, num_host_blocks=num_cpu_blocks)
        # Graphs last: the pool they read and write exists. Recorded now, as engines do at start-up, so that no
        # step pays for a recording.
        if mode is None:
            mode = "capture" if on_cuda and capturable else "off"
        self.graph_mode = mode
        self.graphs = (
            StepGraphs(model, self.kv_store, backend, max_num_seqs, max_num_batched_tokens, capture=mode == "capture")
            if mode != "off"
            else None
        )
        if mode == "capture":
            self.graphs.capture_all()
        self.num_transferred_blocks = {"to_host": 0, "to_device": 0}
        self.transfer_seconds = 0.0  # time spent copying blocks between the pools

    @property
    def block_size(self) -> int:
        return self.block_manager.block_size

    def step(self, work: Sequence[tuple[Hashable, Sequence[int]]], all_logits: bool = False) -> torch.Tensor:
        """Run one step; ``work`` lists ``(seq_id, new_token_ids)``. Returns logits ``[B, vocab]``.

        Row ``b`` is the next-token logits of ``work[b]``'s sequence (``all_logits=True``: one row per
        fed token, ``[N, vocab]``). A ``seq_id`` the pool has not seen starts a new sequence.
        Raises :class:`~kvcourse.paged.NoFreeBlocksError`, changing nothing, if the pool is too full,
        and ``ValueError``/``TypeError``, changing nothing, for bad work (a token outside the
        vocabulary, a sequence past the context, an id twice): everything is checked before a slot
        is reserved. (A forward that fails for another reason, such as running out of memory, leaves
        the step's slots reserved.)
        """
        if isinstance(work, tuple) or not isinstance(work, Sequence) or not work:
            raise ValueError("work must be a non-empty list of (seq_id, new_token_ids) pairs")
        bm, config = self.block_manager, self.model.config
        # Everything is checked before the pool changes: a refused step leaves no sequence behind
        # holding slots whose K/V were never written.
        checked = []
        for i, item in enumerate(work):
            if not isinstance(item, Sequence) or isinstance(item, str) or len(item) != 2:
                raise ValueError(f"work[{i}] must be a (seq_id, new_token_ids) pair, got {item!r}")
            seq_id = check_hashable(f"work[{i}]'s seq_id", item[0])
            tokens = check_token_ids(f"work[{i}]'s new_token_ids", item[1], config.vocab_size)
            cached = bm.num_tokens(seq_id) if seq_id in bm else 0
            if cached + len(tokens) > config.max_position_embeddings:
                raise ValueError(
                    f"work[{i}]: sequence {seq_id!r} of {cached} cached + {len(tokens)} new tokens exceeds the "
                    f"model's context length ({config.max_position_embeddings} positions)"
                )
            checked.append((seq_id, tokens))
        ids = [seq_id for seq_id, _ in checked]
        if len(set(ids)) != len(ids):
            raise ValueError(f"work names a sequence twice: {ids}")
        new = [seq_id for seq_id in ids if seq_id not in bm]
        needed = sum(
            bm.blocks_needed(len(tokens)) if seq_id in new else bm.blocks_to_append(seq_id, len(tokens))
            for seq_id, tokens in checked
        )
        if needed > bm.num_free_blocks:
            raise NoFreeBlocksError(f"the step needs {needed} free blocks, only {bm.num_free_blocks} are free")
        for seq_id in new:
            bm.allocate(seq_id, 0)
        starts = [allocate_slots(bm, self.kv_store, seq_id, len(tokens)) for seq_id, tokens in checked]
        return self.forward(
            [SeqSlice(tokens, start, bm.block_table(seq_id)) for (seq_id, tokens), start in zip(checked, starts)],
            all_logits,
        )

    def prepare(self, out, all_logits: bool = False) -> PackedStep:
        """Pack the step the scheduler chose (a :class:`~kvcourse.serving.SchedulerOutput`, its slots reserved)
        into device inputs, without running it: :meth:`launch` runs it (logits as :meth:`step`). A token the host
        has not read yet (:data:`UNKNOWN_TOKEN`, the last one a sequence feeds) is packed as 0;
        :meth:`feed_tokens` writes it on the device.

        Packing step n+1 while the device runs step n is safe: every write into device memory (a graph's static
        buffers too) is a copy queued on the stream behind step n, from a pinned host buffer that torch's caching
        allocator hands out again only once its copy is done, so the host-side inputs are double-buffered (and
        more) without a second set of device buffers."""
        table = self.block_manager.block_table
        seqs = []
        for s in out.scheduled:
            ids = s.token_ids  # a copy: changing it leaves the sequence alone
            if ids[-1] == UNKNOWN_TOKEN:
                ids[-1] = 0
            seqs.append(SeqSlice(ids, s.num_computed_tokens, table(s.seq.seq_id)))
        return self.pack(seqs, all_logits, out)

    def pack(self, seqs: Sequence[SeqSlice], all_logits: bool = False, out=None) -> PackedStep:
        """Pack ``seqs`` (slots reserved, K/V of earlier tokens in the pool): into the graphs' static buffers when
        every sequence decodes one token and a decode graph holds them, or the step fits a mixed-step graph
        (:meth:`StepGraphs.lookup`); else into a :class:`~kvcourse.batch.ForwardBatch` run eagerly."""
        key = None if all_logits or self.graphs is None else self.graphs.lookup(seqs)
        if key is not None:
            return PackedStep(out, self.graphs.input_ids, graph=key, last=self.graphs.load_inputs(seqs, key))
        batch = ForwardBatch.build(seqs, self.block_size, self.model.device)  # where the model and its pool are
        return PackedStep(out, batch.input_ids, batch=batch, all_logits=all_logits)

    def launch(self, step: PackedStep) -> torch.Tensor:
        """Run a packed step: its block moves and copy-on-write copies, then one forward. Returns its logits
        (on the device: nothing here waits for it).

        Why transfers first: a copy's ``dst_block`` was free when the scheduler took it, so it may be
        a block that the same step moves to the host (swapped out, or a cached block evicted to the
        host tier by that very take): the move must read it before the copy overwrites it. The other
        way round never happens (no transfer writes a block a copy reads or writes): copies are
        decided while the running sequences reserve their slots, and ``"to_device"`` transfers come
        from swap-ins and admissions, which happen after that, only in a step that preempted nobody,
        into blocks no running sequence holds. Tested in ``tests/test_bad_input.py``.
        """
        if step.out is not None:  # a scheduled step (ModelRunner.step's have no moves and no copies)
            if step.out.transfers:
                self.move_blocks(step.out.transfers)
            for cow in step.out.copies:
                self.kv_store.copy_block(cow.src_block, cow.dst_block)
        with torch.profiler.record_function(FORWARD_SCOPE):  # a label for profile_step (else a no-op)
            if step.graph is not None:
                return self.graphs.replay(step.graph, step.last)
            return self.model.forward_batch(step.batch, self.kv_store, self.backend_cls, all_logits=step.all_logits)

    def feed_tokens(self, step: PackedStep, rows: Sequence[int], tokens: torch.Tensor, picks: Sequence[int]) -> None:
        """Write ``tokens[picks[i]]`` into the packed step's input id at row ``rows[i]``, on the device: the tokens
        the step before sampled, which the host has not read (``tokens`` lives where the inputs do)."""
        index = torch.tensor([list(rows), list(picks)], dtype=torch.int64, device="cpu")  # built on the host
        if tokens.device.type == "cuda":  # pinned: the copy does not wait for the device
            index = index.pin_memory()
        index = index.to(tokens.device, non_blocking=True)
        step.input_ids.index_copy_(0, index[0], tokens[index[1]])

    @property
    def graph_steps(self) -> int:
        """Steps served from a CUDA graph (or, with ``cuda_graphs="eager"``, its eager twin): decode-only and mixed."""
        return sum(self.graphs.replays.values()) if self.graphs is not None else 0

    def forward(self, seqs: Sequence[SeqSlice], all_logits: bool = False) -> torch.Tensor:
        """Pack ``seqs`` (:meth:`pack`) and run them (:meth:`launch`): logits as :meth:`step`."""
        return self.launch(self.pack(seqs, all_logits))

    def move_blocks(self, transfers: Sequence[BlockTransfer]) -> None:
        """Copy blocks between the device pool and the host pool, in order, and time it."""
        if self.host_kv_store is None:
            raise ValueError("transfers need a host pool: make the runner with num_cpu_blocks > 0")
        start = time.perf_counter()
        apply_transfers(self.kv_store, self.host_kv_store, transfers)
        if self.kv_store.device.type == "cuda":
            torch.cuda.synchronize(self.kv_store.device)  # time the copies, not their launch
        self.transfer_seconds += time.perf_counter() - start
        for t in transfers:
            self.num_transferred_blocks[t.direction] += 1

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """``child_id`` shares every block of ``parent_id`` (copy-on-write on its first write)."""
        self.block_manager.fork(parent_id, child_id)

    def free(self, seq_id: Hashable) -> None:
        """Give ``seq_id``'s blocks back (shared blocks stay with their other owners)."""
        self.block_manager.free(seq_id)
