"""FP8 checkpoints: the weights' bytes against bf16, and tokens/s against the same model unquantized, side by side.

    python -m bench.fp8 --json [--preset tiny-blocks] [--requests 32] [--new-tokens 32] [--rounds 2] [--device auto]
    python -m bench.fp8 --json --preset tiny-moe-blocks   # Qwen3-MoE: its experts in FP8 too

A cli.tiny_model preset (random weights) is written as an FP8 checkpoint laid out as Qwen's `*-FP8` and as its
dequantized twin, an ordinary float32 checkpoint holding the same values (`cli.tiny_model.write_fp8`). Both load
in bf16 for the weights' bytes (`memory_report`), then run the same greedy requests in the engine's own dtype
(fp32 on a CPU, bf16 on a GPU), rounds alternating so that the machine's drift falls on both. On a CPU the FP8
model dequantizes each projection's weight for every matmul (and each chosen expert's), so the tokens/s ratio is
that cost, and the outputs are identical; on a GPU with FP8 tensor cores it runs the W8A8 GEMM and experts
(activations quantized too, so outputs may part ways), and the GEMM is also timed against a bf16 matmul at
Qwen3-32B's MLP shapes (bench.gpu_kernels).
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.common import MODELS_DIR, report, tiny_model, tokens_per_s
from cli.tiny_model import write_fp8
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.model.fp8 import Fp8Linear


def checkpoints(preset: str) -> tuple[str, str]:
    """The preset's FP8 copy and its dequantized float32 twin under the data folder, written on first use."""
    fp8, fp32 = MODELS_DIR / f"{preset}-fp8", MODELS_DIR / f"{preset}-fp32"
    if not (fp8 / "config.json").exists() or not (fp32 / "config.json").exists():
        print(f"writing the FP8 copy of {preset} in {fp8} and its dequantized twin in {fp32}", file=sys.stderr)
        write_fp8(tiny_model(preset), fp8, fp32)
    return str(fp8), str(fp32)


def weight_bytes(fp8: str, fp32: str, device: str) -> dict[str, int | float]:
    """Both models' weights loaded in bf16: all of them, the layers' projections alone, and the experts of a
    mixture-of-experts model."""
    quantized = LLMEngine(EngineConfig(model=fp8, device=device, dtype="bfloat16", initial_blocks=4))
    plain = LLMEngine(EngineConfig(model=fp32, device=device, dtype="bfloat16", initial_blocks=4))
    projections = [m for m in quantized.model.modules() if isinstance(m, Fp8Linear)]
    fp8_projections = sum(t.nbytes for m in projections for t in (m.weight, m.weight_scale_inv, m.scale_rows))
    bf16_projections = sum(2 * m.weight.numel() for m in projections)
    ours, bf16 = quantized.memory_report(), plain.memory_report()
    experts = {} if not bf16["expert_bytes"] else {
        "expert_bytes_fp8": ours["expert_bytes"], "expert_bytes_bf16": bf16["expert_bytes"],
        "experts_fp8_over_bf16": round(ours["expert_bytes"] / bf16["expert_bytes"], 4)}
    return {"weights_bytes_fp8": ours["weights_bytes"], "weights_bytes_bf16": bf16["weights_bytes"],
            "fp8_over_bf16": round(ours["weights_bytes"] / bf16["weights_bytes"], 3),
            "projection_bytes_fp8": fp8_projections, "projection_bytes_bf16": bf16_projections,
            "projections_fp8_over_bf16": round(fp8_projections / bf16_projections, 4), **experts}


def side_by_side(fp8: str, fp32: str, device: str, requests: int, new_tokens: int, rounds: int) -> dict:
    """Tokens/s of the FP8 model and of its dequantized twin, each the mean of `rounds` alternating runs."""
    engines = {name: LLMEngine(EngineConfig(model=path, device=device)) for name, path in
               (("fp8", fp8), ("unquantized", fp32))}
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    for name, engine in engines.items():
        tokens_per_s(engine, 4, 4, f"warm-{name}.")  # first steps allocate and warm up
    for r in range(rounds):
        for name, engine in engines.items():
            rate, outputs[name] = tokens_per_s(engine, requests, new_tokens, f"{name}.{r}.")
            rates[name].append(rate)
    ours, plain = statistics.mean(rates["fp8"]), statistics.mean(rates["unquantized"])
    ops = engines["fp8"].executor.ops
    return {"dtype": str(engines["fp8"].config.torch_dtype).removeprefix("torch."),
            "fp8_linear": ops.fp8_linear.__name__,
            "fp8_experts": f"{ops.fp8_fused_moe.__module__}.{ops.fp8_fused_moe.__name__}",
            "tokens_per_s_fp8": round(ours, 1), "tokens_per_s_unquantized": round(plain, 1),
            "fp8_over_unquantized": round(ours / plain, 3), "identical": outputs["fp8"] == outputs["unquantized"]}


def gemm_timings() -> list[dict]:
    """On a GPU with FP8 tensor cores: the W8A8 GEMM against a bf16 matmul, Qwen3-32B's MLP shapes."""
    from bench import gpu_kernels
    from kernels.fp8_gemm import has_fp8_tensor_cores

    if not torch.cuda.is_available() or not has_fp8_tensor_cores("cuda"):
        return []
    return [{"shape": t.name, "fp8_ms": round(t.ms, 4), "bf16_ms": round(t.baseline_ms, 4),
             "speedup": round(t.speedup(), 3)} for t in gpu_kernels.time_fp8_gemms(quick=False)]


def run(preset: str = "tiny-blocks", device: str = "auto", requests: int = 32, new_tokens: int = 32,
        rounds: int = 2, gemm: bool = True) -> dict:
    """`gemm`: also time the GEMM on a GPU (the GPU check's `kernels` part times it already)."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    fp8, fp32 = checkpoints(preset)
    return {"preset": preset, "device": device, "requests": requests, "new_tokens": new_tokens,
            **weight_bytes(fp8, fp32, device), **side_by_side(fp8, fp32, device, requests, new_tokens, rounds),
            "gemm": gemm_timings() if gemm and device.startswith("cuda") else []}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-blocks", help="a cli.tiny_model preset")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    report(run(args.preset, args.device, args.requests, args.new_tokens, args.rounds), args.json)


if __name__ == "__main__":
    main()
