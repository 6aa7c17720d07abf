"""Next tokens from last-position logits: greedy rows in one argmax, sampled rows one by one."""

from __future__ import annotations

import torch

from engine.interface import SamplingParams


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """`logits [vocab]` with everything outside the top-k and the top-p nucleus set to -inf."""
    if 0 < top_k < logits.numel():
        logits = logits.masked_fill(logits < logits.topk(top_k).values[-1], float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the ones before it already cover top_p; the most likely always stays
        drop = probs.cumsum(-1) - probs >= top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of `logits [batch, vocab]` (fp32)."""
    tokens = logits.argmax(-1)
    for i, p in enumerate(params):
        if p.temperature > 0:
            probs = _filter(logits[i] / p.temperature, p.top_k, p.top_p).softmax(-1)
            tokens[i] = torch.multinomial(probs, 1, generator=generators[i])[0]
    return tokens.tolist()
