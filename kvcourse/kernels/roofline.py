"""How fast decode attention could possibly run: bytes moved, FLOPs, and the GPUs' published peaks.

A decode step reads every cached key and value once and does little with each: for each of the
``G = Hq / Hkv`` query heads sharing a KV head, one multiply-add against the key and one against the
value. Per cached element (2 bytes in fp16) that is ``2 G`` FLOPs for K and V together per ``2 x 2``
bytes, ``G`` FLOPs per byte, where a GPU's ridge point (peak FLOP/s over peak byte/s) is in the
hundreds. Decode attention is bandwidth-bound: its best possible time is ``bytes / bandwidth``, and a
kernel's quality is the fraction of the peak bandwidth it reaches.

The peaks below are the vendors' published figures (datasheets), not measurements.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "GPU_PEAKS",
    "GpuPeak",
    "decode_attention_bytes",
    "decode_attention_flops",
    "int8_speedup_bound",
    "peak_for",
]


@dataclass(frozen=True)
class GpuPeak:
    """A GPU's vendor-published figures: memory bandwidth, dense fp16 tensor-core throughput, SM count."""

    name: str
    bandwidth: float  # bytes/s
    fp16_flops: float  # FLOP/s, dense (no sparsity)
    sms: int  # streaming multiprocessors
    source: str

    @property
    def ridge(self) -> float:
        """FLOPs per byte above which a kernel is compute-bound rather than bandwidth-bound."""
        return self.fp16_flops / self.bandwidth


# Vendor figures (NVIDIA datasheets and architecture whitepapers for the SM counts).
GPU_PEAKS: dict[str, GpuPeak] = {
    "T4": GpuPeak("NVIDIA T4", 320e9, 65e12, 40, "NVIDIA T4 datasheet: 320 GB/s GDDR6, 65 TFLOPS fp16"),
    "A100-40GB": GpuPeak("NVIDIA A100 40GB", 1555e9, 312e12, 108, "NVIDIA A100 datasheet: 1,555 GB/s, 312 TFLOPS fp16"),
    "A100-80GB": GpuPeak(
        "NVIDIA A100 80GB SXM", 2039e9, 312e12, 108, "NVIDIA A100 datasheet: 2,039 GB/s, 312 TFLOPS fp16"
    ),
    "H100-SXM": GpuPeak(
        "NVIDIA H100 SXM", 3.35e12, 989e12, 132, "NVIDIA H100 datasheet: 3.35 TB/s, 989 TFLOPS fp16 dense"
    ),
    "H200": GpuPeak("NVIDIA H200", 4.8e12, 989e12, 132, "NVIDIA H200 datasheet: 4.8 TB/s, 989 TFLOPS fp16 dense"),
}


def _check_lens(seq_lens: Sequence[int]) -> list[int]:
    lens = list(seq_lens)
    if not lens or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in lens):
        raise ValueError(f"seq_lens must be a non-empty list of positive ints, got {seq_lens!r}")
    return lens


def decode_attention_bytes(
    seq_lens: Sequence[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_bytes: float,
    q_bytes: float,
    scale_bytes: float = 0,
    block_size: int | None = None,
) -> int:
    """Bytes one decode step of attention must move through memory (one layer).

    K and V of every cached token and KV head (``kv_bytes`` per value, plus ``scale_bytes`` per token
    and head for a quantized cache); the query read and the output written (``q_bytes`` per value);
    with ``block_size``, the int32 block-table entries read.
    """
    lens = _check_lens(seq_lens)
    tokens = sum(lens)
    kv = 2 * tokens * num_kv_heads * (head_dim * kv_bytes + scale_bytes)
    q_and_out = 2 * len(lens) * num_q_heads * head_dim * q_bytes
    tables = 4 * sum(-(-n // block_size) for n in lens) if block_size else 0
    return int(kv + q_and_out + tables)


def int8_speedup_bound(
    seq_lens: Sequence[int], num_q_heads: int, num_kv_heads: int, head_dim: int, block_size: int | None = None
) -> float:
    """The roofline's speed-up of the int8 paged kernel over the fp16 one: fp16's bytes over int8's.

    Both kernels read the fp16 query and write the fp16 output, and read the same block-table entries; fp16 K/V cost
    2 bytes a value, int8 K/V 1 byte a value plus one fp32 scale per token and KV head, for K and for V (the layout
    of :mod:`kvcourse.kernels.int8`). A bandwidth-bound kernel's time follows its bytes, so this is the speed-up the
    roofline promises, and an upper bound on what the bytes alone can give.
    """
    fp16 = decode_attention_bytes(
        seq_lens, num_q_heads, num_kv_heads, head_dim, kv_bytes=2, q_bytes=2, block_size=block_size
    )
    int8 = decode_attention_bytes(
        seq_lens, num_q_heads, num_kv_heads, head_dim, kv_bytes=1, q_bytes=2, scale_bytes=4, block_size=block_size
    )
    return fp16 / int8


def decode_attention_flops(seq_lens: Sequence[int], num_q_heads: int, head_dim: int) -> int:
    """FLOPs of one decode step of attention (one layer): ``q . k`` and ``p v``, 2 FLOPs per multiply-add."""
    return 4 * sum(_check_lens(seq_lens)) * num_q_heads * head_dim


def peak_for(device_name: str) -> GpuPeak | None:
    """The published peaks of a GPU from its CUDA name (``torch.cuda.get_device_name()``), if we list it."""
    name = device_name.upper()
    if "T4" in name:
        return GPU_PEAKS["T4"]
    if "A100" in name:
        return GPU_PEAKS["A100-80GB" if "80GB" in name else "A100-40GB"]
    if "H200" in name:
        return GPU_PEAKS["H200"]
    if "H100" in name and "PCIE" not in name and "NVL" not in name:  # SXM: "NVIDIA H100 80GB HBM3"
        return GPU_PEAKS["H100-SXM"]
    return None
