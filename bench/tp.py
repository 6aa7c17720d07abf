"""Tensor parallelism: tokens/s with the model on one rank and split over two, side by side.

    python -m bench.tp --json [--requests 64] [--new-tokens 64] [--rounds 2] [--preset tiny]

The same greedy requests run on an engine of one rank and on one of two (engine.tensor_parallel), rounds
alternating so that the machine's drift falls on both; `identical` says whether every output was the same
token for token. On a CPU (gloo) two ranks share the cores and pay an all-reduce per attention and per MLP
and a gather of the logits each step, so the ratio shows what the collectives cost; on GPUs, where each rank
has a device of its own and the collectives run over NVLink, it is the figure that matters.
"""

from __future__ import annotations

import argparse
import statistics

from bench.common import report, tiny_model, tokens_per_s
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--preset", default="tiny", help="a cli.tiny_model preset")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    path = str(tiny_model(args.preset))
    rates: dict[int, list[float]] = {1: [], 2: []}
    outputs: dict[int, list[list[int]]] = {}
    for r in range(args.rounds):
        for world in (1, 2):
            engine = LLMEngine(EngineConfig(model=path, device=args.device, tensor_parallel=world))
            try:
                tokens_per_s(engine, 4, 4, f"warm{world}.")  # first steps allocate and warm up
                rate, outputs[world] = tokens_per_s(engine, args.requests, args.new_tokens, f"tp{world}.{r}.")
            finally:
                engine.close()
            rates[world].append(rate)
    one, two = statistics.mean(rates[1]), statistics.mean(rates[2])
    report({"preset": args.preset, "requests": args.requests, "new_tokens": args.new_tokens,
            "tokens_per_s_tp1": round(one, 1), "tokens_per_s_tp2": round(two, 1), "tp2_over_tp1": round(two / one, 3),
            "identical": outputs[1] == outputs[2]}, args.json)


if __name__ == "__main__":
    main()
