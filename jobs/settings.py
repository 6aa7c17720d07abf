"""Every setting of the service, read once from the environment (prefix `CONVOQ_`) or a `.env` file."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from jobs.priority import Priority

DATA_DIR = Path(".convoq")


SCOPES = frozenset({"submit", "read", "admin"})
DEFAULT_SCOPES = frozenset({"submit", "read"})
MIN_KEY_CHARS = 16  # shorter keys fall to guessing long before the failed-auth limit matters
TENANT = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class ApiKey:
    """What one `CONVOQ_API_KEYS` entry grants: scopes, and the tenant whose jobs, batches and files it sees."""

    digest: str  # sha256 of the key
    scopes: frozenset[str]
    tenant: str


def parse_key(entry: str) -> ApiKey:
    """`KEY[:scope+scope][@tenant]`, or the same with `sha256=HEX` in place of KEY.

    The hashed form keeps plaintext keys out of the environment; scopes default to submit+read; a key that
    names no tenant is a tenant of its own (its hash). Keys may not contain `:`, `@` or `,`.
    """
    head, at, tenant = entry.rpartition("@")
    if not at:
        head, tenant = entry, ""
    secret, _, scopes_text = head.partition(":")
    scopes = frozenset(s for s in scopes_text.split("+") if s) or DEFAULT_SCOPES
    if unknown := scopes - SCOPES:
        raise ValueError(f"unknown API key scope(s) {sorted(unknown)}; use {sorted(SCOPES)}")
    if at and not TENANT.fullmatch(tenant):
        raise ValueError("a tenant is 1-64 letters, digits, '_', '.' or '-'")
    if secret.startswith("sha256="):
        digest = secret.removeprefix("sha256=").lower()
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError("a sha256= key needs 64 hex digits")
    elif len(secret) < MIN_KEY_CHARS:
        raise ValueError(f"API keys must be at least {MIN_KEY_CHARS} characters")
    else:
        digest = hash_key(secret)
    return ApiKey(digest, scopes, tenant or digest)


def redact(url: str) -> str:
    """`url` with its password (if any) as `***`: what may be printed or logged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rpartition("@")[2]
    user = f"{parts.username}:" if parts.username else ":"
    return urlunsplit(parts._replace(netloc=f"{user}***@{netloc}"))


