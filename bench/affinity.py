"""Prefix-affinity routing: do a conversation's later turns find their prefix cached when several workers serve?

    python -m bench.affinity --json [--conversations 24] [--turns 5] [--seed 0] [--repeats 2]

One multi-turn chat workload through the real service (API and Celery workers as processes, tiny model, each
run on a PostgreSQL and a Redis of its own, so none sees another's cache or queues): on 1 worker; on 3 workers
with prefix-affinity routing (CONVOQ_AFFINITY on, the default: a turn goes to the queue of the worker that ran
the conversation's previous one); on 3 workers with CONVOQ_AFFINITY=off (shared queues only). The two 3-worker
configurations run `--repeats` times each, alternately, and their figures pool the runs: three engines on a
small machine's cores make one run's p95 swing by half. Every worker runs a warm-up job before the workload. The workload, drawn from `--seed`: `--conversations`
conversations of `--turns` turns, each with its own conversation_id and a one-line system prompt;
each turn's prompt is the whole history (earlier user messages, the replies the service returned) and a new
user message; priority 9, greedy, 16 new tokens. Conversations run concurrently, each submitting its next turn
when the previous one finished. Figures, from the database (turns 2.. unless said otherwise):
- `reuse_1_worker`, `reuse_3_workers`, `reuse_3_workers_no_affinity`: prompt tokens served from the prefix
  cache (timings.prompt_tokens_reused) over prompt tokens (results.prompt_tokens);
- `home_share` (`home_share_no_affinity`): turns that ran on the worker of the conversation's previous turn
  (jobs.worker), with affinity (without: about 1/3 by chance);
- `max_over_mean_load`: with affinity, the most jobs (every turn) one worker ran over the mean per worker, in
  the worst run;
- `chat_p95_ms_affinity`, `chat_p95_ms_no_affinity` (and `_1_worker`): end-to-end time (timings.end_to_end_ms:
  job created -> result stored) of every turn, 95th percentile.
Targets (`targets_met`): reuse_3_workers >= 0.9 reuse_1_worker; max_over_mean_load <= 1.5; the p95 with
affinity at most 1.1x the one without (10% for noise).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import uuid
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import sqlalchemy as sa
from tqdm import tqdm

from api.http.client import AsyncClient, Client
from bench.common import percentile, report, tiny_model
from bench.mixed_pipeline import ASKS, NAMES
from cli.servers import PostgresServer, RedisServer
from cli.stack import Stack
from jobs.priority import HIGHEST
from jobs.schemas import JobIn
from jobs.status import JobStatus
from jobs.tables import Job, Result, Timing
from migrations.apply import upgrade

KEY = "bench-key-not-a-secret"
SAMPLING = {"max_new_tokens": 16, "temperature": 0.0}
# short on purpose: a long prompt every conversation shares is cached on every worker after its first job, and
# would hide what routing is for, a conversation's own history
SYSTEM = "You are the support assistant of Northwind Parcel. Answer in two sentences, quoting the order number."
FOLLOW_UPS = ["It still says in transit.", "Nobody called me back.", "Can you check again?", "Thanks, and the invoice?",
              "I moved last week, is that a problem?", "The driver left a note but no parcel.", "Please escalate this."]


@dataclass
class Turn:
    conversation: int
    turn: int
    worker: str
    prompt_tokens: int
    reused: int
    e2e_ms: float
    run: int = 0  # which run of its configuration (`--repeats`)


def user_messages(conversations: int, turns: int, seed: int) -> list[list[str]]:
    """Each conversation's user messages: an opening with its own order number and name, then follow-ups."""
    rng = random.Random(seed)
    return [[f"Order {rng.randrange(10**6, 10**7)}, {rng.choice(NAMES)} here. {rng.choice(ASKS)}",
             *(rng.choice(FOLLOW_UPS) for _ in range(turns - 1))] for _ in range(conversations)]


async def converse(client: AsyncClient, c: int, users: list[str], bar: tqdm) -> list[uuid.UUID]:
    """One conversation, turn after turn; the ids of its jobs in turn order."""
    messages = [{"role": "system", "content": SYSTEM}]
    ids = []
    for user in users:
        messages.append({"role": "user", "content": user})
        job = await client.submit(JobIn(messages=messages, priority=HIGHEST, conversation_id=f"conversation-{c}",
                                        sampling=SAMPLING))
        done = await client.wait(job.id, timeout=600)
        if done.status != JobStatus.succeeded or done.result is None:
            raise RuntimeError(f"conversation {c}, turn {len(ids) + 1}: job {job.id} {done.status} ({done.error})")
        # a reply of nothing (EOS first) cannot be a message: a placeholder, the same in every configuration
        messages.append({"role": "assistant", "content": done.result.text or "(no reply)"})
        ids.append(job.id)
        bar.update()
    return ids


async def converse_all(url: str, users: list[list[str]], desc: str) -> list[list[uuid.UUID]]:
    with tqdm(total=sum(map(len, users)), desc=desc, file=sys.stderr) as bar:
        async with AsyncClient(url, KEY, timeout=60) as client:
            return await asyncio.gather(*(converse(client, c, u, bar) for c, u in enumerate(users)))


