"""Next tokens from last-position logits, every row at once.

A grammar's mask first (tokens it forbids at -inf, on the logits' device), then penalties (transformers' repetition penalty over prompt and output, OpenAI's presence penalty over the
output), then greedy rows (a temperature under `GREEDY_BELOW`) take the argmax and sampled rows are scaled by
their temperature, filtered by top-k, top-p and min-p in that order (transformers' warpers) and all drawn in one
call by inverting their cumulative distribution. A seeded row's uniform number comes from a counter-based hash of (seed, tokens drawn
so far), so its draws never depend on its batch-mates, pre-emptions or the device.

On the CPU, sorting, selecting and argmax go through numpy, many times faster than torch on rows this short;
only sorted values are computed there (4x cheaper than indices) and the drawn rank's column is looked up
afterwards, tied logits keeping a rank each as a sort by column would give them.

Rows that ask for log-probabilities get them from the masked, penalized logits, before temperature and
filters (what the model and the constraints make of each token, as vLLM reports by default); the others cost
nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.interface import SamplingParams, TokenLogprobs
from engine.step import SamplingInputs, TokenMasks

MASK32 = 0xFFFFFFFF
# numpy sorts rows up to about this long faster than it selects their top values; longer rows are partitioned
# first, and only the part kept is sorted
SORT_WHOLE_ROW = 512


def _on_host(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype == torch.float32


def _column(values: list, device: torch.device, dtype=np.float32) -> torch.Tensor:
    """`[len(values), 1]` tensor of per-row numbers (through numpy: `torch.tensor` of a list is several times
    slower)."""
    return torch.from_numpy(np.array(values, dtype=dtype)).to(device)[:, None]


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Column of each row's largest value (the first one on ties)."""
    return torch.from_numpy(x.numpy().argmax(1)) if _on_host(x) else x.argmax(1)


