"""`convoq demo`: the main job, bulk transcript summarization, end to end on embedded defaults.

A tiny random Qwen3 checkpoint, a SQLite database, the configured Redis (or a throwaway one, or kombu's
SQLAlchemy transport when no Redis exists at all), the API and one worker as real processes. The bundled
transcripts (a few longer than the tiny model's context) go in as one batch at low priority, each to be
summarized into a JSON record (`RECORD_SCHEMA`, the batch lines' `response_format`); customer chats at priority
9 arrive while it runs and overtake it. The same chats are first sent to the idle service, so their latency
during the batch can be read against it. The records are printed as a table and checked with `jsonschema`:
decoded under the schema's grammar, even the random weights' records validate.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from jsonschema import Draft202012Validator
from sqlalchemy import select

from api.http.client import Client
from broker.redis_layout import is_redis
from cli.batch import follow
from cli.servers import RedisServer, ServerUnavailable, port_open
from cli.stack import Stack
from cli.tiny_model import build_tiny_model
from jobs.priority import HIGHEST
from jobs.schemas import JobIn
from jobs.settings import DATA_DIR, Settings, redact
from jobs.tables import Job, Result, Timing, as_utc
from migrations.apply import upgrade
from store.connections import make_db_engine

DEMO_KEY = "demo-key-not-a-secret"
SAMPLES = Path(__file__).parent / "samples" / "transcripts.jsonl"

# What a transcript becomes: a record a dashboard can take as it is. The grammar leaves no free whitespace and the
# strings are bounded, so a record ends within a known budget whatever the weights: with the tiny model's
# tokenizer, 96 to 120 tokens (measured over 60 seeds), which the demo's default of 160 new tokens covers.
RECORD_SCHEMA = {
    "type": "object",
    "properties": {
        "category": {"type": "string", "enum": ["delivery", "billing", "account", "technical", "travel", "other"]},
        "resolved": {"type": "boolean"},
        "sentiment": {"type": "string", "enum": ["positive", "neutral", "negative"]},
        "follow_up": {"type": "string", "maxLength": 32},
        "summary": {"type": "string", "maxLength": 80},
    },
    "required": ["category", "resolved", "sentiment", "follow_up", "summary"],
    "additionalProperties": False,
}
RECORD_FORMAT = {"type": "json_schema", "json_schema": {"name": "ticket_record", "schema": RECORD_SCHEMA}}

QUESTIONS = [
    "My parcel was marked delivered but it is not here. What can I do?",
    "I was charged twice for my subscription this month.",
    "How do I reset my password? The reset email never arrives.",
    "Can I change the delivery address of order 5531?",
    "The app crashes every time I open the billing page.",
]


def pick_broker(settings: Settings) -> tuple[str, str, RedisServer | None]:
    """The broker URL to use, a sentence saying why, and a server to stop afterwards (if we started one)."""
    configured = settings.broker_url.get_secret_value()
    shown = redact(configured)  # a broker password never reaches the terminal
    url = urlparse(configured)
    if is_redis(settings) and port_open(url.hostname or "127.0.0.1", url.port or 6379):
        return configured, f"Redis at {shown}", None
    try:
        server = RedisServer().start()
        return server.url, f"no Redis at {shown}: started a throwaway redis-server", server
    except ServerUnavailable:
        fallback = f"sqla+sqlite:///{DATA_DIR}/broker.db"
        return fallback, (f"no Redis at {shown} and no redis-server installed: using kombu's "
                          "SQLAlchemy transport on SQLite (embedded, no priorities)"), None


def ensure_model(settings: Settings) -> str:
    path = Path(settings.model)
    if path.exists() or settings.model != Settings.model_fields["model"].default:
        return settings.model
    print(f"writing the tiny random Qwen3 checkpoint to {path} ...")
    build_tiny_model(path)
    return str(path)


def run_demo(max_new_tokens: int) -> int:
    settings = Settings()
    model = ensure_model(settings)
    database_url = settings.database_url.get_secret_value()
    upgrade(database_url)
    broker_url, broker_note, server = pick_broker(settings)
    print(f"database: {redact(database_url)}\nbroker:   {broker_note}\nmodel:    {model} "
          f"(backend: {settings.backend})")
    env = {
        "CONVOQ_DATABASE_URL": database_url,
        "CONVOQ_BROKER_URL": broker_url,
        "CONVOQ_MODEL": model,
        "CONVOQ_API_KEYS": os.environ.get("CONVOQ_API_KEYS") or DEMO_KEY,
    }
    key = env["CONVOQ_API_KEYS"].split(",")[0].strip().split("@")[0].split(":")[0]  # KEY[:scopes][@tenant]
    lines = [json.loads(line) | {"max_new_tokens": max_new_tokens, "response_format": RECORD_FORMAT}
             for line in SAMPLES.read_text().splitlines()]
    try:
        with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-demo-"))) as stack:
            print("starting the API and a worker ...")
            stack.start_api()
            stack.start_worker()
            with Client(stack.api_url, key) as client:
                idle = [client.wait(i, timeout=300) for i in send_chats(client, ticket=4100)]
                print(f"{len(idle)} customer chats at priority {HIGHEST} on the idle service: "
                      f"{latency_line(idle)}")
                start = time.monotonic()
                upload = "\n".join(json.dumps(line) for line in lines).encode()
                batch = client.create_batch(upload, name=SAMPLES.name)
                print(f"batch {batch.id}: {len(lines)} transcripts to summarize at priority {batch.priority} "
                      "(bulk queue)")
                while client.get_batch(batch.id).status == "validating":
                    time.sleep(0.05)
                time.sleep(1.0)  # the batch's items are in the engine now
                chats = send_chats(client, ticket=7300)
                print(f"the same {len(chats)} chats submitted while the batch runs")
                batch = follow(client, str(batch.id), poll=0.2)
                chats_done = [client.wait(i, timeout=300) for i in chats]
                elapsed = time.monotonic() - start
                jobs = batch_jobs(database_url, batch.id)
            print_results(jobs)
            valid = print_records(jobs)
            print_overtaking(chats_done, jobs)
            print(f"\nchats end to end: idle service {latency_line(idle)}; during the batch "
                  f"{latency_line(chats_done)}")
            print_summary(jobs + [timing_row(j) for j in chats_done], elapsed, len(lines))
            logs = stack.logdir
    finally:
        if server is not None:
            server.stop()
    print(f"\nlogs: {logs}")
    print("The tiny model has random weights, so the records' strings are gibberish; that they validate all the "
          "same is the grammar's doing: the demo shows the pipeline, not the model. To run a real model, point "
          "CONVOQ_MODEL at a folder of a supported family (e.g. a downloaded Qwen/Qwen3-0.6B; `convoq doctor` says "
          "whether it loads) and run `make demo` again.")
    succeeded = batch.status == "completed" and all(j.status == "succeeded" for j in chats_done)
    return 0 if succeeded and valid == len(lines) else 1


def send_chats(client: Client, ticket: int) -> list:
    """The customer chats, one every 0.2 s (as people would write), at the highest priority; their ids. The ticket number
    opens each message, so a second round is not answered from the first one's cached prompt."""
    ids = []
    for i, question in enumerate(QUESTIONS):
        content = f"Ticket {ticket + i}. {question}"
        ids.append(client.submit(JobIn(messages=[{"role": "user", "content": content}], priority=HIGHEST,
                                       sampling={"max_new_tokens": 24})).id)
        time.sleep(0.2)
    return ids


