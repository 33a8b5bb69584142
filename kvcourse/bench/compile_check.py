"""Compile chapter 5's kernels and a layer's fused ops for NVIDIA GPUs without one, and read what came out.

    TRITON_INTERPRET=0 python -m kvcourse.bench.compile_check [--quick] [--json report.json]

Triton compiles in three steps that need no GPU: Python -> Triton IR -> LLVM IR -> PTX (the
virtual ISA), then ``ptxas`` (shipped inside the triton wheel) turns the PTX into machine code
(a cubin) for one architecture. Only *loading* the cubin needs the driver. So on a CPU we can still
ask, for a T4 (sm_75), an A100 (sm_80) and an H100 (sm_90):

* does every kernel compile, with the launch parameters the wrappers really pick there?
* how many registers does a thread use, and does it **spill** (a stack frame in local memory: these
  kernels have no local arrays, so any stack is spilled registers, read back at memory speed)?
* how much shared memory does a block ask for, against the GPU's per-block limit?
* do the ``tl.dot``s become tensor-core instructions (``mma.sync``/``wgmma`` in the PTX) or plain
  fused multiply-adds (``fma``)?

How: the wrappers' launch functions (:func:`~kvcourse.kernels.triton_decode.decode`, :func:`~kvcourse.kernels.triton_paged.paged_decode`,
:func:`~kvcourse.kernels.triton_cache.reshape_and_cache`'s launch, :mod:`~kvcourse.kernels.triton_fused`'s ``_launch_*``) run on small
CPU tensors with each kernel's ``run`` replaced by a recorder (:func:`recorded_launches`); each
recorded launch goes through Triton's own argument binder and
``triton.compile(ASTSource(...), target=GPUTarget("cuda", cc, 32))``; the cubin's registers and stack
come from ``cuobjdump --dump-resource-usage`` (also in the wheel).

This uses Triton internals (``JITFunction.run``/``_pack_args``, ``create_function_from_signature``,
``ASTSource``, ``make_backend``, the bundled ``cuobjdump``), tested with the triton version pinned in
``constraints.txt`` (3.9.0). Another version may move them: :func:`check_triton_version` says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import torch

TESTED_TRITON = "3.9.0"  # the internals below were read in this version (constraints.txt pins it)


@dataclasses.dataclass(frozen=True)
class Target:
    """An NVIDIA GPU to compile for."""

    capability: int  # 75 = sm_75
    gpu: str
    num_sms: int  # streaming multiprocessors: choose_num_splits depends on them
    max_shared: int  # bytes of shared memory one block may use (the opt-in maximum)


TARGETS = (
    Target(75, "T4", 40, 64 * 1024),
    Target(80, "A100", 108, 163 * 1024),
    Target(90, "H100", 132, 227 * 1024),
)

# (q heads, kv heads, head dim) of the models whose launches must compile without spills.
NAMED_HEADS = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}
# Other GQA groups (1, 8) the sweep compiles and reports, at both head dims.
OTHER_HEADS = ((8, 8), (64, 8))

# A layer's small ops (:mod:`~kvcourse.kernels.triton_fused`), compiled at the shapes of the models named here:
# (hidden size, intermediate size, q heads, kv heads, head dim). RoPE rotates Q and K together (Hq + Hkv heads).
NAMED_LAYERS = {"SmolLM2-135M": (576, 1536, 9, 3, 64)}
FUSED_OPS = ("rms_norm", "embed_rms_norm", "fused_add_rms_norm", "rotary_embedding", "silu_and_mul")
# Every target compiles all three (a T4 has no bf16 arithmetic: what Triton makes of bf16 there is reported too).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FUSED_TOKENS = (1, 64, 2048)  # a decode step, a batch of decodes, a prefill chunk (only the grid depends on it)
# The kernels with tl.dot.
_ATTENTION_KERNELS = ("_decode_kernel", "_paged_decode_kernel", "_merge_splits_kernel", "_ragged_paged_kernel",
                      "_rope_cache_decode_kernel")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """One launch of one wrapper: what it runs on (the tensors are made small; the kernel sees the same)."""

    op: str  # "decode" | "paged" | "ragged" | "cache" | "rope_cache_decode", or one of FUSED_OPS
    dtype: torch.dtype  # the query's (or the new K/V's) dtype
    heads: tuple[int, int]  # (q heads, kv heads); the cache write sees only kv heads
    head_dim: int
    kv_int8: bool = False
    block_size: int = 16  # paged and cache
    num_splits: int = 1  # paged
    tokens: int = 1  # cache: new tokens written in one step; fused ops: rows (tokens) in the step
    width: int = 0  # fused ops: the row a norm reads (hidden size), or silu_and_mul's intermediate size
    tiles: tuple[int, int, int] | None = None  # (BLOCK_N, num_warps, num_stages) instead of tile_config's choice
    int8_conversion: str = "bits"  # paged int8: how the kernel converts (triton_paged.INT8_CONVERSIONS)
    kv_fp8: bool = False  # paged: an fp8 (e4m3) pool, compiled for sm_89 and later only

    @property
    def model(self) -> str | None:
        """Which named model's heads these are (spills fail only there), else None."""
        if self.op in FUSED_OPS:
            for name, (hidden, intermediate, hq, hkv, d) in NAMED_LAYERS.items():
                if self.op == "rotary_embedding":
                    if (self.heads, self.head_dim) == ((hq, hkv), d):
                        return name
                elif self.width == (intermediate if self.op == "silu_and_mul" else hidden):
                    return name
            return None
        for name, (hq, hkv, d) in NAMED_HEADS.items():
            if self.head_dim == d and self.heads[1] == hkv and (self.op == "cache" or self.heads[0] == hq):
                return name
        return None

    def describe(self) -> str:
        if self.op in FUSED_OPS:
            shape = {
                "rotary_embedding": f"heads={self.heads[0]}+{self.heads[1]} D={self.head_dim}",
                "silu_and_mul": f"intermediate={self.width}",
            }.get(self.op, f"hidden={self.width}")
            return f"{self.op} dtype={_dtype_name(self.dtype)} {shape} tokens={self.tokens}"
        kv = "int8" if self.kv_int8 else "fp8" if self.kv_fp8 else _dtype_name(self.dtype)
        parts = [self.op, f"q={_dtype_name(self.dtype)}", f"kv={kv}", f"heads={self.heads[0]}/{self.heads[1]}",
                 f"D={self.head_dim}"]  # fmt: skip
        if self.op != "decode":
            parts.append(f"block={self.block_size}")
        if self.op == "paged":
            parts.append(f"splits={self.num_splits}")
        if self.op == "cache":
            parts.append(f"tokens={self.tokens}")
        if self.tiles:
            parts.append("BLOCK_N={} warps={} stages={}".format(*self.tiles))
        if self.kv_int8 and self.op == "paged" and self.int8_conversion != "bits":
            parts.append(f"conversion={self.int8_conversion}")
        return " ".join(parts)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]


