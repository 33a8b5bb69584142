"""ForwardBatch: its checks, and ragged mixed steps on the paged pool equal to each sequence run alone."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcourse
from kvcourse.batch import ForwardBatch, SeqSlice, slot_mapping
from kvcourse.paged import BlockManager, NoFreeBlocksError
from kvcourse.serving import ModelRunner

from .tolerances import assert_logits_close


# ---- the slot-mapping formula and building a batch ------------------------------------------------
def test_slot_mapping_formula():
    assert slot_mapping([7, 2, 5], [0, 3, 4, 9, 11], block_size=4) == [28, 31, 8, 21, 23]
    with pytest.raises(ValueError, match=r"positions must lie in \[0, 12\)"):
        slot_mapping([7, 2, 5], [12], block_size=4)
    with pytest.raises(ValueError, match="block_size"):
        slot_mapping([0], [0], block_size=0)


def test_build_packs_sequences_one_after_another():
    batch = ForwardBatch.build(
        [SeqSlice([5, 6, 7], 0, [3]), SeqSlice([8], 9, [0, 2, 1]), SeqSlice([9, 10], 4, [4, 6])], block_size=4
    )
    assert batch.input_ids.tolist() == [5, 6, 7, 8, 9, 10]
    assert batch.positions.tolist() == [0, 1, 2, 9, 4, 5]
    assert batch.slot_mapping.tolist() == [12, 13, 14, 5, 24, 25]  # block 3 off 0-2; pos 9: block 1 off 1; block 6
    assert batch.query_start_loc.tolist() == [0, 3, 4, 6]
    assert batch.seq_lens.tolist() == [3, 10, 6]
    assert batch.block_tables.tolist() == [[3, -1, -1], [0, 2, 1], [4, 6, -1]]
    assert batch.block_tables.dtype == batch.seq_lens.dtype == batch.query_start_loc.dtype == torch.int32
    assert batch.query_lens == [3, 1, 2] and batch.num_tokens == 6 and batch.num_seqs == 3
    assert batch.last_token_indices.tolist() == [2, 3, 5]
    assert batch.max_block_host == 6


def _hand_made(**changes):
    fields = dict(
        input_ids=torch.tensor([5, 6, 7, 8]),
        positions=torch.tensor([0, 1, 2, 9]),
        slot_mapping=torch.tensor([12, 13, 14, 5]),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([3, 10], dtype=torch.int32),
        block_tables=torch.tensor([[3, -1, -1], [0, 2, 1]], dtype=torch.int32),
        block_size=4,
    )
    return ForwardBatch(**(fields | changes)).check()


def test_hand_made_batch_is_checked():
    assert _hand_made().seq_lens_host == (3, 10)
    cases = [
        (dict(positions=torch.tensor([0, 2, 3, 9])), r"positions of sequence 0 must be consecutive"),  # skips
        (dict(positions=torch.tensor([0, 1, 2, 8])), r"positions of sequence 1 .* end at seq_lens\[1\] - 1 = 9"),
        (dict(slot_mapping=torch.tensor([12, 13, 14, 5, 6])), "slot_mapping has 5 entries but input_ids has 4"),
        (
            dict(block_tables=torch.tensor([[3, -1, -1], [0, 2, -1]], dtype=torch.int32)),
            r"block_tables\[1\] is too short for seq_lens\[1\] = 10",
        ),
        (
            dict(
                query_start_loc=torch.tensor([0, 3, 3, 4], dtype=torch.int32),
                seq_lens=torch.tensor([3, 1, 10], dtype=torch.int32),
            ),
            "block_tables B rows",
        ),
        (dict(query_start_loc=torch.tensor([0, 4, 4], dtype=torch.int32)), "strictly increasing"),
        (dict(query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32)), "from 0 to the token count 4"),
        (dict(slot_mapping=torch.tensor([12, 13, 14, 9])), "slot_mapping of sequence 1 does not match"),
        (dict(seq_lens=torch.tensor([3, 10])), "seq_lens must be a 1-D torch.int32"),
        (dict(block_tables=torch.tensor([[3, -1, -1], [0, 2, 1]])), "block_tables must be a 2-D torch.int32"),
        (dict(block_size=0), "block_size must be an int >= 1, got 0"),
    ]
    for changes, match in cases:
        with pytest.raises(ValueError, match=match):
            _hand_made(**changes)
    # Two sequences writing one slot overlap in the pool (here: both claim block 3).
    with pytest.raises(ValueError, match="two sequences overlap"):
        ForwardBatch.build([SeqSlice([1, 2], 0, [3]), SeqSlice([4], 1, [3])], block_size=4)
    with pytest.raises(TypeError, match="input_ids must be a torch.Tensor"):
        _hand_made(input_ids=[5, 6, 7, 8])


def test_build_rejects_bad_sequences():
    with pytest.raises(ValueError, match="non-empty list of SeqSlice"):
        ForwardBatch.build([], block_size=4)
    with pytest.raises(ValueError, match=r"seqs\[1\] has no new tokens"):
        ForwardBatch.build([SeqSlice([1], 0, [0]), SeqSlice([], 0, [1])], block_size=4)
    with pytest.raises(ValueError, match=r"seqs\[0\].block_table is too short"):
        ForwardBatch.build([SeqSlice([1, 2, 3], 3, [0])], block_size=4)
    with pytest.raises(ValueError, match=r"num_computed_tokens must be an int >= 0"):
        ForwardBatch.build([SeqSlice([1], -1, [0])], block_size=4)
    with pytest.raises(TypeError, match=r"seqs\[0\] must be a SeqSlice"):
        ForwardBatch.build([([1], 0, [0])], block_size=4)


def test_forward_batch_refuses_a_batch_for_another_pool(model):
    runner = ModelRunner(model, num_blocks=4, block_size=16)
    batch = ForwardBatch.build([SeqSlice([1, 2], 0, [7])], block_size=16)
    with pytest.raises(ValueError, match="name block 7, but kv_pool has 4 blocks"):
        model.forward_batch(batch, runner.kv_store)
    with pytest.raises(ValueError, match=r"batch.block_size \(8\) must equal kv_pool.block_size \(16\)"):
        model.forward_batch(ForwardBatch.build([SeqSlice([1], 0, [0])], block_size=8), runner.kv_store)
    with pytest.raises(ValueError, match="backend must be one of"):
        model.forward_batch(ForwardBatch.build([SeqSlice([1], 0, [0])], block_size=16), runner.kv_store, "cuda")


# ---- a tiny random model: property tests over many random schedules -------------------------------
@pytest.fixture(scope="module")
def tiny():
    cfg = kvcourse.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                               max_position_embeddings=1024)  # fmt: skip
    model = kvcourse.LlamaModel(cfg)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def _run_schedule(runner, tokens, rnd, max_chunk=None):
    """Feed every sequence's ``tokens`` through ``runner`` in random chunks, several sequences per step.

    Returns, per sequence, the logits at every position (``[len, vocab]``), and the number of steps.
    """
    done = [0] * len(tokens)
    rows = [[] for _ in tokens]
    steps = 0
    while any(d < len(t) for d, t in zip(done, tokens)):
        active = [i for i, t in enumerate(tokens) if done[i] < len(t)]
        chosen = rnd.sample(active, rnd.randint(1, len(active)))
        rnd.shuffle(chosen)  # the packing order must not matter
        work = []
        for i in chosen:
            left = len(tokens[i]) - done[i]
            n = 1 if rnd.random() < 0.3 else rnd.randint(1, min(left, max_chunk or left))
            work.append((i, tokens[i][done[i] : done[i] + n]))
        logits = runner.step(work, all_logits=True)
        lo = 0
        for i, chunk in work:
            rows[i].append(logits[lo : lo + len(chunk)])
            lo += len(chunk)
            done[i] += len(chunk)
        steps += 1
    return [torch.cat(r) for r in rows], steps


@settings(max_examples=40, deadline=None, derandomize=True)
@given(
    seed=st.integers(0, 2**31 - 1),
    num_seqs=st.integers(1, 6),
    block_size=st.sampled_from([1, 2, 3, 16]),
    holes=st.integers(0, 5),
)
def test_random_schedules_equal_each_sequence_alone(tiny, seed, num_seqs, block_size, holes):
    rnd = random.Random(seed)
    tokens = [[rnd.randrange(101) for _ in range(rnd.randint(1, 300))] for _ in range(num_seqs)]
    need = sum(-(-len(t) // block_size) for t in tokens)
    runner = ModelRunner(tiny, num_blocks=need + 2 * holes + 1, block_size=block_size)
    bm = runner.block_manager
    for h in range(2 * holes):  # interleave other owners, then free every other one: scattered free blocks
        bm.allocate(("hole", h), rnd.randint(1, block_size))
    for h in range(0, 2 * holes, 2):
        bm.free(("hole", h))
    got, _ = _run_schedule(runner, tokens, rnd)
    for seq_id, (t, logits) in enumerate(zip(tokens, got)):
        alone = tiny(torch.tensor([t]))[0]  # no cache at all: an independent path
        torch.testing.assert_close(logits, alone, rtol=1e-5, atol=1e-5)
        runner.free(seq_id)
    for h in range(1, 2 * holes, 2):
        bm.free(("hole", h))
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked


def test_runner_step_is_all_or_nothing(tiny):
    runner = ModelRunner(tiny, num_blocks=3, block_size=4)
    runner.step([(0, [1, 2, 3, 4, 5])])  # 2 blocks
    with pytest.raises(NoFreeBlocksError, match="needs 2 free blocks, only 1"):
        runner.step([(0, [6]), (1, [1, 2, 3, 4, 5])])
    assert runner.block_manager.num_tokens(0) == 5 and runner.block_manager.num_free_blocks == 1
    with pytest.raises(ValueError, match="names a sequence twice"):
        runner.step([(0, [6]), (0, [7])])


# ---- the real model --------------------------------------------------------------------------------
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from winemaking. Within fifty years presses "
    "were running in more than two hundred cities across Europe, and the price of books fell so far that "
    "ordinary merchants could own them. Scholars argue about how quickly the change spread, but nobody "
    "disputes that it reshaped religion, science and politics. Letters, pamphlets and newspapers followed, "
    "and with them a new public that read, argued and wrote back. "
)


@pytest.fixture(scope="module")
def long_ids(tok):
    ids = tok.encode(TEXT * 3)
    assert len(ids) >= 300
    return ids


def test_mixed_step_on_the_real_model_equals_solo_runs(model, long_ids):
    """Whole prompts, prefill chunks and decodes in the same steps; logits and greedy tokens as if alone."""
    prompts = [long_ids[:150], long_ids[10:310], long_ids[40:47], long_ids[5:6], long_ids[100:164]]
    plan = [  # per step: {seq: tokens of its prompt to feed}; a sequence past its prompt decodes
        {0: 150, 1: 64, 2: 7},
        {0: 0, 1: 100, 2: 0, 3: 1},
        {0: 0, 1: 136, 2: 0, 3: 0, 4: 30},
        {0: 0, 1: 0, 2: 0, 3: 0, 4: 34},
        {0: 0, 1: 0, 2: 0, 3: 0, 4: 0},
        {0: 0, 1: 0, 2: 0, 3: 0, 4: 0},
    ]
    runner = ModelRunner(model, num_blocks=64, block_size=16)
    fed = {i: 0 for i in range(len(prompts))}
    generated = {i: [] for i in range(len(prompts))}
    mixed = 0
    for step in plan:
        work = []
        for i, n in step.items():
            if n:
                work.append((i, prompts[i][fed[i] : fed[i] + n]))
                fed[i] += n
            else:
                work.append((i, generated[i][-1:]))
        mixed += len({len(chunk) == 1 for _, chunk in work}) == 2  # prefills and decodes in one step
        logits = runner.step(work)
        for (i, _), row in zip(work, logits):
            if fed[i] == len(prompts[i]):
                generated[i].append(int(row.argmax()))
        # Each sequence's last-position logits equal a contiguous run of the same tokens alone.
        for (i, _), row in zip(work, logits):
            seen = prompts[i][: fed[i]] + generated[i][:-1] if fed[i] == len(prompts[i]) else prompts[i][: fed[i]]
            alone = model(torch.tensor([seen]), cache=kvcourse.KVCache.for_model(model.config))[0, -1]
            assert_logits_close(row, alone)
    assert mixed >= 3
    for i, p in enumerate(prompts):
        assert generated[i] == kvcourse.generate(model, p, len(generated[i]), eos_token_ids=())
    assert min(len(g) for g in generated.values()) >= 2


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_prefill_equals_one_shot_prefill(model, long_ids, chunk):
    prompt = long_ids[: 40 if chunk == 1 else 200]
    runner = ModelRunner(model, num_blocks=16, block_size=16)
    rows = [runner.step([(0, prompt[i : i + chunk])], all_logits=True) for i in range(0, len(prompt), chunk)]
    one_shot = ModelRunner(model, num_blocks=16, block_size=16).step([(0, prompt)], all_logits=True)
    assert_logits_close(torch.cat(rows), one_shot)
    # The chunks wrote exactly the K/V one shot writes.
    k_chunked = runner.kv_store.k_cache[29].view(-1, 3, 64)[: len(prompt)]
    k_one = ModelRunner(model, num_blocks=16, block_size=16)
    k_one.step([(0, prompt)])
    assert_logits_close(k_chunked, k_one.kv_store.k_cache[29].view(-1, 3, 64)[: len(prompt)])


def test_fork_inside_a_batch_copies_on_write(model, long_ids):
    prompt = long_ids[:37]  # 2 full blocks and a partial third: the one both branches write into
    runner = ModelRunner(model, num_blocks=12, block_size=16)
    runner.step([("parent", prompt)])
    runner.fork("parent", "child")
    bm = runner.block_manager
    assert bm.block_table("child") == bm.block_table("parent") and bm.num_used_blocks == 3
    a, b = long_ids[37], long_ids[200]
    logits = runner.step([("child", [a]), ("parent", [b])])  # both append to the shared partial block
    assert bm.block_table("child")[:2] == bm.block_table("parent")[:2]  # full blocks still shared
    assert bm.block_table("child")[2] != bm.block_table("parent")[2]  # one private copy was made
    assert bm.num_used_blocks == 4
    for token, row in ((a, logits[0]), (b, logits[1])):
        alone = model(torch.tensor([prompt + [token]]))[0, -1]
        assert_logits_close(row, alone)
    # Both branches keep decoding in one batch, each as if it were alone.
    ta, tb = int(logits[0].argmax()), int(logits[1].argmax())
    seqs = {"child": prompt + [a, ta], "parent": prompt + [b, tb]}
    for _ in range(3):
        logits = runner.step([("child", seqs["child"][-1:]), ("parent", seqs["parent"][-1:])])
        for name, row in zip(("child", "parent"), logits):
            seqs[name].append(int(row.argmax()))
    for name in ("child", "parent"):
        start = len(prompt) + 1
        assert seqs[name][start:] == kvcourse.generate(model, seqs[name][:start], 4, eos_token_ids=())
    runner.free("child")
    runner.free("parent")
    assert bm.num_free_blocks == 12
