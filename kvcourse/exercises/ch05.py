"""Checks for chapter 5, *Triton kernels*. Three exercises hand the learner a kernel to fix; one counts bytes.

1. :func:`check_masked_decode` -- a decode kernel that reads past ``seq_len``: add the masks.
2. :func:`check_online_softmax` -- a tiled decode kernel whose running sums are not rescaled.
3. :func:`check_paged_offsets` -- a paged kernel that computes the wrong address from the block table.
4. :func:`check_kv_bytes` -- bytes of K and V one decode step reads, and so its fastest possible time.

Each kernel check launches the learner's ``@triton.jit`` kernel (with the signature the exercise gives)
on hidden cases and compares it with torch. A wrong answer is compared with the typical mistakes,
computed in torch, to say which one it looks like.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch

from ..kernels.reference import paged_decode_attention_ref
from ..kernels.testing import random_paged_case
from ..kernels.triton_runtime import triton  # noqa: F401  (settles TRITON_INTERPRET before the learner's kernels)
from ._core import ExerciseError, call_learner, passed

__all__ = ["check_kv_bytes", "check_masked_decode", "check_online_softmax", "check_paged_offsets"]


def _expect_kernel(kernel: object) -> None:
    if not (callable(getattr(kernel, "__getitem__", None)) and hasattr(kernel, "fn")):
        raise ExerciseError(f"pass the @triton.jit kernel itself (not called, not a string), got {type(kernel).__name__}")


def _launch(name: str, kernel, grid: tuple[int, ...], *args, **constexprs) -> None:
    def run():
        with np.errstate(all="ignore"):  # a wrong kernel may overflow: the check reports it, NumPy need not
            kernel[grid](*args, **constexprs)

    call_learner(name, run)


def _close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> bool:
    return bool(torch.isfinite(got).all()) and torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)


def _softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row: ``q [B, D]``, ``k, v [B, S, D]`` -> ``[B, D]``, in float64."""
    s = torch.einsum("bd,bsd->bs", q.double(), k.double()) * scale
    return torch.einsum("bs,bsd->bd", torch.softmax(s, dim=-1), v.double())


# ---------------------------------------------------------------------------------------------
# 1. The missing mask
# ---------------------------------------------------------------------------------------------
MASK_BLOCK_S, MASK_D = 64, 16


def _mask_case(seed: int, pad: str) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([1, 5, 33, 64, 50], dtype=torch.int32)
    b = len(lens)
    q = torch.randn(b, MASK_D, generator=g) * 2
    k = torch.randn(b, MASK_BLOCK_S, MASK_D, generator=g)
    v = torch.randn(b, MASK_BLOCK_S, MASK_D, generator=g)
    for i, n in enumerate(lens.tolist()):  # slots past seq_len: stale data, or NaN
        if pad == "nan":
            k[i, n:], v[i, n:] = float("nan"), float("nan")
        else:
            k[i, n:] *= 3
    return q, k, v, lens


