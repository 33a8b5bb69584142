"""The engine on a tiny random-weight model (fast): every request as if alone, under any schedule.

The reference is ``kvcourse.generate`` on the contiguous cache, one request at a time: a different
path (no blocks, no batching, no scheduler). The real model gets the same checks in
``test_serving_real.py``.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcourse
from kvcourse import SamplingParams
from kvcourse.serving import Engine

from .conftest import on_device
from .tolerances import LOGIT_REL_TOL

VOCAB = 101


@pytest.fixture(scope="module")
def tiny():
    cfg = kvcourse.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                               num_attention_heads=6, num_key_value_heads=2, head_dim=8, rope_theta=10000.0,
                               max_position_embeddings=1024, eos_token_id=[3])  # fmt: skip
    model = kvcourse.LlamaModel(cfg)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model.eval()


def assert_greedy_equal(model, prompt, got, want):
    """``got == want``, or they part at a near-tie of the reference (two logits within fp32 noise)."""
    if got == want:
        return
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    assert k < min(len(got), len(want)), f"lengths differ without a differing token: {got} vs {want}"
    logits = model(torch.tensor([prompt + want[:k]], device=model.device))[0, -1]
    gap = float(logits[want[k]] - logits[got[k]])
    assert gap < LOGIT_REL_TOL * float(logits.abs().max()), f"token {k}: {got[k]} vs {want[k]}, a gap of {gap}"


def workload(rnd, num, max_prompt=120, max_new=24):
    prompts = [[rnd.randrange(VOCAB) for _ in range(rnd.randint(1, max_prompt))] for _ in range(num)]
    return prompts, [SamplingParams(max_new_tokens=rnd.randint(1, max_new)) for _ in range(num)]


def check_events_match_stats(eng: Engine) -> None:
    st_ = eng.stats
    ev = eng.events
    assert st_["steps"] == len(ev) and [e.step for e in ev] == list(range(len(ev)))
    assert st_["preemptions"] == sum(len(e.preempted) for e in ev)
    assert st_["batched_tokens"] == sum(e.num_tokens for e in ev)
    assert st_["generated_tokens"] == sum(len(o) for r in eng.requests.values() for o in r.outputs)
    if all(r.status == "finished" and r.params.n == 1 for r in eng.requests.values()):
        # every token but the last output is fed once, plus what preemptions made us feed again
        once = sum(r.metrics.num_prompt_tokens + r.metrics.num_output_tokens - 1 for r in eng.requests.values())
        assert st_["batched_tokens"] == once + st_["recomputed_tokens"]
        assert st_["prompt_tokens"] == sum(r.metrics.num_prompt_tokens for r in eng.requests.values())
    for m in st_["requests"].values():
        if m.finish_time is not None and m.first_token_time is not None:
            assert m.arrival_step <= m.first_scheduled_step <= m.first_token_step <= m.finish_step
            assert 0 <= m.queue_time <= m.ttft <= m.e2e_latency


# ---- every request as if alone ------------------------------------------------------------------
@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), block_size=st.sampled_from([1, 4, 16]),
       budget=st.sampled_from([16, 48, None]), chunked=st.booleans(), max_num_seqs=st.sampled_from([1, 4, 16]),
       slack=st.sampled_from([0, 4, 200]))  # fmt: skip
def test_random_workloads_equal_each_request_alone(tiny, seed, block_size, budget, chunked, max_num_seqs, slack):
    rnd = random.Random(seed)
    prompts, params = workload(rnd, rnd.randint(1, 10))
    if not chunked and budget is not None:
        budget = None  # without chunking every prompt must fit the budget: no cap
    if budget is not None and budget < block_size:
        budget = block_size
    biggest = max(-(-(len(p) + sp.max_new_tokens - 1) // block_size) for p, sp in zip(prompts, params))
    eng = Engine(tiny, num_blocks=biggest + slack, block_size=block_size, max_num_seqs=max_num_seqs,
                 max_num_batched_tokens=budget, enable_chunked_prefill=chunked, watermark=0.01)  # fmt: skip
    outs = eng.generate(prompts, params)
    for p, sp, got in zip(prompts, params, outs):
        assert_greedy_equal(tiny, p, got, kvcourse.generate(tiny, p, sampling_params=sp))
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks  # nothing leaked
    assert eng.stats["finished"] == len(prompts) and not eng.has_unfinished_requests()
    check_events_match_stats(eng)


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_live_loop_with_arrivals_and_aborts(tiny, seed):
    """Requests arrive between steps and some are aborted: the rest finish as if alone, the aborted
    ones keep a prefix of their solo output, every block comes back, each request ends exactly once."""
    rnd = random.Random(seed)
    prompts, params = workload(rnd, 8)
    eng = Engine(tiny, num_blocks=40, block_size=4, max_num_seqs=4, max_num_batched_tokens=32)
    arrivals = sorted(rnd.randrange(0, 30) for _ in prompts)
    ids, aborted, streamed = {}, set(), {}
    step = 0
    while len(ids) < len(prompts) or eng.has_unfinished_requests():
        while len(ids) < len(prompts) and arrivals[len(ids)] <= step:
            i = len(ids)
            ids[eng.add_request(prompts[i], params[i], request_id=f"r{i}")] = i
        live = [rid for rid in ids if rid not in aborted and eng.requests[rid].status in ("waiting", "running")]
        if live and rnd.random() < 0.08:
            rid = rnd.choice(live)
            eng.abort(rid)
            aborted.add(rid)
        for tok in eng.step():
            streamed.setdefault(tok.request_id, []).append(tok.token_id)
        step += 1
        assert step < 2000
    for rid, i in ids.items():
        want = kvcourse.generate(tiny, prompts[i], sampling_params=params[i])
        got = eng.output(rid)
        assert streamed.get(rid, []) == got  # streaming saw every token once, in order
        if rid in aborted:
            assert eng.requests[rid].status == "cancelled"
            assert_greedy_equal(tiny, prompts[i], got, want[: len(got)])
        else:
            assert eng.requests[rid].status == "finished"
            assert_greedy_equal(tiny, prompts[i], got, want)
    assert eng.stats["finished"] + eng.stats["cancelled"] == len(prompts)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    with pytest.raises(ValueError, match="not an unfinished request"):
        eng.abort("r0")


def test_stream_yields_the_tokens_generate_returns(tiny, device):
    tiny = on_device(tiny, device)
    prompts, params = workload(random.Random(3), 5)
    eng = Engine(tiny, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    streamed = [[] for _ in prompts]
    for i, tok in eng.stream(prompts, params):
        streamed[i].append(tok.token_id)
        assert tok.finished == eng.requests[tok.request_id].is_finished  # the last token says so
    again = Engine(tiny, num_blocks=64, block_size=4, max_num_batched_tokens=16).generate(prompts, params)
    assert streamed == again
    assert eng.runner.kv_store.k_cache[0].device.type == device.type


# ---- parallel sampling: fork and copy-on-write ---------------------------------------------------
def test_parallel_samples_share_the_prompt_and_equal_seeded_solo_runs(tiny, device):
    tiny = on_device(tiny, device)
    rnd = random.Random(5)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (37, 64, 9)]
    params = SamplingParams(max_new_tokens=10, n=3, temperature=1.0, seed=11, stop_token_ids=())
    eng = Engine(tiny, num_blocks=200, block_size=4, max_num_seqs=9)
    outs = eng.generate(prompts, params)
    for p, samples in zip(prompts, outs):
        solo = [kvcourse.generate(tiny, p, 10, temperature=1.0, seed=11 + i, eos_token_ids=()) for i in range(3)]
        assert samples == solo  # sample i draws with seed + i
    st_ = eng.stats
    # Prompt blocks stored once instead of three times: the full blocks of all three prompts, twice over
    # (37 -> 9 full blocks of 4, 64 -> 16, 9 -> 2), plus partial blocks until their copy-on-write.
    assert st_["max_blocks_saved_by_sharing"] >= 2 * (9 + 16 + 2)
    assert st_["max_bytes_saved_by_sharing"] == st_["max_blocks_saved_by_sharing"] * eng.runner.kv_store.block_nbytes
    # 37 and 9 end in a partly filled block that two of the three samples copy; 64 fills its blocks.
    assert st_["copy_on_write_copies"] == 4
    assert eng.block_manager.num_free_blocks == 200


def test_greedy_samples_are_identical_and_a_sample_can_be_preempted(tiny):
    rnd = random.Random(6)
    prompt = [rnd.randrange(VOCAB) for _ in range(30)]
    params = SamplingParams(max_new_tokens=20, n=4, stop_token_ids=())
    # 30 + 19 tokens = 13 blocks of 4 for one sample; 4 samples cannot all grow in 20 blocks: preemptions.
    eng = Engine(tiny, num_blocks=20, block_size=4, max_num_seqs=4, watermark=0)
    samples = eng.generate([prompt], params)[0]
    solo = kvcourse.generate(tiny, prompt, 20, eos_token_ids=())
    assert eng.stats["preemptions"] > 0
    for s in samples:
        assert_greedy_equal(tiny, prompt, s, solo)


def fewest_computed(candidates):
    """A victim policy other than vLLM's: the running sequence with the fewest computed tokens (ties: the newest)."""
    return min(reversed(candidates), key=lambda s: s.num_computed_tokens)


