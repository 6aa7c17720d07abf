"""The worker's writes are idempotent, survive odd model output, and never leave a job `running`."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import insert

from bench.statements import Statements
from engine.interface import Completion, Timings
from jobs.error_codes import ErrorCode
from jobs.schemas import JobIn
from jobs.tables import Job, Result, job_row, utcnow
from store.connections import make_db_engine, make_sessions
from worker import results
from worker.claims import claim, claim_many
from worker.outcome import Outcome
from worker.run_ends import fail, requeue


def new_job(sessions, **payload) -> str:
    job = JobIn(messages=[{"role": "user", "content": "hi"}], **payload)
    with sessions.begin() as session:
        session.execute(insert(Job.__table__), row := job_row(job, utcnow()))
    return str(row["id"])


def counts(engine, job_id: str) -> tuple[str, int, int]:
    with engine.connect() as conn:
        status = conn.execute(sa.text("SELECT status FROM jobs WHERE id = :i"), {"i": uuid.UUID(job_id)}).scalar_one()
        n_results = conn.execute(sa.text("SELECT count(*) FROM results")).scalar_one()
        n_timings = conn.execute(sa.text("SELECT count(*) FROM timings")).scalar_one()
    return status, n_results, n_timings


def outcome(job_id: str, text: str = "fine") -> Outcome:
    return Outcome(Completion(job_id, [1, 2, 3], text, 7, "length", None, Timings(first_step=3, batch_size=2)), 12.0)


def test_a_message_delivered_twice_stores_one_result(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    first = claim(sessions, job_id, "w1", 3)
    assert claim(sessions, job_id, "w2", 3) is None  # redelivered while the first still runs
    results.store(sessions, first, outcome(job_id), "w1")
    results.store(sessions, first, outcome(job_id, "other"), "w1")  # the store itself repeated
    assert counts(engine, job_id) == ("succeeded", 1, 1)
    assert claim(sessions, job_id, "w3", 3) is None  # a later delivery finds it finished


def test_nul_in_generated_text_is_stored(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    results.store(sessions, claim(sessions, job_id, "w", 3), outcome(job_id, "a\x00b"), "w")
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT text FROM results")).scalar_one() == "a\ufffdb"
    # and everywhere else a result holds model output: its reasoning, its tool calls, its other choices
    other = new_job(sessions)
    calls = [{"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"a": "\x00"}'}}]
    answer = Outcome(Completion(other, [1], "x", 7, "stop"), 1.0, reasoning="r\x00", tool_calls=calls,
                     choices=[outcome(other, "c\x00")])
    assert results.store(sessions, claim(sessions, other, "w", 3), answer, "w").applied
    with make_sessions(engine)() as session:
        stored = session.get(Result, uuid.UUID(other))
    assert stored.reasoning == "r\ufffd" and stored.choices[0]["text"] == "c\ufffd"
    assert stored.tool_calls == calls  # JSON holds a NUL, escaped


def test_a_crashed_run_marks_the_job_failed(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    fail(sessions, claim(sessions, job_id, "w", 3), ErrorCode.engine_error, "RuntimeError: boom")
    assert counts(engine, job_id) == ("failed", 0, 0)
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT error, error_code, error_detail FROM jobs")).one()
    assert tuple(row) == ("the engine failed to run this job", "engine_error", "RuntimeError: boom")


def test_attempts_are_bounded(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    for attempt in (1, 2):
        claimed = claim(sessions, job_id, "w", 2)
        assert claimed.attempt == attempt
        assert requeue(sessions, claimed, f"boom {attempt}")
    assert claim(sessions, job_id, "w", 2) is None  # the third try is not run
    with engine.connect() as conn:
        status, code, detail = conn.execute(sa.text("SELECT status, error_code, error_detail FROM jobs")).one()
    assert status == "failed" and code == "engine_error"
    assert "gave up after 2 attempts" in detail and "boom 2" in detail


def test_many_jobs_are_claimed_and_stored_in_one_transaction_each(database):
    from jobs.tables import Batch

    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    with sessions.begin() as session:
        batch = Batch(status="in_progress", priority=1, total=3)
        session.add(batch)
    ids = [new_job(sessions) for _ in range(4)]
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE jobs SET batch_id = :b WHERE id <> :solo"),
                     {"b": batch.id, "solo": uuid.UUID(ids[3])})
    finished = claim(sessions, ids[2], "w0", 3)
    results.store(sessions, finished, outcome(ids[2]), "w0")

    claimed = claim_many(sessions, [ids[0], ids[1], ids[0], ids[2], ids[3]], "w1", 3)
    # the repeated id is claimed once, by its first entry; the finished job is not claimed again
    assert [c is not None for c in claimed] == [True, True, False, False, True]
    assert [str(c.job_id) for c in claimed if c] == [ids[0], ids[1], ids[3]]
    failed = Outcome(Completion(ids[3], [], "", 7, "error", "bad prompt", Timings()), 1.0)
    stored = results.store_many(sessions, [(claimed[0], outcome(ids[0], "one")), (claimed[1], outcome(ids[1], "two")),
                                           (claimed[4], failed)], "w1")
    assert [s.status.value for s in stored] == ["succeeded", "succeeded", "failed"]
    assert stored[0].timing["job_id"] == claimed[0].job_id and stored[2].timing is None
    with engine.connect() as conn:
        rows = dict(conn.execute(sa.text("SELECT j.id, r.text FROM jobs j LEFT JOIN results r ON r.job_id = j.id")).all())
        statuses = dict(conn.execute(sa.text("SELECT id, status FROM jobs")).all())
        batch_status = conn.execute(sa.text("SELECT status FROM batches")).scalar_one()
    assert [rows[uuid.UUID(i)] for i in ids] == ["one", "two", "fine", None]
    assert [statuses[uuid.UUID(i)] for i in ids] == ["succeeded", "succeeded", "succeeded", "failed"]
    assert batch_status == "completed"  # every job of the batch finished, so the store settled it


def test_a_claim_and_a_store_are_one_statement_each_on_postgresql(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    ids = [new_job(sessions) for _ in range(4)]
    statements = Statements(engine)
    claimed = claim_many(sessions, ids, "w1", 3)
    assert len(statements.take()) == 1  # the jobs and their runs rows, committed on their own
    with engine.begin() as conn:  # the last job's lease is lost: a sweep handed it to another worker
        conn.execute(sa.text("UPDATE jobs SET lease_id = :l WHERE id = :i"), {"l": uuid.uuid4(), "i": claimed[3].job_id})
    statements.take()
    stopped = Outcome(Completion(ids[2], [1], "half", 7, "cancelled", None, Timings()), 1.0)
    failed = Outcome(Completion(ids[1], [], "", 7, "error", "bad prompt", Timings()), 1.0)
    stored = results.store_many(sessions, [(claimed[0], outcome(ids[0], "one")), (claimed[1], failed),
                                           (claimed[2], stopped), (claimed[3], outcome(ids[3]))], "w1")
    # one statement for all of them; then, as one of them was not written, why, and its refusal recorded
    assert len(statements.take()) == 3
    assert [(s.status.value, s.applied, s.timing is not None) for s in stored] == [
        ("succeeded", True, True), ("failed", True, False), ("cancelled", True, False), ("succeeded", False, False)]
    with engine.connect() as conn:
        jobs = dict(conn.execute(sa.text("SELECT id, status FROM jobs")).all())
        texts = dict(conn.execute(sa.text("SELECT job_id, text FROM results")).all())
        timed = set(conn.execute(sa.text("SELECT job_id FROM timings")).scalars())
        runs = {row[0]: row[1:] for row in conn.execute(
            sa.text("SELECT job_id, outcome, stale_writes, ended_at IS NOT NULL FROM runs"))}
    assert [jobs[uuid.UUID(i)] for i in ids] == ["succeeded", "failed", "cancelled", "running"]
    assert texts == {uuid.UUID(ids[0]): "one", uuid.UUID(ids[2]): "half"}  # a stopped job keeps its text
    assert timed == {uuid.UUID(ids[0])}
    assert [runs[uuid.UUID(i)] for i in ids] == [
        ("succeeded", 0, True), ("failed", 0, True), ("cancelled", 0, True), (None, 1, False)]
    # the same write again (its reply was lost): what it wrote is recognised as its own, nothing is written twice
    again = results.store_many(sessions, [(claimed[0], outcome(ids[0], "other"))], "w1")
    assert again[0].applied
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT text FROM results WHERE job_id = :i"), {"i": claimed[0].job_id}) \
            .scalar_one() == "one"


def test_a_claims_text_is_the_same_whatever_its_number_of_jobs_on_postgresql(database):
    """Its ids are one array parameter: the driver parses the text once, however many jobs a flush claims."""
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    statements = Statements(engine)
    texts = set()
    for n in (1, 3, 60):
        ids = [new_job(sessions) for _ in range(n)]
        statements.take()
        assert all(c is not None for c in claim_many(sessions, ids, "w1", 3))
        sent = statements.take()
        assert len(sent) == 1
        texts.add(sent[0])
    assert len(texts) == 1


def test_group_commit_writes_waiting_items_together_and_isolates_a_bad_one():
    import threading
    import time

    from worker.group_commit import GroupCommit

    flushes: list[list[int]] = []
    started = threading.Event()

    def flush(items: list[int]) -> list[int]:
        started.set()
        time.sleep(0.05)  # a slow transaction: the other callers queue up behind it
        flushes.append(items)
        if -1 in items:
            raise ValueError("bad item")
        return [i * 10 for i in items]

    writer = GroupCommit(flush, "test-writer")
    out: dict[int, object] = {}

    def call(i: int) -> None:
        try:
            out[i] = writer(i)
        except ValueError as exc:
            out[i] = exc

    first = threading.Thread(target=call, args=(0,))
    first.start()
    started.wait()
    threads = [threading.Thread(target=call, args=(i,)) for i in [1, 2, -1, 3]]
    for t in threads:
        t.start()
    for t in [first, *threads]:
        t.join()
    writer.close()
    assert {i: out[i] for i in (0, 1, 2, 3)} == {0: 0, 1: 10, 2: 20, 3: 30}
    assert isinstance(out[-1], ValueError)
    # the four that waited went in one flush, which failed; then each alone, so only the bad one failed
    assert flushes[0] == [0] and sorted(flushes[1]) == [-1, 1, 2, 3]
    assert sorted(len(f) for f in flushes[2:]) == [1, 1, 1, 1]


def test_a_job_whose_payload_is_not_a_job_fails_at_claim(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    with sessions.begin() as session:
        job = Job(kind="chat", priority=5, payload={"kind": "chat", "priority": 5, "messages": []}, status="queued")
        session.add(job)
    assert claim(sessions, str(job.id), "w", 3) is None  # never handed to the engine
    with engine.connect() as conn:
        status, code, detail = conn.execute(sa.text("SELECT status, error_code, error_detail FROM jobs")).one()
    assert status == "failed" and code == "invalid_prompt"
    assert "payload is not a valid job" in detail and "messages" in detail


def job_columns(engine, job_id: str) -> tuple[str, str | None]:
    with engine.connect() as conn:
        return tuple(conn.execute(sa.text("SELECT status, error FROM jobs WHERE id = :i"), {"i": uuid.UUID(job_id)}).one())


def test_a_job_past_its_deadline_is_not_claimed_but_expires(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    late, on_time = new_job(sessions, deadline_s=0.001), new_job(sessions, deadline_s=3600)
    with sessions.begin() as session:  # the deadline was set from the creation: now it has passed
        session.execute(sa.update(Job).where(Job.id == uuid.UUID(late)).values(deadline_at=utcnow() - timedelta(seconds=1)))
    claimed = claim_many(sessions, [late, on_time], "w", 3)
    assert claimed[0] is None and claimed[1] is not None
    assert claimed[1].deadline_at is not None
    assert job_columns(engine, late) == ("expired", "its deadline passed before it ran")


def test_a_handed_back_job_whose_cancel_was_asked_for_ends_cancelled_at_claim(database):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    with sessions.begin() as session:  # running when the cancel came, then its worker died and it was handed back
        session.execute(sa.update(Job).where(Job.id == uuid.UUID(job_id)).values(cancel_requested_at=utcnow()))
    assert claim(sessions, job_id, "w", 3) is None
    assert job_columns(engine, job_id) == ("cancelled", "cancelled before it ran")


@pytest.mark.parametrize("reason", ["cancelled", "expired"])
def test_a_stopped_run_keeps_its_text_and_ends_with_the_reason(database, reason):
    engine = make_db_engine(database)
    sessions = make_sessions(engine)
    job_id = new_job(sessions)
    stopped = Outcome(Completion(job_id, [1, 2], "half an ans", 7, reason, None, Timings()), 5.0)
    results.store(sessions, claim(sessions, job_id, "w", 3), stopped, "w")
    assert counts(engine, job_id) == (reason, 1, 0)  # a result with the text so far; no timings: it did not finish
    with engine.connect() as conn:
        text, finish = conn.execute(sa.text("SELECT text, finish_reason FROM results")).one()
    assert (text, finish) == ("half an ans", reason)
    assert "kept in its result" in job_columns(engine, job_id)[1]


@pytest.mark.parametrize("ping_idle_s", [0.0, None])
def test_a_pooled_connection_dropped_while_idle_is_replaced_when_pinged(empty_database, ping_idle_s):
    """The API pings a pooled connection only once it has been idle a while
    (`store.connections._ping_when_idle`): one the server dropped meanwhile is replaced before it is used;
    unpinged, its first use fails."""
    engine = make_db_engine(empty_database, pool_size=1, ping_idle_s=ping_idle_s)
    with engine.connect() as conn:
        pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
    killer = sa.create_engine(empty_database)
    with killer.connect() as other:
        assert other.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar_one()
    killer.dispose()
    try:
        if ping_idle_s is None:
            with pytest.raises(sa.exc.OperationalError), engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
        else:
            with engine.connect() as conn:
                assert conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one() != pid
    finally:
        engine.dispose()


def test_a_connection_in_use_a_moment_ago_is_not_pinged(database):
    engine = make_db_engine(database, pool_size=1, ping_idle_s=0.5)
    pings = []
    ping = engine.dialect.do_ping
    engine.dialect.do_ping = lambda dbapi_connection: pings.append(1) or ping(dbapi_connection)
    try:
        for pause in (0.0, 0.0, 0.7, 0.0):
            time.sleep(pause)
            with engine.connect() as conn:
                conn.execute(sa.text("SELECT 1"))
    finally:
        engine.dispose()
    assert len(pings) == 1  # the checkout after the pause alone
