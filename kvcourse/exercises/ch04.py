"""Checks for chapter 4, *Paged KV cache*.

1. :func:`check_slot_mapping` -- the pool slots of a ragged step's new tokens (prefills, chunks, decodes).
2. :func:`check_block_manager` -- the bug hunt: a block allocator with fork and copy-on-write, run on
   random operations against :class:`kvcourse.paged.BlockManager`, with K/V data written through it.
3. :func:`check_parallel_sampling_blocks` -- blocks used by ``n`` samples of one prompt, as a formula.
4. :func:`check_live_fraction` -- the share of a pool's slots that hold tokens, for a block size.
5. :func:`check_reservation_live` -- predict the share of max-length reservations that holds tokens.

Each check runs the learner's code on hidden random cases (seeded from the check's ``seed``
argument) and raises :class:`~kvcourse.exercises.ExerciseError` with the case, the expected and
returned values and a hint for the typical mistake it recognises.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

from .. import batch as _batch
from .. import fragmentation as _fragmentation
from ..paged import BlockManager
from ._core import CheckResult, ExerciseError, a_number, an_int, call_learner, check, describe, diagnose, mistaken, fail
from ._core import hidden_rng, learner_runs, passed, same

__all__ = [
    "check_slot_mapping",
    "check_block_manager",
    "check_parallel_sampling_blocks",
    "check_live_fraction",
    "check_reservation_live",
]


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# --- Exercise 1: the slot mapping of a ragged step -----------------------------------------------

# What a learner's function that indexes past a block table "returns", so a crash can be diagnosed too.
_PAST_THE_TABLE = "IndexError: a logical block past the end of a block table"


def _slots(tables, seq_lens, query_lens, block_size, mistake: str = "") -> list[int] | str:
    """The right slot mapping, or what a typical ``mistake`` gives (``_PAST_THE_TABLE`` if it would crash)."""
    try:
        return _slots_or_raise(tables, seq_lens, query_lens, block_size, mistake)
    except IndexError:
        return _PAST_THE_TABLE


def _slots_or_raise(tables, seq_lens, query_lens, block_size, mistake: str) -> list[int]:
    out = []
    for b, (table, seq_len, q) in enumerate(zip(tables, seq_lens, query_lens)):
        start = {"from_zero": 0, "after_end": seq_len, "one_late": seq_len - q + 1}.get(mistake, seq_len - q)
        if mistake == "first_table":
            table = tables[0]
        for pos in range(start, start + q):
            if mistake == "contiguous":
                out.append(pos)
            elif mistake == "block_not_scaled":
                out.append(table[pos // block_size] + pos % block_size)
            elif mistake == "no_offset":
                out.append(table[pos // block_size] * block_size)
            else:
                out.append(table[pos // block_size] * block_size + pos % block_size)
    return out


def _step_cases(rng) -> list[tuple[list[list[int]], list[int], list[int], int]]:
    fixed = [
        ([[7, 2, 9]], [12], [12], 4),  # one prompt, three blocks
        ([[7, 2, 9]], [10], [1], 4),  # one decode step
        ([[3, 0, 2], [5], [1, 4]], [17, 4, 9], [1, 4, 3], 8),  # decode, prefill, chunk
    ]
    cases = list(fixed)
    for _ in range(12):
        block_size = rng.choice([1, 2, 4, 8, 16, 32])
        num_seqs = rng.randint(1, 5)
        seq_lens = [rng.randint(1, 6 * block_size) for _ in range(num_seqs)]
        query_lens = [rng.choice([1, 1, n, rng.randint(1, n)]) for n in seq_lens]  # decodes, prefills, chunks
        blocks = rng.sample(range(64), sum(_ceil_div(n, block_size) for n in seq_lens))
        tables = []
        for n in seq_lens:
            k = _ceil_div(n, block_size)
            tables.append(blocks[:k])
            blocks = blocks[k:]
        cases.append((tables, seq_lens, query_lens, block_size))
    return cases


def _call_or_past_table(label: str, fn: Callable, *args) -> Any:
    """The learner's slot mapping, or ``_PAST_THE_TABLE`` if it read past a block table (an off-by-one, diagnosed
    with the other cases)."""
    try:
        return call_learner("slot_mapping", fn, *args)
    except ExerciseError as exc:
        if not isinstance(exc.__cause__, IndexError):
            raise
        return _PAST_THE_TABLE


def _as_int_list(case: str, got: Any, length: int) -> list[int]:
    try:
        values = [int(x) for x in (got.tolist() if hasattr(got, "tolist") else got)]
    except (TypeError, ValueError):
        raise ExerciseError(
            f"{case} should return a list of ints (one slot per new token), got {type(got).__name__}: {describe(got)}",
            case=case,
        ) from None
    if any(
        isinstance(x, float) and not float(x).is_integer() for x in (got.tolist() if hasattr(got, "tolist") else got)
    ):
        raise ExerciseError(f"{case} should return whole slot numbers, got {describe(got)}", case=case)
    if len(values) != length:
        hint = (
            "One slot per NEW token: query_lens[b] of them for sequence b, not seq_lens[b] (the cached tokens "
            "already have their slots)."
            if length < len(values)
            else "One slot per new token of every sequence, all sequences one after another."
        )
        fail(case, expected=f"{length} slots", got=f"{len(values)} slots", hint=hint)
    return values


@check(
    "ch04.check_slot_mapping",
    takes="fn(block_tables, seq_lens, query_lens, block_size)",
    references={"slot_mapping": _batch.slot_mapping, "ForwardBatch": _batch.ForwardBatch, "SeqSlice": _batch.SeqSlice},
    task="write the slot mapping yourself.",
)
def check_slot_mapping(
    fn: Callable[[list[list[int]], list[int], list[int], int], list[int]], seed: int = 0
) -> CheckResult:
    """``fn(block_tables, seq_lens, query_lens, block_size)`` -> the pool slot of every new token of a step.

    Sequence ``b`` has block table ``block_tables[b]``, holds ``seq_lens[b]`` tokens after this step, and
    ``query_lens[b]`` of them are new in this step (a whole prompt, a chunk of one, or a decode token).
    The answer lists the new tokens' slots, sequence after sequence, in position order; the pool is
    viewed as one flat array of ``num_blocks * block_size`` slots.
    """
    diagnose(
        fn,
        _step_cases(hidden_rng()),
        label=lambda tables, seq_lens, query_lens, block_size: (
            f"slot_mapping({tables}, seq_lens={seq_lens}, query_lens={query_lens}, block_size={block_size})"
        ),
        reference=_slots,
        mistakes=mistaken(
            _slots,
            from_zero="The new tokens come after the cached ones: sequence b's new tokens sit at positions seq_lens[b] "
            "- query_lens[b] .. seq_lens[b] - 1, not from 0.",
            after_end="Off by one: seq_lens[b] is the length AFTER this step, so the new tokens end at position "
            "seq_lens[b] - 1.",
            one_late="Off by one: the first new token is at position seq_lens[b] - query_lens[b] (a prefill starts at "
            "0).",
            contiguous="That is the slot of a contiguous cache: look the logical block pos // block_size up in the "
            "sequence's block table first.",
            block_not_scaled="A block id counts blocks, not slots: multiply it by block_size, then add the offset pos "
            "% block_size.",
            no_offset="Add the offset inside the block, pos % block_size.",
            first_table="Each sequence has its own block table: use block_tables[b] for sequence b.",
        ),
        hint="Position pos of sequence b lives at block_tables[b][pos // block_size] * block_size + pos % block_size.",
        compare=operator.eq,
        returns=lambda case, got, tables, seq_lens, query_lens, block_size: (
            got if got is _PAST_THE_TABLE else _as_int_list(case, got, sum(query_lens))
        ),
        call=_call_or_past_table,
    )
    return passed(
        "every new token's slot, prefills, chunks and decodes alike: vLLM builds this slot_mapping for "
        "each step, and the K/V write kernel stores the step's keys and values at exactly these slots."
    )


# --- Exercise 2 (bug hunt): a block allocator with fork and copy-on-write -----------------------


def _copy_pair(cow: Any) -> tuple[int, int] | None:
    """``(src, dst)`` from a learner's copy-on-write report: a pair, or an object with src_block / dst_block."""
    if cow is None:
        return None
    if hasattr(cow, "src_block") and hasattr(cow, "dst_block"):
        return int(cow.src_block), int(cow.dst_block)
    try:
        src, dst = cow
        return int(src), int(dst)
    except (TypeError, ValueError):
        raise ExerciseError(
            f"append_slot should return None or the copy (src_block, dst_block), got {describe(cow)}"
        ) from None


