"""Checks for chapter 5, *Triton kernels*. Three warm-ups hand the learner a broken kernel to fix, two ask for a
whole kernel from its signature, one counts bytes.

1. :func:`check_masked_decode` -- a decode kernel that reads past ``seq_len``: add the masks.
2. :func:`check_online_softmax` -- a tiled decode kernel whose running sums are not all rescaled.
3. :func:`check_paged_offsets` -- a paged kernel that computes the wrong address from the block table.
4. :func:`check_merge_splits` -- split-KV's stage 2, written whole: merge partial outputs by their log-sum-exps.
5. :func:`check_tiled_decode` -- a GQA decode kernel written whole: a loop over tiles, an online softmax, masks.
6. :func:`check_kv_bytes` -- bytes of K and V one decode step reads, and so its fastest possible time.
7. :func:`check_int8_speedup` -- the int8 kernel's speed-up over fp16 that the roofline predicts from the bytes.

Each kernel check launches the learner's ``@triton.jit`` kernel (with the signature the exercise gives)
on hidden cases seeded from the check's ``seed`` argument, and compares it with torch. The kernels that take
strides get tensors laid out more than one way (views with padding, token-major or head-major, K and V side by
side in one buffer), so a kernel that hard-codes a packed layout is caught. Wrong outputs are
compared with the typical mistakes, computed in torch (:class:`~kvcourse.exercises._core.Diagnosis`),
to say which one they look like. The cases are drawn and answered on the CPU, then copied to where
kernels run (:func:`~kvcourse.kernels.triton_runtime.kernel_device`): compiled on a GPU, or, without
one, in Triton's interpreter on the CPU.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import warnings
from collections.abc import Callable

import numpy as np
import torch

from ..kernels.online_softmax import online_softmax_attention
from ..kernels.reference import paged_decode_attention_ref
from ..kernels.roofline import GPU_PEAKS, decode_attention_bytes, int8_speedup_bound
from ..kernels.testing import random_paged_case
from ..kernels.triton_runtime import kernel_device, triton  # settles where kernels run before the learner's launch
from ._core import CheckResult, Diagnosis, ExerciseError, call_learner, check, describe, diagnose, fail, handed
from ._core import hidden_generator, hidden_rng, on_host, passed, same, tensor_diff

__all__ = [
    "check_int8_speedup",
    "check_kv_bytes",
    "check_masked_decode",
    "check_merge_splits",
    "check_online_softmax",
    "check_paged_offsets",
    "check_tiled_decode",
]


def _expect_kernel(kernel: object, name: str) -> None:
    if not (callable(getattr(kernel, "__getitem__", None)) and hasattr(kernel, "fn")):
        raise ExerciseError(
            f"pass the @triton.jit kernel {name} itself (not called, not a string), got {type(kernel).__name__}"
        )


def _launch(name: str, kernel, grid: tuple[int, ...], *args, inputs: tuple[str, ...] = (), **constexprs) -> None:
    """Launch the learner's kernel on ``args`` (tensors already where kernels run).

    The first ``len(inputs)`` arguments are the kernel's inputs, named by ``inputs``: they are copies (the
    expected answer was computed from the originals before the launch), and a kernel that writes into
    one is refused, naming it, even where the output happens to come out right.
    """
    before = [a.clone() for a in args[: len(inputs)]]

    def run():
        # A wrong kernel may overflow, or reduce a tile of NaN it should not have read (the interpreter's NumPy
        # warns "All-NaN slice"): the check reports the wrong output, NumPy need not.
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            try:
                kernel[grid](*args, **constexprs)
            except Exception as exc:  # the interpreter wraps what a kernel raises; a stub's "not written yet" shows
                if isinstance(exc.__cause__, NotImplementedError):
                    raise exc.__cause__ from None
                if "Raise" in str(exc) and "NotImplementedError" in str(getattr(kernel, "src", "")):
                    # Compiled, a stub does not even compile (Triton has no `raise`): it is still a stub.
                    raise NotImplementedError("the kernel's body is still the stub's raise") from None
                raise

    call_learner(getattr(getattr(kernel, "fn", None), "__name__", name), run)  # the learner's own kernel name
    for arg_name, was, now in zip(inputs, before, args):
        if not torch.equal(was.isnan(), now.isnan()) or not torch.equal(was.nan_to_num(), now.nan_to_num()):
            fail(
                f"{name}'s input {arg_name}",
                expected="left as it was (a kernel reads its inputs)",
                got=f"changed at {int(((was != now) & ~(was.isnan() & now.isnan())).sum())} positions",
                hint=f"Store only into the output: a tl.store to {arg_name} overwrites the caller's data.",
            )


def _same(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> bool:
    """Equal within ``tol``, NaN where the other has NaN (a typical mistake may read NaN padding too)."""
    return got.shape == want.shape and torch.allclose(got.double(), want.double(), rtol=tol, atol=tol, equal_nan=True)


def _right(got: torch.Tensor, want: torch.Tensor) -> bool:
    return bool(torch.isfinite(got).all()) and _same(got, want)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per row: ``q [..., D]``, ``k, v [..., S, D]`` -> ``[..., D]``, in float64."""
    s = torch.einsum("...d,...sd->...s", q.double(), k.double()) * scale
    return torch.einsum("...s,...sd->...d", torch.softmax(s, dim=-1), v.double())


