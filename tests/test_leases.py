"""Leases with fencing, crash attribution and the one sweeper, on a real PostgreSQL and Redis.

Workers are played by calls of the worker's own functions under different names; expiry is made to happen
by moving a lease's expiry into the past on the database's clock.
"""

from __future__ import annotations

import threading
import time
import uuid
from types import SimpleNamespace

import pytest
import redis
import sqlalchemy as sa
from sqlalchemy import insert
from sqlalchemy.exc import DBAPIError, OperationalError

from bench.audit import audit, messages_by_job
from bench.faults import lose_replies_of
from broker.app import create_celery
from broker.publish import publish
from engine.interface import Completion, EngineDead, Timings
from jobs.error_codes import ErrorCode
from jobs.schemas import JobIn
from jobs.tables import Job, job_row, utcnow
from worker import reconciler, results
from worker.claims import claim, claim_many, mark_alone
from worker.crashes import attribute, hand_back_expired
from worker.database import transient
from worker.heartbeat import beat, hand_back
from worker.leases import Leases
from worker.outcome import Ending, Outcome, RunEnd
from worker.reconciler import Reconciler
from worker.run_ends import fail, give_back, requeue
from worker.runs import guarded
from worker.solo import Solo
from worker.sweep import SWEEP_LOCK, LockLost, Sweeper


def new_job(sessions, text: str = "hi", **columns) -> str:
    job = JobIn(messages=[{"role": "user", "content": text}], priority=2)
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), row := job_row(job, utcnow(), **columns))
    return str(row["id"])


def done(job_id: str, text: str = "fine") -> Outcome:
    return Outcome(Completion(job_id, [1, 2, 3], text, 7, "length", None, Timings(first_step=1, batch_size=1)), 5.0)


def expire_leases(engine, *job_ids: str) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET lease_expires_at = now() - interval '1 second' WHERE id = ANY(:ids)"),
                     {"ids": [uuid.UUID(i) for i in job_ids]})


def row(engine, job_id: str) -> sa.Row:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT status, attempts, crashes, error_detail, worker, lease_id FROM jobs "
                                    "WHERE id = :i"),
                            {"i": uuid.UUID(job_id)}).one()


def runs(engine, job_id: str) -> list[tuple[str, str | None, int]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.text(
            "SELECT worker, outcome, stale_writes FROM runs WHERE job_id = :i ORDER BY started_at"),
            {"i": uuid.UUID(job_id)})]


def test_a_run_that_lost_its_lease_writes_nothing(db):
    engine, sessions = db
    job_id = new_job(sessions)
    old = claim(sessions, job_id, "w1", 3)
    expire_leases(engine, job_id)  # w1 froze past its lease
    assert hand_back_expired(sessions, max_crashes=5)["crashed"] == 1
    status, attempts, crashes, *_ = row(engine, job_id)
    assert (status, attempts, crashes) == ("queued", 0, 1)  # a crash is not charged as an attempt
    new = claim(sessions, job_id, "w2", 3)
    assert new.lease != old.lease and new.attempt == 1 and new.crashes == 1

    # w1 wakes up: every write it tries is refused and counted, none applied
    assert results.store(sessions, old, done(job_id, "stale"), "w1").applied is False
    assert requeue(sessions, old, "late error") is False
    assert fail(sessions, old, ErrorCode.engine_error, "late failure") is False
    assert mark_alone(sessions, old) is False
    assert row(engine, job_id)[0] == "running"
    assert results.store(sessions, new, done(job_id, "fresh"), "w2").applied
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT text FROM results")).scalars().all() == ["fresh"]
    assert runs(engine, job_id) == [("w1", "crashed", 4), ("w2", "succeeded", 0)]
    report = audit(engine, [uuid.UUID(job_id)])
    assert (report["duplicate_executions"], report["duplicate_results"], report["stale_writes_refused"]) == (0, 0, 4)


