"""`convoq demo`: the whole service on embedded defaults, with nothing to configure.

A tiny random Qwen3 checkpoint, a SQLite database, the configured Redis (or a throwaway one, or kombu's
SQLAlchemy transport when no Redis exists at all), the API and one worker as real processes. Bulk
summaries are queued first, urgent chat replies after them; the table shows the chats overtaking.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

from api.client import Client
from cli.servers import RedisServer, ServerUnavailable, port_open
from cli.stack import Stack
from engine.tiny import build_tiny_model
from jobs.migrate import upgrade
from jobs.schemas import JobIn
from jobs.settings import DATA_DIR, Settings

DEMO_KEY = "demo-key"

QUESTIONS = [
    "My parcel was marked delivered but it is not here. What can I do?",
    "I was charged twice for my subscription this month.",
    "How do I reset my password? The reset email never arrives.",
    "Can I change the delivery address of order 5531?",
    "The app crashes every time I open the billing page.",
]

TRANSCRIPT = [
    {"role": "user", "content": "Hi, my order 7731 arrived damaged, the screen is cracked."},
    {"role": "assistant", "content": "I'm sorry to hear that. Could you send a photo of the damage?"},
    {"role": "user", "content": "Sent it just now to the support email."},
    {"role": "assistant", "content": "Thanks, I see it. I've issued a replacement; it ships tomorrow."},
]


def pick_broker(settings: Settings) -> tuple[str, str, RedisServer | None]:
    """The broker URL to use, a sentence saying why, and a server to stop afterwards (if we started one)."""
    url = urlparse(settings.broker_url)
    if url.scheme.startswith("redis") and port_open(url.hostname or "127.0.0.1", url.port or 6379):
        return settings.broker_url, f"Redis at {settings.broker_url}", None
    try:
        server = RedisServer().start()
        return server.url, f"no Redis at {settings.broker_url}: started a throwaway redis-server", server
    except ServerUnavailable:
        fallback = f"sqla+sqlite:///{DATA_DIR}/broker.db"
        return fallback, (f"no Redis at {settings.broker_url} and no redis-server installed: using kombu's "
                          "SQLAlchemy transport on SQLite (embedded, no priorities)"), None


def ensure_model(settings: Settings) -> str:
    path = Path(settings.model)
    if path.exists() or settings.model != Settings.model_fields["model"].default:
        return settings.model
    print(f"writing the tiny random Qwen3 checkpoint to {path} ...")
    build_tiny_model(path)
    return str(path)


def run_demo(jobs: int = 20) -> int:
    settings = Settings()
    model = ensure_model(settings)
    upgrade(settings.database_url)
    broker_url, broker_note, server = pick_broker(settings)
    print(f"database: {settings.database_url}\nbroker:   {broker_note}\nmodel:    {model}")
    env = {
        "CONVOQ_DATABASE_URL": settings.database_url,
        "CONVOQ_BROKER_URL": broker_url,
        "CONVOQ_MODEL": model,
        "CONVOQ_API_KEYS": os.environ.get("CONVOQ_API_KEYS") or DEMO_KEY,
    }
    key = env["CONVOQ_API_KEYS"].split(",")[0].strip()
    try:
        with Stack(env, Path(tempfile.mkdtemp(prefix="convoq-demo-"))) as stack:
            print("starting the API and a worker ...")
            stack.start_api()
            with Client(stack.api_url, key) as client:
                bulk = [JobIn(messages=TRANSCRIPT, kind="summarize", priority=1,
                              sampling={"max_new_tokens": 32}) for _ in range(jobs - len(QUESTIONS))]
                urgent = [JobIn(messages=[{"role": "user", "content": q}], priority=9,
                                sampling={"max_new_tokens": 24}) for q in QUESTIONS]
                start = time.monotonic()
                ids = [client.submit(job).id for job in bulk + urgent]
                print(f"queued {len(bulk)} bulk summaries (priority 1), then {len(urgent)} chats (priority 9)")
                stack.start_worker()
                done = [client.wait(i, timeout=300) for i in ids]
                elapsed = time.monotonic() - start
            print_table(done)
            print_summary(done, elapsed)
            logs = stack.logdir
    finally:
        if server is not None:
            server.stop()
    print(f"\nlogs: {logs}")
    print("The tiny model has random weights, so its text is gibberish. To run a real model, point "
          "CONVOQ_MODEL at a Qwen3 folder (e.g. a downloaded Qwen/Qwen3-0.6B) and run `make demo` again.")
    return 0 if all(j.status == "succeeded" for j in done) else 1


def print_table(done: list) -> None:
    order = sorted(done, key=lambda j: j.finished_at or j.created_at)
    print(f"\n{'#':>3} {'kind':<10} {'prio':>4} {'status':<10} {'wait ms':>8} {'ttft ms':>8} {'e2e ms':>8} {'batch':>5}  text")
    for n, j in enumerate(order, 1):
        t = j.timings
        text = (j.result.text if j.result else j.error or "").replace("\n", " ")[:40]
        print(f"{n:>3} {j.kind:<10} {j.priority:>4} {j.status:<10} "
              f"{t.queue_wait_ms if t else 0:>8.0f} {t.ttft_ms if t else 0:>8.0f} {t.end_to_end_ms if t else 0:>8.0f} "
              f"{t.batch_size if t else 0:>5}  {text}")


def print_summary(done: list, elapsed: float) -> None:
    timed = [j.timings for j in done if j.timings]
    ok = sum(j.status == "succeeded" for j in done)
    print(f"\n{ok}/{len(done)} succeeded in {elapsed:.1f}s (including worker start-up)")
    if timed:
        for name in ("queue_wait_ms", "ttft_ms", "prefill_ms", "decode_ms", "end_to_end_ms"):
            values = [getattr(t, name) for t in timed]
            print(f"  {name:<14} p50 {statistics.median(values):8.1f}   max {max(values):8.1f}")
    by_kind = {}
    for n, j in enumerate(sorted(done, key=lambda j: j.finished_at or j.created_at)):
        by_kind.setdefault(j.kind, []).append(n + 1)
    for kind, places in by_kind.items():
        print(f"  {kind} jobs finished at places {places[0]}..{places[-1]} of {len(done)}")
