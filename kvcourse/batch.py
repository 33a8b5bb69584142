"""What one forward step runs: :class:`ForwardBatch`, and the slot-mapping formula.

A serving engine runs many requests in one forward pass. Some are starting (a whole prompt), some
continue a long prompt cut into chunks, most are decoding one token. The step packs the new tokens of
all of them into one row of ``N`` tokens and describes the packing with a few small tensors, the
same ones vLLM's attention metadata, nano-vllm's context and SGLang's forward batch carry:

==================  ==============  ===========================================================
field               shape, dtype    meaning
==================  ==============  ===========================================================
input_ids           [N] int64       the new tokens, sequence after sequence
positions           [N] int64       each token's position in its own sequence (for RoPE, masks)
slot_mapping        [N] int64       the pool slot each token's K/V is written to
query_start_loc     [B+1] int32     sequence b owns tokens query_start_loc[b] : [b+1]
seq_lens            [B] int32       context length of sequence b after this step
block_tables        [B, M] int32    each sequence's blocks, padded with -1
==================  ==============  ===========================================================

A sequence's new tokens are the tail of its context: positions ``seq_lens[b] - q_len ..
seq_lens[b] - 1``. :meth:`ForwardBatch.build` checks the per-sequence facts once per step, on the host,
and computes every per-token field from them with tensor ops; the forward pass then trusts them and
never synchronises with the device to look at them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .checks import check_int
from .kernels.reference import slot_mapping  # the slot formula, one sequence on the host: slots_of's reference

__all__ = ["ForwardBatch", "SeqSlice", "slot_mapping", "slots_of"]


@dataclass(frozen=True)
class SeqSlice:
    """One sequence's share of a step: its new tokens, where they start, and its block table.

    ``num_computed_tokens`` tokens of the sequence already have K/V in the pool; ``token_ids`` are the
    next ones, at positions ``num_computed_tokens ..``. ``block_table`` must already cover them (the
    block manager allocates before the step is built).
    """

    token_ids: Sequence[int]
    num_computed_tokens: int
    block_table: Sequence[int]


@dataclass(frozen=True, eq=False)
class ForwardBatch:
    """The packed new tokens of ``B`` sequences and the metadata attention needs (see the module doc).

    Build it with :meth:`build`, which checks each sequence as it packs it. A batch made by hand is
    checked by :meth:`check` (``model.forward_batch`` calls it for any batch not checked yet), so an
    inconsistent one fails with a message naming the field; a built one is not checked twice.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    block_size: int
    # Host copies of the lengths, so backends can split the batch without asking the device.
    query_start_loc_host: tuple[int, ...] = field(default=(), repr=False)
    seq_lens_host: tuple[int, ...] = field(default=(), repr=False)
    max_block_host: int = field(default=-1, repr=False)  # largest block id any sequence uses
    token_range_host: tuple[int, int] = field(default=(0, 0), repr=False)  # smallest and largest token id
    checked: bool = field(default=False, repr=False)
    # A decode step's split-KV plan (kernels.split_plan.SplitPlan), already filled from the step's real lengths:
    # the "triton" backend then reads its work from it (what a CUDA graph can replay); None: it chooses splits itself.
    split_plan: object = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.query_start_loc_host:  # made by hand: read the host copies now, check on demand
            tensors = (self.query_start_loc, self.seq_lens, self.block_tables)
            if all(isinstance(t, torch.Tensor) for t in tensors):
                object.__setattr__(self, "query_start_loc_host", tuple(self.query_start_loc.tolist()))
                object.__setattr__(self, "seq_lens_host", tuple(self.seq_lens.tolist()))
                object.__setattr__(
                    self, "max_block_host", int(self.block_tables.max()) if self.block_tables.numel() else -1
                )
            if isinstance(self.input_ids, torch.Tensor) and self.input_ids.numel():
                object.__setattr__(self, "token_range_host", tuple(torch.stack(torch.aminmax(self.input_ids)).tolist()))

    def check(self) -> ForwardBatch:
        """Validate every field against the others (on the host, once); return the batch."""
        if not self.checked:
            qsl, lens, max_block = _validate(self)
            object.__setattr__(self, "query_start_loc_host", tuple(qsl))
            object.__setattr__(self, "seq_lens_host", tuple(lens))
            object.__setattr__(self, "max_block_host", max_block)
            object.__setattr__(self, "checked", True)
        return self

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def build(cls, seqs: Sequence[SeqSlice], block_size: int, device: torch.device | str = "cpu") -> ForwardBatch:
        """Pack ``seqs`` into one step: positions, slot mapping, ``query_start_loc``, ``seq_lens``, tables.

        Each sequence is checked once, on the host; the per-token fields are computed with tensor ops.
        """
        if isinstance(seqs, SeqSlice) or not isinstance(seqs, Sequence) or not seqs:
            raise ValueError("seqs must be a non-empty list of SeqSlice, one per sequence in the step")
        check_int("block_size", block_size, min=1)
        qsl, lens, tables, max_block = [0], [], [], -1
        for b, s in enumerate(seqs):
            if not isinstance(s, SeqSlice):
                raise TypeError(f"seqs[{b}] must be a SeqSlice, got {type(s).__name__}")
            n = len(s.token_ids)
            if n == 0:
                raise ValueError(f"seqs[{b}] has no new tokens: every sequence in a step needs at least one")
            start = check_int(f"seqs[{b}].num_computed_tokens", s.num_computed_tokens, min=0)
            table = list(s.block_table)
            used = -(-(start + n) // block_size)
            if used > len(table) or min(table[:used]) < 0:
                raise ValueError(
                    f"seqs[{b}].block_table is too short for its tokens: positions up to {start + n - 1} need "
                    f"{used} blocks of {block_size}, got {table[:used]}"
                )
            max_block = max(max_block, *table[:used])
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
            tables.append(table)
        # Built on the host from the host lists, checked there, then moved to ``device`` in one go.
        host = torch.device("cpu")
        width = max(len(t) for t in tables)
        block_tables = torch.tensor([t + [-1] * (width - len(t)) for t in tables], dtype=torch.int32, device=host)
        query_start_loc = torch.tensor(qsl, dtype=torch.int32, device=host)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=host)
        # Token i belongs to sequence seq_idx[i]; its position counts on from where that sequence stood.
        query_lens = torch.diff(query_start_loc).to(torch.int64)
        seq_idx = torch.repeat_interleave(torch.arange(len(seqs), device=host), query_lens)
        first_pos = (seq_lens.to(torch.int64) - query_lens)[seq_idx]
        positions = first_pos + torch.arange(qsl[-1], device=host) - query_start_loc[:-1].to(torch.int64)[seq_idx]
        slots = slots_of(block_tables, seq_idx, positions, block_size)
        if torch.unique(slots).numel() != slots.numel():
            raise ValueError("slot_mapping names one slot twice: two sequences overlap in the pool")
        tokens = [t for s in seqs for t in s.token_ids]
        batch = cls(
            input_ids=torch.tensor(tokens, dtype=torch.int64, device=host),
            positions=positions,
            slot_mapping=slots,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_tables=block_tables,
            block_size=block_size,
            query_start_loc_host=tuple(qsl),
            seq_lens_host=tuple(lens),
            max_block_host=max_block,
            token_range_host=(min(tokens), max(tokens)),
            checked=True,
        )
        return batch.to(device)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with its tensors on ``device`` (host copies kept: no revalidation).

        From the host to a GPU the six tensors travel in two copies (the int64 fields, the int32 ones)
        through pinned buffers, without waiting for the GPU: the step's only wait stays the read of
        its sampled tokens.
        """
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        if device.type == "cuda" and self.input_ids.device.type == "cpu":
            moved = _to_cuda_pinned(self, device)
        else:
            moved = {name: getattr(self, name).to(device) for name in _TENSOR_FIELDS}
        return ForwardBatch(
            **moved,
            block_size=self.block_size,
            query_start_loc_host=self.query_start_loc_host,
            seq_lens_host=self.seq_lens_host,
            max_block_host=self.max_block_host,
            token_range_host=self.token_range_host,
            checked=self.checked,
        )

    # ---- what backends and runners read --------------------------------------------------------
    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc_host[-1]

    @property
    def query_lens(self) -> list[int]:
        """New tokens per sequence."""
        q = self.query_start_loc_host
        return [b - a for a, b in zip(q, q[1:])]

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host)

    @property
    def last_token_indices(self) -> torch.Tensor:
        """Row of each sequence's last new token in the packed batch: where its next-token logits are."""
        return self.query_start_loc[1:].to(torch.int64) - 1

    def __repr__(self) -> str:
        return (
            f"ForwardBatch(seqs={self.num_seqs}, tokens={self.num_tokens}, query_lens={self.query_lens}, "
            f"seq_lens={list(self.seq_lens_host)}, block_size={self.block_size})"
        )


