"""Checks for chapter 3, the memory bill."""

from __future__ import annotations

from typing import Callable

from ..memory import CATALOG, kv_bytes_per_token, kv_cache_bytes, max_concurrent_sequences
from ._core import ExerciseError, expect_close, expect_equal, passed

__all__ = ["check_bytes_per_token", "check_max_sequences", "check_tp_per_rank", "check_mla_ratio"]

# (catalog name, bytes per value, dtype name) pairs the learner's function must get right.
_CASES = [("llama-2-7b", 2, "fp16"), ("llama-3-8b", 2, "bf16"), ("qwen2.5-7b", 4, "fp32"),
          ("gemma-2-9b", 2, "bf16"), ("smollm2-135m", 4, "fp32")]


def check_bytes_per_token(fn: Callable[[dict, float], float]) -> bool:
    """``fn(config, bytes_per_value)`` must give KV bytes per token for Llama-style configs (GQA, explicit head_dim)."""
    if not callable(fn):
        raise ExerciseError(f"pass your function itself, not {type(fn).__name__}")
    for name, nbytes, dtype in _CASES:
        config = dict(CATALOG[name].config)
        want = kv_bytes_per_token(name, dtype)
        got = fn(config, nbytes)
        layers, heads, kv = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        hint = ""
        if nbytes != 2 and got == want * 2 // nbytes:
            hint = "Use bytes_per_value: the answer must change with the dtype (4 bytes for fp32, 2 for bf16)."
        elif got == want // 2:
            hint = "The cache holds two tensors per layer: K and V."
        elif kv != heads and got == want * heads // kv:
            hint = "Under GQA only num_key_value_heads heads are cached, not num_attention_heads."
        elif got == 2 * layers * kv * (config["hidden_size"] // heads) * nbytes:
            hint = "Use config['head_dim'] when it is there: Gemma's heads are not hidden_size / num_attention_heads wide."
        expect_close(f"fn({name} config, {nbytes})", got, want, rel=1e-9,
                     hint=hint or "Multiply 2 x layers x KV heads x head dim x bytes per value.")
    return passed("2 x layers x KV heads x head_dim x bytes per value, right for MHA, GQA and Gemma's explicit head_dim.")


def check_max_sequences(n: int) -> bool:
    """Llama-3-8B, bf16 weights, fp8 KV cache, 32768-token sequences, 80 GB GPU at vLLM's 0.9 utilization."""
    want = max_concurrent_sequences("llama-3-8b", 80 * 10**9, 32768, dtype="fp8", weight_dtype="bf16",
                                    gpu_memory_utilization=0.9)
    per_seq = kv_cache_bytes("llama-3-8b", 32768, dtype="fp8")
    if isinstance(n, int) and not isinstance(n, bool):
        if n == max_concurrent_sequences("llama-3-8b", 80 * 10**9, 32768, dtype="fp8", weight_dtype="fp8",
                                         gpu_memory_utilization=0.9):
            raise ExerciseError(f"n = {n} is not right. The weights stay in bf16 (2 bytes each); only the cache is fp8.")
        if n == int(0.9 * 80 * 2**30 - 2 * CATALOG["llama-3-8b"].num_parameters) // per_seq:
            raise ExerciseError(f"n = {n} is not right. 80 GB is 80 x 10^9 bytes, not 80 x 2^30.")
    expect_equal("n", n, want, hint="Budget = 0.9 x 80e9 - weight bytes; divide by one sequence's fp8 cache and round down.")
    return passed(f"{want} sequences of 32k tokens fit; each holds {per_seq / 2**30:.0f} GiB of fp8 K/V.")


def check_tp_per_rank(nbytes: int) -> bool:
    """Bytes of K/V per GPU for one 131072-token Llama-3-70B sequence, bf16, tensor-parallel over 16 GPUs."""
    want = kv_cache_bytes("llama-3-70b", 131072, dtype="bf16", tp_size=16)
    naive = kv_cache_bytes("llama-3-70b", 131072, dtype="bf16") // 16
    if nbytes == naive:
        raise ExerciseError(
            f"nbytes = {nbytes!r} is not right. Dividing the total by 16 assumes 16 KV heads to split; "
            "how many KV heads does Llama-3-70B have, and what happens to the extra ranks?"
        )
    expect_equal("nbytes", nbytes, want, hint="Each rank stores at least one whole KV head in every layer.")
    return passed(f"{want:,} bytes per rank: 8 KV heads over 16 ranks means each head is stored twice.")


def check_mla_ratio(ratio: float) -> bool:
    """How many times more bytes DeepSeek-V3 would cache per token with K and V per head instead of MLA's latent."""
    cfg = CATALOG["deepseek-v3"].config
    per_head_values = cfg["num_attention_heads"] * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"])
    latent_values = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
    want = per_head_values / latent_values
    if isinstance(ratio, (int, float)) and abs(ratio - cfg["num_attention_heads"] * 2 * cfg["v_head_dim"] / latent_values) < 1e-6:
        raise ExerciseError(
            f"ratio = {ratio!r} is not right. A DeepSeek key head is qk_nope_head_dim + qk_rope_head_dim wide, "
            "wider than a value head."
        )
    expect_close("ratio", ratio, want, rel=1e-6,
                 hint="Per head: a key of qk_nope_head_dim + qk_rope_head_dim values and a value of v_head_dim; "
                      "MLA: kv_lora_rank + qk_rope_head_dim values, once per layer.")
    return passed(f"MLA caches {want:.1f}x fewer values than per-head K and V would.")