def test_a_live_worker_renews_its_expired_leases_unless_their_jobs_moved_on(db):
    engine, sessions = db
    kept, swept = new_job(sessions), new_job(sessions)
    claims = claim_many(sessions, [kept, swept], "w1", 3)
    expire_leases(engine, kept, swept)  # w1 was cut off from the database past its leases, alive
    with engine.begin() as conn:  # a sweep reached `swept` first and another worker took it
        conn.execute(sa.text("UPDATE jobs SET lease_id = NULL, status = 'queued' WHERE id = :i"), {"i": uuid.UUID(swept)})
    claim(sessions, swept, "w2", 3)
    assert beat(sessions, "w1", {c.job_id: c.lease for c in claims}, 30, 15).lost == [swept]
    assert row(engine, kept)[:3] == ("running", 1, 0)  # renewed: nobody else had it, nothing is charged
    assert not give_back(sessions, claims[1])  # the run that lost its job writes nothing
    assert row(engine, swept)[0] == "running" and row(engine, swept)[4] == "w2"
    assert runs(engine, swept) == [("w1", None, 1), ("w2", None, 0)]

    # w1 shuts down and returns `kept` with its message: uncharged, published, run again by the next worker
    assert give_back(sessions, claims[0], requeued=True)
    assert row(engine, kept)[:3] == ("queued", 0, 0)
    assert runs(engine, kept) == [("w1", "returned", 0)]
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT published_at IS NOT NULL FROM jobs WHERE id = :i"),
                            {"i": uuid.UUID(kept)}).scalar_one()


class LostReply:
    """Makes the next `n` commits of these sessions lose their reply (`bench.faults.lose_replies_of`): a
    transaction's COMMIT, or a statement that commits on its own, as a claim on PostgreSQL does."""

    def __init__(self, sessions, n: int = 1) -> None:
        self.left = n
        lose_replies_of(sessions, sessions.kw["bind"], self.lost)

    def lost(self) -> bool:
        if not self.left:
            return False
        self.left -= 1
        return True


def test_writes_retried_after_a_lost_reply_recognise_their_own_lease(db):
    engine, sessions = db
    job_id = new_job(sessions)
    lost = LostReply(sessions)
    claimed = claim(sessions, job_id, "w1", 3)
    assert lost.left == 0  # the first commit's reply was lost
    assert claimed is not None and claimed.attempt == 1  # the retry found the job running under its own lease
    lost = LostReply(sessions)
    assert results.store(sessions, claimed, done(job_id), "w1").applied  # and this retry found it stored
    assert lost.left == 0
    assert row(engine, job_id)[:2] == ("succeeded", 1)
    assert runs(engine, job_id) == [("w1", "succeeded", 0)]

    retried = new_job(sessions)
    claimed = claim(sessions, retried, "w1", 3)
    LostReply(sessions)
    assert requeue(sessions, claimed, "boom")  # applied, though its first reply was lost


def test_heartbeats_renew_held_leases_only_and_report_lost_and_cancelled_jobs(db):
    engine, sessions = db
    held, orphan, cancelled = (new_job(sessions) for _ in range(3))
    claims = {i: claim(sessions, i, "w1", 3) for i in (held, orphan, cancelled)}
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET cancel_requested_at = now() WHERE id = :i"), {"i": uuid.UUID(cancelled)})
    leases = {claims[i].job_id: claims[i].lease for i in (held, cancelled)}  # w1 never learnt it holds `orphan`
    expire_leases(engine, held, orphan, cancelled)
    first = beat(sessions, "w1", leases, lease_s=30, sweep_every_s=15)
    # w1's own expired leases are renewed (still its jobs' tokens); the one it does not know it holds is not
    assert first.lost == [] and first.cancelled == [cancelled] and first.sweep_due
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT lease_expires_at < now() FROM jobs WHERE id = :i"),
                            {"i": uuid.UUID(orphan)}).scalar_one()

    a, b = new_job(sessions), new_job(sessions)
    mine, theirs = claim(sessions, a, "w1", 3), claim(sessions, b, "w1", 3)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET cancel_requested_at = now() WHERE id = :i"), {"i": uuid.UUID(a)})
        conn.execute(sa.text("UPDATE jobs SET lease_expires_at = now() + interval '1 second'"))
    result = beat(sessions, "w1", {mine.job_id: mine.lease, theirs.job_id: theirs.lease}, 30, 15)
    assert result.lost == [] and result.cancelled == [a]
    with engine.connect() as conn:
        left = conn.execute(sa.text("SELECT min(lease_expires_at - now()) FROM jobs WHERE id IN (:a, :b)"),
                            {"a": uuid.UUID(a), "b": uuid.UUID(b)}).scalar_one()
    assert left.total_seconds() > 25  # renewed for lease_s on the database's clock


