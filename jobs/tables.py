"""Tables: one row per job, at most one result and one timings row per job (keyed by the job id)."""

from __future__ import annotations

import hashlib
import json
import uuid
from datetime import UTC, datetime, timedelta

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    SmallInteger,
    String,
    Table,
    Text,
    UniqueConstraint,
    Uuid,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from jobs.schemas import LATER_OPTIONS, JobIn, Message, Sampling


def utcnow() -> datetime:
    return datetime.now(UTC)


def as_utc(moment: datetime) -> datetime:
    """SQLite hands back naive datetimes; every time we write is UTC."""
    return moment if moment.tzinfo else moment.replace(tzinfo=UTC)


class Base(DeclarativeBase):
    pass


class Batch(Base):
    """A bulk upload: its lines became jobs (`Job.batch_id`); lines that could not become jobs are `errors`.

    While it is `validating`, everything its ingest needs is here and in its stored file, so that any API process
    can take the ingest over from one that died (`api.service.batch_ingest`)."""

    __tablename__ = "batches"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    status: Mapped[str] = mapped_column(String(16), default="validating")
    priority: Mapped[int] = mapped_column(SmallInteger)
    input_name: Mapped[str | None] = mapped_column(String(255))
    tenant: Mapped[str | None] = mapped_column(String(64))  # who may see it (None: admin keys only)
    total: Mapped[int] = mapped_column(Integer, default=0)  # lines in the upload
    # lines that could not become jobs (each a `BatchLineError` row)
    invalid_lines: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    metadata_: Mapped[dict] = mapped_column("metadata", JSON, default=dict)
    # the `File` it was made from (OpenAI's JSON create); None for a multipart upload. No foreign key: deleting
    # the file later leaves the batch as it is, as OpenAI's do
    input_file_id: Mapped[str | None] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16), default="24h", server_default="24h")
    owner: Mapped[str | None] = mapped_column(String(64))  # sha256 of the API key that sent it: its jobs' owner
    # the stored file its lines are read from, until they are jobs (then NULL); the key keeps the file from being
    # deleted under an ingest
    source_file_id: Mapped[str | None] = mapped_column(
        String(64), ForeignKey("files.id", name="fk_batches_source_file_id"))
    # the lease of the ingest that reads it (a token new at every claim, an expiry on the database's clock,
    # renewed while it runs): once expired, any API process takes the ingest over
    ingest_lease_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    ingest_lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # ingests of it that raised (not counting those that ended with their process): a few, and it fails
    ingest_failures: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # created_at + completion_window: items unfinished by then end `expired`
    expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_batches_created", "created_at", "id"),  # `GET /v1/batches`, newest first
        Index("ix_batches_tenant_created", "tenant", "created_at", "id"),
        # the ingests to take over, and the file a deletion must not pull from under one
        Index("ix_batches_source_file", "source_file_id", postgresql_where=text("source_file_id IS NOT NULL")),
    )


class BatchLineError(Base):
    """A line of a batch upload that could not become a job, with its reason."""

    __tablename__ = "batch_line_errors"

    batch_id: Mapped[uuid.UUID] = mapped_column(
        Uuid, ForeignKey("batches.id", ondelete="CASCADE", name="fk_batch_line_errors_batch_id"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1-based line number in the upload
    custom_id: Mapped[str | None] = mapped_column(String(255))
    message: Mapped[str] = mapped_column(Text)


class File(Base):
    """An upload of `POST /v1/files` (OpenAI's File), or a multipart batch upload until its lines are jobs; its
    bytes are `FileChunk` rows, so that no upload or download holds more than one chunk in memory."""

    __tablename__ = "files"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)  # file-<32 hex>
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(255))
    size: Mapped[int] = mapped_column("bytes", BigInteger)
    owner: Mapped[str] = mapped_column(String(64))  # sha256 of the API key that uploaded it
    tenant: Mapped[str | None] = mapped_column(String(64))  # who may see it (None: admin keys only)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    __table_args__ = (Index("ix_files_tenant_created", "tenant", "created_at", "id"),)


