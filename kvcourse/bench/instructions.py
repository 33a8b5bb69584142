"""What the paged decode kernel compiles to, instruction by instruction: the evidence a GPU-less session can gather.

    TRITON_INTERPRET=0 python -m kvcourse.bench.instructions [--json report.json] [--note "how Triton was installed"]

On an NVIDIA H200 the int8 paged kernel read half of fp16's bytes and took about twice its time, flat at ~1,000
GB/s on every shape (issue 30, :mod:`.measured`): not bandwidth-bound. Four suspects: unvectorised int8 loads,
the int8 -> float conversion, the scales' loads, the tiles. Without a GPU to profile, the machine code says which
are possible. :mod:`.compile_check` compiles each launch for a target; this module disassembles the cubin
(``nvdisasm``, shipped in the triton wheel) and counts the instructions that bear on each suspect:

* global loads by width (``LDG``/``LDGSTS`` ``.64``/``.128``: 8 and 16 bytes a thread; plain: 4 or fewer);
* shared-memory loads of single bytes (``LDS.U8``/``LDS.S8``) against ``ldmatrix`` (``LDSM``);
* conversions through the conversion unit (``I2F``, ``F2F``: 16 results per clock per SM on sm_80/90, against 64
  and 128 fp32 adds)
  and the integer bit-work that replaces them (``PRMT``, ``LOP3``), packed halves (``HADD2``, ``HFMA2``);
* tensor-core instructions (``HMMA``/``HGMMA``) and fp32 FMAs.

The counts are static (each instruction once, however often its loop runs), so they compare variants of one
kernel, not times. The JSON (``kvcourse/results/int8-instructions-*.json``) records them with the Triton version.
"""

from __future__ import annotations

import argparse
import collections
import datetime as dt
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from . import compile_check as cc

__all__ = ["GROUPS", "instruction_mix", "paged_variants", "report"]

# Counted groups: name -> the SASS opcodes (with their modifiers) that fall in it.
GROUPS = {
    "global_load_128": r"LDG(STS)?\.E(\.BYPASS)?(\.EL)?\.128",
    "global_load_64": r"LDG(STS)?\.E(\.EL)?\.64",
    "global_load_32_or_less": r"LDG(STS)?\.E(\.EL)?(\.(U8|S8|U16|S16))?",
    "shared_byte_load": r"LDS\.(U8|S8)",
    "ldmatrix": r"LDSM\..*",
    "conversion_unit": r"(I2F|F2F|I2I)(\..*)?",
    "byte_permute": r"PRMT",
    "logic": r"LOP3\.LUT",
    "packed_half_math": r"H(ADD|FMA|MUL)2(\..*)?",
    "fp32_add_mul": r"F(ADD|MUL)(\..*)?",
    "fp32_fma": r"FFMA(\..*)?",
    "tensor_core": r"H(G)?MMA\..*",
    "pack_to_16_bit": r"F2FP\..*",
}
_OPCODE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]+)", re.M)


def _nvdisasm() -> str:
    return os.path.join(os.path.dirname(cc._cuobjdump()), "nvdisasm")


def instruction_mix(cubin: bytes) -> dict[str, int]:
    """Counts per :data:`GROUPS` group of one cubin's SASS, and ``"total"``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True, check=True).stdout
    opcodes = collections.Counter(_OPCODE.findall(sass))
    counts = {name: sum(n for op, n in opcodes.items() if re.fullmatch(rx, op)) for name, rx in GROUPS.items()}
    counts["total"] = sum(opcodes.values())
    return counts


def _compile(config: cc.Config, target: cc.Target):
    """The paged kernel's compiled form for ``config`` and the launch's keyword arguments (its tiles)."""
    launch = next(x for x in cc.launches_for(config, target) if x.kernel.__name__ == "_paged_decode_kernel")
    return cc.compile_for(launch, target)[0], launch.kwargs


def paged_variants(
    dtype: torch.dtype = torch.float16, heads: tuple[int, int, int] = (32, 8, 128)
) -> dict[str, cc.Config]:
    """The variants compared: the float pool, the int8 pool converted by ``cvt`` (the first version), by bits."""
    hq, hkv, d = heads
    return {
        "float": cc.Config("paged", dtype, (hq, hkv), d),
        "int8, cvt (first version)": cc.Config("paged", dtype, (hq, hkv), d, True, int8_conversion="cvt"),
        "int8, bits": cc.Config("paged", dtype, (hq, hkv), d, True, int8_conversion="bits"),
    }


def report(capabilities: tuple[int, ...] = (90, 80), dtypes=(torch.float16, torch.bfloat16), note: str = "") -> dict:
    """One row per (target, query dtype, variant): tiles, registers, stack and :func:`instruction_mix`."""
    import triton

    rows = []
    for target in [t for t in cc.TARGETS if t.capability in capabilities]:
        for dtype in dtypes:
            for name, config in paged_variants(dtype).items():
                compiled, kwargs = _compile(config, target)
                usage = cc.resource_usage(compiled.asm["cubin"])
                rows.append({"capability": target.capability, "gpu": target.gpu, "dtype": cc._dtype_name(dtype),
                             "variant": name, "config": config.describe(), "BLOCK_N": kwargs["BLOCK_N"],
                             "num_warps": kwargs["num_warps"], "num_stages": kwargs["num_stages"],
                             "registers": usage["registers"], "stack_bytes": usage["stack"] + usage["local"],
                             **instruction_mix(compiled.asm["cubin"])})  # fmt: skip
    try:  # which code was compiled
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {"what": "static SASS instruction counts of _paged_decode_kernel (python -m kvcourse.bench.instructions)",
            "date": dt.date.today().isoformat(), "commit": commit, "machine": "compiled on a CPU, no GPU",
            "triton": triton.__version__, "torch": torch.__version__,
            "shape": "32 query / 8 KV heads, head_dim 128, blocks of 16, 1 split", "note": note,
            "rows": rows}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvcourse.bench.instructions", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--note", default="", help="recorded in the report: how this Triton was installed, say")
    args = parser.parse_args(argv)
    from ..kernels.triton_runtime import interpreting

    if interpreting():
        print("instructions needs Triton in compile mode: run it with TRITON_INTERPRET=0", file=sys.stderr)
        return 2
    out = report(note=args.note)
    cols = ("global_load_128", "shared_byte_load", "ldmatrix", "conversion_unit", "byte_permute", "logic",
            "packed_half_math", "tensor_core", "registers", "stack_bytes")  # fmt: skip
    print(f"{'sm':>3} {'dtype':<5} {'variant':<26} {'BLOCK_N':>7} " + " ".join(f"{c[:12]:>12}" for c in cols))
    for r in out["rows"]:
        print(
            f"{r['capability']:>3} {r['dtype']:<5} {r['variant']:<26} {r['BLOCK_N']:>7} "
            + " ".join(f"{r[c]:>12}" for c in cols)
        )
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