def _free_count(manager: Any, name: str) -> int:
    with learner_runs():  # the learner's property
        value = getattr(manager, "num_free_blocks", None)
        if callable(value):
            value = value()
    if isinstance(value, bool) or not isinstance(value, int):
        raise ExerciseError(f"{name}.num_free_blocks should be an int (blocks on the free list), got {describe(value)}")
    return value


def _operations(rng, num_blocks: int, block_size: int, steps: int) -> list[tuple]:
    """A random but valid script of allocate / append / fork / free that never runs out of blocks."""
    ref = BlockManager(num_blocks, block_size)
    live, next_id, ops = [], 0, []
    for _ in range(steps):
        kind = rng.choices(["allocate", "append", "fork", "free"], weights=[2, 8, 3, 2])[0]
        if not live or (kind == "allocate" and len(live) < 6):
            n = rng.choice([0, 1, block_size - 1, block_size, block_size + 1, rng.randint(1, 3 * block_size)])
            if ref.can_allocate(n):
                ref.allocate(next_id, n)
                ops.append(("allocate", next_id, n))
                live.append(next_id)
                next_id += 1
            continue
        seq = rng.choice(live)
        if kind == "fork" and len(live) < 8:
            ref.fork(seq, next_id)
            ops.append(("fork", seq, next_id))
            live.append(next_id)
            next_id += 1
        elif kind == "free" and len(live) > 1:
            ref.free(seq)
            ops.append(("free", seq))
            live.remove(seq)
        elif kind in ("append", "allocate") and ref.can_append(seq, 1):
            ref.append_slot(seq)
            ops.append(("append", seq))
    ops += [("free", seq) for seq in live]  # everything ends: every block must come back
    return ops