def check_triton_version() -> str:
    """The triton version; a warning on stderr when it is not the one these internals were read in."""
    import triton

    if triton.__version__ != TESTED_TRITON:
        print(
            f"compile_check: written against triton {TESTED_TRITON}, running {triton.__version__}: "
            "if it fails inside Triton, the internals it uses have moved",
            file=sys.stderr,
        )
    return triton.__version__


# ---------------------------------------------------------------------------------------------
# Recording the launches the wrappers make
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Launch:
    kernel: object  # a triton JITFunction
    args: tuple
    kwargs: dict


def _kernels() -> tuple:
    from ..kernels import triton_fused
    from ..kernels.triton_cache import _reshape_and_cache_kernel
    from ..kernels.triton_decode import _decode_kernel
    from ..kernels.triton_fused_decode import _rope_cache_decode_kernel
    from ..kernels.triton_paged import _merge_splits_kernel, _paged_decode_kernel
    from ..kernels.triton_ragged import _ragged_paged_kernel

    fused = (triton_fused._rms_norm_kernel, triton_fused._fused_add_rms_norm_kernel,
             triton_fused._rotary_embedding_kernel, triton_fused._silu_and_mul_kernel)  # fmt: skip
    return (_decode_kernel, _paged_decode_kernel, _merge_splits_kernel, _ragged_paged_kernel, _reshape_and_cache_kernel,
            _rope_cache_decode_kernel, *fused)  # fmt: skip


