"""Command line: ``python -m kvcourse.memory --model llama-3-8b --seq-len 8192 --batch-size 64``.

Prints the KV cache bill of one model as a table: the layout read from the config,
bytes per token, per sequence, per tensor-parallel rank, and for all ranks, in GB
(10**9 bytes) and GiB (2**30 bytes).
"""

from __future__ import annotations

import argparse
import sys

from . import (
    CATALOG,
    DTYPE_BYTES,
    catalog_names,
    format_bytes,
    kv_bytes_per_token,
    kv_cache_bytes,
    kv_layout,
    load_config,
    weight_bytes,
)
from .units import dtype_key


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _dtype(text: str) -> str:
    """A dtype name as the Python API accepts it (``bf16``, ``bfloat16``, ``torch.float16``, ...)."""
    try:
        return dtype_key(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def context_note(config, seq_len: int) -> str | None:
    """A warning line when ``seq_len`` is beyond the model's trained context, else ``None``."""
    limit = load_config(config).get("max_position_embeddings")
    if isinstance(limit, int) and seq_len > limit:
        return (
            f"note: --seq-len {seq_len:,} is beyond the model's context length ({limit:,} positions, "
            "max_position_embeddings); the bill is computed anyway"
        )
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.memory",
        description="KV cache memory for a model: a catalog name or any Hugging Face config.json.",
        epilog="Catalog: " + ", ".join(catalog_names()) + ". GB = 10^9 bytes, GiB = 2^30 bytes.",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=catalog_names(), metavar="NAME", help="a catalog model name (see --list)")
    source.add_argument("--config", metavar="PATH", help="path to a Hugging Face config.json")
    source.add_argument("--list", action="store_true", help="list the catalog models and their sources, then exit")
    parser.add_argument("--seq-len", type=_positive, default=8192, help="tokens per sequence (default 8192)")
    parser.add_argument("--batch-size", type=_positive, default=1, help="concurrent sequences (default 1)")
    dtypes = ", ".join(sorted(DTYPE_BYTES))
    parser.add_argument("--dtype", type=_dtype, default="bf16", help=f"KV cache dtype: {dtypes} (default bf16)")
    parser.add_argument("--tp-size", type=_positive, default=1, help="tensor-parallel ranks (default 1)")
    parser.add_argument("--quant-group-size", type=_positive, help="for fp8/int8/int4: count an fp16 scale and zero "
                        "point per this many values (default: payload only)")  # fmt: skip
    parser.add_argument("--weight-dtype", type=_dtype, default="bf16",
                        help="dtype of the weights, for the weights row of catalog models (default bf16)")  # fmt: skip
    return parser


def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def report(
    config,
    label: str,
    seq_len: int,
    batch_size: int,
    dtype: str,
    tp_size: int,
    quant_group_size: int | None = None,
    weight_dtype: str = "bf16",
) -> str:
    """The table ``main`` prints, as a string."""
    layout = kv_layout(config)
    per_token = kv_bytes_per_token(config, dtype, tp_size=tp_size, quant_group_size=quant_group_size)
    per_seq = kv_cache_bytes(config, seq_len, 1, dtype, tp_size, quant_group_size)
    per_rank = kv_cache_bytes(config, seq_len, batch_size, dtype, tp_size, quant_group_size)
    windows = sorted({w for w in layout.layer_windows if w is not None})
    window_text = (
        f"{layout.num_windowed_layers} of {layout.num_layers} layers at {windows} tokens" if windows else "none"
    )
    scales = "" if quant_group_size is None else f" + fp16 scale and zero point per {quant_group_size} values"
    if layout.attention == "MLA":
        heads = f"MLA latent of {layout.head_dim} values per layer (replicated on every rank)"
    else:
        heads = f"{layout.num_kv_heads} (of {layout.num_attention_heads} query heads), {layout.kv_heads_per_rank(tp_size)} per rank"
    rows = [
        ("model", label),
        ("attention", layout.attention),
        ("layers", str(layout.num_layers)),
        ("KV heads", heads),
        ("head dim", str(layout.head_dim)),
        ("sliding window", window_text),
        ("dtype", dtype + scales),
        ("seq len x batch", f"{seq_len:,} x {batch_size:,}"),
        ("tp size", str(tp_size)),
        ("KV bytes per token", f"{per_token:,} B = {format_bytes(per_token)} per rank"),
        ("KV per sequence", f"{per_seq:,} B = {format_bytes(per_seq)} per rank"),
        ("KV total per rank", f"{per_rank:,} B = {format_bytes(per_rank)}"),
        ("KV total, all ranks", format_bytes(per_rank * tp_size)),
    ]
    if isinstance(config, str) and config in CATALOG:
        w = weight_bytes(config, weight_dtype, tp_size)
        params = CATALOG[config].num_parameters
        rows.append(("weights per rank", f"{format_bytes(w)} ({params:,} parameters at {weight_dtype})"))
        rows.append(("config source", f"huggingface.co/{CATALOG[config].hf_repo}"))
    return _table(rows)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.list:
        for name, entry in CATALOG.items():
            print(f"{name:<14} {entry.hf_repo:<38} {kv_layout(name).attention}")
        return 0
    config = args.model if args.model else args.config
    try:
        text = report(config, config, args.seq_len, args.batch_size, args.dtype, args.tp_size, args.quant_group_size,
                      args.weight_dtype)  # fmt: skip
        note = context_note(config, args.seq_len)
    except (ValueError, TypeError) as e:
        parser.error(str(e))
    print(text)
    if note:
        print(note, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
