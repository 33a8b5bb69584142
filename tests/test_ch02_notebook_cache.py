"""Chapter 2 builds a KV cache and a forward pass in the notebook; here they are taken from the notebook's JSON
and checked against the package: ``SimpleKVCache`` against ``kvcourse.KVCache``, ``forward_with_cache`` against
``LlamaModel``. If either drifts from the package, these tests fail."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import kvcourse
from kvcourse.model import apply_rope, rope_cos_sin

NOTEBOOK = Path(__file__).resolve().parents[1] / "book" / "02_kv_cache.ipynb"


def _notebook_code(starts_with: str) -> str:
    cells = json.loads(NOTEBOOK.read_text())["cells"]
    sources = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    found = [s for s in sources if s.lstrip().startswith(starts_with)]
    assert len(found) == 1, f"expected one code cell starting with {starts_with!r} in {NOTEBOOK.name}"
    return found[0]


@pytest.fixture(scope="module")
def SimpleKVCache():
    namespace = {"torch": torch}
    exec(_notebook_code("class SimpleKVCache"), namespace)
    return namespace["SimpleKVCache"]


@pytest.mark.parametrize("seed", range(5))
def test_notebook_cache_returns_what_kvcourse_cache_returns(SimpleKVCache, seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    layers, batch, heads, dim = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 4), rng.choice([2, 8, 64])
    ours = SimpleKVCache(layers)
    theirs = kvcourse.KVCache(layers, batch, heads, dim, initial_capacity=4)  # small: it must grow on the way
    chunks = [rng.randint(1, 9)] + [rng.choice([1, 1, 1, 3]) for _ in range(12)]
    for t in chunks:
        assert ours.seq_len == theirs.seq_len
        for layer in range(layers):
            k = torch.randn(batch, heads, t, dim, generator=gen)
            v = torch.randn(batch, heads, t, dim, generator=gen)
            got, want = ours.update(layer, k, v), theirs.update(layer, k, v)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert ours.seq_len == theirs.seq_len == sum(chunks)


def test_notebook_cache_runs_the_real_model_like_kvcourse_cache(model, tok, SimpleKVCache):
    cfg = model.config
    ids = tok.encode("The capital of France is")
    caches = SimpleKVCache(cfg.num_hidden_layers), kvcourse.KVCache.for_model(cfg)
    tokens = ([], [])
    for cache, out in zip(caches, tokens):
        step_input = ids
        for _ in range(8):
            out.append(int(model(torch.tensor([step_input]), cache=cache)[0, -1].argmax()))
            step_input = [out[-1]]
    assert tokens[0] == tokens[1] == kvcourse.generate(model, ids, 8, eos_token_ids=())
    ours, theirs = caches
    for layer in range(cfg.num_hidden_layers):
        assert torch.equal(ours.k[layer], theirs.keys(layer)) and torch.equal(ours.v[layer], theirs.values(layer))


def test_notebook_forward_pass_equals_the_model(model, tok, SimpleKVCache):
    cfg = model.config
    namespace = {
        "torch": torch,
        "F": F,
        "rope_cos_sin": rope_cos_sin,
        "apply_rope": apply_rope,
        "cfg": cfg,
        "D": cfg.head_dim,
        "Hq": cfg.num_attention_heads,
        "Hkv": cfg.num_key_value_heads,
    }
    exec(_notebook_code("@torch.inference_mode()\ndef forward_with_cache"), namespace)
    forward_with_cache = namespace["forward_with_cache"]
    ids = tok.encode("Once upon a time, in a small village,")
    ours, theirs = SimpleKVCache(cfg.num_hidden_layers), kvcourse.KVCache.for_model(cfg)
    assert len(ids) >= 7
    for chunk in (ids[:4], ids[4:-2], ids[-2:-1], ids[-1:]):  # a prefill in chunks, then single tokens
        got = forward_with_cache(model, chunk, ours, start_pos=ours.seq_len)
        want = model(torch.tensor([chunk]), cache=theirs)[0]
        assert (got - want).abs().max().item() < 1e-4
    assert ours.seq_len == theirs.seq_len == len(ids)
