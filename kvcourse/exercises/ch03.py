"""Checks for chapter 3, *The memory bill*.

1. :func:`check_bytes_per_token` -- K/V bytes one token adds, from a Llama-style ``config.json`` dict.
2. :func:`check_bytes_per_rank` -- one sequence's K/V on one tensor-parallel rank, for GQA and MLA configs.
3. :func:`check_quantized_bytes` -- a KIVI-style quantized cache: per-group scale and zero point, a
   full-precision window of recent tokens.
4. :func:`check_max_sequences` -- how many long sequences fit on one GPU (a number).
5. :func:`check_max_context` -- the longest context a given number of sequences can each hold on one GPU.

Each check runs the learner's code on hidden random cases (seeded from the check's ``seed``
argument) and raises :class:`~kvcourse.exercises.ExerciseError` with the case, the expected and
returned values and a hint; :class:`~kvcourse.exercises._core.Diagnosis` names the typical mistake
that explains every failing case.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any

from .. import memory
from ..memory import CATALOG, GB, kv_cache_bytes
from ._core import CheckResult, ExerciseError, a_number, an_int, call_learner, check, describe, diagnose, mistaken, fail
from ._core import hidden_rng, passed

__all__ = [
    "check_bytes_per_token",
    "check_bytes_per_rank",
    "check_quantized_bytes",
    "check_max_sequences",
    "check_max_context",
]

# The package's own calculator: a learner's function must not call it.
_REFERENCES = {name: getattr(memory, name) for name in ("kv_bytes_per_token", "kv_cache_bytes", "kv_layout")}
# The fit exercise's answer is kvcourse's max_concurrent_sequences, which takes its budget from kv_budget_bytes and
# the weights from weight_bytes: all three are what the learner is asked to count.
_FIT_REFERENCES = {
    name: getattr(memory, name) for name in ("max_concurrent_sequences", "kv_budget_bytes", "weight_bytes")
}


def _call_on_config(label: str, fn: Callable, config: dict, *args) -> Any:
    """Call the learner; a missing optional key gets its own hint instead of a bare KeyError."""
    name = label.split("(")[0]
    try:
        return call_learner(name, fn, config, *args)
    except ExerciseError as exc:
        cause = exc.__cause__
        if isinstance(cause, KeyError) and cause.args and cause.args[0] in _OPTIONAL_KEYS:
            key = cause.args[0]
            fail(
                f"{name}({describe(config)}, {', '.join(map(repr, args))})",
                expected="a number",
                got=f"KeyError: {key!r}",
                hint=_OPTIONAL_KEYS[key],
            )
        raise


_OPTIONAL_KEYS = {
    "num_key_value_heads": "num_key_value_heads is optional: a config without it is multi-head attention, where "
    "every query head has its own K/V head (num_key_value_heads = num_attention_heads).",
    "head_dim": "head_dim is optional: without it a head is hidden_size // num_attention_heads wide.",
}


# --- Exercise 1: bytes per token from a config ---------------------------------------------------


def _head_dim(cfg: dict) -> int:
    return cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]


def _kv_heads(cfg: dict) -> int:
    return cfg.get("num_key_value_heads") or cfg["num_attention_heads"]


def _per_token(
    cfg: dict, nbytes: float, *, kv: int = 2, heads: int | None = None, head_dim: int | None = None, layers: bool = True
) -> float:
    heads = _kv_heads(cfg) if heads is None else heads
    head_dim = _head_dim(cfg) if head_dim is None else head_dim
    return kv * (cfg["num_hidden_layers"] if layers else 1) * heads * head_dim * nbytes


def _llama_style_cases(rng) -> list[tuple[dict, int]]:
    names = ["llama-2-7b", "llama-3-8b", "llama-3.1-70b", "qwen2.5-7b", "gemma-2-9b", "smollm2-135m"]
    keep = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    cases = [({k: v for k, v in CATALOG[n].config.items() if k in keep}, b) for n, b in zip(names, [2, 2, 1, 4, 2, 4])]
    cases.append(({"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768}, 4))  # MHA, no KV key
    for _ in range(10):
        kv = rng.choice([1, 2, 4, 8, 16])
        heads = kv * rng.choice([1, 2, 4, 8])
        head_dim = rng.choice([64, 80, 96, 128, 256])
        cfg = {"num_hidden_layers": rng.randint(2, 96), "num_attention_heads": heads, "hidden_size": heads * head_dim}
        if kv != heads or rng.random() < 0.5:
            cfg["num_key_value_heads"] = kv  # MHA configs often leave it out
        if rng.random() < 0.4:  # an explicit head_dim that hidden_size / heads does not give (Gemma)
            cfg["head_dim"] = head_dim
            cfg["hidden_size"] = heads * head_dim * rng.choice([3, 5, 7]) // 4
        cases.append((cfg, rng.choice([1, 2, 4])))
    return cases


@check(
    "ch03.check_bytes_per_token",
    takes="fn(config, bytes_per_value)",
    references=_REFERENCES,
    task="compute the bytes from the config yourself.",
)
def check_bytes_per_token(fn: Callable[[dict, int], float], seed: int = 0) -> CheckResult:
    """``fn(config, bytes_per_value)`` -> bytes of K/V one more token adds to one sequence.

    ``config`` is a Llama-style ``config.json`` dict: ``num_hidden_layers``, ``num_attention_heads``,
    ``hidden_size``, and sometimes ``num_key_value_heads`` (absent: multi-head attention) and
    ``head_dim`` (absent: ``hidden_size // num_attention_heads``).
    """
    diagnose(
        fn,
        _llama_style_cases(hidden_rng()),
        label=lambda cfg, nbytes: f"bytes_per_token({cfg}, bytes_per_value={nbytes})",
        reference=_per_token,
        mistakes=[
            (
                "Every token stores two vectors per KV head and layer, K and V: you left out the factor 2.",
                lambda c, b: _per_token(c, b, kv=1),
            ),
            (
                "Only the num_key_value_heads KV heads are cached, not the query heads (grouped-query attention).",
                lambda c, b: _per_token(c, b, heads=c["num_attention_heads"]),
            ),
            (
                "Use config['head_dim'] when it is there: a head need not be hidden_size / num_attention_heads wide "
                "(Gemma-2-9B: 16 heads of 256 with hidden_size 3584).",
                lambda c, b: _per_token(c, b, head_dim=c["hidden_size"] // c["num_attention_heads"]),
            ),
            (
                "Multiply by bytes_per_value: the answer must change with the dtype (4 bytes in fp32, 2 in bf16, 1 in fp8).",
                lambda c, b: _per_token(c, 2),
            ),
            (
                "Every layer caches its own K and V: multiply by num_hidden_layers.",
                lambda c, b: _per_token(c, b, layers=False),
            ),
        ],
        hint="2 (K and V) x layers x KV heads x head_dim x bytes per value.",
        returns=a_number("a number (bytes)"),
        call=_call_on_config,
    )
    return passed("2 x layers x KV heads x head_dim x bytes per value, right for MHA, GQA and an explicit head_dim.")


# --- Exercise 2: bytes per tensor-parallel rank, GQA and MLA ------------------------------------


def _per_rank(cfg: dict, seq_len: int, tp: int, nbytes: int, mistake: str = "") -> float:
    """Bytes of one sequence's K/V on one rank; ``mistake`` names a typical wrong answer to reproduce."""
    layers = cfg["num_hidden_layers"]
    if "kv_lora_rank" in cfg:  # MLA: one latent of kv_lora_rank values + one shared RoPE key, per layer
        width = cfg["kv_lora_rank"] + (0 if mistake == "mla_no_rope" else cfg["qk_rope_head_dim"])
        if mistake == "mla_as_gqa":
            return 2 * layers * max(1, cfg["num_key_value_heads"] // tp) * _head_dim(cfg) * seq_len * nbytes
        if mistake == "mla_per_head":
            per_head = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"] + cfg["v_head_dim"]
            return layers * cfg["num_attention_heads"] // tp * per_head * seq_len * nbytes
        values = width * (2 if mistake == "mla_kv" else 1)
        return layers * values * seq_len * nbytes / (tp if mistake in ("split", "mla_split") else 1)
    kv, head_dim = cfg["num_key_value_heads"], cfg["head_dim"]
    heads = {"split": kv / tp, "query_heads": max(1, cfg["num_attention_heads"] // tp)}.get(mistake, max(1, kv // tp))
    return (1 if mistake == "no_kv" else 2) * layers * heads * head_dim * seq_len * nbytes


def _tp_cases(rng) -> list[tuple[dict, int, int, int]]:
    l31 = {
        k: CATALOG["llama-3.1-70b"].config[k]
        for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size")
    }
    l31["head_dim"] = 128
    ds = {
        k: v
        for k, v in CATALOG["deepseek-v3"].config.items()
        if k
        in (
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "hidden_size",
            "kv_lora_rank",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
        )
    }
    cases = [(l31, 131072, 8, 2), (l31, 131072, 16, 2), (l31, 4096, 1, 2), (ds, 131072, 8, 1), (ds, 1000, 1, 2)]
    for _ in range(10):
        tp = rng.choice([1, 2, 4, 8, 16, 32])
        seq_len, nbytes = rng.randint(1, 200_000), rng.choice([1, 2, 4])
        if rng.random() < 0.35:  # a DeepSeek-style MLA config: it also states num_key_value_heads
            heads = rng.choice([32, 64, 128])
            cfg = {
                "num_hidden_layers": rng.randint(20, 64),
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "hidden_size": heads * 56,
                "kv_lora_rank": rng.choice([256, 512]),
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 128,
                "v_head_dim": 128,
            }
        else:
            kv = rng.choice([1, 2, 4, 8])
            heads = kv * rng.choice([2, 4, 8])
            while heads % tp:  # each rank gets a whole number of query heads
                tp //= 2
            cfg = {
                "num_hidden_layers": rng.randint(16, 96),
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
                "head_dim": rng.choice([64, 128]),
                "hidden_size": heads * 128,
            }
        cases.append((cfg, seq_len, tp, nbytes))
    return cases


@check(
    "ch03.check_bytes_per_rank",
    takes="fn(config, seq_len, tp_size, bytes_per_value)",
    references=_REFERENCES,
    task="compute the bytes per rank yourself.",
)
def check_bytes_per_rank(fn: Callable[[dict, int, int, int], float], seed: int = 0) -> CheckResult:
    """``fn(config, seq_len, tp_size, bytes_per_value)`` -> bytes of K/V that one of ``tp_size``
    tensor-parallel ranks holds for one sequence of ``seq_len`` tokens.

    ``config`` is either a GQA/MHA/MQA config (``num_hidden_layers``, ``num_attention_heads``,
    ``num_key_value_heads``, ``head_dim``) or a DeepSeek-style MLA config (it has ``kv_lora_rank``,
    ``qk_rope_head_dim``, ``qk_nope_head_dim``, ``v_head_dim``). KV heads are split evenly across
    ranks; with more ranks than KV heads, each rank stores one whole head.
    """
    split_hint = (
        "Dividing by tp_size assumes tp_size KV heads to share out. With more ranks than KV heads every rank "
        "still stores one whole head (each head is replicated on tp_size / KV-heads ranks), and an MLA "
        "latent serves all heads, so every rank stores all of it."
    )
    diagnose(
        fn,
        _tp_cases(hidden_rng()),
        label=lambda cfg, seq_len, tp, nbytes: (
            f"bytes_per_rank({cfg}, seq_len={seq_len}, tp_size={tp}, bytes_per_value={nbytes})"
        ),
        reference=_per_rank,
        mistakes=[
            *mistaken(
                _per_rank,
                mla_as_gqa="The MLA config also says num_key_value_heads (DeepSeek-V3: 128), but MLA caches no "
                "per-head K and V: per token and layer it caches one latent of kv_lora_rank values and one RoPE key of "
                "qk_rope_head_dim values.",
                mla_per_head="That is the cache of MLA decompressed into per-head keys and values, which is what MLA "
                "avoids storing: cache kv_lora_rank + qk_rope_head_dim values per token and layer, once for all heads.",
                mla_kv="MLA caches one latent vector per token and layer, not a K and a V: no factor 2 for it.",
                mla_no_rope="The MLA latent is kv_lora_rank values plus the shared RoPE key of qk_rope_head_dim values.",
            ),
            (split_hint, lambda c, s, t, b: _per_rank(c, s, t, b, "split")),
            (split_hint, lambda c, s, t, b: _per_rank(c, s, t, b, "mla_split")),
            *mistaken(
                _per_rank,
                no_kv="Every token stores two vectors per KV head and layer, K and V: you left out the factor 2.",
                query_heads="Only the num_key_value_heads KV heads are cached, not the query heads (grouped-query "
                "attention).",
            ),
            ("The answer is for a whole sequence: multiply by seq_len.", lambda c, s, t, b: _per_rank(c, 1, t, b)),
        ],
        hint="GQA: 2 x layers x max(1, KV heads // tp_size) x head_dim x seq_len x bytes. MLA: layers x (kv_lora_rank "
        "+ qk_rope_head_dim) x seq_len x bytes on every rank.",
        returns=a_number("a number (bytes)"),
    )
    ds = CATALOG["deepseek-v3"].config
    latent = ds["kv_lora_rank"] + ds["qk_rope_head_dim"]
    per_head = ds["num_attention_heads"] * (ds["qk_nope_head_dim"] + ds["qk_rope_head_dim"] + ds["v_head_dim"])
    return passed(
        f"heads are whole on every rank, and MLA's latent ({latent} values per token and layer for "
        f"DeepSeek-V3, {per_head / latent:.0f}x fewer than per-head K and V) is on all of them."
    )


# --- Exercise 3: a KIVI-style quantized cache ----------------------------------------------------


def _quantized(cfg: dict, seq_len: int, bits: int, group: int, residual: int, mistake: str = "") -> float:
    values = (1 if mistake == "no_kv" else 2) * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"]
    recent = min(seq_len, residual)
    quantized = seq_len - recent
    if mistake == "no_window":
        quantized, recent = seq_len, 0
    elif mistake == "window_twice":
        quantized = seq_len
    per_value = bits if mistake == "bits_as_bytes" else bits / 8
    group_bytes = 2 if mistake == "scale_only" else 4
    groups_per_value = 1 / (cfg["head_dim"] if mistake == "per_vector" else group)
    window_bytes = 4 if mistake == "window_fp32" else 2
    return values * (quantized * (per_value + group_bytes * groups_per_value) + recent * window_bytes)


def _quant_cases(rng) -> list[tuple[dict, int, int, int, int]]:
    l38 = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}
    cases = [
        (l38, 131072, 4, 32, 128),
        (l38, 131072, 2, 32, 128),
        (l38, 100, 2, 32, 128),
        (l38, 4096, 8, 64, 32),
        (l38, 5000, 4, 128, 0),
    ]
    for _ in range(10):
        head_dim = rng.choice([64, 128, 256])
        cfg = {
            "num_hidden_layers": rng.randint(8, 80),
            "num_key_value_heads": rng.choice([1, 2, 4, 8]),
            "head_dim": head_dim,
        }
        group = rng.choice([g for g in (32, 64, 128) if head_dim % g == 0])
        residual = rng.choice([0, 32, 64, 128])
        seq_len = rng.choice([rng.randint(1, 2 * max(residual, 1)), rng.randint(1, 200_000)])
        cases.append((cfg, seq_len, rng.choice([2, 4, 8]), group, residual))
    return cases


@check(
    "ch03.check_quantized_bytes",
    takes="fn(config, seq_len, bits, group_size, residual_len)",
    references=_REFERENCES,
    task="count the bytes of the quantized cache yourself.",
)
def check_quantized_bytes(fn: Callable[[dict, int, int, int, int], float], seed: int = 0) -> CheckResult:
    """``fn(config, seq_len, bits, group_size, residual_len)`` -> bytes of one sequence's K/V, quantized the
    KIVI way.

    ``config`` has ``num_hidden_layers``, ``num_key_value_heads`` and ``head_dim``. The most recent
    ``min(seq_len, residual_len)`` tokens stay in fp16. Every other K or V value is stored in ``bits``
    bits, and each group of ``group_size`` of those values also stores an fp16 scale and an fp16 zero
    point (``group_size`` divides ``head_dim`` in every case).
    """
    diagnose(
        fn,
        _quant_cases(hidden_rng()),
        label=lambda cfg, seq_len, bits, group, residual: (
            f"quantized_bytes({cfg}, seq_len={seq_len}, bits={bits}, group_size={group}, residual_len={residual})"
        ),
        reference=_quantized,
        mistakes=mistaken(
            _quantized,
            scale_only="KIVI is asymmetric: a group is stored as q with x = scale * q + zero_point, so each group "
            "keeps a scale AND a zero point, 2 + 2 bytes in fp16. Counting the scale alone halves the overhead (for "
            "int4 in groups of 32, a quarter of the payload, not an eighth).",
            no_window="The most recent residual_len tokens are not quantized: they stay in fp16 (KIVI keeps a window "
            "of recent tokens in full precision and quantizes it once it fills).",
            window_twice="The recent tokens in the fp16 window are not also stored quantized: only the older seq_len - "
            "residual_len tokens are.",
            bits_as_bytes="bits counts bits: a value takes bits / 8 bytes.",
            per_vector="One scale and zero point per group of group_size values, not one per head vector of head_dim "
            "values.",
            window_fp32="The recent window is fp16: 2 bytes per value.",
            no_kv="Every token stores two vectors per KV head and layer, K and V: you left out the factor 2.",
        ),
        hint="Price the two kinds of token separately: which ones are not quantized yet, and what does an asymmetric "
        "group keep beside its values?",
        returns=a_number("a number (bytes)"),
    )
    l38 = {"num_hidden_layers": 32, "num_key_value_heads": 8, "head_dim": 128}
    ratio = _quantized(l38, 131072, 2, 32, 128) / (2 * 32 * 8 * 128 * 131072 * 2)
    return passed(
        f"2-bit KIVI (groups of 32, 128 recent tokens in fp16) keeps Llama-3-8B's 128k-token cache at "
        f"{ratio:.1%} of its bf16 size: an eighth for the payload, half as much again for the scales and "
        "zero points."
    )


# --- Exercise 4: sequences on one GPU -----------------------------------------------------------

# Dense-attention models of the catalog (no sliding window, no MLA): one K and one V per KV head, layer and token.
_FIT_MODELS = ("smollm2-135m", "llama-2-7b", "llama-2-70b", "llama-3-8b", "llama-3-70b", "llama-3.1-70b", "qwen2.5-7b")
_FIT_CHAPTER = ("qwen2.5-7b", 32768, 80 * GB, 2, 1, 0.9)  # the chapter's question: bf16 weights, fp8 cache, 80 GB


def _fit_ratio(
    c: dict,
    num_parameters: int,
    seq_len: int,
    gpu_bytes: float,
    weight_bytes: float,
    kv_bytes: float,
    utilization: float,
    *,
    kv: int = 2,
    on_what_is_left: bool = False,
) -> float:
    """The budget over one sequence's cache (keywords: the typical mistakes)."""
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_seq = kv * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim * seq_len * kv_bytes
    weights = num_parameters * weight_bytes
    budget = utilization * (gpu_bytes - weights) if on_what_is_left else utilization * gpu_bytes - weights
    return budget / per_seq


def _fit(*args, rounding=math.floor, clamp: bool = True, **mistake) -> int:
    """How many sequences fit: the ratio rounded down, and 0 when even the weights do not fit."""
    n = int(rounding(_fit_ratio(*args, **mistake)))
    return max(n, 0) if clamp else n


_FIT_MISTAKES = [
    (
        "The weights and the cache have their own dtypes: weight_bytes_per_value for the parameters, kv_bytes_per_value "
        "for K and V.",
        lambda c, p, s, g, w, k, u: _fit(c, p, s, g, k, k, u),
    ),
    (
        "The cache's values take kv_bytes_per_value bytes each (fp8: 1), not the weights' weight_bytes_per_value.",
        lambda c, p, s, g, w, k, u: _fit(c, p, s, g, w, w, u),
    ),
    (
        "The engine may use `utilization` of the whole GPU, and the weights come out of that share: budget = "
        "utilization x gpu_bytes - weight bytes.",
        lambda *a: _fit(*a, on_what_is_left=True),
    ),
    ("Round down: a sequence that does not fit whole does not run.", lambda *a: _fit(*a, rounding=math.ceil)),
    (
        "Every token stores two vectors per KV head and layer, K and V: you left out the factor 2.",
        lambda *a: _fit(*a, kv=1),
    ),
    (
        "When the weights alone take more than the budget, no sequence fits: 0, not a negative count.",
        lambda *a: _fit(*a, clamp=False),
    ),
]


def _fit_cases(rng) -> list[tuple]:
    cases = [_FIT_CHAPTER, ("llama-3-70b", 8192, 24 * GB, 2, 2, 0.9)]  # the chapter's, and one where nothing fits
    while len(cases) < 14:
        name = rng.choice(_FIT_MODELS)
        longest = CATALOG[name].config["max_position_embeddings"]
        seq_len = rng.choice([s for s in (1024, 4096, 8192, 32768, 131072) if s <= longest])
        case = (name, seq_len, rng.choice([24, 40, 80, 141]) * GB, rng.choice([2, 1]), rng.choice([2, 1]),
                rng.choice([0.8, 0.9, 0.95]))  # fmt: skip
        ratio = _fit_ratio(*_fit_args(*case))
        if 1 <= ratio < 10**6 and abs(ratio - round(ratio)) > 1e-6:  # some fit, none sits on a rounding boundary
            cases.append(case)
    return cases


def _fit_args(name: str, *rest) -> tuple:
    """A case's arguments as the learner's function takes them: the catalog entry's config (a dict) and size first."""
    return (dict(CATALOG[name].config), CATALOG[name].num_parameters, *rest)


def _catalog_label(call: str, count: str) -> Callable[..., str]:
    """How the fit exercises name a case: by its catalog entry, not its whole config."""

    def label(config: dict, num_parameters: int, n: int, gpu_bytes: float, w: float, k: float, u: float) -> str:
        name = next(name for name in _FIT_MODELS if CATALOG[name].config == config)
        return (
            f"{call}(CATALOG[{name!r}].config, {num_parameters:_}, {count}={n}, gpu_bytes={gpu_bytes / GB:g}e9, "
            f"weight_bytes_per_value={w}, kv_bytes_per_value={k}, utilization={u})"
        )

    return label


@check(
    "ch03.check_max_sequences",
    takes="fn(config, num_parameters, seq_len, gpu_bytes, weight_bytes_per_value, kv_bytes_per_value, utilization)",
    references={**_REFERENCES, **_FIT_REFERENCES},
    task="count the bytes yourself (your bytes_per_token may help).",
)
def check_max_sequences(fn: Callable[..., int], seed: int = 0) -> CheckResult:
    """``fn(config, num_parameters, seq_len, gpu_bytes, weight_bytes_per_value, kv_bytes_per_value, utilization)``
    -> how many ``seq_len``-token sequences fit at once on a GPU of ``gpu_bytes`` bytes, of which the engine may
    use the fraction ``utilization`` (vLLM's ``gpu_memory_utilization``) for the weights and the cache together.
    ``config`` and ``num_parameters`` are a :data:`~kvcourse.memory.CATALOG` entry's."""
    diagnose(
        fn,
        [_fit_args(*case) for case in _fit_cases(hidden_rng())],
        label=_catalog_label("max_sequences", "seq_len"),
        reference=_fit,
        mistakes=_FIT_MISTAKES,
        hint="Budget = utilization x gpu_bytes - weight bytes; divide by one sequence's cache and round down.",
        compare=operator.eq,
        returns=an_int("number of sequences"),
    )
    n = _fit(*_fit_args(*_FIT_CHAPTER))
    per_seq = kv_cache_bytes(_FIT_CHAPTER[0], _FIT_CHAPTER[1], dtype="fp8")
    return passed(
        f"the chapter's question: {n} sequences of 32k tokens fit on 80 GB, each holding "
        f"{per_seq / 2**30:.3f} GiB of fp8 K/V."
    )


# --- Exercise 5: the longest context for n users --------------------------------------------------


def _context(
    c: dict,
    num_parameters: int,
    num_sequences: int,
    gpu_bytes: float,
    weight_bytes: float,
    kv_bytes: float,
    utilization: float,
    *,
    rounding=math.floor,
    per: int | None = None,
    **mistake,
) -> int:
    """Tokens each of ``num_sequences`` sequences can hold: the budget over their bytes per token, rounded down
    (keywords: the typical mistakes; ``per`` replaces the number of sequences sharing the budget)."""
    tokens = _fit_ratio(c, num_parameters, 1, gpu_bytes, weight_bytes, kv_bytes, utilization, **mistake)
    return max(0, int(rounding(tokens / (num_sequences if per is None else per))))


_CONTEXT_MISTAKES = [
    (
        "The budget is shared: num_sequences sequences each hold the context, so divide by num_sequences x the bytes "
        "of one token.",
        lambda c, p, n, g, w, k, u: _context(c, p, n, g, w, k, u, per=1),
    ),
    (
        "The weights and the cache have their own dtypes: weight_bytes_per_value for the parameters, kv_bytes_per_value "
        "for K and V.",
        lambda c, p, n, g, w, k, u: _context(c, p, n, g, k, k, u),
    ),
    (
        "The engine may use `utilization` of the whole GPU, and the weights come out of that share: budget = "
        "utilization x gpu_bytes - weight bytes.",
        lambda *a: _context(*a, on_what_is_left=True),
    ),
    (
        "Every token stores two vectors per KV head and layer, K and V: you left out the factor 2.",
        lambda *a: _context(*a, kv=1),
    ),
    ("Round down: a context one token longer would not fit.", lambda *a: _context(*a, rounding=math.ceil)),
    (
        "The weights are loaded first: subtract num_parameters x weight_bytes_per_value from the budget.",
        lambda c, p, n, g, w, k, u: _context(c, 0, n, g, w, k, u),
    ),
]


def _context_cases(rng) -> list[tuple]:
    # the chapter's question: 64 Llama-3-8B users on 80 GB in bf16; then one where the weights take everything
    cases = [("llama-3-8b", 64, 80 * GB, 2, 2, 0.9), ("llama-3-70b", 4, 24 * GB, 2, 2, 0.9)]
    while len(cases) < 14:
        case = (rng.choice(_FIT_MODELS), rng.choice([1, 3, 8, 32, 100]), rng.choice([24, 40, 80, 141]) * GB,
                rng.choice([2, 1]), rng.choice([2, 1]), rng.choice([0.8, 0.9, 0.95]))  # fmt: skip
        tokens = _fit_ratio(*_fit_args(case[0], 1, *case[2:])) / case[1]
        if 1 <= tokens < 10**8 and abs(tokens - round(tokens)) > 1e-6:  # none sits on a rounding boundary
            cases.append(case)
    return cases


@check(
    "ch03.check_max_context",
    takes="fn(config, num_parameters, num_sequences, gpu_bytes, weight_bytes_per_value, kv_bytes_per_value, "
    "utilization)",
    references={**_REFERENCES, **_FIT_REFERENCES},
    task="count the bytes yourself (your bytes_per_token may help).",
)
def check_max_context(fn: Callable[..., int], seed: int = 0) -> CheckResult:
    """``fn(config, num_parameters, num_sequences, gpu_bytes, weight_bytes_per_value, kv_bytes_per_value,
    utilization)`` -> the longest context (tokens) each of ``num_sequences`` sequences can hold at once on a GPU of
    ``gpu_bytes`` bytes, of which the engine may use ``utilization`` for the weights and the cache together; 0 if
    the weights leave nothing. The model's own context limit is left out."""
    diagnose(
        fn,
        [_fit_args(*case) for case in _context_cases(hidden_rng())],
        label=_catalog_label("max_context", "num_sequences"),
        reference=_context,
        mistakes=_CONTEXT_MISTAKES,
        hint="Budget = utilization x gpu_bytes - weight bytes; divide by num_sequences x one token's K/V bytes and "
        "round down.",
        compare=operator.eq,
        returns=an_int("number of tokens"),
    )
    tokens = _context(*_fit_args("llama-3-8b", 64, 80 * GB, 2, 2, 0.9))
    return passed(
        f"the chapter's question: 64 Llama-3-8B users on 80 GB in bf16 can each hold {tokens:,} tokens, "
        "just under 7k: the 8k of the fit section leaves room for 52."
    )
