"""Do urgent chats stay fast while bulk summarization saturates the same worker? The service-level part of
`python -m bench.mixed --pipeline`.

Starts its own API and one worker (real processes, default worker settings) against the configured broker
and database (CONVOQ_BROKER_URL, CONVOQ_DATABASE_URL), then runs three phases on the tiny model:

1. bulk alone: one batch of transcript summaries (default batch priority), nothing else running (it runs
   first: after interactive traffic the engine keeps bulk steps short for a while, expecting more);
2. idle: priority-9 customer chats on a steady schedule, nothing else running;
3. mixed: a batch of the same size, and chats on the same schedule once its items are running.

Chat latency is the job's end-to-end time (created -> result stored) from the timings rows; bulk throughput
is the batch's completion tokens over upload -> the batch's `completed_at`, both read from the database.
Every phase has its own random order, ticket numbers and names, so the engine's prefix cache cannot serve
one phase from another.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

import sqlalchemy as sa
from tqdm import tqdm

from api.http.client import Client
from bench.common import chat_comparison, chat_figures, tiny_model
from cli.demo import SAMPLES
from cli.stack import Stack
from jobs.priority import HIGHEST
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.status import BATCH_SETTLED, TERMINAL, JobStatus
from jobs.tables import Batch, Job, Result, Timing, as_utc
from migrations.apply import upgrade
from store.connections import make_db_engine

KEY = "bench-key-not-a-secret"
NAMES = ["Ana", "Bilal", "Chen", "Dara", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jun", "Kofi", "Lena"]
ASKS = ["Where is my parcel?", "I was charged twice this month.", "The reset email never arrives.",
        "Can I change the delivery address?", "The app crashes on the billing page."]
MIN_MIXED = 5  # fewer chats than this inside the batch's run say nothing about contention
SETTLE_S = 0.5  # after the batch's first job started: let the worker pull the rest into the engine
POLL_S = 0.5  # database polls: on two cores every poll is CPU taken from the service being measured


def _chats(rng: random.Random, n: int, priority: int = HIGHEST) -> list[JobIn]:
    """Short chats, urgent unless said otherwise; the order number and name up front keep each phase's prompts
    apart."""
    return [JobIn(messages=[{"role": "user", "content": f"Order {rng.randrange(10**6, 10**7)}, "
                             f"{rng.choice(NAMES)} here. {rng.choice(ASKS)}"}],
                  priority=priority, sampling={"max_new_tokens": rng.randint(24, 48)}) for _ in range(n)]


def _batch_upload(rng: random.Random, n: int, max_new_tokens: int) -> bytes:
    """`n` lines cycling the bundled transcripts (as bench/bulk.py), each opening with its own ticket."""
    samples = [json.loads(line) for line in SAMPLES.read_text().splitlines()]
    lines = []
    for i in range(n):
        sample = samples[i % len(samples)]
        first, *rest = sample["transcript"]
        first = {**first, "content": f"Ticket {rng.randrange(10**7, 10**8)}. {first['content']}"}
        lines.append({"custom_id": f"{sample['custom_id']}-{i}", "transcript": [first, *rest],
                      "max_new_tokens": max_new_tokens})
    return "\n".join(json.dumps(x) for x in lines).encode()


def _send(url: str, jobs: list[JobIn], rate: float, stop: threading.Event) -> tuple[list[str], float]:
    """Submit job i at start + i / rate (absolute times, so one slow submit does not shift the rest) until
    `stop` is set. Returns the ids sent and the worst lateness against the schedule, in seconds."""
    ids: list[str] = []
    lag = 0.0
    with Client(url, KEY) as client:
        start = time.monotonic()
        for i, job in enumerate(jobs):
            if stop.wait(max(0.0, start + i / rate - time.monotonic())):
                break
            lag = max(lag, time.monotonic() - (start + i / rate))
            ids.append(str(client.submit(job).id))
    return ids, lag


def _wait_jobs(db: sa.Engine, ids: list[str], desc: str, timeout: float = 600) -> None:
    mine = Job.id.in_([uuid.UUID(i) for i in ids])
    query = sa.select(sa.func.count()).where(mine, Job.status.in_(TERMINAL))
    deadline = time.monotonic() + timeout
    with tqdm(total=len(ids), desc=desc, file=sys.stderr) as bar:
        while (done := _scalar(db, query)) < len(ids):
            bar.update(done - bar.n)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{desc}: {done}/{len(ids)} jobs finished within {timeout}s")
            time.sleep(POLL_S)
        bar.update(done - bar.n)


def _wait_batch(db: sa.Engine, batch_id: uuid.UUID, n: int, desc: str, timeout: float = 1800) -> None:
    """Until the batch settles; raises unless every one of its `n` lines became a job that succeeded."""
    done = sa.select(sa.func.count()).where(Job.batch_id == batch_id, Job.status.in_(TERMINAL))
    deadline = time.monotonic() + timeout
    with tqdm(total=n, desc=desc, file=sys.stderr) as bar:
        while _scalar(db, sa.select(Batch.status).where(Batch.id == batch_id)) not in BATCH_SETTLED:
            bar.update(_scalar(db, done) - bar.n)
            if time.monotonic() > deadline:
                raise TimeoutError(f"{desc}: batch {batch_id} not settled within {timeout}s")
            time.sleep(POLL_S)
        bar.update(n - bar.n)
    mine = Job.batch_id == batch_id
    ok = _scalar(db, sa.select(sa.func.count()).where(mine, Job.status == JobStatus.succeeded.value))
    status = _scalar(db, sa.select(Batch.status).where(Batch.id == batch_id))
    if status != "completed" or ok != n:  # a batch completes even when some of its jobs failed
        error = _scalar(db, sa.select(Job.error).where(mine, Job.error.is_not(None)).limit(1))
        raise RuntimeError(f"{desc}: batch {batch_id} {status}, {ok}/{n} lines succeeded (an error: {error})")


def _bulk(db: sa.Engine, batch_id: uuid.UUID, start: datetime) -> tuple[float, datetime]:
    """Tokens/s (completion tokens over upload -> `completed_at`, its last result stored), `completed_at`."""
    tokens = _scalar(db, sa.select(sa.func.sum(Result.completion_tokens))
                     .join(Job, Job.id == Result.job_id).where(Job.batch_id == batch_id))
    completed = as_utc(_scalar(db, sa.select(Batch.completed_at).where(Batch.id == batch_id)))
    return int(tokens) / (completed - start).total_seconds(), completed


def _chat_rows(db: sa.Engine, ids: list[str]) -> list[sa.Row]:
    """Every chat's timings; raises unless all of them succeeded."""
    query = (sa.select(Job.status, Job.error, Job.created_at, Timing.end_to_end_ms, Timing.ttft_ms,
                       Timing.decode_ms, Result.completion_tokens)
             .outerjoin(Timing, Timing.job_id == Job.id).outerjoin(Result, Result.job_id == Job.id)
             .where(Job.id.in_([uuid.UUID(i) for i in ids])))
    with db.connect() as conn:
        rows = conn.execute(query).all()
    bad = [r for r in rows if r.status != JobStatus.succeeded.value or r.end_to_end_ms is None]
    if bad or len(rows) != len(ids):
        raise RuntimeError(f"{len(bad)} of {len(ids)} chats did not succeed (first: {bad[:1]})")
    return rows