def _on_kernel_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Copies of hidden-case tensors where this process's kernels run, for the learner's kernel to read and write.

    A strided view is copied with its whole buffer and rebuilt with the same strides and offset: a plain copy
    would pack it, and the layout the case was drawn to test (padding, interleaving) would be gone.
    """
    device = kernel_device()
    return [handed(_buffer(t), device).as_strided(t.shape, t.stride(), t.storage_offset()) for t in tensors]


def _buffer(t: torch.Tensor) -> torch.Tensor:
    """The whole buffer under ``t`` (every element of its storage), as a flat tensor sharing it."""
    return t.as_strided((t.untyped_storage().nbytes() // t.element_size(),), (1,), 0)


def _laid_out(t: torch.Tensor, order: tuple[int, ...], pad: int, fill: torch.Tensor | float) -> torch.Tensor:
    """A view holding ``t``'s values whose dimensions are stored outermost first in ``order`` (the last dimension
    stays last and contiguous), each innermost row followed by ``pad`` elements that belong to no position.

    ``fill`` (a tensor of the buffer's shape, or a number) is what those elements hold: stale numbers, so a kernel
    that reads them by a hard-coded layout gets a wrong number rather than a crash.
    """
    shape = [t.shape[i] for i in order]
    shape[-1] += pad
    if isinstance(fill, torch.Tensor):
        buf = fill.reshape(shape).to(t.dtype)
    else:
        buf = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    view = buf[..., : t.shape[-1]].permute([order.index(i) for i in range(t.dim())])
    view.copy_(t)
    return view


def _stale(gen: torch.Generator, t: torch.Tensor, order: tuple[int, ...], pad: int) -> torch.Tensor:
    """Stale numbers for the buffer :func:`_laid_out` makes for ``t``."""
    size = math.prod(t.shape[i] for i in order[:-1]) * (t.shape[-1] + pad)
    return torch.randn(size, generator=gen, device="cpu") * 3


def _interleaved(k: torch.Tensor, v: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as two views of one buffer, side by side at dimension ``dim`` (FlashInfer keeps its paged pool as
    ``[num_blocks, 2, block_size, H, D]``): neither is contiguous, both have the same strides."""
    both = torch.stack([k, v], dim=dim)
    return both.select(dim, 0), both.select(dim, 1)


def _restrided(t: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """``t``'s buffer read with other strides: what a kernel that hard-codes a layout reads."""
    return t.as_strided(t.shape, stride, t.storage_offset())


def _stored_as(values: torch.Tensor, out: torch.Tensor, stride: tuple[int, ...]) -> torch.Tensor:
    """What ``out`` (a NaN-filled buffer's view) holds after a kernel stores ``values`` with ``stride`` instead of
    its own strides (nothing else in the buffer written)."""
    buf = torch.full_like(_buffer(out), float("nan"), dtype=values.dtype)
    buf.as_strided(out.shape, stride, out.storage_offset()).copy_(values)
    return buf.as_strided(out.shape, out.stride(), out.storage_offset())


def _nan_laid_out_as(t: torch.Tensor) -> torch.Tensor:
    """An output buffer with ``t``'s layout (its strides and its padding), all NaN."""
    return torch.full_like(_buffer(t), float("nan")).as_strided(t.shape, t.stride(), t.storage_offset())


def _per_sequence(q, k, v, lens, scale, extra: int = 0) -> torch.Tensor:
    """Attention of row ``b`` over its first ``lens[b] + extra`` positions (never beyond the cache)."""
    return torch.stack([_attend(q[b], k[b, : n + extra], v[b, : n + extra], scale) for b, n in enumerate(lens)])


# ---------------------------------------------------------------------------------------------
# 1. The missing mask
# ---------------------------------------------------------------------------------------------
MASK_BLOCK_S, MASK_D = 64, 16


@check("ch05.check_masked_decode")
def check_masked_decode(kernel, seed: int = 0) -> CheckResult:
    """``masked_decode_kernel(Q, K, V, Seq_lens, Out, scale, BLOCK_S, D)``, grid ``(B,)``.

    ``Q [B, D]``, ``K, V [B, BLOCK_S, D]`` (sequence ``b`` owns the first ``Seq_lens[b]`` slots),
    ``Out [B, D]``, all fp32 and contiguous. Slots past ``seq_len`` hold stale numbers, then NaN.
    """
    _expect_kernel(kernel, "masked_decode_kernel")
    rng, gen = hidden_rng(), hidden_generator()
    scale = 1 / math.sqrt(MASK_D)

    def pad_mask(lens):  # [B, BLOCK_S, 1]: True where the slot belongs to the sequence (on the host, as the cases)
        return (torch.arange(MASK_BLOCK_S, device="cpu")[None, :] < torch.tensor(lens, device="cpu")[:, None])[
            ..., None
        ]

    def scores_only(q, k, v, lens):  # scores masked to -inf, V loaded whole: 0 x NaN is NaN
        s = torch.einsum("bd,bsd->bs", q.double(), torch.where(pad_mask(lens), k, 0.0).double()) * scale
        p = torch.softmax(s.masked_fill(~pad_mask(lens)[..., 0], float("-inf")), dim=-1)
        return torch.einsum("bs,bsd->bd", p, v.double())

    def loads_only(q, k, v, lens):  # padding loaded as 0, its scores of 0 still weighted
        return _attend(q, torch.where(pad_mask(lens), k, 0.0), torch.where(pad_mask(lens), v, 0.0), scale)

    diagnosis = Diagnosis([
        ("Correct on stale padding, but NaN padding leaks into the output: a probability of 0 times NaN is still NaN. "
         "Mask the loads of K and V (mask=n < seq_len, other=0.0), not only the scores.", scores_only),
        ("Masked loads return 0, and a score of 0 still gets weight exp(0 - max) in the softmax: set the scores of "
         "masked positions to -inf (tl.where).", loads_only),
        ("One slot too many: sequence b owns positions 0 .. seq_len - 1, so the mask is n < seq_len.",
         lambda q, k, v, lens: _per_sequence(q, k, v, lens, scale, extra=1)),
        ("The output attends to all BLOCK_S slots: positions n >= seq_len must be masked, in the loads and in the scores.",
         lambda q, k, v, lens: _attend(q, k, v, scale)),
    ], "Compare with softmax attention over each sequence's first seq_len slots: check the mask, the max and the "
       "final division.", _same)  # fmt: skip
    lens_sets = [[1, 5, 33, MASK_BLOCK_S, 50]]
    lens_sets += [[rng.randint(1, MASK_BLOCK_S) for _ in range(rng.randint(2, 5))] for _ in range(2)]
    for lens in lens_sets:
        for pad in ("stale", "nan"):
            q = torch.randn(len(lens), MASK_D, generator=gen, device="cpu") * 2
            k = torch.randn(len(lens), MASK_BLOCK_S, MASK_D, generator=gen, device="cpu")
            v = torch.randn(len(lens), MASK_BLOCK_S, MASK_D, generator=gen, device="cpu")
            outside = ~pad_mask(lens)
            k = torch.where(outside, k * 3 if pad == "stale" else float("nan"), k)
            v = torch.where(outside, v if pad == "stale" else float("nan"), v)
            want = _per_sequence(q, k, v, lens, scale)
            seq_lens = torch.tensor(lens, dtype=torch.int32, device="cpu")
            out = torch.full_like(q, float("nan"))
            args = _on_kernel_device(q, k, v, seq_lens, out)
            _launch(
                "masked_decode_kernel",
                kernel,
                (len(lens),),
                *args,
                scale,
                inputs=("Q", "K", "V", "Seq_lens"),
                BLOCK_S=MASK_BLOCK_S,
                D=MASK_D,
            )
            out = on_host(args[-1])
            if not _right(out, want):
                diagnosis.record(f"masked_decode_kernel with seq_lens {lens}, {pad} padding", (q, k, v, lens), out, want,
                                 extra=f"; {tensor_diff(out, want)}")  # fmt: skip
    diagnosis.raise_if_wrong()
    return passed("positions past seq_len are neither loaded nor weighted: stale data and NaN cannot leak in.")


# ---------------------------------------------------------------------------------------------
# 2. The online softmax rescale
# ---------------------------------------------------------------------------------------------
ONLINE_BLOCK_N, ONLINE_D, ONLINE_S = 16, 16, 80


def _online(q, k, v, lens, scale, mistake: str = "", block_n: int = ONLINE_BLOCK_N) -> torch.Tensor:
    """What the tiled loop computes (float64), right or with one typical mistake."""
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        m, l, acc = -math.inf, 0.0, torch.zeros(q.shape[1], dtype=torch.float64, device=q.device)
        for start in range(0, n, block_n):
            s = (k[b, start : min(start + block_n, n)].double() @ q[b].double()) * scale
            m_new = max(m, float(s.max()))
            alpha = math.exp(m - m_new)
            p = torch.exp(s - m_new)
            l = (l if mistake == "l" else l * alpha) + float(p.sum())
            acc = (acc if mistake == "acc" else acc * alpha) + p @ v[b, start : min(start + block_n, n)].double()
            m = m_new
        out[b] = acc if mistake == "divide" else acc / l
    return out


@check("ch05.check_online_softmax")
def check_online_softmax(kernel, seed: int = 0) -> CheckResult:
    """``online_decode_kernel(Q, K, V, Seq_lens, Out, scale, S_MAX, BLOCK_N, D)``, grid ``(B,)``.

    ``Q [B, D]``, ``K, V [B, S_MAX, D]``, ``Out [B, D]``, fp32, contiguous. The kernel reads K and V in
    tiles of ``BLOCK_N`` positions with an online softmax.
    """
    _expect_kernel(kernel, "online_decode_kernel")
    rng, gen = hidden_rng(), hidden_generator()
    scale = 1 / math.sqrt(ONLINE_D)
    diagnosis = Diagnosis([
        ("The output has inf or NaN: exponentiate against the new maximum, p = exp(s - m_new), and rescale by "
         "alpha = exp(m_old - m_new), which is at most 1 (0 for the first tile, where m_old = -inf).",
         lambda q, k, v, lens: torch.full(q.shape, float("nan"), dtype=torch.float64, device=q.device)),
        ("acc was summed under the old maximum: multiply it by alpha = exp(m_old - m_new) before adding this tile's "
         "p @ v.", lambda q, k, v, lens: _online(q, k, v, lens, scale, "acc")),
        ("acc is rescaled but l is not: l = l * alpha + sum(p).", lambda q, k, v, lens: _online(q, k, v, lens, scale, "l")),
        ("acc holds an unnormalised sum: divide it by l at the end.",
         lambda q, k, v, lens: _online(q, k, v, lens, scale, "divide")),
    ], "Check the update order: m_new, alpha, p, then l and acc, then m = m_new.",
        lambda got, want: _same(torch.nan_to_num(got, nan=math.nan, posinf=math.nan, neginf=math.nan), want))  # fmt: skip
    lens_sets = [[5, 16, 40, 80, 33]] + [[rng.randint(1, ONLINE_S) for _ in range(4)] for _ in range(2)]
    for lens in lens_sets:
        for growing in (True, False):
            q = torch.randn(len(lens), ONLINE_D, generator=gen, device="cpu")
            k = torch.randn(len(lens), ONLINE_S, ONLINE_D, generator=gen, device="cpu")
            v = torch.randn(len(lens), ONLINE_S, ONLINE_D, generator=gen, device="cpu")
            if growing:  # scores rise along the sequence: every new tile raises the running maximum
                rise = torch.arange(ONLINE_S, device="cpu")[None, :, None] * 0.15
                k += rise * q[:, None, :] / q.norm(dim=1)[:, None, None]
            want = _online(q, k, v, lens, scale)
            out = torch.full_like(q, float("nan"))
            args = _on_kernel_device(q, k, v, torch.tensor(lens, dtype=torch.int32, device="cpu"), out)
            _launch("online_decode_kernel", kernel, (len(lens),), *args, scale, inputs=("Q", "K", "V", "Seq_lens"),
                    S_MAX=ONLINE_S, BLOCK_N=ONLINE_BLOCK_N, D=ONLINE_D)  # fmt: skip
            out = on_host(args[-1])
            if not _right(out, want):
                kind = "scores rising along the sequence" if growing else "random scores"
                diagnosis.record(f"online_decode_kernel with seq_lens {lens}, {kind}", (q, k, v, lens), out, want,
                                 extra=f"; {tensor_diff(out, want)}")  # fmt: skip
    diagnosis.raise_if_wrong()
    return passed("the running max, sum and output are rescaled whenever a tile raises the maximum: one pass is exact.")


# ---------------------------------------------------------------------------------------------
# 3. The block-table offset
# ---------------------------------------------------------------------------------------------
PAGED_D = 16


def _read_as(case, rows_of: Callable, head_stride: int | None = None, q: torch.Tensor | None = None) -> torch.Tensor:
    """Attention computed as a kernel reads the pool: position ``n`` of sequence ``b``, KV head ``h``, at element
    ``rows_of(tables, b, n, stride_kb, stride_kt) + h * head_stride + d`` of the pool's buffer (``head_stride``
    defaults to ``stride_kh``), the query ``q`` (default ``case.q``). NaN where that reads a NaN slot.
    """
    tables = case.block_tables.clamp_min(0).long()
    hkv, d = case.k_cache.shape[2:]
    stride_kb, stride_kt, stride_kh = case.k_cache.stride()[:3]
    heads = torch.arange(hkv, device="cpu") * (stride_kh if head_stride is None else head_stride)
    q = case.q if q is None else q
    group = q.shape[1] // hkv
    rows = []
    for b, n in enumerate(case.seq_lens.tolist()):
        row = rows_of(tables, b, torch.arange(n, device="cpu"), stride_kb, stride_kt)
        offsets = row[:, None, None] + heads[None, :, None] + torch.arange(d, device="cpu")  # [n, Hkv, D]
        k, v = (
            _buffer(c)[(c.storage_offset() + offsets).clamp(0, _buffer(c).numel() - 1)]
            .repeat_interleave(group, dim=1)
            .transpose(0, 1)  # [Hq, n, D]
            for c in (case.k_cache, case.v_cache)
        )
        rows.append(_attend(q[b], k, v, 1 / math.sqrt(d)))
    return torch.stack(rows)


@check("ch05.check_paged_offsets")
def check_paged_offsets(kernel, seed: int = 0) -> CheckResult:
    """``paged_decode_kernel(Q, K_cache, V_cache, Block_tables, Seq_lens, Out, scale, stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh, stride_bt, GROUP, BLOCK_SIZE, BLOCK_N, D)``, grid ``(B, Hq)``.

    ``Q, Out [B, Hq, D]`` with strides ``stride_qb, stride_qh, 1``; ``K_cache, V_cache [num_blocks, BLOCK_SIZE,
    Hkv, D]`` with strides ``stride_kb, stride_kt, stride_kh, 1`` (the same for both; the pool need not be one
    packed array); ``Block_tables`` int32 ``[B, max_blocks]``, rows ``stride_bt`` apart; fp32 data.
    """
    _expect_kernel(kernel, "paged_decode_kernel")
    rng = hidden_rng()
    hints = {
        "contiguous": "You read slot n as if the pool were one contiguous cache: look up the physical block "
        "block_tables[b, n // BLOCK_SIZE] first.",
        "no_offset": "Every position of a block reads the block's first slot: add the offset (n % BLOCK_SIZE) times "
        "the token stride.",
        "unscaled": "A block id counts blocks, not tokens: multiply it by the block stride (stride_kb), not by the "
        "token stride.",
        "row0": "Every sequence reads sequence 0's table: row b of Block_tables starts at b * stride_bt.",
        "packed_blocks": "Right while the pool is one packed [num_blocks, BLOCK_SIZE, Hkv, D] array, wrong here: "
        "block * BLOCK_SIZE * stride_kt is where a block starts only then. In a head-major pool, or "
        "one that keeps K and V side by side in each block, blocks are stride_kb elements apart: "
        "a block starts at block * stride_kb.",
        "head_by_d": "Right while each token's KV heads are packed, wrong here: KV head h starts h * stride_kh "
        "elements into the token's row, not h * D (a head-major pool, or padded rows).",
        "q_heads_by_d": "Right while Q and Out are packed [B, Hq, D], wrong here: query head h sits h * stride_qh "
        "elements into its row, not h * D (this Q's heads are padded). Step the heads of Q and Out "
        "by stride_qh.",
    }
    # How the pool and Q/Out are laid out in memory: the strides the kernel is given must be the ones it uses.
    pool_layouts = {
        "packed": None,
        "head-major": ((0, 2, 1, 3), 0),  # [num_blocks, Hkv, BLOCK_SIZE, D] underneath: stride_kt = D
        "padded rows": ((0, 1, 2, 3), 8),  # every head's D values followed by 8 unused ones
        "K and V side by side": 1,  # one [num_blocks, 2, BLOCK_SIZE, Hkv, D] buffer, as FlashInfer keeps it
    }
    layout_rng = hidden_rng("layout")
    filler = hidden_generator("layout")  # the layouts' unused elements
    cases = []
    for (block_size, nan), layout, padded in zip(
        ((4, False), (16, False), (1, True), (8, True))
        + tuple((rng.choice([2, 4, 8, 16]), rng.random() < 0.5) for _ in range(2)),
        ["head-major", "packed", "K and V side by side", "padded rows"] + layout_rng.sample(list(pool_layouts), 2),
        [False, False, True, True] + [layout_rng.random() < 0.5 for _ in range(2)],
    ):
        others = sorted((rng.randint(1, 39) for _ in range(rng.randint(1, 3))), reverse=True)
        # Sequence 0 is the longest, so even a kernel that reads row 0 for everyone stays inside the table.
        cases.append((block_size, nan, [40, *others], layout, padded))

    def make(block_size, nan, lens, case_seed):
        case = random_paged_case(case_seed, lens, num_q_heads=4, num_kv_heads=2, head_dim=PAGED_D,
                                 block_size=block_size, spare_blocks=6, device="cpu")  # fmt: skip
        if not nan:  # unused slots hold stale numbers (a wrong address then gives a wrong number, not NaN)
            g = torch.Generator(device="cpu").manual_seed(case_seed)
            for cache in (case.k_cache, case.v_cache):
                stale = torch.isnan(cache)
                cache[stale] = torch.randn(int(stale.sum()), generator=g, device="cpu") * 3
        return case

    def lay_out(case, layout: str, padded: bool):
        """The case with its pool laid out as ``layout`` and, if ``padded``, Q's heads and the table's rows padded."""
        k, v = case.k_cache, case.v_cache
        how = pool_layouts[layout]
        if isinstance(how, int):
            k, v = _interleaved(k, v, how)
        elif how:
            k, v = (_laid_out(t, *how, _stale(filler, t, *how)) for t in (k, v))
        q, tables = case.q, case.block_tables
        if padded:  # Q's heads 8 elements apart (so are Out's), the table's rows 3 entries apart
            q = _laid_out(q, (0, 1, 2), 8, _stale(filler, q, (0, 1, 2), 8))
            tables = _laid_out(tables, (0, 1), 3, -1)
        return dataclasses.replace(case, q=q, k_cache=k, v_cache=v, block_tables=tables)

    def variant(name):
        """What a kernel with mistake ``name`` computes for a case (``right`` for the others' addresses)."""

        def compute(case, bs):
            def row(t, b, n, skb, skt):  # the element offset of position n's token row in the pool
                block = t[0 if name == "row0" else b, n // bs]
                return {"contiguous": n * skt, "no_offset": block * skb, "unscaled": (block + n % bs) * skt,
                        "packed_blocks": (block * bs + n % bs) * skt}.get(name, block * skb + n % bs * skt)  # fmt: skip

            if name == "q_heads_by_d":
                by_d = (case.q.stride(0), PAGED_D, 1)
                return _stored_as(_read_as(case, row, q=_restrided(case.q, by_d)), case.q, by_d)
            return _read_as(case, row, head_stride=PAGED_D if name == "head_by_d" else None)

        return compute

    diagnosis = Diagnosis(
        [(hint, variant(name)) for name, hint in hints.items()],
        "The address of position n is block * stride_kb + (n % BLOCK_SIZE) * stride_kt "
        "+ kv_head * stride_kh, with block = Block_tables[b * stride_bt + n // BLOCK_SIZE].",
        _same,
    )
    for i, (block_size, nan, lens, layout, padded) in enumerate(cases):
        case = make(block_size, nan, lens, rng.randrange(2**31) + i)
        want = paged_decode_attention_ref(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens)
        case = lay_out(case, layout, padded)
        args = _on_kernel_device(
            case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, _nan_laid_out_as(case.q)
        )
        _launch("paged_decode_kernel", kernel, case.q.shape[:2], *args, 1 / math.sqrt(PAGED_D), *case.q.stride()[:2],
                *case.k_cache.stride()[:3], case.block_tables.stride(0), GROUP=2, BLOCK_SIZE=block_size, BLOCK_N=16,
                D=PAGED_D, inputs=("Q", "K_cache", "V_cache", "Block_tables", "Seq_lens"))  # fmt: skip
        out = on_host(args[-1])
        if not _right(out, want):
            what = (
                f"blocks of {block_size}, seq_lens {lens}, unused slots holding {'NaN' if nan else 'stale numbers'}"
                f", pool layout {layout} (strides {case.k_cache.stride()})"
            )
            what += f", Q and Out with padded heads (strides {case.q.stride()})" if padded else ""
            diagnosis.record(
                f"paged_decode_kernel with {what}", (case, block_size), out, want, extra=f"; {tensor_diff(out, want)}"
            )
    diagnosis.raise_if_wrong()
    return passed(
        "position n of sequence b lives at block_tables[b, n // BLOCK_SIZE] * stride_kb + "
        "(n % BLOCK_SIZE) * stride_kt: the slot mapping, inside the kernel, whatever the pool's "
        "layout."
    )


# ---------------------------------------------------------------------------------------------
# 4. Split-KV, stage 2: the merge
# ---------------------------------------------------------------------------------------------
MERGE_D, MERGE_HEADS = 16, 2


def _merge_case(gen, lens: list[int], num_splits: int, shift: float):
    """Stage 1's results for ``len(lens)`` sequences x MERGE_HEADS heads, as the merge kernel receives them.

    Returns ``(partial, lse, want_out, want_lse, rows)``: fp32 buffers ``partial [rows + spare, num_splits, D]`` and
    ``lse [rows + spare, num_splits]`` (spare rows of NaN: buffers are sized for a bigger batch, enough that a kernel
    reading rows ``BLOCK_S`` splits apart stays inside them), and the float64 answer for the ``rows`` real rows.
    Split ``i`` of a sequence of ``n`` tokens covers positions ``i * ceil(n / num_splits) .. `` (the package's
    layout); an empty one has ``lse = -inf`` and a partial output never written (NaN). ``shift`` is added to every
    score: the answer does not move, every lse moves by it.
    """
    rows = len(lens) * MERGE_HEADS
    host = dict(dtype=torch.float64, device="cpu")
    allocated = max(rows + 1, -(-rows * triton.next_power_of_2(num_splits) // num_splits) + 1)
    partial = torch.full((allocated, num_splits, MERGE_D), float("nan"), **host)
    lse = torch.full((allocated, num_splits), float("nan"), **host)
    want_out = torch.empty(rows, MERGE_D, **host)
    want_lse = torch.empty(rows, **host)
    for b, n in enumerate(lens):
        q = torch.randn(MERGE_HEADS, MERGE_D, generator=gen, **host) * 1.5
        k = torch.randn(n, MERGE_D, generator=gen, **host)
        v = torch.randn(n, MERGE_D, generator=gen, **host)
        k[: n // 2] += 0.5 * q[0]  # the splits' log-sum-exps differ: the weights matter
        split_len = -(-n // num_splits)
        for i in range(num_splits):
            lo, hi = i * split_len, min((i + 1) * split_len, n)
            if lo >= hi:  # an empty split: stage 1 wrote lse = -inf and left its output slot alone
                lse[b * MERGE_HEADS : (b + 1) * MERGE_HEADS, i] = float("-inf")
                continue
            o, l = online_softmax_attention(q, k[lo:hi], v[lo:hi], tile=16)
            partial[b * MERGE_HEADS : (b + 1) * MERGE_HEADS, i] = o
            lse[b * MERGE_HEADS : (b + 1) * MERGE_HEADS, i] = l + shift
        out, l = online_softmax_attention(q, k, v, tile=64)
        want_out[b * MERGE_HEADS : (b + 1) * MERGE_HEADS] = out
        want_lse[b * MERGE_HEADS : (b + 1) * MERGE_HEADS] = l + shift
    return partial.float(), lse.float(), want_out, want_lse, rows


def _merge_as(partial, lse, rows, block_s, mistake: str = ""):
    """What a merge kernel computes (float64 unless the mistake is about float32's range), right or wrong.

    Returns ``(out [rows, D], lse [rows])``; ``None`` in place of a part the mistake does not touch.
    """
    num_splits = lse.shape[1]
    if mistake == "split_mask":  # lanes past NUM_SPLITS read on into the next row's splits
        flat_o, flat_l = partial.reshape(-1, MERGE_D), lse.reshape(-1)
        flat_o = torch.cat([flat_o, flat_o.new_full((block_s, MERGE_D), float("nan"))])
        flat_l = torch.cat([flat_l, flat_l.new_full((block_s,), float("nan"))])
        o = torch.stack([flat_o[r * num_splits : r * num_splits + block_s] for r in range(rows)]).double()
        l = torch.stack([flat_l[r * num_splits : r * num_splits + block_s] for r in range(rows)]).double()
    elif mistake == "row_stride":  # row r's splits looked for BLOCK_S splits apart: right for powers of two only
        flat_o, flat_l = partial.reshape(-1, MERGE_D), lse.reshape(-1)
        o = torch.stack([flat_o[r * block_s : r * block_s + num_splits] for r in range(rows)]).double()
        l = torch.stack([flat_l[r * block_s : r * block_s + num_splits] for r in range(rows)]).double()
    else:
        o, l = partial[:rows].double(), lse[:rows].double()
    empty = torch.isneginf(l)
    if mistake != "empty":
        o = torch.where(empty[..., None], 0.0, o)  # a right kernel never lets an empty split's slot in
    m = l.amax(dim=1, keepdim=True)
    if mistake == "no_max":  # exp of raw log-sum-exps, in float32 as the kernel computes it: overflow or underflow
        w = torch.exp(l.float())
        out = (w[..., None] * o.float()).sum(1) / w.sum(1, keepdim=True)
        return out.double(), torch.log(w.sum(1)).double()
    if mistake == "mean":
        w = (~empty).double()
        return (w[..., None] * o).sum(1) / w.sum(1, keepdim=True), None
    w = torch.exp2(l - m) if mistake == "exp2" else torch.exp(l - m)
    total = w.sum(1, keepdim=True)
    out = (w[..., None] * o).sum(1) / (1.0 if mistake == "unnormalised" else total)
    merged = (m + torch.log(total))[:, 0]
    if mistake == "lse_max":
        return None, m[:, 0]
    if mistake == "lse_sum":
        return None, torch.where(empty, 0.0, l).sum(1)
    if mistake in ("exp2", "unnormalised", "empty"):
        return out, None
    return out, merged


class _Merged(tuple):
    """A merge's two results, ``(out, lse)``, shown briefly in a failure message."""

    def __repr__(self) -> str:
        return f"Out {describe(self[0], limit=4)}; Out_lse {describe(self[1], limit=4)}"


@check("ch05.check_merge_splits")
def check_merge_splits(kernel, seed: int = 0) -> CheckResult:
    """``merge_splits_kernel(Partial, Lse, Out, Out_lse, NUM_SPLITS, BLOCK_S, D)``, grid ``(rows,)``.

    Row ``r`` (one sequence and query head) merges ``NUM_SPLITS`` partial results: ``Partial [>= rows, NUM_SPLITS, D]``
    (each split's output, normalised over its own positions) and ``Lse [>= rows, NUM_SPLITS]`` (their natural
    log-sum-exps, ``-inf`` for an empty split, whose output slot holds garbage). It writes ``Out [rows, D]`` and
    ``Out_lse [rows]``, the log-sum-exp of the whole row. ``BLOCK_S`` is ``NUM_SPLITS`` rounded up to a power of two.
    All fp32, contiguous.
    """
    _expect_kernel(kernel, "merge_splits_kernel")
    rng, gen = hidden_rng(), hidden_generator()

    def both(got, wrong):  # a mistake's None part is whatever the kernel wrote there
        return all(w is None or _same(g, w) for g, w in zip(got, wrong))

    diagnosis = Diagnosis([
        ("Some rows came out NaN where a split is empty: its weight is exp(-inf) = 0, but its output slot was never "
         "written, and 0 x NaN is NaN. Load an empty split's output as 0 (mask = lse > -inf), or tl.where it away.",
         lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "empty")),
        ("Lanes s >= NUM_SPLITS of the BLOCK_S-wide tile read the next row's splits: mask the loads with "
         "s < NUM_SPLITS (other=-inf for the lse, 0.0 for the outputs).",
         lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "split_mask")),
        ("Right until the log-sum-exps are large (or very negative): exp(lse) overflows float32 past 88. Subtract "
         "their maximum M first: w_i = exp(lse_i - M), which is at most 1.",
         lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "no_max")),
        ("Right when NUM_SPLITS is a power of two, wrong otherwise: row r's splits start r * NUM_SPLITS elements "
         "into Lse (r * NUM_SPLITS * D into Partial). BLOCK_S is the width of the tile you load, not the length of a "
         "row in memory.", lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "row_stride")),
        ("Every split got the same weight: a split's share of the row is its share of the softmax denominator, "
         "w_i = exp(lse_i - M), not 1 / (number of splits).", lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "mean")),
        ("The lse are natural logarithms (m + log l): weigh with tl.exp(lse_i - M), not tl.exp2 (the package's "
         "kernels keep theirs in log2 units, these are not).",
         lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "exp2")),
        ("Out is sum_i w_i o_i without the division: each partial output is already normalised over its split, so "
         "divide by sum_i w_i.", lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "unnormalised")),
        ("Out_lse is the maximum M alone: the whole row's log-sum-exp is M + log(sum_i exp(lse_i - M)).",
         lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "lse_max")),
        ("Out_lse adds the splits' log-sum-exps: logs of sums do not add. The row's denominator is the sum of the "
         "splits' denominators, so Out_lse = M + log(sum_i exp(lse_i - M)).",
         lambda p, l, rows, bs: _merge_as(p, l, rows, bs, "lse_sum")),
    ], "Merge with M = max_i lse_i and w_i = exp(lse_i - M): Out = sum_i w_i o_i / sum_i w_i, "
       "Out_lse = M + log(sum_i w_i); empty splits (lse = -inf) weigh nothing.", both)  # fmt: skip
    cases = [(4, [1, 37, 9], 0.0), (3, [2, 50, 5], 0.0), (5, [3, 21, 64], 0.0), (4, [30, 6, 47], 200.0),
             (3, [13, 1, 40], -200.0)]  # fmt: skip
    cases += [(rng.choice([2, 3, 4, 5, 6]), [rng.randint(1, 64) for _ in range(3)], 0.0)]
    for num_splits, lens, shift in cases:
        partial, lse, want_out, want_lse, rows = _merge_case(gen, lens, num_splits, shift)
        block_s = triton.next_power_of_2(num_splits)
        args = _on_kernel_device(partial, lse, torch.full((rows, MERGE_D), float("nan"), device="cpu"),
                                 torch.full((rows,), float("nan"), device="cpu"))  # fmt: skip
        _launch(
            "merge_splits_kernel",
            kernel,
            (rows,),
            *args,
            NUM_SPLITS=num_splits,
            BLOCK_S=block_s,
            D=MERGE_D,
            inputs=("Partial", "Lse"),
        )
        out, out_lse = on_host(args[2]), on_host(args[3])
        right = _right(out, want_out) and _right(out_lse, want_lse)
        if not right:
            what = f"{num_splits} splits of seq_lens {lens}" + (f", every score shifted by {shift:+g}" if shift else "")
            bad_out = not _right(out, want_out)
            got, want = (out, want_out) if bad_out else (out_lse, want_lse)
            diagnosis.record(f"merge_splits_kernel with {what} ({'Out' if bad_out else 'Out_lse'})",
                             (partial, lse, rows, block_s), _Merged((out, out_lse)), _Merged((want_out, want_lse)),
                             extra=f"; {tensor_diff(got, want)}")  # fmt: skip
    diagnosis.raise_if_wrong()
    return passed(
        "each split weighs exp(lse_i - M), its share of the softmax denominator: the merge is exact, "
        "empty splits and all."
    )