def test_a_heartbeat_stamps_what_its_worker_used_on_its_row(db):
    """The report's CPU per job reads it (`cli.report.usage_rows`): the first beat inserts the row with it, later
    beats replace it, a beat that brings none leaves the last one, and a clean stop stamps its last."""
    engine, sessions = db

    def used() -> tuple:
        with engine.connect() as conn:
            return conn.execute(sa.text("SELECT cpu_s, jobs_finished FROM workers WHERE name = 'w-usage'")).one()

    beat(sessions, "w-usage", {}, 30, 15, usage=(1.5, 3))
    assert used() == (1.5, 3)
    beat(sessions, "w-usage", {}, 30, 15, usage=(4.25, 10))
    assert used() == (4.25, 10)
    beat(sessions, "w-usage", {}, 30, 15)
    assert used() == (4.25, 10)
    hand_back(sessions, "w-usage", usage=(5.0, 12))  # a clean stop: what it did since its last beat
    assert used() == (5.0, 12)


def crash(engine, sessions, *job_ids: str) -> dict:
    expire_leases(engine, *job_ids)
    return dict(hand_back_expired(sessions, max_crashes=5))


def test_a_crash_while_a_suspect_runs_alone_condemns_it_and_spares_the_rest(db):
    engine, sessions = db
    poison, bystander = new_job(sessions), new_job(sessions)
    for n in (1, 2):  # two crashes with both in flight: both are suspects now
        claimed = claim_many(sessions, [poison, bystander], f"w{n}", 3)
        assert [c.crashes for c in claimed] == [n - 1, n - 1]
        assert crash(engine, sessions, poison, bystander) == {"crashed": 2}
    suspect, _ = claim_many(sessions, [poison, bystander], "w3", 3)
    assert mark_alone(sessions, suspect)  # the bystander waits for its turn meanwhile
    assert crash(engine, sessions, poison, bystander) == {"condemned": 1, "spared": 1}
    status, _, crashes, error, *_ = row(engine, poison)
    assert status == "failed" and crashes == 3 and "while it ran alone" in error
    assert row(engine, bystander)[:3] == ("queued", 0, 2)  # not charged for w3's death

    # a lease of w3 that expires later is still blamed on the condemned job, not charged
    late = new_job(sessions)
    claim(sessions, late, "w3", 3)
    assert crash(engine, sessions, late) == {"spared": 1}


def test_crashes_are_bounded_whatever_ran_beside_the_job(db):
    engine, sessions = db
    job_id = new_job(sessions)
    for n in range(5):
        claim(sessions, job_id, f"w{n}", 3)
        verdicts = crash(engine, sessions, job_id)
    assert verdicts == {"exhausted": 1}
    status, _, crashes, error, *_ = row(engine, job_id)
    assert status == "failed" and crashes == 5 and "CONVOQ_MAX_CRASHES" in error


def test_attribution_rules():
    rows = [SimpleNamespace(id=i, worker=w, alone_at=alone, crashes=c)
            for i, w, alone, c in [(1, "a", None, 0), (2, "a", utcnow(), 1), (3, "b", None, 3), (4, "b", None, 4),
                                   (5, "c", None, 0)]]
    assert attribute(rows, blamed_workers={"c"}, max_crashes=5) == {
        1: "spared", 2: "condemned", 3: "crashed", 4: "exhausted", 5: "spared"}


def test_a_suspect_waits_for_runs_in_progress_and_holds_new_ones_back():
    solo, order = Solo(), []
    first_in, release = threading.Event(), threading.Event()

    def shared(name: str, wait: threading.Event | None = None) -> None:
        with solo.shared():
            order.append(f"{name} in")
            if wait is not None:
                first_in.set()
                wait.wait(5)
            order.append(f"{name} out")

    def alone() -> None:
        with solo.alone():
            order.append("suspect alone")

    threads = [threading.Thread(target=shared, args=("first", release))]
    threads[0].start()
    first_in.wait(5)
    threads.append(threading.Thread(target=alone))
    threads[1].start()
    while solo._waiting == 0:  # the suspect is queued behind the run in progress
        threading.Event().wait(0.01)
    threads.append(threading.Thread(target=shared, args=("later",)))
    threads[2].start()
    release.set()
    for t in threads:
        t.join(5)
    assert order == ["first in", "first out", "suspect alone", "later in", "later out"]


