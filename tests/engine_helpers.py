"""Shared pieces of the engine tests: building engines, prompts, and running requests to completion."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cli.tiny_model import SPECIAL_TOKENS
from engine.config import EngineConfig
from engine.interface import Completion, EngineStats, GrammarKind, GrammarSpec, Request, SamplingParams
from engine.llm_engine import LLMEngine
from engine.model.families import read_shape
from engine.step import SamplingInputs
from jobs.chat import encode_chat


def make_engine(path: Path, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **overrides))


def kv_block_bytes(path: Path, block_size: int = 16) -> int:
    """Bytes of one block across all layers of a fp32 checkpoint: budgets in tests are counted in blocks."""
    c = json.loads((path / "config.json").read_text())
    return 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 4 * block_size


def prompts(count: int, shortest: int, longest: int, seed: int = 0, vocab: int = 4096) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(len(SPECIAL_TOKENS), vocab) for _ in range(rng.randint(shortest, longest))]
            for _ in range(count)]


TRANSCRIPTS = Path(__file__).resolve().parent.parent / "cli" / "samples" / "transcripts.jsonl"


def chats(path: Path, count: int = 8) -> list[list[int]]:
    """Customer chats (a transcript's opening turns, up to a customer's message) as the chat template of the
    model folder `path` renders them."""
    tokenizer = AutoTokenizer.from_pretrained(path)
    transcripts = [json.loads(line)["transcript"] for line in TRANSCRIPTS.read_text().splitlines()[:count]]
    return [encode_chat(tokenizer, t[: 1 + 2 * (i % 2)], thinking=False) for i, t in enumerate(transcripts)]


def greedy(max_new_tokens: int, ignore_eos: bool = True) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)


def run_all(engine: LLMEngine, requests: list[Request], check=None) -> dict[str, Completion]:
    """Submits `requests` together and steps until all finish; `check(engine)` runs after every step."""
    for request in requests:
        engine.add_request(request)
    done: dict[str, Completion] = {}
    while engine.has_unfinished():
        for completion in engine.step():
            done[completion.request_id] = completion
        if check is not None:
            check(engine)
    return done


def transformers_greedy(path: Path, prompts: list[list[int]], new_tokens: list[int]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, run alone (no padding), stopping at EOS."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    rows = []
    for ids, n in zip(prompts, new_tokens, strict=True):
        with torch.inference_mode():
            generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                       max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=0)
        row = generated[0, len(ids):].tolist()
        rows.append(row[: row.index(eos)] if eos in row else row)
    return rows


def assert_packed_logits_match(path: Path, reference: Path | None = None) -> None:
    """Four sequences packed into one forward of the engine on `path` (the longest, 200 tokens, crosses the
    tiny models' windows several times) give the logits transformers gives (fp32) on `reference` (by default
    the same folder) for each alone."""
    engine = make_engine(path, initial_blocks=32)
    hf = AutoModelForCausalLM.from_pretrained(reference or path, dtype=torch.float32).eval()
    ids = dict(enumerate([*prompts(3, 5, 200, seed=1), *prompts(1, 200, 200, seed=2)]))
    for i, prompt in ids.items():
        engine.add_request(Request(str(i), prompt, greedy(1)))
    step = engine.executor.pack(engine.scheduler.schedule(time.monotonic()))
    assert len(step.request_ids) == 4 and step.num_decodes == 0
    logits = engine.model.compute_logits(engine.executor.forward(step))
    for i, request_id in enumerate(step.request_ids):
        with torch.inference_mode():
            expected = hf(torch.tensor([ids[int(request_id)]])).logits[0]
        torch.testing.assert_close(logits[step.cu_seqlens[i]:step.cu_seqlens[i + 1]], expected, atol=1e-4, rtol=0)


def rank_block_bytes(path: Path, world: int = 1) -> int:
    """One 16-token KV block's bytes on one of `world` ranks (its KV heads' share, at least one head), fp32."""
    c = json.loads((path / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    heads = max(1, c["num_key_value_heads"] // world)
    return 2 * c["num_hidden_layers"] * heads * head_dim * 4 * 16


def tight(path: Path, world: int = 1) -> dict:
    """40 blocks for a few thousand tokens of work (12 where a window keeps each sequence's blocks few), 64-token
    prefill chunks, 96 tokens a step: chunked prefill and pre-emption on every run."""
    blocks = 12 if read_shape(path).windows[0] else 40
    return dict(kv_cache_memory=blocks * rank_block_bytes(path, world), initial_blocks=8, max_num_batched_tokens=96,
                prefill_chunk_size=64, max_num_seqs=32)


def greedy_requests(prompts: list[list[int]], new_tokens: list[int]) -> list[Request]:
    """Each prompt greedy for its number of new tokens, stopping at EOS, request ids "0", "1", ..."""
    return [Request(str(i), ids, greedy(n, ignore_eos=False))
            for i, (ids, n) in enumerate(zip(prompts, new_tokens, strict=True))]


def engine_greedy(path: Path, prompts: list[list[int]], new_tokens: list[int],
                  **overrides) -> tuple[list[list[int]], EngineStats]:
    """An engine's greedy tokens for each prompt (`greedy_requests`, submitted together), and its stats; the
    engine is closed after (a tensor-parallel engine's other ranks stopped)."""
    engine = make_engine(path, **overrides)
    try:
        done = run_all(engine, greedy_requests(prompts, new_tokens))
        return [done[str(i)].token_ids for i in range(len(prompts))], engine.stats()
    finally:
        engine.close()


def sampling_rows(rows: list) -> SamplingInputs:
    """What a step's plan hands the sampler for `rows`, each with a sequence's `params`, `token_ids` (prompt,
    then output) and `num_prompt_tokens`."""
    prompt_lens = np.array([row.num_prompt_tokens for row in rows], np.int64)
    drawn = np.array([len(row.token_ids) for row in rows], np.int64) - prompt_lens
    return SamplingInputs([row.params for row in rows], drawn, prompt_lens, [row.token_ids for row in rows])


class FakeCost:
    """A fixed step-cost model (seconds): the planner's decisions depend on it, not on this machine's speed."""

    def __init__(self, fixed: float = 0.004, per_token: float = 1e-4, per_row: float = 5e-4,
                 per_context: float = 0.0, per_draft_row: float = 0.0) -> None:
        self.fixed, self.per_token, self.per_row, self.per_context = fixed, per_token, per_row, per_context
        self.per_draft_row = per_draft_row

    def predict(self, work) -> float:
        return (self.fixed + self.per_token * work.prefill_tokens + self.per_row * work.decode_rows
                + self.per_context * work.decode_rows * work.decode_longest + self.per_draft_row * work.draft_rows)

    def observe(self, work, seconds: float) -> None:
        pass

    @property
    def cheapest(self) -> float:
        return self.fixed

    @property
    def coefficients(self) -> dict[str, float]:
        return {"step_fixed_s": self.fixed, "step_per_token_s": self.per_token, "step_per_row_s": self.per_row,
                "step_per_context_s": self.per_context, "step_per_draft_row_s": self.per_draft_row}


def json_grammar(schema: dict) -> GrammarSpec:
    """The grammar of JSON that validates against `schema`."""
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema))
