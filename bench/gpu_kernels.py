"""GPU check of every Triton kernel: correctness against the PyTorch references (fp32 and bf16), then timings
against the PyTorch path (SDPA / eager, a bf16 matmul for the FP8 GEMM, bf16 experts for FP8 ones) and against
the memory-bandwidth floor measured in the same run. The W8A8 FP8 kernels are checked and timed on GPUs with FP8
tensor cores (compute capability 8.9 and up) only; the FP8 experts dequantized in registers on any GPU.

    python -m bench.gpu_kernels [gpu_kernels.json]

Prints a table last, writes the details as JSON to the given path, and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from bench.moe import moe_inputs
from kernels import fp8_gemm, qk_norm_rope, rms_norm
from kernels.attention import paged_attention
from kernels.attention_ref import paged_attention_ref, store_kv_ref
from kernels.fused_moe import dequant_fused_moe, fp8_fused_moe, fused_moe
from kernels.fused_moe_ref import dequantize_experts, fp8_fused_moe_ref, fused_moe_ref, quantize_experts
from kernels.kv_store import store_kv
from kernels.swiglu import swiglu, swiglu_ref

# Targets the kernels are built to meet on an H200.
DECODE_BANDWIDTH_TARGET = 0.70  # of measured copy bandwidth, 8k-token contexts
SPARSE_SPEEDUP_TARGET = 8.0  # 1k-window prefill on 32k tokens vs dense causal SDPA
SWIGLU_SPEEDUP_TARGET = 1.3  # vs eager gate/up matmuls, silu, multiply
FP8_DECODE_SPEEDUP_TARGET = 1.5  # the W8A8 GEMM (activations quantized too) at 16 rows vs a bf16 matmul
# Qwen3-30B-A3B's experts: 128 of hidden 2048 and width 768, 8 a token
QWEN3_30B_EXPERTS = dict(experts=128, top_k=8, hidden=2048, intermediate=768)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# W8A8 experts quantize the SwiGLU rows again before down, which the kernel sums in another order (and in bf16,
# rounds once where the reference rounds gate, up and their product): a value on a rounding edge lands one fp8
# step (6-12%) away, and each such value moves its token's output
W8A8_MOE_TOLERANCE = {torch.float32: 5e-3, torch.bfloat16: 5e-2}


@dataclass
class Check:
    name: str
    dtype: str
    rel_error: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_error < self.tolerance


@dataclass
class Timing:
    name: str
    ms: float
    baseline: str
    baseline_ms: float
    bytes_moved: int  # the least traffic the operation needs; 0 where compute bound

    def speedup(self) -> float:
        return self.baseline_ms / self.ms

    def bandwidth_gbs(self) -> float:
        return self.bytes_moved / self.ms / 1e6


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Check and time the Triton kernels on a CUDA GPU.")
    parser.add_argument("json_path", nargs="?", default="gpu_kernels.json", help="where the details go")
    parser.add_argument("--quick", action="store_true", help="smaller timing shapes (a smoke run)")
    return parser.parse_args(argv)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.isnan().any():
        return float("inf")
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def bench_ms(fn: Callable[[], object]) -> float:
    return do_bench(fn, warmup=25, rep=100)


def copy_bandwidth_gbs() -> float:
    """Device-to-device copy of 2 GiB: the floor every memory-bound kernel is held against."""
    src = torch.empty(2**30, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


@dataclass
class Paged:
    """A paged cache holding `batch` sequences of `length` tokens at randomly placed blocks."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None

    def dense_kv(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V as SDPA takes them, `[batch, kv_heads, length, head_dim]` bf16 (fp8 dequantized)."""
        return self._dense(self.k_cache, self.k_scale, length), self._dense(self.v_cache, self.v_scale, length)

    def _dense(self, cache: torch.Tensor, scale: torch.Tensor | None, length: int) -> torch.Tensor:
        blocks = cache[self.block_tables.long()].flatten(1, 2)[:, :length].float()
        blocks = blocks if scale is None else blocks * scale.view(-1, 1)
        return blocks.transpose(1, 2).bfloat16()


def paged(batch: int, length: int, kv_heads: int, head_dim: int, dtype: torch.dtype, block_size: int = 16) -> Paged:
    blocks = -(-length // block_size)
    shape = (batch * blocks, block_size, kv_heads, head_dim)
    k_cache = torch.empty(shape, dtype=dtype, device="cuda")
    v_cache = torch.empty(shape, dtype=dtype, device="cuda")
    tables = torch.randperm(batch * blocks, device="cuda").view(batch, blocks).int()
    quantized = dtype == torch.float8_e4m3fn
    k_scale = torch.rand(kv_heads, device="cuda") * 0.02 + 0.005 if quantized else None
    v_scale = torch.rand(kv_heads, device="cuda") * 0.02 + 0.005 if quantized else None
    slots = (tables.repeat_interleave(block_size, 1) * block_size + torch.arange(blocks * block_size, device="cuda") % block_size)
    k = torch.randn(batch * blocks * block_size, kv_heads, head_dim, device="cuda")
    store_kv_ref(k, torch.randn_like(k), k_cache, v_cache, slots.flatten(), k_scale, v_scale)
    return Paged(k_cache, v_cache, tables, k_scale, v_scale)


def attention_checks(dtype: torch.dtype) -> list[Check]:
    checks = []
    cases = [  # (new tokens, lengths, window, sinks, stride, cache dtype)
        ([1, 1, 1, 1], [1, 300, 1000, 4099], 0, 0, 0, dtype),
        ([1, 1, 1], [700, 2000, 129], 256, 4, 0, dtype),
        ([300, 1, 77], [300, 900, 1000], 0, 0, 0, dtype),
        ([500, 64], [1500, 64], 128, 4, 0, dtype),
        ([200, 100], [900, 400], 64, 0, 96, dtype),
        ([1, 1], [1000, 3000], 0, 0, 0, torch.float8_e4m3fn),
        ([300, 40], [800, 40], 0, 0, 0, torch.float8_e4m3fn),
    ]
    for new, lens, window, sinks, stride, cache_dtype in cases:
        cache = paged(len(lens), max(lens), 8, 128, cache_dtype)
        q = torch.randn(sum(new), 32, 128, device="cuda", dtype=dtype)
        cu = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
        seq_lens = torch.tensor(lens, device="cuda", dtype=torch.int32)
        args = (q, cache.k_cache, cache.v_cache, cu, seq_lens, cache.block_tables, 128**-0.5, window, sinks)
        scales = dict(stride=stride, k_scale=cache.k_scale, v_scale=cache.v_scale)
        kind = "decode" if len(new) == sum(new) else "extend"
        name = f"attention-{kind}-w{window}-s{sinks}-t{stride}" + ("-fp8kv" if cache.k_scale is not None else "")
        error = rel_error(paged_attention(*args, **scales), paged_attention_ref(*args, **scales))
        checks.append(Check(name, str(dtype), error, TOLERANCE[dtype]))
    return checks


def store_kv_checks(dtype: torch.dtype) -> list[Check]:
    checks = []
    for cache_dtype in (dtype, torch.float8_e4m3fn):
        scale = torch.rand(8, device="cuda") + 0.1 if cache_dtype == torch.float8_e4m3fn else None
        k, v = (torch.randn(1000, 8, 128, device="cuda", dtype=dtype) * 4 for _ in range(2))
        slots = torch.randperm(4096, device="cuda")[:1000]
        slots[::7] = -1
        caches = [torch.zeros(256, 16, 8, 128, device="cuda", dtype=cache_dtype) for _ in range(4)]
        store_kv(k, v, caches[0], caches[1], slots, scale, scale)
        store_kv_ref(k, v, caches[2], caches[3], slots, scale, scale)
        mismatched = sum((ours.view(torch.uint8) != ref.view(torch.uint8)).float().mean().item()
                         for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])))
        name = f"store-kv-{str(cache_dtype).removeprefix('torch.')}"
        checks.append(Check(name, str(dtype), mismatched, 1e-6))  # the same rounding: every byte should match
    return checks


def fused_checks(dtype: torch.dtype) -> list[Check]:
    x = torch.randn(300, 4096, device="cuda", dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(4096, device="cuda", dtype=dtype)
    qkv = torch.randn(300, 48 * 128, device="cuda", dtype=dtype)
    q, k = qkv[:, : 32 * 128].view(300, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(300, 8, 128)
    cos, sin = qk_norm_rope.rope_tables(4096, 128, 1e6, "cuda")
    positions = torch.randint(0, 4096, (300,), device="cuda")
    rope_args = (q, k, weight[:128], weight[128:256], cos, sin, positions, 1e-6)
    w_gate_up = torch.randn(2 * 1536, 4096, device="cuda", dtype=dtype) / 64
    pairs = {
        "rms-norm": (rms_norm.rms_norm(x, weight, 1e-6), rms_norm.rms_norm_ref(x, weight, 1e-6)),
        "add-rms-norm": (rms_norm.add_rms_norm(x, residual, weight, 1e-6)[0],
                         rms_norm.add_rms_norm_ref(x, residual, weight, 1e-6)[0]),
        "qk-norm-rope-q": (qk_norm_rope.qk_norm_rope(*rope_args)[0], qk_norm_rope.qk_norm_rope_ref(*rope_args)[0]),
        "qk-norm-rope-k": (qk_norm_rope.qk_norm_rope(*rope_args)[1], qk_norm_rope.qk_norm_rope_ref(*rope_args)[1]),
        "swiglu": (swiglu(x, w_gate_up), swiglu_ref(x, w_gate_up)),
    }
    return [Check(name, str(dtype), rel_error(*pair), TOLERANCE[dtype]) for name, pair in pairs.items()]


def fp8_operands(m: int, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """bf16 activations `[m, k]`, and a weight `[n, k]` in fp8 with its 128x128 block scales and scale rows."""
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    weight, scales = fp8_gemm.block_quantize(torch.randn(n, k, device="cuda") / k**0.5, fp8_gemm.BLOCK, fp8_gemm.BLOCK)
    rows = torch.arange(n, device="cuda", dtype=torch.int32) // fp8_gemm.BLOCK
    return x, weight, scales, rows


def fp8_checks() -> list[Check]:
    """The activation quantizer (its fp8 bytes: the same rounding as PyTorch's cast), the W8A8 GEMM on the same
    fp8 operands (float32 out), and the whole FP8 linear in bf16, each against its reference."""
    x, weight, scales, rows = fp8_operands(300, 2 * 1536, 4096 + 64)  # a partial K step
    xq, x_scales = fp8_gemm.quantize_groups(x)
    xq_ref, x_scales_ref = fp8_gemm.quantize_groups_ref(x)
    mismatched = (xq.view(torch.uint8) != xq_ref.view(torch.uint8)).float().mean().item()
    gemm = fp8_gemm.w8a8_gemm(xq_ref, x_scales_ref, weight, scales, rows, torch.float32)
    gemm_ref = fp8_gemm.w8a8_gemm_ref(xq_ref, x_scales_ref, weight, scales, rows, torch.float32)
    linear = fp8_gemm.fp8_linear(x, weight, scales, rows)
    return [Check("fp8-quantize-groups-bytes", "bfloat16", mismatched, 1e-3),
            Check("fp8-quantize-groups-scales", "float32", rel_error(x_scales, x_scales_ref), 1e-6),
            Check("fp8-w8a8-gemm", "float32", rel_error(gemm, gemm_ref), 1e-4),
            Check("fp8-linear", "bfloat16", rel_error(linear, fp8_gemm.fp8_linear_ref(x, weight, scales, rows)),
                  TOLERANCE[torch.bfloat16])]


def time_fp8_gemm(m: int, n: int, k: int, label: str) -> Timing:
    """The FP8 linear (the activations' quantization included) against a bf16 matmul of the same shape."""
    x, weight, scales, rows = fp8_operands(m, n, k)
    w_bf16 = fp8_gemm.block_dequantize(weight, scales, rows, torch.bfloat16)
    ours = bench_ms(lambda: fp8_gemm.fp8_linear(x, weight, scales, rows))
    bf16 = bench_ms(lambda: F.linear(x, w_bf16))
    return Timing(f"fp8-gemm-{label}-{m}x{n}x{k}", ours, "bf16 matmul", bf16, n * k + 2 * m * (k + n))


def time_fp8_gemms(quick: bool) -> list[Timing]:
    """Qwen3-32B's MLP projections (gate/up fused, down) at a decode step's 16 rows and a prefill's many."""
    shapes = {"gate-up": (2 * 25600, 5120), "down": (5120, 25600)}
    return [time_fp8_gemm(m, n, k, label) for m in (16, 512 if quick else 4096) for label, (n, k) in shapes.items()]


def moe_checks(dtype: torch.dtype) -> list[Check]:
    """The experts' kernels at a decode's and a prefill's token counts (tiles of 16 and 64 rows)."""
    checks = []
    for tokens in (5, 300):
        inputs = moe_inputs(tokens, **QWEN3_30B_EXPERTS, dtype=dtype, device="cuda")
        checks.append(Check(f"fused-moe-{tokens}-tokens", str(dtype), rel_error(fused_moe(*inputs),
                                                                                  fused_moe_ref(*inputs)),
                            TOLERANCE[dtype]))
    return checks


def time_moe(tokens: int) -> Timing:
    """One layer's experts against the per-expert loop; the bytes are the chosen experts' weights."""
    inputs = moe_inputs(tokens, **QWEN3_30B_EXPERTS, dtype=torch.bfloat16, device="cuda")
    ours = bench_ms(lambda: fused_moe(*inputs))
    loop = bench_ms(lambda: fused_moe_ref(*inputs))
    shape = QWEN3_30B_EXPERTS
    chosen = inputs[-1].unique().numel()
    return Timing(f"fused-moe-{tokens}x{shape['experts']}e-top{shape['top_k']}", ours, "per-expert loop", loop,
                  chosen * 3 * shape["hidden"] * shape["intermediate"] * 2)


def fp8_moe_inputs(tokens: int, shape: dict, dtype: torch.dtype,
                   device: str = "cuda") -> tuple[torch.Tensor, ...]:
    """`moe_inputs` with the experts quantized to fp8 blocks: (x, w_gate_up, gate_up_scales, w_down, down_scales,
    weights, ids)."""
    x, w_gate_up, w_down, weights, ids = moe_inputs(tokens, **shape, dtype=dtype, device=device)
    return x, *quantize_experts(w_gate_up.float(), w_down.float()), weights, ids


def fp8_moe_checks(dtype: torch.dtype, shape: dict = QWEN3_30B_EXPERTS, device: str = "cuda") -> list[Check]:
    """FP8 experts at a decode's and a prefill's token counts: dequantized in registers against the reference on
    their values (any GPU), W8A8 against its own reference (FP8 tensor cores only)."""
    checks = []
    for tokens in (5, 300):
        x, *experts, weights, ids = fp8_moe_inputs(tokens, shape, dtype, device)
        values = [w.to(dtype) for w in dequantize_experts(*experts)]
        dequantized = dequant_fused_moe(x, *experts, weights, ids)
        checks.append(Check(f"fp8-moe-dequant-{tokens}-tokens", str(dtype),
                            rel_error(dequantized, fused_moe_ref(x, *values, weights, ids)), TOLERANCE[dtype]))
        if fp8_gemm.has_fp8_tensor_cores(device):
            w8a8 = fp8_fused_moe(x, *experts, weights, ids)
            expected = fp8_fused_moe_ref(x, *experts, weights, ids)
            checks.append(Check(f"fp8-moe-w8a8-{tokens}-tokens", str(dtype), rel_error(w8a8, expected),
                                W8A8_MOE_TOLERANCE[dtype]))
    return checks


def time_fp8_moe(tokens: int, shape: dict = QWEN3_30B_EXPERTS, device: str = "cuda") -> list[Timing]:
    """One layer's FP8 experts against the same experts in bf16, all on the grouped kernels: dequantized in
    registers, and W8A8 where FP8 tensor cores are; the bytes are the chosen experts' fp8 weights."""
    x, *experts, weights, ids = fp8_moe_inputs(tokens, shape, torch.bfloat16, device)
    w_gate_up, w_down = (w.to(x.dtype) for w in dequantize_experts(*experts))
    bf16 = bench_ms(lambda: fused_moe(x, w_gate_up, w_down, weights, ids))
    chosen_bytes = ids.unique().numel() * 3 * shape["hidden"] * shape["intermediate"]
    label = f"{tokens}x{shape['experts']}e-top{shape['top_k']}"
    paths = {"dequant": dequant_fused_moe}
    if fp8_gemm.has_fp8_tensor_cores(device):
        paths["w8a8"] = fp8_fused_moe
    return [Timing(f"fp8-moe-{name}-{label}", bench_ms(lambda run=run: run(x, *experts, weights, ids)),
                   "bf16 experts", bf16, chosen_bytes) for name, run in paths.items()]


def time_decode(context: int, batch: int) -> Timing:
    """Qwen3-8B shapes (32 query heads, 8 KV heads, head_dim 128), bf16 cache, one new token per sequence."""
    cache = paged(batch, context, 8, 128, torch.bfloat16)
    q = torch.randn(batch, 32, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
    ours = bench_ms(lambda: paged_attention(q, cache.k_cache, cache.v_cache, cu, lens, cache.block_tables, 128**-0.5))
    k, v = cache.dense_kv(context)
    sdpa = bench_ms(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True))
    kv_bytes = 2 * batch * context * 8 * 128 * 2
    return Timing(f"decode-{batch}x{context // 1024}k", ours, "sdpa (contiguous kv)", sdpa, kv_bytes)


def time_prefill(tokens: int, window: int) -> tuple[Timing, Timing]:
    """One sequence's whole prompt: windowed (block-sparse) and dense, against dense causal SDPA."""
    cache = paged(1, tokens, 8, 128, torch.bfloat16)
    q = torch.randn(tokens, 32, 128, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, tokens], device="cuda", dtype=torch.int32)
    lens = torch.tensor([tokens], device="cuda", dtype=torch.int32)
    args = (q, cache.k_cache, cache.v_cache, cu, lens, cache.block_tables, 128**-0.5)
    sparse = bench_ms(lambda: paged_attention(*args, window))
    dense = bench_ms(lambda: paged_attention(*args))
    k, v = (part.repeat_interleave(4, 1) for part in cache.dense_kv(tokens))  # flash SDPA wants equal heads
    q_sdpa = q.transpose(0, 1).unsqueeze(0)
    sdpa = bench_ms(lambda: F.scaled_dot_product_attention(q_sdpa, k, v, is_causal=True))
    label = f"prefill-{tokens // 1024}k"
    return (Timing(f"{label}-window{window}", sparse, "dense causal sdpa", sdpa, 0),
            Timing(f"{label}-dense", dense, "dense causal sdpa", sdpa, 0))


def time_swiglu(rows: int, hidden: int = 4096, intermediate: int = 12288) -> Timing:
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    gate, up = (torch.randn(intermediate, hidden, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(2))
    w_gate_up = torch.cat([gate, up])
    ours = bench_ms(lambda: swiglu(x, w_gate_up))
    eager = bench_ms(lambda: F.silu(x @ gate.T) * (x @ up.T))
    return Timing(f"swiglu-{rows}x{hidden}x{intermediate}", ours, "eager gate/up/silu/mul", eager,
                  (x.numel() + w_gate_up.numel() + rows * intermediate) * 2)


def time_norms(rows: int) -> list[Timing]:
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    residual, weight = torch.randn_like(x), torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    fused = bench_ms(lambda: rms_norm.add_rms_norm(x, residual, weight, 1e-6))
    eager = bench_ms(lambda: rms_norm.add_rms_norm_ref(x, residual, weight, 1e-6))
    qkv = torch.randn(rows, 48 * 128, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, : 32 * 128].view(rows, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(rows, 8, 128)
    cos, sin = qk_norm_rope.rope_tables(32768, 128, 1e6, "cuda")
    positions = torch.randint(0, 32768, (rows,), device="cuda")
    args = (q, k, weight[:128], weight[128:256], cos, sin, positions, 1e-6)
    rope = bench_ms(lambda: qk_norm_rope.qk_norm_rope(*args))
    rope_eager = bench_ms(lambda: qk_norm_rope.qk_norm_rope_ref(*args))
    return [
        Timing(f"add-rms-norm-{rows}x4096", fused, "eager", eager, 4 * x.numel() * 2),
        Timing(f"qk-norm-rope-{rows}x40x128", rope, "eager", rope_eager, 2 * 40 * 128 * rows * 2),
    ]


def run(quick: bool) -> dict:
    checks = [c for dtype in (torch.float32, torch.bfloat16)
              for c in (*attention_checks(dtype), *store_kv_checks(dtype), *fused_checks(dtype), *moe_checks(dtype),
                        *fp8_moe_checks(dtype))]
    checks += fp8_checks() if fp8_gemm.has_fp8_tensor_cores("cuda") else []
    copy_gbs = copy_bandwidth_gbs()
    context, batch, tokens = (2048, 8, 8192) if quick else (8192, 32, 32768)
    decode = time_decode(context, batch)
    sparse, dense = time_prefill(tokens, 1024)
    swiglus = [time_swiglu(rows) for rows in ((16, 512) if quick else (16, 256, 4096))]
    fp8 = time_fp8_gemms(quick) if fp8_gemm.has_fp8_tensor_cores("cuda") else []
    moes = [time_moe(tokens) for tokens in ((8, 512) if quick else (8, 64, 512, 4096))]
    moes += [t for tokens in ((8, 512) if quick else (8, 64, 512, 4096)) for t in time_fp8_moe(tokens)]
    timings = [decode, sparse, dense, *swiglus, *moes, *time_norms(4096 if quick else 16384), *fp8]
    targets = {
        "decode_fraction_of_copy_bandwidth": (decode.bandwidth_gbs() / copy_gbs, DECODE_BANDWIDTH_TARGET),
        "sparse_prefill_speedup_vs_sdpa": (sparse.speedup(), SPARSE_SPEEDUP_TARGET),
        "swiglu_best_speedup_vs_eager": (max(t.speedup() for t in swiglus), SWIGLU_SPEEDUP_TARGET),
    }
    if fp8:
        targets["fp8_decode_gemm_speedup_vs_bf16"] = (min(t.speedup() for t in fp8[:2]), FP8_DECODE_SPEEDUP_TARGET)
    return {
        "device": torch.cuda.get_device_name(),
        "quick": quick,
        "copy_bandwidth_gbs": copy_gbs,
        "checks": [{**asdict(c), "ok": c.ok} for c in checks],
        "timings": [{**asdict(t), "speedup": t.speedup(), "bandwidth_gbs": t.bandwidth_gbs(),
                     "fraction_of_copy": t.bandwidth_gbs() / copy_gbs} for t in timings],
        "targets": {name: {"value": value, "target": target, "met": value >= target}
                    for name, (value, target) in targets.items()},
    }


def print_table(report: dict) -> None:
    failed = [c for c in report["checks"] if not c["ok"]]
    print(f"{len(report['checks']) - len(failed)}/{len(report['checks'])} correctness checks pass")
    for check in failed:
        print(f"  FAIL {check['name']} {check['dtype']}: rel error {check['rel_error']:.2e} >= {check['tolerance']:.0e}")
    print(f"copy bandwidth {report['copy_bandwidth_gbs']:.0f} GB/s")
    print(f"{'kernel':32s} {'ms':>9s} {'baseline ms':>12s} {'speedup':>8s} {'GB/s':>7s} {'of copy':>8s}  baseline")
    for t in report["timings"]:
        bandwidth = f"{t['bandwidth_gbs']:7.0f} {t['fraction_of_copy']:8.0%}" if t["bytes_moved"] else f"{'-':>7s} {'-':>8s}"
        print(f"{t['name']:32s} {t['ms']:9.3f} {t['baseline_ms']:12.3f} {t['speedup']:7.2f}x {bandwidth}  {t['baseline']}")
    for name, target in report["targets"].items():
        print(f"target {name}: {target['value']:.2f} (>= {target['target']}) {'met' if target['met'] else 'MISSED'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_kernels: no CUDA device here; run this on a machine with an NVIDIA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    report = run(args.quick)
    with open(args.json_path, "w") as f:
        json.dump(report, f, indent=2)
    print_table(report)
    summary = {
        "checks_ok": all(c["ok"] for c in report["checks"]),
        "targets_met": {name: t["met"] for name, t in report["targets"].items()},
        "json": args.json_path,
    }
    print(json.dumps(summary))
    return 0 if summary["checks_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
