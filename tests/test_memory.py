"""kvcourse.memory: the KV cache bill for every config layout, checked against hand counts and real caches."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcourse
from kvcourse.memory import (
    CATALOG,
    GiB,
    catalog_names,
    format_bytes,
    kv_budget_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_layout,
    load_config,
    max_concurrent_sequences,
    weight_bytes,
)
from kvcourse.memory.__main__ import main as cli_main
from kvcourse.memory.config import INT_FIELDS

LLAMA3_8B = dict(CATALOG["llama-3-8b"].config)
GPT2 = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768, "n_positions": 1024}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite config.json: 27 layers, 16 heads, kv_lora_rank 512, rope 64
    "model_type": "deepseek_v2",
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "hidden_size": 2048,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "q_lora_rank": None,
}


# ---- each layout, against a count by hand --------------------------------------------------
def test_seed_llama3_8b_figures():
    assert kv_bytes_per_token("llama-3-8b") == 32 * 2 * 8 * 128 * 2 == 128 * 1024
    assert kv_cache_bytes("llama-3-8b", 8192, batch_size=64) == 64 * GiB


def test_mha_is_kv_heads_equal_to_query_heads():
    layout = kv_layout("llama-2-7b")
    assert (layout.attention, layout.num_kv_heads, layout.head_dim) == ("MHA", 32, 128)
    assert kv_bytes_per_token("llama-2-7b", "fp16") == 2 * 32 * 32 * 128 * 2 == 524_288


def test_mha_without_kv_key_defaults_to_query_heads():
    cfg = {"num_hidden_layers": 4, "num_attention_heads": 8, "hidden_size": 512}
    assert kv_bytes_per_token(cfg, "fp32") == 2 * 4 * 8 * 64 * 4


def test_gqa_counts_kv_heads_not_query_heads():
    assert kv_layout("llama-2-70b").attention == "GQA"
    assert kv_bytes_per_token("llama-2-70b") == 2 * 80 * 8 * 128 * 2 == 327_680
    assert kv_bytes_per_token("qwen2.5-7b") == 2 * 28 * 4 * 128 * 2


def test_mqa_falcon_multi_query_flag():
    layout = kv_layout("falcon-7b")
    assert (layout.attention, layout.num_kv_heads, layout.head_dim) == ("MQA", 1, 4544 // 71)
    assert kv_bytes_per_token("falcon-7b") == 2 * 32 * 1 * 64 * 2 == 8192
    # Without the flag the same shape is multi-head: 71 times bigger.
    mha = {**CATALOG["falcon-7b"].config, "multi_query": False}
    assert kv_bytes_per_token(mha) == 71 * 8192


def test_falcon_new_decoder_architecture_uses_num_kv_heads():
    falcon40 = {
        "model_type": "falcon",
        "num_hidden_layers": 60,
        "hidden_size": 8192,
        "num_attention_heads": 128,
        "num_kv_heads": 8,
        "multi_query": True,
        "new_decoder_architecture": True,
    }
    assert kv_bytes_per_token(falcon40) == 2 * 60 * 8 * 64 * 2


def test_gpt_bigcode_legacy_keys_with_multi_query():
    starcoder = {"n_layer": 40, "n_head": 48, "n_embd": 6144, "multi_query": True}
    assert kv_bytes_per_token(starcoder) == 2 * 40 * 1 * 128 * 2


def test_explicit_head_dim_gemma():
    layout = kv_layout("gemma-2-9b")
    assert layout.head_dim == 256 and 16 * 256 != 3584
    assert kv_bytes_per_token("gemma-2-9b") == 2 * 42 * 8 * 256 * 2
    # Deriving head_dim from hidden / heads (224) would undercount by 256/224.
    derived = {k: v for k, v in CATALOG["gemma-2-9b"].config.items() if k != "head_dim"}
    assert kv_bytes_per_token(derived) == 2 * 42 * 8 * 224 * 2


def test_null_head_dim_falls_back_to_hidden_over_heads():
    assert kv_bytes_per_token({**LLAMA3_8B, "head_dim": None}) == kv_bytes_per_token(LLAMA3_8B)


def test_legacy_gpt2_keys():
    layout = kv_layout(GPT2)
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.attention) == (12, 12, 64, "MHA")
    assert kv_bytes_per_token(GPT2, "fp16") == 2 * 12 * 12 * 64 * 2 == 36_864


def test_mla_caches_latent_plus_rope_key():
    layout = kv_layout("deepseek-v3")
    assert layout.attention == "MLA" and layout.values_per_layer == 512 + 64
    assert kv_bytes_per_token("deepseek-v3") == 61 * (512 + 64) * 2 == 70_272
    # Not K and V per head: that would be 128 heads x (192 + 128) values per layer, 71x more.
    per_head = 61 * 128 * ((128 + 64) + 128) * 2
    assert per_head / kv_bytes_per_token("deepseek-v3") > 70
    assert kv_bytes_per_token(DEEPSEEK_V2_LITE, "fp16") == 27 * 576 * 2
    assert kv_cache_bytes("deepseek-v3", 1000, batch_size=3) == 3 * 1000 * 70_272


def test_mla_missing_rope_width_is_an_error():
    bad = {k: v for k, v in DEEPSEEK_V2_LITE.items() if k != "qk_rope_head_dim"}
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        kv_bytes_per_token(bad)


# ---- sliding windows ---------------------------------------------------------------------------
def test_model_wide_sliding_window_caps_every_layer():
    per_token = kv_bytes_per_token("mistral-7b")
    assert kv_layout("mistral-7b").num_windowed_layers == 32
    assert kv_cache_bytes("mistral-7b", 1000) == 1000 * per_token
    assert kv_cache_bytes("mistral-7b", 4096) == kv_cache_bytes("mistral-7b", 32768) == 4096 * per_token
    no_window = {**CATALOG["mistral-7b"].config, "sliding_window": None}
    assert kv_cache_bytes(no_window, 32768) == 32768 * per_token


def test_layer_types_cap_only_sliding_layers():
    per_layer = 2 * 8 * 256 * 2
    assert kv_cache_bytes("gemma-2-9b", 8192) == (21 * 8192 + 21 * 4096) * per_layer
    assert kv_cache_bytes("gemma-2-9b", 2048) == 42 * 2048 * per_layer


def test_gemma2_without_layer_types_alternates():
    original = {k: v for k, v in CATALOG["gemma-2-9b"].config.items() if k != "layer_types"}
    assert kv_layout(original).layer_windows == kv_layout("gemma-2-9b").layer_windows
    assert kv_layout(original).layer_windows[:2] == (4096, None)


def test_sliding_window_pattern_gemma3_style():
    cfg = {
        "num_hidden_layers": 12,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 64,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    }
    windows = kv_layout(cfg).layer_windows
    assert windows.count(None) == 2 and windows[5] is None and windows[11] is None


def test_use_sliding_window_false_is_honoured():
    qwen = dict(CATALOG["qwen2.5-7b"].config)
    small_window = {**qwen, "sliding_window": 4096}
    assert kv_cache_bytes(small_window, 32768) == 32768 * kv_bytes_per_token(qwen)
    # Switched on, Qwen2 windows the layers from max_window_layers on.
    on = {**small_window, "use_sliding_window": True, "max_window_layers": 14}
    per_layer = 2 * 4 * 128 * 2
    assert kv_cache_bytes(on, 32768) == (14 * 32768 + 14 * 4096) * per_layer
    # use_sliding_window: false also overrides layer_types.
    forced = {**small_window, "layer_types": ["sliding_attention"] * 28}
    assert kv_cache_bytes(forced, 32768) == 32768 * kv_bytes_per_token(qwen)


def test_chunked_attention_layers_use_chunk_size():
    cfg = {**LLAMA3_8B, "layer_types": ["chunked_attention", "full_attention"] * 16, "attention_chunk_size": 8192}
    assert kv_cache_bytes(cfg, 100_000) == (16 * 100_000 + 16 * 8192) * 2 * 8 * 128 * 2


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"layer_types": ["sliding_attention"] * 3}, "one entry per layer"),
        ({"layer_types": ["linear_attention"] * 32, "sliding_window": 10}, "not supported"),
        ({"layer_types": ["sliding_attention"] * 32}, "sliding_window is null"),
        ({"sliding_window": -5}, "sliding_window"),
    ],
)
def test_bad_window_configs(patch, match):
    with pytest.raises(ValueError, match=match):
        kv_cache_bytes({**LLAMA3_8B, **patch}, 10)


# ---- dtypes and quantization scales ------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, factor", [("fp32", 2), ("bf16", 1), ("fp16", 1), ("fp8", 0.5), ("int8", 0.5), ("int4", 0.25)]
)
def test_dtype_scales_bytes(dtype, factor):
    assert kv_cache_bytes("llama-3-8b", 8192, 64, dtype) == factor * 64 * GiB


def test_torch_dtypes_and_aliases_accepted():
    assert kv_bytes_per_token("llama-3-8b", torch.float32) == kv_bytes_per_token("llama-3-8b", "float32") == 262_144
    assert kv_bytes_per_token("llama-3-8b", torch.bfloat16) == kv_bytes_per_token("llama-3-8b", "bfloat16")


def test_unknown_dtype_is_named():
    with pytest.raises(ValueError, match="dtype"):
        kv_bytes_per_token("llama-3-8b", "fp12")


def test_quantization_scales_counted_per_group():
    # int4, an fp16 scale and an fp16 zero point per 32 values: a 128-value head vector is 64 B of payload
    # + 4 groups x 4 B, a quarter more.
    assert kv_bytes_per_token("llama-3-8b", "int4", quant_group_size=32) == 32 * 2 * 8 * (64 + 16)
    assert kv_bytes_per_token("llama-3-8b", "int4") == 32 * 2 * 8 * 64
    with pytest.raises(ValueError, match="quant_group_size"):
        kv_bytes_per_token("llama-3-8b", "bf16", quant_group_size=32)
    with pytest.raises(ValueError, match="quant_group_size"):
        kv_bytes_per_token("llama-3-8b", "int8", quant_group_size=0)


# ---- tensor parallelism ------------------------------------------------------------------------
def test_tp_splits_kv_heads():
    full = kv_cache_bytes("llama-3-8b", 8192, 64)
    assert kv_cache_bytes("llama-3-8b", 8192, 64, tp_size=2) == full // 2
    assert kv_cache_bytes("llama-3-8b", 8192, 64, tp_size=8) == full // 8
    assert kv_layout("llama-3-8b").kv_heads_per_rank(8) == 1


def test_tp_beyond_kv_heads_replicates():
    # 16 ranks, 8 KV heads: each head lives on two ranks, so per-rank bytes stop falling at tp=8.
    assert kv_cache_bytes("llama-3-8b", 8192, tp_size=16) == kv_cache_bytes("llama-3-8b", 8192, tp_size=8)
    assert kv_cache_bytes("falcon-7b", 100, tp_size=71) == kv_cache_bytes("falcon-7b", 100)


def test_tp_mla_latent_is_replicated():
    assert kv_cache_bytes("deepseek-v3", 4096, tp_size=8) == kv_cache_bytes("deepseek-v3", 4096)


@pytest.mark.parametrize("model, tp", [("llama-3-8b", 3), ("falcon-7b", 2), ("llama-3-8b", 0), ("llama-3-8b", 64)])
def test_tp_that_cannot_shard_is_an_error(model, tp):
    with pytest.raises(ValueError, match="tp_size"):
        kv_cache_bytes(model, 10, tp_size=tp)


# ---- bad input ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cfg, match",
    [
        ({"num_attention_heads": 8, "hidden_size": 512}, "layer count"),
        ({"num_hidden_layers": 4, "hidden_size": 512}, "attention head count"),
        ({"num_hidden_layers": 4, "num_attention_heads": 8}, "hidden size"),
        ({"num_hidden_layers": 0, "num_attention_heads": 8, "hidden_size": 512}, "num_hidden_layers"),
        ({"num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 3, "hidden_size": 512}, "divide"),
        ({"num_hidden_layers": 4, "num_attention_heads": 6, "hidden_size": 512}, "divisible"),
    ],
)
def test_bad_configs_name_the_problem(cfg, match):
    with pytest.raises(ValueError, match=match):
        kv_bytes_per_token(cfg)


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="seq_len"):
        kv_cache_bytes("llama-3-8b", -1)
    with pytest.raises(TypeError, match="seq_len must be an int >= 0, got float"):
        kv_cache_bytes("llama-3-8b", 1.5)
    with pytest.raises(ValueError, match="batch_size"):
        kv_cache_bytes("llama-3-8b", 10, batch_size=0)
    with pytest.raises(ValueError, match="catalog name"):
        kv_cache_bytes("llama-9-1b", 10)
    with pytest.raises(TypeError, match="config"):
        kv_cache_bytes(42, 10)
    assert kv_cache_bytes("llama-3-8b", 0) == 0


def test_config_from_path_and_text_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA3_8B))
    assert kv_bytes_per_token(path) == kv_bytes_per_token(str(path)) == 131_072
    wrapped = {"model_type": "llava", "text_config": LLAMA3_8B}
    assert kv_bytes_per_token(wrapped) == 131_072
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config(bad)


def test_llama_config_object_accepted(model):
    assert kv_bytes_per_token(model.config, "fp32") == kv_bytes_per_token(model.config.to_dict(), "fp32")


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 100),
    kv=st.sampled_from([1, 2, 4, 8]),
    group=st.integers(1, 8),
    head_dim=st.sampled_from([32, 64, 96, 128, 256]),
    seq=st.integers(0, 10**6),
    batch=st.integers(1, 256),
)
def test_formula_is_the_product(layers, kv, group, head_dim, seq, batch):
    cfg = {
        "num_hidden_layers": layers,
        "num_attention_heads": kv * group,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
    }
    assert kv_cache_bytes(cfg, seq, batch, "fp16") == 2 * layers * kv * head_dim * seq * batch * 2
    assert kv_cache_bytes(cfg, seq, batch, "int4") * 4 == kv_cache_bytes(cfg, seq, batch, "fp16")


@settings(max_examples=40, deadline=None)
@given(seq=st.integers(0, 200_000), extra=st.integers(1, 10_000))
def test_windowed_cache_never_shrinks_and_is_bounded(seq, extra):
    for name in ("gemma-2-9b", "mistral-7b"):
        a, b = kv_cache_bytes(name, seq), kv_cache_bytes(name, seq + extra)
        assert a <= b <= kv_cache_bytes(name, seq) + extra * kv_bytes_per_token(name)
    assert kv_cache_bytes("mistral-7b", seq) <= 4096 * kv_bytes_per_token("mistral-7b")


# ---- the catalog -------------------------------------------------------------------------------
def test_catalog_names_are_exact():
    assert catalog_names() == [
        "smollm2-135m",
        "llama-2-7b",
        "llama-2-70b",
        "llama-3-8b",
        "llama-3-70b",
        "llama-3.1-70b",
        "mistral-7b",
        "qwen2.5-7b",
        "gemma-2-9b",
        "falcon-7b",
        "deepseek-v3",
    ]
    for entry in CATALOG.values():
        assert "/" in entry.hf_repo and entry.parameters_source and entry.num_parameters > 10**8


def _dense_parameters(cfg) -> int:
    """Parameter count of a dense decoder from its config.json shapes (Llama/Mistral/Qwen2/Gemma2/Falcon)."""
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    layout = kv_layout(dict(cfg))
    q_out = layout.num_attention_heads * layout.head_dim
    kv_out = layout.num_kv_heads * layout.head_dim
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings") else 2)
    if cfg["model_type"] == "falcon":  # fused QKV, 4h GELU MLP, one LayerNorm (weight + bias) per layer
        per_layer = h * (q_out + 2 * kv_out) + q_out * h + 2 * h * 4 * h + 2 * h
        return embed + layers * per_layer + 2 * h
    attn = h * q_out + 2 * h * kv_out + q_out * h
    if cfg["model_type"] == "qwen2":
        attn += q_out + 2 * kv_out  # q/k/v biases
    norms = (4 if cfg["model_type"] == "gemma2" else 2) * h
    per_layer = attn + 3 * h * cfg["intermediate_size"] + norms
    return embed + layers * per_layer + h


@pytest.mark.parametrize("name", [n for n in catalog_names() if n != "deepseek-v3"])
def test_catalog_parameter_counts_match_config_shapes(name):
    assert CATALOG[name].num_parameters == _dense_parameters(CATALOG[name].config)


def test_smollm2_catalog_entry_matches_the_loaded_model(model):
    cfg = model.config.to_dict()
    for key, value in CATALOG["smollm2-135m"].config.items():
        assert cfg[key] == value, key
    assert sum(p.numel() for p in model.parameters()) == CATALOG["smollm2-135m"].num_parameters
    assert kv_bytes_per_token("smollm2-135m", "fp32") == kv_bytes_per_token(cfg, "fp32") == 30 * 2 * 3 * 64 * 4


def test_weight_bytes_and_gpu_fit():
    assert weight_bytes("llama-3-8b") == 2 * 8_030_261_248
    assert weight_bytes("llama-3-70b", "fp16", tp_size=4) == 70_553_706_496 // 2
    with pytest.raises(ValueError, match="catalog name"):
        weight_bytes({"num_hidden_layers": 2})
    # 80 GB, Llama-3-8B bf16 weights 16.06 GB: 63.94 GB left, 1.07 GB per 8k sequence -> 59.
    n = max_concurrent_sequences("llama-3-8b", 80 * 10**9, 8192)
    assert n == (80 * 10**9 - weight_bytes("llama-3-8b")) // kv_cache_bytes("llama-3-8b", 8192) == 59
    assert max_concurrent_sequences("llama-3-70b", 80 * 10**9, 8192) == 0  # 141 GB of weights do not fit
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        max_concurrent_sequences("llama-3-8b", 80 * 10**9, 8192, gpu_memory_utilization=1.5)


def test_kv_budget_is_what_the_weights_leave():
    # Qwen2.5-7B in bf16: 15.23 GB of weights; vLLM's 90% of an 80 GB GPU is 72 GB, so 56.77 GB are left.
    assert kv_budget_bytes("qwen2.5-7b", 80 * 10**9, gpu_memory_utilization=0.9) == 72 * 10**9 - 2 * 7_615_616_512
    assert kv_budget_bytes("qwen2.5-7b", 80 * 10**9, "int8") == 80 * 10**9 - 7_615_616_512  # 1-byte weights
    assert kv_budget_bytes("llama-3-70b", 80 * 10**9) == 0  # the weights alone overflow the GPU
    # The sequences that fit are the budget over one sequence's cache, rounded down: 966 of 1k, 30 of 32k.
    for seq_len, fit in ((1024, 966), (32768, 30)):
        per_seq = kv_cache_bytes("qwen2.5-7b", seq_len)
        assert per_seq == seq_len * 28 * 2 * 4 * 128 * 2
        budget = kv_budget_bytes("qwen2.5-7b", 80 * 10**9, gpu_memory_utilization=0.9)
        assert max_concurrent_sequences("qwen2.5-7b", 80 * 10**9, seq_len, gpu_memory_utilization=0.9) == fit
        assert fit * per_seq <= budget < (fit + 1) * per_seq
    # An int8 cache with an fp16 scale and zero point per 128-value vector: 132 bytes where bf16 takes 256.
    int8_per_seq = 32768 * 28 * 2 * 4 * (128 + 4)
    assert kv_cache_bytes("qwen2.5-7b", 32768, dtype="int8", quant_group_size=128) == int8_per_seq
    budget = kv_budget_bytes("qwen2.5-7b", 80 * 10**9, "bf16", gpu_memory_utilization=0.9)
    assert (
        max_concurrent_sequences(
            "qwen2.5-7b",
            80 * 10**9,
            32768,
            "int8",
            weight_dtype="bf16",
            gpu_memory_utilization=0.9,
            quant_group_size=128,
        )
        == budget // int8_per_seq
        == 58
    )
    with pytest.raises(ValueError, match="quant_group_size"):
        max_concurrent_sequences("qwen2.5-7b", 80 * 10**9, 32768, "bf16", quant_group_size=128)
    for bad, exc in ((0, ValueError), (-1, ValueError), (True, TypeError), ("80GB", TypeError)):
        with pytest.raises(exc, match="gpu_bytes"):
            kv_budget_bytes("qwen2.5-7b", bad)
    for bad, exc in ((0, ValueError), (1.5, ValueError), (True, TypeError), ("0.9", TypeError)):
        with pytest.raises(exc, match="gpu_memory_utilization"):
            kv_budget_bytes("qwen2.5-7b", 80 * 10**9, gpu_memory_utilization=bad)


def test_format_bytes_shows_both_units():
    assert format_bytes(64 * GiB) == "68.72 GB (64.00 GiB)"
    assert format_bytes(131_072) == "131.07 kB (128.00 KiB)"
    assert format_bytes(12) == "12 B"
    with pytest.raises(ValueError, match="bytes"):
        format_bytes(-1)


# ---- the CLI -----------------------------------------------------------------------------------
def test_cli_accepts_every_dtype_spelling_the_api_accepts_and_warns_past_the_context(capsys):
    assert cli_main(["--model", "llama-3-8b", "--seq-len", "1000", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr()
    assert "dtype                bf16" in out.out and out.err == ""
    assert cli_main(["--model", "llama-3-8b", "--seq-len", "100000", "--dtype", "torch.float16"]) == 0
    out = capsys.readouterr()
    assert "beyond the model's context length (8,192 positions" in out.err


def test_cli_catalog_model(capsys):
    assert (
        cli_main(
            ["--model", "llama-3-8b", "--seq-len", "8192", "--batch-size", "64", "--dtype", "bf16", "--tp-size", "1"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "68,719,476,736 B = 68.72 GB (64.00 GiB)" in out and "131,072 B" in out and "GQA" in out


def test_cli_config_path(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GPT2))
    assert cli_main(["--config", str(path), "--seq-len", "1024", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out
    assert f"{36_864 * 1024:,} B" in out and "MHA" in out


def test_cli_errors_and_help(capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["--help"])
    assert e.value.code == 0 and "--seq-len" in capsys.readouterr().out
    for argv in (
        ["--model", "gpt-5"],
        ["--model", "llama-3-8b", "--seq-len", "-3"],
        ["--model", "llama-3-8b", "--tp-size", "3"],
        [],
    ):
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        assert e.value.code == 2
    assert "tp_size=3" in capsys.readouterr().err


def test_cli_list(capsys):
    assert cli_main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in catalog_names()) and "deepseek-ai/DeepSeek-V3" in out


# ---- against reality: our running cache and Hugging Face's DynamicCache -------------------------
PROMPT = "The capital of France is"
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def our_run(model, tok):
    ids = tok.encode(PROMPT)
    cache = kvcourse.KVCache.for_model(model.config)
    new = kvcourse.generate(model, ids, NEW_TOKENS, cache=cache)
    return ids, new, cache


def test_formula_equals_our_running_cache(model, our_run):
    ids, new, cache = our_run
    assert len(ids) == 5 and len(new) == NEW_TOKENS
    # The last generated token is never fed back: 5 + 6 - 1 = 10 cached positions. By hand:
    # 10 tokens x 30 layers x (K and V) x 3 KV heads x 64 values x 4 bytes (fp32) = 460,800 bytes.
    assert cache.seq_len == 10
    assert cache.nbytes == 460_800
    assert sum(cache.keys(i).numel() + cache.values(i).numel() for i in range(30)) * 4 == 460_800
    assert kv_cache_bytes(model.config.to_dict(), cache.seq_len, dtype="fp32") == 460_800
    assert kv_cache_bytes("smollm2-135m", cache.seq_len, dtype="fp32") == 460_800


def test_formula_equals_our_batched_bf16_cache(model):
    cache = kvcourse.KVCache.for_model(model.config, batch_size=3, dtype=torch.bfloat16)
    k = torch.zeros(3, 3, 7, 64, dtype=torch.bfloat16)
    for layer in range(model.config.num_hidden_layers):
        cache.update(layer, k, k)
    assert cache.nbytes == kv_cache_bytes(model.config, 7, batch_size=3, dtype="bf16")


def test_formula_equals_hf_dynamic_cache(hf_model, our_run):
    """Hugging Face generates the same tokens and its DynamicCache holds exactly the formula's bytes."""
    ids, new, cache = our_run
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False, return_dict_in_generate=True
        )
    assert out.sequences[0, len(ids) :].tolist() == new
    hf_cache = out.past_key_values
    held = sum(layer.keys.nbytes + layer.values.nbytes for layer in hf_cache.layers)
    assert hf_cache.get_seq_length() == cache.seq_len
    assert held == kv_cache_bytes(hf_model.config.to_dict(), cache.seq_len, dtype="fp32") == cache.nbytes