def test_one_sweeper_at_a_time(db, settings):
    engine, sessions = db
    sweeper = Sweeper(sessions, create_celery(settings), settings)
    with engine.connect() as other:  # another worker is sweeping
        assert other.scalar(sa.text("SELECT pg_try_advisory_lock(:k)"), {"k": SWEEP_LOCK})
        assert sweeper.sweep(force=True) is None
        other.execute(sa.text("SELECT pg_advisory_unlock(:k)"), {"k": SWEEP_LOCK})
    assert sweeper.sweep() is not None
    slow = Sweeper(sessions, create_celery(settings), settings.model_copy(update={"sweep_every_s": 3600}))
    assert slow.sweep() is None  # a sweep just happened: not this worker's turn


def test_queued_jobs_are_sent_again_only_when_their_message_is_gone(db, settings):
    engine, sessions = db
    celery = create_celery(settings)
    waiting, lost, never, restored, stale = (new_job(sessions) for _ in range(5))
    with sessions() as session:
        publish(celery, session, list(session.scalars(sa.select(Job).where(Job.id.in_(
            [uuid.UUID(i) for i in (waiting, lost, restored, stale)])))), settings)
    client = redis.Redis.from_url(settings.broker_url.get_secret_value())
    by_job = messages_by_job(client, settings)
    assert {str(i) for i in by_job} == {waiting, lost, restored, stale}
    # `lost`: Redis lost its message; `restored`: handed back, its message back in the queue; `stale`: fetched
    # long ago by a consumer that died before claiming it
    name, raw = by_job[uuid.UUID(lost)][0]
    client.lrem(name, 1, raw)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET published_at = NULL WHERE id = :i"), {"i": uuid.UUID(restored)})
    name, raw = by_job[uuid.UUID(stale)][0]
    client.lrem(name, 1, raw)
    client.hset("unacked", "tag-1", f"[{raw.decode()}, \"\", \"{name}\"]")
    client.zadd("unacked_index", {"tag-1": 1.0})

    sweeper = Sweeper(sessions, celery, settings)
    first = sweeper.sweep(force=True)
    assert first["published"] == 1 and first["awaiting_confirmation"] == 2  # `never` at once; two to confirm
    second = sweeper.sweep(force=True)
    assert second["published"] == 2 and second["awaiting_confirmation"] == 0
    assert sweeper.sweep(force=True)["published"] == 0
    counts = {str(i): len(m) for i, m in messages_by_job(client, settings).items()}
    assert counts == {i: 1 for i in (waiting, lost, never, restored, stale)}  # one message each, no more
    assert not client.hexists("unacked", "tag-1")  # the dead consumer's copy is gone: Kombu cannot restore it
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM jobs WHERE published_at IS NULL")).scalar_one() == 0
    client.close()


def test_a_stamp_that_fails_after_the_send_is_left_to_the_sweep(db, settings, monkeypatch):
    from broker import publish as publishing

    engine, sessions = db
    celery = create_celery(settings)
    job_id = new_job(sessions)

    def deadlocked(session, job_ids):
        raise OperationalError("UPDATE jobs", {}, RuntimeError("deadlock detected"))

    monkeypatch.setattr(publishing, "mark_published", deadlocked)
    with sessions() as session:
        sent = publish(celery, session, [session.get(Job, uuid.UUID(job_id))], settings)
    assert sent == [uuid.UUID(job_id)]  # sent, and the caller goes on
    monkeypatch.undo()
    swept = Sweeper(sessions, celery, settings).sweep(force=True)
    assert swept["published"] == 0  # its message is there: stamped, not sent again
    client = redis.Redis.from_url(settings.broker_url.get_secret_value())
    assert len(messages_by_job(client, settings)[uuid.UUID(job_id)]) == 1
    client.close()
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT published_at FROM jobs")).scalar_one() is not None


def lease_left(engine, job_id: str) -> float:
    with engine.connect() as conn:
        return conn.execute(sa.text("SELECT extract(epoch FROM lease_expires_at - now()) FROM jobs WHERE id = :i"),
                            {"i": uuid.UUID(job_id)}).scalar_one()


def test_a_sweep_longer_than_a_lease_never_holds_the_heartbeat_back(db, settings, monkeypatch):
    engine, sessions = db
    job_id = new_job(sessions)
    leases = Leases()
    leases.add(claim(sessions, job_id, "w1", 3, lease_s=1))
    sweeping = threading.Event()

    def long_sweep(self, *args) -> dict:  # a large backlog, or an hour of finished jobs to delete
        sweeping.set()
        time.sleep(3)
        return {}

    monkeypatch.setattr(Sweeper, "_sweep", long_sweep)
    fast = settings.model_copy(update={"heartbeat_s": 0.2, "dead_after_s": 1.0})
    worker = Reconciler(sessions, create_celery(fast), fast, "w1", leases, lambda ids, reason: ids).start()
    try:
        assert sweeping.wait(5)
        for _ in range(10):  # through the sweep, three leases long
            time.sleep(0.25)
            assert lease_left(engine, job_id) > 0
    finally:
        worker.stop()
    assert row(engine, job_id)[:3] == ("running", 1, 0)


