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
seq_lens[b] - 1``. :meth:`ForwardBatch.build` computes every field from per-sequence facts and checks
them, once per step, on the host; the forward pass then trusts them and never synchronises with the
device to look at them again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .checks import check_int

__all__ = ["ForwardBatch", "SeqSlice", "slot_mapping"]


def slot_mapping(block_table: Sequence[int], positions: Sequence[int] | range, block_size: int) -> list[int]:
    """The pool slots holding ``positions`` of a sequence with ``block_table``: the one formula.

    ``slot = block_table[pos // block_size] * block_size + pos % block_size``: offset
    ``pos % block_size`` of the physical block that holds logical block ``pos // block_size``, in a
    pool viewed as one flat array of ``num_blocks * block_size`` token slots.
    """
    check_int("block_size", block_size, min=1)
    table = list(block_table)
    limit = len(table) * block_size
    slots = []
    for pos in positions:
        if not 0 <= pos < limit:
            raise ValueError(
                f"positions must lie in [0, {limit}) for a block table of {len(table)} blocks of {block_size}, "
                f"got {pos}"
            )
        slots.append(table[pos // block_size] * block_size + pos % block_size)
    return slots


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

    Build it with :meth:`build`. Constructing it directly validates the tensors (on the host) the
    same way, so a hand-made batch that is inconsistent fails here with a message naming the field.
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

    def __post_init__(self) -> None:
        if not self.query_start_loc_host:  # not yet checked: check everything once, keep host copies
            qsl, lens, max_block = _validate(self)
            object.__setattr__(self, "query_start_loc_host", tuple(qsl))
            object.__setattr__(self, "seq_lens_host", tuple(lens))
            object.__setattr__(self, "max_block_host", max_block)

    # ---- building -----------------------------------------------------------------------------
    @classmethod
    def build(
        cls, seqs: Sequence[SeqSlice], block_size: int, device: torch.device | str = "cpu"
    ) -> ForwardBatch:
        """Pack ``seqs`` into one step: positions, slot mapping, ``query_start_loc``, ``seq_lens``, tables."""
        if isinstance(seqs, SeqSlice) or not isinstance(seqs, Sequence) or not seqs:
            raise ValueError("seqs must be a non-empty list of SeqSlice, one per sequence in the step")
        input_ids, positions, slots, qsl, lens = [], [], [], [0], []
        for b, s in enumerate(seqs):
            if not isinstance(s, SeqSlice):
                raise TypeError(f"seqs[{b}] must be a SeqSlice, got {type(s).__name__}")
            n, start = len(s.token_ids), s.num_computed_tokens
            if n == 0:
                raise ValueError(f"seqs[{b}] has no new tokens: every sequence in a step needs at least one")
            start = check_int(f"seqs[{b}].num_computed_tokens", start, min=0)
            pos = range(start, start + n)
            try:
                slots += slot_mapping(s.block_table, pos, block_size)
            except ValueError as e:
                raise ValueError(f"seqs[{b}].block_table is too short for its tokens: {e}") from None
            input_ids += list(s.token_ids)
            positions += pos
            qsl.append(qsl[-1] + n)
            lens.append(start + n)
        width = max(len(s.block_table) for s in seqs)
        tables = [list(s.block_table) + [-1] * (width - len(s.block_table)) for s in seqs]
        batch = cls(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            block_size=block_size,
        )
        return batch.to(device)

    def to(self, device: torch.device | str) -> ForwardBatch:
        """The same batch with its tensors on ``device`` (host copies kept: no revalidation)."""
        device = torch.device(device)
        if self.input_ids.device == device:
            return self
        moved = {
            name: getattr(self, name).to(device)
            for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables")
        }
        return ForwardBatch(
            **moved,
            block_size=self.block_size,
            query_start_loc_host=self.query_start_loc_host,
            seq_lens_host=self.seq_lens_host,
            max_block_host=self.max_block_host,
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
        raise ValueError(
            f"query_start_loc must be strictly increasing, got {qsl}: sequences would overlap or be empty"
        )
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