# ---- crossover and prefill cost ----------------------------------------------------------------
def test_crossover_tokens_is_the_first_token_count_past_the_weights():
    from kvcourse.memory import crossover_tokens

    n = crossover_tokens("llama-3-8b")
    assert kv_cache_bytes("llama-3-8b", n) >= weight_bytes("llama-3-8b") > kv_cache_bytes("llama-3-8b", n - 1)
    assert n == -(-weight_bytes("llama-3-8b") // 131_072)
    assert crossover_tokens("mistral-7b") is None  # every layer windowed at 4096: 0.54 GB at most
    g = crossover_tokens("gemma-2-9b")  # half the layers stop at 4096, so it takes ~2x the naive count
    assert kv_cache_bytes("gemma-2-9b", g) >= weight_bytes("gemma-2-9b") > kv_cache_bytes("gemma-2-9b", g - 1)


def test_prefill_flops_matches_the_course_cost_model():
    from kvcourse.costs import forward_flops
    from kvcourse.memory import prefill_flops

    for t in (1, 50, 2000):
        ours, reference = prefill_flops("smollm2-135m", t), forward_flops(kvcourse.LlamaConfig(), t)
        assert abs(ours / reference - 1) < 5e-4
    # Untied Llama-3-8B: the 525M-parameter embedding table is a lookup, not a product.
    assert prefill_flops("llama-3-8b", 1) == 2 * (8_030_261_248 - 128256 * 4096) + 4 * 32 * 4096
    with pytest.raises(ValueError, match="num_tokens"):
        prefill_flops("llama-3-8b", -1)
    with pytest.raises(ValueError, match="dense"):
        prefill_flops("deepseek-v3", 10)


# ---- configs a user might hand the CLI by mistake (issue 31, item 5): each refused with a clear line ----------
_QWEN = {
    "model_type": "qwen2",
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "hidden_size": 512,
    "sliding_window": 128,
    "use_sliding_window": True,
}


@pytest.mark.parametrize(("text", "word"), [
    (json.dumps({**GPT2, "n_layer": 10**30}), "at most 10,000"),
    (json.dumps({**GPT2, "n_layer": 10**8}), "at most 10,000"),
    ("[" * 100_000 + "]" * 100_000, "nests its JSON too deeply"),
    (json.dumps({**_QWEN, "max_window_layers": "a"}), "max_window_layers"),
    (json.dumps({**_QWEN, "max_window_layers": -5}), "max_window_layers"),
    (json.dumps({**_QWEN, "max_window_layers": 2.5}), "max_window_layers"),
    (json.dumps({**_QWEN, "max_window_layers": 5}), "max_window_layers"),
    (json.dumps({"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096, "multi_query": True,
                 "num_key_value_heads": 8}), "disagree"),
])  # fmt: skip
def test_cli_refuses_odd_configs_in_one_line(tmp_path, capsys, text, word):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(SystemExit) as e:  # refused before anything per layer is built (10^8 layers once took 1.8 GB)
        cli_main(["--config", str(path), "--seq-len", "1024"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and word in err and "Traceback" not in err, err


@pytest.mark.parametrize("field", INT_FIELDS)
def test_every_integer_field_is_checked_where_the_config_does_not_use_it(tmp_path, capsys, field):
    # issue 47, item 8: a Llama config (no sliding window) with max_window_layers "a" printed a bill
    llama = {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 64}
    for bad in ("a", 2.5, True):
        path = tmp_path / "config.json"
        path.write_text(json.dumps({**llama, field: bad}))
        with pytest.raises(SystemExit) as e:
            cli_main(["--config", str(path), "--seq-len", "1024"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and f"config['{field}'] must be an integer or null, got {bad!r}" in err, err
        with pytest.raises(ValueError, match=rf"config\['{field}'\] must be an integer"):
            kv_layout({**llama, field: bad})
    if field not in llama:
        assert kv_layout({**llama, field: None}).num_layers == 2  # null stays "not set"


def test_qwen_max_window_layers_still_reads_right():
    layout = kv_layout({**_QWEN, "max_window_layers": 2})
    assert layout.layer_windows == (None, None, 128, 128)
    assert kv_layout({**_QWEN, "max_window_layers": None}).layer_windows == (128,) * 4
    assert (
        kv_layout(
            {
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "hidden_size": 64,
                "multi_query": True,
                "num_key_value_heads": 1,
            }
        ).num_kv_heads
        == 1
    )  # agreeing keys are fine
