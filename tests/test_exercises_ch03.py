"""Chapter 3's checks accept right answers and reject each typical wrong answer with its own hint.

The wrong answers are written the way a learner would write them, independently of the checks.
"""

from __future__ import annotations

import math

import pytest

from kvcourse.exercises import ExerciseError, ch03
from kvcourse.memory import CATALOG, kv_bytes_per_token, kv_cache_bytes


# ---- 1. bytes per token ------------------------------------------------------------------------
def per_token(config, nbytes):
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return 2 * config["num_hidden_layers"] * kv_heads * head_dim * nbytes


def test_bytes_per_token_accepts_right_answers(capsys):
    assert ch03.check_bytes_per_token(per_token)
    assert "Correct" in capsys.readouterr().out
    for seed in (1, 2):
        assert ch03.check_bytes_per_token(per_token, seed=seed)


def test_bytes_per_token_agrees_with_the_package():
    for name in ("llama-2-7b", "llama-3.1-70b", "gemma-2-9b", "smollm2-135m"):
        assert per_token(dict(CATALOG[name].config), 2) == kv_bytes_per_token(name, "bf16")


def _kv(c):
    return c.get("num_key_value_heads", c["num_attention_heads"])


def _dim(c):
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda c, b: c["num_hidden_layers"] * _kv(c) * _dim(c) * b, "factor 2"),
        (lambda c, b: 2 * c["num_hidden_layers"] * c["num_attention_heads"] * _dim(c) * b, "not the query heads"),
        (
            lambda c, b: 2 * c["num_hidden_layers"] * _kv(c) * (c["hidden_size"] // c["num_attention_heads"]) * b,
            "config\\['head_dim'\\]",
        ),
        (lambda c, b: 2 * c["num_hidden_layers"] * _kv(c) * _dim(c) * 2, "bytes_per_value"),
        (lambda c, b: 2 * _kv(c) * _dim(c) * b, "num_hidden_layers"),
        (lambda c, b: 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * _dim(c) * b, "multi-head attention"),
        (lambda c, b: 2 * c["num_hidden_layers"] * _kv(c) * c["head_dim"] * b, "hidden_size // num_attention_heads"),
        (lambda c, b: str(per_token(c, b)), "should return a number"),
        (lambda c, b: per_token(c, b) * 8, "2 \\(K and V\\) x layers"),
    ],
)
def test_bytes_per_token_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch03.check_bytes_per_token(wrong)


def test_bytes_per_token_refuses_the_package():
    with pytest.raises(ExerciseError, match="kvcourse's own kv_bytes_per_token"):
        ch03.check_bytes_per_token(kv_bytes_per_token)
    with pytest.raises(ExerciseError, match="calls kvcourse's"):
        ch03.check_bytes_per_token(lambda c, b: kv_bytes_per_token(c, "fp32") * b / 4)
    with pytest.raises(ExerciseError, match="function"):
        ch03.check_bytes_per_token(131072)


