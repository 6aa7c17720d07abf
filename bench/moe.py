"""A mixture-of-experts layer's experts on the CPU fast path: the grouped path against a loop over every expert.

    python -m bench.moe --json [--tokens 1,16,128,512] [--experts 64] [--top-k 8] [--hidden 1024]
                               [--intermediate 384] [--threads 1] [--repeat 7] [--fp8]

Both compute one layer's experts for the same routed tokens (`kernels.fused_moe_ref`'s contract), fp32, side by
side in one run: the grouped path is `kernels.torch_ops.fused_moe`, the engine's on CPU (the pairs sorted by
expert, each chosen expert two matmuls over its own rows); the loop is `kernels.fused_moe_ref.fused_moe_ref`,
which asks every expert in turn for its tokens, as transformers' eager experts do. Routing is a softmax top-k
of random logits, so a token's experts are spread as a trained router's roughly are. The default shape is
Qwen3-30B-A3B's layer at half its hidden size and experts (`moe_intermediate_size` 768 halved too). Each count
is timed as the best of `--repeat` runs of each, the two alternating after a warm-up, on `--threads` threads
(one by default: on a shared machine two threads' timings swing with the neighbours' load); the last line is
JSON. With `--fp8` the same experts quantized to fp8 blocks (as an FP8 checkpoint holds them) run the CPU path for
FP8 experts too, `kernels.torch_ops.fp8_fused_moe`, which dequantizes each chosen expert for its matmuls.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from kernels.fused_moe_ref import fused_moe_ref, quantize_experts
from kernels.torch_ops import fp8_fused_moe, fused_moe


def moe_inputs(tokens: int, experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype,
               device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, ...]:
    """`x`, `w_gate_up`, `w_down`, `weights`, `ids` of one layer (random, scaled to unit-sized outputs), routed by a
    renormalized softmax top-k of random logits."""
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    x = randn(tokens, hidden)
    w_gate_up = randn(experts, 2 * intermediate, hidden, scale=hidden ** -0.5)
    w_down = randn(experts, hidden, intermediate, scale=intermediate ** -0.5)
    weights, ids = torch.randn(tokens, experts, generator=gen, device=device).softmax(-1).topk(top_k)
    return x, w_gate_up, w_down, (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


def best_ms(fns: list[Callable[[], object]], repeat: int) -> list[float]:
    """Each of `fns`' best time, run in turn `repeat` times after one warm-up call each."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    for _ in range(repeat):
        for fn, spent in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return [min(spent) * 1e3 for spent in times]


def time_layer(inputs: tuple[torch.Tensor, ...], fp8: bool, repeat: int) -> dict:
    """The grouped path and the loop on one layer's `moe_inputs`, and with `fp8` the grouped path on the experts
    quantized to fp8 blocks."""
    x, w_gate_up, w_down, weights, ids = inputs
    fns = [lambda: fused_moe(*inputs), lambda: fused_moe_ref(*inputs)]
    if fp8:
        experts = quantize_experts(w_gate_up, w_down)
        fns.append(lambda: fp8_fused_moe(x, *experts, weights, ids))
    with torch.inference_mode():
        grouped, loop, *quantized = best_ms(fns, repeat)
    row = {"experts_chosen": ids.unique().numel(), "grouped_ms": round(grouped, 3), "loop_ms": round(loop, 3),
           "loop_over_grouped": round(loop / grouped, 2)}
    if quantized:
        row |= {"fp8_grouped_ms": round(quantized[0], 3), "fp8_over_grouped": round(quantized[0] / grouped, 2)}
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,128,512", help="comma-separated token counts")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--fp8", action="store_true", help="also time the experts in fp8 (dequantized per matmul)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        inputs = moe_inputs(tokens, args.experts, args.top_k, args.hidden, args.intermediate, torch.float32)
        row = time_layer(inputs, args.fp8, args.repeat)
        rows.append({"tokens": tokens, **row})
        print(f"{tokens:5d} tokens ({row['experts_chosen']:3d} experts chosen): grouped {row['grouped_ms']:8.3f} ms, "
              f"every-expert loop {row['loop_ms']:8.3f} ms, {row['loop_over_grouped']:5.2f}x"
              + (f"; fp8 grouped {row['fp8_grouped_ms']:8.3f} ms" if args.fp8 else ""))
    if args.json:
        print(json.dumps({"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                          "intermediate": args.intermediate, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
