"""The ragged paged attention kernel (a mixed step's attention, in one launch) against chapter 4's reference.

Cases mix what a serving step holds: decodes (one row), whole prompts, chunks of prompts with cached
context before them, lanes without rows and rows past the last sequence (a CUDA graph's padding), and
block tables that are not in order. In Triton's interpreter on a CPU; compiled on a GPU by ``make gpu-check``.
"""

from __future__ import annotations

import pytest
import torch

from kvcourse.kernels.testing import tolerance
from kvcourse.kernels.triton_ragged import (num_programs, ragged_paged, ragged_paged_attention,
                                            ragged_paged_attention_ref)  # fmt: skip
from kvcourse.kernels.triton_runtime import fallbacks, kernel_device, reset_fallbacks

DEVICE = kernel_device()


def ragged_case(
    q_lens, cached, heads=(9, 3), head_dim=64, block_size=16, dtype=torch.float32, spare_rows=0, spare_lanes=0, seed=0
):
    """A step: sequence b feeds ``q_lens[b]`` rows after ``cached[b]`` tokens; blocks shuffled in the pool."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in zip(cached, q_lens)]
    used = [-(-n // block_size) for n in lens]
    num_blocks = sum(used) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(used) + 1
    tables, i = [], 0
    for k in used:
        tables.append(order[i : i + k] + [-1] * (width - k))
        i += k
    tables += [[0] * width] * spare_lanes
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    qsl += [qsl[-1]] * spare_lanes
    hq, hkv = heads
    q = torch.randn(qsl[-1] + spare_rows, hq, head_dim, generator=g).to(dtype)
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g).to(dtype)
    i32 = dict(dtype=torch.int32)
    meta = (torch.tensor(tables, **i32), torch.tensor(lens + [0] * spare_lanes, **i32), torch.tensor(qsl, **i32))
    return [t.to(DEVICE) for t in (q, k, v, *meta)]


CASES = [
    dict(q_lens=[5], cached=[0]),  # one prompt
    dict(q_lens=[1, 1, 1], cached=[7, 30, 100]),  # decodes only
    dict(q_lens=[40, 1, 17, 1], cached=[0, 33, 16, 5]),  # a mixed step
    dict(q_lens=[3, 70], cached=[20, 0], spare_rows=9, spare_lanes=3),  # a graph's padding
    dict(q_lens=[1, 64, 63, 65], cached=[0, 0, 1, 2], heads=(4, 4)),  # tiles of exactly 64 rows, and either side
    dict(q_lens=[20, 1], cached=[3, 50], heads=(8, 1), head_dim=128, block_size=1),
    dict(q_lens=[33, 1], cached=[3, 50], dtype=torch.bfloat16, block_size=32),
    dict(q_lens=[9, 2], cached=[250, 0], heads=(32, 8), dtype=torch.float16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()).replace(" ", ""))
def test_ragged_kernel_equals_the_reference(case):
    reset_fallbacks()
    q, k, v, tables, lens, qsl = ragged_case(**case)
    got = ragged_paged_attention(q, k, v, tables, lens, qsl)
    want = ragged_paged_attention_ref(q, k, v, tables, lens, qsl)
    torch.testing.assert_close(got.float(), want.float(), **tolerance(q.dtype))
    assert not fallbacks()
    # A decode row here equals the decode it is: one query at the sequence's last position.
    end = int(qsl[-1])
    assert got[end:].abs().sum() == 0  # rows of no sequence come back as zeros


def test_a_row_sees_only_its_own_past():
    """Changing a key after a row's position, or in another sequence, leaves that row as it was."""
    q, k, v, tables, lens, qsl = ragged_case([4, 6], [2, 0])
    before = ragged_paged_attention(q, k, v, tables, lens, qsl)
    # Sequence 1's last position (5) sits in its first block, slot 5: only its last row may change.
    block = int(tables[1, 0])
    k2 = k.clone()
    k2[block, 5] += 3.0
    after = ragged_paged_attention(q, k2, v, tables, lens, qsl)
    torch.testing.assert_close(after[:9], before[:9])  # sequence 0's rows and sequence 1's first five
    assert not torch.allclose(after[9], before[9])


def test_the_grid_depends_only_on_the_shapes():
    """Enough programs for any split of N rows into B sequences: a graph recorded for N replays any of them."""
    assert num_programs(2048, 64, 3) == 2048 // 16 + 64
    assert num_programs(64, 1, 1) == 1 + 1
    for q_lens in ([64], [1] * 64, [15, 17, 32], [63, 1]):  # every split of 64 rows
        tiles = sum(-(-n // 16) for n in q_lens)
        assert tiles <= num_programs(64, len(q_lens), 3)


def test_the_launch_writes_only_the_rows_of_sequences():
    q, k, v, tables, lens, qsl = ragged_case([3, 2], [1, 4], spare_rows=5)
    out = torch.full_like(q, 7.0)
    ragged_paged(q, k, v, tables, lens, qsl, 0.125, out=out)
    assert (out[5:] == 7.0).all() and not (out[:5] == 7.0).any()


@pytest.mark.parametrize(
    "bad, match",
    [
        (lambda m: m.update(qsl=m["qsl"].to(torch.int64)), "query_start_loc must be an int32"),
        (lambda m: m.update(qsl=m["qsl"][:-1]), "query_start_loc needs 3 entries"),
        (lambda m: m.update(qsl=m["qsl"].flip(0)), "query_start_loc must rise from 0"),
        (lambda m: m.update(lens=m["lens"] - 3), "seq_lens must count at least"),
        (lambda m: m.update(tables=m["tables"][:, :1]), "block_tables has 1 columns"),
        (lambda m: m.update(tables=m["tables"] + 100), "outside the pool"),
    ],
)
def test_bad_input_is_refused_by_name(bad, match):
    q, k, v, tables, lens, qsl = ragged_case([3, 2], [1, 30])
    m = dict(tables=tables, lens=lens, qsl=qsl)
    bad(m)
    with pytest.raises(ValueError, match=match):
        ragged_paged_attention(q, k, v, m["tables"], m["lens"], m["qsl"])
