"""The engine on SmolLM2-135M: 16 requests, every greedy output equal to the request run alone.

Prompts of 1 to 300 tokens, outputs of 1 to 64, under token budgets of 16, 64 and 256 tokens per
step (chunked prefill mixed with decodes), and under heavy preemption in a pool of a few dozen
blocks. The reference is ``kvcourse.generate`` on the contiguous cache, one request at a time.
"""

from __future__ import annotations

import pytest

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine

from .test_serving_engine import assert_greedy_equal

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a screw press adapted from winemaking. Within fifty years presses "
    "were running in more than two hundred cities across Europe, and the price of books fell so far that "
    "ordinary merchants could own them. Scholars argue about how quickly the change spread, but nobody "
    "disputes that it reshaped religion, science and politics. Letters, pamphlets and newspapers followed, "
    "and with them a new public that read, argued and wrote back. "
)
PROMPT_LENS = [1, 2, 5, 9, 17, 24, 33, 48, 64, 80, 96, 128, 150, 200, 256, 300]
OUTPUT_LENS = [64, 1, 2, 3, 5, 7, 9, 12, 2, 4, 6, 1, 8, 16, 3, 32]


@pytest.fixture(scope="module")
def workload(model, tok):
    ids = tok.encode(TEXT * 4)
    prompts = [ids[7 * i : 7 * i + n] for i, n in enumerate(PROMPT_LENS)]
    assert [len(p) for p in prompts] == PROMPT_LENS
    params = [SamplingParams(max_new_tokens=n) for n in OUTPUT_LENS]
    solo = [kvcourse.generate(model, p, sampling_params=sp) for p, sp in zip(prompts, params)]
    return prompts, params, solo


@pytest.mark.parametrize(
    "budget, num_blocks, heavy",
    [(16, 256, False), (64, 256, False), (256, 256, False), (64, 26, True)],
    ids=["budget16", "budget64", "budget256", "preemption"],
)
def test_sixteen_requests_equal_each_request_alone(model, workload, budget, num_blocks, heavy):
    prompts, params, solo = workload
    eng = Engine(model, num_blocks=num_blocks, block_size=16, max_num_seqs=16, max_num_batched_tokens=budget,
                 watermark=0.0 if heavy else 0.01)  # fmt: skip
    outs = eng.generate(prompts, params)
    for p, got, want in zip(prompts, outs, solo):
        assert_greedy_equal(model, p, got, want)
    stats = eng.stats
    mixed = sum(1 for e in eng.events if {k for *_, k in e.scheduled} >= {"decode", "chunk"})
    assert mixed > 0  # prefill chunks and decodes of other requests shared steps
    assert max(e.num_tokens for e in eng.events) <= budget
    if heavy:
        # 16 requests in 26 blocks of 16 (416 slots; the longest alone needs 20 blocks): many preemptions
        assert stats["preemptions"] >= 5 and stats["recomputed_tokens"] > 0
    else:
        assert stats["preemptions"] == 0
    assert eng.block_manager.num_free_blocks == num_blocks


def test_engine_on_device_equals_each_request_alone(model_on, tok, device):
    """The engine with chunked prefill beside decodes, on the CPU (and on the GPU when there is one)."""
    ids = tok.encode(TEXT)
    prompts = [ids[:n] for n in (3, 20, 41)]
    solo = [kvcourse.generate(model_on, p, max_new_tokens=6, eos_token_ids=()) for p in prompts]
    eng = Engine(model_on, num_blocks=32, block_size=16, max_num_batched_tokens=24)
    outs = eng.generate(prompts, [SamplingParams(max_new_tokens=6, stop_token_ids=())] * 3)
    for p, got, want in zip(prompts, outs, solo):
        assert_greedy_equal(model_on, p, got, want)
    assert eng.runner.kv_store.k_cache[0].device.type == device.type


# ---- prefix caching (chapter 7) ------------------------------------------------------------------
SYSTEM_PROMPT = (
    "You are a careful assistant for a public library. Answer in one or two short sentences, in plain "
    "English, without lists. If you do not know an answer, say so and suggest asking a librarian at the desk."
)
QUESTIONS = [
    "When does the library open on Sundays?",
    "Can I renew a book online?",
    "What is a library card?",
    "How many books can I borrow at once?",
    "Do you have a quiet room for studying?",
    "Who wrote Pride and Prejudice?",
]


@pytest.fixture(scope="module")
def chat_workload(model, tok):
    prompts = [tok.encode_chat(q, system_prompt=SYSTEM_PROMPT) for q in QUESTIONS]
    params = SamplingParams(max_new_tokens=12)
    solo = [kvcourse.generate(model, p, sampling_params=params) for p in prompts]
    return prompts, params, solo


# Larger budgets with prefix caching: the tiny-model fuzz test in test_prefix_cache.py.
@pytest.mark.parametrize(
    "budget, num_blocks, block_size, heavy",
    [(16, 64, 16, False), (64, 16, 8, True)],
    ids=["budget16", "preemption"],
)
def test_prefix_caching_leaves_chat_outputs_unchanged(model, chat_workload, budget, num_blocks, block_size, heavy):
    # The requests share a chat-template system prompt. The first runs alone (a warm cache), the rest
    # together; each output must equal the request run alone (as test_sixteen_requests_equal_each_request_alone
    # checks without prefix caching).
    prompts, params, solo = chat_workload
    shared = next(i for i, col in enumerate(zip(*prompts)) if len(set(col)) > 1)  # tokens all prompts share
    assert shared >= 48
    eng = Engine(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=8, max_num_batched_tokens=budget,
                 enable_prefix_caching=True, watermark=0.0 if heavy else 0.01)  # fmt: skip
    outs = eng.generate(prompts[:1], params) + eng.generate(prompts[1:], params)
    for p, got, want in zip(prompts, outs, solo):
        assert_greedy_equal(model, p, got, want)
    stats, bm = eng.stats, eng.block_manager
    assert bm.num_free_blocks == num_blocks
    if heavy:  # 5 requests of 10 blocks of 8 in 16, sharing 6: preempted as they grow, re-admitted on cached blocks
        assert stats["preemptions"] >= 1
    # Every later request finds at least the shared system prompt's full blocks.
    assert stats["prefix_cache_hit_tokens"] >= (len(prompts) - 1) * (shared // block_size * block_size)
