"""Our decoder against an implementation nobody here wrote: Hugging Face's LlamaForCausalLM on the same GGUF."""

import math

import pytest
import torch

import kvcourse
from kvcourse import KVCache
from kvcourse.paged import PagedKVCache

from .conftest import PROMPTS
from .tolerances import assert_logits_close

LONG_PROMPT = (
    "The KV cache stores the keys and values of every earlier token, in every layer, so that a decoder "
    "does not recompute them at each step. " * 4
)


@pytest.mark.parametrize("prompt", PROMPTS + [LONG_PROMPT])
def test_logits_match_hugging_face(model, tok, hf_model, prompt):
    ids = torch.tensor([tok.encode(prompt)])
    with torch.no_grad():
        theirs = hf_model(ids).logits
    ours = model(ids)
    assert ours.shape == theirs.shape == (1, ids.shape[1], 49152)
    assert (ours - theirs).abs().max().item() < 1e-4


def test_batched_logits_match_hugging_face(model, tok, hf_model):
    rows = [tok.encode("Hello there, my friend"), tok.encode("One two three four five")]
    ids = torch.tensor(rows)
    with torch.no_grad():
        theirs = hf_model(ids).logits
    ours = model(ids)
    assert (ours - theirs).abs().max().item() < 1e-4
    # Row b of a batch is what that sequence gives alone: the batch dimension mixes nothing.
    for b, row in enumerate(rows):
        assert (ours[b] - model(torch.tensor([row]))[0]).abs().max().item() < 1e-4


@pytest.mark.parametrize("prompt", PROMPTS + ["The history of the printing press"])
def test_greedy_generation_matches_hugging_face(model, tok, hf_model, prompt):
    """Token for token, EOS included. All but the first prompt run the full 64 tokens."""
    ids = tok.encode(prompt)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False)
    theirs = out[0, len(ids) :].tolist()
    ours = kvcourse.generate(model, ids, max_new_tokens=64)
    assert ours == theirs
    if prompt != PROMPTS[0]:  # "The capital of France is" answers and stops (EOS) after 30 tokens
        assert len(ours) == 64


@pytest.mark.parametrize("prompt", PROMPTS)
def test_cached_equals_naive_token_for_token(model_on, tok, prompt):
    ids = tok.encode(prompt)
    cached = kvcourse.generate(model_on, ids, max_new_tokens=40, use_cache=True, eos_token_ids=())
    naive = kvcourse.generate(model_on, ids, max_new_tokens=40, use_cache=False, eos_token_ids=())
    assert cached == naive and len(cached) == 40


def test_cached_logits_equal_full_recompute_and_cache_holds_the_same_kv(model_on, tok, device):
    model = model_on
    ids = tok.encode(LONG_PROMPT)
    cache = KVCache.for_model(model.config, device=device)
    prefix = model(torch.tensor([ids[:30]], device=device), cache=cache)
    steps = [model(torch.tensor([[t]], device=device), cache=cache) for t in ids[30:40]]
    full_cache = KVCache.for_model(model.config, device=device)
    full = model(torch.tensor([ids[:40]], device=device), cache=full_cache)
    assert (prefix[0] - full[0, :30]).abs().max() < 1e-4
    for i, step in enumerate(steps):
        assert (step[0, 0] - full[0, 30 + i]).abs().max() < 1e-4
    assert cache.seq_len == full_cache.seq_len == 40
    for layer in (0, 15, 29):
        assert (cache.keys(layer) - full_cache.keys(layer)).abs().max() < 1e-4
        assert (cache.values(layer) - full_cache.values(layer)).abs().max() < 1e-4


def test_sampling_is_seeded(model, tok):
    ids = tok.encode("My favourite animal is")
    a = kvcourse.generate(model, ids, 12, temperature=0.9, seed=3, eos_token_ids=())
    b = kvcourse.generate(model, ids, 12, temperature=0.9, seed=3, eos_token_ids=())
    c = kvcourse.generate(model, ids, 12, temperature=0.9, seed=4, eos_token_ids=())
    naive = kvcourse.generate(model, ids, 12, use_cache=False, temperature=0.9, seed=3, eos_token_ids=())
    assert a == b == naive and a != c


def test_generation_stops_at_eos(model, tok):
    ids = tok.encode_chat("What is the capital of France? Answer in one word.")
    out = kvcourse.generate(model, ids, max_new_tokens=60)
    assert out[-1] == tok.eos_token_id and len(out) < 60
    assert "Paris" in tok.decode(out)


def test_capital_of_france(model, tok):
    out = kvcourse.generate(model, tok.encode("The capital of France is"), max_new_tokens=1)
    assert tok.decode(out) == " Paris"


def test_streaming_and_timings(model, tok):
    ids = tok.encode("Count: one, two, three,")
    streamed = list(kvcourse.stream_generate(model, ids, 8, eos_token_ids=()))
    timed = kvcourse.timed_generate(model, ids, 8, eos_token_ids=())
    assert streamed == timed.tokens == kvcourse.generate(model, ids, 8, eos_token_ids=())
    assert len(timed.step_times) == 8 and all(t > 0 for t in timed.step_times)