_SHARED_FREED = (
    "A block went back to the free list while another sequence still holds it: fork must add the child "
    "as an owner of every block it shares (raise the reference counts), and free must return a block "
    "only when its reference count drops to 0."
)
_HINTS = {
    "allocate": "allocate(seq, num_tokens) takes ceil(num_tokens / block_size) blocks: a partly filled last block is "
    "a whole block, an exact multiple needs no extra one, and 0 tokens need none.",
    "new_block": "append_slot needs a new block exactly when the last one is full (num_tokens % block_size == 0, "
    "which includes a sequence with no block yet), and only then.",
    "no_copy": "This sequence writes into a partly filled block that another sequence also holds: copy it first "
    "(copy-on-write), point this table at the copy and report (src_block, dst_block).",
    "copy_full": "The last block is full, so the new token goes into a NEW block: a full block is never written again "
    "and stays shared without a copy.",
    "copy_unshared": "This sequence is the block's only owner now (the others copied it away already, or never held "
    "it), yet it copied: copy only while another table still holds the block (reference count "
    "above 1). Does a copy-on-write drop this sequence's own reference to the source block?",
    "leak": "After every sequence is freed, some blocks never came back to the free list: a leak. A block's owner "
    "count must drop whenever a table stops holding it, in free and in copy-on-write.",
    "data": "The free-block counts are right, but a sequence no longer reads its own tokens back through its table: "
    "two sequences wrote into one block. After a copy-on-write the sequence's table must point at the copy "
    "(dst_block), and the report must name the block to copy from and the one to copy to.",
}


def _expected(op: tuple, ref: BlockManager) -> tuple[Any, int]:
    """Run ``op`` on the reference; return its copy-on-write report (or None) and its free blocks after."""
    kind = op[0]
    cow = None
    if kind == "allocate":
        ref.allocate(op[1], op[2])
    elif kind == "append":
        cow = ref.append_slot(op[1])
    elif kind == "fork":
        ref.fork(op[1], op[2])
    else:
        ref.free(op[1])
    return cow, ref.num_free_blocks