_TENSOR_FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")


def _to_cuda_pinned(batch: ForwardBatch, device: torch.device) -> dict[str, torch.Tensor]:
    """The batch's tensors on ``device``: each dtype's fields packed into one pinned host buffer, one
    asynchronous copy per buffer, then views. ``pin_memory`` draws from torch's caching host
    allocator, which hands a buffer out again only once the copy that read it has finished."""
    moved = {}
    for names in (("input_ids", "positions", "slot_mapping"), ("query_start_loc", "seq_lens", "block_tables")):
        parts = [getattr(batch, n).reshape(-1) for n in names]
        staged = torch.cat(parts).pin_memory().to(device, non_blocking=True)
        for name, piece in zip(names, staged.split([p.numel() for p in parts])):
            moved[name] = piece.view(getattr(batch, name).shape)
    return moved


def _validate(batch: ForwardBatch) -> tuple[list[int], list[int], int]:
    """Check a batch; return host copies of ``query_start_loc``, ``seq_lens`` and the largest block used."""
    int64, int32 = (torch.int64,), (torch.int32,)
    specs = (
        ("input_ids", 1, int64), ("positions", 1, int64), ("slot_mapping", 1, int64),
        ("query_start_loc", 1, int32), ("seq_lens", 1, int32), ("block_tables", 2, int32),
    )  # fmt: skip
    for name, ndim, dtypes in specs:
        t = getattr(batch, name)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in dtypes or t.ndim != ndim:
            raise ValueError(f"{name} must be a {ndim}-D {dtypes[0]} tensor, got {t.ndim}-D {t.dtype}")
    bs = batch.block_size
    check_int("block_size", bs, min=1)
    n = batch.input_ids.shape[0]
    for name in ("positions", "slot_mapping"):
        if getattr(batch, name).shape[0] != n:
            raise ValueError(f"{name} has {getattr(batch, name).shape[0]} entries but input_ids has {n} tokens")
    qsl, lens = batch.query_start_loc.tolist(), batch.seq_lens.tolist()
    if len(qsl) != len(lens) + 1 or batch.block_tables.shape[0] != len(lens):
        raise ValueError(
            f"query_start_loc must have B + 1 entries and block_tables B rows for B = len(seq_lens) = {len(lens)}, "
            f"got {len(qsl)} and {batch.block_tables.shape[0]}"
        )
    if not lens:
        raise ValueError("seq_lens is empty: a batch needs at least one sequence")
    if qsl[0] != 0 or qsl[-1] != n:
        raise ValueError(f"query_start_loc must run from 0 to the token count {n}, got {qsl}")
    if any(a >= b for a, b in zip(qsl, qsl[1:])):
        raise ValueError(f"query_start_loc must be strictly increasing, got {qsl}: sequences would overlap or be empty")
    positions, slots, tables = batch.positions.tolist(), batch.slot_mapping.tolist(), batch.block_tables.tolist()
    max_block = -1
    for b, (lo, hi) in enumerate(zip(qsl, qsl[1:])):
        want = list(range(lens[b] - (hi - lo), lens[b]))
        if positions[lo:hi] != want:
            raise ValueError(
                f"positions of sequence {b} must be consecutive and end at seq_lens[{b}] - 1 = {lens[b] - 1}: "
                f"expected {want[:3]}...{want[-1:]}, got {positions[lo:hi][:8]}"
            )
        used = -(-lens[b] // bs)
        table = tables[b]
        if used > len(table) or any(x < 0 for x in table[:used]):
            raise ValueError(
                f"block_tables[{b}] is too short for seq_lens[{b}] = {lens[b]}: needs {used} blocks of {bs}, "
                f"has {table[:used]}"
            )
        if slots[lo:hi] != slot_mapping(table[:used], want, bs):
            raise ValueError(f"slot_mapping of sequence {b} does not match its block table and positions")
        max_block = max(max_block, *table[:used])
    if len(set(slots)) != len(slots):
        raise ValueError("slot_mapping names one slot twice: two sequences overlap in the pool")
    return qsl, lens, max_block


def slots_of(
    block_tables: torch.Tensor, seq_idx: torch.Tensor, positions: torch.Tensor, block_size: int
) -> torch.Tensor:
    """:func:`slot_mapping` for many sequences at once, in tensor ops: token ``i`` of sequence
    ``seq_idx[i]`` at ``positions[i]``, read through ``block_tables [B, M]``. Unchecked."""
    blocks = block_tables[seq_idx, positions // block_size].to(torch.int64)
    return blocks * block_size + positions % block_size