def test_a_preemption_policy_changes_the_victims_not_the_outputs(tiny, device):
    tiny = on_device(tiny, device)
    rnd = random.Random(11)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (30, 5, 18, 9)]
    params = SamplingParams(max_new_tokens=16, stop_token_ids=())
    runs = {}
    for name, policy in (("newest", None), ("fewest computed", fewest_computed), ("itself", lambda c: c[0])):
        eng = Engine(
            tiny, num_blocks=17, block_size=4, max_num_batched_tokens=64, watermark=0, preemption_policy=policy
        )
        outs = eng.generate(prompts, params)
        for p, o in zip(prompts, outs):
            assert_greedy_equal(tiny, p, o, kvcourse.generate(tiny, p, 16, eos_token_ids=()))
        check_events_match_stats(eng)
        runs[name] = [tuple(rid for rid, _ in e.preempted) for e in eng.events]
    assert all(any(r) for r in runs.values())  # every policy had to preempt
    assert len({tuple(r) for r in runs.values()}) == 3  # and each chose its own victims


def test_a_request_samples_its_tokens_and_forks_its_samples_at_the_first_one():
    from kvcourse.sampling import Sampler
    from kvcourse.sequence import Sequence
    from kvcourse.serving import Request, RequestMetrics

    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(max_new_tokens=4, n=3, temperature=1.0, seed=5)
    samplers = [Sampler(params, i) for i in range(3)]
    request = Request(7, Sequence((7, 0), [1, 2, 3], params), RequestMetrics(0.0, 0, 3), samplers)
    first = request.samples_of(request.seqs[0])
    # The two forked samples come first (new sequences on the parent's tokens), then the parent.
    assert [seq.seq_id for seq in first] == [(7, 1), (7, 2), (7, 0)]
    assert request.seqs == [first[2], first[0], first[1]]  # seqs[i] is sample i
    got = [request.pick(seq, logits, argmax=-1) for seq in first]
    assert got == [Sampler(params, i)(logits) for i in (1, 2, 0)]  # sample i: seed + i
    assert [seq.seq_id for seq in request.samples_of(request.seqs[1])] == [(7, 1)]  # no more forks
    greedy_params = SamplingParams(n=2)
    greedy = Request(
        8,
        Sequence((8, 0), [1], greedy_params),
        RequestMetrics(0.0, 0, 1),
        [Sampler(greedy_params, i) for i in range(2)],
    )
    assert [greedy.pick(seq, logits, argmax=42) for seq in greedy.samples_of(greedy.seqs[0])] == [42, 42]