def _run_op(manager: Any, op: tuple) -> Any:
    kind = op[0]
    method = getattr(manager, {"append": "append_slot"}.get(kind, kind), None)
    if not callable(method):
        raise ExerciseError(f"your class has no method { ({'append': 'append_slot'}.get(kind, kind)) }")
    return call_learner(f"{kind}{op[1:]}", method, *op[1:])


@check(
    "ch04.check_block_manager",
    takes="class",
    references={"BlockManager": BlockManager},
    task="write the allocator yourself.",
)
def check_block_manager(cls: type, seed: int = 0) -> CheckResult:
    """``cls(num_blocks, block_size)``: a block allocator with ``allocate(seq_id, num_tokens)``,
    ``append_slot(seq_id)`` (returns ``None`` or the copy-on-write ``(src_block, dst_block)``),
    ``fork(parent_id, child_id)``, ``free(seq_id)``, ``block_table(seq_id)`` and ``num_free_blocks``.

    Random scripts of operations run on it and on :class:`kvcourse.paged.BlockManager`: after every
    operation the free-block count and the copy-on-write reports must agree, and tokens written
    through the learner's block tables (copies included) must read back right for every sequence.
    """
    if issubclass(cls, BlockManager):
        raise ExerciseError("your class inherits from kvcourse.paged.BlockManager; write the allocator yourself.")
    rng = hidden_rng()
    for trial in range(6):
        block_size = rng.choice([1, 2, 4, 16])
        num_blocks = rng.randint(24, 64)
        ops = _operations(rng, num_blocks, block_size, steps=rng.randint(40, 120))
        made = f"{cls.__name__}(num_blocks={num_blocks}, block_size={block_size})"
        manager = call_learner(cls.__name__, cls, num_blocks, block_size)
        ref = BlockManager(num_blocks, block_size)
        slots: dict[int, Any] = {}  # slot -> token written there (the K/V data, reduced to a label)
        tokens: dict[int, list] = {}  # seq -> what it must read back
        done = []
        for op in ops:
            want_cow, want_free = _expected(op, ref)
            got_cow = _copy_pair(_run_op(manager, op))
            got_free = _free_count(manager, made)
            case = f"{made}: after {', '.join(_show(o) for o in done[-4:] + [op])}"
            kind = op[0]
            if kind == "append" and (want_cow is None) != (got_cow is None):
                n = ref.num_tokens(op[1]) - 1  # tokens the sequence held before this append
                hint = (
                    _HINTS["no_copy"]
                    if want_cow is not None
                    else _HINTS["copy_full"]
                    if n % block_size == 0
                    else _HINTS["copy_unshared"]
                )
                fail(
                    case, expected="a copy-on-write" if want_cow else "no copy (None)", got=describe(got_cow), hint=hint
                )
            if got_free != want_free:
                if kind == "allocate":
                    hint = _HINTS["allocate"]
                elif kind == "append":
                    hint = _HINTS["new_block"]
                elif got_free > want_free:
                    hint = _SHARED_FREED
                else:
                    hint = _HINTS["leak"]
                fail(case + ": num_free_blocks", expected=want_free, got=got_free, hint=hint)
            _apply_data(op, got_cow, manager, ref, slots, tokens, block_size, case)
            done.append(op)
    return passed(
        "fork shares every block, copy-on-write copies only a shared, partly filled last block, and "
        "every block comes back when its last owner frees it."
    )


def _show(op: tuple) -> str:
    return f"{op[0]}({', '.join(map(str, op[1:]))})"


