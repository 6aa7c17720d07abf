"""A mixture-of-experts layer's experts on the CPU fast path: the grouped path against a loop over every expert.

    python -m bench.moe --json [--tokens 1,16,128,512] [--experts 64] [--top-k 8] [--hidden 1024]
                               [--intermediate 384] [--threads 1] [--repeat 7]

Both compute one layer's experts for the same routed tokens (`kernels.fused_moe_ref`'s contract), fp32, side by
side in one run: the grouped path is `kernels.torch_ops.fused_moe`, the engine's on CPU (the pairs sorted by
expert, each chosen expert two matmuls over its own rows); the loop is `kernels.fused_moe_ref.fused_moe_ref`,
which asks every expert in turn for its tokens, as transformers' eager experts do. Routing is a softmax top-k
of random logits, so a token's experts are spread as a trained router's roughly are. The default shape is
Qwen3-30B-A3B's layer at half its hidden size and experts (`moe_intermediate_size` 768 halved too). Each count
is timed as the best of `--repeat` runs of each, the two alternating after a warm-up, on `--threads` threads
(one by default: on a shared machine two threads' timings swing with the neighbours' load); the last line is
JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from kernels.fused_moe_ref import fused_moe_ref
from kernels.torch_ops import fused_moe


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,16,128,512", help="comma-separated token counts")
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="end with one JSON line of the results")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        inputs = moe_inputs(tokens, args.experts, args.top_k, args.hidden, args.intermediate, torch.float32)
        with torch.inference_mode():
            grouped, loop = best_ms([lambda inputs=inputs: fused_moe(*inputs),
                                     lambda inputs=inputs: fused_moe_ref(*inputs)], args.repeat)
        chosen = inputs[-1].unique().numel()
        rows.append({"tokens": tokens, "experts_chosen": chosen, "grouped_ms": round(grouped, 3),
                     "loop_ms": round(loop, 3), "loop_over_grouped": round(loop / grouped, 2)})
        print(f"{tokens:5d} tokens ({chosen:3d} experts chosen): grouped {grouped:8.3f} ms, every-expert loop "
              f"{loop:8.3f} ms, {loop / grouped:5.2f}x")
    if args.json:
        print(json.dumps({"experts": args.experts, "top_k": args.top_k, "hidden": args.hidden,
                          "intermediate": args.intermediate, "threads": torch.get_num_threads(), "rows": rows}))


if __name__ == "__main__":
    main()
