"""The overlapped engine (issue 49): the next step scheduled and packed while this one runs, the sampled tokens
fed to it on the device and read by the host one step late.

Whatever the workload, ``Engine(overlap=True)`` must give the tokens of ``overlap=False``, token for token in
fp32, and take the same decisions: every step's event (who ran how many tokens, who was admitted, preempted,
finished, the pool's free blocks) is the same but for its timing. On a CPU the overlap saves nothing (nothing
runs ahead of the host), but every line of its logic runs here: stops on EOS that roll the step scheduled ahead
back, seeded sampling and forks, prefix caching, preemption by recompute and by swap, requests that come and go
between steps, a step that fails. The ``cuda`` cases run it on a GPU, every step from a CUDA graph (``make gpu-check``
runs them).
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcourse import SamplingParams
from kvcourse.kernels.triton_runtime import kernel_device
from kvcourse.serving import Engine
from kvcourse.serving.scheduler import preempt_newest

from .conftest import tiny_llama

QUESTIONS = ["What is 2+2?", "Say hello.", "Name a color.", "What is the capital of France?", "Is water wet?",
             "Give me a number."]  # fmt: skip


def decisions(eng: Engine) -> list:
    """Every step's event but its timing (steps overlap in time when the engine overlaps)."""
    return [dataclasses.replace(e, start=0.0, duration=0.0) for e in eng.events]


def counters(eng: Engine) -> dict:
    """What the recorder counted, but for the overlap's own counters."""
    return {k: v for k, v in eng.recorder.counters.items() if not k.startswith("overlap")}


def serve_both(model, prompts, params, **engine) -> Engine:
    """Serve ``prompts`` without overlap and with it; assert the same tokens and decisions; return the overlapped
    engine."""
    runs = {}
    for overlap in (False, True):
        eng = Engine(model, overlap=overlap, **engine)
        runs[overlap] = eng.generate(prompts, params), eng
    (want, sync), (got, eng) = runs[False], runs[True]
    assert got == want
    assert decisions(eng) == decisions(sync)
    assert counters(eng) == counters(sync)
    assert sync.stats["overlapped_steps"] == sync.stats["overlap_rollbacks"] == 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return eng


