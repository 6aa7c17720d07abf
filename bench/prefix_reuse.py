"""Prefix reuse on multi-turn chat traffic: the prefix cache and its host tier against no cache, same run.

    python -m bench.prefix_reuse --json

32 conversations of 10 turns share a 300-token system prompt. A few turns are in flight at a time and a
conversation comes back only after most others have had a turn, as in real traffic; each turn's prompt is the
previous prompt, the engine's own reply and a new user message. The GPU pool holds about a third of the
conversations' distinct tokens, so returning conversations mostly come back from the host tier.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections import deque
from pathlib import Path

import torch
from transformers import AutoTokenizer

from bench.common import report, tiny_model
from cli.tiny_model import SPECIAL_TOKENS
from engine.config import EngineConfig
from engine.interface import Request, SamplingParams
from engine.llm_engine import LLMEngine

CONVERSATIONS, TURNS, SYSTEM_TOKENS, IN_FLIGHT = 32, 10, 300, 4
USER_TOKENS, REPLY_TOKENS = (8, 24), (8, 16)
BLOCK_SIZE = 16


class Chat:
    """The traffic, drawn up front so both engines see the same user messages and reply lengths."""

    def __init__(self, vocab: int, seed: int) -> None:
        rng = random.Random(seed)
        draw = lambda n: [rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(n)]  # noqa: E731
        self.system = draw(SYSTEM_TOKENS)
        self.users = [[draw(rng.randint(*USER_TOKENS)) for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
        self.replies = [[rng.randint(*REPLY_TOKENS) for _ in range(TURNS)] for _ in range(CONVERSATIONS)]
        self.order = rng.sample(range(CONVERSATIONS), CONVERSATIONS)

    def pool_blocks(self) -> int:
        """A third of the distinct blocks of every conversation at its last turn."""
        per_conversation = sum(len(u) + r for us, rs in zip(self.users, self.replies, strict=True)
                               for u, r in zip(us, rs, strict=True))
        return math.ceil((SYSTEM_TOKENS + per_conversation) / BLOCK_SIZE / 3)


def run(engine: LLMEngine, chat: Chat) -> tuple[dict[tuple[int, int], list[int]], float, float]:
    """Replies by (conversation, turn), the fraction of prompt tokens reused, and total prefill seconds."""
    history = {c: list(chat.system) for c in chat.order}
    ready = deque(chat.order)
    turns = dict.fromkeys(chat.order, 0)
    replies: dict[tuple[int, int], list[int]] = {}
    prompt_tokens = reused = 0
    prefill_ms = 0.0
    in_flight: dict[str, int] = {}
    while ready or in_flight:
        while ready and len(in_flight) < IN_FLIGHT:
            c = ready.popleft()
            history[c] += chat.users[c][turns[c]]
            sampling = SamplingParams(max_new_tokens=chat.replies[c][turns[c]], ignore_eos=True)
            request_id = f"c{c}-t{turns[c]}"
            engine.add_request(Request(request_id, list(history[c]), sampling, conversation_id=f"c{c}"))
            in_flight[request_id] = c
        for done in engine.step():
            c = in_flight.pop(done.request_id)
            replies[(c, turns[c])] = done.token_ids
            history[c] += done.token_ids
            prompt_tokens += done.prompt_tokens
            reused += done.timings.prompt_tokens_reused
            prefill_ms += done.timings.prefill_ms
            turns[c] += 1
            if turns[c] < TURNS:
                ready.append(c)  # back of the line: it returns after the others have had a turn
    return replies, reused / prompt_tokens, prefill_ms / 1e3


def make_engine(path: Path, pool_blocks: int, cache: bool) -> LLMEngine:
    c = json.loads((path / "config.json").read_text())
    block_bytes = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4 * BLOCK_SIZE
    return LLMEngine(EngineConfig(model=str(path), dtype="float32", block_size=BLOCK_SIZE,
                                  kv_cache_memory=pool_blocks * block_bytes, initial_blocks=pool_blocks,
                                  enable_prefix_cache=cache))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    path = tiny_model()
    chat = Chat(len(AutoTokenizer.from_pretrained(path)), args.seed)
    results = {}
    for cache in (False, True):
        engine = make_engine(path, chat.pool_blocks(), cache)
        start = time.monotonic()
        results[cache] = (*run(engine, chat), engine.stats())
        print(f"cache={cache}: {time.monotonic() - start:.1f} s", file=sys.stderr)
    (plain, _, plain_prefill, _), (cached, reused_frac, cached_prefill, stats) = results[False], results[True]
    report({
        "reused_frac": round(reused_frac, 3),
        "host_prefetch_hit_rate": round(stats.host_prefetch_hit_rate, 3),
        "prefill_time_ratio": round(cached_prefill / plain_prefill, 3),
        "outputs_identical": cached == plain,
        "host_hit_tokens": stats.host_hit_tokens,
        "prefix_cache_hit_tokens": stats.prefix_cache_hit_tokens,
        "evictions": stats.evictions,
        "pool_blocks": chat.pool_blocks(),
    }, args.json)


if __name__ == "__main__":
    main()