def _apply_data(op, cow, manager, ref, slots, tokens, block_size, case) -> None:
    """Mirror ``op`` on the fake K/V data and check every live sequence reads back its own tokens."""
    kind, seq = op[0], op[1]
    if kind == "allocate":
        tokens[seq] = [(seq, pos) for pos in range(op[2])]
    elif kind == "fork":
        tokens[op[2]] = list(tokens[seq])
    elif kind == "free":
        del tokens[seq]
        return
    if kind == "append":
        if cow is not None:
            src, dst = cow
            for offset in range(block_size):
                slots[dst * block_size + offset] = slots.get(src * block_size + offset)
        tokens[seq].append((seq, len(tokens[seq])))
    table = _table(manager, seq, case)
    # Write the new tokens of this op (a prompt, or one appended token) through the learner's table.
    new = (
        range(len(tokens[seq]))
        if kind == "allocate"
        else range(len(tokens[seq]) - 1, len(tokens[seq]))
        if kind == "append"
        else range(0)
    )
    for pos in new:
        slots[_slot(table, pos, block_size, case)] = tokens[seq][pos]
    for other, expected in tokens.items():
        table = _table(manager, other, case)
        read = [slots.get(_slot(table, pos, block_size, case)) for pos in range(len(expected))]
        if read != expected:
            bad = next(p for p, (a, b) in enumerate(zip(read, expected)) if a != b)
            fail(
                case + f": sequence {other} reads position {bad}",
                expected=f"its own token {expected[bad]}",
                got=f"{read[bad]} (written by sequence {read[bad][0]})" if read[bad] else "nothing written there",
                hint=_HINTS["data"],
            )


def _table(manager, seq, case) -> list[int]:
    method = getattr(manager, "block_table", None)
    if not callable(method):
        raise ExerciseError("your class needs block_table(seq_id), returning the sequence's list of block ids")
    table = call_learner(f"block_table({seq})", method, seq)
    try:
        return [int(b) for b in table]
    except (TypeError, ValueError):
        raise ExerciseError(
            f"{case}: block_table({seq}) should be a list of block ids, got {describe(table)}"
        ) from None