class FileChunk(Base):
    """A file's bytes `seq * CHUNK_BYTES` on, `CHUNK_BYTES` of them (fewer in its last chunk)."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(
        String(64), ForeignKey("files.id", ondelete="CASCADE", name="fk_file_chunks_file_id"), primary_key=True)
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


CHUNK_BYTES = 2**20


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True, default=uuid.uuid4)
    status: Mapped[str] = mapped_column(String(16), default="queued")
    kind: Mapped[str] = mapped_column(String(16))
    priority: Mapped[int] = mapped_column(SmallInteger)
    payload: Mapped[dict] = mapped_column(JSON)
    conversation_id: Mapped[str | None] = mapped_column(String(128), index=True)
    # unique per tenant; `request_hash` (sha256 of the request) tells a repeat from a reuse with another body
    idempotency_key: Mapped[str | None] = mapped_column(String(128))
    request_hash: Mapped[str | None] = mapped_column(String(64))
    batch_id: Mapped[uuid.UUID | None] = mapped_column(
        Uuid, ForeignKey("batches.id", ondelete="CASCADE", name="fk_jobs_batch_id")
    )
    custom_id: Mapped[str | None] = mapped_column(String(255))
    owner: Mapped[str | None] = mapped_column(String(64))  # sha256 of the API key that submitted it
    tenant: Mapped[str | None] = mapped_column(String(64))  # who may see it (None: admin keys only)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    # what its tenant is told when it failed: a stable message and an OpenAI-style code (`engine_error`,
    # `invalid_prompt`, `timeout`, ...); the exception's own text is `error_detail`, shown to admin keys only
    error: Mapped[str | None] = mapped_column(Text)
    error_code: Mapped[str | None] = mapped_column(String(32))
    error_detail: Mapped[str | None] = mapped_column(Text)
    worker: Mapped[str | None] = mapped_column(String(255))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    published_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # not started by then: it expires unrun; running then: it is stopped and keeps its text so far
    deadline_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # a cancel asked for while it ran: the worker running it stops it and ends it `cancelled`
    cancel_requested_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The lease of the run that holds it (a fencing token, new at every claim): every write of that run is
    # conditional on it, so a worker that lost the job (frozen, cut off) can no longer change it. Cleared when the
    # job goes back to `queued`; kept on a job its run ended, as the mark of which run ended it.
    lease_id: Mapped[uuid.UUID | None] = mapped_column(Uuid)
    lease_expires_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))  # database clock
    # runs of it that ended with their worker (a crash, or a lease that expired): not charged as attempts
    crashes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # queued, sent, and yet its message was nowhere in the broker at this sweep: sent again if the next agrees
    message_missing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # when its run started alone in its worker (a suspect after crashes): a crash from then on is its own doing
    alone_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("ix_jobs_status_created", "status", "created_at"),
        Index("ix_jobs_owner_status", "owner", "status"),
        Index("ix_jobs_status_deadline", "status", "deadline_at"),  # the reconciler's expiry sweep
        Index("ix_jobs_batch_status", "batch_id", "status"),
        # the reconciler's sweep for expired leases reads only running jobs
        Index("ix_jobs_lease_expiry", "lease_expires_at", postgresql_where=text("status = 'running'")),
        UniqueConstraint("batch_id", "custom_id", name="uq_jobs_batch_custom_id"),
        Index("ix_jobs_created", "created_at"),  # `convoq report` and `convoq tune` windows
        # the reconciler's hunt for queued jobs with no message out, or whose message went out long ago
        Index("ix_jobs_queued_published", "published_at", "created_at",
              postgresql_where=text("status = 'queued'")),
        # running jobs by worker: a dead worker's jobs, a stopping worker's hand-back, cancels to pass on
        Index("ix_jobs_running_worker", "worker", postgresql_where=text("status = 'running'")),
        Index("ix_jobs_finished", "finished_at", postgresql_where=text("finished_at IS NOT NULL")),  # retention
        UniqueConstraint("tenant", "idempotency_key", name="uq_jobs_tenant_idempotency_key"),
        Index("ix_jobs_tenant_created", "tenant", "created_at"),
    )


# what a request gained after idempotency hashes were first stored (`jobs.schemas.LATER_OPTIONS`, two fields of a
# message, one of its sampling): left at their defaults they are not hashed, so that a request sent again across
# the deploy that added them still matches the hash stored for it
LATER_MESSAGE_FIELDS = ("tool_calls", "tool_call_id")
LATER_SAMPLING_FIELDS = ("speculative",)


def _without_later_defaults(dump: dict, model: type, names: tuple[str, ...]) -> dict:
    defaults = {name: model.model_fields[name].default for name in names}
    return {k: v for k, v in dump.items() if k not in defaults or v != defaults[k]}


def request_hash(job: JobIn) -> str:
    """sha256 of the job as submitted, keys sorted: equal for a repeat of the same request."""
    dump = _without_later_defaults(job.model_dump(mode="json"), JobIn, LATER_OPTIONS)
    dump["messages"] = [_without_later_defaults(m, Message, LATER_MESSAGE_FIELDS) for m in dump["messages"]]
    dump["sampling"] = _without_later_defaults(dump["sampling"], Sampling, LATER_SAMPLING_FIELDS)
    return hashlib.sha256(json.dumps(dump, sort_keys=True).encode()).hexdigest()


def job_row(job: JobIn, now: datetime, deadline_at: datetime | None = None, **columns) -> dict:
    """A new job's row for a Core insert (the column defaults fill status and attempts): the ORM's unit of
    work costs more than the rest of a submission. Its deadline is the earlier of its own `deadline_s` and
    `deadline_at` (a batch's expiry)."""
    if job.deadline_s is not None:
        own = now + timedelta(seconds=job.deadline_s)
        deadline_at = own if deadline_at is None else min(own, deadline_at)
    return dict(id=uuid.uuid4(), kind=job.kind, priority=job.priority, payload=job.model_dump(mode="json"),
                conversation_id=job.conversation_id, idempotency_key=job.idempotency_key,
                request_hash=request_hash(job) if job.idempotency_key else None, created_at=now,
                deadline_at=deadline_at, **columns)


class Result(Base):
    __tablename__ = "results"

    job_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    text: Mapped[str] = mapped_column(Text)
    reasoning: Mapped[str | None] = mapped_column(Text)  # with thinking: the <think> block's content
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str] = mapped_column(String(16))
    # long transcripts are summarized map-reduce: how many chunks, and how many levels of summaries
    chunks: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    levels: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    # OpenAI's `logprobs.content` of the answer, when the job asked for log-probabilities
    logprobs: Mapped[list | None] = mapped_column(JSON)
    # OpenAI's `message.tool_calls`, when the answer called tools
    tool_calls: Mapped[list | None] = mapped_column(JSON)
    # a job with `n` > 1: choices 1..n-1, each {text, reasoning, finish_reason, logprobs, tool_calls} (choice 0
    # is the row itself)
    choices: Mapped[list | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Timing(Base):
    """Where a job's time went, in milliseconds; `queue_wait_ms` and `ttft_ms` count from job creation."""

    __tablename__ = "timings"

    job_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    queue_wait_ms: Mapped[float] = mapped_column(Float)
    ttft_ms: Mapped[float] = mapped_column(Float)
    prefill_ms: Mapped[float] = mapped_column(Float)
    decode_ms: Mapped[float] = mapped_column(Float)
    engine_ms: Mapped[float] = mapped_column(Float)  # submitted to the engine -> completion
    end_to_end_ms: Mapped[float] = mapped_column(Float)  # job created -> result stored
    tokens_per_s: Mapped[float] = mapped_column(Float)
    # `worker:step`: the engine step that first ran the job (its batch-mates share it)
    engine_step: Mapped[str | None] = mapped_column(String(128))
    batch_size: Mapped[int] = mapped_column(Integer)
    prompt_tokens_reused: Mapped[int] = mapped_column(Integer, default=0)
    host_tokens_reused: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Worker(Base):
    """One worker process: its heartbeat tells the reconciler whether its `running` jobs are still alive."""

    __tablename__ = "workers"

    name: Mapped[str] = mapped_column(String(255), primary_key=True)  # host:pid:start, unique per process
    hostname: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # over the worker's life, stamped at each heartbeat: CPU seconds of the worker process and its engine process,
    # and the jobs it brought to a terminal status (the report's CPU per job)
    cpu_s: Mapped[float | None] = mapped_column(Float)
    jobs_finished: Mapped[int | None] = mapped_column(Integer)
    # the classes of its own queue it consumes ("interactive,bulk", "bulk", ...; None on rows older than migration
    # 0014: both), whether it takes conversations (`CONVOQ_AFFINITY`), and when its shutdown began: the router
    # places a conversation only on a live worker that takes it, consumes its class and is not draining
    classes: Mapped[str | None] = mapped_column(String(32))
    affinity: Mapped[bool] = mapped_column(Boolean, default=True, server_default=text("true"))
    draining_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    # workers gone silent (the reconciler), alive (`/readyz`), long dead (retention)
    __table_args__ = (Index("ix_workers_heartbeat", "heartbeat_at"),)



class Run(Base):
    """One run of a job: the lease a claim took, the worker that held it and how it ended. It counts how often
    the engine ran each job (a second run is explained only by an earlier one that ended with its worker)."""

    __tablename__ = "runs"

    job_id: Mapped[uuid.UUID] = mapped_column(Uuid, ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    lease_id: Mapped[uuid.UUID] = mapped_column(Uuid, primary_key=True)
    worker: Mapped[str] = mapped_column(String(255))
    started_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # succeeded | failed | cancelled | expired | retry | crashed | condemned | returned | stalled; None while it runs
    outcome: Mapped[str | None] = mapped_column(String(16))
    alone: Mapped[bool] = mapped_column(Boolean, default=False, server_default=text("false"))
    # writes this run tried after it had lost its lease: refused, never applied
    stale_writes: Mapped[int] = mapped_column(Integer, default=0, server_default="0")


class Sweep(Base):
    """When the reconciler last swept (one row): a worker's heartbeat reads it to learn whether a sweep is due,
    so that idle workers do not even try for the sweep's lock."""

    __tablename__ = "sweeps"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    swept_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))


# Rows of `jobs` and `batches` by status, kept by triggers (`store.counts`) as deltas that a reader folds:
# `/metrics` reads a handful of rows instead of counting the tables. The key only names a row (logical
# replication needs one to delete); nothing looks rows up by it.
status_counts = Table(
    "status_counts", Base.metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=True),
    Column("table_name", String(16), nullable=False),
    Column("status", String(16), nullable=False),
    Column("n", BigInteger, nullable=False),
)
