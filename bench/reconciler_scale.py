"""The reconciler's load on the database and Redis for a fleet of simulated workers.

    python -m bench.reconciler_scale --workers 1000 --jobs-per-worker 8 --backlog 20000 --json

On a PostgreSQL and a Redis of its own it builds what a fleet leaves there: `--workers` rows in `workers`, each
holding `--jobs-per-worker` running jobs under live leases with their messages unacknowledged in Redis, and a
backlog of queued jobs whose messages wait in the queue lists (a few of them lost). Then it runs, with the code
the workers run, every worker's heartbeat once and the sweep once, counting SQL statements and Redis calls, and
scales them by the settings' periods into load per second across the fleet:

- beats: every worker, every `CONVOQ_HEARTBEAT_S`: constant work each (stamp, renew its own leases);
- sweeps: one worker at a time, every `CONVOQ_SWEEP_EVERY_S`, whoever holds the advisory lock (checked by
  `--contenders` workers trying at once: exactly one sweeps);
- for comparison, the load if every worker swept on every heartbeat instead.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
import uuid

import redis
import sqlalchemy as sa
from sqlalchemy import insert
from tqdm import tqdm

from bench.common import report
from bench.statements import Statements
from broker.app import create_celery
from broker.publish import publish
from broker.redis_layout import UNACKED_INDEX_KEY, UNACKED_KEY
from cli.servers import PostgresServer, RedisServer
from jobs.schemas import JobIn
from jobs.settings import Settings
from jobs.tables import Job, Run, Worker, job_row, utcnow
from migrations.apply import upgrade
from store.clock import db_now
from store.connections import make_db_engine, make_sessions
from worker.heartbeat import beat
from worker.sweep import Sweeper

CHUNK = 5000


def message_template(settings: Settings, sessions) -> tuple[bytes, str, str]:
    """One real message of ours as Kombu stored it, to copy for the simulated jobs; (raw, list name, job id)."""
    client = redis.Redis.from_url(settings.broker_url.get_secret_value())
    job = JobIn(messages=[{"role": "user", "content": "template"}], priority=2)
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), row := job_row(job, utcnow()))
    with sessions() as session:
        publish(create_celery(settings), session, [session.get(Job, row["id"])], settings)
    for name in client.keys("convoq.*"):
        if raw := client.lrange(name, 0, 0):
            client.delete(name)
            with sessions.begin() as session:  # only its message is wanted
                session.execute(sa.delete(Job.__table__).where(Job.id == row["id"]))
            return raw[0], name.decode(), str(row["id"])
    raise RuntimeError("the template message did not reach Redis")


def populate(sessions, settings: Settings, workers: int, per_worker: int, backlog: int, lost: int,
             dead: int) -> list[str]:
    """The fleet's rows and messages (the first `dead` workers' leases expired); returns the worker names."""
    client = redis.Redis.from_url(settings.broker_url.get_secret_value())
    raw, queue, template_id = message_template(settings, sessions)
    names = [f"host{w // 8}:{1000 + w}:1" for w in range(workers)]
    now = utcnow()
    job = JobIn(messages=[{"role": "user", "content": "Summarize the call."}], priority=2)
    with sessions.begin() as session:
        session.execute(insert(Worker.__table__), [dict(name=n, hostname=n.split(":")[0], pid=1, started_at=now,
                                                        heartbeat_at=now) for n in names])
    running: list[dict] = []
    for name in tqdm(names, desc="running jobs", file=sys.stderr):
        lease = uuid.uuid4()
        running += [job_row(job, now, status="running", worker=name, lease_id=lease, started_at=now, attempts=1,
                            published_at=now) for _ in range(per_worker)]
    queued = [job_row(job, now, published_at=now) for _ in range(backlog)]
    with sessions.begin() as session:
        for start in range(0, len(running), CHUNK):
            session.execute(insert(Job.__table__), running[start:start + CHUNK])
            session.execute(insert(Run.__table__), [dict(job_id=r["id"], lease_id=r["lease_id"], worker=r["worker"],
                                                         started_at=now) for r in running[start:start + CHUNK]])
        for start in range(0, len(queued), CHUNK):
            session.execute(insert(Job.__table__), queued[start:start + CHUNK])
        session.execute(sa.update(Job.__table__).where(Job.status == "running").values(lease_expires_at=db_now(3600)))
        session.execute(sa.update(Job.__table__).where(Job.worker.in_(names[:dead])).values(lease_expires_at=db_now(-1)))
    pipe = client.pipeline(transaction=False)
    for r in tqdm(running, desc="held messages", file=sys.stderr):
        tag = str(uuid.uuid4())
        held = raw.replace(template_id.encode(), str(r["id"]).encode())
        pipe.hset(UNACKED_KEY, tag, b"[" + held + b', "", "' + queue.encode() + b'"]')
        pipe.zadd(UNACKED_INDEX_KEY, {tag: time.time()})
    for q in tqdm(queued[lost:], desc="queued messages", file=sys.stderr):  # the first `lost` lost their message
        pipe.lpush(queue, raw.replace(template_id.encode(), str(q["id"]).encode()))
    pipe.execute()
    client.close()
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--jobs-per-worker", type=int, default=8)
    parser.add_argument("--backlog", type=int, default=20000, help="queued jobs waiting in the broker")
    parser.add_argument("--lost", type=int, default=20, help="queued jobs whose message Redis lost")
    parser.add_argument("--dead", type=int, default=5, help="workers that died: their leases have expired")
    parser.add_argument("--contenders", type=int, default=16, help="workers trying to sweep at the same moment")
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    args = parser.parse_args()
    pg, broker = PostgresServer().start(), RedisServer().start()
    try:
        upgrade(pg.url)
        # every queued job is old enough to be checked: the sweep does all the work it ever does
        settings = Settings(database_url=pg.url, broker_url=broker.url, unpublished_grace_s=0)
        db = make_db_engine(pg.url, pool_size=args.contenders)
        sessions = make_sessions(db)
        names = populate(sessions, settings, args.workers, args.jobs_per_worker, args.backlog, args.lost, args.dead)
        with sessions() as session:
            leases = {name: {} for name in names}
            for job_id, worker, lease in session.execute(sa.select(Job.id, Job.worker, Job.lease_id)
                                                         .where(Job.status == "running")):
                leases[worker][job_id] = lease
        statements = Statements(db)

        start = time.perf_counter()
        alive = names[args.dead:]  # a dead worker beats no more (a live one would renew even its expired leases)
        for name in tqdm(alive, desc="beats", file=sys.stderr):
            beat(sessions, name, leases[name], settings.dead_after_s, settings.sweep_every_s)
        beat_s = (time.perf_counter() - start) / len(alive)
        beat_statements = len(statements.sent) / len(alive)

        # every contender finds the sweep due and tries at once; the advisory lock and the turn let one through
        barrier, swept = threading.Barrier(args.contenders), []

        def contend() -> None:
            sweeper = Sweeper(sessions, create_celery(settings), settings)
            barrier.wait()
            if (result := sweeper.sweep()) is not None:
                swept.append(result)

        threads = [threading.Thread(target=contend) for _ in range(args.contenders)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

        sweeper = Sweeper(sessions, create_celery(settings), settings)
        first = sweeper.sweep(force=True)  # the contended sweep saw the lost messages missing; this confirms them
        statements.take()
        calls_before = redis_calls(broker.url)
        start = time.perf_counter()
        second = sweeper.sweep(force=True)
        sweep_s = time.perf_counter() - start
        sweep_statements = len(statements.take())
        sweep_redis = redis_calls(broker.url) - calls_before - 1  # less the INFO call itself
    finally:
        pg.stop()
        broker.stop()

    s = settings
    fleet_sql = args.workers * beat_statements / s.heartbeat_s + sweep_statements / s.sweep_every_s
    result = {
        "workers": args.workers,
        "running_jobs": args.workers * args.jobs_per_worker,
        "backlog": args.backlog,
        "beat_statements": round(beat_statements, 2),
        "beat_ms": round(beat_s * 1e3, 2),
        "sweepers_of_contenders": f"{len(swept)}/{args.contenders}",
        "sweep_statements": sweep_statements,
        "sweep_redis_calls": sweep_redis,
        "sweep_ms": round(sweep_s * 1e3, 1),
        "handed_back": swept[0]["handed_back"] if swept else None,
        "lost_messages_resent": first["published"] + second["published"],
        "fleet_sql_per_s": round(fleet_sql, 1),
        "fleet_redis_calls_per_s": round(sweep_redis / s.sweep_every_s, 2),
        "sweep_share_of_one_core": round(sweep_s / s.sweep_every_s, 3),
        "if_every_worker_swept_sql_per_s": round(args.workers * (beat_statements + sweep_statements) / s.heartbeat_s),
        "if_every_worker_swept_redis_per_s": round(args.workers * sweep_redis / s.heartbeat_s),
    }
    report(result, args.json)


def redis_calls(url: str) -> int:
    """Commands the Redis server has processed so far."""
    client = redis.Redis.from_url(url)
    try:
        return int(client.info("stats")["total_commands_processed"])
    finally:
        client.close()


if __name__ == "__main__":
    main()
