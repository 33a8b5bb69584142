"""BlockManager: worked examples, error cases, and a hypothesis state machine for the invariants."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvcourse.paged import BlockManager, CopyOnWrite, NoFreeBlocksError, slot_mapping


def snapshot(bm: BlockManager) -> dict:
    """Everything observable about the allocator, to check that failed calls change nothing."""
    return {
        "free": bm.num_free_blocks,
        "refs": [bm.ref_count(b) for b in range(bm.num_blocks)],
        "tables": {s: bm.block_table(s) for s in bm.seq_ids},
        "tokens": {s: bm.num_tokens(s) for s in bm.seq_ids},
    }


# ---- worked examples ---------------------------------------------------------------------------
def test_allocate_takes_ceil_blocks_and_maps_slots():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate("a", 6) == [0, 1]
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 2
    assert bm.num_tokens("a") == 6
    assert slot_mapping(bm.block_table("a"), range(6), 4) == [0, 1, 2, 3, 4, 5]
    assert bm.allocate("b", 4) == [2]
    assert bm.allocate("c", 0) == [] and bm.num_free_blocks == 5
    bm.free("a")
    # Freed blocks go to the back of the free list; the next request takes block 3 first.
    assert bm.allocate("d", 5) == [3, 4]
    assert slot_mapping(bm.block_table("d"), range(3, 5), 4) == [3 * 4 + 3, 4 * 4 + 0]


def test_append_slot_takes_a_new_block_only_when_the_last_is_full():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 3)
    assert bm.append_slot(0) is None and bm.block_table(0) == [0]  # fills slot 3 of block 0
    assert bm.append_slot(0) is None and bm.block_table(0) == [0, 1]  # block 0 full: new block
    assert bm.num_tokens(0) == 5
    assert bm.append_slots(0, 7) is None and bm.block_table(0) == [0, 1, 2]
    assert bm.num_tokens(0) == 12
    assert bm.append_slots(0, 0) is None and bm.num_tokens(0) == 12


def test_fork_shares_blocks_and_copy_on_write_splits_the_partial_last_block():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate("parent", 6)  # blocks [0, 1]; block 1 holds 2 of 4 tokens
    bm.fork("parent", "child")
    assert bm.block_table("child") == [0, 1]
    assert bm.ref_count(0) == bm.ref_count(1) == 2
    assert bm.num_free_blocks == 4  # forking took no memory

    cow = bm.append_slot("child")
    assert cow == CopyOnWrite(src_block=1, dst_block=2)
    assert bm.block_table("child") == [0, 2] and bm.block_table("parent") == [0, 1]
    assert (bm.ref_count(0), bm.ref_count(1), bm.ref_count(2)) == (2, 1, 1)
    # The parent is now the only owner of block 1: it writes in place.
    assert bm.append_slot("parent") is None and bm.block_table("parent") == [0, 1]

    bm.free("parent")
    assert bm.ref_count(1) == 0 and bm.ref_count(0) == 1  # block 0 still belongs to the child
    bm.free("child")
    assert bm.num_free_blocks == 6


def test_fork_of_full_blocks_needs_no_copy():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 8)
    bm.fork(0, 1)
    assert bm.append_slot(1) is None  # the shared blocks are full; the child gets a fresh block
    assert bm.block_table(1) == [0, 1, 2] and bm.ref_count(2) == 1


def test_copy_on_write_counts_the_copy_when_checking_for_space():
    bm = BlockManager(num_blocks=2, block_size=4)
    bm.allocate(0, 6)  # both blocks
    bm.fork(0, 1)
    assert not bm.can_append(1)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError, match="needs 1 free blocks, only 0"):
        bm.append_slot(1)
    assert snapshot(bm) == before


def test_running_out_leaves_no_half_made_sequence():
    bm = BlockManager(num_blocks=3, block_size=2)
    bm.allocate("a", 3)
    before = snapshot(bm)
    assert not bm.can_allocate(3) and bm.can_allocate(2)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate("b", 3)
    assert "b" not in bm and snapshot(bm) == before
    with pytest.raises(NoFreeBlocksError):
        bm.append_slots("a", 4)  # would need 2 more blocks, 1 is free
    assert snapshot(bm) == before
    assert isinstance(NoFreeBlocksError("x"), RuntimeError)


def test_bad_ids_and_double_free_are_clear_errors():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(1, 2)
    with pytest.raises(ValueError, match="seq_id=1 is already allocated"):
        bm.allocate(1, 2)
    with pytest.raises(ValueError, match="seq_id=7 is not an allocated sequence"):
        bm.append_slot(7)
    with pytest.raises(ValueError, match="parent_id=7"):
        bm.fork(7, 8)
    with pytest.raises(ValueError, match="child_id=1 is already allocated"):
        bm.fork(1, 1)
    bm.free(1)
    with pytest.raises(ValueError, match="already freed"):
        bm.free(1)
    with pytest.raises(TypeError, match="seq_id must be hashable"):
        bm.allocate([1], 2)
    assert bm.num_free_blocks == 4


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"num_blocks": 0, "block_size": 4}, ValueError, "num_blocks"),
        ({"num_blocks": 4, "block_size": 0}, ValueError, "block_size"),
        ({"num_blocks": 4.0, "block_size": 4}, TypeError, "num_blocks"),
        ({"num_blocks": 4, "block_size": True}, TypeError, "block_size"),
    ],
)
def test_constructor_validates(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        BlockManager(**kwargs)


def test_argument_validation():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 5)
    with pytest.raises(ValueError, match="num_tokens"):
        bm.allocate(1, -1)
    with pytest.raises(TypeError, match="num_tokens"):
        bm.append_slots(0, 1.5)
    with pytest.raises(ValueError, match="block must be in"):
        bm.ref_count(4)
    before = snapshot(bm)
    for bad in (-6, -10):  # a sequence never shrinks through append: it keeps its 5 tokens and 2 blocks
        with pytest.raises(ValueError, match=f"num_tokens must be an int >= 0, got {bad}"):
            bm.append_slots(0, bad)
        with pytest.raises(ValueError, match="num_tokens"):
            bm.can_append(0, bad)
    assert snapshot(bm) == before
    assert 1 not in bm


# ---- property-based: a random workload against the invariants ----------------------------------
class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free on a small pool, so running out happens often.

    A shadow model keeps each live sequence's token count; the invariants check the manager's
    bookkeeping against it after every step.
    """

    def __init__(self) -> None:
        super().__init__()
        self.block_size = 3
        self.bm = BlockManager(num_blocks=8, block_size=self.block_size)
        self.tokens: dict[int, int] = {}
        self.next_id = 0

    def _fails_cleanly(self, call) -> bool:
        """Run ``call``; if it raises NoFreeBlocksError, check nothing changed and report failure."""
        before = snapshot(self.bm)
        try:
            call()
        except NoFreeBlocksError:
            assert snapshot(self.bm) == before
            return True
        return False

    @rule(num_tokens=st.integers(0, 14))
    def allocate(self, num_tokens):
        seq_id, fits = self.next_id, self.bm.can_allocate(num_tokens)
        failed = self._fails_cleanly(lambda: self.bm.allocate(seq_id, num_tokens))
        assert failed == (not fits)
        if not failed:
            self.tokens[seq_id] = num_tokens
            self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), num_tokens=st.integers(1, 5))
    def append(self, data, num_tokens):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        old_table = self.bm.block_table(seq_id)
        shared_partial = bool(self.tokens[seq_id] % self.block_size) and self.bm.ref_count(old_table[-1]) > 1
        fits = self.bm.can_append(seq_id, num_tokens)
        result = []
        failed = self._fails_cleanly(lambda: result.append(self.bm.append_slots(seq_id, num_tokens)))
        assert failed == (not fits)
        if failed:
            return
        self.tokens[seq_id] += num_tokens
        new_table = self.bm.block_table(seq_id)
        (cow,) = result
        if shared_partial:
            # Copy-on-write: only the last old block changes, to a block that was free.
            assert cow == CopyOnWrite(old_table[-1], new_table[len(old_table) - 1])
            assert new_table[: len(old_table) - 1] == old_table[:-1]
            assert self.bm.ref_count(cow.dst_block) == 1
        else:
            assert cow is None and new_table[: len(old_table)] == old_table
        # The slots just appended are private to this sequence, so writing them changes no one else.
        old_n = self.tokens[seq_id] - num_tokens
        for slot in slot_mapping(new_table, range(old_n, self.tokens[seq_id]), self.block_size):
            assert self.bm.ref_count(slot // self.block_size) == 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        free_before = self.bm.num_free_blocks
        self.bm.fork(parent, self.next_id)
        assert self.bm.block_table(self.next_id) == self.bm.block_table(parent)
        assert self.bm.num_free_blocks == free_before
        self.tokens[self.next_id] = self.tokens[parent]
        self.next_id += 1

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        del self.tokens[seq_id]
        with pytest.raises(ValueError):
            self.bm.free(seq_id)  # a double free is refused and changes nothing

    @invariant()
    def sequences_match_the_model(self):
        assert sorted(self.bm.seq_ids) == sorted(self.tokens)
        for seq_id, n in self.tokens.items():
            assert self.bm.num_tokens(seq_id) == n
            assert len(self.bm.block_table(seq_id)) == -(-n // self.block_size)

    @invariant()
    def blocks_are_free_xor_owned_and_refcounts_match(self):
        bm = self.bm
        owners = [0] * bm.num_blocks
        for seq_id in bm.seq_ids:
            table = bm.block_table(seq_id)
            assert len(set(table)) == len(table)  # no block twice in one table
            for block in table:
                owners[block] += 1
        for block in range(bm.num_blocks):
            assert bm.ref_count(block) == owners[block]
        in_use = sum(1 for c in owners if c > 0)
        assert bm.num_free_blocks + in_use == bm.num_blocks  # no leaks
        assert bm.num_used_blocks == in_use


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