def check_masked_decode(kernel) -> bool:
    """``masked_decode_kernel(Q, K, V, Seq_lens, Out, scale, BLOCK_S, D)``, grid ``(B,)``.

    ``Q [B, D]``, ``K, V [B, BLOCK_S, D]`` (sequence ``b`` owns the first ``Seq_lens[b]`` slots),
    ``Out [B, D]``, all fp32 and contiguous.
    """
    _expect_kernel(kernel)
    scale = 1 / math.sqrt(MASK_D)
    for pad in ("stale", "nan"):
        q, k, v, lens = _mask_case(5, pad)
        out = torch.full_like(q, float("nan"))
        _launch("masked_decode_kernel", kernel, (q.shape[0],), q, k, v, lens, out, scale,
                BLOCK_S=MASK_BLOCK_S, D=MASK_D)  # fmt: skip
        want = torch.stack([_softmax_attention(q[i : i + 1], k[i : i + 1, :n], v[i : i + 1, :n], scale)[0]
                            for i, n in enumerate(lens.tolist())])  # fmt: skip
        if _close(out, want):
            continue
        if pad == "nan":
            raise ExerciseError(
                "Correct on stale padding, but NaN padding leaks into the output: a probability of 0 times "
                "NaN is still NaN. Mask the loads of K and V (mask=n < seq_len, other=0.0), not only the scores."
            )
        no_mask = _softmax_attention(q, k, v, scale)
        k0 = torch.where(torch.arange(MASK_BLOCK_S)[None, :, None] < lens[:, None, None], k, 0.0)
        v0 = torch.where(torch.arange(MASK_BLOCK_S)[None, :, None] < lens[:, None, None], v, 0.0)
        zero_scores = _softmax_attention(q, k0, v0, scale)
        one_more = torch.stack([_softmax_attention(q[i : i + 1], k[i : i + 1, : n + 1], v[i : i + 1, : n + 1], scale)[0]
                                for i, n in enumerate(lens.tolist())])  # fmt: skip
        if _close(out, no_mask):
            hint = "The output attends to all BLOCK_S slots: positions n >= seq_len must be masked."
        elif _close(out, zero_scores):
            hint = ("Masked loads return 0, and a score of 0 still gets weight exp(0 - max) in the softmax: set the "
                    "scores of masked positions to -inf (tl.where).")  # fmt: skip
        elif torch.allclose(out[lens < MASK_BLOCK_S].double(), one_more[lens < MASK_BLOCK_S], rtol=1e-4, atol=1e-4):
            hint = "One slot too many: sequence b owns positions 0 .. seq_len - 1, so the mask is n < seq_len."
        else:
            hint = "Compare with the torch reference on one sequence; check the mask, the max and the final division."
        raise ExerciseError(f"masked_decode_kernel gives wrong outputs (seq_lens {lens.tolist()}). {hint}")
    return passed("positions past seq_len are neither loaded nor weighted: stale data and NaN cannot leak in.")


# ---------------------------------------------------------------------------------------------
# 2. The online softmax rescale
# ---------------------------------------------------------------------------------------------
ONLINE_BLOCK_N, ONLINE_D, ONLINE_S = 16, 16, 80


def _online_variants(q, k, v, lens, scale, tile) -> dict[str, torch.Tensor]:
    """What the tiled loop computes, right and with each typical mistake (float64)."""
    out = {name: torch.zeros(q.shape, dtype=torch.float64) for name in ("right", "acc", "l", "divide")}
    for b, n in enumerate(lens.tolist()):
        for name in out:
            m, l, acc = -math.inf, 0.0, torch.zeros(q.shape[1], dtype=torch.float64)
            for start in range(0, n, tile):
                s = (k[b, start : min(start + tile, n)].double() @ q[b].double()) * scale
                m_new = max(m, float(s.max()))
                alpha = math.exp(m - m_new)
                p = torch.exp(s - m_new)
                l = (l if name == "l" else l * alpha) + float(p.sum())
                acc = (acc if name == "acc" else acc * alpha) + p @ v[b, start : min(start + tile, n)].double()
                m = m_new
            out[name][b] = acc if name == "divide" else acc / l
    return out


def _online_case(seed: int, growing: bool) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor([5, 16, 40, 80, 33], dtype=torch.int32)
    q = torch.randn(len(lens), ONLINE_D, generator=g)
    k = torch.randn(len(lens), ONLINE_S, ONLINE_D, generator=g)
    v = torch.randn(len(lens), ONLINE_S, ONLINE_D, generator=g)
    if growing:  # scores rise along the sequence: every new tile raises the running maximum
        k += torch.arange(ONLINE_S)[None, :, None] * 0.15 * q[:, None, :] / q.norm(dim=1)[:, None, None]
    return q, k, v, lens


