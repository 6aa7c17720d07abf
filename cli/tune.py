"""`convoq tune`: the batch-size diagnosis loop, automated.

Run a sample of real jobs (a JSONL file of batch lines, or recent jobs from the database) through the engine
once per setting of its batch limits (sequences per step, tokens per step), measure throughput, latency and
KV memory, and pick the smallest setting whose throughput is within `plateau` of the best while the KV
cache stays under 90% of its budget: past that point a bigger batch only adds memory and latency.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from tqdm import tqdm

from engine.config import EngineConfig
from engine.interface import Request, SamplingParams
from engine.llm_engine import LLMEngine
from engine.text import encode_chat
from worker.payload import sampling_from
from worker.prompts import chat_for

MEMORY_CEILING = 0.9


@dataclass
class Trial:
    max_num_seqs: int
    max_num_batched_tokens: int
    tok_s: float
    latency_p50_s: float
    latency_p95_s: float
    peak_kv_usage: float  # of the KV budget

    @property
    def fits(self) -> bool:
        return self.peak_kv_usage <= MEMORY_CEILING


def run_trial(base: EngineConfig, payloads: list[dict], seqs: int, tokens: int) -> Trial:
    engine = LLMEngine(EngineConfig(**{**base.__dict__, "max_num_seqs": seqs, "max_num_batched_tokens": tokens}))
    start = time.monotonic()
    for i, p in enumerate(payloads):
        prompt = encode_chat(engine.tokenizer, chat_for(p["kind"], p["messages"]))[: engine.max_model_len - 1]
        s = sampling_from(p)
        engine.add_request(Request(str(i), prompt, SamplingParams(
            max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed,
        ), priority=p.get("priority", 5), arrival=start))
    latencies, generated, peak_blocks = [], 0, 0
    while engine.has_unfinished():
        for completion in engine.step():
            latencies.append(time.monotonic() - start)
            generated += len(completion.token_ids)
        peak_blocks = max(peak_blocks, engine.stats()["kv_blocks_used"])
    elapsed = time.monotonic() - start
    latencies.sort()
    memory = engine.memory_report()
    block_bytes = memory["pool_bytes"] / memory["pool_blocks"]
    return Trial(seqs, tokens, generated / elapsed, statistics.median(latencies),
                 latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
                 peak_blocks * block_bytes / memory["kv_budget_bytes"])


def sweep(base: EngineConfig, payloads: list[dict], seqs: list[int], tokens: list[int]) -> list[Trial]:
    grid = [(s, t) for s in seqs for t in tokens if t >= s]
    return [run_trial(base, payloads, s, t) for s, t in tqdm(grid, desc="settings", unit="setting")]


def recommend(trials: list[Trial], plateau: float = 0.05) -> Trial | None:
    """The smallest setting within `plateau` of the best throughput among those under the memory ceiling."""
    fitting = [t for t in trials if t.fits]
    if not fitting:
        return None
    best = max(t.tok_s for t in fitting)
    near = [t for t in fitting if t.tok_s >= (1 - plateau) * best]
    return min(near, key=lambda t: (t.max_num_seqs, t.max_num_batched_tokens))


def sample_from_file(path: str, limit: int) -> list[dict]:
    from api.batch_input import parse_batch

    with open(path, "rb") as f:
        parsed, _, _ = parse_batch(f.read(), priority=5)
    return [p.job.model_dump(mode="json") for p in parsed[:limit]]


def sample_from_database(database_url: str, limit: int) -> list[dict]:
    from sqlalchemy import select

    from jobs.db import make_engine
    from jobs.tables import Job

    engine = make_engine(database_url)
    with engine.connect() as conn:
        rows = conn.execute(select(Job.payload).order_by(Job.created_at.desc()).limit(limit)).scalars().all()
    engine.dispose()
    return list(rows)