def test_the_recorder_counts_what_the_event_log_shows(tiny):
    rnd = random.Random(8)
    prompts = [[rnd.randrange(VOCAB) for _ in range(n)] for n in (20, 7, 33)]
    eng = Engine(tiny, num_blocks=12, block_size=4, max_num_batched_tokens=16, watermark=0)
    eng.generate(prompts, SamplingParams(max_new_tokens=6, n=2, stop_token_ids=()))
    st_, events = eng.stats, eng.events
    assert st_["steps"] == len(events) == events[-1].step + 1
    assert st_["batched_tokens"] == sum(e.num_tokens for e in events)
    assert st_["preemptions"] == sum(len(e.preempted) for e in events) > 0
    assert st_["finished"] == 3 and sum(len(e.finished) for e in events) == 6  # 3 requests, 2 samples each
    assert st_["generated_tokens"] == 36 and st_["prompt_tokens"] == 60
    for m in st_["requests"].values():
        assert m.arrival_step <= m.first_scheduled_step <= m.first_token_step <= m.finish_step < len(events)
        assert m.num_output_tokens == 12 and m.max_sample_tokens == 6


# ---- the bugs other engines shipped -------------------------------------------------------------
def test_decode_positions_follow_the_prompt_and_chunks_see_earlier_chunks(tiny, monkeypatch):
    prompt = [random.Random(7).randrange(VOCAB) for _ in range(50)]
    eng = Engine(tiny, num_blocks=32, block_size=4, max_num_batched_tokens=16)
    fed = []
    real_prepare = eng.runner.prepare
    monkeypatch.setattr(
        eng.runner,
        "prepare",
        lambda out, all_logits=False: (
            fed.append([(s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]),
            real_prepare(out, all_logits),
        )[1],
    )
    out = eng.generate([prompt], max_new_tokens=4)[0]
    # chunks of 16 from positions 0, 16, 32, 48; then decodes at 50, 51, 52: never off by one
    assert fed == [[(0, 16)], [(16, 16)], [(32, 16)], [(48, 2)], [(50, 1)], [(51, 1)], [(52, 1)]]
    assert out == kvcourse.generate(tiny, prompt, 4)
    # The last chunk's next-token logits are one-shot prefill's: its attention read the earlier chunks.
    runner = Engine(tiny, num_blocks=32, block_size=4).runner
    chunked = [runner.step([(0, prompt[i : i + 16])]) for i in range(0, 50, 16)][-1]
    torch.testing.assert_close(chunked[0], tiny(torch.tensor([prompt]))[0, -1], rtol=1e-5, atol=1e-5)


def test_a_request_too_big_for_the_pool_is_refused_at_add_request_not_left_to_hang(tiny):
    eng = Engine(tiny, num_blocks=4, block_size=16)
    with pytest.raises(ValueError, match=r"request 0 alone needs 5 blocks of 16 .* num_blocks=4: it could never run"):
        eng.add_request(list(range(60)), SamplingParams(max_new_tokens=10))
    assert not eng.has_unfinished_requests() and not eng.requests
    # generate checks every prompt before queueing any
    with pytest.raises(ValueError, match=r"alone needs"):
        eng.generate([[1, 2], list(range(64))], max_new_tokens=2)
    assert not eng.requests
    assert eng.generate([[1, 2]], max_new_tokens=2) == [kvcourse.generate(tiny, [1, 2], 2)]


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        (dict(num_blocks=0), ValueError, "num_blocks must be an int >= 1"),
        (dict(num_blocks=2.5), TypeError, "num_blocks must be an int"),
        (dict(num_blocks=8, block_size=0), ValueError, "block_size"),
        (dict(num_blocks=8, max_num_seqs=0), ValueError, "max_num_seqs"),
        (
            dict(num_blocks=8, max_num_batched_tokens=8),
            ValueError,
            r"max_num_batched_tokens must be at least one block \(block_size=16\)",
        ),
        (dict(num_blocks=8, backend="cuda-magic"), ValueError, "backend must be one of"),
        (dict(num_blocks=8, watermark=2), ValueError, "watermark"),
        (dict(num_blocks=8, preemption_policy="newest"), TypeError, "preemption_policy must be a function"),
    ],
)
def test_bad_engine_arguments(tiny, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        Engine(tiny, **kwargs)


@pytest.mark.parametrize(
    "prompt, params, exc, match",
    [
        ([], None, ValueError, "prompt is empty"),
        ("hello", None, TypeError, r"prompt must be a list of token ids \(use tok.encode"),
        ([1, VOCAB], None, ValueError, r"prompt has token ids outside the vocabulary \[0, 101\): \[101\]"),
        ([1, -1], None, ValueError, "outside the vocabulary"),
        ([1, 2], "greedy", TypeError, "sampling_params must be a SamplingParams"),
        ([1] * 1020, SamplingParams(max_new_tokens=10), ValueError, "exceed the model's context length"),
        ([1, 2], SamplingParams(n=5), ValueError, "n=5 samples exceed max_num_seqs=4"),
    ],
)
def test_bad_requests(tiny, prompt, params, exc, match):
    eng = Engine(tiny, num_blocks=200, block_size=16, max_num_seqs=4)
    with pytest.raises(exc, match=match):
        eng.add_request(prompt, params)
    assert not eng.requests


def test_bad_generate_arguments(tiny):
    eng = Engine(tiny, num_blocks=32, block_size=4)
    with pytest.raises(ValueError, match="max_new_tokens must be an int >= 1"):
        eng.generate([[1, 2]], max_new_tokens=0)
    with pytest.raises(ValueError, match="either sampling_params or max_new_tokens"):
        eng.generate([[1, 2]], SamplingParams(), max_new_tokens=3)
    with pytest.raises(ValueError, match="one per prompt"):
        eng.generate([[1, 2], [3]], [SamplingParams()])
    with pytest.raises(TypeError, match="prompts must be a non-empty list"):
        eng.generate([])
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        eng.generate([[1], []])
    with pytest.raises(ValueError, match="request_id=7 is already used"):
        eng.add_request([1], request_id=7)
        eng.add_request([1], request_id=7)
    with pytest.raises(ValueError, match="sampling_params.n = 2"):
        kvcourse.generate(tiny, [1, 2], sampling_params=SamplingParams(n=2))


def test_progress_bar_counts_finished_requests(tiny, capsys):
    prompts, params = workload(random.Random(9), 3, max_prompt=10, max_new=3)
    Engine(tiny, num_blocks=16, block_size=4).generate(prompts, params, use_tqdm=True)
    err = capsys.readouterr().err
    assert "requests: 100%" in err and "3/3" in err
    Engine(tiny, num_blocks=16, block_size=4).generate(prompts, params)  # fewer than 32 prompts: no bar
    assert capsys.readouterr().err == ""


def test_the_engine_runs_chapter_5s_triton_backend(tiny, device):
    """The backend is the caller's choice: chapter 5's Triton kernels (interpreted on a CPU) give the same tokens."""
    from kvcourse.kernels.triton_runtime import kernel_device

    if device.type != kernel_device().type:
        pytest.skip(f"kernels take {kernel_device().type} tensors in this process")
    tiny = on_device(tiny, device)
    prompts, params = workload(random.Random(10), 4, max_prompt=40, max_new=5)
    outs = {
        b: Engine(tiny, num_blocks=32, block_size=4, max_num_batched_tokens=16, backend=b).generate(prompts, params)
        for b in ("paged-torch", "triton")
    }
    for p, a, b in zip(prompts, outs["paged-torch"], outs["triton"]):
        assert_greedy_equal(tiny, p, b, a)