# ---------------------------------------------------------------------------------------------
# 5. A GQA decode kernel, tiled by the learner
# ---------------------------------------------------------------------------------------------
TILED_D, TILED_HKV, TILED_BLOCK_N = 16, 2, 16


def _tiled_as(q, k, v, lens, group, block_n, scale, mistake: str = "") -> torch.Tensor:
    """What a tiled GQA decode kernel computes, right or with one typical mistake, in float64: ``[B, Hq, D]``."""
    bsz, hq, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(bsz, hq, d, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        padded = -(-n // block_n) * block_n  # the positions the loop's tiles cover
        for h in range(hq):
            kv = h % hkv if mistake == "interleaved" else h // group
            qh, kb, vb = q[b, h].double(), k[b, kv].double(), v[b, kv].double()
            if mistake in ("acc", "l", "divide"):
                out[b, h] = _online(qh[None], kb[None], vb[None], [n], scale, mistake, block_n)[0]
                continue
            if mistake == "tail":  # whole tiles only: the ragged tail is never read
                n_read = n // block_n * block_n
                out[b, h] = _attend(qh, kb[:n_read], vb[:n_read], scale) if n_read else math.nan
                continue
            if mistake in ("no_mask", "loads_only", "scores_only"):
                kt, vt = kb[:padded].clone(), vb[:padded].clone()
                if mistake == "loads_only":  # masked loads give 0, and a score of 0 still counts
                    kt[n:], vt[n:] = 0.0, 0.0
                s = (kt @ qh) * scale
                if mistake == "scores_only":  # padding scores -inf, but V's padding is loaded: 0 x NaN
                    kt[n:] = 0.0
                    s = (kt @ qh) * scale
                    s[n:] = -math.inf
                out[b, h] = torch.softmax(s, 0) @ vt
                continue
            out[b, h] = _attend(qh, kb[:n], vb[:n], scale)
    return out


@check("ch05.check_tiled_decode")
def check_tiled_decode(kernel, seed: int = 0) -> CheckResult:
    """``tiled_decode_kernel(Q, K, V, Seq_lens, Out, scale, stride_qb, stride_qh, stride_kb, stride_kh, stride_ks,
    GROUP, BLOCK_N, D)``, grid ``(B, Hkv)``: one program per (sequence, KV head) for the ``GROUP`` query heads
    ``kv * GROUP .. kv * GROUP + GROUP - 1`` that read it.

    ``Q, Out [B, Hq, D]``, ``K, V [B, Hkv, S_MAX, D]`` (strides as named, shared by Q and Out and by K and V; only
    ``D`` is contiguous: the cases include token-major, padded and interleaved K/V, and Q/Out with padded heads), fp32;
    sequence ``b`` owns positions ``0 .. Seq_lens[b] - 1``, the slots after it hold stale numbers or NaN.
    """
    _expect_kernel(kernel, "tiled_decode_kernel")
    rng, gen = hidden_rng(), hidden_generator()
    scale = 1 / math.sqrt(TILED_D)

    def mistake(name):
        return lambda q, k, v, lens, group, block_n: _tiled_as(q, k, v, lens, group, block_n, scale, name)

    def keys_by_d(q, k, v, lens, group, block_n):  # positions TILED_D apart, whatever stride_ks says
        kd, vd = (_restrided(t, (*t.stride()[:2], TILED_D, 1)) for t in (k, v))
        return _tiled_as(q, kd, vd, lens, group, block_n, scale)

    def heads_by_d(q, k, v, lens, group, block_n):  # query heads TILED_D apart in Q and in Out
        by_d = (q.stride(0), TILED_D, 1)
        return _stored_as(_tiled_as(_restrided(q, by_d), k, v, lens, group, block_n, scale), q, by_d)

    diagnosis = Diagnosis([
        ("The loop reads whole tiles only, so the last Seq_len % BLOCK_N positions (and every sequence shorter than "
         "one tile) are dropped: loop over range(0, seq_len, BLOCK_N) and mask the last tile's lanes n >= seq_len.",
         mistake("tail")),
        ("NaN padding leaks into the output: a probability of 0 times a NaN value is NaN. Mask the loads of V (and K), "
         "not only the scores.", mistake("scores_only")),
        ("The last tile reads past seq_len: the slots there hold stale numbers or NaN. Mask the loads "
         "(mask=n < seq_len, other=0.0) and set those scores to -inf.", mistake("no_mask")),
        ("Masked loads return 0, and a score of 0 still gets weight exp(0 - m): set the scores of lanes n >= seq_len "
         "to -inf (tl.where).", mistake("loads_only")),
        ("acc was summed under the old maximum: multiply it by alpha = exp(m_old - m_new) before adding the tile's "
         "p @ v.", mistake("acc")),
        ("acc is rescaled but l is not: l = l * alpha + sum(p).", mistake("l")),
        ("acc holds an unnormalised sum: divide it by l at the end.", mistake("divide")),
        ("Query head h reads KV head h // GROUP: program kv serves the consecutive heads kv * GROUP + g, not "
         "kv + g * Hkv.", mistake("interleaved")),
        ("Right while K and V are packed [B, Hkv, S_MAX, D], wrong here: position n sits n * stride_ks elements "
         "into its head, not n * D. In a padded cache, a token-major one, or one with K and V side by side, "
         "stride_ks is not D: step the keys and values by stride_ks.", keys_by_d),
        ("Right while Q and Out are packed [B, Hq, D], wrong here: query head h sits h * stride_qh elements into "
         "its row, not h * D (this Q's heads are padded). Step the heads of Q and Out by stride_qh.", heads_by_d),
    ], "Compare with softmax attention of each query head over its KV head's first seq_len positions: check the "
       "pointers (stride_qb and stride_qh for Q and Out, stride_kb, stride_kh and stride_ks for K and V), the masks, "
       "and the update order m_new, alpha, p, l, acc.", _same)  # fmt: skip
    # How K/V and Q/Out are laid out in memory: the strides the kernel is given must be the ones it uses.
    kv_layouts = {
        "packed": None,
        "token-major": ((0, 2, 1, 3), 0),  # [B, S_MAX, Hkv, D] underneath: stride_ks = Hkv * D, stride_kh = D
        "padded rows": ((0, 1, 2, 3), 8),  # every position's D values followed by 8 unused ones
        "K and V side by side": 3,  # one [B, Hkv, S_MAX, 2, D] buffer: stride_ks = 2 * D
    }
    cases = [
        (2, 16, [1, 16, 17, 47], "nan", False, "packed", False),
        (4, 16, [33, 5, 48], "stale", True, "token-major", True),
        (1, 8, [9, 24, 3], "nan", True, "padded rows", False),
        (2, 8, [40, 8, 15], "stale", False, "K and V side by side", True),
    ]
    cases += [(rng.choice([1, 2, 4]), rng.choice([8, 16]), [rng.randint(1, 48) for _ in range(3)],
               rng.choice(["nan", "stale"]), rng.random() < 0.5, rng.choice(list(kv_layouts)),
               rng.random() < 0.5)]  # fmt: skip
    s_max = 48  # a multiple of every BLOCK_N: even an unmasked tile stays inside the cache
    filler = hidden_generator("layout")  # the layouts' unused elements
    for group, block_n, lens, pad, growing, kv_layout, padded_heads in cases:
        hq = TILED_HKV * group
        q = torch.randn(len(lens), hq, TILED_D, generator=gen, device="cpu")
        k = torch.randn(len(lens), TILED_HKV, s_max, TILED_D, generator=gen, device="cpu")
        v = torch.randn(len(lens), TILED_HKV, s_max, TILED_D, generator=gen, device="cpu")
        positions = torch.arange(s_max, device="cpu")
        if growing:  # scores rise along the sequence: later tiles raise the running maximum
            k += positions[None, None, :, None] * 0.1 * q[:, ::group, None, :] / TILED_D**0.5
        outside = (positions[None, :] >= torch.tensor(lens, device="cpu")[:, None])[:, None, :, None]
        k = torch.where(outside, k * 3 if pad == "stale" else float("nan"), k)
        v = torch.where(outside, v + 2 if pad == "stale" else float("nan"), v)
        want = _tiled_as(q, k, v, lens, group, block_n, scale)
        layout = kv_layouts[kv_layout]
        if isinstance(layout, int):
            k, v = _interleaved(k, v, layout)
        elif layout:
            k, v = (_laid_out(t, *layout, _stale(filler, t, *layout)) for t in (k, v))
        if padded_heads:  # Q's heads 8 elements apart, as Out's: stride_qh = D + 8
            q = _laid_out(q, (0, 1, 2), 8, _stale(filler, q, (0, 1, 2), 8))
        args = _on_kernel_device(q, k, v, torch.tensor(lens, dtype=torch.int32, device="cpu"), _nan_laid_out_as(q))
        _launch("tiled_decode_kernel", kernel, (len(lens), TILED_HKV), *args, scale, *q.stride()[:2], *k.stride()[:3],
                GROUP=group, BLOCK_N=block_n, D=TILED_D, inputs=("Q", "K", "V", "Seq_lens"))  # fmt: skip
        out = on_host(args[-1])
        if not _right(out, want):
            what = f"GROUP={group}, BLOCK_N={block_n}, seq_lens {lens}, {pad} padding" + (
                ", scores rising along the sequence" if growing else ""
            )
            what += f", K/V layout {kv_layout} (strides {k.stride()})"
            what += f", Q and Out with padded heads (strides {q.stride()})" if padded_heads else ""
            diagnosis.record(f"tiled_decode_kernel with {what}", (q, k, v, lens, group, block_n), out, want,
                             extra=f"; {tensor_diff(out, want)}")  # fmt: skip
    diagnosis.raise_if_wrong()
    return passed(
        "one program per KV head reads each tile once for its whole group; the online softmax rescales "
        "on every new maximum, and the ragged tail is masked in the loads and in the scores."
    )


# ---------------------------------------------------------------------------------------------
# 6. Bytes a decode step reads
# ---------------------------------------------------------------------------------------------
def _kv_bytes(seq_lens: list[int], num_kv_heads: int, head_dim: int, bytes_per_value: int) -> int:
    """Reference: bytes of K and V one decode step reads in one layer."""
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * bytes_per_value


def _a_byte_count(case: str, got, *_):
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        fail(case, expected="a number of bytes", got=type(got).__name__, hint="Return an int.")
    return got


def _lengths(lens: list[int]) -> str:
    return str(lens) if len(lens) < 5 else f"[{lens[0]}, ... {len(lens)} lengths]"


_KV_BYTES_MISTAKES = [
    ("Both K and V are read: twice the bytes of K alone.", lambda lens, h, d, nb: _kv_bytes(lens, h, d, nb) // 2),
    ("Each sequence reads its own seq_len, not the longest one: sum the lengths.",
     lambda lens, h, d, nb: 2 * len(lens) * max(lens) * h * d * nb),
    ("bytes_per_value is already in bytes (2 for fp16): do not multiply by 8 bits.",
     lambda lens, h, d, nb: 8 * _kv_bytes(lens, h, d, nb)),
    ("Every KV head stores its own K and V: multiply by num_kv_heads.", lambda lens, h, d, nb: _kv_bytes(lens, 1, d, nb)),
]  # fmt: skip


@check("ch05.check_kv_bytes", takes="fn(seq_lens, num_kv_heads, head_dim, bytes_per_value)")
def check_kv_bytes(fn: Callable[[list[int], int, int, int], int], seed: int = 0) -> CheckResult:
    """``fn(seq_lens, num_kv_heads, head_dim, bytes_per_value)``: bytes of K and V one layer's decode step reads."""
    rng = hidden_rng()
    cases = [([512], 8, 128, 2), ([100, 2000, 7], 8, 128, 2), ([4096] * 32, 8, 128, 1), ([1, 1], 3, 64, 4)]
    cases += [([rng.randint(1, 5000) for _ in range(rng.randint(2, 6))], rng.choice([1, 2, 4, 8]),
               rng.choice([64, 128, 256]), rng.choice([1, 2, 4])) for _ in range(4)]  # fmt: skip
    diagnose(
        fn,
        cases,
        label=lambda lens, hkv, d, nbytes: f"kv_bytes({_lengths(lens)}, {hkv}, {d}, {nbytes})",
        reference=_kv_bytes,
        mistakes=_KV_BYTES_MISTAKES,
        hint="Count tokens x KV heads x head_dim x bytes per value, for K and for V.",
        compare=operator.eq,
        returns=_a_byte_count,
    )
    # The chapter's scenario fits on one H100 SXM (80 GB): 17.2 GB of cache and 16.1 GB of fp16 weights.
    step = 32 * _kv_bytes([4096] * 32, 8, 128, 2)
    h100 = GPU_PEAKS["H100-SXM"]
    return passed(
        f"32 layers x 32 sequences x 4096 tokens of Llama-3-8B's fp16 K/V is {step / 1e9:.1f} GB a step: at "
        f"least {step / h100.bandwidth * 1e3:.1f} ms on an {h100.name} ({h100.bandwidth / 1e12:.2f} TB/s "
        f"vendor peak), whatever the kernel, before the weights are read."
    )


# --- Exercise 7: the speed-up the bytes promise ----------------------------------------------------------------------


def _int8_bytes_wrong(
    lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    bs: int,
    *,
    kv_scale: float = 4,
    q_int8: bool = False,
    tables: bool = True,
    q_out: bool = True,
) -> float:
    """fp16's bytes over int8's, counted with one typical slip."""
    fp16 = decode_attention_bytes(
        lens, hq, hkv, d, kv_bytes=2, q_bytes=2 if q_out else 0, block_size=bs if tables else None
    )
    int8 = decode_attention_bytes(lens, hq, hkv, d, kv_bytes=1, q_bytes=(1 if q_int8 else 2) if q_out else 0,
                                  scale_bytes=kv_scale, block_size=bs if tables else None)  # fmt: skip
    return fp16 / int8


_INT8_MISTAKES = [
    (
        "The scales are bytes too: each token's K and V carry one fp32 scale (4 bytes) per KV head, so int8 reads "
        "head_dim + 4 bytes where fp16 reads 2 * head_dim.",
        lambda *c: _int8_bytes_wrong(*c, kv_scale=0),
    ),
    (
        "Both K and V carry a scale: 4 bytes per token and KV head for K, and 4 more for V.",
        lambda *c: _int8_bytes_wrong(*c, kv_scale=2),
    ),
    (
        "Speed-up is fp16's time over int8's: fp16's bytes divided by int8's, a number above 1.",
        lambda *c: 1 / int8_speedup_bound(*c),
    ),
    (
        "Only the cache is int8: the query is read and the output written in fp16 by both kernels, 2 bytes a value.",
        lambda *c: _int8_bytes_wrong(*c, q_int8=True),
    ),
    (
        "The kernels also read the fp16 query and write the fp16 output (2 bytes a value, every query head of every "
        "sequence): at short contexts they are a large share of the bytes.",
        lambda *c: _int8_bytes_wrong(*c, q_out=False),
    ),
    (
        "Both kernels read the block table too: one int32 (4 bytes) per started block of each sequence.",
        lambda *c: _int8_bytes_wrong(*c, tables=False),
    ),
]


def _int8_cases(rng) -> list[tuple[list[int], int, int, int, int]]:
    cases = [([2048] * 32, 32, 8, 128, 16), ([1], 32, 8, 128, 16), ([7, 300, 65], 9, 3, 64, 16), ([100], 4, 4, 64, 1)]
    for _ in range(6):
        hkv = rng.choice([1, 2, 4, 8])
        cases.append(([rng.randint(1, 9000) for _ in range(rng.randint(1, 5))], hkv * rng.choice([1, 2, 4, 8]), hkv,
                      rng.choice([64, 128, 256]), rng.choice([1, 8, 16, 32])))  # fmt: skip
    return cases


def _a_speedup(case: str, got, *_):
    if isinstance(got, bool) or not isinstance(got, (int, float)):
        fail(case, expected="a speed-up (a number)", got=type(got).__name__, hint="Return a float.")
    return got


@check(
    "ch05.check_int8_speedup",
    takes="predict_speedup",
    references={"int8_speedup_bound": int8_speedup_bound},
    task="count the bytes yourself; decode_attention_bytes is allowed, the finished model is not.",
)
def check_int8_speedup(predict_speedup: Callable[[list[int], int, int, int, int], float], seed: int = 0) -> CheckResult:
    """``predict_speedup(seq_lens, num_q_heads, num_kv_heads, head_dim, block_size)``: the roofline's speed-up of the
    int8 paged decode kernel over the fp16 one, from the bytes each must move (the course's model:
    :func:`kvcourse.kernels.roofline.int8_speedup_bound`)."""
    diagnose(
        predict_speedup,
        _int8_cases(hidden_rng()),
        label=lambda lens, hq, hkv, d, bs: f"predict_speedup({_lengths(lens)}, {hq}, {hkv}, {d}, {bs})",
        reference=int8_speedup_bound,
        mistakes=_INT8_MISTAKES,
        hint="Count each kernel's bytes: K and V of every cached token and KV head (fp16: 2 bytes a value; int8: 1 "
        "byte a value plus a 4-byte scale per token and head), the fp16 query and output, the block-table entries; "
        "divide fp16's by int8's.",
        compare=lambda got, want: same(got, want, abs_tol=0.0),
        returns=_a_speedup,
    )
    big = int8_speedup_bound([2048] * 32, 32, 8, 128, 16)
    return passed(
        f"at 32 x 2,048 tokens of a Llama-3-8B layer the bytes promise int8 a {big:.2f}x speed-up, and "
        f"{int8_speedup_bound([1], 32, 8, 128, 16):.2f}x at one token: the roofline's bound, not a "
        "measurement."
    )