@contextmanager
def recorded_launches() -> Iterator[list[Launch]]:
    """While inside, launching any kernel of :func:`_kernels` records its arguments instead of running it.

    ``kernel[grid](*args, **kwargs)`` calls ``kernel.run(*args, grid=grid, warmup=False, **kwargs)``;
    an instance attribute ``run`` shadows the method.
    """
    launches: list[Launch] = []

    def record(kernel, *args, grid, warmup, **kwargs):
        launches.append(Launch(kernel, args, kwargs))

    kernels = _kernels()
    for k in kernels:
        k.run = functools.partial(record, k)
    try:
        yield launches
    finally:
        for k in kernels:
            del k.run


@contextmanager
def _tiles(tiles: tuple[int, int, int] | None) -> Iterator[None]:
    """Make the decode kernels' launches use ``(BLOCK_N, num_warps, num_stages)``: to measure the alternatives."""
    if tiles is None:
        yield
        return
    from ..kernels import triton_decode, triton_paged

    def chosen(head_dim, dtype, capability, kv_dtype=None, int8_conversion="bits"):
        block_n, warps, stages = tiles
        return dict(BLOCK_N=block_n, BLOCK_D=triton_decode.head_tile(head_dim), num_warps=warps, num_stages=stages)

    original = triton_decode.tile_config
    triton_decode.tile_config = triton_paged.tile_config = chosen
    try:
        yield
    finally:
        triton_decode.tile_config = triton_paged.tile_config = original


def launches_for(config: Config, target: Target | None) -> list[Launch]:
    """The kernel launches the wrappers make for ``config`` on ``target`` (None: the interpreter's)."""
    from ..kernels.triton_cache import _launch as cache_launch
    from ..kernels.triton_decode import decode
    from ..kernels.triton_paged import paged_decode
    from ..kernels.triton_ragged import ragged_paged

    hq, hkv = config.heads
    d, dtype, cap = config.head_dim, config.dtype, target.capability if target else None
    cache_dtype = torch.int8 if config.kv_int8 else torch.float8_e4m3fn if config.kv_fp8 else dtype
    quantized = config.kv_int8 or config.kv_fp8
    with recorded_launches() as launches, _tiles(config.tiles):
        if config.op == "decode":
            q = torch.empty(2, hq, d, dtype=dtype)
            k = torch.empty(2, hkv, 32, d, dtype=dtype)
            decode(q, k, k.clone(), torch.full((2,), 32, dtype=torch.int32), d**-0.5, capability=cap)
        elif config.op == "paged":
            q = torch.empty(2, hq, d, dtype=dtype)
            pool = torch.empty(4, config.block_size, hkv, d, dtype=cache_dtype)
            scales = (torch.empty(pool.shape[:3]), torch.empty(pool.shape[:3])) if quantized else (None, None)
            tables = torch.zeros(2, 2, dtype=torch.int32)
            paged_decode(q, pool, pool.clone(), tables, torch.ones(2, dtype=torch.int32), d**-0.5, config.num_splits,
                         *scales, capability=cap, int8_conversion=config.int8_conversion)  # fmt: skip
        elif config.op == "ragged":  # two sequences of 3 and 1 new tokens; the grid alone depends on the counts
            q = torch.empty(4, hq, d, dtype=dtype)
            pool = torch.empty(4, config.block_size, hkv, d, dtype=dtype)
            ragged_paged(q, pool, pool.clone(), torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
                         torch.tensor([0, 3, 4], dtype=torch.int32), d**-0.5, capability=cap)  # fmt: skip
        elif config.op == "cache":
            new = torch.empty(config.tokens, hkv, d, dtype=dtype)
            pool = torch.empty(max(4, config.tokens), config.block_size, hkv, d, dtype=cache_dtype)
            scales = (torch.empty(pool.shape[:3]), torch.empty(pool.shape[:3])) if config.kv_int8 else ()
            cache_launch(new, new.clone(), pool, pool.clone(), torch.zeros(config.tokens, dtype=torch.int64), *scales)
        elif config.op == "rope_cache_decode":  # a decode step of two sequences, the packed QKV as the model has it
            from ..kernels.split_plan import SplitPlan
            from ..kernels.triton_fused_decode import rope_cache_decode

            pool = torch.empty(4, config.block_size, hkv, d, dtype=dtype)
            table, rows = torch.empty(8, d, dtype=dtype), torch.zeros(2, dtype=torch.int64)
            rope_cache_decode(torch.empty(2, hq + 2 * hkv, d, dtype=dtype), table, table.clone(), rows, rows.clone(),
                              pool, pool.clone(), torch.zeros(2, 2, dtype=torch.int32), SplitPlan(4, 2, "cpu"),
                              d**-0.5, capability=cap)  # fmt: skip
        elif config.op in FUSED_OPS:
            _launch_fused(config)
        else:
            raise ValueError(
                f"config.op must be 'decode', 'paged', 'ragged', 'cache', 'rope_cache_decode' or one of {FUSED_OPS}, "
                f"got {config.op!r}"
            )
    return launches