def latency_line(chats: list) -> str:
    ms = sorted(c.timings.end_to_end_ms for c in chats if c.timings)
    return f"p50 {statistics.median(ms):.0f} ms, max {ms[-1]:.0f} ms" if ms else "no timings"


def batch_jobs(database_url: str, batch_id) -> list[dict]:
    """Every job of the batch with its result and timings, read straight from the database."""
    engine = make_db_engine(database_url)
    query = (
        select(Job.custom_id, Job.status, Job.error, Job.finished_at, Result.text, Result.chunks, Result.levels,
               Result.prompt_tokens, Result.completion_tokens, Timing.queue_wait_ms, Timing.ttft_ms,
               Timing.prefill_ms, Timing.decode_ms, Timing.end_to_end_ms)
        .outerjoin(Result, Result.job_id == Job.id).outerjoin(Timing, Timing.job_id == Job.id)
        .where(Job.batch_id == batch_id).order_by(Job.finished_at)
    )
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(query)]
    engine.dispose()
    return rows


def timing_row(job) -> dict:
    t = job.timings
    return {"finished_at": job.finished_at, **({k: getattr(t, k) for k in TIMINGS} if t else {})}


TIMINGS = ("queue_wait_ms", "ttft_ms", "prefill_ms", "decode_ms", "end_to_end_ms")