@pytest.fixture(scope="module")
def chats(tok) -> list[list[int]]:
    return [tok.encode(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n") for q in QUESTIONS]


def test_overlap_is_on_for_a_gpu_only(model_on, device):
    assert Engine(model_on, num_blocks=8).overlap is (device.type == "cuda")
    assert Engine(model_on, num_blocks=8, overlap=True).overlap is True
    with pytest.raises(TypeError, match="overlap"):
        Engine(model_on, num_blocks=8, overlap="yes")


def backend_on(device) -> str:
    """On a GPU, the backend whose steps replay CUDA graphs (every step of these tests is from a graph)."""
    return "triton" if device.type == "cuda" else "paged-torch"


def test_eos_mid_batch_rolls_the_step_ahead_back(model_on, device, chats):
    """Chats that end on EOS at different steps: each time, the next step was scheduled with the finished sequence
    in it, and is scheduled again without it."""
    eng = serve_both(model_on, chats, SamplingParams(max_new_tokens=12), num_blocks=64, block_size=16,
                     max_num_seqs=4, backend=backend_on(device))  # fmt: skip
    outs = [eng.output(i) for i in range(len(chats))]
    assert sum(o[-1] in eng.eos_token_ids and len(o) < 12 for o in outs) >= 2
    stats = eng.stats
    assert stats["overlap_rollbacks"] >= 2 and stats["overlapped_steps"] > stats["steps"] // 2
    if device.type == "cuda":
        assert eng.runner.graph_steps == stats["steps"]


def test_seeded_sampling_and_forks(model_on, device, chats):
    """Temperature, top-k and top-p with seeds, n=3 samples forked at the first token, beside greedy requests:
    each sample draws from its own generator in the same order, and sampled tokens reach the next step from the
    host."""
    params = [SamplingParams(max_new_tokens=8, temperature=0.9, top_k=40, seed=7, n=3),
              SamplingParams(max_new_tokens=8),
              SamplingParams(max_new_tokens=8, temperature=1.2, top_p=0.9, seed=1),
              SamplingParams(max_new_tokens=6, temperature=0.7, seed=3, n=2)]  # fmt: skip
    eng = serve_both(model_on, chats[:4], params, num_blocks=64, block_size=8, max_num_seqs=8,
                     backend=backend_on(device))  # fmt: skip
    assert len(eng.output(0)) == 3 and eng.stats["max_blocks_saved_by_sharing"] > 0
    assert eng.stats["overlapped_steps"] > 0


def test_prefix_caching(model, tok, chats):
    """Blocks hashed when they fill, from token values the host read one step late: the same hits, the same
    decisions. The second wave reuses the first one's blocks."""
    system = "You are a careful assistant for a public library. Answer in one short sentence."
    prompts = [tok.encode_chat(q, system_prompt=system) for q in QUESTIONS[:4]]
    prompts += [p + tok.encode(" Thanks.") for p in prompts[:2]]
    eng = serve_both(model, prompts, SamplingParams(max_new_tokens=10), num_blocks=48, block_size=8,
                     max_num_seqs=3, max_num_batched_tokens=64, enable_prefix_caching=True)  # fmt: skip
    assert eng.stats["prefix_cache_hit_tokens"] > 0 and eng.stats["overlap_rollbacks"] > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(model, chats, mode):
    """A pool too small for the batch: sequences scheduled ahead are preempted (and recomputed, or swapped out and
    back) exactly as without overlap, EOS rolling some of those steps back."""
    swap = {"preemption_mode": "swap", "num_cpu_blocks": 16} if mode == "swap" else {}
    eng = serve_both(model, chats[:5], SamplingParams(max_new_tokens=10), num_blocks=9, block_size=4,
                     max_num_seqs=5, max_num_batched_tokens=32, watermark=0.0, **swap)  # fmt: skip
    assert eng.stats["preemptions"] > 0 and eng.stats["overlap_rollbacks"] > 0
    if mode == "swap":
        assert eng.stats["swapped_out"] > 0 and eng.stats["swapped_in"] > 0


def test_requests_that_come_and_go_between_steps(model, chats):
    """A request added, and one aborted, between two steps: the step scheduled ahead did not see them, so it is
    dropped and scheduled again; each step gives the tokens it gives without overlap."""
    streams = {}
    for overlap in (False, True):
        eng = Engine(model, num_blocks=64, block_size=16, max_num_seqs=4, overlap=overlap)
        params = SamplingParams(max_new_tokens=10)
        for p in chats[:3]:
            eng.add_request(p, params)
        steps = []
        while eng.has_unfinished_requests():
            if len(steps) == 2:
                eng.add_request(chats[3], params)
            if len(steps) == 4:
                eng.abort(1)
            steps.append(eng.step())
        streams[overlap] = steps, decisions(eng), eng.stats["overlapped_steps"]
    assert streams[True][:2] == streams[False][:2]
    assert streams[True][2] > 0


@pytest.mark.parametrize("where", ["forward", "preemption policy"])
def test_a_failed_step_fails_as_without_overlap(model, chats, where):
    """A step whose forward fails (the step scheduled ahead), or whose scheduling does (a preemption policy that
    refuses once, called while the step before runs): the same call raises, the scheduler is rolled back to where
    it was before the step, and the run goes on to the tokens and decisions of an engine without overlap."""
    runs = {}
    for overlap in (False, True):
        calls = []  # of the policy, or of the forward

        def policy(candidates, calls=calls):
            calls.append(len(candidates))
            return "not a sequence" if len(calls) == 2 else preempt_newest(candidates)

        eng = Engine(model, num_blocks=10, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, watermark=0.0,
                     overlap=overlap, preemption_policy=policy if where != "forward" else None)  # fmt: skip
        if where == "forward":
            launch = eng.runner.launch

            def failing(step, launch=launch, calls=calls):
                calls.append(None)
                if len(calls) in (4, 9):
                    raise RuntimeError("not a sequence (an injected out of memory)")
                return launch(step)

            eng.runner.launch = failing
        ids = [eng.add_request(p, SamplingParams(max_new_tokens=8, stop_token_ids=())) for p in chats[:4]]
        failed, steps = [], 0
        while eng.has_unfinished_requests():
            try:
                eng.step()
            except (RuntimeError, ValueError) as error:
                assert "not a sequence" in str(error)
                failed.append(steps)
            steps += 1
        runs[overlap] = [eng.output(i) for i in ids], decisions(eng), failed, len(calls)
    assert runs[True] == runs[False]
    assert len(runs[True][2]) == (2 if where == "forward" else 1) and runs[True][1][0].preempted == ()
    assert any(e.preempted for e in runs[True][1])


@pytest.mark.skipif(kernel_device().type != "cpu", reason="Triton kernels take cuda tensors in this process")
def test_the_static_buffers_of_the_graph_path():
    """``cuda_graphs="eager"``: the steps a graph would replay, packed ahead into its static buffers, the sampled
    tokens gathered into them on the device (Triton's interpreter on a CPU, a tiny model)."""
    model = tiny_llama(5)
    prompts = [[1, 5, 9, 13, 2, 6], [3, 7], [11] * 19, [4, 8, 12], [9, 9, 9, 9, 9, 9, 9, 9, 9]]
    params = [SamplingParams(max_new_tokens=n, stop_token_ids=(7, 42)) for n in (9, 4, 7, 12, 5)]
    eng = serve_both(model, prompts, params, num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=8,
                     backend="triton", cuda_graphs="eager")  # fmt: skip
    assert eng.runner.graph_steps == len(eng.events) and eng.stats["overlapped_steps"] > 0