def _launch_fused(config: Config) -> None:
    """Launch one of :mod:`~kvcourse.kernels.triton_fused`'s kernels as its wrapper does, on ``config.tokens`` contiguous rows.

    (A slice of a packed projection has another row stride, but Triton specialises an integer argument
    only on being 1 or a multiple of 16, and SmolLM2's widths (576, 960 for Q+K+V, 3072) are multiples
    of 16: the same machine code.)
    """
    from ..kernels import triton_fused

    n, dtype = config.tokens, config.dtype
    if config.op == "rotary_embedding":
        heads, d = sum(config.heads), config.head_dim
        table = torch.empty(n, 1, d, dtype=dtype)
        triton_fused._launch_rotary_embedding(torch.empty(n, heads, d, dtype=dtype), table, table.clone())
    elif config.op == "silu_and_mul":
        triton_fused._launch_silu_and_mul(torch.empty(n, 2 * config.width, dtype=dtype))
    else:
        x, weight = torch.empty(n, config.width, dtype=dtype), torch.empty(config.width, dtype=dtype)
        if config.op == "rms_norm":
            triton_fused._launch_rms_norm(x, weight, 1e-5)
        elif config.op == "embed_rms_norm":  # x as the embedding table, one row per token
            triton_fused._launch_rms_norm(x, weight, 1e-5, torch.zeros(n, dtype=torch.int64))
        else:
            triton_fused._launch_fused_add_rms_norm(x, x.clone(), weight, 1e-5)


# ---------------------------------------------------------------------------------------------
# Compiling one launch for one target, and reading the result
# ---------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Compiled:
    kernel: str
    capability: int
    registers: int  # per thread
    stack: int  # bytes of stack frame per thread: spilled registers (these kernels have no local arrays)
    shared: int  # bytes per block: Triton's dynamic shared memory + any static
    num_warps: int
    mma: bool  # tensor-core instructions (mma.sync / wgmma) in the PTX
    dots: str  # what the tl.dots became: "wgmma", "mma.sync" (tensor cores) or "fma" (CUDA cores only)
    fma: int  # fp32 fused multiply-adds in the PTX (the dots' only form without tensor cores)
    seconds: float
    constants: dict  # the constexprs: BLOCK_N, BLOCK_H...

    @property
    def spills(self) -> bool:
        return self.stack > 0


def _cuobjdump() -> str:
    from triton import knobs  # the wheel ships ptxas, cuobjdump and nvdisasm side by side

    return os.path.join(os.path.dirname(knobs.nvidia.ptxas.path), "cuobjdump")


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack, static shared and local memory of the one kernel in ``cubin`` (cuobjdump)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_cuobjdump(), "--dump-resource-usage", f.name], capture_output=True, text=True, check=True
        )
    found = _USAGE.findall(out.stdout)
    if len(found) != 1:
        raise RuntimeError(f"expected one kernel's resource usage from cuobjdump, got:\n{out.stdout}")
    reg, stack, shared, local = map(int, found[0])
    return dict(registers=reg, stack=stack, static_shared=shared, local=local)