def check_online_softmax(kernel) -> bool:
    """``online_decode_kernel(Q, K, V, Seq_lens, Out, scale, S_MAX, BLOCK_N, D)``, grid ``(B,)``.

    ``Q [B, D]``, ``K, V [B, S_MAX, D]``, ``Out [B, D]``, fp32, contiguous. The kernel reads K and V in
    tiles of ``BLOCK_N`` positions with an online softmax.
    """
    _expect_kernel(kernel)
    scale = 1 / math.sqrt(ONLINE_D)
    for growing in (True, False):
        q, k, v, lens = _online_case(9 if growing else 10, growing)
        out = torch.full_like(q, float("nan"))
        _launch("online_decode_kernel", kernel, (q.shape[0],), q, k, v, lens, out, scale,
                S_MAX=ONLINE_S, BLOCK_N=ONLINE_BLOCK_N, D=ONLINE_D)  # fmt: skip
        variants = _online_variants(q, k, v, lens, scale, ONLINE_BLOCK_N)
        if _close(out, variants["right"]):
            continue
        if not bool(torch.isfinite(out).all()):
            hint = ("The output has inf or NaN: exponentiate against the new maximum, p = exp(s - m_new), and rescale "
                    "by alpha = exp(m_old - m_new) <= 1 (the first tile has m_old = -inf, alpha = 0).")  # fmt: skip
        elif _close(out, variants["acc"]):
            hint = ("acc was summed under the old maximum: multiply it by alpha = exp(m_old - m_new) before adding "
                    "this tile's p @ v.")  # fmt: skip
        elif _close(out, variants["l"]):
            hint = "acc is rescaled but l is not: l = l * alpha + sum(p)."
        elif _close(out, variants["divide"]):
            hint = "acc holds an unnormalised sum: divide it by l at the end."
        else:
            hint = "Check the update order: m_new, alpha, p, then l and acc, then m = m_new."
        case = "scores that rise along the sequence" if growing else "random scores"
        raise ExerciseError(f"online_decode_kernel gives wrong outputs on {case} (seq_lens {lens.tolist()}). {hint}")
    return passed("the running max, sum and output are rescaled whenever a tile raises the maximum: one pass is exact.")


# ---------------------------------------------------------------------------------------------
# 3. The block-table offset
# ---------------------------------------------------------------------------------------------
PAGED_D = 16