def print_results(jobs: list[dict]) -> None:
    print(f"\n{'custom_id':<34} {'status':<10} {'chunks':>6} {'levels':>6} {'prompt':>7} {'out':>4} {'e2e ms':>8}")
    for j in jobs:
        print(f"{j['custom_id']:<34} {j['status']:<10} {j['chunks'] or '-':>6} {j['levels'] or '-':>6} "
              f"{j['prompt_tokens'] or 0:>7} {j['completion_tokens'] or 0:>4} {j['end_to_end_ms'] or 0:>8.0f}")


RECORD_COLUMNS = (("category", 9), ("resolved", 8), ("sentiment", 9), ("follow_up", 20), ("summary", 36))


def print_records(jobs: list[dict]) -> int:
    """The batch's records as a table (long strings cut to their column), then how many validate against
    `RECORD_SCHEMA`; returns that count."""
    validator = Draft202012Validator(RECORD_SCHEMA)
    print(f"\n{'custom_id':<34} " + " ".join(f"{name:<{width}}" for name, width in RECORD_COLUMNS))
    valid, problems = 0, []
    for j in sorted(jobs, key=lambda j: j["custom_id"]):
        try:
            record = json.loads(j["text"] or "")
        except json.JSONDecodeError as exc:
            problems.append(f"{j['custom_id']}: {j['status']}, not JSON ({exc.msg})")
            continue
        if errors := [e.message for e in validator.iter_errors(record)]:
            problems.append(f"{j['custom_id']}: {errors[0]}")
            continue
        valid += 1
        print(f"{j['custom_id']:<34} " + " ".join(f"{_cell(record[name], width):<{width}}"
                                                   for name, width in RECORD_COLUMNS))
    print(f"{valid} of {len(jobs)} records parse and validate against the schema (jsonschema)")
    for problem in problems:
        print(f"  {problem}")
    return valid


def _cell(value: object, width: int) -> str:
    """A record's value in a column: JSON's spelling, what does not print shown as a dot, cut to `width`."""
    text = json.dumps(value, ensure_ascii=False) if isinstance(value, bool) else str(value)
    text = "".join(ch if ch.isprintable() else "·" for ch in text)
    return text if len(text) <= width else text[:width - 1] + "…"


def print_overtaking(chats: list, jobs: list[dict]) -> None:
    for chat in chats:
        later = sum(as_utc(j["finished_at"]) > as_utc(chat.finished_at) for j in jobs if j["finished_at"])
        print(f"chat {str(chat.id)[:8]} (priority {HIGHEST}): {chat.status}, finished before {later} of the "
              f"{len(jobs)} batch items, end to end {chat.timings.end_to_end_ms if chat.timings else 0:.0f} ms")


def print_summary(rows: list[dict], elapsed: float, transcripts: int) -> None:
    print(f"\n{transcripts} transcripts summarized and {len(rows) - transcripts} chats answered in {elapsed:.1f}s")
    for name in TIMINGS:
        values = sorted(r[name] for r in rows if r.get(name) is not None)
        if values:
            p95 = values[min(len(values) - 1, round(0.95 * (len(values) - 1)))]
            print(f"  {name:<14} p50 {statistics.median(values):9.1f}   p95 {p95:9.1f}   max {values[-1]:9.1f}")