def compile_for(launch: Launch, target: Target):
    """Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``, ``.metadata``) for one recorded launch on
    ``target``, made exactly as ``JITFunction.run`` would on that GPU; and its constexprs by argument path."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    kernel, gpu = launch.kernel, GPUTarget("cuda", target.capability, 32)
    backend = make_backend(gpu)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, specialization, options)
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=gpu, options=options.__dict__)
    return compiled, constexprs


def compile_launch(launch: Launch, target: Target) -> Compiled:
    """Compile one recorded launch for ``target`` (:func:`compile_for`) and read what came out."""
    kernel = launch.kernel
    start = time.perf_counter()
    compiled, constexprs = compile_for(launch, target)
    seconds = time.perf_counter() - start
    usage = resource_usage(compiled.asm["cubin"])
    ptx = compiled.asm["ptx"]
    names = list(kernel.signature.parameters)
    return Compiled(
        kernel=kernel.__name__,
        capability=target.capability,
        registers=usage["registers"],
        stack=usage["stack"] + usage["local"],
        shared=compiled.metadata.shared + usage["static_shared"],
        num_warps=compiled.metadata.num_warps,
        mma="mma.sync" in ptx or "wgmma" in ptx,
        dots="wgmma" if "wgmma" in ptx else "mma.sync" if "mma.sync" in ptx else "fma",
        fma=len(re.findall(r"\bfma\.rn\.f32\b", ptx)),
        seconds=seconds,
        constants={names[path[0]]: value for path, value in constexprs.items() if isinstance(value, (int, bool))},
    )


# ---------------------------------------------------------------------------------------------
# The sweep: which configurations each target sees
# ---------------------------------------------------------------------------------------------
def split_counts(num_kv_heads: int, target: Target) -> list[int]:
    """The distinct split counts :func:`~kvcourse.kernels.triton_paged.choose_num_splits` gives on ``target``."""
    from ..kernels.triton_paged import choose_num_splits

    shapes = itertools.product((1, 2, 4, 8, 16, 64), (256, 1024, 2048, 8192, 32768, 131072))
    return sorted({choose_num_splits(b, num_kv_heads, s, target.num_sms) for b, s in shapes})


def configurations(target: Target, quick: bool = False) -> list[Config]:
    """What the wrappers launch on ``target``: every dtype, float and int8 K/V.

    ``quick`` (``make test``): the named models' heads; paged reads with blocks of 16 and 1 split and
    the most the heuristic gives (the merge kernel's widest tile), int8 with 1 split; fp16 cache
    writes. Full: also GQA groups 1 and 8 and the named groups at the other head dim; blocks of 1, 16
    and 32 for the named heads; 1, 2 and the most splits; cache writes of 1, 5 and 37 tokens. (Split
    counts above 1 differ in one constant of the same code, so all of them are not compiled.) Both also
    compile a layer's fused small ops (:func:`fused_configurations`).
    """
    named = list(NAMED_HEADS.values())
    others = [(hq, hkv, d) for hq, hkv in OTHER_HEADS for d in (64, 128)]
    others += [(hq, hkv, 128 if d == 64 else 64) for hq, hkv, d in named]
    out: list[Config] = []
    for (hq, hkv, d), dtype in itertools.product(named + ([] if quick else others), DTYPES):
        is_named = (hq, hkv, d) in named
        out.append(Config("decode", dtype, (hq, hkv), d))
        most = max(split_counts(hkv, target))
        for kv_int8 in (False, True):
            if quick:
                blocks, splits = (16,), [1] if kv_int8 else [1, most]
                tokens = (37,) if dtype == torch.float16 else ()
            else:
                blocks, splits, tokens = ((1, 16, 32) if is_named else (16,)), sorted({1, 2, most}), (1, 5, 37)
            for block_size, s in itertools.product(blocks, splits):
                out.append(Config("paged", dtype, (hq, hkv), d, kv_int8, block_size, s))
            if not kv_int8:  # the ragged kernel (a mixed step's attention in a CUDA graph) reads float pools only
                out += [Config("ragged", dtype, (hq, hkv), d, False, block_size) for block_size in blocks]
                # and so does a decode step's fused attention (RoPE, cache write, paged read, merge: one kernel)
                out += [Config("rope_cache_decode", dtype, (hq, hkv), d, False, block_size) for block_size in blocks]
            for block_size, n in itertools.product(blocks, tokens):  # BLOCK_T follows the count; 1 is specialised
                out.append(Config("cache", dtype, (hq, hkv), d, kv_int8, block_size, tokens=n))
        if target.capability >= 89:  # fp8 pools: the paged read, where the GPU converts e4m3 (no cache write yet)
            for block_size, s in itertools.product(blocks, [1] if quick else sorted({1, 2, most})):
                out.append(Config("paged", dtype, (hq, hkv), d, block_size=block_size, num_splits=s, kv_fp8=True))
    # The tests' tiny model (tests/conftest.py): head_dim 8 is under tl.dot's 16, so BLOCK_D pads it.
    # gpu-check runs those tests on the GPU; this compiles them here.
    tiny = (6, 2)
    out += [
        Config("decode", torch.float32, tiny, 8),
        Config("paged", torch.float32, tiny, 8, False, 4, 1),
        Config("ragged", torch.float32, tiny, 8, False, 4),
        Config("rope_cache_decode", torch.float32, tiny, 8, False, 4),
    ]
    return out + fused_configurations(target)


def fused_configurations(target: Target) -> list[Config]:
    """The fused small ops at :data:`NAMED_LAYERS`' shapes: every dtype, :data:`FUSED_TOKENS` rows (quick and full)."""
    out = []
    for (hidden, intermediate, hq, hkv, d), dtype, n in itertools.product(NAMED_LAYERS.values(), DTYPES, FUSED_TOKENS):
        out += [
            Config("rms_norm", dtype, (hq, hkv), d, tokens=n, width=hidden),
            Config("embed_rms_norm", dtype, (hq, hkv), d, tokens=n, width=hidden),
            Config("fused_add_rms_norm", dtype, (hq, hkv), d, tokens=n, width=hidden),
            Config("rotary_embedding", dtype, (hq, hkv), d, tokens=n),
            Config("silu_and_mul", dtype, (hq, hkv), d, tokens=n, width=intermediate),
        ]
    return out


# The launches that spilled before tile_config took the GPU into account, each with the alternatives
# measured: (capability, config, [(BLOCK_N, num_warps, num_stages), ...]); the first is the old choice.
CHOICES = (
    (75, Config("paged", torch.float16, (9, 3), 64), [(64, 4, 2), (64, 8, 1), (32, 4, 1), (32, 8, 1), (16, 8, 1)]),
    (80, Config("paged", torch.float32, (32, 8), 128, True), [(16, 4, 2), (16, 8, 2), (16, 4, 1), (16, 8, 1)]),
    (90, Config("paged", torch.float32, (32, 8), 128, True), [(16, 4, 2), (16, 8, 2), (16, 4, 1), (16, 8, 1)]),
    (90, Config("paged", torch.bfloat16, (32, 8), 128, True), [(32, 4, 2), (32, 4, 1), (32, 8, 2)]),
)


def choices() -> list[dict]:
    """Registers and spills of each alternative in :data:`CHOICES`, and which one ``tile_config`` now picks."""
    from ..kernels.triton_decode import tile_config

    rows = []
    for capability, config, options in CHOICES:
        target = next(t for t in TARGETS if t.capability == capability)
        picked = tile_config(config.head_dim, config.dtype, capability, torch.int8 if config.kv_int8 else config.dtype)
        for tiles in options:
            c = check(dataclasses.replace(config, tiles=tiles), target).compiled[0]
            rows.append(dict(
                gpu=target.gpu, capability=capability, config=config.describe(), BLOCK_N=tiles[0], num_warps=tiles[1],
                num_stages=tiles[2], registers=c.registers, stack_bytes=c.stack, old=tiles == options[0],
                chosen=tiles == (picked["BLOCK_N"], picked["num_warps"], picked["num_stages"]),
            ))  # fmt: skip
    return rows


@dataclasses.dataclass
class Result:
    config: Config
    target: Target
    compiled: list[Compiled]
    error: str | None = None

    def problems(self) -> list[str]:
        """What fails the check: a compile error, shared memory over the limit, spills in a named model."""
        if self.error:
            return [f"does not compile: {self.error}"]
        out = []
        for c in self.compiled:
            if c.shared > self.target.max_shared:
                out.append(f"{c.kernel}: {c.shared} B of shared memory > {self.target.max_shared} B")
            if c.spills and self.config.model is not None:
                out.append(
                    f"{c.kernel}: {c.registers} registers, spills ({c.stack} B of stack) for {self.config.model}"
                )
        return out


def check(config: Config, target: Target, cache: dict | None = None) -> Result:
    """Compile every launch ``config`` makes on ``target``; a compile error is reported, not raised.

    ``cache`` (launch key -> :class:`Compiled`) lets configurations that launch identical code share a compile.
    """
    from ..kernels.triton_runtime import is_compile_failure

    cache = {} if cache is None else cache
    compiled = []
    try:
        for launch in launches_for(config, target):
            key = (launch.kernel.__name__, target.capability, _launch_key(launch))
            if key not in cache:
                cache[key] = compile_launch(launch, target)
            compiled.append(cache[key])
    except Exception as exc:
        if not is_compile_failure(exc):
            raise
        reason = (str(exc).strip().splitlines() or [""])[-1][:300]
        return Result(config, target, compiled, f"{type(exc).__name__}: {reason}")
    return Result(config, target, compiled)


def _launch_key(launch: Launch) -> str:
    """What the compiled code depends on: dtypes, 1 / divisible-by-16 of ints and pointers, constexprs, options."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(launch.kernel.signature, launch.kernel.params, _any_backend())
    _, specialization, options = binder(*launch.args, **launch.kwargs)
    return str(specialization) + str(sorted(options.items()))


@functools.cache
def _any_backend():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    return make_backend(GPUTarget("cuda", 80, 32))  # the binder's specialization does not depend on the GPU


def _compile_job(job: tuple[Config, int, int]) -> Compiled | str:
    """In a worker process: compile launch ``index`` of ``config`` on the target; an error as a string."""
    from ..kernels.triton_runtime import is_compile_failure

    config, capability, index = job
    target = next(t for t in TARGETS if t.capability == capability)
    try:
        return compile_launch(launches_for(config, target)[index], target)
    except Exception as exc:
        if not is_compile_failure(exc):
            raise
        return f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1][:300]}"


def sweep(
    quick: bool = False, targets: Sequence[Target] = TARGETS, workers: int | None = None, log=print
) -> list[Result]:
    """Every configuration on every target; each distinct compile once, ``workers`` processes in parallel."""
    import concurrent.futures
    import multiprocessing

    plan = []  # (config, target, [launch keys])
    jobs: dict[tuple, tuple[Config, int, int]] = {}  # launch key -> the first (config, capability, index) making it
    for target in targets:
        for config in configurations(target, quick):
            keys = []
            for i, launch in enumerate(launches_for(config, target)):
                key = (launch.kernel.__name__, target.capability, _launch_key(launch))
                jobs.setdefault(key, (config, target.capability, i))
                keys.append(key)
            plan.append((config, target, keys))
    workers = workers or os.cpu_count() or 1
    # spawn, not fork: the workers import Triton afresh (in compile mode, from the environment)
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        done = dict(zip(jobs, pool.map(_compile_job, jobs.values())))
    results = []
    for config, target, keys in plan:
        errors = [done[k] for k in keys if isinstance(done[k], str)]
        r = Result(
            config, target, [done[k] for k in keys if not isinstance(done[k], str)], errors[0] if errors else None
        )
        results.append(r)
        for problem in r.problems():
            log(f"sm_{target.capability} {config.describe()}: {problem}")
    log(
        f"{len(results)} configurations, {len(jobs)} distinct compiles, "
        f"{sum(bool(r.problems()) for r in results)} with problems"
    )
    return results


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------
def report(results: list[Result], quick: bool, choice_rows: list[dict] | None = None) -> dict:
    """A JSON-able summary: per target and kernel, and one row per configuration."""
    import triton

    rows = []
    for r in results:
        for c in r.compiled:
            rows.append(dict(
                gpu=r.target.gpu, capability=r.target.capability, config=r.config.describe(),
                model=r.config.model, kernel=c.kernel, registers=c.registers, stack_bytes=c.stack,
                shared_bytes=c.shared, num_warps=c.num_warps, mma=c.mma, dots=c.dots, fma=c.fma,
                BLOCK_N=c.constants.get("BLOCK_N"), BLOCK_H=c.constants.get("BLOCK_H"),
                BLOCK=c.constants.get("BLOCK"),  # the fused row kernels' tile
            ))  # fmt: skip
        if r.error:
            rows.append(dict(gpu=r.target.gpu, capability=r.target.capability, config=r.config.describe(),
                             model=r.config.model, error=r.error))  # fmt: skip
    per_target = []
    for t in {r.target: None for r in results}:
        mine = [row for row in rows if row["capability"] == t.capability and "error" not in row]
        per_target.append(dict(
            gpu=t.gpu, capability=t.capability, max_shared_bytes=t.max_shared,
            configurations=sum(r.target == t for r in results),
            errors=sum(r.target == t and r.error is not None for r in results),
            max_registers=max((row["registers"] for row in mine), default=None),
            max_shared_bytes_used=max((row["shared_bytes"] for row in mine), default=None),
            spilling_named=sorted({row["config"] for row in mine if row["stack_bytes"] and row["model"]}),
            spilling_other=sorted({row["config"] for row in mine if row["stack_bytes"] and not row["model"]}),
            attention_uses_mma=sorted({row["config"].split()[1] for row in mine
                                       if row["kernel"] in _ATTENTION_KERNELS and row["mma"]}),
        ))  # fmt: skip
    return dict(
        report="compile",
        note="compiled on a CPU, no GPU: registers, spills and shared memory from the cubins ptxas wrote; "
        "nothing here was run or timed on a GPU",
        date=dt.datetime.now(dt.timezone.utc).date().isoformat(),
        triton=triton.__version__,
        torch=torch.__version__.split("+")[0],
        sweep="quick" if quick else "full",
        configurations=len(results),
        distinct_compiles=len({id(c) for r in results for c in r.compiled}),  # shared launches share one object
        targets=per_target,
        choices=choice_rows or [],
        # every row of the named models, and any other row that failed or spilled (the rest: counted above)
        rows=[row for row in rows if row["model"] or "error" in row or row["stack_bytes"]],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvcourse.bench.compile_check", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="the named models only, fewer splits (make test)")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--choices", action="store_true", help="also measure the tile alternatives (CHOICES)")
    parser.add_argument("--workers", type=int, help="compile processes (default: one per CPU)")
    parser.add_argument("--capability", type=int, nargs="+", choices=[t.capability for t in TARGETS],
                        help="only these targets (default: all)")  # fmt: skip
    args = parser.parse_args(argv)
    from ..kernels.triton_runtime import interpreting

    if interpreting():
        why = "(kvcourse turns the interpreter on when there is no GPU)"
        print(f"compile_check needs Triton in compile mode: run it with TRITON_INTERPRET=0 in the environment {why}",
              file=sys.stderr)  # fmt: skip
        return 2
    check_triton_version()
    targets = [t for t in TARGETS if args.capability is None or t.capability in args.capability]
    start = time.perf_counter()
    results = sweep(args.quick, targets, args.workers)
    print(f"{time.perf_counter() - start:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        choice_rows = choices() if args.choices else None
        args.json.write_text(json.dumps(report(results, args.quick, choice_rows), indent=1) + "\n")
    return 1 if any(r.problems() for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