def _stats(rows: list[sa.Row]) -> dict[str, float] | None:
    """The chats' latency figures; None when the batch ended before any chat went out."""
    if not rows:
        return None
    return chat_figures([r.end_to_end_ms for r in rows], [r.ttft_ms for r in rows],
                        [r.decode_ms / max(1, r.completion_tokens - 1) for r in rows])


def _scalar(db: sa.Engine, query: sa.Select) -> object:
    with db.connect() as conn:
        return conn.execute(query).scalar()


def run_pipeline(chats: int, chat_rate: float, transcripts: int, max_new_tokens: int, seed: int) -> dict:
    settings = Settings()
    model = tiny_model()
    upgrade(settings.database_url.get_secret_value())
    db = make_db_engine(settings.database_url.get_secret_value(), pool_size=2)
    env = {"CONVOQ_DATABASE_URL": settings.database_url.get_secret_value(), "CONVOQ_BROKER_URL": settings.broker_url.get_secret_value(),
           "CONVOQ_MODEL": str(model), "CONVOQ_API_KEYS": KEY}
    rng = random.Random(seed)
    never = threading.Event()
    with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-mixed-"))) as stack, \
            Client(stack.api_url, KEY, timeout=600) as client, ThreadPoolExecutor(1) as pool:
        stack.start_api()
        stack.start_worker()
        # warm-up, outside the measurement: first engine steps, connection pools, the batch + map-reduce path
        # (bulk priority: no interactive traffic before the bulk-alone phase)
        _wait_jobs(db, _send(stack.api_url, _chats(rng, 2, priority=5), 100.0, never)[0], "warm-up")
        _wait_batch(db, client.create_batch(_batch_upload(rng, 2, max_new_tokens)).id, 2, "warm-up batch")

        start = datetime.now(UTC)
        alone = client.create_batch(_batch_upload(rng, transcripts, max_new_tokens), name="alone.jsonl")
        _wait_batch(db, alone.id, transcripts, "bulk alone")

        idle_ids, idle_lag = _send(stack.api_url, _chats(rng, chats), chat_rate, never)
        _wait_jobs(db, idle_ids, "idle chats")

        mixed_chats = _chats(rng, chats)
        start_mixed = datetime.now(UTC)
        mixed = client.create_batch(_batch_upload(rng, transcripts, max_new_tokens), name="mixed.jsonl")
        first = sa.select(sa.func.count()).where(Job.batch_id == mixed.id, Job.started_at.is_not(None))
        deadline = time.monotonic() + 300
        while not _scalar(db, first):  # its items are running: the engine is busy with bulk work
            if time.monotonic() > deadline:
                raise TimeoutError(f"no job of batch {mixed.id} started within 300s")
            time.sleep(0.1)
        time.sleep(SETTLE_S)
        stop = threading.Event()
        sender = pool.submit(_send, stack.api_url, mixed_chats, chat_rate, stop)
        try:
            _wait_batch(db, mixed.id, transcripts, "bulk + chats")
        finally:
            stop.set()  # stop sending once the batch is done: later chats would find the worker idle
        mixed_ids, mixed_lag = sender.result()
        _wait_jobs(db, mixed_ids, "mixed chats")

    idle = _stats(_chat_rows(db, idle_ids))
    alone_tok_s, _ = _bulk(db, alone.id, start)
    mixed_tok_s, completed = _bulk(db, mixed.id, start_mixed)
    # only chats created before the batch completed ran against bulk work; the stop above lags by one poll
    inside = [r for r in _chat_rows(db, mixed_ids) if as_utc(r.created_at) < completed]
    busy = _stats(inside)
    db.dispose()
    result = {
        "mode": "pipeline", "transcripts": transcripts,
        "chats_idle": len(idle_ids), "chats_mixed": len(inside),
        **chat_comparison(idle, busy),
        "bulk_tok_s_alone": round(alone_tok_s, 1), "bulk_tok_s_mixed": round(mixed_tok_s, 1),
        "bulk_keep": round(mixed_tok_s / alone_tok_s, 3),
        "send_lag_max_ms": round(1000 * max(idle_lag, mixed_lag), 1),
        "mixed_ok": len(inside) >= MIN_MIXED,
    }
    if len(inside) < MIN_MIXED:
        result["note"] = (f"only {len(inside)} chats ran during the mixed batch (want >= {MIN_MIXED}): "
                          "raise --transcripts or --chat-rate")
    return result