def _slot(table: list[int], pos: int, block_size: int, case: str) -> int:
    if pos // block_size >= len(table):
        fail(
            case,
            expected=f"a table with a block for position {pos}",
            got=f"{len(table)} blocks: {table}",
            hint=_HINTS["new_block"],
        )
    return table[pos // block_size] * block_size + pos % block_size


# --- Exercise 3: memory of n samples ---------------------------------------------------------------


def _sharing_blocks(prompt_len: int, n: int, new_tokens: int, block_size: int) -> int:
    """Blocks in use after ``n`` forked samples of a ``prompt_len``-token prompt each append ``new_tokens``,
    measured on a real :class:`BlockManager` (one step at a time, all samples in turn)."""
    blocks = _ceil_div(prompt_len + new_tokens, block_size)
    bm = BlockManager(n * blocks + 1, block_size)
    bm.allocate(0, prompt_len)
    for child in range(1, n):
        bm.fork(0, child)
    for _ in range(new_tokens):
        for seq in range(n):
            bm.append_slot(seq)
    return bm.num_used_blocks


@check(
    "ch04.check_parallel_sampling_blocks",
    takes="blocks_with_sharing(prompt_len, n, new_tokens, block_size)",
    references={"BlockManager": BlockManager},
    task="write it as a formula.",
)
def check_parallel_sampling_blocks(
    blocks_with_sharing: Callable[[int, int, int, int], int], seed: int = 0
) -> CheckResult:
    """``blocks_with_sharing(prompt_len, n, new_tokens, block_size)`` (``new_tokens >= 1``): blocks in use
    once ``n`` samples forked from one prefilled prompt have each appended ``new_tokens`` tokens."""
    rng = hidden_rng()
    cases = [(300, 4, 64, 16), (32, 4, 10, 16), (33, 4, 10, 16), (300, 1, 64, 16), (5, 3, 1, 16), (17, 2, 15, 16)]
    for _ in range(10):
        block_size = rng.choice([1, 4, 8, 16, 32])
        cases.append((rng.randint(1, 200), rng.randint(1, 8), rng.randint(1, 100), block_size))

    def full(p, b):
        return p // b

    diagnose(
        blocks_with_sharing,
        cases,
        label=lambda *args: f"blocks_with_sharing{args}",
        reference=_sharing_blocks,
        mistakes=[
            (
                "After fork the prompt's full blocks are stored once, whatever n is: count them once, not per sample.",
                lambda p, n, t, b: n * _ceil_div(p + t, b),
            ),
            (
                "The prompt's last block is partly filled and shared: each sample writing into it gets a copy "
                "(copy-on-write), except the last owner, which writes in place. Only FULL prompt blocks stay shared.",
                lambda p, n, t, b: _ceil_div(p, b) + n * (_ceil_div(p + t, b) - _ceil_div(p, b)),
            ),
            (
                "The last sample to write into the shared partial block owns it alone by then and writes in place: "
                "n - 1 copies, not n.",
                lambda p, n, t, b: full(p, b) + n * (_ceil_div(p + t, b) - full(p, b)) + (p % b > 0),
            ),
            (
                "Off by one: a sample of p + new_tokens tokens occupies ceil((p + new_tokens) / block_size) blocks; round up.",
                lambda p, n, t, b: full(p, b) + n * ((p + t) // b - full(p, b)),
            ),
            (
                "All n sequences are samples, the one forked from included: n of them own their own blocks.",
                lambda p, n, t, b: full(p, b) + (n - 1) * (_ceil_div(p + t, b) - full(p, b)),
            ),
        ],
        hint="Count the full prompt blocks once, then each of the n samples' own blocks.",
        compare=operator.eq,
        returns=an_int("number of blocks", strict=True),
    )
    return passed(
        "the full prompt blocks once, then each sample's own blocks, among them a copy of the partly "
        "filled prompt block for every sample but its last owner."
    )


# --- Exercise 4: the live fraction of a block size --------------------------------------------------


def _live(lengths: list[int], block_size: int, mistake: str = "") -> float:
    """The right live fraction, or what a typical ``mistake`` gives."""
    if mistake == "floor":
        slots = sum(max(1, n // block_size) * block_size for n in lengths)
    elif mistake == "half_block":
        slots = sum(n + (block_size - 1) / 2 for n in lengths)
    else:
        slots = sum(_ceil_div(n, block_size) * block_size for n in lengths)
    if mistake == "mean_of_fractions":
        return sum(n / (_ceil_div(n, block_size) * block_size) for n in lengths) / len(lengths)
    live = sum(lengths) / slots
    return 1 - live if mistake == "empty" else live


@check("ch04.check_live_fraction", takes="live_fraction(lengths, block_size)")
def check_live_fraction(live_fraction: Callable[[list[int], int], float], seed: int = 0) -> CheckResult:
    """``live_fraction(lengths, block_size)``: the share of the slots held by sequences of ``lengths`` tokens
    (each in whole blocks of ``block_size`` slots) that hold tokens. Compared on hidden traces."""
    rng = hidden_rng()
    cases = [([16, 32], 16), ([1], 16), ([17, 15, 300], 16), ([5, 5, 5], 1), ([100], 256), ([31, 33, 64], 32)]
    for _ in range(12):
        n = rng.randint(1, 40)
        median = rng.choice([20, 80, 300, 1000])
        cases.append(
            (
                [max(1, int(rng.lognormvariate(0, 1) * median)) for _ in range(n)],
                rng.choice([1, 2, 4, 8, 16, 32, 64, 128, 256]),
            )
        )
    diagnose(
        live_fraction,
        cases,
        label=lambda lengths, block_size: f"live_fraction({lengths}, block_size={block_size})",
        reference=_live,
        mistakes=mistaken(
            _live,
            floor="A sequence's partly filled last block is still a whole block: round the blocks up, not down.",
            empty="That is the empty share: the question asks for the slots that hold tokens.",
            mean_of_fractions="The pool's fraction is all tokens over all slots; the mean of each sequence's fraction "
            "weighs a short sequence as much as a long one.",
            half_block="(b - 1) / 2 empty slots per sequence is an average over lengths: count each sequence's own "
            "last block.",
        ),
        hint="Count the slots each sequence holds: whole blocks, enough for its tokens.",
        compare=lambda a, w: abs(a - w) <= 1e-9 * max(1.0, abs(w)),
        returns=lambda case, got, *_: float(a_number("a number (a fraction)")(case, got)),
    )
    return passed(
        "tokens over whole-block slots: each sequence wastes the empty tail of its last block, "
        "up to block_size - 1 slots, which weighs more the shorter the sequences."
    )


# --- Exercise 5: predict the live share of max-length reservations ---------------------------------


def _reservation_live(p: list[int], o: list[int], max_len: int, *, weight=lambda p, o: o, held=lambda p, o: p + (o + 1) / 2,
          ) -> float:  # fmt: skip
    """Each request's average holding, weighted (keywords: the typical mistakes)."""
    w = [weight(a, b) for a, b in zip(p, o)]
    return sum(wi * held(a, b) for wi, a, b in zip(w, p, o)) / sum(w) / max_len


_RESERVATION_MISTAKES = [
    (
        "Each request counted once: that is the trace's average request, not the running batch's. A request runs for "
        "as many steps as it has output tokens, so weight it by output_len.",
        lambda p, o, m: _reservation_live(p, o, m, weight=lambda a, b: 1),
    ),
    (
        "That is the final length: a running request is on average halfway through its output, holding "
        "prompt_len + (output_len + 1) / 2 tokens.",
        lambda p, o, m: _reservation_live(p, o, m, held=lambda a, b: a + b),
    ),
    (
        "The trace's mean final length over max_len: each request counted once, at its end. A snapshot meets "
        "requests midway, and long ones more often.",
        lambda p, o, m: _reservation_live(p, o, m, weight=lambda a, b: 1, held=lambda a, b: a + b),
    ),
    (
        "Half a token off: at its k-th step (k = 1 .. output_len) a request holds prompt_len + k tokens, so "
        "prompt_len + (output_len + 1) / 2 on average.",
        lambda p, o, m: _reservation_live(p, o, m, held=lambda a, b: a + b / 2),
    ),
    (
        "The prompt is held from the first step to the last: add prompt_len to what the request holds.",
        lambda p, o, m: _reservation_live(p, o, m, held=lambda a, b: (b + 1) / 2),
    ),
    (
        "A request occupies the batch for output_len steps (one token each), not prompt_len + output_len: weight by "
        "output_len.",
        lambda p, o, m: _reservation_live(p, o, m, weight=lambda a, b: a + b),
    ),
]


@check(
    "ch04.check_reservation_live",
    takes="predict_reservation_live",
    references={"reservation_live_fraction": _fragmentation.reservation_live_fraction},
    task="weigh the requests yourself.",
)
def check_reservation_live(fn: Callable[[list[int], list[int], int], float], seed: int = 0) -> CheckResult:
    """``fn(prompt_lens, output_lens, max_len)`` -> the share of a pool of max-length reservations that holds tokens,
    averaged over time: each request runs ``output_len`` steps and at its ``k``-th holds ``prompt_len + k`` tokens.
    Compared with :func:`kvcourse.fragmentation.reservation_live_fraction` on hidden traces."""
    rng = hidden_rng()
    cases = [([10], [4], 100), ([10, 10], [2, 8], 100)]
    while len(cases) < 12:
        max_len, n = rng.choice([256, 2048, 4096]), rng.randint(2, 40)
        prompts = [rng.randint(1, max_len // 4) for _ in range(n)]
        cases.append((prompts, [rng.randint(1, max_len - p) for p in prompts], max_len))
    diagnose(
        fn,
        cases,
        label=lambda prompts, outputs, max_len: f"predict_reservation_live({prompts}, {outputs}, max_len={max_len})",
        reference=_fragmentation.reservation_live_fraction,
        mistakes=_RESERVATION_MISTAKES,
        hint="Weight each request by output_len (the steps it runs) and count what it holds on average, prompt_len + "
        "(output_len + 1) / 2, over max_len.",
        compare=lambda got, want: same(got, want, abs_tol=0.0),
        returns=lambda case, got, *_: float(a_number("a fraction (a float)", finite=True)(case, got)),
    )
    return passed(
        "a running batch is a time sample: long requests are in it longer, so weighting by output_len "
        "predicts the snapshot where the trace's averages do not."
    )