def descending(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The `k` largest values of each row of `x`, largest first, `[rows, k]`, and on a device their columns
    (None on the host: `column_at` finds them)."""
    vocab = x.shape[1]
    if not _on_host(x):
        return x.topk(k) if k < vocab else x.sort(dim=-1, descending=True)
    a = x.numpy()
    if k < vocab and vocab > SORT_WHOLE_ROW:
        a = np.partition(a, vocab - k, axis=1)[:, vocab - k:]
    return torch.from_numpy(np.sort(a, axis=1)[:, ::-1][:, :k].copy()), None


def column_at(x: torch.Tensor, ranked: torch.Tensor, order: torch.Tensor | None, ranks: torch.Tensor) -> torch.Tensor:
    """For each row of `x`, the column of its `ranks[row, 0]`-th largest value. Without the `order` of
    `descending`: the value is looked up, and among the columns holding it (a tie), the one its rank falls on
    counting from the first rank holding that value."""
    if order is not None:
        return order.gather(1, ranks)[:, 0]
    values = ranked.gather(1, ranks).numpy()
    equal = x.numpy() == values
    nth = ranks.numpy()[:, 0] - (ranked.numpy() > values).sum(1)  # which of the equal columns
    if not nth.any():  # no tie reached past its first column: the first equal column
        return torch.from_numpy(equal.argmax(1))
    return torch.from_numpy((np.cumsum(equal, 1) > nth[:, None]).argmax(1))


def _seen(histories: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[rows, vocab] bool: which tokens each row's `histories` entry holds."""
    lengths = torch.tensor([len(h) for h in histories], device=device)
    where = torch.repeat_interleave(torch.arange(len(histories), device=device), lengths)
    seen = torch.zeros(len(histories), vocab, dtype=torch.bool, device=device)
    seen[where, torch.tensor([t for h in histories for t in h], dtype=torch.long, device=device)] = True
    return seen


def penalize(logits: torch.Tensor, rows: SamplingInputs) -> torch.Tensor:
    """`logits [rows, vocab]` with each row's repetition and presence penalties applied."""
    params, vocab, device = rows.params, logits.shape[1], logits.device
    repeat = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if repeat:
        sub = logits[repeat]
        penalty = torch.tensor([params[i].repetition_penalty for i in repeat], device=device)[:, None]
        # as transformers: a positive logit is divided by the penalty, a negative one multiplied
        hit = torch.where(sub > 0, sub / penalty, sub * penalty)
        logits[repeat] = torch.where(_seen([rows.histories[i] for i in repeat], vocab, device), hit, sub)
    present = [i for i, p in enumerate(params) if p.presence_penalty != 0.0]
    if present:
        penalty = torch.tensor([params[i].presence_penalty for i in present], device=device)[:, None]
        outputs = [rows.histories[i][rows.prompt_lens[i]:] for i in present]
        logits[present] = logits[present] - penalty * _seen(outputs, vocab, device)
    return logits


def _filtered_probs(ranked: torch.Tensor, params: list[SamplingParams], top_k: list[int]) -> torch.Tensor:
    """Probabilities after top-k, top-p and min-p of `ranked [rows, ranks]`, each row's scaled logits in
    descending order (ranks: the largest top-k, or the whole vocabulary); `top_k` per row, at most `ranks`.
    A filter no row uses is skipped (a top-p of 1 keeps everything, as transformers does not apply it)."""
    device = ranked.device
    if min(top_k) < ranked.shape[1]:
        rank = torch.arange(ranked.shape[1], device=device)[None, :]
        ranked = ranked.masked_fill(rank >= _column(top_k, device, np.int64), float("-inf"))
    probs = ranked.softmax(-1)
    drop = torch.zeros_like(probs, dtype=torch.bool)
    if any(p.top_p < 1 for p in params):
        # a token goes when the ones before it already cover top_p; the most likely always stays
        drop |= probs.cumsum(-1) - probs >= _column([p.top_p for p in params], device)
    if any(p.min_p > 0 for p in params):
        drop |= probs < _column([p.min_p for p in params], device) * probs[:, :1]
    return probs.masked_fill(drop, 0.0)


def _mix32(x):
    """A 32-bit integer hash (Wang/Mueller), on int64 values below 2**32: no product overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    x = ((x >> 16) ^ x) * 0x45D9F3B & MASK32
    return (x >> 16) ^ x


def seeded_uniforms(seeds: list[int], counters: list[int], device: torch.device) -> torch.Tensor:
    """One number in [0, 1) per (seed, counter), the same wherever and with whatever else it is computed
    (worked out on the host: a handful of integer operations on a few hundred numbers)."""
    low = np.array([s & MASK32 for s in seeds], dtype=np.int64)
    high = np.array([(s >> 32) & MASK32 for s in seeds], dtype=np.int64)
    counter = np.array(counters, dtype=np.int64)
    x = _mix32(_mix32(low ^ _mix32(high)) ^ (counter & MASK32))
    x = _mix32(x ^ (counter >> 32))
    return torch.from_numpy(x.astype(np.float64) / 2.0 ** 32).to(device)


def _draw(logits: torch.Tensor, params: list[SamplingParams], drawn: np.ndarray) -> torch.Tensor:
    """One token per row of `logits`, every row sampled (not greedy); `drawn`: each row's draws so far."""
    vocab = logits.shape[1]
    scaled = logits / _column([p.temperature for p in params], logits.device)
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    # when every row has a top-k, only the best `widest` ever survive: a partial sort is enough
    ranked, order = descending(scaled, max(top_k))
    probs = _filtered_probs(ranked, params, top_k)
    uniforms = torch.rand(len(params), dtype=torch.float64, device=logits.device)
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    if seeded:
        values = seeded_uniforms([params[j].seed for j in seeded], drawn[seeded].tolist(), logits.device)
        if len(seeded) == len(params):
            uniforms = values
        else:
            uniforms[seeded] = values
    cdf = probs.double().cumsum(-1)
    # the first rank whose cumulative mass exceeds the draw; clamped for rounding at the very top
    ranks = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).clamp_(max=probs.shape[1] - 1)
    return column_at(scaled, ranked, order, ranks)