def test_generation_result_summaries():
    r = kvcourse.GenerationResult([5, 6, 7], [0.5, 0.1, 0.3])
    assert r.ttft == 0.5 and r.tpot == pytest.approx(0.2) and r.total == pytest.approx(0.9)
    assert math.isnan(kvcourse.GenerationResult([5], [0.4]).tpot)


@pytest.mark.parametrize(
    "kwargs, exc, word",
    [
        (dict(ids=[]), ValueError, "ids"),
        (dict(ids="hello"), TypeError, "ids"),
        (dict(ids=[1, 99999]), ValueError, "ids"),
        (dict(max_new_tokens=-1), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens must be an int >= 1"),
        (dict(sampling_params=kvcourse.SamplingParams(4), temperature=0.5), ValueError, "either sampling_params or"),
        (dict(max_new_tokens=None, sampling_params={"max_new_tokens": 4}), TypeError, "SamplingParams"),
        (dict(use_cache=False, cache=kvcourse.KVCache(1, 1, 1, 1)), ValueError, "use_cache=False"),
        (dict(cache=kvcourse.KVCache(1, 2, 1, 1)), ValueError, "batch_size=2"),
        (dict(cache="paged"), TypeError, "cache must be a KVCache, a PagedKVCache or None"),
        (dict(temperature=-0.5), ValueError, "temperature"),
        (dict(max_new_tokens=9000), ValueError, "context length"),
    ],
)
def test_generate_rejects_bad_input(model, kwargs, exc, word):
    args = dict(ids=[1, 2, 3], max_new_tokens=2) | kwargs
    with pytest.raises(exc, match=word):
        kvcourse.generate(model, **args)


def test_generate_continues_a_cache_it_is_given(model, tok):
    ids = tok.encode("Once upon a time, in a small village,")
    cache = kvcourse.KVCache.for_model(model.config)
    first = kvcourse.generate(model, ids, 5, eos_token_ids=(), cache=cache)
    assert cache.seq_len == len(ids) + 4  # the last token is not fed back
    more = kvcourse.generate(model, first[-1:], 5, eos_token_ids=(), cache=cache)  # carry on from it
    assert first + more == kvcourse.generate(model, ids, 10, eos_token_ids=())


def test_sampling_params_top_k_one_is_greedy_and_runs_are_reproducible(model, tok):
    ids = tok.encode("My favourite animal is")
    greedy = kvcourse.generate(model, ids, 8, eos_token_ids=())
    top1 = kvcourse.SamplingParams(max_new_tokens=8, temperature=1.5, top_k=1, seed=9, stop_token_ids=())
    assert kvcourse.generate(model, ids, sampling_params=top1) == greedy
    nucleus = kvcourse.SamplingParams(max_new_tokens=8, temperature=1.0, top_p=0.9, seed=5, stop_token_ids=())
    runs = [kvcourse.generate(model, ids, sampling_params=nucleus) for _ in range(2)]
    assert runs[0] == runs[1]
    paged = [
        kvcourse.generate(model, ids, sampling_params=nucleus, cache=PagedKVCache.for_model(model.config, 4))
        for _ in range(2)
    ]
    assert paged[0] == paged[1]
    # Across the two caches the logits agree to fp32's rounding; a sampled draw may still land on the other
    # side of a cumulative-probability boundary, so the paths are compared by their logits, not their samples.
    seq = torch.tensor([ids + runs[0]])
    cache = PagedKVCache.for_model(model.config, 4)
    assert_logits_close(
        model.forward_batch(cache.prepare(seq[0].tolist()), cache.kv_store, all_logits=True), model(seq)[0]
    )


def test_a_cache_returning_the_wrong_history_is_caught(model):
    class Forgetful(kvcourse.KVCache):
        """Stores, but reports no tokens: the model would put new tokens at position 0 again."""

        @property
        def seq_len(self):
            return 0

    cache = Forgetful.for_model(model.config)
    model(torch.tensor([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match=r"returned 4 keys, but the cache held seq_len=0"):
        model(torch.tensor([[4]]), cache=cache)


def test_model_rejects_bad_input(model):
    with pytest.raises(TypeError, match="input_ids"):
        model(torch.tensor([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="input_ids"):
        model(torch.tensor([1, 2]))


@pytest.mark.parametrize("shape", [(7, 32), (2, 5, 32), (0, 32)], ids=["rows", "batch", "empty"])
def test_linear_is_nn_linear_bit_for_bit(shape):
    # The model's Linear takes a shortcut for 2-D rows (torch.mm on the weight's transposed view): the same bits
    # as nn.Linear, the same state dict, the same repr; and it has no bias.
    from kvcourse.model import Linear

    torch.manual_seed(len(shape))
    ours, theirs = Linear(32, 24), torch.nn.Linear(32, 24, bias=False)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(shape)
    assert ours.bias is None and list(ours.state_dict()) == ["weight"]
    assert torch.equal(ours(x), theirs(x))
    assert repr(ours) == repr(theirs)