# ---- 2. bytes per tensor-parallel rank ----------------------------------------------------------
def per_rank(config, seq_len, tp_size, nbytes):
    layers = config["num_hidden_layers"]
    if "kv_lora_rank" in config:
        return layers * (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * seq_len * nbytes
    heads_here = max(1, config["num_key_value_heads"] // tp_size)
    return 2 * layers * heads_here * config["head_dim"] * seq_len * nbytes


def test_bytes_per_rank_accepts_right_answers():
    assert ch03.check_bytes_per_rank(per_rank)
    assert ch03.check_bytes_per_rank(per_rank, seed=3)


def test_bytes_per_rank_agrees_with_the_package():
    for name, tp in (("llama-3.1-70b", 16), ("llama-3.1-70b", 4), ("deepseek-v3", 8)):
        cfg = dict(CATALOG[name].config)
        cfg.setdefault("head_dim", 128)
        assert per_rank(cfg, 131072, tp, 2) == kv_cache_bytes(name, 131072, dtype="bf16", tp_size=tp)


def _mla(c):
    return "kv_lora_rank" in c


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        # MLA read as GQA: DeepSeek's config says num_key_value_heads = 128 and has no head_dim
        (
            lambda c, s, t, b: (
                2
                * c["num_hidden_layers"]
                * max(1, c["num_key_value_heads"] // t)
                * c.get("head_dim", c["hidden_size"] // c["num_attention_heads"])
                * s
                * b
            ),
            "MLA caches no per-head",
        ),
        (
            lambda c, s, t, b: (
                c["num_hidden_layers"]
                * (c["num_attention_heads"] // t)
                * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"] + c["v_head_dim"])
                * s
                * b
                if _mla(c)
                else per_rank(c, s, t, b)
            ),
            "decompressed",
        ),
        (lambda c, s, t, b: 2 * per_rank(c, s, t, b) if _mla(c) else per_rank(c, s, t, b), "not a K and a V"),
        (
            lambda c, s, t, b: c["num_hidden_layers"] * c["kv_lora_rank"] * s * b if _mla(c) else per_rank(c, s, t, b),
            "shared RoPE key",
        ),
        (lambda c, s, t, b: per_rank(c, s, 1, b) / t, "replicated"),
        (lambda c, s, t, b: per_rank(c, s, t, b) / t if _mla(c) else per_rank(c, s, t, b), "every rank stores all"),
        (lambda c, s, t, b: per_rank(c, s, t, b) / 2 if not _mla(c) else per_rank(c, s, t, b), "factor 2"),
        (
            lambda c, s, t, b: (
                2 * c["num_hidden_layers"] * max(1, c["num_attention_heads"] // t) * c["head_dim"] * s * b
                if not _mla(c)
                else per_rank(c, s, t, b)
            ),
            "not the query heads",
        ),
        (lambda c, s, t, b: per_rank(c, 1, t, b), "multiply by seq_len"),
        (lambda c, s, t, b: None, "should return a number"),
        (lambda c, s, t, b: per_rank(c, s, t, b) + 1, "GQA: 2 x layers"),
    ],
)
def test_bytes_per_rank_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch03.check_bytes_per_rank(wrong)


def test_bytes_per_rank_refuses_the_package():
    with pytest.raises(ExerciseError, match="calls kvcourse's kv_cache_bytes"):
        ch03.check_bytes_per_rank(lambda c, s, t, b: kv_cache_bytes(c, s, dtype="fp32", tp_size=t) * b / 4)


# ---- 3. a KIVI-style quantized cache ------------------------------------------------------------
def kivi_bytes(config, seq_len, bits, group_size, residual_len):
    values_per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"]
    recent = min(seq_len, residual_len)
    old = seq_len - recent
    quantized = old * values_per_token * bits / 8
    scales_and_zeros = old * values_per_token // group_size * (2 + 2)
    return quantized + scales_and_zeros + recent * values_per_token * 2


def test_quantized_bytes_accepts_right_answers():
    assert ch03.check_quantized_bytes(kivi_bytes)
    assert ch03.check_quantized_bytes(kivi_bytes, seed=5)


def test_quantized_bytes_without_window_is_the_package_formula():
    # With no fp16 window, the package's per-group count (scale and zero point per group) gives the same bytes.
    cfg = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}
    assert kivi_bytes(cfg, 4096, 4, 32, 0) == kv_cache_bytes(
        cfg | {"num_attention_heads": 32}, 4096, dtype="int4", quant_group_size=32
    )
    # int4 in groups of 32: the scales and zero points add a quarter to the payload, not an eighth
    payload = kv_cache_bytes(cfg | {"num_attention_heads": 32}, 4096, dtype="int4")
    assert kivi_bytes(cfg, 4096, 4, 32, 0) == payload * 5 // 4


def _vals(c):
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"]


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        # one fp16 scale per group, no zero point (symmetric quantization)
        (
            lambda c, s, bits, g, r: _vals(c) * ((s - min(s, r)) * (bits / 8 + 2 / g) + min(s, r) * 2),
            "AND a zero point",
        ),
        (lambda c, s, bits, g, r: _vals(c) * s * (bits / 8 + 4 / g), "stay in fp16"),
        (lambda c, s, bits, g, r: _vals(c) * (s * (bits / 8 + 4 / g) + min(s, r) * 2), "not also stored quantized"),
        (lambda c, s, bits, g, r: _vals(c) * ((s - min(s, r)) * (bits + 4 / g) + min(s, r) * 2), "bits / 8 bytes"),
        (
            lambda c, s, bits, g, r: _vals(c) * ((s - min(s, r)) * (bits / 8 + 4 / c["head_dim"]) + min(s, r) * 2),
            "not one per head vector",
        ),
        (
            lambda c, s, bits, g, r: _vals(c) * ((s - min(s, r)) * (bits / 8 + 4 / g) + min(s, r) * 4),
            "2 bytes per value",
        ),
        (lambda c, s, bits, g, r: kivi_bytes(c, s, bits, g, r) / 2, "factor 2"),
        (lambda c, s, bits, g, r: kivi_bytes(c, s, bits, g, r) * 1.5, "two kinds of token separately"),
    ],
)
def test_quantized_bytes_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch03.check_quantized_bytes(wrong)


# ---- 4. sequences on one GPU --------------------------------------------------------------------
def max_sequences(c, num_parameters, seq_len, gpu_bytes, weight_bytes_per_value, kv_bytes_per_value, utilization=0.9):
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_seq = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * seq_len * kv_bytes_per_value
    budget = utilization * gpu_bytes - num_parameters * weight_bytes_per_value
    return max(0, math.floor(budget / per_seq))


@pytest.mark.parametrize("seed", [0, 1, 5])
def test_max_sequences_accepts_the_right_function(seed):
    assert ch03.check_max_sequences(max_sequences, seed=seed)


def test_max_sequences_answers_the_chapters_question():
    # Written out: Qwen2.5-7B caches 2 x 28 layers x 4 KV heads x 128 values per token, 1 byte each in fp8.
    per_seq = 2 * 28 * 4 * 128 * 32768
    assert math.floor((0.9 * 80e9 - 2 * 7_615_616_512) / per_seq) == 60
    qwen = CATALOG["qwen2.5-7b"]
    assert max_sequences(dict(qwen.config), qwen.num_parameters, 32768, 80e9, 2, 1) == 60
    assert "60 sequences" in str(ch03.check_max_sequences(max_sequences))


def _variant(**mistake):
    def fn(c, num_parameters, seq_len, gpu_bytes, w, k, u):
        w = k if mistake.get("weights_at_kv") else w
        k = w if mistake.get("kv_at_weights") else k
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        per_seq = mistake.get("kv", 2) * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * seq_len * k
        weights = num_parameters * w
        budget = u * (gpu_bytes - weights) if mistake.get("left") else u * gpu_bytes - weights
        n = (math.ceil if mistake.get("ceil") else math.floor)(budget / per_seq)
        return n if mistake.get("negative") else max(0, n)

    return fn


@pytest.mark.parametrize(
    ("fn", "hint"),
    [
        (_variant(weights_at_kv=True), "their own dtypes"),
        (_variant(kv_at_weights=True), "fp8: 1"),
        (_variant(left=True), "come out of that share"),
        (_variant(ceil=True), "Round down"),
        (_variant(kv=1), "factor 2"),
        (_variant(negative=True), "not a negative count"),
        (lambda *a: 60, "Budget ="),
        (lambda *a: "60", "should return an int"),
        (lambda *a: None, "should return an int"),
        (60, "pass your function"),
    ],
)
def test_max_sequences_rejects_typical_mistakes_with_their_hint(fn, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch03.check_max_sequences(fn)


def test_max_sequences_refuses_the_packages_calculator():
    def wrapped(c, num_parameters, seq_len, gpu_bytes, w, k, u):
        name = next(n for n, e in CATALOG.items() if dict(e.config) == c)
        return int((u * gpu_bytes - num_parameters * w) // (kv_cache_bytes(name, seq_len, dtype="fp8") * k))

    with pytest.raises(ExerciseError, match="count the bytes yourself"):
        ch03.check_max_sequences(wrapped)


def test_no_reference_answers_are_public():
    for name in dir(ch03):
        obj = getattr(ch03, name)
        if callable(obj) and getattr(obj, "__module__", "") == ch03.__name__ and not name.startswith("_"):
            assert name.startswith("check_"), f"ch03.{name} is public but not a check"


def test_student_copy_fails_every_check_with_its_label(capsys):
    """The chapter's student copy: each exercise's stub reaches its check, which fails saying it is not written."""
    import json
    from pathlib import Path

    from kvcourse.instructor import find_exercises, student_copy
    from kvcourse.instructor.notebook import cell_source

    chapter = Path(__file__).resolve().parents[1] / "book" / "03_memory.ipynb"
    student = student_copy(json.loads(chapter.read_text()))
    exercises = find_exercises(student)
    assert len(exercises) >= 4
    for exercise in exercises:
        namespace = {"ch03": ch03, "CATALOG": CATALOG, "kv_cache_bytes": kv_cache_bytes}
        for i in exercise.code_cells:
            exec(cell_source(student["cells"][i]), namespace)  # nothing raises: "Run all" goes on
        said = capsys.readouterr().out
        assert "Not done yet" in said and "Correct" not in said, (exercise.label, said)
        stub = cell_source(student["cells"][exercise.code_cells[-1]])
        assert exercise.label in said or f"= NotImplemented  # {exercise.label}" in stub, (exercise.label, said)


# --- exercise 5: the longest context for n users --------------------------------------------------
def right_context(c, num_parameters, n, gpu_bytes, w, k, u):
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * k
    return max(0, int((u * gpu_bytes - num_parameters * w) // (n * per_token)))


def test_max_context_accepts_the_right_answer(capsys):
    assert ch03.check_max_context(right_context)
    assert "6,668 tokens" in capsys.readouterr().out


def test_max_context_is_the_calculators_inverse():
    # the longest context for 64 users is the one at which kvcourse.memory still fits 64, and one token more does not
    from kvcourse.memory import CATALOG, GB, max_concurrent_sequences

    entry = CATALOG["llama-3-8b"]
    t = right_context(dict(entry.config), entry.num_parameters, 64, 80 * GB, 2, 2, 0.9)
    assert max_concurrent_sequences("llama-3-8b", 80 * GB, t, gpu_memory_utilization=0.9) >= 64
    assert max_concurrent_sequences("llama-3-8b", 80 * GB, t + 1, gpu_memory_utilization=0.9) < 64


def _per_token(c, k, kv=2):
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return kv * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * k


@pytest.mark.parametrize(
    ("wrong", "hint"),
    [
        (lambda c, p, n, g, w, k, u: max(0, int((u * g - p * w) // _per_token(c, k))), "shared"),
        (lambda c, p, n, g, w, k, u: max(0, int((u * g - p * k) // (n * _per_token(c, k)))), "own dtypes"),
        (lambda c, p, n, g, w, k, u: max(0, int(u * (g - p * w) // (n * _per_token(c, k)))), "come out of that share"),
        (lambda c, p, n, g, w, k, u: max(0, int((u * g - p * w) // (n * _per_token(c, k, kv=1)))), "factor 2"),
        (lambda c, p, n, g, w, k, u: max(0, math.ceil((u * g - p * w) / (n * _per_token(c, k)))), "Round down"),
        (lambda c, p, n, g, w, k, u: int(u * g // (n * _per_token(c, k))), "loaded first"),
    ],
)
def test_max_context_rejects_wrong_answers_with_their_hint(wrong, hint):
    with pytest.raises(ExerciseError, match=hint):
        ch03.check_max_context(wrong)


def test_max_context_refuses_the_calculator():
    from kvcourse.memory import GB, kv_bytes_per_token

    def through_memory(c, p, n, g, w, k, u):
        return int((u * g - p * w) // (n * kv_bytes_per_token(c, "bf16")))

    with pytest.raises(ExerciseError, match="kv_bytes_per_token"):
        ch03.check_max_context(through_memory)
