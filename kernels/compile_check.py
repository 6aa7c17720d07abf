"""Compile every Triton kernel for a GPU architecture on a machine without a GPU, with the ptxas that ships with
Triton, and report registers, stack (spills) and shared memory per kernel: catches kernels that the
interpreter runs but the compiler rejects.

    TRITON_INTERPRET=0 python -m kernels.compile_check [--arch 90]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import attention, fp8_gemm, fused_moe, kv_store, qk_norm_rope, rms_norm, swiglu


@dataclass(frozen=True)
class Build:
    name: str
    kernel: triton.JITFunction
    pointers: dict[str, str]  # pointer arguments and their Triton types; other runtime arguments are i32
    constants: dict[str, object]
    options: dict[str, int] = field(default_factory=dict)
    floats: tuple[str, ...] = ()
    arch: int | None = None  # the architecture it is for, whatever --arch asks


def _attention_builds() -> list[Build]:
    builds = []
    for label, cache, scaled, sparse in [("bf16", "*bf16", False, False), ("bf16-window", "*bf16", False, True),
                                         ("fp8", "*fp8e4nv", True, False)]:
        pointers = dict(
            q="*bf16", out="*bf16", k_cache=cache, v_cache=cache, seq_lens="*i32", block_tables="*i32",
            cu_seqlens_q="*i32", row_seq="*i32", row_tok="*i32", row_cnt="*i32", row_ptr="*i32", col_idx="*i32",
            k_scale="*fp32", v_scale="*fp32", part_out="*fp32", part_lse="*fp32",
        )
        common = dict(GROUP=4, BLOCK_SIZE=16, BLOCK_N=64, HEAD_DIM=128, SPARSE=sparse, WINDOWED=sparse,
                      SCALED=scaled, PRECISION="tf32")
        builds.append(Build(f"decode-{label}", attention._decode_kernel, pointers, {**common, "GROUP_PAD": 16},
                            dict(num_warps=4, num_stages=2), ("qk_scale",)))
        builds.append(Build(f"extend-{label}", attention._extend_kernel, pointers, {**common, "BLOCK_M": 128},
                            dict(num_warps=8, num_stages=2), ("qk_scale",)))
    builds.append(Build("decode-merge", attention._merge_kernel,
                        dict(part_out="*fp32", part_lse="*fp32", out="*bf16"), dict(SPLITS_PAD=16, HEAD_DIM=128)))
    return builds


def _fp8_builds() -> list[Build]:
    gemm = dict(a="*fp8e4nv", a_scales="*fp32", w="*fp8e4nv", w_scales="*fp32", scale_rows="*i32", out="*bf16")
    return [
        Build("fp8-quantize-groups", fp8_gemm._quantize_groups_kernel,
              dict(x="*bf16", out="*fp8e4nv", scales="*fp32"), dict(ROWS=16, GROUP=128, LIMIT=448.0, EPSILON=1e-10)),
        *(Build(f"fp8-gemm-{label}", fp8_gemm._w8a8_kernel, gemm,
                dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=128, GROUP_M=8, EVEN_K=True), dict(num_warps=warps, num_stages=stages))
          for label, m, n, warps, stages in (("decode", 16, 128, 4, 4), ("prefill", 64, 256, 8, 3))),
    ]


def _moe_builds() -> list[Build]:
    """Each expert kernel at the tile it runs with: gate/up at a prefill's 64 rows (its two accumulators are the
    most registers), down at a decode's 16; bf16 experts, fp8 ones W8A8 (sm_90), and fp8 ones dequantized in
    registers, built for sm_80, the GPUs without FP8 tensor cores they are for."""
    builds = []
    formats = (("", "*bf16", "*bf16", "none", None), ("-fp8", "*fp8e4nv", "*fp8e4nv", "w8a8", None),
               ("-fp8-dequant", "*i8", "*bf16", "dequant", 80))
    for label, weight, act, fp8, arch in formats:
        scales = {"w_scales": "*fp32"} if fp8 != "none" else {}
        scales |= {"x_scales": "*fp32", "h_scales": "*fp32"} if fp8 == "w8a8" else {}
        for name, kernel, pointers, rows, extra in [
            ("gate-up", fused_moe._gate_up_kernel, dict(x=act, w=weight, out="*bf16"), 64, {"TOP_K": 8}),
            ("down", fused_moe._down_kernel, dict(h=act, w=weight, out="*bf16", weights="*bf16"), 16, {}),
        ]:
            launch = fused_moe.launch_options(rows, on_gpu=True, fp8=fp8)
            tiles = {key: value for key, value in launch.items() if key.startswith("BLOCK")}
            options = {key: value for key, value in launch.items() if not key.startswith("BLOCK")}
            absent = {key: None for key in ("x_scales", "h_scales", "w_scales")
                      if key in kernel.arg_names and key not in scales}
            builds.append(Build(f"fused-moe{label}-{name}", kernel,
                                {**pointers, **scales, "sorted_pairs": "*i32", "tile_experts": "*i32"},
                                {**extra, **tiles, **absent, "BLOCK_M": rows, "PRECISION": "tf32", "FP8": fp8},
                                options, arch=arch))
    return builds


def builds() -> list[Build]:
    bf16_norm = dict(x="*bf16", residual="*bf16", weight="*bf16", out="*bf16", residual_out="*bf16")
    qk = dict(q="*bf16", k="*bf16", q_out="*bf16", k_out="*bf16", q_weight="*bf16", k_weight="*bf16",
              cos="*fp32", sin="*fp32", positions="*i64")
    store = {"k": "*bf16", "v": "*bf16", "slot_mapping": "*i64", "k_scale": "*fp32", "v_scale": "*fp32"}
    return [
        *_attention_builds(),
        *_fp8_builds(),
        Build("store-kv-bf16", kv_store._store_kv_kernel, {**store, "k_cache": "*bf16", "v_cache": "*bf16"},
              dict(HEADS=8, HEADS_PAD=8, HEAD_DIM=128, SCALED=False, LIMIT=0.0)),
        Build("store-kv-fp8", kv_store._store_kv_kernel, {**store, "k_cache": "*fp8e4nv", "v_cache": "*fp8e4nv"},
              dict(HEADS=8, HEADS_PAD=8, HEAD_DIM=128, SCALED=True, LIMIT=448.0)),
        Build("add-rms-norm", rms_norm._rms_norm_kernel, bf16_norm, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True),
              dict(num_warps=16), ("eps",)),
        Build("qk-norm-rope", qk_norm_rope._qk_norm_rope_kernel, qk,
              dict(Q_HEADS=32, Q_PAD=32, K_HEADS=8, K_PAD=8, HEAD_DIM=128), floats=("eps",)),
        Build("swiglu", swiglu._swiglu_kernel, dict(x="*bf16", w="*bf16", out="*bf16"),
              dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, PRECISION="tf32"),
              dict(num_warps=8, num_stages=3)),
        *_moe_builds(),
    ]


def _resources(cubin: bytes) -> dict[str, int]:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        report = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True, text=True, check=True)
    registers, stack = re.findall(r"REG:(\d+) STACK:(\d+)", report.stdout)[-1]
    return {"registers": int(registers), "stack_bytes": int(stack)}


def compile_build(build: Build, arch: int) -> dict[str, int]:
    signature = {
        name: "constexpr" if name in build.constants
        else build.pointers.get(name) or ("fp32" if name in build.floats else "i32")
        for name in build.kernel.arg_names
    }
    # At launch Triton marks pointers and integers that are multiples of 16 as such, which is what lets it
    # vectorize loads; real pointers, strides and sizes are, so assume the same here.
    aligned = {
        (index,): [["tt.divisibility", 16]]
        for index, name in enumerate(build.kernel.arg_names)
        if name in build.pointers or name.startswith("stride")
    }
    source = ASTSource(build.kernel, signature, build.constants, aligned)
    compiled = triton.compile(source, target=GPUTarget("cuda", build.arch or arch, 32), options=build.options)
    wgmma = int("wgmma" in compiled.asm["ptx"])  # Hopper's warpgroup tensor-core instructions
    return {**_resources(compiled.asm["cubin"]), "shared_bytes": compiled.metadata.shared, "wgmma": wgmma}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability without the dot (90: Hopper)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: the interpreter replaces the compiler")
    for build in builds():
        usage = compile_build(build, args.arch)
        print(f"{build.name:29s} " + " ".join(f"{key}={value}" for key, value in usage.items()))


if __name__ == "__main__":
    main()
