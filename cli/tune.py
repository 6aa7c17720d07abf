"""`convoq tune`: the batch-size diagnosis loop, automated.

Run a sample of real jobs (a JSONL file of batch lines, or recent jobs from the database) through the engine
the worker would run (the same settings, the same chat and map-reduce paths) once per setting of its batch
limits (sequences per step, tokens per step), measure throughput, latency and KV memory, and pick the
smallest setting whose throughput is within `plateau` of the best while the KV cache stays under 90% of its
budget: past that point a bigger batch only adds memory and latency.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

from tqdm import tqdm

from engine import builder
from jobs.model_source import resolve_model
from jobs.priority import DEFAULT_BATCH_PRIORITY
from jobs.schemas import JobIn
from jobs.settings import Settings
from worker.bridge import Bridge
from worker.engine_factory import engine_options
from worker.runs import RUN_BY_KIND

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


def run_trial(settings: Settings, jobs: list[JobIn], seqs: int, tokens: int) -> Trial:
    knobs = {**engine_options(settings), "max_num_seqs": seqs, "max_num_batched_tokens": tokens}
    bridge = Bridge.for_settings(builder.start_runner("engine", settings.model, knobs, resolve_model, own_process=False),
                                 settings)
    start = time.monotonic()

    created = datetime.now(UTC)

    def run(i: int) -> float:
        with bridge.run(str(i), jobs[i], created) as run:
            RUN_BY_KIND[jobs[i].kind](run)
        return time.monotonic() - start

    try:
        with ThreadPoolExecutor(len(jobs)) as pool:  # every job in flight at once, as the worker's threads are
            latencies = sorted(pool.map(run, range(len(jobs))))
        elapsed = time.monotonic() - start
        stats = bridge.stats()
    finally:
        bridge.close()
    return Trial(seqs, tokens, stats.tokens_generated / elapsed, statistics.median(latencies),
                 latencies[min(len(latencies) - 1, round(0.95 * (len(latencies) - 1)))],
                 stats.kv_blocks_peak / stats.kv_blocks_max)


def sweep(settings: Settings, jobs: list[JobIn], seqs: list[int], tokens: list[int]) -> list[Trial]:
    grid = [(s, t) for s in seqs for t in tokens if t >= s]
    return [run_trial(settings, jobs, s, t) for s, t in tqdm(grid, desc="settings", unit="setting")]


def recommend(trials: list[Trial], plateau: float = 0.05) -> Trial | None:
    """The smallest setting within `plateau` of the best throughput among those under the memory ceiling."""
    fitting = [t for t in trials if t.fits]
    if not fitting:
        return None
    best = max(t.tok_s for t in fitting)
    near = [t for t in fitting if t.tok_s >= (1 - plateau) * best]
    return min(near, key=lambda t: (t.max_num_seqs, t.max_num_batched_tokens))


def sample_from_file(path: str, limit: int) -> list[JobIn]:
    from api.service.batch_input import parse_batch

    with open(path, "rb") as f:
        parsed, _, _ = parse_batch(f.read(), priority=DEFAULT_BATCH_PRIORITY)
    return [p.job for p in parsed[:limit]]


def sample_from_database(database_url: str, limit: int) -> list[JobIn]:
    from sqlalchemy import select

    from jobs.tables import Job
    from store.connections import make_db_engine

    db = make_db_engine(database_url)
    with db.connect() as conn:
        rows = conn.execute(select(Job.payload).order_by(Job.created_at.desc()).limit(limit)).scalars().all()
    db.dispose()
    return [JobIn.model_validate(row) for row in rows]