def warm_up(url: str, db: sa.Engine, workers: int) -> None:
    """Every worker's first engine steps, outside the measurement: a round of short jobs (no system prompt, so
    nothing cached for later) per worker at once, until each worker has run one (an idle worker takes whatever
    comes, so a round may miss one)."""
    warmed: set[str] = set()
    with Client(url, KEY) as client:
        for _ in range(20):
            ids = [client.submit(JobIn(messages=[{"role": "user", "content": f"Warm-up {i}."}], priority=HIGHEST,
                                       sampling=SAMPLING)).id for i in range(workers)]
            for job_id in ids:
                client.wait(job_id)
            with db.connect() as conn:
                warmed |= set(conn.execute(sa.select(Job.worker).where(Job.id.in_(ids))).scalars())
            if len(warmed) == workers:
                return
    raise RuntimeError(f"only {len(warmed)} of {workers} workers ran a warm-up job")


def serve(workers: int, affinity: bool, model: Path, users: list[list[str]], desc: str) -> list[Turn]:
    """The workload on a fresh service of `workers` workers; every turn's figures from the database."""
    pg, broker = PostgresServer().start(), RedisServer().start()
    try:
        upgrade(pg.url)
        env = {"CONVOQ_DATABASE_URL": pg.url, "CONVOQ_BROKER_URL": broker.url, "CONVOQ_MODEL": str(model),
               "CONVOQ_API_KEYS": KEY, "CONVOQ_WORKER_METRICS_PORT": "0", "CONVOQ_WORKER_CONCURRENCY": "32",
               "CONVOQ_AFFINITY": "on" if affinity else "off"}
        with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-affinity-"))) as stack:
            stack.start_api()
            db = sa.create_engine(pg.url)
            for _ in range(workers):
                stack.start_worker()
            warm_up(stack.api_url, db, workers)
            ids = asyncio.run(converse_all(stack.api_url, users, desc))
        turn_of = {job: (c, t) for c, jobs in enumerate(ids) for t, job in enumerate(jobs)}
        query = (sa.select(Job.id, Job.worker, Result.prompt_tokens, Timing.prompt_tokens_reused,
                           Timing.end_to_end_ms)
                 .join(Result, Result.job_id == Job.id).join(Timing, Timing.job_id == Job.id)
                 .where(Job.id.in_(list(turn_of))))
        with db.connect() as conn:
            rows = conn.execute(query).all()
        db.dispose()
    finally:
        pg.stop()
        broker.stop()
    if len(rows) != len(turn_of):
        raise RuntimeError(f"{desc}: {len(rows)} of {len(turn_of)} jobs have a result and timings")
    return [Turn(*turn_of[r.id], r.worker, r.prompt_tokens, r.prompt_tokens_reused, r.end_to_end_ms) for r in rows]


def reuse(turns: list[Turn]) -> float:
    later = [t for t in turns if t.turn > 0]
    return sum(t.reused for t in later) / sum(t.prompt_tokens for t in later)


def home_share(turns: list[Turn]) -> float:
    worker = {(t.run, t.conversation, t.turn): t.worker for t in turns}
    later = [t for t in turns if t.turn > 0]
    return sum(t.worker == worker[t.run, t.conversation, t.turn - 1] for t in later) / len(later)


def max_over_mean_load(turns: list[Turn]) -> float:
    """The most jobs one worker ran over the mean per worker, in the worst run."""
    worst = 0.0
    for run in {t.run for t in turns}:
        load = Counter(t.worker for t in turns if t.run == run)
        worst = max(worst, max(load.values()) / (sum(load.values()) / len(load)))
    return worst


def p95(turns: list[Turn]) -> float:
    return percentile([t.e2e_ms for t in turns], 0.95)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=24)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each 3-worker configuration, pooled")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    if args.turns < 2:
        parser.error("--turns must be at least 2: reuse is measured from the second turn on")
    model = tiny_model()
    users = user_messages(args.conversations, args.turns, args.seed)
    one = serve(1, True, model, users, "1 worker")
    three: list[Turn] = []
    spread: list[Turn] = []
    for r in range(args.repeats):  # alternated, so that a slow spell of the machine falls on both
        three += [replace(t, run=r) for t in serve(3, True, model, users, f"3 workers, affinity ({r + 1})")]
        spread += [replace(t, run=r) for t in serve(3, False, model, users, f"3 workers, no affinity ({r + 1})")]
    result = {
        "reuse_1_worker": round(reuse(one), 3),
        "reuse_3_workers": round(reuse(three), 3),
        "reuse_3_workers_no_affinity": round(reuse(spread), 3),
        "home_share": round(home_share(three), 3),
        "home_share_no_affinity": round(home_share(spread), 3),
        "max_over_mean_load": round(max_over_mean_load(three), 2),
        "chat_p95_ms_1_worker": round(p95(one), 1),
        "chat_p95_ms_affinity": round(p95(three), 1),
        "chat_p95_ms_no_affinity": round(p95(spread), 1),
    }
    result["targets_met"] = {
        "reuse": result["reuse_3_workers"] >= 0.9 * result["reuse_1_worker"],
        "load": result["max_over_mean_load"] <= 1.5,
        "p95": result["chat_p95_ms_affinity"] <= 1.1 * result["chat_p95_ms_no_affinity"],
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
