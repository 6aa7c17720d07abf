"""Next tokens from last-position logits, every row at once.

Penalties come first: transformers' repetition penalty over the prompt and the output, OpenAI's presence
penalty over the output. Greedy rows then take the argmax. Sampled rows are divided by their temperature and
filtered on one sort of their logits by top-k, top-p and min-p, in that order (transformers' warpers), and
drawn in vocabulary order: rows with a seed from their own generator, so that their draws never depend on
their batch-mates, the others in one call.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.interface import SamplingParams


class Row(Protocol):
    """What sampling needs of a sequence (`engine.sequence.Sequence`)."""

    params: SamplingParams
    generator: torch.Generator | None
    token_ids: list[int]  # prompt, then output so far
    num_prompt_tokens: int


def _seen(rows: list[Row], vocab: int, device: torch.device, output_only: bool) -> torch.Tensor:
    """[rows, vocab] bool: which tokens each row's prompt and output (or output only) hold."""
    ids = [row.token_ids[row.num_prompt_tokens:] if output_only else row.token_ids for row in rows]
    lengths = torch.tensor([len(i) for i in ids], device=device)
    where = torch.repeat_interleave(torch.arange(len(rows), device=device), lengths)
    seen = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    seen[where, torch.tensor([t for i in ids for t in i], dtype=torch.long, device=device)] = True
    return seen


def penalize(logits: torch.Tensor, rows: list[Row]) -> torch.Tensor:
    """`logits [rows, vocab]` with each row's repetition and presence penalties applied."""
    repeat = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if repeat:
        sub = logits[repeat]
        penalty = torch.tensor([rows[i].params.repetition_penalty for i in repeat], device=logits.device)[:, None]
        # as transformers: a positive logit is divided by the penalty, a negative one multiplied
        hit = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[repeat] = torch.where(_seen([rows[i] for i in repeat], logits.shape[1], logits.device, False), hit, sub)
    present = [i for i, r in enumerate(rows) if r.params.presence_penalty != 0.0]
    if present:
        penalty = torch.tensor([rows[i].params.presence_penalty for i in present], device=logits.device)[:, None]
        seen = _seen([rows[i] for i in present], logits.shape[1], logits.device, True)
        logits[present] = logits[present] - penalty * seen
    return logits


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """[rows, vocab] probabilities after temperature, top-k, top-p and min-p, in vocabulary order."""
    device = logits.device
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    sorted_logits, order = (logits / temperature).sort(dim=-1, descending=True)
    rank = torch.arange(logits.shape[1], device=device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else logits.shape[1] for p in params], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    # a token goes when the ones before it already cover top_p; the most likely always stays
    drop = probs.cumsum(-1) - probs >= top_p
    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    drop |= probs < min_p * probs[:, :1]
    probs = probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, probs / probs.sum(-1, keepdim=True))


def sample(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """One token per row of `logits [rows, vocab]` (fp32)."""
    logits = penalize(logits, rows)
    tokens = logits.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if sampled:
        probs = _filtered_probs(logits[sampled], [rows[i].params for i in sampled])
        seeded = [j for j, i in enumerate(sampled) if rows[i].generator is not None]
        free = [j for j, i in enumerate(sampled) if rows[i].generator is None]
        if free:
            tokens[[sampled[j] for j in free]] = torch.multinomial(probs[free], 1)[:, 0]
        for j in seeded:
            tokens[sampled[j]] = torch.multinomial(probs[j], 1, generator=rows[sampled[j]].generator)[0]
    return tokens.tolist()