def mask(logits: torch.Tensor, masks: TokenMasks) -> None:
    """Forbidden tokens of the constrained rows to -inf, in place: xgrammar's kernel on a device, `mask_host` on
    the host."""
    if _on_host(logits):
        mask_host(logits.numpy(), masks.bitmask.numpy(), masks.rows)
        return
    from xgrammar import apply_token_bitmask_inplace  # only steps with a constrained row get here

    apply_token_bitmask_inplace(logits, masks.bitmask.to(logits.device, non_blocking=True), indices=masks.rows)


def mask_host(logits: np.ndarray, bitmask: np.ndarray, rows: list[int]) -> None:
    """What xgrammar's kernel does to `logits [rows, vocab]` (bit t of a row's `bitmask` allows token t), in
    numpy: about twice as fast on the host, where that kernel tests every bit of every row. A grammar allows a
    few tokens at most places (JSON's structure: most of a mask's words are 0) and forbids a few elsewhere (in a
    string's text): a row of the first kind is set to -inf and its allowed tokens put back, one of the second
    has its forbidden tokens set, so that only the words that hold the few are unpacked."""
    vocab = min(logits.shape[1], bitmask.shape[1] * 32)
    rows = np.asarray(rows, dtype=np.intp)
    words = bitmask[rows].view(np.uint32)
    mostly_allowed = 2 * (words == MASK32).sum(1) > words.shape[1]
    if mostly_allowed.any():
        r, column = _set_bits(~words[mostly_allowed])
        keep = column < vocab
        logits[rows[mostly_allowed][r[keep]], column[keep]] = -np.inf
    if not mostly_allowed.all():
        few = ~mostly_allowed
        r, column = _set_bits(words[few])
        keep = column < vocab
        at = rows[few][r[keep]], column[keep]
        allowed = logits[at]
        logits[rows[few], :vocab] = -np.inf
        logits[at] = allowed


def _set_bits(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each set bit of `words [rows, n]` (uint32), its column being word * 32 + bit; only the
    words that are not 0 are unpacked."""
    r, w = np.nonzero(words)
    bits = np.unpackbits(words[r, w].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
    k, bit = np.nonzero(bits)
    return r[k], w[k] * 32 + bit


def sample(logits: torch.Tensor, rows: SamplingInputs, masks: TokenMasks | None = None,
           ) -> tuple[list[int], list[TokenLogprobs | None] | None]:
    """One token per row of `logits [rows, vocab]` (fp32), and the rows' log-probabilities (None when no row
    asked for them)."""
    if masks is not None:
        mask(logits, masks)
    logits = penalize(logits, rows)
    params = rows.params
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if not sampled:
        tokens = argmax(logits)
    elif len(sampled) == len(params):
        tokens = _draw(logits, params, rows.drawn)
    else:
        tokens = argmax(logits)
        tokens[sampled] = _draw(logits[sampled], [params[i] for i in sampled], rows.drawn[sampled]).to(tokens.device)
    tokens = tokens.tolist()
    return tokens, logprobs(logits, tokens, params)


def logprobs(logits: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprobs | None] | None:
    """Per row that asks (`logprobs` not None), the log-probability of its token and of its `logprobs` most likely
    ones; None when no row asks."""
    asking = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not asking:
        return None
    logp = torch.log_softmax(logits[asking].float(), dim=-1)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in asking], device=logits.device)[:, None])[:, 0].tolist()
    widest = max(params[i].logprobs for i in asking)
    top_values, top_ids = logp.topk(widest) if widest else (logp[:, :0], logp[:, :0].long())
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    out: list[TokenLogprobs | None] = [None] * len(params)
    for j, i in enumerate(asking):
        k = params[i].logprobs
        out[i] = (chosen[j], list(zip(top_ids[j][:k], top_values[j][:k], strict=True)))
    return out