def freeze_inside_a_heartbeat(engine, job_id: str) -> sa.Connection:
    """A connection of `engine` left inside a transaction that holds w1's row and its job's row, as a worker
    frozen between its heartbeat's statements leaves them."""
    conn = engine.connect()
    conn.begin()
    conn.execute(sa.text("UPDATE workers SET heartbeat_at = heartbeat_at WHERE name = 'w1'"))
    conn.execute(sa.text("UPDATE jobs SET lease_expires_at = lease_expires_at WHERE id = :i"), {"i": uuid.UUID(job_id)})
    return conn


def test_a_transaction_a_frozen_worker_left_open_stops_no_sweep_and_is_ended(db, database, settings):
    """A worker frozen between the statements of its heartbeat (SIGSTOP, a paused VM) holds its `workers` row
    and its jobs' rows locked; here a connection left inside such a transaction stands in for it (a real
    SIGSTOP lands inside one only by chance: `test_faults`' frozen worker). The sweep skips what it cannot lock
    instead of waiting on it, and the server ends the frozen transaction after `idle_in_transaction_s` (a
    worker's `FROZEN_TRANSACTION_S`), so a later sweep hands its job back and marks it stopped."""
    from store.connections import make_db_engine

    engine, sessions = db
    job_id = new_job(sessions)
    claimed = claim(sessions, job_id, "w1", 3)
    beat(sessions, "w1", {claimed.job_id: claimed.lease}, 30, 15)
    with engine.begin() as conn:  # w1 then went silent: past its lease, and no longer alive
        conn.execute(sa.text("UPDATE workers SET heartbeat_at = now() - interval '1 hour' WHERE name = 'w1'"))
    expire_leases(engine, job_id)
    sweeper = Sweeper(sessions, create_celery(settings), settings)

    def stopped() -> bool:
        with engine.connect() as conn:
            return conn.scalar(sa.text("SELECT stopped_at IS NOT NULL FROM workers WHERE name = 'w1'"))

    frozen = freeze_inside_a_heartbeat(engine, job_id)  # a session with no timeout: frozen for good
    try:
        sweep = threading.Thread(target=sweeper.sweep, kwargs={"force": True})
        sweep.start()
        sweep.join(15)
        assert not sweep.is_alive()  # it did not wait on the locked rows
    finally:
        frozen.close()  # rolls back: the thread ends either way
        sweep.join(15)
    assert row(engine, job_id)[0] == "running" and not stopped()  # both left to a later sweep

    timed = make_db_engine(database, idle_in_transaction_s=0.5)
    frozen = freeze_inside_a_heartbeat(timed, job_id)
    try:
        time.sleep(2)
        with pytest.raises(DBAPIError) as ended:  # the server ended the session, and its locks with it
            frozen.execute(sa.text("SELECT 1"))
        assert transient(ended.value)  # what a worker's writes retry (`worker.database.retrying`)
        assert sweeper.sweep(force=True)["handed_back"] == 1
        assert row(engine, job_id)[:3] == ("queued", 0, 1) and stopped()
    finally:
        frozen.close()
        timed.dispose()


