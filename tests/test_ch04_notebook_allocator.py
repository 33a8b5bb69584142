"""Chapter 4 builds a block allocator in the notebook; here it is taken from the notebook's JSON and run
against ``kvcourse.paged.BlockManager`` on random scripts of allocate / append / fork / free. Both must
keep the same block tables, reference counts, free blocks and copy-on-write copies after every
operation, and refuse the same operations when the pool runs dry. If either drifts, these tests fail."""

from __future__ import annotations

import json
import random
from collections import deque
from pathlib import Path

import pytest

from kvcourse.exercises import ExerciseError, ch04
from kvcourse.paged import BlockManager, NoFreeBlocksError

NOTEBOOK = Path(__file__).resolve().parents[1] / "book" / "04_paged_kv_cache.ipynb"


def _notebook_code(starts_with: str) -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    found = [s for s in sources if s.lstrip().startswith(starts_with)]
    assert len(found) == 1, f"expected one code cell starting with {starts_with!r} in {NOTEBOOK.name}"
    return found[0]


@pytest.fixture(scope="module")
def SimpleBlockManager():
    namespace = {"deque": deque}
    exec(_notebook_code("class SimpleBlockManager"), namespace)
    return namespace["SimpleBlockManager"]


def _state(ours, package):
    """Everything both allocators expose, in one comparable form each."""
    mine = ({s: ours.block_table(s) for s in ours.tables}, list(ours.ref_count), ours.num_free_blocks)
    theirs = (
        {s: package.block_table(s) for s in package.seq_ids},
        [package.ref_count(b) for b in range(package.num_blocks)],
        package.num_free_blocks,
    )
    return mine, theirs


@pytest.mark.parametrize("seed", range(8))
def test_notebook_allocator_keeps_the_same_books_as_block_manager(SimpleBlockManager, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    num_blocks = rng.randint(8, 48)
    ours, package = SimpleBlockManager(num_blocks, block_size), BlockManager(num_blocks, block_size)
    live, next_id, copies = [], 0, 0
    for _ in range(400):
        kind = rng.choices(["allocate", "append", "fork", "free"], weights=[2, 10, 3, 2])[0]
        if kind == "allocate" or not live:
            n = rng.choice([0, 1, block_size - 1, block_size, block_size + 1, rng.randint(0, 4 * block_size)])
            if not package.can_allocate(n):
                with pytest.raises(NoFreeBlocksError):
                    package.allocate(next_id, n)
                with pytest.raises(RuntimeError, match="out of blocks"):
                    ours.allocate(next_id, n)
            else:
                ours.allocate(next_id, n)
                package.allocate(next_id, n)
                live.append(next_id)
            next_id += 1
        elif kind == "append":
            seq = rng.choice(live)
            if package.can_append(seq):
                got, want = ours.append_slot(seq), package.append_slot(seq)
                assert got == (None if want is None else (want.src_block, want.dst_block))
                copies += got is not None
            else:  # the pool is dry: both refuse, and neither changes anything
                with pytest.raises(NoFreeBlocksError):
                    package.append_slot(seq)
                with pytest.raises(RuntimeError, match="out of blocks"):
                    ours.append_slot(seq)
                assert ours.num_tokens[seq] == package.num_tokens(seq)
        elif kind == "fork":
            parent = rng.choice(live)
            ours.fork(parent, next_id)
            package.fork(parent, next_id)
            live.append(next_id)
            next_id += 1
        else:
            seq = live.pop(rng.randrange(len(live)))
            ours.free(seq)
            package.free(seq)
        mine, theirs = _state(ours, package)
        assert mine == theirs
        assert ours.num_tokens == {s: package.num_tokens(s) for s in package.seq_ids}
    for seq in live:
        ours.free(seq)
        package.free(seq)
    assert ours.num_free_blocks == package.num_free_blocks == num_blocks
    assert copies > 0 or block_size == 1  # the scripts exercise copy-on-write (blocks of 1 are never partial)


def test_notebook_allocator_passes_the_chapter_check(SimpleBlockManager):
    assert ch04.check_block_manager(SimpleBlockManager)
    assert ch04.check_block_manager(SimpleBlockManager, seed=1)


def test_the_chapter_bug_hunt_allocator_leaks_and_its_fix_does_not():
    namespace = {"deque": deque}
    code = _notebook_code("class OwnerSetBlockManager")
    exec(code[: code.index("quick = ")], namespace)  # the class, without the quick test under it
    buggy = namespace["OwnerSetBlockManager"]
    with pytest.raises(ExerciseError, match="only owner now"):
        ch04.check_block_manager(buggy)
    manager = buggy(8, 4)
    manager.allocate("a", 5)
    manager.fork("a", "b")
    assert manager.append_slot("b") is not None and manager.append_slot("a") is not None  # a copy too many
    manager.free("a")
    manager.free("b")
    assert manager.num_free_blocks == 7  # the shared partial block never comes back