def _paged_variants(case, block_size: int) -> dict[str, torch.Tensor]:
    """Attention with the K/V slots each typical addressing mistake reads (NaN where it reads a NaN slot)."""
    tables = case.block_tables.clamp_min(0).long()
    hkv, d = case.k_cache.shape[2:]
    flat_k, flat_v = case.k_cache.reshape(-1, hkv, d), case.v_cache.reshape(-1, hkv, d)
    group = case.q.shape[1] // hkv
    slots_of = {
        "right": lambda b, n: tables[b, n // block_size] * block_size + n % block_size,
        "contiguous": lambda b, n: n,
        "no_offset": lambda b, n: tables[b, n // block_size] * block_size,
        "unscaled": lambda b, n: tables[b, n // block_size] + n % block_size,
        "row0": lambda b, n: tables[0, n // block_size] * block_size + n % block_size,
    }
    out = {}
    for name, slots in slots_of.items():
        rows = []
        for b, n in enumerate(case.seq_lens.tolist()):
            idx = slots(b, torch.arange(n)).clamp(max=flat_k.shape[0] - 1)
            k = flat_k[idx].repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, n, D]
            v = flat_v[idx].repeat_interleave(group, dim=1).transpose(0, 1)
            rows.append(_softmax_attention(case.q[b], k, v, 1 / math.sqrt(d)))
        out[name] = torch.stack(rows)
    return out


def check_paged_offsets(kernel) -> bool:
    """``paged_decode_kernel(Q, K_cache, V_cache, Block_tables, Seq_lens, Out, scale, stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_bt, GROUP, BLOCK_SIZE, BLOCK_N, D)``, grid ``(B, Hq)``.

    ``Q, Out [B, Hq, D]``; ``K_cache, V_cache [num_blocks, BLOCK_SIZE, Hkv, D]`` with strides
    ``stride_kb, stride_kt, stride_kh, 1``; ``Block_tables`` int32 ``[B, max_blocks]``; fp32 data.
    """
    _expect_kernel(kernel)
    for seed, block_size, nan in ((1, 4, False), (2, 16, False), (3, 1, True), (4, 8, True)):
        # Sequence 0 is the longest, so even a kernel that reads row 0 for everyone stays inside the table.
        case = random_paged_case(seed, [40, 21, 3], num_q_heads=4, num_kv_heads=2, head_dim=PAGED_D,
                                 block_size=block_size, spare_blocks=6)  # fmt: skip
        if not nan:  # unused slots hold stale numbers first (so a wrong address gives a wrong number, not NaN)
            g = torch.Generator().manual_seed(seed)
            for cache in (case.k_cache, case.v_cache):
                stale = torch.isnan(cache)
                cache[stale] = torch.randn(int(stale.sum()), generator=g) * 3
        q = case.q
        out = torch.full_like(q, float("nan"))
        k_cache, v_cache, tables = case.k_cache, case.v_cache, case.block_tables
        _launch("paged_decode_kernel", kernel, (q.shape[0], q.shape[1]), q, k_cache, v_cache, tables, case.seq_lens,
                out, 1 / math.sqrt(PAGED_D), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
                k_cache.stride(2), tables.stride(0), GROUP=2, BLOCK_SIZE=block_size, BLOCK_N=16, D=PAGED_D)  # fmt: skip
        want = paged_decode_attention_ref(q, k_cache, v_cache, tables, case.seq_lens)
        if _close(out, want):
            continue
        where = f"blocks of {block_size}, seq_lens {case.seq_lens.tolist()}"
        if nan:
            raise ExerciseError(f"paged_decode_kernel reads unused slots ({where}): NaN reached the output. "
                                "Load only positions n < seq_len, through the block table.")  # fmt: skip
        variants = _paged_variants(case, block_size)
        hints = {
            "contiguous": "You read slot n as if the pool were one contiguous cache: look up the physical block "
                          "block_tables[b, n // BLOCK_SIZE] first.",
            "no_offset": "Every position of a block reads the block's first slot: add the offset (n % BLOCK_SIZE) "
                         "times the token stride.",
            "unscaled": "A block id counts blocks, not tokens: multiply it by the block stride (stride_kb), not the "
                        "token stride.",
            "row0": "Every sequence reads sequence 0's table: row b of Block_tables starts at b * stride_bt.",
        }  # fmt: skip
        fallback = "The address of position n is block * stride_kb + (n % BLOCK_SIZE) * stride_kt + kv_head * stride_kh."
        hint = next((h for name, h in hints.items() if _close(out, variants[name])), fallback)
        raise ExerciseError(f"paged_decode_kernel gives wrong outputs ({where}). {hint}")
    return passed("position n of sequence b lives at block_tables[b, n // BLOCK_SIZE] * stride_kb + "
                  "(n % BLOCK_SIZE) * stride_kt: the slot mapping, inside the kernel.")  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 4. Bytes a decode step reads
# ---------------------------------------------------------------------------------------------
def kv_bytes(seq_lens: list[int], num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """Reference: bytes of K and V one decode step reads in one layer."""
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * bytes_per_value


def check_kv_bytes(fn: Callable[[list[int], int, int, int], int]) -> bool:
    """``fn(seq_lens, num_kv_heads, head_dim, bytes_per_value)``: bytes of K and V one layer's decode step reads."""
    cases = [([512], 8, 128, 2), ([100, 2000, 7], 8, 128, 2), ([4096] * 32, 8, 128, 1), ([1, 1], 3, 64, 4),
             ([300, 40], 1, 256, 2)]  # fmt: skip
    for seq_lens, hkv, d, nbytes in cases:
        got = call_learner("fn", fn, list(seq_lens), hkv, d, nbytes)
        want = kv_bytes(seq_lens, hkv, d, nbytes)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            raise ExerciseError(f"fn should return a number of bytes, got {type(got).__name__}")
        if got == want:
            continue
        if got == want // 2:
            hint = "Both K and V are read: twice the bytes of K alone."
        elif got == 2 * len(seq_lens) * max(seq_lens) * hkv * d * nbytes:
            hint = "Each sequence reads its own seq_len, not the longest one: sum the lengths."
        elif got == want * 8 or got == want * 4:
            hint = "bytes_per_value is already in bytes (2 for fp16): do not multiply by 8 bits or by 4 bytes of fp32."
        else:
            hint = "Count tokens x KV heads x head_dim x bytes per value, for K and for V."
        raise ExerciseError(f"fn({seq_lens if len(seq_lens) < 5 else '[...]'}, {hkv}, {d}, {nbytes}) = {got!r} is "
                            f"not right. {hint}")  # fmt: skip
    t4 = 32 * kv_bytes([4096] * 32, 8, 128, 2) / 320e9
    return passed(f"32 layers x 32 sequences x 4096 tokens of Llama-3-8B's fp16 K/V is "
                  f"{32 * kv_bytes([4096] * 32, 8, 128, 2) / 1e9:.1f} GB a step: at least {t4 * 1e3:.0f} ms on a "
                  "T4 (320 GB/s), whatever the kernel.")  # fmt: skip