def test_the_sweep_lock_lasts_the_whole_sweep_and_a_sweeper_that_lost_it_stops(db, settings, monkeypatch):
    engine, sessions = db
    monkeypatch.setattr("worker.crashes.CHUNK", 2)
    # the server's minute, shortened; still several chunks long, so a sweeper slowed by a busy machine keeps it
    monkeypatch.setattr("worker.sweep.LOCK_IDLE_S", 2.5)
    ids = [new_job(sessions) for _ in range(24)]  # 12 chunks, 6 s of sweeping
    claim_many(sessions, ids, "gone", 3)
    expire_leases(engine, *ids)
    chunks, attribute_now = [], attribute

    def slow(*args):
        chunks.append(time.monotonic())
        time.sleep(0.5)
        return attribute_now(*args)

    monkeypatch.setattr("worker.crashes.attribute", slow)
    first, second = (Sweeper(sessions, create_celery(settings), settings) for _ in range(2))
    errors: list[Exception] = []

    def sweep_first() -> None:
        try:
            first.sweep(force=True)
        except Exception as exc:
            errors.append(exc)

    sweeping = threading.Thread(target=sweep_first)
    sweeping.start()
    time.sleep(3.0)  # longer than the lock may sit idle: the first sweeper kept it by using it
    assert second.sweep(force=True) is None
    held = sa.text("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND database = "
                   "(SELECT oid FROM pg_database WHERE datname = current_database()) "
                   "AND ((classid::bigint << 32) | objid::bigint) = :k")
    with engine.connect() as conn:  # its session ends, as a frozen sweeper's would once idle too long
        conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": conn.execute(held, {"k": SWEEP_LOCK}).scalar_one()})
        while conn.execute(held, {"k": SWEEP_LOCK}).first() is not None:
            time.sleep(0.01)
    ended = time.monotonic()
    sweeping.join(5)
    assert [t for t in chunks if t > ended] == []  # it stopped before its next chunk: no two sweepers at once
    assert [type(e) for e in errors] == [LockLost]
    left = 24 - 2 * len(chunks)
    assert second.sweep(force=True)["handed_back"] == left > 0  # the next sweeper goes on from there


def test_after_an_outage_expired_leases_wait_a_lease_for_their_workers(db, settings, monkeypatch):
    engine, sessions = db
    job_id = new_job(sessions)
    claimed = claim(sessions, job_id, "w1", 3)
    expire_leases(engine, job_id)  # the database was away for longer than a lease; w1 lives on
    short = settings.model_copy(update={"dead_after_s": 1.0, "heartbeat_s": 0.2})
    sweeper = Reconciler(sessions, create_celery(short), short, "w2", Leases(), lambda ids, reason: [])

    def beats(for_s: float) -> None:
        for _ in range(round(for_s / 0.2)):
            sweeper.beat()
            time.sleep(0.2)

    sweeper.beat()  # its first beat since the outage (or since it started: it cannot tell)
    assert not sweeper.settled()
    assert sweeper.sweeper.sweep(force=True, hand_back=sweeper.settled())["handed_back"] == 0
    assert beat(sessions, "w1", {claimed.job_id: claimed.lease}, 30, 15).lost == []  # w1's first beat back
    beats(1.2)
    assert sweeper.settled()
    assert sweeper.sweeper.sweep(force=True, hand_back=sweeper.settled())["handed_back"] == 0  # renewed by now
    assert row(engine, job_id)[:3] == ("running", 1, 0)

    real_beat = reconciler.beat

    def away(*args):
        raise OperationalError("UPDATE workers", {}, ConnectionRefusedError("the database is away"))

    monkeypatch.setattr(reconciler, "beat", away)
    with pytest.raises(OperationalError):  # one beat lost: nothing to go on
        sweeper.beat()
    assert sweeper.settled()
    time.sleep(0.7)  # an outage, as long as leases can expire in
    assert not sweeper.settled()
    monkeypatch.setattr(reconciler, "beat", real_beat)
    sweeper.beat()
    assert not sweeper.settled()  # back, and counting a lease from here
    beats(1.2)
    assert sweeper.settled()


def test_a_run_whose_engine_closed_at_shutdown_ends_handed_back_and_its_job_goes_back_uncharged(db):
    """The engine closed under a run while its worker shuts down: no crash of the job's doing. The job goes back
    uncharged, and the run ends `HANDED_BACK`, which returns its message to the queue. A job that moved on
    meanwhile is settled with nothing to send back."""
    engine, sessions = db
    job_id = new_job(sessions)
    claimed = claim(sessions, job_id, "w1", 3)
    begun = threading.Event()
    begun.set()
    ctx = SimpleNamespace(sessions=sessions, leases=Leases(), shutdown=SimpleNamespace(begun=begun),
                          progress=SimpleNamespace(status=lambda *_: None),
                          metrics=SimpleNamespace(refused=lambda: None))

    def closed() -> None:
        raise EngineDead("the engine was closed at shutdown")

    assert guarded(ctx, claimed, closed) == RunEnd(Ending.HANDED_BACK)
    assert row(engine, job_id)[:3] == ("queued", 0, 0)
    assert claim(sessions, job_id, "w2", 3) is not None  # taken by the next worker
    assert guarded(ctx, claimed, closed) == RunEnd(Ending.SETTLED)