class Settings(BaseSettings):
    """The service's settings. Each field is read from `CONVOQ_<FIELD>`; the string below a field is its entry in
    the configuration reference (docs/configuration.md, written by `convoq config-docs`). The engine's own knobs
    are `EngineConfig` fields, read as CONVOQ_<FIELD> by the worker's settings (`worker.engine_factory.WorkerSettings`)."""

    model_config = SettingsConfigDict(env_prefix="CONVOQ_", env_file=".env", extra="ignore",
                                      use_attribute_docstrings=True)

    # Connection URLs may hold passwords: SecretStr, so they never show in a repr, a log or a traceback;
    # `.get_secret_value()` where a connection is made, `redact()` where one is printed.
    database_url: SecretStr = SecretStr(f"sqlite:///{DATA_DIR}/convoq.db")
    """SQLAlchemy URL of the database: PostgreSQL in production (`postgresql+psycopg://user:password@host/db`);
    the default SQLite file serves the demo and a single machine."""
    broker_url: SecretStr = SecretStr("redis://127.0.0.1:6379/0")
    """Celery broker URL: Redis (`redis://:password@host:6379/0`)."""
    model: str = str(DATA_DIR / "models" / "tiny")
    """An HF model folder or hub id (`Qwen/Qwen3-8B`), for every backend and the API; the default is the tiny
    random checkpoint `convoq tiny-model` and `convoq demo` write."""
    backend: str = Field("engine", pattern=r"^(hf|engine|[\w.]+:\w+)$")
    """`engine` (ours), `hf` (transformers' generate, the reference), or `package.module:factory` for a backend of
    your own: factory(model, device=..., dtype=...) returning a StepEngine. The engine's own knobs (device, dtype,
    KV memory, step limits, latency targets, ...) are settings of their own, listed apart."""
    max_batch_size: int = Field(16, ge=1, le=1024)
    """`hf` backend: requests per generate call."""
    generation_config: Literal["auto", "none"] = "auto"
    """Sampling fields a job leaves unset: `auto` takes them from the model folder's generation_config.json (Qwen3
    samples by default: temperature 0.6, top_p 0.95, top_k 20), `none` uses convoq's defaults (greedy)."""
    default_thinking: bool = False
    """Chats that do not say `thinking` let a thinking model reason first (summaries never do unless asked)."""
    speculative: Literal["off", "ngram"] = "ngram"
    """Draft-free speculative decoding in the engine: `ngram` lets a decoding request carry draft tokens into a
    step, tokens copied from after an earlier occurrence of its last few tokens (prompt and output: a summary
    copying names and phrases from its transcript) and the text its grammar forces next (a JSON record's keys and
    punctuation), all verified in the one forward that computes its next token, so a step can yield several of its
    tokens. The output is the same token for token (greedy, or seeded sampling) and the same in distribution
    otherwise. Each step the engine proposes only the drafts its fitted step cost says are worth their compute: on
    a GPU a large batch proposes none, so `ngram` is never slower than `off`. `off`: never. A job's
    `sampling.speculative` overrides it. The engine's `convoq_engine_draft_*` metrics show drafts proposed,
    accepted and the mean accepted per row; CONVOQ_SPECULATIVE_TOKENS bounds the drafts of a row and
    CONVOQ_SPECULATIVE_NGRAM_MIN / _MAX the matches."""
    engine_process: bool = True
    """The engine (model and step loop) runs in a process of its own, spawned by the worker, so the Python of the
    worker's Celery threads never holds up a step; false runs it as a thread of the worker process."""
    # the stall's hand-back: `worker.run_ends.record_stall`
    engine_stall_s: float = Field(180.0, gt=0)
    """An engine whose loop makes no progress for this long while it has work is stalled: its process is killed
    and a new one started, its jobs go back to the queue; a thread, which cannot be killed, ends its worker. A
    fixed limit, not one fitted to the step cost, because what it must stay clear of is the slowest honest step,
    which no fit has seen: a full-context prefill or a first-step kernel compile (seconds to tens of seconds).
    Three minutes is an order of magnitude above those, and small next to what a stuck engine would otherwise
    cost: its jobs, held until a person notices."""

    # the raw value is a SecretStr; `known_keys` holds their hashes
    api_keys: Annotated[SecretStr, NoDecode] = SecretStr("")
    """Comma-separated `KEY[:scopes][@tenant]` or `sha256=HEX[:scopes][@tenant]` entries, keys of at least 16
    characters, scopes `+`-joined from submit, read, admin (default submit+read; admin sees every tenant). A key
    without a tenant is a tenant of its own. Only hashes are kept once read. Empty refuses every `/v1` call."""
    rate_limit_per_s: float = Field(200.0, gt=0)
    """Requests per second per API key, per API process (a token bucket; past it `429` with Retry-After)."""
    rate_limit_burst: int = Field(400, ge=1)
    """The per-key token bucket's burst."""
    auth_failures_per_s: float = Field(0.2, gt=0)
    """Failed authentications (an unknown key) per client address, per API process: a token bucket refilled at
    this rate; an address past it gets `429` for every keyed request, its keys unchecked."""
    auth_failures_burst: int = Field(10, ge=1)
    """The failed-authentication bucket's burst."""
    max_request_bytes: int = Field(8 * 2**20, ge=1024)
    """One JSON request body, and one batch line (checked before the body is read; past it `413`)."""
    # The three bounds of a JSON schema in a request: the grammar it becomes is compiled by the worker, where a
    # schema at these bounds takes a few seconds at worst (a thousand optional properties).
    max_schema_bytes: int = Field(64 * 1024, ge=1024)
    """A JSON schema in a request (`response_format`'s, a tool's `parameters`, in a body or a batch line): its
    compact JSON's bytes. Past it a `400` naming the bound (a line error in a batch); OpenAI's own limits are of
    the same order."""
    max_schema_nodes: int = Field(2000, ge=16)
    """A JSON schema in a request: the JSON values it holds."""
    max_schema_depth: int = Field(32, ge=2, le=64)
    """A JSON schema in a request: its levels of nesting."""
    forwarded_allow_ips: str = "127.0.0.1,::1"
    """Proxies (IPs or networks, comma-separated, `*` any) whose X-Forwarded-For / X-Forwarded-Proto `convoq api`
    believes: behind a TLS-terminating proxy, name it here so that failed authentications are counted per real
    client, not per proxy (uvicorn's default, loopback only). Empty: the client is always the TCP peer."""

    # streams are multiplexed by `api.streams.hub.Hub`
    max_streams_per_key: int = Field(1000, ge=1)
    """Streams (`GET /v1/jobs/{id}/events`, and chat completions while they wait) per API key, per API process:
    past it a new one gets `429` with Retry-After. Each holds a connection to the API, none to Redis or the
    database (one pub/sub connection carries them all)."""
    max_streams: int = Field(10_000, ge=1)
    """Streams in all, per API process: past it a new one gets `429` with Retry-After."""
    api_redis_connections: int = Field(12, ge=5)
    """The most Redis connections one API process holds: one pub/sub connection for every stream, one for health
    checks, one for metrics, the rest Celery's pool for publishing and cancel broadcasts (two per pooled one)."""

    interactive_priority: Priority = 7
    """Jobs of at least this priority are interactive: a person waits on them (`jobs.queues.is_interactive`). They
    go to the interactive queue and get the engine's latency targets; everything else is bulk."""
    bulk_share: float = Field(0.75, gt=0, le=1)
    """Bulk jobs may hold at most this share of a worker's threads: the rest stay free for interactive messages."""
    bulk_group: int = Field(16, ge=1, le=256)  # `broker.publish`
    """A batch's lines travel this many to a Celery message: claimed, stored and acknowledged together, so a bulk
    line costs the worker a share of a message's fixed cost, not all of it. Interactive jobs always travel one to
    a message (a person waits on each). 1 sends bulk lines one to a message too."""
    interactive_queue: str = "convoq.interactive"
    """The shared queue of interactive jobs (each worker also reads one of its own, this name `@` the worker)."""
    bulk_queue: str = "convoq.bulk"
    """The shared queue of bulk jobs (each worker also reads one of its own, this name `@` the worker)."""
    affinity: bool = True  # `broker.affinity`
    """Prefix affinity: a job with a conversation_id goes to the queue of the worker that holds its conversation's
    prefix. Off on the API and the workers turns the routing off."""
    affinity_max_waiting: int = Field(8, ge=1)
    """A conversation's job goes to the shared queue instead when its worker's own queue already has this many
    messages of its class waiting (the worker is saturated: the shared queue serves it sooner than the prefix
    would save)."""
    visibility_timeout: int = Field(4 * 3600, ge=60)
    """Seconds a delivered but unacknowledged message stays invisible before Redis hands it out again: longer than
    the longest queue wait plus run time, or long jobs would run twice."""
    worker_concurrency: int = Field(256, ge=1, le=1024)
    """Celery threads feeding one engine (jobs in flight per engine): as many as the engine batches
    (max_num_seqs), so every message the worker holds is in the engine, where priorities and batching happen."""

    max_attempts: int = Field(3, ge=1, le=20)
    """Tries per job: a job whose run raises is tried at most this many times, waiting
    retry_backoff_s * 2**(n-1) between tries (crashes are counted apart)."""
    retry_backoff_s: float = Field(2.0, ge=0)
    """The base of the exponential backoff between a job's tries."""
    heartbeat_s: float = Field(5.0, gt=0)
    """Each worker's heartbeat: one transaction that renews the leases of the jobs it holds."""
    dead_after_s: float = Field(30.0, gt=0)
    """The lease a claim takes on its job, renewed at every heartbeat. A lease not renewed in time (the worker
    died, froze or lost the database) expires on the database's clock, the job is handed back, and anything its
    old run still writes is refused. Also how long a worker that stopped beating still counts as alive."""
    shutdown_grace_s: float = Field(90.0, ge=0)
    """A warm shutdown (SIGTERM: a deploy) lets the jobs in flight finish for this long, then hands the rest back
    uncharged, their messages returned to the queue. It must stay below the supervisor's wait before SIGKILL
    (compose's `stop_grace_period`, 2 minutes) by the time the hand-back and the engine's close take (seconds), or
    a deploy ends in a kill and charges its jobs a crash."""
    suspect_after_crashes: int = Field(2, ge=1)
    """A worker's death is not charged as an attempt to the jobs it held: each becomes a suspect (`crashes`); one
    with this many crashes runs alone in its worker, where a crash condemns it and nobody else."""
    max_crashes: int = Field(5, ge=1)
    """Past this many crashes a job fails whatever ran beside it."""
    sweep_every_s: float = Field(15.0, gt=0)
    """One worker at a time sweeps, once per this many seconds across the fleet: expired leases, deadlines, lost
    messages (a sent job whose message two sweeps in a row cannot find is sent again)."""
    unpublished_grace_s: float = Field(10.0, ge=0)
    """Age before a queued job's missing message is looked for: queued jobs whose message never went out are sent
    after this long."""
    republish_after_s: float = Field(3600.0, gt=0)
    """With a broker that cannot be inspected (not Redis), a job still queued this long after it was sent is sent
    again."""

    max_queued_per_key: int = Field(100_000, ge=0)
    """Backpressure: unfinished (queued or running) jobs allowed per API key; past it a submission (a batch counts
    its lines) gets `429` with Retry-After and stores nothing. 0: no bound."""
    max_queued: int = Field(1_000_000, ge=0)
    """Backpressure: unfinished jobs allowed overall (and `GET /readyz` answers `503` past it). 0: no bound."""
    busy_retry_after_s: int = Field(5, ge=1)
    """The Retry-After of a backpressure `429` (and of a stream refused past its bounds): what it tells a producer
    to wait."""

    retention_days: float = Field(30.0, ge=0)
    """Finished jobs (with their results and timings), settled batches and workers rows silent this long are
    deleted (`convoq prune`; the reconciler too when set). 30 days keeps a month of results for producers to fetch
    and for `convoq report`, while payloads of up to 8 MiB per job stop piling up. 0: keep forever."""

    max_upload_bytes: int = Field(200 * 10**6, ge=1)
    """One batch upload (multipart or `POST /v1/files`), as OpenAI's Batch API: 200 MB (past it `413`)."""
    max_batch_lines: int = Field(50_000, ge=1)
    """Lines in one batch upload, as OpenAI's Batch API."""
    max_wait_seconds: float = Field(60.0, ge=0)
    """The longest `GET /v1/jobs/{id}?wait=` long-polls; a longer wait is cut to this."""

    flower_port: int = 5555
    """The port `convoq flower` serves on unless `--port` says otherwise."""
    flower_user: str = "admin"
    """Flower's basic-auth user."""
    flower_password: SecretStr = SecretStr("")
    """Flower's basic-auth password: `convoq flower` refuses to start without one (Flower shows every job)."""
    worker_metrics_port: int = Field(9464, ge=0, le=65535)
    """Each worker process serves Prometheus metrics on this port, or on the first free one of the 63 above it
    when other workers on the host hold it (each logs the one it took); 0: off."""
    metrics_key: SecretStr = SecretStr("")
    """The API's `/metrics`: with a key (at least 16 characters), a scrape must send it as
    `Authorization: Bearer KEY`, else `401`; empty, it is open."""
    metrics_port: int = Field(0, ge=0, le=65535)
    """Serve the API's `/metrics` on this port (or on the first free one of the 63 above it: one per API process,
    each logs the one it took) for a scraper inside the cluster, and not on the API's own port, where it answers
    `404`; the key is not asked there. 0: on the API's own port."""
    metrics_refresh_s: float = Field(5.0, gt=0)
    """What a scrape of an API or a worker process reads is collected at most this often, by one thread of the
    process on connections of its own: a flood of scrapes sends no command to Redis, the database or the engine."""

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, value: SecretStr) -> SecretStr:
        for entry in value.get_secret_value().split(","):
            if entry.strip():
                parse_key(entry.strip())
        return value

    @field_validator("metrics_key")
    @classmethod
    def _check_metrics_key(cls, value: SecretStr) -> SecretStr:
        if 0 < len(value.get_secret_value()) < MIN_KEY_CHARS:
            raise ValueError(f"the metrics key must be at least {MIN_KEY_CHARS} characters")
        return value

    @cached_property
    def known_keys(self) -> dict[str, ApiKey]:
        """Hash of each key -> what it grants."""
        entries = [e.strip() for e in self.api_keys.get_secret_value().split(",") if e.strip()]
        return {key.digest: key for key in map(parse_key, entries)}


def get_settings() -> Settings:
    return Settings()
