"""Next tokens from last-position logits, every row at once.

Penalties come first: transformers' repetition penalty over the prompt and the output, OpenAI's presence
penalty over the output. Greedy rows then take the argmax. Sampled rows are divided by their temperature and
filtered on one sort of their logits by top-k, top-p and min-p, in that order (transformers' warpers), and
all drawn in one call by inverting their cumulative distribution at one uniform number per row. A row with a
seed takes its number from a counter-based hash of (seed, tokens it has drawn so far), so its draws never
depend on its batch-mates, on pre-emptions or on the device, and no row needs a generator of its own.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.interface import SamplingParams

MASK32 = 0xFFFFFFFF


class Row(Protocol):
    """What sampling needs of a sequence (`engine.sequence.Sequence`)."""

    params: SamplingParams
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


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities after temperature, top-k, top-p and min-p, each row in descending order of its logits,
    `[rows, ranks]` (ranks: the largest top-k, or the whole vocabulary), and the vocabulary id at each rank."""
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    widest = max(p.top_k if 0 < p.top_k < vocab else vocab for p in params)
    # when every row has a top-k, only the best `widest` ever survive: a partial sort is enough
    scaled = logits / temperature
    sorted_logits, order = scaled.topk(widest) if widest < vocab else scaled.sort(dim=-1, descending=True)
    rank = torch.arange(widest, device=device)[None, :]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)[:, None]
    sorted_logits = sorted_logits.masked_fill(rank >= top_k, float("-inf"))
    probs = sorted_logits.softmax(-1)
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    # a token goes when the ones before it already cover top_p; the most likely always stays
    drop = probs.cumsum(-1) - probs >= top_p
    min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
    drop |= probs < min_p * probs[:, :1]
    return probs.masked_fill(drop, 0.0), order


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Wang/Mueller), on int64 tensors holding values below 2**32: no product overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def seeded_uniforms(seeds: list[int], counters: list[int], device: torch.device) -> torch.Tensor:
    """One number in [0, 1) per (seed, counter), the same wherever and with whatever else it is computed."""
    low = torch.tensor([s & MASK32 for s in seeds], dtype=torch.int64, device=device)
    high = torch.tensor([(s >> 32) & MASK32 for s in seeds], dtype=torch.int64, device=device)
    counter = torch.tensor(counters, dtype=torch.int64, device=device)
    x = _mix32(_mix32(low ^ _mix32(high)) ^ (counter & MASK32))
    x = _mix32(x ^ (counter >> 32))
    return x.double() / 2.0 ** 32


def sample(logits: torch.Tensor, rows: list[Row]) -> list[int]:
    """One token per row of `logits [rows, vocab]` (fp32)."""
    logits = penalize(logits, rows)
    tokens = logits.argmax(-1)
    sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
    if sampled:
        params = [rows[i].params for i in sampled]
        probs, order = _filtered_probs(logits[sampled], params)
        uniforms = torch.rand(len(sampled), dtype=torch.float64, device=logits.device)
        seeded = [j for j, p in enumerate(params) if p.seed is not None]
        if seeded:
            draws = [len(rows[sampled[j]].token_ids) - rows[sampled[j]].num_prompt_tokens for j in seeded]
            uniforms[seeded] = seeded_uniforms([params[j].seed for j in seeded], draws, logits.device)
        cdf = probs.double().cumsum(-1)
        # the first rank whose cumulative mass exceeds the draw; clamped for rounding at the very top
        ranks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).clamp_(max=probs.shape[1] - 1)
        tokens[sampled] = order.gather(1, ranks)[:, 0]
    return tokens.tolist()
